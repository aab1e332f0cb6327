"""The SPEC 13 arena in tensor terms: one byte buffer of equal units and its strided views (private).

Public through :mod:`flat_kvcache.torch`. The layout is docs/architecture.md ("Hybrid storage
(SPEC 13)") and the plan is ``flat_kvcache.plan_arena`` (docs/sizing-api.md "Arena plan"). The
engine does not allocate from the arena yet: these are the views it will index once it does.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import torch

from flat_kvcache._types import ArenaComponent, ArenaGroup, ArenaPlan
from flat_kvcache.torch._checks import DeviceLike, as_device, as_int, storage_dtype
from flat_kvcache.torch.shape import ModelShape

__all__ = ["ArenaBuffers", "allocate_arena"]


def _as_typed_view(
    base: torch.Tensor,
    dtype: torch.dtype,
    size: tuple[int, ...],
    stride_bytes: int,
    offset_bytes: int,
    what: str,
) -> torch.Tensor:
    """``[size[0], *size[1:]]`` elements of ``dtype`` over the uint8 ``base``: the leading dim
    steps ``stride_bytes``, the rest is contiguous, and element 0 is at byte ``offset_bytes``."""
    item = dtype.itemsize
    for name, value in (("stride", stride_bytes), ("offset", offset_bytes), ("arena size", base.numel())):
        if value % item:
            raise ValueError(
                f"{what}: the {name} of {value} bytes is not a multiple of the {dtype} itemsize "
                f"({item} bytes), so it cannot be viewed as {dtype}"
            )
    inner = [1] * len(size)
    for i in range(len(size) - 2, -1, -1):
        inner[i] = inner[i + 1] * size[i + 1]
    stride = (stride_bytes // item, *inner[1:])
    return torch.as_strided(base.view(dtype), size, stride, offset_bytes // item)


class ArenaBuffers:
    """The SPEC 13 arena of an :class:`~flat_kvcache.ArenaPlan` over one ``uint8`` tensor.

    The arena is ``num_units * unit_bytes`` bytes; unit 0 is null (zeros: the null page of every
    page group and the null state slot) and is never written. The views share its storage:

    - ``k(layer)`` / ``v(layer)``: ``[num_ids, page_size, num_kv_heads, head_dim]`` of the K/V
      storage dtype, one page stride (``page_bytes / itemsize`` elements): page ``p`` of the
      layer's group lies at byte ``p * page_bytes``, its ``kv`` component at the planned offset
      inside the page, K in the first half of the component and V in the second.
    - ``state(layer, component)``: ``[num_units, *shape]`` of the component's dtype with stride
      ``unit_bytes / itemsize``: slot ``s`` is unit ``s``, the component at its planned offset
      inside the slot.

    These are the views the engine's ids index (``FlatKVCache(specs, arena=plan)``: its block
    tables and ``state_slots``); :meth:`pages_of_unit` / :meth:`unit_of` map between a group's
    ids and the units, and :meth:`pages` gives a group's pages as raw bytes (what the host tier
    copies, :class:`~flat_kvcache.torch.ArenaHostBuffers`).
    """

    def __init__(self, shape: ModelShape, plan: ArenaPlan, arena: torch.Tensor) -> None:
        """Wrap an existing arena: a 1-D contiguous ``uint8`` tensor of ``num_units * unit_bytes``
        bytes, laid out as ``plan`` says for ``shape`` (whose components ``plan`` was made from).

        :func:`allocate_arena` is the usual way to get one.
        """
        if not isinstance(plan, ArenaPlan):
            raise TypeError(f"plan must be an ArenaPlan (flat_kvcache.plan_arena), not {type(plan).__name__}")
        size = plan.num_units * plan.unit_bytes
        if arena.dtype != torch.uint8 or arena.dim() != 1 or not arena.is_contiguous():
            raise ValueError(
                f"the arena must be a contiguous 1-D uint8 tensor, got {arena.dtype} {tuple(arena.shape)}"
            )
        if arena.numel() != size:
            raise ValueError(
                f"the arena is {arena.numel()} bytes, the plan says {plan.num_units} units of "
                f"{plan.unit_bytes} bytes = {size}"
            )
        self._shape = shape
        self._plan = plan
        self._arena = arena
        self._groups: dict[str, ArenaGroup] = {group.group_id: group for group in plan.groups}
        placed = {(c.group_id, c.layer, c.component): c for c in plan.components}
        expected = shape.components()
        wanted = [(c.group_id, c.layer, c.component) for c in expected]
        if len(wanted) != len(placed) or any(key not in placed for key in wanted):
            raise ValueError(
                "the plan's components are not the shape's: make the plan from shape.components() "
                f"(plan: {sorted(placed)}, shape: {sorted(wanted)})"
            )
        kv_dtype = shape.kv_storage_dtype
        half = plan.page_size * shape.num_kv_heads * shape.head_dim * kv_dtype.itemsize
        self._k: dict[int, torch.Tensor] = {}
        self._v: dict[int, torch.Tensor] = {}
        self._state: dict[int, dict[str, torch.Tensor]] = {}
        self._layer_group: dict[int, str] = {}
        for spec in expected:
            placed_spec = placed[(spec.group_id, spec.layer, spec.component)]
            group = self._groups[spec.group_id]
            self._layer_group[spec.layer] = spec.group_id
            what = f"layer {spec.layer} {spec.component!r} (group {spec.group_id!r})"
            if group.kind == "pages":
                self._check_nbytes(placed_spec, 2 * half, what)
                size_kv = (group.num_ids, plan.page_size, shape.num_kv_heads, shape.head_dim)
                self._k[spec.layer] = _as_typed_view(
                    arena, kv_dtype, size_kv, group.item_bytes, placed_spec.offset, what + " K"
                )
                self._v[spec.layer] = _as_typed_view(
                    arena, kv_dtype, size_kv, group.item_bytes, placed_spec.offset + half, what + " V"
                )
            else:
                if shape.state_shapes is None or shape.state_dtypes is None:
                    raise ValueError(f"{what}: the shape has no state components")
                dims = shape.state_shapes[spec.component]
                dtype = storage_dtype(shape.state_dtypes[spec.component])
                self._check_nbytes(placed_spec, spec.const_bytes, what)
                self._state.setdefault(spec.layer, {})[spec.component] = _as_typed_view(
                    arena, dtype, (plan.num_units, *dims), plan.unit_bytes, placed_spec.offset, what
                )

    @staticmethod
    def _check_nbytes(component: ArenaComponent, nbytes: int, what: str) -> None:
        if component.nbytes != nbytes:
            raise ValueError(f"{what}: the plan gives it {component.nbytes} bytes, the shape needs {nbytes}")

    # -- the arena -----------------------------------------------------------------------------

    @property
    def plan(self) -> ArenaPlan:
        return self._plan

    @property
    def shape(self) -> ModelShape:
        return self._shape

    @property
    def arena(self) -> torch.Tensor:
        """The raw arena: ``num_units * unit_bytes`` bytes, ``uint8``."""
        return self._arena

    def unit(self, unit: int) -> torch.Tensor:
        """The bytes of one unit (a ``uint8`` view of ``unit_bytes``)."""
        index = self._index(unit, self._plan.num_units, "unit")
        start = index * self._plan.unit_bytes
        return self._arena[start : start + self._plan.unit_bytes]

    @property
    def groups(self) -> Mapping[str, ArenaGroup]:
        """The plan's groups by id."""
        return MappingProxyType(self._groups)

    # -- views -----------------------------------------------------------------------------------

    def _layer(self, layer: int) -> int:
        index = as_int(layer, "layer", minimum=0)
        if index >= self._shape.num_layers:
            raise IndexError(f"layer {index} out of range: the model has {self._shape.num_layers} layers")
        return index

    def _kv(self, layer: int, table: Mapping[int, torch.Tensor]) -> torch.Tensor:
        index = self._layer(layer)
        if index not in table:
            label = self._shape.layer_types[index]
            raise ValueError(
                f"layer {index} is a {label} (state) layer: it has no K/V; use state({index}, ...)"
            )
        return table[index]

    def k(self, layer: int) -> torch.Tensor:
        """K of an attention layer: ``[num_ids, page_size, num_kv_heads, head_dim]``, indexed by
        the page ids of the layer's group (one page stride, ``page_bytes / itemsize``)."""
        return self._kv(layer, self._k)

    def v(self, layer: int) -> torch.Tensor:
        """V of an attention layer, as :meth:`k` (the second half of the layer's ``kv`` bytes)."""
        return self._kv(layer, self._v)

    def state(self, layer: int, component: str) -> torch.Tensor:
        """One state component of a state layer: ``[num_units, *shape]``, indexed by slot id
        (slot ``s`` is unit ``s``; stride ``unit_bytes / itemsize``)."""
        index = self._layer(layer)
        if index not in self._state:
            label = self._shape.layer_types[index]
            raise ValueError(
                f"layer {index} is a {label} layer: it has no state; use k({index}) / v({index})"
            )
        components = self._state[index]
        if component not in components:
            raise KeyError(f"layer {index} has no state component {component!r}; it has {sorted(components)}")
        return components[component]

    def group_of(self, layer: int) -> str:
        """The group id of a layer."""
        return self._layer_group[self._layer(layer)]

    # -- ids and units ---------------------------------------------------------------------------

    def _group(self, group_id: str) -> ArenaGroup:
        group = self._groups.get(group_id)
        if group is None:
            raise KeyError(f"unknown group {group_id!r}; the plan has {list(self._groups)}")
        return group

    @staticmethod
    def _index(value: int, bound: int, name: str) -> int:
        index = as_int(value, name, minimum=0)
        if index >= bound:
            raise IndexError(f"{name} {index} out of range: there are {bound}")
        return index

    def pages(self, group_id: str) -> torch.Tensor:
        """Every page (or state slot) of ``group_id`` as raw bytes: a ``uint8`` view
        ``[num_ids, item_bytes]`` of the arena whose row ``p`` is the group's id ``p``, all of
        the group's layers (and, for a state group, all of the slot's state components) at their
        planned offsets; the rows step ``item_bytes`` (a page group's page) or ``unit_bytes`` (a
        state slot is a unit, ``num_ids`` = ``num_units``). Row 0 is the null page or slot."""
        group = self._group(group_id)
        stride = group.item_bytes if group.kind == "pages" else self._plan.unit_bytes
        rows = group.num_ids if group.kind == "pages" else self._plan.num_units
        return torch.as_strided(self._arena, (rows, group.item_bytes), (stride, 1))

    def pages_of_unit(self, group_id: str, unit: int) -> range:
        """The ids of ``group_id`` that lie in ``unit`` while it is bound to the group: for a page
        group ``ceil(u * unit_bytes / page_bytes) .. floor((u + 1) * unit_bytes / page_bytes) - 1``
        (a page straddling two units belongs to neither), for a state group the one slot ``u``."""
        group = self._group(group_id)
        index = self._index(unit, self._plan.num_units, "unit")
        if group.kind != "pages":
            return range(index, index + 1)
        size, item = self._plan.unit_bytes, group.item_bytes
        return range(-(-index * size // item), (index + 1) * size // item)

    def unit_of(self, group_id: str, page_id: int) -> int:
        """The unit holding id ``page_id`` of ``group_id`` (a state slot is its own unit); a
        ``ValueError`` for a page that straddles two units, which is never handed out."""
        group = self._group(group_id)
        index = self._index(page_id, group.num_ids, f"{group_id} id")
        if group.kind != "pages":
            return index
        start, end = index * group.item_bytes, (index + 1) * group.item_bytes
        unit = start // self._plan.unit_bytes
        if end > (unit + 1) * self._plan.unit_bytes:
            raise ValueError(
                f"{group_id} page {index} (bytes {start}..{end}) straddles units {unit} and "
                f"{unit + 1}: it is never handed out"
            )
        return unit


def allocate_arena(shape: ModelShape, plan: ArenaPlan, device: DeviceLike) -> ArenaBuffers:
    """Allocate the arena of ``plan`` (``flat_kvcache.plan_arena(shape.components(), ...)``) on
    ``device``: one ``uint8`` tensor of ``num_units * unit_bytes`` bytes, all zeros (unit 0, the
    null page and slot, must stay so), with the SPEC 13 views of :class:`ArenaBuffers`."""
    if not isinstance(plan, ArenaPlan):
        raise TypeError(f"plan must be an ArenaPlan (flat_kvcache.plan_arena), not {type(plan).__name__}")
    arena = torch.zeros(plan.num_units * plan.unit_bytes, dtype=torch.uint8, device=as_device(device))
    return ArenaBuffers(shape, plan, arena)
