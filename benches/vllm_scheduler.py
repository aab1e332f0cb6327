"""Time vLLM's own scheduler with its KV-cache manager and with flat-kvcache's (not in CI).

The same request stream (shared prefixes, 256 requests running at once once the queue fills)
goes through vLLM 0.33's ``AsyncScheduler`` twice: with vLLM's ``KVCacheManager`` and with
``flat_kvcache.vllm.FlatScheduler``. Per step it measures (1) the time spent inside the KV
manager's calls the scheduler makes (every manager method is wrapped with a timer on the
instance, the same wrapper for both; what the wrapper itself costs per call, measured on a no-op
in the same process, is subtracted) and (2) the whole ``schedule()`` + ``update_from_output()``;
then, with no timer inside, the cost per call of the two calls the scheduler makes for every
running request every step (``allocate_slots``, ``cache_blocks``) on one decoding request.
Runs alternate between the two managers; each figure is the median over steps, then the median
(and range) over runs. The step decisions of the two are checked equal on the way (tests/vllm
checks them in full).

vLLM lives in its own venv (see requirements/vllm.txt, or ``pip install vllm==0.33.0``)::

    PYTHONPATH=python /tmp/vllm-venv/bin/python benches/vllm_scheduler.py --runs 5
    PYTHONPATH=python /tmp/vllm-venv/bin/python benches/vllm_scheduler.py --smoke
    PYTHONPATH=python /tmp/vllm-venv/bin/python benches/vllm_scheduler.py --hybrid gdn-align

``--hybrid`` runs a GDN hybrid instead of a full-attention model: Qwen3.5's layer pattern (three
GDN layers to one full-attention layer, twice), its KV cache config built by vLLM's config steps
(three MambaSpec groups and one full group), mamba_cache_mode "align" with prefix caching (dense
retention) or "none" without.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flat_kvcache.vllm import FlatScheduler
from flat_kvcache.vllm.harness import (
    SchedulerSetup,
    build_scheduler,
    fake_model_output,
    make_stream,
    new_request,
    record_step,
    run_steps,
)
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # type: ignore[import-not-found]

# The manager calls vLLM 0.33's scheduler makes on its default path.
MANAGER_CALLS = (
    "new_step_starts",
    "get_computed_blocks",
    "allocate_slots",
    "get_blocks",
    "get_block_ids",
    "free",
    "record_prefix_cache_stats",
    "make_prefix_cache_stats",
    "take_new_block_ids",
    "take_kv_cache_block_copies",
    "take_boundary_state_offloads",
    "take_events",
    "estimate_cached_tokens",
    "cache_blocks",
    "remove_skipped_blocks",
)


# Qwen3.5 / Qwen3-Next: three GDN (linear-attention) layers to one full-attention layer.
HYBRID_LAYERS = ("linear_attention", "linear_attention", "linear_attention", "full_attention") * 2


class _Clock:
    def __init__(self) -> None:
        self.ns = 0
        self.calls = 0


def _time_manager(manager: Any, clock: _Clock) -> None:
    """Shadow each manager method on the instance with a timed wrapper."""
    perf = time.perf_counter_ns

    def timed(method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def call(*args: Any, **kwargs: Any) -> Any:
            start = perf()
            try:
                return method(*args, **kwargs)
            finally:
                clock.ns += perf() - start
                clock.calls += 1

        return call

    for name in MANAGER_CALLS:
        method = getattr(manager, name, None)
        if method is not None:
            setattr(manager, name, timed(method))


def timer_overhead_ns() -> float:
    """What the timed wrapper itself adds inside its measurement, per call (a no-op, timed)."""

    class _Noop:
        def new_step_starts(self, *args: Any, **kwargs: Any) -> None:
            pass

    noop = _Noop()
    clock = _Clock()
    _time_manager(noop, clock)
    for _ in range(200_000):
        noop.new_step_starts(1, key=2)
    return clock.ns / clock.calls


def run_once(
    cls: type, setup: SchedulerSetup, stream: list[Any], min_running: int, overhead_ns: float
) -> dict[str, Any]:
    scheduler = build_scheduler(cls, setup)
    clock = _Clock()
    _time_manager(scheduler.kv_cache_manager, clock)
    pending = sorted(stream, key=lambda r: r.arrival_step)
    index = 0
    manager_ns: list[float] = []
    raw_ns: list[int] = []
    step_ns: list[int] = []
    decisions: list[Any] = []
    perf = time.perf_counter_ns
    step = 0
    while index < len(pending) or scheduler.requests:
        while index < len(pending) and pending[index].arrival_step <= step:
            scheduler.add_request(new_request(pending[index], setup.block_size))
            index += 1
        before, before_calls = clock.ns, clock.calls
        start = perf()
        output = scheduler.schedule()
        model_output = fake_model_output(scheduler, output)  # not timed: stands in for the GPU
        mid = perf()
        scheduler.update_from_output(output, model_output)
        end = perf()
        running = len(output.num_scheduled_tokens)
        if running >= min_running:
            manager_ns.append(clock.ns - before - (clock.calls - before_calls) * overhead_ns)
            raw_ns.append(clock.ns - before)
            step_ns.append((mid - start) + (end - mid))
        if step % 50 == 0:
            decisions.append(record_step(scheduler, output, tables=False).scheduled)
        step += 1
    return {
        "steps": step,
        "measured_steps": len(manager_ns),
        "manager_us": statistics.median(manager_ns) / 1e3 if manager_ns else float("nan"),
        "raw_manager_us": statistics.median(raw_ns) / 1e3 if raw_ns else float("nan"),
        "step_us": statistics.median(step_ns) / 1e3 if step_ns else float("nan"),
        "manager_total_s": (clock.ns - clock.calls * overhead_ns) / 1e9,
        "calls_per_step": clock.calls / step,
        "decisions": decisions,
    }


def per_call_ns(cls: type, setup: SchedulerSetup, stream: list[Any], calls: int) -> tuple[float, float]:
    """``allocate_slots`` and ``cache_blocks`` on one decoding request, in a tight loop, in ns per call:
    the two calls the scheduler makes for every running request every step (no timer inside)."""
    scheduler = build_scheduler(cls, setup)
    steps = run_steps(scheduler, stream, block_size=setup.block_size)
    request = None
    for _ in steps:
        request = next((r for r in scheduler.running if not r.is_prefill_chunk), None)
        if request is not None and request.num_output_tokens > 2:
            break
    assert request is not None, "no decoding request"
    manager = scheduler.kv_cache_manager
    perf = time.perf_counter_ns
    start = perf()
    for _ in range(calls):
        manager.allocate_slots(request, 1, num_lookahead_tokens=0)
    allocate = (perf() - start) / calls
    start = perf()
    for _ in range(calls):
        manager.cache_blocks(request, request.num_computed_tokens)
    cache = (perf() - start) / calls
    steps.close()
    return allocate, cache


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=1500)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--running", type=int, default=256, help="max_num_seqs (requests running at once)")
    parser.add_argument("--num-blocks", type=int, default=40000)
    parser.add_argument("--smoke", action="store_true", help="one tiny run of each; nothing is measured")
    parser.add_argument(
        "--hybrid",
        choices=("gdn-align", "gdn-none"),
        default=None,
        help="a GDN hybrid (Qwen3.5 layer pattern) in mamba_cache_mode align (prefix caching) or none",
    )
    args = parser.parse_args(argv)
    if args.smoke:
        args.num_requests, args.runs, args.running, args.num_blocks = 40, 1, 16, 2000
    with tempfile.TemporaryDirectory() as folder:
        from flat_kvcache.vllm.harness import tiny_model_dir

        setup = SchedulerSetup(
            model_dir=tiny_model_dir(Path(folder)),
            num_blocks=args.num_blocks,
            max_num_seqs=args.running,
            max_num_batched_tokens=8192,
            max_model_len=8192,
            log_stats=True,
            layer_types=HYBRID_LAYERS if args.hybrid else (),
            enable_prefix_caching=args.hybrid != "gdn-none",
        )
        # Arrivals fast enough to keep the running set full; decode-heavy outputs.
        stream = make_stream(
            args.num_requests,
            seed=5,
            arrivals_per_step=8.0,
            suffix_len=(50, 800),
            output_len=(100, 600),
            abort_fraction=0.0,
        )
        min_running = max(1, args.running * 3 // 4)
        results: dict[str, list[dict[str, Any]]] = {"vllm": [], "flat": []}
        overheads = []
        for _ in range(args.runs):
            overheads.append(timer_overhead_ns())
            for name, cls in (("vllm", AsyncScheduler), ("flat", FlatScheduler)):
                results[name].append(run_once(cls, setup, stream, min_running, overheads[-1]))
            if results["vllm"][-1]["decisions"] != results["flat"][-1]["decisions"]:
                print("vllm_scheduler: the two schedulers decided differently", file=sys.stderr)
                return 1
        calls = 2_000 if args.smoke else 200_000
        theirs = per_call_ns(AsyncScheduler, setup, stream, calls)
        ours = per_call_ns(FlatScheduler, setup, stream, calls)

    def summary(name: str, key: str) -> tuple[float, float, float]:
        values = [r[key] for r in results[name]]
        return statistics.median(values), min(values), max(values)

    first = results["vllm"][0]
    if args.hybrid:
        print(f"GDN hybrid, mamba_cache_mode {args.hybrid.split('-')[1]!r}: {' '.join(HYBRID_LAYERS)}")
    print(
        f"{args.num_requests} requests, {first['steps']} steps, max_num_seqs={args.running}, "
        f"{first['measured_steps']} steps with >= {min_running} scheduled; {args.runs} runs, alternating; "
        f"{first['calls_per_step']:.0f} KV-manager calls per step, timer cost "
        f"{statistics.median(overheads):.0f} ns per call subtracted"
    )
    for key, label in (
        ("manager_us", "KV-manager calls per step"),
        ("raw_manager_us", "  same, timer cost not subtracted"),
        ("step_us", "schedule + update_from_output per step"),
    ):
        v, f = summary("vllm", key), summary("flat", key)
        print(
            f"{label:<42} vLLM {v[0]:8.1f} us ({v[1]:.1f}-{v[2]:.1f})   flat {f[0]:8.1f} us "
            f"({f[1]:.1f}-{f[2]:.1f})   ratio {v[0] / f[0]:.2f}x"
        )
    v, f = summary("vllm", "manager_total_s"), summary("flat", "manager_total_s")
    print(f"{'KV-manager calls, whole run':<42} vLLM {v[0]:8.3f} s             flat {f[0]:8.3f} s")
    for i, name in enumerate(("allocate_slots", "cache_blocks")):
        print(
            f"{name + ', one decoding request, per call':<42} vLLM {theirs[i]:8.0f} ns"
            f"             flat {ours[i]:8.0f} ns             ratio {theirs[i] / ours[i]:.2f}x"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
