"""Per-step cost of ``FlatKVCache``'s slot API (target and results: benches/README.md).

256 running decode requests on a full + sliding-window model (page 16, window 1024, 2048-token
prompts), named by the slots ``add_request`` returned (an int64 array). One step is what a
scheduler loop calls once per step:

- ``schedule(slots, ones)``: one native call registers each completed page, reclaims the page
  that slid out of the window and acquires the next page slot, for all 256 requests;
- ``block_tables(slots, out=buffers)``: writes both groups' ``[256, cols]`` int32 tables into
  preallocated buffers (``cols`` = 145, the capture width for a 2304-token context).

The target (median <= 50 us per step on the 2-core machine) is for those two calls. Handing
the 256 sampled tokens to the cache is measured and reported separately, both ways: 256
one-slot ``append_tokens([slot], [token])`` calls (odd steps) and one
``append_tokens(slots, tokens)`` call for all of them (even steps).

Run as a script (build first with ``maturin develop --release``)::

    python benches/bench_step.py            # full run
    python benches/bench_step.py --quick    # fewer steps
    python benches/bench_step.py --smoke    # a few steps: does it run (CI), measures nothing
    python benches/bench_step.py --torch    # torch CPU tensors as the out= buffers

or through pytest-benchmark (``pytest benches/bench_step.py``; ``--benchmark-disable`` for a
one-shot smoke run).
"""

from __future__ import annotations

import os

# OpenBLAS worker threads spin-wait and steal the timed thread's core on a 2-core machine.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import statistics
import sys
import time
from typing import Any

import numpy as np
from bench_engine import DECODE_PAGES, PAGE, PROMPT, REQUESTS, STEPS, decode_specs  # the same decode scenario
from flat_kvcache import FlatKVCache

#: Capture width of the longest context in the run (SPEC 2: ceil((C + 1) / P)).
COLS = -(-(PROMPT + STEPS + 1) // PAGE)


def prompt_tokens(n: int, seed: int) -> list[int]:
    """``n`` distinct-per-seed token ids (no prefix sharing between requests)."""
    return [(i * 2654435761 + seed * 7919) % 151936 for i in range(n)]


class StepLoop:
    """256 requests decoding one token per step, named by their slots."""

    def __init__(self, *, use_torch: bool = False) -> None:
        self.cache = FlatKVCache(decode_specs(), DECODE_PAGES)
        self.reqs = [f"req-{r}" for r in range(REQUESTS)]
        #: The slots of the running requests (set by :meth:`admit`).
        self.slots = np.zeros(0, dtype=np.int64)
        self.ones = np.ones(REQUESTS, dtype=np.int64)
        self.out: dict[str, Any]
        if use_torch:
            import torch

            self.out = {g: torch.zeros((REQUESTS, COLS), dtype=torch.int32) for g in ("full", "swa")}
        else:
            self.out = {g: np.zeros((REQUESTS, COLS), dtype=np.int32) for g in ("full", "swa")}
        self.steps_left = 0
        self.rounds = 0
        self.next_token = 0
        self.admit()

    def admit(self) -> None:
        """(Re)admit every request: add its prompt and prefill it in one schedule call."""
        if len(self.slots):
            self.cache.finish(self.slots)
        slots = []
        for r, req in enumerate(self.reqs):
            # New prompts every round: no prefix hits, the same work every round.
            slot, hit = self.cache.add_request(req, prompt_tokens(PROMPT, self.rounds * REQUESTS + r))
            assert hit == 0
            slots.append(slot)
        self.slots = np.array(slots, dtype=np.int64)
        assert self.cache.schedule(self.slots, [PROMPT] * REQUESTS).all()
        # The prefill's pages are registered by the next schedule at c = 2048; do it here, as
        # part of admission, so the timed decode steps are decode steps only.
        assert self.cache.schedule(self.slots, [0] * REQUESTS).all()
        self.steps_left = STEPS
        self.rounds += 1

    def append(self, *, batch: bool = False) -> None:
        """Hand each request the token it sampled last step: one one-slot ``append_tokens``
        call per request, or one ``append_tokens`` call for all of them."""
        token = self.next_token % 151936
        if batch:
            self.cache.append_tokens(self.slots, [token] * REQUESTS)
        else:
            append = self.cache.append_tokens
            for slot in self.slots.tolist():
                append([slot], [token])
        self.next_token += 1

    def schedule(self) -> None:
        scheduled = self.cache.schedule(self.slots, self.ones)
        assert scheduled.all()

    def tables(self) -> None:
        self.cache.block_tables(self.slots, out=self.out)

    def ensure_room(self) -> None:
        if self.steps_left == 0:
            self.admit()
        self.steps_left -= 1


def measure(loop: StepLoop, steps: int) -> dict[str, list[int]]:
    """Per-step ns of each part over ``steps`` steps (``boundary``: the steps that cross a
    page boundary, which register, reclaim and allocate a page per group per request)."""
    names = ("append", "append_batch", "schedule", "tables", "step", "boundary")
    parts: dict[str, list[int]] = {name: [] for name in names}
    for i in range(steps):
        loop.ensure_room()
        batch = i % 2 == 0
        t0 = time.perf_counter_ns()
        loop.append(batch=batch)
        t1 = time.perf_counter_ns()
        loop.schedule()
        t2 = time.perf_counter_ns()
        loop.tables()
        t3 = time.perf_counter_ns()
        parts["append_batch" if batch else "append"].append(t1 - t0)
        parts["schedule"].append(t2 - t1)
        parts["tables"].append(t3 - t2)
        parts["step"].append(t3 - t1)
        if loop.cache.num_computed_tokens(int(loop.slots[0])) % PAGE == 1:
            parts["boundary"].append(t3 - t1)
    return parts


def main(argv: list[str]) -> None:
    steps = 16 if "--smoke" in argv else 512 if "--quick" in argv else 4096
    use_torch = "--torch" in argv
    loop = StepLoop(use_torch=use_torch)
    measure(loop, STEPS)  # warm-up: one whole round
    m = measure(loop, steps)
    us = {name: statistics.median(values) / 1e3 for name, values in m.items()}
    ordered = sorted(m["step"])
    mean = statistics.mean(ordered) / 1e3
    p99 = ordered[int(len(ordered) * 0.99)] / 1e3
    buffers = "torch CPU tensors" if use_torch else "numpy arrays"
    print(f"cpu cores: {os.cpu_count()}, python {sys.version.split()[0]}, out= {buffers}, {steps} steps")
    print("| benchmark | target | measured |")
    print("|---|---|---|")
    name = "schedule(slots) + block_tables(slots, out=), 256 decode requests, median"
    print(f"| {name} | <= 50 us | {us['step']:.1f} us |")
    print(f"|   of which schedule(slots) | | {us['schedule']:.1f} us |")
    print(f"|   of which block_tables(out=) (2 x 256 x {COLS} int32) | | {us['tables']:.1f} us |")
    print(f"| same, mean over all steps / p99 | | {mean:.1f} us / {p99:.1f} us |")
    print(f"| same, median of the 1-in-{PAGE} page-boundary steps | | {us['boundary']:.1f} us |")
    print(f"| 256 one-slot append_tokens calls (median, not in the target) | | {us['append']:.1f} us |")
    batch_name = "one append_tokens(slots) call, 256 tokens (median, not in the target)"
    print(f"| {batch_name} | | {us['append_batch']:.1f} us |")
    loop.cache.check_invariants()


# ----- pytest-benchmark entry points -------------------------------------------------------------


def test_step_schedule_and_block_tables_out(benchmark: Any) -> None:
    """The timed part is the target's: schedule + block_tables(out=); appends are setup."""
    loop = StepLoop()

    def setup() -> None:
        loop.ensure_room()
        loop.append()

    def step() -> None:
        loop.schedule()
        loop.tables()

    benchmark.pedantic(step, setup=setup, rounds=500, iterations=1, warmup_rounds=10)
    loop.cache.check_invariants()
    assert (loop.out["full"][:, 0] > 0).all()


if __name__ == "__main__":
    main(sys.argv[1:])
