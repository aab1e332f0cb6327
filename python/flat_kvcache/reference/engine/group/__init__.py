"""The group managers (SPEC 6), one module per engine kind, and the kind -> manager table."""

from __future__ import annotations

from flat_kvcache._types import CHUNKED, FULL, SLIDING, STATE, KVCacheSpec
from flat_kvcache.reference.engine.group.base import GroupManager
from flat_kvcache.reference.engine.group.chunked import ChunkedLocalManager
from flat_kvcache.reference.engine.group.full import FullAttentionManager
from flat_kvcache.reference.engine.group.sliding import SlidingWindowManager
from flat_kvcache.reference.engine.group.state import StateManager
from flat_kvcache.reference.engine.pool import BlockPool

__all__ = [
    "ChunkedLocalManager",
    "FullAttentionManager",
    "GroupManager",
    "SlidingWindowManager",
    "StateManager",
    "new_manager",
]

#: The manager class of each engine kind.
_MANAGER_OF_KIND: dict[str, type[GroupManager]] = {
    FULL: FullAttentionManager,
    SLIDING: SlidingWindowManager,
    STATE: StateManager,
    CHUNKED: ChunkedLocalManager,
}


def new_manager(index: int, spec: KVCacheSpec, base_page_size: int, pool: BlockPool) -> GroupManager:
    """The manager of group ``index`` for ``spec`` (its kind was checked by ``KVCacheSpec``)."""
    return _MANAGER_OF_KIND[spec.kind](index, spec, base_page_size, pool)
