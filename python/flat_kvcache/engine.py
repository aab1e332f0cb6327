"""The page engine (SPEC 4-8), backed by Rust: content hashes, the block pool, and the hybrid
KV cache that keeps full-attention, sliding-window and state groups in one page-id space.

The classes and functions are the native ones from :mod:`flat_kvcache._native`, re-exported
as they are: the engine's per-request calls (``decode_step`` once per request per step) are
hot, and a Python wrapper around each would cost as much as the call itself. The native code
validates every argument. :class:`KVCacheSpec` is plain data and lives here; ``FlatKVCache``
reads its four fields.

The exact contract (shared with :mod:`flat_kvcache.reference`) is ``docs/engine-api.md`` for the
page-level calls and ``docs/requests-api.md`` for the scheduler-loop API on the same
``FlatKVCache``: requests that own their tokens (``add_request``, ``append_tokens``,
``schedule`` / ``schedule_batch``, ``finish``, ``preempt``), ``block_tables(reqs, out=...)``
writing into caller buffers, admission accounting, ``stats()`` and KV events
(:mod:`flat_kvcache.events`).
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from dataclasses import dataclass
from typing import SupportsIndex, cast

from flat_kvcache import _native
from flat_kvcache._types import FULL_HISTORY, SLIDING_WINDOW, STATE, PagedCacheGroupSpec

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

hash_page = _native.hash_page
hash_pages = _native.hash_pages
group_key = _native.group_key
fold_hashes = _native.fold_hashes
BlockPool = _native.BlockPool
FlatKVCache = _native.FlatKVCache
PrefixMatch = _native.PrefixMatch

#: The group kinds the engine knows (SPEC 6).
_KINDS = ("full", "sliding_window", "state")


def _int(value: object, name: str) -> int:
    """``value`` as an int (``__index__``, not bool), else ``TypeError`` naming ``name``."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, not bool")
    try:
        return operator.index(cast("SupportsIndex", value))
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None


@dataclass(frozen=True)
class KVCacheSpec:
    """One attention group as the page engine sees it (SPEC 7).

    ``kind`` is ``"full"``, ``"sliding_window"`` or ``"state"``; ``page_size`` (> 0) is tokens
    per page; ``sliding_window`` is an int >= 1 for a sliding group and None otherwise;
    ``group_id`` None means ``f"g{index}"`` by position in the cache.
    """

    kind: str
    page_size: int
    sliding_window: int | None = None
    group_id: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"kind must be one of {', '.join(_KINDS)}; got {self.kind!r}")
        if _int(self.page_size, "page_size") <= 0:
            raise ValueError(f"page_size must be > 0, got {self.page_size}")
        window = self.sliding_window
        if self.kind == "sliding_window":
            if isinstance(window, bool) or not isinstance(window, int) or window < 1:
                raise ValueError(
                    f"sliding_window must be an int >= 1 for a sliding_window group, got {window!r}"
                )
        elif window is not None:
            raise ValueError(f"sliding_window must be None for a {self.kind} group, got {window!r}")
        if self.group_id is not None and not isinstance(self.group_id, str):
            raise TypeError(f"group_id must be a str or None, got {type(self.group_id).__name__}")


def kv_cache_specs(
    group_specs: Iterable[PagedCacheGroupSpec], page_size: int | None = None
) -> list[KVCacheSpec]:
    """Engine specs from the sizing group specs (SPEC 2 -> SPEC 7).

    ``page_size`` defaults to each spec's ``rows_per_page * entry_stride_tokens``. Family
    ``state`` with retention ``full_history`` becomes ``"state"``; retention ``sliding_window``
    becomes ``"sliding_window"`` with its window; anything else ``"full"``. Group ids are kept.
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
