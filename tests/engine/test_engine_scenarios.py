"""Scenario tests of the page engine, one or more per rule of SPEC 4 to 8 (and 12.2, 12.4, 12.5).

Every expectation is worked out by hand from the SPEC and ``docs/engine-api.md``; the reasoning is
in the comments. Hashes are rebuilt here from raw bytes with ``struct`` and ``hashlib``, never by
calling the implementation under test. Each test runs against both the native module
(``flat_kvcache``) and the pure-Python reference (``flat_kvcache.reference``).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable
from types import ModuleType
from typing import Any

import flat_kvcache
import flat_kvcache.reference
import numpy as np
import pytest
from flat_kvcache import _native
from flat_kvcache._types import PagedCacheGroupSpec

# ------------------------------------------------------------------------------------------------
# Fixtures and helpers
# ------------------------------------------------------------------------------------------------


def u32(value: int) -> bytes:
    """One little-endian u32 field of the SPEC 4 hash input."""
    return struct.pack("<I", value)


def sha(*parts: bytes) -> str:
    return hashlib.sha256(b"".join(parts)).hexdigest()


def page_input(tokens: list[int], prior_hex: str = "", extra: list[str] | None = None) -> bytes:
    """SPEC 4 bytes of one page, written out field by field."""
    prior = bytes.fromhex(prior_hex)
    out = u32(len(prior)) + prior + u32(len(tokens)) + b"".join(u32(t) for t in tokens)
    if extra:
        out += u32(len(extra))
        for key in extra:
            raw = key.encode("utf-8")
            out += u32(len(raw)) + raw
    return out


def fake_hashes(count: int, seed: int = 0) -> list[str]:
    """Distinct 64-char hex content hashes for ``count`` base pages (content does not matter
    to the coordinator; only equality of keys does)."""
    return [hashlib.sha256(f"page-{seed}-{i}".encode()).hexdigest() for i in range(count)]


def make_cache(
    api: ModuleType,
    groups: list[tuple[Any, ...]],
    num_pages: int,
    caching: bool = True,
    order: str = "",
    *,
    appending: bool = False,
) -> Any:
    """A PageCache from ``(kind, page_size[, window])`` tuples; ``order`` is an eviction order
    (empty: the default, ``"hybrid"``); ``appending`` puts every released page at the back of
    the free list (``reuse_uncached_first=False``, SPEC 5's original order), so the free list
    shows the release order of pages that were never registered."""
    specs = [api.KVCacheSpec(g[0], g[1], g[2] if len(g) > 2 else None) for g in groups]
    options: dict[str, Any] = {"enable_caching": caching}
    if order:
        options["eviction_order"] = order
    if appending:
        options["reuse_uncached_first"] = False
    return api.PageCache(specs, num_pages, **options)


def stats(cache: Any) -> dict[str, int]:
    return dict(cache.pool_stats())


# ------------------------------------------------------------------------------------------------
# SPEC 4: content hashes and group keys
# ------------------------------------------------------------------------------------------------


def test_hash_page_layout_without_extra_keys(api: ModuleType) -> None:
    # h_{-1} is empty: prior length 0, no prior bytes, 3 tokens, then each token; no extra keys
    # means no count field at all.
    expected = sha(u32(0), u32(3), u32(1), u32(2), u32(3))
    assert api.hash_page([1, 2, 3]) == expected
    # Empty extra keys are the same as none (the count is hashed only if there are keys).
    assert api.hash_page([1, 2, 3], "", []) == expected
    assert len(expected) == 64 and expected == expected.lower()


def test_hash_page_layout_with_prior_and_extra_keys(api: ModuleType) -> None:
    prior = sha(b"anything")  # 32 raw bytes once decoded
    tokens = [0, 7, 0xFFFF_FFFF]
    # prior length 32, its raw bytes, 3 tokens, tokens, 2 keys, ("lora-a": 6 bytes), ("é": 2 bytes).
    expected = sha(
        u32(32),
        bytes.fromhex(prior),
        u32(3),
        u32(0),
        u32(7),
        u32(0xFFFF_FFFF),
        u32(2),
        u32(6),
        b"lora-a",
        u32(2),
        "é".encode(),
    )
    assert api.hash_page(tokens, prior, ["lora-a", "é"]) == expected
    # An upper-case prior decodes to the same bytes.
    assert api.hash_page(tokens, prior.upper(), ["lora-a", "é"]) == expected
    # A single empty key still adds the count field (1) and a zero-length key.
    assert api.hash_page([], "", [""]) == sha(u32(0), u32(0), u32(1), u32(0))


def test_hash_page_accepts_numpy_tokens(api: ModuleType) -> None:
    expected = sha(u32(0), u32(2), u32(5), u32(9))
    assert api.hash_page(np.array([5, 9], dtype=np.int64)) == expected
    assert api.hash_page(np.array([5, 9], dtype=np.uint32)) == expected


def test_hash_pages_chain_and_drop_partial_tail(api: ModuleType) -> None:
    tokens = list(range(10))
    # Page size 4: pages [0..3], [4..7]; the 2-token tail [8, 9] is not a full page: dropped.
    h0 = sha(page_input([0, 1, 2, 3]))
    h1 = sha(page_input([4, 5, 6, 7], h0))
    assert api.hash_pages(tokens, 4) == [h0, h1]
    # With a prior and extra keys both enter every page; the chain links the hashes.
    prior = sha(b"prior")
    g0 = sha(page_input([0, 1, 2, 3], prior, ["salt"]))
    g1 = sha(page_input([4, 5, 6, 7], g0, ["salt"]))
    assert api.hash_pages(tokens, 4, prior=prior, extra_keys=["salt"]) == [g0, g1]
    assert api.hash_pages(np.arange(10), 4) == [h0, h1]
    assert api.hash_pages([1, 2, 3], 4) == []


def test_hashing_argument_errors(api: ModuleType) -> None:
    with pytest.raises(ValueError, match=r"tokens\[1\] = 4294967296 does not fit in u32"):
        api.hash_page([1, 2**32])
    with pytest.raises(ValueError, match=r"tokens\[0\] = -1 does not fit in u32"):
        api.hash_page([-1])
    with pytest.raises(ValueError, match=r"token_ids\[2\] = -5 does not fit in u32"):
        api.hash_pages([0, 1, -5, 3], 2)
    with pytest.raises(ValueError, match="prior"):
        api.hash_page([1], "abc")  # odd length
    with pytest.raises(ValueError, match="prior"):
        api.hash_page([1], "zz")  # not hex
    with pytest.raises(TypeError):
        api.hash_page([1], "", "salt")  # a bare str is not a sequence of keys
    with pytest.raises(ValueError, match="page_size"):
        api.hash_pages([1, 2], 0)


def test_group_key_appends_big_endian_group_index(api: ModuleType) -> None:
    h = sha(b"x")
    assert api.group_key(h, 0) == h + "00000000"
    assert api.group_key(h, 10) == h + "0000000a"
    assert api.group_key(h, 0x01020304) == h + "01020304"  # most significant digit first
    assert api.group_key(h, 2**32 - 1) == h + "ffffffff"
    with pytest.raises(ValueError, match="group_index"):
        api.group_key(h, 2**32)
    with pytest.raises(ValueError, match="group_index"):
        api.group_key(h, -1)


def fold_by_hand(run_hashes: list[str]) -> str:
    """SPEC 4 fold written out: run = "", then run = H([], run, [h]) for each hash."""
    run = ""
    for h in run_hashes:
        # prior length + prior raw bytes, 0 tokens, 1 extra key: (64, the hex text as UTF-8).
        run = sha(page_input([], run, [h]))
    return run


def test_fold_hashes_runs_alignment_and_m1(api: ModuleType) -> None:
    hs = fake_hashes(7)
    first = sha(u32(0), u32(0), u32(1), u32(64), hs[0].encode())  # the first step, fully by hand
    assert fold_by_hand([hs[0]]) == first
    # m == 1: the hashes themselves (a copy).
    assert api.fold_hashes(hs, 5, 1) == hs
    # m == 2 from base page 0: runs (0,1) (2,3) (4,5); base page 6 is an incomplete run: dropped.
    assert api.fold_hashes(hs, 0, 2) == [fold_by_hand(hs[0:2]), fold_by_hand(hs[2:4]), fold_by_hand(hs[4:6])]
    # m == 2 from base page 1: hs[j] is base page 1 + j. Skip hs[0] (base page 1) to base page 2;
    # runs (2, 3), (4, 5), (6, 7) are hs[1:3], hs[3:5], hs[5:7].
    assert api.fold_hashes(hs, 1, 2) == [fold_by_hand(hs[1:3]), fold_by_hand(hs[3:5]), fold_by_hand(hs[5:7])]
    # m == 4 from base page 3: the next multiple of 4 is 4 (hs[1]); run hs[1:5]; hs[5:7] incomplete.
    assert api.fold_hashes(hs, 3, 4) == [fold_by_hand(hs[1:5])]
    # Too few hashes for one run.
    assert api.fold_hashes(hs[:3], 0, 4) == []
    with pytest.raises(ValueError):
        api.fold_hashes(hs, 0, 0)
    with pytest.raises(ValueError):
        api.fold_hashes(hs, -1, 2)


# ------------------------------------------------------------------------------------------------
# SPEC 5: the block pool
# ------------------------------------------------------------------------------------------------


def test_pool_initial_state_and_null_page(api: ModuleType) -> None:
    pool = api.BlockPool(5)
    # Page 0 is the null page: never free, never counted. Free list 1..4 in order.
    assert (pool.num_blocks, pool.num_free, pool.num_cached) == (5, 4, 0)
    assert pool.allocate(4) == [1, 2, 3, 4]
    assert [pool.ref_count(p) for p in range(5)] == [0, 1, 1, 1, 1]
    assert repr(pool) == "BlockPool(num_blocks=5, num_free=0, num_cached=0)"
    only_null = api.BlockPool(1)
    assert only_null.num_free == 0
    assert only_null.allocate(1) == []
    with pytest.raises(ValueError, match="num_blocks"):
        api.BlockPool(0)


def test_pool_allocate_is_all_or_nothing(api: ModuleType) -> None:
    pool = api.BlockPool(5)
    assert pool.allocate(5) == []  # only 4 free: nothing changes
    assert pool.num_free == 4
    assert pool.allocate(0) == []
    with pytest.raises(ValueError):
        pool.allocate(-1)
    assert pool.allocate(2) == [1, 2]


def test_pool_free_releases_in_reverse_order(api: ModuleType) -> None:
    pool = api.BlockPool(5, reuse_uncached_first=False)  # SPEC 5's order: all to the back
    assert pool.allocate(4) == [1, 2, 3, 4]
    # free([1, 2, 3]) releases 3, then 2, then 1: each goes to the back, so the free list is
    # [3, 2, 1] (a chain's tail is evicted before its head).
    pool.free([1, 2, 3])
    assert pool.allocate(3) == [3, 2, 1]


def test_pool_eviction_is_least_recently_freed_first(api: ModuleType) -> None:
    pool = api.BlockPool(6, reuse_uncached_first=False)  # SPEC 5's order: all to the back
    assert pool.allocate(5) == [1, 2, 3, 4, 5]
    pool.free([2])
    pool.free([4])
    pool.free([1])
    # Free list [2, 4, 1]: the least recently freed page goes first.
    assert pool.allocate(2) == [2, 4]
    assert pool.allocate(1) == [1]


def test_pool_cached_page_survives_free_until_reallocated(api: ModuleType) -> None:
    pool = api.BlockPool(3)
    assert pool.allocate(1) == [1]
    pool.cache(1, "k")
    assert (pool.num_cached, pool.num_cached_pinned, pool.num_cached_free) == (1, 1, 0)
    pool.free([1])
    # Count 0: back of the free list [2, 1], key intact, still found by lookup.
    assert pool.is_cached(1) and pool.lookup("k") == 1
    assert (pool.num_cached, pool.num_cached_pinned, pool.num_cached_free) == (1, 0, 1)
    # A prefix hit: touch takes it out of the middle of the free list.
    pool.touch(1)
    assert (pool.ref_count(1), pool.num_free) == (1, 1)
    pool.free([1])
    # Free list [2, 1]: allocating both takes 2 then 1, and taking 1 evicts its key.
    assert pool.allocate(2) == [2, 1]
    assert pool.lookup("k") is None and not pool.is_cached(1)
    assert pool.num_cached == 0


def test_pool_touch_removes_from_the_middle_and_keeps_order(api: ModuleType) -> None:
    pool = api.BlockPool(6)  # free list [1, 2, 3, 4, 5]
    pool.touch(3)
    assert pool.ref_count(3) == 1 and pool.num_free == 4
    assert pool.allocate(4) == [1, 2, 4, 5]
    pool.touch(3)
    assert pool.ref_count(3) == 2


def test_pool_null_page_is_a_no_op(api: ModuleType) -> None:
    pool = api.BlockPool(3)
    pool.touch(0)
    pool.free([0, 0])
    pool.cache(0, "k")
    assert (pool.ref_count(0), pool.num_free, pool.num_cached, pool.lookup("k")) == (0, 2, 0, None)


def test_pool_misuse_raises_and_changes_nothing(api: ModuleType) -> None:
    pool = api.BlockPool(4)
    assert pool.allocate(2) == [1, 2]
    # Page 2 would go below zero (repeats in one call count): nothing is released, not even 1.
    with pytest.raises(ValueError):
        pool.free([1, 2, 2])
    assert (pool.ref_count(1), pool.ref_count(2), pool.num_free) == (1, 1, 1)
    # Freeing a page with count 0 (page 3 is free).
    with pytest.raises(ValueError):
        pool.free([3])
    assert pool.num_free == 1
    # A page out of range, even after valid entries.
    with pytest.raises(ValueError, match="4"):
        pool.free([1, 4])
    assert pool.ref_count(1) == 1
    for bad in (-1, 4):
        with pytest.raises(ValueError):
            pool.touch(bad)
        with pytest.raises(ValueError):
            pool.ref_count(bad)
        with pytest.raises(ValueError):
            pool.is_cached(bad)
        with pytest.raises(ValueError):
            pool.cache(bad, "k")
    # Registering a page that already holds a key.
    pool.cache(1, "a")
    with pytest.raises(ValueError):
        pool.cache(1, "b")
    assert pool.lookup("a") == 1 and pool.lookup("b") is None
    assert (pool.num_cached, pool.num_free) == (1, 1)


def test_pool_key_with_several_pages_returns_the_earliest(api: ModuleType) -> None:
    pool = api.BlockPool(4)
    assert pool.allocate(3) == [1, 2, 3]
    pool.cache(2, "k")
    pool.cache(1, "k")  # registered later: never de-duplicated
    assert pool.lookup("k") == 2 and pool.num_cached == 2
    pool.free([2])
    assert pool.allocate(1) == [2]  # evicts page 2 from the key's list
    assert pool.lookup("k") == 1
    # lookup never changes counts.
    assert [pool.ref_count(p) for p in (1, 2, 3)] == [1, 1, 1]


@pytest.mark.parametrize("reuse_uncached_first", [True, False])
def test_pool_uncached_pages_rejoin_the_front_when_reused_first(
    api: ModuleType, reuse_uncached_first: bool
) -> None:
    pool = api.BlockPool(8, reuse_uncached_first=reuse_uncached_first)
    assert pool.allocate(5) == [1, 2, 3, 4, 5]  # free list [6, 7]
    pool.cache(2, "b")
    pool.cache(4, "d")
    # Released in reverse: 5, 4 (cached), 3, 2 (cached), 1.
    pool.free([1, 2, 3, 4, 5])
    if reuse_uncached_first:
        # Uncached 5, 3, 1 each join the front (1 ends up first); cached 4, 2 the back.
        assert pool.allocate(7) == [1, 3, 5, 6, 7, 4, 2]
    else:
        assert pool.allocate(7) == [6, 7, 5, 4, 3, 2, 1]
    assert pool.num_cached == 0
    with pytest.raises(TypeError, match="reuse_uncached_first"):
        api.BlockPool(4, reuse_uncached_first=1)


def test_pool_with_caching_off(api: ModuleType) -> None:
    pool = api.BlockPool(3, enable_caching=False)
    assert pool.allocate(1) == [1]
    pool.cache(1, "k")
    assert (pool.num_cached, pool.is_cached(1), pool.lookup("k")) == (0, False, None)


# ------------------------------------------------------------------------------------------------
# Specs
# ------------------------------------------------------------------------------------------------


def test_kv_cache_spec_validation_and_conversion(api: ModuleType) -> None:
    spec = api.KVCacheSpec("sliding_window", 16, 128, "swa")
    assert (spec.kind, spec.page_size, spec.sliding_window, spec.group_id) == (
        "sliding_window",
        16,
        128,
        "swa",
    )
    assert spec == api.KVCacheSpec("sliding_window", 16, 128, "swa")
    for bad in [
        ("nope", 16, None),
        ("full", 0, None),
        ("sliding_window", 16, None),
        ("sliding_window", 16, 0),
    ]:
        with pytest.raises(ValueError):
            api.KVCacheSpec(*bad)
    with pytest.raises(ValueError, match="sliding_window"):
        api.KVCacheSpec("full", 16, 8)
    group_specs = [
        PagedCacheGroupSpec("full_attention", "full_history", 16, 1, None),
        PagedCacheGroupSpec("sliding_attention", "sliding_window", 8, 2, 512),
        PagedCacheGroupSpec("linear_attention", "full_history", 16, 1, None, "state"),
    ]
    got = [(s.kind, s.page_size, s.sliding_window, s.group_id) for s in api.kv_cache_specs(group_specs)]
    assert got == [
        ("full", 16, None, "full_attention"),
        ("sliding_window", 16, 512, "sliding_attention"),  # raw = 8 * 2
        ("state", 16, None, "linear_attention"),
    ]
    assert [s.page_size for s in api.kv_cache_specs(group_specs, 32)] == [32, 32, 32]


def test_cache_construction(api: ModuleType) -> None:
    cache = make_cache(api, [("sliding_window", 32, 100), ("full", 16), ("state", 48)], 10)
    # gcd(32, 16, 48) = 16, lcm = 96; group ids default to g<index>.
    assert (cache.base_page_size, cache.lcm_page_size, cache.num_groups) == (16, 96, 3)
    assert list(cache.group_ids) == ["g0", "g1", "g2"]
    assert cache.num_free_pages == 9 and cache.num_requests == 0
    with pytest.raises(ValueError):
        api.PageCache([], 10)
    with pytest.raises(ValueError):
        api.PageCache([api.KVCacheSpec("full", 16, None, "a"), api.KVCacheSpec("full", 16, None, "a")], 10)
    with pytest.raises(OverflowError, match="specs"):
        # lcm of three large coprimes is about 2**180: no native integer holds it.
        api.PageCache([api.KVCacheSpec("full", p) for p in (2**61 - 1, 2**59 - 1, 2**60 - 1)], 10)


def test_argument_edges_the_contract_leaves_open(api: ModuleType) -> None:
    """Decisions both implementations share where the contract is silent (see the final report):
    a bool is never an int; counts and sizes are u64 (OverflowError past it); page ids are int32."""
    cache = make_cache(api, [("full", 4)], 10)
    type_errors: list[Callable[[], object]] = [
        lambda: cache.acquire(True, 4),  # a bool request id
        lambda: cache.acquire("a", True),  # a bool count
        lambda: api.hash_page([True]),
        lambda: api.BlockPool(3).touch(True),
        lambda: api.BlockPool(3, enable_caching=1),
        lambda: api.KVCacheSpec("full", True),
    ]
    for call in type_errors:
        with pytest.raises(TypeError):
            call()
    overflow_errors: list[Callable[[], object]] = [
        lambda: cache.acquire("a", 2**64),
        lambda: cache.pages_needed(2**64),
        lambda: api.BlockPool(3).allocate(2**64),
        lambda: api.hash_pages([1, 2], 2**64),
        lambda: api.PageCache([api.KVCacheSpec("full", 2**64)], 4),
        lambda: api.PageCache([api.KVCacheSpec("sliding_window", 4, 2**64)], 4),
    ]
    for call in overflow_errors:
        with pytest.raises(OverflowError):
            call()
    assert cache.pages_needed(2**64 - 1) == 2**62  # ceil((2**64 - 1) / 4) still fits
    with pytest.raises(ValueError, match="int32"):
        api.BlockPool(2**31)
    with pytest.raises(ValueError, match="int32"):
        api.PageCache([api.KVCacheSpec("full", 4)], 2**31)
    assert cache.num_requests == 0


# ------------------------------------------------------------------------------------------------
# SPEC 6: tables and managers
# ------------------------------------------------------------------------------------------------


def test_acquire_uses_tail_then_whole_pages(api: ModuleType) -> None:
    cache = make_cache(api, [("full", 16)], 20)
    assert cache.acquire("r", 0) and cache.page_ids("r") == [[]]  # n <= 0: nothing to do
    assert cache.pages_needed(20, "r") == 2  # ceil(20 / 16)
    assert cache.acquire("r", 20)
    # over = 20, 20 % 16 = 4 -> tail_avail = 16 - 4 = 12.
    assert (cache.page_ids("r"), cache.tail_available("r")) == ([[1, 2]], [12])
    assert cache.pages_needed(12, "r") == 0
    assert cache.acquire("r", 12)  # fits in the tail
    assert (cache.page_ids("r"), cache.tail_available("r")) == ([[1, 2]], [0])
    assert cache.acquire("r", 1)  # over = 1 -> tail 15
    assert (cache.page_ids("r"), cache.tail_available("r")) == ([[1, 2, 3]], [15])
    assert cache.pages_needed(33, "r") == 2  # over = 33 - 15 = 18 -> ceil(18/16) = 2
    assert cache.acquire("r", 33)  # 18 % 16 = 2 -> tail 14
    assert (cache.page_ids("r"), cache.tail_available("r")) == ([[1, 2, 3, 4, 5]], [14])
    assert cache.acquire("r", 32)  # over = 18 again
    assert cache.tail_available("r") == [14]
    cache.check_invariants()


def test_acquire_is_all_or_nothing_across_groups(api: ModuleType) -> None:
    cache = make_cache(api, [("full", 16), ("sliding_window", 32, 64)], 5)  # 4 free pages
    # 64 tokens: full ceil(64/16) = 4 + sliding ceil(64/32) = 2 = 6 > 4 free: nothing anywhere.
    assert cache.pages_needed(64) == 6
    assert not cache.acquire("r", 64)
    assert cache.has_request("r")  # the request exists even though acquire returned False
    assert (cache.page_ids("r"), cache.tail_available("r"), cache.num_free_pages) == ([[], []], [0, 0], 4)
    # 32 tokens: 2 + 1 = 3 pages; groups allocate in index order: full [1, 2], sliding [3].
    assert cache.acquire("r", 32)
    assert cache.page_ids("r") == [[1, 2], [3]]
    # 40 more tokens (both tails are 0): full ceil(40/16) = 3, sliding ceil(40/32) = 2 -> 5 > 1.
    assert not cache.acquire("r", 40)
    assert cache.page_ids("r") == [[1, 2], [3]] and cache.num_free_pages == 1
    cache.check_invariants()


def register_slots(cache: Any, req: str, hashes: list[str], slots: list[int]) -> None:
    """Register single base pages (only groups with m == 1 get a key from one hash)."""
    for slot in slots:
        cache.register(req, [hashes[slot]], first_slot=slot)


def test_register_skips_holes_hashed_pages_and_partial_tail(api: ModuleType) -> None:
    cache = make_cache(api, [("full", 4)], 20)
    hs = fake_hashes(4)
    assert cache.acquire("r", 14)  # 4 pages, tail 2: slot 3 is partial
    cache.register("r", hs[:4])
    # Slot 3 is the last page and still has free slots: never registered.
    assert stats(cache)["num_cached"] == 3
    cache.register("r", hs[:4])  # idempotent: already-hashed pages are skipped
    assert stats(cache)["num_cached"] == 3
    assert cache.acquire("r", 2)  # the tail fills up: slot 3 is now complete
    cache.register("r", hs[:4])
    assert stats(cache)["num_cached"] == 4
    # A range past the table is an error.
    with pytest.raises(ValueError):
        cache.register("r", fake_hashes(5))
    with pytest.raises(ValueError):
        cache.register("r", hs[:2], first_slot=3)
    cache.check_invariants()


def test_register_range_is_checked_in_every_group_before_any_registration(api: ModuleType) -> None:
    cache = make_cache(api, [("full", 16), ("full", 32)], 20)
    hs = fake_hashes(4)
    assert cache.acquire("r", 48)  # g0: 3 pages; g1: 2 pages (slot 1 partial, tail 16)
    # 4 base hashes from slot 0: g1 folds them into 2 keys (slots 0, 1): fits its 2 pages; g0 needs
    # slots 0..3 but holds 3 pages: ValueError, and g1 must not have registered anything.
    with pytest.raises(ValueError):
        cache.register("r", hs)
    assert stats(cache)["num_cached"] == 0
    cache.check_invariants()


def test_full_attention_match_stops_at_first_miss(api: ModuleType) -> None:
    cache = make_cache(api, [("full", 4)], 20)
    hs = fake_hashes(5)
    assert cache.acquire("a", 20)  # pages 1..5
    register_slots(cache, "a", hs, [0, 1, 3, 4])  # slot 2 never registered
    cache.free("a")
    match = cache.match_prefix(hs)
    # Walk 0, 1 (hits), 2 (miss): stop. Slots 3 and 4 are cached but unreachable.
    assert (match.num_common_tokens, match.pages, match.num_hit_pages) == (8, [[1, 2]], [2])
    assert cache.match_prefix([]).pages == [[]]


def test_sliding_match_leaves_holes_left_of_the_run(api: ModuleType) -> None:
    # P = 4, W = 9: needed = ceil(8 / 4) = 2 cached pages behind a resumable boundary.
    cache = make_cache(api, [("sliding_window", 4, 9)], 20)
    hs = fake_hashes(6)
    assert cache.acquire("a", 24)  # pages 1..6
    cache.register("a", hs)
    cache.free("a")
    before = stats(cache)
    match = cache.match_prefix(hs)
    # Scan from slot 5: hit, hit -> run 2 >= 2: accept b = 6. Slots [4, 6) hold pages 5, 6;
    # slots [0, 4) are holes; the hit count counts the 2 real pages only.
    assert (match.num_common_tokens, match.pages, match.num_hit_pages) == (24, [[0, 0, 0, 0, 5, 6]], [2])
    assert stats(cache) == before  # read-only


def test_sliding_match_miss_moves_the_boundary(api: ModuleType) -> None:
    # P = 4, W = 5: needed = 1.
    cache = make_cache(api, [("sliding_window", 4, 5)], 20)
    hs = fake_hashes(4)
    assert cache.acquire("a", 16)  # pages 1..4
    register_slots(cache, "a", hs, [0, 1, 2])
    cache.free("a")
    # Slot 3 misses: b = 3. Slot 2 hits: run 1 >= 1: accept b = 3 -> [0, 0, page 3].
    match = cache.match_prefix(hs)
    assert (match.num_common_tokens, match.pages, match.num_hit_pages) == (12, [[0, 0, 3]], [1])


def test_sliding_match_run_reaching_the_begin_bound_is_accepted(api: ModuleType) -> None:
    # P = 4, W = 13: needed = ceil(12 / 4) = 3.
    cache = make_cache(api, [("sliding_window", 4, 13)], 20)
    hs = fake_hashes(4)
    assert cache.acquire("a", 16)  # pages 1..4
    register_slots(cache, "a", hs, [0, 1, 3])
    cache.free("a")
    # i=3 hit (run 1); i=2 miss -> b = 2, run 0; i=1 hit, i=0 hit (run 2 < 3) and the loop reaches
    # slot 0: a run that reaches the begin bound is accepted anyway -> b = 2, pages [1, 2].
    match = cache.match_prefix(hs)
    assert (match.num_common_tokens, match.pages, match.num_hit_pages) == (8, [[1, 2]], [2])
    # Two hashes only: run of 2 from the end bound reaches slot 0: accepted.
    assert cache.match_prefix(hs[:2]).pages == [[1, 2]]
    # Slot 0 misses while everything right of it hits: the boundary falls to 0.
    cache2 = make_cache(api, [("sliding_window", 4, 13)], 20)
    assert cache2.acquire("a", 12)
    register_slots(cache2, "a", hs, [1, 2])
    cache2.free("a")
    assert cache2.match_prefix(hs[:3]).num_common_tokens == 0


def test_sliding_match_window_one_needs_no_pages(api: ModuleType) -> None:
    # W = 1: needed = ceil(0 / 4) = 0: every boundary is resumable, every slot is a hole.
    cache = make_cache(api, [("sliding_window", 4, 1)], 10)
    match = cache.match_prefix(fake_hashes(6))
    assert (match.num_common_tokens, match.pages, match.num_hit_pages) == (24, [[0] * 6], [0])
    assert cache.pages_consumed_by_claim(match) == 0
    assert cache.prefill_first_chunk("r", match, 5)
    # The claimed table is 6 holes, tail 0; 5 new tokens take 2 pages after them, tail 3.
    assert cache.page_ids("r") == [[0, 0, 0, 0, 0, 0, 1, 2]]
    assert cache.tail_available("r") == [3]
    cache.check_invariants()


def test_reclaim_frees_slid_out_pages_lowest_slot_first(api: ModuleType) -> None:
    # P = 4, W = 6. Pool of exactly 6 pages (5 usable) so the free list is empty before reclaim.
    cache = make_cache(api, [("sliding_window", 4, 6)], 6, appending=True)
    assert cache.acquire("r", 20)  # pages 1..5, free list empty
    # n - W + 1 = 5 - 6 + 1 = 0 <= 0: nothing has slid out.
    assert cache.pages_reclaimable("r", 5) == 0
    # n = 17: (17 - 6 + 1) // 4 = 12 // 4 = 3 slots [0, 3) slid out.
    assert cache.pages_reclaimable("r", 17) == 3
    assert cache.pages_reclaimable("r", 17, count_uncached=False) == 0  # none hashed
    cache.reclaim("r", 17)
    assert cache.page_ids("r") == [[0, 0, 0, 4, 5]] and cache.num_free_pages == 3
    # Released lowest slot first: free list [1, 2, 3], page 1 is evicted first.
    assert cache.acquire("q", 4) and cache.page_ids("q") == [[1]]
    # Reclaiming again is a no-op; k is capped at the table length.
    cache.reclaim("r", 17)
    assert cache.page_ids("r") == [[0, 0, 0, 4, 5]]
    cache.reclaim("r", 10**6)
    assert cache.page_ids("r") == [[0] * 5] and cache.num_free_pages == 4
    cache.check_invariants()


def test_reclaim_frees_every_slid_out_page_past_a_hole_in_the_middle(api: ModuleType) -> None:
    """SPEC 12.2: a hole in the middle (e.g. left by a host-tier extension) must not stop reclaim."""
    # P = 4, W = 5: reclaim k = (n - 4) // 4.
    cache = make_cache(api, [("sliding_window", 4, 5)], 10)
    hs = fake_hashes(4)
    assert cache.acquire("a", 16)  # pages 1..4
    cache.register("a", hs)
    cache.free("a")  # all four stay cached; free list [5..9, 4, 3, 2, 1]
    # A table [1, hole, 3, 4]: the hole is in the middle. Build it as a match (all real pages
    # hold keys, so it is not stale).
    match = api.PrefixMatch(16, [[1, 0, 3, 4]], [3])
    cache.claim("b", match)
    assert cache.page_ids("b") == [[1, 0, 3, 4]] and cache.num_free_pages == 6
    # n = 20: k = (20 - 5 + 1) // 4 = 4: slots 0..3 slid out. The reference design scanned down
    # from slot 3, stopped at the hole in slot 1 and kept page 1 until the request ended.
    assert cache.pages_reclaimable("b", 20) == 3
    cache.reclaim("b", 20)
    assert cache.page_ids("b") == [[0, 0, 0, 0]] and cache.num_free_pages == 9
    cache.check_invariants()


def test_pages_reclaimable_counts_only_last_references(api: ModuleType) -> None:
    cache = make_cache(api, [("sliding_window", 4, 5)], 20)
    hs = fake_hashes(4)
    assert cache.acquire("a", 16)  # pages 1..4, all registered
    cache.register("a", hs)
    # "b" shares a's slot 3 page (hit at boundary 16, W = 5 needs 1 page).
    match = cache.match_prefix(hs)
    assert match.pages == [[0, 0, 0, 4]]
    assert cache.pages_consumed_by_claim(match) == 0  # page 4 is held by "a": count 1, not free
    cache.claim("b", match)
    assert cache.acquire("b", 8)  # pages 5, 6
    # "a" at n = 20: k = 4: pages 1..4, but page 4 is also referenced by "b": 3 would be freed.
    assert cache.pages_reclaimable("a", 20) == 3
    cache.register("b", hs + fake_hashes(2, seed=1), end_tokens=24)  # registers slots 4, 5 only
    # "b" at n = 24: k = (24 - 4) // 4 = 5: slots 0..4 = holes, page 4 (shared), page 5.
    assert cache.pages_reclaimable("b", 24) == 1  # page 5 only; page 4 is shared with "a"
    cache.reclaim("a", 20)
    assert cache.pages_reclaimable("b", 24) == 2  # now b holds the last reference to page 4
    assert cache.pages_reclaimable("b", 24, count_uncached=False) == 2  # both hashed
    cache.check_invariants()


def test_state_group_registers_only_boundary_snapshots(api: ModuleType) -> None:
    # Full P = 16 next to state P = 32: base 16, the state group folds m = 2 base pages per page.
    # A state group is sparse (SPEC 13.4): a chunk gets a page only for its last slot, so the
    # request goes in two chunks to hold a state page at 64 and one at 96.
    cache = make_cache(api, [("full", 16), ("state", 32)], 30)
    hs = fake_hashes(6)
    assert cache.acquire("r", 64)  # full pages 1..4; state slot 1 only: page 5, slot 0 a hole
    assert cache.page_ids("r") == [[1, 2, 3, 4], [0, 5]]
    # Ends at 48 tokens: 48 % 32 != 0: the state page holding token 47 was never snapshotted there.
    cache.register("r", hs[:3], end_tokens=48)
    assert stats(cache)["num_cached"] == 3  # full slots 0..2 only
    # No end_tokens: state groups register nothing.
    cache.register("r", hs[:4])
    assert stats(cache)["num_cached"] == 4
    # end_tokens given but the hashes end at 64, not 96: nothing for state.
    cache.register("r", hs[:4], end_tokens=96)
    assert stats(cache)["num_cached"] == 4
    # Ends at 64 = 2 state pages: only the last key (slot 1) is registered; slot 0 is a hole.
    cache.register("r", hs[:4], end_tokens=64)
    assert stats(cache)["num_cached"] == 5
    assert cache.acquire("r", 32)  # full pages 6, 7; state slot 2: page 8
    assert cache.page_ids("r") == [[1, 2, 3, 4, 6, 7], [0, 5, 8]]
    # Hashes from base page 2 to 6 ending at 96: state key for slot 2 only.
    cache.register("r", hs[2:6], first_slot=2, end_tokens=96)
    assert stats(cache)["num_cached"] == 6 + 2  # full slots 0..5, state slots 1 and 2
    cache.free("r")
    # Match 96 tokens: full hits 6 -> bound 96. State at 96: slots [0, 3): slot 2 hits -> accept;
    # the rightmost snapshot, W = 2 needs 1 page: [0, 0, page 8].
    match = cache.match_prefix(hs)
    assert (match.num_common_tokens, match.pages, match.num_hit_pages) == (
        96,
        [[1, 2, 3, 4, 6, 7], [0, 0, 8]],
        [6, 1],
    )
    # Match 80 tokens: bound = align_down(5 * 16, 32) = 64: full 4 pages; state slots [0, 2):
    # slot 1 hits -> [0, page 5].
    match = cache.match_prefix(hs[:5])
    assert (match.num_common_tokens, match.pages) == (64, [[1, 2, 3, 4], [0, 5]])


def test_state_reclaim_keeps_the_page_of_the_last_token(api: ModuleType) -> None:
    cache = make_cache(api, [("state", 4)], 10)
    hs = fake_hashes(2)
    # One slot per chunk, each chunk's end keyed (a checkpoint), so that every slot holds a
    # page: a checkpoint stays where it is and the next slot gets a new page.
    assert cache.acquire("r", 4)
    cache.register("r", hs[:1], end_tokens=4)
    assert cache.acquire("r", 4)
    cache.register("r", hs[:2], end_tokens=8)
    assert cache.acquire("r", 4)
    assert cache.page_ids("r") == [[1, 2, 3]]
    # W = 2: k = (n - 1) // 4. n = 8: k = 1 (token 7 is in slot 1, kept).
    cache.reclaim("r", 8)
    assert cache.page_ids("r") == [[0, 2, 3]]
    # n = 9: k = 2 (token 8 lives in slot 2).
    cache.reclaim("r", 9)
    assert cache.page_ids("r") == [[0, 0, 3]]
    # The reclaimed pages are cached: they went to the back of the free list, so a 12-token
    # chunk at once (SPEC 13.4: the page of its last slot only) takes the front page, 4.
    assert cache.acquire("s", 12)
    assert cache.page_ids("s") == [[0, 0, 4]]
    # Without a key the working page moves on: one page however many slots are passed.
    assert cache.acquire("t", 4)
    assert cache.page_ids("t") == [[5]]
    assert cache.acquire("t", 4)
    assert cache.acquire("t", 8)
    assert cache.page_ids("t") == [[0, 0, 0, 5]]
    assert cache.pages_needed(4, "t") == 0  # the next slot costs nothing either
    cache.check_invariants()


# ------------------------------------------------------------------------------------------------
# SPEC 7: the coordinator
# ------------------------------------------------------------------------------------------------


def test_register_folds_keys_from_an_unaligned_first_slot(api: ModuleType) -> None:
    cache = make_cache(api, [("full", 16), ("full", 32)], 30)
    hs = fake_hashes(6)
    assert cache.acquire("r", 96)  # g0 pages 1..6, g1 pages 7..9
    # Hashes of base pages 1..4. g0 (m = 1): slots 1..4. g1 (m = 2): the fold starts at base page
    # 2 (slot ceil(1/2) = 1): run (2, 3) -> slot 1; base page 4 alone is incomplete: dropped.
    cache.register("r", hs[1:5], first_slot=1)
    assert stats(cache)["num_cached"] == 4 + 1
    # g1's slot 0 needs base pages 0, 1 together.
    cache.register("r", hs[0:2], first_slot=0)
    # g0 adds slot 0 (slot 1 is already hashed: skipped) -> 5 keys; g1 adds slot 0 -> 2 keys.
    assert stats(cache)["num_cached"] == 5 + 2
    cache.free("r")
    # bound = align_down(6 * 16, 32) = 96. g0 hits slots 0..4 (slot 5 was never registered):
    # extent 80 -> bound 64. g1 at 64: slots 0, 1 hit. g0 is truncated to 64 // 16 = 4 slots.
    match = cache.match_prefix(hs)
    assert (match.num_common_tokens, match.pages) == (64, [[1, 2, 3, 4], [7, 8]])


def test_match_sweep_with_mixed_page_sizes(api: ModuleType) -> None:
    # g0 sliding P = 32, W = 33 (needed = ceil(32/32) = 1); g1 full P = 16. base 16, lcm 32.
    cache = make_cache(api, [("sliding_window", 32, 33), ("full", 16)], 40)
    hs = fake_hashes(8)
    assert cache.acquire("a", 128)  # g0 pages 1..4, g1 pages 5..12
    cache.register("a", hs[:5])  # g1 slots 0..4; g0 slots 0, 1 (base pages 0..3); base page 4 alone: no key
    cache.free("a")
    # bound = align_down(8 * 16, 32) = 128. Match order: full first (g1, although index 1):
    # hits slots 0..4 -> extent 80 -> bound = align_down(80, 32) = 64. Then g0 at 64: slots [0, 2):
    # slot 1 hits -> accept b = 2 -> [0, page 2]. Final truncation: g1 to 64 // 16 = 4 slots.
    match = cache.match_prefix(hs)
    assert match.num_common_tokens == 64
    assert match.pages == [[0, 2], [5, 6, 7, 8]]
    assert match.num_hit_pages == [1, 4]


def test_match_converge_rematches_a_sliding_group_above_the_bound(api: ModuleType) -> None:
    # g0 sliding P = 16, W = 17 (needed 1); g1 state P = 32 (W = 2, needed 1). base 16, lcm 32.
    # 13 pages. The state group is sparse (SPEC 13.4): each chunk gets a page for its last slot.
    cache = make_cache(api, [("sliding_window", 16, 17), ("state", 32)], 13, order="group", appending=True)
    hs = fake_hashes(8)
    assert cache.acquire("a", 32)  # g0 pages 1, 2; g1 slot 0: page 3
    cache.register("a", hs[:2], end_tokens=32)  # g0 slots 0, 1; state snapshot at 32 (slot 0)
    assert cache.acquire("a", 32)  # g0 pages 4, 5; g1 slot 1: page 6
    cache.register("a", hs[:4], end_tokens=64)  # g0 slots 2, 3; state snapshot at 64 (slot 1)
    assert cache.acquire("a", 64)  # g0 pages 7..10; g1 slot 3: page 11, slot 2 a hole
    assert cache.page_ids("a") == [[1, 2, 4, 5, 7, 8, 9, 10], [3, 6, 0, 11]]
    cache.register("a", hs[:8])  # g0 slots 4..7 (no end_tokens: no state key)
    cache.free("a")
    # Free list: page 12 (never used), then g0 released tail first [10, 9, 8, 7, 5, 4, 2, 1],
    # then g1 [11, 6, 3] (its hole holds no page).
    # "q" takes 16 tokens: g0 1 page (12, never used), g1 1 page (10, evicting g0 slot 7).
    assert cache.acquire("q", 16)
    assert cache.page_ids("q") == [[12], [10]]
    # Now g0 hits slots 0..6, g1 hits slots 0, 1.
    # Sweep: bound 128. g0 at 128: slot 7 misses, slot 6 hits -> extent 112, bound
    # align_down(112, 32) = 96. g1 at 96: slots [0, 3): slot 2 misses, slot 1 hits -> extent 64,
    # bound 64. Converge: g0's extent 112 > 64 -> re-match at 64: slots [0, 4): slot 3 hits ->
    # [0, 0, 0, 5], extent 64. g1's extent 64 is not above. Nothing else changes.
    match = cache.match_prefix(hs)
    assert match.num_common_tokens == 64
    assert match.pages == [[0, 0, 0, 5], [0, 6]]
    assert match.num_hit_pages == [1, 1]
    # The claim takes 2 pages off the free list (5 and 6 are cached with count 0).
    assert cache.pages_consumed_by_claim(match) == 2
    free_before = cache.num_free_pages
    cache.claim("b", match)
    assert cache.num_free_pages == free_before - 2
    assert cache.page_ids("b") == [[0, 0, 0, 5], [0, 6]] and cache.tail_available("b") == [0, 0]
    cache.check_invariants()


def test_match_is_read_only(api: ModuleType) -> None:
    cache = make_cache(api, [("full", 4), ("sliding_window", 4, 5)], 12, order="group")
    hs = fake_hashes(3)
    assert cache.acquire("a", 12)
    cache.register("a", hs)
    cache.free("a")  # free list [7..11, 3, 2, 1, 6, 5, 4]
    before = stats(cache)
    match = cache.match_prefix(hs)
    assert match.pages == [[1, 2, 3], [0, 0, 6]]
    assert stats(cache) == before
    # Free-list order unchanged: the next 5 allocations are the never-used pages 7..11 for g0.
    assert cache.acquire("z", 20) and cache.page_ids("z") == [[7, 8, 9, 10, 11], [3, 2, 1, 6, 5]]


def test_claim_errors_change_nothing(api: ModuleType) -> None:
    cache = make_cache(api, [("full", 4)], 6)
    hs = fake_hashes(2)
    assert cache.acquire("a", 8)  # pages 1, 2
    cache.register("a", hs)
    cache.free("a")  # free list [3, 4, 5, 2, 1]
    match = cache.match_prefix(hs)
    assert match.pages == [[1, 2]]
    # Wrong number of groups: a match from a two-group cache.
    other = make_cache(api, [("full", 4), ("full", 4)], 6).match_prefix(hs)
    with pytest.raises(ValueError):
        cache.claim("b", other)
    assert not cache.has_request("b") and cache.num_free_pages == 5
    # Tables that already hold pages.
    assert cache.acquire("c", 1)  # page 3
    with pytest.raises(ValueError):
        cache.claim("c", match)
    assert cache.page_ids("c") == [[3]] and cache.num_free_pages == 4
    # A stale match: page 1 was evicted since the match was taken.
    assert cache.acquire("d", 12)  # pages 4, 5, 2 (evicts page 2's key)
    with pytest.raises(ValueError):
        cache.claim("e", match)
    assert not cache.has_request("e") and cache.num_free_pages == 1
    cache.check_invariants()


def test_claim_refuses_a_page_recached_for_another_group(api: ModuleType) -> None:
    """A stale match whose page was evicted and re-cached under another key (here another
    group's) must be refused: claiming it would put one page in two groups' tables."""
    # g0 full P = 4, g1 full P = 8: base 4, lcm 8. Pages 1..3 only.
    cache = make_cache(api, [("full", 4), ("full", 8)], 4, order="group")
    hs, other = fake_hashes(2), fake_hashes(2, seed=1)
    assert cache.acquire("a", 8)  # g0 [1, 2], g1 [3]
    cache.register("a", hs)  # keys: page 1, 2 (g0 slots 0, 1), page 3 (g1 slot 0)
    cache.free("a")  # g0 released 2, 1, then g1 3: free list [2, 1, 3]
    match = cache.match_prefix(hs)
    assert match.pages == [[1, 2], [3]]
    # "b" takes 4 tokens: g0 page 2, g1 page 1 (tail 4); 4 more: g0 page 3, g1 uses its tail.
    assert cache.acquire("b", 4) and cache.acquire("b", 4)
    assert cache.page_ids("b") == [[2, 3], [1]]
    cache.register("b", other)  # page 1 now holds a g1 key, pages 2, 3 g0 keys: all cached
    free_before = cache.num_free_pages
    with pytest.raises(ValueError):
        cache.claim("c", match)  # page 1 would be in c's g0 table and b's g1 table
    assert not cache.has_request("c") and cache.num_free_pages == free_before
    cache.check_invariants()


def test_content_hashes_are_lowercase_hex(api: ModuleType) -> None:
    cache = make_cache(api, [("full", 4)], 4)
    good = fake_hashes(1)[0]
    assert cache.match_prefix([good]).num_common_tokens == 0
    for bad in (good.upper(), good[:-1], good + "0", "g" * 64):
        with pytest.raises(ValueError, match=r"content_hashes\[0\]"):
            cache.match_prefix([bad])


def test_unknown_requests_raise_key_error(api: ModuleType) -> None:
    cache = make_cache(api, [("full", 4), ("state", 4)], 10)
    hs = fake_hashes(1)
    calls: list[Callable[[], object]] = [
        lambda: cache.register("x", hs),
        lambda: cache.reclaim("x", 4),
        lambda: cache.free("x"),
        lambda: cache.pages_needed(4, "x"),
        lambda: cache.pages_reclaimable("x", 4),
        lambda: cache.page_ids("x"),
        lambda: cache.tail_available("x"),
        lambda: cache.prefill_chunk("x", hs, 4, 4),
        lambda: cache.decode_step("x", hs, 0, 1, 4),
    ]
    if flat_kvcache.FLAT_KVCACHE:  # without the `flat` feature block_tables is a RuntimeError first
        calls.append(lambda: cache.block_tables(["x"]))
    for call in calls:
        with pytest.raises(KeyError):
            call()
    assert cache.num_requests == 0
    # 5 and "5" are different requests; claim, acquire and prefill_first_chunk create them.
    assert cache.acquire(5, 4)
    assert cache.has_request(5) and not cache.has_request("5")
    with pytest.raises(KeyError):
        cache.page_ids("5")
    cache.claim("5", cache.match_prefix([]))
    assert cache.prefill_first_chunk(2**80, cache.match_prefix([]), 1)
    assert cache.num_requests == 3
    with pytest.raises(TypeError):
        cache.acquire(1.5, 4)
    cache.check_invariants()


# ------------------------------------------------------------------------------------------------
# SPEC 8: step operations
# ------------------------------------------------------------------------------------------------


def test_prefill_first_chunk_keeps_the_claim_on_failure(api: ModuleType) -> None:
    cache = make_cache(api, [("full", 4)], 5)
    hs = fake_hashes(2)
    assert cache.acquire("a", 8)
    cache.register("a", hs)
    cache.free("a")  # free list [3, 4, 2, 1]
    match = cache.match_prefix(hs)
    # The claim takes 1 and 2; 12 more tokens need 3 pages but only 3, 4 are free: False.
    assert not cache.prefill_first_chunk("b", match, 12)
    assert cache.page_ids("b") == [[1, 2]] and cache.num_free_pages == 2
    cache.free("b")
    assert cache.num_free_pages == 4 and not cache.has_request("b")
    cache.check_invariants()


def test_prefill_chunk_registers_before_reclaiming(api: ModuleType) -> None:
    # P = 4, W = 5: reclaim k = (n - 4) // 4. Pool of 4 pages (3 usable).
    cache = make_cache(api, [("sliding_window", 4, 5)], 4)
    hs = fake_hashes(4)
    assert cache.prefill_first_chunk("r", cache.match_prefix([]), 8)  # pages 1, 2
    # Chunk 2 (8 tokens) at computed = 8: register slots 0, 1; THEN reclaim slot 0
    # (k = (8 - 4) // 4 = 1), keeping its key; THEN acquire 2 pages: page 3 and reclaimed page 1
    # (the reclaimed page funds this step; taking it evicts its key).
    assert cache.pages_needed(8, "r") == 2 and cache.num_free_pages == 1
    assert cache.prefill_chunk("r", hs, 8, 8)
    assert cache.page_ids("r") == [[0, 2, 3, 1]]
    # Page 2 (slot 1) is hashed and pinned.
    assert stats(cache) == {
        "num_blocks": 4,
        "num_free": 0,
        "num_cached": 1,
        "num_cached_free": 0,
        "num_cached_pinned": 1,
    }
    cache.check_invariants()


def test_prefill_chunk_keeps_the_hash_of_a_page_that_slides_out(api: ModuleType) -> None:
    cache = make_cache(api, [("sliding_window", 4, 5)], 10)
    hs = fake_hashes(4)
    assert cache.prefill_first_chunk("r", cache.match_prefix([]), 8)  # pages 1, 2
    assert cache.prefill_chunk("r", hs, 8, 8)  # registers 1, 2; reclaims 1; acquires 3, 4
    # Page 1 slid out but was registered first: cached and free. (Reclaiming first would have
    # freed it without a hash.)
    assert cache.page_ids("r") == [[0, 2, 3, 4]]
    assert stats(cache)["num_cached_free"] == 1 and stats(cache)["num_cached"] == 2
    # Hashes beyond computed // base are cut: only 2 of the 4 were used.
    cache.free("r")
    assert cache.match_prefix(hs).num_common_tokens == 8


def test_caching_disabled_registers_nothing(api: ModuleType) -> None:
    """SPEC 12.4: with prefix caching off nothing is registered and nothing ever matches."""
    cache = make_cache(api, [("full", 4), ("sliding_window", 4, 5), ("state", 8)], 30, caching=False)
    hs = fake_hashes(6)
    assert cache.prefill_first_chunk("r", cache.match_prefix(hs), 8)
    assert cache.prefill_chunk("r", hs, 8, 8)
    assert cache.decode_step("r", hs[4:], 4, 1, 16)
    cache.register("r", hs[:4], end_tokens=16)
    assert stats(cache)["num_cached"] == 0
    cache.free("r")
    match = cache.match_prefix(hs)
    assert (match.num_common_tokens, match.pages, match.num_hit_pages) == (0, [[], [], []], [0, 0, 0])
    cache.check_invariants()


def test_chunked_prefill_registers_each_page_once(api: ModuleType) -> None:
    """SPEC 12.4: hash each page once; re-registration of a chunk's pages is a no-op."""
    cache = make_cache(api, [("full", 4)], 30)
    hs = fake_hashes(6)
    assert cache.prefill_first_chunk("r", cache.match_prefix([]), 8)
    for computed in (8, 16, 24):
        assert cache.prefill_chunk("r", hs, 8, computed)
        # Every full computed page holds exactly one key: computed // 4 of them.
        assert stats(cache)["num_cached"] == computed // 4
    cache.check_invariants()


def test_decode_step_cuts_hashes_at_computed_tokens(api: ModuleType) -> None:
    cache = make_cache(api, [("full", 4), ("state", 8)], 30, appending=True)
    hs = fake_hashes(6)
    # full 1..4; state sparse (SPEC 13.4): slot 1 only (the state after token 14), page 5.
    assert cache.prefill_first_chunk("r", cache.match_prefix([]), 15)
    assert cache.page_ids("r") == [[1, 2, 3, 4], [0, 5]]
    # computed 15: hashes of base pages 2.. cut so that 2 + len <= 15 // 4 = 3: one hash (page 2).
    # State: end_tokens 15 % 8 != 0: nothing. Reclaim state at 15: k = 14 // 8 = 1 -> slot 0
    # (already a hole). The token fits both tails.
    assert cache.decode_step("r", hs[2:], 2, 1, 15)
    assert stats(cache)["num_cached"] == 1  # only full slot 2 (slots 0, 1 were never given)
    assert cache.page_ids("r") == [[1, 2, 3, 4], [0, 5]]
    assert cache.tail_available("r") == [0, 0]
    # computed 16: hashes from base page 0, all 4 full pages; state: (0 + 4) * 4 == 16 and
    # 16 % 8 == 0 -> state slot 1 (page 5) registered. Then 1 token: full page 6, state page 7.
    assert cache.decode_step("r", hs, 0, 1, 16)
    assert stats(cache)["num_cached"] == 4 + 1
    assert cache.page_ids("r") == [[1, 2, 3, 4, 6], [0, 5, 7]]
    cache.check_invariants()


def test_free_in_group_order_releases_each_group_tail_first(api: ModuleType) -> None:
    cache = make_cache(api, [("full", 4), ("full", 8)], 7, order="group", appending=True)
    assert cache.acquire("r", 16)  # g0 [1, 2, 3, 4], g1 [5, 6]: free list empty
    cache.free("r")
    # g0 released 4, 3, 2, 1, then g1 6, 5: free list [4, 3, 2, 1, 6, 5].
    assert cache.acquire("q", 8)
    assert cache.page_ids("q") == [[4, 3], [2]]
    cache.check_invariants()


def test_free_in_hybrid_order_evicts_every_group_tail_first_together(api: ModuleType) -> None:
    """SPEC 12.3, the default order: a request's groups are evicted together, tail first."""
    cache = make_cache(api, [("full", 4), ("full", 8)], 7, appending=True)
    assert cache.acquire("r", 16)  # g0 [1, 2, 3, 4] (slot ends 4, 8, 12, 16), g1 [5, 6] (8, 16)
    cache.free("r")
    # By slot end token, descending; ties: lower group first. 16: page 4 (g0), page 6 (g1);
    # 12: page 3; 8: page 2 (g0), page 5 (g1); 4: page 1. Free list [4, 6, 3, 2, 5, 1].
    assert cache.acquire("q", 16)  # takes all six: g0 the first four, g1 the last two
    assert cache.page_ids("q") == [[4, 6, 3, 2], [5, 1]]
    cache.check_invariants()
    # A shorter request: two evictions take the tail of both groups' chains, not one group's half.
    hs = fake_hashes(4)
    cache.register("q", hs)
    cache.free("q")  # free list by end: 16: 2 (g0), 1 (g1); 12: 3; 8: 6 (g0), 5 (g1); 4: 4
    assert cache.acquire("z", 4)  # g0 takes page 2, g1 takes page 1: the 16-token boundary goes
    assert cache.match_prefix(hs).num_common_tokens == 8  # the 8-token prefix survives whole
    with pytest.raises(ValueError, match="eviction_order"):
        make_cache(api, [("full", 4)], 4, order="lru")


def test_no_group_stands_for_the_request(api: ModuleType) -> None:
    """SPEC 12.5: group 0 is the sliding group here (alternating models); the request is all groups."""
    cache = make_cache(api, [("sliding_window", 16, 17), ("full", 16)], 40)
    hs = fake_hashes(4)
    assert cache.pages_needed(40) == 3 + 3
    assert cache.acquire("a", 64)  # g0 pages 1..4, g1 pages 5..8
    cache.register("a", hs[:2])
    cache.register("a", [hs[3]], first_slot=3)  # slot 3 in both groups; slot 2 in neither
    cache.free("a")
    # Group 0 alone would resume at 64 (slot 3 hits, needed = 1). The full group stops at slot 2:
    # bound 32; g0 re-matched at 32 -> slot 1 hits -> [0, page 2].
    match = cache.match_prefix(hs)
    assert (match.num_common_tokens, match.pages, match.num_hit_pages) == (32, [[0, 2], [5, 6]], [1, 2])
    assert cache.prefill_first_chunk("b", match, 32)
    assert cache.tail_available("b") == [0, 0]
    # Reclaim counts the sliding group's pages; the full group keeps all: at n = 64 g0's
    # k = (64 - 16) // 16 = 3 -> slots 0..2: page 2 and the first new page.
    assert cache.pages_reclaimable("b", 64) == 2
    cache.free("b")
    assert cache.num_requests == 0 and cache.num_free_pages == 39
    cache.check_invariants()


def test_block_tables_pad_holes_and_dtype(api: ModuleType) -> None:
    if not flat_kvcache.FLAT_KVCACHE:
        pytest.skip("the `flat` feature is off in this build (see test_block_tables_follow_the_build_flag)")
    cache = api.PageCache(
        [api.KVCacheSpec("sliding_window", 4, 5, "swa"), api.KVCacheSpec("full", 8, None, "full")], 20
    )
    assert cache.acquire("a", 16)  # swa [1, 2, 3, 4], full [5, 6]
    assert cache.acquire("b", 4)  # swa [7], full [8] (tail 4)
    cache.reclaim("a", 16)  # swa k = (16 - 4) // 4 = 3 -> [0, 0, 0, 4]
    tables = cache.block_tables(["b", "a", "b"])
    assert list(tables) == ["swa", "full"]
    for array in tables.values():
        assert array.dtype == np.int32 and array.ndim == 2
    assert tables["swa"].tolist() == [[7, -1, -1, -1], [0, 0, 0, 4], [7, -1, -1, -1]]
    assert tables["full"].tolist() == [[8, -1], [5, 6], [8, -1]]
    empty = cache.block_tables([])
    assert [a.shape for a in empty.values()] == [(0, 0), (0, 0)]
    assert cache.acquire("c", 0)
    assert [a.shape for a in cache.block_tables(["c"]).values()] == [(1, 0), (1, 0)]


@pytest.mark.flag
def test_block_tables_follow_the_build_flag(api: ModuleType) -> None:
    cache = make_cache(api, [("full", 4)], 4)
    assert cache.acquire("a", 4)
    if flat_kvcache.FLAT_KVCACHE:
        assert cache.block_tables(["a"])["g0"].tolist() == [[1]]
    else:
        with pytest.raises(RuntimeError, match="without the `flat` cargo feature"):
            cache.block_tables(["a"])


@pytest.mark.flag
def test_reference_reads_the_build_flag_at_call_time(monkeypatch: pytest.MonkeyPatch) -> None:
    ref = flat_kvcache.reference
    cache = ref.PageCache([ref.KVCacheSpec("full", 4)], 4)
    assert cache.acquire("a", 4)
    monkeypatch.setattr(_native, "FLAT_KVCACHE", False)
    with pytest.raises(RuntimeError, match="compiled without the `flat` cargo feature"):
        cache.block_tables(["a"])
    monkeypatch.setattr(_native, "FLAT_KVCACHE", True)
    assert cache.block_tables(["a"])["g0"].tolist() == [[1]]


def test_check_invariants_detects_a_broken_pool() -> None:
    # Reference only: break the bookkeeping on purpose through a private attribute.
    ref = flat_kvcache.reference
    cache = ref.PageCache([ref.KVCacheSpec("full", 4)], 4)
    assert cache.acquire("a", 4)
    cache.check_invariants()
    cache._pool._ref_counts[1] = 2
    with pytest.raises(RuntimeError, match="page 1"):
        cache.check_invariants()


def test_checkpoint_counters_follow_written_hit_and_evicted(api: ModuleType) -> None:
    """SPEC 13.5 checkpoints, counted in ``stats()``. Full P = 4 next to state P = 8 over 11
    usable pages; the figures below are worked out from the rules, not read from a run."""
    specs = [api.KVCacheSpec("full", 4, group_id="full"), api.KVCacheSpec("state", 8, group_id="state")]
    cache = api.FlatKVCache(specs, 12)

    def counts() -> tuple[int, int, int]:
        s = cache.stats()
        return s["checkpoints_written"], s["checkpoints_hit"], s["checkpoints_evicted"]

    slot, hit = cache.add_request("a", list(range(20)))
    assert hit == 0 and counts() == (0, 0, 0)
    # Chunk 16 ends on the state grain: its state page (slot 1) is the checkpoint at 16, keyed
    # when the next schedule registers what was computed (the step has run by then).
    assert cache.schedule([slot], [16]).tolist() == [True]
    assert counts() == (0, 0, 0)
    assert cache.schedule([slot], [4]).tolist() == [True]
    assert counts() == (1, 0, 0)
    # 20 is not a multiple of 8: finishing keys no state page (only full pages 0..4).
    cache.finish([slot])
    assert counts() == (1, 0, 0)
    # B shares the 20 tokens: the deepest checkpoint on the path is 16; one hit restores it.
    slot_b, hit_b = cache.add_request("b", [*range(20), 99, 99, 99, 99])
    assert hit_b == 16 and counts() == (1, 1, 0)
    cache.finish([slot_b])
    # C, 40 new tokens, needs 10 full pages and 1 state page: all 11, so every key is evicted,
    # the 5 full pages' and the one checkpoint's.
    slot_c, _ = cache.add_request("c", [500 + i for i in range(40)])
    assert cache.schedule([slot_c], [40]).tolist() == [True]
    assert cache.stats()["evictions"] == 6
    assert counts() == (1, 1, 1)


def test_register_in_some_groups_only(api: ModuleType) -> None:
    """``register(..., groups=[...])`` keys the listed groups' slots and leaves the others'
    pages unkeyed (vLLM's sparse retention keys a sliding group's block only where a later
    request could resume, a full group's always). Full P = 4 beside sliding P = 4, W = 8: two
    pages registered in the full group only are a full hit for it and none for the sliding
    group, so a match resumes nowhere; registering the sliding group's last page afterwards
    (its window: ceil(7 / 4) = 2 pages, the first a hole in a hit) makes the 8 tokens a hit."""
    specs = [api.KVCacheSpec("full", 4, group_id="full"), api.KVCacheSpec("sliding_window", 4, 8, "swa")]
    cache = api.PageCache(specs, 32, enable_kv_events=True)
    hashes = api.hash_pages(list(range(9)), 4)
    assert cache.acquire("a", 9)
    cache.register("a", hashes, groups=[0])
    stored = [e for e in cache.take_events() if type(e).__name__ == "BlockStored"]
    assert [e.group_index for e in stored] == [0] and len(stored[0].block_hashes) == 2
    assert cache.match_prefix(hashes).num_common_tokens == 0  # the sliding group has no page
    cache.register("a", hashes, groups=[1])
    stored = [e for e in cache.take_events() if type(e).__name__ == "BlockStored"]
    assert [e.group_index for e in stored] == [1]
    match = cache.match_prefix(hashes)
    assert match.num_common_tokens == 8 and match.num_hit_pages == [2, 2]
    # An empty list registers nothing; None (the default) every group.
    assert cache.acquire("b", 4)
    cache.register("b", api.hash_pages([7, 7, 7, 7], 4), groups=[])
    assert cache.take_events() == []


def test_register_groups_are_checked_before_the_request(api: ModuleType) -> None:
    cache = api.PageCache([api.KVCacheSpec("full", 4)], 8)
    with pytest.raises(ValueError, match=r"^groups\[0\] = 1 is no group of this cache \(it has 1: 0 to 0\)$"):
        cache.register("nobody", [], groups=[1])
    with pytest.raises(ValueError, match=r"^groups\[1\] = 0 is listed twice$"):
        cache.register("nobody", [], groups=[0, 0])
    with pytest.raises(TypeError, match=r"^groups\[0\] must be an int, got str$"):
        cache.register("nobody", [], groups=["0"])
