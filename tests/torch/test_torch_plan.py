"""plan_kv_memory: page geometry, tensor shapes, slab saving, groups and the budget (never exceeded)."""

from __future__ import annotations

import math
from typing import Any

import pytest
from helpers import missing
from hypothesis import given, settings
from hypothesis import strategies as st

try:
    import torch
except ImportError as exc:
    missing("torch", exc)

import flat_kvcache
from flat_kvcache import reference as ref
from flat_kvcache.torch import KVMemoryPlan, ModelShape, plan_kv_memory

pytestmark = pytest.mark.torch

GiB = 1 << 30
LIMITS = {"max_live_requests": 8, "max_scheduled_tokens": 256, "max_context_len": 4096}


def plan(shape: ModelShape, **kwargs: Any) -> KVMemoryPlan:
    """SPEC 3's plan, asked for explicitly (a model with state layers gets the arena unless it
    asks: ``test_a_state_model_is_pointed_at_the_arena``)."""
    return plan_kv_memory(shape, **{"page_size": 16, **LIMITS, "storage": "equalized", **kwargs})


def test_a_state_model_is_pointed_at_the_arena() -> None:
    """A shape with state layers is refused without ``storage="equalized"``: its storage is the
    SPEC 13 arena, which ``plan_arena_memory`` plans from the same arguments; an attention-only
    shape is planned the same either way."""
    from flat_kvcache.errors import ConfigError

    with pytest.raises(
        ConfigError, match="36 of the 48 cache layers keep a recurrent state: their storage is"
    ):
        plan_kv_memory(ModelShape.preset("qwen3.5-like"), page_size=16, budget_bytes=GiB, **LIMITS)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="storage must be None or 'equalized', got 'arena'"):
        plan(ModelShape.preset("qwen3.5-like"), budget_bytes=GiB, storage="arena")
    gpt = ModelShape.preset("gpt-oss-like")
    limits: dict[str, Any] = dict(LIMITS)
    assert plan_kv_memory(gpt, page_size=16, budget_bytes=GiB, **limits) == plan(gpt, budget_bytes=GiB)


def alternating(pairs: int = 4, **overrides: Any) -> ModelShape:
    fields: dict[str, Any] = {
        "layer_types": ("sliding_attention", "full_attention") * pairs,
        "sliding_window": 128,
        "num_kv_heads": 2,
        "head_dim": 64,
        "kv_dtype": torch.bfloat16,
    }
    return ModelShape(**{**fields, **overrides})


def hybrid_state(**overrides: Any) -> ModelShape:
    fields: dict[str, Any] = {
        "layer_types": ("linear_attention", "linear_attention", "linear_attention", "full_attention") * 2,
        "num_kv_heads": 2,
        "head_dim": 32,
        "kv_dtype": torch.bfloat16,
        "state_shapes": {"conv": (96, 3), "ssm": (4, 16, 16)},
        "state_dtypes": {"conv": torch.bfloat16, "ssm": torch.float32},
    }
    return ModelShape(**{**fields, **overrides})


def expected_geometry(shape: ModelShape, page_size: int) -> tuple[int, int]:
    """(page size, bytes per page) from first principles, independent of the sizing API."""
    kv = 2 * shape.num_kv_heads * shape.head_dim * shape.kv_dtype.itemsize
    state = sum(
        math.prod(dims) * (shape.state_dtypes or {})[name].itemsize
        for name, dims in (shape.state_shapes or {}).items()
    )
    needed = -(-state // kv)
    size = page_size if needed <= page_size else page_size * -(-needed // page_size)
    labels = [t for t in shape.layer_types if t != "linear_attention"]
    counts = {label: labels.count(label) for label in labels}
    windows = shape.sliding_window
    one_window = windows is None or isinstance(windows, int) or len({w for w in windows if w}) <= 1
    pairs = not state and len(counts) >= 2 and len(set(counts.values())) == 1 and one_window
    if pairs and flat_kvcache.FLAT_KVCACHE:
        return size, next(iter(counts.values())) * kv * size  # shared slabs: one row per slot
    num_state = len(shape.layer_types) - len(labels)
    return size, len(labels) * kv * size + num_state * state


def test_full_attention_only_gets_per_layer_tensors() -> None:
    shape = alternating(layer_types=("full_attention",) * 3, sliding_window=None)
    got = plan(shape, budget_bytes=GiB)
    bytes_per_page = 3 * 2 * 2 * 64 * 2 * 16
    assert (got.page_size, got.bytes_per_page) == (16, bytes_per_page)
    assert got.num_pages == GiB // bytes_per_page
    assert got.slab_group_size is None and got.slab_saving_bytes == 0
    assert [t.name for t in got.tensors] == [
        "layer0.k",
        "layer0.v",
        "layer1.k",
        "layer1.v",
        "layer2.k",
        "layer2.v",
    ]
    for spec in got.tensors:
        assert spec.shape == (got.num_pages * 16, 2, 64)
        assert spec.dtype is torch.bfloat16
        assert spec.layers == (int(spec.name[5]),)
    assert got.total_bytes == got.num_pages * got.bytes_per_page <= GiB
    assert got.max_total_tokens == (got.num_pages - 1) * 16
    assert got.allocator_slack_bytes == 0


@pytest.mark.flag
def test_alternating_model_shares_slabs_and_saves_memory() -> None:
    shape = alternating(pairs=4)
    got = plan(shape, budget_bytes=GiB)
    assert got.slab_group_size == ref.hybrid_slab_group_size(shape.layer_types, sliding_window_tokens=128)
    if got.slab_group_size is None:  # the `flat` feature is off: per-layer tensors
        assert got.slab_saving_bytes == 0
        return
    assert got.slab_group_size == 4
    assert [t.name for t in got.tensors] == [f"slab{j}.{r}" for j in range(4) for r in "kv"]
    assert [t.layers for t in got.tensors[::2]] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert got.bytes_per_page == 4 * 2 * 2 * 64 * 2 * 16
    # Two labels: per-layer tensors would take twice the memory for the same pages.
    assert got.slab_saving_bytes == got.total_bytes > 0


def test_state_model_equalizes_the_page_size() -> None:
    shape = hybrid_state()
    got = plan(shape, budget_bytes=GiB)
    components = shape.components()
    assert got.page_size == ref.equalized_block_size(components, 16)
    assert (got.page_size, got.bytes_per_page) == expected_geometry(shape, 16)
    assert got.page_size > 16 and got.requested_page_size == 16
    state = [t for t in got.tensors if t.role not in ("k", "v")]
    assert [t.name for t in state[:2]] == ["layer0.conv", "layer0.ssm"]
    assert {t.layers[0] for t in state} == {0, 1, 2, 4, 5, 6}
    for spec in state:
        assert spec.shape == (got.num_pages, *(shape.state_shapes or {})[spec.role])
        assert spec.dtype == (shape.state_dtypes or {})[spec.role]
    kv = [t for t in got.tensors if t.role in ("k", "v")]
    assert [t.layers for t in kv] == [(3,), (3,), (7,), (7,)]
    assert got.slab_group_size is None and got.slab_saving_bytes == 0


@pytest.mark.flag
def test_groups_and_page_counts_are_the_published_ones() -> None:
    for shape in (alternating(), hybrid_state(), ModelShape.preset("multi-window-demo")):
        got = plan(shape, budget_bytes=4 * GiB)
        tokens = (got.num_pages - 1) * got.page_size
        assert got.max_total_tokens == tokens
        published = ref.publish_paged_cache_groups(
            layer_types=shape.layer_types,
            sliding_window_tokens=shape.sliding_window,
            page_size=got.page_size,
            max_total_tokens=tokens,
            **LIMITS,
        )
        specs = ref.group_specs_from_layer_types(
            shape.layer_types, shape.sliding_window, page_size=got.page_size
        )
        counts = ref.compute_paged_cache_group_page_counts(specs, max_total_tokens=tokens, **LIMITS)
        assert list(got.groups) == specs and dict(got.page_counts) == counts
        if flat_kvcache.FLAT_KVCACHE:
            assert published == (specs, counts)


def test_fp8_kv_is_planned_as_uint8() -> None:
    got = plan(alternating(kv_dtype=torch.float8_e4m3fn), budget_bytes=GiB)
    assert {t.dtype for t in got.tensors} == {torch.uint8}
    assert got.bytes_per_page == plan(alternating(), budget_bytes=GiB).bytes_per_page // 2


def test_summary() -> None:
    got = plan(alternating(), budget_bytes=GiB)
    assert got.summary() == {
        "budget_bytes": GiB,
        "page_size": 16,
        "bytes_per_page": got.bytes_per_page,
        "num_pages": got.num_pages,
        "tokens_that_fit": got.max_total_tokens,
        "total_bytes": got.total_bytes,
        "slab_group_size": got.slab_group_size,
        "slab_saving_bytes": got.slab_saving_bytes,
    }
    assert "KVMemoryPlan(page_size=16" in repr(got) and "TensorSpec" not in repr(got)


# -- budgets ----------------------------------------------------------------------------------


@st.composite
def shapes(draw: st.DrawFn) -> ModelShape:
    kind = draw(st.sampled_from(["full", "alternating", "uneven", "state", "windows"]))
    n = draw(st.integers(1, 6))
    window: Any = draw(st.integers(1, 4096))
    state_shapes = state_dtypes = None
    if kind == "full":
        layers, window = ["full_attention"] * n, None
    elif kind == "alternating":
        layers = ["sliding_attention", "full_attention"] * n
    elif kind == "uneven":
        layers = ["sliding_attention"] * (n + 1) + ["full_attention"] * n
    elif kind == "windows":
        layers = ["sliding_attention", "sliding_attention", "full_attention"] * n
        window = [window, window + 1, None] * n
    else:
        layers = (["linear_attention"] * draw(st.integers(1, 3)) + ["full_attention"]) * n
        window = None
        dims = st.integers(1, 64)
        state_shapes = {"conv": (draw(dims), draw(dims)), "ssm": (draw(dims), draw(dims), draw(dims))}
        state_dtypes = {"conv": torch.bfloat16, "ssm": draw(st.sampled_from([torch.float32, torch.bfloat16]))}
    return ModelShape(
        layer_types=tuple(layers),
        sliding_window=window,
        num_kv_heads=draw(st.integers(1, 8)),
        head_dim=draw(st.sampled_from([8, 64, 128, 256])),
        kv_dtype=draw(st.sampled_from([torch.bfloat16, torch.float32, torch.float8_e5m2])),
        state_shapes=state_shapes,
        state_dtypes=state_dtypes,
    )


@settings(deadline=None)
@given(shape=shapes(), page_size=st.integers(1, 64), budget=st.integers(0, 1 << 36))
def test_budget_is_never_exceeded(shape: ModelShape, page_size: int, budget: int) -> None:
    size, bytes_per_page = expected_geometry(shape, page_size)
    if budget // bytes_per_page < 2:
        with pytest.raises(ValueError, match="need at least 2"):
            plan(shape, page_size=page_size, budget_bytes=budget)
        return
    got = plan(shape, page_size=page_size, budget_bytes=budget)
    assert (got.page_size, got.bytes_per_page) == (size, bytes_per_page)
    assert got.num_pages == budget // bytes_per_page  # rounded down, page 0 included
    assert got.total_bytes == sum(t.nbytes for t in got.tensors) == got.num_pages * got.bytes_per_page
    assert got.total_bytes <= budget < got.total_bytes + got.bytes_per_page
    rows = got.num_pages * got.page_size
    assert all(t.shape[0] == (rows if t.role in ("k", "v") else got.num_pages) for t in got.tensors)
    if got.slab_group_size is not None:
        assert got.slab_saving_bytes > 0


# -- the budget from a device -----------------------------------------------------------------


def fake_cuda(monkeypatch: pytest.MonkeyPatch, free: int, total: int) -> list[Any]:
    calls: list[Any] = []

    def mem_get_info(device: Any = None) -> tuple[int, int]:
        calls.append(device)
        return free, total

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    return calls


def test_cuda_budget_formula_and_allocator_slack(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = fake_cuda(monkeypatch, free=60 * GiB, total=80 * GiB)
    shape = alternating(layer_types=("full_attention",) * 4, sliding_window=None)
    got = plan(shape, device="cuda", utilization=0.9)
    assert calls == [torch.device("cuda")]
    assert got.budget_bytes == 60 * GiB - 8 * GiB  # free - total * (1 - utilization)
    assert got.allocator_slack_bytes == (20 << 20) + 8 * (2 << 20)  # 8 tensors: K and V of 4 layers
    assert got.total_bytes <= got.budget_bytes - got.allocator_slack_bytes
    assert got.num_pages == (got.budget_bytes - got.allocator_slack_bytes) // got.bytes_per_page
    explicit = plan(shape, device=torch.device("cuda", 0), budget_bytes=GiB)
    assert explicit.budget_bytes == GiB and explicit.allocator_slack_bytes > 0 and len(calls) == 1


@pytest.mark.parametrize("utilization", [0, -0.5, 1.5])
def test_bad_utilization(monkeypatch: pytest.MonkeyPatch, utilization: float) -> None:
    fake_cuda(monkeypatch, free=60 * GiB, total=80 * GiB)
    with pytest.raises(ValueError, match="utilization must be in"):
        plan(alternating(), device="cuda", utilization=utilization)


def test_cuda_without_room(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cuda(monkeypatch, free=GiB, total=80 * GiB)
    with pytest.raises(ValueError, match="no memory left for the KV cache"):
        plan(alternating(), device="cuda")
    fake_cuda(monkeypatch, free=9 * GiB, total=80 * GiB)
    with pytest.raises(
        ValueError, match=r"cuda: free .* less \d+ bytes of CUDA allocator slack: .*need at least 2"
    ):
        plan(alternating(head_dim=1 << 16, num_kv_heads=1 << 8), device="cuda")


def test_cuda_budget_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="from device cuda: CUDA is not available"):
        plan(alternating(), device="cuda")


def test_cpu_needs_an_explicit_budget() -> None:
    with pytest.raises(ValueError, match="only CUDA devices report free memory; pass budget_bytes"):
        plan(alternating(), device="cpu")
    with pytest.raises(ValueError, match="pass budget_bytes or a CUDA device"):
        plan(alternating())
    got = plan(alternating(), device="cpu", budget_bytes=GiB)
    assert got.allocator_slack_bytes == 0


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"budget_bytes": 1000}, ValueError, r"^budget_bytes=1000 gives 0 blocks of \d+ bytes; need"),
        ({"budget_bytes": -1}, ValueError, "budget_bytes must be >= 0"),
        ({"budget_bytes": 1.5}, TypeError, "budget_bytes must be an int"),
        ({"budget_bytes": GiB, "page_size": 0}, ValueError, "page_size must be >= 1"),
        ({"budget_bytes": GiB, "max_live_requests": -1}, ValueError, "max_live_requests must be >= 0"),
        ({"budget_bytes": GiB, "max_context_len": True}, TypeError, "max_context_len must be an int"),
    ],
)
def test_bad_arguments(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        plan(alternating(), **kwargs)


def test_shape_must_be_a_model_shape() -> None:
    with pytest.raises(TypeError, match="shape must be a ModelShape"):
        plan_kv_memory("gpt-oss-like", page_size=16, budget_bytes=GiB, **LIMITS)  # type: ignore[arg-type]
