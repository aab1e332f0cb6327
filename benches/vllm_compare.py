"""Replay the ``flat-kvcache simulate`` trace through vLLM's ``KVCacheManager`` (optional; its
``--check-digest`` runs in the vLLM drop-in CI step).

The same trace (``flat_kvcache.simulate.default_trace`` or a JSONL file), the same pool size,
the same token budget and the same scheduler loop as ``flat-kvcache simulate``
(``flat_kvcache.simulate.loop``), with vLLM's block manager in place of ours, and the same
per-step figure: time spent in the block manager's calls per step (median, p99) and in all.
``flat-kvcache simulate`` runs in the same process on the same trace with the settings printed
as ``flat side`` (``flat_config``), and the ratio of the two cache times is printed only when
both loops made the same decisions at every step: each side folds what each step decided
(requests scheduled with their tokens, admitted with their hit and first chunk, finished,
preempted, aborted) into a digest (``flat_kvcache.simulate.decisions``). When the digests
differ the first differing step is printed instead and the exit status is 1.

The loop is simulate's, phase for phase, in the calls vLLM's manager has:

- running requests, in admission order, get their sizes cut from the token budget first (as
  simulate builds its one ``schedule`` call), then one ``allocate_slots`` call each (vLLM has no
  batch call); a request whose pages do not fit waits and its tokens go to admissions;
- when a page is cached (``--cache-at``): ``allocation`` (the default) runs vLLM's manager as
  vLLM's own scheduler does, caching a page's key when ``allocate_slots`` allocates it, so a
  request admitted in the same step hits the prefix its neighbours' chunks write in that step;
  simulate runs with ``register_on_schedule`` (``FlatKVCache(register_on_schedule=True)``:
  ``schedule`` registers the full pages of the chunk it takes, docs/requests-api.md), the same
  decision. ``computed`` caches a page once it is computed, as ``FlatKVCache`` registers it
  without that option (at the request's next ``schedule``, or its ``finish`` / ``preempt``):
  ``allocate_slots(delay_cache_blocks=True)`` and ``cache_blocks(request, computed)`` before each
  allocation and each ``free``;
- admission (``get_computed_blocks`` then ``allocate_slots``) keeps simulate's decode reserve
  free through ``reserved_blocks``: the pages promised to running requests whose next decode
  starts a page, plus the first decode's page when the chunk completes the prompt (what
  ``FlatKVCache.admit`` checks); simulate's budget pre-check (less than a page per group left
  stops admission) is made on the same figure;
- simulate runs with ``--eviction-order group`` (``flat_config``): vLLM frees a request's pages
  group by group, each tail first, and hands a page without a key out first (with simulate's
  default ``hybrid`` order, all groups' tails first, other pages stay cached: at 300 requests
  the first admission that differs is at step 243, and the hit rate is 17.76 % instead of 18.03 %);
- the block ids a step hands the model are read with ``get_block_ids()`` on what
  ``allocate_slots`` returned; a sampled token goes through ``Request.append_output_token_ids``,
  which hashes a page when it fills (the counterpart of our ``append_tokens``); creating a
  ``Request`` hashes its prompt's full pages, which is timed too (our ``admit`` hashes the prompt
  inside the timed call); retraction after two stuck steps as in simulate.

vLLM's block manager runs on the CPU, but vLLM pulls in a CUDA build of torch, so it lives in
its own virtual environment::

    python -m venv /tmp/vllm-venv && /tmp/vllm-venv/bin/pip install vllm
    PYTHONPATH=python /tmp/vllm-venv/bin/python benches/vllm_compare.py --num-requests 2000
    PYTHONPATH=python /tmp/vllm-venv/bin/python benches/vllm_compare.py --num-requests 300 --check-digest

``PYTHONPATH=python`` makes this checkout's ``flat_kvcache`` importable there (for the trace,
the pool size and the simulate run; the built extension must match that Python, and be a release
build for the times to mean anything). ``--decisions DIR`` writes both sides' per-step records
(``benches/decisions_diff.py`` compares two such files). Without vLLM the script says so and
exits with status 2. Checked with vLLM 0.33.0; only full-attention and sliding-window groups
are mapped (presets with state groups are refused).
"""

from __future__ import annotations

import argparse
import gc
import io
import json
import math
import os
import sys
import time
from collections import deque
from collections.abc import Sequence
from importlib import import_module
from pathlib import Path
from typing import Any, Literal

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from flat_kvcache.presets import PRESETS
from flat_kvcache.simulate import (
    DEFAULT_MAX_RUNNING,
    DEFAULT_MAX_SCHEDULED_TOKENS,
    DecisionLog,
    SimulationConfig,
    TraceRequest,
    default_num_pages,
    default_trace,
    engine_specs,
    first_difference,
    load_trace,
    simulate,
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
        self.rid = request.request_id
        self.generated = 0
        self.computed = 0
        self.known = len(request.prompt)
        self.admitted_at = -1


def _pages_for_token(specs: Sequence[Any], position: int) -> int:
    """Pages a request's token at ``position`` starts (one in every group whose page ends there):
    what ``FlatKVCache.pages_needed(1, slot)`` counts for a request holding ``position`` tokens."""
    return sum(1 for spec in specs if position % spec.page_size == 0)


def replay(
    trace: Sequence[TraceRequest],
    *,
    num_pages: int,
    specs: Sequence[Any],
    args: argparse.Namespace,
    decisions: DecisionLog,
) -> dict[str, Any]:
    """The loop of ``flat-kvcache simulate`` (``flat_kvcache.simulate.loop``) on vLLM's manager,
    phase by phase; every step's decisions go to ``decisions``."""
    v = _import_vllm()
    v["init_none_hash"](v["sha256"])
    hasher = v["get_request_block_hasher"](math.gcd(*(s.page_size for s in specs)), v["sha256"])
    longest = max(len(r.prompt) + r.output_len for r in trace)
    manager = _manager(v, specs, num_pages, longest + 16)
    pool = manager.block_pool
    # --cache-at computed: pages are cached once computed (delay_cache_blocks, cache_blocks).
    delay = args.cache_at == "computed"
    num_groups = len(specs)
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
    # simulate's decode reserve (FlatKVCache.reserve): the pages promised to a running request's
    # next decode, which admissions leave free (allocate_slots(reserved_blocks=)); a running
    # request's own allocation ignores them, as FlatKVCache.schedule does.
    reserves: dict[int, int] = {}
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
        decided: dict[str, list[Any]] = {
            "scheduled": [],
            "admitted": [],
            "finished": [],
            "preempted": [],
            "aborted": [],
        }
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
        # Running requests: every size is cut from the budget first, as simulate builds its one
        # schedule() call; a request whose pages do not fit gives its tokens back to admissions.
        tokens_left = args.max_scheduled_tokens
        asked: list[tuple[_Live, int]] = []
        for live in running:
            if tokens_left == 0:
                break
            n = min(live.known - live.computed, tokens_left)
            asked.append((live, n))
            tokens_left -= n
        scheduled: list[tuple[_Live, Any]] = []
        decodes = 0
        for live, n in asked:
            t0 = perf()
            if delay:
                # FlatKVCache.schedule registers the request's computed full pages first, whether
                # or not its new pages fit (delay_cache_blocks below keeps vLLM from caching
                # pages at allocation, before they are computed).
                manager.cache_blocks(live.req, live.computed)
            blocks = manager.allocate_slots(live.req, n, delay_cache_blocks=delay)
            elapsed = perf() - t0
            calls["allocate_slots"] += elapsed
            ns += elapsed
            if blocks is None:
                tokens_left += n
                continue
            reserves.pop(live.rid, None)  # schedule() releases the reserve it used
            live.computed += n
            live.req.num_computed_tokens = live.computed
            scheduled.append((live, blocks))
            decided["scheduled"].append((live.rid, n))
            decodes += live.generated > 0 and n == 1
        # Admission, FCFS: simulate's admit() checks the first chunk plus, when it completes the
        # prompt, one token of reserve for the first decode, against free pages less every
        # reserve; allocate_slots checks the chunk against free pages less reserved_blocks.
        while waiting and tokens_left > 0 and len(running) < args.max_running:
            live = waiting[0]
            t0 = perf()
            held = sum(reserves.values())
            if pool.get_num_free_blocks() - held < num_groups:
                # simulate's budget pre-check: no first chunk fits in less than a page per group.
                elapsed = perf() - t0
                calls["admit"] += elapsed
                ns += elapsed
                break
            cached, hit = manager.get_computed_blocks(live.req)[:2]
            chunk = min(live.known - hit, tokens_left)
            first_decode = _pages_for_token(specs, hit + chunk) if hit + chunk == live.known else 0
            blocks = manager.allocate_slots(
                live.req,
                chunk,
                num_new_computed_tokens=hit,
                new_computed_blocks=cached,
                reserved_blocks=held + first_decode,
                delay_cache_blocks=delay,
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
            running.append(live)
            scheduled.append((live, blocks))
            decided["admitted"].append((live.rid, hit, chunk))
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
                if delay:
                    manager.cache_blocks(live.req, live.computed)  # finish() registers, then frees
                manager.free(live.req)
            elapsed = perf() - t0
            calls["free"] += elapsed
            ns += elapsed
            finished += len(done)
            gone = {id(live) for live in done}
            running = [live for live in running if id(live) not in gone]
            for live in done:
                reserves.pop(live.rid, None)
            decided["finished"] += [live.rid for live in done]
        # simulate's reserve(): a request whose next decode starts a page is promised it.
        for live, _ in scheduled:
            if (
                live.known - live.computed == 1
                and live.generated < live.trace.output_len
                and _pages_for_token(specs, live.computed)
            ):
                reserves[live.rid] = _pages_for_token(specs, live.computed)
        stuck = 0 if scheduled else stuck + 1
        if stuck >= 2:
            if running:
                victim = max(running, key=lambda live: (live.known, live.admitted_at))
                running.remove(victim)
                reserves.pop(victim.rid, None)
                t0 = perf()
                if delay:
                    manager.cache_blocks(victim.req, victim.computed)  # as preempt() registers
                manager.free(victim.req)
                elapsed = perf() - t0
                calls["preempt"] += elapsed
                ns += elapsed
                if running:
                    preemptions += 1
                    victim.req.num_computed_tokens = 0
                    victim.computed = 0
                    waiting.appendleft(victim)
                    decided["preempted"].append(victim.rid)
                else:
                    aborted += 1
                    decided["aborted"].append(victim.rid)
            elif waiting:
                decided["aborted"].append(waiting.popleft().rid)
                aborted += 1
        decisions.record(step, **decided)
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
        "decisions": decisions.summary(),
        "timing": {
            "cache_total_ms": round(sum(step_ns) / 1e6, 3),
            "per_step": pct(step_ns),
            "per_decode_step": {**pct(decode_ns), "steps": len(decode_ns)},
            "by_call_ms": {kind: round(value / 1e6, 3) for kind, value in calls.items()},
            "wall_s": round(wall_ns / 1e9, 3),
        },
    }


def flat_config(args: argparse.Namespace, num_pages: int) -> SimulationConfig:
    """The ``flat-kvcache simulate`` settings that replay what ``replay`` replays: the same model,
    pool, page size and budgets, and vLLM's free order (a finished request's pages group by
    group, each tail first; a page that holds no key reused first)."""
    return SimulationConfig(
        model=args.preset if args.config is None else Path(args.config),
        num_pages=num_pages,
        page_size=args.page_size,
        max_scheduled_tokens=args.max_scheduled_tokens,
        max_running=args.max_running,
        eviction_order=EVICTION_ORDER,
        reuse_uncached_first=REUSE_UNCACHED_FIRST,
        register_on_schedule=args.cache_at == "allocation",
        storage="equalized",
    )


#: vLLM's free order in ``flat-kvcache simulate``'s terms (``flat_config``).
EVICTION_ORDER: Literal["hybrid", "group"] = "group"
REUSE_UNCACHED_FIRST = True


def simulate_command(args: argparse.Namespace, num_pages: int) -> str:
    """The ``flat-kvcache simulate`` command line of ``flat_config`` (built-in trace)."""
    model = f"--preset {args.preset}" if args.config is None else f"--config {args.config}"
    trace = f"--trace {args.trace}" if args.trace else f"--num-requests {args.num_requests}"
    return (
        f"flat-kvcache simulate {model} {trace} --seed {args.seed} --num-pages {num_pages} "
        f"--page-size {args.page_size} --max-scheduled-tokens {args.max_scheduled_tokens} "
        f"--max-running {args.max_running} --eviction-order {EVICTION_ORDER} "
        + ("--reuse-uncached-first" if REUSE_UNCACHED_FIRST else "--no-reuse-uncached-first")
        + (" --register-on-schedule" if args.cache_at == "allocation" else "")
    )


def run_flat(
    trace: Sequence[TraceRequest], config: SimulationConfig, runs: int
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """``runs`` runs of ``flat-kvcache simulate``: the summary of the run with the median cache
    time, and the first run's decision records (every run decides alike: the digests are checked)."""
    summaries = []
    records: list[dict[str, Any]] = []
    for k in range(runs):
        sink = io.StringIO()
        gc.collect()  # another run's garbage is not this run's time
        summaries.append(simulate(trace, config, decisions=sink).summary)
        if k == 0:
            records = [json.loads(line) for line in sink.getvalue().splitlines()]
    if len({json.dumps(s["decisions"]) for s in summaries}) != 1:
        raise SystemExit("vllm_compare: two runs of flat-kvcache simulate decided differently")
    summaries.sort(key=lambda s: s["timing"]["cache_total_ms"])
    return summaries[len(summaries) // 2], records


def _line(record: dict[str, Any]) -> str:
    return json.dumps(record, sort_keys=True, separators=(",", ":"))


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
    parser.add_argument(
        "--cache-at",
        choices=("allocation", "computed"),
        default="allocation",
        help="when a page is cached: when allocated (vLLM's scheduler; simulate with "
        "--register-on-schedule, default) or once computed (delay_cache_blocks + cache_blocks; "
        "simulate without it)",
    )
    parser.add_argument(
        "--flat-runs",
        type=int,
        default=3,
        metavar="N",
        help="runs of flat-kvcache simulate; the one with the median cache time is compared (3)",
    )
    parser.add_argument(
        "--check-digest",
        action="store_true",
        help="only check that both loops decide alike (one flat-kvcache run, no timings): exit "
        "status 1 and the first differing step when they do not",
    )
    parser.add_argument(
        "--decisions",
        metavar="DIR",
        help="write each side's per-step decisions to DIR/vllm.jsonl and DIR/flat.jsonl "
        "(benches/decisions_diff.py compares them)",
    )
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args(argv)
    if args.preset not in PRESETS:
        parser.error(f"--preset {args.preset}: not a built-in preset (a config.json goes with --config)")
    if args.flat_runs < 1:
        parser.error("--flat-runs must be >= 1")
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
    runs = 1 if args.check_digest else args.flat_runs
    flat, flat_records = run_flat(trace, flat_config(args, num_pages), runs)
    vllm_log = DecisionLog(keep=True)
    gc.collect()
    result = replay(trace, num_pages=num_pages, specs=specs, args=args, decisions=vllm_log)
    if args.decisions:
        folder = Path(args.decisions)
        folder.mkdir(parents=True, exist_ok=True)
        for name, records in (("vllm", vllm_log.records or []), ("flat", flat_records)):
            with open(folder / f"{name}.jsonl", "w", encoding="utf-8") as handle:
                handle.writelines(
                    json.dumps(r, sort_keys=True, separators=(",", ":")) + "\n" for r in records
                )
    difference = first_difference(vllm_log.records or [], flat_records)
    match = result["decisions"] == flat["decisions"]
    if match != (difference is None):
        raise SystemExit("vllm_compare: the digests and the records disagree")
    compared = {
        "command": "benches/vllm_compare.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "flat_command": simulate_command(args, num_pages),
        "decisions_match": match,
        "first_difference": None if difference is None else difference.describe("vllm", "flat"),
        "vllm": result,
        "flat": {
            key: flat[key]
            for key in ("engine", "requests", "num_pages", "steps", "finished", "aborted", "preemptions")
        }
        | {
            "prefix_hit_rate": flat["prefix_hit_rate"],
            "decisions": flat["decisions"],
            "timing": flat["timing"],
        },
        # vLLM's cache time over flat-kvcache's, only for runs that did the same work.
        "ratio": None
        if not match or args.check_digest
        else {
            "cache_total": round(result["timing"]["cache_total_ms"] / flat["timing"]["cache_total_ms"], 2),
            "per_step_median": round(
                result["timing"]["per_step"]["median_us"] / flat["timing"]["per_step"]["median_us"], 2
            ),
        },
    }
    if args.json:
        print(json.dumps(compared, indent=2))
    else:
        print(_report(compared, timings=not args.check_digest))
    return 0 if match else 1


def _report(compared: dict[str, Any], *, timings: bool) -> str:
    """The comparison as text: each side's run and digest, then the ratio or the first difference."""
    lines = [f"$ {compared['command']}", f"  flat side: {compared['flat_command']}"]
    for side in ("vllm", "flat"):
        r = compared[side]
        lines.append(
            f"{r['engine']}: {r['requests']} requests, {r['num_pages']} pages, {r['steps']} steps, "
            f"{r['finished']} finished, {r['aborted']} aborted, {r['preemptions']} preemptions, "
            f"prefix hit rate {r['prefix_hit_rate']:.2%}, decisions {r['decisions']['digest']}"
        )
        if timings:
            timing = r["timing"]
            lines.append(
                f"  cache time per step: median {timing['per_step']['median_us']:.1f} us, "
                f"p99 {timing['per_step']['p99_us']:.1f} us; decode-only steps: median "
                f"{timing['per_decode_step']['median_us']:.1f} us ({timing['per_decode_step']['steps']} "
                f"steps); total {timing['cache_total_ms']:.1f} ms; by call (ms): {timing['by_call_ms']}"
            )
    if not compared["decisions_match"]:
        lines.append("the two loops decided differently, so their times are not compared; first difference:")
        lines.append(compared["first_difference"])
    elif compared["ratio"] is not None:
        ratio = compared["ratio"]
        lines.append(
            f"same decisions at every step; vLLM / flat-kvcache cache time: total {ratio['cache_total']}x, "
            f"per-step median {ratio['per_step_median']}x"
        )
    else:
        lines.append("same decisions at every step")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
