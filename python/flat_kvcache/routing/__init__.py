"""KV-aware routing over many ``FlatKVCache`` workers (docs/routing.md).

- :mod:`flat_kvcache.routing.dynamo`: Dynamo's radix-tree indexer and its event layout (the one
  place that writes it; needs the ``dynamo`` extra, ``ai-dynamo-runtime``);
- :mod:`flat_kvcache.routing.adapter`: what one worker advertises, kept from its KV events
  (plain blocks for its consecutive full-attention pages, marked blocks for resumable state
  checkpoint boundaries);
- :mod:`flat_kvcache.routing.router`: the round-robin and KV routers.

The cluster simulator that drives them is :mod:`flat_kvcache.simulate.cluster`.
"""

from flat_kvcache.routing.adapter import MARK_BLOCK, MARK_TOKENS, WorkerAdapter, block_u64, page_tokens_hashes
from flat_kvcache.routing.dynamo import DynamoIndex, encode_op, load_radix_tree
from flat_kvcache.routing.router import KvRouter, RoundRobinRouter, RouterKind, check_kv_routable

__all__ = [
    "MARK_BLOCK",
    "MARK_TOKENS",
    "DynamoIndex",
    "KvRouter",
    "RoundRobinRouter",
    "RouterKind",
    "WorkerAdapter",
    "block_u64",
    "check_kv_routable",
    "encode_op",
    "load_radix_tree",
    "page_tokens_hashes",
]
