"""Chunked local attention groups (SPEC 6, "Chunked local attention"; Llama 4's local layers).

The token at position ``t`` attends ``[t - t % C, t]``; a chunk is ``K = C / P`` slots.

- Reclaim at ``n`` releases slots ``[0, min(floor(n / C) * K, len))``, lowest slot first.
- Match: a boundary at slot ``e`` needs every slot of its chunk before it, ``[floor(e / K) * K,
  e)``, cached (a chunk start needs none); a miss at slot ``i`` moves the boundary to ``i`` and
  the check restarts from that boundary's chunk start; slots left of the accepted run are holes.
- Registration as full attention; not prefix-closed.

Every expectation is worked out by hand from that rule (the reasoning is in the comments), and
each test runs on both engines (the ``api`` fixture: native and reference), so both must give
exactly these values.
"""

from __future__ import annotations

import hashlib
from types import ModuleType
from typing import Any

import flat_kvcache
import flat_kvcache.reference
import pytest
from slots import outcome_of

# ------------------------------------------------------------------------------------------------
# Helpers
# ------------------------------------------------------------------------------------------------


def fake_hashes(count: int, seed: int = 0) -> list[str]:
    """Distinct 64-char hex content hashes (only equality of keys matters to the coordinator)."""
    return [hashlib.sha256(f"chunk-{seed}-{i}".encode()).hexdigest() for i in range(count)]


def spec(api: ModuleType, group: tuple[Any, ...]) -> Any:
    """A ``KVCacheSpec`` from ``("full", P)``, ``("sliding_window", P, W)`` or
    ``("chunked_local", P, C)``."""
    kind, size, *rest = group
    param = rest[0] if rest else None
    if kind == "chunked_local":
        return api.KVCacheSpec(kind, size, None, None, param)
    return api.KVCacheSpec(kind, size, param)


def page_cache(api: ModuleType, groups: list[tuple[Any, ...]], num_pages: int, **options: Any) -> Any:
    return api.PageCache([spec(api, g) for g in groups], num_pages, **options)


def flat_cache(api: ModuleType, groups: list[tuple[Any, ...]], num_pages: int, **options: Any) -> Any:
    return api.FlatKVCache([spec(api, g) for g in groups], num_pages, **options)


def matched(cache: Any, hashes: list[str]) -> tuple[int, list[list[int]], list[int]]:
    match = cache.match_prefix(hashes)
    return match.num_common_tokens, match.pages, match.num_hit_pages


def cached_run(api: ModuleType, slots: list[int], total: int = 8) -> tuple[Any, list[str]]:
    """One chunked group, P = 4, C = 12 (K = 3: chunks are slots [0, 3), [3, 6), [6, 9)): a
    request of ``total`` pages (pages 1..total) registers only ``slots``, then is freed."""
    cache = page_cache(api, [("chunked_local", 4, 12)], 20)
    hs = fake_hashes(total)
    assert cache.acquire("a", 4 * total)
    for slot in slots:
        cache.register("a", [hs[slot]], first_slot=slot)
    cache.free("a")
    return cache, hs


# ------------------------------------------------------------------------------------------------
# Match
# ------------------------------------------------------------------------------------------------


def test_match_needs_the_boundary_chunks_earlier_pages(api: ModuleType) -> None:
    cache, hs = cached_run(api, list(range(8)))
    before = dict(cache.pool_stats())
    # End bound 8 (token 32), its chunk starts at slot 6: slots 7 and 6 hit: boundary 8 accepted.
    # Slots [0, 6) are holes; the hit count is the 2 real pages.
    assert matched(cache, hs) == (32, [[0, 0, 0, 0, 0, 0, 7, 8]], [2])
    # End bound 5: chunk start 3; slots 4, 3 hit.
    assert matched(cache, hs[:5]) == (20, [[0, 0, 0, 4, 5]], [2])
    # End bound 3 is a chunk start: nothing to check, every slot a hole.
    assert matched(cache, hs[:3]) == (12, [[0, 0, 0]], [0])
    # End bound 2 inside chunk 0: slots 1, 0 hit, no hole.
    assert matched(cache, hs[:2]) == (8, [[1, 2]], [2])
    assert matched(cache, []) == (0, [[]], [0])
    assert dict(cache.pool_stats()) == before  # match is read-only


def test_match_miss_inside_a_chunk_moves_the_boundary(api: ModuleType) -> None:
    # Slot 7 never registered: end 8 -> slot 7 misses -> boundary 7 (chunk start 6); slot 6
    # hits: accepted at 7 (token 28) with one page.
    cache, hs = cached_run(api, [0, 1, 2, 3, 4, 5, 6])
    assert matched(cache, hs) == (28, [[0, 0, 0, 0, 0, 0, 7]], [1])
    # Slot 6 missing: slot 7 hits, slot 6 misses -> boundary 6, a chunk start: accepted with no
    # page at all (a boundary on a chunk start needs none).
    cache, hs = cached_run(api, [0, 1, 2, 3, 4, 5, 7])
    assert matched(cache, hs) == (24, [[0] * 6], [0])
    # Slot 4 missing, end bound 6 (a chunk start): accepted at once, whatever is cached below.
    cache, hs = cached_run(api, [0, 1, 2, 3, 5, 6, 7])
    assert matched(cache, hs[:6]) == (24, [[0] * 6], [0])
    # End bound 5: slot 4 misses -> boundary 4 (chunk start 3); slot 3 hits.
    assert matched(cache, hs[:5]) == (16, [[0, 0, 0, 4]], [1])


def test_match_inside_the_first_chunk_walks_down_to_zero(api: ModuleType) -> None:
    # Slot 0 missing: end 2 -> slot 1 hits, slot 0 misses -> boundary 0: nothing matched.
    cache, hs = cached_run(api, [1, 2, 3])
    assert matched(cache, hs[:2]) == (0, [[]], [0])
    # Nothing cached at all: end 8 -> slot 7 misses -> boundary 7 -> slot 6 misses -> boundary
    # 6, a chunk start: 24 tokens resumable with no page (the chunk before is never attended).
    cache, hs = cached_run(api, [])
    assert matched(cache, hs) == (24, [[0] * 6], [0])
    # End 5 with nothing cached: 4 misses -> 4; 3 misses -> 3, a chunk start: 12 tokens.
    assert matched(cache, hs[:5]) == (12, [[0, 0, 0]], [0])
    # A match with only holes claims nothing, and a claim of it takes no page.
    match = cache.match_prefix(hs[:5])
    assert cache.pages_consumed_by_claim(match) == 0
    free = cache.num_free_pages
    cache.claim("b", match)
    assert cache.page_ids("b") == [[0, 0, 0]] and cache.num_free_pages == free
    cache.check_invariants()


def test_match_full_and_chunked_groups(api: ModuleType) -> None:
    # g0 full, P = 4; g1 chunked, P = 4, C = 12 (K = 3). Acquire allocates in group order:
    # g0 pages 1..8, g1 pages 9..16. Base slot 4 is never registered (in either group).
    cache = page_cache(api, [("full", 4), ("chunked_local", 4, 12)], 20)
    hs = fake_hashes(8)
    assert cache.acquire("a", 32)
    assert cache.page_ids("a") == [list(range(1, 9)), list(range(9, 17))]
    for slot in (0, 1, 2, 3, 5, 6, 7):
        cache.register("a", [hs[slot]], first_slot=slot)
    cache.free("a")
    # Full first (prefix-closed): slots 0..3 hit, slot 4 misses: bound 16. Chunked up to slot
    # 4: chunk start 3, slot 3 (page 12) hits: boundary 4 accepted, slots 0..2 holes.
    assert matched(cache, hs) == (16, [[1, 2, 3, 4], [0, 0, 0, 12]], [4, 1])
    # Bound 12 is a chunk start: the chunked group needs nothing there.
    assert matched(cache, hs[:3]) == (12, [[1, 2, 3], [0, 0, 0]], [3, 0])
    # Bound 8: chunk start 0, slots 1, 0 hit (pages 10, 9).
    assert matched(cache, hs[:2]) == (8, [[1, 2], [9, 10]], [2, 2])


def test_match_full_group_is_cut_back_to_the_chunked_boundary(api: ModuleType) -> None:
    # g0 full P = 4, g1 chunked P = 4, C = 12. "a" holds 24 tokens: g0 pages 1..6, g1 pages
    # 7..12, all registered. Reclaim at 12 releases g1 slots 0..2 (pages 7, 8, 9), lowest slot
    # first, onto the (empty) free list: [7, 8, 9]. "x" takes one page per group from the
    # front: g0 page 7, g1 page 8 -- both evicted (their keys dropped). Page 9 stays cached.
    cache = page_cache(api, [("full", 4), ("chunked_local", 4, 12)], 13)
    hs = fake_hashes(6)
    assert cache.acquire("a", 24)
    cache.register("a", hs)
    assert cache.num_free_pages == 0
    assert cache.pages_reclaimable("a", 12) == 3
    cache.reclaim("a", 12)
    assert cache.page_ids("a") == [[1, 2, 3, 4, 5, 6], [0, 0, 0, 10, 11, 12]]
    assert cache.acquire("x", 4) and cache.page_ids("x") == [[7], [8]]
    # Bound 8 (inside chunk 0): full hits slots 0, 1. Chunked: slot 1 (page 8) was evicted ->
    # boundary 1; slot 0 (page 7) too -> boundary 0. The bound falls to 0 and the full group
    # is cut back to it: resuming inside a chunk needs that chunk's earlier pages.
    assert matched(cache, hs[:2]) == (0, [[], []], [0, 0])
    # Bound 12: a chunk start, resumable although chunk 0 is gone.
    assert matched(cache, hs[:3]) == (12, [[1, 2, 3], [0, 0, 0]], [3, 0])
    # Bound 20: chunk start 3; slots 4, 3 hit (pages 11, 10, held by "a").
    assert matched(cache, hs[:5]) == (20, [[1, 2, 3, 4, 5], [0, 0, 0, 10, 11]], [5, 2])
    cache.check_invariants()


# ------------------------------------------------------------------------------------------------
# Reclaim
# ------------------------------------------------------------------------------------------------


def test_reclaim_releases_finished_chunks_lowest_slot_first(api: ModuleType) -> None:
    # P = 4, C = 12 (K = 3). A pool of 8 pages (7 usable): "r" takes pages 1..7, the free list
    # is empty. Released pages join the back of the free list.
    cache = page_cache(api, [("chunked_local", 4, 12)], 8, reuse_uncached_first=False)
    assert cache.acquire("r", 28) and cache.num_free_pages == 0
    # n = 11: token 11 is in chunk 0: nothing to release. n = 12 starts chunk 1: k = 3.
    assert cache.pages_reclaimable("r", 11) == 0
    assert cache.pages_reclaimable("r", 12) == 3
    assert cache.pages_reclaimable("r", 12, count_uncached=False) == 0  # none hashed
    assert cache.pages_reclaimable("r", 24) == 6  # k = 2 * 3
    assert cache.pages_reclaimable("r", 10**6) == 7  # k capped at the table length
    cache.reclaim("r", 11)
    assert cache.page_ids("r") == [[1, 2, 3, 4, 5, 6, 7]]
    cache.reclaim("r", 12)
    assert cache.page_ids("r") == [[0, 0, 0, 4, 5, 6, 7]] and cache.num_free_pages == 3
    # Lowest slot first: page 1 is handed out first.
    assert cache.acquire("q", 4) and cache.page_ids("q") == [[1]]
    # n = 23 is still in chunk 1: no change; n = 24: k = 6.
    cache.reclaim("r", 23)
    assert cache.page_ids("r") == [[0, 0, 0, 4, 5, 6, 7]]
    cache.reclaim("r", 24)
    assert cache.page_ids("r") == [[0, 0, 0, 0, 0, 0, 7]] and cache.num_free_pages == 5
    cache.reclaim("r", 10**6)
    assert cache.page_ids("r") == [[0] * 7] and cache.num_free_pages == 6
    cache.check_invariants()


def test_reclaim_counts_only_last_references(api: ModuleType) -> None:
    # P = 4, C = 8 (K = 2). "a": pages 1..4, registered. "b" matches 3 base pages: end 3,
    # chunk start 2, slot 2 (page 3) hits; slots 0, 1 are holes.
    cache = page_cache(api, [("chunked_local", 4, 8)], 20)
    hs = fake_hashes(4)
    assert cache.acquire("a", 16)
    cache.register("a", hs)
    match = cache.match_prefix(hs[:3])
    assert (match.num_common_tokens, match.pages) == (12, [[0, 0, 3]])
    cache.claim("b", match)
    # "a" at n = 16: k = 4, pages 1..4; page 3 is shared with "b", so 3 would be freed.
    assert cache.pages_reclaimable("a", 16) == 3
    assert cache.pages_reclaimable("a", 15) == 2  # k = 2: pages 1, 2
    # "b" at n = 16: k = min(4, 3) = 3: only page 3, shared: 0; after "a" lets go: 1.
    assert cache.pages_reclaimable("b", 16) == 0
    cache.reclaim("a", 16)
    assert cache.pages_reclaimable("b", 16) == 1
    assert cache.pages_reclaimable("b", 16, count_uncached=False) == 1  # page 3 is hashed
    cache.check_invariants()


# ------------------------------------------------------------------------------------------------
# Token level: a request whose chunked pages go at each chunk start
# ------------------------------------------------------------------------------------------------

PROMPT = [7000 + i for i in range(40)]


def test_token_level_request_releases_each_finished_chunk(api: ModuleType) -> None:
    # g0 full P = 4; g1 chunked P = 4, C = 8 (K = 2). One request, a 5-token prompt, then one
    # token per step up to 40 tokens.
    cache = flat_cache(api, [("full", 4), ("chunked_local", 4, 8)], 40)
    usable = 39
    slot, hit = cache.add_request("r", PROMPT[:5])
    assert (slot, hit) == (0, 0)
    assert cache.schedule([slot], [5]).tolist() == [True]
    for n in range(5, 40):
        # Before this step the position is n: schedule registers, reclaims at n, then makes
        # room for token n. The full table covers tokens [0, n + 1): ceil((n + 1) / 4) pages,
        # none a hole. The chunked one has as many slots; those of finished chunks,
        # [0, (n // 8) * 2), are holes.
        cache.append_tokens([slot], [PROMPT[n]])
        assert cache.schedule([slot], [1]).tolist() == [True]
        full, chunked = cache.page_ids(slot)
        slots = -(-(n + 1) // 4)
        released = (n // 8) * 2
        assert len(full) == len(chunked) == slots
        assert 0 not in full
        assert chunked[:released] == [0] * released and 0 not in chunked[released:], (n, chunked)
        assert cache.num_free_pages == usable - slots - (slots - released)
        assert cache.num_computed_tokens(slot) == n + 1
    # n = 39 was the last step: 10 slots, chunks 0..3 finished (8 holes), pages of slots 8, 9.
    assert [p == 0 for p in cache.page_ids(slot)[1]] == [True] * 8 + [False] * 2
    cache.finish([slot])
    assert cache.num_free_pages == usable
    cache.check_invariants()


def test_token_level_prefix_hit_resumes_inside_a_chunk(api: ModuleType) -> None:
    # g0 full P = 4; g1 chunked P = 4, C = 12 (K = 3). "a" computes an 18-token prompt in one
    # step and finishes: 4 complete base pages (tokens [0, 16)) are registered in both groups.
    cache = flat_cache(api, [("full", 4), ("chunked_local", 4, 12)], 40)
    slot, hit = cache.add_request("a", PROMPT[:18])
    assert (slot, hit) == (0, 0)
    assert cache.schedule([slot], [18]).tolist() == [True]
    assert cache.page_ids(slot) == [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]]
    cache.finish([slot])
    # "b" with 30 tokens: the match is capped to (30 - 1) // 4 = 7 base pages. Full: slots 0..3
    # hit, slot 4 misses: bound 16 (token 16, slot 4, inside chunk 1 = slots [3, 6)). Chunked
    # at end 4: chunk start 3, slot 3 (page 9) hits: resume at 16 with slots 0..2 holes.
    slot, hit = cache.add_request("b", PROMPT[:30])
    assert (slot, hit) == (0, 16)
    assert cache.page_ids(slot) == [[1, 2, 3, 4], [0, 0, 0, 9]]
    assert cache.num_computed_tokens(slot) == 16
    # The rest of the prompt: position 16 is in chunk 1, so nothing is released yet; the
    # tables grow to ceil(30 / 4) = 8 slots.
    assert cache.schedule([slot], [14]).tolist() == [True]
    full, chunked = cache.page_ids(slot)
    assert full[:4] == [1, 2, 3, 4] and chunked[:4] == [0, 0, 0, 9] and len(full) == len(chunked) == 8
    # "c" with 13 tokens: capped to 3 base pages, bound 12, a chunk start: the full group hits
    # slots 0..2 and the chunked group needs nothing.
    slot_c, hit_c = cache.add_request("c", PROMPT[:13])
    assert (slot_c, hit_c) == (1, 12)
    assert cache.page_ids(slot_c) == [[1, 2, 3], [0, 0, 0]]
    cache.finish([slot, slot_c])
    cache.check_invariants()


def test_token_level_no_hit_inside_a_chunk_whose_pages_are_gone(api: ModuleType) -> None:
    # g0 full P = 4; g1 chunked P = 4, C = 12, a pool of 13 pages (12 usable). "a" computes 24
    # tokens in one step (pages g0 1..6, g1 7..12), then one more token: schedule registers
    # the 6 base pages, reclaims at n = 24 (k = 2 * 3 = 6: g1 slots 0..5, pages 7..12, lowest
    # slot first onto the empty free list) and then acquires a page per group for token 24
    # from the front of the free list: g0 gets 7, g1 gets 8 (both evicted, keys dropped).
    cache = flat_cache(api, [("full", 4), ("chunked_local", 4, 12)], 13)
    slot, _ = cache.add_request("a", PROMPT[:24])
    assert cache.schedule([slot], [24]).tolist() == [True]
    assert cache.page_ids(slot) == [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]]
    cache.append_tokens([slot], [PROMPT[24]])
    assert cache.schedule([slot], [1]).tolist() == [True]
    assert cache.page_ids(slot) == [[1, 2, 3, 4, 5, 6, 7], [0, 0, 0, 0, 0, 0, 8]]
    # "b" with 10 tokens: capped to 2 base pages (bound 8, inside chunk 0). Full hits slots 0,
    # 1; the chunked slots 1 and 0 were evicted: boundary 0, so no hit at all.
    slot_b, hit_b = cache.add_request("b", PROMPT[:10])
    assert (slot_b, hit_b) == (1, 0)
    assert cache.page_ids(slot_b) == [[], []]
    # "c" with 21 tokens: capped to 5 base pages (bound 20, chunk start 3): slots 4, 3 of the
    # chunked group (pages 11, 10) are still cached on the free list: hit 20.
    slot_c, hit_c = cache.add_request("c", PROMPT[:21])
    assert (slot_c, hit_c) == (2, 20)
    assert cache.page_ids(slot_c) == [[1, 2, 3, 4, 5], [0, 0, 0, 10, 11]]
    cache.check_invariants()


# ------------------------------------------------------------------------------------------------
# Both engines side by side
# ------------------------------------------------------------------------------------------------


def drive(api: ModuleType) -> list[Any]:
    """A fixed run of several requests over full + sliding + chunked groups of mixed page sizes;
    every result (or exception) in order."""
    groups = [("full", 2), ("chunked_local", 4, 8), ("sliding_window", 2, 5), ("chunked_local", 2, 6)]
    cache = flat_cache(api, groups, 60, enable_kv_events=True)
    out: list[Any] = []

    def record(method: str, *args: Any) -> Any:
        outcome = outcome_of(lambda: getattr(cache, method)(*args))
        out.append((method, args, outcome))
        return outcome

    docs = [PROMPT, [*PROMPT[:20], 1, 2, 3, *PROMPT[23:]]]
    live: dict[str, int] = {}
    for step in range(30):
        req = f"r{step % 5}"
        if req not in live:
            outcome = record("add_request", req, docs[step % 2][: 7 + step % 13])
            if outcome[0] == "ok":
                live[req] = int(outcome[1][0])
                record("schedule", [live[req]], [int(cache.num_tokens(live[req]) - outcome[1][1])])
            continue
        slot = live[req]
        n = int(cache.num_tokens(slot))
        record("append_tokens", [slot], [docs[step % 2][n % 40]])
        record("schedule", [slot], [1])
        record("page_ids", slot)
        record("pages_needed", 3, slot)
        if step % 7 == 6:
            record("finish", [slot])
            del live[req]
    record("take_events")
    out.append(("free", cache.num_free_pages))
    cache.check_invariants()
    return out


def test_both_engines_agree_on_a_mixed_run() -> None:
    native = drive(flat_kvcache)
    reference = drive(flat_kvcache.reference)
    assert len(native) == len(reference)
    for got, want in zip(native, reference, strict=True):
        assert got == want


# ------------------------------------------------------------------------------------------------
# Spec validation
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("chunked_local", 4), "chunk_size must be an int >= 1 for a chunked_local group, got None"),
        (
            ("chunked_local", 4, None, None, 0),
            "chunk_size must be an int >= 1 for a chunked_local group, got 0",
        ),
        (("chunked_local", 4, None, None, 6), "chunk_size must be a multiple of page_size 4, got 6"),
        (("full", 4, None, None, 8), "chunk_size must be None for a full group, got 8"),
        (("chunked_local", 4, 8, None, 8), "sliding_window must be None for a chunked_local group, got 8"),
    ],
)
def test_kv_cache_spec_checks_the_chunk(api: ModuleType, args: tuple[Any, ...], message: str) -> None:
    with pytest.raises(ValueError) as info:
        api.KVCacheSpec(*args)
    assert str(info.value) == message


def changed(base: Any, **fields: Any) -> Any:
    """A spec changed after construction (a frozen dataclass still allows
    ``object.__setattr__``): the engines check its fields again."""
    for name, value in fields.items():
        object.__setattr__(base, name, value)
    return base


@pytest.mark.parametrize("cls", ["FlatKVCache", "PageCache"])
def test_engines_check_a_changed_spec_alike(api: ModuleType, cls: str) -> None:
    def error(*specs: Any) -> tuple[str, str]:
        with pytest.raises(Exception) as info:
            getattr(api, cls)(list(specs), 8)
        return type(info.value).__name__, str(info.value)

    def chunked() -> Any:
        return api.KVCacheSpec("chunked_local", 4, None, None, 8)

    def full() -> Any:
        return api.KVCacheSpec("full", 4)

    assert error(full(), changed(chunked(), chunk_size=6)) == (
        "ValueError",
        "specs[1].chunk_size must be a positive multiple of its page_size 4, got 6",
    )
    assert error(changed(chunked(), chunk_size=0)) == (
        "ValueError",
        "specs[0].chunk_size must be an int >= 1 for a chunked_local group, got 0",
    )
    assert error(changed(chunked(), chunk_size=None)) == (
        "ValueError",
        "specs[0].chunk_size must be an int >= 1 for a chunked_local group, got None",
    )
    assert error(changed(chunked(), sliding_window=3)) == (
        "ValueError",
        "specs[0].sliding_window must be None for a chunked_local group, got 3",
    )
    assert error(changed(full(), chunk_size=8)) == (
        "ValueError",
        "specs[0].chunk_size must be None for a full group, got 8",
    )
    assert error(changed(api.KVCacheSpec("sliding_window", 4, 3), chunk_size=0)) == (
        "ValueError",
        "specs[0].chunk_size must be None for a sliding_window group, got 0",
    )
    assert error(changed(chunked(), chunk_size=-1)) == (
        "ValueError",
        "specs[0].chunk_size must be >= 0, got -1",
    )
    assert error(changed(chunked(), chunk_size=2.0)) == (
        "TypeError",
        "specs[0].chunk_size must be an int, got float",
    )
    assert error(changed(chunked(), chunk_size=2**64)) == (
        "OverflowError",
        "specs[0].chunk_size: value does not fit in an unsigned 64-bit integer",
    )
    assert error(changed(full(), kind="chunked")) == (
        "ValueError",
        "specs[0].kind must be 'full', 'sliding_window', 'state' or 'chunked_local', got \"chunked\"",
    )
    # The chunk's own checks come before the group id's; the coordinator's come last.
    assert error(
        changed(api.KVCacheSpec("full", 4, None, "a"), group_id=5),
    ) == ("TypeError", "specs[0].group_id must be a str or None, got int")
    assert error(
        api.KVCacheSpec("full", 4, None, "a"), api.KVCacheSpec("chunked_local", 4, None, "a", 8)
    ) == (
        "ValueError",
        'specs: group id "a" appears more than once',
    )


def test_a_chunked_group_is_not_prefix_closed_and_keeps_its_chunk(api: ModuleType) -> None:
    cache = flat_cache(api, [("chunked_local", 2, 6), ("full", 4)], 10)
    assert cache.group_ids == ["g0", "g1"]
    assert (cache.base_page_size, cache.lcm_page_size) == (2, 4)
