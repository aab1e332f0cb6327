"""Reference memory plan: components, page geometry and tensor plans from a byte budget.

A plain pure-Python implementation of SPEC section 3 (and of the SPEC 13 arena plan), following
docs/sizing-api.md. Sizes are
Python ints, so every product and sum is exact (the native module raises ``OverflowError``
where one does not fit ``u64``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

from flat_kvcache._types import (
    STATE_LAYER_TYPES,
    ArenaComponent,
    ArenaGroup,
    ArenaPlan,
    BlockGeometry,
    ComponentSpec,
    FlatMemoryPlan,
    LayerBinding,
    TensorPlan,
)
from flat_kvcache.errors import ConfigError
from flat_kvcache.reference._checks import as_int, ceil_div, is_sequence, non_negative, positive
from flat_kvcache.reference.sizing import layer_group_ids, layer_labels

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

#: A (group, layer) row of the page layout.
_Row = tuple[str, int]


def occurrence_index(layer_types: Sequence[str]) -> list[int]:
    """SPEC 3: for each layer, the number of earlier layers with the same label.

    That index is the slab pairing order. Labels are not checked against the known ones.
    """
    seen: dict[str, int] = {}
    indices: list[int] = []
    for label in layer_labels(layer_types):
        indices.append(seen.get(label, 0))
        seen[label] = indices[-1] + 1
    return indices


def state_const_bytes(shape: Sequence[int], itemsize: int) -> int:
    """SPEC 3: bytes per page of one state component, ``prod(shape) * itemsize``.

    An empty shape is one element. Every ``shape[i]`` must be an int >= 0, ``itemsize`` > 0.
    """
    if isinstance(shape, str) or not is_sequence(shape):
        raise TypeError(f"shape must be a sequence of ints, not {type(shape).__name__}")
    dims = [non_negative(dim, f"shape[{i}]") for i, dim in enumerate(shape)]
    return math.prod(dims) * positive(itemsize, "itemsize")


def _state_components(state_component_bytes: Mapping[str, int] | None) -> list[tuple[str, int]]:
    """The ``(name, bytes per page)`` items of the state mapping, in its order, checked."""
    if state_component_bytes is None:
        return []
    if not isinstance(state_component_bytes, Mapping):
        raise TypeError(
            "state_component_bytes must be a mapping of component name to bytes per page, "
            f"not {type(state_component_bytes).__name__}"
        )
    items: list[tuple[str, int]] = []
    for name, nbytes in state_component_bytes.items():
        if not isinstance(name, str):
            raise TypeError(f"state_component_bytes keys must be str, not {type(name).__name__}")
        items.append((name, non_negative(nbytes, f"state_component_bytes[{name!r}]")))
    return items


def components_from_layers(
    layer_types: Sequence[str],
    *,
    kv_bytes_per_slot: int,
    state_component_bytes: Mapping[str, int] | None = None,
    sliding_window_tokens: int | Sequence[int | None] | None = None,
) -> list[ComponentSpec]:
    """SPEC 3: the memory components of every layer, layer by layer.

    A history layer has one per-token component ``kv`` of ``kv_bytes_per_slot`` bytes per slot;
    a state layer has one per-page component per item of ``state_component_bytes``. Group ids
    come from :func:`layer_group_ids`; layers keep their absolute index.
    """
    kv_bytes = positive(kv_bytes_per_slot, "kv_bytes_per_slot")
    state_items = _state_components(state_component_bytes)
    labels = layer_labels(layer_types)
    components: list[ComponentSpec] = []
    for i, group_id in enumerate(layer_group_ids(labels, sliding_window_tokens)):
        if labels[i] not in STATE_LAYER_TYPES:
            components.append(ComponentSpec(group_id, i, "kv", kv_bytes, 0))
            continue
        if not state_items:
            raise ValueError(f"layer {i} ({labels[i]}) needs state_component_bytes")
        components.extend(ComponentSpec(group_id, i, name, 0, nbytes) for name, nbytes in state_items)
    return components


def _component_items(components: Iterable[ComponentSpec], str_ids: bool = False) -> list[ComponentSpec]:
    """The items of ``components``, each a :class:`ComponentSpec` (TypeError naming
    ``components[k]``); with ``str_ids`` (the arena plan, whose groups are the cache's), its
    ``group_id`` and ``component`` a str UTF-8 can encode (``UnicodeEncodeError`` otherwise)."""
    not_a_sequence = TypeError(
        f"components must be a sequence of ComponentSpec, got {type(components).__name__}"
    )
    if isinstance(components, (str, bytes, bytearray, memoryview)):
        raise not_a_sequence
    try:
        items = list(components)
    except TypeError:
        raise not_a_sequence from None
    for k, comp in enumerate(items):
        if not isinstance(comp, ComponentSpec):
            raise TypeError(f"components[{k}] must be a ComponentSpec, got {type(comp).__name__}")
        if str_ids:
            for name in ("group_id", "component"):
                value = getattr(comp, name)
                if not isinstance(value, str):
                    raise TypeError(f"components[{k}].{name} must be a str, got {type(value).__name__}")
                value.encode("utf-8")
    return items


def _checked_components(components: Iterable[ComponentSpec], str_ids: bool = False) -> list[ComponentSpec]:
    """The components (:func:`_component_items`, all of them first) with int fields: ``layer``
    an int, ``bytes_per_slot`` and ``const_bytes`` >= 0."""
    checked: list[ComponentSpec] = []
    for k, comp in enumerate(_component_items(components, str_ids)):
        checked.append(
            ComponentSpec(
                group_id=comp.group_id,
                layer=as_int(comp.layer, f"components[{k}].layer"),
                component=comp.component,
                bytes_per_slot=non_negative(comp.bytes_per_slot, f"components[{k}].bytes_per_slot"),
                const_bytes=non_negative(comp.const_bytes, f"components[{k}].const_bytes"),
            )
        )
    return checked


def solve_page_geometry(
    components: Sequence[ComponentSpec], block_size: int, alignment: int
) -> BlockGeometry:
    """SPEC 3 page geometry: tokens per page and bytes per page row (``num_blocks`` is 0).

    Per (group, layer) row, per-token bytes and per-page bytes are summed; a row with both is an
    error. If some row has per-page (state) bytes, a page must hold at least ``needed =
    ceil(max_const / max_linear)`` tokens so a history row is as large as the largest state row;
    when ``needed > block_size`` the block size grows to ``needed`` rounded up to ``alignment``.
    ``block_bytes = max(max_linear * block_size, max_const)``.
    """
    block_size = positive(block_size, "block_size")
    alignment = positive(alignment, "alignment")
    linear: dict[_Row, int] = {}
    const: dict[_Row, int] = {}
    for comp in _checked_components(components):
        row = (comp.group_id, comp.layer)
        linear[row] = linear.get(row, 0) + comp.bytes_per_slot
        const[row] = const.get(row, 0) + comp.const_bytes
    for group_id, layer in linear:
        if linear[group_id, layer] > 0 and const[group_id, layer] > 0:
            raise ValueError(f"group {group_id} layer {layer} mixes per-token and per-page components")
    max_linear = max(linear.values(), default=0)
    max_const = max(const.values(), default=0)
    if max_const > 0:
        if max_linear == 0:
            raise ValueError("state components need at least one per-token (history) component to size pages")
        needed = ceil_div(max_const, max_linear)
        if needed > block_size:
            block_size = alignment * ceil_div(needed, alignment)
    return BlockGeometry(block_size, max(max_linear * block_size, max_const))


def equalized_block_size(
    components: Sequence[ComponentSpec], block_size: int, alignment: int | None = None
) -> int:
    """SPEC 3: the block size of :func:`solve_page_geometry`, ``alignment`` defaulting to ``block_size``."""
    alignment = block_size if alignment is None else alignment
    return solve_page_geometry(components, block_size, alignment).block_size


def _num_blocks(budget_bytes: int, bytes_per_block: int) -> int:
    """SPEC 3: how many whole blocks fit the budget (round down); fewer than 2 is an error."""
    num_blocks = budget_bytes // bytes_per_block if bytes_per_block > 0 else 0
    if num_blocks <= 1:
        raise ValueError(
            f"budget_bytes={budget_bytes} gives {num_blocks} blocks of {bytes_per_block} bytes; "
            "need at least 2 (one is the null page)"
        )
    return num_blocks


def plan_component_tensors(
    components: Sequence[ComponentSpec],
    block_size: int,
    budget_bytes: int,
    *,
    reserved_bytes_per_block: int = 0,
) -> FlatMemoryPlan:
    """SPEC 3 per-component plan: one tensor per component, every one with ``num_blocks`` rows.

    A component's row is ``bytes_per_slot * P + const_bytes`` bytes; ``num_blocks = budget //
    (sum of rows + reserved_bytes_per_block)``.
    """
    page = positive(block_size, "block_size")
    budget = non_negative(budget_bytes, "budget_bytes")
    reserved = non_negative(reserved_bytes_per_block, "reserved_bytes_per_block")
    checked = _checked_components(components)
    rows = [comp.bytes_per_slot * page + comp.const_bytes for comp in checked]
    num_blocks = _num_blocks(budget, sum(rows) + reserved)
    tensors = tuple(
        TensorPlan(
            name=f"{comp.group_id}.{comp.layer}.{comp.component}",
            nbytes=num_blocks * row,
            bindings=(LayerBinding(k, comp.group_id, comp.layer, comp.component, row, 0),),
        )
        for k, (comp, row) in enumerate(zip(checked, rows, strict=True))
    )
    return FlatMemoryPlan(BlockGeometry(page, sum(rows), num_blocks), tensors)


def plan_tensors(components: Sequence[ComponentSpec], block_size: int, budget_bytes: int) -> FlatMemoryPlan:
    """SPEC 3 slab plan: slot j is one tensor shared by the j-th layer of every group.

    Groups and, within a group, layers are taken in first-appearance order. A (group, layer)
    row packs its components (in order) at increasing byte offsets; a slot's row is the largest
    row bound to it, and ``num_blocks = budget // sum(slot rows)``.
    """
    page = positive(block_size, "block_size")
    budget = non_negative(budget_bytes, "budget_bytes")
    # group -> layer -> [(component, row bytes)], all in first-appearance order
    groups: dict[str, dict[int, list[tuple[str, int]]]] = {}
    for comp in _checked_components(components):
        row = comp.bytes_per_slot * page + comp.const_bytes
        groups.setdefault(comp.group_id, {}).setdefault(comp.layer, []).append((comp.component, row))

    num_slots = max((len(layers) for layers in groups.values()), default=0)
    slot_row_bytes = [0] * num_slots
    slot_bindings: list[list[LayerBinding]] = [[] for _ in range(num_slots)]
    for group_id, layers in groups.items():
        for slot, (layer, parts) in enumerate(layers.items()):
            offset = 0
            for component, row in parts:
                slot_bindings[slot].append(LayerBinding(slot, group_id, layer, component, row, offset))
                offset += row
            slot_row_bytes[slot] = max(slot_row_bytes[slot], offset)

    num_blocks = _num_blocks(budget, sum(slot_row_bytes))
    tensors = tuple(
        TensorPlan(f"slab{slot}", num_blocks * slot_row_bytes[slot], tuple(slot_bindings[slot]))
        for slot in range(num_slots)
    )
    return FlatMemoryPlan(BlockGeometry(page, sum(slot_row_bytes), num_blocks), tensors)


def _round_up(value: int, alignment: int) -> int:
    """``value`` rounded up to a multiple of ``alignment`` (> 0)."""
    return alignment * ceil_div(value, alignment)


def _fits_u64(value: int, what: str) -> None:
    """The arena's sizes are u64 on both implementations: ``OverflowError`` naming ``what``."""
    if value > _U64_MAX:
        raise OverflowError(f"{what} does not fit in an unsigned 64-bit integer")


_U64_MAX = (1 << 64) - 1


#: The divisors ``k`` of the largest page tried for a unit of ``2 b - b / k`` bytes.
UNIT_DIVISORS = 64


def _unit_holding_every_page(default: int, pages: list[int], step: int) -> int:
    """``default``, or when some unit of that size would hold no whole page of some group (page
    ``p`` lies at byte ``p * b``; a page across two units is never used), the smallest unit that
    gives every unit a page of every group among: ``2 b - b / k`` for ``k`` in ``1 ..
    UNIT_DIVISORS`` dividing ``b`` (the largest page) and the first size ``>= 2 b - 1``, each
    ``>= default`` and a multiple of ``step``.

    A unit of ``U`` bytes starts ``d`` bytes before the next page boundary, ``d`` a multiple of
    ``gcd(U, b)`` up to ``b - gcd(U, b)``, and holds a page when ``d + b <= U``: so every unit
    holds one iff ``U >= 2 b - gcd(U, b)``. Below ``2 b - 1`` (and from ``b`` up) that is
    ``2 b - U`` dividing ``b``, so these are the sizes to try."""

    def holds_all(unit: int) -> bool:
        return all(unit + math.gcd(unit, page) >= 2 * page for page in pages)

    if holds_all(default):
        return default
    largest = max(pages)
    threshold = _round_up(max(2 * largest - 1, default), step)
    candidates = [
        unit
        for k in range(1, UNIT_DIVISORS + 1)
        if largest % k == 0
        for unit in (2 * largest - largest // k,)
        if unit >= default and unit % step == 0 and holds_all(unit)
    ]
    return min([threshold, *candidates])


def plan_arena(
    components: Sequence[ComponentSpec],
    page_size: int,
    budget_bytes: int,
    *,
    alignment: int = 256,
    max_live_requests: int = 0,
) -> ArenaPlan:
    """SPEC 13 storage: one arena of ``num_units`` units of ``unit_bytes`` (unit 0 is null).

    Groups are taken in first-appearance order. A group of per-token components is a *page*
    group (a page of ``page_size * sum(bytes_per_slot)`` bytes, its components side by side);
    a group of constant components is a *state* group, and every state group's components share
    one state slot (each component at an ``alignment``-aligned offset, in order). A unit holds
    the state slot and the largest page (rounded up to ``alignment``) when there are state
    groups; otherwise it is the lcm of the pages when that is at most 4 of the largest page,
    else the largest page. ``num_units = budget_bytes // unit_bytes`` must be at least 2, and with
    state groups at least ``max_live_requests + 1`` (a working state slot per live request;
    ``ConfigError`` otherwise; 0 checks nothing).
    """
    page = positive(page_size, "page_size")
    budget = non_negative(budget_bytes, "budget_bytes")
    align = positive(alignment, "alignment")
    live = non_negative(max_live_requests, "max_live_requests")
    checked = _checked_components(components, str_ids=True)
    if not checked:
        raise ValueError("components must not be empty")

    # group -> its components, both in first-appearance order
    groups: dict[str, list[ComponentSpec]] = {}
    for comp in checked:
        groups.setdefault(comp.group_id, []).append(comp)
    page_bytes: dict[str, int] = {}
    for group_id, comps in groups.items():
        linear = sum(comp.bytes_per_slot for comp in comps)
        const = sum(comp.const_bytes for comp in comps)
        if linear > 0 and const > 0:
            raise ValueError(f"group {group_id} mixes per-token and constant components")
        if linear == 0 and const == 0:
            raise ValueError(f"group {group_id} holds no bytes")
        if linear > 0:
            page_bytes[group_id] = page * linear

    # Sizes are u64 on both implementations (docs/sizing-api.md), checked in this order.
    _fits_u64(page, "page_size")
    _fits_u64(align, "alignment")
    for group_id, size in page_bytes.items():
        _fits_u64(size, f"page_bytes of group {group_id}: page_size * sum of its bytes_per_slot")

    # offsets: inside its page (page groups) or inside the one state slot (state groups)
    offsets: list[int] = []
    page_end = dict.fromkeys(page_bytes, 0)
    slot_end = 0
    for comp in checked:
        if comp.group_id in page_bytes:
            offsets.append(page_end[comp.group_id])
            page_end[comp.group_id] += comp.bytes_per_slot * page
        else:
            offsets.append(_round_up(slot_end, align))
            slot_end = offsets[-1] + comp.const_bytes
    has_state = len(page_bytes) < len(groups)
    slot_bytes = _round_up(slot_end, align) if has_state else 0
    _fits_u64(slot_bytes, "slot_bytes: the state components, each aligned")

    largest_page = max(page_bytes.values(), default=0)
    if has_state:
        unit_bytes = _round_up(max(slot_bytes, largest_page), align)
    else:
        lcm = math.lcm(*page_bytes.values())
        unit_bytes = lcm if lcm <= 4 * largest_page else largest_page
    _fits_u64(unit_bytes, "unit_bytes")
    unit_bytes = _unit_holding_every_page(unit_bytes, list(page_bytes.values()), align if has_state else 1)
    _fits_u64(unit_bytes, "unit_bytes")

    num_units = budget // unit_bytes
    if num_units < 2:
        raise ValueError(
            f"budget_bytes={budget} gives {num_units} units of {unit_bytes} bytes; "
            "need at least 2 (unit 0 is null)"
        )
    _fits_u64(num_units, "num_units = budget_bytes // unit_bytes")
    if has_state and num_units - 1 < live:
        raise ConfigError(
            f"budget_bytes={budget} gives {num_units} units of {unit_bytes} bytes: {num_units - 1} working "
            f"state slots, fewer than max_live_requests={live} live requests need (one each); give "
            f"budget_bytes >= {(live + 1) * unit_bytes} or fewer live requests"
        )

    arena_groups: list[ArenaGroup] = []
    for group_id in groups:
        if group_id in page_bytes:
            item = page_bytes[group_id]
            per_unit = unit_bytes // item
            kind, num_ids = "pages", (num_units * unit_bytes) // item
            _fits_u64(num_ids, f"num_ids of group {group_id}")
        else:
            item, per_unit, kind, num_ids = slot_bytes, 1, "state", num_units
        arena_groups.append(ArenaGroup(group_id, kind, item, per_unit, num_ids, unit_bytes - per_unit * item))
    arena_components = tuple(
        ArenaComponent(
            comp.group_id,
            comp.layer,
            comp.component,
            offset,
            comp.bytes_per_slot * page if comp.group_id in page_bytes else comp.const_bytes,
        )
        for comp, offset in zip(checked, offsets, strict=True)
    )
    return ArenaPlan(page, align, unit_bytes, num_units, tuple(arena_groups), arena_components)
