"""Sliding-window groups (SPEC 6): only the last ``W - 1`` tokens matter, older pages become holes."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from flat_kvcache._types import KVCacheSpec
from flat_kvcache.reference._checks import ceil_div
from flat_kvcache.reference.engine.group.base import GroupManager, release_newest_first
from flat_kvcache.reference.engine.pool import BlockPool
from flat_kvcache.reference.engine.table import Table

__all__ = ["SlidingWindowManager"]


class SlidingWindowManager(GroupManager):
    """Sliding window attention with window ``W`` tokens (SPEC 6): not prefix-closed.

    To resume at a boundary only the last ``W - 1`` tokens before it must be cached, that is
    ``ceil((W-1)/P)`` pages; everything further left may be a hole.
    """

    def __init__(self, index: int, spec: KVCacheSpec, base_page_size: int, pool: BlockPool) -> None:
        super().__init__(index, spec, base_page_size, pool)
        self.window = self.window_of(spec)

    @staticmethod
    def window_of(spec: KVCacheSpec) -> int:
        """The window ``W`` in tokens: the spec's own (``KVCacheSpec`` checked it is >= 1)."""
        assert spec.sliding_window is not None, "a sliding_window spec always has a window"
        return spec.sliding_window

    def match(self, keys: Sequence[str], lookup: Callable[[str], int | None] | None = None) -> list[int]:
        """Right-to-left scan for the greatest boundary backed by ``ceil((W-1)/P)`` hits.

        Boundary ``b = end``, ``run = 0``; for ``i = end-1 .. 0``: stop once ``run`` hits are
        enough; a hit extends the run; a miss moves the boundary to ``i`` and resets the run.
        A run that reaches slot 0 is accepted even if shorter. The result has length ``b``:
        slots ``[b-run, b)`` are the hits, the slots left of them are holes (W == 1 needs no
        hits: every slot is a hole).
        """
        find = self.pool.lookup if lookup is None else lookup
        needed = ceil_div(self.window - 1, self.page_size)
        boundary = len(keys)
        run: list[int] = []  # hit pages right to left, just behind the boundary
        for slot in range(len(keys) - 1, -1, -1):
            if len(run) >= needed:
                break
            page = find(keys[slot])
            if page is None:
                boundary = slot
                run = []
            else:
                run.append(page)
        holes = [0] * (boundary - len(run))
        return holes + run[::-1]

    def _slid_out_slots(self, table: Table, num_computed_tokens: int) -> int:
        """``k``: slots ``[0, k)`` hold only tokens before ``n - W + 1``, outside every future window."""
        first_kept_token = num_computed_tokens - self.window + 1
        if first_kept_token <= 0:
            return 0
        return min(first_kept_token // self.page_size, len(table.pages))

    def reclaim(self, table: Table, num_computed_tokens: int, order: str) -> None:
        """Replace every real page in the slid-out slots by a hole and free them (SPEC 6, 12.2).

        Holes in the middle do not stop the scan (the reference design stopped at the first
        hole and leaked the pages below it). Under the ``"hybrid"`` eviction order pages are
        released lowest slot first, so the oldest page is evicted first (``BlockPool.free``
        releases in reverse list order, hence the reversed list); under ``"group"`` they are
        released as vLLM's sliding-window manager frees them (:func:`release_newest_first`).
        """
        collected = []
        for slot in range(self._slid_out_slots(table, num_computed_tokens)):
            page = table.pages[slot]
            if page != 0:
                collected.append(page)
                table.pages[slot] = 0
        if order == "group":
            release_newest_first(self.pool, collected)
        else:
            self.pool.free(collected[::-1])

    def blocks_reclaimable_at(self, table: Table, num_computed_tokens: int, count_uncached: bool) -> int:
        """Slid-out real pages whose last reference is this table (only hashed ones unless
        ``count_uncached``): exactly the pages :meth:`reclaim` returns to the free list."""
        count = 0
        for slot in range(self._slid_out_slots(table, num_computed_tokens)):
            page = table.pages[slot]
            if page == 0 or self.pool.ref_count(page) != 1:
                continue
            if count_uncached or self.pool.is_cached(page):
                count += 1
        return count
