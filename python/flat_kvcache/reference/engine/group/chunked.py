"""Chunked local attention groups (SPEC 6): a token attends only the tokens of its own chunk.

The token at position ``t`` attends ``[t - t % C, t]`` (Llama 4's local layers). ``C`` is a
multiple of the page size ``P``, so chunks start on page boundaries and a chunk is
``K = C / P`` slots.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from flat_kvcache._types import KVCacheSpec
from flat_kvcache.reference.engine.group.base import GroupManager, release_newest_first
from flat_kvcache.reference.engine.pool import BlockPool
from flat_kvcache.reference.engine.table import Table

__all__ = ["ChunkedLocalManager"]


class ChunkedLocalManager(GroupManager):
    """Chunked local attention with chunk ``C`` tokens (SPEC 6): not prefix-closed.

    A boundary at slot ``e`` can be resumed from only if every slot of its chunk before it,
    ``[floor(e / K) * K, e)``, is cached (a boundary on a chunk start needs none); the pages
    of finished chunks are released by reclaim. Every complete page is registered, as full
    attention does.
    """

    def __init__(self, index: int, spec: KVCacheSpec, base_page_size: int, pool: BlockPool) -> None:
        super().__init__(index, spec, base_page_size, pool)
        assert spec.chunk_size is not None, "a chunked_local spec always has a chunk"
        #: The chunk ``C`` in tokens (a positive multiple of the page size).
        self.chunk = spec.chunk_size
        #: ``K``: slots per chunk.
        self.slots_per_chunk = spec.chunk_size // spec.page_size

    def match(self, keys: Sequence[str], lookup: Callable[[str], int | None] | None = None) -> list[int]:
        """Right-to-left scan for the greatest boundary whose chunk is cached up to it.

        Boundary ``b = end``; check the slots ``[b - b % K, b)`` from right to left. A miss at
        slot ``i`` moves the boundary to ``i`` and the check restarts from that boundary's own
        chunk start; a check with no miss accepts ``b``. The result has length ``b``: the
        checked slots are the hits, every slot left of them is a hole.
        """
        find = self.pool.lookup if lookup is None else lookup
        per_chunk = max(self.slots_per_chunk, 1)
        boundary = len(keys)
        while True:
            start = boundary - boundary % per_chunk
            run: list[int] = []  # hit pages right to left, just behind the boundary
            missed = None
            for slot in range(boundary - 1, start - 1, -1):
                page = find(keys[slot])
                if page is None:
                    missed = slot
                    break
                run.append(page)
            if missed is None:
                break
            boundary = missed
        return [0] * (boundary - len(run)) + run[::-1]

    def _finished_chunk_slots(self, table: Table, num_computed_tokens: int) -> int:
        """``k = min(floor(n / C) * K, len)``: slots ``[0, k)`` hold only tokens of finished
        chunks, which no later token attends."""
        finished = num_computed_tokens // self.chunk
        return min(finished * self.slots_per_chunk, len(table.pages))

    def reclaim(self, table: Table, num_computed_tokens: int, order: str) -> None:
        """Replace every real page of the finished chunks by a hole and free them, in the order a
        sliding window's reclaim uses: lowest slot first under ``"hybrid"`` (``BlockPool.free``
        releases in reverse list order, hence the reversed list), newest first as vLLM frees
        them under ``"group"`` (:func:`release_newest_first`)."""
        collected = []
        for slot in range(self._finished_chunk_slots(table, num_computed_tokens)):
            page = table.pages[slot]
            if page != 0:
                collected.append(page)
                table.pages[slot] = 0
        if order == "group":
            release_newest_first(self.pool, collected)
        else:
            self.pool.free(collected[::-1])

    def blocks_reclaimable_at(self, table: Table, num_computed_tokens: int, count_uncached: bool) -> int:
        """Real pages of finished chunks whose last reference is this table (only hashed ones
        unless ``count_uncached``): exactly the pages :meth:`reclaim` returns to the free list."""
        count = 0
        for slot in range(self._finished_chunk_slots(table, num_computed_tokens)):
            page = table.pages[slot]
            if page == 0 or self.pool.ref_count(page) != 1:
                continue
            if count_uncached or self.pool.is_cached(page):
                count += 1
        return count
