"""KV-cache events (docs/requests-api.md, "KV events").

The event types are plain frozen dataclasses shared by the native engine and the reference, so
both produce values that compare equal. Encoding to vLLM's wire layout and publishing over ZMQ
live here too.

Wire layout
-----------
:func:`encode_event_batch` writes a batch the way vLLM's ``ZmqEventPublisher`` does
(``vllm/distributed/kv_events.py``): msgspec's MessagePack encoding of ``KVEventBatch``, a
struct declared ``array_like=True, omit_defaults=True`` holding ``ts, events,
data_parallel_rank``, whose events are structs declared ``omit_defaults=True, tag=True`` (the
tag is the class name). Two event layouts exist because vLLM changed its encoding:

``layout="array"`` (the default; vLLM up to 0.23 and the consumers written for it)
    The events are ``array_like=True`` too: an event is an array whose first element is its
    class name, then every field in declaration order. msgspec ignores ``omit_defaults`` for
    array-like structs (jcrist/msgspec#720): fields equal to their default, trailing ones
    included, are still written, so every ``BlockStored`` has 11 fields after its tag and a
    batch always has 3 elements (``data_parallel_rank`` nil when None). Decoders accept a
    shorter array (missing trailing fields take their defaults), so this stays readable by
    consumers built for older vLLM field lists. The bytes are those of vLLM 0.23.0.
``layout="map"`` (vLLM after 0.23: vllm-project/vllm#42892)
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
``medium``                          ``"GPU"``
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

``BlockRemoved`` is ``block_hashes, medium ("GPU"), group_idx``; ``AllBlocksCleared`` has no
fields. ``ts`` is a float64.

The MessagePack writer below covers the subset these values need (nil, bool, int, float64,
str, bin, array, map) and chooses the shortest form for each value, as the ``msgpack`` and
``msgspec`` packages do, so the bytes are the same as theirs.
"""

from __future__ import annotations

import math
import struct
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Literal, Self


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


@dataclass(frozen=True)
class BlockRemoved:
    """Cached pages of one group whose keys were dropped because the pool handed them out again."""

    block_hashes: list[bytes]
    group_index: int


@dataclass(frozen=True)
class AllBlocksCleared:
    """Every cached free page lost its key (``reset_prefix_cache``)."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared

#: vLLM's ``medium`` for pages in device memory (``MEDIUM_GPU``).
MEDIUM_GPU = "GPU"

#: Our group kinds in vLLM's ``KVCacheSpecKind`` words.
VLLM_SPEC_KINDS = {"full": "full_attention", "sliding_window": "sliding_window", "state": "mamba"}

__all__ = [
    "MEDIUM_GPU",
    "VLLM_SPEC_KINDS",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KVCacheEvent",
    "ZmqEventPublisher",
    "encode_event_batch",
    "packb",
]

# --- MessagePack (the subset vLLM's events need) ----------------------------------------------

_PACK_B = struct.Struct(">B").pack
_PACK_H = struct.Struct(">H").pack
_PACK_I = struct.Struct(">I").pack
_PACK_Q = struct.Struct(">Q").pack
_PACK_b = struct.Struct(">b").pack
_PACK_h = struct.Struct(">h").pack
_PACK_i = struct.Struct(">i").pack
_PACK_q = struct.Struct(">q").pack
_PACK_d = struct.Struct(">d").pack


def _pack_int(value: int, out: bytearray) -> None:
    """The shortest MessagePack int: unsigned forms for values >= 0, signed ones below."""
    if value >= 0:
        if value < 0x80:
            out.append(value)  # positive fixint
        elif value <= 0xFF:
            out += b"\xcc" + _PACK_B(value)
        elif value <= 0xFFFF:
            out += b"\xcd" + _PACK_H(value)
        elif value <= 0xFFFF_FFFF:
            out += b"\xce" + _PACK_I(value)
        elif value <= 0xFFFF_FFFF_FFFF_FFFF:
            out += b"\xcf" + _PACK_Q(value)
        else:
            raise OverflowError(f"int {value} does not fit in MessagePack (at most 2**64 - 1)")
    elif value >= -32:
        out.append(value & 0xFF)  # negative fixint
    elif value >= -0x80:
        out += b"\xd0" + _PACK_b(value)
    elif value >= -0x8000:
        out += b"\xd1" + _PACK_h(value)
    elif value >= -0x8000_0000:
        out += b"\xd2" + _PACK_i(value)
    elif value >= -0x8000_0000_0000_0000:
        out += b"\xd3" + _PACK_q(value)
    else:
        raise OverflowError(f"int {value} does not fit in MessagePack (at least -2**63)")


def _pack_length(length: int, fix_tag: int, fix_limit: int, tags: bytes, out: bytearray, what: str) -> None:
    """A length header: the fix form below ``fix_limit`` (if any), then 8/16/32-bit forms.

    ``tags`` holds the 8-, 16- and 32-bit tag bytes (0 for a form the type does not have).
    """
    if length < fix_limit:
        out.append(fix_tag | length)
    elif length <= 0xFF and tags[0]:
        out += bytes((tags[0], length))
    elif length <= 0xFFFF:
        out += bytes((tags[1],)) + _PACK_H(length)
    elif length <= 0xFFFF_FFFF:
        out += bytes((tags[2],)) + _PACK_I(length)
    else:
        raise OverflowError(f"{what} of length {length} does not fit in MessagePack")


class _WideMap(dict[str, object]):
    """A map written with the 16-bit header whatever its size (see ``layout="map"``)."""


def _pack(value: object, out: bytearray) -> None:
    if value is None:
        out.append(0xC0)
    elif value is True:
        out.append(0xC3)
    elif value is False:
        out.append(0xC2)
    elif isinstance(value, int):
        _pack_int(value, out)
    elif isinstance(value, float):
        out += b"\xcb" + _PACK_d(value)
    elif isinstance(value, str):
        data = value.encode("utf-8")
        _pack_length(len(data), 0xA0, 32, b"\xd9\xda\xdb", out, "str")
        out += data
    elif isinstance(value, bytes | bytearray | memoryview):
        data = bytes(value)
        _pack_length(len(data), 0, 0, b"\xc4\xc5\xc6", out, "bin")
        out += data
    elif isinstance(value, list | tuple):
        _pack_length(len(value), 0x90, 16, b"\x00\xdc\xdd", out, "array")
        for item in value:
            _pack(item, out)
    elif isinstance(value, dict):
        _pack_length(len(value), 0x80, 0 if type(value) is _WideMap else 16, b"\x00\xde\xdf", out, "map")
        for key, item in value.items():
            _pack(key, out)
            _pack(item, out)
    else:
        raise TypeError(f"cannot encode {type(value).__name__} as MessagePack")


def packb(value: object) -> bytes:
    """``value`` as MessagePack bytes (None, bool, int, float, str, bytes, list/tuple, dict).

    Floats are always float64 and ints take their shortest form, like ``msgpack.packb`` with
    its defaults and msgspec's encoder. Anything else is a TypeError; an int outside
    ``[-2**63, 2**64)`` is an OverflowError.
    """
    out = bytearray()
    _pack(value, out)
    return bytes(out)


# --- vLLM's event layout ----------------------------------------------------------------------

_U64 = (1 << 64) - 1


def _block_hash(value: object, int_block_hashes: bool, name: str) -> bytes | int:
    if not isinstance(value, bytes):
        raise TypeError(f"{name} must be bytes, got {type(value).__name__}")
    return int.from_bytes(value, "big") & _U64 if int_block_hashes else value


def _block_hashes(values: object, int_block_hashes: bool, name: str) -> list[bytes | int]:
    if not isinstance(values, list | tuple):
        raise TypeError(f"{name} must be a list of bytes, got {type(values).__name__}")
    return [_block_hash(value, int_block_hashes, f"{name}[{i}]") for i, value in enumerate(values)]


def _int_field(value: object, name: str) -> int:
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
    tokens = [_int_field(token, f"{where}.token_ids[{i}]") for i, token in enumerate(event.token_ids)]
    if event.group_kind not in VLLM_SPEC_KINDS:
        raise ValueError(
            f"{where}.group_kind must be one of {', '.join(VLLM_SPEC_KINDS)}, got {event.group_kind!r}"
        )
    window = event.sliding_window
    if window is not None:
        window = _int_field(window, f"{where}.sliding_window")
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
        ("block_size", _int_field(event.block_size, f"{where}.block_size"), False),
        ("lora_id", None, False),
        ("medium", MEDIUM_GPU, False),
        ("lora_name", None, False),
        ("extra_keys", [per_block] * len(hashes), False),
        ("group_idx", _int_field(event.group_index, f"{where}.group_index"), False),
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
            ("medium", MEDIUM_GPU, False),
            ("group_idx", _int_field(event.group_index, f"{where}.group_index"), False),
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
    return _WideMap(entries) if _VLLM_MAP_ENTRIES[tag] > 15 else entries


def encode_event_batch(
    events: Iterable[KVCacheEvent],
    *,
    ts: float,
    data_parallel_rank: int | None = None,
    layout: Literal["array", "map"] = "array",
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
    if data_parallel_rank is not None and _int_field(data_parallel_rank, "data_parallel_rank") < 0:
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


# --- publishing over ZMQ ----------------------------------------------------------------------


def _import_zmq() -> Any:
    try:
        import zmq
    except ImportError as exc:
        raise ImportError(
            "ZmqEventPublisher needs pyzmq, the optional `zmq` extra: pip install 'flat-kvcache[zmq]'"
        ) from exc
    return zmq


class ZmqEventPublisher:
    """Publishes event batches on a ZMQ PUB socket, framed as vLLM's publisher frames them.

    Each :meth:`publish` sends one multipart message ``[topic, seq, payload]``: the topic as
    UTF-8 bytes, ``seq`` as an 8-byte big-endian unsigned int counting batches from 0, and the
    payload from :func:`encode_event_batch`. Subscribers filter on the topic prefix.

    ``endpoint`` is a ZMQ address such as ``tcp://127.0.0.1:5557``; the publisher binds it
    (``bind=False`` connects instead, for a subscriber or proxy that binds). A bound TCP
    endpoint may name port ``*``; :attr:`endpoint` then tells the port ZMQ chose.

    Sending happens in the calling thread: ``publish`` returns once ZMQ has queued the
    message. Like any PUB socket, batches sent before a subscriber has joined are dropped;
    :meth:`wait_for_subscriber` blocks until one has subscribed. Use as a context manager or
    call :meth:`close`. ``data_parallel_rank``, ``layout`` and ``int_block_hashes`` go to
    :func:`encode_event_batch`. Needs pyzmq (``pip install 'flat-kvcache[zmq]'``).
    """

    def __init__(
        self,
        endpoint: str,
        *,
        topic: str = "kv-events",
        data_parallel_rank: int | None = None,
        layout: Literal["array", "map"] = "array",
        int_block_hashes: bool = False,
        bind: bool = True,
        send_hwm: int = 100_000,
    ) -> None:
        zmq = _import_zmq()
        if not isinstance(endpoint, str):
            raise TypeError(f"endpoint must be a str, got {type(endpoint).__name__}")
        if not isinstance(topic, str):
            raise TypeError(f"topic must be a str, got {type(topic).__name__}")
        if layout not in ("array", "map"):
            raise ValueError(f"layout must be 'array' or 'map', got {layout!r}")
        if data_parallel_rank is not None and _int_field(data_parallel_rank, "data_parallel_rank") < 0:
            raise ValueError(f"data_parallel_rank must be >= 0, got {data_parallel_rank}")
        if not isinstance(int_block_hashes, bool):
            raise TypeError(f"int_block_hashes must be a bool, got {type(int_block_hashes).__name__}")
        if _int_field(send_hwm, "send_hwm") < 0:
            raise ValueError(f"send_hwm must be >= 0, got {send_hwm}")
        self._endpoint = endpoint
        self._topic = topic.encode("utf-8")
        self._rank = data_parallel_rank
        self._layout: Literal["array", "map"] = layout
        self._int_block_hashes = int_block_hashes
        self._seq = 0
        self._subscribed = False
        # pyzmq is optional, so its objects are typed Any here.
        self._context: Any = zmq.Context()
        # XPUB is a PUB socket that also reports subscriptions (for wait_for_subscriber).
        self._socket: Any = self._context.socket(zmq.XPUB)
        try:
            self._socket.setsockopt(zmq.SNDHWM, send_hwm)
            if bind:
                self._socket.bind(endpoint)
                self._endpoint = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                self._socket.connect(endpoint)
        except zmq.ZMQError as exc:
            self._socket.close(linger=0)
            self._socket = None
            self._context.term()
            raise ValueError(f"cannot {'bind' if bind else 'connect'} endpoint {endpoint!r}: {exc}") from exc
        self._zmq = zmq

    @property
    def endpoint(self) -> str:
        """The endpoint: as bound (with the port ZMQ chose for ``*``), or as given to connect."""
        return self._endpoint

    @property
    def next_seq(self) -> int:
        """The sequence number the next :meth:`publish` will use."""
        return self._seq

    @property
    def closed(self) -> bool:
        return self._socket is None

    def _live_socket(self) -> Any:
        if self._socket is None:
            raise RuntimeError("the publisher is closed")
        return self._socket

    def wait_for_subscriber(self, timeout: float) -> bool:
        """Block up to ``timeout`` seconds until a subscriber has subscribed; True if one has."""
        socket = self._live_socket()
        deadline = time.monotonic() + max(0.0, float(timeout))
        while not self._subscribed:
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            if remaining_ms <= 0 or not socket.poll(remaining_ms, self._zmq.POLLIN):
                break
            message = socket.recv()
            # A subscription message is b"\x01" + topic prefix (b"\x00" unsubscribes).
            if message[:1] == b"\x01" and self._topic.startswith(message[1:]):
                self._subscribed = True
        return self._subscribed

    def publish(self, events: Sequence[KVCacheEvent], *, ts: float | None = None) -> int:
        """Encode ``events`` as one batch (``ts`` defaults to now), send it, return its sequence number."""
        socket = self._live_socket()
        payload = encode_event_batch(
            events,
            ts=time.time() if ts is None else ts,
            data_parallel_rank=self._rank,
            layout=self._layout,
            int_block_hashes=self._int_block_hashes,
        )
        seq = self._seq
        socket.send_multipart([self._topic, seq.to_bytes(8, "big"), payload])
        self._seq = seq + 1
        return seq

    def close(self, linger: float = 1.0) -> None:
        """Close the socket, waiting up to ``linger`` seconds for queued batches to go out. Idempotent."""
        if self._socket is None:
            return
        self._socket.close(linger=max(0, round(linger * 1000)))
        self._socket = None
        self._context.term()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"next_seq={self._seq}"
        return f"ZmqEventPublisher({self._endpoint!r}, topic={self._topic.decode('utf-8')!r}, {state})"
