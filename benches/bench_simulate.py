"""The ``flat-kvcache simulate`` loop as a benchmark (targets and results: benches/README.md).

Two measurements:

``speed`` (default)
    The built-in trace through the scheduler loop on the native engine and on the pure-Python
    reference: time spent in cache calls in all and per step (median and p99, all steps and
    decode-only steps). The reference is slow (minutes for the whole trace on 2 cores), so by
    default it runs the first ``--reference-requests`` requests, and the native engine runs
    both that trace (for the like-for-like ratio) and the whole one.
``eviction``
    The effect of the hybrid eviction order (SPEC 12.3) on the prefix hit rate under memory
    pressure: two workloads (requests returning to shared prefixes; multi-turn chats) on two
    models (gpt-oss-like, W=128; a Gemma-2-like model, W=4096), on pools from roomy to tight,
    run with ``eviction_order="hybrid"`` and ``"group"`` (the reference design's order).

Build the extension in release mode first (``maturin develop --release``), then::

    python benches/bench_simulate.py                          # speed: native 2000, reference 200
    python benches/bench_simulate.py --reference-requests 2000  # the whole trace on both (slow)
    python benches/bench_simulate.py eviction                 # hybrid vs group hit rates
    python benches/bench_simulate.py host                     # hit rates with a host-memory tier
    python benches/bench_simulate.py --json ...               # machine-readable
    python benches/bench_simulate.py all --smoke              # tiny sizes: does it run (CI)
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
import numpy.typing as npt
from flat_kvcache.presets import PRESETS
from flat_kvcache.simulate import VOCAB, SimulationConfig, TraceRequest, default_trace, load_trace, simulate


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
    config = {"model": args.model, "num_pages": args.num_pages}
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
        print(f"cores: {os.cpu_count()}, model {args.model}, seed {args.seed}")
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


#: A Gemma-2-style model: sliding-window layers with a 4096-token window, alternating with
#: full-attention layers. With prompts of at most a few thousand tokens its sliding group keeps
#: (nearly) every page until the request ends, like the full group.
GEMMA2_LIKE: dict[str, Any] = {
    "model_type": "gemma2_like",
    "num_hidden_layers": 4,
    "layer_types": ["sliding_attention", "full_attention"] * 2,
    "sliding_window": 4096,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "torch_dtype": "bfloat16",
    "max_position_embeddings": 8192,
}


def shared_prefix_trace(*, num_requests: int, prefixes: int, seed: int) -> list[TraceRequest]:
    """Requests that return to one of ``prefixes`` shared prefixes over time (a system prompt,
    a document): 1024 to 3072 prefix tokens plus 64 to 512 own tokens, 64 generated tokens,
    two arrivals per step. Written as JSONL and read back, so the file format is exercised too."""
    rng = np.random.default_rng(seed)
    prefix_len = rng.integers(1024, 3072, size=prefixes, endpoint=True)
    lines = []
    for index in range(num_requests):
        prefix = int(rng.integers(prefixes))
        own = int(rng.integers(64, 512, endpoint=True))
        record = {
            "prompt_len": int(prefix_len[prefix]) + own,
            "prefix_id": prefix,
            "prefix_len": int(prefix_len[prefix]),
            "output_len": 64,
            "arrival_step": index // 2,
        }
        lines.append(json.dumps(record))
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "shared_prefix.jsonl"
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        return load_trace(path, seed=seed)


def multi_turn_trace(*, conversations: int, turns: int, gap: int, seed: int) -> list[TraceRequest]:
    """Chats: each turn's prompt is the conversation so far (previous prompt and answer) plus a
    new user message of 64 to 256 tokens; the first is a 512-token system prompt shared by all
    conversations plus 256 to 1024 tokens. 128 generated tokens per turn. Conversation c's turn
    k arrives at step ``2 c + k gap``, so its previous turn's pages have been freed and partly
    evicted by then."""
    rng = np.random.default_rng(seed)

    def tokens(count: int) -> npt.NDArray[np.uint32]:
        return rng.integers(0, VOCAB, size=count, dtype=np.uint32)

    system = tokens(512)
    requests = []
    for conversation in range(conversations):
        history = np.concatenate([system, tokens(int(rng.integers(256, 1024, endpoint=True)))])
        for turn in range(turns):
            answer = tokens(128)
            requests.append((conversation * 2 + turn * gap, history, answer))
            history = np.concatenate([history, answer, tokens(int(rng.integers(64, 256, endpoint=True)))])
    requests.sort(key=lambda request: request[0])
    return [TraceRequest(i, prompt, answer, arrival) for i, (arrival, prompt, answer) in enumerate(requests)]


def eviction(args: argparse.Namespace) -> dict[str, Any]:
    traces = {
        "shared-prefix": shared_prefix_trace(
            num_requests=args.eviction_requests, prefixes=args.prefixes, seed=args.seed
        ),
        "multi-turn": multi_turn_trace(conversations=args.conversations, turns=4, gap=150, seed=args.seed),
    }
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        gemma = Path(folder) / "gemma2_like.json"
        gemma.write_text(json.dumps(GEMMA2_LIKE), encoding="utf-8")
        models: dict[str, str | Path] = {
            "gpt-oss-like (W=128)": "gpt-oss-like",
            "gemma2-like (W=4096)": gemma,
        }
        for model, source in models.items():
            for workload, trace in traces.items():
                for pages in args.eviction_pages:
                    row: dict[str, Any] = {"model": model, "workload": workload, "num_pages": pages}
                    for order in ("hybrid", "group"):
                        config = SimulationConfig(model=source, eviction_order=order, num_pages=pages)
                        summary = simulate(trace, config).summary
                        keys = ("prefix_hit_rate", "prefix_hits_tokens", "preemptions", "evictions", "steps")
                        row[order] = {key: summary[key] for key in keys}
                    rows.append(row)
    if not args.json:
        print(
            f"eviction order (native engine): shared-prefix = {args.eviction_requests} requests over "
            f"{args.prefixes} prefixes; multi-turn = {args.conversations} conversations x 4 turns"
        )
        header = (
            "model",
            "workload",
            "pages",
            "hit hybrid",
            "hit group",
            "diff (pp)",
            "preempt h/g",
            "steps h/g",
        )
        widths = (22, 14, 7, 11, 10, 10, 12, 12)
        print("  ".join(f"{name:>{width}}" for name, width in zip(header, widths, strict=True)))
        for row in rows:
            h, g = row["hybrid"], row["group"]
            cells = (
                row["model"],
                row["workload"],
                str(row["num_pages"]),
                f"{h['prefix_hit_rate']:.2%}",
                f"{g['prefix_hit_rate']:.2%}",
                f"{100 * (h['prefix_hit_rate'] - g['prefix_hit_rate']):+.2f}",
                f"{h['preemptions']}/{g['preemptions']}",
                f"{h['steps']}/{g['steps']}",
            )
            print("  ".join(f"{cell:>{width}}" for cell, width in zip(cells, widths, strict=True)))
    return {"eviction": rows}


def host(args: argparse.Namespace) -> dict[str, Any]:
    """The host-memory tier on the multi-turn workload: prefix hit rate without the tier and with
    ``--host-pages`` pages of it, on each ``--host-device-pages`` pool (native engine, write-through
    tier whose transfers are acknowledged at once, as ``flat-kvcache simulate --host-pages``)."""
    trace = multi_turn_trace(conversations=args.conversations, turns=4, gap=150, seed=args.seed)
    rows = []
    keys = ("prefix_hit_rate", "prefix_hits_tokens", "host_hits_tokens", "host_stores", "host_loads")
    for pages in args.host_device_pages:
        row: dict[str, Any] = {"model": str(args.model), "num_pages": pages, "runs": {}}
        for host_pages in (0, *args.host_pages):
            config = SimulationConfig(model=args.model, num_pages=pages, host_pages=host_pages)
            summary = simulate(trace, config).summary
            row["runs"][host_pages] = {key: summary[key] for key in keys}
        rows.append(row)
    if not args.json:
        print(
            f"host tier (native engine, {args.model}): "
            f"multi-turn = {args.conversations} conversations x 4 turns"
        )
        for row in rows:
            cells = [
                f"{host}: {run['prefix_hit_rate']:.2%} (host hits {run['host_hits_tokens']}, "
                f"loads {run['host_loads']})"
                for host, run in row["runs"].items()
            ]
            print(f"  device pages {row['num_pages']:>6}  host pages " + "  ".join(cells))
    return {"host": rows}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="flat-kvcache simulate as a benchmark")
    parser.add_argument("what", nargs="?", choices=("speed", "eviction", "host", "all"), default="speed")
    model = parser.add_mutually_exclusive_group()
    model.add_argument("--preset", default="gpt-oss-like", metavar="NAME", help="a built-in model preset")
    model.add_argument("--config", metavar="PATH", help="a config.json (or its folder) instead of a preset")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-requests", type=int, default=2000, help="native trace size (2000)")
    parser.add_argument("--reference-requests", type=int, default=200, help="reference trace size (200)")
    parser.add_argument("--num-pages", type=int, help="pool size (default: as flat-kvcache simulate)")
    parser.add_argument("--eviction-requests", type=int, default=2000)
    parser.add_argument("--prefixes", type=int, default=256)
    parser.add_argument("--conversations", type=int, default=300)
    parser.add_argument(
        "--eviction-pages", type=int, nargs="+", default=[40000, 20000, 15000, 10000], metavar="N"
    )
    parser.add_argument(
        "--host-device-pages",
        type=int,
        nargs="+",
        default=[20000, 10000],
        metavar="N",
        help="device pools of the host-tier comparison",
    )
    parser.add_argument(
        "--host-pages",
        type=int,
        nargs="+",
        default=[10000, 20000, 40000],
        metavar="N",
        help="host tiers of the host-tier comparison (besides none)",
    )
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny traces and one pool size: checks that the benchmark runs (CI), measures nothing",
    )
    args = parser.parse_args(argv)
    if args.preset not in PRESETS:
        parser.error(f"--preset {args.preset}: not a built-in preset (a config.json goes with --config)")
    args.model = args.preset if args.config is None else Path(args.config)
    if args.smoke:
        args.num_requests, args.reference_requests = 40, 10
        args.eviction_requests, args.prefixes, args.conversations = 20, 3, 4
        args.eviction_pages = [2000]
        args.host_device_pages, args.host_pages = [2000], [2000]
    result: dict[str, Any] = {}
    if args.what in ("speed", "all"):
        result.update(speed(args))
    if args.what in ("eviction", "all"):
        result.update(eviction(args))
    if args.what in ("host", "all"):
        result.update(host(args))
    if args.json:
        json.dump(result, sys.stdout, indent=2)
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
