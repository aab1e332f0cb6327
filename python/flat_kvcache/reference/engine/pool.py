"""The page pool with prefix caching (SPEC 5): one page-id space shared by every group."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence

from flat_kvcache.reference._checks import as_int
from flat_kvcache.reference.engine._args import INTS, as_count, as_flag, as_pool_size, batch_items

__all__ = ["DEFAULT_REUSE_UNCACHED_FIRST", "BlockPool"]

#: Whether a pool reuses released uncached pages first unless told otherwise.
DEFAULT_REUSE_UNCACHED_FIRST = True


class BlockPool:
    """One page-id space shared by all groups, with reference counts and prefix caching (SPEC 5).

    Page 0 is the null page: never free, never cached, never counted. The free list is the
    eviction order: allocation takes from its front, a page whose count drops to 0 goes to its
    back with its key intact (it stays prefix-reusable), and a prefix hit removes a free page
    from the middle. With ``reuse_uncached_first``, a page that drops to 0 holding no key goes
    to the front instead (it is handed out before any cached page). An ``OrderedDict`` keyed by
    page id gives all of these in O(1).
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
        self._ref_counts = [0] * total
        # The key each page holds (None: not cached), and each key's pages in registration order.
        self._key_of: list[str | None] = [None] * total
        self._pages_by_key: dict[str, list[int]] = {}
        # Free list, front = next to allocate = least recently freed. Values are unused.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, total))
        # Keys dropped because their page was handed out again (the ``evictions`` metric), and,
        # while the owning cache records KV events, those keys in eviction order.
        self._evictions = 0
        self._record_evictions = False
        self._evicted: list[str] = []
        # While the owning cache has a store-on-eviction host tier: cached pages whose count
        # dropped to 0, in release order.
        self._record_released = False
        self._released: list[int] = []

    # -- probes ---------------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        """Total pages, the null page included."""
        return self._num_blocks

    @property
    def num_free(self) -> int:
        """Length of the free list (the null page is never counted)."""
        return len(self._free)

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

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` pages from the front of the free list, all or nothing (SPEC 5).

        Fewer than ``n`` free pages returns ``[]`` and changes nothing. A cached page taken
        here loses its key. New pages have count 1.
        """
        count = as_count(n, "n")
        if count == 0 or count > len(self._free):
            return []
        pages = []
        for _ in range(count):
            page, _unused = self._free.popitem(last=False)
            self._evict(page)
            self._ref_counts[page] = 1
            pages.append(page)
        return pages

    def touch(self, page: int) -> None:
        """Take one more reference on ``page``; a free page leaves the free list. Page 0: no-op."""
        index = self._page(page)
        if index == 0:
            return
        if self._ref_counts[index] == 0:
            del self._free[index]
        self._ref_counts[index] += 1

    def free(self, pages: Sequence[int]) -> None:
        """Release one reference per entry, in REVERSE order of ``pages`` (SPEC 5).

        A chain's tail is released, hence evicted, before its head; a page that drops to 0
        joins the back of the free list, or the front when it holds no key and the pool reuses
        uncached pages first (so such pages end up in list order). Entries equal to 0 are
        skipped. Everything is validated first: a page out of range, or one released more
        times than it is referenced (repeats counted), raises ValueError and changes nothing.
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
                self._free[page] = None  # to the back, key kept
                if self._record_released and self._key_of[page] is not None:
                    self._released.append(page)
                if self._reuse_uncached_first and self._key_of[page] is None:
                    self._free.move_to_end(page, last=False)

    def cache(self, page: int, key: str) -> None:
        """Register ``page`` under ``key`` (SPEC 5). No-op when caching is off or page is 0.

        A page that already holds a key is an error. A key may map to several pages; they are
        never de-duplicated, so page ids already handed out stay valid.
        """
        index = self._page(page)
        if not isinstance(key, str):
            raise TypeError(f"key must be a str, got {type(key).__name__}")
        key.encode("utf-8")  # keys are UTF-8 text: a lone surrogate is a UnicodeEncodeError
        if not self._enable_caching or index == 0:
            return
        if self._key_of[index] is not None:
            raise ValueError(f"page {index} already holds a key")
        self._key_of[index] = key
        self._pages_by_key.setdefault(key, []).append(index)

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

    def _evict(self, page: int) -> None:
        """Drop ``page``'s key, if it holds one (it leaves that key's page list)."""
        key = self._drop_key(page)
        if key is None:
            return
        self._evictions += 1
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

    def _take_evicted(self) -> list[str]:
        """The keys evicted since the last call, in eviction order (recorded only when asked)."""
        evicted, self._evicted = self._evicted, []
        return evicted

    def _clear_cached_free(self) -> list[str]:
        """Drop the key of every free cached page (they stay free, in place); not evictions.

        Returns the dropped keys in free-list order."""
        dropped = []
        for page in self._free:
            key = self._drop_key(page)
            if key is not None:
                dropped.append(key)
        return dropped

    def _cached_pages(self) -> Iterator[int]:
        for pages in self._pages_by_key.values():
            yield from pages

    def _free_list(self) -> list[int]:
        """The free list, front first (for invariant checks)."""
        return list(self._free)

    def _key_map(self) -> dict[str, list[int]]:
        """A copy of the key -> pages map (for invariant checks)."""
        return {key: list(pages) for key, pages in self._pages_by_key.items()}

    def _key_held_by(self, page: int) -> str | None:
        return self._key_of[page]
