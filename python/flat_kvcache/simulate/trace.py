"""Request traces for the simulator: the built-in one and JSONL trace files.

Trace files: one JSON object per line (blank lines and lines starting with ``#`` are
skipped):

- ``prompt`` (list of token ids, each in ``[0, 2**32)``) or ``prompt_len`` (int >= 1): the
  prompt, given or drawn from the seed;
- ``output_len`` (int >= 1): tokens to generate;
- ``prefix_id`` (str or int) with ``prefix_len`` (int >= 1, < ``prompt_len``), optional and only
  with ``prompt_len``: the prompt starts with the first ``prefix_len`` tokens of a token stream
  drawn from the seed and the prefix id, so requests with the same id share that prefix;
- ``arrival_step`` (int >= 0, default 0): the step at which the request arrives;
- ``extra_keys`` (list of str, default none): keys that separate equal token pages (LoRA
  adapter, cache salt), hashed into every page of the request.

Requests keep file order within an arrival step. Generated tokens are pseudo-random ids drawn
from the seed when the trace is built, so a run over a trace is deterministic.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["DEFAULT_NUM_REQUESTS", "VOCAB", "TokenArray", "TraceRequest", "default_trace", "load_trace"]

DEFAULT_NUM_REQUESTS = 2000
#: Token ids are drawn from ``[0, VOCAB)``.
VOCAB = 50_000

TokenArray = npt.NDArray[np.uint32]


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace: its prompt, the tokens it will generate, when it arrives."""

    request_id: int
    prompt: TokenArray
    output: TokenArray
    arrival_step: int = 0
    extra_keys: tuple[str, ...] = ()

    @property
    def output_len(self) -> int:
        return len(self.output)


def _tokens(rng: np.random.Generator, count: int) -> TokenArray:
    return rng.integers(0, VOCAB, size=count, dtype=np.uint32)


def default_trace(
    num_requests: int = DEFAULT_NUM_REQUESTS,
    *,
    seed: int = 0,
    prompt_len: tuple[int, int] = (512, 4096),
    shared_prefix_len: int = 1024,
    shared_fraction: float = 0.5,
    output_len: int = 128,
) -> list[TraceRequest]:
    """The built-in trace: ``num_requests`` requests, all arriving at step 0.

    Prompts are ``prompt_len[0]`` to ``prompt_len[1]`` tokens (uniform). A ``shared_fraction``
    of the requests (chosen at random) start with one common ``shared_prefix_len``-token prefix
    followed by at least ``prompt_len[0] // 2`` own tokens, so their prompts are
    ``shared_prefix_len + prompt_len[0] // 2`` to ``prompt_len[1]`` tokens. Each generates
    ``output_len`` tokens. Everything is drawn from ``seed``.
    """
    low, high = prompt_len
    if not 1 <= low <= high:
        raise ValueError(f"prompt_len must be (low, high) with 1 <= low <= high, got {prompt_len}")
    if num_requests < 0 or output_len < 1 or shared_prefix_len < 0:
        raise ValueError("num_requests and shared_prefix_len must be >= 0 and output_len >= 1")
    rng = np.random.default_rng(seed)
    prefix = _tokens(rng, shared_prefix_len)
    shared_low = min(shared_prefix_len + max(low // 2, 1), high)
    trace = []
    for index in range(num_requests):
        shared = shared_prefix_len > 0 and shared_low < high and rng.random() < shared_fraction
        if shared:
            length = int(rng.integers(shared_low, high, endpoint=True))
            prompt = np.concatenate([prefix, _tokens(rng, length - shared_prefix_len)])
        else:
            prompt = _tokens(rng, int(rng.integers(low, high, endpoint=True)))
        trace.append(TraceRequest(index, prompt, _tokens(rng, output_len)))
    return trace


def _prefix_stream_seed(seed: int, prefix_id: str | int) -> list[int]:
    """An entropy list for the token stream of ``prefix_id`` (stable across runs and platforms)."""
    digest = hashlib.sha256(f"{type(prefix_id).__name__}:{prefix_id}".encode()).digest()
    return [seed, int.from_bytes(digest[:8], "little")]


def _field_int(
    record: dict[str, Any], key: str, where: str, *, minimum: int, default: int | None = None
) -> int:
    value = record.get(key, default)
    if value is None:
        raise ValueError(f"{where}: {key} is required")
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{where}: {key} must be an int >= {minimum}, got {value!r}")
    return value


_TRACE_KEYS = frozenset(
    {"prompt", "prompt_len", "output_len", "prefix_id", "prefix_len", "arrival_step", "extra_keys"}
)


def _parse_trace_lines(lines: Iterable[str], source: str, seed: int) -> list[TraceRequest]:
    rng = np.random.default_rng(seed)
    prefixes: dict[str | int, TokenArray] = {}
    parsed: list[TraceRequest] = []
    for number, line in enumerate(lines, start=1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        where = f"{source}:{number}"
        try:
            record = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: not valid JSON: {exc.msg}") from None
        if not isinstance(record, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
        unknown = sorted(set(record) - _TRACE_KEYS)
        if unknown:
            raise ValueError(
                f"{where}: unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(_TRACE_KEYS))}"
            )
        if ("prompt" in record) == ("prompt_len" in record):
            raise ValueError(f"{where}: give exactly one of prompt (token ids) and prompt_len")
        output_len = _field_int(record, "output_len", where, minimum=1)
        arrival = _field_int(record, "arrival_step", where, minimum=0, default=0)
        extra = record.get("extra_keys", [])
        if not isinstance(extra, list) or not all(isinstance(key, str) for key in extra):
            raise ValueError(f"{where}: extra_keys must be a list of strings, got {extra!r}")
        if "prompt" in record:
            if "prefix_id" in record or "prefix_len" in record:
                raise ValueError(f"{where}: prefix_id/prefix_len go with prompt_len, not with prompt")
            tokens = record["prompt"]
            if not isinstance(tokens, list) or not tokens:
                raise ValueError(f"{where}: prompt must be a non-empty list of token ids")
            for i, token in enumerate(tokens):
                if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < 2**32:
                    raise ValueError(f"{where}: prompt[{i}] = {token!r} is not a token id in [0, 2**32)")
            prompt = np.asarray(tokens, dtype=np.uint32)
        else:
            length = _field_int(record, "prompt_len", where, minimum=1)
            prefix_len = 0
            if "prefix_id" in record or "prefix_len" in record:
                prefix_id = record.get("prefix_id")
                if isinstance(prefix_id, bool) or not isinstance(prefix_id, str | int):
                    raise ValueError(f"{where}: prefix_id must be a string or an int, got {prefix_id!r}")
                prefix_len = _field_int(record, "prefix_len", where, minimum=1)
                if prefix_len >= length:
                    raise ValueError(f"{where}: prefix_len ({prefix_len}) must be < prompt_len ({length})")
                stream = prefixes.get(prefix_id)
                if stream is None or len(stream) < prefix_len:
                    stream = _tokens(np.random.default_rng(_prefix_stream_seed(seed, prefix_id)), prefix_len)
                    prefixes[prefix_id] = stream
                own = _tokens(rng, length - prefix_len)
                prompt = np.concatenate([stream[:prefix_len], own])
            else:
                prompt = _tokens(rng, length)
        parsed.append(TraceRequest(len(parsed), prompt, _tokens(rng, output_len), arrival, tuple(extra)))
    if not parsed:
        raise ValueError(f"{source}: the trace has no requests")
    parsed.sort(key=lambda request: request.arrival_step)  # stable: file order within a step
    return parsed


def load_trace(path: str | os.PathLike[str], *, seed: int = 0) -> list[TraceRequest]:
    """Read a JSONL trace (format in the module docstring); ``ValueError`` naming ``FILE:LINE``."""
    with open(path, encoding="utf-8") as lines:
        return _parse_trace_lines(lines, str(path), seed)
