"""The scheduler loop of ``flat-kvcache simulate`` (SPEC 9).

The loop is what a serving engine's scheduler does with the slot API of ``FlatKVCache``
(``docs/requests-api.md``), minus the model: every step it schedules the running requests, admits
waiting ones, builds the block tables, "samples" one token for every request whose known
tokens are all computed, and finishes the requests that have their output. Only the calls into
the cache are timed, so the figures are the cache's cost per step, not the loop's.

One step, in order:

1. Arrivals: requests whose ``arrival_step`` has come join the back of the waiting queue.
2. Running requests, in admission order, each get ``n = min(known - computed, tokens left)``
   tokens: the rest of the prompt (a chunked-prefill chunk, cut by ``next_chunk`` where the
   state groups keep a snapshot: no cut without state groups) or the one token sampled last
   step (a decode). One ``schedule(slots, ns)`` call schedules them all, addressed by the slots
   ``admit`` returned; a request whose pages do not fit keeps its place and gets nothing this
   step (SPEC 9: a later chunk or decode admits if its pages fit, reclaimable pages counted,
   which ``schedule`` checks itself).
3. Admission, first come first served, while the token budget lasts and fewer than
   ``max_running`` run: the head of the queue gets a first chunk of
   ``min(prompt - hit, tokens left)`` tokens (cut as ``next_chunk`` cuts) if
   ``pages_needed_to_admit(prompt, chunk, reserve)`` fits in ``budget()`` (free pages less the
   pages promised to other requests' next decode; ``reserve`` is 1 token when the chunk
   completes the prompt, for the first decode).
   ``admit`` makes that check and, when it passes, ``add_request`` (which claims the prefix
   hit and gives the request the lowest free slot, its row of the persistent block tables) in
   one call; then ``schedule([slot], [chunk])`` takes the chunk. The first
   request that does not fit stops admission (no overtaking). While ``budget()`` is below one
   page per group no first chunk can fit, and the check is skipped. With
   ``register_on_schedule`` every chunk scheduled earlier in the step (the running requests'
   and earlier admissions') has registered the pages it fills, so a hit counts them (vLLM's
   scheduler caches a page when it allocates it).
4. The block tables: ``update_rows()`` writes the cells that changed into the persistent
   ``[max_running, cols]`` tables bound at the start (``tables="rows"``, the default: row
   ``s`` is the request in slot ``s``), or ``block_tables(slots, out=...)`` rewrites the batch's
   rows (``tables="full"``, no rows bound).
5. Every scheduled request whose known tokens are now all computed samples a token: the last
   one it needs finishes it (one ``finish(slots)`` call for all of them), the others' tokens are
   appended in one ``append_tokens(slots, tokens)`` call. The requests whose next decode starts a
   page get one token of reserve in one ``reserve(slots, ones)`` call, so admissions leave them
   their page (at any other position the next token fits in the pages a request has and the
   reserve would be 0).
6. SPEC 9 retraction: when nothing in flight progressed for two consecutive steps (so no chunk
   scheduled in this step is dropped from its forward, as ``register_on_schedule`` requires), the running
   request holding the most tokens (the latest admitted on a tie) is preempted
   (``preempt([slot])``), its generated tokens folded into its prompt, and it goes back to the front of
   the queue; each further stuck step retracts one more. If that request is the only one
   holding pages it can never fit, so it is aborted as out of memory instead; with nothing
   running and a waiting request that does not fit for two steps, that one is aborted.

Generated tokens are pseudo-random ids drawn from the seed when the trace is built, so a run is
deterministic and the native engine and the reference give the same summary (timings aside).

What each step decided (the requests scheduled with their tokens, those admitted with their hit,
those finished, preempted or aborted) is folded into a digest, the summary's ``decisions``
(:mod:`flat_kvcache.simulate.decisions`): another loop over the same trace did the same work
only if its digest is the same (``benches/vllm_compare.py`` checks it before comparing times).
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib import import_module
from types import ModuleType
from typing import Any, Literal, TextIO

import numpy as np

from flat_kvcache._types import SLIDING
from flat_kvcache.config import (
    cache_from_config,
    layer_types_from_config,
    load_model_config,
    sliding_window_from_config,
)
from flat_kvcache.errors import ConfigError
from flat_kvcache.families import read_model_layers
from flat_kvcache.presets import DEFAULT_PRESET
from flat_kvcache.simulate.decisions import DecisionLog
from flat_kvcache.simulate.report import SimulationResult, percentiles
from flat_kvcache.simulate.trace import TokenArray, TraceRequest

__all__ = [
    "CALL_KINDS",
    "DEFAULT_MAX_RUNNING",
    "DEFAULT_MAX_SCHEDULED_TOKENS",
    "DEFAULT_PAGE_SIZE",
    "DEFAULT_POOL_FRACTION",
    "DEFAULT_REUSE_UNCACHED_FIRST",
    "DEFAULT_STATE_GRAIN",
    "Engine",
    "EvictionOrder",
    "SimulationConfig",
    "default_arena",
    "default_num_pages",
    "engine_specs",
    "simulate",
    "with_storage",
]

DEFAULT_MAX_SCHEDULED_TOKENS = 8192
DEFAULT_MAX_RUNNING = 256
DEFAULT_PAGE_SIZE = 16
#: The default pool holds this fraction of what the trace's first ``max_running`` requests need
#: at their full length (see :func:`default_num_pages`): enough to run, short enough to preempt.
DEFAULT_POOL_FRACTION = 0.5
#: The engines' default for ``reuse_uncached_first`` (a released page that holds no key is
#: handed out before any cached page).
DEFAULT_REUSE_UNCACHED_FIRST = True

Engine = Literal["native", "reference"]
EvictionOrder = Literal["hybrid", "group"]


# --- the engine -------------------------------------------------------------------------------


def _engine_module(engine: Engine) -> ModuleType:
    if engine == "native":
        return import_module("flat_kvcache")
    if engine == "reference":
        return import_module("flat_kvcache.reference")
    raise ValueError(f"engine must be 'native' or 'reference', got {engine!r}")


#: A model: a preset name, a ``config.json`` path (or its folder) or a config dict.
Model = str | os.PathLike[str] | Mapping[str, Any]


def engine_options(config: SimulationConfig) -> dict[str, Any]:
    """The ``FlatKVCache`` keyword options a run of ``config`` builds its cache with."""
    return {
        "enable_caching": config.enable_caching,
        "eviction_order": config.eviction_order,
        "reuse_uncached_first": config.reuse_uncached_first,
        "host_pages": config.host_pages,
        "eviction_policy": config.eviction_policy,
        "register_on_schedule": config.register_on_schedule,
    }


def engine_specs(module: ModuleType, model: Model, page_size: int) -> list[Any]:
    """The engine specs (``module.kv_cache_specs``) of a model (a preset name, a ``config.json``
    path or a config dict), computed with ``module``'s own sizing (native or reference)."""
    cfg = load_model_config(model)
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
            if spec.kind == SLIDING:
                total += min(
                    math.ceil(tokens / spec.page_size),
                    math.ceil((spec.sliding_window - 1) / spec.page_size) + 1,
                )
            else:
                total += math.ceil(tokens / spec.page_size)
        return total

    sizes = [len(request.prompt) + request.output_len for request in trace]
    together = sum(pages(tokens) for tokens in sizes[:max_running])
    # Alone, a request holds its whole prompt in every group during prefill (nothing slid out
    # yet). An empty trace still gets a pool that holds one token (a page per group).
    alone = max(
        (len(specs) * math.ceil(tokens / min(s.page_size for s in specs)) for tokens in sizes),
        default=len(specs),
    )
    return 1 + max(math.ceil(fraction * together), alone)


# --- the loop ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class SimulationConfig:
    """Settings of one run. ``model`` is a preset name, a ``config.json`` path (or its folder) or
    a config dict; ``reuse_uncached_first`` is the engine option of that name (where released
    pages that hold no key join the free list).

    The storage (``storage``): a model with state layers runs on the SPEC 13 arena (``arena``;
    None: :func:`default_arena`, which needs torch) unless ``storage="equalized"`` asks for
    ``num_pages`` equal pages (the layout vLLM-style storage uses); an attention-only model runs
    on ``num_pages`` equal pages unless ``arena`` is given or ``storage="arena"``.
    ``num_pages`` None means :func:`default_num_pages`. :func:`with_storage` resolves it."""

    model: Model = DEFAULT_PRESET
    engine: Engine = "native"
    eviction_order: EvictionOrder = "hybrid"
    #: Which state checkpoints the cache keeps (SPEC 13.8): ``"lru"`` or ``"reuse"``.
    eviction_policy: Literal["lru", "reuse"] = "lru"
    reuse_uncached_first: bool = DEFAULT_REUSE_UNCACHED_FIRST
    #: Same-step sharing (``FlatKVCache(register_on_schedule=)``): a request admitted in the step
    #: that schedules its prefix's pages hits them, as under vLLM's scheduler. The loop keeps the
    #: option's promise: it preempts only in a step that scheduled nothing.
    register_on_schedule: bool = False
    num_pages: int | None = None
    page_size: int = DEFAULT_PAGE_SIZE
    max_scheduled_tokens: int = DEFAULT_MAX_SCHEDULED_TOKENS
    max_running: int = DEFAULT_MAX_RUNNING
    enable_caching: bool = True
    block_tables: bool = True
    #: ``"rows"``: persistent rows (``bind_rows`` once, ``update_rows`` every step; row ``s`` is
    #: slot ``s``); ``"full"``: a full ``block_tables(slots, out=)`` rewrite every step.
    tables: Literal["rows", "full"] = "rows"
    #: Host-memory tier pages (0: none); its transfers are acknowledged as soon as emitted.
    host_pages: int = 0
    #: SPEC 13 storage: an ``ArenaPlan`` (``plan_arena``) the engine's pages live in, instead of
    #: ``num_pages`` equal pages (``FlatKVCache(specs, arena=...)``).
    arena: Any = None
    #: The state groups' page size in tokens, their checkpoint grain ``G`` (None: over an arena
    #: the least multiple of 64 and ``page_size``, else ``page_size``).
    state_page_size: int | None = None
    #: ``"arena"``, ``"equalized"`` or None: the model's default (the class docstring).
    storage: Literal["arena", "equalized"] | None = None


#: The state checkpoint grain over an arena when none is given (SPEC 13: 64 tokens, where the
#: state kernels' chunked prefill aligns; rounded up to a multiple of the page size).
DEFAULT_STATE_GRAIN = 64
#: The budget of the probe plan :func:`default_arena` reads the unit's size from (no memory is
#: allocated for a plan).
_PROBE_BYTES = 1 << 50


def _has_state(model: Model) -> bool:
    return read_model_layers(load_model_config(model)).state_kind is not None


def default_arena(
    trace: Sequence[TraceRequest],
    model: Model,
    page_size: int = DEFAULT_PAGE_SIZE,
    max_running: int = DEFAULT_MAX_RUNNING,
    fraction: float = DEFAULT_POOL_FRACTION,
    workers: int = 1,
) -> Any:
    """The arena a run gets when none is given, sized as :func:`default_num_pages` sizes a pool:
    ``fraction`` of the units the trace's first ``max_running`` requests would take at their
    full length, all at once (a working state slot each, their attention pages packed into
    units as the engine packs them), split over ``workers``, and at least what the largest
    request takes alone (its prompt in every attention group before anything slides out, a
    page less per unit where pages straddle units, a working slot and a checkpoint), plus the
    null unit. ``flat_kvcache.plan_arena`` over the model's components (``ModelShape``'s
    dtypes); needs torch."""
    try:
        from flat_kvcache.torch import ModelShape
    except ImportError:
        raise ValueError(
            "a model with state layers runs on the SPEC 13 arena, whose plan needs PyTorch (the "
            "torch extra: pip install '.[torch]'); or run it on equal pages: storage='equalized'"
        ) from None
    from flat_kvcache import plan_arena

    cfg = load_model_config(model)
    try:
        components = ModelShape.from_config(cfg).components()
    except TypeError as exc:
        raise ValueError(str(exc)) from None
    probe = plan_arena(components, page_size, _PROBE_BYTES)
    unit = probe.unit_bytes
    windows = {
        spec.group_id: spec.sliding_window
        for spec in engine_specs(import_module("flat_kvcache"), cfg, page_size)
    }
    state = any(g.kind == "state" for g in probe.groups)
    paged = [g for g in probe.groups if g.kind == "pages"]

    def together(tokens: int) -> float:
        units = 1.0 if state else 0.0
        for group in paged:
            pages = math.ceil(tokens / page_size)
            window = windows[group.group_id]
            if window is not None:
                pages = min(pages, math.ceil((window - 1) / page_size) + 1)
            units += pages * group.item_bytes / unit
        return units

    def alone(tokens: int) -> int:
        fewest = [max(1, g.per_unit - 1 if g.slack_bytes else g.per_unit) for g in paged]
        pages = math.ceil(tokens / page_size)
        return (2 if state else 0) + sum(math.ceil(pages / k) for k in fewest)

    sizes = [len(request.prompt) + request.output_len for request in trace]
    share = math.ceil(fraction * sum(together(tokens) for tokens in sizes[:max_running]) / workers)
    units = 1 + max(share, max((alone(tokens) for tokens in sizes), default=alone(1)))
    return plan_arena(components, page_size, units * unit)


def with_storage(
    trace: Sequence[TraceRequest], config: SimulationConfig, workers: int = 1
) -> SimulationConfig:
    """``config`` with its storage resolved (the :class:`SimulationConfig` docstring): an arena
    (:func:`default_arena` for ``workers`` engines when none is given) and a state grain, or
    equal pages. A ``ValueError`` for settings that contradict each other; a
    :class:`~flat_kvcache.errors.ConfigError` for ``num_pages`` on a model with state layers
    without ``storage="equalized"``."""
    if config.storage not in (None, "arena", "equalized"):
        raise ValueError(f"storage must be 'arena', 'equalized' or None, got {config.storage!r}")
    if config.arena is not None and config.num_pages is not None:
        raise ValueError("num_pages must be None with arena (the arena sizes the pool)")
    if config.storage == "equalized" and config.arena is not None:
        raise ValueError("storage='equalized' runs on num_pages equal pages: it takes no arena")
    if config.storage == "arena" and config.num_pages is not None:
        raise ValueError("storage='arena' sizes the pool in units: it takes no num_pages (pass arena)")
    storage = config.storage
    if storage is None:
        if config.arena is not None:
            storage = "arena"
        elif _has_state(config.model):
            if config.num_pages is not None:
                raise ConfigError(
                    "num_pages is a pool of equal pages, and a model with state layers runs on the "
                    "SPEC 13 arena: pass arena (or neither, for the default arena), or "
                    "storage='equalized' for num_pages equal pages (the layout vLLM-style storage uses)"
                )
            storage = "arena"
        else:
            storage = "equalized"
    if storage == "equalized":
        return dataclasses.replace(config, storage="equalized")
    arena = config.arena
    if arena is None:
        arena = default_arena(trace, config.model, config.page_size, config.max_running, workers=workers)
    grain = config.state_page_size
    if grain is None:
        grain = math.lcm(DEFAULT_STATE_GRAIN, config.page_size)
    return dataclasses.replace(config, storage="arena", arena=arena, state_page_size=grain)


@dataclass
class _Live:
    """The loop's view of one request."""

    request: TraceRequest
    prompt: TokenArray  # as given to add_request: the trace prompt, or the folded one after preemption
    generated: int = 0  # tokens sampled so far (all but the last are appended)
    computed: int = 0
    known: int = 0  # tokens the cache holds: prompt + appended
    admitted_at: int = -1  # admission counter, for the preemption tie-break
    slot: int = -1  # the slot admit returned, while running (its row when rows are bound)

    @property
    def rid(self) -> int:
        return self.request.request_id


#: Cache calls are timed per kind; these are the kinds, in summary order.
CALL_KINDS = ("schedule", "admit", "block_tables", "append_tokens", "finish", "reserve", "preempt")


_perf = time.perf_counter_ns


class _Loop:
    """The scheduler loop of :func:`simulate`: one method per phase of a step (module docstring)."""

    def __init__(
        self, trace: Sequence[TraceRequest], config: SimulationConfig, decisions: TextIO | None = None
    ) -> None:
        if config.max_scheduled_tokens < 1 or config.max_running < 1:
            raise ValueError("max_scheduled_tokens and max_running must be >= 1")
        if config.tables not in ("rows", "full"):
            raise ValueError(f"tables must be 'rows' or 'full', got {config.tables!r}")
        module = _engine_module(config.engine)
        config = with_storage(trace, config)
        self.config = config
        cfg = load_model_config(config.model)
        self.specs = engine_specs(module, cfg, config.page_size)
        if config.state_page_size is not None:
            self.specs = [
                dataclasses.replace(spec, page_size=config.state_page_size) if spec.kind == "state" else spec
                for spec in self.specs
            ]
        # Only state groups make next_chunk cut a chunk; without them it is a call for nothing.
        self.cuts_chunks = any(spec.kind == "state" for spec in self.specs)
        if config.arena is not None and config.num_pages is not None:
            raise ValueError("num_pages must be None with arena (the arena sizes the pool)")
        self.num_pages: int | None = (
            None
            if config.arena is not None
            else default_num_pages(trace, self.specs, config.max_running)
            if config.num_pages is None
            else config.num_pages
        )
        options = engine_options(config)
        # The native engine is built as a user builds it; the reference from its own sizing.
        self.cache: Any = (
            module.FlatKVCache(self.specs, arena=config.arena, **options)
            if config.arena is not None
            else cache_from_config(cfg, num_pages=self.num_pages, page_size=config.page_size, **options)
            if not self.cuts_chunks
            # Equal pages for a model with state layers were asked for (with_storage checked it).
            else cache_from_config(
                cfg, num_pages=self.num_pages, page_size=config.page_size, storage="equalized", **options
            )
            if config.engine == "native" and config.state_page_size is None
            else module.FlatKVCache(self.specs, self.num_pages, **options)
        )
        # The pool must hold one token of a request (a page in every group) besides the null
        # page, or no request is ever scheduled and every one is aborted.
        one_token = int(self.cache.pages_needed(1))
        if self.num_pages is None:
            if int(self.cache.budget()) < one_token:
                raise ValueError(f"the arena is too small: one token of a request needs {one_token} credits")
        elif self.num_pages - 1 < one_token:
            raise ValueError(
                f"num_pages={self.num_pages} is too small: one token of a request needs {one_token} "
                f"pages (one per group) besides the null page 0, so num_pages must be >= {one_token + 1}"
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
        self.rows_bound = config.tables == "rows"
        if self.rows_bound:
            # Row s is the request in slot s: at most max_running are live, so every slot the
            # cache gives is a row of the buffers (a finished or preempted request's slot is reused).
            self.cache.bind_rows(self.out)
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
        # Arena storage: the share of the arena stranded (free pages of busy units) per step.
        self.stranded_series: list[float] = []
        # ... and the share held by cached pages of busy units (cached prefixes that only their
        # own group can reuse or evict).
        self.cached_busy_series: list[float] = []
        # What each step decided (simulate.decisions): its digest goes into the summary, its
        # records to ``decisions`` when given. Not timed.
        self.decisions = DecisionLog(decisions)
        self._decided: dict[str, list[Any]] = {}

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
            self.one_step()
            if progress is not None and self.step - last_report >= 50:
                last_report = self.step
                progress(self.step, self.done, self.total, len(self.running))
        wall_ns = _perf() - wall_start
        if progress is not None:
            progress(self.step, self.done, self.total, len(self.running))
        return SimulationResult(
            self._summary(wall_ns), self.step_cache_ns, self.running_series, self.pages_series, self.group_ids
        )

    def one_step(self) -> None:
        """One scheduler step: arrivals, the running requests' chunks, admissions, the cache
        calls and the sampled tokens (:meth:`run` calls it until the trace is done; a cluster,
        ``simulate.cluster``, drives each worker's loop step by step)."""
        self._arrivals()
        self.step_ns = 0
        self._decided = {"scheduled": [], "admitted": [], "finished": [], "preempted": [], "aborted": []}
        scheduled, decodes, tokens_left = self._schedule_running(self.config.max_scheduled_tokens)
        admitted = self._admit(tokens_left)
        batch = scheduled + admitted
        if batch and self.config.block_tables:
            start = _perf()
            if self.rows_bound:
                self.cache.update_rows()
            else:
                self.cache.block_tables([live.slot for live in batch], out=self.out)
            self._charge("block_tables", start)
        self._sample(batch)
        self._ack_transfers()
        self.stuck_steps = 0 if batch else self.stuck_steps + 1
        if self.stuck_steps >= 2:
            self._retract()
        self.decisions.record(self.step, **self._decided)
        self._record(decode_only=bool(batch) and decodes == len(batch))

    def _ack_transfers(self) -> None:
        """With a host tier: run (instantly) and acknowledge every transfer emitted so far."""
        if not self.config.host_pages:
            return
        start = _perf()
        taken = self.cache.take_transfers()
        ids = [int(i) for kind in ("store", "load") for ids, _, _ in taken[kind].values() for i in ids]
        if ids:
            self.cache.ack_transfers(ids)
        self._charge("admit", start)

    def _arrivals(self) -> None:
        if not self.waiting and not self.running and self.pending[0].arrival_step > self.step:
            self.step = self.pending[0].arrival_step  # idle until the next arrival
        while self.pending and self.pending[0].arrival_step <= self.step:
            request = self.pending.popleft()
            self.waiting.append(_Live(request, request.prompt))

    def _schedule_running(self, tokens_left: int) -> tuple[list[_Live], int, int]:
        """Step 2: one ``schedule`` call over the running requests' slots.

        Returns the requests that got their tokens, how many of those were decodes, and the
        tokens left for admissions.
        """
        batch: list[_Live] = []
        sizes: list[int] = []
        slots: list[int] = []
        for live in self.running:
            if tokens_left == 0:
                break
            n = min(live.known - live.computed, tokens_left)
            if n > 1 and self.cuts_chunks:
                # A prefill chunk: cut where the state groups keep a snapshot (next_chunk).
                # Decode steps (one token) need no cut.
                start = _perf()
                n = self.cache.next_chunk(live.slot, n)
                self._charge("schedule", start)
            batch.append(live)
            sizes.append(n)
            slots.append(live.slot)
            tokens_left -= n
        scheduled: list[_Live] = []
        decodes = 0
        if not batch:
            return scheduled, decodes, tokens_left
        start = _perf()
        # Plain lists: converting them natively is cheaper than building numpy arrays.
        ok = self.cache.schedule(slots, sizes)
        self._charge("schedule", start)
        for live, n, success in zip(batch, sizes, ok.tolist(), strict=True):
            if success:
                live.computed += n
                scheduled.append(live)
                self._decided["scheduled"].append((live.rid, n))
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
                # the last page), so the full check, which hashes the prompt, would fail.
                self._charge("admit", start)
                break
            # One call: the capped hit, the first chunk, its fit check and add_request.
            admitted_as = cache.admit(rid, prompt, tokens_left, extra_keys=extra)
            if admitted_as is None:
                self._charge("admit", start)
                break
            slot, hit, chunk = admitted_as
            self._charge("admit", start)
            self._ack_transfers()  # host loads land before the request is scheduled (timed there)
            start = _perf()
            ok = bool(cache.schedule([slot], [chunk])[0])
            if not ok:
                cache.finish([slot])  # SPEC 8: on failure the claim stays; the caller frees it
            self._charge("admit", start)
            if not ok:
                self.counts["admission_failures"] += 1  # the check said it fits; retry next step
                break
            self.waiting.popleft()
            live.slot = slot
            live.computed, live.known = hit + chunk, len(prompt)
            live.admitted_at = self.admissions
            self.admissions += 1
            self.running.append(live)
            admitted.append(live)
            self._decided["admitted"].append((rid, hit, chunk))
            self.counts["scheduled_tokens"] += chunk
            tokens_left -= chunk
        return admitted

    def _sample(self, scheduled: list[_Live]) -> None:
        """Step 5: a token for each request with all its known tokens computed; finish, append, reserve."""
        done: list[_Live] = []
        append_slots: list[int] = []
        append_tokens: list[int] = []
        for live in scheduled:
            if live.computed == live.known:
                live.generated += 1
                self.counts["generated_tokens"] += 1
                if live.generated == live.request.output_len:
                    done.append(live)
                else:
                    append_slots.append(live.slot)
                    append_tokens.append(int(live.request.output[live.generated - 1]))
                    live.known += 1
        cache = self.cache
        if append_slots:
            start = _perf()
            cache.append_tokens(append_slots, append_tokens)  # one token each, one call
            self._charge("append_tokens", start)
        if done:
            start = _perf()
            cache.finish([live.slot for live in done])
            self._charge("finish", start)
            for live in done:
                live.slot = -1  # free: the next admission may get it
            self.counts["finished"] += len(done)
            self._decided["finished"] += [live.rid for live in done]
            gone = {id(live) for live in done}
            self.running = [live for live in self.running if id(live) not in gone]
        # The next decode starts a page only at a base-page boundary (every page size is a
        # multiple of the base); anywhere else each group's last page has room for the token.
        reserves = [
            live.slot
            for live in scheduled
            if live.known - live.computed == 1
            and live.computed % self.base == 0
            and live.generated < live.request.output_len
        ]
        if reserves:
            start = _perf()
            cache.reserve(reserves, [1] * len(reserves))
            self._charge("reserve", start)

    def _retract(self) -> None:
        """Step 6: preempt the running request holding the most tokens (or abort, see the docstring)."""
        if not self.running:
            if self.waiting:
                gone = self.waiting.popleft()  # nothing holds pages and it still does not fit
                self.counts["aborted"] += 1
                self._decided["aborted"].append(gone.rid)
            return
        victim = max(self.running, key=lambda live: (live.known, live.admitted_at))
        self.running.remove(victim)
        slot, victim.slot = victim.slot, -1
        start = _perf()
        if self.running:
            folded = self.cache.preempt([slot])[0]
        else:
            self.cache.finish([slot])  # the only holder: it cannot fit even alone
            folded = None
        self._charge("preempt", start)
        if folded is None:
            self.counts["aborted"] += 1
            self._decided["aborted"].append(victim.rid)
            return
        self._decided["preempted"].append(victim.rid)
        victim.prompt = np.asarray(folded, dtype=np.uint32)
        victim.computed = victim.known = 0
        self.waiting.appendleft(victim)

    def _record(self, *, decode_only: bool) -> None:
        stats = self.cache.stats()  # instrumentation, not timed
        by_group = stats["pages_in_use_by_group"]
        for gid in self.group_ids:
            self.pages_series[gid].append(int(by_group[gid]))
        self.running_series.append(len(self.running))
        arena = self.cache.arena_stats() if self.config.arena is not None else None
        if arena is not None:
            size = arena["units_total"] * arena["unit_bytes"]
            self.stranded_series.append(arena["stranded_bytes"] / size if size else 0.0)
            self.cached_busy_series.append(arena["cached_bytes"] / size if size else 0.0)
        self.step_cache_ns.append(self.step_ns)
        if decode_only:
            self.decode_step_ns.append(self.step_ns)
        self.step += 1

    def _arena_summary(self) -> dict[str, Any]:
        """The arena's size, and over the run the shares of it stranded (free pages of busy
        units that hold nothing) and cached in busy units (arena storage only)."""
        arena = self.cache.arena_stats()

        def share(series: list[float]) -> tuple[float, float]:
            return round(max(series, default=0.0), 6), round(sum(series) / len(series), 6) if series else 0.0

        stranded, cached = share(self.stranded_series), share(self.cached_busy_series)
        return {
            "unit_bytes": arena["unit_bytes"],
            "units": arena["units_total"],
            "stranded_share_max": stranded[0],
            "stranded_share_mean": stranded[1],
            "cached_busy_share_max": cached[0],
            "cached_busy_share_mean": cached[1],
        }

    def _summary(self, wall_ns: int) -> dict[str, Any]:
        stats = self.cache.stats()
        queries, hits = int(stats["prefix_queries_tokens"]), int(stats["prefix_hits_tokens"])
        config = self.config
        return {
            "engine": config.engine,
            "model": _model_name(config.model),
            "eviction_order": config.eviction_order,
            "eviction_policy": config.eviction_policy,
            "reuse_uncached_first": config.reuse_uncached_first,
            "register_on_schedule": config.register_on_schedule,
            "tables": config.tables,
            "groups": [
                {
                    "group_id": gid,
                    "kind": spec.kind,
                    "page_size": spec.page_size,
                    "sliding_window": spec.sliding_window,
                }
                for gid, spec in zip(self.group_ids, self.specs, strict=True)
            ],
            "storage": config.storage,
            "num_pages": self.num_pages,
            "arena": None if config.arena is None else self._arena_summary(),
            "max_scheduled_tokens": config.max_scheduled_tokens,
            "max_running": config.max_running,
            "requests": self.total,
            "steps": len(self.step_cache_ns),
            # The digest of every step's decisions (simulate.decisions): equal digests, same work.
            "decisions": self.decisions.summary(),
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
            "host_pages": config.host_pages,
            "host_hits_tokens": int(stats["host_hits_tokens"]),
            "host_stores": int(stats["host_stores"]),
            "host_loads": int(stats["host_loads"]),
            "host_evictions": int(stats["host_evictions"]),
            "checkpoints": (
                {key: int(stats[f"checkpoints_{key}"]) for key in ("written", "hit", "evicted")}
                if self.cuts_chunks
                else None
            ),
            "peak_running": max(self.running_series, default=0),
            "peak_pages_by_group": {gid: max(self.pages_series[gid], default=0) for gid in self.group_ids},
            "peak_pages_in_use": max(
                (sum(pages) for pages in zip(*self.pages_series.values(), strict=True)), default=0
            ),
            "timing": {
                "cache_total_ms": round(sum(self.step_cache_ns) / 1e6, 3),
                "per_step": percentiles(self.step_cache_ns),
                "per_decode_step": {**percentiles(self.decode_step_ns), "steps": len(self.decode_step_ns)},
                "by_call_ms": {kind: round(ns / 1e6, 3) for kind, ns in self.calls_ns.items()},
                "wall_s": round(wall_ns / 1e9, 3),
            },
        }


def _model_name(model: Model) -> str:
    """How the summary names a model: the preset name or path, or a config dict's model type."""
    if isinstance(model, Mapping):
        return f"a config dict ({model.get('model_type') or 'no model_type'})"
    return os.fspath(model)


def simulate(
    trace: Sequence[TraceRequest],
    config: SimulationConfig = SimulationConfig(),
    *,
    progress: Callable[[int, int, int, int], None] | None = None,
    decisions: TextIO | None = None,
) -> SimulationResult:
    """Run the scheduler loop (module docstring) over ``trace``; see :class:`SimulationResult`.

    ``progress(step, done, total, running)`` is called every 50 steps and once at the end.
    ``decisions``: each step's decisions are written there as a JSONL record
    (:mod:`flat_kvcache.simulate.decisions`); the summary's ``decisions`` is their digest.
    """
    return _Loop(trace, config, decisions).run(progress)
