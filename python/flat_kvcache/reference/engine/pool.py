"""The page pool with prefix caching (SPEC 5): one page-id space shared by every group.

Arena mode (SPEC 13.2; docs/architecture.md, "Hybrid storage"; the native
``rust/core/src/engine/pool/arena.rs``, which this mirrors list for list): device memory is
``num_units`` equal units of ``unit_bytes`` (unit 0 is null). A unit is free or bound to one group
until it is free again; group ``g``'s pages are its view indices (page ``p`` lies at byte
``p * page_bytes[g]`` of the arena), so a unit ``u`` holds the pages
``ceil(u U / s) .. floor((u + 1) U / s) - 1`` of a group with pages of ``s`` bytes, and a page that
straddles two units is never handed out. In the pool's one id space group ``g``'s page ``p`` is id
``group_base(g) + p`` (the null page is id 0 of every group).

Lists (``OrderedDict``s, front first, like the free list):

- the free units: unbound units;
- the idle units: bound units none of whose pages is referenced but some hold a key, least
  recently idle first; their pages are on no list;
- per group, the free pages and the cached pages: the pages of count 0 in the group's *busy*
  units (units with a referenced page), those without a key (released ones at the front, a newly
  bound unit's in id order) and those with one (least recently released first).

Taking a page for group ``g`` (all or nothing over a call, checked first) spends what holds no
data before what holds a cached prefix: the front of the group's free pages; else the front free
unit, bound to ``g``; else the older of the front of the group's cached pages (its key is
evicted) and the least recently idle unit (its keys are all evicted; bound to ``g``), by when each
joined its list (one clock for both). A unit whose last
referenced page is released leaves the page lists: to the free units (front) when it holds no
key, else to the back of the idle units; a prefix hit on a page of an idle unit makes it busy
again (its other pages join the group's free pages at the front in id order, or the back of its
cached pages). A page that gains a key moves to the back of the cached pages; one whose key is
cleared, to the back of the free pages.

Accounting: a page of group ``g`` costs ``L / kmin[g]`` credits, where ``kmin[g]`` is the fewest
pages of ``g`` a unit holds and ``L`` the lcm of the ``kmin``s; the free credit (``num_free`` in
arena mode) is ``L`` per free or idle unit plus each group's listed pages at their cost. Whether
an allocation fits is decided exactly (:meth:`BlockPool.fits`): by following the taking through
the pages and units it would use, each unit holding what it holds of its group.
"""

from __future__ import annotations

import itertools
import math
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from flat_kvcache.reference._checks import as_int
from flat_kvcache.reference.engine._args import (
    INTS,
    MAX_PAGES,
    as_count,
    as_counts,
    as_flag,
    as_pool_size,
    batch_items,
)

__all__ = ["DEFAULT_REUSE_UNCACHED_FIRST", "MAX_BLOCKS", "MAX_SCALE", "BlockPool"]

#: Whether a pool reuses released uncached pages first unless told otherwise.
DEFAULT_REUSE_UNCACHED_FIRST = True
#: Largest pool size: page ids are written into int32 block tables.
MAX_BLOCKS = MAX_PAGES
#: Largest credit scale of an arena (the lcm of the groups' fewest pages per unit).
MAX_SCALE = 2**24
#: The group of a unit bound to none.
_UNBOUND = -1


def _unit_pages(unit_bytes: int, page_bytes: int, unit: int) -> tuple[int, int]:
    """The pages of a group with pages of ``page_bytes`` wholly in ``unit``: view ids ``lo .. hi``."""
    start = unit * unit_bytes
    return -(-start // page_bytes), (start + unit_bytes) // page_bytes


def _first_hit(a: int, m: int, lo: int, hi: int) -> int | None:
    """The smallest ``x >= 0`` with ``lo <= (a * x) % m <= hi`` (``0 <= lo <= hi < m``), or None.

    Euclid-like: O(log m) steps."""
    a %= m
    if lo == 0:
        return 0
    if a == 0:
        return None
    x = -(-lo // a)
    if a * x <= hi:
        return x
    # Every hit wraps: a*x - m*y lies in [lo, hi] for some y >= 1, i.e. (m*y) mod a lies in
    # [a - hi % a, a - lo % a] (no multiple of a lies in [lo, hi] here, so lo % a <= hi % a).
    y = _first_hit(m % a, a, a - hi % a, a - lo % a)
    if y is None:
        return None
    return -(-(m * y + lo) // a)


def _fewest_pages(unit_bytes: int, page_bytes: int, num_units: int) -> int:
    """The fewest pages of ``page_bytes`` any unit ``1 .. num_units - 1`` holds wholly (the
    native ``Arena::new`` scans the units; this is the same number in O(log page_bytes)).

    With ``q, r = divmod(unit_bytes, page_bytes)``, unit ``u`` starts ``a = u * r mod page_bytes``
    bytes into a page: it holds ``q`` pages when ``a == 0`` or ``a + r >= page_bytes``, else
    ``q - 1``. So the fewest is ``q - 1`` when some unit has ``1 <= a <= page_bytes - r - 1``."""
    q, r = divmod(unit_bytes, page_bytes)
    if r == 0 or page_bytes - r - 1 < 1:
        return q
    first = _first_hit(r, page_bytes, 1, page_bytes - r - 1)
    return q - 1 if first is not None and first <= num_units - 1 else q


def _push_front(items: OrderedDict[int, None], item: int) -> None:
    items[item] = None
    items.move_to_end(item, last=False)


def _insert_behind(items: OrderedDict[int, None], ages: dict[int, int], item: int, age: int) -> None:
    """Move ``item`` (on ``items``, oldest first by ``ages``) to age ``age``: behind every member
    no newer than it, searching from the back (the native ``insert_behind``)."""
    del items[item]
    ages[item] = age
    newer = []
    while items:
        last = next(reversed(items))
        if ages[last] <= age:
            break
        items.popitem()
        newer.append(last)
    items[item] = None
    for other in reversed(newer):
        items[other] = None


def _front(items: OrderedDict[int, None]) -> int:
    return next(iter(items))


class _Arena:
    """The arena bookkeeping of a :class:`BlockPool` in arena mode (see the module doc)."""

    def __init__(self, unit_bytes: int, num_units: int, page_bytes: Sequence[int]) -> None:
        """The arena of a checked geometry, every unit free (``ValueError`` naming the problem,
        worded as the native ``Arena::new``). ``total`` is the size of the pool's id space."""
        if unit_bytes == 0:
            raise ValueError("arena: unit_bytes must be > 0, got 0")
        if num_units < 2:
            raise ValueError(f"arena: num_units must be >= 2 (unit 0 is null), got {num_units}")
        if not page_bytes:
            raise ValueError("arena: page_bytes must name one size per group")
        if num_units > MAX_BLOCKS:
            raise ValueError(f"arena: num_units must be <= {MAX_BLOCKS} (ids are int32), got {num_units}")
        base: list[int] = []
        num_ids: list[int] = []
        kmin: list[int] = []
        total = 1  # the null id
        for g, size in enumerate(page_bytes):
            if size == 0 or size > unit_bytes:
                raise ValueError(
                    f"arena: page_bytes[{g}] must be in [1, unit_bytes = {unit_bytes}], got {size}"
                )
            ids = num_units * unit_bytes // size
            fewest = _fewest_pages(unit_bytes, size, num_units)
            if fewest == 0:
                raise ValueError(
                    f"arena: some unit holds no page of group {g} "
                    f"(unit_bytes = {unit_bytes}, page_bytes = {size})"
                )
            if ids > MAX_BLOCKS or total + ids - 1 > MAX_BLOCKS:
                raise ValueError(
                    f"arena: the page ids of every group must number <= {MAX_BLOCKS} in all (ids are int32)"
                )
            base.append(total - 1)
            num_ids.append(ids)
            kmin.append(fewest)
            total += ids - 1
        scale = 1
        for k in kmin:
            scale = scale // math.gcd(scale, k) * k
            if scale > MAX_SCALE:
                raise ValueError(
                    f"arena: the pages per unit of the groups ({kmin}) have an lcm over {MAX_SCALE}"
                )
        self.unit_bytes = unit_bytes
        self.page_bytes = list(page_bytes)
        #: Per group, the pool id of its view index 0 (``id = base + page``).
        self.base = base
        #: Per group, its view's ids ``0 .. num_ids``.
        self.num_ids = num_ids
        #: Per group, the fewest pages a unit holds, and the credit of one page (``scale / kmin``).
        self.kmin = kmin
        self.cost = [scale // k for k in kmin]
        #: Credits per unit.
        self.scale = scale
        self.total = total
        #: Per pool id, its unit (0 for ids never handed out) and its group.
        try:
            self.unit_of = [0] * total
            self.group_of = [0] * total
        except MemoryError:
            raise MemoryError(f"out of memory: arena: {total} page ids do not fit in memory") from None
        for g, size in enumerate(page_bytes):
            for page in range(1, num_ids[g]):
                pool_id = base[g] + page
                self.group_of[pool_id] = g
                # The unit that holds the page wholly, if any (a straddling page keeps 0).
                unit = page * size // unit_bytes
                lo, hi = _unit_pages(unit_bytes, size, unit)
                if unit > 0 and lo <= page < hi:
                    self.unit_of[pool_id] = unit
        #: Per unit, the group it is bound to (``_UNBOUND``: none), its pages with count > 0 and
        #: its pages holding a key.
        self.group_of_unit = [_UNBOUND] * num_units
        self.live = [0] * num_units
        self.cached = [0] * num_units
        self.free_units: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_units))
        self.idle_units: OrderedDict[int, None] = OrderedDict()
        self.free_pages: list[OrderedDict[int, None]] = [OrderedDict() for _ in page_bytes]
        self.cached_pages: list[OrderedDict[int, None]] = [OrderedDict() for _ in page_bytes]
        #: When each cached page and each idle unit joined its list, on one clock: taking
        #: compares the oldest of both.
        self.clock = 0
        self.page_age: dict[int, int] = {}
        self.unit_age: dict[int, int] = {}

    def tick(self) -> int:
        """The next time of the clock."""
        self.clock += 1
        return self.clock

    def ids_of_unit(self, g: int, unit: int) -> range:
        """The pool ids of group ``g``'s pages in ``unit``, ascending."""
        lo, hi = _unit_pages(self.unit_bytes, self.page_bytes[g], unit)
        return range(self.base[g] + lo, self.base[g] + hi)

    def units_suffice(self, needs: Sequence[int], claim: ClaimEffect | None = None) -> bool:
        """Whether the taking of ``needs[g]`` pages per group (in group order) finds them, as
        :meth:`BlockPool._arena_take` takes, once ``claim`` (None: nothing) is made: the free
        pages, then the free units front first, then the cached pages and the idle units, the
        one that joined its list earlier first (the idle units ``claim`` woke are not there;
        the cached pages it adds came last and are taken last), each unit giving ``g`` every
        page it holds of it."""
        effect = claim if claim is not None else ClaimEffect()
        free_units = iter(self.free_units)
        idle = [u for u in self.idle_units if u not in effect.woken]
        next_idle = 0
        for g, need in enumerate(needs):
            short = need - (
                len(self.free_pages[g]) + effect.added_free.get(g, 0) - effect.taken_free.get(g, 0)
            )
            while short > 0:
                unit = next(free_units, None)
                if unit is None:
                    break
                short -= len(self.ids_of_unit(g, unit))
            cached = [page for page in self.cached_pages[g] if page not in effect.taken_cached]
            next_page = 0
            while short > 0:
                has_page, has_unit = next_page < len(cached), next_idle < len(idle)
                if has_page and (
                    not has_unit or self.page_age[cached[next_page]] <= self.unit_age[idle[next_idle]]
                ):
                    next_page += 1
                    short -= 1
                elif has_unit:
                    short -= len(self.ids_of_unit(g, idle[next_idle]))
                    next_idle += 1
                else:
                    break
            short -= effect.added_cached.get(g, 0)
            if short > 0:
                return False
        return True

    def units_available(self) -> int:
        """Units that can be bound now: free plus idle."""
        return len(self.free_units) + len(self.idle_units)

    def credit(self) -> int:
        """The free credit: ``scale`` per free or idle unit plus each group's listed pages."""
        pages = sum(
            (len(self.free_pages[g]) + len(self.cached_pages[g])) * cost for g, cost in enumerate(self.cost)
        )
        return self.units_available() * self.scale + pages


@dataclass
class ClaimEffect:
    """What a claim does to an arena's lists before the allocation after it: per group, pages
    it takes off and adds to the free pages and the cached pages, the cached pages it takes,
    and the idle units it wakes."""

    taken_free: dict[int, int] = field(default_factory=dict)
    taken_cached: set[int] = field(default_factory=set)
    added_free: dict[int, int] = field(default_factory=dict)
    added_cached: dict[int, int] = field(default_factory=dict)
    woken: set[int] = field(default_factory=set)


class BlockPool:
    """One page-id space shared by all groups, with reference counts and prefix caching (SPEC 5).

    Page 0 is the null page: never free, never cached, never counted. The free list is the
    eviction order: allocation takes from its front, a page whose count drops to 0 goes to its
    back with its key intact (it stays prefix-reusable), and a prefix hit removes a free page
    from the middle. With ``reuse_uncached_first``, a page that drops to 0 holding no key goes
    to the front instead (it is handed out before any cached page). An ``OrderedDict`` keyed by
    page id gives all of these in O(1).

    :meth:`with_arena` builds a pool in arena mode (see the module doc): pages come from units
    bound to groups, and ``num_free`` is the arena's free credit.
    """

    def __init__(
        self,
        num_blocks: int,
        *,
        enable_caching: bool = True,
        reuse_uncached_first: bool = DEFAULT_REUSE_UNCACHED_FIRST,
    ) -> None:
        total = as_pool_size(num_blocks, "num_blocks")
        self._num_blocks = total
        self._enable_caching = as_flag(enable_caching, "enable_caching")
        self._reuse_uncached_first = as_flag(reuse_uncached_first, "reuse_uncached_first")
        try:
            self._ref_counts = [0] * total
            # The key each page holds (None: not cached), and each key's pages in registration order.
            self._key_of: list[str | None] = [None] * total
            # Free list, front = next to allocate = least recently freed. Values are unused.
            self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, total))
        except MemoryError:
            # Say what did not fit, as the native pool does.
            raise MemoryError(
                f"out of memory: num_blocks = {total}: the page pool does not fit in memory"
            ) from None
        self._pages_by_key: dict[str, list[int]] = {}
        # Keys dropped because their page was handed out again (the ``evictions`` metric), and,
        # while the owning cache records KV events, those keys in eviction order.
        self._evictions = 0
        self._record_evictions = False
        self._evicted: list[str] = []
        # The group of a key, when the owning cache counts evictions per group, and the counts.
        self._key_group: Callable[[str], int] | None = None
        self._evictions_by_group: dict[int, int] = {}
        # While the owning cache has a store-on-eviction host tier: cached pages whose count
        # dropped to 0, in release order.
        self._record_released = False
        self._released: list[int] = []
        # Arena mode: units bound to groups and per-group free pages; ``_free`` stays empty.
        self._arena: _Arena | None = None

    @classmethod
    def with_arena(
        cls,
        unit_bytes: int,
        num_units: int,
        page_bytes: Sequence[int],
        *,
        enable_caching: bool = True,
    ) -> BlockPool:
        """A pool in arena mode: ``num_units`` units of ``unit_bytes`` (unit 0 is null), group
        ``g``'s pages of ``page_bytes[g]`` bytes; every unit starts free.

        The arguments are checked as ints first (``TypeError`` / ``ValueError`` /
        ``OverflowError`` naming them), then the geometry (``ValueError`` naming the problem):
        ``unit_bytes > 0``, ``2 <= num_units <= 2**31 - 1``, one page size per group, each in
        ``[1, unit_bytes]`` with every unit holding at least one page, at most ``2**31 - 1`` page
        ids in all and an lcm of the groups' fewest pages per unit of at most ``2**24``. Group
        ``g``'s page ``p`` is id ``group_base(g) + p``.
        """
        unit = as_count(unit_bytes, "unit_bytes")
        units = as_count(num_units, "num_units")
        sizes = as_counts(page_bytes, "page_bytes")
        caching = as_flag(enable_caching, "enable_caching")
        arena = _Arena(unit, units, sizes)
        pool = cls(arena.total, enable_caching=caching)
        pool._free = OrderedDict()
        pool._arena = arena
        return pool

    # -- probes ---------------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        """Total pages, the null page included."""
        return self._num_blocks

    @property
    def num_free(self) -> int:
        """Length of the free list (the null page is never counted); in arena mode the free
        credit (see the module doc)."""
        if self._arena is not None:
            return self._arena.credit()
        return len(self._free)

    @property
    def num_total(self) -> int:
        """What ``num_free`` counts when nothing is allocated: the pages but the null page; in
        arena mode the credit of every unit but the null one."""
        if self._arena is not None:
            return (len(self._arena.group_of_unit) - 1) * self._arena.scale
        return self._num_blocks - 1

    def arena_stats(self) -> dict[str, Any] | None:
        """The arena's occupancy, or None without an arena: ``unit_bytes``, ``units_total``
        (units but the null one), ``units_free`` (bound to no group), ``units_idle`` (bound,
        nothing referenced, some key held), ``units_bound`` (per group, idle ones included),
        ``pages_free`` (per group, the free pages of its busy units that hold no key, usable by
        it only), ``stranded_bytes`` (their bytes), ``pages_cached`` (per group, those that
        hold a key) and ``cached_bytes`` (their bytes)."""
        arena = self._arena
        if arena is None:
            return None
        groups = len(arena.free_pages)
        units_bound = [0] * groups
        for g in arena.group_of_unit[1:]:
            if g != _UNBOUND:
                units_bound[g] += 1
        pages_free = [len(free) for free in arena.free_pages]
        pages_cached = [len(cached) for cached in arena.cached_pages]
        return {
            "unit_bytes": arena.unit_bytes,
            "units_total": len(arena.group_of_unit) - 1,
            "units_free": len(arena.free_units),
            "units_idle": len(arena.idle_units),
            "units_bound": units_bound,
            "pages_free": pages_free,
            "stranded_bytes": sum(n * size for n, size in zip(pages_free, arena.page_bytes, strict=True)),
            "pages_cached": pages_cached,
            "cached_bytes": sum(n * size for n, size in zip(pages_cached, arena.page_bytes, strict=True)),
        }

    @property
    def num_cached(self) -> int:
        """Pages holding a key."""
        return sum(len(pages) for pages in self._pages_by_key.values())

    @property
    def num_cached_free(self) -> int:
        """Pages holding a key whose count is 0 (reusable by a prefix hit until evicted)."""
        return sum(1 for page in self._cached_pages() if self._ref_counts[page] == 0)

    @property
    def num_cached_pinned(self) -> int:
        """Pages holding a key whose count is > 0."""
        return sum(1 for page in self._cached_pages() if self._ref_counts[page] > 0)

    @property
    def is_arena(self) -> bool:
        """Whether the pool is in arena mode."""
        return self._arena is not None

    def group_base(self, g: int) -> int:
        """The pool id of group ``g``'s view index 0 (0 without an arena): a table value ``id``
        of group ``g`` is page ``id - group_base(g)`` of the group's view (0 stays 0)."""
        group = self._group(g, "g")
        return 0 if self._arena is None else self._arena.base[group]

    def group_ids(self, g: int) -> int:
        """The ids of group ``g``'s view, the null page included (without an arena: the pool's
        pages)."""
        group = self._group(g, "g")
        return self._num_blocks if self._arena is None else self._arena.num_ids[group]

    def page_cost(self, g: int) -> int:
        """What one page of group ``g`` counts in ``num_free``: 1, or its credit in arena mode."""
        group = self._group(g, "g")
        return 1 if self._arena is None else self._arena.cost[group]

    def fits(self, needs: Sequence[int]) -> bool:
        """Whether taking ``needs[g]`` pages for each group ``g`` (in group order) succeeds.

        Without an arena: whether their sum is at most ``num_free``. In arena mode ``needs`` may
        be shorter than the groups (the others need 0), never longer (``ValueError``)."""
        values = as_counts(needs, "needs")
        arena = self._arena
        if arena is None:
            return sum(values) <= len(self._free)
        self._check_needs(values)
        return arena.units_suffice(values)

    def fits_after_claim(self, claimed: Sequence[int], needs: Sequence[int]) -> bool:
        """Whether claiming ``claimed`` (one more reference on each: pages of any count, repeats
        allowed, 0 entries skipped) and then taking ``needs[g]`` pages per group succeeds.

        Checked first, in this order: each claimed page in range (as :meth:`touch`), ``needs``
        as in :meth:`fits`, then in arena mode each claimed page of count 0 claimable as
        :meth:`touch` requires (``ValueError``). Nothing changes."""
        pages = [self._page(page) for page in batch_items(claimed, "claimed", INTS)]
        values = as_counts(needs, "needs")
        arena = self._arena
        if arena is not None:
            self._check_needs(values)
        pages = [page for page in pages if page != 0]
        if arena is None:
            unclaimed = {page for page in pages if self._ref_counts[page] == 0}
            return len(unclaimed) + sum(values) <= len(self._free)
        for page in pages:
            self._check_claimable(page)
        free = sorted({(arena.unit_of[page], page) for page in pages if self._ref_counts[page] == 0})
        effect = ClaimEffect()
        for unit, members in itertools.groupby(free, key=lambda item: item[0]):
            g = arena.group_of_unit[unit]
            claimed_here = {page for _, page in members}
            if arena.live[unit] == 0:
                # An idle unit becomes busy: its other pages join the group's lists.
                effect.woken.add(unit)
                for page in arena.ids_of_unit(g, unit):
                    if page not in claimed_here:
                        into = effect.added_free if self._key_of[page] is None else effect.added_cached
                        into[g] = into.get(g, 0) + 1
            else:
                for page in claimed_here:
                    if self._key_of[page] is None:
                        effect.taken_free[g] = effect.taken_free.get(g, 0) + 1
                    else:
                        effect.taken_cached.add(page)
        return arena.units_suffice(values, effect)

    def ref_count(self, page: int) -> int:
        """The reference count of ``page``."""
        return self._ref_counts[self._page(page)]

    def is_cached(self, page: int) -> bool:
        """Whether ``page`` holds a key."""
        return self._key_of[self._page(page)] is not None

    def lookup(self, key: str) -> int | None:
        """The earliest registered page still holding ``key``, or None; counts never change."""
        if not isinstance(key, str):
            raise TypeError(f"key must be a str, got {type(key).__name__}")
        key.encode("utf-8")  # keys are UTF-8 text: a lone surrogate is a UnicodeEncodeError
        if not self._enable_caching:
            return None
        pages = self._pages_by_key.get(key)
        return pages[0] if pages else None

    # -- mutations ------------------------------------------------------------------------------

    def allocate(self, n: int, group: int = 0) -> list[int]:
        """Take ``n`` pages from the front of the free list, all or nothing (SPEC 5).

        Fewer than ``n`` free pages returns ``[]`` and changes nothing. A cached page taken
        here loses its key. New pages have count 1.

        In arena mode the ``n`` pages are ``group``'s (see the module doc), ``[]`` when they do
        not fit; ``group`` must be one of the arena's groups (``ValueError``). Without an arena
        ``group`` is checked as a count and otherwise ignored (every group shares the free
        list), as the native ``allocate_group_into`` ignores it.
        """
        count = as_count(n, "n")
        g = self._group(group, "group")
        if count == 0:
            return []
        if self._arena is not None:
            arena = self._arena
            if not arena.units_suffice([*([0] * g), count]):
                return []
            return [self._arena_take(g) for _ in range(count)]
        if count > len(self._free):
            return []
        pages = []
        for _ in range(count):
            page, _unused = self._free.popitem(last=False)
            self._evict(page)
            self._ref_counts[page] = 1
            pages.append(page)
        return pages

    def touch(self, page: int) -> None:
        """Take one more reference on ``page``; a free page leaves the free list. Page 0: no-op.

        In arena mode a page of count 0 must lie in a unit bound to its group (on the group's
        free pages or in an idle unit, which becomes busy): any other page (in a free unit, a
        unit of another group, the null unit or straddling two units) is a ``ValueError``."""
        index = self._page(page)
        if index == 0:
            return
        if self._ref_counts[index] == 0:
            if self._arena is None:
                del self._free[index]
            else:
                self._check_claimable(index)
                self._arena_on_take(index)
        self._ref_counts[index] += 1

    def free(self, pages: Sequence[int]) -> None:
        """Release one reference per entry, in REVERSE order of ``pages`` (SPEC 5).

        A chain's tail is released, hence evicted, before its head; a page that drops to 0
        joins the back of the free list, or the front when it holds no key and the pool reuses
        uncached pages first (so such pages end up in list order). Entries equal to 0 are
        skipped. Everything is validated first: a page out of range, or one released more
        times than it is referenced (repeats counted), raises ValueError and changes nothing.
        In arena mode a page that drops to 0 goes where the module doc says.
        """
        checked = [self._page(page) for page in batch_items(pages, "pages", INTS)]
        releases: dict[int, int] = {}
        for page in checked:
            if page == 0:
                continue
            releases[page] = releases.get(page, 0) + 1
            if releases[page] > self._ref_counts[page]:
                raise ValueError(f"page {page} is freed more times than it is referenced")
        for page in reversed(checked):
            if page == 0:
                continue
            self._ref_counts[page] -= 1
            if self._ref_counts[page] == 0:
                if self._arena is not None:
                    if self._record_released and self._key_of[page] is not None:
                        self._released.append(page)
                    self._arena_on_free(page)
                    continue
                self._free[page] = None  # to the back, key kept
                if self._record_released and self._key_of[page] is not None:
                    self._released.append(page)
                if self._reuse_uncached_first and self._key_of[page] is None:
                    self._free.move_to_end(page, last=False)

    def cache(self, page: int, key: str) -> None:
        """Register ``page`` under ``key`` (SPEC 5). No-op when caching is off or page is 0.

        A page that already holds a key is an error. A key may map to several pages; they are
        never de-duplicated, so page ids already handed out stay valid. In arena mode a page of
        count 0 must be claimable as :meth:`touch` requires (``ValueError``, checked last).
        """
        index = self._page(page)
        if not isinstance(key, str):
            raise TypeError(f"key must be a str, got {type(key).__name__}")
        key.encode("utf-8")  # keys are UTF-8 text: a lone surrogate is a UnicodeEncodeError
        if not self._enable_caching or index == 0:
            return
        if self._key_of[index] is not None:
            raise ValueError(f"page {index} already holds a key")
        if self._arena is not None:
            self._check_claimable(index)
        self._key_of[index] = key
        self._pages_by_key.setdefault(key, []).append(index)
        if self._arena is not None:
            self._arena_on_cache(index)

    def __repr__(self) -> str:
        return (
            f"BlockPool(num_blocks={self._num_blocks}, num_free={self.num_free}, "
            f"num_cached={self.num_cached})"
        )

    # -- helpers for this module ----------------------------------------------------------------

    def _page(self, page: object) -> int:
        """A page argument checked to lie in ``[0, num_blocks)`` (ValueError naming it)."""
        index = as_int(page, "page")
        if not 0 <= index < self._num_blocks:
            raise ValueError(f"page {index} is out of range [0, {self._num_blocks})")
        return index

    def _group(self, value: object, name: str) -> int:
        """A group argument: a count (TypeError / ValueError / OverflowError naming ``name``),
        in arena mode one of the arena's groups (ValueError)."""
        group = as_count(value, name)
        if self._arena is not None and group >= len(self._arena.page_bytes):
            groups = len(self._arena.page_bytes)
            raise ValueError(f"{name} must be < {groups} (the arena's groups), got {group}")
        return group

    def _check_needs(self, needs: list[int]) -> None:
        """Arena mode: at most one need per group (ValueError)."""
        assert self._arena is not None
        groups = len(self._arena.page_bytes)
        if len(needs) > groups:
            raise ValueError(f"needs has {len(needs)} entries, more than the arena's {groups} groups")

    def _check_claimable(self, page: int) -> None:
        """Arena mode: a real page of count 0 may take a reference or a key only in a unit bound
        to its own group (ValueError otherwise, worded as the native ``check_arena_page``)."""
        arena = self._arena
        if arena is None or page == 0 or self._ref_counts[page] > 0:
            return
        unit = arena.unit_of[page]
        if unit == 0 or arena.group_of_unit[unit] != arena.group_of[page]:
            g = arena.group_of[page]
            raise ValueError(f"page {page} of group {g} lies in no unit bound to that group (arena mode)")

    def _evict(self, page: int) -> None:
        """Drop ``page``'s key, if it holds one (it leaves that key's page list)."""
        key = self._drop_key(page)
        if key is None:
            return
        self._evictions += 1
        if self._key_group is not None:
            group = self._key_group(key)
            self._evictions_by_group[group] = self._evictions_by_group.get(group, 0) + 1
        if self._record_evictions:
            self._evicted.append(key)

    def _drop_key(self, page: int) -> str | None:
        """Forget ``page``'s key (it leaves that key's page list); returns the key, if any."""
        key = self._key_of[page]
        if key is None:
            return None
        self._key_of[page] = None
        holders = self._pages_by_key[key]
        holders.remove(page)
        if not holders:
            del self._pages_by_key[key]
        return key

    def _drop_free_key(self, page: int) -> str | None:
        """Drop the key of ``page``, a page of count 0 holding one (it stays free where it is);
        returns the key, or None (nothing changes) when it is referenced or holds no key. Not
        an eviction."""
        if self._ref_counts[page] != 0 or self._key_of[page] is None:
            return None
        key = self._drop_key(page)
        if self._arena is not None:
            self._arena_on_uncache(page)
        return key

    def _set_record_evictions(self, on: bool) -> None:
        """Keep (or stop keeping, dropping those kept) the keys allocations evict."""
        self._record_evictions = as_flag(on, "on")
        if not on:
            self._evicted = []

    def _take_evicted(self) -> list[str]:
        """The keys evicted since the last call, in eviction order (recorded only when asked)."""
        evicted, self._evicted = self._evicted, []
        return evicted

    def _clear_cached_free(self) -> list[str]:
        """Drop the key of every free cached page (they stay free, in place); not evictions.

        Returns the dropped keys in free-list order; in arena mode in arena order (each group's
        free pages, then the idle units least recently idle first, ids ascending), an idle unit
        left without a key joining the front of the free units."""
        dropped = []
        if self._arena is not None:
            for page in self._arena_cached_free():
                key = self._drop_key(page)
                if key is not None:
                    dropped.append(key)
                self._arena_on_uncache(page)
            return dropped
        for page in self._free:
            key = self._drop_key(page)
            if key is not None:
                dropped.append(key)
        return dropped

    def _cached_pages(self) -> Iterator[int]:
        for pages in self._pages_by_key.values():
            yield from pages

    def _free_list(self) -> list[int]:
        """The free list, front first (for invariant checks).

        In arena mode: the free pages of each group (those of count 0 in its busy units),
        concatenated in group order, each front first. The pages of idle units (count 0 too)
        are on no list; :meth:`_arena_check` checks the arena's lists."""
        if self._arena is not None:
            arena = self._arena
            return [
                page
                for g in range(len(arena.free_pages))
                for page in (*arena.free_pages[g], *arena.cached_pages[g])
            ]
        return list(self._free)

    def _key_map(self) -> dict[str, list[int]]:
        """A copy of the key -> pages map (for invariant checks)."""
        return {key: list(pages) for key, pages in self._pages_by_key.items()}

    def _arena_group_of(self, page: int) -> int:
        """The group whose id range holds ``page`` (arena mode; for invariant checks)."""
        assert self._arena is not None
        return self._arena.group_of[page]

    def _key_held_by(self, page: int) -> str | None:
        return self._key_of[page]

    # -- arena mode (the native arena.rs, operation for operation) ------------------------------

    def _arena_take(self, g: int) -> int:
        """Take one page for group ``g`` (the caller checked that one can be taken): a free page,
        a free unit, a cached page, an idle unit, in this order (module doc)."""
        arena = self._arena
        assert arena is not None
        source = arena.free_pages[g]
        if not source:
            cached = arena.cached_pages[g]
            if arena.free_units:
                unit, _unused = arena.free_units.popitem(last=False)
                self._arena_bind(unit, g)
            elif cached and (
                not arena.idle_units
                or arena.page_age[_front(cached)] <= arena.unit_age[_front(arena.idle_units)]
            ):
                source = cached
            else:
                unit, _unused = arena.idle_units.popitem(last=False)
                self._arena_evict_unit(unit)
                self._arena_bind(unit, g)
        page = _front(source)
        had_key = self._key_of[page] is not None
        del source[page]
        self._evict(page)
        self._ref_counts[page] = 1
        unit = arena.unit_of[page]
        arena.live[unit] += 1
        arena.cached[unit] -= int(had_key)
        return page

    def _arena_evict_unit(self, unit: int) -> None:
        """Evict every key of the idle ``unit`` (in id order) and unbind it."""
        arena = self._arena
        assert arena is not None
        for page in arena.ids_of_unit(arena.group_of_unit[unit], unit):
            self._evict(page)
        arena.cached[unit] = 0
        arena.group_of_unit[unit] = _UNBOUND

    def _arena_bind(self, unit: int, g: int) -> None:
        """Bind the free ``unit`` to group ``g``: its pages join the front of the group's free
        pages, lowest id first."""
        arena = self._arena
        assert arena is not None
        arena.group_of_unit[unit] = g
        for page in reversed(arena.ids_of_unit(g, unit)):
            _push_front(arena.free_pages[g], page)

    def _arena_on_take(self, page: int) -> None:
        """A page of count 0 takes a reference: off its group's list, or its idle unit becomes
        busy (its other pages join the group's lists: uncached ones at the front of the free
        pages in id order, cached ones at the back of the cached pages in id order)."""
        arena = self._arena
        assert arena is not None
        unit = arena.unit_of[page]
        g = arena.group_of_unit[unit]
        if arena.live[unit] == 0:
            ids = arena.ids_of_unit(g, unit)
            del arena.idle_units[unit]
            for other in reversed(ids):
                if other != page and self._key_of[other] is None:
                    _push_front(arena.free_pages[g], other)
            for other in ids:
                if other != page and self._key_of[other] is not None:
                    arena.cached_pages[g][other] = None
                    arena.page_age[other] = arena.tick()
        else:
            self._arena_list_of(g, page).pop(page)
        arena.live[unit] += 1

    def _arena_list_of(self, g: int, page: int) -> OrderedDict[int, None]:
        """The list of group ``g`` a listed ``page`` is on: by whether it holds a key."""
        arena = self._arena
        assert arena is not None
        return arena.free_pages[g] if self._key_of[page] is None else arena.cached_pages[g]

    def _arena_on_free(self, page: int) -> None:
        """A page's count dropped to 0: while its unit is busy, to the front of its group's free
        pages (uncached) or the back of its cached pages; the unit's last referenced page takes
        the unit's pages off the lists and sends the unit to the front of the free units (no
        key) or the back of the idle units."""
        arena = self._arena
        assert arena is not None
        cached = self._key_of[page] is not None
        unit = arena.unit_of[page]
        g = arena.group_of_unit[unit]
        arena.live[unit] -= 1
        if arena.live[unit] > 0:
            if cached:
                arena.cached_pages[g][page] = None
                arena.page_age[page] = arena.tick()
            else:
                _push_front(arena.free_pages[g], page)
            return
        for other in arena.ids_of_unit(g, unit):
            if other != page:
                self._arena_list_of(g, other).pop(other)
        if arena.cached[unit] == 0:
            arena.group_of_unit[unit] = _UNBOUND
            _push_front(arena.free_units, unit)
        else:
            arena.idle_units[unit] = None
            arena.unit_age[unit] = arena.tick()

    def _arena_on_cache(self, page: int) -> None:
        """A page gained a key: counted in its unit; a listed free page moves to the back of the
        cached pages."""
        arena = self._arena
        assert arena is not None
        unit = arena.unit_of[page]
        arena.cached[unit] += 1
        if self._ref_counts[page] == 0 and arena.live[unit] > 0:
            g = arena.group_of_unit[unit]
            del arena.free_pages[g][page]
            arena.cached_pages[g][page] = None
            arena.page_age[page] = arena.tick()

    def _arena_on_uncache(self, page: int) -> None:
        """A free page lost its key (not by eviction): a listed one moves to the back of the free
        pages; an idle unit left with no key is free again, at the front of the free units."""
        arena = self._arena
        assert arena is not None
        unit = arena.unit_of[page]
        arena.cached[unit] -= 1
        if arena.live[unit] > 0:
            g = arena.group_of_unit[unit]
            del arena.cached_pages[g][page]
            arena.free_pages[g][page] = None
        if arena.cached[unit] == 0 and arena.live[unit] == 0 and arena.group_of_unit[unit] != _UNBOUND:
            del arena.idle_units[unit]
            arena.group_of_unit[unit] = _UNBOUND
            _push_front(arena.free_units, unit)

    def _eviction_stamp(self, page: int) -> int | None:
        """The eviction stamp of ``page`` if it is a cached page of count 0 in arena mode (its
        idle unit's, or its own on a busy unit's cached pages; lower stamps are evicted first);
        ``None`` otherwise (the native ``eviction_stamp``)."""
        arena = self._arena
        if arena is None or not 0 < page < len(self._ref_counts):
            return None
        if self._ref_counts[page] != 0 or self._key_of[page] is None:
            return None
        unit = arena.unit_of[page]
        return arena.unit_age[unit] if arena.live[unit] == 0 else arena.page_age[page]

    def _date(self, page: int, stamp: int | None) -> None:
        """Date the cached page of count 0 ``page`` at eviction stamp ``stamp`` (``None``: the
        clock's next, the newest): evicted after every page and unit stamped earlier, before those
        stamped later. Arena mode only (a plain pool's free list has no dates: a no-op, as for a
        page not cached and free), as the native ``date``."""
        if self._eviction_stamp(page) is None:
            return
        arena = self._arena
        assert arena is not None
        if stamp is None:
            stamp = arena.tick()
        unit = arena.unit_of[page]
        if arena.live[unit] == 0:
            _insert_behind(arena.idle_units, arena.unit_age, unit, stamp)
        else:
            g = arena.group_of_unit[unit]
            _insert_behind(arena.cached_pages[g], arena.page_age, page, stamp)

    def _arena_cached_free(self) -> list[int]:
        """Every cached page of count 0, in arena order: each group's cached pages, then the idle
        units least recently idle first, ids ascending."""
        arena = self._arena
        assert arena is not None
        pages = [page for cached in arena.cached_pages for page in cached]
        for unit in arena.idle_units:
            ids = arena.ids_of_unit(arena.group_of_unit[unit], unit)
            pages.extend(page for page in ids if self._key_of[page] is not None)
        return pages

    def _arena_check(self) -> str | None:
        """The first broken arena invariant, described, or None (also without an arena).

        Mirrors the native ``arena_check`` (unit lists and counts, per-unit listing of free
        pages, live pages against reference counts) and checks a little more: every listed
        page is a free page of a busy unit of its list's group, no list holds an id out of
        range, and the free list is unused."""
        arena = self._arena
        if arena is None:
            return None
        units = len(arena.group_of_unit)
        for name, members in (("free units", arena.free_units), ("idle units", arena.idle_units)):
            for unit in members:
                if not 0 < unit < units:
                    return f"{name}: unit {unit} is out of range [1, {units})"
        for unit in range(1, units):
            g = arena.group_of_unit[unit]
            if g == _UNBOUND:
                if (
                    unit not in arena.free_units
                    or unit in arena.idle_units
                    or arena.live[unit] != 0
                    or arena.cached[unit] != 0
                ):
                    return f"unbound unit {unit} is not exactly on the free units"
                continue
            live = cached = 0
            for page in arena.ids_of_unit(g, unit):
                referenced = self._ref_counts[page] > 0
                live += int(referenced)
                cached += int(self._key_of[page] is not None)
                if arena.unit_of[page] != unit or arena.group_of[page] != g:
                    return f"page {page} is not mapped to unit {unit} of group {g}"
                want = not referenced and arena.live[unit] > 0
                has_key = self._key_of[page] is not None
                on_free, on_cached = page in arena.free_pages[g], page in arena.cached_pages[g]
                if on_free != (want and not has_key) or on_cached != (want and has_key):
                    return (
                        f"page {page} of unit {unit} (key: {has_key}): on the free pages {on_free}, "
                        f"on the cached pages {on_cached}, but listed should be {want}"
                    )
            if live != arena.live[unit] or cached != arena.cached[unit]:
                return (
                    f"unit {unit}: counts live {arena.live[unit]}/{live}, "
                    f"cached {arena.cached[unit]}/{cached} disagree"
                )
            if unit in arena.free_units or (unit in arena.idle_units) != (live == 0) or live == cached == 0:
                return f"bound unit {unit} (live {live}, cached {cached}) is on the wrong unit list"
        for g in range(len(arena.free_pages)):
            for page in (*arena.free_pages[g], *arena.cached_pages[g]):
                unit = arena.unit_of[page] if 0 < page < self._num_blocks else 0
                if (
                    unit == 0
                    or arena.group_of[page] != g
                    or arena.group_of_unit[unit] != g
                    or self._ref_counts[page] != 0
                    or arena.live[unit] == 0
                ):
                    return f"page {page} is on the free pages of group {g} but is no free page of a busy unit"
        referenced_pages = sum(1 for count in self._ref_counts if count > 0)
        if referenced_pages != sum(arena.live):
            return f"{referenced_pages} pages referenced but units count {sum(arena.live)} live"
        if self._free:
            return "the free list is used in arena mode"
        return None
