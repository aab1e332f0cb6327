"""Torch buffers for the flat KV cache (SPEC 11), sized from a memory budget (SPEC 3).

The pipeline, one call per step::

    from flat_kvcache.torch import (ModelShape, plan_kv_memory, allocate_kv_buffers,
                                    CaptureBuffers, write_locations)

    shape = ModelShape.preset("gpt-oss-like")            # or ModelShape.from_config("config.json")
    plan = plan_kv_memory(shape, page_size=16, device="cuda", max_live_requests=256,
                          max_scheduled_tokens=8192, max_context_len=32768)
    buffers = allocate_kv_buffers(plan, "cuda")          # buffers.k(i), .v(i), .state(i)
    capture = CaptureBuffers(plan.groups, max_batch_size=256, max_context_len=32768, device="cuda")
    # every step, after cache.schedule(slots, ns), into the same storage:
    capture.fill(cache.block_tables(slots), batch_size=len(slots))
    out_loc = write_locations(capture.buffer("full_attention"), positions, plan.page_size)

Persistent rows instead of a full table per step: :class:`DeviceRows` binds host tables to the
cache (row ``s`` is the request in slot ``s``) and applies each step's ``update_rows()`` deltas
to device copies (one ``index_put_`` per group).

Attention over the pages: :func:`paged_attention` and :func:`write_kv` are the executable
definition of the layout a kernel must match (docs/model-runner.md); ``flat_kvcache.torch.runner``
runs a ``transformers`` model on them (needs the ``model`` extra).

The SPEC 13 arena (docs/architecture.md "Hybrid storage"), the storage for state models
(``plan_kv_memory`` refuses a shape with state layers unless ``storage="equalized"`` asks for
SPEC 3's equal pages): ``plan_arena_memory`` plans it (an :class:`ArenaMemoryPlan`),
``allocate_kv_buffers`` allocates its units as one byte buffer and :class:`ArenaBuffers` gives
its per-layer K/V and state views (one page stride per layer); the engine allocates from the
same plan::

    plan = plan_arena_memory(shape, page_size=16, device="cuda", max_live_requests=256,
                             max_scheduled_tokens=8192, max_context_len=32768)
    arena = allocate_kv_buffers(plan, "cuda")            # arena.k(i)[page_id], .state(i, "ssm")[slot]
    cache = flat_kvcache.cache_from_config(plan)         # FlatKVCache(specs, arena=plan.arena)

A host-memory tier (``FlatKVCache(..., host_pages=N)``): :class:`HostKVBuffers` are its pages in
CPU memory (pinned when CUDA is available), mirroring the device buffers, and
:class:`TransferExecutor` runs the cache's store/load transfers on them and acknowledges them::

    host = HostKVBuffers(plan, host_pages=N)
    executor = TransferExecutor(cache, buffers, host)
    executor.run()   # after each forward and before scheduling requests with loads in flight

Over the arena the host tier is per group (each group's host pages of its own geometry: a page
group's page, a state group's whole slot, so checkpoints offload too); :class:`ArenaHostBuffers`
holds them, with ``host_pages`` as the cache got it (an int for every group, or
``{group_id: pages}``)::

    cache = flat_kvcache.FlatKVCache(specs, arena=plan.arena, host_pages={"linear_attention": 64})
    executor = TransferExecutor(cache, arena, ArenaHostBuffers(plan, {"linear_attention": 64}))

Every size comes from the native memory plan (``flat_kvcache.components_from_layers``,
``equalized_block_size``, ``plan_tensors`` / ``plan_component_tensors``), computed in Rust with
checked arithmetic; this module turns the planned byte counts into tensor shapes and checks
that the two agree.

PyTorch is an optional extra (``pip install '.[torch]'``); no other public module
of the package imports it.
"""

from __future__ import annotations

try:
    import torch as _torch  # noqa: F401
except ModuleNotFoundError as exc:
    if exc.name != "torch":
        raise
    raise ImportError(
        "flat_kvcache.torch needs PyTorch, an optional extra of flat-kvcache: "
        "install it with `pip install '.[torch]'` in the flat-kvcache source tree"
    ) from exc

from flat_kvcache.torch.arena import ArenaBuffers, allocate_arena
from flat_kvcache.torch.attention import paged_attention, write_kv
from flat_kvcache.torch.capture import CaptureBuffers, extend_locations, write_locations
from flat_kvcache.torch.host import (
    ArenaHostBuffers,
    HostKVBuffers,
    TransferCache,
    TransferCounts,
    TransferExecutor,
)
from flat_kvcache.torch.plan import (
    ArenaMemoryPlan,
    KVBuffers,
    KVMemoryPlan,
    TensorSpec,
    allocate_kv_buffers,
    plan_arena_memory,
    plan_kv_memory,
)
from flat_kvcache.torch.rows import DeviceRows
from flat_kvcache.torch.shape import ModelShape

__all__ = [
    "ArenaBuffers",
    "ArenaHostBuffers",
    "ArenaMemoryPlan",
    "CaptureBuffers",
    "DeviceRows",
    "HostKVBuffers",
    "KVBuffers",
    "KVMemoryPlan",
    "ModelShape",
    "TensorSpec",
    "TransferCache",
    "TransferCounts",
    "TransferExecutor",
    "allocate_arena",
    "allocate_kv_buffers",
    "extend_locations",
    "paged_attention",
    "plan_arena_memory",
    "plan_kv_memory",
    "write_kv",
    "write_locations",
]
