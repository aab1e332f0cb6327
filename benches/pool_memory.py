"""Host memory of the engine's bookkeeping per page id: the plain pool against an arena.

Each case builds one ``FlatKVCache`` in a fresh Python process and reads the process's resident
memory (``/proc/self/statm``) before and after; the difference over the cache's page ids is
the bookkeeping one id costs (reference counts, free-list links, the key slot and the key map
of the plain pool; over an arena also each id's unit and group, the per-group page lists and
the time a cached page was released). Nothing is allocated by the cache after construction,
so the figure is what an idle engine holds.

    python benches/pool_memory.py              # 8 M page ids a case
    python benches/pool_memory.py --ids 1000000 --json

Cases: ``plain`` (one full-attention group, ``num_pages = ids``); ``arena-2`` (a full group of
16-token pages beside a state group, the state units a tiny share of the ids: the Qwen3.5
shape); ``arena-3`` (two page groups, full and sliding, and a state group).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Sequence

#: Each case's body, run in its own interpreter with ``IDS`` set: it prints the page ids the
#: cache built and the resident bytes it added.
_CASE = r"""
import os, sys
import flat_kvcache as fk

def resident() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

IDS = int(sys.argv[2])
case = sys.argv[1]
full = fk.KVCacheSpec("full", 16, group_id="full")
before = resident()
if case == "plain":
    cache = fk.FlatKVCache([full], IDS)
    ids = IDS
else:
    groups = [("full", 1)] if case == "arena-2" else [("full", 1), ("swa", 1)]
    # A unit of 64 pages of every page group (64 * page bytes of 1) plus a state slot as large.
    per_unit = 64
    units = IDS // (per_unit * len(groups)) + 1
    plan_groups = [fk.ArenaGroup(g, "pages", 1, per_unit, units * per_unit, 0) for g, _ in groups]
    plan_groups.append(fk.ArenaGroup("s", "state", per_unit, 1, units, 0))
    plan = fk.ArenaPlan(16, 1, per_unit, units, tuple(plan_groups), ())
    specs = [fk.KVCacheSpec("full", 16, group_id=g) for g, _ in groups]
    if case == "arena-3":
        specs[1] = fk.KVCacheSpec("sliding_window", 16, 1024, "swa")
    specs.append(fk.KVCacheSpec("state", 64, group_id="s"))
    cache = fk.FlatKVCache(specs, arena=plan)
    ids = sum(g.num_ids for g in plan_groups)
print(ids, resident() - before)
"""

CASES = ("plain", "arena-2", "arena-3")


def measure(case: str, ids: int) -> dict[str, float]:
    """Resident bytes per page id of ``case`` with about ``ids`` page ids."""
    out = subprocess.run(
        [sys.executable, "-c", _CASE, case, str(ids)],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONHASHSEED": "0"},
    ).stdout.split()
    built, added = int(out[0]), int(out[1])
    return {"ids": built, "bytes": added, "bytes_per_id": added / built}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ids", type=int, default=8_000_000, help="page ids a case (default 8,000,000)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--smoke", action="store_true", help="one tiny run of each case (CI)")
    args = parser.parse_args(argv)
    if args.ids < 1000:
        parser.error(f"--ids must be >= 1000, got {args.ids}")
    ids = 20_000 if args.smoke else args.ids
    results = {}
    for case in CASES:
        print(f"{case}: building {ids:,} page ids ...", file=sys.stderr, flush=True)
        results[case] = measure(case, ids)
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    print("| case | page ids | resident bytes | bytes per id |")
    print("|---|---|---|---|")
    for case, r in results.items():
        print(f"| {case} | {r['ids']:,} | {r['bytes']:,} | {r['bytes_per_id']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
