"""A scheduler loop's decisions, step by step, folded into one digest (issue 38 item 4).

Two loops that drive different KV managers over the same trace (``flat-kvcache simulate`` and
``benches/vllm_compare.py``) only do the same work if they decide the same things: which
requests run, with how many tokens, which are admitted with what prefix hit, which finish, are
preempted or aborted. Their times are comparable only then. Each step's decisions are one
record:

- ``step``: the loop's step counter (it jumps over idle steps to the next arrival);
- ``scheduled``: ``[request_id, tokens]`` of every running request that got tokens, in order;
- ``admitted``: ``[request_id, hit_tokens, chunk_tokens]`` of every admission, in order;
- ``finished``, ``preempted``, ``aborted``: request ids, in order.

A record's canonical encoding is its JSON with sorted keys and no spaces, one line; the digest
is BLAKE2b (16 bytes) over those lines in step order, reported with the number of steps
(``{"digest": hex, "steps": n}``). Two runs decided alike if and only if (bar a hash collision)
their digests and step counts are equal; :func:`first_difference` names the first step where
two runs' records differ, and :func:`main` (``benches/decisions_diff.py A.jsonl B.jsonl``) does it
for two record files (``simulate --decisions FILE.jsonl`` writes one, ``benches/vllm_compare.py
--decisions DIR`` one per side).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

__all__ = [
    "DECISION_FIELDS",
    "DecisionLog",
    "Difference",
    "first_difference",
    "read_decisions",
]

#: The fields of a step's record, besides ``step``.
DECISION_FIELDS = ("scheduled", "admitted", "finished", "preempted", "aborted")


def _encode(record: dict[str, Any]) -> str:
    """A record's canonical line (no newline)."""
    return json.dumps(record, sort_keys=True, separators=(",", ":"))


class DecisionLog:
    """The running digest of a loop's decisions; optionally each record as a JSONL line on
    ``sink``, and kept in memory when ``keep`` (for :func:`first_difference`)."""

    def __init__(self, sink: TextIO | None = None, *, keep: bool = False) -> None:
        self._hash = hashlib.blake2b(digest_size=16)
        self._sink = sink
        self.steps = 0
        self.records: list[dict[str, Any]] | None = [] if keep else None

    def record(
        self,
        step: int,
        *,
        scheduled: Sequence[tuple[int, int]] = (),
        admitted: Sequence[tuple[int, int, int]] = (),
        finished: Sequence[int] = (),
        preempted: Sequence[int] = (),
        aborted: Sequence[int] = (),
    ) -> None:
        """Fold one step's decisions into the digest (every value an ``int``)."""
        record: dict[str, Any] = {
            "step": int(step),
            "scheduled": [[int(rid), int(n)] for rid, n in scheduled],
            "admitted": [[int(rid), int(hit), int(chunk)] for rid, hit, chunk in admitted],
            "finished": [int(rid) for rid in finished],
            "preempted": [int(rid) for rid in preempted],
            "aborted": [int(rid) for rid in aborted],
        }
        line = _encode(record)
        self._hash.update(line.encode())
        self._hash.update(b"\n")
        self.steps += 1
        if self._sink is not None:
            self._sink.write(line + "\n")
        if self.records is not None:
            self.records.append(record)

    def summary(self) -> dict[str, Any]:
        """``{"digest": hex, "steps": n}``: what a run reports."""
        return {"digest": self._hash.hexdigest(), "steps": self.steps}


@dataclass(frozen=True)
class Difference:
    """The first record where two runs differ: its index (0-based, in steps run), both
    records (None past the end of the shorter run) and the fields that differ."""

    index: int
    left: dict[str, Any] | None
    right: dict[str, Any] | None
    fields: tuple[str, ...]

    def describe(self, left_name: str = "left", right_name: str = "right") -> str:
        """One paragraph: the step and, per differing field, both values."""
        if self.left is None or self.right is None:
            ended = left_name if self.left is None else right_name
            other = self.right if self.left is None else self.left
            return f"step #{self.index}: {ended} has ended; the other goes on with {_encode(other or {})}"
        lines = [f"step #{self.index} (loop step {self.left['step']} vs {self.right['step']}) differs:"]
        for name in self.fields:
            lines.append(f"  {name}: {left_name} {_encode_value(self.left.get(name))}")
            lines.append(f"  {' ' * len(name)}  {right_name} {_encode_value(self.right.get(name))}")
        return "\n".join(lines)


def _encode_value(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def first_difference(left: Iterable[dict[str, Any]], right: Iterable[dict[str, Any]]) -> Difference | None:
    """The first step where two runs' records differ (:class:`Difference`), or None when they
    are the same records in the same order."""
    left_iter, right_iter = iter(left), iter(right)
    index = 0
    while True:
        a = next(left_iter, None)
        b = next(right_iter, None)
        if a is None and b is None:
            return None
        if a is None or b is None:
            return Difference(index, a, b, ())
        keys = ("step", *DECISION_FIELDS, *sorted((set(a) | set(b)) - {"step", *DECISION_FIELDS}))
        fields = tuple(key for key in keys if a.get(key) != b.get(key))
        if fields:
            return Difference(index, a, b, fields)
        index += 1


def read_decisions(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The records of a JSONL decision file (``simulate --decisions``)."""
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def main(argv: Sequence[str] | None = None) -> int:
    """``benches/decisions_diff.py A.jsonl B.jsonl``: 0 when the two runs decided alike, else 1
    and the first differing step."""
    parser = argparse.ArgumentParser(
        prog="decisions_diff.py",
        description="Name the first step where two runs' decision records (JSONL) differ.",
    )
    parser.add_argument("left")
    parser.add_argument("right")
    args = parser.parse_args(argv)
    difference = first_difference(read_decisions(args.left), read_decisions(args.right))
    if difference is None:
        print("same decisions at every step")
        return 0
    print(difference.describe(args.left, args.right))
    return 1
