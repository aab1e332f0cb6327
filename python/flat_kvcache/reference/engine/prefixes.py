"""Whole hybrid prefixes (SPEC 13.8, the ``reuse`` policy with one state group).

A prompt resumes at a boundary ``t`` only while every full-attention page of ``[0, t)`` and the
state checkpoint at ``t`` are cached, so a cached full-attention page on the path of no kept
checkpoint can never be hit. :class:`PathCounts` remembers, for every checkpoint a finished
request left in the cache, its path (the base-page hashes of ``[0, t)``) and, per base-page
hash, how many remembered paths hold it; the engine drops the key of a free full-attention page
no path holds, at a request's finish and when a checkpoint leaves the cache.

This counts every whole path per hash, the plain form of the rule. The native ``prefixes.rs``
keeps the paths as a radix tree instead (one comparison per page, no per-page hash-map work);
the held hashes and the order of ``on_unheld`` are the same, which the native == reference
tests check event for event.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["PathCounts"]


class PathCounts:
    """The remembered checkpoints' paths and, per base-page hash, how many paths hold it."""

    def __init__(self) -> None:
        self._paths: dict[str, Sequence[str]] = {}
        self._holders: dict[str, int] = {}

    def remember(self, key: str, hashes: Sequence[str], length: int) -> bool:
        """Remember checkpoint ``key`` with the path ``hashes[:length]``; a key already
        remembered keeps its first path. Returns whether it was added."""
        if key in self._paths:
            return False
        path = hashes[:length]
        for page_hash in path:
            self._holders[page_hash] = self._holders.get(page_hash, 0) + 1
        self._paths[key] = path
        return True

    def forget(self, key: str, on_unheld: Callable[[str], None]) -> None:
        """Forget checkpoint ``key``'s path; ``on_unheld`` gets each hash no remembered path
        holds any more, in path order. Nothing happens for a key not remembered."""
        path = self._paths.pop(key, None)
        if path is None:
            return
        for page_hash in path:
            self._holders[page_hash] -= 1
            if self._holders[page_hash] == 0:
                del self._holders[page_hash]
                on_unheld(page_hash)

    def holds(self, page_hash: str) -> bool:
        """Whether some remembered path holds ``page_hash``."""
        return page_hash in self._holders

    def remembers(self, key: str) -> bool:
        """Whether checkpoint ``key`` is remembered."""
        return key in self._paths

    def __len__(self) -> int:
        return len(self._paths)
