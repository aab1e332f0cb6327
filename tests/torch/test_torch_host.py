"""flat_kvcache.torch host tier: HostKVBuffers and TransferExecutor at the page level.

Every buffer of every group (K/V rows, state components) is filled with values that name the
token positions (or the state snapshot) they belong to; after the pages went to the host, the
device was cleared and a later request loaded them back, the request's pages must hold the same
values at the same positions. The model-level check is tests/model/test_model_paged.py.
"""

from __future__ import annotations

from typing import Any

import pytest
from helpers import missing

try:
    import torch
except ImportError as exc:
    missing(exc.name or "torch", exc)


import flat_kvcache as fk
from flat_kvcache import reference
from flat_kvcache.torch import (
    HostKVBuffers,
    KVBuffers,
    ModelShape,
    TransferExecutor,
    allocate_kv_buffers,
    plan_kv_memory,
)

pytestmark = [pytest.mark.torch, pytest.mark.skipif(not fk.FLAT_KVCACHE, reason="needs the flat build")]

PAGE = 4


def hybrid_plan() -> Any:
    """State, full and sliding layers (per-layer buffers, state components of two shapes)."""
    shape = ModelShape(
        layer_types=("linear_attention", "full_attention", "sliding_attention", "full_attention"),
        sliding_window=8,
        num_kv_heads=1,
        head_dim=2,
        kv_dtype=torch.float32,
        state_shapes={"conv": (3,), "ssm": (2, 2)},
        state_dtypes={"conv": torch.float32, "ssm": torch.float32},
    )
    return plan_kv_memory(
        shape,
        page_size=PAGE,
        budget_bytes=1 << 16,
        max_live_requests=2,
        max_scheduled_tokens=64,
        max_context_len=64,
        storage="equalized",
    )


def slab_plan() -> Any:
    """Sliding/full alternation: shared K/V slabs (a slab page belongs to either group)."""
    shape = ModelShape(
        layer_types=("sliding_attention", "full_attention") * 2,
        sliding_window=8,
        num_kv_heads=2,
        head_dim=2,
        kv_dtype=torch.float32,
    )
    plan = plan_kv_memory(
        shape,
        page_size=PAGE,
        budget_bytes=1 << 15,
        max_live_requests=2,
        max_scheduled_tokens=64,
        max_context_len=64,
    )
    assert plan.slab_group_size
    return plan


def write_request(cache: Any, buffers: KVBuffers, slot: int, salt: float) -> None:
    """Fill every page of the tables of the request in ``slot`` in every layer with
    ``salt + layer * 1000 + value``, value the token position (K/V rows) or the table column
    (state)."""
    tables = cache.block_tables([slot])
    group_of_layer = fk.layer_group_ids(buffers.plan.shape.layer_types, buffers.plan.shape.sliding_window)
    for layer, group in enumerate(group_of_layer):
        for column, page in enumerate(int(p) for p in tables[group][0]):
            if page == 0:
                continue
            base = salt + layer * 1000
            if group == "linear_attention":
                for tensor in buffers.state(layer).values():
                    tensor[page] = base + column
            else:
                rows = torch.arange(column * PAGE, (column + 1) * PAGE, dtype=torch.float32)
                for tensor in (buffers.k(layer), buffers.v(layer)):
                    tensor[page * PAGE : (page + 1) * PAGE] = (base + rows)[:, None, None]


def check_request(cache: Any, buffers: KVBuffers, slot: int, salt: float, hit: int) -> int:
    """Every page of the tables of the request in ``slot`` below ``hit`` holds what
    :func:`write_request` wrote; returns how many pages were checked."""
    tables = cache.block_tables([slot])
    group_of_layer = fk.layer_group_ids(buffers.plan.shape.layer_types, buffers.plan.shape.sliding_window)
    checked = 0
    for layer, group in enumerate(group_of_layer):
        for column, page in enumerate(int(p) for p in tables[group][0]):
            if page == 0 or (column + 1) * PAGE > hit:
                continue
            base = salt + layer * 1000
            if group == "linear_attention":
                for tensor in buffers.state(layer).values():
                    assert bool((tensor[page] == base + column).all()), (layer, column, page)
            else:
                rows = torch.arange(column * PAGE, (column + 1) * PAGE, dtype=torch.float32)
                for tensor in (buffers.k(layer), buffers.v(layer)):
                    got = tensor[page * PAGE : (page + 1) * PAGE, :, :]
                    assert bool((got == (base + rows)[:, None, None]).all()), (layer, column, page)
            checked += 1
    return checked


@pytest.mark.parametrize("make_plan", [hybrid_plan, slab_plan], ids=["state-full-sliding", "slabs"])
@pytest.mark.parametrize("host_store", ["write_through", "evict"])
@pytest.mark.parametrize("engine", ["native", "reference"])
def test_pages_stored_and_loaded_back_hold_their_values(make_plan: Any, host_store: str, engine: str) -> None:
    """The executor runs on either engine's transfers (it only calls the cache's API)."""
    plan = make_plan()
    buffers = allocate_kv_buffers(plan, "cpu")
    cache = (fk.FlatKVCache if engine == "native" else reference.FlatKVCache)(
        fk.kv_cache_specs(plan.groups),
        plan.num_pages,
        host_pages=64,
        host_store=host_store,  # type: ignore[arg-type]
    )
    host = HostKVBuffers(plan, 64, pin_memory=False)
    executor = TransferExecutor(cache, buffers, host)
    tokens = list(range(1, 40))
    slot, hit = cache.add_request("a", tokens)
    assert (slot, hit) == (0, 0)
    for _ in range(4):  # page-aligned chunks: state snapshots at every boundary
        assert cache.schedule([slot], [8]).all()
        write_request(cache, buffers, slot, salt=0.5)
    cache.finish([slot])
    done = executor.run()
    assert done.stores >= 8 and done.loads == 0 and done.acked == done.stores
    # Bytes: a page copies at most every buffer's page (host.nbytes() / host pages).
    page_bytes = host.nbytes() // 64
    assert 0 < done.store_bytes <= done.stores * page_bytes and done.load_bytes == 0
    first = done
    # the device forgets: keys dropped and every buffer overwritten
    cache.reset_prefix_cache()
    for tensor in buffers.tensors.values():
        tensor.fill_(-1.0)

    slot, hit = cache.add_request("b", [*tokens, 7])
    assert (slot, hit) == (0, 32)  # the last boundary before the prompt's end, as on the device
    assert cache.stats()["host_hits_tokens"] == hit
    assert cache.loads_in_flight(slot) >= 1
    done = executor.run()
    assert done.loads == cache.stats()["host_loads"] >= 1 and done.stores == 0
    assert 0 < done.load_bytes <= done.loads * page_bytes and done.store_bytes == 0
    assert executor.totals == first + done
    assert cache.loads_in_flight(slot) == 0
    assert check_request(cache, buffers, slot, salt=0.5, hit=hit) >= 1
    cache.finish([slot])
    executor.run()
    cache.check_invariants()
    assert cache.transfers_in_flight() == 0


def test_a_store_copies_each_group_page_in_every_buffer_of_that_group_only() -> None:
    """A store of a full-attention page copies that page of the full layers' buffers (in slabs
    too), and nothing else of the host buffers changes."""
    plan = slab_plan()
    buffers = allocate_kv_buffers(plan, "cpu")
    for index, tensor in enumerate(buffers.tensors.values()):
        tensor.copy_(torch.arange(tensor.numel(), dtype=torch.float32).reshape(tensor.shape) + index * 1e5)
    cache = fk.FlatKVCache(fk.kv_cache_specs(plan.groups), plan.num_pages, host_pages=16)
    host = HostKVBuffers(plan, 16)
    executor = TransferExecutor(cache, buffers, host)
    seen: list[Any] = []

    class Recording:
        """The cache, with every ``take_transfers`` answer kept for the check."""

        def __getattr__(self, name: str) -> Any:
            return getattr(cache, name)

        def take_transfers(self) -> Any:
            seen.append(cache.take_transfers())
            return seen[-1]

    executor.cache = Recording()
    before = {name: t.clone() for name, t in host.tensors.items()}
    slot, _ = cache.add_request("a", list(range(1, 18)))
    assert cache.schedule([slot], [17]).all()
    cache.finish([slot])
    done = executor.run()
    (transfers,) = seen
    stores = transfers["store"]
    assert set(stores) == {"full_attention", "sliding_attention"} and not transfers["load"]
    assert done.stores == sum(len(ids) for ids, _, _ in stores.values()) == done.acked >= 8
    touched: dict[str, set[int]] = {name: set() for name in host.tensors}
    group_of_layer = fk.layer_group_ids(plan.shape.layer_types, plan.shape.sliding_window)
    for group, (_, src, dst) in stores.items():
        for spec in plan.tensors:
            if group not in {group_of_layer[layer] for layer in spec.layers}:
                continue
            device_rows = buffers.tensors[spec.name].view(-1, PAGE, *buffers.tensors[spec.name].shape[1:])
            host_rows = host.tensors[spec.name].view(-1, PAGE, *host.tensors[spec.name].shape[1:])
            for s, d in zip(src.tolist(), dst.tolist(), strict=True):
                assert torch.equal(host_rows[d], device_rows[s]), (spec.name, group, s, d)
                touched[spec.name].add(d)
    for name, tensor in host.tensors.items():
        rows = tensor.view(-1, PAGE, *tensor.shape[1:])
        for page in range(16):
            if page not in touched[name]:
                assert torch.equal(rows[page], before[name].view_as(rows)[page]), (name, page)
    cache.check_invariants()
