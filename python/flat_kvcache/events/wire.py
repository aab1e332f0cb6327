"""vLLM's wire layouts for KV-event batches.

:func:`encode_event_batch` writes a batch the way vLLM's ``ZmqEventPublisher`` does
(``vllm/distributed/kv_events.py``): msgspec's MessagePack encoding of ``KVEventBatch``, a
struct declared ``array_like=True, omit_defaults=True`` holding ``ts, events,
data_parallel_rank``, whose events are structs declared ``omit_defaults=True, tag=True`` (the
tag is the class name). Two event layouts exist because vLLM changed its encoding:

``layout="array"`` (the default; vLLM up to 0.23 and the consumers written for it)
    The events are ``array_like=True`` too: an event is an array whose first element is its
    class name, then every field in declaration order. msgspec ignores ``omit_defaults`` for
    array-like structs (a msgspec limitation): fields equal to their default, trailing ones
    included, are still written, so every ``BlockStored`` has 11 fields after its tag and a
    batch always has 3 elements (``data_parallel_rank`` nil when None). Decoders accept a
    shorter array (missing trailing fields take their defaults), so this stays readable by
    consumers built for older vLLM field lists. The bytes are those of vLLM 0.23.0.
``layout="map"`` (vLLM after 0.23, which moved its events to tagged maps)
    The batch is still the positional ``[ts, events, data_parallel_rank]``; each event is a
    map whose first key is ``"type"`` (the class name), then its fields by name in
    declaration order. Here ``omit_defaults`` applies: a field equal to its default (only
    ``kv_cache_spec_sliding_window`` None, for full and state groups) is left out, and so are
    the fields vLLM added later that have no counterpart here (``locality``, ``ownership``,
    ``session_id``, ``lookahead_token_ids``, all None). msgspec sizes a struct's map header
    by its declared fields: vLLM 0.33's ``BlockStored`` declares 15 (16 entries with the
    tag), so its header is the 16-bit form even for 11 entries; this module writes it the
    same way, so the bytes are those of vLLM 0.33.0. Decoders read either header.

vLLM's fields, in its declaration order, and what this module puts in them:

==================================  =====================================================
``BlockStored`` field (vLLM)        value written
==================================  =====================================================
``block_hashes``                    :attr:`BlockStored.block_hashes`: 32-byte ``bin``
                                    each, or with ``int_block_hashes=True`` the low 64
                                    bits of the big-endian hash as an int (vLLM's
                                    ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` convention)
``parent_block_hash``               :attr:`BlockStored.parent_block_hash`, converted the
                                    same way (nil at slot 0)
``token_ids``                       :attr:`BlockStored.token_ids`
``block_size``                      :attr:`BlockStored.block_size` (the group page size)
``lora_id``                         nil (a LoRA adapter reaches the hash as an extra key)
``medium``                          :attr:`BlockStored.medium` (``"GPU"``/``"CPU"``)
``lora_name``                       nil
``extra_keys`` (default nil)        one entry per block, as vLLM sends it: the event's
                                    :attr:`BlockStored.extra_keys` as an array of str, or
                                    nil when it has none (the same keys hash every page)
``group_idx`` (default nil)         :attr:`BlockStored.group_index`
``kv_cache_spec_kind`` (nil)        ``group_kind`` in vLLM's ``KVCacheSpecKind`` words:
                                    full -> ``"full_attention"``, sliding_window ->
                                    ``"sliding_window"``, state -> ``"mamba"``
``kv_cache_spec_sliding_window``    :attr:`BlockStored.sliding_window` (nil for full and
(default nil)                       state groups)
==================================  =====================================================

``BlockRemoved`` is ``block_hashes, medium, group_idx``; ``AllBlocksCleared`` has no
fields. ``ts`` is a float64.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Literal

from flat_kvcache._types import LAYER_KINDS
from flat_kvcache.events.pack import WideMap, packb
from flat_kvcache.events.types import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent

__all__ = ["MEDIUM_GPU", "VLLM_SPEC_KINDS", "Layout", "encode_event_batch", "int_field"]

#: The two event layouts (see the module docstring).
Layout = Literal["array", "map"]

#: vLLM's ``medium`` for pages in device memory (``MEDIUM_GPU``).
MEDIUM_GPU = "GPU"

#: Our group kinds in vLLM's ``KVCacheSpecKind`` words (from the one kind table, ``LAYER_KINDS``).
VLLM_SPEC_KINDS = {row.kind: row.event_kind for row in LAYER_KINDS}


_U64 = (1 << 64) - 1


def _block_hash(value: object, int_block_hashes: bool, name: str) -> bytes | int:
    if not isinstance(value, bytes):
        raise TypeError(f"{name} must be bytes, got {type(value).__name__}")
    return int.from_bytes(value, "big") & _U64 if int_block_hashes else value


def _block_hashes(values: object, int_block_hashes: bool, name: str) -> list[bytes | int]:
    if not isinstance(values, list | tuple):
        raise TypeError(f"{name} must be a list of bytes, got {type(values).__name__}")
    return [_block_hash(value, int_block_hashes, f"{name}[{i}]") for i, value in enumerate(values)]


def int_field(value: object, name: str) -> int:
    """``value`` if it is an int (not a bool); a TypeError naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    return value


def _stored_fields(event: BlockStored, int_block_hashes: bool, where: str) -> list[tuple[str, object, bool]]:
    """``(name, value, is_default)`` for vLLM's ``BlockStored`` fields, in its declaration order."""
    hashes = _block_hashes(event.block_hashes, int_block_hashes, f"{where}.block_hashes")
    parent = (
        None
        if event.parent_block_hash is None
        else _block_hash(event.parent_block_hash, int_block_hashes, f"{where}.parent_block_hash")
    )
    if not isinstance(event.token_ids, list | tuple):
        raise TypeError(f"{where}.token_ids must be a list of ints, got {type(event.token_ids).__name__}")
    tokens = [int_field(token, f"{where}.token_ids[{i}]") for i, token in enumerate(event.token_ids)]
    if event.group_kind not in VLLM_SPEC_KINDS:
        raise ValueError(
            f"{where}.group_kind must be one of {', '.join(VLLM_SPEC_KINDS)}, got {event.group_kind!r}"
        )
    window = event.sliding_window
    if window is not None:
        window = int_field(window, f"{where}.sliding_window")
    if isinstance(event.extra_keys, str) or not isinstance(event.extra_keys, list | tuple):
        raise TypeError(f"{where}.extra_keys must be a list of str, got {type(event.extra_keys).__name__}")
    for i, key in enumerate(event.extra_keys):
        if not isinstance(key, str):
            raise TypeError(f"{where}.extra_keys[{i}] must be a str, got {type(key).__name__}")
    per_block = list(event.extra_keys) if event.extra_keys else None
    return [
        ("block_hashes", hashes, False),
        ("parent_block_hash", parent, False),
        ("token_ids", tokens, False),
        ("block_size", int_field(event.block_size, f"{where}.block_size"), False),
        ("lora_id", None, False),
        ("medium", event.medium, False),
        ("lora_name", None, False),
        ("extra_keys", [per_block] * len(hashes), False),
        ("group_idx", int_field(event.group_index, f"{where}.group_index"), False),
        ("kv_cache_spec_kind", VLLM_SPEC_KINDS[event.group_kind], False),
        ("kv_cache_spec_sliding_window", window, window is None),
    ]


def _event_fields(event: object, int_block_hashes: bool, where: str) -> list[tuple[str, object, bool]]:
    if isinstance(event, BlockStored):
        return _stored_fields(event, int_block_hashes, where)
    if isinstance(event, BlockRemoved):
        hashes = _block_hashes(event.block_hashes, int_block_hashes, f"{where}.block_hashes")
        return [
            ("block_hashes", hashes, False),
            ("medium", event.medium, False),
            ("group_idx", int_field(event.group_index, f"{where}.group_index"), False),
        ]
    if isinstance(event, AllBlocksCleared):
        return []
    raise TypeError(
        f"{where} must be a BlockStored, BlockRemoved or AllBlocksCleared, got {type(event).__name__}"
    )


def _as_array(tag: str, fields: list[tuple[str, object, bool]]) -> list[object]:
    """``array_like``: the tag, then every field; msgspec writes defaults here too (see the docstring)."""
    return [tag, *(value for _, value, _ in fields)]


#: Entries (fields + tag) vLLM 0.33 declares per event class; msgspec writes a 16-bit map header
#: for a struct of more than 15.
_VLLM_MAP_ENTRIES = {"BlockStored": 16, "BlockRemoved": 6, "AllBlocksCleared": 1}


def _as_map(tag: str, fields: list[tuple[str, object, bool]]) -> dict[str, object]:
    """A tagged map with ``omit_defaults``: fields at their default are left out; the tag comes first."""
    entries = {"type": tag, **{name: value for name, value, is_default in fields if not is_default}}
    return WideMap(entries) if _VLLM_MAP_ENTRIES[tag] > 15 else entries


def encode_event_batch(
    events: Iterable[KVCacheEvent],
    *,
    ts: float,
    data_parallel_rank: int | None = None,
    layout: Layout = "array",
    int_block_hashes: bool = False,
) -> bytes:
    """One batch of events as the MessagePack bytes vLLM's ``KVEventBatch`` encodes to.

    ``ts`` is the batch time in seconds (a float64 on the wire); ``data_parallel_rank`` None is
    written as nil. ``layout`` and ``int_block_hashes`` are described in the module docstring.
    Events are written in the order given.
    """
    if isinstance(ts, bool) or not isinstance(ts, int | float):
        raise TypeError(f"ts must be a number, got {type(ts).__name__}")
    if not math.isfinite(ts):
        raise ValueError(f"ts must be finite, got {ts}")
    if data_parallel_rank is not None and int_field(data_parallel_rank, "data_parallel_rank") < 0:
        raise ValueError(f"data_parallel_rank must be >= 0, got {data_parallel_rank}")
    if layout not in ("array", "map"):
        raise ValueError(f"layout must be 'array' or 'map', got {layout!r}")
    if not isinstance(int_block_hashes, bool):
        raise TypeError(f"int_block_hashes must be a bool, got {type(int_block_hashes).__name__}")
    shape = _as_array if layout == "array" else _as_map
    encoded: list[object] = []
    for i, event in enumerate(events):
        fields = _event_fields(event, int_block_hashes, f"events[{i}]")
        encoded.append(shape(type(event).__name__, fields))
    return packb([float(ts), encoded, data_parallel_rank])
