"""flat_kvcache.torch host tier over the SPEC 13 arena: ArenaHostBuffers and TransferExecutor.

Over an arena the host tier is per group (``FlatKVCache(specs, arena=plan, host_pages=...)``):
each group's host pages hold pages of its own geometry, a state group's a whole state slot, so
a checkpoint offloads like any attention page. A runner without a model writes known values at
the ids the engine hands out (K/V of position ``t`` and layer ``l``; the state after ``c``
tokens), runs the transfers after each step, evicts everything from the device and overwrites
the arena with NaN poison; a request sharing the prefix then loads the pages and the checkpoint
back, and must read exactly those values: K/V through its page table, the state in the slot its
first step reads (``state_slots``). On CPU, both engines, both store policies.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest
from helpers import missing, small_arena_hybrid

try:
    import torch
except ImportError as exc:
    missing("torch", exc)

import flat_kvcache
import flat_kvcache.reference
from flat_kvcache import KVCacheSpec, plan_arena
from flat_kvcache.torch import (
    ArenaBuffers,
    ArenaHostBuffers,
    HostKVBuffers,
    ModelShape,
    TransferExecutor,
    allocate_arena,
    plan_kv_memory,
)

pytestmark = pytest.mark.torch

P, G = 4, 8
FULL, STATE = "full_attention", "linear_attention"
ENGINES = [pytest.param(flat_kvcache, id="native"), pytest.param(flat_kvcache.reference, id="reference")]


def shape() -> ModelShape:
    """The arena data tests' small hybrid (``test_arena_engine_dataflow.hybrid``): some K/V pages
    straddle units; bf16 K/V and conv state, fp32 ssm state."""
    made: ModelShape = small_arena_hybrid()
    return made


def kv_value(layer: int, position: int) -> float:
    return float(layer * 100 + position + 1)  # exact in bf16 below 256


def state_value(layer: int, component: str, computed: int) -> float:
    return float(computed * 10 + layer + len(component))


class Runner:
    """The engine over an arena plan, the arena on CPU, its host tier and the executor."""

    def __init__(self, engine: ModuleType, host_pages: Any, host_store: str) -> None:
        self.shape = shape()
        components = self.shape.components()
        unit = plan_arena(components, P, 1 << 30).unit_bytes
        self.plan = plan_arena(components, P, 24 * unit)
        self.arena: ArenaBuffers = allocate_arena(self.shape, self.plan, "cpu")
        specs = [KVCacheSpec("full", P, group_id=FULL), KVCacheSpec("state", G, group_id=STATE)]
        self.cache = engine.FlatKVCache(specs, arena=self.plan, host_pages=host_pages, host_store=host_store)
        self.host = ArenaHostBuffers(self.plan, host_pages, pin_memory=False)
        self.executor = TransferExecutor(self.cache, self.arena, self.host)
        self.attention = [i for i, t in enumerate(self.shape.layer_types) if t == FULL]
        self.states = [
            (i, c) for i, t in enumerate(self.shape.layer_types) if t == STATE for c in ("conv", "ssm")
        ]

    def pages(self, slot: int, group: str) -> list[int]:
        return [int(p) for p in self.cache.page_ids(slot)[list(self.cache.group_ids).index(group)]]

    def step(self, slot: int) -> tuple[int, int]:
        """Schedule the next chunk and write what a model would: the state after it in the write
        slot (after checking the read slot holds the state before it), K/V of its positions."""
        n = int(self.cache.next_chunk(slot, 64))
        start = int(self.cache.num_computed_tokens(slot))
        assert self.cache.schedule([slot], [n]).tolist() == [True]
        read, write = (int(x[0]) for x in self.cache.state_slots([slot], [n]))
        for layer, component in self.states:
            view = self.arena.state(layer, component)
            want = 0.0 if start == 0 else state_value(layer, component, start)
            assert torch.equal(view[read], torch.full_like(view[read], want)), (layer, component, read)
            view[write] = state_value(layer, component, start + n)
        table = self.pages(slot, FULL)
        for t in range(start, start + n):
            for layer in self.attention:
                self.arena.k(layer)[table[t // P], t % P] = kv_value(layer, t)
                self.arena.v(layer)[table[t // P], t % P] = -kv_value(layer, t)
        self.executor.run()  # after the forward: the write-through stores of this step
        return read, write

    def kv_holds(self, slot: int, tokens: int) -> bool:
        table = self.pages(slot, FULL)
        for t in range(tokens):
            for layer in self.attention:
                k = self.arena.k(layer)[table[t // P], t % P]
                v = self.arena.v(layer)[table[t // P], t % P]
                if not (bool((k == kv_value(layer, t)).all()) and bool((v == -kv_value(layer, t)).all())):
                    return False
        return True


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("host_store", ["write_through", "evict"])
@pytest.mark.parametrize("host_pages", [{FULL: 16, STATE: 4}, 8])
def test_a_checkpoint_and_its_pages_come_back_from_host_memory(
    engine: ModuleType, host_store: str, host_pages: Any
) -> None:
    run = Runner(engine, host_pages, host_store)
    prompt = list(range(100, 120))
    slot, hit = (int(x) for x in run.cache.add_request("a", prompt))
    assert hit == 0
    while run.cache.num_computed_tokens(slot) < len(prompt):
        run.step(slot)  # 16 (the body, checkpointed at 16), then 4
    checkpoint = run.pages(slot, STATE)[1]
    saved = run.arena.pages(STATE)[checkpoint].clone()
    run.cache.finish([slot])
    done = run.executor.run()  # the evict policy stores here
    assert run.cache.transfers_in_flight() == 0
    assert run.executor.totals.stores == 6 and run.executor.totals.loads == 0
    assert run.executor.totals.store_bytes == 5 * run.plan.groups[0].item_bytes + run.plan.unit_bytes
    assert done.acked == done.stores
    # the checkpoint's bytes are on the host: the state group's one stored page
    assert torch.equal(run.host.page(STATE, 0), saved)

    # Evict every key on the device and poison the arena (unit 0 stays zeros).
    assert run.cache.reset_prefix_cache() == 6
    run.arena.arena[run.plan.unit_bytes :].fill_(0xFF)

    slot, hit = (int(x) for x in run.cache.add_request("b", [*prompt, 7, 8, 9, 10]))
    assert hit == 16 and run.cache.loads_in_flight(slot) == 5
    loaded = run.executor.run()
    assert (loaded.loads, loaded.stores, run.cache.loads_in_flight(slot)) == (5, 0, 0)
    assert loaded.load_bytes == 4 * run.plan.groups[0].item_bytes + run.plan.unit_bytes
    assert run.kv_holds(slot, 16), "the loaded K/V pages hold what the first request wrote"
    assert torch.equal(run.arena.pages(STATE)[run.pages(slot, STATE)[1]], saved)
    read, write = run.step(slot)  # checks that the read slot holds the state after 16 tokens
    assert read == run.pages(slot, STATE)[1] and write != read
    run.cache.check_invariants()


def test_host_buffers_follow_the_host_pages_forms() -> None:
    components = shape().components()
    plan = plan_arena(components, P, 24 * plan_arena(components, P, 1 << 30).unit_bytes)
    sizes = {g.group_id: g.item_bytes for g in plan.groups}
    every = ArenaHostBuffers(plan, 3, pin_memory=False)
    assert dict(every.host_pages) == {FULL: 3, STATE: 3} and every.host_pages_total == 6
    assert {gid: tuple(t.shape) for gid, t in every.tensors.items()} == {
        FULL: (3, sizes[FULL]),
        STATE: (3, sizes[STATE]),
    }
    assert every.nbytes() == 3 * (sizes[FULL] + sizes[STATE]) and not every.pinned
    some = ArenaHostBuffers(plan, {STATE: 2}, pin_memory=False)
    assert dict(some.host_pages) == {FULL: 0, STATE: 2} and list(some.tensors) == [STATE]
    assert some.page(STATE, 1).shape == (sizes[STATE],)
    with pytest.raises(IndexError, match="group 'full_attention' has 0 host pages"):
        some.page(FULL, 0)
    with pytest.raises(ValueError, match="host_pages names group 'attn'"):
        ArenaHostBuffers(plan, {"attn": 2})
    with pytest.raises(TypeError, match=r"host_pages keys must be group ids \(str\)"):
        ArenaHostBuffers(plan, {0: 2})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match=r"host_pages must be >= 0"):
        ArenaHostBuffers(plan, -1)
    with pytest.raises(OverflowError, match="host_pages: the groups' host pages add up to"):
        ArenaHostBuffers(plan, 2**31)
    with pytest.raises(TypeError, match="plan must be an ArenaPlan or an ArenaMemoryPlan"):
        ArenaHostBuffers(object(), 2)  # type: ignore[arg-type]


def test_the_executor_refuses_buffers_that_do_not_match() -> None:
    run = Runner(flat_kvcache, {STATE: 2}, "write_through")
    with pytest.raises(ValueError, match="host tier of 2 pages in all, the host buffers have 4"):
        TransferExecutor(run.cache, run.arena, ArenaHostBuffers(run.plan, {STATE: 4}, pin_memory=False))
    paged = plan_kv_memory(
        shape(),
        page_size=P,
        budget_bytes=1 << 16,
        max_live_requests=1,
        max_scheduled_tokens=8,
        max_context_len=8,
        storage="equalized",
    )
    with pytest.raises(TypeError, match="host must be ArenaHostBuffers over ArenaBuffers"):
        TransferExecutor(run.cache, run.arena, HostKVBuffers(paged, 2, pin_memory=False))
    # The same total in other groups: refused at the first transfer naming a page past them.
    wrong = TransferExecutor(run.cache, run.arena, ArenaHostBuffers(run.plan, {FULL: 2}, pin_memory=False))
    run.cache.add_request("a", list(range(20)))
    run.cache.schedule([0], [16])
    run.cache.schedule([0], [4])  # registers the checkpoint: a store of the state group
    with pytest.raises(ValueError, match="a store of group 'linear_attention', which has no host buffers"):
        wrong.run()
