"""Prefix-hit tokens of a GDN hybrid through vLLM 0.33's own scheduler: stock vs FlatScheduler.

Replays a multi-turn trace (the Mooncake conversation trace) through vLLM's real scheduler on the
CPU with no model (``flat_kvcache.vllm.harness``: vLLM's configs, fake model outputs), for a
Qwen3.5-like GDN hybrid (three GDN layers to one full-attention layer, 8 layers: three
``MambaSpec`` groups in mode "align" and one full-attention group, built by vLLM's own config
steps), in one KV budget where stock vLLM evicts, under four schedulers:

* ``stock-dense``: vLLM's ``AsyncScheduler``, ``prefix_cache_retention_interval=None`` (every
  chunk-end and decode block state keyed);
* ``stock-default``: the same with vLLM's default sparse retention 0 (the replay boundary and the
  shared-prefix junction keyed);
* ``flat-vllm``: ``FlatScheduler``, option off (``mamba_checkpoints="vllm"``), retention 0: every
  request's hit must equal ``stock-default``'s (asserted: the adapter makes vLLM's decisions);
* ``flat-reuse``: ``FlatScheduler`` with ``additional_config={"flat_kvcache":
  {"mamba_checkpoints": "reuse"}}`` (docs/vllm.md), retention 0.

The trace: the first ``--num-requests`` rows; each ``hash_id`` is 512 deterministic token ids
(seeded by the id), the prompt is the blocks concatenated and cut at ``input_length``; the output
is ``output_length`` tokens (``ignore_eos``), capped at ``--max-output-tokens``. Arrivals: the
row's timestamp (ms) mapped to a scheduler step at ``--ms-per-step`` ms of trace time per step
(a fixed step duration, not a measured one). The budget: ``--budget`` (a fraction, default 0.5)
of the unique prompt tokens the replayed rows name (``U * 512``), as 64-token blocks, the same
block ids for every scheduler (a hybrid block id serves one group: full-attention pages and
mamba states alike); printed. At 0.1 nothing of a conversation survives to its next turn (a
median 217 requests later) under any of the four, so 0.5 is the default: stock still evicts.

Reported per scheduler: prefix-hit tokens (vLLM's ``num_cached_tokens`` of each request, at its
first scheduling) over prompt tokens, for the whole replay and for the requests of its first
10 %, 25 % and 50 % (by arrival), and the ratio ``flat-reuse / stock-default``. A second workload
(``--workload agent``: sessions whose next call is the previous call's prompt, its output and a
tool result, the shape where decode checkpoints pay) and a third (``make_stream``: the
differential tests' shared-prefix stream) run the same four schedulers so that nothing is fitted
to one trace.

Runs in the vLLM 0.33 side venv (docs/vllm.md)::

    PYTHONPATH=python /tmp/vllm-side/bin/python benches/vllm_trace_hits.py            # N = 1,000
    PYTHONPATH=python /tmp/vllm-side/bin/python benches/vllm_trace_hits.py --smoke    # seconds
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
# The tiny model's config says 32,768 positions; the trace's prompts run to 122k tokens. No model
# runs here, so vLLM's length check is lifted.
os.environ.setdefault("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")

import argparse
import json
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from flat_kvcache.vllm import FlatScheduler
from flat_kvcache.vllm.harness import (
    VOCAB,
    SchedulerSetup,
    StreamRequest,
    build_scheduler,
    make_stream,
    run_steps,
    sampled_token,
    tiny_model_dir,
)
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # type: ignore[import-not-found]

TRACE_BLOCK = 512  # tokens per Mooncake hash id
QWEN35_LAYERS = ("linear_attention", "linear_attention", "linear_attention", "full_attention") * 2
REUSE = {"flat_kvcache": {"mamba_checkpoints": "reuse"}}
# name -> (scheduler class, prefix_cache_retention_interval, additional_config)
SCHEDULERS: dict[str, tuple[type, int | None, dict[str, Any] | None]] = {
    "stock-dense": (AsyncScheduler, None, None),
    "stock-default": (AsyncScheduler, 0, None),
    "flat-vllm": (FlatScheduler, 0, None),
    "flat-reuse": (FlatScheduler, 0, REUSE),
}
PREFIXES = (0.10, 0.25, 0.50, 1.0)


def _default_trace() -> Path:
    here = Path(__file__).resolve().parent.parent
    for candidate in (here / "shared/traces", here.parent / "shared/traces"):
        path = candidate / "mooncake_conversation.jsonl"
        if path.exists():
            return path
    return Path("/work/shared/traces/mooncake_conversation.jsonl")


def _block_tokens(hash_id: int, cache: dict[int, list[int]]) -> list[int]:
    tokens = cache.get(hash_id)
    if tokens is None:
        rng = np.random.default_rng(hash_id)
        tokens = cache[hash_id] = rng.integers(0, VOCAB, TRACE_BLOCK).tolist()
    return tokens


def trace_stream(
    path: Path, num_requests: int, ms_per_step: float, max_output: int
) -> tuple[list[StreamRequest], int]:
    """The first ``num_requests`` rows as a stream, and the unique prompt tokens they name."""
    cache: dict[int, list[int]] = {}
    stream = []
    unique: set[int] = set()
    with path.open() as rows:
        for i, line in enumerate(rows):
            if i >= num_requests:
                break
            row = json.loads(line)
            prompt: list[int] = []
            for hash_id in row["hash_ids"]:
                prompt.extend(_block_tokens(hash_id, cache))
            prompt = prompt[: row["input_length"]]
            unique.update(row["hash_ids"])
            stream.append(
                StreamRequest(
                    f"t{i}",
                    int(row["timestamp"] / ms_per_step),
                    tuple(prompt),
                    max(1, min(row["output_length"], max_output)),
                )
            )
    return stream, len(unique) * TRACE_BLOCK


def unique_tokens(stream: list[StreamRequest], block: int = 64) -> int:
    """The prompt tokens of ``stream`` with every shared prefix counted once (by ``block``-token
    blocks of each prompt's chain)."""
    seen: set[int] = set()
    for request in stream:
        chain = 0
        prompt = request.prompt
        for start in range(0, len(prompt), block):
            chain = hash((chain, prompt[start : start + block]))
            seen.add(chain)
    return len(seen) * block


def agent_stream(num_requests: int, seed: int, max_output: int) -> list[StreamRequest]:
    """Agent sessions: a system prompt (one of 4), a task, then calls whose prompt is the previous
    call's prompt, its output (the fake model's tokens, ``harness.sampled_token``) and a tool
    result; the next call arrives a few hundred steps after the previous one."""
    rng = random.Random(seed)
    systems = [[rng.randrange(VOCAB) for _ in range(rng.randint(400, 1500))] for _ in range(4)]
    stream: list[StreamRequest] = []
    session = 0
    start = 0
    while len(stream) < num_requests:
        prompt = list(rng.choice(systems)) + [rng.randrange(VOCAB) for _ in range(rng.randint(200, 2000))]
        arrival = start
        for _ in range(rng.randint(2, 10)):
            if len(stream) >= num_requests:
                break
            rid = f"a{session}-{len(stream)}"
            out = rng.randint(20, max_output)
            stream.append(StreamRequest(rid, arrival, tuple(prompt), out))
            tool = [rng.randrange(VOCAB) for _ in range(rng.randint(50, 800))]
            prompt = prompt + [sampled_token(rid, k) for k in range(out)] + tool
            arrival += rng.randint(out + 20, out + 400)
        session += 1
        start += rng.randint(5, 40)
    stream.sort(key=lambda r: r.arrival_step)
    return stream


@dataclass
class Result:
    hits: dict[str, int]  # request id -> hit tokens at its first scheduling
    steps: int
    seconds: float


def replay(cls: type, setup: SchedulerSetup, stream: list[StreamRequest]) -> Result:
    scheduler = build_scheduler(cls, setup)
    hits: dict[str, int] = {}
    steps = 0
    began = time.perf_counter()
    for output in run_steps(scheduler, stream, block_size=setup.block_size):
        steps += 1
        for new in output.scheduled_new_reqs:
            hits.setdefault(new.req_id, new.num_computed_tokens)
    return Result(hits, steps, time.perf_counter() - began)


def fractions(stream: list[StreamRequest], hits: dict[str, int]) -> list[tuple[int, int]]:
    """(hit tokens, prompt tokens) over the first 10 %, 25 %, 50 %, 100 % of the stream's requests."""
    order = sorted(stream, key=lambda r: (r.arrival_step, r.request_id))
    out = []
    for share in PREFIXES:
        head = order[: max(1, round(len(order) * share))]
        out.append((sum(hits.get(r.request_id, 0) for r in head), sum(len(r.prompt) for r in head)))
    return out


def run_workload(
    name: str, stream: list[StreamRequest], unique: int, args: argparse.Namespace, model_dir: Path
) -> dict[str, Any]:
    block = args.block_size
    longest = max(len(r.prompt) + r.max_tokens for r in stream)
    max_model_len = -(-longest // block) * block + block
    # vLLM refuses a pool that cannot hold its longest request twice over (its config check):
    # small runs get that floor instead of the budget.
    num_blocks = max(int(unique * args.budget) // block, 2 * (max_model_len // block) + 16)
    print(
        f"\n## {name}: {len(stream)} requests, {sum(len(r.prompt) for r in stream):,} prompt tokens, "
        f"{unique:,} unique tokens; budget {args.budget:.0%} of them = {num_blocks:,} blocks of "
        f"{block} tokens ({num_blocks * block:,} tokens of block ids)",
        flush=True,
    )
    results: dict[str, Result] = {}
    for label, (cls, retention, extra) in SCHEDULERS.items():
        setup = SchedulerSetup(
            model_dir=model_dir,
            layer_types=QWEN35_LAYERS,
            block_size=block,
            num_blocks=num_blocks,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=max_model_len,
            prefix_cache_retention_interval=retention,
            additional_config=extra,
            log_stats=False,
        )
        results[label] = replay(cls, setup, stream)
        print(f"  {label}: {results[label].steps:,} steps, {results[label].seconds:.1f} s", flush=True)
    same = results["flat-vllm"].hits == results["stock-default"].hits
    assert same and results["flat-vllm"].steps == results["stock-default"].steps, (
        "FlatScheduler with the option off made other decisions than vLLM's manager"
    )
    table: dict[str, Any] = {"workload": name, "num_blocks": num_blocks, "block_size": block, "rows": {}}
    print(f"\n| {name}: hit tokens / prompt tokens | first 10 % | first 25 % | first 50 % | all |")
    print("|---|---|---|---|---|")
    base = fractions(stream, results["stock-default"].hits)
    for label, result in results.items():
        parts = fractions(stream, result.hits)
        table["rows"][label] = [{"hit": h, "prompt": p} for h, p in parts]
        cells = [f"{h:,} ({h / p:.1%})" for h, p in parts]
        print(f"| {label} | " + " | ".join(cells) + " |")
    # None where stock's default hit nothing on that prefix of the replay (no ratio; JSON null).
    ratios = [
        (h / b if b else None)
        for (h, _), (b, _) in zip(fractions(stream, results["flat-reuse"].hits), base, strict=True)
    ]
    table["reuse_over_stock_default"] = ratios
    shown = ["-" if r is None else f"{r:.2f}x" for r in ratios]
    print("| flat-reuse / stock-default | " + " | ".join(shown) + " |")
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, default=_default_trace())
    parser.add_argument("--num-requests", type=int, default=1000)
    parser.add_argument("--budget", type=float, default=0.5, help="pool size: this share of unique tokens")
    parser.add_argument("--ms-per-step", type=float, default=50.0, help="trace ms per scheduler step")
    parser.add_argument("--max-output-tokens", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--workload", choices=["trace", "agent", "stream", "all"], default="all")
    parser.add_argument("--json", type=Path, help="write the tables here")
    parser.add_argument("--smoke", action="store_true", help="a tiny run: does it work")
    args = parser.parse_args(argv)
    if args.smoke:
        args.num_requests = min(args.num_requests, 60)
        args.max_output_tokens = min(args.max_output_tokens, 32)
    tables = []
    with tempfile.TemporaryDirectory() as folder:
        model_dir = tiny_model_dir(Path(folder))
        if args.workload in ("trace", "all"):
            stream, unique = trace_stream(
                args.trace, args.num_requests, args.ms_per_step, args.max_output_tokens
            )
            tables.append(run_workload("mooncake conversation trace", stream, unique, args, model_dir))
        if args.workload in ("agent", "all"):
            stream = agent_stream(args.num_requests, seed=7, max_output=min(args.max_output_tokens, 400))
            tables.append(
                run_workload("agent sessions (synthetic)", stream, unique_tokens(stream), args, model_dir)
            )
        if args.workload in ("stream", "all"):
            stream = make_stream(args.num_requests, seed=11)
            tables.append(
                run_workload(
                    "harness make_stream (shared prefixes)", stream, unique_tokens(stream), args, model_dir
                )
            )
    if args.json is not None:
        args.json.write_text(json.dumps(tables, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
