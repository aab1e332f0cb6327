"""Request traces for the simulator: the built-in one, JSONL trace files and Mooncake traces.

:func:`load_trace` reads either format, told apart by the first request line: a line with a
``hash_ids`` key is a Mooncake trace, anything else the JSONL format below.

JSONL trace files: one JSON object per line (blank lines and lines starting with ``#`` are
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

Mooncake traces (the FAST'25 trace release of kvcache-ai/Mooncake): one JSON object per line
with exactly ``timestamp`` (ms since the first request, >= 0), ``input_length`` (prompt
tokens), ``output_length`` (tokens to generate, >= 1) and ``hash_ids`` (a non-empty list of ints
>= 0). Each hash id stands for one :data:`MOONCAKE_BLOCK_TOKENS`-token block of the prompt; the
last block may be partial, so ``input_length - 512 * (len(hash_ids) - 1)`` must be 1 to 512
(anything else is an error naming the line). A block's tokens are drawn from a generator seeded
by ``(seed, hash_id)``, so equal ids give equal tokens and different ids (almost surely)
different ones; a partial last block is the first tokens of its id's block. Token ids are in
``[0, VOCAB)``, like every other trace's. Arrival: the simulator counts steps, not time, so a
request arrives at step ``floor(timestamp / ms_per_step)`` (``--ms-per-step``, default
:data:`DEFAULT_MS_PER_STEP` ms, about one decode step of a busy engine); requests keep file order
within a step. ``max_requests`` reads only the first requests of the file (of either format).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = [
    "DEFAULT_MS_PER_STEP",
    "DEFAULT_NUM_REQUESTS",
    "MOONCAKE_BLOCK_TOKENS",
    "VOCAB",
    "TokenArray",
    "TraceRequest",
    "default_trace",
    "load_trace",
    "mooncake_block",
]

DEFAULT_NUM_REQUESTS = 2000
#: Token ids are drawn from ``[0, VOCAB)``.
VOCAB = 50_000
#: Tokens per hash id of a Mooncake trace (the format's block size).
MOONCAKE_BLOCK_TOKENS = 512
#: Milliseconds of a Mooncake ``timestamp`` per simulator step.
DEFAULT_MS_PER_STEP = 50.0

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


def _records(
    lines: Iterable[tuple[int, str]], source: str, max_requests: int | None, known: frozenset[str], kind: str
) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(FILE:LINE, record)`` of the first ``max_requests`` request lines (all without a limit):
    each must be a JSON object with only ``known`` fields (``kind`` completes the message that
    names the others, e.g. ``" in a Mooncake trace"``)."""
    for count, (number, text) in enumerate(lines):
        if max_requests is not None and count >= max_requests:
            return
        where = f"{source}:{number}"
        try:
            record = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: not valid JSON: {exc.msg}") from None
        if not isinstance(record, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
        unknown = sorted(set(record) - known)
        if unknown:
            raise ValueError(
                f"{where}: unknown field(s) {', '.join(unknown)}{kind}; known: {', '.join(sorted(known))}"
            )
        yield where, record


_TRACE_KEYS = frozenset(
    {"prompt", "prompt_len", "output_len", "prefix_id", "prefix_len", "arrival_step", "extra_keys"}
)


def _parse_trace_lines(
    lines: Iterable[tuple[int, str]], source: str, seed: int, max_requests: int | None
) -> list[TraceRequest]:
    rng = np.random.default_rng(seed)
    prefixes: dict[str | int, TokenArray] = {}
    parsed: list[TraceRequest] = []
    for where, record in _records(lines, source, max_requests, _TRACE_KEYS, ""):
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
    return _finish_trace(parsed, source)


def _finish_trace(parsed: list[TraceRequest], source: str) -> list[TraceRequest]:
    if not parsed:
        raise ValueError(f"{source}: the trace has no requests")
    parsed.sort(key=lambda request: request.arrival_step)  # stable: file order within a step
    return parsed


def mooncake_block(seed: int, hash_id: int, block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> TokenArray:
    """The ``block_tokens`` token ids a Mooncake ``hash_id`` stands for under ``seed``."""
    return _tokens(np.random.default_rng([seed, hash_id]), block_tokens)


_MOONCAKE_KEYS = frozenset({"timestamp", "input_length", "output_length", "hash_ids"})


def _parse_mooncake_lines(
    lines: Iterable[tuple[int, str]],
    source: str,
    seed: int,
    max_requests: int | None,
    ms_per_step: float,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
) -> list[TraceRequest]:
    rng = np.random.default_rng(seed)
    blocks: dict[int, TokenArray] = {}
    parsed: list[TraceRequest] = []
    for where, record in _records(lines, source, max_requests, _MOONCAKE_KEYS, " in a Mooncake trace"):
        timestamp = record.get("timestamp")
        if timestamp is None:
            raise ValueError(f"{where}: timestamp is required")
        is_number = isinstance(timestamp, int | float) and not isinstance(timestamp, bool)
        if not is_number or not 0 <= timestamp < math.inf:
            raise ValueError(f"{where}: timestamp must be a finite number of ms >= 0, got {timestamp!r}")
        input_length = _field_int(record, "input_length", where, minimum=1)
        output_length = _field_int(record, "output_length", where, minimum=1)
        hash_ids = record.get("hash_ids")
        if hash_ids is None:
            raise ValueError(f"{where}: hash_ids is required")
        if not isinstance(hash_ids, list) or not hash_ids:
            raise ValueError(f"{where}: hash_ids must be a non-empty list of ints >= 0")
        for i, hash_id in enumerate(hash_ids):
            if isinstance(hash_id, bool) or not isinstance(hash_id, int) or hash_id < 0:
                raise ValueError(f"{where}: hash_ids[{i}] = {hash_id!r} is not an int >= 0")
        last = input_length - block_tokens * (len(hash_ids) - 1)
        if not 1 <= last <= block_tokens:
            raise ValueError(
                f"{where}: input_length {input_length} does not match {len(hash_ids)} hash_ids of "
                f"{block_tokens} tokens (must be {block_tokens * (len(hash_ids) - 1) + 1} to "
                f"{block_tokens * len(hash_ids)})"
            )
        parts = []
        for hash_id in hash_ids:
            block = blocks.get(hash_id)
            if block is None:
                block = blocks[hash_id] = mooncake_block(seed, hash_id, block_tokens)
            parts.append(block)
        prompt = np.concatenate(parts)[:input_length]
        arrival = math.floor(timestamp / ms_per_step)
        parsed.append(TraceRequest(len(parsed), prompt, _tokens(rng, output_length), arrival))
    return _finish_trace(parsed, source)


def _request_lines(lines: Iterable[str]) -> Iterator[tuple[int, str]]:
    """``(line number, stripped text)`` of each line that is not blank or a ``#`` comment."""
    for number, line in enumerate(lines, start=1):
        text = line.strip()
        if text and not text.startswith("#"):
            yield number, text


def _is_mooncake(text: str) -> bool:
    try:
        record = json.loads(text)
    except json.JSONDecodeError:
        return False
    return isinstance(record, dict) and "hash_ids" in record


def load_trace(
    path: str | os.PathLike[str],
    *,
    seed: int = 0,
    max_requests: int | None = None,
    ms_per_step: float = DEFAULT_MS_PER_STEP,
) -> list[TraceRequest]:
    """Read a JSONL or Mooncake trace (formats in the module docstring, told apart by the first
    request line); ``ValueError`` naming ``FILE:LINE``. ``max_requests``: read only the file's
    first requests. ``ms_per_step``: Mooncake timestamps per simulator step."""
    if max_requests is not None and max_requests < 1:
        raise ValueError(f"max_requests must be >= 1, got {max_requests}")
    if not ms_per_step > 0:
        raise ValueError(f"ms_per_step must be > 0, got {ms_per_step}")
    with open(path, encoding="utf-8") as file:
        lines = _request_lines(file)
        first = next(lines, None)
        if first is None:
            raise ValueError(f"{path}: the trace has no requests")
        stream = itertools.chain([first], lines)
        if _is_mooncake(first[1]):
            return _parse_mooncake_lines(stream, str(path), seed, max_requests, ms_per_step)
        return _parse_trace_lines(stream, str(path), seed, max_requests)
