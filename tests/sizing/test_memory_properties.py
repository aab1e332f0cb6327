"""Hypothesis: the native memory-plan API agrees with the reference on random inputs (SPEC 3).

Inputs range far past ``u64``. Native gives the reference's result, or the same exception class
and message; it raises ``OverflowError`` (naming an argument) exactly when a size the reference
computes (bytes per block, block counts, tensor bytes, offsets) does not fit ``u64``. Values a
result only hands back (component sizes, layers, an unchanged block size) are returned exactly.
"""

from __future__ import annotations

from typing import Any

import flat_kvcache
import flat_kvcache.reference as reference
import pytest
from flat_kvcache._types import BlockGeometry, ComponentSpec, FlatMemoryPlan
from helpers import Outcome, assert_exact, ints_in, outcome
from hypothesis import example, given
from hypothesis import strategies as st
from strategies import U64_MAX, i32, mostly_valid, signed_sizes, sizes, wide_signed_sizes, wide_sizes

pytestmark = pytest.mark.properties

FULL, SLIDING, LINEAR = "full_attention", "sliding_attention", "linear_attention"
CHUNKED = "chunked_attention"
FIELDS = [
    "bytes_per_slot",
    "const_bytes",
    "block_size",
    "alignment",
    "budget_bytes",
    "reserved_bytes_per_block",
]

block_sizes = st.one_of(st.integers(1, 64), mostly_valid)
budgets = st.one_of(st.integers(0, 10**9), mostly_valid)
FIELD_SIZES = st.one_of(sizes(small=512), wide_sizes())


COMPONENT_GROUPS = st.sampled_from(["g0", "g1", "state"])
COMPONENT_LAYERS = st.integers(0, 3)
COMPONENT_NAMES = st.sampled_from(["kv", "k", "v", "conv", "ssm"])
ONE_IN_TEN = st.integers(0, 9)


@st.composite
def component_lists(
    draw: st.DrawFn, ints: st.SearchStrategy[int] = FIELD_SIZES, max_size: int = 6
) -> list[ComponentSpec]:
    """Components of history groups (per-token bytes) and a state group (per-page bytes);
    now and then a component of the other kind, so some rows mix both."""
    comps = []
    for _ in range(draw(st.integers(0, max_size))):
        group = draw(COMPONENT_GROUPS)
        per_token = (group != "state") != (draw(ONE_IN_TEN) == 0)
        comps.append(
            ComponentSpec(
                group_id=group,
                layer=draw(COMPONENT_LAYERS),
                component=draw(COMPONENT_NAMES),
                bytes_per_slot=draw(ints) if per_token else 0,
                const_bytes=0 if per_token else draw(ints),
            )
        )
    return comps


# --- what a result computes (as opposed to what it hands back) --------------------------------


def geometry_sizes(geometry: BlockGeometry) -> list[int]:
    """The computed sizes of a geometry: its block bytes and block count (not the block size)."""
    return [geometry.block_bytes, geometry.num_blocks]


def plan_sizes(plan: FlatMemoryPlan | None) -> list[int]:
    """The computed sizes of a plan: geometry, tensor bytes, bytes per block and offsets."""
    if plan is None:
        return []
    values = geometry_sizes(plan.geometry)
    for tensor in plan.tensors:
        values.append(tensor.nbytes)
        values += [v for b in tensor.bindings for v in (b.nbytes_per_block, b.row_offset)]
    return values


# --- properties ------------------------------------------------------------------------------------


@given(
    layer_types=st.one_of(
        st.lists(st.sampled_from([FULL, SLIDING, LINEAR]), max_size=12),
        st.lists(st.text(max_size=5), max_size=8),
        st.sampled_from(["full_attention", None, [1]]),
    )
)
def test_occurrence_index_agrees(layer_types: Any) -> None:
    native = outcome(lambda: flat_kvcache.occurrence_index(layer_types))
    ref = outcome(lambda: reference.occurrence_index(layer_types))
    if isinstance(layer_types, list) and all(isinstance(label, str) for label in layer_types):
        assert native == ref
    else:  # a bare str or a non-str label: the contract names no message
        assert native.error is not None and ref.error is not None, f"native {native}, reference {ref}"


def check_state_const_bytes(shape: list[int], itemsize: int) -> None:
    native = outcome(lambda: flat_kvcache.state_const_bytes(shape, itemsize))
    ref = outcome(lambda: reference.state_const_bytes(shape, itemsize))
    assert_exact(native, ref, computed=ints_in(ref.value), names=["shape", "itemsize"])


@given(
    shape=st.lists(mostly_valid, max_size=4), itemsize=st.one_of(st.sampled_from([1, 2, 4, 8]), mostly_valid)
)
@example(shape=[2**32, 2**32], itemsize=1)  # 2**64: one more than u64 holds
@example(shape=[2**32 - 1, 2**32 + 1], itemsize=1)  # 2**64 - 1 fits exactly
@example(shape=[2**40, 2**40, 0], itemsize=4)  # a zero after an overflowing prefix
@example(shape=[0, 2**70], itemsize=4)
@example(shape=[2**200, 0], itemsize=2**200)  # a zero dimension: every other size multiplied by zero
@example(shape=[], itemsize=2**64)
@example(shape=[3, -(2**200)], itemsize=2)
def test_state_const_bytes_agrees(shape: list[int], itemsize: int) -> None:
    check_state_const_bytes(shape, itemsize)


@given(shape=st.lists(i32(low=0), max_size=1), itemsize=i32(low=1))
def test_state_const_bytes_never_overflows_on_32_bit_inputs(shape: list[int], itemsize: int) -> None:
    assert flat_kvcache.state_const_bytes(shape, itemsize) == reference.state_const_bytes(shape, itemsize)


state_bytes: st.SearchStrategy[dict[str, int] | None] = st.one_of(
    st.none(),
    st.just({}),
    st.dictionaries(
        st.sampled_from(["conv", "ssm", "h"]), st.one_of(st.integers(0, 10**6), mostly_valid), max_size=3
    ),
)


MEMORY_LAYER_TYPES = st.one_of(
    st.lists(st.sampled_from([FULL, SLIDING, LINEAR, CHUNKED]), max_size=8),
    st.lists(st.sampled_from([FULL, SLIDING, LINEAR, "mamba"]), max_size=4),
)
SLIDING_WINDOWS = st.sampled_from([8, 16, 2**64])
OTHER_WINDOWS = st.sampled_from([None, 0])
WHOLE_WINDOWS = st.sampled_from([None, 0, 8, 2**70])
PER_LAYER = st.booleans()


@st.composite
def layers_with_windows(draw: st.DrawFn) -> tuple[list[str], Any]:
    """Layer types with one window for all, or a window per layer (huge ones included)."""
    layer_types = draw(MEMORY_LAYER_TYPES)
    if not draw(PER_LAYER):
        return layer_types, draw(WHOLE_WINDOWS)
    return layer_types, [
        draw(SLIDING_WINDOWS if label in (SLIDING, CHUNKED) else OTHER_WINDOWS) for label in layer_types
    ]


@given(case=layers_with_windows(), kv_bytes=st.one_of(st.integers(1, 4096), mostly_valid), state=state_bytes)
@example(case=([FULL, LINEAR], None), kv_bytes=2**64, state={"conv": 1})
@example(case=([FULL, LINEAR], None), kv_bytes=8, state={"conv": 2**200, "ssm": 0})
@example(case=([FULL], None), kv_bytes=8, state={"conv": -1})
def test_components_from_layers_agree(case: tuple[list[str], Any], kv_bytes: int, state: Any) -> None:
    layer_types, window = case

    def call(api: Any) -> Any:
        return api.components_from_layers(
            layer_types, kv_bytes_per_slot=kv_bytes, state_component_bytes=state, sliding_window_tokens=window
        )

    native, ref = outcome(lambda: call(flat_kvcache)), outcome(lambda: call(reference))
    if ref.error is not None and "state_component_bytes[" in ref.message:
        # a negative per-page size: the contract fixes the class, not the wording
        assert native.error is ref.error, f"native {native}, reference {ref}"
        return
    assert_exact(native, ref, computed=[], names=[])


def check_geometry(comps: list[ComponentSpec], block_size: int, alignment: int) -> tuple[Outcome, Outcome]:
    """Native and reference geometry and equalized block size agree; returns the native outcomes."""
    native = outcome(lambda: flat_kvcache.solve_page_geometry(comps, block_size, alignment))
    ref = outcome(lambda: reference.solve_page_geometry(comps, block_size, alignment))
    # a block size is computed when it grew; unchanged, it is the caller's own value
    grown = [v for v in ints_in(ref.value)[:1] if v != block_size]
    computed = [] if ref.value is None else [*grown, *geometry_sizes(ref.value)]
    assert_exact(native, ref, computed=computed, names=FIELDS)
    native_eq = outcome(lambda: flat_kvcache.equalized_block_size(comps, block_size, alignment))
    ref_eq = outcome(lambda: reference.equalized_block_size(comps, block_size, alignment))
    # the block size alone: the block bytes are not part of the answer
    assert_exact(
        native_eq, ref_eq, computed=[v for v in ints_in(ref_eq.value) if v != block_size], names=FIELDS
    )
    return native, native_eq


@given(
    comps=component_lists(),
    block_size=block_sizes,
    alignment=st.one_of(st.sampled_from([1, 8, 16, 64]), mostly_valid),
)
@example(
    comps=[ComponentSpec("g", 0, "kv", 1, 0), ComponentSpec("s", 1, "ssm", 0, U64_MAX)],
    block_size=1,
    alignment=1,
)
@example(
    comps=[ComponentSpec("g", 0, "kv", 2, 0), ComponentSpec("s", 1, "ssm", 0, U64_MAX)],
    block_size=16,
    alignment=2**63,
)
@example(comps=[ComponentSpec("g", 0, "kv", 2**32, 0)], block_size=2**32, alignment=1)
@example(comps=[ComponentSpec("g", 0, "kv", 2**32 - 1, 0)], block_size=2**32 + 1, alignment=1)
@example(comps=[], block_size=2**64, alignment=1)
@example(  # per-page bytes beyond u64 over per-token bytes beyond u64: needed = 2, aligned to 2**100
    comps=[ComponentSpec("g", 0, "kv", 2**199, 0), ComponentSpec("s", 1, "ssm", 0, 2**200)],
    block_size=1,
    alignment=2**100,
)
@example(  # needed = 2**136 does not fit, so neither do the block bytes; the block size is exact
    comps=[ComponentSpec("g", 0, "kv", 2**64, 0), ComponentSpec("s", 1, "ssm", 0, 2**200)],
    block_size=1,
    alignment=1,
)
@example(comps=[ComponentSpec("g", 0, "kv", 0, 0)], block_size=2**200, alignment=2**200)  # times zero
@example(  # needed = 2**64 + 1 just above a block size of 2**64: the grown block does not fit
    comps=[ComponentSpec("g", 0, "kv", 1, 0), ComponentSpec("g", 1, "kv", 0, 2**64 + 1)],
    block_size=2**64,
    alignment=1,
)
def test_page_geometry_agrees(comps: list[ComponentSpec], block_size: int, alignment: int) -> None:
    check_geometry(comps, block_size, alignment)


@given(comps=component_lists(ints=i32(low=0), max_size=3), block_size=i32(low=1), alignment=i32(low=1))
def test_page_geometry_never_overflows_on_32_bit_inputs(
    comps: list[ComponentSpec], block_size: int, alignment: int
) -> None:
    for native in check_geometry(comps, block_size, alignment):
        assert native.error is not OverflowError, native


def check_component_plan(comps: list[ComponentSpec], block_size: int, budget: int, reserved: int) -> Outcome:
    """Native and reference per-component plans agree; returns the native outcome."""

    def call(api: Any) -> Any:
        return api.plan_component_tensors(comps, block_size, budget, reserved_bytes_per_block=reserved)

    native, ref = outcome(lambda: call(flat_kvcache)), outcome(lambda: call(reference))
    assert_exact(native, ref, computed=plan_sizes(ref.value), names=FIELDS)
    return native


@given(
    comps=component_lists(),
    block_size=block_sizes,
    budget=budgets,
    reserved=st.one_of(st.just(0), mostly_valid),
)
@example(comps=[ComponentSpec("g", 0, "kv", 2**60, 0)], block_size=16, budget=2**66, reserved=0)
@example(comps=[ComponentSpec("g", 0, "kv", 2**60 - 1, 15)], block_size=16, budget=U64_MAX, reserved=1)
@example(comps=[], block_size=16, budget=100, reserved=0)
@example(  # the row sum overflows even u128: the OverflowError must still name the arguments
    comps=[ComponentSpec("g", 0, "k", U64_MAX, 0), ComponentSpec("g", 0, "v", U64_MAX, 0)],
    block_size=U64_MAX,
    budget=0,
    reserved=0,
)
@example(comps=[], block_size=16, budget=2**200, reserved=7)
@example(  # per-page rows only: the block size beyond u64 is multiplied by zero
    comps=[ComponentSpec("s", 0, "ssm", 0, 100)], block_size=2**200, budget=1000, reserved=0
)
@example(  # rows beyond u64 against a small budget: "need at least 2", not an overflow
    comps=[ComponentSpec("g", 0, "kv", 2**100, 0)], block_size=2**100, budget=10**9, reserved=2**200
)
@example(  # rows and budget beyond u64: 4 blocks, but each row of 2**100 bytes does not fit
    comps=[ComponentSpec("g", 0, "kv", 2**100, 0)], block_size=1, budget=2**102, reserved=0
)
def test_component_plan_agrees(
    comps: list[ComponentSpec], block_size: int, budget: int, reserved: int
) -> None:
    check_component_plan(comps, block_size, budget, reserved)


@given(
    comps=component_lists(ints=i32(low=0), max_size=3),
    block_size=i32(low=1),
    budget=i32(low=0),
    reserved=i32(low=0),
)
def test_component_plan_never_overflows_on_32_bit_inputs(
    comps: list[ComponentSpec], block_size: int, budget: int, reserved: int
) -> None:
    native = check_component_plan(comps, block_size, budget, reserved)
    assert native.error is not OverflowError, native


def check_slab_plan(comps: list[ComponentSpec], block_size: int, budget: int) -> Outcome:
    """Native and reference slab plans agree; returns the native outcome."""
    native = outcome(lambda: flat_kvcache.plan_tensors(comps, block_size, budget))
    ref = outcome(lambda: reference.plan_tensors(comps, block_size, budget))
    assert_exact(native, ref, computed=plan_sizes(ref.value), names=FIELDS)
    return native


@given(comps=component_lists(), block_size=block_sizes, budget=st.one_of(budgets, wide_signed_sizes()))
@example(comps=[ComponentSpec("g", 0, "kv", 2**60, 0)], block_size=16, budget=2**66)
@example(
    comps=[ComponentSpec("g", 0, "kv", 1, 0), ComponentSpec("h", 0, "kv", 1, 0)], block_size=1, budget=U64_MAX
)
@example(comps=[ComponentSpec("g", 0, "kv", 1, 0)], block_size=1, budget=2**64)
@example(  # the block size beyond u64 is multiplied by zero
    comps=[ComponentSpec("s", 0, "ssm", 0, 7), ComponentSpec("s", 0, "conv", 0, 9)],
    block_size=2**64,
    budget=100,
)
@example(  # a budget beyond u64 with rows beyond u64: 4 blocks, but a row of 2**100 bytes does not fit
    comps=[ComponentSpec("g", 0, "kv", 2**99, 0)], block_size=2, budget=2**102 + 5
)
@example(  # the row sum overflows even u128: the OverflowError must still name the arguments
    comps=[ComponentSpec("g", 0, "k", U64_MAX, 0), ComponentSpec("g", 0, "v", U64_MAX, 0)],
    block_size=U64_MAX,
    budget=0,
)
def test_slab_plan_agrees(comps: list[ComponentSpec], block_size: int, budget: int) -> None:
    check_slab_plan(comps, block_size, budget)


@given(comps=component_lists(ints=i32(low=0), max_size=3), block_size=i32(low=1), budget=i32(low=0))
def test_slab_plan_never_overflows_on_32_bit_inputs(
    comps: list[ComponentSpec], block_size: int, budget: int
) -> None:
    native = check_slab_plan(comps, block_size, budget)
    assert native.error is not OverflowError, native


@given(
    comps=component_lists(ints=signed_sizes(small=64)).filter(
        lambda comps: any(c.bytes_per_slot < 0 or c.const_bytes < 0 for c in comps)
    )
)
def test_negative_component_fields_are_value_errors_naming_the_field(comps: list[ComponentSpec]) -> None:
    # the contract fixes the class and that the message names the field, not the exact wording
    for call in ("solve_page_geometry", "plan_component_tensors", "plan_tensors"):
        args = (comps, 16, 16) if call == "solve_page_geometry" else (comps, 16, 10**9)
        native = outcome(lambda: getattr(flat_kvcache, call)(*args))  # noqa: B023
        ref = outcome(lambda: getattr(reference, call)(*args))  # noqa: B023
        assert ref.error is ValueError
        if native.error is OverflowError:  # a huge field may be refused by size first
            assert max(map(abs, ints_in(comps))) > U64_MAX
            continue
        assert native.error is ValueError, native
        assert "bytes_per_slot" in native.message or "const_bytes" in native.message, native
