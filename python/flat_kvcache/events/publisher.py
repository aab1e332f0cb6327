"""Publishing KV-event batches over ZMQ, framed as vLLM's publisher frames them.

The stream
    A PUB socket sends one multipart message per batch, ``[topic, seq, payload]``: the topic
    as UTF-8 (vLLM's default is the empty topic, which every subscriber receives), ``seq`` as
    an 8-byte big-endian unsigned int counting batches from 0, and the payload from
    :func:`~flat_kvcache.events.wire.encode_event_batch`.

Replay
    With a ``replay_endpoint``, the publisher also binds a ROUTER socket and keeps the last
    ``buffer_steps`` batches it sent. A consumer that sees a gap in the sequence numbers asks
    for the missing batches there, as it would ask vLLM's publisher:

    - request: one message whose last frame is the first wanted ``seq`` (8 bytes, big-endian),
      from a REQ socket (the ROUTER sees ``[identity, b"", start]``) or a DEALER socket
      (``[identity, start]``);
    - reply: one message ``[seq, payload]`` for every buffered batch with ``seq >= start``, in
      order, then the end marker ``[(-1).to_bytes(8, "big", signed=True), b""]`` (an empty
      payload). Batches that have left the buffer are not sent, so a consumer can tell what
      it lost for good from the first ``seq`` it gets back. The envelope (identity, and the
      empty delimiter for REQ) is the request's. A REQ socket receives one message per
      request: the first buffered batch from ``start`` (or the end marker); the rest of the
      run stays queued on it and would answer its next request, so a REQ consumer uses a
      fresh socket per request. A DEALER consumer reads the whole run up to the end marker.

    A message of any other shape is ignored, as vLLM ignores it. Requests are served by a
    daemon thread that owns the ROUTER socket, so a consumer is answered while the engine is
    idle; :meth:`ZmqEventPublisher.close` stops it.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence
from types import TracebackType
from typing import Any, Self

from flat_kvcache.events.types import KVCacheEvent
from flat_kvcache.events.wire import Layout, encode_event_batch, int_field

__all__ = ["DEFAULT_TOPIC", "REPLAY_END_SEQ", "ZmqEventPublisher"]

#: vLLM's default topic (``KVEventsConfig.topic``): empty, so a subscription to ``b""`` gets it.
DEFAULT_TOPIC = ""
#: The ``seq`` frame of the message that ends a replay: -1 as an 8-byte big-endian signed int.
REPLAY_END_SEQ = (-1).to_bytes(8, "big", signed=True)
#: How often (milliseconds) the replay thread checks whether it should stop.
_REPLAY_POLL_MS = 50


def _import_zmq() -> Any:
    try:
        import zmq
    except ImportError as exc:
        raise ImportError(
            "ZmqEventPublisher needs pyzmq, the optional `zmq` extra: pip install '.[zmq]' in the "
            "flat-kvcache source tree"
        ) from exc
    return zmq


class _ReplayServer:
    """The replay side of a publisher (module docstring): a ROUTER socket served by a daemon
    thread over a bounded buffer of the batches sent."""

    def __init__(self, zmq: Any, context: Any, endpoint: str, buffer_steps: int) -> None:
        self._zmq = zmq
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        #: The exception that stopped the thread, if one did.
        self.error: BaseException | None = None
        self._socket: Any = context.socket(zmq.ROUTER)
        try:
            self._socket.bind(endpoint)
            self.endpoint: str = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as exc:
            self._socket.close(linger=0)
            raise ValueError(f"cannot bind replay_endpoint {endpoint!r}: {exc}") from exc
        # From here on only the thread touches the socket (ZMQ sockets are not thread-safe).
        self._thread = threading.Thread(target=self._serve, name="kv-events-replay", daemon=True)
        self._thread.start()

    def record(self, seq: int, payload: bytes) -> None:
        """Keep a sent batch for replay (the oldest leaves once ``buffer_steps`` are kept)."""
        with self._lock:
            self._buffer.append((seq, payload))

    def _serve(self) -> None:
        socket = self._socket
        try:
            while not self._stop.is_set():
                if socket.poll(_REPLAY_POLL_MS, self._zmq.POLLIN):
                    self._answer(socket, socket.recv_multipart())
        except BaseException as exc:  # reported by the publisher's next call
            self.error = exc
        finally:
            socket.close(linger=0)

    def _answer(self, socket: Any, frames: list[bytes]) -> None:
        if len(frames) == 3 and frames[1] == b"":
            envelope = frames[:2]  # a REQ client: identity, empty delimiter
        elif len(frames) == 2:
            envelope = frames[:1]  # a DEALER client: identity
        else:
            return
        if len(frames[-1]) != 8:
            return
        start = int.from_bytes(frames[-1], "big")
        with self._lock:
            batches = [(seq, payload) for seq, payload in self._buffer if seq >= start]
        for seq, payload in batches:
            socket.send_multipart([*envelope, seq.to_bytes(8, "big"), payload])
        socket.send_multipart([*envelope, REPLAY_END_SEQ, b""])

    def close(self) -> None:
        """Stop the thread (within one poll interval); it closes the socket."""
        self._stop.set()
        self._thread.join()


class ZmqEventPublisher:
    """Publishes event batches on a ZMQ PUB socket, framed as vLLM's publisher frames them.

    Each :meth:`publish` sends one multipart message ``[topic, seq, payload]`` (module
    docstring). Subscribers filter on the topic prefix; the default topic is vLLM's, empty.

    ``endpoint`` is a ZMQ address such as ``tcp://127.0.0.1:5557``; the publisher binds it
    (``bind=False`` connects instead, for a subscriber or proxy that binds). A bound TCP
    endpoint may name port ``*``; :attr:`endpoint` then tells the port ZMQ chose.

    Sending happens in the calling thread: ``publish`` returns once ZMQ has queued the
    message. Like any PUB socket, batches sent before a subscriber has joined are dropped;
    :meth:`wait_for_subscriber` blocks until one has subscribed. Use as a context manager or
    call :meth:`close`. ``data_parallel_rank``, ``layout`` and ``int_block_hashes`` go to
    :func:`encode_event_batch`. Needs pyzmq (``pip install '.[zmq]'``).

    ``replay_endpoint`` (an address to bind, port ``*`` allowed; :attr:`replay_endpoint` tells
    the bound one) turns on vLLM's replay socket, which answers for the last ``buffer_steps``
    batches (module docstring).
    """

    def __init__(
        self,
        endpoint: str,
        *,
        topic: str = DEFAULT_TOPIC,
        data_parallel_rank: int | None = None,
        layout: Layout = "array",
        int_block_hashes: bool = False,
        bind: bool = True,
        send_hwm: int = 100_000,
        replay_endpoint: str | None = None,
        buffer_steps: int = 10_000,
    ) -> None:
        zmq = _import_zmq()
        if not isinstance(endpoint, str):
            raise TypeError(f"endpoint must be a str, got {type(endpoint).__name__}")
        if not isinstance(topic, str):
            raise TypeError(f"topic must be a str, got {type(topic).__name__}")
        if layout not in ("array", "map"):
            raise ValueError(f"layout must be 'array' or 'map', got {layout!r}")
        if data_parallel_rank is not None and int_field(data_parallel_rank, "data_parallel_rank") < 0:
            raise ValueError(f"data_parallel_rank must be >= 0, got {data_parallel_rank}")
        if not isinstance(int_block_hashes, bool):
            raise TypeError(f"int_block_hashes must be a bool, got {type(int_block_hashes).__name__}")
        if int_field(send_hwm, "send_hwm") < 0:
            raise ValueError(f"send_hwm must be >= 0, got {send_hwm}")
        if replay_endpoint is not None and not isinstance(replay_endpoint, str):
            raise TypeError(f"replay_endpoint must be a str or None, got {type(replay_endpoint).__name__}")
        if int_field(buffer_steps, "buffer_steps") < 1:
            raise ValueError(f"buffer_steps must be >= 1, got {buffer_steps}")
        self._endpoint = endpoint
        self._topic = topic.encode("utf-8")
        self._rank = data_parallel_rank
        self._layout: Layout = layout
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
        self._replay: _ReplayServer | None = None
        if replay_endpoint is not None:
            try:
                self._replay = _ReplayServer(zmq, self._context, replay_endpoint, buffer_steps)
            except ValueError:
                self._socket.close(linger=0)
                self._socket = None
                self._context.term()
                raise
        self._zmq = zmq

    @property
    def endpoint(self) -> str:
        """The endpoint: as bound (with the port ZMQ chose for ``*``), or as given to connect."""
        return self._endpoint

    @property
    def replay_endpoint(self) -> str | None:
        """The bound replay endpoint (with the port ZMQ chose for ``*``); None without replay."""
        return None if self._replay is None else self._replay.endpoint

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
        replay = self._replay
        if replay is not None and replay.error is not None:
            raise RuntimeError(f"the replay thread stopped: {replay.error!r}") from replay.error
        seq = self._seq
        socket.send_multipart([self._topic, seq.to_bytes(8, "big"), payload])
        if replay is not None:
            replay.record(seq, payload)
        self._seq = seq + 1
        return seq

    def close(self, linger: float = 1.0) -> None:
        """Close the socket, waiting up to ``linger`` seconds for queued batches to go out. Idempotent."""
        if self._socket is None:
            return
        if self._replay is not None:
            self._replay.close()
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
