"""The arena mode of ``BlockPool`` (SPEC 13.2; ``rust/core/src/engine/pool/arena.rs``), native
against the pure-Python reference.

- Scenario tests (``api`` fixture: both implementations): every expectation is worked out by hand
  from the rules of the arena module doc, with the working in comments, never by running the
  code: the page ids of a unit (``ceil(u*U/s) .. floor((u+1)*U/s) - 1`` plus the group's base),
  where released pages go (their own group's list while the unit is busy, the unit to the free
  units when nothing in it is referenced or cached, to the idle units when some page holds a
  key), whole-unit eviction of the least recently idle unit, prefix hits waking an idle unit,
  all-or-nothing allocation, the credit, and the errors of bad geometries and misuse.
- A hypothesis state machine drives a native and a reference arena pool side by side with the
  same operations (misuse too) and requires identical results or identical exceptions (class
  and message), identical probes after every step, and no broken invariant on either side
  (native ``_check()``, reference ``_arena_check()``). ``HYPOTHESIS_PROFILE=ci`` runs more.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import flat_kvcache
import flat_kvcache.reference
import numpy as np
import pytest
from helpers import Outcome, outcome
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from strategies import examples

NATIVE: ModuleType = flat_kvcache
REFERENCE: ModuleType = flat_kvcache.reference

#: Examples of the native-vs-reference machine: 200 by default, 1000 under the CI profile.
MACHINE_EXAMPLES = examples(dev=200, ci=1000, variable="ARENA_POOL_EXAMPLES")

MAX_BLOCKS = 2**31 - 1
MAX_SCALE = 2**24


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def unit_ids(unit_bytes: int, page_bytes: int, base: int, unit: int) -> list[int]:
    """The contract's pool ids of a group's pages in ``unit``: view pages
    ``ceil(u*U/s) .. floor((u+1)*U/s) - 1``, offset by the group's base."""
    lo = ceil_div(unit * unit_bytes, page_bytes)
    hi = (unit + 1) * unit_bytes // page_bytes
    return [base + page for page in range(lo, hi)]


def bases(unit_bytes: int, num_units: int, page_bytes: list[int]) -> list[int]:
    """Group ``g``'s base: ``base[0] = 0`` and each group's view ``0 .. N*U/s - 1`` follows the
    previous one's last id (its view index 0, the null page, is never handed out)."""
    out, total = [], 1
    for size in page_bytes:
        out.append(total - 1)
        total += num_units * unit_bytes // size - 1
    return out


def record(pool: Any) -> Any:
    pool._set_record_evictions(True)
    return pool


# ------------------------------------------------------------------------------------------------
# Geometry: ids, bases, costs
# ------------------------------------------------------------------------------------------------


def test_arena_geometry_probes(api: ModuleType) -> None:
    # U = 10, N = 4, pages [10, 3, 4].
    # g0 (s = 10): N*U/s = 4 view ids (0..3), base 0; unit u holds page u. kmin 1.
    # g1 (s = 3): 40 // 3 = 13 view ids, base 4 - 1 = 3; unit 1 = bytes [10, 20): pages
    #   ceil(10/3) = 4 .. floor(20/3) - 1 = 5 (2 pages); unit 2: 7..9; unit 3: 10..12. kmin 2.
    # g2 (s = 4): 10 view ids, base 3 + 13 - 1 = 15; units hold 3..4, 5..6, 8..9. kmin 2.
    # Ids 1 + 3 + 12 + 9 = 25; scale lcm(1, 2, 2) = 2; costs 2/1, 2/2, 2/2.
    pool = api.BlockPool.with_arena(10, 4, [10, 3, 4])
    assert pool.is_arena
    assert pool.num_blocks == 25
    assert [pool.group_base(g) for g in range(3)] == [0, 3, 15]
    assert [pool.group_ids(g) for g in range(3)] == [4, 13, 10]
    assert [pool.page_cost(g) for g in range(3)] == [2, 1, 1]
    # Three free units of 2 credits each.
    assert (pool.num_free, pool.num_cached, pool.num_cached_free) == (6, 0, 0)
    assert repr(pool) == "BlockPool(num_blocks=25, num_free=6, num_cached=0)"
    assert pool.num_total == 6  # 3 units but the null one, 2 credits each
    assert pool.arena_stats() == {
        "unit_bytes": 10,
        "units_total": 3,
        "units_free": 3,
        "units_idle": 0,
        "units_bound": [0, 0, 0],
        "pages_free": [0, 0, 0],
        "stranded_bytes": 0,
        "pages_cached": [0, 0, 0],
        "cached_bytes": 0,
    }
    for g in (3, 10):
        with pytest.raises(ValueError, match=r"^g must be < 3 \(the arena's groups\), got "):
            pool.group_base(g)
    with pytest.raises(ValueError, match=r"^g must be >= 0, got -1$"):
        pool.page_cost(-1)
    with pytest.raises(TypeError, match=r"^g must be an int, got str$"):
        pool.group_ids("0")


@pytest.mark.parametrize(
    ("unit_bytes", "num_units", "page_bytes"),
    [
        (10, 4, [10, 3, 4]),  # pages straddling units; units of 2 or 3 pages of g1
        (7, 5, [2, 3, 7]),  # 7 is prime: every small page straddles somewhere
        (12, 3, [5, 12, 4]),  # units of 1 or 2 pages of 5 bytes, 3 of 4 bytes
        (6, 6, [4]),  # 4 > 6 / 2: one page per unit, every other one straddling
    ],
)
def test_a_bound_unit_hands_out_its_pages_lowest_id_first(
    api: ModuleType, unit_bytes: int, num_units: int, page_bytes: list[int]
) -> None:
    """Binding a unit puts its pages at the front of the group's free pages lowest id first, and
    units are bound front first (1, 2, ...): group g's n-th unit's pages are exactly the formula's."""
    base = bases(unit_bytes, num_units, page_bytes)
    for g, size in enumerate(page_bytes):
        pool = api.BlockPool.with_arena(unit_bytes, num_units, page_bytes)
        assert pool.group_base(g) == base[g]
        assert pool.group_ids(g) == num_units * unit_bytes // size
        handed_out = []
        for unit in range(1, num_units):
            # One page at a time: the bound unit's pages first, then the next free unit.
            want = unit_ids(unit_bytes, size, base[g], unit)
            got = [page for _ in want for page in pool.allocate(1, group=g)]
            assert got == want, (g, unit)
            handed_out += want
        # Every unit is bound: nothing more for any group, whatever the pages straddling.
        assert pool.num_free == 0
        for h in range(len(page_bytes)):
            assert pool.allocate(1, group=h) == []
        # The ids handed out are the group's view pages that lie wholly in units 1..N-1.
        view = {
            page
            for page in range(1, num_units * unit_bytes // size)
            if page * size >= unit_bytes
            and page * size // unit_bytes == ((page + 1) * size - 1) // unit_bytes
        }
        assert sorted(handed_out) == sorted(base[g] + page for page in view)
        assert pool.num_cached == 0


def test_straddling_and_null_unit_pages_are_never_handed_out(api: ModuleType) -> None:
    # U = 10, N = 4, one group of 4-byte pages: 10 view ids, base 0. Unit 1 holds 3..4 (bytes
    # 12..20), unit 2 5..6, unit 3 8..9; pages 0..1 lie in the null unit, page 2 (bytes 8..12)
    # and page 7 (28..32) straddle two units. kmin 2, scale 2, cost 1: 3 units = 6 credits.
    pool = api.BlockPool.with_arena(10, 4, [4])
    assert (pool.num_blocks, pool.num_free, pool.page_cost(0)) == (10, 6, 1)
    assert pool.allocate(6) == [3, 4, 5, 6, 8, 9]
    assert pool.num_free == 0
    # No unit holds 1, 2 or 7: nothing to claim or cache there.
    for page in (1, 2, 7):
        message = f"page {page} of group 0 lies in no unit bound to that group (arena mode)"
        with pytest.raises(ValueError, match=rf"^{message}$".replace("(", r"\(").replace(")", r"\)")):
            pool.touch(page)
        with pytest.raises(ValueError, match="lies in no unit bound"):
            pool.cache(page, "k")
    assert [pool.ref_count(p) for p in range(10)] == [0, 0, 0, 1, 1, 1, 1, 0, 1, 1]


# ------------------------------------------------------------------------------------------------
# Where released pages go
# ------------------------------------------------------------------------------------------------

# U = 4, N = 3, pages [4, 2]: g0 (s = 4) has 3 view ids, base 0, unit u = id u; g1 (s = 2) has
# 6 view ids, base 2, unit u = view pages 2u, 2u + 1 = ids 2u + 2, 2u + 3 (unit 1: 4, 5; unit 2:
# 6, 7). kmin [1, 2], scale 2, costs [2, 1]. Two units: 4 credits.
SMALL = (4, 3, [4, 2])


def test_a_released_page_of_a_busy_unit_serves_only_its_own_group(api: ModuleType) -> None:
    pool = api.BlockPool.with_arena(*SMALL)
    assert pool.num_free == 4
    assert pool.allocate(2, group=1) == [4, 5]  # unit 1 bound to g1
    assert pool.num_free == 2  # one free unit
    pool.free([5])  # unit 1 still has page 4 referenced: 5 joins g1's free pages
    assert pool.num_free == 2 + 1
    # Page 5's 2 bytes are stranded: only g1 can use them until unit 1 empties.
    stats = pool.arena_stats()
    assert (stats["units_free"], stats["units_bound"], stats["pages_free"]) == (1, [0, 1], [0, 1])
    assert (stats["units_idle"], stats["stranded_bytes"], pool.num_total) == (0, 2, 4)
    assert pool.allocate(1, group=0) == [2]  # g0 takes the free unit 2, not page 5's unit
    assert pool.num_free == 1
    # No unit is free or idle: g0 gets nothing although page 5 is free ...
    assert pool.allocate(1, group=0) == []
    assert pool.fits([1]) is False
    assert pool.fits([0, 1]) is True
    # ... while g1 reuses it.
    assert pool.allocate(1, group=1) == [5]
    assert (pool.num_free, pool.ref_count(5)) == (0, 1)


def test_a_unit_with_nothing_referenced_or_cached_is_free_for_any_group(api: ModuleType) -> None:
    pool = api.BlockPool.with_arena(*SMALL)
    assert pool.allocate(2, group=1) == [4, 5]
    assert pool.allocate(1, group=0) == [2]
    assert pool.allocate(1, group=0) == []
    # Released 5 (unit still busy: to g1's list), then 4: the unit's last referenced page, no
    # key in it, so unit 1 is free again (front of the free units) and its pages leave the list.
    pool.free([4, 5])
    assert pool.num_free == 2  # one free unit, no listed page
    assert pool.allocate(1, group=0) == [1]
    assert pool.num_free == 0


def test_an_idle_unit_is_evicted_whole_when_another_group_needs_a_unit(api: ModuleType) -> None:
    pool = record(api.BlockPool.with_arena(*SMALL))
    assert pool.allocate(2, group=1) == [4, 5]
    pool.cache(4, "a")
    pool.cache(5, "b")
    # Released 5 (cached: to the back of g1's list), then 4: nothing referenced, keys held, so
    # unit 1 goes idle; its pages stay findable.
    pool.free([4, 5])
    assert (pool.num_free, pool.num_cached, pool.num_cached_free) == (4, 2, 2)  # free + idle unit
    stats = pool.arena_stats()
    assert (stats["units_free"], stats["units_idle"], stats["units_bound"]) == (1, 1, [0, 1])
    assert (stats["pages_free"], stats["stranded_bytes"]) == ([0, 0], 0)
    assert pool.allocate(1, group=0) == [2]  # the free unit 2 first: the idle one is kept
    assert (pool.lookup("a"), pool.lookup("b"), pool._take_evicted()) == (4, 5, [])
    # No free unit left: the idle unit 1 is evicted whole (keys in id order) and bound to g0.
    assert pool.allocate(1, group=0) == [1]
    assert pool._take_evicted() == ["a", "b"]
    assert (pool.lookup("a"), pool.lookup("b"), pool.num_cached, pool.num_free) == (None, None, 0, 0)


def test_a_free_unit_goes_before_a_cached_page_of_a_busy_unit(api: ModuleType) -> None:
    """Taking spends what holds no data before a cached prefix: a page without a key, then a
    free unit, then a cached page of a busy unit, then an idle unit."""
    pool = record(api.BlockPool.with_arena(4, 4, [4, 2]))
    g1 = bases(4, 4, [4, 2])[1]
    u1, u2, u3 = (unit_ids(4, 2, g1, u) for u in (1, 2, 3))
    assert pool.allocate(2, group=1) == u1
    pool.cache(u1[1], "k")
    pool.free([u1[1]])  # unit 1 stays busy (u1[0] held); u1[1] is a cached free page
    stats = pool.arena_stats()  # it holds data: cached, not stranded
    assert (stats["pages_free"], stats["stranded_bytes"]) == ([0, 0], 0)
    assert (stats["pages_cached"], stats["cached_bytes"]) == ([0, 1], 2)
    assert pool.allocate(1, group=1) == [u2[0]]  # the free unit 2, not the cached page
    assert pool.allocate(1, group=1) == [u2[1]]  # unit 2's page without a key
    assert pool.allocate(1, group=1) == [u3[0]]  # then unit 3
    assert (pool.lookup("k"), pool._take_evicted()) == (u1[1], [])
    assert pool.fits([0, 2]) is True  # u3[1], then the cached page
    assert pool.fits([0, 3]) is False
    assert pool.allocate(2, group=1) == [u3[1], u1[1]]
    assert (pool.lookup("k"), pool._take_evicted()) == (None, ["k"])


def test_a_hit_on_an_idle_unit_keeps_it(api: ModuleType) -> None:
    pool = record(api.BlockPool.with_arena(*SMALL))
    assert pool.allocate(2, group=1) == [4, 5]
    pool.cache(4, "a")
    pool.cache(5, "b")
    pool.free([4, 5])  # unit 1 idle
    assert pool.allocate(1, group=0) == [2]
    # A prefix hit on "b": unit 1 is busy again, its other page (cached 4) joins g1's list.
    assert pool.lookup("b") == 5
    pool.touch(5)
    assert (pool.num_free, pool.num_cached_free, pool.num_cached_pinned) == (1, 1, 1)
    assert pool.allocate(1, group=0) == []  # no unit to take: nothing evicted
    assert (pool.lookup("a"), pool.lookup("b"), pool._take_evicted()) == (4, 5, [])
    assert pool.allocate(1, group=1) == [4]  # g1 reuses page 4, evicting "a"
    assert pool._take_evicted() == ["a"]


def test_the_least_recently_idle_unit_goes_first(api: ModuleType) -> None:
    # U = 2, N = 4, pages [2, 1]: g0 unit u = id u (1..3); g1 (s = 1) 8 view ids, base 3, unit u
    # = view 2u, 2u + 1 = ids 2u + 3, 2u + 4 (unit 1: 5, 6; unit 2: 7, 8; unit 3: 9, 10).
    pool = record(api.BlockPool.with_arena(2, 4, [2, 1]))
    assert pool.allocate(2, group=1) == [5, 6]
    assert pool.allocate(2, group=1) == [7, 8]
    assert pool.allocate(1, group=0) == [3]
    pool.cache(5, "a")
    pool.cache(7, "c")
    pool.free([7, 8])  # unit 2 idle first
    pool.free([5, 6])  # then unit 1
    assert pool.allocate(1, group=0) == [2]  # unit 2 evicted and bound: g0's page 2
    assert (pool._take_evicted(), pool.lookup("a")) == (["c"], 5)
    assert pool.allocate(1, group=0) == [1]
    assert pool._take_evicted() == ["a"]


def test_waking_and_release_order_within_a_unit(api: ModuleType) -> None:
    # U = 8, N = 2, one group of 2-byte pages: 8 view ids; unit 1 holds 4..7. kmin 4, scale 4,
    # cost 1: one unit = 4 credits.
    pool = record(api.BlockPool.with_arena(8, 2, [2]))
    assert pool.allocate(4) == [4, 5, 6, 7]
    pool.cache(5, "x")
    pool.cache(7, "y")
    pool.free([4, 5, 6, 7])  # unit 1 idle: 2 keys
    assert (pool.num_free, pool.num_cached_free) == (4, 2)
    # A hit on 7 wakes the unit: its other uncached pages 4, 6 join the front in id order, the
    # cached 5 the back: [4, 6, 5].
    pool.touch(7)
    assert pool.num_free == 3
    assert pool.allocate(3) == [4, 6, 5]
    assert (pool._take_evicted(), pool.lookup("y")) == (["x"], 7)
    # Within a busy unit: a released cached page joins the back, an uncached one the front.
    pool.cache(4, "p")
    pool.free([4])  # [4]
    pool.free([6])  # [6, 4]
    pool.free([5])  # [5, 6, 4]
    assert pool.allocate(3) == [5, 6, 4]
    assert pool._take_evicted() == ["p"]


def test_clear_cached_free_frees_an_idle_unit_at_the_front(api: ModuleType) -> None:
    pool = api.BlockPool.with_arena(*SMALL)
    assert pool.allocate(2, group=1) == [4, 5]  # free units left: [2]
    pool.cache(4, "a")
    pool.cache(5, "b")
    pool.free([4, 5])  # unit 1 idle
    # The idle unit's keys in id order; left without a key it is free again, at the front.
    assert pool._clear_cached_free() == ["a", "b"]
    assert (pool.num_cached, pool.num_free) == (0, 4)
    assert pool.allocate(1, group=0) == [1]  # unit 1 before unit 2
    assert pool.allocate(1, group=0) == [2]


def test_allocate_is_all_or_nothing(api: ModuleType) -> None:
    pool = api.BlockPool.with_arena(*SMALL)
    assert pool.allocate(2, group=1) == [4, 5]
    pool.free([5])  # g1 lists 5; one free unit (2 pages of g1)
    assert pool.num_free == 3
    # 4 pages: 1 listed + 3 more = 2 units, only 1 to take: nothing changes.
    assert pool.fits([0, 4]) is False
    assert pool.allocate(4, group=1) == []
    assert (pool.num_free, pool.ref_count(5)) == (3, 0)
    assert pool.allocate(0, group=1) == []
    # 3 pages: 5 first, then unit 2 bound (6, 7).
    assert pool.fits([0, 3]) is True
    assert pool.allocate(3, group=1) == [5, 6, 7]
    assert pool.num_free == 0


def test_an_allocation_that_the_next_unit_holds_fits(api: ModuleType) -> None:
    # U = 10, N = 4, one group of 3-byte pages: unit 1 holds 4..5, units 2 and 3 hold 7..9 and
    # 10..12 (kmin 2). After unit 1 and 2's pages are taken, the free unit 3 holds 3 pages.
    pool = api.BlockPool.with_arena(10, 4, [3])
    assert pool.allocate(2) == [4, 5]
    assert pool.allocate(3) == [7, 8, 9]  # 2 units of kmin: 2 are free, so this one passes
    assert pool.fits([3]) is True  # the one free unit holds 10, 11, 12
    assert pool.allocate(3) == [10, 11, 12]


def test_fits_after_claim_counts_a_woken_unit(api: ModuleType) -> None:
    pool = api.BlockPool.with_arena(*SMALL)
    assert pool.allocate(2, group=1) == [4, 5]
    pool.cache(4, "a")
    pool.free([4, 5])  # unit 1 idle (key on 4); unit 2 free
    assert pool.fits([2]) is True  # two units to take
    # Claiming 4 wakes unit 1: one unit left, and g1 gets page 5 back on its list.
    assert pool.fits_after_claim([4], [2]) is False
    assert pool.fits_after_claim([4, 0, 4], [1, 1]) is True
    assert pool.fits_after_claim([4], [1, 2]) is False
    pool.touch(4)
    assert (pool.fits([2]), pool.fits([1, 1]), pool.fits([1, 2])) == (False, True, False)


# ------------------------------------------------------------------------------------------------
# Errors
# ------------------------------------------------------------------------------------------------

BAD_GEOMETRIES: list[tuple[tuple[Any, ...], type[Exception], str]] = [
    ((0, 4, [1]), ValueError, "arena: unit_bytes must be > 0, got 0"),
    ((4, 1, [1]), ValueError, "arena: num_units must be >= 2 (unit 0 is null), got 1"),
    ((4, 0, [1]), ValueError, "arena: num_units must be >= 2 (unit 0 is null), got 0"),
    ((4, 4, []), ValueError, "arena: page_bytes must name one size per group"),
    ((4, 2**31, [4]), ValueError, "arena: num_units must be <= 2147483647 (ids are int32), got 2147483648"),
    ((4, 4, [5]), ValueError, "arena: page_bytes[0] must be in [1, unit_bytes = 4], got 5"),
    ((4, 4, [4, 0]), ValueError, "arena: page_bytes[1] must be in [1, unit_bytes = 4], got 0"),
    # Unit 1 = bytes [4, 8): pages ceil(4/3) = 2 .. floor(8/3) - 1 = 1: none.
    (
        (4, 4, [2, 3]),
        ValueError,
        "arena: some unit holds no page of group 1 (unit_bytes = 4, page_bytes = 3)",
    ),
    # 2**12 units of 2**20 one-byte pages: 2**32 ids.
    (
        (2**20, 2**12, [1]),
        ValueError,
        "arena: the page ids of every group must number <= 2147483647 in all (ids are int32)",
    ),
    # 2**30 ids each: 1 + 2 * (2**30 - 1) fits, the third group does not.
    (
        (2**29, 2, [1, 1, 1]),
        ValueError,
        "arena: the page ids of every group must number <= 2147483647 in all (ids are int32)",
    ),
    # Units of 4096 * 4097 bytes hold 4097 and 4096 pages: lcm 16781312 > 2**24.
    (
        (4096 * 4097, 2, [4096, 4097]),
        ValueError,
        "arena: the pages per unit of the groups ([4097, 4096]) have an lcm over 16777216",
    ),
    # Arguments are ints first, each named.
    (("4", 4, [1]), TypeError, "unit_bytes must be an int, got str"),
    ((-1, 4, [1]), ValueError, "unit_bytes must be >= 0, got -1"),
    ((4, 4.0, [1]), TypeError, "num_units must be an int, got float"),
    ((4, True, [1]), TypeError, "num_units must be an int, not bool"),
    ((4, 2**64, [1]), OverflowError, "num_units: value does not fit in an unsigned 64-bit integer"),
    ((4, 4, 4), TypeError, "page_bytes must be a sequence of ints or a 1-D integer array, got int"),
    ((4, 4, "4"), TypeError, "page_bytes must be a sequence of ints or a 1-D integer array, got str"),
    ((4, 4, [1, 2.0]), TypeError, "page_bytes[1] must be an int, got float"),
    ((4, 4, [-2]), ValueError, "page_bytes[0] must be >= 0, got -2"),
]


@pytest.mark.parametrize(("args", "error", "message"), BAD_GEOMETRIES)
def test_bad_geometries_name_the_problem(
    api: ModuleType, args: tuple[Any, ...], error: type[Exception], message: str
) -> None:
    with pytest.raises(error) as caught:
        api.BlockPool.with_arena(*args)
    assert str(caught.value) == message


def test_geometry_arguments_accept_int_likes(api: ModuleType) -> None:
    pool = api.BlockPool.with_arena(np.int64(4), np.uint8(3), np.array([4, 2], dtype=np.int32))
    assert (pool.num_blocks, pool.num_free) == (8, 4)
    with pytest.raises(TypeError, match=r"^enable_caching must be a bool, got int$"):
        api.BlockPool.with_arena(4, 3, [4], enable_caching=1)
    off = api.BlockPool.with_arena(4, 3, [4, 2], enable_caching=False)
    assert off.allocate(1) == [1]
    off.cache(1, "k")
    assert (off.num_cached, off.lookup("k")) == (0, None)


def test_arena_misuse_raises_and_changes_nothing(api: ModuleType) -> None:
    pool = api.BlockPool.with_arena(*SMALL)
    assert pool.allocate(2, group=1) == [4, 5]
    pool.cache(5, "b")
    pool.free([5])
    before = (pool.num_free, pool.num_cached, pool.num_cached_free, [pool.ref_count(p) for p in range(8)])
    calls: list[tuple[Callable[[], object], type[Exception], str]] = [
        (lambda: pool.allocate(1, group=2), ValueError, "group must be < 2 (the arena's groups), got 2"),
        (lambda: pool.allocate(1, group=None), TypeError, "group must be an int, got NoneType"),
        (lambda: pool.allocate(-1, group=0), ValueError, "n must be >= 0, got -1"),
        (lambda: pool.fits([0, 0, 1]), ValueError, "needs has 3 entries, more than the arena's 2 groups"),
        (lambda: pool.fits([1, -1]), ValueError, "needs[1] must be >= 0, got -1"),
        (lambda: pool.fits_after_claim([8], [1]), ValueError, "page 8 is out of range [0, 8)"),
        (
            lambda: pool.fits_after_claim([1], [1]),
            ValueError,
            "page 1 of group 0 lies in no unit bound to that group (arena mode)",
        ),
        # Unit 2 is free: neither group's page there can be claimed; unit 1 is g1's.
        (
            lambda: pool.touch(2),
            ValueError,
            "page 2 of group 0 lies in no unit bound to that group (arena mode)",
        ),
        (
            lambda: pool.touch(6),
            ValueError,
            "page 6 of group 1 lies in no unit bound to that group (arena mode)",
        ),
        (
            lambda: pool.touch(1),
            ValueError,
            "page 1 of group 0 lies in no unit bound to that group (arena mode)",
        ),
        (
            lambda: pool.cache(7, "k"),
            ValueError,
            "page 7 of group 1 lies in no unit bound to that group (arena mode)",
        ),
        (lambda: pool.cache(5, "k"), ValueError, "page 5 already holds a key"),
        (lambda: pool.touch(8), ValueError, "page 8 is out of range [0, 8)"),
        (lambda: pool.free([4, 4]), ValueError, "page 4 is freed more times than it is referenced"),
    ]
    for call, error, message in calls:
        with pytest.raises(error) as caught:
            call()
        assert str(caught.value) == message
    after = (pool.num_free, pool.num_cached, pool.num_cached_free, [pool.ref_count(p) for p in range(8)])
    assert after == before
    # The free page 5 of the busy unit 1 is claimable: a hit.
    pool.touch(5)
    assert pool.fits_after_claim([0], []) is True


def test_without_an_arena_the_probes_are_the_plain_pool(api: ModuleType) -> None:
    pool = api.BlockPool(6)
    assert pool.is_arena is False
    assert (pool.num_total, pool.arena_stats()) == (5, None)
    assert (pool.group_base(0), pool.group_base(7), pool.group_ids(3), pool.page_cost(2)) == (0, 0, 6, 1)
    assert pool.fits([2, 3]) is True  # 5 free pages
    assert pool.fits([2, 4]) is False
    assert pool.allocate(2) == [1, 2]
    # Claiming free page 3 (once, whatever the repeats) and held page 1 leaves 2 free pages.
    assert pool.fits_after_claim([3, 1, 3, 0], [2]) is True
    assert pool.fits_after_claim([3, 1, 3], [3]) is False
    # Every group shares the one free list: the group is checked as a count, else ignored.
    assert pool.allocate(1, group=3) == [3]
    with pytest.raises(ValueError, match=r"^group must be >= 0, got -1$"):
        pool.allocate(1, group=-1)
    with pytest.raises(TypeError, match=r"^group must be an int, not bool$"):
        pool.allocate(1, group=True)
    assert pool.num_free == 2


def test_native_and_reference_raise_the_same_argument_errors() -> None:
    """Argument errors of the new methods: the same class and message on both."""
    cases: list[Callable[[ModuleType], object]] = [
        lambda m: m.BlockPool.with_arena(4, 3, [4, 2]).fits("12"),
        lambda m: m.BlockPool.with_arena(4, 3, [4, 2]).fits([1.5]),
        lambda m: m.BlockPool.with_arena(4, 3, [4, 2]).fits(np.array([[1]])),
        lambda m: m.BlockPool.with_arena(4, 3, [4, 2]).fits_after_claim(3, []),
        lambda m: m.BlockPool.with_arena(4, 3, [4, 2]).fits_after_claim([-1], []),
        lambda m: m.BlockPool.with_arena(4, 3, [4, 2]).fits_after_claim([True], []),
        lambda m: m.BlockPool.with_arena(4, 3, [4, 2]).fits_after_claim([1], 3),
        lambda m: m.BlockPool.with_arena(4, 3, [4, 2]).allocate(1, 2**64),
        lambda m: m.BlockPool.with_arena(4, 3, [4, 2]).allocate(1.0),
        lambda m: m.BlockPool.with_arena(4, 3, [4, 2]).group_base(2**64),
        lambda m: m.BlockPool.with_arena(4, 3, [4, 2]).page_cost(None),
        lambda m: m.BlockPool.with_arena(4, 3, [4, 2], enable_caching=None),
        lambda m: m.BlockPool.with_arena(4, 3, np.ma.masked_array([4])),
        lambda m: m.BlockPool.with_arena(4, 3, [4])._set_record_evictions(1),
        lambda m: m.BlockPool(4).allocate(1, group=2**64),
        lambda m: m.BlockPool(4).fits([2**64]),
        lambda m: m.BlockPool(4).fits_after_claim([4], [1]),
    ]
    for case in cases:
        native = outcome(lambda case=case: case(NATIVE))  # type: ignore[misc]
        reference = outcome(lambda case=case: case(REFERENCE))  # type: ignore[misc]
        assert native.error is not None, native
        assert native == reference, (native, reference)


@st.composite
def wide_geometries(draw: st.DrawFn) -> tuple[int, int, list[int]]:
    """Geometries far past the machine's: units up to 10**9 bytes, up to 10**5 units, pages near
    the unit, near its fractions or anywhere (often refused), sometimes 0 or above the unit, and
    sometimes fewer than 2 units.
    Kept to what both can build quickly: at most 20000 ids in all, or so many that the ids
    check refuses them before anything is allocated."""
    unit = draw(st.integers(1, 10**9))
    units = draw(st.one_of(st.integers(2, 40), st.integers(2, 10**5)))
    if draw(st.integers(0, 19)) == 0:
        units = draw(st.integers(0, 1))

    def near(value: int) -> st.SearchStrategy[int]:
        return st.integers(max(0, value - 3), value + 3)

    page = st.one_of(
        near(unit),
        st.integers(1, 64).flatmap(lambda k: near(unit // k)),
        st.integers(0, unit + 1),
    )
    sizes = draw(st.lists(page, min_size=1, max_size=3))  # an empty list: the scenarios
    ids = sum(units * unit // size for size in sizes if 0 < size <= unit)
    assume(ids <= 20_000 or ids > MAX_BLOCKS)
    return unit, units, sizes


@pytest.mark.properties
@settings(max_examples=MACHINE_EXAMPLES, deadline=None)
@given(geometry=wide_geometries())
def test_geometry_agrees(geometry: tuple[int, int, list[int]]) -> None:
    """The same error, or the same ids, bases, costs (hence the fewest pages per unit) and credit."""

    def probe(module: ModuleType) -> Any:
        pool = module.BlockPool.with_arena(*geometry)
        groups = range(len(geometry[2]))
        return (
            pool.num_blocks,
            pool.num_total,
            pool.num_free,
            [(pool.group_base(g), pool.group_ids(g), pool.page_cost(g)) for g in groups],
        )

    native, reference = outcome(lambda: probe(NATIVE)), outcome(lambda: probe(REFERENCE))
    assert native == reference


# ------------------------------------------------------------------------------------------------
# The native-vs-reference machine
# ------------------------------------------------------------------------------------------------

KEYS = [f"k{i}" for i in range(12)]


def touching(page: int) -> Callable[[Any], Any]:
    return lambda pool: pool.touch(page)


def caching(page: int, key: str) -> Callable[[Any], Any]:
    return lambda pool: pool.cache(page, key)


def freeing(pages: list[int]) -> Callable[[Any], Any]:
    return lambda pool: pool.free(pages)


def allocating(n: int, group: int) -> Callable[[Any], Any]:
    return lambda pool: pool.allocate(n, group=group)


@st.composite
def geometries(draw: st.DrawFn) -> tuple[int, int, list[int]]:
    """A small arena: units of 1 to 16 bytes, 2 to 12 units (mostly 4 or fewer), one to three
    groups whose pages are the whole unit, at most half of it (every unit holds one page or more;
    most such pages straddle units somewhere, so units hold ``per_unit`` or ``per_unit - 1``
    pages), or anything up to the unit (then the geometry may be refused)."""
    unit = draw(st.integers(1, 16))
    page = st.one_of(st.just(unit), st.integers(1, max(1, unit // 2)), st.integers(1, unit))
    sizes = draw(st.lists(page, min_size=1, max_size=3))
    if unit not in sizes and len(sizes) < 3 and draw(st.booleans()):
        sizes.insert(draw(st.integers(0, len(sizes))), unit)  # a state group's slot: the whole unit
    # Mostly few units, so that free units run out and idle ones are evicted.
    return unit, draw(st.one_of(st.integers(2, 4), st.integers(2, 12))), sizes


class ArenaPoolMachine(RuleBasedStateMachine):
    """A native and a reference arena pool under identical operations, misuse included."""

    def __init__(self) -> None:
        super().__init__()
        self.ready = False

    # -- helpers ----------------------------------------------------------------------------------

    def both(self, what: str, call: Callable[[Any], Any]) -> Outcome:
        """``call`` on both pools: the same result, or the same exception class and message."""
        native, reference = outcome(lambda: call(self.native)), outcome(lambda: call(self.reference))
        assert native == reference, f"{what}: native {native}, reference {reference}"
        return reference

    def held(self) -> list[int]:
        return [p for p in range(1, self.num_blocks) if self.reference.ref_count(p) > 0]

    def cached_free(self) -> list[int]:
        return [
            p
            for p in range(1, self.num_blocks)
            if self.reference.is_cached(p) and self.reference.ref_count(p) == 0
        ]

    def page(self, data: st.DataObject) -> int:
        """A held page, a cached free one (a prefix hit), or any id (sometimes out of range)."""
        choices = [st.integers(-1, self.num_blocks)]
        held, hits = self.held(), self.cached_free()
        if held:
            choices.append(st.sampled_from(held))
        if hits:
            choices += [st.sampled_from(hits)] * 2
        return data.draw(st.one_of(choices))

    def needs(self, data: st.DataObject) -> list[int]:
        """Mostly one need per group or fewer, sometimes one too many."""
        size = data.draw(st.integers(0, self.groups + (1 if data.draw(st.integers(0, 9)) == 0 else 0)))
        return data.draw(st.lists(st.integers(0, 8), min_size=size, max_size=size))

    # -- rules ------------------------------------------------------------------------------------

    #: A warm-up request: (group, pages, first key, keys on, then: 0 kept, 1 freed, 2 freed and
    #: its first key hit, 3 freed, hit and the hit freed again).
    WARMUP = st.lists(
        st.tuples(st.integers(0, 2), st.integers(1, 6), st.integers(0, 11), st.booleans(), st.integers(0, 3)),
        min_size=1,
        max_size=12,
    )

    @initialize(geometry=geometries(), caching=st.sampled_from([True, True, True, False]), warmup=WARMUP)
    def setup(
        self,
        geometry: tuple[int, int, list[int]],
        caching: bool,
        warmup: list[tuple[int, int, int, bool, int]],
    ) -> None:
        """Both pools over one geometry (the same error when it is refused, then the example is
        dropped), then a few requests so that every run starts with units bound, busy and idle."""
        unit, units, sizes = geometry
        native = outcome(lambda: NATIVE.BlockPool.with_arena(unit, units, sizes, enable_caching=caching))
        reference = outcome(
            lambda: REFERENCE.BlockPool.with_arena(unit, units, sizes, enable_caching=caching)
        )
        assert (native.error, native.message) == (reference.error, reference.message), (native, reference)
        assume(reference.error is None)
        self.native, self.reference = native.value, reference.value
        self.groups, self.num_blocks = len(sizes), reference.value.num_blocks
        straddling = any(unit % size for size in sizes)
        event(f"geometry: {len(sizes)} group(s)" + (", pages straddling units" if straddling else ""))
        self.native._set_record_evictions(True)
        self.reference._set_record_evictions(True)
        self.ready = True
        for group, n, first, keyed, then in warmup:
            keys = [KEYS[(first + i) % len(KEYS)] for i in range(n)] if keyed else []
            self.run_request(group % self.groups, n, keys, then > 0)
            if then >= 2:
                hit = self.run_hit(KEYS[first])
                if then == 3 and hit is not None:
                    self.both(f"free([{hit}])", freeing([hit]))

    @rule(n=st.integers(-1, 7), data=st.data())
    def allocate(self, n: int, data: st.DataObject) -> None:
        group = data.draw(st.integers(0, self.groups))  # sometimes one past the last
        valid = n >= 0 and group < self.groups
        predicted = self.reference.fits([*([0] * group), n]) if valid else None
        got = self.both(f"allocate({n}, group={group})", lambda p: p.allocate(n, group=group))
        if valid and n > 0:
            assert (got.value != []) == predicted, "allocate disagrees with fits"
            base, ids = self.reference.group_base(group), self.reference.group_ids(group)
            assert all(base < page < base + ids for page in got.value), "a page of another group"
            event("allocate: " + ("taken" if got.value else "refused"))
        evicted = self.both("_take_evicted()", lambda p: p._take_evicted())
        if len(evicted.value) > 1:
            event("allocate: evicted several keys")
        if evicted.value:
            event("allocate: evicted")

    @rule(n=st.integers(1, 6), data=st.data(), release=st.booleans())
    def request(self, n: int, data: st.DataObject, release: bool) -> None:
        """A request's life: ``n`` pages of a group, a key on each (distinct keys mostly), then
        freed (or kept), so units go idle with keys in them."""
        group = data.draw(st.integers(0, self.groups - 1))
        keys = data.draw(st.lists(st.sampled_from(KEYS), min_size=n, max_size=n))
        self.run_request(group, n, keys, release)

    def run_request(self, group: int, n: int, keys: list[str], release: bool) -> None:
        """``n`` pages of ``group``, ``keys`` on the first of them, then freed when ``release``."""
        pages = self.both(f"allocate({n}, group={group})", lambda p: p.allocate(n, group=group)).value
        evicted = self.both("_take_evicted()", lambda p: p._take_evicted()).value
        if len(evicted) > 1:
            event("request: evicted several keys")
        for page, key in zip(pages, keys, strict=False):
            self.both(f"cache({page}, {key!r})", caching(page, key))
        if release:
            self.both(f"free({pages})", lambda p: p.free(pages))

    @rule(data=st.data(), release=st.booleans())
    def fill(self, data: st.DataObject, release: bool) -> None:
        """Memory pressure: one page at a time for a group until none is left (binding every
        free unit, then evicting every idle unit), then maybe all of them freed again."""
        group = data.draw(st.integers(0, self.groups - 1))
        taken: list[int] = []
        while True:
            got = self.both(f"allocate(1, group={group})", lambda p: p.allocate(1, group=group)).value
            evicted = self.both("_take_evicted()", lambda p: p._take_evicted()).value
            if len(evicted) > 1:
                event("fill: evicted a unit's several keys")
            if not got:
                break
            taken += got
        assert self.reference.fits([*([0] * group), 1]) is False
        if release:
            self.both(f"free({taken})", lambda p: p.free(taken))

    @rule(key=st.sampled_from(KEYS))
    def hit(self, key: str) -> None:
        """A prefix hit: the page ``key`` finds takes one more reference."""
        self.run_hit(key)

    def run_hit(self, key: str) -> int | None:
        """Touch the page ``key`` finds, if any; returns it."""
        page: int | None = self.both(f"lookup({key!r})", lambda p: p.lookup(key)).value
        if page is None:
            return None
        if self.reference.ref_count(page) == 0:
            event("hit: a free cached page")
        self.both(f"touch({page})", lambda p: p.touch(page))
        return page

    @rule(data=st.data())
    def touch(self, data: st.DataObject) -> None:
        page = self.page(data)
        hit = 0 < page < self.num_blocks and self.reference.is_cached(page)
        free = hit and self.reference.ref_count(page) == 0
        got = self.both(f"touch({page})", lambda p: p.touch(page))
        if free and got.error is None:
            event("touch: a hit on a free cached page")

    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        held = self.held()
        if held and data.draw(st.integers(0, 4)) > 0:
            pages = data.draw(st.lists(st.sampled_from(held), max_size=5))  # repeats may over-free
        else:
            pages = data.draw(st.lists(st.integers(-1, self.num_blocks), max_size=4))  # mostly misuse
        self.both(f"free({pages})", lambda p: p.free(pages))

    @rule(data=st.data(), key=st.sampled_from(KEYS))
    def cache(self, data: st.DataObject, key: str) -> None:
        uncached = [p for p in self.held() if not self.reference.is_cached(p)]
        if uncached and data.draw(st.integers(0, 3)) > 0:
            page = data.draw(st.sampled_from(uncached))
        else:
            page = self.page(data)
        self.both(f"cache({page}, {key!r})", lambda p: p.cache(page, key))

    @rule()
    def clear_cached_free(self) -> None:
        self.both("_clear_cached_free()", lambda p: p._clear_cached_free())

    @rule(data=st.data())
    def fits(self, data: st.DataObject) -> None:
        needs = self.needs(data)
        self.both(f"fits({needs})", lambda p: p.fits(needs))

    @rule(data=st.data(), release=st.booleans())
    def allocate_needs(self, data: st.DataObject, release: bool) -> None:
        """``fits(needs)`` is exact: taking ``needs[g]`` pages per group in group order then
        succeeds for every group exactly when it said so (units that hold more than the
        group's fewest pages count what they hold); what was taken is maybe freed again."""
        needs = data.draw(st.lists(st.integers(0, 8), min_size=self.groups, max_size=self.groups))
        predicted = self.both(f"fits({needs})", lambda p: p.fits(needs)).value
        taken: list[int] = []
        every = True
        for g, n in enumerate(needs):
            got = self.both(f"allocate({n}, group={g})", allocating(n, g)).value
            self.both("_take_evicted()", lambda p: p._take_evicted())
            every = every and (n == 0 or got != [])
            taken += got
        assert every == predicted, f"fits({needs}) said {predicted}"
        event("allocate_needs: " + ("all taken" if every else "refused"))
        if release:
            self.both(f"free({taken})", lambda p: p.free(taken))

    @rule(data=st.data())
    def claim(self, data: st.DataObject) -> None:
        """``fits_after_claim(claimed, needs)``, then (when it answered) the claim itself: after
        touching every claimed page, ``fits(needs)`` must give the same answer."""
        claimed = [self.page(data) for _ in range(data.draw(st.integers(0, 4)))]
        needs = self.needs(data)
        predicted = self.both(
            f"fits_after_claim({claimed}, {needs})", lambda p: p.fits_after_claim(claimed, needs)
        )
        if predicted.error is not None or not data.draw(st.booleans()):
            return
        for page in claimed:
            self.both(f"touch({page})", touching(page))
        assert self.both(f"fits({needs})", lambda p: p.fits(needs)).value == predicted.value

    # -- after every step -------------------------------------------------------------------------

    @invariant()
    def same_state(self) -> None:
        if not self.ready:
            return
        native, reference = self.native, self.reference
        for name in (
            "num_blocks",
            "num_free",
            "num_total",
            "num_cached",
            "num_cached_free",
            "num_cached_pinned",
            "is_arena",
        ):
            assert getattr(native, name) == getattr(reference, name), name
        for g in range(self.groups):
            for probe in ("group_base", "group_ids", "page_cost"):
                assert getattr(native, probe)(g) == getattr(reference, probe)(g), (probe, g)
        for page in range(self.num_blocks):
            assert native.ref_count(page) == reference.ref_count(page), page
            assert native.is_cached(page) == reference.is_cached(page), page
        for key in KEYS:
            assert native.lookup(key) == reference.lookup(key), key
        assert repr(native) == repr(reference)
        assert native.arena_stats() == reference.arena_stats()
        assert native._check() is None, native._check()
        assert reference._arena_check() is None, reference._arena_check()


TestArenaPoolNativeVsReference = ArenaPoolMachine.TestCase
TestArenaPoolNativeVsReference.settings = settings(
    max_examples=MACHINE_EXAMPLES,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestArenaPoolNativeVsReference = pytest.mark.properties(TestArenaPoolNativeVsReference)
