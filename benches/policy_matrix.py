"""Checkpoint policies on several workloads and on each prefix of them (issue 38 item 2).

For every workload of ``flat_kvcache.simulate.workloads`` (the shared conversation trace; agent /
tool use; document QA; multi-turn with long answers the next turn carries; a mix that shifts from
multi-turn to document QA halfway, and the same shift reversed) and every prefix of it (its
first 10 %, 25 %, 50 % and 100 % of requests), the replay of ``benches/hybrid_hits.py``:

1. Models: the ``qwen3.5-like`` preset (12 full + 36 linear-attention layers) with
   ``eviction_policy="lru"`` and ``"reuse"`` (SPEC 13.8), and its attention layers alone (no
   checkpoint, so the policy changes nothing there: run once, ``lru``).
2. Budgets: Bx = W + the bytes that hold x % (10 / 25 / 50) of the replayed prefix's unique
   512-token blocks in the attention-only model's K/V (``hybrid_hits.budget_bytes``). W
   (``working_set_bytes``) is the most the prefix's running requests hold at once on an engine
   short of nothing and sharing nothing (a state slot and the K/V of prompt and output each),
   read from the trace alone. ``hybrid_hits.py``'s budgets (``--budget plain``) have no W: on the
   shapes that share much (agent, document QA) x % of the few unique blocks is less than the
   running requests take, so the hybrid queues without end (agent, 3,000 requests, B10: 17
   running at most, 84,650 steps for arrivals that end at step 18,500, 10 minutes for one run)
   and hit rates measure the queue, not the policy. Each prefix is a trace of its own at the same
   pressure (what ``hybrid_hits.py --max-requests N`` does), so the first 10 % shows a policy
   before it has seen much. Every run gets ``plan_arena`` over its budget, 16-token pages,
   64-token state grain.
3. Replay: ``load_trace`` of the Mooncake file, then ``workloads.carry_answers`` (a request whose
   prompt a later one extends generates the tokens that later prompt carries, so an answer comes
   back as the next turn); hit rate = prefix hit tokens / prompt tokens.

One table: hit rates, reuse / lru, and hybrid / attention-only for each policy. Runs are
sequential (one core each): the full matrix is 6 workloads x 4 prefixes x 3 budgets x 3 runs.
For the two mixes, a prefix that reaches the second half also reports each half's hit rate
within the run (a second table).

    python benches/policy_matrix.py                     # 2000 requests per workload, the table
    python benches/policy_matrix.py --json > m.json     # machine-readable
    python benches/policy_matrix.py --plot matrix.png   # and a grid of hit rates (matplotlib)
    python benches/policy_matrix.py --workload doc_qa   # one workload (repeatable)
    python benches/policy_matrix.py --workload mix --prefix 0.1 --bx 25   # one cell
    python benches/policy_matrix.py --write-traces DIR  # keep the generated Mooncake files
    python benches/policy_matrix.py --smoke             # 40 requests each: does it run (CI)

The conversation workload is ``FLAT_KVCACHE_MOONCAKE_TRACE`` or
``shared/traces/mooncake_conversation.jsonl`` in or beside the checkout (``--trace``); without it
``--smoke`` leaves it out. Progress goes to stderr. Needs the ``torch`` extra; runs on the CPU.
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # spinning BLAS threads steal a core (benches/README.md)

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Literal

sys.path.insert(0, str(Path(__file__).resolve().parent))

from flat_kvcache.presets import get_preset
from flat_kvcache.simulate import (
    DEFAULT_MAX_SCHEDULED_TOKENS,
    DEFAULT_MS_PER_STEP,
    load_trace,
)
from flat_kvcache.simulate.workloads import HALVES, SHAPES, carry_answers, generate, write_mooncake
from flat_kvcache.torch import ModelShape
from hybrid_hits import (
    FRACTIONS,
    PRESET,
    TRACE_NAME,
    _attention_only,
    _find_trace,
    _unique_blocks,
    attention_kv_bytes_per_token,
    budget_bytes,
    report,
    run_arena,
)

PREFIXES = (0.10, 0.25, 0.50, 1.0)
#: (key, model, policy) of the three runs at each budget.
#: (result key, model, checkpoint policy) of each run in a cell.
RUNS: tuple[tuple[str, str, Literal["lru", "reuse"]], ...] = (
    ("attention", "attention only", "lru"),
    ("lru", "hybrid", "lru"),
    ("reuse", "hybrid", "reuse"),
)


def working_set_bytes(
    records: list[dict[str, Any]], ms_per_step: float, state_bytes: int, kv_bytes_per_token: int
) -> int:
    """The most bytes the running requests of ``records`` hold at once on an engine that is never
    short of memory and shares nothing (each runs from its arrival step for
    ``ceil(prompt / 8192)`` prefill steps and one step per output token, and holds a state slot
    of ``state_bytes`` and the K/V of its prompt and output). Read from the trace alone, the same
    for every budget, model and policy: what the load needs whatever the policy keeps (a hybrid
    whose checkpoint misses recomputes the prefix into pages of its own, so a prefix shared by
    running requests is not shared in memory unless it hit)."""
    events: list[tuple[int, int, int]] = []  # (step, +1 start / -1 end, bytes)
    for record in records:
        start = math.floor(record["timestamp"] / ms_per_step)
        steps = math.ceil(record["input_length"] / DEFAULT_MAX_SCHEDULED_TOKENS) + record["output_length"]
        held = state_bytes + (record["input_length"] + record["output_length"]) * kv_bytes_per_token
        events.append((start, 1, held))
        events.append((start + steps, -1, held))
    events.sort(key=lambda event: (event[0], event[1]))  # ends before starts at one step
    total = peak = 0
    for _, kind, held in events:
        total += kind * held
        peak = max(peak, total)
    return peak


def preset_costs() -> tuple[int, int]:
    """The ``qwen3.5-like`` hybrid's state slot (its SPEC 13 arena unit: every linear-attention
    layer's conv and recurrent state) and its attention layers' K/V bytes per token."""
    hybrid = get_preset(PRESET)
    state_bytes = sum(c.const_bytes for c in ModelShape.from_config(hybrid).components())
    return state_bytes, attention_kv_bytes_per_token(_attention_only(hybrid))


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def measure(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    hybrid = get_preset(PRESET)
    attention = _attention_only(hybrid)
    models = {"hybrid": hybrid, "attention only": attention}
    # The hybrid's working state per running request, and the K/V of a token.
    state_bytes, kv_bytes_per_token = preset_costs()
    prefixes, fractions = (PREFIXES[-2:], FRACTIONS[-1:]) if args.smoke else (PREFIXES, FRACTIONS)
    prefixes = tuple(args.prefix or prefixes)
    fractions = tuple(x / 100 for x in args.bx) if args.bx else fractions
    total_runs = len(args.workload) * len(prefixes) * len(fractions) * len(RUNS)
    done = 0
    start = time.perf_counter()
    workloads = []
    for shape in args.workload:
        records = generate(shape, args.num_requests, seed=args.seed, trace=args.trace)
        path = write_mooncake(records, folder / f"{shape}.jsonl")
        rows = []
        for prefix in prefixes:
            count = max(1, round(prefix * len(records)))
            trace = load_trace(path, max_requests=count, ms_per_step=args.ms_per_step)
            trace, carried = carry_answers(trace, records[:count])
            prompt_tokens = sum(len(request.prompt) for request in trace)
            blocks = _unique_blocks(path, count)
            working_set = (
                working_set_bytes(records[:count], args.ms_per_step, state_bytes, kv_bytes_per_token)
                if args.budget == "working-set"
                else 0
            )
            # A shifting workload's prefix that reaches its second half: each half's hit rate too.
            half = len(records) // 2 or 1
            split = half if shape in HALVES and count > half else None
            for fraction in fractions:
                budget = working_set + budget_bytes(fraction, blocks, kv_bytes_per_token)
                runs: dict[str, dict[str, Any]] = {}
                for key, model, policy in RUNS:
                    runs[key] = run_arena(
                        f"{PRESET} {model}",
                        models[model],
                        budget,
                        trace,
                        prompt_tokens,
                        policy=policy,
                        split=split,
                    )
                    done += 1
                    elapsed = time.perf_counter() - start
                    seconds = runs[key].get("seconds", 0.0)
                    print(
                        f"[{done}/{total_runs}] {shape} {round(100 * prefix)}% B{round(100 * fraction)} "
                        f"{key}: {100 * runs[key]['hit_rate']:.2f}% hits, {seconds:.1f} s "
                        f"(elapsed {elapsed / 60:.1f} min)",
                        file=sys.stderr,
                        flush=True,
                    )
                rates = {key: run["hit_rate"] for key, run in runs.items()}
                rows.append(
                    {
                        "prefix": prefix,
                        "requests": count,
                        "prompt_tokens": prompt_tokens,
                        "unique_blocks": blocks,
                        "carried_answers": carried,
                        "fraction": fraction,
                        "working_set_bytes": working_set,
                        "budget_bytes": budget,
                        "hit_rates": rates,
                        "reuse_over_lru": _ratio(rates["reuse"], rates["lru"]),
                        "lru_over_attention": _ratio(rates["lru"], rates["attention"]),
                        "reuse_over_attention": _ratio(rates["reuse"], rates["attention"]),
                        "cache_ms_reuse_over_lru": _ratio(
                            runs["reuse"].get("cache_ms", 0.0), runs["lru"].get("cache_ms", 0.0)
                        ),
                        "runs": runs,
                    }
                    | (
                        {}
                        if split is None
                        else {"split": split, "halves": {key: run.get("halves") for key, run in runs.items()}}
                    )
                )
        workloads.append({"workload": shape, "requests": len(records), "rows": rows})
    return {
        "preset": PRESET,
        "seed": args.seed,
        "num_requests": args.num_requests,
        "ms_per_step": args.ms_per_step,
        "budget": args.budget,
        "state_bytes": state_bytes,
        "trace": None if args.trace is None else str(args.trace),
        "attention_kv_bytes_per_token": kv_bytes_per_token,
        "workloads": workloads,
    }


def _cell(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def format_table(result: dict[str, Any]) -> str:
    """One markdown table: a row per workload, prefix and budget."""
    lines = [
        "| workload | prefix (requests) | budget | attention only | hybrid lru | hybrid reuse | reuse / lru "
        "| lru / attention | reuse / attention | aborted lru / reuse | cache time reuse / lru |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for workload in result["workloads"]:
        for row in workload["rows"]:
            rates = row["hit_rates"]
            runs = row["runs"]
            errors = [key for key, run in runs.items() if "error" in run]
            aborted = "/".join(str(runs[key].get("aborted", "-")) for key in ("lru", "reuse"))
            lines.append(
                f"| {workload['workload']} | {round(100 * row['prefix'])} % ({row['requests']}) "
                f"| B{round(100 * row['fraction'])} | {100 * rates['attention']:.2f} % "
                f"| {100 * rates['lru']:.2f} % | {100 * rates['reuse']:.2f} % "
                f"| {_cell(row['reuse_over_lru'])} | {_cell(row['lru_over_attention'])} "
                f"| {_cell(row['reuse_over_attention'])} | {aborted} "
                f"| {_cell(row['cache_ms_reuse_over_lru'])}"
                + (f" (does not fit: {', '.join(errors)})" if errors else "")
                + " |"
            )
    halves = [
        (workload["workload"], row)
        for workload in result["workloads"]
        for row in workload["rows"]
        if "halves" in row
    ]
    if halves:
        lines += [
            "",
            "Each half of a shifting workload within the same run (a request's hit at its first admission):",
            "",
            "| workload | prefix | budget | half | attention only | hybrid lru | hybrid reuse "
            "| reuse / lru |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for name, row in halves:
            for i, label in enumerate(HALVES[name]):
                rate = {key: (row["halves"][key] or [0.0, 0.0])[i] for key in row["halves"]}
                part = f"{'first' if i == 0 else 'second'} ({label})"
                lines.append(
                    f"| {name} | {round(100 * row['prefix'])} % | B{round(100 * row['fraction'])} | {part} "
                    f"| {100 * rate['attention']:.2f} % | {100 * rate['lru']:.2f} % "
                    f"| {100 * rate['reuse']:.2f} % "
                    f"| {_cell(_ratio(rate['reuse'], rate['lru']))} |"
                )
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    """A grid of hit rate against prefix: a row per workload, a column per budget, a line per
    run (PNG at ``path``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = result["workloads"]
    fractions = sorted({row["fraction"] for workload in workloads for row in workload["rows"]})
    fig, axes = plt.subplots(
        len(workloads), len(fractions), figsize=(4 * len(fractions), 2.6 * len(workloads)), squeeze=False
    )
    for r, workload in enumerate(workloads):
        for c, fraction in enumerate(fractions):
            ax = axes[r][c]
            rows = [row for row in workload["rows"] if row["fraction"] == fraction]
            xs = [100 * row["prefix"] for row in rows]
            for key, _, _ in RUNS:
                ax.plot(xs, [100 * row["hit_rates"][key] for row in rows], marker="o", label=key)
            ax.set_xscale("log")
            ax.set_xticks(xs)
            ax.set_xticklabels([f"{x:g}" for x in xs])
            ax.set_title(f"{workload['workload']}, B{round(100 * fraction)}", fontsize=9)
            if c == 0:
                ax.set_ylabel("token hit rate (%)")
            if r == len(workloads) - 1:
                ax.set_xlabel("first % of requests")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--workload",
        action="append",
        choices=SHAPES,
        default=None,
        help="a workload to run (repeatable; default: all)",
    )
    parser.add_argument("--num-requests", type=int, default=2000, help="requests per workload (2000)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the generated workloads (0)")
    parser.add_argument(
        "--trace",
        type=Path,
        default=None,
        help=f"the conversation workload's trace (default: shared/traces/{TRACE_NAME} in or beside "
        "the checkout)",
    )
    parser.add_argument("--ms-per-step", type=float, default=DEFAULT_MS_PER_STEP, help="trace ms per step")
    parser.add_argument(
        "--write-traces", type=Path, default=None, help="keep the Mooncake files in this folder"
    )
    parser.add_argument(
        "--budget",
        choices=("working-set", "plain"),
        default="working-set",
        help="working-set: Bx = the running requests' peak bytes + x %% of the unique blocks' K/V (the "
        "default); plain: x %% of the unique blocks' K/V alone (hybrid_hits.py's)",
    )
    parser.add_argument(
        "--prefix",
        action="append",
        type=float,
        default=None,
        help="only this prefix: 0.1, 0.25, 0.5, 1 (repeatable)",
    )
    parser.add_argument(
        "--bx",
        action="append",
        type=int,
        default=None,
        help="only the budget Bx of this x: 10, 25, 50 (repeatable)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--plot", type=Path, default=None, help="write a PNG of the hit rates (matplotlib)")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="24 requests per workload, 50 %% and 100 %%, B50: does it run (CI)",
    )
    args = parser.parse_args(argv)
    if args.plot is not None and not args.plot.parent.is_dir():
        parser.error(f"--plot: folder {args.plot.parent} does not exist")
    if args.write_traces is not None and not args.write_traces.is_dir():
        parser.error(f"--write-traces: folder {args.write_traces} does not exist")
    if args.smoke:
        args.num_requests = min(args.num_requests, 24)
    args.workload = args.workload or list(SHAPES)
    if args.trace is None:
        args.trace = _find_trace()
    if args.trace is None and "conversation" in args.workload:
        if not args.smoke:
            parser.error(f"{TRACE_NAME} not found beside the checkout; pass --trace")
        print(f"{TRACE_NAME} not found: the conversation workload is left out", file=sys.stderr)
        args.workload.remove("conversation")
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as temporary:
        result = measure(args, args.write_traces or Path(temporary))
    result["total_seconds"] = round(time.perf_counter() - start, 2)
    report(result, args, format_table, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
