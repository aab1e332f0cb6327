"""vLLM's KV cache events (``kv_events_config.enable_kv_cache_events``) for FlatKVCacheManager.

vLLM's block pool records three kinds of event, which its scheduler takes once per step
(``kv_cache_manager.take_events()``) and publishes as one ``KVEventBatch``:

- ``BlockStored``: one per (``cache_full_blocks`` call, group) whose range of newly full blocks
  is not empty: the hashes of the range's non-null blocks (``request.block_hashes``, as
  ``maybe_convert_block_hash`` gives them), the parent (the hash of the block before the range,
  null or not), the tokens of the whole range (null blocks' included), the group's block size,
  LoRA, medium, per-block extra keys, the group index and its spec kind and window. A mamba
  table's range holds null blocks between its states: their tokens are sent, their hashes are not
  (a range of null blocks alone would be sent with no hash, as vLLM's pool would).
  With ``kv_cache_report_mode="full"`` (a request's ``extra_args``) a prefix hit also stores the
  hit's blocks again, per group.
- ``BlockRemoved``: one per key a block loses when the pool hands the block out again
  (``get_new_blocks``: groups in index order, each group's blocks in the order they are taken).
- ``AllBlocksCleared``: a successful ``reset_prefix_cache``.

The engine's own KV events (``PageCache(enable_kv_events=True)``) cannot be turned into these one
for one: its evictions are one event per (allocation, key group), which loses the order in which
one group's allocation evicts keys of several groups (a hybrid's pages serve every group; vLLM
sends one removal per key in the order the blocks are taken); its stores carry no tokens at page
level and are recorded only for a register call that keyed a page (vLLM's pool would also send a
range of null blocks alone); and a hash that is not 32 bytes is folded into its SHA-256, which
cannot be turned back into vLLM's hash object. So the adapter records vLLM's events at the
engine calls that cause them: a store where it registers pages (the same range, the same tables,
so the same null blocks), a removal where ``acquire`` hands out a page that holds a key (the page
ids it returns are vLLM's, in vLLM's order, and this log knows which key each page was given), a
clear where the prefix cache is reset. Nothing here runs unless events are enabled.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllm.distributed.kv_events import (  # type: ignore[import-not-found]
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
)
from vllm.v1.core.kv_cache_utils import (  # type: ignore[import-not-found]
    generate_block_hash_extra_keys,
    maybe_convert_block_hash,
    to_event_extra_keys,
)
from vllm.v1.kv_cache_interface import (  # type: ignore[import-not-found]
    get_kv_cache_spec_kind,
    get_kv_cache_spec_sliding_window,
)


class VllmEventLog:
    """vLLM's event queue for one manager, and which key each cached page holds."""

    __slots__ = ("_block_sizes", "_kinds", "_more_keys", "_page_keys", "_queue")

    def __init__(self, kv_cache_config: Any) -> None:
        groups = kv_cache_config.kv_cache_groups
        # As vLLM's KVCacheManager annotates its stores: (spec kind, sliding window) per group.
        self._kinds = [
            (get_kv_cache_spec_kind(g.kv_cache_spec).value, get_kv_cache_spec_sliding_window(g.kv_cache_spec))
            for g in groups
        ]
        self._block_sizes = [g.kv_cache_spec.block_size for g in groups]
        self._queue: list[Any] = []
        # page id -> the key it holds, (vLLM's block hash, group): one tuple per page (a list
        # each would be one more object for the garbage collector to walk), and any further key
        # a page was given, in order, in ``_more_keys`` (vLLM's pool would keep it; never seen)
        self._page_keys: dict[int, tuple[Any, int]] = {}
        self._more_keys: dict[int, list[tuple[Any, int]]] = {}

    def take(self) -> list[Any]:
        events = self._queue
        self._queue = []
        return events

    def _store(
        self, request: Any, group: int, hashes: list[Any], start: int, end: int, extra: list[Any]
    ) -> None:
        size = self._block_sizes[group]
        lora = request.lora_request
        kind, window = self._kinds[group]
        parent = maybe_convert_block_hash(request.block_hashes[start - 1]) if start else None
        self._queue.append(
            BlockStored(
                block_hashes=hashes,
                parent_block_hash=parent,
                token_ids=request.all_token_ids[start * size : end * size],
                block_size=size,
                lora_id=lora.adapter_id if lora else None,
                medium=MEDIUM_GPU,
                lora_name=lora.name if lora else None,
                extra_keys=to_event_extra_keys(extra),
                group_idx=group,
                kv_cache_spec_kind=kind,
                kv_cache_spec_sliding_window=window,
                session_id=request.session_id,
            )
        )

    def stored(
        self,
        request: Any,
        tables: Sequence[Sequence[Any]],
        start: int,
        end: int,
        masks: Sequence[Sequence[bool] | None] | None = None,
    ) -> None:
        """Slots ``[start, end)`` of every group's table became cached (vLLM's ``cache_blocks``):
        one ``BlockStored`` per group, null blocks' hashes left out, and so are the blocks a
        group's mask (``masks[group]`` over ``[start, end)``; sparse retention) leaves out. A
        slot's hash and extra keys are the same in every group (one block size), so they are
        worked out once per slot."""
        raw = request.block_hashes
        page_keys = self._page_keys
        size = self._block_sizes[0]
        converted = [maybe_convert_block_hash(raw[slot]) for slot in range(start, end)]
        extra_keys = []
        mm_index = 0  # a search cursor over the request's multimodal inputs, only ever behind
        for slot in range(start, end):
            keys, mm_index = generate_block_hash_extra_keys(request, slot * size, (slot + 1) * size, mm_index)
            extra_keys.append(keys)
        for group, blocks in enumerate(tables):
            hashes = []
            extra = []
            mask = None if masks is None else masks[group]
            for i, block in enumerate(blocks[start:end]):
                if block.is_null or (mask is not None and not mask[i]):
                    continue
                hashes.append(converted[i])
                extra.append(extra_keys[i])
                key = (raw[start + i], group)
                held = page_keys.setdefault(block.block_id, key)
                if held != key:
                    more = self._more_keys.setdefault(block.block_id, [])
                    if key not in more:  # vLLM's pool keeps a block's key once
                        more.append(key)
            self._store(request, group, hashes, start, end, extra)

    def hit(self, request: Any, lengths: Sequence[int]) -> None:
        """A prefix hit reported in full (``kv_cache_report_mode="full"``): per group that holds
        hit blocks, their hashes from slot 0 (null blocks included, as vLLM sends them)."""
        raw = request.block_hashes
        for group, length in enumerate(lengths):
            if not length:
                continue
            size = self._block_sizes[group]
            extra = []
            mm_index = 0
            for slot in range(length):
                keys, mm_index = generate_block_hash_extra_keys(
                    request, slot * size, (slot + 1) * size, mm_index
                )
                extra.append(keys)
            hashes = [maybe_convert_block_hash(raw[slot]) for slot in range(length)]
            self._store(request, group, hashes, 0, length, extra)

    def handed_out(self, page_ids: Sequence[int]) -> None:
        """Pages the pool just handed out again, in vLLM's order: the keys they held are gone."""
        page_keys = self._page_keys
        if not page_keys:
            return
        queue = self._queue
        for page in page_ids:
            first = page_keys.pop(page, None)
            if first is None:
                continue
            keys = [first, *self._more_keys.pop(page, ())] if self._more_keys else [first]
            for key, group in keys:
                queue.append(
                    BlockRemoved(
                        block_hashes=[maybe_convert_block_hash(key)], medium=MEDIUM_GPU, group_idx=group
                    )
                )

    def cleared(self) -> None:
        """The prefix cache was reset (no page held): every key is gone."""
        self._page_keys.clear()
        self._more_keys.clear()
        self._queue.append(AllBlocksCleared())
