"""allocate_kv_buffers: shapes, dtypes, slab sharing, the zero page and state slabs by page id."""

from __future__ import annotations

from typing import Any

import pytest
from helpers import missing

try:
    import torch
except ImportError as exc:
    missing("torch", exc)

from flat_kvcache.torch import KVBuffers, KVMemoryPlan, ModelShape, allocate_kv_buffers, plan_kv_memory

pytestmark = pytest.mark.torch

MiB = 1 << 20
LIMITS = {"max_live_requests": 4, "max_scheduled_tokens": 64, "max_context_len": 1024}


def plan(shape: ModelShape, budget: int = 8 * MiB, page_size: int = 16) -> KVMemoryPlan:
    return plan_kv_memory(shape, page_size=page_size, budget_bytes=budget, storage="equalized", **LIMITS)


def make_shape(**overrides: Any) -> ModelShape:
    fields: dict[str, Any] = {
        "layer_types": ("sliding_attention", "full_attention") * 3,
        "sliding_window": 64,
        "num_kv_heads": 2,
        "head_dim": 32,
        "kv_dtype": torch.float16,
    }
    return ModelShape(**{**fields, **overrides})


STATE_SHAPE = make_shape(
    layer_types=("linear_attention", "linear_attention", "full_attention") * 2,
    sliding_window=None,
    state_shapes={"conv": (48, 3), "ssm": (2, 8, 8)},
    state_dtypes={"conv": torch.float16, "ssm": torch.float32},
)


@pytest.mark.flag
def test_alternating_layers_share_slabs() -> None:
    got = plan(make_shape())
    buffers = allocate_kv_buffers(got, "cpu")
    if got.slab_group_size is None:  # built without the `flat` feature: per-layer K/V
        assert len({id(buffers.k(i)) for i in range(6)}) == 6
        assert buffers.nbytes() == got.total_bytes
        return
    for i in range(3):
        assert buffers.k(2 * i) is buffers.k(2 * i + 1)
        assert buffers.v(2 * i) is buffers.v(2 * i + 1)
        assert buffers.k(2 * i) is not buffers.v(2 * i)
    assert len({id(buffers.k(i)) for i in range(6)}) == 3
    assert len(buffers.tensors) == len(buffers.data_ptrs()) == 6
    assert len(set(buffers.data_ptrs().values())) == 6
    assert buffers.nbytes() == got.total_bytes <= 8 * MiB


def test_per_layer_shapes_and_dtypes() -> None:
    shape = make_shape(layer_types=("full_attention",) * 3, sliding_window=None)
    got = plan(shape)
    buffers = allocate_kv_buffers(got, torch.device("cpu"))
    tensors = [buffers.k(i) for i in range(3)] + [buffers.v(i) for i in range(3)]
    assert len({id(t) for t in tensors}) == 6
    for tensor in tensors:
        assert tensor.shape == (got.num_pages * got.page_size, 2, 32)
        assert tensor.dtype is torch.float16 and tensor.device.type == "cpu"
        assert tensor.is_contiguous()
    assert buffers.nbytes() == got.total_bytes
    assert buffers.plan is got
    assert repr(buffers).startswith(f"KVBuffers(num_pages={got.num_pages}, page_size=16, tensors=6")


def test_buffers_start_zeroed_so_the_null_page_is_zero() -> None:
    buffers = allocate_kv_buffers(plan(STATE_SHAPE), "cpu")
    for tensor in buffers.tensors.values():
        assert not tensor.any()
    assert not buffers.k(2)[:16].any()  # page 0 rows of an attention layer
    assert not buffers.state(0)["ssm"][0].any()  # page 0 of a state layer


def test_fp8_kv_is_stored_as_uint8() -> None:
    buffers = allocate_kv_buffers(plan(make_shape(kv_dtype=torch.float8_e4m3fn)), "cpu")
    k = buffers.k(0)
    assert k.dtype is torch.uint8
    view = k.view(torch.float8_e4m3fn)
    view[16] = 1.5
    assert view[16].float().eq(1.5).all() and k[16].ne(0).all()


def test_state_slabs_are_per_layer_and_indexed_by_page_id() -> None:
    got = plan(STATE_SHAPE, budget=64 * MiB)
    buffers = allocate_kv_buffers(got, "cpu")
    state_layers = [0, 1, 3, 4]
    for layer in state_layers:
        state = buffers.state(layer)
        assert list(state) == ["conv", "ssm"]
        assert state["conv"].shape == (got.num_pages, 48, 3) and state["conv"].dtype is torch.float16
        assert state["ssm"].shape == (got.num_pages, 2, 8, 8) and state["ssm"].dtype is torch.float32
    assert len({id(buffers.state(layer)["ssm"]) for layer in state_layers}) == 4
    page = got.num_pages - 1
    buffers.state(3)["ssm"][page] = 7.0
    assert buffers.state(3)["ssm"][page].eq(7.0).all()
    assert buffers.state(3)["ssm"][:page].eq(0).all()
    assert all(not buffers.state(layer)["ssm"].any() for layer in (0, 1, 4))
    assert buffers.k(2).shape == (got.num_pages * got.page_size, 2, 32)
    assert buffers.nbytes() == got.total_bytes


def test_state_layers_have_no_kv_and_attention_layers_no_state() -> None:
    buffers = allocate_kv_buffers(plan(STATE_SHAPE, budget=64 * MiB), "cpu")
    with pytest.raises(ValueError, match=r"layer 1 is a linear_attention \(state\) layer: it has no K/V"):
        buffers.k(1)
    with pytest.raises(ValueError, match="layer 4 is a linear_attention"):
        buffers.v(4)
    with pytest.raises(ValueError, match="layer 2 is a full_attention layer: it has no state"):
        buffers.state(2)
    with pytest.raises(IndexError, match="layer 6 out of range: the model has 6 layers"):
        buffers.k(6)
    with pytest.raises(ValueError, match="layer must be >= 0"):
        buffers.state(-1)
    with pytest.raises(TypeError, match="layer must be an int"):
        buffers.k(True)
    with pytest.raises(TypeError):
        buffers.state(0)["conv"] = torch.zeros(1)  # type: ignore[index]


def test_allocate_checks_its_plan() -> None:
    with pytest.raises(TypeError, match="plan must be a KVMemoryPlan or an ArenaMemoryPlan, not str"):
        allocate_kv_buffers("plan", "cpu")  # type: ignore[call-overload]
    assert isinstance(allocate_kv_buffers(plan(make_shape()), "cpu"), KVBuffers)


def test_writes_through_a_page_reach_the_shared_slab() -> None:
    got = plan(make_shape())
    buffers = allocate_kv_buffers(got, "cpu")
    size = got.page_size
    page = 3
    buffers.k(0)[page * size : (page + 1) * size] = 1.0  # the sliding group owns page 3 ...
    if got.slab_group_size is not None:
        assert buffers.k(1)[page * size].eq(1.0).all()  # ... so layer 1 sees it: same memory
    assert buffers.k(0)[: page * size].eq(0).all()


def test_wrapping_existing_tensors_checks_them() -> None:
    got = plan(make_shape())
    tensors = {spec.name: torch.zeros(spec.shape, dtype=spec.dtype) for spec in got.tensors}
    assert KVBuffers(got, tensors).nbytes() == got.total_bytes
    first = got.tensors[0]
    with pytest.raises(ValueError, match=f"no tensor for planned buffer '{first.name}'"):
        KVBuffers(got, {name: t for name, t in tensors.items() if name != first.name})
    with pytest.raises(ValueError, match=f"buffer '{first.name}' is .* the plan says"):
        KVBuffers(got, {**tensors, first.name: torch.zeros(3)})
