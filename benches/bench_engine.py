"""Python-side benchmarks of the native page engine (targets and results: benches/README.md).

Run as a script for the target table (build first with ``maturin develop --release``)::

    python benches/bench_engine.py            # full run
    python benches/bench_engine.py --quick    # fewer repeats
    python benches/bench_engine.py --smoke    # a few repeats: does it run (CI), measures nothing

or through pytest-benchmark (``pytest benches/bench_engine.py``; add ``--benchmark-disable``
for a one-shot smoke run). Timings are wall-clock medians of repeated runs on whatever
machine runs them; the script prints the machine's core count next to them.
"""

from __future__ import annotations

import functools
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from flat_kvcache.engine import BlockPool, KVCacheSpec, PageCache, hash_pages

PAGE = 16
REQUESTS = 256
PROMPT = 2048
WINDOW = 1024
STEPS = 256


#: The decode scenario's pool: pages for every request's whole run in both groups (page 0 is
#: the null page).
DECODE_PAGES = REQUESTS * (PROMPT + STEPS + PAGE) // PAGE * 2 + 1


def decode_specs() -> list[KVCacheSpec]:
    """The decode scenario's groups: full attention plus a ``WINDOW``-token sliding window."""
    return [
        KVCacheSpec("full", PAGE, group_id="full"),
        KVCacheSpec("sliding_window", PAGE, WINDOW, "swa"),
    ]


def decode_cache() -> PageCache:
    """The decode scenario's page-level cache (:func:`decode_specs`, ``DECODE_PAGES``)."""
    return PageCache(decode_specs(), DECODE_PAGES)


def _median_ns(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of ``fn()`` in nanoseconds over ``repeats`` runs (after one warm-up)."""
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        fn()
        samples.append(time.perf_counter_ns() - start)
    return statistics.median(samples)


# ----- scenarios ---------------------------------------------------------------------------------


def pool_cycle(pool: Any, n: int) -> None:
    """Allocate ``n`` pages and free them again."""
    pool.free(pool.allocate(n))


def prompt_tokens(n: int, seed: int = 0) -> np.ndarray:
    return ((np.arange(n, dtype=np.uint64) * 2654435761 + seed) % 151936).astype(np.uint32)


def cached_full_cache(pages: int) -> tuple[Any, list[str]]:
    """A full-attention cache whose pool holds a freed (still cached) ``pages``-page prompt."""
    hashes = hash_pages(prompt_tokens(pages * PAGE), PAGE)
    cache = PageCache([KVCacheSpec("full", PAGE)], 4 * pages)
    assert cache.acquire("warm", pages * PAGE)
    cache.register("warm", hashes)
    cache.free("warm")
    assert cache.match_prefix(hashes).num_hit_pages == [pages]
    return cache, hashes


class DecodeLoop:
    """256 requests with a 2048-token prompt on a full + sliding-window (W = 1024) model.

    One step calls ``decode_step`` once per request from Python (registering the page the
    previous step completed, every 16th step) and then ``block_tables`` for the batch.
    """

    def __init__(self) -> None:
        self.cache = decode_cache()
        self.reqs = [f"req-{r}" for r in range(REQUESTS)]
        self.hashes = [hash_pages(prompt_tokens(PROMPT + STEPS, r), PAGE) for r in range(REQUESTS)]
        self.computed = 0
        self.admit()

    def admit(self) -> None:
        empty = self.cache.match_prefix([])
        for req in self.reqs:
            if self.cache.has_request(req):
                self.cache.free(req)
            assert self.cache.prefill_first_chunk(req, empty, PROMPT)
        self.computed = PROMPT

    def decode_all(self) -> None:
        """One ``decode_step`` per request (the per-request Python loop)."""
        computed = self.computed
        slot = computed // PAGE
        step = self.cache.decode_step
        if computed % PAGE == 0:
            for req, hashes in zip(self.reqs, self.hashes, strict=True):
                step(req, hashes[slot - 1 : slot], slot - 1, 1, computed)
        else:
            empty: tuple[str, ...] = ()
            for req in self.reqs:
                step(req, empty, slot, 1, computed)
        self.computed += 1

    def tables(self) -> dict[str, np.ndarray]:
        return self.cache.block_tables(self.reqs)

    def step(self) -> None:
        self.decode_all()
        self.tables()

    def ensure_room(self) -> None:
        if self.computed >= PROMPT + STEPS - 1:
            self.admit()


def measure_decode(loop: DecodeLoop, steps: int) -> tuple[float, float, float]:
    """Median ns of (decode loop, block_tables, whole step) over ``steps`` steps."""
    decode, tables, whole = [], [], []
    for _ in range(steps):
        loop.ensure_room()
        t0 = time.perf_counter_ns()
        loop.decode_all()
        t1 = time.perf_counter_ns()
        loop.tables()
        t2 = time.perf_counter_ns()
        decode.append(t1 - t0)
        tables.append(t2 - t1)
        whole.append(t2 - t0)
    return statistics.median(decode), statistics.median(tables), statistics.median(whole)


# ----- script ------------------------------------------------------------------------------------


def main(argv: list[str]) -> None:
    smoke = "--smoke" in argv
    quick = smoke or "--quick" in argv
    repeats = 3 if smoke else 50 if quick else 400
    rows: list[tuple[str, str, str]] = []

    pool = BlockPool(65536)
    for n in (16, 256):
        ns = _median_ns(functools.partial(pool_cycle, pool, n), repeats) / n
        rows.append((f"allocate+free, {n} pages per call", "<= 50 ns/page", f"{ns:.1f} ns/page"))

    tokens = prompt_tokens(4096 * PAGE)
    listed = tokens.tolist()
    for label, data in (("uint32 array", tokens), ("list", listed)):
        ns = _median_ns(functools.partial(hash_pages, data, PAGE), max(5, repeats // 20))
        rate = f"{4096 / ns * 1e3:.2f} M pages/s"
        rows.append((f"hash_pages 16-token pages ({label})", ">= 5 M pages/s", rate))

    cache, hashes = cached_full_cache(256)
    ns = _median_ns(lambda: cache.match_prefix(hashes), repeats)
    rows.append(("match_prefix, 256-page full-attention hit", "<= 10 us", f"{ns / 1e3:.2f} us"))

    loop = DecodeLoop()
    decode, tables, whole = measure_decode(loop, 4 if smoke else 64 if quick else STEPS)
    rows.append(("decode step x256 + block_tables (full+SWA)", "<= 100 us", f"{whole / 1e3:.1f} us"))
    per_request = f"{decode / 1e3:.1f} us ({decode / REQUESTS:.0f} ns/req)"
    rows.append(("  of which 256 decode_step calls", "", per_request))
    rows.append(("  of which block_tables (256 x ~136 cols x 2)", "", f"{tables / 1e3:.1f} us"))

    print(f"cpu cores: {os.cpu_count()}, python {sys.version.split()[0]}")
    print("| benchmark | target | measured |")
    print("|---|---|---|")
    for name, target, value in rows:
        print(f"| {name} | {target} | {value} |")


# ----- pytest-benchmark entry points -------------------------------------------------------------


def test_pool_allocate_free(benchmark: Any) -> None:
    pool = BlockPool(65536)
    benchmark(pool_cycle, pool, 256)


def test_hash_pages_16_tokens(benchmark: Any) -> None:
    tokens = prompt_tokens(4096 * PAGE)
    assert len(benchmark(hash_pages, tokens, PAGE)) == 4096


def test_match_prefix_256_pages(benchmark: Any) -> None:
    cache, hashes = cached_full_cache(256)
    assert benchmark(cache.match_prefix, hashes).num_common_tokens == 256 * PAGE


def test_decode_step_256_requests(benchmark: Any) -> None:
    loop = DecodeLoop()

    def step() -> None:
        loop.ensure_room()
        loop.step()

    benchmark(step)
    loop.cache.check_invariants()


if __name__ == "__main__":
    main(sys.argv[1:])
