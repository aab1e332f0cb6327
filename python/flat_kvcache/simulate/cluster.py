"""``flat-kvcache simulate --workers N``: one trace over N engines behind a router (docs/routing.md).

Each worker is the single-engine scheduler loop of :mod:`flat_kvcache.simulate.loop` (its own
``FlatKVCache``, running and waiting queues), built from the same :class:`SimulationConfig`
(``num_pages`` / ``arena`` are per worker), with KV events on. The workers advance in lockstep:
each global step,

1. the requests whose ``arrival_step`` has come are routed, in arrival order, each to one
   worker's queue (:class:`~flat_kvcache.routing.RoundRobinRouter` or
   :class:`~flat_kvcache.routing.KvRouter`; a worker's load is its queued and running requests);
2. every worker with work runs one step of its loop, and the KV router takes its events.

Every admission is recorded: the worker, the hit the router predicted when it routed the request,
the hit predicted again from the index just before the worker's ``admit`` (its events taken
first), and the hit ``admit`` served. The second must always equal the third (the index is an
exact mirror); the first can differ when the worker's cache changed while the request queued.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from flat_kvcache.simulate.loop import (
    SimulationConfig,
    _Loop,
    default_num_pages,
    engine_options,
    engine_specs,
    with_storage,
)
from flat_kvcache.simulate.report import percentiles
from flat_kvcache.simulate.trace import TraceRequest

__all__ = ["Admission", "ClusterResult", "simulate_cluster"]


@dataclass(frozen=True)
class Admission:
    """One admission of a request by a worker (a preempted request is admitted again)."""

    request_id: int
    worker: int
    #: The router's prediction for this worker when it routed the request (None: round-robin).
    routed_prediction: int | None
    #: The index's prediction just before ``admit`` (None: round-robin).
    admit_prediction: int | None
    served: int


@dataclass
class ClusterResult:
    """A cluster run: its summary (``summary``), the admissions and each worker's own summary."""

    summary: dict[str, Any]
    admissions: list[Admission] = field(default_factory=list)
    workers: list[dict[str, Any]] = field(default_factory=list)


class _Recorded:
    """A worker's cache as its loop sees it: every call forwarded, ``admit`` recorded."""

    def __init__(self, cache: Any, on_admit: Callable[[Any, Any, Sequence[str], int], None]) -> None:
        self._cache = cache
        self._on_admit = on_admit
        self._before: Callable[[Any, Sequence[str]], int | None] = lambda prompt, extra: None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cache, name)

    def admit(self, request_id: Any, prompt: Any, tokens: int, *, extra_keys: Sequence[str] = ()) -> Any:
        predicted = self._before(prompt, extra_keys)
        admitted = self._cache.admit(request_id, prompt, tokens, extra_keys=extra_keys)
        if admitted is not None:
            self._on_admit(request_id, predicted, extra_keys, int(admitted[1]))
        return admitted


def _worker_config(trace: Sequence[TraceRequest], config: SimulationConfig, workers: int) -> SimulationConfig:
    """``config`` with its storage resolved (:func:`with_storage`; a default arena is 1/N of the
    single-engine one) and ``num_pages`` set: as given, or 1/N of the single-engine default pool."""
    config = with_storage(trace, config, workers)
    if config.arena is not None or config.num_pages is not None:
        return config
    import flat_kvcache

    specs = engine_specs(flat_kvcache, config.model, config.page_size)
    if config.state_page_size is not None:
        specs = [
            dataclasses.replace(s, page_size=config.state_page_size) if s.kind == "state" else s
            for s in specs
        ]
    total = default_num_pages(trace, specs, config.max_running)
    return dataclasses.replace(config, num_pages=1 + math.ceil((total - 1) / workers))


def active_blocks(loop: _Loop, page_size: int) -> int:
    """The blocks of ``page_size`` tokens of every request ``loop`` holds (queued, waiting or
    running: prompt plus what it generated), as Dynamo's router counts a worker's active blocks."""
    queued = sum(-(-len(request.prompt) // page_size) for request in loop.pending)
    # A preempted request's folded prompt holds what it generated: count the trace prompt.
    live = sum(-(-(len(x.request.prompt) + x.generated) // page_size) for x in (*loop.waiting, *loop.running))
    return queued + live


def simulate_cluster(
    trace: Sequence[TraceRequest],
    config: SimulationConfig,
    *,
    workers: int,
    router: str = "kv",
    overlap_weight: float | None = None,
    progress: Callable[[int, int, int, int], None] | None = None,
) -> ClusterResult:
    """Replay ``trace`` over ``workers`` engines (module docstring). ``config`` is one worker's
    settings: ``num_pages`` / ``arena`` per worker (``num_pages`` None: 1/N of the pool
    :func:`~flat_kvcache.simulate.default_num_pages` gives one engine); the native engine only.
    ``router`` is ``"round-robin"`` or ``"kv"`` (needs the ``dynamo`` extra); ``overlap_weight``
    (``kv`` only) routes by Dynamo's cost, ``overlap_weight`` times the prefill blocks plus the
    worker's active blocks (:class:`~flat_kvcache.routing.KvRouter`), instead of overlap first."""
    import flat_kvcache

    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if router not in ("round-robin", "kv"):
        raise ValueError(f"router must be 'round-robin' or 'kv', got {router!r}")
    if config.engine != "native":
        raise ValueError("a cluster runs the native engine only (engine='native')")
    if overlap_weight is not None and router != "kv":
        raise ValueError(f"overlap_weight is a kv router setting; router is {router!r}")
    if router == "kv" and config.host_pages:
        raise ValueError("--router kv does not model a host-memory tier (host_pages must be 0)")
    config = _worker_config(trace, config, workers)
    loops: list[_Loop] = []
    admissions: list[Admission] = []
    routed: dict[int, int | None] = {}
    for worker in range(workers):
        # The loop is built as simulate() builds it (the trace sizes its block-table buffers);
        # then its cache is replaced by one with KV events, and its queue starts empty.
        loop = _Loop(trace, config)
        options = {**engine_options(config), "enable_kv_events": True}
        cache = (
            flat_kvcache.FlatKVCache(loop.specs, arena=config.arena, **options)
            if config.arena is not None
            else flat_kvcache.FlatKVCache(loop.specs, loop.num_pages, **options)
        )

        def on_admit(
            rid: Any, predicted: int | None, extra: Sequence[str], hit: int, worker: int = worker
        ) -> None:
            admissions.append(Admission(int(rid), worker, routed.get(int(rid)), predicted, hit))

        loop.cache = _Recorded(cache, on_admit)
        if loop.rows_bound:
            loop.cache.bind_rows(loop.out)
        loop.pending = deque()
        loop.total = 0
        loops.append(loop)

    specs = loops[0].specs
    kv: Any = None
    if router == "kv":
        from flat_kvcache.routing import KvRouter

        kv = KvRouter(workers, specs, loops[0].base, overlap_weight)
        chooser: Any = kv

        for worker, loop in enumerate(loops):

            def before(prompt: Any, extra: Sequence[str], worker: int = worker) -> int:
                drain(worker)
                return int(kv.predict(prompt, extra).get(worker, 0))

            loop.cache._before = before
    else:
        from flat_kvcache.routing import RoundRobinRouter

        chooser = RoundRobinRouter(workers)

    def drain(worker: int) -> None:
        if kv is not None:
            kv.feed(worker, loops[worker].cache._cache.take_events())
        else:
            loops[worker].cache._cache.take_events()  # keep the event list from growing

    pending = deque(sorted(trace, key=lambda r: r.arrival_step))
    route_ns: list[int] = []
    step = 0
    wall_start = time.perf_counter_ns()
    last_report = 0
    total = len(trace)

    def busy(loop: _Loop) -> bool:
        return bool(loop.pending or loop.waiting or loop.running)

    while pending or any(busy(loop) for loop in loops):
        if pending and not any(busy(loop) for loop in loops) and pending[0].arrival_step > step:
            step = pending[0].arrival_step  # idle until the next arrival
        while pending and pending[0].arrival_step <= step:
            request = pending.popleft()
            loads = [len(loop.pending) + len(loop.waiting) + len(loop.running) for loop in loops]
            blocks = None if overlap_weight is None else [active_blocks(loop, kv.page_size) for loop in loops]
            start = time.perf_counter_ns()
            worker, predicted = chooser.route(request.prompt, request.extra_keys, loads, blocks)
            route_ns.append(time.perf_counter_ns() - start)
            routed[request.request_id] = predicted
            loops[worker].pending.append(request)
            loops[worker].total += 1
        for worker, loop in enumerate(loops):
            if busy(loop):
                loop.step = step
                loop.one_step()
                drain(worker)
        step += 1
        if progress is not None and step - last_report >= 50:
            last_report = step
            done = sum(loop.done for loop in loops)
            progress(step, done, total, sum(len(loop.running) for loop in loops))
    wall_ns = time.perf_counter_ns() - wall_start
    if progress is not None:
        progress(step, sum(loop.done for loop in loops), total, 0)
    per_worker = [loop._summary(wall_ns) for loop in loops]
    return ClusterResult(
        _cluster_summary(trace, router, overlap_weight, step, per_worker, admissions, route_ns, wall_ns),
        admissions,
        per_worker,
    )


def _cluster_summary(
    trace: Sequence[TraceRequest],
    router: str,
    overlap_weight: float | None,
    steps: int,
    per_worker: list[dict[str, Any]],
    admissions: list[Admission],
    route_ns: list[int],
    wall_ns: int,
) -> dict[str, Any]:
    prompt_tokens = sum(len(request.prompt) for request in trace)
    hits = sum(s["prefix_hits_tokens"] for s in per_worker)
    queries = sum(s["prefix_queries_tokens"] for s in per_worker)
    predicted = [a for a in admissions if a.admit_prediction is not None]
    exact_admit = sum(a.admit_prediction == a.served for a in predicted)
    first: dict[int, Admission] = {}
    for a in admissions:
        first.setdefault(a.request_id, a)
    routed_hits = sum(a.served for a in first.values())
    # A routing prediction is for the request's first admission (a re-admission after
    # preemption is not routed again).
    routed = [a for a in first.values() if a.routed_prediction is not None]
    exact_routed = sum(a.routed_prediction == a.served for a in routed)
    return {
        "router": router,
        #: The kv router's Dynamo cost weight (None: overlap first, load on ties).
        "overlap_weight": overlap_weight,
        "workers": len(per_worker),
        "requests": len(trace),
        "steps": steps,
        "finished": sum(s["finished"] for s in per_worker),
        "aborted": sum(s["aborted"] for s in per_worker),
        "preemptions": sum(s["preemptions"] for s in per_worker),
        "admissions": len(admissions),
        "prompt_tokens": prompt_tokens,
        #: Hit tokens of each request's first admission (where the router placed it).
        "routed_hits_tokens": routed_hits,
        #: Those over the trace's prompt tokens: the cluster token hit rate.
        "hit_rate": round(routed_hits / prompt_tokens, 6) if prompt_tokens else 0.0,
        #: The engines' counters, re-admissions after preemption included (a preempted request
        #: gets its own pages back, which says nothing about routing).
        "prefix_queries_tokens": queries,
        "prefix_hits_tokens": hits,
        "all_admissions_hit_rate": round(hits / prompt_tokens, 6) if prompt_tokens else 0.0,
        "requests_per_worker": [
            sum(1 for a in first.values() if a.worker == w) for w in range(len(per_worker))
        ],
        "hits_per_worker": [s["prefix_hits_tokens"] for s in per_worker],
        "num_pages_per_worker": per_worker[0]["num_pages"] if per_worker else None,
        "arena_units_per_worker": (per_worker[0]["arena"] or {}).get("units") if per_worker else None,
        "predicted_admissions": len(predicted),
        #: Share of admissions whose prediction just before admit equals the served hit (must be 1).
        "exact_at_admit": round(exact_admit / len(predicted), 6) if predicted else None,
        #: Share of first admissions whose prediction at routing time equals the served hit (the
        #: request may queue while the worker's cache changes).
        "exact_at_routing": round(exact_routed / len(routed), 6) if routed else None,
        #: Time to route one request (predict every worker's hit and choose), in microseconds.
        "route_us": percentiles(route_ns),
        "wall_s": round(wall_ns / 1e9, 3),
    }
