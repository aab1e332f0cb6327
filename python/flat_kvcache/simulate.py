"""``flat-kvcache simulate``: a reference scheduler loop over a request trace (issue 5, SPEC 9).

The loop is what a serving engine's scheduler does with the token-level API of
``docs/requests-api.md``, minus the model: every step it schedules the running requests, admits
waiting ones, builds the block tables, "samples" one token for every request whose known
tokens are all computed, and finishes the requests that have their output. Only the calls into
the cache are timed, so the figures are the cache's cost per step, not the loop's.

One step, in order:

1. Arrivals: requests whose ``arrival_step`` has come join the back of the waiting queue.
2. Running requests, in admission order, each get ``n = min(known - computed, tokens left)``
   tokens: the rest of the prompt (a chunked-prefill chunk) or the one token sampled last step
   (a decode). One ``schedule_batch`` call schedules them all; a request whose pages do not
   fit keeps its place and gets nothing this step (SPEC 9: a later chunk or decode admits if
   its pages fit, reclaimable pages counted, which ``schedule`` checks itself).
3. Admission, first come first served, while the token budget lasts and fewer than
   ``max_running`` run: the head of the queue gets a first chunk of
   ``min(prompt - hit, tokens left)`` tokens if ``pages_needed_to_admit(prompt, chunk,
   reserve)`` fits in ``budget()`` (free pages less the pages promised to other requests' next
   decode; ``reserve`` is 1 token when the chunk completes the prompt, for the first decode).
   Then ``add_request`` claims the prefix hit and ``schedule`` takes the chunk. The first
   request that does not fit stops admission (no overtaking). While ``budget()`` is below one
   page per group no first chunk can fit, and the check is skipped.
4. ``block_tables(scheduled, out=...)`` into preallocated int32 buffers.
5. Every scheduled request whose known tokens are now all computed samples a token: the last
   one it needs finishes it (``finish``), the others' tokens are appended in one
   ``append_tokens_batch`` call (timed as ``append_tokens``). A request
   whose next decode starts a page gets ``reserve(req, 1)`` so admissions leave it its page
   (at any other position the next token fits in the pages it has and the reserve would be 0).
6. SPEC 9 retraction: when nothing in flight progressed for two consecutive steps, the running
   request holding the most tokens (the latest admitted on a tie) is preempted
   (``preempt``), its generated tokens folded into its prompt, and it goes back to the front of
   the queue; each further stuck step retracts one more. If that request is the only one
   holding pages it can never fit, so it is aborted as out of memory instead; with nothing
   running and a waiting request that does not fit for two steps, that one is aborted.

Generated tokens are pseudo-random ids drawn from the seed when the trace is built, so a run is
deterministic and the native engine and the reference give the same summary (timings aside).

Trace files (``--trace FILE.jsonl``): one JSON object per line (blank lines and lines starting
with ``#`` are skipped):

- ``prompt`` (list of token ids, each in ``[0, 2**32)``) or ``prompt_len`` (int >= 1): the
  prompt, given or drawn from the seed;
- ``output_len`` (int >= 1): tokens to generate;
- ``prefix_id`` (str or int) with ``prefix_len`` (int >= 1, < ``prompt_len``), optional and only
  with ``prompt_len``: the prompt starts with the first ``prefix_len`` tokens of a token stream
  drawn from the seed and the prefix id, so requests with the same id share that prefix;
- ``arrival_step`` (int >= 0, default 0): the step at which the request arrives;
- ``extra_keys`` (list of str, default none): keys that separate equal token pages (LoRA
  adapter, cache salt), hashed into every page of the request.

Requests keep file order within an arrival step.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from importlib import import_module
from types import ModuleType
from typing import Any, Literal, TextIO

import numpy as np
import numpy.typing as npt

from flat_kvcache.config import layer_types_from_config, load_model_config, sliding_window_from_config
from flat_kvcache.presets import DEFAULT_PRESET, preset_names

__all__ = [
    "DEFAULT_MAX_SCHEDULED_TOKENS",
    "SimulationConfig",
    "SimulationResult",
    "TraceRequest",
    "add_parser",
    "default_num_pages",
    "default_trace",
    "format_summary",
    "load_trace",
    "plot_result",
    "simulate",
]

PROG = "flat-kvcache"
DEFAULT_NUM_REQUESTS = 2000
DEFAULT_MAX_SCHEDULED_TOKENS = 8192
DEFAULT_MAX_RUNNING = 256
DEFAULT_PAGE_SIZE = 16
#: Token ids are drawn from ``[0, VOCAB)``.
VOCAB = 50_000
#: The default pool holds this fraction of what the trace's first ``max_running`` requests need
#: at their full length (see :func:`default_num_pages`): enough to run, short enough to preempt.
DEFAULT_POOL_FRACTION = 0.5

Engine = Literal["native", "reference"]
EvictionOrder = Literal["hybrid", "group"]
TokenArray = npt.NDArray[np.uint32]


# --- traces -----------------------------------------------------------------------------------


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


# --- the engine -------------------------------------------------------------------------------


def _engine_module(engine: Engine) -> ModuleType:
    if engine == "native":
        return import_module("flat_kvcache")
    if engine == "reference":
        return import_module("flat_kvcache.reference")
    raise ValueError(f"engine must be 'native' or 'reference', got {engine!r}")


def engine_specs(module: ModuleType, preset: str | os.PathLike[str], page_size: int) -> list[Any]:
    """The engine specs (``module.kv_cache_specs``) of a preset name or ``config.json`` path."""
    cfg = load_model_config(preset)
    layer_types = layer_types_from_config(cfg)
    if not layer_types:
        raise ValueError("the model config has no layers")
    groups = module.group_specs_from_layer_types(
        layer_types, sliding_window_from_config(cfg), page_size=page_size
    )
    specs: list[Any] = module.kv_cache_specs(groups)
    return specs


def default_num_pages(
    trace: Sequence[TraceRequest],
    specs: Sequence[Any],
    max_running: int = DEFAULT_MAX_RUNNING,
    fraction: float = DEFAULT_POOL_FRACTION,
) -> int:
    """A pool under memory pressure: ``fraction`` of the pages the first ``max_running``
    requests of the trace would hold at their full length, all at once, plus the null page.

    A full or state group counts ``ceil(tokens / P)`` pages per request; a sliding group
    ``ceil((W - 1) / P) + 1`` (what it keeps after reclaim). At least enough for the largest
    request alone, so every request can run.
    """

    def pages(tokens: int) -> int:
        total = 0
        for spec in specs:
            if spec.kind == "sliding_window":
                total += min(
                    math.ceil(tokens / spec.page_size),
                    math.ceil((spec.sliding_window - 1) / spec.page_size) + 1,
                )
            else:
                total += math.ceil(tokens / spec.page_size)
        return total

    sizes = [len(request.prompt) + request.output_len for request in trace]
    together = sum(pages(tokens) for tokens in sizes[:max_running])
    # Alone, a request holds its whole prompt in every group during prefill (nothing slid out yet).
    alone = max(
        (len(specs) * math.ceil(tokens / min(s.page_size for s in specs)) for tokens in sizes), default=1
    )
    return 1 + max(math.ceil(fraction * together), alone)


# --- the loop ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class SimulationConfig:
    """Settings of one run. ``num_pages`` None means :func:`default_num_pages`."""

    preset: str = DEFAULT_PRESET
    engine: Engine = "native"
    eviction_order: EvictionOrder = "hybrid"
    num_pages: int | None = None
    page_size: int = DEFAULT_PAGE_SIZE
    max_scheduled_tokens: int = DEFAULT_MAX_SCHEDULED_TOKENS
    max_running: int = DEFAULT_MAX_RUNNING
    enable_caching: bool = True
    block_tables: bool = True


@dataclass
class _Live:
    """The loop's view of one request."""

    request: TraceRequest
    prompt: TokenArray  # as given to add_request: the trace prompt, or the folded one after preemption
    generated: int = 0  # tokens sampled so far (all but the last are appended)
    computed: int = 0
    known: int = 0  # tokens the cache holds: prompt + appended
    admitted_at: int = -1  # admission counter, for the preemption tie-break

    @property
    def rid(self) -> int:
        return self.request.request_id


#: Cache calls are timed per kind; these are the kinds, in summary order.
CALL_KINDS = ("schedule_batch", "admit", "block_tables", "append_tokens", "finish", "reserve", "preempt")


@dataclass
class SimulationResult:
    """The summary (JSON-ready) and per-step series of a run."""

    summary: dict[str, Any]
    step_cache_ns: list[int] = field(default_factory=list)
    running: list[int] = field(default_factory=list)
    pages_by_group: dict[str, list[int]] = field(default_factory=dict)
    group_ids: list[str] = field(default_factory=list)


def _percentiles(values_ns: Sequence[int]) -> dict[str, float]:
    if not values_ns:
        return {"median_us": 0.0, "p99_us": 0.0, "mean_us": 0.0, "max_us": 0.0}
    array = np.asarray(values_ns, dtype=np.float64) / 1000.0
    return {
        "median_us": round(float(np.median(array)), 3),
        "p99_us": round(float(np.percentile(array, 99)), 3),
        "mean_us": round(float(array.mean()), 3),
        "max_us": round(float(array.max()), 3),
    }


_perf = time.perf_counter_ns


class _Loop:
    """The scheduler loop of :func:`simulate`: one method per phase of a step (module docstring)."""

    def __init__(self, trace: Sequence[TraceRequest], config: SimulationConfig) -> None:
        if config.max_scheduled_tokens < 1 or config.max_running < 1:
            raise ValueError("max_scheduled_tokens and max_running must be >= 1")
        module = _engine_module(config.engine)
        self.config = config
        self.specs = engine_specs(module, config.preset, config.page_size)
        self.num_pages = (
            default_num_pages(trace, self.specs, config.max_running)
            if config.num_pages is None
            else config.num_pages
        )
        self.cache: Any = module.FlatKVCache(
            self.specs,
            self.num_pages,
            enable_caching=config.enable_caching,
            eviction_order=config.eviction_order,
        )
        self.group_ids: list[str] = list(self.cache.group_ids)
        self.num_groups = len(self.group_ids)
        self.base = int(self.cache.base_page_size)
        # Block-table buffers wide enough for the longest request (a folded prompt is no longer).
        longest = max((len(r.prompt) + r.output_len for r in trace), default=1)
        self.out = {
            gid: np.empty((config.max_running, math.ceil(longest / spec.page_size) + 2), dtype=np.int32)
            for gid, spec in zip(self.group_ids, self.specs, strict=True)
        }
        self.total = len(trace)
        self.pending = deque(trace)  # not arrived yet, in arrival order
        self.waiting: deque[_Live] = deque()
        self.running: list[_Live] = []
        self.step = 0
        self.stuck_steps = 0
        self.admissions = 0
        self.counts = dict.fromkeys(
            ("finished", "aborted", "admission_failures", "scheduled_tokens", "generated_tokens"), 0
        )
        self.calls_ns = dict.fromkeys(CALL_KINDS, 0)
        self.step_ns = 0
        self.step_cache_ns: list[int] = []
        self.decode_step_ns: list[int] = []
        self.running_series: list[int] = []
        self.pages_series: dict[str, list[int]] = {gid: [] for gid in self.group_ids}

    def _charge(self, kind: str, start_ns: int) -> None:
        """Add the time since ``start_ns`` to the step and to ``kind``."""
        elapsed = _perf() - start_ns
        self.calls_ns[kind] += elapsed
        self.step_ns += elapsed

    @property
    def done(self) -> int:
        return self.counts["finished"] + self.counts["aborted"]

    def run(self, progress: Callable[[int, int, int, int], None] | None) -> SimulationResult:
        wall_start = _perf()
        last_report = 0
        while self.pending or self.waiting or self.running:
            self._one_step()
            if progress is not None and self.step - last_report >= 50:
                last_report = self.step
                progress(self.step, self.done, self.total, len(self.running))
        wall_ns = _perf() - wall_start
        if progress is not None:
            progress(self.step, self.done, self.total, len(self.running))
        return SimulationResult(
            self._summary(wall_ns), self.step_cache_ns, self.running_series, self.pages_series, self.group_ids
        )

    def _one_step(self) -> None:
        self._arrivals()
        self.step_ns = 0
        scheduled, decodes, tokens_left = self._schedule_running(self.config.max_scheduled_tokens)
        admitted = self._admit(tokens_left)
        batch = scheduled + admitted
        if batch and self.config.block_tables:
            start = _perf()
            self.cache.block_tables([live.rid for live in batch], out=self.out)
            self._charge("block_tables", start)
        self._sample(batch)
        self.stuck_steps = 0 if batch else self.stuck_steps + 1
        if self.stuck_steps >= 2:
            self._retract()
        self._record(decode_only=bool(batch) and decodes == len(batch))

    def _arrivals(self) -> None:
        if not self.waiting and not self.running and self.pending[0].arrival_step > self.step:
            self.step = self.pending[0].arrival_step  # idle until the next arrival
        while self.pending and self.pending[0].arrival_step <= self.step:
            request = self.pending.popleft()
            self.waiting.append(_Live(request, request.prompt))

    def _schedule_running(self, tokens_left: int) -> tuple[list[_Live], int, int]:
        """Step 2: one ``schedule_batch`` over the running requests.

        Returns the requests that got their tokens, how many of those were decodes, and the
        tokens left for admissions.
        """
        batch: list[_Live] = []
        sizes: list[int] = []
        for live in self.running:
            if tokens_left == 0:
                break
            n = min(live.known - live.computed, tokens_left)
            batch.append(live)
            sizes.append(n)
            tokens_left -= n
        scheduled: list[_Live] = []
        decodes = 0
        if not batch:
            return scheduled, decodes, tokens_left
        start = _perf()
        ok = self.cache.schedule_batch([live.rid for live in batch], sizes)
        self._charge("schedule_batch", start)
        for live, n, success in zip(batch, sizes, ok.tolist(), strict=True):
            if success:
                live.computed += n
                scheduled.append(live)
                self.counts["scheduled_tokens"] += n
                decodes += live.generated > 0 and n == 1
            else:
                tokens_left += n  # not used: admissions may have it
        return scheduled, decodes, tokens_left

    def _admit(self, tokens_left: int) -> list[_Live]:
        """Step 3: admit waiting requests first come first served; returns the admitted ones."""
        admitted: list[_Live] = []
        cache = self.cache
        while self.waiting and tokens_left > 0 and len(self.running) < self.config.max_running:
            live = self.waiting[0]
            rid, prompt, extra = live.rid, live.prompt, live.request.extra_keys
            start = _perf()
            if cache.budget() < self.num_groups:
                # Any first chunk takes at least one page per group (a claim leaves no room in
                # the last page), so the full check, which hashes the prompt twice, would fail.
                self._charge("admit", start)
                break
            hit = cache.prefix_hit_tokens(prompt, extra_keys=extra)
            chunk = min(len(prompt) - hit, tokens_left)
            reserve = 1 if hit + chunk == len(prompt) else 0
            fits = cache.pages_needed_to_admit(prompt, chunk, reserve, extra_keys=extra) <= cache.budget()
            got = ok = 0
            if fits:
                got = cache.add_request(rid, prompt, extra_keys=extra)
                ok = cache.schedule(rid, chunk)
                if not ok:
                    cache.finish(rid)  # SPEC 8: on failure the claim stays; the caller frees it
            self._charge("admit", start)
            if not fits:
                break
            if got != hit:
                raise RuntimeError(
                    f"request {rid}: add_request hit {got} tokens but prefix_hit_tokens said {hit}"
                )
            if not ok:
                self.counts["admission_failures"] += 1  # the check said it fits; retry next step
                break
            self.waiting.popleft()
            live.computed, live.known = hit + chunk, len(prompt)
            live.admitted_at = self.admissions
            self.admissions += 1
            self.running.append(live)
            admitted.append(live)
            self.counts["scheduled_tokens"] += chunk
            tokens_left -= chunk
        return admitted

    def _sample(self, scheduled: list[_Live]) -> None:
        """Step 5: a token for each request with all its known tokens computed; finish, append, reserve."""
        done: list[_Live] = []
        append_reqs: list[int] = []
        append_tokens: list[int] = []
        for live in scheduled:
            if live.computed == live.known:
                live.generated += 1
                self.counts["generated_tokens"] += 1
                if live.generated == live.request.output_len:
                    done.append(live)
                else:
                    append_reqs.append(live.rid)
                    append_tokens.append(int(live.request.output[live.generated - 1]))
                    live.known += 1
        cache = self.cache
        if append_reqs:
            start = _perf()
            cache.append_tokens_batch(append_reqs, append_tokens)  # one token each, one call
            self._charge("append_tokens", start)
        if done:
            start = _perf()
            for live in done:
                cache.finish(live.rid)
            self._charge("finish", start)
            self.counts["finished"] += len(done)
            gone = {id(live) for live in done}
            self.running = [live for live in self.running if id(live) not in gone]
        # The next decode starts a page only at a base-page boundary (every page size is a
        # multiple of the base); anywhere else each group's last page has room for the token.
        reserves = [
            live.rid
            for live in scheduled
            if live.known - live.computed == 1
            and live.computed % self.base == 0
            and live.generated < live.request.output_len
        ]
        if reserves:
            start = _perf()
            for rid in reserves:
                cache.reserve(rid, 1)
            self._charge("reserve", start)

    def _retract(self) -> None:
        """Step 6: preempt the running request holding the most tokens (or abort, see the docstring)."""
        if not self.running:
            if self.waiting:
                self.waiting.popleft()  # nothing holds pages and it still does not fit
                self.counts["aborted"] += 1
            return
        victim = max(self.running, key=lambda live: (live.known, live.admitted_at))
        self.running.remove(victim)
        start = _perf()
        if self.running:
            folded = self.cache.preempt(victim.rid)
        else:
            self.cache.finish(victim.rid)  # the only holder: it cannot fit even alone
            folded = None
        self._charge("preempt", start)
        if folded is None:
            self.counts["aborted"] += 1
            return
        victim.prompt = np.asarray(folded, dtype=np.uint32)
        victim.computed = victim.known = 0
        self.waiting.appendleft(victim)

    def _record(self, *, decode_only: bool) -> None:
        stats = self.cache.stats()  # instrumentation, not timed
        by_group = stats["pages_in_use_by_group"]
        for gid in self.group_ids:
            self.pages_series[gid].append(int(by_group[gid]))
        self.running_series.append(len(self.running))
        self.step_cache_ns.append(self.step_ns)
        if decode_only:
            self.decode_step_ns.append(self.step_ns)
        self.step += 1

    def _summary(self, wall_ns: int) -> dict[str, Any]:
        stats = self.cache.stats()
        queries, hits = int(stats["prefix_queries_tokens"]), int(stats["prefix_hits_tokens"])
        config = self.config
        return {
            "engine": config.engine,
            "preset": config.preset,
            "eviction_order": config.eviction_order,
            "groups": [
                {
                    "group_id": gid,
                    "kind": spec.kind,
                    "page_size": spec.page_size,
                    "sliding_window": spec.sliding_window,
                }
                for gid, spec in zip(self.group_ids, self.specs, strict=True)
            ],
            "num_pages": self.num_pages,
            "max_scheduled_tokens": config.max_scheduled_tokens,
            "max_running": config.max_running,
            "requests": self.total,
            "steps": len(self.step_cache_ns),
            **{key: self.counts[key] for key in ("finished", "aborted")},
            "preemptions": int(stats["preemptions"]),
            **{
                key: self.counts[key]
                for key in ("admission_failures", "scheduled_tokens", "generated_tokens")
            },
            "prefix_queries_tokens": queries,
            "prefix_hits_tokens": hits,
            "prefix_hit_rate": round(hits / queries, 6) if queries else 0.0,
            "evictions": int(stats["evictions"]),
            "peak_running": max(self.running_series, default=0),
            "peak_pages_by_group": {gid: max(self.pages_series[gid], default=0) for gid in self.group_ids},
            "peak_pages_in_use": max(
                (sum(pages) for pages in zip(*self.pages_series.values(), strict=True)), default=0
            ),
            "timing": {
                "cache_total_ms": round(sum(self.step_cache_ns) / 1e6, 3),
                "per_step": _percentiles(self.step_cache_ns),
                "per_decode_step": {**_percentiles(self.decode_step_ns), "steps": len(self.decode_step_ns)},
                "by_call_ms": {kind: round(ns / 1e6, 3) for kind, ns in self.calls_ns.items()},
                "wall_s": round(wall_ns / 1e9, 3),
            },
        }


def simulate(
    trace: Sequence[TraceRequest],
    config: SimulationConfig = SimulationConfig(),
    *,
    progress: Callable[[int, int, int, int], None] | None = None,
) -> SimulationResult:
    """Run the scheduler loop (module docstring) over ``trace``; see :class:`SimulationResult`.

    ``progress(step, done, total, running)`` is called every 50 steps and once at the end.
    """
    return _Loop(trace, config).run(progress)


# --- output -----------------------------------------------------------------------------------


def format_summary(summary: dict[str, Any]) -> str:
    """The summary as an aligned table."""
    timing = summary["timing"]
    step, decode = timing["per_step"], timing["per_decode_step"]
    groups = ", ".join(
        f"{g['group_id']} ({g['kind']}, P={g['page_size']}"
        + (f", W={g['sliding_window']})" if g["sliding_window"] is not None else ")")
        for g in summary["groups"]
    )
    peak = ", ".join(f"{gid} {pages}" for gid, pages in summary["peak_pages_by_group"].items())
    calls = ", ".join(f"{kind} {ms:.1f}" for kind, ms in timing["by_call_ms"].items() if ms)
    rows = [
        ("engine", f"{summary['engine']} (eviction order {summary['eviction_order']})"),
        ("model", f"{summary['preset']}: {groups}"),
        ("pool", f"{summary['num_pages']} pages (page 0 is the null page)"),
        ("limits", f"{summary['max_scheduled_tokens']} tokens per step, {summary['max_running']} running"),
        ("requests", f"{summary['requests']}: {summary['finished']} finished, {summary['aborted']} aborted"),
        ("steps", str(summary["steps"])),
        ("preemptions", str(summary["preemptions"])),
        (
            "prefix hit rate",
            f"{summary['prefix_hit_rate']:.2%} ({summary['prefix_hits_tokens']} of "
            f"{summary['prefix_queries_tokens']} prompt tokens)",
        ),
        ("evictions", str(summary["evictions"])),
        ("tokens", f"{summary['scheduled_tokens']} scheduled, {summary['generated_tokens']} generated"),
        ("peak running", str(summary["peak_running"])),
        ("peak pages", f"{peak} (together {summary['peak_pages_in_use']})"),
        ("cache time / step", f"median {step['median_us']:.1f} us, p99 {step['p99_us']:.1f} us"),
        (
            "  decode-only steps",
            f"median {decode['median_us']:.1f} us, p99 {decode['p99_us']:.1f} us ({decode['steps']} steps)",
        ),
        ("cache time total", f"{timing['cache_total_ms']:.1f} ms (by call, ms: {calls})"),
        ("wall time", f"{timing['wall_s']:.2f} s"),
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def plot_result(result: SimulationResult, path: str | os.PathLike[str]) -> None:
    """Pages in use per group and running requests over the steps, as a PNG (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError(
            "--plot needs matplotlib, the optional `plot` extra: pip install 'flat-kvcache[plot]'"
        ) from exc
    summary = result.summary
    steps = np.arange(len(result.running))
    figure, (pages_axis, running_axis) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    for gid in result.group_ids:
        pages_axis.plot(steps, result.pages_by_group[gid], label=gid, linewidth=1)
    pages_axis.axhline(summary["num_pages"] - 1, color="grey", linestyle="--", linewidth=1, label="pool")
    pages_axis.set_ylabel("pages in use")
    pages_axis.legend(loc="center right")
    pages_axis.set_title(
        f"{summary['preset']}, {summary['engine']} engine, eviction order {summary['eviction_order']}: "
        f"{summary['requests']} requests, {summary['preemptions']} preemptions, "
        f"prefix hit rate {summary['prefix_hit_rate']:.1%}"
    )
    running_axis.plot(steps, result.running, color="black", linewidth=1)
    running_axis.set_ylabel("running requests")
    running_axis.set_xlabel("step")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


class _ProgressBar:
    """A one-line progress bar on a stream (stderr), redrawn at most every 0.1 s."""

    def __init__(self, stream: TextIO, width: int = 30) -> None:
        self._stream = stream
        self._width = width
        self._last = 0.0

    def __call__(self, step: int, done: int, total: int, running: int) -> None:
        now = time.monotonic()
        if done < total and now - self._last < 0.1:
            return
        self._last = now
        filled = self._width * done // total if total else self._width
        bar = "#" * filled + "." * (self._width - filled)
        self._stream.write(f"\r[{bar}] {done}/{total} requests, step {step}, {running} running ")
        if done >= total:
            self._stream.write("\n")
        self._stream.flush()


# --- the command line -------------------------------------------------------------------------


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def add_parser(commands: Any) -> argparse.ArgumentParser:
    """Add the ``simulate`` subcommand to ``commands`` (an argparse subparsers object)."""
    parser: argparse.ArgumentParser = commands.add_parser(
        "simulate",
        help="run a reference scheduler loop over a request trace and time the cache calls",
        description=(
            "Run a reference scheduler loop (FCFS, chunked prefill under a token budget, decode, "
            "admission and preemption per SPEC 9) over a request trace, and print steps, finished "
            "requests, preemptions, prefix hit rate, peak pages per group and the time spent in "
            "cache calls per step. The default trace is built in: 2000 requests, prompts of 512 "
            "to 4096 tokens, half sharing a 1024-token prefix, 128 generated tokens each."
        ),
    )
    parser.add_argument(
        "--preset",
        default=DEFAULT_PRESET,
        metavar="NAME",
        help=f"model preset or config.json path (default {DEFAULT_PRESET}; "
        f"presets: {', '.join(preset_names())})",
    )
    parser.add_argument("--trace", metavar="FILE.jsonl", help="a JSONL trace (default: the built-in one)")
    parser.add_argument(
        "--num-requests",
        type=_non_negative,
        default=DEFAULT_NUM_REQUESTS,
        metavar="N",
        help=f"requests in the built-in trace ({DEFAULT_NUM_REQUESTS})",
    )
    parser.add_argument(
        "--seed", type=_non_negative, default=0, metavar="S", help="seed of every token id (0)"
    )
    parser.add_argument(
        "--num-pages",
        type=_positive,
        metavar="N",
        help="pool size, page 0 included (default: half of what the first --max-running requests "
        "need at full length, so the run preempts)",
    )
    parser.add_argument(
        "--page-size", type=_positive, default=DEFAULT_PAGE_SIZE, metavar="P", help="tokens per page (16)"
    )
    parser.add_argument(
        "--max-scheduled-tokens",
        type=_positive,
        default=DEFAULT_MAX_SCHEDULED_TOKENS,
        metavar="S",
        help=f"token budget per step ({DEFAULT_MAX_SCHEDULED_TOKENS})",
    )
    parser.add_argument(
        "--max-running",
        type=_positive,
        default=DEFAULT_MAX_RUNNING,
        metavar="B",
        help=f"most requests running at once ({DEFAULT_MAX_RUNNING})",
    )
    parser.add_argument(
        "--engine",
        choices=("native", "reference"),
        default="native",
        help="the Rust engine (default) or the pure-Python reference",
    )
    parser.add_argument(
        "--eviction-order",
        choices=("hybrid", "group"),
        default="hybrid",
        help="free-list order of a finished request's pages: all groups tail first (hybrid, "
        "default) or group by group (group, the reference design's)",
    )
    parser.add_argument("--no-prefix-caching", action="store_true", help="run with prefix caching off")
    parser.add_argument("--no-block-tables", action="store_true", help="skip the per-step block_tables call")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.add_argument(
        "--plot",
        metavar="FILE.png",
        help="draw pages in use per group and running requests per step (needs the plot extra)",
    )
    parser.add_argument(
        "--progress",
        action="store_true",
        help="show the progress bar even when stderr is not a terminal",
    )
    parser.set_defaults(run=run_command)
    return parser


def _error(message: str) -> None:
    print(f"{PROG}: error: {' '.join(message.split())}", file=sys.stderr)


def run_command(args: argparse.Namespace) -> int:
    """Run ``flat-kvcache simulate`` from parsed arguments; returns the exit status."""
    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            _error("--plot needs matplotlib, the optional `plot` extra: pip install 'flat-kvcache[plot]'")
            return 1
    try:
        if args.trace is not None:
            trace = load_trace(args.trace, seed=args.seed)
        else:
            trace = default_trace(args.num_requests, seed=args.seed)
        config = SimulationConfig(
            preset=args.preset,
            engine=args.engine,
            eviction_order=args.eviction_order,
            num_pages=args.num_pages,
            page_size=args.page_size,
            max_scheduled_tokens=args.max_scheduled_tokens,
            max_running=args.max_running,
            enable_caching=not args.no_prefix_caching,
            block_tables=not args.no_block_tables,
        )
        show = args.progress or sys.stderr.isatty()
        result = simulate(trace, config, progress=_ProgressBar(sys.stderr) if show and trace else None)
        if args.plot is not None:
            plot_result(result, args.plot)
    except (OSError, ValueError, OverflowError) as exc:
        _error(str(exc))
        return 1
    print(json.dumps(result.summary, indent=2) if args.json else format_summary(result.summary))
    return 0
