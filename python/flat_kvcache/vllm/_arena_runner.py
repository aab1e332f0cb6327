"""What the arena's model runners share (vLLM's CPU and CUDA builds): the layouts, the views
into the one buffer, and :class:`ArenaRunnerMixin`, the two runner methods that allocate it.

The workers that use it: ``flat_kvcache.vllm.arena_plugin.ArenaCPUWorker`` (vLLM's CPU build)
and ``flat_kvcache.vllm.arena_gpu.ArenaGPUWorker`` (its CUDA build). This module imports none of
vLLM's worker modules but ``vllm.v1.worker.utils``, so each worker module imports its own
platform's worker first (the CPU one must come before the others, see arena_plugin). Layouts,
refusals and what the kernels read: arena_plugin's docstring and docs/vllm.md.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.kv_transfer import has_kv_transfer_group  # type: ignore[import-not-found]
from vllm.logger import init_logger  # type: ignore[import-not-found]
from vllm.v1.kv_cache_interface import (  # type: ignore[import-not-found]
    AttentionSpec,
    KVCacheConfig,
    MambaSpec,
    UniformTypeKVCacheSpecs,
)
from vllm.v1.worker.utils import bind_kv_cache  # type: ignore[import-not-found]

from flat_kvcache.vllm._arena import VllmArena, arena_page_size, class_path, plan_vllm_arena
from flat_kvcache.vllm._manager import UnsupportedVllmConfigError

__all__ = [
    "ALIGN",
    "ArenaRunnerMixin",
    "LayerPlacement",
    "VllmArenaLayout",
    "adopt_arena_runner",
    "arena_layer_views",
    "layout_for_vllm_ids",
    "paged_arena_views",
]

# Under vLLM's "vllm" logger, the only one its logging config gives a handler and a level.
logger = init_logger(f"vllm.{__name__}")

#: Bytes each layer's region inside a unit is rounded up to: a cache line, and a multiple of
#: every dtype's itemsize so each view's offset and stride are whole elements.
ALIGN = 64

# vLLM's KVCacheLayout numbers the logical axes L, B, H, N, C as 0..4.
_H, _N, _C = 2, 3, 4


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True)
class LayerPlacement:
    """Where one layer's page (attention) or state (GDN / mamba) lies inside a unit."""

    layer_name: str
    group_id: int
    kind: str  # "attention" or "state"
    offset: int  # bytes from the start of the unit
    nbytes: int  # the layer's bytes per block id, unpadded (vLLM's unpadded page / state)


@dataclass(frozen=True)
class VllmArenaLayout:
    """One arena of ``num_units`` units of ``unit_bytes``; block id ``b`` of every group is
    unit ``b`` (this step keeps vLLM's ids), group ``g``'s layers at their placements."""

    unit_bytes: int
    num_units: int
    layers: tuple[LayerPlacement, ...]
    stock_bytes: int  # what vLLM's own allocation of the same config takes

    @property
    def total_bytes(self) -> int:
        return self.unit_bytes * self.num_units

    def group_bytes(self, group_id: int) -> int:
        """The bytes of a unit the group's layers use (the rest of the unit is slack)."""
        mine = [p for p in self.layers if p.group_id == group_id]
        return max((p.offset + p.nbytes for p in mine), default=0)


def _layer_nbytes(spec: Any, what: str) -> tuple[str, int]:
    """The layer's kind and its bytes per block id, unpadded."""
    if isinstance(spec, AttentionSpec):
        return "attention", int(spec.real_page_size_bytes)
    if isinstance(spec, MambaSpec):
        return "state", int(spec.state_content_size_bytes)
    raise UnsupportedVllmConfigError(
        f"{what}: the arena plugin maps attention and mamba specs only, not {type(spec).__name__}"
    )


def layout_for_vllm_ids(kv_cache_config: Any) -> VllmArenaLayout:
    """The arena for vLLM's block ids unchanged: one unit per block id, as large as the largest
    group's layers side by side (each rounded up to :data:`ALIGN`); no per-layer padding to a
    common page size."""
    if not kv_cache_config.kv_cache_groups:
        raise UnsupportedVllmConfigError("the model has no KV cache groups: nothing to place")
    placements: list[LayerPlacement] = []
    unit = 0
    for group_id, group in enumerate(kv_cache_config.kv_cache_groups):
        what = f"KV cache group {group_id} ({type(group.kv_cache_spec).__name__}, layers {group.layer_names})"
        spec = group.kv_cache_spec
        if isinstance(spec, UniformTypeKVCacheSpecs):
            raise UnsupportedVllmConfigError(f"{what}: per-layer specs in one group are not mapped yet")
        if not spec.has_layer_views:
            raise UnsupportedVllmConfigError(f"{what}: the spec lays out its raw storage itself")
        if getattr(group, "host_resident", False):
            raise UnsupportedVllmConfigError(f"{what}: host-resident groups are not mapped")
        offset = 0
        for name in group.layer_names:
            kind, nbytes = _layer_nbytes(spec, what)
            placements.append(LayerPlacement(name, group_id, kind, offset, nbytes))
            offset += _round_up(nbytes, ALIGN)
        unit = max(unit, offset)
    # vLLM places every KVCacheTensor in one backing allocation of ``size`` bytes.
    stock = max((int(t.size) for t in kv_cache_config.kv_cache_tensors), default=0)
    return VllmArenaLayout(
        unit_bytes=unit,
        num_units=int(kv_cache_config.num_blocks),
        layers=tuple(placements),
        stock_bytes=int(stock),
    )


def _interior_strides(layout: Any, heads: int, tokens: int, content: int) -> tuple[int, int, int]:
    """Element strides of a page's ``H``, ``N`` and ``C`` axes for vLLM's resolved layout, the
    page interior contiguous in the layout's order of those three axes."""
    order = [axis for axis in layout.stride_order if axis in (_H, _N, _C)]
    sizes = {_H: heads, _N: tokens, _C: content}
    strides: dict[int, int] = {}
    step = 1
    for axis in reversed(order):
        strides[axis] = step
        step *= sizes[axis]
    return strides[_H], strides[_N], strides[_C]


def _check_arena_buffer(buffer: torch.Tensor, total_bytes: int, kv_cache_layout: Any, room: str) -> None:
    """``buffer`` is 1-D ``int8`` of ``total_bytes``, and the layout keeps a page's ``[H, N, C]``
    one contiguous run (so it can sit in ``room``: an arena unit or page)."""
    if buffer.dtype != torch.int8 or buffer.dim() != 1 or buffer.numel() != total_bytes:
        raise ValueError(f"the arena buffer must be 1-D int8 of {total_bytes} bytes")
    if any(axis not in kv_cache_layout.stride_order[-3:] for axis in (_H, _N, _C)):
        raise UnsupportedVllmConfigError(
            f"KV cache layout {kv_cache_layout.name}: a page's [H, N, C] is not one contiguous run, "
            f"so it cannot sit in an arena {room}"
        )


def _state_view(buffer: torch.Tensor, rows: int, row_bytes: int, offset: int, nbytes: int) -> torch.Tensor:
    """A mamba / GDN layer's ``[rows, 1, 1, nbytes]`` ``int8`` view, rows ``row_bytes`` apart from
    byte ``offset``: what the layer's own ``bind_kv_cache`` cuts into its states."""
    return torch.as_strided(buffer, (rows, 1, 1, nbytes), (row_bytes, nbytes, nbytes, 1), offset)


def _attention_view(
    buffer: torch.Tensor,
    spec: Any,
    name: str,
    rows: int,
    row_bytes: int,
    offset: int,
    kv_cache_layout: Any,
    nbytes: int | None = None,
) -> torch.Tensor:
    """An attention layer's ``[rows, H, N, C]`` view of its dtype (``C`` = K and V of a token's
    head), rows ``row_bytes`` apart from byte ``offset``, the page interior in the layout's order;
    ``nbytes`` (when given) is the plan's page, which must be vLLM's."""
    dtype = spec.dtype
    item = dtype.itemsize
    content_bytes = int(spec.state_content_size_bytes)
    if content_bytes % item or row_bytes % item or offset % item:
        raise UnsupportedVllmConfigError(
            f"layer {name}: its page content of {content_bytes} bytes is not whole {dtype} elements"
        )
    heads, tokens, content = int(spec.num_heads), int(spec.num_states), content_bytes // item
    if nbytes is not None and heads * tokens * content * item != nbytes:
        raise UnsupportedVllmConfigError(f"layer {name}: the plan's page ({nbytes} bytes) is not vLLM's")
    h, n, c = _interior_strides(kv_cache_layout, heads, tokens, content)
    return torch.as_strided(
        buffer.view(dtype), (rows, heads, tokens, content), (row_bytes // item, h, n, c), offset // item
    )


def arena_layer_views(
    buffer: torch.Tensor, arena: VllmArenaLayout, kv_cache_config: Any, kv_cache_layout: Any
) -> dict[str, torch.Tensor]:
    """Each layer's view into ``buffer`` (1-D ``int8``, ``arena.total_bytes``), in the form
    vLLM's ``allocate_kv_cache`` hands to ``bind_kv_cache``: an attention layer
    ``[num_units, H, N, C]`` of its dtype (``C`` = K and V of a token's head), a mamba / GDN
    layer ``[num_units, 1, 1, state bytes]`` of ``int8`` that the layer's own ``bind_kv_cache``
    cuts into its conv and temporal states. Dim 0 steps one unit."""
    _check_arena_buffer(buffer, arena.total_bytes, kv_cache_layout, "unit")
    groups = kv_cache_config.kv_cache_groups
    views: dict[str, torch.Tensor] = {}
    for place in arena.layers:
        if place.kind == "state":
            views[place.layer_name] = _state_view(
                buffer, arena.num_units, arena.unit_bytes, place.offset, place.nbytes
            )
        else:
            views[place.layer_name] = _attention_view(
                buffer,
                groups[place.group_id].kv_cache_spec,
                place.layer_name,
                arena.num_units,
                arena.unit_bytes,
                place.offset,
                kv_cache_layout,
            )
    return views


def paged_arena_views(
    buffer: torch.Tensor, arena: VllmArena, kv_cache_layout: Any
) -> dict[str, torch.Tensor]:
    """Each layer's view into ``buffer`` (1-D ``int8``, ``arena.total_bytes``) for the arena's
    own ids (``flat_kvcache.vllm._arena``): an attention layer ``[pages, H, N, C]`` (N the page
    size) whose row ``p`` is page ``p`` at byte ``p * page_stride`` plus the layer's offset in the
    page; a mamba / GDN layer ``[units, 1, 1, state bytes]`` whose row ``s`` is state slot ``s``
    (unit ``s``) plus the layer's offset in the slot. Dim 0 of each view is its group's ids."""
    _check_arena_buffer(buffer, arena.total_bytes, kv_cache_layout, "page")
    config = arena.kv_cache_config
    views: dict[str, torch.Tensor] = {}
    for group_id, group in enumerate(config.kv_cache_groups):
        kind, _ = arena.group_roles[group_id]
        rows = arena.num_ids(group_id)
        for name in group.layer_names:
            offset, nbytes = arena.layer_offsets[name]
            if kind == "state":
                views[name] = _state_view(buffer, rows, arena.unit_bytes, offset, nbytes)
            else:
                views[name] = _attention_view(
                    buffer,
                    group.kv_cache_spec,
                    name,
                    rows,
                    arena.page_stride,
                    offset,
                    kv_cache_layout,
                    nbytes,
                )
    return views


class ArenaRunnerMixin:
    """The two methods of vLLM's ``GPUModelRunner`` (which vLLM's ``CPUModelRunner`` subclasses)
    that the arena replaces, mixed in before the platform's runner: ``initialize_kv_cache`` runs
    the runner on the arena's ``KVCacheConfig`` when ``arena_page_size`` is set, and
    ``initialize_kv_cache_tensors`` allocates one buffer and binds every layer a view into it.
    After it, ``flat_arena`` is the buffer and ``flat_arena_layout`` its layout
    (:class:`VllmArenaLayout` on vLLM's ids, ``VllmArena`` on the arena's own)."""

    flat_arena: torch.Tensor
    flat_arena_layout: VllmArenaLayout | VllmArena
    _flat_paged: VllmArena | None
    # The platform runner's attributes the two methods read (vLLM's GPUModelRunner sets them).
    vllm_config: Any
    cache_config: Any
    model_config: Any
    compilation_config: Any
    device: torch.device
    shared_kv_cache_layers: dict[str, str]
    kv_caches: list[torch.Tensor]
    attn_groups: list[list[Any]]

    def initialize_kv_cache(
        self,
        kv_cache_config: KVCacheConfig,
        is_profiling: bool = False,
        kv_cache_allocation_context: AbstractContextManager[Any] | None = None,
    ) -> None:
        # With the ``arena_page_size`` option the runner runs on the arena's config (attention
        # groups at the page size, each group's ids its own), planned from the engine core's
        # config exactly as FlatScheduler plans it.
        page_size = arena_page_size(self.vllm_config)
        self._flat_paged = None
        if page_size is not None:
            name = class_path(self.vllm_config.scheduler_config.scheduler_cls)
            if not name.startswith("flat_kvcache.vllm"):
                raise UnsupportedVllmConfigError(
                    "the flat_kvcache arena (arena_page_size) hands out its own ids: it needs "
                    f"scheduler_cls='flat_kvcache.vllm.FlatScheduler', not {name!r}"
                )
            self._flat_paged = plan_vllm_arena(self.vllm_config, kv_cache_config, page_size)
            kv_cache_config = self._flat_paged.kv_cache_config
        super().initialize_kv_cache(  # type: ignore[misc]
            kv_cache_config, is_profiling, kv_cache_allocation_context=kv_cache_allocation_context
        )

    def _check_kernel_blocks(self, kv_cache_config: KVCacheConfig, kernel_block_sizes: list[int]) -> None:
        """Refuse the kernel-block split: vLLM's kernel block of every attention group (the
        engine's per KV cache group, and each attention group's own, which vLLM binds through
        ``map_kv_caches_to_kernel_blocks``) must be the manager block, so the views bound are
        the views the ids index."""
        for group_id, group in enumerate(kv_cache_config.kv_cache_groups):
            spec = group.kv_cache_spec
            kernel = kernel_block_sizes[group_id] if group_id < len(kernel_block_sizes) else None
            if isinstance(spec, AttentionSpec) and kernel is not None and kernel != spec.block_size:
                raise UnsupportedVllmConfigError(
                    f"KV cache group {group_id}: the attention kernel block ({kernel} tokens) differs "
                    f"from the manager block ({spec.block_size}); the kernel-block split is not mapped yet"
                )
        for attn_group in (g for groups in self.attn_groups for g in groups):
            kernel = getattr(attn_group, "kernel_block_size", None)
            if kernel is not None:
                raise UnsupportedVllmConfigError(
                    f"KV cache group {attn_group.kv_cache_group_id} ({attn_group.backend.get_name()}): "
                    f"the attention kernel block ({kernel} tokens) differs from the manager block "
                    f"({attn_group.kv_cache_spec.block_size}); the kernel-block split is not mapped yet"
                )

    def initialize_kv_cache_tensors(
        self,
        kv_cache_config: KVCacheConfig,
        kernel_block_sizes: list[int],
        kv_cache_allocation_context: AbstractContextManager[Any] | None = None,
    ) -> dict[str, torch.Tensor]:
        if has_kv_transfer_group():
            raise UnsupportedVllmConfigError(
                "KV connectors register vLLM's own KV tensors; the arena plugin refuses them"
            )
        self._check_kernel_blocks(kv_cache_config, kernel_block_sizes)
        layout = self.cache_config.get_resolved_kv_cache_layout()
        paged = getattr(self, "_flat_paged", None)
        arena: VllmArenaLayout | VllmArena = (
            paged if paged is not None else layout_for_vllm_ids(kv_cache_config)
        )
        with kv_cache_allocation_context or nullcontext():
            buffer = torch.zeros(arena.total_bytes, dtype=torch.int8, device=self.device)
        if paged is not None:
            kv_caches = paged_arena_views(buffer, paged, layout)
        else:
            assert isinstance(arena, VllmArenaLayout)
            kv_caches = arena_layer_views(buffer, arena, kv_cache_config, layout)
        # Layers that read another layer's KV cache (cross-layer sharing) get its view.
        for layer_name, target in self.shared_kv_cache_layers.items():
            kv_caches[layer_name] = kv_caches[target]
        num_attn_module = 2 if self.model_config.hf_config.model_type == "longcat_flash" else 1
        # No ``layer_kv_caches``: with no kernel-block split (refused above) vLLM's
        # ``map_kv_caches_to_kernel_blocks`` hands every layer the view it is given.
        bind_kv_cache(
            kv_caches,
            self.compilation_config.static_forward_context,
            self.kv_caches,
            num_attn_module,
            kv_cache_groups=kv_cache_config.kv_cache_groups,
        )
        self.flat_arena = buffer
        self.flat_arena_layout = arena
        logger.info(
            "flat-kvcache arena: %d units of %d bytes = %d bytes in one buffer "
            "(vLLM's own allocation: %d bytes)",
            arena.num_units,
            arena.unit_bytes,
            arena.total_bytes,
            arena.budget_bytes if isinstance(arena, VllmArena) else arena.stock_bytes,
        )
        return kv_caches


def adopt_arena_runner(worker: Any, stock_runner: type, arena_runner: type) -> None:
    """Make the runner vLLM's ``init_device`` built for ``worker`` an ``arena_runner`` in place.
    The arena runner adds methods only, so its constructor (which sizes the persistent batch and
    binds the device buffers) runs once, as vLLM's. Refused when vLLM built another runner
    than ``stock_runner`` (its V2 model runner, or a platform's own)."""
    runner = worker.model_runner
    if type(runner) is not stock_runner:
        raise UnsupportedVllmConfigError(
            f"the arena plugin extends vLLM's {stock_runner.__name__}, and this engine built "
            f"{type(runner).__name__} (vLLM's V2 model runner is not mapped yet: "
            "set VLLM_USE_V2_MODEL_RUNNER=0)"
        )
    runner.__class__ = arena_runner
