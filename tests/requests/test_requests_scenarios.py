"""Hand-derived scenarios of the token-level request API (docs/requests-api.md).

Each runs against both implementations (the ``api`` fixture: native and reference) and checks
values worked out by hand from the contract.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import flat_kvcache
import numpy as np
import pytest
from flat_kvcache.events import AllBlocksCleared, BlockRemoved
from helpers import PAGE_LEVEL_METHODS, need
from slots import running

needs_flat = pytest.mark.skipif(
    not getattr(flat_kvcache, "FLAT_KVCACHE", False), reason="built without the `flat` feature"
)


def full_cache(api: ModuleType, num_pages: int = 64, **options: Any) -> Any:
    """One full-attention group, P = 4."""
    return api.FlatKVCache([api.KVCacheSpec("full", 4)], num_pages, **options)


#: The token-level protocol (docs/requests-api.md): only ``FlatKVCache`` has these.
TOKEN_LEVEL = (
    "add_request",
    "admit",
    "append_tokens",
    "schedule",
    "finish",
    "preempt",
    "num_computed_tokens",
    "num_tokens",
    "slot_of",
    "id_of",
    "bind_rows",
    "update_rows",
    "unbind_rows",
    "prefix_hit_tokens",
    "pages_needed_to_admit",
    "reserve",
    "budget",
)
#: What both classes answer (docs/requests-api.md, the shared calls).
SHARED = (
    "base_page_size",
    "lcm_page_size",
    "num_groups",
    "group_ids",
    "num_free_pages",
    "num_requests",
    "pool_stats",
    "stats",
    "take_events",
    "reset_prefix_cache",
    "check_invariants",
    "take_transfers",
    "ack_transfers",
    "transfers_in_flight",
)
#: Readers both classes have, each its own way: by slot on ``FlatKVCache``, by id on ``PageCache``.
PER_CLASS = ("page_ids", "tail_available", "block_tables", "pages_needed", "loads_in_flight")
#: Gone from ``FlatKVCache`` with the slot API (``has_request`` stays on ``PageCache``).
REMOVED = ("schedule_batch", "schedule_rows", "append_tokens_batch", "append_tokens_rows", "row_of")


def test_each_class_has_its_own_protocol_only(api: ModuleType) -> None:
    """A method of one protocol is absent from the other class (AttributeError), so a cache's
    requests are all of one kind; the shared calls are on both."""
    specs = [api.KVCacheSpec("full", 4)]
    token, page = api.FlatKVCache(specs, 8), api.PageCache(specs, 8)
    for name in (*SHARED, *PER_CLASS):
        assert hasattr(token, name) and hasattr(page, name), name
    for name in (*PAGE_LEVEL_METHODS, "has_request"):
        assert hasattr(page, name), name
        with pytest.raises(AttributeError, match=name):
            getattr(token, name)
    for name in TOKEN_LEVEL:
        assert hasattr(token, name), name
        with pytest.raises(AttributeError, match=name):
            getattr(page, name)
    for name in REMOVED:
        for cache in (token, page):
            with pytest.raises(AttributeError, match=name):
                getattr(cache, name)
    assert not issubclass(api.PageCache, api.FlatKVCache)
    assert not issubclass(api.FlatKVCache, api.PageCache)
    assert repr(page).startswith("PageCache(") and repr(token).startswith("FlatKVCache(")


def test_the_readers_take_slots_on_one_class_and_ids_on_the_other(api: ModuleType) -> None:
    """``page_ids``, ``tail_available``, ``block_tables``, ``pages_needed`` and
    ``loads_in_flight`` read a request by slot on ``FlatKVCache`` and by id on ``PageCache``."""
    specs = [api.KVCacheSpec("full", 4)]
    token, page = api.FlatKVCache(specs, 8), api.PageCache(specs, 8)
    assert token.add_request("r", list(range(6))) == (0, 0)
    assert token.schedule([0], [6]).all()
    assert page.acquire("r", 6)
    assert token.page_ids(0) == page.page_ids("r") == [[1, 2]]
    assert token.tail_available(0) == page.tail_available("r") == [2]
    assert token.pages_needed(3, 0) == page.pages_needed(3, "r") == 1
    assert token.loads_in_flight(0) == page.loads_in_flight("r") == 0
    # An id where a slot goes is no slot, and a slot where an id goes names no request.
    with pytest.raises(TypeError):
        token.page_ids("r")
    with pytest.raises(KeyError):
        page.page_ids(0)
    assert page.has_request("r") and not page.has_request(0)


def test_capped_match_leaves_the_last_prompt_token(api: ModuleType) -> None:
    cache = full_cache(api)
    assert cache.add_request("a", list(range(16))) == (0, 0)
    assert cache.schedule([0], [16]).tolist() == [True]
    cache.finish([0])
    # All 4 pages are cached, but a prompt of exactly 4 pages matches (16 - 1) // 4 = 3.
    assert cache.prefix_hit_tokens(list(range(16))) == 12
    assert cache.prefix_hit_tokens(list(range(17))) == 16
    assert cache.prefix_hit_tokens([0]) == 0
    assert cache.add_request("b", list(range(16))) == (0, 12)
    assert (cache.num_computed_tokens(0), cache.num_tokens(0)) == (12, 16)
    assert [len(pages) for pages in cache.page_ids(0)] == [3]
    # Different extra keys hash apart: no hit.
    assert cache.prefix_hit_tokens(list(range(17)), extra_keys=["lora-1"]) == 0
    stats = cache.stats()
    assert (stats["prefix_queries_tokens"], stats["prefix_hits_tokens"]) == (16 + 16, 12)
    cache.check_invariants()


def test_append_tokens_of_many_slots_hashes_pages_in_order(api: ModuleType) -> None:
    """An append of many slots is per-request appends in order: pages that fill are hashed and
    register once computed, so a later prompt with the same tokens hits them."""
    cache = full_cache(api)
    assert cache.add_request("a", [1, 2, 3]) == (0, 0)
    assert cache.add_request(7, [50]) == (1, 0)
    assert cache.schedule([0, 1], [3, 1]).tolist() == [True, True]
    cache.append_tokens([0, 1], [4, 51])  # one each: "a" fills its first page
    # Counts: 7 gets 52, "a" gets 5 to 8, then 7 gets 53 (a repeated slot appends in order).
    cache.append_tokens([1, 0, 1], [52, 5, 6, 7, 8, 53], [1, 4, 1])
    assert (cache.num_tokens(0), cache.num_tokens(1)) == (8, 4)
    assert cache.schedule([0, 1], [5, 3]).tolist() == [True, True]
    assert cache.preempt([1]) == [[50, 51, 52, 53]]
    cache.finish([0])
    # "a" knew [1..8]: two full pages, both registered at finish; a 9-token prompt hits both.
    assert cache.prefix_hit_tokens([1, 2, 3, 4, 5, 6, 7, 8, 0]) == 8
    assert cache.prefix_hit_tokens([50, 51, 52, 53, 0]) == 4
    cache.check_invariants()


def test_admission_probes_follow_the_prompt_contents(api: ModuleType) -> None:
    """Probing, sizing and adding one prompt hash it once natively (a memo of the last prompt),
    so the answers must follow the tokens, not the array object: an array changed in place, a
    strided view and a copy each get the answer for their contents."""
    cache = full_cache(api)
    running(cache, "a", list(range(17)))
    cache.finish([0])  # 4 full pages cached
    prompt = np.arange(17, dtype=np.uint32)
    assert cache.prefix_hit_tokens(prompt) == 16
    prompt[5] = 999  # same object, page 1 differs now: only page 0 matches
    assert cache.prefix_hit_tokens(prompt) == 4
    # The claim takes the one free cached page, then ceil(13 / 4) = 4 fresh pages.
    assert cache.pages_needed_to_admit(prompt, 13) == 1 + 4
    assert cache.prefix_hit_tokens(np.arange(34, dtype=np.uint32)[::2]) == 0  # 0, 2, 4, ...
    assert cache.prefix_hit_tokens(np.arange(17, dtype=np.int64)) == 16
    assert cache.add_request("b", prompt) == (0, 4)
    assert cache.num_tokens(0) == 17
    assert cache.preempt([0]) == [[*range(5), 999, *range(6, 17)]]
    cache.check_invariants()


def test_preempt_then_readd_is_a_prefix_hit(api: ModuleType) -> None:
    cache = full_cache(api)
    running(cache, "a", list(range(10)))
    cache.append_tokens([0], [100, 101, 102, 103, 104, 105], [6])
    assert cache.schedule([0], [6]).tolist() == [True]
    (tokens,) = cache.preempt([0])
    assert tokens == [*range(10), *range(100, 106)]
    assert cache.slot_of("a") is None and cache.num_requests == 0
    assert cache.stats()["preemptions"] == 1
    # preempt registered the 4 computed pages; the re-added prompt (16 tokens) hits 3 of them.
    assert cache.add_request("a", tokens) == (0, 12)
    assert cache.num_computed_tokens(0) == 12
    cache.check_invariants()


def test_reserve_budget_and_schedule_release(api: ModuleType) -> None:
    cache = full_cache(api, num_pages=9)  # 8 real pages
    a = running(cache, "a", list(range(8)))  # 2 pages
    assert cache.budget() == 6
    cache.reserve([a], [4])  # the next 4 tokens need 1 page (the tail is full)
    assert (cache.budget(), cache.budget(a)) == (5, 6)
    b, _ = cache.add_request("b", list(range(50, 53)))
    cache.reserve([b], [8])  # 2 pages on empty tables
    assert (cache.budget(), cache.budget(a), cache.budget(b)) == (3, 4, 5)
    cache.reserve([b], [0])  # clears b's reserve
    assert cache.budget() == 5
    cache.reserve([b], [5])  # replaces: 2 pages again
    assert cache.budget() == 3
    cache.append_tokens([a], [9])
    assert cache.schedule([a], [1]).tolist() == [True]  # releases a's reserve; 1 page allocated
    assert (cache.num_free_pages, cache.budget()) == (5, 3)
    # A failed schedule keeps the reserve.
    cache.reserve([a], [4])
    cache.append_tokens([a], list(range(30)), [30])
    assert cache.schedule([a], [30]).tolist() == [False]
    assert cache.budget() == 5 - 1 - 2
    cache.finish([b])  # releases b's reserve
    assert cache.budget() == 5 - 1
    cache.preempt([a])  # releases a's reserve too
    assert cache.budget() == 8
    # Admission: an unrelated 8-token prompt, 8 new tokens and 4 reserved: 0 + ceil(12 / 4).
    assert cache.pages_needed_to_admit(list(range(200, 208)), 8, 4) == 3
    cache.check_invariants()


@pytest.mark.parametrize(
    ("order", "expected"),
    [
        # hybrid: slot ends 8 (g0 4, g1 6), 6 (g0 3), 4 (g0 2, g1 5), 2 (g0 1) leave first.
        ("hybrid", [[7, 8, 4, 6], [3, 2]]),
        # group: g0's table tail first (4, 3, 2, 1), then g1's (6, 5).
        ("group", [[7, 8, 4, 3], [2, 1]]),
    ],
)
def test_eviction_order_on_two_groups(api: ModuleType, order: str, expected: list[list[int]]) -> None:
    # Full P = 2 (g0) and sliding P = 4, W = 64 (g1): 8 tokens hold g0 [1, 2, 3, 4], g1 [5, 6].
    specs = [api.KVCacheSpec("full", 2), api.KVCacheSpec("sliding_window", 4, 64)]
    cache = api.FlatKVCache(specs, 9, eviction_order=order, enable_kv_events=True)
    running(cache, "a", list(range(8)))
    assert cache.page_ids(0) == [[1, 2, 3, 4], [5, 6]]
    cache.finish([0])
    cache.take_events()
    # An unrelated request takes 4 + 2 pages from the front of the free list: the two never
    # used pages (7, 8), then the first four pages `finish` released.
    assert running(cache, "b", list(range(100, 108))) == 0
    assert cache.page_ids(0) == expected
    removed = [event for event in cache.take_events() if type(event).__name__ == "BlockRemoved"]
    evicted = sum(len(event.block_hashes) for event in removed)
    assert evicted == 4 == cache.stats()["evictions"]
    cache.check_invariants()


def test_events_of_a_request(api: ModuleType) -> None:
    cache = full_cache(api, enable_kv_events=True)
    assert cache.add_request("a", list(range(9)), extra_keys=["salt"]) == (0, 0)
    assert cache.take_events() == []
    assert cache.schedule([0], [9]).all()  # registers nothing yet: the position was 0
    assert cache.take_events() == []
    cache.finish([0])  # registers the 2 full pages below 9
    (stored,) = cache.take_events()
    hashes = flat_kvcache.hash_pages(list(range(9)), 4, extra_keys=["salt"])
    assert stored.block_hashes == [bytes.fromhex(h) for h in hashes]
    assert stored.parent_block_hash is None
    assert stored.token_ids == list(range(8))
    assert (stored.block_size, stored.group_index, stored.group_kind) == (4, 0, "full")
    assert stored.extra_keys == ["salt"]
    assert cache.reset_prefix_cache() == 2
    assert [type(event).__name__ for event in cache.take_events()] == ["AllBlocksCleared"]
    # Events off: nothing is recorded.
    quiet = full_cache(api)
    running(quiet, "a", list(range(9)))
    quiet.finish([0])
    assert quiet.take_events() == []


def test_reset_while_a_request_holds_cached_pages_reports_only_the_dropped_keys(api: ModuleType) -> None:
    """Pages a running request holds keep their keys through a reset and keep serving hits,
    so the events must not claim the cache is empty: they name exactly the dropped keys."""
    cache = full_cache(api, enable_kv_events=True)
    other = list(range(100, 105))
    running(cache, "b", other)
    cache.finish([0])  # one full page cached, then free
    a = running(cache, "a", list(range(9)))
    cache.append_tokens([a], [9])
    assert cache.schedule([a], [1]).all()  # registers a's two full pages below 9: cached and pinned
    assert [type(item).__name__ for item in cache.take_events()] == ["BlockStored", "BlockStored"]
    stats = cache.stats()
    assert (stats["pages_cached"], stats["pages_cached_free"]) == (3, 1)
    # The reset drops b's free page only; a's two pages keep their keys.
    assert cache.reset_prefix_cache() == 1
    dropped = bytes.fromhex(flat_kvcache.hash_pages(other, 4)[0])
    assert cache.take_events() == [BlockRemoved([dropped], 0)]
    assert cache.stats()["pages_cached"] == 2
    assert cache.prefix_hit_tokens(other) == 0
    assert cache.prefix_hit_tokens(list(range(9))) == 8
    # Nothing free is cached now: a second reset drops nothing and records nothing.
    assert cache.reset_prefix_cache() == 0
    assert cache.take_events() == []
    cache.finish([a])  # both full pages were registered already: no new event
    assert cache.take_events() == []
    assert cache.prefix_hit_tokens(list(range(9))) == 8
    # No request holds a cached page any more: the reset empties the cache, one AllBlocksCleared.
    assert cache.reset_prefix_cache() == 2
    assert cache.take_events() == [AllBlocksCleared()]
    assert cache.stats()["pages_cached"] == 0
    assert cache.prefix_hit_tokens(list(range(9))) == 0
    cache.check_invariants()


@pytest.mark.parametrize(
    ("reuse_uncached_first", "expected", "hit"),
    [
        # Free list after "x" is freed (released 4 then 3, both uncached): [3, 4, 5, 6, 2, 1];
        # "c" takes 3, 4, 5, 6, 2 and evicts only a's page 2 (slot 1): page 1 still hits 4.
        (True, [3, 4, 5, 6, 2], 4),
        # SPEC 5: [5, 6, 2, 1, 4, 3]; "c" takes 5, 6, 2, 1, 4 and evicts both of a's pages.
        (False, [5, 6, 2, 1, 4], 0),
    ],
)
def test_reuse_uncached_first_keeps_cached_pages_longer(
    api: ModuleType, reuse_uncached_first: bool, expected: list[int], hit: int
) -> None:
    cache = full_cache(api, 7, reuse_uncached_first=reuse_uncached_first)  # pages 1..6
    running(cache, "a", list(range(8)))
    cache.finish([0])  # a's pages [1, 2] cached; released by slot end: 2, then 1
    # x takes 8 tokens' pages by lookahead and computes none: they are never registered.
    assert cache.add_request("x", [900], use_prefix_cache=False) == (0, 0)
    assert cache.schedule([0], [0], lookahead=8).all()
    assert cache.page_ids(0) == [[3, 4]]
    cache.finish([0])  # released by slot end, as a's: 4, then 3
    assert cache.add_request("c", [800], use_prefix_cache=False) == (0, 0)
    assert cache.schedule([0], [0], lookahead=20).all()
    assert cache.page_ids(0) == [expected]
    assert cache.prefix_hit_tokens(list(range(9))) == hit
    assert cache.stats()["evictions"] == 2 - hit // 4
    cache.check_invariants()


def test_schedule_more_than_known_is_value_error(api: ModuleType) -> None:
    cache = full_cache(api)
    cache.add_request("a", list(range(6)))
    with pytest.raises(ValueError, match=r"request 'a' \(slot 0\)"):
        cache.schedule([0], [7])
    # The lookahead is room past the scheduled tokens, known or not (the reference engine;
    # docs/requests-api.md's check "computed + ns + lookahead <= num_tokens" would refuse it).
    assert cache.schedule([0], [4], lookahead=3).tolist() == [True]
    with pytest.raises(ValueError):
        cache.schedule([0], [3])
    assert (cache.num_computed_tokens(0), cache.num_free_pages) == (4, 63 - 2)
    assert cache.schedule([0], [0]).tolist() == [True]  # n == 0 is allowed
    with pytest.raises(KeyError):
        cache.schedule([1], [1])
    cache.check_invariants()


def test_schedule_validates_everything_before_changing_anything(api: ModuleType) -> None:
    cache = full_cache(api)
    cache.add_request("a", list(range(8)))
    cache.add_request("b", list(range(8)))
    before = (cache.num_free_pages, cache.page_ids(0), cache.page_ids(1))
    with pytest.raises(KeyError):
        cache.schedule([0, 2], [1, 1])
    with pytest.raises(ValueError):
        cache.schedule([0, 1], [1, 9])
    with pytest.raises(ValueError):
        cache.schedule([0, 0], [5, 5])  # a repeated slot's asks add up
    with pytest.raises(ValueError):
        cache.schedule([0], [1, 1])
    assert (cache.num_free_pages, cache.page_ids(0), cache.page_ids(1)) == before
    assert cache.num_computed_tokens(0) == cache.num_computed_tokens(1) == 0
    got = cache.schedule(np.array([0, 1]), np.array([8, 4]))
    assert isinstance(got, np.ndarray)
    assert got.dtype == np.bool_
    assert got.tolist() == [True, True]
    assert (cache.num_computed_tokens(0), cache.num_computed_tokens(1)) == (8, 4)
    cache.check_invariants()


def test_a_failed_schedule_moves_nothing_and_the_rest_go_on(api: ModuleType) -> None:
    """Each slot is scheduled in order: one that does not fit returns False (position and
    pages unchanged) and the next ones still run."""
    cache = full_cache(api, 5)  # 4 real pages
    cache.add_request("a", list(range(4)))
    cache.add_request("b", list(range(100, 120)))
    cache.add_request("c", list(range(200, 204)))
    assert cache.schedule([0, 1, 2], [4, 20, 4]).tolist() == [True, False, True]
    assert (cache.num_computed_tokens(0), cache.num_computed_tokens(1), cache.num_computed_tokens(2)) == (
        4,
        0,
        4,
    )
    assert cache.page_ids(1) == [[]] and cache.num_free_pages == 2
    cache.check_invariants()


@needs_flat
def test_block_tables_out_writes_the_callers_buffer(api: ModuleType) -> None:
    specs = [api.KVCacheSpec("full", 4), api.KVCacheSpec("sliding_window", 4, 5)]
    cache = api.FlatKVCache(specs, 64)
    assert cache.add_request("a", list(range(16))) == (0, 0)
    assert cache.schedule([0], [12]).all()
    assert cache.schedule([0], [4]).all()  # the sliding group reclaimed table slots 0 and 1
    assert running(cache, "b", list(range(100, 104))) == 1
    expected = cache.block_tables([0, 1])
    for g, gid in enumerate(cache.group_ids):
        assert expected[gid][0, :4].tolist() == cache.page_ids(0)[g]
        assert expected[gid][1, :1].tolist() == cache.page_ids(1)[g]
    out = {gid: np.full((3, 6), 77, dtype=np.int32) for gid in cache.group_ids}
    views = {gid: array for gid, array in out.items()}
    returned = cache.block_tables([0, 1], out=out)
    assert returned is out
    for gid, array in out.items():
        assert array is views[gid]
        rows = expected[gid].shape[1]
        assert array[:2, :rows].tolist() == expected[gid].tolist()
        assert (array[:2, rows:] == -1).all()
        assert (array[2] == 77).all()  # rows past len(reqs) are untouched
    assert out["g1"][0, :2].tolist() == [0, 0]  # holes are 0
    # A table wider than cols: ValueError, nothing written.
    narrow = {gid: np.full((2, 2), 77, dtype=np.int32) for gid in cache.group_ids}
    with pytest.raises(ValueError):
        cache.block_tables([0, 1], out=narrow)
    assert all((array == 77).all() for array in narrow.values())
    # Wrong dtype, too few rows, not contiguous, a missing group.
    bad_dtype = {gid: np.zeros((2, 8), dtype=np.int64) for gid in cache.group_ids}
    with pytest.raises(TypeError):
        cache.block_tables([0], out=bad_dtype)
    with pytest.raises(ValueError):
        cache.block_tables([0, 1], out={gid: np.zeros((1, 8), np.int32) for gid in cache.group_ids})
    with pytest.raises(ValueError):
        cache.block_tables([0], out={gid: np.zeros((8, 8), np.int32)[:, ::2] for gid in cache.group_ids})
    with pytest.raises(ValueError):
        cache.block_tables([0], out={"g0": np.zeros((1, 8), np.int32)})
    # Rows follow the slots given, repeats included.
    again = cache.block_tables(np.array([1, 0, 1]))
    for gid, table in again.items():
        assert table[0].tolist() == table[2].tolist() == expected[gid][1].tolist()


@needs_flat
@pytest.mark.torch
def test_block_tables_out_torch_tensor_in_place(api: ModuleType) -> None:
    torch = need("torch")
    cache = full_cache(api)
    slot = running(cache, "a", list(range(8)))
    tensor = torch.full((2, 4), 77, dtype=torch.int32)
    pointer = tensor.data_ptr()
    returned = cache.block_tables([slot], out={"g0": tensor})
    assert returned["g0"] is tensor
    assert tensor.data_ptr() == pointer
    assert tensor.tolist() == [[1, 2, -1, -1], [77, 77, 77, 77]]
