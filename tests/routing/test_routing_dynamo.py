"""Our block operations in Dynamo's event layout, checked against Dynamo's own radix tree.

Every expectation is the tree's documented meaning: ``find_matches`` counts, per worker, the
query's blocks that worker holds consecutively from the root.
"""

from __future__ import annotations

import json

import pytest
from helpers import missing

try:
    import dynamo._core  # noqa: F401 (the dynamo extra must be installed; CI installs it)
except ImportError as exc:
    missing("dynamo", exc)

from flat_kvcache.routing import DynamoIndex, encode_op


def test_the_layout_is_dynamos() -> None:
    stored = json.loads(encode_op(7, ("stored", (None, [(1, 11), (2, 12)]))))
    assert stored == {
        "event_id": 7,
        "data": {
            "stored": {
                "parent_hash": None,
                "blocks": [{"block_hash": 1, "tokens_hash": 11}, {"block_hash": 2, "tokens_hash": 12}],
            }
        },
    }
    assert json.loads(encode_op(8, ("removed", [2]))) == {
        "event_id": 8,
        "data": {"removed": {"block_hashes": [2]}},
    }
    assert json.loads(encode_op(9, ("cleared", None))) == {"event_id": 9, "data": "cleared"}
    with pytest.raises(ValueError, match="unknown block operation"):
        encode_op(0, ("moved", None))


def test_stored_runs_and_parents() -> None:
    index = DynamoIndex()
    index.apply(0, [("stored", (None, [(1, 11), (2, 12)]))])
    assert index.match_depths([11, 12, 13]) == {0: 2}
    # A later run continues from its parent's block hash.
    index.apply(0, [("stored", (2, [(3, 13)]))])
    assert index.match_depths([11, 12, 13, 14]) == {0: 3}
    assert index.match_depths([12]) == {}  # not from the root
    assert index.match_depths([]) == {}
    # The full 64-bit range round-trips.
    index.apply(0, [("stored", (3, [(2**64 - 1, 2**64 - 2)]))])
    assert index.match_depths([11, 12, 13, 2**64 - 2]) == {0: 4}


def test_removed_cuts_the_chain_and_cleared_drops_the_worker() -> None:
    index = DynamoIndex()
    index.apply(0, [("stored", (None, [(1, 11), (2, 12), (3, 13)]))])
    index.apply(0, [("removed", [2])])
    assert index.match_depths([11, 12, 13]) == {0: 1}  # block 3 is not consecutive any more
    index.apply(0, [("cleared", None)])
    assert index.match_depths([11, 12, 13]) == {}


def test_two_workers() -> None:
    index = DynamoIndex()
    # A node is found by tokens under its parent; the block hashes of a shared node must be the
    # same for every worker (1.6.1 keeps the first worker's: a parent named by another hash is
    # not found). Ours are content hashes, equal wherever the content is.
    index.apply(0, [("stored", (None, [(1, 11), (2, 12), (3, 13)]))])
    index.apply(1, [("stored", (None, [(1, 11), (2, 12)]))])
    assert index.match_depths([11, 12, 13]) == {0: 3, 1: 2}
    index.apply(1, [("stored", (2, [(3, 13)]))])
    index.apply(0, [("removed", [1])])
    assert index.match_depths([11, 12, 13]) == {1: 3}
    index.apply(1, [("removed", [3])])
    assert index.match_depths([11, 12, 13]) == {1: 2}
    dumped = [json.loads(line) for line in index.dump()]
    assert {entry["worker_id"] for entry in dumped} == {1}


def test_a_parent_the_worker_never_stored_is_refused() -> None:
    index = DynamoIndex()
    index.apply(0, [("stored", (None, [(1, 11)]))])
    with pytest.raises(RuntimeError, match="parent"):
        index.apply(1, [("stored", (1, [(2, 12)]))])  # block 1 is worker 0's, not worker 1's
