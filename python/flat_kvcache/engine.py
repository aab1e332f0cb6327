"""The page engine (SPEC 4-8), backed by Rust: content hashes, the block pool, and the hybrid
KV cache that keeps full-attention, sliding-window and state groups in one page-id space.

The classes and functions are the native ones from :mod:`flat_kvcache._native`, re-exported
as they are: the engine's per-request calls (``decode_step`` once per request per step) are
hot, and a Python wrapper around each would cost as much as the call itself. The native code
validates every argument. :class:`KVCacheSpec` and :func:`kv_cache_specs` are plain data
shared with the reference (they live in :mod:`flat_kvcache._types`); ``FlatKVCache`` reads the
spec's four fields.

The exact contract (shared with :mod:`flat_kvcache.reference`) is ``docs/engine-api.md`` for the
page-level calls and ``docs/requests-api.md`` for the scheduler-loop API on the same
``FlatKVCache``: requests that own their tokens (``add_request``, ``append_tokens``,
``schedule`` / ``schedule_batch``, ``finish``, ``preempt``), ``block_tables(reqs, out=...)``
writing into caller buffers, admission accounting, ``stats()`` and KV events
(:mod:`flat_kvcache.events`).
"""

from __future__ import annotations

from flat_kvcache import _native
from flat_kvcache._types import KVCacheSpec, kv_cache_specs

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
