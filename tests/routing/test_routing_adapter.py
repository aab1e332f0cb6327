"""What a worker advertises, from hand-made event sequences (docs/routing.md).

Pages are 4 tokens, the state grain 8 (two pages). A prompt of ``t + 1`` tokens can resume at a
grain boundary ``t`` only when every page of ``[0, t)`` is held and the checkpoint at ``t`` too;
the router's prediction for it must be exactly that boundary, whatever the order of the events.
"""

from __future__ import annotations

import math
from typing import Any

from helpers import missing

try:
    import dynamo._core  # noqa: F401 (the dynamo extra must be installed; CI installs it)
except ImportError as exc:
    missing("dynamo", exc)

import flat_kvcache as fk
import pytest
from flat_kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored
from flat_kvcache.routing import MARK_BLOCK, KvRouter, WorkerAdapter, block_u64

P, G = 4, 8
TOKENS = list(range(100, 100 + 4 * P + 1))  # four full pages, then one token
PAGES = [bytes.fromhex(h) for h in fk.hash_pages(TOKENS, P)]
# The checkpoint at 8 tokens folds pages 0-1; at 16 tokens, pages 2-3 (SPEC 4's fold).
KEY_8, KEY_16 = (bytes.fromhex(h) for h in fk.fold_hashes([p.hex() for p in PAGES], 0, G // P))
FULL, STATE = 1, 0  # event group indices, as the qwen3.5-like preset orders its groups


def stored(first: int, last: int) -> BlockStored:
    """Pages ``first..last - 1`` of TOKENS stored by one register call."""
    return BlockStored(
        block_hashes=PAGES[first:last],
        parent_block_hash=PAGES[first - 1] if first else None,
        token_ids=TOKENS[first * P : last * P],
        block_size=P,
        group_index=FULL,
        group_kind="full",
        sliding_window=None,
    )


def checkpoint(key: bytes) -> BlockStored:
    return BlockStored([key], None, [], G, STATE, "state", None)


def removed(*hashes: bytes, group: int = FULL) -> BlockRemoved:
    return BlockRemoved(list(hashes), group)


def router(state: bool) -> KvRouter:
    specs = [fk.KVCacheSpec("state", G, group_id="state"), fk.KVCacheSpec("full", P, group_id="full")]
    if not state:
        specs = specs[1:]
    return KvRouter(2, specs, P)


def predict(kv: KvRouter, tokens: list[int] = TOKENS) -> int:
    return kv.predict(tokens).get(0, 0)


def feed(kv: KvRouter, *events: Any) -> None:
    kv.feed(0, list(events))


# --- attention only ---------------------------------------------------------------------------


def test_attention_chain_depth_and_the_last_token_cap() -> None:
    kv = router(state=False)
    kv.adapters = [WorkerAdapter(P, 0), WorkerAdapter(P, 0)]  # the full group is index 0 here
    events = [
        BlockStored(e.block_hashes, e.parent_block_hash, e.token_ids, P, 0, "full", None)
        for e in (stored(0, 2), stored(2, 4))
    ]
    feed(kv, *events)
    assert predict(kv) == 16  # 17 tokens: all four pages
    assert predict(kv, TOKENS[:16]) == 12  # 16 tokens: the last token is recomputed, 3 pages
    assert predict(kv, TOKENS[:5] + [7] * 12) == 4  # differs in page 1
    assert kv.predict(TOKENS) == {0: 16}  # worker 1 holds nothing
    feed(kv, BlockRemoved([PAGES[1]], 0))
    assert predict(kv) == 4  # pages 2-3 are held but not reachable
    feed(kv, BlockStored([PAGES[1]], PAGES[0], TOKENS[4:8], P, 0, "full", None))
    assert predict(kv) == 16  # page 1 back: 2-3 are reachable again, re-advertised


def test_two_copies_of_a_page_need_two_removals() -> None:
    kv = router(state=False)
    kv.adapters = [WorkerAdapter(P, 0), WorkerAdapter(P, 0)]
    event = BlockStored(PAGES[:1], None, TOKENS[:4], P, 0, "full", None)
    feed(kv, event, event)  # two requests registered the same page
    feed(kv, BlockRemoved([PAGES[0]], 0))
    assert predict(kv) == 4
    feed(kv, BlockRemoved([PAGES[0]], 0))
    assert predict(kv) == 0


# --- with a state group ---------------------------------------------------------------------------


def test_a_boundary_needs_its_checkpoint() -> None:
    kv = router(state=True)
    feed(kv, stored(0, 4))
    assert predict(kv) == 0  # pages without a checkpoint: nothing to resume from
    feed(kv, checkpoint(KEY_16))
    assert predict(kv) == 16
    assert predict(kv, TOKENS[:16]) == 0  # the cap is 15 tokens: boundary 8 has no checkpoint
    feed(kv, checkpoint(KEY_8))
    assert predict(kv, TOKENS[:16]) == 8


def test_a_removed_checkpoint_withdraws_its_marked_block() -> None:
    kv = router(state=True)
    feed(kv, stored(0, 4), checkpoint(KEY_8), checkpoint(KEY_16))
    adapter = kv.adapters[0]
    assert adapter.marked == {PAGES[1], PAGES[3]}
    ops = adapter.apply([removed(KEY_16, group=STATE)])
    assert ops == [("removed", [block_u64(PAGES[3]) ^ MARK_BLOCK])]
    kv.index.apply(0, ops)
    assert predict(kv) == 8  # the next checkpoint down
    feed(kv, removed(KEY_8, group=STATE))
    assert predict(kv) == 0 and adapter.marked == set()
    assert adapter.advertised == set(PAGES)  # the pages stay advertised


def test_a_removed_page_withdraws_every_boundary_below_it() -> None:
    kv = router(state=True)
    feed(kv, stored(0, 4), checkpoint(KEY_8), checkpoint(KEY_16))
    adapter = kv.adapters[0]
    ops = adapter.apply([removed(PAGES[1])])
    # Deepest first: page 3's mark, page 3, page 2, page 1's mark, page 1.
    assert ops == [
        (
            "removed",
            [
                block_u64(PAGES[3]) ^ MARK_BLOCK,
                block_u64(PAGES[3]),
                block_u64(PAGES[2]),
                block_u64(PAGES[1]) ^ MARK_BLOCK,
                block_u64(PAGES[1]),
            ],
        )
    ]
    kv.index.apply(0, ops)
    assert predict(kv) == 0 and adapter.marked == set()
    # Page 1 cached again: both boundaries are resumable again (the checkpoints stayed).
    feed(kv, stored(1, 2))
    assert predict(kv) == 16 and adapter.marked == {PAGES[1], PAGES[3]}


def test_a_checkpoint_before_its_pages_and_a_clear() -> None:
    kv = router(state=True)
    feed(kv, checkpoint(KEY_16))  # the state group's event comes first in a batch
    assert predict(kv) == 0
    feed(kv, stored(0, 4))
    assert predict(kv) == 16
    feed(kv, AllBlocksCleared())
    assert predict(kv) == 0 and not kv.adapters[0].advertised


def test_the_other_worker_is_separate_and_ties_go_to_the_least_loaded() -> None:
    kv = router(state=True)
    kv.feed(1, [stored(0, 4), checkpoint(KEY_8)])
    assert kv.predict(TOKENS) == {1: 8}
    assert kv.route(TOKENS, (), [5, 5]) == (1, 8)
    assert kv.route(TOKENS[:2], (), [5, 3]) == (1, 0)  # nothing to hit: fewest queued
    assert kv.route(TOKENS[:2], (), [3, 3]) == (0, 0)  # then the lowest id


def test_dynamos_cost_trades_prefill_blocks_for_active_blocks() -> None:
    # TOKENS are 17 tokens: 5 blocks of 4. Worker 1 holds pages 0-3 and the checkpoint at 16, so
    # it would serve 16 tokens and prefill 1 block; worker 0 prefills all 5. Cost = w x prefill
    # blocks + active blocks.
    specs = [fk.KVCacheSpec("state", G, group_id="state"), fk.KVCacheSpec("full", P, group_id="full")]
    kv = KvRouter(2, specs, P, overlap_weight=1.0)
    kv.feed(1, [stored(0, 4), checkpoint(KEY_16)])
    assert kv.route(TOKENS, (), [0, 0], [0, 3]) == (1, 16)  # 5 vs 1 + 3
    assert kv.route(TOKENS, (), [0, 0], [0, 5]) == (0, 0)  # 5 vs 1 + 5
    assert kv.route(TOKENS, (), [2, 1], [0, 4]) == (1, 16)  # 5 vs 5: fewest requests
    assert kv.route(TOKENS, (), [1, 1], [0, 4]) == (0, 0)  # then the lowest id
    zero = KvRouter(2, specs, P, overlap_weight=0)
    zero.feed(1, [stored(0, 4), checkpoint(KEY_16)])
    assert zero.route(TOKENS, (), [0, 0], [1, 0]) == (1, 16)  # load alone decides
    assert zero.route(TOKENS, (), [0, 0], [0, 1]) == (0, 0)
    with pytest.raises(ValueError, match="active_blocks"):
        kv.route(TOKENS, (), [0, 0])
    with pytest.raises(ValueError, match="active_blocks"):
        kv.route(TOKENS, (), [0, 0], [0])
    for bad in (-1.0, math.nan, math.inf, True, "1"):
        with pytest.raises(ValueError, match="overlap_weight"):
            KvRouter(2, specs, P, overlap_weight=bad)  # type: ignore[arg-type]


def test_events_the_router_cannot_model_are_refused() -> None:
    adapter = WorkerAdapter(P, FULL, STATE, G)
    with pytest.raises(ValueError, match="token ids"):
        adapter.apply([BlockStored(PAGES[:1], None, [], P, FULL, "full", None)])
    with pytest.raises(ValueError, match="host-memory tier"):
        adapter.apply([BlockStored(PAGES[:1], None, [], P, FULL, "full", None, medium="CPU")])
    with pytest.raises(ValueError, match="group 5"):
        adapter.apply([removed(PAGES[0], group=5)])
