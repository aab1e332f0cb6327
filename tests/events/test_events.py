"""KV events on the wire: the MessagePack writer, vLLM's batch layout, ZMQ publishing.

The writer is checked byte for byte against the ``msgpack`` package, and the batch layout
against msgspec encoding structs declared the way vLLM declares its event classes, so the
bytes are what vLLM's own publisher sends. The ZMQ test publishes on a loopback TCP port and
decodes what a SUB socket receives, field by field.

``msgpack``, ``msgspec`` and ``pyzmq`` are test dependencies (requirements/test.txt). Without
one a test skips, except in CI (``CI`` set), where it fails: CI must run them.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from types import ModuleType
from typing import Any, Literal

import pytest
from flat_kvcache.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    ZmqEventPublisher,
    encode_event_batch,
    packb,
)
from helpers import need
from hypothesis import given
from hypothesis import strategies as st

#: Bounded waits for the loopback tests (seconds / milliseconds).
WAIT_S = 10.0
WAIT_MS = 10_000


H0, H1, H2 = (bytes([i]) * 31 + bytes([0x80 + i]) for i in range(3))

EVENTS: list[KVCacheEvent] = [
    BlockStored([H0, H1], None, list(range(32)), 16, 0, "full", None, []),
    BlockStored([H2], H1, list(range(100_000, 100_016)), 16, 1, "sliding_window", 128, ["lora:a", "salt"]),
    BlockStored([H0], None, [7] * 16, 16, 2, "state", None, []),
    BlockRemoved([H0, H2], 1),
    AllBlocksCleared(),
]


def low64(block_hash: bytes) -> int:
    """vLLM's int form of a block hash: the big-endian value's low 64 bits."""
    return int.from_bytes(block_hash, "big") & ((1 << 64) - 1)


# --- the MessagePack writer -------------------------------------------------------------------

BOUNDARY_INTS = [
    0, 1, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**64 - 1,
    -1, -32, -33, -128, -129, -32768, -32769, -(2**31), -(2**31) - 1, -(2**63),
]  # fmt: skip


@pytest.mark.parametrize("value", BOUNDARY_INTS)
def test_ints_take_the_same_shortest_form_as_msgpack(value: int) -> None:
    msgpack = need("msgpack")
    assert packb(value) == msgpack.packb(value)


@pytest.mark.parametrize("length", [0, 1, 15, 16, 31, 32, 255, 256, 65535, 65536])
def test_length_headers_match_msgpack_at_each_boundary(length: int) -> None:
    msgpack = need("msgpack")
    for value in ("x" * length, b"x" * length, [None] * length, {str(i): i for i in range(length)}):
        assert packb(value) == msgpack.packb(value), (type(value).__name__, length)


def test_scalars_match_msgpack() -> None:
    msgpack = need("msgpack")
    for value in (None, True, False, 0.0, -0.0, 1.5, -1e300, math.inf, -math.inf, "", "é€𝄞", b"", b"\x00"):
        assert packb(value) == msgpack.packb(value), value
    assert packb((1, "a")) == msgpack.packb([1, "a"])  # a tuple is an array
    assert packb(bytearray(b"ab")) == packb(memoryview(b"ab")) == msgpack.packb(b"ab")


_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text()
    | st.binary(),
    lambda inner: st.lists(inner, max_size=20) | st.dictionaries(st.text(max_size=8), inner, max_size=20),
    max_leaves=60,
)


@given(_values)
def test_any_supported_value_packs_like_msgpack(value: Any) -> None:
    msgpack = need("msgpack")
    assert packb(value) == msgpack.packb(value)


@pytest.mark.parametrize(
    ("value", "error"),
    [(2**64, OverflowError), (-(2**63) - 1, OverflowError), ({1, 2}, TypeError), (object(), TypeError)],
)
def test_values_outside_the_subset_are_refused(value: object, error: type[Exception]) -> None:
    with pytest.raises(error):
        packb([value])


# --- vLLM's batch layout, field by field --------------------------------------------------------


def test_array_layout_field_by_field() -> None:
    msgpack = need("msgpack")
    ts, events, rank = msgpack.unpackb(encode_event_batch(EVENTS, ts=1234.5))
    assert (ts, rank) == (1234.5, None)
    assert isinstance(ts, float)
    full, sliding, state, removed, cleared = events

    assert full[0] == "BlockStored"
    assert full[1] == [H0, H1]  # block_hashes
    assert full[2] is None  # parent_block_hash
    assert full[3] == list(range(32))  # token_ids
    assert full[4] == 16  # block_size
    assert full[5] is None  # lora_id
    assert full[6] == "GPU"  # medium
    assert full[7] is None  # lora_name
    assert full[8] == [None, None]  # extra_keys, one entry per block
    assert full[9] == 0  # group_idx
    assert full[10] == "full_attention"  # kv_cache_spec_kind
    assert full[11] is None  # kv_cache_spec_sliding_window (written: array-like keeps defaults)
    assert len(full) == 12

    assert sliding == [
        "BlockStored",
        [H2],
        H1,
        list(range(100_000, 100_016)),
        16,
        None,
        "GPU",
        None,
        [["lora:a", "salt"]],
        1,
        "sliding_window",
        128,
    ]
    assert state[9:] == [2, "mamba", None]
    assert removed == ["BlockRemoved", [H0, H2], "GPU", 1]
    assert cleared == ["AllBlocksCleared"]


def test_map_layout_field_by_field() -> None:
    msgpack = need("msgpack")
    ts, events, rank = msgpack.unpackb(encode_event_batch(EVENTS, ts=2.0, data_parallel_rank=3, layout="map"))
    assert (ts, rank) == (2.0, 3)
    full, sliding, state, removed, cleared = events
    assert list(full) == [
        "type",
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
        "group_idx",
        "kv_cache_spec_kind",
    ]  # the sliding window is None, its default, so omit_defaults leaves it out
    assert full["type"] == "BlockStored"
    assert full["block_hashes"] == [H0, H1]
    assert full["parent_block_hash"] is None
    assert full["token_ids"] == list(range(32))
    assert (full["block_size"], full["lora_id"], full["medium"], full["lora_name"]) == (16, None, "GPU", None)
    assert full["extra_keys"] == [None, None]
    assert (full["group_idx"], full["kv_cache_spec_kind"]) == (0, "full_attention")
    assert sliding["kv_cache_spec_sliding_window"] == 128
    assert sliding["extra_keys"] == [["lora:a", "salt"]]
    assert (sliding["parent_block_hash"], sliding["group_idx"]) == (H1, 1)
    assert (state["kv_cache_spec_kind"], state["group_idx"]) == ("mamba", 2)
    assert removed == {"type": "BlockRemoved", "block_hashes": [H0, H2], "medium": "GPU", "group_idx": 1}
    assert cleared == {"type": "AllBlocksCleared"}


def test_int_block_hashes_are_the_low_64_bits() -> None:
    msgpack = need("msgpack")
    _, events, _ = msgpack.unpackb(encode_event_batch(EVENTS, ts=0.0, int_block_hashes=True))
    assert events[0][1] == [low64(H0), low64(H1)]
    assert events[1][1:3] == [[low64(H2)], low64(H1)]
    assert events[3][1] == [low64(H0), low64(H2)]
    assert low64(H0) == 0x0000_0000_0000_0080


def test_empty_batch() -> None:
    msgpack = need("msgpack")
    assert msgpack.unpackb(encode_event_batch([], ts=5)) == [5.0, [], None]


def vllm_structs(layout: str) -> dict[str, Any]:
    """msgspec structs declared as vLLM declares its KV events (vllm/distributed/kv_events.py).

    ``layout="array"``: vLLM 0.23.0, the last array-like release. ``layout="map"``: vLLM 0.33.0,
    which dropped ``array_like`` on the events and added four optional fields to
    ``BlockStored`` and two to ``BlockRemoved`` (they change msgspec's map header, see
    flat_kvcache.events). Built with ``defstruct`` because this module's annotations are
    strings that would resolve to our own dataclasses of the same names.
    """
    msgspec = need("msgspec")
    hash_type = bytes | int
    later = layout == "map"
    options = {"array_like": not later, "omit_defaults": True, "gc": False, "tag": True}
    stored_fields: list[tuple[Any, ...]] = [
        ("block_hashes", list[hash_type]),
        ("parent_block_hash", hash_type | None),
        ("token_ids", list[int]),
        ("block_size", int),
        ("lora_id", int | None),
        ("medium", str | None),
        ("lora_name", str | None),
        ("extra_keys", list[tuple[Any, ...] | None] | None, None),
        ("group_idx", int | None, None),
        ("kv_cache_spec_kind", str | None, None),
        ("kv_cache_spec_sliding_window", int | None, None),
    ]
    removed_fields: list[tuple[Any, ...]] = [
        ("block_hashes", list[hash_type]),
        ("medium", str | None),
        ("group_idx", int | None, None),
    ]
    if later:
        stored_fields += [
            ("locality", str | None, None),
            ("ownership", str | None, None),
            ("session_id", str | None, None),
            ("lookahead_token_ids", list[list[int]] | None, None),
        ]
        removed_fields += [("locality", str | None, None), ("ownership", str | None, None)]
    stored = msgspec.defstruct("BlockStored", stored_fields, **options)
    removed = msgspec.defstruct("BlockRemoved", removed_fields, **options)
    cleared = msgspec.defstruct("AllBlocksCleared", [], **options)
    batch = msgspec.defstruct(
        "KVEventBatch",
        [
            ("ts", float),
            ("events", list[stored | removed | cleared]),  # type: ignore[valid-type]
            ("data_parallel_rank", int | None, None),
        ],
        array_like=True,
        omit_defaults=True,
        gc=False,
    )
    return {"batch": batch, "stored": stored, "removed": removed, "cleared": cleared}


@pytest.mark.parametrize("layout", ["array", "map"])
@pytest.mark.parametrize("rank", [None, 0, 7])
@pytest.mark.parametrize("int_hashes", [False, True])
def test_bytes_equal_msgspec_encoding_of_vllms_structs(
    layout: Literal["array", "map"], rank: int | None, int_hashes: bool
) -> None:
    msgspec = need("msgspec")
    vllm = vllm_structs(layout)

    def h(block_hash: bytes) -> bytes | int:
        return low64(block_hash) if int_hashes else block_hash

    stored, removed = vllm["stored"], vllm["removed"]
    expected = vllm["batch"](
        ts=99.25,
        events=[
            stored(
                [h(H0), h(H1)], None, list(range(32)), 16, None, "GPU", None, [None] * 2, 0, "full_attention"
            ),
            stored(
                [h(H2)],
                h(H1),
                list(range(100_000, 100_016)),
                16,
                None,
                "GPU",
                None,
                [("lora:a", "salt")],
                1,
                "sliding_window",
                128,
            ),
            stored([h(H0)], None, [7] * 16, 16, None, "GPU", None, [None], 2, "mamba"),
            removed([h(H0), h(H2)], "GPU", 1),
            vllm["cleared"](),
        ],
        data_parallel_rank=rank,
    )
    payload = encode_event_batch(
        EVENTS, ts=99.25, data_parallel_rank=rank, layout=layout, int_block_hashes=int_hashes
    )
    assert payload == msgspec.msgpack.encode(expected)
    assert msgspec.msgpack.decode(payload, type=vllm["batch"]) == expected


def stored(**changes: Any) -> BlockStored:
    """A valid BlockStored with ``changes`` (possibly invalid) applied."""
    return dataclasses.replace(BlockStored([H0], None, [], 16, 0, "full", None), **changes)


@pytest.mark.parametrize(
    ("events", "kwargs", "error", "match"),
    [
        ([object()], {}, TypeError, r"events\[0\] must be a BlockStored"),
        ([stored(block_hashes=["00"])], {}, TypeError, r"block_hashes\[0\] must be bytes"),
        ([stored(group_kind="mla")], {}, ValueError, r"group_kind must be one of"),
        ([stored(token_ids=[True])], {}, TypeError, r"token_ids\[0\] must be an int"),
        ([stored(extra_keys="salt")], {}, TypeError, r"extra_keys must be a list"),
        ([stored(extra_keys=[1])], {}, TypeError, r"extra_keys\[0\] must be a str"),
        ([stored(sliding_window=1.5)], {}, TypeError, r"sliding_window must be an int"),
        ([BlockRemoved([H0], None)], {}, TypeError, r"events\[0\]\.group_index must be an int"),  # type: ignore[arg-type]
        ([], {"ts": True}, TypeError, "ts must be a number"),
        ([], {"ts": math.nan}, ValueError, "ts must be finite"),
        ([], {"data_parallel_rank": -1}, ValueError, "data_parallel_rank must be >= 0"),
        ([], {"layout": "json"}, ValueError, "layout must be"),
        ([], {"int_block_hashes": 1}, TypeError, "int_block_hashes must be a bool"),
    ],
)
def test_bad_batches_are_refused_with_the_field_named(
    events: list[Any], kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        encode_event_batch(events, **{"ts": 1.0, **kwargs})


# --- ZMQ -----------------------------------------------------------------------------------------


def receive(sub: Any) -> list[bytes]:
    """One multipart message from ``sub``, waiting at most WAIT_MS."""
    zmq = need("zmq")
    assert sub.poll(WAIT_MS, zmq.POLLIN), "nothing received within the wait"
    frames: list[bytes] = sub.recv_multipart()
    return frames


def test_publish_over_loopback_decodes_field_by_field() -> None:
    zmq = need("zmq")
    msgpack = need("msgpack")
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    try:
        with ZmqEventPublisher("tcp://127.0.0.1:*", topic="kv-events", data_parallel_rank=2) as publisher:
            assert publisher.endpoint.startswith("tcp://127.0.0.1:")
            assert publisher.next_seq == 0
            sub.connect(publisher.endpoint)
            sub.setsockopt(zmq.SUBSCRIBE, b"kv-events")
            assert publisher.wait_for_subscriber(WAIT_S)
            assert publisher.publish(EVENTS[:2], ts=10.5) == 0
            assert publisher.publish([EVENTS[3]], ts=11.0) == 1
            assert publisher.publish([AllBlocksCleared()]) == 2
            assert publisher.next_seq == 3
            messages = [receive(sub) for _ in range(3)]
    finally:
        sub.close(linger=0)
        context.term()

    for seq, message in enumerate(messages):
        assert len(message) == 3
        topic, seq_bytes, _ = message
        assert topic == b"kv-events"
        assert seq_bytes == seq.to_bytes(8, "big")
        assert int.from_bytes(seq_bytes, "big") == seq

    ts, events, rank = msgpack.unpackb(messages[0][2])
    assert (ts, rank) == (10.5, 2)
    [full, sliding] = events
    assert full[:4] == ["BlockStored", [H0, H1], None, list(range(32))]
    assert full[4:] == [16, None, "GPU", None, [None, None], 0, "full_attention", None]
    assert sliding[0] == "BlockStored"
    assert sliding[1] == [H2]
    assert sliding[2] == H1
    assert sliding[3] == list(range(100_000, 100_016))
    assert sliding[4] == 16
    assert sliding[5:8] == [None, "GPU", None]
    assert sliding[8] == [["lora:a", "salt"]]
    assert sliding[9:] == [1, "sliding_window", 128]

    assert msgpack.unpackb(messages[1][2]) == [11.0, [["BlockRemoved", [H0, H2], "GPU", 1]], 2]
    ts, events, rank = msgpack.unpackb(messages[2][2])
    assert (events, rank) == ([["AllBlocksCleared"]], 2)
    assert isinstance(ts, float) and ts > 1.6e9  # publish() stamps the wall clock


def test_a_subscriber_of_another_topic_gets_nothing() -> None:
    zmq = need("zmq")
    context = zmq.Context()
    other = context.socket(zmq.SUB)
    try:
        with ZmqEventPublisher("tcp://127.0.0.1:*", topic="kv-events") as publisher:
            other.connect(publisher.endpoint)
            other.setsockopt(zmq.SUBSCRIBE, b"other")
            assert not publisher.wait_for_subscriber(0.3)  # that subscription is not for us
            publisher.publish(EVENTS)
            assert not other.poll(200, zmq.POLLIN)
    finally:
        other.close(linger=0)
        context.term()


def test_publisher_errors_and_lifecycle() -> None:
    need("zmq")
    with pytest.raises(ValueError, match=r"cannot bind endpoint 'not-an-endpoint'"):
        ZmqEventPublisher("not-an-endpoint")
    with pytest.raises(TypeError, match="topic must be a str"):
        ZmqEventPublisher("tcp://127.0.0.1:*", topic=b"kv")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="layout must be"):
        ZmqEventPublisher("tcp://127.0.0.1:*", layout="json")  # type: ignore[arg-type]
    publisher = ZmqEventPublisher("tcp://127.0.0.1:*")
    assert "next_seq=0" in repr(publisher)
    with pytest.raises(TypeError, match=r"events\[0\] must be"):
        publisher.publish(["nope"])  # type: ignore[list-item]
    assert publisher.next_seq == 0  # nothing was sent
    publisher.close()
    publisher.close()  # idempotent
    assert publisher.closed and "closed" in repr(publisher)
    with pytest.raises(RuntimeError, match="closed"):
        publisher.publish(EVENTS)
    with pytest.raises(RuntimeError, match="closed"):
        publisher.wait_for_subscriber(0)


# --- replay ------------------------------------------------------------------------------------

#: vLLM's end-of-replay marker, written out here rather than taken from the module under test.
END_SEQ = b"\xff" * 8


def replay_from(dealer: Any, start: int) -> list[tuple[int, bytes]]:
    """Ask for the batches from ``start`` on a DEALER socket; (seq, payload) until the end
    marker, each reply waited for at most WAIT_MS."""
    zmq = need("zmq")
    dealer.send_multipart([b"", start.to_bytes(8, "big")])  # the delimiter a REQ socket would add
    got: list[tuple[int, bytes]] = []
    while True:
        assert dealer.poll(WAIT_MS, zmq.POLLIN), "no replay reply within the wait"
        delimiter, seq_bytes, payload = dealer.recv_multipart()
        assert delimiter == b""
        if seq_bytes == END_SEQ:
            assert payload == b""
            return got
        got.append((int.from_bytes(seq_bytes, "big"), payload))


def ask_once(context: Any, endpoint: str, start: int) -> tuple[bytes, bytes]:
    """One request on a fresh REQ socket: ZMQ hands it the first reply message only (the rest
    of the run would stay queued on that socket and answer its next request)."""
    zmq = need("zmq")
    req = context.socket(zmq.REQ)
    try:
        req.connect(endpoint)
        req.send(start.to_bytes(8, "big"))
        assert req.poll(WAIT_MS, zmq.POLLIN), "no replay reply within the wait"
        seq_bytes, payload = req.recv_multipart()
    finally:
        req.close(linger=0)
    return seq_bytes, payload


def test_replay_returns_the_buffered_batches_from_the_asked_seq() -> None:
    zmq = need("zmq")
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    try:
        with ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*") as publisher:
            assert publisher.replay_endpoint is not None
            assert publisher.replay_endpoint.startswith("tcp://127.0.0.1:")
            assert publisher.replay_endpoint != publisher.endpoint
            # Nobody subscribes: the stream drops all five; replay still has them.
            batches = [[EVENTS[i % len(EVENTS)]] for i in range(5)]
            for i, batch in enumerate(batches):
                assert publisher.publish(batch, ts=float(i)) == i
            dealer.connect(publisher.replay_endpoint)
            from_two = replay_from(dealer, 2)
            everything = replay_from(dealer, 0)
            nothing = replay_from(dealer, 5)
            req_three = ask_once(context, publisher.replay_endpoint, 3)
            req_past_the_end = ask_once(context, publisher.replay_endpoint, 9)
    finally:
        dealer.close(linger=0)
        context.term()
    expected = [(i, encode_event_batch(batch, ts=float(i))) for i, batch in enumerate(batches)]
    assert from_two == expected[2:]
    assert everything == expected
    assert nothing == []
    assert req_three == ((3).to_bytes(8, "big"), expected[3][1])
    assert req_past_the_end == (END_SEQ, b"")


def test_replay_keeps_only_the_last_buffer_steps_batches() -> None:
    zmq = need("zmq")
    context = zmq.Context()
    client = context.socket(zmq.DEALER)
    try:
        with ZmqEventPublisher(
            "tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*", buffer_steps=2, layout="map"
        ) as publisher:
            for i in range(4):
                publisher.publish([EVENTS[3]], ts=float(i))
            client.connect(publisher.replay_endpoint)
            got = replay_from(client, 0)
    finally:
        client.close(linger=0)
        context.term()
    assert [seq for seq, _ in got] == [2, 3]  # 0 and 1 left the buffer: lost for good
    assert got[0][1] == encode_event_batch([EVENTS[3]], ts=2.0, layout="map")


def test_a_consumer_fills_a_gap_from_the_replay_socket() -> None:
    """vLLM's subscriber recipe: on the stream, a seq past last + 1 means batches were missed;
    ask the replay socket from last + 1 (here one REQ request per batch) up to the one before
    the gap."""
    zmq = need("zmq")
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    try:
        with ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*") as publisher:
            sub.connect(publisher.endpoint)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            assert publisher.wait_for_subscriber(WAIT_S)
            for i in range(4):
                publisher.publish([EVENTS[i]], ts=float(i))
            stream = [receive(sub) for _ in range(4)]
            # The consumer got seq 0, then lost 1 and 2 on the way: the next it sees is 3.
            seen = {0: stream[0][2]}
            last, (_, seq_bytes, payload) = 0, stream[3]
            seq = int.from_bytes(seq_bytes, "big")
            replay_endpoint = publisher.replay_endpoint
            assert replay_endpoint is not None
            while last < seq - 1:
                replay_seq_bytes, replay_payload = ask_once(context, replay_endpoint, last + 1)
                assert replay_seq_bytes != END_SEQ, "the batches are still buffered"
                last = int.from_bytes(replay_seq_bytes, "big")
                seen[last] = replay_payload
            seen[seq] = payload
    finally:
        sub.close(linger=0)
        context.term()
    assert seen == {i: encode_event_batch([EVENTS[i]], ts=float(i)) for i in range(4)}


def test_replay_ignores_malformed_requests_and_argument_errors() -> None:
    zmq = need("zmq")
    with pytest.raises(TypeError, match="replay_endpoint must be a str or None"):
        ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint=5557)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="buffer_steps must be >= 1, got 0"):
        ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*", buffer_steps=0)
    with pytest.raises(ValueError, match=r"cannot bind replay_endpoint 'nowhere'"):
        ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint="nowhere")
    with ZmqEventPublisher("tcp://127.0.0.1:*") as plain:
        assert plain.replay_endpoint is None
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    try:
        with ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*") as publisher:
            publisher.publish([EVENTS[3]], ts=0.0)
            dealer.connect(publisher.replay_endpoint)
            dealer.send_multipart([b"", b"\x00\x01"])  # a start seq that is not 8 bytes
            dealer.send_multipart([b"a", b"b", b"c"])  # not a request at all
            assert not dealer.poll(300, zmq.POLLIN)  # both ignored
            assert replay_from(dealer, 0) == [(0, encode_event_batch([EVENTS[3]], ts=0.0))]  # still serving
        assert publisher.closed
    finally:
        dealer.close(linger=0)
        context.term()


def test_publisher_without_pyzmq_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "zmq", None)  # makes `import zmq` raise ImportError
    with pytest.raises(ImportError, match=r"pip install '\.\[zmq\]' in the flat-kvcache source tree"):
        ZmqEventPublisher("tcp://127.0.0.1:*")
    # Encoding needs nothing optional.
    assert encode_event_batch(EVENTS, ts=0.0).startswith(b"\x93")


def engine_events(api: ModuleType) -> tuple[list[KVCacheEvent], list[str], list[str]]:
    """Events of a small run on ``api`` (native or reference): stored, evicted, stored, cleared.

    One full-attention group of 4-token pages in a 5-page pool (4 usable). Request a (10
    tokens) computes 3 pages and finishes: its 2 full pages are registered, then all 3 freed,
    tail first. Request b (12 other tokens) takes the 4 free pages' first 3: the free page 4,
    then a's pages 3 and 2, evicting a's second page (page 1 keeps a's first hash). b finishes
    with 3 full pages registered; reset_prefix_cache drops the 4 cached keys.
    """
    cache = api.FlatKVCache([api.KVCacheSpec("full", 4)], 5, enable_kv_events=True)
    tokens_a, tokens_b = list(range(10)), list(range(100, 112))
    assert cache.add_request("a", tokens_a) == (0, 0)
    assert cache.schedule([0], [10]).tolist() == [True]
    cache.finish([0])
    assert cache.add_request("b", tokens_b) == (0, 0)
    assert cache.schedule([0], [12]).tolist() == [True]
    cache.finish([0])
    assert cache.reset_prefix_cache() == 4
    events: list[KVCacheEvent] = cache.take_events()
    assert cache.take_events() == []
    return events, api.hash_pages(tokens_a, 4), api.hash_pages(tokens_b, 4)


def test_engine_events_published_over_loopback(api: ModuleType) -> None:
    zmq = need("zmq")
    msgpack = need("msgpack")
    events, hashes_a, hashes_b = engine_events(api)
    a0, a1 = (bytes.fromhex(h) for h in hashes_a)
    b0, b1, b2 = (bytes.fromhex(h) for h in hashes_b)
    assert events == [
        BlockStored([a0, a1], None, list(range(8)), 4, 0, "full", None, []),
        BlockRemoved([a1], 0),
        BlockStored([b0, b1, b2], None, list(range(100, 112)), 4, 0, "full", None, []),
        AllBlocksCleared(),
    ]
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    try:
        with ZmqEventPublisher("tcp://127.0.0.1:*") as publisher:
            sub.connect(publisher.endpoint)
            sub.setsockopt(zmq.SUBSCRIBE, b"")  # vLLM's default topic is the empty one
            assert publisher.wait_for_subscriber(WAIT_S)
            assert publisher.publish(events, ts=7.25) == 0
            topic, seq, payload = receive(sub)
    finally:
        sub.close(linger=0)
        context.term()
    assert (topic, seq) == (b"", bytes(8))
    ts, wire, rank = msgpack.unpackb(payload)
    assert (ts, rank, len(wire)) == (7.25, None, 4)
    stored_a, removed, stored_b, cleared = wire
    assert stored_a[:4] == ["BlockStored", [a0, a1], None, list(range(8))]
    assert stored_a[4:] == [4, None, "GPU", None, [None, None], 0, "full_attention", None]
    assert removed == ["BlockRemoved", [a1], "GPU", 0]
    assert stored_b[1:4] == [[b0, b1, b2], None, list(range(100, 112))]
    assert stored_b[8:] == [[None, None, None], 0, "full_attention", None]
    assert cleared == ["AllBlocksCleared"]


def test_events_off_by_default(api: ModuleType) -> None:
    cache = api.FlatKVCache([api.KVCacheSpec("full", 4)], 5)
    assert cache.add_request("a", list(range(10))) == (0, 0)
    assert cache.schedule([0], [10]).tolist() == [True]
    cache.finish([0])
    assert cache.take_events() == []


def test_medium_is_written_as_given() -> None:
    """A host-tier (``medium="CPU"``) event carries its medium on the wire, in both layouts,
    as vLLM's ``BlockStored``/``BlockRemoved`` do; the default stays ``"GPU"``."""
    msgpack = need("msgpack")
    stored = BlockStored([H0], None, [], 16, 0, "full", None, medium="CPU")
    removed = BlockRemoved([H1], 1, medium="CPU")
    _, (s, r), _ = msgpack.unpackb(encode_event_batch([stored, removed], ts=1.0))
    assert (s[0], s[6], r[0], r[2]) == ("BlockStored", "CPU", "BlockRemoved", "CPU")
    _, (s, r), _ = msgpack.unpackb(encode_event_batch([stored, removed], ts=1.0, layout="map"))
    assert (s["medium"], r["medium"]) == ("CPU", "CPU")
    assert BlockRemoved([H1], 1).medium == "GPU"
