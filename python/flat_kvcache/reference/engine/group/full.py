"""Full-attention groups (SPEC 6): prefix-closed, every page kept."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from flat_kvcache.reference.engine.group.base import GroupManager

__all__ = ["FullAttentionManager"]


class FullAttentionManager(GroupManager):
    """Full attention (SPEC 6): prefix-closed, keeps all history, never reclaims."""

    prefix_closed = True

    def match(self, keys: Sequence[str], lookup: Callable[[str], int | None] | None = None) -> list[int]:
        """Walk the keys left to right and stop at the first miss."""
        find = self.pool.lookup if lookup is None else lookup
        pages = []
        for key in keys:
            page = find(key)
            if page is None:
                break
            pages.append(page)
        return pages
