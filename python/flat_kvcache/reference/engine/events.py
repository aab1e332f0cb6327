"""KV events (docs/requests-api.md): what the cache records, and the calls that read and clear it.

The coordinator records a ``BlockStored`` per group that a register call newly caches, and a
``BlockRemoved`` per group whose keys an allocation evicted; :class:`KVEvents` hands them out
and records what ``reset_prefix_cache`` drops.
The event classes themselves are :mod:`flat_kvcache.events`.
"""

from __future__ import annotations

from flat_kvcache._types import KVCacheSpec
from flat_kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from flat_kvcache.reference.engine._args import HASH_HEX_LEN
from flat_kvcache.reference.engine.group import GroupManager
from flat_kvcache.reference.engine.hash import fold_hashes
from flat_kvcache.reference.engine.policy import ReuseEvidence
from flat_kvcache.reference.engine.pool import BlockPool
from flat_kvcache.reference.engine.prefixes import PathCounts
from flat_kvcache.reference.engine.table import Table, TokenState

__all__ = ["KVEvents", "removed_events", "stored_event"]


def removed_events(evicted_keys: list[str]) -> list[BlockRemoved]:
    """One ``BlockRemoved`` per group among ``evicted_keys``, groups in the order they first appear,
    hashes in eviction order (a key is the content hash then the group index in 8 hex digits)."""
    by_group: dict[int, list[bytes]] = {}
    for key in evicted_keys:
        group = int(key[HASH_HEX_LEN:], 16)
        by_group.setdefault(group, []).append(bytes.fromhex(key[:HASH_HEX_LEN]))
    return [BlockRemoved(hashes, group) for group, hashes in by_group.items()]


def stored_event(
    pool: BlockPool,
    spec: KVCacheSpec,
    manager: GroupManager,
    table: Table,
    stored: list[tuple[int, str]],
    hashes: list[str],
    first: int,
    state: TokenState | None,
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
            held = pool._key_held_by(page) if page != 0 else None
            if held is not None:
                parent = bytes.fromhex(held[:HASH_HEX_LEN])
    tokens: list[int] = []
    if state is not None:
        for slot, _ in stored:
            tokens.extend(state.tokens[slot * manager.page_size : (slot + 1) * manager.page_size])
    return BlockStored(
        block_hashes=[bytes.fromhex(key[:HASH_HEX_LEN]) for _, key in stored],
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=spec.page_size,
        group_index=manager.index,
        group_kind=spec.kind,
        sliding_window=spec.sliding_window,
        extra_keys=list(state.extra_keys) if state is not None else [],
    )


class KVEvents:
    """``take_events`` and ``reset_prefix_cache``; the state they use is the coordinator's."""

    _events: list[KVCacheEvent]
    _events_enabled: bool
    _pool: BlockPool
    _prefixes: PathCounts
    _evidence: ReuseEvidence

    def take_events(self) -> list[KVCacheEvent]:
        """The events recorded since the last call, oldest first (``[]`` when events are off)."""
        events, self._events = self._events, []
        return events

    def reset_prefix_cache(self) -> int:
        """Drop the key of every free cached page (they stay free, in place) and return how many
        keys were dropped; pages held by requests keep theirs.

        The events say exactly what changed: ``AllBlocksCleared`` when no request held a
        cached page (no key is left), else one ``BlockRemoved`` per group of dropped keys
        (groups in first-appearance order, hashes in free-list order), nothing if none was.
        """
        pinned = self._pool.num_cached_pinned
        dropped = self._pool._clear_cached_free()
        for key in dropped:
            # Every free page lost its key already: only the paths are forgotten.
            self._prefixes.forget(key, lambda _hash: None)
            self._evidence.forget_boundary(key)
        if self._events_enabled:
            if pinned == 0:
                self._events.append(AllBlocksCleared())
            else:
                self._events.extend(removed_events(dropped))
        return len(dropped)
