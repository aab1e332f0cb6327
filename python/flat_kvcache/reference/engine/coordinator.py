"""The coordinator (SPEC 7): the cache's state, and match / claim / acquire / register across groups.

The public page-level calls built on these (``match_prefix``, ``claim``, ``acquire``,
``register``) are :class:`~flat_kvcache.reference.engine.calls.page.PageApi`'s; the token-level
calls use the same private steps.

:class:`Coordinator` owns everything a cache holds (the pool, one manager per group, the
request tables keyed by id, the token-level states, their slots, reserves, counters and the
event list); the mixins of ``calls`` (and ``events``) add calls on top of it.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from flat_kvcache._types import FULL, STATE, ArenaComponent, ArenaGroup, ArenaPlan, KVCacheSpec
from flat_kvcache.errors import UnknownRequestError
from flat_kvcache.events import BlockRemoved, BlockStored, KVCacheEvent
from flat_kvcache.reference._checks import ceil_div
from flat_kvcache.reference.engine._args import (
    EVICTION_ORDERS,
    HASH_HEX_LEN,
    U64_MAX,
    RequestId,
    align_down,
    as_count,
    as_counts,
    as_flag,
    as_group_spec,
    as_page_ids,
    as_pool_size,
    as_request_id,
    batch_items,
    clipped_repr,
    debug_str,
    shown_id,
)
from flat_kvcache.reference.engine.events import removed_events, stored_event
from flat_kvcache.reference.engine.group import GroupManager, new_manager
from flat_kvcache.reference.engine.hash import fold_hashes, group_key
from flat_kvcache.reference.engine.host import HOST_BIT, HOST_STORES, MAX_HOST_PAGES, HostTier
from flat_kvcache.reference.engine.policy import EVICTION_POLICIES, ReuseEvidence
from flat_kvcache.reference.engine.pool import DEFAULT_REUSE_UNCACHED_FIRST, BlockPool
from flat_kvcache.reference.engine.prefixes import PathCounts
from flat_kvcache.reference.engine.table import Table, TokenState

__all__ = ["Coordinator", "PrefixMatch"]


@dataclass(frozen=True)
class PrefixMatch:
    """The result of :meth:`FlatKVCache.match_prefix` (SPEC 7).

    ``pages[g]`` is group ``g``'s matched table (0 = hole); ``num_hit_pages[g]`` counts its real
    pages; ``num_common_tokens`` is the greatest boundary every group supports (a multiple of
    the lcm page size).

    A match from ``match_prefix`` also remembers the key each real page was matched under, so
    ``claim`` can refuse it once a page holds another key (or none). A match built by hand
    remembers none. Equality compares the three public fields only.
    """

    num_common_tokens: int
    pages: list[list[int]]
    num_hit_pages: list[int]
    _keys: list[list[str | None]] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        """Check a hand-built match the way the native one does, and keep plain lists."""
        common = as_count(self.num_common_tokens, "num_common_tokens")
        groups = batch_items(self.pages, "pages", "page-id sequences")
        checked = [as_page_ids(group, f"pages[{g}]") for g, group in enumerate(groups)]
        object.__setattr__(self, "num_common_tokens", common)
        object.__setattr__(self, "pages", checked)
        object.__setattr__(self, "num_hit_pages", as_counts(self.num_hit_pages, "num_hit_pages"))


def _plan_items(arena: ArenaPlan, field: str, cls: type) -> list[Any]:
    """The items of the plan's ``field``, each a ``cls`` (TypeError naming ``arena.<field>[i]``)."""
    items = list(batch_items(getattr(arena, field), f"arena.{field}", cls.__name__))
    for i, item in enumerate(items):
        if not isinstance(item, cls):
            raise TypeError(f"arena.{field}[{i}] must be an {cls.__name__}, got {type(item).__name__}")
    return items


def _plan_text(item: object, field: str, index: int, name: str) -> str:
    """The str field ``name`` of ``item``, the ``index``-th of the plan's ``field``."""
    value = getattr(item, name)
    if not isinstance(value, str):
        raise TypeError(f"arena.{field}[{index}].{name} must be a str, got {type(value).__name__}")
    value.encode("utf-8")  # a lone surrogate: UnicodeEncodeError, as natively
    return value


def arena_geometry(
    arena: object, specs: Sequence[KVCacheSpec], group_ids: Sequence[str]
) -> tuple[int, int, list[int]]:
    """The ``arena=`` argument over the cache's groups: ``(unit_bytes, num_units, page_bytes)``
    with one page size per group in group order (a state group's page is the whole unit).

    Checked in the order of docs/engine-api.md ("Arena"): ``arena`` an :class:`ArenaPlan`, its
    fields in their order (each group an :class:`ArenaGroup`, each component an
    :class:`ArenaComponent`: TypeError); then the plan in itself (no group twice, every
    component in one of its groups); then against the specs (the same groups, each laid out as
    its kind, every page group's pages of ``arena.page_size`` tokens): ValueError."""
    if not isinstance(arena, ArenaPlan):
        raise TypeError(f"arena must be an ArenaPlan (from plan_arena), got {type(arena).__name__}")
    page_size = as_count(arena.page_size, "arena.page_size")
    as_count(arena.alignment, "arena.alignment")
    unit_bytes = as_count(arena.unit_bytes, "arena.unit_bytes")
    num_units = as_count(arena.num_units, "arena.num_units")
    planned: list[tuple[str, str, int]] = []
    for i, group in enumerate(_plan_items(arena, "groups", ArenaGroup)):
        gid = _plan_text(group, "groups", i, "group_id")
        kind = _plan_text(group, "groups", i, "kind")
        planned.append((gid, kind, as_count(group.item_bytes, f"arena.groups[{i}].item_bytes")))
    placed = [
        _plan_text(comp, "components", i, "group_id")
        for i, comp in enumerate(_plan_items(arena, "components", ArenaComponent))
    ]
    seen: set[str] = set()
    for gid, _, _ in planned:
        if gid in seen:
            raise ValueError(f"arena: the plan lists group {debug_str(gid[:80])} twice")
        seen.add(gid)
    for i, gid in enumerate(placed):
        if gid not in seen:
            raise ValueError(
                f"arena: arena.components[{i}] lies in group {debug_str(gid[:80])}, which the plan "
                "does not list"
            )
    for gid, _, _ in planned:
        if gid not in group_ids:
            raise ValueError(
                f"arena: the plan's group {debug_str(gid[:80])} is not one of the cache's groups"
            )
    page_bytes = []
    for gid, spec in zip(group_ids, specs, strict=True):
        found = next((p for p in planned if p[0] == gid), None)
        if found is None:
            raise ValueError(f"arena: the plan has no group {debug_str(gid[:80])} (a group of specs)")
        want = "state" if spec.kind == STATE else "pages"
        if found[1] != want:
            raise ValueError(
                f"arena: group {debug_str(gid[:80])} is a {spec.kind} group but the plan lays it "
                f"out as {debug_str(found[1][:80])}"
            )
        if spec.kind != STATE and spec.page_size != page_size:
            raise ValueError(
                f"arena: group {debug_str(gid[:80])} has pages of {spec.page_size} tokens but the "
                f"plan's pages hold {page_size} (arena.page_size)"
            )
        page_bytes.append(unit_bytes if spec.kind == STATE else found[2])
    return unit_bytes, num_units, page_bytes


def host_pages_per_group(host_pages: Mapping[Any, Any], group_ids: Sequence[str]) -> list[int]:
    """The host pages of each group, in group order, from a ``{group_id: pages}`` mapping (the
    groups it does not name get 0): a key that is not a str is a TypeError, one that names no
    group a ValueError, a bad count the error of ``as_count`` naming ``host_pages[<group id>]``."""
    pages = [0] * len(group_ids)
    for gid, value in host_pages.items():
        if not isinstance(gid, str):
            raise TypeError(f"host_pages keys must be group ids (str), got {type(gid).__name__}")
        gid.encode("utf-8")  # a lone surrogate is a UnicodeEncodeError, as in every str argument
        if gid not in group_ids:
            raise ValueError(
                f"host_pages names group {debug_str(gid[:80])}, which is not one of the cache's groups"
            )
        pages[group_ids.index(gid)] = as_count(value, f"host_pages[{debug_str(gid[:80])}]")
    return pages


class Coordinator:
    """The cache's state and the calls that span every group (SPEC 7).

    ``base`` (gcd) and ``lcm`` of the page sizes tie the groups together: content hashes are
    per base page, a group of page size ``P_g`` folds ``m_g = P_g / base`` of them per key, and
    a prefix match ends on a multiple of ``lcm`` so every group's pages are whole. Groups keep
    their index order everywhere; no group stands for the request (SPEC 12.5).
    """

    def __init__(
        self,
        specs: Sequence[KVCacheSpec],
        num_pages: int | None = None,
        *,
        arena: ArenaPlan | None = None,
        enable_caching: bool = True,
        eviction_order: str = "hybrid",
        enable_kv_events: bool = False,
        reuse_uncached_first: bool = DEFAULT_REUSE_UNCACHED_FIRST,
        host_pages: int | Mapping[str, int] | None = 0,
        host_store: str = "write_through",
        eviction_policy: str = "lru",
        move_state_pages: bool = True,
        register_on_schedule: bool = False,
    ) -> None:
        # docs/engine-api.md, "The checking order": each argument's form in signature order
        # (``arena=`` is read against the specs below), then what they say together.
        spec_items = batch_items(specs, "specs", "KVCacheSpec")
        # Each spec is read field by field, as the native engine reads it (_args.as_group_spec).
        spec_list = [as_group_spec(index, spec) for index, spec in enumerate(spec_items)]
        if not spec_list:
            raise ValueError("specs must hold at least one group")
        group_ids = [
            spec.group_id if spec.group_id is not None else f"g{i}" for i, spec in enumerate(spec_list)
        ]
        for index, spec in enumerate(spec_list):
            chunk = spec.chunk_size
            if chunk is not None and chunk % spec.page_size != 0:
                raise ValueError(
                    f"specs[{index}].chunk_size must be a positive multiple of its page_size "
                    f"{spec.page_size}, got {chunk}"
                )
            if group_ids[index] in group_ids[:index]:
                raise ValueError(f"specs: group id {debug_str(group_ids[index])} appears more than once")
        sizes = [spec.page_size for spec in spec_list]
        lcm = math.lcm(*sizes)
        if lcm > U64_MAX:
            raise OverflowError(
                f"specs: the lcm of the page sizes {sizes} does not fit in an unsigned 64-bit integer"
            )
        total = None if num_pages is None else as_pool_size(num_pages, "num_pages")
        caching = as_flag(enable_caching, "enable_caching")
        if not isinstance(eviction_order, str) or eviction_order not in EVICTION_ORDERS:
            shown = clipped_repr(eviction_order)
            raise ValueError(f"eviction_order must be 'hybrid' or 'group', got {shown}")
        events_on = as_flag(enable_kv_events, "enable_kv_events")
        as_flag(reuse_uncached_first, "reuse_uncached_first")
        host_map: Mapping[Any, Any] | None = None
        if isinstance(host_pages, Mapping):
            host_map, num_host = host_pages, 0
        else:
            num_host = 0 if host_pages is None else as_count(host_pages, "host_pages")
        if not isinstance(host_store, str) or host_store not in HOST_STORES:
            shown = clipped_repr(host_store)
            raise ValueError(f"host_store must be 'write_through' or 'evict', got {shown}")
        if not isinstance(eviction_policy, str) or eviction_policy not in EVICTION_POLICIES:
            raise ValueError(f"eviction_policy must be 'lru' or 'reuse', got {clipped_repr(eviction_policy)}")
        moves = as_flag(move_state_pages, "move_state_pages")
        on_schedule = as_flag(register_on_schedule, "register_on_schedule")
        #: Which state checkpoints are kept (SPEC 13.8, ``policy``), and what ``reuse`` learned.
        self._policy = eviction_policy
        self._evidence = ReuseEvidence()
        geometry: tuple[int, int, list[int]] | None = None
        host_per_group: list[int] = []
        if num_pages is not None and arena is not None:
            raise ValueError(
                f"num_pages must be None with arena= (the arena sizes the pool), got {num_pages!r}"
            )
        if num_pages is None and arena is None:
            raise TypeError(
                "num_pages must be an int (the pages in the pool, page 0 included) unless arena= is "
                "given, got None"
            )
        if arena is None:
            if host_map is not None:
                raise TypeError(
                    "host_pages must be an int without arena= (a {group_id: pages} mapping gives each "
                    f"group of an arena its own host pages), got {type(host_pages).__name__}"
                )
        else:
            geometry = arena_geometry(arena, spec_list, group_ids)
            host_per_group = (
                [num_host] * len(group_ids) if host_map is None else host_pages_per_group(host_map, group_ids)
            )
            if not reuse_uncached_first:
                raise ValueError(
                    "reuse_uncached_first must be True with arena storage (an arena reuses a "
                    "unit's free pages first)"
                )

        self._specs = spec_list
        #: The state groups' indices (read per request per step).
        self._state_groups = [g for g, spec in enumerate(spec_list) if spec.kind == STATE]
        #: Same-step sharing (docs/requests-api.md): ``schedule`` registers the full pages of
        #: the chunk it takes. Off with state groups: a checkpoint exists only once its chunk is
        #: computed, and a hit there ends on one, so early attention pages never extend a hit.
        self._register_on_schedule = on_schedule and not self._state_groups
        #: The lcm of the state groups' page sizes (None without state groups).
        self._state_grain = (
            math.lcm(*(spec_list[g].page_size for g in self._state_groups)) if self._state_groups else None
        )
        self._group_ids = group_ids
        self._base = math.gcd(*sizes)
        self._lcm = lcm
        self._enable_caching = caching
        self._eviction_order = eviction_order
        if geometry is None:
            assert total is not None  # num_pages was given (checked above)
            self._pool = BlockPool(
                total, enable_caching=self._enable_caching, reuse_uncached_first=reuse_uncached_first
            )
        else:
            states = [gid for gid, spec in zip(group_ids, spec_list, strict=True) if spec.kind == STATE]
            if len(states) > 1:
                shown = "[" + ", ".join(debug_str(gid) for gid in states) + "]"
                raise ValueError(
                    f"arena: at most one state group (one state slot holds every state layer), got {shown}"
                )
            unit_bytes, num_units, page_bytes = geometry
            self._pool = BlockPool.with_arena(
                unit_bytes, num_units, page_bytes, enable_caching=self._enable_caching
            )
        self._managers: list[GroupManager] = [
            new_manager(index, spec, self._base, self._pool) for index, spec in enumerate(spec_list)
        ]
        for manager in self._managers:
            manager.moves_working_page = moves
        # SPEC 7: prefix-closed groups first, then the others, each in index order.
        closed = [m.index for m in self._managers if m.prefix_closed]
        others = [m.index for m in self._managers if not m.prefix_closed]
        self._match_order = closed + others
        self._requests: dict[RequestId, list[Table]] = {}
        # Token-level requests (docs/requests-api.md): their tokens and position, and the
        # pages promised to any request's next decode (SPEC 9).
        self._token_states: dict[RequestId, TokenState] = {}
        self._reserves: dict[RequestId, int] = {}
        # Slots of token-level requests (docs/requests-api.md "Slots"): a new request takes the
        # lowest slot no live request holds: the lowest freed one, else the next never used.
        self._slot_of: dict[RequestId, int] = {}
        self._id_at: dict[int, RequestId] = {}
        self._vacant_slots: list[int] = []  # a min-heap of freed slots below _slots_used
        # Slots taken or freed since the last update_rows that succeeded (calls/rows.py).
        self._rows_handed: set[int] = set()
        self._slots_used = 0
        self._counters = {
            "prefix_queries_tokens": 0,
            "prefix_hits_tokens": 0,
            "preemptions": 0,
            "host_hits_tokens": 0,
            "checkpoints_written": 0,
            "checkpoints_hit": 0,
        }
        # A key is the content hash then the group index in hex: count evictions per group.
        self._pool._key_group = lambda key: int(key[HASH_HEX_LEN:], 16)
        self._events_enabled = events_on
        self._events: list[KVCacheEvent] = []
        self._pool._record_evictions = self._events_enabled
        # The host-memory tier (host.py), and per token-level request its loads in flight.
        self._host: HostTier | None = None
        self._loading: dict[RequestId, int] = {}
        if geometry is not None and any(host_per_group):
            # Over an arena the tier is per group: each group's host pages of its own geometry.
            total = sum(host_per_group)
            if total > MAX_HOST_PAGES:
                raise ValueError(
                    f"host_pages: the groups' host pages add up to {total}, which must be in "
                    f"[1, {MAX_HOST_PAGES}] for a host tier (host page ids are int32)"
                )
            self._host = HostTier(host_per_group, host_store)
        elif geometry is None and num_host > 0:
            if num_host > MAX_HOST_PAGES:
                raise ValueError(
                    f"host_pages must be in [1, {MAX_HOST_PAGES}] for a host tier, got {num_host}"
                )
            self._host = HostTier(num_host, host_store)
        if self._host is not None:
            self._pool._record_released = host_store == "evict"
        # Whole hybrid prefixes (prefixes.py): the paths of the checkpoints finished requests
        # left, over the full-attention groups keyed by base-page hashes.
        self._prefixes = PathCounts()
        self._full_at_base = [
            g for g, spec in enumerate(spec_list) if spec.kind == FULL and spec.page_size == self._base
        ]
        self._pool._record_evictions = (
            self._events_enabled
            or self._whole_prefixes()
            or (self._policy == "reuse" and len(self._state_groups) == 1)
        )

    # -- properties -----------------------------------------------------------------------------

    def _state_slots(self) -> int:
        """The state pages the pool can hold for the single state group (its ids less the null
        page): the evidence's decay horizon and ghost capacity (SPEC 13.8b); 0 without one."""
        if len(self._state_groups) != 1:
            return 0
        return max(self._pool.group_ids(self._state_groups[0]) - 1, 0)

    def _sharing_grain(self) -> int | None:
        """The grain prompts share at (SPEC 13.8): the state grain under ``lru``, the learned
        sharing grain under ``reuse``; None without state groups."""
        if self._state_grain is None:
            return None
        if self._policy == "lru":
            return self._state_grain
        return self._evidence.sharing_grain(self._state_grain)

    @property
    def base_page_size(self) -> int:
        """gcd of the page sizes: the size of the pages content hashes are taken over."""
        return self._base

    @property
    def lcm_page_size(self) -> int:
        """lcm of the page sizes: prefix matches end on a multiple of it."""
        return self._lcm

    @property
    def num_groups(self) -> int:
        return len(self._managers)

    @property
    def group_ids(self) -> list[str]:
        return list(self._group_ids)

    @property
    def num_free_pages(self) -> int:
        return self._pool.num_free

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(group_ids={self._group_ids}, num_pages={self._pool.num_blocks}, "
            f"num_free_pages={self._pool.num_free}, num_requests={len(self._requests)})"
        )

    # -- helpers --------------------------------------------------------------------------------

    def _tables(self, req: RequestId) -> list[Table]:
        """The request's tables, one per group; ``UnknownRequestError`` (a ``KeyError``) for an unknown id."""
        key = as_request_id(req)
        try:
            return self._requests[key]
        except KeyError:
            raise UnknownRequestError(f"unknown request id {shown_id(key)}") from None

    def _check_page_level(self, method: str, key: RequestId) -> None:
        """ValueError naming ``method`` if ``key`` is a live token-level request: its tables
        follow its tokens, which only the token-level calls move (docs/requests-api.md)."""
        if key in self._token_states:
            raise ValueError(f"{method}: request {shown_id(key)} is token-level (created by add_request)")

    # -- slots (token-level requests) -----------------------------------------------------------

    def _next_slot(self) -> int:
        """The slot the next token-level request would get: the lowest one no live request holds."""
        return self._vacant_slots[0] if self._vacant_slots else self._slots_used

    def _take_slot(self, key: RequestId) -> int:
        """Give the new request ``key`` the lowest free slot; returns it."""
        if self._vacant_slots:
            slot = heapq.heappop(self._vacant_slots)
        else:
            slot = self._slots_used
            self._slots_used += 1
        self._slot_of[key] = slot
        self._id_at[slot] = key
        self._rows_handed.add(slot)
        return slot

    def _free_slot(self, key: RequestId) -> None:
        """The request ``key`` is gone: its slot (if it held one) may be given out again."""
        slot = self._slot_of.pop(key, None)
        if slot is not None:
            del self._id_at[slot]
            heapq.heappush(self._vacant_slots, slot)
            self._rows_handed.add(slot)

    def _held(self, method: str, slot: int) -> RequestId:
        """The id of the request in the checked ``slot``; ``UnknownRequestError`` (a
        ``KeyError``) naming ``method`` if the slot holds none."""
        key = self._id_at.get(slot)
        if key is None:
            raise UnknownRequestError(f"{method}: slot {slot} holds no request")
        return key

    def _named(self, key: RequestId) -> str:
        """A request as messages name it: ``'a' (slot 3)`` for one in a slot, else ``'a'``."""
        slot = self._slot_of.get(key)
        return shown_id(key) if slot is None else f"{shown_id(key)} (slot {slot})"

    def _tables_or_new(self, req: RequestId) -> list[Table]:
        """The request's tables, created empty on first use (claim, acquire, first chunk)."""
        key = as_request_id(req)
        if key not in self._requests:
            self._requests[key] = [Table() for _ in self._managers]
        return self._requests[key]

    def _group_keys(self, manager: GroupManager, hashes: Sequence[str], first_base: int) -> list[str]:
        """Group keys of the group's slots covered by ``hashes`` (base pages from ``first_base``)."""
        return [group_key(folded, manager.index) for folded in fold_hashes(hashes, first_base, manager.fold)]

    def _still_matches(self, match: PrefixMatch, group: int, slot: int, page: int) -> bool:
        """Whether ``page`` (slot ``slot`` of group ``group``) still holds the key it was matched
        under; for a hand-built match, whether it holds any key of that group."""
        held = self._pool._key_held_by(self._pool._page(page))
        if held is None:
            return False
        if match._keys is None:
            return held.endswith(f"{group:08x}")
        return held == match._keys[group][slot]

    @staticmethod
    def _check_match(match: object) -> PrefixMatch:
        if not isinstance(match, PrefixMatch):
            raise TypeError(f"match must be a PrefixMatch, got {type(match).__name__}")
        return match

    # -- SPEC 7: across groups ------------------------------------------------------------------

    def _match(
        self, hashes: list[str], *, tiered: bool
    ) -> tuple[int, list[list[int]], list[list[str | None]], int]:
        """:meth:`match_prefix` on checked hashes: ``(bound, pages, keys, branch)``. With
        ``tiered`` (and a host tier) a key missing on the device is looked up on the host, and a
        host hit is ``HOST_BIT | host page``. ``branch`` is the bound once the full-attention
        groups are matched (``bound`` without them, never below it): where the prompt leaves
        the cached path (SPEC 13.5c)."""
        count = len(self._managers)
        if not self._enable_caching:
            return 0, [[] for _ in range(count)], [[] for _ in range(count)], 0
        host = self._host if tiered else None

        def lookup(key: str) -> int | None:
            page = self._pool.lookup(key)
            if page is None and host is not None:
                found = host.lookup(key)
                return None if found is None else HOST_BIT | found
            return page

        keys = [self._group_keys(manager, hashes, 0) for manager in self._managers]
        results: list[list[int]] = [[] for _ in range(count)]
        bound = align_down(len(hashes) * self._base, self._lcm)

        def match_group(index: int) -> None:
            nonlocal bound
            manager = self._managers[index]
            results[index] = manager.match(keys[index][: bound // manager.page_size], lookup)
            extent = len(results[index]) * manager.page_size
            bound = min(bound, align_down(extent, self._lcm))

        closed: int | None = None
        for index in self._match_order:
            match_group(index)
            if self._managers[index].prefix_closed:
                closed = bound
        changed = True
        while changed:
            changed = False
            for manager in self._managers:
                if not manager.prefix_closed and len(results[manager.index]) * manager.page_size > bound:
                    match_group(manager.index)
                    changed = True
        pages = [results[m.index][: bound // m.page_size] for m in self._managers]
        matched_keys = [
            [keys[group][slot] if page != 0 else None for slot, page in enumerate(group_pages)]
            for group, group_pages in enumerate(pages)
        ]
        return bound, pages, matched_keys, bound if closed is None else max(closed, bound)

    def _claim(self, method: str, key: RequestId, checked: PrefixMatch) -> None:
        """:meth:`claim` of a checked match, errors naming ``method`` (token-level requests
        are refused)."""
        self._check_page_level(method, key)
        existing = self._requests.get(key)
        if existing is not None and any(table.pages for table in existing):
            raise ValueError(f"{method}: request {shown_id(key)} already holds pages")
        if len(checked.pages) != len(self._managers):
            raise ValueError(
                f"{method}: the match has {len(checked.pages)} groups but the cache has {len(self._managers)}"
            )
        for group, pages in enumerate(checked.pages):
            for slot, page in enumerate(pages):
                if page != 0 and not self._still_matches(checked, group, slot, page):
                    raise ValueError(
                        f"{method}: stale match: page {page} of group {debug_str(self._group_ids[group])} "
                        "no longer holds the key it was matched under"
                    )
        tables = self._tables_or_new(key)
        for table, pages in zip(tables, checked.pages, strict=True):
            table.pages = list(pages)
            table.tail_avail = 0
            for page in pages:
                self._pool.touch(page)

    def _view_ids(self, group: int, pages: Sequence[int]) -> list[int]:
        """``pages`` of ``group`` as indices of the group's view: a pool id ``p > 0`` is page
        ``p - group_base(group)`` (arena storage; the same id without one), 0 stays 0."""
        base = self._pool.group_base(group)
        return [page - base if page else 0 for page in pages]

    def _acquire(self, tables: list[Table], count: int) -> bool:
        """:meth:`acquire` on a request's tables and a checked count."""
        needs = [m.blocks_needed_for(t, count) for m, t in zip(self._managers, tables, strict=True)]
        if not self._pool.fits(needs):
            return False
        for manager, table in zip(self._managers, tables, strict=True):
            ok = manager.acquire(table, count)
            assert ok, "the check above guarantees every group's allocation"
            self._record_evictions()
        return True

    def _record_evictions(self) -> None:
        """After an allocation: the keys it evicted become ``BlockRemoved`` events and, keeping
        whole prefixes, an evicted checkpoint's path is forgotten and the pages only it held
        are dropped (their events follow)."""
        keys = self._pool._take_evicted()
        if self._policy == "reuse" and len(self._state_groups) == 1:
            # SPEC 13.8b: an evicted checkpoint leaves a ghost (the marginal worth of a slot).
            group = self._state_groups[0]
            capacity = self._state_slots()
            for key in keys:
                if int(key[HASH_HEX_LEN:], 16) == group:
                    self._evidence.evicted(key, capacity)
        if self._whole_prefixes() and len(self._prefixes):
            for key in list(keys):
                if self._prefixes.remembers(key):
                    self._drop_path(key, keys)
        if self._events_enabled:
            self._events.extend(removed_events(keys))

    def _whole_prefixes(self) -> bool:
        """Whether whole hybrid prefixes are kept (prefixes.py): the ``reuse`` policy, one state
        group, a full-attention group on the base page, prefix caching on, no host tier."""
        return (
            self._policy == "reuse"
            and len(self._state_groups) == 1
            and bool(self._full_at_base)
            and self._enable_caching
            and self._host is None
        )

    def _drop_free(self, key: str, dropped: list[str]) -> None:
        """Drop the key of the earliest registered page holding ``key`` if it is free."""
        page = self._pool.lookup(key)
        if page is not None:
            held = self._pool._drop_free_key(page)
            if held is not None:
                dropped.append(held)

    def _drop_path(self, key: str, dropped: list[str]) -> None:
        """Forget checkpoint ``key``'s path and drop the free full-attention pages only it held."""

        def unheld(page_hash: str) -> None:
            for g in self._full_at_base:
                self._drop_free(group_key(page_hash, g), dropped)

        self._prefixes.forget(key, unheld)

    def _drop_unheld(self, hashes: Sequence[str]) -> None:
        """Drop the key of every free full-attention page among ``hashes`` (a finished request's,
        in order) that no remembered path holds."""
        dropped: list[str] = []
        for page_hash in hashes:
            if not self._prefixes.holds(page_hash):
                for g in self._full_at_base:
                    self._drop_free(group_key(page_hash, g), dropped)
        if dropped and self._events_enabled:
            self._events.extend(removed_events(dropped))

    def _register(
        self,
        tables: list[Table],
        hashes: list[str],
        first: int,
        end: int | None,
        state: TokenState | None,
        only: list[int] | None = None,
    ) -> None:
        """:meth:`register` on checked arguments; ``state`` is the token-level request, if any
        (its tokens, hashes and extra keys go into the ``BlockStored`` events); ``only``, the
        groups that register (every group when None)."""
        if not self._enable_caching:
            return  # SPEC 12.4: nothing is registered when prefix caching is disabled
        plan: list[tuple[GroupManager, Table, list[str], int]] = []
        for manager, table in zip(self._managers, tables, strict=True):
            if only is not None and manager.index not in only:
                continue
            keys = self._group_keys(manager, hashes, first)
            slot = ceil_div(first, manager.fold)
            chosen = manager.keys_to_register(keys, slot, (first + len(hashes)) * self._base, end)
            if chosen is None:
                continue
            chosen_keys, chosen_slot = chosen
            manager.check_register_range(table, chosen_keys, chosen_slot)
            plan.append((manager, table, chosen_keys, chosen_slot))
        for manager, table, chosen_keys, chosen_slot in plan:
            stored = manager.register(table, chosen_keys, chosen_slot)
            if self._specs[manager.index].kind == STATE:
                self._counters["checkpoints_written"] += len(stored)
            if self._host is not None and self._host.policy == "write_through":
                for slot, key in stored:
                    self._store_to_host(table.pages[slot], key)
            if stored and self._events_enabled:
                self._events.append(
                    stored_event(
                        self._pool, self._specs[manager.index], manager, table, stored, hashes, first, state
                    )
                )

    # -- the host-memory tier (host.py) ---------------------------------------------------------

    def _store_to_host(self, page: int, key: str) -> None:
        """Emit a store of device ``page`` holding ``key`` if the tier takes it; the page keeps
        one more reference until the store is acknowledged."""
        if self._host is None:
            return
        stored = self._host.store(page, key, int(key[-8:], 16))
        evicted, self._host.evicted = self._host.evicted, []
        if self._events_enabled:
            for dropped in evicted:
                hashes = [bytes.fromhex(dropped[:HASH_HEX_LEN])]
                self._events.append(BlockRemoved(hashes, int(dropped[HASH_HEX_LEN:], 16), medium="CPU"))
        if stored:
            self._pool.touch(page)

    def _store_released(self) -> None:
        """Store-on-eviction: store every cached page whose count dropped to 0 since the last
        call, in release order (a stored page leaves the free list until acknowledged)."""
        if self._host is None or self._host.policy != "evict":
            return
        released, self._pool._released = self._pool._released, []
        for page in released:
            key = self._pool._key_held_by(page)
            if self._pool.ref_count(page) == 0 and key is not None:
                self._store_to_host(page, key)

    def _host_hit_tokens(self, pages: list[list[int]], hit: int) -> int:
        """Tokens of ``hit`` at or after the first slot any group loads from the host tier."""
        first = hit
        for manager, group_pages in zip(self._managers, pages, strict=True):
            for slot, page in enumerate(group_pages):
                if page & HOST_BIT:
                    first = min(first, slot * manager.page_size)
                    break
        return hit - first

    def _tiered_claim_cost(self, pages: list[list[int]]) -> tuple[int, int]:
        """What claiming a tiered match's ``pages`` takes, each page counted as its group's page
        cost (1 without an arena): (distinct device pages with count 0, one device page per
        host hit)."""
        device: dict[int, int] = {}
        for g, group in enumerate(pages):
            for p in group:
                if p != 0 and not p & HOST_BIT:
                    device.setdefault(p, g)
        loads = sum(self._pool.page_cost(g) for g, group in enumerate(pages) for p in group if p & HOST_BIT)
        cost = sum(self._pool.page_cost(g) for p, g in device.items() if self._pool.ref_count(p) == 0)
        return cost, loads

    def _tiered_claim_fits(self, pages: list[list[int]]) -> bool:
        """Whether a new request can claim a tiered match's ``pages``: its device hits, then one
        device page of its group per host hit, group by group in index order. Without an arena
        the free pages cover both; in arena mode exactly as the units would be bound."""
        if not self._pool.is_arena:
            device, loads = self._tiered_claim_cost(pages)
            return device + loads <= self._pool.num_free
        claimed = [p for group in pages for p in group if p != 0 and not p & HOST_BIT]
        needs = [sum(1 for p in group if p & HOST_BIT) for group in pages]
        return self._pool.fits_after_claim(claimed, needs)

    def _claim_tiered(self, key: RequestId, pages: list[list[int]], state: TokenState) -> None:
        """Claim a tiered match for the new request ``key``: a reference on each device hit,
        then a device page per host hit (allocated group by group in index order, slots
        ascending), each put in the table, pinned, and loaded from the host."""
        tables = self._requests[key]
        wanted = []
        for group, group_pages in enumerate(pages):
            for slot, page in enumerate(group_pages):
                if page & HOST_BIT:
                    wanted.append((group, slot, page & ~HOST_BIT))
                elif page != 0:
                    self._pool.touch(page)
        dest: list[int] = []
        for group, group_pages in enumerate(pages):
            count = sum(1 for page in group_pages if page & HOST_BIT)
            if count:
                dest += self._pool.allocate(count, group)
        assert len(dest) == len(wanted), "the caller checked the free pages"
        self._record_evictions()
        filled = [list(group_pages) for group_pages in pages]
        for (group, slot, host_page), page in zip(wanted, dest, strict=True):
            filled[group][slot] = page
            self._pool.touch(page)  # the load's pin
            manager = self._managers[group]
            host_key = self._host.keys[host_page] if self._host is not None else None
            assert host_key is not None
            event = stored_event(
                self._pool, self._specs[group], manager, Table(), [(slot, host_key)], [], 0, state
            )
            assert self._host is not None
            self._host.load(host_page, page, key, tables, event)
        for table, group_pages in zip(tables, filled, strict=True):
            table.pages = group_pages
            table.tail_avail = 0
        if wanted:
            self._loading[key] = len(wanted)

    def _check_loaded(self, method: str, key: RequestId) -> None:
        """A request with loads in flight cannot be scheduled: its pages are not filled yet."""
        n = self._loading.get(key, 0)
        if n:
            raise ValueError(
                f"{method}: request {self._named(key)} has {n} host page load(s) in flight; run "
                "take_transfers() and ack_transfers() first (loads_in_flight tells when it can be scheduled)"
            )

    def take_transfers(self) -> dict[str, dict[str, tuple[Any, Any, Any]]]:
        """The transfers emitted since the last call: ``{"store": {group_id: (ids, src, dst)},
        "load": {...}}`` with int64 arrays, groups in index order (only those with transfers).
        A store copies device page ``src`` to host page ``dst``; a load host ``src`` to device
        ``dst``: device pages are indices of the group's view (arena storage; the pool's ids
        without one), host pages those of the group's host space (shared by every group
        without an arena). The engine runs them, then calls :meth:`ack_transfers`."""
        host = self._host
        taken = host.take() if host is not None else []
        out: dict[str, dict[str, tuple[Any, Any, Any]]] = {}
        for kind in ("store", "load"):
            per_group: dict[str, tuple[Any, Any, Any]] = {}
            for group, group_id in enumerate(self._group_ids):
                ops = [(op_id, op) for op_id, op in taken if op.kind == kind and op.group == group]
                if not ops or host is None:
                    continue
                # Device pages as the group's view indices, host pages in the group's space.
                devices = self._view_ids(group, [op.device for _, op in ops])
                hosts = [host.space_page(group, op.host) for _, op in ops]
                src, dst = (devices, hosts) if kind == "store" else (hosts, devices)
                per_group[group_id] = (
                    np.array([op_id for op_id, _ in ops], dtype=np.int64),
                    np.array(src, dtype=np.int64),
                    np.array(dst, dtype=np.int64),
                )
            out[kind] = per_group
        return out

    def ack_transfers(self, ids: Sequence[int] | Any) -> None:
        """Acknowledge finished transfers, in any order; everything is checked first.

        A store makes its host page findable; a load registers its device page under the key
        (with its ``BlockStored`` event). Either way the device page's pin goes. A load
        acknowledged after its request ended only releases the page.
        """
        checked = as_counts(ids, "ids")
        if self._host is None:
            if checked:
                raise ValueError(
                    f"ack_transfers: transfer {checked[0]} is not in flight (this cache has no host tier)"
                )
            return
        self._host.check_ack(checked)
        for op_id in checked:
            op = self._host.finish(op_id)
            if op.kind == "store" and self._events_enabled:
                spec = self._specs[op.group]
                self._events.append(
                    BlockStored(
                        block_hashes=[bytes.fromhex(op.key[:HASH_HEX_LEN])],
                        parent_block_hash=None,
                        token_ids=[],
                        block_size=spec.page_size,
                        group_index=op.group,
                        group_kind=spec.kind,
                        sliding_window=spec.sliding_window,
                        medium="CPU",
                    )
                )
            if op.kind == "load":
                if self._enable_caching and self._pool._key_held_by(op.device) is None:
                    self._pool.cache(op.device, op.key)
                    if self._events_enabled and op.event is not None:
                        self._events.append(op.event)
                if self._requests.get(op.owner_key) is op.owner:
                    self._loading[op.owner_key] -= 1
                    if not self._loading[op.owner_key]:
                        del self._loading[op.owner_key]
            self._pool.free([op.device])
        self._store_released()

    def transfers_in_flight(self) -> int:
        """Transfers emitted and not acknowledged yet."""
        return 0 if self._host is None else len(self._host.ops)
