"""Memory plan (SPEC 3): layer components, page geometry, and tensor plans from a byte budget.

Every function is computed natively (``flat_kvcache._native``, Rust, checked arithmetic); this
module only converts between the native tuples and the :mod:`flat_kvcache._types` dataclasses.
The contract, errors included, is docs/sizing-api.md; :mod:`flat_kvcache.reference.memory` is
the pure-Python implementation of the same contract.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from flat_kvcache import _native
from flat_kvcache._types import (
    ArenaComponent,
    ArenaGroup,
    ArenaPlan,
    BlockGeometry,
    ComponentSpec,
    FlatMemoryPlan,
    LayerBinding,
    TensorPlan,
)

__all__ = [
    "ArenaComponent",
    "ArenaGroup",
    "ArenaPlan",
    "BlockGeometry",
    "ComponentSpec",
    "FlatMemoryPlan",
    "LayerBinding",
    "TensorPlan",
    "components_from_layers",
    "equalized_block_size",
    "occurrence_index",
    "plan_arena",
    "plan_component_tensors",
    "plan_tensors",
    "solve_page_geometry",
    "state_const_bytes",
]

_Binding = tuple[int, Any, int, Any, int, int]
_Plan = tuple[tuple[int, int, int], list[tuple[str, int, list[_Binding]]]]


def _plan(raw: _Plan) -> FlatMemoryPlan:
    (block_size, block_bytes, num_blocks), tensors = raw
    return FlatMemoryPlan(
        BlockGeometry(block_size, block_bytes, num_blocks),
        tuple(
            TensorPlan(name, nbytes, tuple(LayerBinding(*binding) for binding in bindings))
            for name, nbytes, bindings in tensors
        ),
    )


def occurrence_index(layer_types: Sequence[str]) -> list[int]:
    """For each layer, the number of earlier layers with the same label (the slab pairing order).

    Parameters
    ----------
    layer_types : sequence of str
        One label per layer; labels are not checked against the known ones.

    Returns
    -------
    list of int
        The occurrence index of every layer.

    Raises
    ------
    ValueError
        ``layer_types`` is a bare str.
    TypeError
        ``layer_types`` is not a sequence of str.
    """
    return _native.occurrence_index(layer_types)


def state_const_bytes(shape: Sequence[int], itemsize: int) -> int:
    """Bytes per page of one state component, ``prod(shape) * itemsize``.

    Parameters
    ----------
    shape : sequence of int
        The component's shape per page, each dimension >= 0; empty means one element.
    itemsize : int
        Bytes per element, > 0.

    Returns
    -------
    int
        The component's bytes per page.

    Raises
    ------
    ValueError
        A negative dimension or ``itemsize <= 0``.
    TypeError
        ``shape`` is not a sequence of ints, or ``itemsize`` is not an int.
    OverflowError
        The product does not fit an unsigned 64-bit integer.
    """
    return _native.state_const_bytes(shape, itemsize)


def components_from_layers(
    layer_types: Sequence[str],
    *,
    kv_bytes_per_slot: int,
    state_component_bytes: Mapping[str, int] | None = None,
    sliding_window_tokens: int | Sequence[int | None] | None = None,
) -> list[ComponentSpec]:
    """The memory components of every layer, layer by layer.

    Parameters
    ----------
    layer_types : sequence of str
        One label per layer; group ids come from
        :func:`flat_kvcache.sizing.layer_group_ids`.
    kv_bytes_per_slot : int
        Bytes per token of a history layer's ``kv`` component, > 0.
    state_component_bytes : mapping of str to int, optional
        A state layer's components (name -> bytes per page, >= 0), in order.
    sliding_window_tokens : int, sequence of (int or None), or None
        The window argument of the grouping.

    Returns
    -------
    list of ComponentSpec
        ``ComponentSpec(gid, i, "kv", kv_bytes_per_slot, 0)`` for a history layer ``i``; one
        ``ComponentSpec(gid, i, name, 0, nbytes)`` per state component for a state layer.

    Raises
    ------
    ValueError
        ``kv_bytes_per_slot <= 0``, a negative state size, a grouping error, or a state layer
        without ``state_component_bytes``.
    TypeError
        A non-int size, a non-mapping ``state_component_bytes`` or a non-str component name.
    """
    components = _native.components_from_layers(
        layer_types,
        kv_bytes_per_slot=kv_bytes_per_slot,
        state_component_bytes=state_component_bytes,
        sliding_window_tokens=sliding_window_tokens,
    )
    return [ComponentSpec(*fields) for fields in components]


def solve_page_geometry(
    components: Sequence[ComponentSpec], block_size: int, alignment: int
) -> BlockGeometry:
    """Tokens per page and bytes per page row (``num_blocks`` is 0).

    Per (group, layer) row, per-token and per-page bytes are summed. If some row has per-page
    (state) bytes, a page must hold ``needed = ceil(max_const / max_linear)`` tokens; when
    ``needed > block_size`` the block size grows to ``needed`` rounded up to ``alignment``.
    ``block_bytes = max(max_linear * block_size, max_const)``.

    Parameters
    ----------
    components : sequence of ComponentSpec
        The components (may be empty).
    block_size : int
        Requested tokens per page, > 0.
    alignment : int
        Granularity of a grown block size, > 0.

    Returns
    -------
    BlockGeometry
        ``BlockGeometry(block_size, block_bytes, 0)``.

    Raises
    ------
    ValueError
        A bad argument or component size, a row that mixes per-token and per-page components,
        or per-page components without any per-token one.
    TypeError
        A non-int argument or component field.
    OverflowError
        A size does not fit an unsigned 64-bit integer.
    """
    block, block_bytes, num_blocks = _native.solve_page_geometry(components, block_size, alignment)
    return BlockGeometry(block, block_bytes, num_blocks)


def equalized_block_size(
    components: Sequence[ComponentSpec], block_size: int, alignment: int | None = None
) -> int:
    """The block size of :func:`solve_page_geometry`, ``alignment`` defaulting to ``block_size``.

    Parameters
    ----------
    components : sequence of ComponentSpec
        The components.
    block_size : int
        Requested tokens per page, > 0.
    alignment : int, optional
        Granularity of a grown block size (default: ``block_size``).

    Returns
    -------
    int
        Tokens per page.

    Raises
    ------
    ValueError, TypeError, OverflowError
        As :func:`solve_page_geometry`.
    """
    return _native.equalized_block_size(components, block_size, alignment)


def plan_component_tensors(
    components: Sequence[ComponentSpec],
    block_size: int,
    budget_bytes: int,
    *,
    reserved_bytes_per_block: int = 0,
) -> FlatMemoryPlan:
    """A plan with one tensor per component, every one with ``num_blocks`` page rows.

    A component's row is ``bytes_per_slot * block_size + const_bytes`` bytes and
    ``num_blocks = budget_bytes // (sum of rows + reserved_bytes_per_block)``.

    Parameters
    ----------
    components : sequence of ComponentSpec
        The components; tensor ``k`` serves component ``k``.
    block_size : int
        Tokens per page, > 0.
    budget_bytes : int
        Bytes available, >= 0.
    reserved_bytes_per_block : int, default 0
        Extra bytes per page kept outside these tensors, >= 0.

    Returns
    -------
    FlatMemoryPlan
        Tensor ``k`` is ``TensorPlan(f"{group_id}.{layer}.{component}", num_blocks * row,
        (LayerBinding(k, group_id, layer, component, row, 0),))``.

    Raises
    ------
    ValueError
        A bad argument or component size, or a budget that gives fewer than 2 blocks.
    TypeError
        A non-int argument or component field.
    OverflowError
        An operand does not fit an unsigned 64-bit integer.
    """
    raw = _native.plan_component_tensors(
        components, block_size, budget_bytes, reserved_bytes_per_block=reserved_bytes_per_block
    )
    return _plan(raw)


def plan_tensors(components: Sequence[ComponentSpec], block_size: int, budget_bytes: int) -> FlatMemoryPlan:
    """The slab plan: slot ``j`` is one tensor shared by the ``j``-th layer of every group.

    Groups and, within a group, layers are taken in first-appearance order. A (group, layer) row
    packs its components (in order) at increasing byte offsets; a slot's row is the largest row
    bound to it, and ``num_blocks = budget_bytes // sum(slot rows)``.

    Parameters
    ----------
    components : sequence of ComponentSpec
        The components.
    block_size : int
        Tokens per page, > 0.
    budget_bytes : int
        Bytes available, >= 0.

    Returns
    -------
    FlatMemoryPlan
        Tensor ``j`` is ``TensorPlan(f"slab{j}", num_blocks * slot_row_bytes[j], bindings)``
        with bindings in (group, component) order.

    Raises
    ------
    ValueError
        A bad argument or component size, or a budget that gives fewer than 2 blocks.
    TypeError
        A non-int argument or component field.
    OverflowError
        An operand does not fit an unsigned 64-bit integer.
    """
    return _plan(_native.plan_tensors(components, block_size, budget_bytes))


def plan_arena(
    components: Sequence[ComponentSpec],
    page_size: int,
    budget_bytes: int,
    *,
    alignment: int = 256,
    max_live_requests: int = 0,
) -> ArenaPlan:
    """The arena of the SPEC 13 storage (docs/sizing-api.md "Arena plan"): ``num_units`` units
    of ``unit_bytes`` (unit 0 null), each bound to one group while in use. Pass it to
    ``FlatKVCache(specs, arena=plan)`` (the engine allocates from it) and to
    ``flat_kvcache.torch.allocate_arena`` (the tensor views over it).

    Page groups (per-token components) get pages of ``page_size * sum(bytes_per_slot)`` bytes,
    addressed by byte offset (page ``p`` at byte ``p * page_bytes``), their components side by
    side in the page; every state component together makes one state slot (each component
    aligned to ``alignment``), one per unit. The unit is the state slot (or the largest page,
    if larger), rounded up to ``alignment``; without state groups, the lcm of the page sizes
    when it is at most 4 pages, else the largest page.

    Parameters
    ----------
    components : sequence of ComponentSpec
        The components (``ModelShape.components()``).
    page_size : int
        Tokens per page of the page groups, > 0.
    budget_bytes : int
        Bytes available, >= 0.
    alignment : int
        Alignment of the state components and the unit, > 0.
    max_live_requests : int
        Requests live at once, >= 0 (0: not checked). Each live request of a model with state
        groups holds a working state slot, one unit: a budget with fewer units than that is a
        ``ConfigError`` with the numbers, not a plan that cannot run.

    Returns
    -------
    ArenaPlan
        The units, one :class:`ArenaGroup` per group (first-appearance order) and one
        :class:`ArenaComponent` per component (input order).

    Raises
    ------
    ValueError
        A bad argument, no components, a group that mixes per-token and constant components or
        holds no bytes, or a budget that gives fewer than 2 units.
    ConfigError
        State groups and fewer units (the null one aside) than ``max_live_requests``.
    TypeError
        A non-int argument or component field.
    OverflowError
        A size does not fit an unsigned 64-bit integer.
    """
    try:
        if isinstance(components, (str, bytes, bytearray, memoryview)):
            raise TypeError("text is no sequence of components")
        comps = list(components)
    except TypeError:
        # Not iterable: the native call names it, after the arguments the contract checks first.
        comps = components  # type: ignore[assignment]
    page, align, unit, units, groups, placed = _native.plan_arena(
        comps, page_size, budget_bytes, alignment=alignment, max_live_requests=max_live_requests
    )
    return ArenaPlan(
        page_size=page,
        alignment=align,
        unit_bytes=unit,
        num_units=units,
        groups=tuple(
            ArenaGroup(comps[first].group_id, kind, item, per_unit, num_ids, slack)
            for first, kind, item, per_unit, num_ids, slack in groups
        ),
        components=tuple(
            ArenaComponent(comp.group_id, comp.layer, comp.component, offset, nbytes)
            for comp, (offset, nbytes) in zip(comps, placed, strict=True)
        ),
    )
