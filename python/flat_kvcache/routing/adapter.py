"""What one worker advertises to the router's index, kept from its KV events (docs/routing.md).

A worker resumes a prompt at a boundary ``t`` only when every full-attention page of ``[0, t)`` is
cached and, for a model with a state group, a state checkpoint sits at ``t`` (SPEC 13.6). The
router's index (Dynamo's radix tree) only counts blocks consecutive from the root, so
:class:`WorkerAdapter` advertises exactly the resumable structure:

- a *plain* block for every cached full-attention page whose whole chain from the root is cached
  (a page whose ancestor was evicted is withdrawn until that ancestor is cached again);
- for a state model, a *marked* block beside each plain block at a checkpoint boundary
  (``t`` a multiple of the grain ``G``) whose checkpoint is cached: same parent, tokens hash
  ``tokens_hash ^ MARK_TOKENS``, block hash ``block_hash ^ MARK_BLOCK``. It is withdrawn when the
  checkpoint or any page of its chain goes.

Tokens hash of a page: :func:`page_tokens_hashes` over its token ids (and the request's extra
keys). Block hash: the first 8 bytes of the page's own chained content hash. A checkpoint's key
is the fold of the ``G / P`` page hashes that end at its boundary (``fold_hashes``), so the
adapter finds the boundary of a checkpoint from the page chain alone.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from flat_kvcache import fold_hashes
from flat_kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored

__all__ = ["MARK_BLOCK", "MARK_TOKENS", "WorkerAdapter", "block_u64", "page_tokens_hashes"]

#: XORed into a page's tokens hash / block hash to name its marked (resumable boundary) block.
MARK_TOKENS = 0x9E37_79B9_7F4A_7C15
MARK_BLOCK = 0xD6E8_FEB8_6659_FD93


def block_u64(content_hash: bytes) -> int:
    """A page's block hash for the index: the first 8 bytes of its content hash, little-endian."""
    return int.from_bytes(content_hash[:8], "little")


def page_tokens_hashes(tokens: Any, page_size: int, extra_keys: Sequence[str] = ()) -> list[int]:
    """A u64 per full page of ``tokens``: blake2b (8 bytes) of the extra keys (each as its
    length, then its UTF-8 bytes), then the page's token ids as little-endian u32. A trailing
    partial page gets none."""
    array = np.ascontiguousarray(np.asarray(tokens, dtype=np.dtype("<u4")))
    pages = len(array) // page_size
    seed = hashlib.blake2b(digest_size=8)
    for key in extra_keys:  # each key length-prefixed, so no two lists of keys read the same
        encoded = key.encode()
        seed.update(len(encoded).to_bytes(8, "little") + encoded)
    seed.update(b"\xff" * 8)
    data = array[: pages * page_size].tobytes()
    width = 4 * page_size
    out = []
    for index in range(pages):
        hasher = seed.copy()
        hasher.update(data[index * width : (index + 1) * width])
        out.append(int.from_bytes(hasher.digest(), "little"))
    return out


def _drop(counts: dict[bytes, int], key: bytes) -> bool:
    """One copy of ``key`` gone; True when it was the last (an unknown key is ignored: False)."""
    left = counts.get(key, 0) - 1
    if left > 0:
        counts[key] = left
        return False
    counts.pop(key, None)
    return left == 0


class WorkerAdapter:
    """One worker's view for the index: consumes its events, returns block operations.

    ``full_group`` / ``state_group`` are the event ``group_index`` of the full-attention group and
    of the state group (None: attention only); ``page_size`` is the full group's page size (which
    must be the model's base page) and ``grain`` the state group's page size.
    """

    def __init__(
        self, page_size: int, full_group: int, state_group: int | None = None, grain: int | None = None
    ):
        if state_group is not None and (grain is None or grain % page_size):
            raise ValueError(f"grain must be a multiple of page_size {page_size}, got {grain}")
        self.page_size = page_size
        self.full_group = full_group
        self.state_group = state_group
        self.pages_per_grain = 1 if grain is None else grain // page_size
        # Content facts, kept for every page ever seen (a hash names its whole prefix).
        self.parent: dict[bytes, bytes | None] = {}
        self.depth: dict[bytes, int] = {}
        self.tokens_hash: dict[bytes, int] = {}
        self.children: dict[bytes | None, set[bytes]] = {}
        self.key_of: dict[bytes, bytes] = {}  # boundary page -> its checkpoint's key
        self.page_of_key: dict[bytes, bytes] = {}
        # What the worker holds, and what is advertised.
        # Copies held per key: two requests that computed the same page at once each register a
        # copy (a BlockStored each), and each copy's eviction is a BlockRemoved of its own.
        self.held: dict[bytes, int] = {}
        self.checkpoints: dict[bytes, int] = {}
        self.advertised: set[bytes] = set()
        self.marked: set[bytes] = set()

    # --- events -> operations -----------------------------------------------------------------

    def apply(self, events: Iterable[Any]) -> list[tuple[str, Any]]:
        """Take the worker's events in order; return the index operations they cause, in order."""
        ops: list[tuple[str, Any]] = []
        for event in events:
            if isinstance(event, AllBlocksCleared):
                self.held.clear()
                self.checkpoints.clear()
                self.advertised.clear()
                self.marked.clear()
                ops.append(("cleared", None))
                continue
            if getattr(event, "medium", "GPU") != "GPU":
                raise ValueError("the kv router does not model a host-memory tier (a CPU-medium event)")
            if isinstance(event, BlockStored):
                if event.group_index == self.full_group:
                    self._pages_stored(event, ops)
                elif event.group_index == self.state_group:
                    for key in event.block_hashes:
                        self.checkpoints[key] = self.checkpoints.get(key, 0) + 1
                        page = self.page_of_key.get(key)
                        if page is not None and page in self.advertised and page not in self.marked:
                            self._mark(page, ops)
                else:
                    raise ValueError(
                        f"the kv router cannot model group {event.group_index} ({event.group_kind})"
                    )
            elif isinstance(event, BlockRemoved):
                if event.group_index == self.full_group:
                    gone: list[int] = []
                    for page in event.block_hashes:
                        if _drop(self.held, page) and page in self.advertised:
                            self._withdraw(page, gone)
                    if gone:
                        ops.append(("removed", gone))
                elif event.group_index == self.state_group:
                    gone = []
                    for key in event.block_hashes:
                        page = self.page_of_key.get(key)
                        if _drop(self.checkpoints, key) and page is not None and page in self.marked:
                            self.marked.discard(page)
                            gone.append(block_u64(page) ^ MARK_BLOCK)
                    if gone:
                        ops.append(("removed", gone))
                else:
                    raise ValueError(f"the kv router cannot model group {event.group_index}")
            else:
                raise TypeError(f"not a KV event: {event!r}")
        return ops

    def _pages_stored(self, event: BlockStored, ops: list[tuple[str, Any]]) -> None:
        size = self.page_size
        tokens = event.token_ids
        if len(tokens) != size * len(event.block_hashes):
            raise ValueError("the kv router needs token ids in BlockStored events (token-level requests)")
        hashes = page_tokens_hashes(tokens, size, event.extra_keys)
        parent = event.parent_block_hash
        for page, tokens_hash in zip(event.block_hashes, hashes, strict=True):
            if page not in self.depth:
                self.parent[page] = parent
                self.depth[page] = 1 if parent is None else self.depth[parent] + 1
                self.tokens_hash[page] = tokens_hash
                self.children.setdefault(parent, set()).add(page)
                self._learn_key(page)
            self.held[page] = self.held.get(page, 0) + 1
            if page not in self.advertised and (parent is None or parent in self.advertised):
                self._advertise(page, ops)
            parent = page

    def _learn_key(self, page: bytes) -> None:
        """Record the checkpoint key of a page at a grain boundary (the fold of its last G/P pages)."""
        if self.state_group is None or self.depth[page] % self.pages_per_grain:
            return
        run = [page]
        while len(run) < self.pages_per_grain:
            above = self.parent[run[-1]]
            assert above is not None  # depth >= pages_per_grain
            run.append(above)
        run.reverse()
        key = bytes.fromhex(fold_hashes([h.hex() for h in run], 0, self.pages_per_grain)[0])
        self.key_of[page] = key
        self.page_of_key[key] = page

    # --- advertising --------------------------------------------------------------------------

    def _plain(self, page: bytes, ops: list[tuple[str, Any]]) -> None:
        parent = self.parent[page]
        parent_u64 = None if parent is None else block_u64(parent)
        block = (block_u64(page), self.tokens_hash[page])
        last = ops[-1] if ops else None
        # Extend the previous stored run when this page continues it.
        if (
            last is not None
            and last[0] == "stored"
            and parent is not None
            and last[1][1][-1][0] == parent_u64
        ):
            last[1][1].append(block)
        else:
            ops.append(("stored", (parent_u64, [block])))

    def _mark(self, page: bytes, ops: list[tuple[str, Any]]) -> None:
        parent = self.parent[page]
        parent_u64 = None if parent is None else block_u64(parent)
        ops.append(
            ("stored", (parent_u64, [(block_u64(page) ^ MARK_BLOCK, self.tokens_hash[page] ^ MARK_TOKENS)]))
        )
        self.marked.add(page)

    def _advertise(self, page: bytes, ops: list[tuple[str, Any]]) -> None:
        """Advertise ``page`` (its parent is advertised) and every held page now reachable below it."""
        stack = [page]
        while stack:
            node = stack.pop()
            self.advertised.add(node)
            self._plain(node, ops)
            key = self.key_of.get(node)
            if key is not None and key in self.checkpoints:
                self._mark(node, ops)
            stack.extend(
                sorted(c for c in self.children.get(node, ()) if c in self.held and c not in self.advertised)
            )

    def _withdraw(self, page: bytes, gone: list[int]) -> None:
        """Withdraw ``page`` and every advertised page below it (and their marks), deepest first."""
        order: list[bytes] = []
        stack = [page]
        while stack:
            node = stack.pop()
            order.append(node)
            stack.extend(c for c in self.children.get(node, ()) if c in self.advertised)
        for node in reversed(order):
            self.advertised.discard(node)
            if node in self.marked:
                self.marked.discard(node)
                gone.append(block_u64(node) ^ MARK_BLOCK)
            gone.append(block_u64(node))
