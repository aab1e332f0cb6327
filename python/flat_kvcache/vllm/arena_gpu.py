"""The SPEC 13 arena inside vLLM's CUDA build: one buffer, every layer a strided view into it.

Select it as on vLLM's CPU build (``flat_kvcache.vllm.arena_plugin``), with this worker, and run
vLLM's V1 model runner (vLLM 0.33 picks its V2 runner by default where Triton is present)::

    VLLM_USE_V2_MODEL_RUNNER=0
    LLM(model,
        worker_cls="flat_kvcache.vllm.arena_gpu.ArenaGPUWorker",
        scheduler_cls="flat_kvcache.vllm.FlatScheduler",             # with arena_page_size
        additional_config={"flat_kvcache": {"arena_page_size": 64}},  # the arena's own ids
        async_scheduling=False)                                      # with prefix caching

:class:`ArenaGPUWorker` is vLLM's CUDA ``Worker`` whose model runner (:class:`ArenaGPUModelRunner`,
vLLM's ``GPUModelRunner``) takes the arena's ``initialize_kv_cache`` and
``initialize_kv_cache_tensors`` from the mixin the CPU runner takes them from
(``flat_kvcache.vllm._arena_runner.ArenaRunnerMixin``), so both platforms allocate, lay out and
bind the same way. One more method differs on the CUDA build: ``_init_kv_zero_meta``, the
precomputed table of vLLM's zeroing kernel (``KVBlockZeroer``), which derives the rows of a view
per block id from the config's ``num_blocks``; on the arena's own ids an attention id is a page
(several a unit), so the table is built with the attention view's rows, one page a block id.

Refused (``UnsupportedVllmConfigError``) besides what the mixin refuses (the kernel-block
split: with FlashAttention on Hopper any multiple of 16 tokens is a kernel block, so an
``arena_page_size`` that is one runs unsplit): vLLM's V2 model runner. This module imports vLLM's
CUDA worker and never its CPU worker. What was checked without a GPU and what only
``benches/vllm_arena_gpu.py`` checks on one: docs/vllm.md ("The arena on a GPU").
"""

from __future__ import annotations

from vllm.v1.worker.gpu_model_runner import GPUModelRunner  # type: ignore[import-not-found]
from vllm.v1.worker.gpu_worker import Worker  # type: ignore[import-not-found]
from vllm.v1.worker.utils import KVBlockZeroer  # type: ignore[import-not-found]

from flat_kvcache.vllm._arena_runner import ArenaRunnerMixin, adopt_arena_runner

__all__ = ["ArenaGPUModelRunner", "ArenaGPUWorker"]


class ArenaGPUModelRunner(ArenaRunnerMixin, GPUModelRunner):  # type: ignore[misc]
    """vLLM's ``GPUModelRunner`` whose KV cache is one arena buffer (:class:`ArenaRunnerMixin`);
    after ``initialize_kv_cache``, ``flat_arena`` is the buffer and ``flat_arena_layout`` its
    layout."""

    def _init_kv_zero_meta(self) -> None:
        paged = self._flat_paged
        if paged is None:
            # vLLM's ids: every view has one row a block id, as vLLM's allocation has.
            super()._init_kv_zero_meta()
            return
        rows = {paged.num_ids(g) for g, (kind, _) in enumerate(paged.group_roles) if kind == "pages"}
        # The arena plans one attention group at most (plan_vllm_arena refuses more).
        self._kv_block_zeroer = KVBlockZeroer(
            self.device,
            attn_groups_iter=self._kv_cache_spec_attn_group_iterator(),
            kernel_block_sizes=self._kernel_block_sizes,
            static_forward_context=self.compilation_config.static_forward_context,
            num_blocks=rows.pop() if rows else paged.num_units,
            runner_only_attn_layers=self.runner_only_attn_layers,
        )


class ArenaGPUWorker(Worker):  # type: ignore[misc]
    """vLLM's CUDA ``Worker`` with :class:`ArenaGPUModelRunner` as its model runner
    (``worker_cls="flat_kvcache.vllm.arena_gpu.ArenaGPUWorker"``)."""

    def init_device(self) -> None:
        super().init_device()
        adopt_arena_runner(self, GPUModelRunner, ArenaGPUModelRunner)
