"""Cluster prefix hits: N workers behind a KV-aware router vs round-robin (docs/routing.md).

1. Models: the ``qwen3.5-like`` preset (full + linear-attention layers, SPEC 13 arena, 16-token
   attention pages, state checkpoints every ``--grain`` tokens) and its attention layers alone.
2. Memory: the total is B25 of ``benches/hybrid_hits.py`` (the bytes holding 25 % of the trace's
   unique 512-token blocks in the attention-only model's K/V), split evenly: each of the N
   workers gets ``plan_arena`` over B25 / N bytes.
3. Replay: the first ``--max-requests`` requests of the Mooncake trace through
   ``flat_kvcache.simulate.cluster.simulate_cluster`` for N in ``--workers``, routers ``kv``
   (Dynamo's radix indexer fed by every worker's KV events; best hit first, load on ties), ``kv``
   with Dynamo's own cost (``--overlap-weights``: weight x prefill blocks + active blocks) and
   ``round-robin``.

Reported per run: cluster token hit rate (prefix hit tokens / prompt tokens), the share of
admissions whose predicted hit equals the served one (predicted from the index just before the
worker's ``admit``, and predicted when the request was routed), and the routing time per request.

    python benches/cluster_hits.py                       # 3000 requests, N = 4 and 8, a table
    python benches/cluster_hits.py --json --plot hits.png
    python benches/cluster_hits.py --smoke               # 100 requests, N = 2: does it run (CI)

Needs the ``dynamo`` extra (``ai-dynamo-runtime``) and ``torch`` (``ModelShape``); runs on the CPU.
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # spinning BLAS threads steal a core (benches/README.md)

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from flat_kvcache import plan_arena
from flat_kvcache.presets import get_preset
from flat_kvcache.simulate import DEFAULT_MS_PER_STEP, MOONCAKE_BLOCK_TOKENS, SimulationConfig, load_trace
from flat_kvcache.simulate.cluster import simulate_cluster
from flat_kvcache.torch import ModelShape
from hybrid_hits import PRESET, TRACE_NAME, _attention_only, _unique_blocks, resolve_trace

ROUTERS = ("round-robin", "kv")


def _run(
    label: str,
    cfg: dict[str, Any],
    budget: int,
    workers: int,
    router: str,
    weight: float | None,
    trace: list[Any],
    args: argparse.Namespace,
) -> dict[str, Any]:
    arena = plan_arena(ModelShape.from_config(cfg).components(), 16, budget // workers)
    config = SimulationConfig(model=cfg, arena=arena, state_page_size=args.grain)
    start = time.perf_counter()
    summary = simulate_cluster(trace, config, workers=workers, router=router, overlap_weight=weight).summary
    return {
        "model": label,
        "workers": workers,
        "router": router if weight is None else f"kv w={weight:g}",
        "overlap_weight": weight,
        "units_per_worker": arena.num_units,
        "hit_rate": summary["hit_rate"],
        "routed_hits_tokens": summary["routed_hits_tokens"],
        "all_admissions_hit_rate": summary["all_admissions_hit_rate"],
        "preemptions": summary["preemptions"],
        "aborted": summary["aborted"],
        "admissions": summary["admissions"],
        "exact_at_admit": summary["exact_at_admit"],
        "exact_at_routing": summary["exact_at_routing"],
        "route_us": summary["route_us"],
        "requests_per_worker": summary["requests_per_worker"],
        "seconds": round(time.perf_counter() - start, 1),
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    trace = load_trace(args.trace, max_requests=args.max_requests, ms_per_step=args.ms_per_step)
    blocks = _unique_blocks(args.trace, len(trace))
    hybrid = get_preset(PRESET)
    attention = _attention_only(hybrid)
    kv_bytes_per_token = sum(c.bytes_per_slot for c in ModelShape.from_config(attention).components())
    budget = math.ceil(args.fraction * blocks * MOONCAKE_BLOCK_TOKENS) * kv_bytes_per_token
    models = {"hybrid": (f"{PRESET} (hybrid)", hybrid), "attention": (f"{PRESET} attention only", attention)}
    chosen = list(models) if args.model == "both" else [args.model]
    runs = []
    for key in chosen:
        label, cfg = models[key]
        for workers in args.workers:
            routers = [(router, None) for router in ROUTERS] + [("kv", w) for w in args.overlap_weights]
            for router, weight in routers:
                run = _run(label, cfg, budget, workers, router, weight, trace, args)
                runs.append(run)
                print(
                    f"  {label} N={workers} {run['router']}: {100 * run['hit_rate']:.2f} % "
                    f"({run['seconds']} s)",
                    file=sys.stderr,
                )
    return {
        "trace": str(args.trace),
        "requests": len(trace),
        "prompt_tokens": sum(len(r.prompt) for r in trace),
        "unique_blocks": blocks,
        "fraction": args.fraction,
        "budget_bytes": budget,
        "grain": args.grain,
        "runs": runs,
    }


def format_table(result: dict[str, Any]) -> str:
    lines = [
        f"trace {result['trace']}: {result['requests']} requests, {result['unique_blocks']} unique blocks; "
        f"total memory B{round(100 * result['fraction'])} = {result['budget_bytes'] / 2**30:.1f} GiB, "
        "split evenly over the workers",
        f"{'model':<30} {'N':>2} {'router':<12} {'units/w':>7} {'hit rate':>9} {'kv/rr':>6} "
        f"{'exact@admit':>11} {'exact@route':>11} {'route us mean/p99':>18} {'preempt':>7} {'time':>7}",
    ]
    rr = {(r["model"], r["workers"]): r["hit_rate"] for r in result["runs"] if r["router"] == "round-robin"}
    for run in result["runs"]:
        base = rr.get((run["model"], run["workers"]))
        ratio = f"{run['hit_rate'] / base:.2f}" if run["router"] != "round-robin" and base else ""
        exact = "" if run["exact_at_admit"] is None else f"{100 * run['exact_at_admit']:.2f}%"
        routed = "" if run["exact_at_routing"] is None else f"{100 * run['exact_at_routing']:.2f}%"
        timing = f"{run['route_us']['mean_us']:.0f}/{run['route_us']['p99_us']:.0f}"
        lines.append(
            f"{run['model']:<30} {run['workers']:>2} {run['router']:<12} {run['units_per_worker']:>7} "
            f"{100 * run['hit_rate']:>8.2f}% {ratio:>6} {exact:>11} {routed:>11} {timing:>18} "
            f"{run['preemptions']:>7} {run['seconds']:>6.1f}s"
        )
    return "\n".join(lines)


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    groups = sorted({(r["model"], r["workers"]) for r in runs})
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(groups)), 4))
    names = list(dict.fromkeys(r["router"] for r in runs))
    width = 0.8 / len(names)
    for i, router in enumerate(names):
        offset = (i - (len(names) - 1) / 2) * width
        values = [
            100
            * next(
                (r["hit_rate"] for r in runs if (r["model"], r["workers"]) == g and r["router"] == router),
                0.0,
            )
            for g in groups
        ]
        ax.bar([i + offset for i in range(len(groups))], values, width, label=router)
    ax.set_xticks(range(len(groups)), [f"{m.replace(PRESET, '').strip()}\nN={n}" for m, n in groups])
    ax.set_ylabel("cluster token hit rate (%)")
    ax.set_title(
        f"{PRESET}, {result['requests']} Mooncake requests, B{round(100 * result['fraction'])} split over N"
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--trace", type=Path, default=None, help=f"Mooncake trace (default: shared/traces/{TRACE_NAME})"
    )
    parser.add_argument("--max-requests", type=int, default=3000, help="replay the first N requests (3000)")
    parser.add_argument("--ms-per-step", type=float, default=DEFAULT_MS_PER_STEP, help="trace ms per step")
    parser.add_argument("--workers", type=int, nargs="+", default=[4, 8], help="worker counts (4 8)")
    parser.add_argument(
        "--fraction", type=float, default=0.25, help="total memory: this share of the unique blocks (0.25)"
    )
    parser.add_argument("--grain", type=int, default=64, help="state checkpoint grain G in tokens (64)")
    parser.add_argument(
        "--model", choices=("both", "hybrid", "attention"), default="both", help="which model(s)"
    )
    parser.add_argument(
        "--overlap-weights",
        type=float,
        nargs="*",
        default=[1.0],
        metavar="W",
        help="also run the kv router with Dynamo's cost at each weight W (default: 1.0, Dynamo's "
        "default; none to skip)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--plot", metavar="FILE", help="bar chart of the hit rates (matplotlib)")
    parser.add_argument("--smoke", action="store_true", help="100 requests, N = 2: does it run (CI)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.max_requests = min(args.max_requests, 100)
        args.workers = [2]
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        resolve_trace(args, parser, Path(folder))
        result = measure(args)
    result["total_seconds"] = round(time.perf_counter() - start, 1)
    if args.plot:
        plot(result, args.plot)
    if args.json:
        json.dump(result, sys.stdout, indent=2)
        print()
    else:
        print(format_table(result))
        print(f"total {result['total_seconds']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
