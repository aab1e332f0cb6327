"""Memory plans in tensor terms and the K/V / state buffers they allocate (private).

Public through :mod:`flat_kvcache.torch`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from fractions import Fraction
from types import MappingProxyType
from typing import Literal, overload

import torch

from flat_kvcache import (
    ComponentSpec,
    PagedCacheGroupSpec,
    compute_paged_cache_group_page_counts,
    equalized_block_size,
    group_specs_from_layer_types,
    hybrid_slab_group_size,
    plan_arena,
    plan_component_tensors,
    plan_tensors,
)
from flat_kvcache._types import STATE_LAYER_TYPES, ArenaPlan, FlatMemoryPlan, TensorPlan
from flat_kvcache.errors import ConfigError, ModelConfigError
from flat_kvcache.torch._checks import DeviceLike, as_device, as_int
from flat_kvcache.torch.arena import ArenaBuffers, allocate_arena
from flat_kvcache.torch.shape import ModelShape

__all__ = [
    "ArenaMemoryPlan",
    "KVBuffers",
    "KVMemoryPlan",
    "TensorSpec",
    "allocate_kv_buffers",
    "plan_arena_memory",
    "plan_kv_memory",
]

#: The caching allocator rounds each large block up to 2 MiB and may carve medium blocks out of a
#: fresh 20 MiB segment; a plan for a CUDA device sets this much aside so that the memory actually
#: taken, not only the sum of tensor sizes, stays within the budget.
_CUDA_SLACK_PER_TENSOR = 2 << 20
_CUDA_SLACK_FIXED = 20 << 20


@dataclass(frozen=True)
class TensorSpec:
    """One buffer to allocate: its name, shape and (storage) dtype.

    ``role`` is ``"k"``, ``"v"`` or a state component name; ``layers`` are the layers it serves
    (several for a shared slab, one otherwise).
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    role: str
    layers: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class KVMemoryPlan:
    """A memory plan in tensor terms. Build it with :func:`plan_kv_memory`.

    ``page_size`` is the page size after state equalization (``equalized_block_size``);
    ``num_pages`` includes page 0, the null page; ``bytes_per_page`` is the memory one page takes
    across all buffers, so ``total_bytes == num_pages * bytes_per_page <= budget_bytes``.
    ``groups`` / ``page_counts`` are the paged-cache groups and their SPEC 2 page counts with
    ``max_total_tokens = (num_pages - 1) * page_size``, the tokens the non-null pages hold: what
    ``publish_paged_cache_groups`` publishes, computed with ``group_specs_from_layer_types`` and
    ``compute_paged_cache_group_page_counts`` so that they exist in a build without the ``flat``
    feature too. They are each group's worst case, drawn from the one shared pool, so they do not
    add up and are not a split of ``num_pages``. With ``max_total_tokens`` equal to every usable
    page's tokens, the full-history count is ``num_pages + max_live_requests`` (SPEC 2 adds a
    partly filled page per live request), so it always exceeds ``num_pages``: that says the
    worst case cannot all be live at once, not that the budget is too small.
    ``flat-kvcache plan --memory`` instead picks the largest ``max_total_tokens`` whose worst
    cases fit the pool together.
    ``slab_saving_bytes`` is the memory per-layer tensors would take for the same pages minus what
    the shared slabs take (0 without slabs).
    """

    shape: ModelShape = field(repr=False)
    page_size: int
    requested_page_size: int
    budget_bytes: int
    bytes_per_page: int
    num_pages: int
    slab_group_size: int | None
    tensors: tuple[TensorSpec, ...] = field(repr=False)
    groups: tuple[PagedCacheGroupSpec, ...] = field(repr=False)
    page_counts: Mapping[str, int] = field(hash=False)
    slab_saving_bytes: int
    max_live_requests: int
    max_scheduled_tokens: int
    max_context_len: int
    allocator_slack_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        """Bytes of all buffers together (``num_pages * bytes_per_page``)."""
        return sum(spec.nbytes for spec in self.tensors)

    @property
    def max_total_tokens(self) -> int:
        """Tokens the usable pages hold, over all groups: ``(num_pages - 1) * page_size``."""
        return (self.num_pages - 1) * self.page_size

    def summary(self) -> dict[str, int | None]:
        """The headline numbers (the CLI prints these)."""
        return {
            "budget_bytes": self.budget_bytes,
            "page_size": self.page_size,
            "bytes_per_page": self.bytes_per_page,
            "num_pages": self.num_pages,
            "tokens_that_fit": self.max_total_tokens,
            "total_bytes": self.total_bytes,
            "slab_group_size": self.slab_group_size,
            "slab_saving_bytes": self.slab_saving_bytes,
        }


@dataclass(frozen=True)
class ArenaMemoryPlan:
    """A memory plan of the SPEC 13 storage (:func:`plan_arena_memory`): the
    arena ``flat_kvcache.plan_arena`` lays out for the budget (less the CUDA allocator's slack)
    with a working state slot per live request. Build the cache with
    ``FlatKVCache(specs, arena=plan.arena)`` and the buffers with :func:`allocate_kv_buffers`
    (an :class:`~flat_kvcache.torch.ArenaBuffers` over one byte buffer)."""

    shape: ModelShape = field(repr=False)
    arena: ArenaPlan = field(repr=False)
    budget_bytes: int
    allocator_slack_bytes: int
    max_live_requests: int
    max_scheduled_tokens: int
    max_context_len: int

    @property
    def page_size(self) -> int:
        """Tokens per attention page."""
        return self.arena.page_size

    @property
    def total_bytes(self) -> int:
        """Bytes of the arena: ``num_units * unit_bytes``."""
        return self.arena.num_units * self.arena.unit_bytes

    def summary(self) -> dict[str, int | None]:
        """The headline numbers."""
        return {
            "budget_bytes": self.budget_bytes,
            "page_size": self.page_size,
            "unit_bytes": self.arena.unit_bytes,
            "num_units": self.arena.num_units,
            "total_bytes": self.total_bytes,
        }


def plan_kv_memory(
    shape: ModelShape,
    *,
    page_size: int,
    budget_bytes: int | None = None,
    device: DeviceLike | None = None,
    utilization: float = 0.9,
    max_live_requests: int,
    max_scheduled_tokens: int,
    max_context_len: int,
    storage: Literal["equalized"] | None = None,
) -> KVMemoryPlan:
    """Plan the KV buffers of ``shape`` for a memory budget (SPEC 3 and 11): one pool of equal
    pages, each page id a row in every layer's buffer.

    For a model with state layers this is not the default storage: a page must hold a whole
    recurrent state, so it is raised to hundreds or thousands of tokens (1,056 for a
    Qwen3.5-like model) and every page id keeps rows for every layer; the SPEC 13 arena
    (:func:`plan_arena_memory`, the same arguments) keeps 16-token attention pages and one state
    slot per unit instead. Such a shape is refused unless ``storage="equalized"`` asks for the
    equal pages explicitly (the layout vLLM-style storage uses). Attention-only shapes are
    planned either way (nothing is raised for them).

    The budget is ``budget_bytes`` if given, else it is read from ``device``:
    ``free - total * (1 - utilization)`` from ``torch.cuda.mem_get_info`` (call this after the
    weights are loaded). A CPU device has no such query and needs ``budget_bytes``. For a CUDA
    device the plan also sets aside the caching allocator's rounding (``allocator_slack_bytes``)
    so that the memory actually allocated stays within the budget.

    The page size is raised if a state component needs it (``equalized_block_size``). Models whose
    attention labels pair up (``hybrid_slab_group_size``) get shared K/V slabs; others get one K
    and one V tensor per attention layer. State layers get one ``[num_pages, *shape]`` tensor per
    component. The page count is rounded down and includes the null page 0. Chunked local
    attention layers (``chunked_attention``, Llama 4) keep K/V rows like sliding layers; their
    group has retention ``chunked_window`` and the page counts of a sliding window of its chunk.

    :func:`plan_arena_memory` plans the SPEC 13 storage from the same arguments.

    Raises
    ------
    ValueError
        A bad argument (``storage`` other than None or ``"equalized"``), no budget to read, or
        a budget that fits fewer than two pages.
    ConfigError
        A shape with state layers and no ``storage="equalized"`` (:func:`plan_arena_memory`
        plans its default storage).
    ModelConfigError
        A model whose every layer keeps a state (SPEC 3's geometry cannot size it;
        :func:`plan_arena_memory` can).
    """
    if not isinstance(shape, ModelShape):
        raise TypeError(f"shape must be a ModelShape, not {type(shape).__name__}")
    if storage is not None and storage != "equalized":
        raise ValueError(
            f"storage must be None or 'equalized', got {storage!r} (plan_arena_memory plans the arena)"
        )
    state_layers = sum(label in STATE_LAYER_TYPES for label in shape.layer_types)
    if state_layers and storage is None:
        raise ConfigError(
            f"{state_layers} of the {shape.num_layers} cache layers keep a recurrent state: their "
            "storage is the SPEC 13 arena, planned by plan_arena_memory (the same arguments); pass "
            "storage='equalized' for SPEC 3's equal pages, each raised until it holds a state (the "
            "layout vLLM-style storage uses)"
        )
    if state_layers == shape.num_layers:
        raise ModelConfigError(
            f"every one of the {shape.num_layers} cache layers keeps a recurrent state and none keeps "
            "K/V: the SPEC 3 page geometry sizes a state page in tokens of K/V, so a pure state model "
            "cannot be planned by it (plan_arena_memory plans it on the SPEC 13 storage)"
        )
    requested = as_int(page_size, "page_size", minimum=1)
    for name, value in (
        ("max_live_requests", max_live_requests),
        ("max_scheduled_tokens", max_scheduled_tokens),
        ("max_context_len", max_context_len),
    ):
        as_int(value, name, minimum=0)
    target = None if device is None else as_device(device)

    components = shape.components()
    block_size = equalized_block_size(components, requested)
    slab_group_size = hybrid_slab_group_size(shape.layer_types, sliding_window_tokens=shape.sliding_window)
    num_tensors = 2 * slab_group_size if slab_group_size else _count_tensors(components)
    slack = _CUDA_SLACK_FIXED + num_tensors * _CUDA_SLACK_PER_TENSOR if _is_cuda(target) else 0

    budget, origin = _budget(budget_bytes, target, utilization)
    usable = max(budget - slack, 0)
    with _naming_the_budget(budget_bytes, origin, slack):
        native = (
            plan_tensors(components, block_size, usable)
            if slab_group_size
            else plan_component_tensors(components, block_size, usable)
        )

    num_pages = native.geometry.num_blocks
    tensors = _tensor_specs(shape, native, block_size, slabs=bool(slab_group_size))
    bytes_per_page = native.geometry.block_bytes
    total = sum(spec.nbytes for spec in tensors)
    if total != num_pages * bytes_per_page or total > usable:  # pragma: no cover - internal check
        raise RuntimeError(
            f"memory plan disagrees with its tensors: {total} bytes in tensors, "
            f"{num_pages} pages x {bytes_per_page} bytes, budget {usable}"
        )
    per_layer_bytes_per_page = sum(c.bytes_per_slot * block_size + c.const_bytes for c in components)

    groups = group_specs_from_layer_types(shape.layer_types, shape.sliding_window, page_size=block_size)
    counts = compute_paged_cache_group_page_counts(
        groups,
        max_live_requests=max_live_requests,
        max_scheduled_tokens=max_scheduled_tokens,
        max_total_tokens=(num_pages - 1) * block_size,
        max_context_len=max_context_len,
    )
    return KVMemoryPlan(
        shape=shape,
        page_size=block_size,
        requested_page_size=requested,
        budget_bytes=budget,
        bytes_per_page=bytes_per_page,
        num_pages=num_pages,
        slab_group_size=slab_group_size,
        tensors=tensors,
        groups=tuple(groups),
        page_counts=MappingProxyType(dict(counts)),
        slab_saving_bytes=num_pages * (per_layer_bytes_per_page - bytes_per_page),
        max_live_requests=int(max_live_requests),
        max_scheduled_tokens=int(max_scheduled_tokens),
        max_context_len=int(max_context_len),
        allocator_slack_bytes=slack,
    )


def plan_arena_memory(
    shape: ModelShape,
    *,
    page_size: int,
    budget_bytes: int | None = None,
    device: DeviceLike | None = None,
    utilization: float = 0.9,
    max_live_requests: int,
    max_scheduled_tokens: int,
    max_context_len: int,
) -> ArenaMemoryPlan:
    """Plan the SPEC 13 storage of ``shape`` for a memory budget, as :func:`plan_kv_memory`
    plans the SPEC 3 one from the same arguments: ``flat_kvcache.plan_arena`` over
    ``shape.components()`` with ``page_size``-token attention pages, the budget (``budget_bytes``,
    else read from a CUDA ``device``; less the caching allocator's slack for one buffer there)
    and a working state slot per live request. Pure state models are planned too.

    Raises
    ------
    ValueError
        A bad argument, no budget to read, or a budget that fits fewer than two units.
    ConfigError
        State layers and fewer units than ``max_live_requests`` working slots.
    """
    if not isinstance(shape, ModelShape):
        raise TypeError(f"shape must be a ModelShape, not {type(shape).__name__}")
    requested = as_int(page_size, "page_size", minimum=1)
    live = as_int(max_live_requests, "max_live_requests", minimum=0)
    scheduled = as_int(max_scheduled_tokens, "max_scheduled_tokens", minimum=0)
    context = as_int(max_context_len, "max_context_len", minimum=0)
    target = None if device is None else as_device(device)
    slack = _CUDA_SLACK_FIXED + _CUDA_SLACK_PER_TENSOR if _is_cuda(target) else 0
    budget, origin = _budget(budget_bytes, target, utilization)
    with _naming_the_budget(budget_bytes, origin, slack):
        arena = plan_arena(shape.components(), requested, max(budget - slack, 0), max_live_requests=live)
    return ArenaMemoryPlan(
        shape=shape,
        arena=arena,
        budget_bytes=budget,
        allocator_slack_bytes=slack,
        max_live_requests=live,
        max_scheduled_tokens=scheduled,
        max_context_len=context,
    )


def _budget(budget_bytes: int | None, device: torch.device | None, utilization: float) -> tuple[int, str]:
    """The budget (``budget_bytes``, else read from ``device``) and where it came from."""
    if budget_bytes is not None:
        budget = as_int(budget_bytes, "budget_bytes", minimum=0)
        return budget, f"budget_bytes={budget}"
    return _device_budget(device, utilization)


@contextmanager
def _naming_the_budget(budget_bytes: int | None, origin: str, slack: int) -> Iterator[None]:
    """A planner's ``ValueError`` about the budget, restated with where the budget came from
    and the slack set aside (a given budget with no slack: the planner's message names it)."""
    try:
        yield
    except ValueError as exc:
        if budget_bytes is not None and not slack:
            raise
        less = f" less {slack} bytes of CUDA allocator slack" if slack else ""
        raise ValueError(f"{origin}{less}: {exc}") from exc


def _is_cuda(device: torch.device | None) -> bool:
    return device is not None and device.type == "cuda"


def _count_tensors(components: Sequence[ComponentSpec]) -> int:
    """Buffers of the per-layer layout: K and V for a ``kv`` component, one per state component."""
    return sum(2 if c.bytes_per_slot else 1 for c in components)


def _device_budget(device: torch.device | None, utilization: float) -> tuple[int, str]:
    """SPEC 3: ``free - total * (1 - utilization)``, rounded down."""
    if device is None:
        raise ValueError("pass budget_bytes or a CUDA device to read the budget from")
    if not _is_cuda(device):
        raise ValueError(
            f"cannot read a memory budget from device {device}: only CUDA devices report free "
            "memory; pass budget_bytes"
        )
    if isinstance(utilization, bool) or not isinstance(utilization, int | float):
        raise TypeError(f"utilization must be a number, not {type(utilization).__name__}")
    if not 0 < utilization <= 1:
        raise ValueError(f"utilization must be in (0, 1], got {utilization}")
    if not torch.cuda.is_available():
        raise ValueError(f"cannot read a memory budget from device {device}: CUDA is not available")
    free, total = torch.cuda.mem_get_info(device)
    # The decimal the caller wrote (0.9 is 9/10), not the nearest binary float, so that a round
    # utilization gives a round reserve; the result is exact and rounded down.
    budget = math.floor(free - total * (1 - Fraction(repr(float(utilization)))))
    origin = f"{device}: free {free} - total {total} x (1 - utilization {utilization}) = {budget} bytes"
    if budget <= 0:
        raise ValueError(f"{origin}: no memory left for the KV cache")
    return budget, origin


def _tensor_specs(
    shape: ModelShape, native: FlatMemoryPlan, block_size: int, *, slabs: bool
) -> tuple[TensorSpec, ...]:
    """Turn the native plan's byte-sized tensors into K/V/state tensor shapes, checking sizes agree.

    Names: ``slab<j>.k`` / ``slab<j>.v`` for shared slabs, ``layer<i>.k`` / ``layer<i>.v`` for
    per-layer K/V and ``layer<i>.<component>`` for state.
    """
    num_pages = native.geometry.num_blocks
    kv_rows = (num_pages * block_size, shape.num_kv_heads, shape.head_dim)
    kv_dtype = shape.kv_storage_dtype
    specs: list[TensorSpec] = []
    for planned in native.tensors:
        components = {b.component for b in planned.bindings}
        layers = tuple(b.layer for b in planned.bindings)
        made: list[TensorSpec]
        if components == {"kv"} and (slabs or len(layers) == 1):
            prefix = planned.name if slabs else f"layer{layers[0]}"
            made = [TensorSpec(f"{prefix}.{role}", kv_rows, kv_dtype, role, layers) for role in ("k", "v")]
        elif not slabs and len(planned.bindings) == 1 and shape.state_shapes and shape.state_dtypes:
            binding = planned.bindings[0]
            made = [
                TensorSpec(
                    f"layer{binding.layer}.{binding.component}",
                    (num_pages, *shape.state_shapes[binding.component]),
                    shape.state_dtypes[binding.component],
                    binding.component,
                    (binding.layer,),
                )
            ]
        else:  # pragma: no cover - slabs are only planned for attention-only models
            raise RuntimeError(f"cannot lay out planned tensor {planned.name}: {_describe(planned)}")
        if sum(spec.nbytes for spec in made) != planned.nbytes:  # pragma: no cover - internal check
            raise RuntimeError(
                f"planned tensor {planned.name} has {planned.nbytes} bytes but its buffers "
                f"{[s.shape for s in made]} hold {sum(s.nbytes for s in made)}"
            )
        specs.extend(made)
    return tuple(specs)


def _describe(planned: TensorPlan) -> str:
    return ", ".join(f"{b.group_id}/{b.layer}/{b.component}" for b in planned.bindings)


# ---------------------------------------------------------------------------------------------
# Buffers
# ---------------------------------------------------------------------------------------------


class KVBuffers:
    """The allocated K/V and state buffers of a :class:`KVMemoryPlan`.

    ``k(layer)`` / ``v(layer)`` are ``[num_pages * page_size, num_kv_heads, head_dim]``; with
    slabs, the i-th layer of every label returns the same tensor. ``state(layer)`` maps each
    state component to its ``[num_pages, *shape]`` tensor, indexed by page id. Everything starts
    zeroed, so page 0 (the null page) is zero and finite.
    """

    def __init__(self, plan: KVMemoryPlan, tensors: Mapping[str, torch.Tensor]) -> None:
        """Wrap existing buffers: one tensor per ``plan.tensors`` name, of its shape and dtype.

        :func:`allocate_kv_buffers` is the usual way to get one.
        """
        for spec in plan.tensors:
            tensor = tensors.get(spec.name)
            if tensor is None:
                raise ValueError(f"no tensor for planned buffer {spec.name!r}")
            if tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype:
                raise ValueError(
                    f"buffer {spec.name!r} is {tuple(tensor.shape)} {tensor.dtype}, "
                    f"the plan says {spec.shape} {spec.dtype}"
                )
        self._plan = plan
        self._tensors = {spec.name: tensors[spec.name] for spec in plan.tensors}
        self._k: dict[int, torch.Tensor] = {}
        self._v: dict[int, torch.Tensor] = {}
        self._state: dict[int, dict[str, torch.Tensor]] = {}
        for spec in plan.tensors:
            tensor = self._tensors[spec.name]
            for layer in spec.layers:
                if spec.role == "k":
                    self._k[layer] = tensor
                elif spec.role == "v":
                    self._v[layer] = tensor
                else:
                    self._state.setdefault(layer, {})[spec.role] = tensor

    @property
    def plan(self) -> KVMemoryPlan:
        return self._plan

    @property
    def tensors(self) -> Mapping[str, torch.Tensor]:
        """Every distinct buffer by its plan name, in plan order."""
        return MappingProxyType(self._tensors)

    def _layer(self, layer: int) -> int:
        index = as_int(layer, "layer", minimum=0)
        if index >= self._plan.shape.num_layers:
            raise IndexError(
                f"layer {index} out of range: the model has {self._plan.shape.num_layers} layers"
            )
        return index

    def _kv(self, layer: int, table: Mapping[int, torch.Tensor]) -> torch.Tensor:
        index = self._layer(layer)
        if index not in table:
            label = self._plan.shape.layer_types[index]
            raise ValueError(f"layer {index} is a {label} (state) layer: it has no K/V; use state({index})")
        return table[index]

    def k(self, layer: int) -> torch.Tensor:
        """The K buffer of an attention layer."""
        return self._kv(layer, self._k)

    def v(self, layer: int) -> torch.Tensor:
        """The V buffer of an attention layer."""
        return self._kv(layer, self._v)

    def state(self, layer: int) -> Mapping[str, torch.Tensor]:
        """The state buffers of a state layer: component name -> ``[num_pages, *shape]``."""
        index = self._layer(layer)
        if index not in self._state:
            label = self._plan.shape.layer_types[index]
            raise ValueError(
                f"layer {index} is a {label} layer: it has no state; use k({index}) / v({index})"
            )
        return MappingProxyType(self._state[index])

    def data_ptrs(self) -> dict[str, int]:
        """Device address of each distinct buffer, by plan name (shared slabs appear once)."""
        return {name: tensor.data_ptr() for name, tensor in self._tensors.items()}

    def nbytes(self) -> int:
        """Bytes held by the buffers, each distinct tensor counted once."""
        unique = {id(t): t for t in self._tensors.values()}
        return sum(t.numel() * t.element_size() for t in unique.values())

    def __repr__(self) -> str:
        device = next(iter(self._tensors.values())).device if self._tensors else None
        return (
            f"KVBuffers(num_pages={self._plan.num_pages}, page_size={self._plan.page_size}, "
            f"tensors={len(self._tensors)}, nbytes={self.nbytes()}, device={device})"
        )


@overload
def allocate_kv_buffers(plan: KVMemoryPlan, device: DeviceLike) -> KVBuffers: ...


@overload
def allocate_kv_buffers(plan: ArenaMemoryPlan, device: DeviceLike) -> ArenaBuffers: ...


def allocate_kv_buffers(plan: KVMemoryPlan | ArenaMemoryPlan, device: DeviceLike) -> KVBuffers | ArenaBuffers:
    """Allocate the zero-initialised buffers of ``plan`` on ``device``: the per-layer (or slab)
    tensors of a :class:`KVMemoryPlan`, or the arena of an :class:`ArenaMemoryPlan` with its
    per-layer views (:func:`~flat_kvcache.torch.allocate_arena`)."""
    if isinstance(plan, ArenaMemoryPlan):
        return allocate_arena(plan.shape, plan.arena, device)
    if not isinstance(plan, KVMemoryPlan):
        raise TypeError(f"plan must be a KVMemoryPlan or an ArenaMemoryPlan, not {type(plan).__name__}")
    target = as_device(device)
    tensors = {spec.name: torch.zeros(spec.shape, dtype=spec.dtype, device=target) for spec in plan.tensors}
    return KVBuffers(plan, tensors)
