"""Prefix hit rate of a hybrid model against its own attention layers alone, in the same bytes.

The figure of SPEC 13 ("a Qwen3.5-like hybrid hits a quarter as often as its own attention
layers alone in the same memory"), measured on today's code so the same command can be re-run
after the storage rework:

1. Models: the ``qwen3.5-like`` preset (full + linear-attention layers) and its attention-only
   variant (the same config with the linear-attention layers dropped).
2. Budgets: the first ``--max-requests`` requests of a Mooncake trace name U unique 512-token
   blocks (``hash_ids``); B25 / B50 are the bytes that hold 25 % / 50 % of ``U * 512`` tokens in
   the attention-only model's K/V (bf16, all its layers: ``ModelShape.components()``). Both get the
   same budget: with ``--storage arena`` (the default) ``plan_arena`` over ``B`` bytes; with
   ``--storage equalized``, pages and page size from ``plan_kv_memory(shape, budget_bytes=B,
   storage="equalized", ...)`` (what ``flat-kvcache plan --memory --storage equalized`` does; the
   hybrid's page size is equalized so a page holds a state snapshot).
3. Replay: those requests through the simulator's native engine (``flat_kvcache.simulate``);
   hit rate = prefix hit tokens / prompt tokens; ratio = hybrid / attention-only per budget.

Build the extension first (``maturin develop --release``), then::

    python benches/hybrid_hits.py                    # 3000 requests, both budgets, a table
    python benches/hybrid_hits.py --json             # machine-readable
    python benches/hybrid_hits.py --plot hits.png    # and a bar chart (matplotlib)
    python benches/hybrid_hits.py --smoke            # 100 requests: does it run (CI)

The trace is ``FLAT_KVCACHE_MOONCAKE_TRACE`` or ``shared/traces/mooncake_conversation.jsonl`` in or
beside the checkout (``--trace`` to choose); without one, ``--smoke`` runs a tiny made-up trace.

Needs the ``torch`` extra (``plan_kv_memory``); runs on the CPU.
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # spinning BLAS threads steal a core (benches/README.md)

import argparse
import io
import json
import math
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from flat_kvcache import plan_arena
from flat_kvcache.presets import get_preset
from flat_kvcache.simulate import (
    DEFAULT_MAX_RUNNING,
    DEFAULT_MAX_SCHEDULED_TOKENS,
    DEFAULT_MS_PER_STEP,
    DEFAULT_PAGE_SIZE,
    MOONCAKE_BLOCK_TOKENS,
    SimulationConfig,
    load_trace,
    simulate,
)
from flat_kvcache.torch import ModelShape, plan_kv_memory

TRACE_NAME = "mooncake_conversation.jsonl"
PRESET = "qwen3.5-like"
FRACTIONS = (0.10, 0.25, 0.50)


def _find_trace() -> Path | None:
    """``FLAT_KVCACHE_MOONCAKE_TRACE``, or ``shared/traces/`` in or beside the checkout (as the
    tests look for it)."""
    root = Path(__file__).resolve().parents[1]
    candidates = [root / "shared" / "traces" / TRACE_NAME, root.parent / "shared" / "traces" / TRACE_NAME]
    if "FLAT_KVCACHE_MOONCAKE_TRACE" in os.environ:
        candidates.insert(0, Path(os.environ["FLAT_KVCACHE_MOONCAKE_TRACE"]))
    return next((path for path in candidates if path.is_file()), None)


def _tiny_trace(folder: Path) -> Path:
    """A small multi-turn Mooncake-format trace (for ``--smoke`` where the real one is absent)."""
    path = folder / "tiny_mooncake.jsonl"
    lines = []
    for turn in range(4):
        for chat in range(5):
            ids = [0] + [1000 * chat + i for i in range(1, 12 + 4 * turn)]
            length = MOONCAKE_BLOCK_TOKENS * (len(ids) - 1) + 100
            record = {
                "timestamp": 1000 * turn + chat,
                "input_length": length,
                "output_length": 8,
                "hash_ids": ids,
            }
            lines.append(json.dumps(record))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _unique_blocks(path: Path, max_requests: int) -> int:
    """Distinct ``hash_ids`` over the first ``max_requests`` requests of a Mooncake trace."""
    seen: set[int] = set()
    count = 0
    with open(path, encoding="utf-8") as file:
        for line in file:
            text = line.strip()
            if not text or text.startswith("#"):
                continue
            if count >= max_requests:
                break
            seen.update(json.loads(text)["hash_ids"])
            count += 1
    return len(seen)


def _attention_only(cfg: dict[str, Any]) -> dict[str, Any]:
    """``cfg`` with only its full-attention layers."""
    layers = [t for t in cfg["layer_types"] if t == "full_attention"]
    return {**cfg, "layer_types": layers, "num_hidden_layers": len(layers)}


def attention_kv_bytes_per_token(attention: dict[str, Any]) -> int:
    """K and V of every attention layer of ``attention`` per token (``ModelShape.kv_bytes_per_slot``
    is one layer's)."""
    return sum(c.bytes_per_slot for c in ModelShape.from_config(attention).components())


def budget_bytes(fraction: float, unique_blocks: int, kv_bytes_per_token: int) -> int:
    """B10 / B25 / B50 (``fraction`` 0.10 / 0.25 / 0.50): the bytes that hold ``fraction`` of the
    unique blocks' tokens in the attention-only model's K/V."""
    return math.ceil(fraction * unique_blocks * MOONCAKE_BLOCK_TOKENS) * kv_bytes_per_token


def run_arena(
    label: str,
    cfg: dict[str, Any],
    budget: int,
    trace: list[Any],
    prompt_tokens: int,
    *,
    page_size: int = DEFAULT_PAGE_SIZE,
    max_running: int = DEFAULT_MAX_RUNNING,
    grain: int = 64,
    policy: Literal["lru", "reuse"] = "lru",
    split: int | None = None,
) -> dict[str, Any]:
    """One run on the SPEC 13 storage: the arena ``plan_arena`` lays out for ``budget`` bytes,
    ``page_size``-token attention pages, state pages (checkpoints) of ``grain`` tokens. With
    ``split``, also ``halves``: the hit rates of ``trace[:split]`` and ``trace[split:]`` within
    the one run (each request's hit at its first admission over its prompt tokens)."""
    shape = ModelShape.from_config(cfg)
    try:
        arena = plan_arena(shape.components(), page_size, budget)
    except ValueError as exc:  # the budget holds fewer than two units (a tiny trace)
        return {"model": label, "budget_bytes": budget, "error": str(exc), "hit_rate": 0.0}
    config = SimulationConfig(
        model=cfg,
        page_size=page_size,
        max_running=max_running,
        arena=arena,
        state_page_size=grain,
        eviction_policy=policy,
    )
    start = time.perf_counter()
    sink = io.StringIO() if split is not None else None
    try:
        summary = simulate(trace, config, decisions=sink).summary
    except ValueError as exc:  # the arena holds no unit for one token of a request (a tiny trace)
        return {"model": label, "budget_bytes": budget, "error": str(exc), "hit_rate": 0.0}
    seconds = time.perf_counter() - start
    hits = int(summary["prefix_hits_tokens"])
    pages_per_unit = {g.group_id: g.per_unit for g in arena.groups}
    return {
        "model": label,
        "storage": "arena",
        "policy": policy,
        "budget_bytes": budget,
        "page_size": page_size,
        "unit_bytes": arena.unit_bytes,
        "num_units": arena.num_units,
        "pages_per_unit": pages_per_unit,
        "prompt_tokens": prompt_tokens,
        "prefix_hits_tokens": hits,
        "hit_rate": hits / prompt_tokens,
        "simulator_hit_rate": summary["prefix_hit_rate"],
        "stranded_share_max": summary["arena"]["stranded_share_max"],
        "stranded_share_mean": summary["arena"]["stranded_share_mean"],
        "cached_busy_share_max": summary["arena"]["cached_busy_share_max"],
        "cached_busy_share_mean": summary["arena"]["cached_busy_share_mean"],
        "preemptions": summary["preemptions"],
        "aborted": summary["aborted"],
        "steps": summary["steps"],
        "checkpoints": summary["checkpoints"],
        "cache_ms": summary["timing"]["cache_total_ms"],
        "seconds": round(seconds, 2),
    } | ({} if sink is None or split is None else {"halves": _halves(sink.getvalue(), trace, split)})


def _halves(decisions: str, trace: list[Any], split: int) -> list[float]:
    """The hit rates of ``trace[:split]`` and ``trace[split:]`` from a run's decision records."""
    index = {request.request_id: i for i, request in enumerate(trace)}
    first_hit: dict[int, int] = {}
    for line in decisions.splitlines():
        for rid, hit, _ in json.loads(line)["admitted"]:
            first_hit.setdefault(rid, hit)
    rates = []
    for part in (range(split), range(split, len(trace))):
        tokens = sum(len(trace[i].prompt) for i in part)
        hits = sum(hit for rid, hit in first_hit.items() if index[rid] in part)
        rates.append(hits / tokens if tokens else 0.0)
    return rates


def _run_arena(
    label: str,
    cfg: dict[str, Any],
    budget: int,
    trace: list[Any],
    prompt_tokens: int,
    args: argparse.Namespace,
    policy: Literal["lru", "reuse"] = "lru",
) -> dict[str, Any]:
    """:func:`run_arena` with the command line's page size, running requests and grain."""
    return run_arena(
        label,
        cfg,
        budget,
        trace,
        prompt_tokens,
        page_size=args.page_size,
        max_running=args.max_running,
        grain=args.grain,
        policy=policy,
    )


def _run(
    label: str,
    cfg: dict[str, Any],
    budget: int,
    trace: list[Any],
    prompt_tokens: int,
    args: argparse.Namespace,
    policy: Literal["lru", "reuse"] = "lru",
) -> dict[str, Any]:
    if args.storage == "arena":
        return _run_arena(label, cfg, budget, trace, prompt_tokens, args, policy)
    shape = ModelShape.from_config(cfg)
    try:
        plan = plan_kv_memory(
            shape,
            page_size=args.page_size,
            budget_bytes=budget,
            max_live_requests=args.max_running,
            max_scheduled_tokens=DEFAULT_MAX_SCHEDULED_TOKENS,
            max_context_len=int(cfg["max_position_embeddings"]),
            storage="equalized",
        )
    except ValueError as exc:  # the budget holds fewer than two pages (a tiny trace)
        return {"model": label, "budget_bytes": budget, "error": str(exc), "hit_rate": 0.0}
    config = SimulationConfig(
        model=cfg,
        num_pages=plan.num_pages,
        page_size=plan.page_size,
        max_running=args.max_running,
        storage="equalized",
    )
    start = time.perf_counter()
    summary = simulate(trace, config).summary
    seconds = time.perf_counter() - start
    hits = int(summary["prefix_hits_tokens"])
    return {
        "model": label,
        "storage": "equalized",
        "budget_bytes": budget,
        "page_size": plan.page_size,
        "bytes_per_page": plan.bytes_per_page,
        "num_pages": plan.num_pages,
        "tokens_that_fit": plan.max_total_tokens,
        "prompt_tokens": prompt_tokens,
        "prefix_hits_tokens": hits,
        "hit_rate": hits / prompt_tokens,
        "simulator_hit_rate": summary["prefix_hit_rate"],
        "preemptions": summary["preemptions"],
        "aborted": summary["aborted"],
        "steps": summary["steps"],
        "seconds": round(seconds, 2),
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    trace_path = args.trace
    trace = load_trace(trace_path, max_requests=args.max_requests, ms_per_step=args.ms_per_step)
    prompt_tokens = sum(len(request.prompt) for request in trace)
    blocks = _unique_blocks(trace_path, len(trace))
    unique_tokens = blocks * MOONCAKE_BLOCK_TOKENS
    hybrid = get_preset(PRESET)
    attention = _attention_only(hybrid)
    kv_bytes_per_token = attention_kv_bytes_per_token(attention)
    budgets = []
    for fraction in FRACTIONS:
        budget = budget_bytes(fraction, blocks, kv_bytes_per_token)
        runs = [
            _run(f"{PRESET} (hybrid)", hybrid, budget, trace, prompt_tokens, args),
            _run(f"{PRESET} attention only", attention, budget, trace, prompt_tokens, args),
        ]
        ratio = runs[0]["hit_rate"] / runs[1]["hit_rate"] if runs[1]["hit_rate"] else None
        entry: dict[str, Any] = {"fraction": fraction, "budget_bytes": budget, "ratio": ratio, "runs": runs}
        if args.storage == "arena":
            # SPEC 13.8: the reuse policy against LRU, for the hybrid and for the attention
            # layers alone (which have no checkpoint, so the policy must change nothing there).
            reuse = [
                _run(f"{PRESET} (hybrid), reuse", hybrid, budget, trace, prompt_tokens, args, "reuse"),
                _run(f"{PRESET} attention, reuse", attention, budget, trace, prompt_tokens, args, "reuse"),
            ]
            runs.extend(reuse)
            entry["reuse_over_lru"] = (
                reuse[0]["hit_rate"] / runs[0]["hit_rate"] if runs[0]["hit_rate"] else None
            )
            entry["attention_reuse_over_lru"] = (
                reuse[1]["hit_rate"] / runs[1]["hit_rate"] if runs[1]["hit_rate"] else None
            )
        budgets.append(entry)
    return {
        "trace": str(trace_path),
        "storage": args.storage,
        "requests": len(trace),
        "ms_per_step": args.ms_per_step,
        "unique_blocks": blocks,
        "unique_tokens": unique_tokens,
        "prompt_tokens": prompt_tokens,
        "attention_kv_bytes_per_token": kv_bytes_per_token,
        "budgets": budgets,
    }


def report(
    result: dict[str, Any],
    args: argparse.Namespace,
    table: Callable[[dict[str, Any]], str],
    draw: Callable[[dict[str, Any], Path], None],
) -> None:
    """A bench's output: ``result`` as JSON with ``--json``, else ``table(result)`` and the total
    time; the plot ``draw`` makes when ``--plot`` names a file (this bench and policy_matrix)."""
    if args.json:
        json.dump(result, sys.stdout, indent=2)
        print()
    else:
        print(table(result))
        print(f"total {result['total_seconds']:.1f} s")
    if args.plot is not None:
        draw(result, args.plot)


def format_table(result: dict[str, Any]) -> str:
    lines = [
        f"trace {result['trace']}: {result['requests']} requests, {result['prompt_tokens']} prompt tokens, "
        f"{result['unique_blocks']} unique {MOONCAKE_BLOCK_TOKENS}-token blocks; attention-only K/V "
        f"{result['attention_kv_bytes_per_token']} bytes/token; storage {result['storage']}",
        f"{'budget':<18} {'model':<30} {'page':>5} {'pages':>7} {'tokens fit':>10} {'hit rate':>9} "
        f"{'preempt':>7} {'aborted':>7} {'time':>7}"
        + ("  stranded max / mean  cached in busy units max / mean" if result["storage"] == "arena" else ""),
    ]
    for entry in result["budgets"]:
        name = f"B{round(entry['fraction'] * 100)} {entry['budget_bytes'] / 2**30:.2f} GiB"
        for run in entry["runs"]:
            if "error" in run:
                lines.append(f"{name:<18} {run['model']:<30} does not fit: {run['error']}")
                continue
            if run["storage"] == "arena":
                lines.append(
                    f"{name:<18} {run['model']:<30} {run['page_size']:>5} {run['num_units']:>7} "
                    f"{'units':>10} {100 * run['hit_rate']:>8.2f}% "
                    f"{run['preemptions']:>7} {run['aborted']:>7} "
                    f"{run['seconds']:>6.1f}s  {100 * run['stranded_share_max']:.2f}% / "
                    f"{100 * run['stranded_share_mean']:.2f}%  {100 * run['cached_busy_share_max']:.2f}% / "
                    f"{100 * run['cached_busy_share_mean']:.2f}%"
                )
                continue
            lines.append(
                f"{name:<18} {run['model']:<30} {run['page_size']:>5} {run['num_pages']:>7} "
                f"{run['tokens_that_fit']:>10} {100 * run['hit_rate']:>8.2f}% "
                f"{run['preemptions']:>7} {run['aborted']:>7} "
                f"{run['seconds']:>6.1f}s"
            )
        ratio = "n/a" if entry["ratio"] is None else f"{entry['ratio']:.3f}"
        lines.append(f"{name:<18} {'ratio hybrid / attention only':<30} {ratio:>46}")
        for key, text in (
            ("reuse_over_lru", "hybrid: reuse / lru"),
            ("attention_reuse_over_lru", "attention: reuse / lru"),
        ):
            if key in entry:
                value = "n/a" if entry[key] is None else f"{entry[key]:.3f}"
                lines.append(f"{name:<18} {text:<30} {value:>46}")
    return "\n".join(lines)


def resolve_trace(args: argparse.Namespace, parser: argparse.ArgumentParser, folder: Path) -> None:
    """Set ``args.trace`` when it was left out: the Mooncake trace in or beside the checkout,
    else (``--smoke`` only) a tiny made-up trace written in ``folder``; without either, a
    ``parser.error`` naming ``--trace``."""
    if args.trace is None:
        args.trace = _find_trace()
    if args.trace is None:
        if not args.smoke:
            parser.error(f"{TRACE_NAME} not found beside the checkout; pass --trace")
        args.trace = _tiny_trace(folder)


def plot(result: dict[str, Any], path: Path) -> None:
    """Token hit rate per budget: the hybrid under each checkpoint policy and its attention layers
    alone (bars), as a PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    budgets = result["budgets"]
    names = [run["model"] for run in budgets[0]["runs"]]
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        rates = [100 * next(r["hit_rate"] for r in b["runs"] if r["model"] == name) for b in budgets]
        xs = [j + i * width for j in range(len(budgets))]
        ax.bar(xs, rates, width, label=name)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(budgets))])
    ax.set_xticklabels([f"B{round(100 * b['fraction'])}" for b in budgets])
    ax.set_ylabel("token hit rate (%)")
    ax.set_title(f"Mooncake {result['requests']} requests: hits per budget and checkpoint policy")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--trace",
        type=Path,
        default=None,
        help=f"Mooncake trace (default: shared/traces/{TRACE_NAME} in or beside the checkout)",
    )
    parser.add_argument("--max-requests", type=int, default=3000, help="replay the first N requests (3000)")
    parser.add_argument("--ms-per-step", type=float, default=DEFAULT_MS_PER_STEP, help="trace ms per step")
    parser.add_argument("--page-size", type=int, default=DEFAULT_PAGE_SIZE, help="requested page size (16)")
    parser.add_argument("--max-running", type=int, default=DEFAULT_MAX_RUNNING, help="max running requests")
    parser.add_argument(
        "--storage",
        choices=("arena", "equalized"),
        default="arena",
        help="arena: SPEC 13 storage (plan_arena, 16-token pages, state checkpoints every --grain "
        "tokens; the default); equalized: the SPEC 3 storage (plan_kv_memory's equal pages)",
    )
    parser.add_argument("--grain", type=int, default=64, help="state checkpoint grain G in tokens (64)")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument(
        "--plot",
        type=Path,
        default=None,
        help="write a PNG of the hit rates per budget and policy (matplotlib)",
    )
    parser.add_argument("--smoke", action="store_true", help="100 requests: does it run (CI)")
    args = parser.parse_args(argv)
    if args.plot is not None and not args.plot.parent.is_dir():
        parser.error(f"--plot: folder {args.plot.parent} does not exist")
    if args.smoke:
        args.max_requests = min(args.max_requests, 100)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        resolve_trace(args, parser, Path(folder))
        result = measure(args)
    result["total_seconds"] = round(time.perf_counter() - start, 2)
    report(result, args, format_table, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
