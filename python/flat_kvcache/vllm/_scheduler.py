"""``FlatScheduler``: vLLM's default (async) scheduler with flat-kvcache as its KV-cache manager."""

from __future__ import annotations

import inspect
from typing import Any

from vllm.logger import init_logger  # type: ignore[import-not-found]
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # type: ignore[import-not-found]
from vllm.v1.core.sched.scheduler import Scheduler  # type: ignore[import-not-found]

from flat_kvcache.vllm._arena import ArenaKVCacheManager, ArenaPrefixKVCacheManager, plan_vllm_arena
from flat_kvcache.vllm._manager import FlatKVCacheManager, adapter_options, check_supported

# Under vLLM's "vllm" logger, the only one its logging config gives a handler and a level.
logger = init_logger(f"vllm.{__name__}")

# vLLM's engine passes these by keyword; binding them finds the configs whatever the form.
_INIT_SIGNATURE = inspect.signature(Scheduler.__init__)


class FlatScheduler(AsyncScheduler):  # type: ignore[misc]
    """vLLM's ``AsyncScheduler`` scheduling over :class:`FlatKVCacheManager`.

    Pass it as ``scheduler_cls`` (``LLM(..., scheduler_cls="flat_kvcache.vllm.FlatScheduler")``).
    The configuration is checked first (:func:`flat_kvcache.vllm.check_supported`): a feature
    this adapter does not serve is an :class:`UnsupportedVllmConfigError` naming it. vLLM's own
    manager is then built by the base class (it derives a few settings from it) and replaced.

    Options come from vLLM's ``additional_config`` (``LLM(..., additional_config={"flat_kvcache":
    {"mamba_checkpoints": "reuse"}})``, ``--additional-config``): ``mamba_checkpoints`` "vllm"
    (the default: vLLM's own decisions) or "reuse" (GDN / mamba hybrids with prefix caching: the
    project's reuse policy places and keeps the mamba state checkpoints; docs/vllm.md), and
    ``arena_page_size`` (the SPEC 13 arena's own ids, with
    ``flat_kvcache.vllm.arena_plugin.ArenaCPUWorker``): :class:`ArenaKVCacheManager` with
    prefix caching off, :class:`ArenaPrefixKVCacheManager` with it on (then prefill chunks are
    cut where that engine checkpoints: :meth:`_mamba_block_aligned_split`).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        bound = _INIT_SIGNATURE.bind(None, *args, **kwargs)
        bound.apply_defaults()
        vllm_config = bound.arguments["vllm_config"]
        kv_cache_config = bound.arguments["kv_cache_config"]
        block_size = bound.arguments["block_size"]
        check_supported(vllm_config, kv_cache_config, block_size, bound.arguments["hash_block_size"])
        options = adapter_options(vllm_config)
        arena = None
        if options["arena_page_size"] is not None:
            # The arena under vLLM's ids (_arena.py): the worker computes the same plan from the
            # same two configs (flat_kvcache.vllm.arena_plugin.ArenaCPUWorker).
            arena = plan_vllm_arena(vllm_config, kv_cache_config, options["arena_page_size"])
        super().__init__(*args, **kwargs)
        self.kv_cache_manager: FlatKVCacheManager | ArenaKVCacheManager
        if arena is not None:
            manager = ArenaPrefixKVCacheManager if arena.prefix_caching else ArenaKVCacheManager
            self.kv_cache_manager = manager(arena, max_model_len=self.max_model_len, log_stats=self.log_stats)
            # With prefix caching the engine cuts prefill chunks (checkpoints only at chunk ends,
            # SPEC 13.5): vLLM's hook for mode "align"'s cuts asks it (_mamba_block_aligned_split).
            self.need_mamba_block_aligned_split = arena.prefix_caching
            self.mamba_partial_cache_hit = False
            self.mamba_shared_prefix_checkpoint = False
            logger.info(
                "flat-kvcache arena ids: %d units of %d bytes (%d bytes of vLLM's allocation); "
                "attention pages of %d tokens, %d a unit, %d bytes apart; KV capacity %d tokens "
                "by vLLM's formula (requests of max_model_len held at once x max_model_len)",
                arena.num_units,
                arena.unit_bytes,
                arena.budget_bytes,
                arena.plan.page_size,
                arena.pages_per_unit,
                arena.page_stride,
                arena.capacity_tokens(self.max_model_len),
            )
            return
        self.kv_cache_manager = FlatKVCacheManager(
            kv_cache_config,
            max_model_len=self.max_model_len,
            block_size=block_size,
            enable_caching=bool(self.cache_config.enable_prefix_caching),
            log_stats=self.log_stats,
            watermark=self.scheduler_config.watermark,
            max_in_flight_tokens=vllm_config.max_in_flight_tokens,
            enable_kv_cache_events=self.enable_kv_cache_events,
            mamba_checkpoints=options["mamba_checkpoints"],
        )

    def _mamba_block_aligned_split(
        self,
        request: Any,
        num_new_tokens: int,
        num_new_local_computed_tokens: int = 0,
        num_external_computed_tokens: int = 0,
    ) -> int:
        """The arena with prefix caching: the engine's cut (``next_chunk``) for a prefill chunk
        (vLLM's own cut otherwise); decode is not cut."""
        manager = self.kv_cache_manager
        if not isinstance(manager, ArenaPrefixKVCacheManager):
            return super()._mamba_block_aligned_split(  # type: ignore[no-any-return]
                request, num_new_tokens, num_new_local_computed_tokens, num_external_computed_tokens
            )
        start = request.num_computed_tokens + num_new_local_computed_tokens + num_external_computed_tokens
        if start >= max(request.num_prompt_tokens, request.num_tokens - 1):
            return num_new_tokens
        return manager.chunk(request, num_new_tokens)
