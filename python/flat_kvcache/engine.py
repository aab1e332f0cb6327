"""The page engine (SPEC 4-8), backed by Rust: content hashes, the block pool, and the hybrid
KV cache that keeps full-attention, sliding-window and state groups in one page-id space.

The classes and functions are the native ones from :mod:`flat_kvcache._native`, re-exported
as they are: the engine's per-request calls (``decode_step`` once per request per step) are
hot, and a Python wrapper around each would cost as much as the call itself. The native code
validates every argument. :class:`KVCacheSpec` and :func:`kv_cache_specs` are plain data
shared with the reference (they live in :mod:`flat_kvcache._types`); ``FlatKVCache`` reads the
spec's four fields.

Two engine classes speak the two protocols, sharing their constructor, the geometry,
``stats()``, KV events, ``reset_prefix_cache()`` and the host tier's transfers; a method of one
protocol is absent from the other class. The exact contracts (shared with
:mod:`flat_kvcache.reference`): ``docs/requests-api.md`` for ``FlatKVCache``, the
scheduler-loop API of requests that own their tokens, named by the slot ``add_request`` /
``admit`` return (``schedule``, ``append_tokens``, ``reserve``, ``finish``, ``preempt`` and
``block_tables`` each take an array of slots; persistent rows, where row ``s`` is slot ``s``;
admission accounting), and ``docs/engine-api.md`` for ``PageCache``, the page-level API of
engines that keep their own request state (``match_prefix``, ``claim``, ``acquire``,
``register``, ``reclaim``, ``free``, ``prefill_first_chunk``, ``prefill_chunk``,
``decode_step``).
"""

from __future__ import annotations

from flat_kvcache import _native
from flat_kvcache._types import KVCacheSpec, kv_cache_specs

__all__ = [
    "BlockPool",
    "FlatKVCache",
    "KVCacheSpec",
    "PageCache",
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
PageCache = _native.PageCache
PrefixMatch = _native.PrefixMatch
