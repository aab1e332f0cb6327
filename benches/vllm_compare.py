"""Replay the ``flat-kvcache simulate`` trace through vLLM's ``KVCacheManager`` (optional, not in CI).

The same trace (``flat_kvcache.simulate.default_trace`` or a JSONL file), the same pool size,
the same token budget and the same scheduler loop as ``flat-kvcache simulate`` (FCFS, chunked
prefill, decode, wait on a failed allocation, retract after two stuck steps), with vLLM's block
manager in place of ours, and the same per-step figure: time spent in the block manager's
calls per step (median, p99) and in all. vLLM's manager has no batch call, so running requests
are allocated one ``allocate_slots`` call each, as vLLM's own scheduler does; the block ids a
step hands the model are read with ``get_block_ids()`` on what ``allocate_slots`` returned; a
sampled token goes through ``Request.append_output_token_ids``, which hashes a page when it
fills (the counterpart of our ``append_tokens``); creating a ``Request`` hashes its prompt's
full pages, which is timed too (our ``add_request`` and admission probes hash the prompt inside
the timed calls). vLLM's scheduler has no decode reserve, so admission is just
``get_computed_blocks`` then ``allocate_slots``.

vLLM's block manager runs on the CPU, but vLLM pulls in a CUDA build of torch, so it lives in
its own virtual environment::

    python -m venv /tmp/vllm-venv && /tmp/vllm-venv/bin/pip install vllm
    PYTHONPATH=python /tmp/vllm-venv/bin/python benches/vllm_compare.py --num-requests 2000

``PYTHONPATH=python`` makes this checkout's ``flat_kvcache`` importable there (for the trace
and the pool size; the built extension must match that Python). Without vLLM the script says so
and exits with status 2. Checked with vLLM 0.33.0; only full-attention and sliding-window
groups are mapped (presets with state groups are refused).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections import deque
from collections.abc import Sequence
from importlib import import_module
from pathlib import Path
from typing import Any

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from flat_kvcache.presets import PRESETS
from flat_kvcache.simulate import (
    DEFAULT_MAX_RUNNING,
    DEFAULT_MAX_SCHEDULED_TOKENS,
    TraceRequest,
    default_num_pages,
    default_trace,
    engine_specs,
    load_trace,
)


def _import_vllm() -> dict[str, Any]:
    """vLLM's pieces by name (imported by name, so that type checkers need no vLLM)."""
    names = {
        "SamplingParams": "vllm",
        "sha256": "vllm.utils.hashing",
        "KVCacheManager": "vllm.v1.core.kv_cache_manager",
        "get_request_block_hasher": "vllm.v1.core.kv_cache_utils",
        "init_none_hash": "vllm.v1.core.kv_cache_utils",
        "FullAttentionSpec": "vllm.v1.kv_cache_interface",
        "SlidingWindowSpec": "vllm.v1.kv_cache_interface",
        "KVCacheConfig": "vllm.v1.kv_cache_interface",
        "KVCacheGroupSpec": "vllm.v1.kv_cache_interface",
        "Request": "vllm.v1.request",
    }
    try:
        found = {name: getattr(import_module(module), name) for name, module in names.items()}
        found["torch"] = import_module("torch")
        found["version"] = import_module("vllm").__version__
    except (ImportError, AttributeError) as exc:
        print(
            f"vllm_compare: vLLM is not importable here ({exc}). Install it in a separate virtual "
            "environment:\n"
            "    python -m venv /tmp/vllm-venv && /tmp/vllm-venv/bin/pip install vllm\n"
            "    PYTHONPATH=python /tmp/vllm-venv/bin/python benches/vllm_compare.py",
            file=sys.stderr,
        )
        raise SystemExit(2) from None
    return found


def _manager(v: dict[str, Any], specs: Sequence[Any], num_pages: int, max_model_len: int) -> Any:
    """A vLLM KVCacheManager with one KV-cache group per engine spec (same page sizes, windows)."""
    torch = v["torch"]
    groups = []
    for spec in specs:
        shape = {"num_kv_heads": 8, "head_size": 64, "dtype": torch.bfloat16}
        if spec.kind == "full":
            kv_spec = v["FullAttentionSpec"](block_size=spec.page_size, **shape)
        elif spec.kind == "sliding_window":
            kv_spec = v["SlidingWindowSpec"](
                block_size=spec.page_size, sliding_window=spec.sliding_window, **shape
            )
        else:
            raise SystemExit(
                f"vllm_compare: a {spec.kind} group is not mapped onto vLLM; pick another preset"
            )
        groups.append(v["KVCacheGroupSpec"](layer_names=[spec.group_id], kv_cache_spec=kv_spec))
    config = v["KVCacheConfig"](num_blocks=num_pages, kv_cache_tensors=[], kv_cache_groups=groups)
    page = math.gcd(*(spec.page_size for spec in specs))
    return v["KVCacheManager"](
        config,
        max_model_len=max_model_len,
        scheduler_block_size=page,
        hash_block_size=page,
        enable_caching=True,
    )


class _Live:
    def __init__(self, request: TraceRequest, vllm_request: Any) -> None:
        self.trace = request
        self.req = vllm_request
        self.generated = 0
        self.computed = 0
        self.known = len(request.prompt)
        self.admitted_at = -1


def replay(
    trace: Sequence[TraceRequest], *, num_pages: int, specs: Sequence[Any], args: argparse.Namespace
) -> dict[str, Any]:
    v = _import_vllm()
    v["init_none_hash"](v["sha256"])
    hasher = v["get_request_block_hasher"](math.gcd(*(s.page_size for s in specs)), v["sha256"])
    longest = max(len(r.prompt) + r.output_len for r in trace)
    manager = _manager(v, specs, num_pages, longest + 16)
    perf = time.perf_counter_ns

    def new_request(request: TraceRequest, prompt: list[int]) -> Any:
        return v["Request"](
            request_id=str(request.request_id),
            prompt_token_ids=prompt,
            sampling_params=v["SamplingParams"](max_tokens=request.output_len),
            pooling_params=None,
            block_hasher=hasher,
        )

    pending = deque(trace)
    waiting: deque[_Live] = deque()
    running: list[_Live] = []
    step = stuck = admissions = 0
    finished = aborted = preemptions = 0
    hit_tokens = query_tokens = 0
    step_ns: list[int] = []
    decode_ns: list[int] = []
    calls = dict.fromkeys(
        (
            "request_hashing",
            "new_step_starts",
            "allocate_slots",
            "admit",
            "block_ids",
            "append",
            "free",
            "preempt",
        ),
        0,
    )
    wall = perf()
    while pending or waiting or running:
        if not waiting and not running and pending[0].arrival_step > step:
            step = pending[0].arrival_step
        ns = 0
        while pending and pending[0].arrival_step <= step:
            request = pending.popleft()
            prompt = [int(token) for token in request.prompt]
            t0 = perf()
            vllm_request = new_request(request, prompt)  # hashes the prompt's full pages
            elapsed = perf() - t0
            calls["request_hashing"] += elapsed
            ns += elapsed
            waiting.append(_Live(request, vllm_request))
        t0 = perf()
        manager.new_step_starts()
        elapsed = perf() - t0
        calls["new_step_starts"] += elapsed
        ns += elapsed
        tokens_left = args.max_scheduled_tokens
        scheduled: list[tuple[_Live, Any]] = []
        decodes = 0
        for live in running:
            if tokens_left == 0:
                break
            n = min(live.known - live.computed, tokens_left)
            t0 = perf()
            blocks = manager.allocate_slots(live.req, n)
            elapsed = perf() - t0
            calls["allocate_slots"] += elapsed
            ns += elapsed
            if blocks is None:
                continue
            tokens_left -= n
            live.computed += n
            live.req.num_computed_tokens = live.computed
            scheduled.append((live, blocks))
            decodes += live.generated > 0 and n == 1
        admitted = 0
        while waiting and tokens_left > 0 and len(running) < args.max_running:
            live = waiting[0]
            t0 = perf()
            cached, hit = manager.get_computed_blocks(live.req)[:2]
            chunk = min(live.known - hit, tokens_left)
            blocks = manager.allocate_slots(
                live.req, chunk, num_new_computed_tokens=hit, new_computed_blocks=cached
            )
            elapsed = perf() - t0
            calls["admit"] += elapsed
            ns += elapsed
            if blocks is None:
                break
            waiting.popleft()
            hit_tokens += hit
            query_tokens += live.known
            live.computed = hit + chunk
            live.req.num_computed_tokens = live.computed
            live.admitted_at = admissions
            admissions += 1
            admitted += 1
            running.append(live)
            scheduled.append((live, blocks))
            tokens_left -= chunk
        t0 = perf()
        for _, blocks in scheduled:
            blocks.get_block_ids()
        elapsed = perf() - t0
        calls["block_ids"] += elapsed
        ns += elapsed
        done: list[_Live] = []
        t0 = perf()
        for live, _ in scheduled:
            if live.computed == live.known:
                live.generated += 1
                if live.generated == live.trace.output_len:
                    done.append(live)
                else:
                    live.req.append_output_token_ids(int(live.trace.output[live.generated - 1]))
                    live.known += 1
        elapsed = perf() - t0
        calls["append"] += elapsed
        ns += elapsed
        if done:
            t0 = perf()
            for live in done:
                manager.free(live.req)
            elapsed = perf() - t0
            calls["free"] += elapsed
            ns += elapsed
            finished += len(done)
            gone = {id(live) for live in done}
            running = [live for live in running if id(live) not in gone]
        stuck = 0 if scheduled else stuck + 1
        if stuck >= 2:
            if running:
                victim = max(running, key=lambda live: (live.known, live.admitted_at))
                running.remove(victim)
                t0 = perf()
                manager.free(victim.req)
                elapsed = perf() - t0
                calls["preempt"] += elapsed
                ns += elapsed
                if running:
                    preemptions += 1
                    victim.req.num_computed_tokens = 0
                    victim.computed = 0
                    waiting.appendleft(victim)
                else:
                    aborted += 1
            elif waiting:
                waiting.popleft()
                aborted += 1
        step_ns.append(ns)
        if scheduled and decodes == len(scheduled):
            decode_ns.append(ns)
        step += 1
    wall_ns = perf() - wall

    def pct(values: Sequence[int]) -> dict[str, float]:
        if not values:
            return {"median_us": 0.0, "p99_us": 0.0}
        ordered = sorted(values)
        return {
            "median_us": round(ordered[len(ordered) // 2] / 1000, 3),
            "p99_us": round(ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)] / 1000, 3),
        }

    return {
        "engine": f"vllm {v['version']} KVCacheManager",
        "requests": len(trace),
        "num_pages": num_pages,
        "steps": len(step_ns),
        "finished": finished,
        "aborted": aborted,
        "preemptions": preemptions,
        "prefix_hit_rate": round(hit_tokens / query_tokens, 6) if query_tokens else 0.0,
        "timing": {
            "cache_total_ms": round(sum(step_ns) / 1e6, 3),
            "per_step": pct(step_ns),
            "per_decode_step": {**pct(decode_ns), "steps": len(decode_ns)},
            "by_call_ms": {kind: round(value / 1e6, 3) for kind, value in calls.items()},
            "wall_s": round(wall_ns / 1e9, 3),
        },
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--num-requests", type=int, default=2000)
    parser.add_argument("--trace", help="a JSONL trace (default: the built-in one)")
    parser.add_argument("--seed", type=int, default=0)
    model = parser.add_mutually_exclusive_group()
    model.add_argument("--preset", default="gpt-oss-like", metavar="NAME", help="a built-in model preset")
    model.add_argument("--config", metavar="PATH", help="a config.json (or its folder) instead of a preset")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--num-pages", type=int, help="default: as flat-kvcache simulate")
    parser.add_argument("--max-scheduled-tokens", type=int, default=DEFAULT_MAX_SCHEDULED_TOKENS)
    parser.add_argument("--max-running", type=int, default=DEFAULT_MAX_RUNNING)
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args(argv)
    if args.preset not in PRESETS:
        parser.error(f"--preset {args.preset}: not a built-in preset (a config.json goes with --config)")
    _import_vllm()  # fail early with the install hint
    import flat_kvcache

    specs = engine_specs(
        flat_kvcache, args.preset if args.config is None else Path(args.config), args.page_size
    )
    trace = (
        load_trace(args.trace, seed=args.seed)
        if args.trace
        else default_trace(args.num_requests, seed=args.seed)
    )
    num_pages = args.num_pages or default_num_pages(trace, specs, args.max_running)
    result = replay(trace, num_pages=num_pages, specs=specs, args=args)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        timing = result["timing"]
        print(
            f"{result['engine']}: {result['requests']} requests, {result['num_pages']} pages, "
            f"{result['steps']} steps, {result['finished']} finished, {result['preemptions']} preemptions, "
            f"prefix hit rate {result['prefix_hit_rate']:.2%}\n"
            f"cache time per step: median {timing['per_step']['median_us']:.1f} us, "
            f"p99 {timing['per_step']['p99_us']:.1f} us; decode-only steps: median "
            f"{timing['per_decode_step']['median_us']:.1f} us ({timing['per_decode_step']['steps']} steps); "
            f"total {timing['cache_total_ms']:.1f} ms; by call (ms): {timing['by_call_ms']}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
