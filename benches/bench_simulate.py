"""The ``flat-kvcache simulate`` loop as a benchmark (targets and results: benches/README.md).

Two measurements:

``speed`` (default)
    The built-in trace through the scheduler loop on the native engine and on the pure-Python
    reference: time spent in cache calls in all and per step (median and p99, all steps and
    decode-only steps). The reference is slow (minutes for the whole trace on 2 cores), so by
    default it runs the first ``--reference-requests`` requests, and the native engine runs
    both that trace (for the like-for-like ratio) and the whole one.
``eviction``
    The effect of the hybrid eviction order (SPEC 12.3): a trace of requests that come back to
    one of many shared prefixes over time, on pools from roomy to tight, run with
    ``eviction_order="hybrid"`` and ``"group"`` (the reference design's order). Reports the
    prefix hit rate and preemptions of each.

Build the extension in release mode first (``maturin develop --release``), then::

    python benches/bench_simulate.py                          # speed: native 2000, reference 200
    python benches/bench_simulate.py --reference-requests 2000  # the whole trace on both (slow)
    python benches/bench_simulate.py eviction                 # hybrid vs group hit rates
    python benches/bench_simulate.py --json ...               # machine-readable
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # spinning BLAS threads steal a core (benches/README.md)

import argparse
import json
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from flat_kvcache.simulate import SimulationConfig, default_trace, load_trace, simulate


def _timing_row(label: str, summary: dict[str, Any]) -> str:
    timing = summary["timing"]
    step, decode = timing["per_step"], timing["per_decode_step"]
    return (
        f"{label:<34} {summary['requests']:>5} req {summary['steps']:>6} steps  "
        f"total {timing['cache_total_ms']:>10.1f} ms  per step median {step['median_us']:>8.1f} us "
        f"p99 {step['p99_us']:>9.1f} us  decode-only median {decode['median_us']:>8.1f} us "
        f"p99 {decode['p99_us']:>9.1f} us ({decode['steps']} steps)"
    )


def speed(args: argparse.Namespace) -> dict[str, Any]:
    full = default_trace(args.num_requests, seed=args.seed)
    subset = full[: args.reference_requests]
    config = {"preset": args.preset, "num_pages": args.num_pages}
    runs: dict[str, Any] = {}
    # Warm the native path once (imports, first allocations) on a tiny trace.
    simulate(default_trace(4, seed=args.seed), SimulationConfig(**config))
    runs["reference"] = simulate(subset, SimulationConfig(engine="reference", **config)).summary
    runs["native_same_trace"] = simulate(subset, SimulationConfig(engine="native", **config)).summary
    if len(full) != len(subset):
        runs["native_full_trace"] = simulate(full, SimulationConfig(engine="native", **config)).summary
    ref, nat = runs["reference"], runs["native_same_trace"]
    same = {k: v for k, v in ref.items() if k not in ("timing", "engine")} == {
        k: v for k, v in nat.items() if k not in ("timing", "engine")
    }
    ratio = ref["timing"]["cache_total_ms"] / max(nat["timing"]["cache_total_ms"], 1e-9)
    runs["speedup_same_trace"] = round(ratio, 1)
    runs["identical_decisions"] = same
    if not args.json:
        print(f"cores: {os.cpu_count()}, preset {args.preset}, seed {args.seed}")
        print(_timing_row(f"reference ({len(subset)} requests)", ref))
        print(_timing_row(f"native ({len(subset)} requests)", nat))
        if "native_full_trace" in runs:
            print(_timing_row(f"native ({len(full)} requests)", runs["native_full_trace"]))
        print(
            f"native vs reference on the same {len(subset)}-request trace: "
            f"{ratio:.1f}x less time in cache calls"
        )
        print(f"same decisions (steps, preemptions, hits, peak pages): {same}")
        for label, summary in runs.items():
            if isinstance(summary, dict):
                print(f"  {label}: by call (ms) {summary['timing']['by_call_ms']}")
    return runs


def eviction_trace(path: Path, *, num_requests: int, seed: int, prefixes: int) -> None:
    """Requests that return to one of ``prefixes`` shared prefixes (a system prompt or a
    conversation so far) over time: 1024 to 3072 prefix tokens plus 64 to 512 own tokens,
    64 generated tokens, two arrivals per step."""
    rng = np.random.default_rng(seed)
    prefix_len = rng.integers(1024, 3072, size=prefixes, endpoint=True)
    lines = []
    for index in range(num_requests):
        prefix = int(rng.integers(prefixes))
        own = int(rng.integers(64, 512, endpoint=True))
        lines.append(
            json.dumps(
                {
                    "prompt_len": int(prefix_len[prefix]) + own,
                    "prefix_id": prefix,
                    "prefix_len": int(prefix_len[prefix]),
                    "output_len": 64,
                    "arrival_step": index // 2,
                }
            )
        )
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def eviction(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "eviction.jsonl"
        eviction_trace(path, num_requests=args.eviction_requests, seed=args.seed, prefixes=args.prefixes)
        trace = load_trace(path, seed=args.seed)
    rows = []
    for pages in args.eviction_pages:
        row: dict[str, Any] = {"num_pages": pages}
        for order in ("hybrid", "group"):
            summary = simulate(
                trace,
                SimulationConfig(
                    preset=args.preset,
                    engine="native",
                    eviction_order=order,
                    num_pages=pages,
                ),
            ).summary
            row[order] = {
                key: summary[key]
                for key in ("prefix_hit_rate", "prefix_hits_tokens", "preemptions", "evictions", "steps")
            }
        rows.append(row)
    if not args.json:
        print(
            f"eviction order, {args.eviction_requests} requests over {args.prefixes} shared prefixes, "
            f"preset {args.preset} (native engine)"
        )
        header = ("pages", "hit rate hybrid", "hit rate group", "preemptions h/g", "steps h/g")
        print("  ".join(f"{name:>{width}}" for name, width in zip(header, (7, 15, 14, 15, 13), strict=True)))
        for row in rows:
            h, g = row["hybrid"], row["group"]
            print(
                f"{row['num_pages']:>7}  {h['prefix_hit_rate']:>15.2%}  {g['prefix_hit_rate']:>14.2%}  "
                f"{h['preemptions']:>7}/{g['preemptions']:<7}  {h['steps']:>6}/{g['steps']:<6}"
            )
    return {"eviction": rows}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="flat-kvcache simulate as a benchmark")
    parser.add_argument("what", nargs="?", choices=("speed", "eviction", "all"), default="speed")
    parser.add_argument("--preset", default="gpt-oss-like")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-requests", type=int, default=2000, help="native trace size (2000)")
    parser.add_argument("--reference-requests", type=int, default=200, help="reference trace size (200)")
    parser.add_argument("--num-pages", type=int, help="pool size (default: as flat-kvcache simulate)")
    parser.add_argument("--eviction-requests", type=int, default=2000)
    parser.add_argument("--prefixes", type=int, default=64)
    parser.add_argument(
        "--eviction-pages", type=int, nargs="+", default=[60000, 30000, 20000, 15000], metavar="N"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    result: dict[str, Any] = {}
    if args.what in ("speed", "all"):
        result.update(speed(args))
    if args.what in ("eviction", "all"):
        result.update(eviction(args))
    if args.json:
        json.dump(result, sys.stdout, indent=2)
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
