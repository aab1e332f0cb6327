"""Page-level calls (docs/engine-api.md, SPEC 6 to 8): the caller brings the content hashes.

:class:`PageTables` holds what both protocols share: releasing and reclaiming a request's
pages and counting the pages an acquire needs (each class names its requests its own way, so
the public readers are on the classes). :class:`PageApi` adds the page-level protocol of
``PageCache``, whose requests are named by id: match, claim, acquire, register, reclaim, free,
the dry runs an admission check needs, the three step operations (first prefill chunk, later
chunk, decode step) built on the coordinator, and the readers by id (``has_request``,
``page_ids``, ``tail_available``, ``pages_needed``, ``loads_in_flight``, ``block_tables``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from flat_kvcache.reference.engine._args import (
    U64_MAX,
    RequestId,
    as_content_hashes,
    as_count,
    as_counts,
    as_flag,
    as_request_id,
    as_request_ids,
    check_u64_total,
    shown_id,
)
from flat_kvcache.reference.engine.calls.tables import BlockTables
from flat_kvcache.reference.engine.coordinator import PrefixMatch
from flat_kvcache.reference.engine.table import Table

__all__ = ["PageApi", "PageTables"]


class PageTables(BlockTables):
    """What both protocols share on top of the coordinator: releasing and reclaiming a
    request's pages, counting the pages an acquire needs, and writing block tables."""

    def _reclaim(self, tables: list[Table], computed: int) -> None:
        """:meth:`reclaim` on a request's tables and a checked count."""
        for manager, table in zip(self._managers, tables, strict=True):
            manager.reclaim(table, computed, self._eviction_order)
        self._store_released()

    def _release(self, key: RequestId) -> None:
        """:meth:`free` of a live request of either kind."""
        tables = self._requests[key]
        if self._eviction_order == "group":
            for manager, table in zip(self._managers, tables, strict=True):
                manager.free(table)  # tail first, as vLLM frees a request's table
        else:
            ordered = sorted(
                (-(slot + 1) * manager.page_size, manager.index, page)
                for manager, table in zip(self._managers, tables, strict=True)
                for slot, page in enumerate(table.pages)
                if page != 0
            )
            # BlockPool.free releases in reverse list order: reverse to release in ``ordered``.
            self._pool.free([page for _, _, page in reversed(ordered)])
        self._free_slot(key)
        self._store_released()
        del self._requests[key]
        self._token_states.pop(key, None)
        self._reserves.pop(key, None)
        self._loading.pop(key, None)

    # -- admission helpers (SPEC 7, 9) ----------------------------------------------------------

    def _pages_needed(self, tables: list[Table] | None, count: int) -> int:
        """Pages an acquire of ``count`` tokens on ``tables`` would allocate (None: fresh tables)."""
        if tables is None:
            tables = [Table() for _ in self._managers]
        # Each group's pages times its arena credit (1 without an arena), saturating at u64 as
        # the native product does; the sum is a checked u64 there.
        needed = sum(
            min(m.blocks_needed_for(t, count) * self._pool.page_cost(m.index), U64_MAX)
            for m, t in zip(self._managers, tables, strict=True)
        )
        return check_u64_total(needed, "num_tokens")


class PageApi(PageTables):
    """The page-level protocol (``PageCache``, docs/engine-api.md): the caller keeps each
    request's state, names it by id and brings the content hashes."""

    # -- reading requests by id -----------------------------------------------------------------

    def has_request(self, req: RequestId) -> bool:
        return as_request_id(req) in self._requests

    def pages_needed(self, num_tokens: int, req: RequestId | None = None) -> int:
        """Pages ``acquire(req, num_tokens)`` would allocate (fresh tables when ``req`` is None)."""
        count = as_count(num_tokens, "num_tokens")
        tables = None if req is None else self._tables(req)
        return self._pages_needed(tables, count)

    def page_ids(self, req: RequestId) -> list[list[int]]:
        """Each group's table of the request (0 = hole)."""
        return [self._view_ids(g, table.pages) for g, table in enumerate(self._tables(req))]

    def tail_available(self, req: RequestId) -> list[int]:
        """Each group's free token slots in the request's last page."""
        return [table.tail_avail for table in self._tables(req)]

    def loads_in_flight(self, req: RequestId) -> int:
        """Host-tier loads of ``req`` not acknowledged yet (0: it can be scheduled)."""
        key = as_request_id(req)
        self._tables(key)
        return self._loading.get(key, 0)

    def block_tables(self, reqs: Sequence[RequestId], out: Any = None) -> Any:
        """Flat per-group block tables of the requests ``reqs`` (SPEC 8): ``{group_id: int32
        [len(reqs), cols]}``, or written into ``out`` (see
        :meth:`~flat_kvcache.reference.engine.calls.tables.BlockTables._block_tables`)."""
        self._check_flat_build()
        keys = as_request_ids(reqs)
        return self._block_tables(
            lambda: [self._tables(key) for key in keys],
            lambda row: f"request {shown_id(keys[row])}",
            out,
        )

    # -- SPEC 7: across groups ------------------------------------------------------------------

    def match_prefix(self, content_hashes: Sequence[str | bytes]) -> PrefixMatch:
        """Hybrid prefix match (SPEC 7), read-only: no count, order or key changes.

        ``bound = align_down(len * base, lcm)``. Sweep: match each group in match order up to
        the bound, then lower the bound to that group's extent (aligned down to lcm). Converge:
        re-match every non-closed group whose extent exceeds the bound until none does (a
        sliding group's answer at a lower bound is not a prefix of its answer at a higher one).
        Finally truncate every group to the bound. With caching off the match is empty.
        """
        hashes = as_content_hashes(content_hashes)
        bound, pages, matched_keys, _ = self._match(hashes, tiered=False)
        hits = [sum(1 for page in group_pages if page != 0) for group_pages in pages]
        return PrefixMatch(bound, pages, hits, matched_keys)

    def claim(self, req: RequestId, match: PrefixMatch) -> None:
        """Take a reference on every matched page; each group's table becomes the match (SPEC 7).

        Holes stay holes; ``tail_avail`` is 0 (the match ends on whole pages). ValueError, with
        nothing changed (the request is not created either), if the request's tables already
        hold pages, if the match has the wrong number of groups, or if the match is stale: a
        matched page no longer holds the very key it was matched under (it was evicted, and
        maybe re-cached under another key or for another group; taking it would put one page
        in two groups). A match built by hand remembers no keys: each real page must then hold
        a key of the group it is claimed for.
        """
        key = as_request_id(req)
        self._claim("claim", key, self._check_match(match))

    def acquire(self, req: RequestId, num_tokens: int) -> bool:
        """Room for ``num_tokens`` more tokens in every group, all or nothing (SPEC 7).

        Check-then-act: if the pages needed over all groups exceed the free pages, return
        False and allocate nothing anywhere. Otherwise groups allocate in index order, so page
        ids are deterministic. A token-level request is a ValueError.
        """
        key = as_request_id(req)
        count = as_count(num_tokens, "num_tokens")
        self._check_page_level("acquire", key)
        return self._acquire(self._tables_or_new(key), count)

    def acquire_pages(self, req: RequestId, num_tokens: int) -> list[list[int]] | None:
        """:meth:`acquire`, answering what it appended: per group, the page ids (0 = hole) of
        the slots past the table's length before the call (``[]`` where it did not grow), as
        :meth:`page_ids` shows them; None (and no change) when the pool has too few free pages.

        A state group's working page that moves to the new last slot leaves a hole in its old
        slot, which is not repeated here (only the new slots are).
        """
        key = as_request_id(req)
        count = as_count(num_tokens, "num_tokens")
        self._check_page_level("acquire_pages", key)
        tables = self._tables_or_new(key)
        before = [len(table.pages) for table in tables]
        if not self._acquire(tables, count):
            return None
        return [
            self._view_ids(g, table.pages[length:])
            for g, (table, length) in enumerate(zip(tables, before, strict=True))
        ]

    def register(
        self,
        req: RequestId,
        content_hashes: Sequence[str | bytes],
        *,
        first_slot: int = 0,
        end_tokens: int | None = None,
        groups: Sequence[int] | None = None,
    ) -> None:
        """Give the request's full pages their cache keys (SPEC 7; nothing when caching is off).

        ``content_hashes[j]`` is base page ``first_slot + j``. Each group folds them into keys
        for its slots from ``ceil(first_slot / m_g)``. History groups register every key; state
        groups only the last, and only when ``end_tokens`` is a multiple of their page size and
        the hashes end exactly there (SPEC 6). ``groups`` (group indices, each once) limits the
        registration to those groups; the others register nothing. Ranges are checked for every
        registering group first. A token-level request is a ValueError (its pages are
        registered as it is scheduled).
        """
        key = as_request_id(req)
        hashes = as_content_hashes(content_hashes)
        first = as_count(first_slot, "first_slot")
        end = None if end_tokens is None else as_count(end_tokens, "end_tokens")
        only = None if groups is None else self._group_indices(as_counts(groups, "groups"))
        tables = self._tables(key)
        self._check_page_level("register", key)
        self._register(tables, hashes, first, end, None, only)

    def _group_indices(self, groups: list[int]) -> list[int]:
        """``groups`` checked against this cache's group count: each below it, none twice."""
        n = len(self._specs)
        for i, g in enumerate(groups):
            if g >= n:
                raise ValueError(f"groups[{i}] = {g} is no group of this cache (it has {n}: 0 to {n - 1})")
            if g in groups[:i]:
                raise ValueError(f"groups[{i}] = {g} is listed twice")
        return groups

    def reclaim(self, req: RequestId, num_computed_tokens: int) -> None:
        """Free every page that slid out of its group's window, per group in index order (SPEC 6).

        A token-level request is a ValueError (``schedule`` reclaims its pages)."""
        key = as_request_id(req)
        computed = as_count(num_computed_tokens, "num_computed_tokens")
        tables = self._tables(key)
        self._check_page_level("reclaim", key)
        self._reclaim(tables, computed)

    def free(self, req: RequestId) -> None:
        """Release every page of the request and forget it (SPEC 7), in the eviction order.

        ``"hybrid"`` (the default, SPEC 12.3): all groups' real pages by the end token of their
        slot, descending (ties: lower group index first), so the chain's tail is evicted first
        in every group together and a hybrid prefix keeps all its groups equally long.
        ``"group"`` (the reference design): each group's table tail first, group 0 first, in
        vLLM's release order (uncached pages to the front as one run, tail first:
        ``release_newest_first``).
        The first page released is the first evicted. A token-level request is a ValueError
        (``finish`` or ``preempt`` end it).
        """
        self._tables(req)
        self._check_page_level("free", as_request_id(req))
        self._release(as_request_id(req))

    # -- admission helpers (SPEC 7, 9) ----------------------------------------------------------

    def pages_reclaimable(
        self, req: RequestId, num_computed_tokens: int, *, count_uncached: bool = True
    ) -> int:
        """Pages ``reclaim(req, num_computed_tokens)`` would put back on the free list."""
        key = as_request_id(req)
        computed = as_count(num_computed_tokens, "num_computed_tokens")
        uncached = as_flag(count_uncached, "count_uncached")
        tables = self._tables(key)
        return sum(
            m.blocks_reclaimable_at(t, computed, uncached)
            for m, t in zip(self._managers, tables, strict=True)
        )

    def pages_consumed_by_claim(self, match: PrefixMatch) -> int:
        """Free pages a claim of ``match`` takes off the free list: distinct real pages, count 0."""
        checked = self._check_match(match)
        distinct = {page for pages in checked.pages for page in pages if page != 0}
        return sum(1 for page in distinct if self._pool.ref_count(page) == 0)

    # -- SPEC 8: step operations ----------------------------------------------------------------

    def prefill_first_chunk(self, req: RequestId, match: PrefixMatch, num_tokens: int) -> bool:
        """Claim the match, then acquire the chunk's tokens (SPEC 8).

        On False the claim stays; the caller frees the request.
        """
        key = as_request_id(req)
        checked = self._check_match(match)
        count = as_count(num_tokens, "num_tokens")
        self._claim("prefill_first_chunk", key, checked)
        return self._acquire(self._requests[key], count)

    def prefill_chunk(
        self, req: RequestId, content_hashes: Sequence[str | bytes], num_tokens: int, num_computed_tokens: int
    ) -> bool:
        """A later prefill chunk (SPEC 8): register, THEN reclaim, THEN acquire.

        ``content_hashes`` start at base page 0 and are cut to the ``computed // base`` pages
        already computed. Registering first keeps the hashes of pages about to slide out
        (registration skips holes); reclaimed pages fund this step's acquire.
        """
        key = as_request_id(req)
        hashes = as_content_hashes(content_hashes)
        count = as_count(num_tokens, "num_tokens")
        computed = as_count(num_computed_tokens, "num_computed_tokens")
        tables = self._tables(key)
        self._check_page_level("prefill_chunk", key)
        cut = hashes[: computed // self._base]
        return self._step(tables, cut, 0, count, computed)

    def _step(self, tables: list[Table], hashes: list[str], first: int, count: int, computed: int) -> bool:
        """Register ``hashes`` from base page ``first``, THEN reclaim at ``computed``, THEN
        acquire ``count`` tokens (arguments checked, the request page-level)."""
        self._register(tables, hashes, first, computed, None)
        self._reclaim(tables, computed)
        return self._acquire(tables, count)

    def decode_step(
        self,
        req: RequestId,
        content_hashes: Sequence[str | bytes],
        first_page_slot: int,
        num_tokens: int,
        num_computed_tokens: int,
    ) -> bool:
        """A decode step (SPEC 8): register, THEN reclaim, THEN acquire.

        ``content_hashes`` start at base page ``first_page_slot`` and are cut so that they end
        at or before base page ``computed // base``.
        """
        key = as_request_id(req)
        hashes = as_content_hashes(content_hashes)
        first = as_count(first_page_slot, "first_page_slot")
        count = as_count(num_tokens, "num_tokens")
        computed = as_count(num_computed_tokens, "num_computed_tokens")
        tables = self._tables(key)
        self._check_page_level("decode_step", key)
        cut = hashes[: max(0, computed // self._base - first)]
        return self._step(tables, cut, first, count, computed)
