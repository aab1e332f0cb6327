"""Dynamo's KV indexer (``ai-dynamo-runtime``, the ``dynamo`` extra): its event layout, in one place.

Dynamo's router keeps one radix tree for all workers (``dynamo._core.RadixTree``). A tree node is a
block of tokens named by its ``tokens_hash`` under its parent node; each worker also names its own
blocks by a ``block_hash`` of its choosing, which later events use to name a parent or a removed
block. ``find_matches(tokens_hashes).scores`` gives, per ``(worker_id, dp_rank)``, how many blocks of
the query that worker holds, consecutive from the root.

The JSON layout ``RadixTree.apply_event(worker_id, payload)`` takes (checked against the 1.6.1
wheel in ``tests/routing/test_dynamo.py``)::

    {"event_id": n, "data": {"stored": {"parent_hash": <u64 or null>,
                                        "blocks": [{"block_hash": <u64>, "tokens_hash": <u64>}, ...]}}}
    {"event_id": n, "data": {"removed": {"block_hashes": [<u64>, ...]}}}
    {"event_id": n, "data": "cleared"}

A stored event's blocks are consecutive: the first one's parent is ``parent_hash`` (null: the
root), each next one's parent is the block before it. This module only writes that layout and
reads the scores back; what to advertise is :mod:`flat_kvcache.routing.adapter`'s business.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

__all__ = ["DynamoIndex", "encode_op", "load_radix_tree"]


def load_radix_tree() -> Any:
    """A new ``dynamo._core.RadixTree``; ``ImportError`` naming the extra when Dynamo is missing."""
    try:
        from dynamo._core import RadixTree
    except ImportError as exc:
        raise ImportError(
            "the kv router needs Dynamo's indexer: pip install 'flat_kvcache[dynamo]' (ai-dynamo-runtime)"
        ) from exc
    return RadixTree()


def encode_op(event_id: int, op: tuple[str, Any]) -> bytes:
    """One block operation as the JSON bytes ``RadixTree.apply_event`` takes.

    ``op`` is ``("stored", (parent, [(block_hash, tokens_hash), ...]))``, ``("removed", [block_hash,
    ...])`` or ``("cleared", None)``; every hash is an int in ``[0, 2**64)``.
    """
    kind, body = op
    data: Any
    if kind == "stored":
        parent, blocks = body
        data = {
            "stored": {
                "parent_hash": parent,
                "blocks": [{"block_hash": block, "tokens_hash": tokens} for block, tokens in blocks],
            }
        }
    elif kind == "removed":
        data = {"removed": {"block_hashes": list(body)}}
    elif kind == "cleared":
        data = "cleared"
    else:
        raise ValueError(f"unknown block operation {kind!r}")
    return json.dumps({"event_id": event_id, "data": data}, separators=(",", ":")).encode()


class DynamoIndex:
    """One Dynamo radix tree over the blocks every worker advertises (``worker_id`` = worker index)."""

    def __init__(self) -> None:
        self._tree = load_radix_tree()
        self._event_ids: dict[int, int] = {}

    def apply(self, worker: int, ops: Sequence[tuple[str, Any]]) -> None:
        """Apply ``worker``'s block operations in order (each gets the worker's next event id)."""
        for op in ops:
            event_id = self._event_ids.get(worker, 0)
            self._event_ids[worker] = event_id + 1
            self._tree.apply_event(worker, encode_op(event_id, op))

    def match_depths(self, tokens_hashes: Sequence[int]) -> dict[int, int]:
        """Per worker, how many blocks of the query it holds, consecutive from the root (absent: 0)."""
        if not tokens_hashes:
            return {}
        scores = self._tree.find_matches(list(tokens_hashes)).scores
        return {int(worker): int(depth) for (worker, _rank), depth in scores.items()}

    def dump(self) -> list[str]:
        """What the tree holds, as Dynamo dumps it (one JSON event per worker's run of blocks)."""
        dumped: list[str] = self._tree.dump_tree_as_events()
        return dumped
