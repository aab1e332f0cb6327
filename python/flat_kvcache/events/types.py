"""The KV-cache event types (docs/requests-api.md, "KV events").

Plain frozen dataclasses shared by the native engine and the reference, so both produce values
that compare equal. The native module builds them by name from :mod:`flat_kvcache.events`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["AllBlocksCleared", "BlockRemoved", "BlockStored", "KVCacheEvent"]


@dataclass(frozen=True)
class BlockStored:
    """Pages of one group newly cached by one register call (slot order)."""

    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    group_index: int
    group_kind: str
    sliding_window: int | None
    extra_keys: list[str] = field(default_factory=list)
    #: Where the pages live, as vLLM's ``medium``: ``"GPU"`` (device pool) or ``"CPU"`` (the
    #: host-memory tier; such an event has no parent, tokens or extra keys).
    medium: str = "GPU"


@dataclass(frozen=True)
class BlockRemoved:
    """Cached pages of one group whose keys were dropped because the pool handed them out again."""

    block_hashes: list[bytes]
    group_index: int
    #: ``"GPU"`` (device pool) or ``"CPU"`` (a host-tier page evicted by a store).
    medium: str = "GPU"


@dataclass(frozen=True)
class AllBlocksCleared:
    """No page holds a key any more (``reset_prefix_cache`` when no request held a cached page)."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
