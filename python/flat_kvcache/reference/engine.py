"""Pure-Python reference of the page engine: SPEC sections 4 to 8, contract ``docs/engine-api.md``.

Written to be read next to the SPEC, not to be fast. Each rule lives in one place:

- content hashes, group keys and folding (SPEC 4): :func:`hash_page`, :func:`hash_pages`,
  :func:`group_key`, :func:`fold_hashes`;
- the page pool with prefix caching (SPEC 5): :class:`BlockPool`;
- per-request tables and the three managers (SPEC 6): ``_Table``, ``_FullAttentionManager``,
  ``_SlidingWindowManager``, ``_StateManager``;
- the coordinator, the step operations and the flat block tables (SPEC 7 and 8):
  :class:`FlatKVCache`.

The only native thing it reads is the build flag ``flat_kvcache._native.FLAT_KVCACHE``, looked
up at call time (see ``_flat_build_enabled``) so tests can switch it.
"""

from __future__ import annotations

import hashlib
import math
import operator
import string
import struct
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from flat_kvcache._types import FULL_HISTORY, SLIDING_WINDOW, STATE, PagedCacheGroupSpec
from flat_kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent

__all__ = [
    "BlockPool",
    "FlatKVCache",
    "KVCacheSpec",
    "PrefixMatch",
    "fold_hashes",
    "group_key",
    "hash_page",
    "hash_pages",
    "kv_cache_specs",
]

#: Largest value of a little-endian u32 field of the hash input (SPEC 4).
_U32_MAX = 0xFFFF_FFFF
#: Largest page-size lcm the native engine can hold (it counts tokens in u64).
_U64_MAX = 0xFFFF_FFFF_FFFF_FFFF
#: Most pages a pool may hold: block tables carry page ids as int32 (SPEC 8).
_MAX_PAGES = 2**31 - 1
#: How ``FlatKVCache.free`` orders a request's pages on the free list (docs/requests-api.md).
_EVICTION_ORDERS = ("hybrid", "group")
#: Length of a hex-encoded SHA-256 content hash.
_HASH_HEX_LEN = 64
_HEX_DIGITS = frozenset(string.hexdigits)
#: Content hashes are lowercase: folding hashes their text, so "AB" and "ab" would fold apart.
_LOWER_HEX_DIGITS = frozenset("0123456789abcdef")

#: A request id: ``5`` and ``"5"`` are different requests.
RequestId = str | int
#: Token ids: a sequence of ints or a 1-D numpy integer array.
TokenIds = Sequence[int] | npt.NDArray[np.integer[Any]]

_FLAT_OFF_MESSAGE = (
    "flat per-group block tables are unavailable: this build of flat_kvcache was compiled "
    "without the `flat` cargo feature"
)


def _flat_build_enabled() -> bool:
    """The native build flag, read at call time (SPEC 10); False if the native module is missing."""
    try:
        from flat_kvcache import _native
    except ImportError:
        return False
    return bool(_native.FLAT_KVCACHE)


# ----------------------------------------------------------------------------------------------
# Argument checks shared by every public entry point.
# ----------------------------------------------------------------------------------------------


def _as_int(value: object, name: str) -> int:
    """``value`` as a Python int (anything with ``__index__`` except bool), else TypeError naming
    ``name``. A bool is refused: ``True`` as a page, token or count is a bug, not a 1."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, not bool")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None


def _check_u64(value: int, name: str) -> int:
    """Token counts and sizes are u64 in the native engine: larger is an OverflowError naming it."""
    if value > _U64_MAX:
        raise OverflowError(f"{name}: value does not fit in an unsigned 64-bit integer")
    return value


def _count(value: object, name: str) -> int:
    """A count argument: an int >= 0 that fits u64 (TypeError / ValueError / OverflowError)."""
    number = _as_int(value, name)
    if number < 0:
        raise ValueError(f"{name} must be >= 0, got {number}")
    return _check_u64(number, name)


def _positive(value: object, name: str) -> int:
    """A size argument: an int > 0 (TypeError / ValueError naming ``name``)."""
    number = _as_int(value, name)
    if number <= 0:
        raise ValueError(f"{name} must be > 0, got {number}")
    return number


def _flag(value: object, name: str) -> bool:
    """A switch: a real bool (TypeError otherwise, as the native extraction does)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def _ceil_div(numerator: int, denominator: int) -> int:
    """Exact integer ``ceil(numerator / denominator)`` for a positive denominator."""
    return -(-numerator // denominator)


def _align_down(value: int, multiple: int) -> int:
    """``value`` rounded down to a multiple of ``multiple``."""
    return value - value % multiple


# ----------------------------------------------------------------------------------------------
# SPEC 4: content hashes and group keys.
# ----------------------------------------------------------------------------------------------


def _u32(value: int) -> bytes:
    """One little-endian u32 field of the hash input."""
    return struct.pack("<I", value)


def _token_values(tokens: object, name: str) -> list[int]:
    """Token ids as Python ints, each checked to fit u32 (ValueError names ``name[i]``)."""
    if isinstance(tokens, np.ndarray):
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise TypeError(f"{name} must be a 1-D integer array, got {tokens.ndim}-D {tokens.dtype}")
        items: list[object] = tokens.tolist()
    elif isinstance(tokens, (str, bytes)):
        raise TypeError(f"{name} must be a sequence of ints, got {type(tokens).__name__}")
    elif isinstance(tokens, Iterable):
        items = list(tokens)
    else:
        raise TypeError(f"{name} must be a sequence of ints, got {type(tokens).__name__}")
    values = []
    for index, item in enumerate(items):
        value = _as_int(item, f"{name}[{index}]")
        if not 0 <= value <= _U32_MAX:
            raise ValueError(f"{name}[{index}] = {value} does not fit in u32")
        values.append(value)
    return values


def _prior_bytes(prior: object) -> bytes:
    """The raw bytes of the previous hash: ``""`` or an even-length hex string (SPEC 4)."""
    if not isinstance(prior, str):
        raise TypeError(f"prior must be a str, got {type(prior).__name__}")
    if len(prior) % 2 != 0 or not set(prior) <= _HEX_DIGITS:
        raise ValueError(f"prior must be '' or a hex string of even length, got {prior!r}")
    return bytes.fromhex(prior)


def _extra_key_bytes(extra_keys: object) -> list[bytes]:
    """The UTF-8 bytes of each extra key; a bare str is refused (it is not a sequence of keys)."""
    if isinstance(extra_keys, str):
        raise TypeError("extra_keys must be a sequence of str, not a bare str")
    if not isinstance(extra_keys, Iterable):
        raise TypeError(f"extra_keys must be a sequence of str, got {type(extra_keys).__name__}")
    encoded = []
    for index, key in enumerate(extra_keys):
        if not isinstance(key, str):
            raise TypeError(f"extra_keys[{index}] must be a str, got {type(key).__name__}")
        encoded.append(key.encode("utf-8"))
    return encoded


def _sha256_page(prior_raw: bytes, tokens: Sequence[int], extra_keys: Sequence[bytes]) -> str:
    """SPEC 4 layout, little-endian u32 fields: prior length, prior bytes, token count, tokens,
    then (only with extra keys) their count and each key as (byte length, bytes)."""
    parts = [_u32(len(prior_raw)), prior_raw, _u32(len(tokens))]
    parts.extend(_u32(token) for token in tokens)
    if extra_keys:
        parts.append(_u32(len(extra_keys)))
        for key in extra_keys:
            parts.append(_u32(len(key)))
            parts.append(key)
    return hashlib.sha256(b"".join(parts)).hexdigest()


def hash_page(tokens: TokenIds, prior: str = "", extra_keys: Sequence[str] = ()) -> str:
    """Content hash of one page, chained on ``prior`` (SPEC 4): lowercase hex SHA-256.

    ``h_i = H(page_i tokens, h_{i-1}, extra_keys)`` with ``h_{-1} = ""``. Extra keys (LoRA
    adapter, cache salt, multimodal hashes) separate otherwise equal token pages.
    """
    prior_raw = _prior_bytes(prior)
    values = _token_values(tokens, "tokens")
    keys = _extra_key_bytes(extra_keys)
    return _sha256_page(prior_raw, values, keys)


def hash_pages(
    token_ids: TokenIds, page_size: int, *, prior: str = "", extra_keys: Sequence[str] = ()
) -> list[str]:
    """Chained content hashes of every full page of ``token_ids`` (SPEC 4); a partial tail is dropped.

    ``h_0 = hash_page(page_0, prior, extra_keys)``, ``h_i = hash_page(page_i, h_{i-1}, extra_keys)``.
    Every token is checked, including those of the dropped tail.
    """
    size = _check_u64(_positive(page_size, "page_size"), "page_size")
    prior_raw = _prior_bytes(prior)
    values = _token_values(token_ids, "token_ids")
    keys = _extra_key_bytes(extra_keys)
    hashes: list[str] = []
    for start in range(0, len(values) - size + 1, size):
        digest = _sha256_page(prior_raw, values[start : start + size], keys)
        hashes.append(digest)
        prior_raw = bytes.fromhex(digest)
    return hashes


def group_key(content_hash: str, group_index: int) -> str:
    """The cache key of a page of group ``group_index``: the hash then 8 hex digits (SPEC 4).

    The group never enters the hash chain, so every group of a model shares one chain.
    """
    if not isinstance(content_hash, str):
        raise TypeError(f"content_hash must be a str, got {type(content_hash).__name__}")
    index = _as_int(group_index, "group_index")
    if not 0 <= index <= _U32_MAX:
        raise ValueError(f"group_index = {index} does not fit in u32")
    return f"{content_hash}{index:08x}"


def fold_hashes(base_hashes: Sequence[str], first_base: int, m: int) -> list[str]:
    """Fold aligned runs of ``m`` base-page hashes into one hash per page of a group (SPEC 4).

    ``base_hashes[j]`` is base page ``first_base + j``. Folding starts at the first base page
    whose index is a multiple of ``m``; each complete run folds as ``run = ""`` then
    ``run = hash_page([], run, [h])`` per hash. Incomplete runs at either end are dropped.
    With ``m == 1`` the hashes are the keys (a copy is returned).
    """
    size = _check_u64(_positive(m, "m"), "m")
    first = _count(first_base, "first_base")
    hashes = list(base_hashes)
    for index, value in enumerate(hashes):
        if not isinstance(value, str):
            raise TypeError(f"base_hashes[{index}] must be a str, got {type(value).__name__}")
    if size == 1:
        return hashes
    # The first aligned base page is ceil(first / m) * m; skip the hashes before it.
    offset = _ceil_div(first, size) * size - first
    folded = []
    for start in range(offset, len(hashes) - size + 1, size):
        run = ""
        for base_hash in hashes[start : start + size]:
            run = hash_page([], run, [base_hash])
        folded.append(run)
    return folded


# ----------------------------------------------------------------------------------------------
# SPEC 5: the block pool.
# ----------------------------------------------------------------------------------------------


class BlockPool:
    """One page-id space shared by all groups, with reference counts and prefix caching (SPEC 5).

    Page 0 is the null page: never free, never cached, never counted. The free list is the
    eviction order: allocation takes from its front, a page whose count drops to 0 goes to its
    back with its key intact (it stays prefix-reusable), and a prefix hit removes a free page
    from the middle. An ``OrderedDict`` keyed by page id gives all three in O(1).
    """

    def __init__(self, num_blocks: int, *, enable_caching: bool = True) -> None:
        total = _check_u64(_as_int(num_blocks, "num_blocks"), "num_blocks")
        if total < 1:
            raise ValueError(f"num_blocks must be >= 1, got {total}")
        if total > _MAX_PAGES:
            raise ValueError(f"num_blocks must be <= {_MAX_PAGES} (page ids are int32), got {total}")
        self._num_blocks = total
        self._enable_caching = _flag(enable_caching, "enable_caching")
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
        count = _count(n, "n")
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

        A chain's tail is released, hence evicted, before its head. Entries equal to 0 are
        skipped. Everything is validated first: a page out of range, or one released more
        times than it is referenced (repeats counted), raises ValueError and changes nothing.
        """
        checked = [self._page(page) for page in pages]
        releases: dict[int, int] = {}
        for page in checked:
            if page == 0:
                continue
            releases[page] = releases.get(page, 0) + 1
            if releases[page] > self._ref_counts[page]:
                raise ValueError(
                    f"page {page} released {releases[page]} time(s) but its ref count is "
                    f"{self._ref_counts[page]}"
                )
        for page in reversed(checked):
            if page == 0:
                continue
            self._ref_counts[page] -= 1
            if self._ref_counts[page] == 0:
                self._free[page] = None  # to the back, key kept

    def cache(self, page: int, key: str) -> None:
        """Register ``page`` under ``key`` (SPEC 5). No-op when caching is off or page is 0.

        A page that already holds a key is an error. A key may map to several pages; they are
        never de-duplicated, so page ids already handed out stay valid.
        """
        index = self._page(page)
        if not isinstance(key, str):
            raise TypeError(f"key must be a str, got {type(key).__name__}")
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
        index = _as_int(page, "page")
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

    def _clear_cached_free(self) -> int:
        """Drop the key of every free cached page (they stay free, in place); not evictions."""
        dropped = 0
        for page in self._free:
            if self._drop_key(page) is not None:
                dropped += 1
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


# ----------------------------------------------------------------------------------------------
# Specs (contract "Specs").
# ----------------------------------------------------------------------------------------------

_KINDS = ("full", "sliding_window", "state")


@dataclass(frozen=True)
class KVCacheSpec:
    """One attention group as the page engine sees it: its kind, page size and window (SPEC 7).

    ``kind`` is ``"full"``, ``"sliding_window"`` or ``"state"``. ``sliding_window`` is an int
    >= 1 for a sliding group and None otherwise. ``group_id`` None means ``f"g{index}"``.
    """

    kind: str
    page_size: int
    sliding_window: int | None = None
    group_id: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"kind must be one of {', '.join(_KINDS)}; got {self.kind!r}")
        _positive(self.page_size, "page_size")
        if self.kind == "sliding_window":
            window = self.sliding_window
            if isinstance(window, bool) or not isinstance(window, int) or window < 1:
                raise ValueError(
                    f"sliding_window must be an int >= 1 for a sliding_window group, got {window!r}"
                )
        elif self.sliding_window is not None:
            raise ValueError(
                f"sliding_window must be None for a {self.kind} group, got {self.sliding_window!r}"
            )
        if self.group_id is not None and not isinstance(self.group_id, str):
            raise TypeError(f"group_id must be a str or None, got {type(self.group_id).__name__}")


def kv_cache_specs(
    group_specs: Iterable[PagedCacheGroupSpec], page_size: int | None = None
) -> list[KVCacheSpec]:
    """Engine specs from the sizing group specs (SPEC 2 -> SPEC 7).

    The page size defaults to each spec's ``rows_per_page * entry_stride_tokens``. Family
    ``state`` with retention ``full_history`` becomes ``"state"``; retention ``sliding_window``
    becomes ``"sliding_window"`` with its window; anything else is ``"full"``.
    """
    specs = []
    for index, group in enumerate(group_specs):
        if not isinstance(group, PagedCacheGroupSpec):
            raise TypeError(f"group_specs[{index}] must be a PagedCacheGroupSpec, got {type(group).__name__}")
        size = group.rows_per_page * group.entry_stride_tokens if page_size is None else page_size
        if group.family == STATE and group.retention == FULL_HISTORY:
            specs.append(KVCacheSpec("state", size, None, group.group_id))
        elif group.retention == SLIDING_WINDOW:
            specs.append(KVCacheSpec("sliding_window", size, group.sliding_window_tokens, group.group_id))
        else:
            specs.append(KVCacheSpec("full", size, None, group.group_id))
    return specs


# ----------------------------------------------------------------------------------------------
# SPEC 6: per-request tables and the three managers.
# ----------------------------------------------------------------------------------------------


@dataclass
class _Table:
    """One request's pages in one group (SPEC 6).

    Absolute: slot ``i`` covers tokens ``[i*P, (i+1)*P)``; a page that slid out of the window
    becomes a hole (0) and the table never shrinks. ``tail_avail`` is the number of free token
    slots in the last page.
    """

    pages: list[int] = field(default_factory=list)
    tail_avail: int = 0


class _GroupManager:
    """What every group kind shares (SPEC 6): acquire and its dry run, and table registration."""

    #: Full attention is prefix-closed; the windowed kinds are not (SPEC 6).
    prefix_closed = False

    def __init__(self, index: int, page_size: int, base_page_size: int, pool: BlockPool) -> None:
        self.index = index
        self.page_size = page_size
        #: Base pages per page of this group (``m_g`` of SPEC 4).
        self.fold = page_size // base_page_size
        self.pool = pool

    def blocks_needed_for(self, table: _Table, num_tokens: int) -> int:
        """Exact dry run of :meth:`acquire`: pages it would allocate."""
        if num_tokens <= table.tail_avail:
            return 0
        return _ceil_div(num_tokens - table.tail_avail, self.page_size)

    def acquire(self, table: _Table, num_tokens: int) -> bool:
        """Room for ``num_tokens`` more tokens: the tail first, then new pages, all or nothing.

        After allocating for ``over = n - tail_avail`` tokens the new tail has
        ``0 if over % P == 0 else P - over % P`` free slots.
        """
        if num_tokens <= 0:
            return True
        if num_tokens <= table.tail_avail:
            table.tail_avail -= num_tokens
            return True
        over = num_tokens - table.tail_avail
        pages = self.pool.allocate(_ceil_div(over, self.page_size))
        if not pages:
            return False
        table.pages.extend(pages)
        table.tail_avail = 0 if over % self.page_size == 0 else self.page_size - over % self.page_size
        return True

    def check_register_range(self, table: _Table, keys: Sequence[str], first_slot: int) -> None:
        """A registration range past the end of the table is an error (SPEC 6)."""
        if first_slot + len(keys) > len(table.pages):
            raise ValueError(
                f"register: slots [{first_slot}, {first_slot + len(keys)}) of group {self.index} "
                f"run past its table of {len(table.pages)} pages"
            )

    def register(self, table: _Table, keys: Sequence[str], first_slot: int) -> list[tuple[int, str]]:
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

    def match(self, keys: Sequence[str]) -> list[int]:
        """Prefix-match one group over the slots of ``keys``; 0 marks a hole."""
        raise NotImplementedError

    def reclaim(self, table: _Table, num_computed_tokens: int) -> None:
        """Free the pages that slid out of the window; full attention keeps everything."""

    def blocks_reclaimable_at(self, table: _Table, num_computed_tokens: int, count_uncached: bool) -> int:
        """Exact dry run of :meth:`reclaim`: pages it would put back on the free list."""
        return 0


class _FullAttentionManager(_GroupManager):
    """Full attention (SPEC 6): prefix-closed, keeps all history, never reclaims."""

    prefix_closed = True

    def match(self, keys: Sequence[str]) -> list[int]:
        """Walk the keys left to right and stop at the first miss."""
        pages = []
        for key in keys:
            page = self.pool.lookup(key)
            if page is None:
                break
            pages.append(page)
        return pages


class _SlidingWindowManager(_GroupManager):
    """Sliding window attention with window ``W`` tokens (SPEC 6): not prefix-closed.

    To resume at a boundary only the last ``W - 1`` tokens before it must be cached, that is
    ``ceil((W-1)/P)`` pages; everything further left may be a hole.
    """

    def __init__(self, index: int, page_size: int, base_page_size: int, pool: BlockPool, window: int) -> None:
        super().__init__(index, page_size, base_page_size, pool)
        self.window = window

    def match(self, keys: Sequence[str]) -> list[int]:
        """Right-to-left scan for the greatest boundary backed by ``ceil((W-1)/P)`` hits.

        Boundary ``b = end``, ``run = 0``; for ``i = end-1 .. 0``: stop once ``run`` hits are
        enough; a hit extends the run; a miss moves the boundary to ``i`` and resets the run.
        A run that reaches slot 0 is accepted even if shorter. The result has length ``b``:
        slots ``[b-run, b)`` are the hits, the slots left of them are holes (W == 1 needs no
        hits: every slot is a hole).
        """
        needed = _ceil_div(self.window - 1, self.page_size)
        boundary = len(keys)
        run: list[int] = []  # hit pages right to left, just behind the boundary
        for slot in range(len(keys) - 1, -1, -1):
            if len(run) >= needed:
                break
            page = self.pool.lookup(keys[slot])
            if page is None:
                boundary = slot
                run = []
            else:
                run.append(page)
        holes = [0] * (boundary - len(run))
        return holes + run[::-1]

    def _slid_out_slots(self, table: _Table, num_computed_tokens: int) -> int:
        """``k``: slots ``[0, k)`` hold only tokens before ``n - W + 1``, outside every future window."""
        first_kept_token = num_computed_tokens - self.window + 1
        if first_kept_token <= 0:
            return 0
        return min(first_kept_token // self.page_size, len(table.pages))

    def reclaim(self, table: _Table, num_computed_tokens: int) -> None:
        """Replace every real page in the slid-out slots by a hole and free them (SPEC 6, 12.2).

        Holes in the middle do not stop the scan (the reference design stopped at the first
        hole and leaked the pages below it). Pages are released lowest slot first, so the
        oldest page is evicted first; ``BlockPool.free`` releases in reverse list order, hence
        the reversed list.
        """
        collected = []
        for slot in range(self._slid_out_slots(table, num_computed_tokens)):
            page = table.pages[slot]
            if page != 0:
                collected.append(page)
                table.pages[slot] = 0
        self.pool.free(collected[::-1])

    def blocks_reclaimable_at(self, table: _Table, num_computed_tokens: int, count_uncached: bool) -> int:
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


class _StateManager(_SlidingWindowManager):
    """Linear attention / mamba state (SPEC 6): a sliding window with ``W = 2``.

    The page of token ``n - 1`` holds the live state; a match is the rightmost cached snapshot
    page. Only the final page of a range that ends exactly on a page boundary is registered:
    interior boundaries never received a state write.
    """

    def __init__(self, index: int, page_size: int, base_page_size: int, pool: BlockPool) -> None:
        super().__init__(index, page_size, base_page_size, pool, window=2)

    def keys_to_register(
        self, keys: list[str], first_slot: int, hashed_end: int, end_tokens: int | None
    ) -> tuple[list[str], int] | None:
        """Only the last key, and only when the hashed range ends exactly at ``end_tokens``, on a
        boundary of this group's pages (SPEC 7). No ``end_tokens`` means no snapshot: nothing."""
        if end_tokens is None or end_tokens % self.page_size != 0 or hashed_end != end_tokens:
            return None
        if not keys:
            return None
        return [keys[-1]], first_slot + len(keys) - 1


# ----------------------------------------------------------------------------------------------
# SPEC 7 and 8: the coordinator and the request API.
# ----------------------------------------------------------------------------------------------


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
        common = _count(self.num_common_tokens, "num_common_tokens")
        pages = self.pages
        if isinstance(pages, str) or not isinstance(pages, Iterable):
            kind = "a str" if isinstance(pages, str) else type(pages).__name__
            raise TypeError(f"pages must be a sequence of page-id sequences, not {kind}")
        checked = [_page_ids(group, f"pages[{g}]") for g, group in enumerate(pages)]
        object.__setattr__(self, "num_common_tokens", common)
        object.__setattr__(self, "pages", checked)
        object.__setattr__(self, "num_hit_pages", _counts(self.num_hit_pages, "num_hit_pages"))


def _page_ids(values: object, name: str) -> list[int]:
    """Page ids of a hand-built match: ints in ``[0, 2**31 - 1)`` (ValueError naming ``name[i]``)."""
    if isinstance(values, np.ndarray):
        if values.ndim != 1 or not np.issubdtype(values.dtype, np.integer):
            raise TypeError(
                f"{name} must be a 1-D integer array, got a {values.ndim}-D array of dtype {values.dtype}"
            )
        values = values.tolist()
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise TypeError(f"{name} must be a sequence of ints, got {type(values).__name__}")
    ids = []
    for index, item in enumerate(values):
        value = _as_int(item, f"{name}[{index}]")
        if not 0 <= value < _MAX_PAGES:
            raise ValueError(f"{name}[{index}] = {value} is not a page id (0 <= id < {_MAX_PAGES})")
        ids.append(value)
    return ids


def _content_hashes(content_hashes: object) -> list[str]:
    """Base-page content hashes: 64-char lowercase hex strings (ValueError naming
    ``content_hashes[i]``; uppercase is refused because folding hashes the text)."""
    if isinstance(content_hashes, str) or not isinstance(content_hashes, Iterable):
        raise TypeError(f"content_hashes must be a sequence of str, got {type(content_hashes).__name__}")
    hashes = list(content_hashes)
    for index, value in enumerate(hashes):
        if not isinstance(value, str):
            raise TypeError(f"content_hashes[{index}] must be a str, got {type(value).__name__}")
        if len(value) != _HASH_HEX_LEN or not set(value) <= _LOWER_HEX_DIGITS:
            raise ValueError(
                f"content_hashes[{index}] must be a {_HASH_HEX_LEN}-char lowercase hex string, got {value!r}"
            )
    return hashes


def _request_key(req: object) -> RequestId:
    """A request id: a str, or an int of any size (``5`` and ``"5"`` differ); else TypeError."""
    if isinstance(req, str):
        return req
    if isinstance(req, bool):
        raise TypeError("request ids must be str or int, got bool")
    try:
        return operator.index(req)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"request ids must be str or int, got {type(req).__name__}") from None


def _request_keys(reqs: Iterable[object]) -> list[RequestId]:
    """The ids of a batch call: a sequence of request ids (a bare str is refused, not split)."""
    if isinstance(reqs, (str, bytes)):
        raise TypeError("reqs must be a sequence of request ids, not a bare str")
    return [_request_key(req) for req in reqs]


@dataclass
class _TokenState:
    """A token-level request's own tokens (docs/requests-api.md).

    ``hashes[i]`` is the chained content hash of full base page ``i`` of ``tokens``;
    ``computed`` is the position; base pages below ``registered`` were already registered (or
    claimed, hence keyed).
    """

    tokens: list[int]
    hashes: list[str]
    extra_keys: list[str]
    computed: int = 0
    registered: int = 0


def _counts(values: object, name: str) -> list[int]:
    """One count per entry: a sequence of ints or a 1-D integer numpy array."""
    if isinstance(values, np.ndarray):
        if values.ndim != 1 or not np.issubdtype(values.dtype, np.integer):
            raise TypeError(f"{name} must be a 1-D integer array, got {values.ndim}-D {values.dtype}")
        items: list[object] = values.tolist()
    elif isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise TypeError(f"{name} must be a sequence of ints, got {type(values).__name__}")
    else:
        items = list(values)
    return [_count(item, f"{name}[{index}]") for index, item in enumerate(items)]


class FlatKVCache:
    """Every attention group of one model over one shared page pool (SPEC 6 to 8).

    ``base`` (gcd) and ``lcm`` of the page sizes tie the groups together: content hashes are
    per base page, a group of page size ``P_g`` folds ``m_g = P_g / base`` of them per key, and
    a prefix match ends on a multiple of ``lcm`` so every group's pages are whole. Groups keep
    their index order everywhere; no group stands for the request (SPEC 12.5).
    """

    def __init__(
        self,
        specs: Sequence[KVCacheSpec],
        num_pages: int,
        *,
        enable_caching: bool = True,
        eviction_order: str = "hybrid",
        enable_kv_events: bool = False,
    ) -> None:
        if not isinstance(eviction_order, str) or eviction_order not in _EVICTION_ORDERS:
            raise ValueError(f"eviction_order must be 'hybrid' or 'group', got {eviction_order!r}")
        spec_list = list(specs)
        if not spec_list:
            raise ValueError("specs must hold at least one KVCacheSpec")
        for index, spec in enumerate(spec_list):
            if not isinstance(spec, KVCacheSpec):
                raise TypeError(f"specs[{index}] must be a KVCacheSpec, got {type(spec).__name__}")
        for index, spec in enumerate(spec_list):
            _check_u64(spec.page_size, f"specs[{index}].page_size")
            if spec.sliding_window is not None:
                _check_u64(spec.sliding_window, f"specs[{index}].sliding_window")
        total = _check_u64(_as_int(num_pages, "num_pages"), "num_pages")
        if total < 1:
            raise ValueError(f"num_pages must be >= 1, got {total}")
        if total > _MAX_PAGES:
            raise ValueError(f"num_pages must be <= {_MAX_PAGES} (page ids are int32), got {total}")
        group_ids = [
            spec.group_id if spec.group_id is not None else f"g{i}" for i, spec in enumerate(spec_list)
        ]
        if len(set(group_ids)) != len(group_ids):
            raise ValueError(f"group ids must be distinct, got {group_ids}")
        sizes = [spec.page_size for spec in spec_list]
        lcm = math.lcm(*sizes)
        if lcm > _U64_MAX:
            raise OverflowError(f"specs: the lcm of the page sizes {sizes} does not fit in u64")

        self._specs = spec_list
        self._group_ids = group_ids
        self._base = math.gcd(*sizes)
        self._lcm = lcm
        self._enable_caching = _flag(enable_caching, "enable_caching")
        self._eviction_order = eviction_order
        self._pool = BlockPool(total, enable_caching=self._enable_caching)
        self._managers: list[_GroupManager] = []
        for index, spec in enumerate(spec_list):
            if spec.kind == "full":
                self._managers.append(_FullAttentionManager(index, spec.page_size, self._base, self._pool))
            elif spec.kind == "sliding_window":
                assert spec.sliding_window is not None  # checked by KVCacheSpec
                self._managers.append(
                    _SlidingWindowManager(index, spec.page_size, self._base, self._pool, spec.sliding_window)
                )
            else:
                self._managers.append(_StateManager(index, spec.page_size, self._base, self._pool))
        # SPEC 7: prefix-closed groups first, then the others, each in index order.
        closed = [m.index for m in self._managers if m.prefix_closed]
        others = [m.index for m in self._managers if not m.prefix_closed]
        self._match_order = closed + others
        self._requests: dict[RequestId, list[_Table]] = {}
        # Token-level requests (docs/requests-api.md): their tokens and position, and the
        # pages promised to any request's next decode (SPEC 9).
        self._token_states: dict[RequestId, _TokenState] = {}
        self._reserves: dict[RequestId, int] = {}
        self._counters = {"prefix_queries_tokens": 0, "prefix_hits_tokens": 0, "preemptions": 0}
        self._events_enabled = _flag(enable_kv_events, "enable_kv_events")
        self._events: list[KVCacheEvent] = []
        self._pool._record_evictions = self._events_enabled

    # -- properties -----------------------------------------------------------------------------

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

    def has_request(self, req: RequestId) -> bool:
        return _request_key(req) in self._requests

    def pool_stats(self) -> dict[str, int]:
        """The pool probes of SPEC 5."""
        pool = self._pool
        return {
            "num_blocks": pool.num_blocks,
            "num_free": pool.num_free,
            "num_cached": pool.num_cached,
            "num_cached_free": pool.num_cached_free,
            "num_cached_pinned": pool.num_cached_pinned,
        }

    def __repr__(self) -> str:
        return (
            f"FlatKVCache(group_ids={self._group_ids}, num_pages={self._pool.num_blocks}, "
            f"num_free_pages={self._pool.num_free}, num_requests={len(self._requests)})"
        )

    # -- helpers --------------------------------------------------------------------------------

    def _tables(self, req: RequestId) -> list[_Table]:
        """The request's tables, one per group; KeyError for an unknown id."""
        key = _request_key(req)
        try:
            return self._requests[key]
        except KeyError:
            raise KeyError(f"unknown request {req!r}") from None

    def _tables_or_new(self, req: RequestId) -> list[_Table]:
        """The request's tables, created empty on first use (claim, acquire, first chunk)."""
        key = _request_key(req)
        if key not in self._requests:
            self._requests[key] = [_Table() for _ in self._managers]
        return self._requests[key]

    def _group_keys(self, manager: _GroupManager, hashes: Sequence[str], first_base: int) -> list[str]:
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

    # -- SPEC 7: the coordinator ----------------------------------------------------------------

    def match_prefix(self, content_hashes: Sequence[str]) -> PrefixMatch:
        """Hybrid prefix match (SPEC 7), read-only: no count, order or key changes.

        ``bound = align_down(len * base, lcm)``. Sweep: match each group in match order up to
        the bound, then lower the bound to that group's extent (aligned down to lcm). Converge:
        re-match every non-closed group whose extent exceeds the bound until none does (a
        sliding group's answer at a lower bound is not a prefix of its answer at a higher one).
        Finally truncate every group to the bound. With caching off the match is empty.
        """
        hashes = _content_hashes(content_hashes)
        count = len(self._managers)
        if not self._enable_caching:
            return PrefixMatch(0, [[] for _ in range(count)], [0] * count)
        keys = [self._group_keys(manager, hashes, 0) for manager in self._managers]
        results: list[list[int]] = [[] for _ in range(count)]
        bound = _align_down(len(hashes) * self._base, self._lcm)

        def match_group(index: int) -> None:
            nonlocal bound
            manager = self._managers[index]
            results[index] = manager.match(keys[index][: bound // manager.page_size])
            extent = len(results[index]) * manager.page_size
            bound = min(bound, _align_down(extent, self._lcm))

        for index in self._match_order:
            match_group(index)
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
        key = _request_key(req)
        checked = self._check_match(match)
        existing = self._requests.get(key)
        if existing is not None and any(table.pages for table in existing):
            raise ValueError(f"claim: request {req!r} already holds pages")
        if len(checked.pages) != len(self._managers):
            raise ValueError(
                f"claim: the match has {len(checked.pages)} groups, this cache has {len(self._managers)}"
            )
        for group, pages in enumerate(checked.pages):
            for slot, page in enumerate(pages):
                if page != 0 and not self._still_matches(checked, group, slot, page):
                    raise ValueError(
                        f"claim: stale match, page {page} of group {self._group_ids[group]} "
                        "no longer holds the key it was matched under"
                    )
        tables = self._tables_or_new(req)
        for table, pages in zip(tables, checked.pages, strict=True):
            table.pages = list(pages)
            table.tail_avail = 0
            for page in pages:
                self._pool.touch(page)

    def acquire(self, req: RequestId, num_tokens: int) -> bool:
        """Room for ``num_tokens`` more tokens in every group, all or nothing (SPEC 7).

        Check-then-act: if the pages needed over all groups exceed the free pages, return
        False and allocate nothing anywhere. Otherwise groups allocate in index order, so page
        ids are deterministic.
        """
        _request_key(req)
        count = _count(num_tokens, "num_tokens")
        tables = self._tables_or_new(req)
        needed = sum(m.blocks_needed_for(t, count) for m, t in zip(self._managers, tables, strict=True))
        if needed > self._pool.num_free:
            return False
        for manager, table in zip(self._managers, tables, strict=True):
            ok = manager.acquire(table, count)
            assert ok, "the check above guarantees every group's allocation"
            self._record_evictions()
        return True

    def _record_evictions(self) -> None:
        """One ``BlockRemoved`` per group whose keys the last allocation evicted, groups in the
        order they first appear among the evicted keys, hashes in eviction order."""
        by_group: dict[int, list[bytes]] = {}
        for key in self._pool._take_evicted():
            group = int(key[_HASH_HEX_LEN:], 16)
            by_group.setdefault(group, []).append(bytes.fromhex(key[:_HASH_HEX_LEN]))
        for group, hashes in by_group.items():
            self._events.append(BlockRemoved(hashes, group))

    def register(
        self,
        req: RequestId,
        content_hashes: Sequence[str],
        *,
        first_slot: int = 0,
        end_tokens: int | None = None,
    ) -> None:
        """Give the request's full pages their cache keys (SPEC 7; nothing when caching is off).

        ``content_hashes[j]`` is base page ``first_slot + j``. Each group folds them into keys
        for its slots from ``ceil(first_slot / m_g)``. History groups register every key; state
        groups only the last, and only when ``end_tokens`` is a multiple of their page size and
        the hashes end exactly there (SPEC 6). Ranges are checked for every group first.
        """
        tables = self._tables(req)
        hashes = _content_hashes(content_hashes)
        first = _count(first_slot, "first_slot")
        end = None if end_tokens is None else _count(end_tokens, "end_tokens")
        self._register(tables, hashes, first, end, None)

    def _register(
        self,
        tables: list[_Table],
        hashes: list[str],
        first: int,
        end: int | None,
        state: _TokenState | None,
    ) -> None:
        """:meth:`register` on checked arguments; ``state`` is the token-level request, if any
        (its tokens, hashes and extra keys go into the ``BlockStored`` events)."""
        if not self._enable_caching:
            return  # SPEC 12.4: nothing is registered when prefix caching is disabled
        plan: list[tuple[_GroupManager, _Table, list[str], int]] = []
        for manager, table in zip(self._managers, tables, strict=True):
            keys = self._group_keys(manager, hashes, first)
            slot = _ceil_div(first, manager.fold)
            chosen = manager.keys_to_register(keys, slot, (first + len(hashes)) * self._base, end)
            if chosen is None:
                continue
            chosen_keys, chosen_slot = chosen
            manager.check_register_range(table, chosen_keys, chosen_slot)
            plan.append((manager, table, chosen_keys, chosen_slot))
        for manager, table, chosen_keys, chosen_slot in plan:
            stored = manager.register(table, chosen_keys, chosen_slot)
            if stored and self._events_enabled:
                self._events.append(self._stored_event(manager, table, stored, hashes, first, state))

    def _stored_event(
        self,
        manager: _GroupManager,
        table: _Table,
        stored: list[tuple[int, str]],
        hashes: list[str],
        first: int,
        state: _TokenState | None,
    ) -> BlockStored:
        """The ``BlockStored`` event of one group's newly cached ``(slot, key)`` pairs.

        The parent is the content hash of the slot before the first one: folded from the
        request's own hashes (token-level) or from the hashes passed to ``register`` when they
        cover that slot, else the hash of the key its page holds, else None (also at slot 0).
        """
        m = manager.fold
        parent: bytes | None = None
        previous = stored[0][0] - 1
        if previous >= 0:
            low, high = previous * m, (previous + 1) * m
            if state is not None and high <= len(state.hashes):
                parent = bytes.fromhex(fold_hashes(state.hashes[low:high], low, m)[0])
            elif low >= first and high - first <= len(hashes):
                parent = bytes.fromhex(fold_hashes(hashes[low - first : high - first], low, m)[0])
            else:
                page = table.pages[previous]
                held = self._pool._key_held_by(page) if page != 0 else None
                if held is not None:
                    parent = bytes.fromhex(held[:_HASH_HEX_LEN])
        tokens: list[int] = []
        if state is not None:
            for slot, _ in stored:
                tokens.extend(state.tokens[slot * manager.page_size : (slot + 1) * manager.page_size])
        spec = self._specs[manager.index]
        return BlockStored(
            block_hashes=[bytes.fromhex(key[:_HASH_HEX_LEN]) for _, key in stored],
            parent_block_hash=parent,
            token_ids=tokens,
            block_size=spec.page_size,
            group_index=manager.index,
            group_kind=spec.kind,
            sliding_window=spec.sliding_window,
            extra_keys=list(state.extra_keys) if state is not None else [],
        )

    def reclaim(self, req: RequestId, num_computed_tokens: int) -> None:
        """Free every page that slid out of its group's window, per group in index order (SPEC 6)."""
        tables = self._tables(req)
        computed = _count(num_computed_tokens, "num_computed_tokens")
        for manager, table in zip(self._managers, tables, strict=True):
            manager.reclaim(table, computed)

    def free(self, req: RequestId) -> None:
        """Release every page of the request and forget it (SPEC 7), in the eviction order.

        ``"hybrid"`` (the default, SPEC 12.3): all groups' real pages by the end token of their
        slot, descending (ties: lower group index first), so the chain's tail is evicted first
        in every group together and a hybrid prefix keeps all its groups equally long.
        ``"group"`` (the reference design): each group's table tail first, group 0 first.
        The first page released is the first evicted.
        """
        tables = self._tables(req)
        if self._eviction_order == "group":
            for table in tables:
                self._pool.free(table.pages)  # BlockPool.free releases the list's tail first
        else:
            ordered = sorted(
                (-(slot + 1) * manager.page_size, manager.index, page)
                for manager, table in zip(self._managers, tables, strict=True)
                for slot, page in enumerate(table.pages)
                if page != 0
            )
            # BlockPool.free releases in reverse list order: reverse to release in ``ordered``.
            self._pool.free([page for _, _, page in reversed(ordered)])
        key = _request_key(req)
        del self._requests[key]
        self._token_states.pop(key, None)
        self._reserves.pop(key, None)

    # -- admission helpers (SPEC 7, 9) ----------------------------------------------------------

    def pages_needed(self, num_tokens: int, req: RequestId | None = None) -> int:
        """Pages ``acquire(req, num_tokens)`` would allocate (fresh tables when ``req`` is None)."""
        tables = None if req is None else self._tables(req)
        count = _count(num_tokens, "num_tokens")
        if tables is None:
            tables = [_Table() for _ in self._managers]
        needed = sum(m.blocks_needed_for(t, count) for m, t in zip(self._managers, tables, strict=True))
        return _check_u64(needed, "num_tokens")  # the native sum is a checked u64

    def pages_reclaimable(
        self, req: RequestId, num_computed_tokens: int, *, count_uncached: bool = True
    ) -> int:
        """Pages ``reclaim(req, num_computed_tokens)`` would put back on the free list."""
        tables = self._tables(req)
        computed = _count(num_computed_tokens, "num_computed_tokens")
        return sum(
            m.blocks_reclaimable_at(t, computed, bool(count_uncached))
            for m, t in zip(self._managers, tables, strict=True)
        )

    def pages_consumed_by_claim(self, match: PrefixMatch) -> int:
        """Free pages a claim of ``match`` takes off the free list: distinct real pages, count 0."""
        checked = self._check_match(match)
        distinct = {page for pages in checked.pages for page in pages if page != 0}
        return sum(1 for page in distinct if self._pool.ref_count(page) == 0)

    # -- reading tables -------------------------------------------------------------------------

    def page_ids(self, req: RequestId) -> list[list[int]]:
        """Each group's table of the request (0 = hole)."""
        return [list(table.pages) for table in self._tables(req)]

    def tail_available(self, req: RequestId) -> list[int]:
        """Each group's free token slots in the request's last page."""
        return [table.tail_avail for table in self._tables(req)]

    # -- SPEC 8: step operations ----------------------------------------------------------------

    def prefill_first_chunk(self, req: RequestId, match: PrefixMatch, num_tokens: int) -> bool:
        """Claim the match, then acquire the chunk's tokens (SPEC 8).

        On False the claim stays; the caller frees the request.
        """
        _request_key(req)
        self._check_match(match)
        count = _count(num_tokens, "num_tokens")
        self.claim(req, match)
        return self.acquire(req, count)

    def prefill_chunk(
        self, req: RequestId, content_hashes: Sequence[str], num_tokens: int, num_computed_tokens: int
    ) -> bool:
        """A later prefill chunk (SPEC 8): register, THEN reclaim, THEN acquire.

        ``content_hashes`` start at base page 0 and are cut to the ``computed // base`` pages
        already computed. Registering first keeps the hashes of pages about to slide out
        (registration skips holes); reclaimed pages fund this step's acquire.
        """
        self._tables(req)
        hashes = _content_hashes(content_hashes)
        count = _count(num_tokens, "num_tokens")
        computed = _count(num_computed_tokens, "num_computed_tokens")
        cut = hashes[: computed // self._base]
        self.register(req, cut, first_slot=0, end_tokens=computed)
        self.reclaim(req, computed)
        return self.acquire(req, count)

    def decode_step(
        self,
        req: RequestId,
        content_hashes: Sequence[str],
        first_page_slot: int,
        num_tokens: int,
        num_computed_tokens: int,
    ) -> bool:
        """A decode step (SPEC 8): register, THEN reclaim, THEN acquire.

        ``content_hashes`` start at base page ``first_page_slot`` and are cut so that they end
        at or before base page ``computed // base``.
        """
        self._tables(req)
        hashes = _content_hashes(content_hashes)
        first = _count(first_page_slot, "first_page_slot")
        count = _count(num_tokens, "num_tokens")
        computed = _count(num_computed_tokens, "num_computed_tokens")
        cut = hashes[: max(0, computed // self._base - first)]
        self.register(req, cut, first_slot=first, end_tokens=computed)
        self.reclaim(req, computed)
        return self.acquire(req, count)

    def block_tables(self, reqs: Sequence[RequestId], out: Any = None) -> Any:
        """Flat per-group block tables for a batch (SPEC 8): ``{group_id: int32 [len(reqs), cols]}``.

        ``cols`` is the longest of those requests' tables in the group; holes are 0 and padding
        past a row's end is -1; rows follow ``reqs`` (repeats allowed). Unavailable without the
        ``flat`` build feature (SPEC 10): never a silent single-table fallback.

        With ``out`` (a mapping group_id -> writable C-contiguous int32 numpy array or CPU torch
        tensor ``[>= len(reqs), cols]`` for every group), row ``r`` of each buffer is written in
        place and ``out`` is returned; rows past ``len(reqs)`` are untouched. Every check (the
        buffers, then the requests, then rows and columns) happens before anything is written.
        """
        if not _flat_build_enabled():
            raise RuntimeError(_FLAT_OFF_MESSAGE)
        keys = _request_keys(reqs)
        if out is None:
            rows = [self._tables(key) for key in keys]
            result: dict[str, npt.NDArray[np.int32]] = {}
            for group, group_id in enumerate(self._group_ids):
                cols = max((len(tables[group].pages) for tables in rows), default=0)
                array = np.full((len(rows), cols), -1, dtype=np.int32)
                self._fill_rows(array, rows, group)
                result[group_id] = array
            return result
        buffers = self._out_buffers(out)
        rows = [self._tables(key) for key in keys]
        for group, (group_id, array) in enumerate(zip(self._group_ids, buffers, strict=True)):
            if array.shape[0] < len(rows):
                raise ValueError(
                    f"block_tables: out[{group_id!r}] has {array.shape[0]} rows, "
                    f"fewer than the {len(rows)} requests"
                )
            for key, tables in zip(keys, rows, strict=True):
                if len(tables[group].pages) > array.shape[1]:
                    raise ValueError(
                        f"block_tables: out[{group_id!r}] has {array.shape[1]} columns but request "
                        f"{key!r} has {len(tables[group].pages)} pages in that group"
                    )
        for group, array in enumerate(buffers):
            self._fill_rows(array, rows, group)
        return out

    @staticmethod
    def _fill_rows(array: npt.NDArray[np.int32], rows: list[list[_Table]], group: int) -> None:
        """Row ``r`` of ``array`` gets request ``r``'s pages in ``group`` (holes 0), then -1."""
        for row, tables in enumerate(rows):
            pages = tables[group].pages
            array[row, : len(pages)] = pages
            array[row, len(pages) :] = -1

    def _out_buffers(self, out: Any) -> list[npt.NDArray[np.int32]]:
        """Each group's ``out`` buffer as a numpy view of the caller's memory, checked."""
        buffers: list[npt.NDArray[np.int32]] = []
        for group_id in self._group_ids:
            label = f"out[{group_id!r}]"
            try:
                item = out[group_id]
            except KeyError:
                raise ValueError(f"block_tables: out has no table for group {group_id!r}") from None
            except TypeError:
                raise TypeError(
                    f"out must be a mapping of group id to int32 array, got {type(out).__name__}"
                ) from None
            if not isinstance(item, np.ndarray):
                if not all(hasattr(item, name) for name in ("numpy", "device", "data_ptr")):
                    raise TypeError(
                        f"{label} must be an int32 numpy array or a CPU torch tensor, "
                        f"got {type(item).__name__}"
                    )
                if getattr(item.device, "type", None) != "cpu":
                    raise ValueError(f"{label} must be a CPU tensor, got one on device {item.device}")
                item = item.numpy()  # shares the tensor's memory
                if not isinstance(item, np.ndarray):
                    raise TypeError(f"{label}.numpy() returned {type(item).__name__}, not a numpy array")
            if item.ndim != 2:
                raise ValueError(f"{label} must be 2-D [rows, cols], got {item.ndim} dimension(s)")
            if item.dtype != np.int32:
                raise TypeError(f"{label} must have dtype int32, got {item.dtype}")
            if not item.flags.c_contiguous:
                raise ValueError(f"{label} must be C-contiguous")
            if not item.flags.writeable:
                raise ValueError(f"{label} must be writable")
            if any(np.shares_memory(item, other) for other in buffers):
                raise ValueError(f"{label} shares its memory with another group's table")
            buffers.append(item)
        return buffers

    # -- token-level requests (docs/requests-api.md; SPEC 8, 9, 12.4) -------------------------

    def _token_state(self, method: str, key: RequestId) -> tuple[list[_Table], _TokenState]:
        """A token-level request's tables and state: KeyError if unknown, ValueError if page-level."""
        tables = self._tables(key)
        state = self._token_states.get(key)
        if state is None:
            raise ValueError(f"{method}: request {key!r} is page-level (not created by add_request)")
        return tables, state

    def _capped_match(self, hashes: list[str], num_tokens: int) -> PrefixMatch:
        """The prefix match over the first ``max((len - 1) // base, 0)`` base pages (SPEC 9):
        the last prompt token is always recomputed."""
        cap = max(num_tokens - 1, 0) // self._base
        return self.match_prefix(hashes[:cap])

    def _hash_prompt(
        self, prompt_token_ids: object, extra_keys: object
    ) -> tuple[list[int], list[str], list[str]]:
        """Tokens, chained base-page hashes and extra keys of a prompt (checked)."""
        tokens = _token_values(prompt_token_ids, "prompt_token_ids")
        _extra_key_bytes(extra_keys)
        keys = list(extra_keys)  # type: ignore[call-overload]
        return tokens, hash_pages(tokens, self._base, extra_keys=keys), keys

    def add_request(
        self,
        req: RequestId,
        prompt_token_ids: TokenIds,
        *,
        extra_keys: Sequence[str] = (),
        use_prefix_cache: bool = True,
    ) -> int:
        """A new token-level request for a non-empty prompt; returns its prefix hit in tokens.

        With caching on and ``use_prefix_cache`` the capped match is claimed and the request
        starts computed up to the hit. Nothing else is allocated.
        """
        use_cache = _flag(use_prefix_cache, "use_prefix_cache")
        key = _request_key(req)
        tokens, hashes, keys = self._hash_prompt(prompt_token_ids, extra_keys)
        if key in self._requests:
            raise ValueError(f"add_request: request {req!r} already exists")
        if not tokens:
            raise ValueError("prompt_token_ids must not be empty")
        hit = 0
        self._requests[key] = [_Table() for _ in self._managers]
        if use_cache and self._enable_caching:
            match = self._capped_match(hashes, len(tokens))
            hit = match.num_common_tokens
            self.claim(key, match)
            self._counters["prefix_queries_tokens"] += len(tokens)
            self._counters["prefix_hits_tokens"] += hit
        self._token_states[key] = _TokenState(
            tokens, hashes, keys, computed=hit, registered=hit // self._base
        )
        return hit

    def append_tokens(self, req: RequestId, token_ids: TokenIds) -> None:
        """Append newly known tokens; each base page that fills is hashed once, chained (SPEC 12.4)."""
        key = _request_key(req)
        tokens = _token_values(token_ids, "token_ids")
        self._token_state("append_tokens", key)
        self._append_checked(key, tokens)

    def _append_checked(self, key: RequestId, tokens: list[int]) -> None:
        _, state = self._token_state("append_tokens", key)
        state.tokens.extend(tokens)
        while len(state.hashes) < len(state.tokens) // self._base:
            start = len(state.hashes) * self._base
            prior = state.hashes[-1] if state.hashes else ""
            state.hashes.append(hash_page(state.tokens[start : start + self._base], prior, state.extra_keys))

    def append_tokens_batch(
        self,
        reqs: Sequence[RequestId],
        token_ids: TokenIds,
        num_tokens: Sequence[int] | npt.NDArray[np.integer[Any]] | None = None,
    ) -> None:
        """``append_tokens`` for many requests in one call, after validating everything.

        Request ``i`` gets the next ``num_tokens[i]`` entries of the flat ``token_ids``, or
        exactly one each when ``num_tokens`` is None.
        """
        keys = _request_keys(reqs)
        tokens = _token_values(token_ids, "token_ids")
        if num_tokens is None:
            if len(tokens) != len(keys):
                raise ValueError(
                    f"token_ids has {len(tokens)} entries but reqs has {len(keys)} "
                    "(one token per request without num_tokens)"
                )
            counts = [1] * len(keys)
        else:
            counts = _counts(num_tokens, "num_tokens")
            if len(counts) != len(keys):
                raise ValueError(f"num_tokens has {len(counts)} entries but reqs has {len(keys)}")
            total = _check_u64(sum(counts), "num_tokens")
            if total != len(tokens):
                raise ValueError(f"num_tokens adds up to {total} but token_ids has {len(tokens)} entries")
        for key in keys:
            self._token_state("append_tokens_batch", key)
        start = 0
        for key, count in zip(keys, counts, strict=True):
            self._append_checked(key, tokens[start : start + count])
            start += count

    def num_computed_tokens(self, req: RequestId) -> int:
        return self._token_state("num_computed_tokens", _request_key(req))[1].computed

    def num_tokens(self, req: RequestId) -> int:
        return len(self._token_state("num_tokens", _request_key(req))[1].tokens)

    def _check_known(self, method: str, key: RequestId, state: _TokenState, n: int) -> None:
        if state.computed + n > len(state.tokens):
            raise ValueError(
                f"{method}: num_new_tokens = {n} for request {key!r} asks for more tokens than are "
                f"known: {state.computed} computed of {len(state.tokens)}"
            )

    def schedule(self, req: RequestId, num_new_tokens: int, *, lookahead: int = 0) -> bool:
        """Schedule the next ``num_new_tokens`` known tokens at the request's position (SPEC 8).

        Register the completed full pages, reclaim slid-out pages, then acquire room for
        ``computed + n + lookahead`` tokens all or nothing. True: the position moved by ``n``
        and the reserve was released. False: nothing allocated, the position stays.
        """
        key = _request_key(req)
        count = _count(num_new_tokens, "num_new_tokens")
        ahead = _count(lookahead, "lookahead")
        _, state = self._token_state("schedule", key)
        self._check_known("schedule", key, state, count)
        _check_u64(state.computed + count + ahead, "lookahead")
        return self._schedule_checked(key, count, ahead)

    def schedule_batch(
        self, reqs: Sequence[RequestId], num_new_tokens: Sequence[int] | npt.NDArray[np.integer[Any]]
    ) -> npt.NDArray[np.bool_]:
        """``schedule(req, n)`` for each pair in order, after validating every pair first."""
        keys = _request_keys(reqs)
        counts = _counts(num_new_tokens, "num_new_tokens")
        if len(counts) != len(keys):
            raise ValueError(f"num_new_tokens has {len(counts)} entries but reqs has {len(keys)}")
        asked: dict[RequestId, int] = {}
        for key, count in zip(keys, counts, strict=True):
            _, state = self._token_state("schedule_batch", key)
            asked[key] = _check_u64(asked.get(key, 0) + count, "num_new_tokens")
            self._check_known("schedule_batch", key, state, asked[key])
        results = [self._schedule_checked(key, count, 0) for key, count in zip(keys, counts, strict=True)]
        return np.array(results, dtype=np.bool_)

    def _schedule_checked(self, key: RequestId, count: int, ahead: int) -> bool:
        tables, state = self._token_state("schedule", key)
        self._register_computed(tables, state)
        position = state.computed
        self.reclaim(key, position)
        # Allocated tokens (claimed plus acquired) are the same in every group.
        allocated = len(tables[0].pages) * self._managers[0].page_size - tables[0].tail_avail
        needed = position + count + ahead - allocated
        if needed > 0 and not self.acquire(key, needed):
            return False
        state.computed = position + count
        self._reserves.pop(key, None)
        return True

    def _register_computed(self, tables: list[_Table], state: _TokenState) -> None:
        """Register the full base pages below the position not registered yet (``end_tokens`` =
        the position). The range starts at the last base page aligned to every group's fold, so
        a group wider than a base page sees whole runs; re-registering caches nothing twice."""
        if not self._enable_caching:
            return
        full = min(state.computed // self._base, len(state.hashes))
        if full <= state.registered:
            return
        step = self._lcm // self._base
        first = state.registered - state.registered % step
        self._register(tables, state.hashes[first:full], first, state.computed, state)
        state.registered = full

    def finish(self, req: RequestId) -> None:
        """Register the completed full pages, free everything in ``eviction_order``, forget the id."""
        self._finish("finish", _request_key(req))

    def preempt(self, req: RequestId) -> list[int]:
        """``finish``, counted as a preemption; returns the request's whole token list to re-add."""
        tokens = self._finish("preempt", _request_key(req))
        self._counters["preemptions"] += 1
        return tokens

    def _finish(self, method: str, key: RequestId) -> list[int]:
        tables, state = self._token_state(method, key)
        self._register_computed(tables, state)
        self.free(key)
        return state.tokens

    # -- admission accounting (SPEC 9) ----------------------------------------------------------

    def prefix_hit_tokens(self, prompt_token_ids: TokenIds, *, extra_keys: Sequence[str] = ()) -> int:
        """The (capped) hit ``add_request`` would get, read-only."""
        tokens, hashes, _ = self._hash_prompt(prompt_token_ids, extra_keys)
        return self._capped_match(hashes, len(tokens)).num_common_tokens

    def pages_needed_to_admit(
        self,
        prompt_token_ids: TokenIds,
        num_new_tokens: int,
        reserve_tokens: int = 0,
        *,
        extra_keys: Sequence[str] = (),
    ) -> int:
        """Pages the capped match's claim takes plus ``pages_needed(new + reserve)`` on fresh tables."""
        count = _count(num_new_tokens, "num_new_tokens")
        extra = _count(reserve_tokens, "reserve_tokens")
        tokens, hashes, _ = self._hash_prompt(prompt_token_ids, extra_keys)
        match = self._capped_match(hashes, len(tokens))
        total = self.pages_needed(_check_u64(count + extra, "num_new_tokens + reserve_tokens"))
        return _check_u64(total + self.pages_consumed_by_claim(match), "num_new_tokens + reserve_tokens")

    def reserve(self, req: RequestId, tokens: int) -> None:
        """Promise ``pages_needed(tokens, req)`` pages to the request's next decode (replaces)."""
        key = _request_key(req)
        count = _count(tokens, "tokens")
        self._reserves[key] = self.pages_needed(count, key)

    def budget(self, req: RequestId | None = None) -> int:
        """Free pages minus the reserves of every request other than ``req`` (may be negative)."""
        own = 0
        if req is not None:
            key = _request_key(req)
            self._tables(key)
            own = self._reserves.get(key, 0)
        return self._pool.num_free - (sum(self._reserves.values()) - own)

    # -- metrics and KV events ------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """The metrics of docs/requests-api.md, with their stable names."""
        pool = self._pool
        total = pool.num_blocks - 1
        in_use_by_group = {}
        for group, group_id in enumerate(self._group_ids):
            pages = {page for tables in self._requests.values() for page in tables[group].pages if page != 0}
            in_use_by_group[group_id] = len(pages)
        return {
            "pages_total": total,
            "pages_free": pool.num_free,
            "pages_in_use": total - pool.num_free,
            "pages_cached": pool.num_cached,
            "pages_cached_free": pool.num_cached_free,
            "requests": len(self._requests),
            "prefix_queries_tokens": self._counters["prefix_queries_tokens"],
            "prefix_hits_tokens": self._counters["prefix_hits_tokens"],
            "evictions": pool._evictions,
            "preemptions": self._counters["preemptions"],
            "pages_in_use_by_group": in_use_by_group,
        }

    def take_events(self) -> list[KVCacheEvent]:
        """The events recorded since the last call, oldest first (``[]`` when events are off)."""
        events, self._events = self._events, []
        return events

    def reset_prefix_cache(self) -> int:
        """Drop the key of every free cached page (they stay free, no ``BlockRemoved``), record
        ``AllBlocksCleared``, and return how many keys were dropped."""
        dropped = self._pool._clear_cached_free()
        if self._events_enabled:
            self._events.append(AllBlocksCleared())
        return dropped

    # -- SPEC 1 core invariants -----------------------------------------------------------------

    def check_invariants(self) -> None:
        """RuntimeError describing the first violated invariant (SPEC 1, contract order).

        A page in two groups' tables; a page count differing from its table references; a free
        page missing from the free list or a referenced one in it; a key-map entry pointing at a
        page that does not hold that key; ``free + in_use + 1 != num_pages``.
        """
        pool = self._pool
        total = pool.num_blocks
        references = [0] * total
        owner: dict[int, int] = {}
        for tables in self._requests.values():
            for group, table in enumerate(tables):
                for page in table.pages:
                    if page == 0:
                        continue
                    if not 0 < page < total:
                        raise RuntimeError(
                            f"group {self._group_ids[group]} holds page {page} outside the pool"
                        )
                    first_group = owner.setdefault(page, group)
                    if first_group != group:
                        raise RuntimeError(
                            f"page {page} is in the tables of groups "
                            f"{self._group_ids[first_group]} and {self._group_ids[group]}"
                        )
                    references[page] += 1
        for page in range(total):
            if pool.ref_count(page) != references[page]:
                raise RuntimeError(
                    f"page {page} has ref count {pool.ref_count(page)} "
                    f"but {references[page]} table references"
                )
        free_list = pool._free_list()
        free_set = set(free_list)
        if len(free_set) != len(free_list) or 0 in free_set:
            raise RuntimeError("the free list holds a page twice or holds the null page")
        for page in range(1, total):
            count = pool.ref_count(page)
            if count == 0 and page not in free_set:
                raise RuntimeError(f"page {page} has count 0 but is missing from the free list")
            if count > 0 and page in free_set:
                raise RuntimeError(f"page {page} has count {count} but is on the free list")
        for key, pages in pool._key_map().items():
            for page in pages:
                if pool._key_held_by(page) != key:
                    raise RuntimeError(f"key map entry {key!r} points at page {page}, which does not hold it")
        in_use = sum(1 for page in range(1, total) if pool.ref_count(page) > 0)
        if pool.num_free + in_use + 1 != total:
            raise RuntimeError(f"accounting: free {pool.num_free} + in use {in_use} + 1 != {total} pages")
