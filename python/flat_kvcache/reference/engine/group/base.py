"""What every group kind shares (SPEC 6): acquiring room, its dry run, and registering keys.

A manager holds no per-request state: the request's :class:`Table` is passed to every call.
The kind-specific rules (how a group matches, what it reclaims, which keys it registers) live
in the kind's own module and override the defaults here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from flat_kvcache._types import KVCacheSpec
from flat_kvcache.reference._checks import ceil_div
from flat_kvcache.reference.engine.pool import BlockPool
from flat_kvcache.reference.engine.table import Table

__all__ = ["GroupManager", "release_newest_first"]


def release_newest_first(pool: BlockPool, pages: Sequence[int]) -> None:
    """Release the real pages of ``pages`` (in slot order) as vLLM's ``BlockPool.free_blocks``
    frees them newest (highest slot) first: the ``"group"`` eviction order of ``free`` and
    ``reclaim``.

    vLLM appends the cached pages to the free list in that order and puts the uncached ones at
    its front as one run in that same order (the highest slot is handed out first). Here a
    page that drops to 0 joins the back when it holds a key and the front when it holds none
    (with ``reuse_uncached_first``), one at a time, so the pages holding a key are released
    highest slot first, then those holding none lowest slot first. Without
    ``reuse_uncached_first`` every page joins the back and all are released highest slot first.
    """
    real = [page for page in pages if page != 0]
    if pool._reuse_uncached_first:
        uncached = [page for page in real if not pool.is_cached(page)]
        cached = [page for page in real if pool.is_cached(page)]
    else:
        uncached, cached = [], real
    # ``BlockPool.free`` releases in reverse list order: the cached pages highest slot first,
    # then the uncached ones lowest slot first.
    pool.free(uncached[::-1] + cached)


class GroupManager:
    """What every group kind shares (SPEC 6): acquire and its dry run, and table registration."""

    #: Full attention is prefix-closed; the windowed kinds are not (SPEC 6).
    prefix_closed = False

    def __init__(self, index: int, spec: KVCacheSpec, base_page_size: int, pool: BlockPool) -> None:
        self.index = index
        self.page_size = spec.page_size
        #: Base pages per page of this group (``m_g`` of SPEC 4).
        self.fold = spec.page_size // base_page_size
        self.pool = pool

    #: Whether the group keeps only the state after a range's last token (SPEC 13.4): its
    #: acquire allocates the page of the last new slot only and leaves the slots before it holes.
    sparse = False

    #: Whether a sparse table's unkeyed working page moves to the slot an acquire adds (the
    #: default) or a fresh page is always taken there, the previous one staying in its slot until
    #: reclaim releases it (the cache option ``move_state_pages=False``: vLLM's mamba "align").
    moves_working_page = True

    def blocks_needed_for(self, table: Table, num_tokens: int) -> int:
        """Exact dry run of :meth:`acquire`: pages it would allocate."""
        if num_tokens <= table.tail_avail:
            return 0
        if self.sparse:
            return 0 if self.working_page_moves(table) else 1
        return ceil_div(num_tokens - table.tail_avail, self.page_size)

    def working_page_moves(self, table: Table) -> bool:
        """A sparse (state) table's working page moves to the next slot it needs, rather than a
        page being allocated there, when its last page is real and holds no key: no checkpoint,
        and no other request holds it (SPEC 13.4); never with ``move_state_pages=False``."""
        return (
            self.sparse
            and self.moves_working_page
            and bool(table.pages)
            and table.pages[-1] != 0
            and not self.pool.is_cached(table.pages[-1])
        )

    def acquire(self, table: Table, num_tokens: int) -> bool:
        """Room for ``num_tokens`` more tokens: the tail first, then new pages, all or nothing.

        After allocating for ``over = n - tail_avail`` tokens the new tail has
        ``0 if over % P == 0 else P - over % P`` free slots. Pages come from this group's own
        pages (the arena's units bound to it, SPEC 13.2) when the pool is an arena.
        """
        if num_tokens <= 0:
            return True
        if num_tokens <= table.tail_avail:
            table.tail_avail -= num_tokens
            return True
        over = num_tokens - table.tail_avail
        count = ceil_div(over, self.page_size)
        if self.working_page_moves(table):
            pages = [table.pages[-1]]
            table.pages[-1] = 0  # the slot it leaves is a hole
        else:
            pages = self.pool.allocate(1 if self.sparse else count, group=self.index)
        if not pages:
            return False
        if self.sparse:
            table.pages.extend([0] * (count - 1))
        table.pages.extend(pages)
        table.tail_avail = 0 if over % self.page_size == 0 else self.page_size - over % self.page_size
        return True

    def check_register_range(self, table: Table, keys: Sequence[str], first_slot: int) -> None:
        """A registration range past the end of the table is an error (SPEC 6)."""
        if first_slot + len(keys) > len(table.pages):
            raise ValueError(
                f"register: slots [{first_slot}, {first_slot + len(keys)}) of group {self.index} "
                f"run past its table of {len(table.pages)} pages"
            )

    def register(self, table: Table, keys: Sequence[str], first_slot: int) -> list[tuple[int, str]]:
        """Slot ``first_slot + j`` gets ``keys[j]`` (SPEC 6); returns the ``(slot, key)`` pairs
        newly cached, in slot order (for KV events).

        Holes and pages that already hold a key are skipped (so registering twice is harmless);
        the last page is skipped while it still has free slots (a partial page has no hash).
        """
        self.check_register_range(table, keys, first_slot)
        last_slot = len(table.pages) - 1
        stored = []
        for offset, key in enumerate(keys):
            slot = first_slot + offset
            page = table.pages[slot]
            if page == 0 or self.pool.is_cached(page):
                continue
            if slot == last_slot and table.tail_avail > 0:
                continue
            self.pool.cache(page, key)
            stored.append((slot, key))
        return stored

    def keys_to_register(
        self, keys: list[str], first_slot: int, hashed_end: int, end_tokens: int | None
    ) -> tuple[list[str], int] | None:
        """Which of this group's keys a coordinator ``register`` writes, and from which slot.

        ``hashed_end`` is the token where the hashed range ends. History groups write every
        key; the state manager overrides this.
        """
        return keys, first_slot

    def match(self, keys: Sequence[str], lookup: Callable[[str], int | None] | None = None) -> list[int]:
        """Prefix-match one group over the slots of ``keys``; 0 marks a hole.

        ``lookup`` answers a key with a page (default: the pool's); the host tier passes one
        that answers device-or-host."""
        raise NotImplementedError

    def reclaim(self, table: Table, num_computed_tokens: int, order: str) -> None:
        """Free the pages that slid out of the window, in the cache's eviction ``order``; full
        attention keeps everything."""

    def free(self, table: Table) -> None:
        """Release every page of the table tail first as vLLM frees a request's table
        (:func:`release_newest_first`, the ``"group"`` eviction order); the caller forgets it."""
        release_newest_first(self.pool, table.pages)

    def blocks_reclaimable_at(self, table: Table, num_computed_tokens: int, count_uncached: bool) -> int:
        """Exact dry run of :meth:`reclaim`: pages it would put back on the free list."""
        return 0
