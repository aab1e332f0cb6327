"""Soak test: thousands of random requests through the native engine, then everything freed.

A small scheduler loop (fixed seed) admits requests with a capped prefix match (SPEC 9), runs
chunked prefill and decode steps (SPEC 8), preempts a request when its step cannot get pages,
and finishes requests. Shared system prompts make prefix hits common; a pool smaller than the
working set makes shortfalls common. At the end every request is freed and the pool must be
whole again: ``num_free == num_pages - 1``, no page referenced, ``check_invariants()`` passes.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import flat_kvcache
import pytest

#: Hybrid models: (kind, page size, window) per group, and a pool somewhat smaller than twelve
#: running requests need, so that admissions are refused and steps preempted now and then.
MODELS: dict[str, tuple[list[tuple[str, int, int | None]], int]] = {
    "full+sliding": ([("full", 16, None), ("sliding_window", 16, 64)], 200),
    "full+state": ([("state", 64, None), ("full", 32, None)], 100),
    "mixed-pages": (
        [("sliding_window", 32, 100), ("full", 16, None), ("state", 64, None), ("sliding_window", 16, 1)],
        200,
    ),
}


@dataclass
class Running:
    """One admitted request: its tokens, hashes (each page hashed once), and progress."""

    rid: int
    tokens: list[int]
    prompt_len: int
    target_len: int
    allocated: int
    hashes: list[str] = field(default_factory=list)
    #: First base page not yet handed to a step for registration.
    first_unregistered: int = 0
    #: Times it was refused or preempted and requeued.
    attempts: int = 0


def extend_hashes(module: ModuleType, req: Running, base: int) -> None:
    """Hash the newly completed base pages of the request, chained on the last hash."""
    full = len(req.tokens) // base
    done = len(req.hashes)
    if full > done:
        prior = req.hashes[-1] if req.hashes else ""
        req.hashes.extend(module.hash_pages(req.tokens[done * base : full * base], base, prior=prior))


def run_soak(
    module: ModuleType,
    groups: list[tuple[str, int, int | None]],
    *,
    num_requests: int,
    num_pages: int,
    seed: int,
    caching: bool = True,
    max_running: int = 12,
    chunk_size: int = 96,
) -> dict[str, int]:
    """Drive ``num_requests`` random requests through one cache; return counters of what happened."""
    rng = random.Random(seed)
    specs = [module.KVCacheSpec(kind, size, window) for kind, size, window in groups]
    cache: Any = module.PageCache(specs, num_pages, enable_caching=caching)
    base = cache.base_page_size
    system_prompts = [[rng.randrange(100) for _ in range(rng.randrange(0, 240))] for _ in range(6)]
    counters = {"admitted": 0, "refused": 0, "preempted": 0, "finished": 0, "dropped": 0, "hit_tokens": 0}
    waiting: deque[Running] = deque()
    running: dict[int, Running] = {}
    created = 0

    def new_request() -> Running:
        nonlocal created
        created += 1
        prompt = rng.choice(system_prompts) + [rng.randrange(100) for _ in range(rng.randrange(1, 120))]
        return Running(created, prompt, len(prompt), len(prompt) + rng.randrange(1, 48), 0)

    def requeue(req: Running) -> None:
        """Out of pages: free it, fold its generated tokens into its prompt, wait (SPEC 9)."""
        cache.free(req.rid)
        req.prompt_len = len(req.tokens)
        req.allocated = 0
        req.first_unregistered = 0
        req.attempts += 1
        if req.attempts > 50:
            counters["dropped"] += 1
        else:
            waiting.append(req)

    def admit(req: Running) -> None:
        extend_hashes(module, req, base)
        cap = max((req.prompt_len - 1) // base, 0)  # never match the last prompt token
        match = cache.match_prefix(req.hashes[:cap])
        common = match.num_common_tokens
        chunk = min(req.prompt_len - common, chunk_size)
        if cache.prefill_first_chunk(req.rid, match, chunk):
            req.allocated = common + chunk
            running[req.rid] = req
            counters["admitted"] += 1
            counters["hit_tokens"] += common
        else:
            counters["refused"] += 1  # the claim stays on failure: requeue frees the request
            requeue(req)

    def advance(req: Running) -> None:
        computed = req.allocated  # the previous step's tokens are now computed
        if computed >= req.target_len:
            first = req.first_unregistered
            cache.decode_step(req.rid, req.hashes[first:], first, 0, computed)  # register the rest
            cache.free(req.rid)
            del running[req.rid]
            counters["finished"] += 1
            return
        if computed < req.prompt_len:
            num = min(chunk_size, req.prompt_len - computed)
            ok = cache.prefill_chunk(req.rid, req.hashes, num, computed)
        else:
            if len(req.tokens) == computed:
                req.tokens.append(rng.randrange(100))  # the token sampled at the last step
                extend_hashes(module, req, base)
            num = 1
            first = req.first_unregistered
            ok = cache.decode_step(req.rid, req.hashes[first:], first, num, computed)
            req.first_unregistered = computed // base
        if ok:
            req.allocated = computed + num
        else:
            counters["preempted"] += 1
            del running[req.rid]
            requeue(req)

    step = 0
    while created < num_requests or running or waiting:
        if len(running) < max_running:
            if waiting:
                admit(waiting.popleft())
            elif created < num_requests:
                admit(new_request())
        for rid in list(running):
            if rng.random() < 0.9:  # not every request is scheduled every step
                advance(running[rid])
        step += 1
        if step % 50 == 0:
            cache.check_invariants()

    # Everything is freed: the pool is whole again.
    assert cache.num_requests == 0
    assert cache.num_free_pages == num_pages - 1
    stats = cache.pool_stats()
    assert stats["num_free"] == num_pages - 1
    assert stats["num_cached_pinned"] == 0  # no page holds a reference
    assert stats["num_cached_free"] == stats["num_cached"]
    if not caching:
        assert stats["num_cached"] == 0
    cache.check_invariants()  # counts equal table references, and there are no tables left
    return counters


@pytest.mark.parametrize("model", sorted(MODELS))
def test_native_soak_returns_every_page(model: str) -> None:
    groups, num_pages = MODELS[model]
    counters = run_soak(flat_kvcache, groups, num_requests=3000, num_pages=num_pages, seed=20261202)
    # Every request completed (preempted ones were requeued) and the run exercised prefix hits
    # and shortfalls.
    assert counters["finished"] + counters["dropped"] == 3000
    assert counters["finished"] > 2900
    assert counters["hit_tokens"] > 0
    assert counters["refused"] + counters["preempted"] > 0


def test_native_soak_without_caching() -> None:
    groups, num_pages = MODELS["mixed-pages"]
    counters = run_soak(flat_kvcache, groups, num_requests=2000, num_pages=num_pages, seed=7, caching=False)
    assert counters["hit_tokens"] == 0
    assert counters["finished"] + counters["dropped"] == 2000
    assert counters["refused"] + counters["preempted"] > 0
