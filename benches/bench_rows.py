"""Per-step cost of persistent block-table rows vs a full table rewrite, on the slot API.

``R`` requests of a ``FlatKVCache`` decode one token per step on a full + sliding-window model
(page 16, window 1024) after a ``C``-token prompt. Every call takes the requests' slots (an
int64 array, the slots ``add_request`` returned). One step is what a scheduler loop calls once
per step:

- ``schedule(slots, ones)``: registers completed pages, reclaims the page that slid out of the
  window, acquires the next page slot;
- the tables: ``update_rows()`` (``rows``: only the cells that changed, returned as deltas;
  the sliding group's rows windowed, ``ceil((W + 1) / P) + 1`` = 66 columns with per-row
  offsets) or ``block_tables(slots, out=buffers)`` (``full``: a rewrite of ``[R, cols]`` per
  group, ``cols`` the full-history width, no rows bound);
- ``append_tokens(slots, tokens)``: the sampled tokens.

Run with a release build (``maturin develop --release`` or ``pip install .``)::

    python benches/bench_rows.py                 # R in 256, 1024, 4096 x C in 8k, 32k
    python benches/bench_rows.py --requests 256 --context 8192 --steps 2048
    python benches/bench_rows.py --calls --requests 256 --context 8192   # each per-step call alone
    python benches/bench_rows.py --smoke         # tiny sizes: does it run (CI), measures nothing

Targets (2-core machine): median step for 256 decoding requests on persistent rows (schedule +
update_rows + append_tokens) <= 10 us; per-step cost flat in context length.
"""

from __future__ import annotations

import os

# OpenBLAS worker threads spin-wait and steal the timed thread's core on a 2-core machine.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import statistics
import sys
import time
from typing import Any

import numpy as np
from flat_kvcache import FlatKVCache, KVCacheSpec

PAGE = 16
WINDOW = 1024
#: The two ways of writing a step's tables (see the module docstring).
MODES = {
    "rows": "slots: schedule + update_rows + append_tokens",
    "full": "slots: schedule + block_tables(out=) + append_tokens",
}
#: Columns of a windowed sliding row: the window plus one step's token, plus one slot.
WINDOW_COLS = -(-(WINDOW + 1) // PAGE) + 1


def prompt(n: int, seed: int) -> np.ndarray:
    """``n`` distinct-per-seed token ids as uint32 (no prefix sharing between requests)."""
    return ((np.arange(n, dtype=np.uint64) * 2654435761 + seed * 7919) % 151936).astype(np.uint32)


class Loop:
    """``requests`` requests after a ``context``-token prompt, decoding (named by their slots)."""

    def __init__(
        self,
        requests: int,
        context: int,
        steps: int,
        *,
        mode: str,
        lockstep: bool = False,
        window_cols: int = WINDOW_COLS,
    ) -> None:
        specs = [
            KVCacheSpec("full", PAGE, group_id="full"),
            KVCacheSpec("sliding_window", PAGE, WINDOW, "swa"),
        ]
        full_cols = -(-(context + PAGE + steps + 1) // PAGE)
        self.cache = FlatKVCache(specs, requests * (full_cols + 2) * 2 + 1)
        self.ones = np.ones(requests, dtype=np.int64)
        self.mode = mode
        incremental = mode == "rows"
        self.incremental = incremental
        if incremental:
            self.tables = {
                "full": np.zeros((requests, full_cols), np.int32),
                "swa": np.zeros((requests, window_cols), np.int32),
            }
            self.offsets = {"swa": np.zeros(requests, np.int32)}
            self.cache.bind_rows(self.tables, offsets=self.offsets)
        else:
            self.tables = {g: np.zeros((requests, full_cols), np.int32) for g in ("full", "swa")}
        # Prompt lengths spread over one page, so about 1 request in PAGE crosses a page
        # boundary each step, as in a running server (not all of them in the same step).
        # ``lockstep``: every prompt is ``context`` long, so all requests cross a page in the
        # same step and the other 15 steps of 16 change nothing (the median is such a step).
        spread = 1 if lockstep else PAGE
        lengths = np.array([context + r % spread for r in range(requests)], dtype=np.int64)
        slots = []
        for r in range(requests):
            slot, _ = self.cache.add_request(f"req-{r}", prompt(int(lengths[r]), r))
            slots.append(slot)
        #: The slots ``add_request`` returned (row ``s`` of the bound tables is slot ``s``).
        self.slots = np.array(slots, dtype=np.int64)
        assert self.cache.schedule(self.slots, lengths).all()
        assert self.cache.schedule(self.slots, np.zeros(requests, np.int64)).all()
        # The first sampled token, scheduled by the first step.
        self.cache.append_tokens(self.slots, np.zeros(requests, np.uint32))
        self.token = 0
        self.cells = 0
        self.write_tables()

    def write_tables(self) -> None:
        if self.incremental:
            cells, _ = self.cache.update_rows()
            self.cells += sum(a.shape[1] for a in cells.values())
        else:
            self.cache.block_tables(self.slots, out=self.tables)

    def step(self) -> tuple[int, int, int]:
        """One step; ns spent in schedule, tables and append."""
        tokens = np.full(len(self.slots), self.token % 151936, np.uint32)
        t0 = time.perf_counter_ns()
        scheduled = self.cache.schedule(self.slots, self.ones)
        t1 = time.perf_counter_ns()
        self.write_tables()
        t2 = time.perf_counter_ns()
        self.cache.append_tokens(self.slots, tokens)
        t3 = time.perf_counter_ns()
        assert scheduled.all()
        self.token += 1
        return t1 - t0, t2 - t1, t3 - t2


def run(
    requests: int,
    context: int,
    steps: int,
    *,
    mode: str,
    lockstep: bool = False,
    window_cols: int = WINDOW_COLS,
) -> dict[str, Any]:
    loop = Loop(requests, context, steps + PAGE, mode=mode, lockstep=lockstep, window_cols=window_cols)
    for _ in range(PAGE):  # warm-up: one page's worth of steps
        loop.step()
    loop.cells = 0
    parts = [loop.step() for _ in range(steps)]
    loop.cache.check_invariants()
    if loop.incremental:
        # The rows are exact: compare with a full block_tables of every slot (row s = slot s).
        assert (loop.slots == np.arange(requests)).all()
        full = loop.cache.block_tables(loop.slots)
        np.testing.assert_array_equal(loop.tables["full"][:, : full["full"].shape[1]], full["full"])
        offsets = loop.offsets["swa"]
        for r, row in enumerate(full["swa"]):
            n, off = int((row != -1).sum()), int(offsets[r])
            np.testing.assert_array_equal(loop.tables["swa"][r][: n - off], row[off:n])
    med = [statistics.median(p[i] for p in parts) / 1e3 for i in range(3)]
    return {
        "schedule": med[0],
        "tables": med[1],
        "append": med[2],
        "step": statistics.median(sum(p) for p in parts) / 1e3,
        "mean": statistics.mean(sum(p) for p in parts) / 1e3,
        "cells": loop.cells / steps,
    }


def batch_calls(requests: int, context: int, repeats: int) -> dict[str, tuple[float, float]]:
    """Each per-step call alone, ``repeats`` times on ``requests`` decoding requests, with the
    slots and counts as int64 numpy arrays and as Python lists: min and median in us. No token
    is scheduled, so only the per-call and per-slot overhead is timed (no page is taken or
    written); each ``append_tokens`` adds one token per request."""
    loop = Loop(requests, context, 4 * repeats + PAGE, mode="rows")
    cache, slots = loop.cache, loop.slots
    slot_list = slots.tolist()
    zeros = np.zeros(requests, np.int64)
    zero_list = zeros.tolist()
    tokens = np.zeros(requests, np.uint32)
    token_list = tokens.tolist()
    calls = {
        "schedule(slots array, zeros array)": lambda: cache.schedule(slots, zeros),
        "schedule(slots list, zeros list)": lambda: cache.schedule(slot_list, zero_list),
        "append_tokens(slots array, tokens array)": lambda: cache.append_tokens(slots, tokens),
        "append_tokens(slots list, tokens list)": lambda: cache.append_tokens(slot_list, token_list),
    }
    out = {}
    for name, call in calls.items():
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter_ns()
            call()
            times.append(time.perf_counter_ns() - t0)
        out[name] = (min(times) / 1e3, statistics.median(times) / 1e3)
    loop.cache.check_invariants()
    return out


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, nargs="*", default=[256, 1024, 4096])
    parser.add_argument("--context", type=int, nargs="*", default=[8192, 32768])
    parser.add_argument("--steps", type=int, default=0, help="timed steps per run (default: by size)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes; measures nothing")
    parser.add_argument(
        "--window-cols",
        type=int,
        default=WINDOW_COLS,
        help=f"columns of a windowed sliding row (default {WINDOW_COLS}, the minimum for 1-token steps; "
        "wider rows move their offset less often)",
    )
    parser.add_argument(
        "--lockstep",
        action="store_true",
        help="equal prompt lengths: all requests cross a page in the same step (default: spread)",
    )
    parser.add_argument(
        "--calls",
        action="store_true",
        help="time each per-step call alone instead (slot arrays vs lists, no token scheduled): "
        "min and median",
    )
    args = parser.parse_args(argv)
    if args.smoke:
        args.requests, args.context, args.steps = [8], [256], 32
    print(f"cpu cores: {os.cpu_count()}, python {sys.version.split()[0]}; page {PAGE}, window {WINDOW}")
    if args.calls or args.smoke:
        print("| requests | context | call | min | median |")
        print("|---|---|---|---|---|")
        for requests in args.requests:
            for context in args.context:
                repeats = args.steps or 1000
                for name, (low, mid) in batch_calls(requests, context, repeats).items():
                    print(f"| {requests} | {context} | `{name}` | {low:.2f} us | {mid:.2f} us |", flush=True)
        if args.calls:
            return
    print("| requests | context | calls | step median | mean | schedule | tables | append | cells/step |")
    print("|---|---|---|---|---|---|---|---|---|")
    for requests in args.requests:
        for context in args.context:
            steps = args.steps or max(64, 2 * 262144 // requests)
            for mode, label in MODES.items():
                start = time.perf_counter()
                r = run(
                    requests, context, steps, mode=mode, lockstep=args.lockstep, window_cols=args.window_cols
                )
                print(
                    f"| {requests} | {context} | {label} | **{r['step']:.1f} us** | {r['mean']:.1f} us | "
                    f"{r['schedule']:.1f} us | "
                    f"{r['tables']:.1f} us | {r['append']:.1f} us | {r['cells']:.0f} |",
                    flush=True,
                )
                print(f"    ({steps} steps, {time.perf_counter() - start:.1f} s with setup)", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1:])
