"""Linear-attention / mamba state groups (SPEC 6): a window of 2 tokens, snapshots at boundaries."""

from __future__ import annotations

from flat_kvcache._types import KVCacheSpec
from flat_kvcache.reference.engine.group.sliding import SlidingWindowManager

__all__ = ["STATE_WINDOW", "StateManager"]

#: The window a state group behaves as: the page of token ``n - 1`` holds the live state.
STATE_WINDOW = 2


class StateManager(SlidingWindowManager):
    """Linear attention / mamba state (SPEC 6): a sliding window with ``W = 2``.

    The page of token ``n - 1`` holds the live state; a match is the rightmost cached snapshot
    page. Only the final page of a range that ends exactly on a page boundary is registered:
    interior boundaries never received a state write.
    """

    #: SPEC 13.4: a range's state lives in the page of its last token only.
    sparse = True

    @staticmethod
    def window_of(spec: KVCacheSpec) -> int:
        """Always 2: the state after token ``n - 1`` is all a resumed request needs."""
        return STATE_WINDOW

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
