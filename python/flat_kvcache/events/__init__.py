"""KV-cache events (docs/requests-api.md, "KV events").

- :mod:`flat_kvcache.events.types`: the event dataclasses, shared by the native engine and the
  reference (the native module imports them from this package by name);
- :mod:`flat_kvcache.events.pack`: the MessagePack writer;
- :mod:`flat_kvcache.events.wire`: vLLM's two wire layouts of an event batch;
- :mod:`flat_kvcache.events.publisher`: the ZMQ publisher, with vLLM's replay socket.
"""

from flat_kvcache.events.pack import packb
from flat_kvcache.events.publisher import DEFAULT_TOPIC, REPLAY_END_SEQ, ZmqEventPublisher
from flat_kvcache.events.types import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from flat_kvcache.events.wire import MEDIUM_GPU, VLLM_SPEC_KINDS, encode_event_batch

__all__ = [
    "DEFAULT_TOPIC",
    "MEDIUM_GPU",
    "REPLAY_END_SEQ",
    "VLLM_SPEC_KINDS",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KVCacheEvent",
    "ZmqEventPublisher",
    "encode_event_batch",
    "packb",
]
