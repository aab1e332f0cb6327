"""Publishing KV-event batches over ZMQ, framed as vLLM's publisher frames them."""

from __future__ import annotations

import time
from collections.abc import Sequence
from types import TracebackType
from typing import Any, Self

from flat_kvcache.events.types import KVCacheEvent
from flat_kvcache.events.wire import Layout, encode_event_batch, int_field

__all__ = ["ZmqEventPublisher"]


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
        layout: Layout = "array",
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
        if data_parallel_rank is not None and int_field(data_parallel_rank, "data_parallel_rank") < 0:
            raise ValueError(f"data_parallel_rank must be >= 0, got {data_parallel_rank}")
        if not isinstance(int_block_hashes, bool):
            raise TypeError(f"int_block_hashes must be a bool, got {type(int_block_hashes).__name__}")
        if int_field(send_hwm, "send_hwm") < 0:
            raise ValueError(f"send_hwm must be >= 0, got {send_hwm}")
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
