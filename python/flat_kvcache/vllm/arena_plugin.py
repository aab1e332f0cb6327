"""The SPEC 13 arena inside vLLM, first step: one buffer, every layer a strided view into it.

Select it with one engine argument (vLLM resolves the class by its qualified name; no entry
point is needed)::

    LLM(model, worker_cls="flat_kvcache.vllm.arena_plugin.ArenaCPUWorker")

:class:`ArenaCPUWorker` is vLLM's ``CPUWorker`` whose model runner
(:class:`ArenaCPUModelRunner`, vLLM's ``CPUModelRunner``) replaces two methods
(``flat_kvcache.vllm._arena_runner.ArenaRunnerMixin``, which the CUDA build's
``flat_kvcache.vllm.arena_gpu.ArenaGPUWorker`` uses too), among them
``initialize_kv_cache_tensors``: instead of vLLM's ``allocate_kv_cache`` (one backing
allocation placed by the engine core's ``KVCacheTensor`` list, every layer's page padded to one
size) it allocates ONE buffer of :class:`VllmArenaLayout` and binds every layer a view into it through
the layers' own ``bind_kv_cache``, as vLLM does.

With ``additional_config={"flat_kvcache": {"arena_page_size": P}}`` (and
``scheduler_cls="flat_kvcache.vllm.FlatScheduler"``) the ids are the arena's own
(``flat_kvcache.vllm._arena``): the runner runs on the plan's ``KVCacheConfig`` (attention
groups at ``P``-token pages; with prefix caching the mamba groups at the checkpoint grain, in
vLLM's mode "align", whose column copy is the engine's read -> write state copy) and binds
:func:`paged_arena_views`, each group's views indexed by its own ids, which the scheduler's
manager hands out from the same plan.

Without the option, block ids are vLLM's, unchanged (the first step):
unit ``u`` of the arena is block id ``u``, and it holds, for the group that owns the block,
each of that group's layers' page (or state) side by side, unpadded (each layer's bytes rounded
up to :data:`ALIGN`). The exact layouts the kernels read and what the next steps change:
docs/vllm.md ("The arena inside vLLM: what vLLM's kernels read").

Refused (``UnsupportedVllmConfigError``) rather than served wrongly: vLLM's V2 model runner,
a KV-cache layout whose page interior is not one contiguous ``[H, N, C]`` permutation,
attention groups whose kernel block differs from the manager block (the kernel-block split),
``UniformTypeKVCacheSpecs`` groups, specs without per-layer views, host-resident groups and
KV connectors (they register vLLM's own tensors).
"""

from __future__ import annotations

# vLLM's CPU worker module must be imported before vLLM's other worker modules (its first line
# loads the CPU shared-memory ops); importing it first here keeps that order whatever imports
# this module.
from vllm.v1.worker.cpu_worker import CPUWorker  # type: ignore[import-not-found]  # isort: skip
from vllm.v1.worker.cpu_model_runner import CPUModelRunner  # type: ignore[import-not-found]

from flat_kvcache.vllm._arena_runner import (
    ALIGN,
    ArenaRunnerMixin,
    LayerPlacement,
    VllmArenaLayout,
    adopt_arena_runner,
    arena_layer_views,
    layout_for_vllm_ids,
    paged_arena_views,
)

__all__ = [
    "ALIGN",
    "ArenaCPUModelRunner",
    "ArenaCPUWorker",
    "LayerPlacement",
    "VllmArenaLayout",
    "arena_layer_views",
    "layout_for_vllm_ids",
    "paged_arena_views",
]


class ArenaCPUModelRunner(ArenaRunnerMixin, CPUModelRunner):  # type: ignore[misc]
    """vLLM's ``CPUModelRunner`` whose KV cache is one arena buffer (:class:`ArenaRunnerMixin`:
    ``initialize_kv_cache`` and ``initialize_kv_cache_tensors``); after it, ``flat_arena`` is the
    buffer and ``flat_arena_layout`` its layout."""


class ArenaCPUWorker(CPUWorker):  # type: ignore[misc]
    """vLLM's ``CPUWorker`` with :class:`ArenaCPUModelRunner` as its model runner
    (``worker_cls="flat_kvcache.vllm.arena_plugin.ArenaCPUWorker"``)."""

    def init_device(self) -> None:
        super().init_device()
        adopt_arena_runner(self, CPUModelRunner, ArenaCPUModelRunner)
