"""SPEC 3 memory-plan rules and every error of the contract (docs/sizing-api.md), by example.

Every test runs against both implementations (``api`` fixture). Expected numbers are worked
out by hand from the SPEC formulas, with the working in comments.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import flat_kvcache
import numpy as np
import pytest
from flat_kvcache._types import BlockGeometry, ComponentSpec, FlatMemoryPlan, LayerBinding, TensorPlan

FULL, SLIDING, LINEAR = "full_attention", "sliding_attention", "linear_attention"

MEMORY_NAMES = {
    "ComponentSpec",
    "BlockGeometry",
    "LayerBinding",
    "TensorPlan",
    "FlatMemoryPlan",
    "occurrence_index",
    "state_const_bytes",
    "components_from_layers",
    "solve_page_geometry",
    "equalized_block_size",
    "plan_component_tensors",
    "plan_tensors",
    "plan_arena",
    "ArenaPlan",
    "ArenaGroup",
    "ArenaComponent",
}


NEED_TWO = "budget_bytes={} gives {} blocks of {} bytes; need at least 2 (one is the null page)"
MIXES = "group {} layer {} mixes per-token and per-page components"
NO_HISTORY = "state components need at least one per-token (history) component to size pages"


def kv(group: str, layer: int, bytes_per_slot: int, name: str = "kv") -> ComponentSpec:
    return ComponentSpec(group, layer, name, bytes_per_slot, 0)


def const(group: str, layer: int, name: str, nbytes: int) -> ComponentSpec:
    return ComponentSpec(group, layer, name, 0, nbytes)


def test_both_implementations_export_the_contract_names(api: ModuleType) -> None:
    assert set(api.memory.__all__) == MEMORY_NAMES
    for name in MEMORY_NAMES:
        assert getattr(api, name) is getattr(api.memory, name)
    assert api.ComponentSpec is ComponentSpec
    assert api.FlatMemoryPlan is FlatMemoryPlan


# --- occurrence_index ----------------------------------------------------------------------------


def test_occurrence_index(api: ModuleType) -> None:
    assert api.occurrence_index([SLIDING, FULL, SLIDING, FULL, LINEAR, SLIDING]) == [0, 0, 1, 1, 0, 2]
    assert api.occurrence_index(["x", "x", "y", "x"]) == [0, 1, 0, 2]  # labels are not validated
    assert api.occurrence_index(()) == []


def test_occurrence_index_refuses_a_bare_str(api: ModuleType) -> None:
    with pytest.raises(ValueError):
        api.occurrence_index("full_attention")


# --- state_const_bytes ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("shape", "itemsize", "expected"),
    [
        ((3, 4), 2, 24),
        ([8192, 3], 2, 49152),  # a conv state: 8192 channels x (kernel 4 - 1), bf16
        ((32, 128, 128), 4, 2097152),  # an ssm state: 32 heads x 128 x 128, fp32
        ((), 4, 4),  # empty shape: one element
        ((0, 5), 2, 0),
        ((np.int64(6), np.uint8(7)), np.int32(1), 42),
    ],
)
def test_state_const_bytes(api: ModuleType, shape: Any, itemsize: Any, expected: int) -> None:
    assert api.state_const_bytes(shape, itemsize) == expected


@pytest.mark.parametrize(
    ("shape", "itemsize", "error", "message"),
    [
        ((3, -1), 2, ValueError, "shape[1] must be >= 0, got -1"),
        ((3, 4), 0, ValueError, "itemsize must be > 0, got 0"),
        ((3, 4), -2, ValueError, "itemsize must be > 0, got -2"),
        ((True, 4), 2, TypeError, "shape[0] must be an int, not bool"),
        ((3, 4), True, TypeError, "itemsize must be an int, not bool"),
        ((3, 4.0), 2, TypeError, None),
        ((3, 4), 2.0, TypeError, None),
    ],
)
def test_state_const_bytes_errors(
    api: ModuleType, shape: Any, itemsize: Any, error: type[Exception], message: str | None
) -> None:
    with pytest.raises(error) as info:
        api.state_const_bytes(shape, itemsize)
    if message is not None:
        assert str(info.value) == message
    else:
        assert "shape[1]" in str(info.value) or "itemsize" in str(info.value)


# --- components_from_layers ----------------------------------------------------------------------


def test_components_of_a_hybrid_model(api: ModuleType) -> None:
    comps = api.components_from_layers(
        [FULL, LINEAR, SLIDING],
        kv_bytes_per_slot=256,
        state_component_bytes={"conv": 100, "ssm": 2000},
        sliding_window_tokens=64,
    )
    assert comps == [
        ComponentSpec(FULL, 0, "kv", 256, 0),
        ComponentSpec(LINEAR, 1, "conv", 0, 100),
        ComponentSpec(LINEAR, 1, "ssm", 0, 2000),
        ComponentSpec(SLIDING, 2, "kv", 256, 0),
    ]


def test_components_keep_the_mapping_order_and_multi_window_ids(api: ModuleType) -> None:
    comps = api.components_from_layers(
        [SLIDING, LINEAR, SLIDING],
        kv_bytes_per_slot=8,
        state_component_bytes={"ssm": 5, "conv": 0},
        sliding_window_tokens=[16, None, 32],
    )
    assert comps == [
        ComponentSpec("sliding_attention_16", 0, "kv", 8, 0),
        ComponentSpec(LINEAR, 1, "ssm", 0, 5),
        ComponentSpec(LINEAR, 1, "conv", 0, 0),
        ComponentSpec("sliding_attention_32", 2, "kv", 8, 0),
    ]


def test_components_without_state_layers_need_no_state_bytes(api: ModuleType) -> None:
    assert api.components_from_layers([FULL, FULL], kv_bytes_per_slot=np.int64(2)) == [
        ComponentSpec(FULL, 0, "kv", 2, 0),
        ComponentSpec(FULL, 1, "kv", 2, 0),
    ]
    assert api.components_from_layers([], kv_bytes_per_slot=1) == []


@pytest.mark.parametrize(
    ("layer_types", "kwargs", "error", "message"),
    [
        ([FULL], {"kv_bytes_per_slot": 0}, ValueError, "kv_bytes_per_slot must be > 0, got 0"),
        ([FULL], {"kv_bytes_per_slot": -8}, ValueError, "kv_bytes_per_slot must be > 0, got -8"),
        ([FULL], {"kv_bytes_per_slot": True}, TypeError, "kv_bytes_per_slot must be an int, not bool"),
        (
            [FULL, LINEAR],
            {"kv_bytes_per_slot": 8},
            ValueError,
            "layer 1 (linear_attention) needs state_component_bytes",
        ),
        (
            [LINEAR],
            {"kv_bytes_per_slot": 8, "state_component_bytes": {}},
            ValueError,
            "layer 0 (linear_attention) needs state_component_bytes",
        ),
        (
            [FULL, "mamba"],
            {"kv_bytes_per_slot": 8},
            ValueError,
            "unknown layer_type 'mamba' at layer 1; expected one of full_attention, sliding_attention, "
            "linear_attention, chunked_attention",
        ),
        (
            [SLIDING],
            {"kv_bytes_per_slot": 8},
            ValueError,
            "layer 0 (sliding_attention) needs a positive sliding window, got None",
        ),
    ],
)
def test_components_errors(
    api: ModuleType, layer_types: list[str], kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error) as info:
        api.components_from_layers(layer_types, **kwargs)
    assert str(info.value) == message


def test_components_refuse_negative_state_bytes(api: ModuleType) -> None:
    with pytest.raises(ValueError, match="state_component_bytes"):
        api.components_from_layers([LINEAR], kv_bytes_per_slot=8, state_component_bytes={"conv": -1})


# --- solve_page_geometry / equalized_block_size ------------------------------------------------


def test_geometry_of_history_rows(api: ModuleType) -> None:
    # rows: (a,0) 100, (b,1) 300, (a,2) 100+100 -> max_linear 300; 300*16
    comps = [kv("a", 0, 100), kv("b", 1, 300), kv("a", 2, 100, "k"), kv("a", 2, 100, "v")]
    assert api.solve_page_geometry(comps, 16, 16) == BlockGeometry(16, 4800, 0)


def test_geometry_components_of_one_row_add_up(api: ModuleType) -> None:
    # (a,0): k 100 + v 250 = 350 per token -> 350*8
    assert api.solve_page_geometry([kv("a", 0, 100, "k"), kv("a", 0, 250, "v")], 8, 8) == BlockGeometry(
        8, 2800
    )


@pytest.mark.parametrize(
    ("linear", "constant", "block_size", "alignment", "expected"),
    [
        # needed = ceil(10000/256) = 40 > 16 -> 16*ceil(40/16) = 48; max(256*48=12288, 10000)
        (256, 10000, 16, 16, BlockGeometry(48, 12288)),
        # alignment 1: 40; max(256*40=10240, 10000)
        (256, 10000, 16, 1, BlockGeometry(40, 10240)),
        # alignment 64: 64*ceil(40/64) = 64; 256*64
        (256, 10000, 16, 64, BlockGeometry(64, 16384)),
        # needed = ceil(10000/1024) = 10 <= 16: block size kept; max(16384, 10000)
        (1024, 10000, 16, 16, BlockGeometry(16, 16384)),
        # needed = 1600/100 = 16, not > 16: kept; max(1600, 1600)
        (100, 1600, 16, 16, BlockGeometry(16, 1600)),
        # needed = ceil(1601/100) = 17 > 16 -> 16*2 = 32; 100*32
        (100, 1601, 16, 16, BlockGeometry(32, 3200)),
        # alignment smaller than the block: 17 -> 5*ceil(17/5) = 20 (may end up off the block size)
        (100, 1601, 16, 5, BlockGeometry(20, 2000)),
    ],
)
def test_geometry_grows_pages_for_state(
    api: ModuleType, linear: int, constant: int, block_size: int, alignment: int, expected: BlockGeometry
) -> None:
    comps = [kv(FULL, 0, linear), const(LINEAR, 1, "ssm", constant)]
    assert api.solve_page_geometry(comps, block_size, alignment) == expected


def test_geometry_takes_the_largest_state_row(api: ModuleType) -> None:
    # rows: (lin,1) 3000+7000 = 10000, (lin,2) 4000; linear 256 -> same as 10000 above
    comps = [
        kv(FULL, 0, 256),
        const(LINEAR, 1, "conv", 3000),
        const(LINEAR, 1, "ssm", 7000),
        const(LINEAR, 2, "conv", 4000),
    ]
    assert api.solve_page_geometry(comps, 16, 16) == BlockGeometry(48, 12288)


def test_geometry_of_nothing(api: ModuleType) -> None:
    assert api.solve_page_geometry([], 16, 4) == BlockGeometry(16, 0, 0)
    # rows with neither kind of bytes count as neither
    assert api.solve_page_geometry([ComponentSpec("g", 0, "x", 0, 0)], 16, 4) == BlockGeometry(16, 0)


@pytest.mark.parametrize(
    ("comps", "block_size", "alignment", "error", "message"),
    [
        ([ComponentSpec("g", 3, "kv", 10, 5)], 16, 16, ValueError, MIXES.format("g", 3)),
        (
            [kv("g", 0, 10), const("h", 0, "s", 5), const("g", 0, "s", 5)],
            16,
            16,
            ValueError,
            MIXES.format("g", 0),
        ),
        ([const(LINEAR, 0, "ssm", 5)], 16, 16, ValueError, NO_HISTORY),
        ([kv("g", 0, 10)], 0, 16, ValueError, "block_size must be > 0, got 0"),
        ([kv("g", 0, 10)], 16, 0, ValueError, "alignment must be > 0, got 0"),
        ([kv("g", 0, 10)], 16, -1, ValueError, "alignment must be > 0, got -1"),
        ([kv("g", 0, 10)], True, 16, TypeError, "block_size must be an int, not bool"),
    ],
)
def test_geometry_errors(
    api: ModuleType,
    comps: list[ComponentSpec],
    block_size: Any,
    alignment: Any,
    error: type[Exception],
    message: str,
) -> None:
    with pytest.raises(error) as info:
        api.solve_page_geometry(comps, block_size, alignment)
    assert str(info.value) == message


@pytest.mark.parametrize("field", ["bytes_per_slot", "const_bytes"])
def test_component_fields_must_not_be_negative(api: ModuleType, field: str) -> None:
    comp = ComponentSpec("g", 0, "kv", **{"bytes_per_slot": 1, "const_bytes": 0, field: -1})
    calls: list[Callable[[], object]] = [
        lambda: api.solve_page_geometry([comp], 16, 16),
        lambda: api.plan_component_tensors([comp], 16, 10**6),
        lambda: api.plan_tensors([comp], 16, 10**6),
    ]
    for call in calls:
        with pytest.raises(ValueError, match=field):
            call()


def test_equalized_block_size(api: ModuleType) -> None:
    comps = [kv(FULL, 0, 256), const(LINEAR, 1, "ssm", 10000)]  # needed = 40
    assert api.equalized_block_size(comps, 16) == 48  # alignment 16: 16*ceil(40/16)
    assert api.equalized_block_size(comps, 32) == 64  # alignment 32: 32*ceil(40/32)
    assert api.equalized_block_size(comps, 16, 8) == 40
    assert api.equalized_block_size(comps, 64) == 64  # 40 <= 64: kept
    assert api.equalized_block_size([kv(FULL, 0, 1)], 16) == 16
    with pytest.raises(ValueError, match=r"^block_size must be > 0, got 0$"):
        api.equalized_block_size(comps, 0)


# --- plan_component_tensors ----------------------------------------------------------------------


def test_component_plan_worked_example(api: ModuleType) -> None:
    # P=16: rows 64*16=1024, 64*16=1024, 500 -> sum 2548; + reserved 52 = 2600; 26000 // 2600 = 10
    comps = [kv("g0", 0, 64), kv("g1", 1, 64), const(LINEAR, 2, "conv", 500)]
    plan = api.plan_component_tensors(comps, 16, 26000, reserved_bytes_per_block=52)
    assert plan == FlatMemoryPlan(
        geometry=BlockGeometry(16, 2548, 10),
        tensors=(
            TensorPlan("g0.0.kv", 10240, (LayerBinding(0, "g0", 0, "kv", 1024, 0),)),
            TensorPlan("g1.1.kv", 10240, (LayerBinding(1, "g1", 1, "kv", 1024, 0),)),
            TensorPlan("linear_attention.2.conv", 5000, (LayerBinding(2, LINEAR, 2, "conv", 500, 0),)),
        ),
    )


def test_component_plan_rounds_the_budget_down(api: ModuleType) -> None:
    # one component, row 10*4 + 3 = 43 bytes; 2 blocks need 86
    plan = api.plan_component_tensors([ComponentSpec("g", 0, "x", 10, 3)], 4, 86 + 42)
    assert plan.geometry == BlockGeometry(4, 43, 2)
    assert plan.tensors[0].nbytes == 86


def test_component_plan_of_no_components_with_reserved_bytes(api: ModuleType) -> None:
    assert api.plan_component_tensors([], 16, 100, reserved_bytes_per_block=10) == FlatMemoryPlan(
        BlockGeometry(16, 0, 10), ()
    )


@pytest.mark.parametrize(
    ("comps", "budget", "reserved", "message"),
    [
        # 2 blocks of 43 + 0 need 86
        ([ComponentSpec("g", 0, "x", 10, 3)], 85, 0, NEED_TWO.format(85, 1, 43)),
        ([ComponentSpec("g", 0, "x", 10, 3)], 99, 7, NEED_TWO.format(99, 1, 50)),
        ([ComponentSpec("g", 0, "x", 10, 3)], 0, 0, NEED_TWO.format(0, 0, 43)),
        # a zero divisor: no bytes per block at all
        ([], 100, 0, NEED_TWO.format(100, 0, 0)),
        ([ComponentSpec("g", 0, "x", 0, 0)], 100, 0, NEED_TWO.format(100, 0, 0)),
    ],
)
def test_component_plan_needs_two_blocks(
    api: ModuleType, comps: list[ComponentSpec], budget: int, reserved: int, message: str
) -> None:
    with pytest.raises(ValueError) as info:
        api.plan_component_tensors(comps, 4, budget, reserved_bytes_per_block=reserved)
    assert str(info.value) == message


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"block_size": 0}, "block_size must be > 0, got 0"),
        ({"budget_bytes": -1}, "budget_bytes must be >= 0, got -1"),
        ({"reserved_bytes_per_block": -1}, "reserved_bytes_per_block must be >= 0, got -1"),
    ],
)
def test_component_plan_argument_errors(api: ModuleType, kwargs: dict[str, int], message: str) -> None:
    args: dict[str, Any] = {"block_size": 16, "budget_bytes": 10**6, "reserved_bytes_per_block": 0}
    args.update(kwargs)
    with pytest.raises(ValueError) as info:
        api.plan_component_tensors([kv("g", 0, 1)], **args)
    assert str(info.value) == message


# --- plan_tensors (slabs) ------------------------------------------------------------------------


def test_slab_plan_pairs_the_jth_layer_of_every_group(api: ModuleType) -> None:
    # sliding layers 0, 2 and full layers 1, 3; P=16, 64 B/token -> every row 1024
    # slot 0: (sliding,0) and (full,1); slot 1: (sliding,2) and (full,3); sum 2048; 14341 // 2048 = 7
    comps = api.components_from_layers(
        [SLIDING, FULL, SLIDING, FULL], kv_bytes_per_slot=64, sliding_window_tokens=8
    )
    plan = api.plan_tensors(comps, 16, 2048 * 7 + 5)
    assert plan == FlatMemoryPlan(
        geometry=BlockGeometry(16, 2048, 7),
        tensors=(
            TensorPlan(
                "slab0",
                7 * 1024,
                (LayerBinding(0, SLIDING, 0, "kv", 1024, 0), LayerBinding(0, FULL, 1, "kv", 1024, 0)),
            ),
            TensorPlan(
                "slab1",
                7 * 1024,
                (LayerBinding(1, SLIDING, 2, "kv", 1024, 0), LayerBinding(1, FULL, 3, "kv", 1024, 0)),
            ),
        ),
    )


def test_slab_plan_packs_state_components_and_takes_the_largest_row(api: ModuleType) -> None:
    # groups: linear (layers 0, 2), full (layer 1); P=16
    # linear rows: conv 100 at offset 0, ssm 900 at offset 100 -> 1000; full row 64*16 = 1024
    # slot 0: max(1000, 1024) = 1024; slot 1: 1000; sum 2024; 10000 // 2024 = 4
    comps = api.components_from_layers(
        [LINEAR, FULL, LINEAR], kv_bytes_per_slot=64, state_component_bytes={"conv": 100, "ssm": 900}
    )
    plan = api.plan_tensors(comps, 16, 10000)
    assert plan == FlatMemoryPlan(
        geometry=BlockGeometry(16, 2024, 4),
        tensors=(
            TensorPlan(
                "slab0",
                4 * 1024,
                (
                    LayerBinding(0, LINEAR, 0, "conv", 100, 0),
                    LayerBinding(0, LINEAR, 0, "ssm", 900, 100),
                    LayerBinding(0, FULL, 1, "kv", 1024, 0),
                ),
            ),
            TensorPlan(
                "slab1",
                4 * 1000,
                (LayerBinding(1, LINEAR, 2, "conv", 100, 0), LayerBinding(1, LINEAR, 2, "ssm", 900, 100)),
            ),
        ),
    )


def test_slab_plan_keeps_first_appearance_order_of_groups_layers_and_components(api: ModuleType) -> None:
    # listed out of order: group b first, then a; a's layer 5 before its layer 1; a row split up
    comps = [
        ComponentSpec("b", 9, "v", 2, 0),
        ComponentSpec("a", 5, "k", 1, 0),
        ComponentSpec("a", 1, "k", 3, 0),
        ComponentSpec("b", 9, "k", 1, 7),
    ]
    # P=2: rows (b,9): v 4 @0, k 2+7=9 @4 -> 13; (a,5): k 2 -> 2; (a,1): k 6 -> 6
    # slot 0: (b,9) 13 and (a,5) 2 -> 13; slot 1: (a,1) 6; sum 19; 100 // 19 = 5
    plan = api.plan_tensors(comps, 2, 100)
    assert plan.geometry == BlockGeometry(2, 19, 5)
    assert plan.tensors == (
        TensorPlan(
            "slab0",
            65,
            (
                LayerBinding(0, "b", 9, "v", 4, 0),
                LayerBinding(0, "b", 9, "k", 9, 4),
                LayerBinding(0, "a", 5, "k", 2, 0),
            ),
        ),
        TensorPlan("slab1", 30, (LayerBinding(1, "a", 1, "k", 6, 0),)),
    )


@pytest.mark.parametrize(
    ("comps", "budget", "message"),
    [
        ([kv("g", 0, 10), kv("h", 0, 20)], 79, NEED_TWO.format(79, 1, 40)),
        ([], 10**6, NEED_TWO.format(10**6, 0, 0)),
    ],
)
def test_slab_plan_needs_two_blocks(
    api: ModuleType, comps: list[ComponentSpec], budget: int, message: str
) -> None:
    # kv 10 and 20 B/token in two groups share slot 0: max(20, 40) = 40 per block at P=2
    with pytest.raises(ValueError) as info:
        api.plan_tensors(comps, 2, budget)
    assert str(info.value) == message


def test_slab_plan_argument_errors(api: ModuleType) -> None:
    with pytest.raises(ValueError, match=r"^block_size must be > 0, got 0$"):
        api.plan_tensors([kv("g", 0, 1)], 0, 100)
    with pytest.raises(ValueError, match=r"^budget_bytes must be >= 0, got -5$"):
        api.plan_tensors([kv("g", 0, 1)], 16, -5)


# --- u64 limit -----------------------------------------------------------------------------------


def test_huge_sizes_overflow_natively_and_stay_exact_in_python(api: ModuleType) -> None:
    # (2**40)**2 * 8 = 2**83 bytes does not fit u64
    if api is flat_kvcache:
        with pytest.raises(OverflowError):
            api.state_const_bytes((2**40, 2**40), 8)
    else:
        assert api.state_const_bytes((2**40, 2**40), 8) == 2**83
    # row 2**60 * 16 = 2**64 bytes: one more than u64 holds
    budget = 2**66
    if api is flat_kvcache:
        with pytest.raises(OverflowError):
            api.plan_tensors([kv("g", 0, 2**60)], 16, budget)
    else:
        assert api.plan_tensors([kv("g", 0, 2**60)], 16, budget).geometry == BlockGeometry(16, 2**64, 4)
