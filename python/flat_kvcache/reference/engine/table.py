"""What the cache keeps per request: one page table per group, and a token-level request's tokens."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Table", "TokenState"]


@dataclass
class Table:
    """One request's pages in one group (SPEC 6).

    Absolute: slot ``i`` covers tokens ``[i*P, (i+1)*P)``; a page that slid out of the window
    becomes a hole (0) and the table never shrinks. ``tail_avail`` is the number of free token
    slots in the last page.
    """

    pages: list[int] = field(default_factory=list)
    tail_avail: int = 0


@dataclass
class TokenState:
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
    #: The branch point (SPEC 13.5c): a multiple of the state grain beyond the hit where the
    #: prompt left the cached path; a chunk ends there to write a checkpoint. 0 if none.
    branch: int = 0
    #: The prompt's length: its end is never a state checkpoint, and beyond it decode keeps
    #: only its latest (SPEC 13.5b, d).
    prompt_len: int = 0
    #: The last schedule's ``(n, read page, write page)`` of the one state group, if any.
    step: tuple[int, int, int] | None = None
    #: The latest checkpoint decode wrote, ``(page, key)`` (SPEC 13.5d keeps one).
    decode_checkpoint: tuple[int, str] | None = None
    #: SPEC 13.8b (reuse, arena storage): the eviction stamp of the request's first decode
    #: checkpoint once free, the date every later one takes (rewriting it a grain on is no use
    #: of the cache), and whether the latest one was dated yet.
    decode_since: int | None = None
    decode_dated: bool = False
    #: The checkpoints written while computing the prompt, ``(page, key, tokens)``, for the
    #: reuse policy at finish (SPEC 13.8; empty under lru).
    prompt_checkpoints: list[tuple[int, str, int]] = field(default_factory=list)
