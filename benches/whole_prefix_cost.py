"""What whole hybrid prefixes (SPEC 13.8c, the ``reuse`` policy) cost on long conversations.

At a request's finish the ``reuse`` policy remembers the path of each checkpoint it kept, and
when a checkpoint leaves the cache it forgets it. Counting every whole path costs the whole
prompt per finish: on a conversation whose tenth turn resumes 90 k tokens deep, that is the 90 k
tokens again, though the request computed only its last few hundred. The native engine keeps
the paths as a radix tree (``rust/core/src/engine/prefixes.rs``): one comparison per page, hash-map
work per node only. This bench shows the difference where it is largest: a synthetic trace in
the Mooncake format (used for cost only; the hit-rate figures come from the real trace, in
``hybrid_hits.py``) of 8 conversations of 60 turns, each turn extending the previous prompt by
two 512-token blocks from 32 k tokens (to 93 k), over an arena that holds them all.

It runs ``flat-kvcache simulate`` on the ``qwen3.5-like`` preset with ``--eviction-policy lru``
and ``reuse`` in turn (A B A B, ``--runs`` pairs), and prints the median cache time in all and
per call, and reuse / lru. Run with a release build (``maturin develop --release``)::

    python benches/whole_prefix_cost.py [--runs 3] [--json]
    python benches/whole_prefix_cost.py --smoke      # 2 conversations of 4 turns (CI)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

#: The arena: 324 GiB (holds every conversation; nothing is evicted).
ARENA_BYTES = 347_835_727_872
BLOCK = 512
#: What the report compares.
CALLS = ("total", "finish", "schedule")


def write_trace(path: Path, conversations: int, turns: int, first_blocks: int) -> None:
    """Conversations whose turns extend the previous prompt by two blocks, 2 s apart."""
    rows: list[dict[str, Any]] = []
    next_id = 0
    for c in range(conversations):
        ids = list(range(next_id, next_id + first_blocks))
        next_id += first_blocks
        for t in range(turns):
            ids += [next_id, next_id + 1]
            next_id += 2
            rows.append(
                {
                    "timestamp": t * 2000 + c * 50,
                    "input_length": BLOCK * len(ids) - 100,
                    "output_length": 64,
                    "hash_ids": list(ids),
                }
            )
    rows.sort(key=lambda r: r["timestamp"])
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def run_once(trace: Path, policy: str) -> dict[str, Any]:
    command = [
        sys.executable, "-m", "flat_kvcache", "simulate", "--preset", "qwen3.5-like",
        "--trace", str(trace), "--arena", str(ARENA_BYTES), "--eviction-policy", policy, "--json",
    ]  # fmt: skip
    out = subprocess.run(command, check=True, capture_output=True, text=True, env=os.environ.copy())
    summary: dict[str, Any] = json.loads(out.stdout)
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="A B pairs (3)")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--smoke", action="store_true", help="2 conversations of 4 turns, 1 pair")
    args = parser.parse_args()
    if args.runs < 1:
        parser.error(f"--runs must be at least 1, got {args.runs}")
    conversations, turns, runs = (2, 4, 1) if args.smoke else (8, 60, args.runs)
    times: dict[str, list[dict[str, float]]] = {"lru": [], "reuse": []}
    hits: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "conversations.jsonl"
        write_trace(trace, conversations, turns, first_blocks=64)
        for i in range(runs):
            for policy in ("lru", "reuse"):
                print(f"run {i + 1}/{runs}: {policy}", file=sys.stderr, flush=True)
                summary = run_once(trace, policy)
                timing = summary["timing"]
                times[policy].append({"total": timing["cache_total_ms"], **timing["by_call_ms"]})
                hits[policy] = summary["prefix_hit_rate"]
    medians = {p: {k: statistics.median(r[k] for r in rows) for k in rows[0]} for p, rows in times.items()}
    ratio = {k: medians["reuse"][k] / medians["lru"][k] for k in CALLS}
    result = {
        "conversations": conversations,
        "turns": turns,
        "runs": runs,
        "hit_rate": hits,
        "median_ms": medians,
        "reuse_over_lru": ratio,
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{conversations} conversations x {turns} turns, {runs} pairs; hit rate {hits['reuse']:.2%}")
    print("| policy | cache total ms | finish ms | schedule ms |")
    print("|---|---|---|---|")
    for p in ("lru", "reuse"):
        m = medians[p]
        print(f"| {p} | {m['total']:.1f} | {m['finish']:.1f} | {m['schedule']:.1f} |")
    print("reuse / lru: " + ", ".join(f"{k} {ratio[k]:.2f}" for k in CALLS))


if __name__ == "__main__":
    main()
