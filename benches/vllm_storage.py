"""KV-cache storage of five models as vLLM 0.33.0's own planning code lays it out (optional).

Per model: the KV cache groups, block size and block count vLLM's planner picks for an 80 GiB
budget, and what vLLM's ``KVCacheManager`` allocates for one 16,384-token request (prefilled in
two 8,192-token chunks, then one decode step: 16,385 tokens in the cache). One JSON object per
model on stdout; ``--markdown`` adds a table. Not in CI. Does not import flat_kvcache.

Side environment (vLLM pulls a CUDA torch; everything here runs on the CPU)::

    python3.11 -m venv /tmp/vllm-venv && /tmp/vllm-venv/bin/pip install vllm==0.33.0
    /tmp/vllm-venv/bin/python benches/vllm_storage.py --markdown

(The full install worked; transformers 5.20.2 came with it.) Without vLLM the script exits 2.

Models: transformers' ``Qwen3NextConfig()``, ``Qwen3_5Config()`` and ``Qwen3_5MoeConfig()`` (vLLM
reads their text config), ``Gemma3TextConfig()``, ``GptOssConfig()``, with their defaults, written to
a temporary ``config.json`` (architecture set, dtype bfloat16) and read by vLLM's
``EngineArgs(dtype="bfloat16", enable_prefix_caching=True, mamba_ssm_cache_dtype="float32",
max_model_len=16400).create_engine_config()``. K/V cache dtype "auto" = bf16; vLLM keeps the GDN
conv state in the model dtype (bf16, shape (3, 8192)) and the recurrent state in float32 (shape
(32, 128, 128)); prefix caching puts the GDN layers in ``mamba_cache_mode="align"``.

How each number is computed, all with vLLM's code except where marked (emulated):

* ``block_size``: ``Platform.update_block_size_for_backend`` (vllm/platforms/interface.py), i.e.
  the backend's preferred block size and, for hybrid models, ``_align_hybrid_block_size``, which
  raises the attention block so a page holds a GDN state, rounded to the kernel block (16) and,
  in align mode, to the GDN prefill checkpoint alignment, and pads the mamba page to the attention
  page. (emulated) The platform is vLLM's CPU platform (``VLLM_TARGET_DEVICE=cpu``, to build the
  config without a GPU), but the numbers are for a Hopper GPU: no model is built, so the two
  lookups that read the built layers are answered as CUDA would: ``_find_non_ssm_backends`` ->
  ``[FlashAttentionBackend]`` (kernel blocks ``MultipleOf(16)``) and
  ``get_mamba_prefill_checkpoint_alignment`` -> ``FLASHINFER_GDN_CHECKPOINT_ALIGNMENT`` (64; the GDN
  layer's value with the FlashInfer GDN prefill chosen on SM90). Hence 1,088 = 64 * ceil(2,146,304 /
  (64 * 2,048)) for Qwen3-Next/Qwen3.5-MoE and 576 for Qwen3.5. On another GPU or backend the
  choice can differ.
* per-layer specs (emulated): built as the layers' ``get_kv_cache_spec`` build them:
  ``FullAttentionSpec``, ``SlidingWindowSpec`` (block from ``_largest_kernel_block_within``) and, for
  GDN, ``MambaSpec`` with vLLM's ``get_mamba_state_shape_from_config`` /
  ``get_mamba_state_dtype_from_config`` and the checkpoint fields ``QwenGDN`` adds in align mode.
* groups, ``num_blocks``: ``resolve_kv_cache_layout``, then ``get_global_kv_cache_groups`` and
  ``get_kv_cache_configs`` (vllm/v1/core/kv_cache_planning.py; grouping by
  ``_get_kv_cache_groups_uniform_page_size``, pages unified by ``unify_kv_cache_spec_page_size``,
  blocks = budget // ``_pool_bytes_per_block``), ``generate_scheduler_kv_cache_config``,
  ``resolve_kv_cache_block_sizes`` and ``resolve_cache_hit_alignment_tokens`` (vllm/v1/core/
  kv_cache_utils.py), in the order ``EngineCore._initialize_kv_caches`` runs them. The budget
  is 80 * 2**30 bytes passed as the available memory.
* ``prefix_hit_grain_tokens``: the cache-hit alignment vLLM resolves; the GDN models run with
  ``prefix_match_unit=64`` (``--prefix-match-unit``; 0 leaves it unset, then the grain is the
  block, 1,088 / 576 tokens). Gemma-3 and GPT-OSS keep it unset (16-token blocks).
* blocks per request: vLLM's ``KVCacheManager`` (with its hybrid coordinator) allocates the request:
  ``get_computed_blocks``, ``allocate_slots(8192)``, ``allocate_slots(8192)``, then one sampled token
  and ``allocate_slots(1)``; after each call the non-null blocks the request holds in each group are
  counted (they equal the pool's used blocks). ``blocks_per_request`` is the peak (during the second
  chunk: sliding windows still hold window + chunk, GDN groups hold 3 states each); ``..._after_load``
  is after the decode step.
* ``tokens_that_fit`` = ``num_blocks // blocks_per_request * 16384`` (peak), ``_after_load`` with the
  after-load count. (The null block is not subtracted, as in the brief's formula.)
* ``padding``: share of the held blocks' bytes (blocks * pool bytes per block) that hold none of
  the request's K/V or GDN state, at the step that holds the most blocks: page padding (mamba page
  padded to the attention page), padding layers (groups with fewer layers than the widest), and
  the unfilled token slots of partly filled attention blocks. ``page_padding`` leaves the unfilled
  slots out (only bytes no token or state could ever use).

Against a teammate's figures (vLLM 0.33: block, padding, tokens that fit): Qwen3-Next 1,088 /
1.0 % / 2.39 M (64-token hits); Qwen3.5 576 / 1.5 % / 2.13 M; Qwen3.5-MoE 1,088 / 1.0 % / 2.87 M;
Gemma-3 16 / 5.0 % / 2.09 M; GPT-OSS 16 / 0.0 % / 2.31 M. Block sizes and hit grain agree. The
teammate's padding is ``page_padding`` (Gemma-3: 5.0 % after load here; GPT-OSS 0.0 %), not
``padding``, which also counts the empty tail of the last attention block. The teammate's
request sizes are attention blocks after load + 2 blocks per GDN group (22 blocks for
Qwen3-Next/Qwen3.5-MoE, 35 for Qwen3.5; that also gives their 1.0 % / 1.5 %); vLLM's manager holds
1 state block per GDN group after the decode step (19 / 32 blocks: 2.77 M / 2.33 M / 3.31 M) and 3
during the second prefill chunk (25 / 38: 2.10 M / 1.95 M / 2.52 M), never 2 in this load. For
Gemma-3 and GPT-OSS the teammate's counts are within a block or two of the after-load count here
(2,567 -> 2.08 M vs 2.09 M; 1,034 -> 2.29 M vs 2.31 M: vLLM keeps 9 blocks for a 128-token window
whose last token starts a new block); the peak (window + a whole chunk) roughly halves them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from importlib import import_module
from pathlib import Path
from typing import Any

GIB = 2**30
PROMPT_TOKENS = 16_384
CHUNK_TOKENS = 8_192
MODELS: dict[str, tuple[str, str]] = {
    # key: (transformers config class, architecture vLLM resolves)
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM"),
    "qwen3_5": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration"),
    "qwen3_5_moe": ("Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM"),
}
TEAMMATE = {  # block size, padding %, tokens that fit (millions), as measured by a teammate
    "qwen3_next": (1088, 1.0, 2.39),
    "qwen3_5": (576, 1.5, 2.13),
    "qwen3_5_moe": (1088, 1.0, 2.87),
    "gemma3": (16, 5.0, 2.09),
    "gpt_oss": (16, 0.0, 2.31),
}


def _vllm() -> Any:
    """vLLM's top-level module, on the CPU platform (imported by name: mypy needs no vLLM)."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")  # keep stdout for the JSON
    try:
        return import_module("vllm")
    except ImportError as exc:
        print(
            f"vllm_storage: vLLM is not importable here ({exc}); see the module docstring "
            "for the side environment.",
            file=sys.stderr,
        )
        raise SystemExit(2) from None


def _mod(name: str) -> Any:
    return import_module(name)


def _write_config(key: str, root: Path) -> Path:
    """config.json of the transformers config class with its defaults (bf16, architecture set)."""
    transformers = _mod("transformers")
    class_name, arch = MODELS[key]
    config = getattr(transformers, class_name)()
    config.architectures = [arch]
    config.dtype = "bfloat16"
    path = root / key
    config.save_pretrained(path)
    return path


def _engine_config(path: Path, max_model_len: int, prefix_match_unit: int | None) -> Any:
    """The VllmConfig ``vllm serve`` would build (bf16, prefix caching on, fp32 SSM state)."""
    engine_args = _mod("vllm.engine.arg_utils").EngineArgs(
        model=str(path),
        skip_tokenizer_init=True,
        dtype="bfloat16",
        load_format="dummy",
        enable_prefix_caching=True,
        mamba_ssm_cache_dtype="float32",
        max_model_len=max_model_len,
        prefix_match_unit=prefix_match_unit,
    )
    return engine_args.create_engine_config()


def _cuda_block_sizes(vllm_config: Any, hybrid: bool) -> dict[str, Any]:
    """Run vLLM's ``Platform.update_block_size_for_backend`` as it runs on an SM90 GPU.

    On CUDA the non-SSM layers get FLASH_ATTN (``MultipleOf(16)`` kernel blocks) and, in
    mamba ``align`` mode, every GDN layer reports ``FLASHINFER_GDN_CHECKPOINT_ALIGNMENT``
    as its prefill checkpoint alignment. No GPU and no built model here, so the two
    lookups that read the built layers (``_find_non_ssm_backends`` and
    ``get_mamba_prefill_checkpoint_alignment``) are answered with those values; the
    rest (block-size preference, hybrid alignment, mamba page padding) is vLLM's code.
    """
    interface = _mod("vllm.platforms.interface")
    abstract = _mod("vllm.model_executor.layers.mamba.abstract")
    flash_attn = _mod("vllm.v1.attention.backends.flash_attn").FlashAttentionBackend
    alignment = _mod("vllm.v1.attention.backends.gdn_attn").FLASHINFER_GDN_CHECKPOINT_ALIGNMENT
    cache_config = vllm_config.cache_config
    gdn_alignment = alignment if cache_config.mamba_cache_mode == "align" else None
    platform = interface.Platform
    saved = (
        platform.__dict__["_find_non_ssm_backends"],
        abstract.__dict__["get_mamba_prefill_checkpoint_alignment"],
    )
    platform._find_non_ssm_backends = classmethod(lambda cls, vc: [flash_attn])
    abstract.get_mamba_prefill_checkpoint_alignment = lambda vc: gdn_alignment if hybrid else 1
    try:
        platform.update_block_size_for_backend.__func__(platform, vllm_config)
    finally:
        platform._find_non_ssm_backends = saved[0]
        abstract.get_mamba_prefill_checkpoint_alignment = saved[1]
    return {"backend": flash_attn, "gdn_checkpoint_alignment": gdn_alignment}


def _layer_specs(vllm_config: Any, backend: Any, gdn_alignment: int | None) -> dict[str, Any]:
    """Each layer's KVCacheSpec, as the layers' ``get_kv_cache_spec`` would return it."""
    torch = _mod("torch")
    iface = _mod("vllm.v1.kv_cache_interface")
    attention = _mod("vllm.model_executor.layers.attention.attention")
    registry = _mod("vllm.model_executor.models").ModelRegistry
    model_config = vllm_config.model_config
    cache_config = vllm_config.cache_config
    hf = model_config.hf_text_config
    num_kv_heads = model_config.get_num_kv_heads(vllm_config.parallel_config)
    head_size = model_config.get_head_size()
    dtype = model_config.dtype if cache_config.cache_dtype == "auto" else None
    assert dtype == torch.bfloat16, dtype
    block_size = cache_config.block_size
    specs: dict[str, Any] = {}
    mamba_spec = None
    if model_config.is_hybrid:
        model_cls, _ = registry.resolve_model_cls(model_config.architecture, model_config)
        mamba_spec = iface.MambaSpec(
            shapes=tuple(model_cls.get_mamba_state_shape_from_config(vllm_config)),
            dtypes=model_cls.get_mamba_state_dtype_from_config(vllm_config),
            block_size=cache_config.mamba_block_size,
            page_size_padded=cache_config.mamba_page_size_padded,
            mamba_type=_mod("vllm.v1.attention.backends.registry").MambaAttentionBackendEnum.GDN_ATTN,
            tp_replicated=False,
            mamba_cache_mode=cache_config.mamba_cache_mode,
            num_speculative_blocks=0,
        )
        if gdn_alignment is not None:  # QwenGDN.get_kv_cache_spec with checkpoint export
            grid = (
                math.lcm(cache_config.prefix_match_unit, gdn_alignment)
                if cache_config.prefix_match_unit is not None
                else cache_config.mamba_block_size
            )
            mamba_spec = _mod("dataclasses").replace(
                mamba_spec, num_prefill_checkpoint_blocks=1, prefill_checkpoint_alignment=grid
            )
    for i, layer_type in enumerate(hf.layer_types):
        if layer_type == "linear_attention":
            specs[f"model.layers.{i}.linear_attn"] = mamba_spec
        elif layer_type == "sliding_attention":
            per_token = backend.customize_spec(
                iface.SlidingWindowSpec(
                    block_size=1,
                    num_kv_heads=num_kv_heads,
                    head_size=head_size,
                    dtype=dtype,
                    sliding_window=hf.sliding_window,
                )
            ).real_page_size_bytes
            sw_block = attention._largest_kernel_block_within(
                backend, per_token, per_token * block_size, block_size
            )
            specs[f"model.layers.{i}.self_attn.attn"] = iface.SlidingWindowSpec(
                block_size=sw_block,
                num_kv_heads=num_kv_heads,
                head_size=head_size,
                dtype=dtype,
                sliding_window=hf.sliding_window,
            )
        else:
            assert layer_type == "full_attention", layer_type
            specs[f"model.layers.{i}.self_attn.attn"] = iface.FullAttentionSpec(
                block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size, dtype=dtype
            )
    return specs


def _plan(vllm_config: Any, specs: dict[str, Any], budget: int, backend: Any) -> dict[str, Any]:
    """The engine core's planning steps (``EngineCore._initialize_kv_caches`` and after)."""
    planning = _mod("vllm.v1.core.kv_cache_planning")
    utils = _mod("vllm.v1.core.kv_cache_utils")
    attn_utils = _mod("vllm.v1.attention.backends.utils")
    gdn = _mod("vllm.v1.attention.backends.gdn_attn").GDNAttentionBackend
    backends = [backend] + ([gdn] if any(type(s).__name__ == "MambaSpec" for s in specs.values()) else [])
    layouts = [layout.name for layout in attn_utils.get_supported_kv_cache_layouts(backends)]
    layout = attn_utils.resolve_kv_cache_layout(vllm_config, [layouts], list(specs.values()))
    attn_utils.record_kv_cache_layout(vllm_config.cache_config, layout.name)
    groups = planning.get_global_kv_cache_groups(vllm_config, [specs])
    configs = planning.get_kv_cache_configs(vllm_config, [specs], [budget], groups)
    config = utils.generate_scheduler_kv_cache_config(configs)
    cache_config = vllm_config.cache_config
    participating = [
        g.kv_cache_spec.block_size for g in config.kv_cache_groups if g.kv_cache_spec.prefix_cacheable
    ]
    cache_config.block_size = min(
        participating or [g.kv_cache_spec.block_size for g in config.kv_cache_groups]
    )
    scheduler_block_size, hash_block_size = utils.resolve_kv_cache_block_sizes(config, vllm_config)
    hit_alignment = utils.resolve_cache_hit_alignment_tokens(
        config, vllm_config, scheduler_block_size, hash_block_size
    )
    bytes_per_block = planning._pool_bytes_per_block(vllm_config, config.kv_cache_groups)
    return {
        "config": config,
        "layout": layout.name,
        "scheduler_block_size": scheduler_block_size,
        "hash_block_size": hash_block_size,
        "cache_hit_alignment_tokens": hit_alignment,
        "bytes_per_block": bytes_per_block,
    }


def _layer_specs_of(group: Any) -> list[Any]:
    spec = group.kv_cache_spec
    if hasattr(spec, "kv_cache_specs"):  # UniformTypeKVCacheSpecs
        return [spec.kv_cache_specs[name] for name in group.layer_names]
    return [spec] * len(group.layer_names)


def _useful_bytes(group: Any, blocks: list[Any], tokens: int) -> int:
    """Bytes of a group's held blocks that hold this request's K/V (or recurrent state)."""
    total = 0
    for spec in _layer_specs_of(group):
        if type(spec).__name__ == "MambaSpec":
            state = spec.real_page_size_bytes
            total += sum(state for b in blocks if not b.is_null)
            continue
        per_token = spec.real_page_size_bytes // spec.block_size
        bs = spec.block_size
        for j, block in enumerate(blocks):
            if not block.is_null:
                total += max(0, min((j + 1) * bs, tokens) - j * bs) * per_token
    return total


def _structural_bytes(group: Any, blocks: list[Any]) -> int:
    """Bytes of a group's held blocks that its layers' pages can use at all (no page padding)."""
    held = sum(not b.is_null for b in blocks)
    return held * sum(int(spec.real_page_size_bytes) for spec in _layer_specs_of(group))


def _run_request(vllm_config: Any, plan: dict[str, Any], max_model_len: int) -> dict[str, Any]:
    """Allocate the reference request through vLLM's KVCacheManager: 2 prefill chunks + 1 decode."""
    utils = _mod("vllm.v1.core.kv_cache_utils")
    sha256 = _mod("vllm.utils.hashing").sha256
    config = plan["config"]
    utils.init_none_hash(sha256)
    manager = _mod("vllm.v1.core.kv_cache_manager").KVCacheManager(
        config,
        max_model_len=max_model_len,
        scheduler_block_size=plan["scheduler_block_size"],
        hash_block_size=plan["hash_block_size"],
        enable_caching=True,
    )
    request = _mod("vllm.v1.request").Request(
        request_id="ref",
        prompt_token_ids=[1000 + i for i in range(PROMPT_TOKENS)],
        sampling_params=_mod("vllm").SamplingParams(max_tokens=2),
        pooling_params=None,
        block_hasher=utils.get_request_block_hasher(plan["hash_block_size"], sha256),
    )
    pool = manager.block_pool
    free_at_start = pool.get_num_free_blocks()
    computed_blocks, num_hit, *_ = manager.get_computed_blocks(request)
    assert num_hit == 0
    steps = []
    schedule = [CHUNK_TOKENS, PROMPT_TOKENS - CHUNK_TOKENS, 1]
    for step, n in enumerate(schedule):
        if hasattr(manager, "new_step_starts"):
            manager.new_step_starts()
        if step == len(schedule) - 1:
            request.append_output_token_ids(7)
        got = manager.allocate_slots(request, n, new_computed_blocks=computed_blocks if step == 0 else None)
        assert got is not None, f"allocation failed at step {step}"
        tokens = request.num_computed_tokens + n
        per_group = manager.get_blocks(request.request_id).blocks
        held = [sum(not b.is_null for b in blocks) for blocks in per_group]
        useful = sum(
            _useful_bytes(group, list(blocks), tokens)
            for group, blocks in zip(config.kv_cache_groups, per_group, strict=True)
        )
        usable = sum(
            _structural_bytes(group, list(blocks))
            for group, blocks in zip(config.kv_cache_groups, per_group, strict=True)
        )
        held_bytes = sum(held) * plan["bytes_per_block"]
        steps.append(
            {
                "tokens": tokens,
                "blocks_held": sum(held),
                "blocks_held_per_group": held,
                "pool_blocks_used": free_at_start - pool.get_num_free_blocks(),
                "padding": 1 - useful / held_bytes,
                "page_padding": 1 - usable / held_bytes,
            }
        )
        request.num_computed_tokens = tokens
    return {"steps": steps}


def _group_rows(config: Any) -> list[dict[str, Any]]:
    rows = []
    for group in config.kv_cache_groups:
        specs = _layer_specs_of(group)
        first = specs[0]
        kind = type(first).__name__
        if kind == "SlidingWindowSpec":
            kind = f"SlidingWindowSpec(window={first.sliding_window})"
        row = {
            "kind": kind,
            "layers": len(group.layer_names),
            "block_size": group.kv_cache_spec.block_size,
            "page_bytes": first.page_size_bytes,
            "real_page_bytes": first.real_page_size_bytes,
        }
        if type(first).__name__ == "MambaSpec":
            row["state_dtypes"] = [str(d).removeprefix("torch.") for d in first.dtypes]
            row["state_shapes"] = [list(s) for s in first.shapes]
            row["mamba_cache_mode"] = first.mamba_cache_mode
        rows.append(row)
    return rows


def measure(key: str, root: Path, budget: int, prefix_match_unit: int | None) -> dict[str, Any]:
    max_model_len = PROMPT_TOKENS + 16
    path = _write_config(key, root)
    vllm_config = _engine_config(path, max_model_len, None)
    hybrid = bool(vllm_config.model_config.is_hybrid)
    if hybrid and prefix_match_unit is not None:
        vllm_config = _engine_config(path, max_model_len, prefix_match_unit)
    cuda = _cuda_block_sizes(vllm_config, hybrid)
    cache_config = vllm_config.cache_config
    attention_block_size = cache_config.block_size
    specs = _layer_specs(vllm_config, cuda["backend"], cuda["gdn_checkpoint_alignment"])
    plan = _plan(vllm_config, specs, budget, cuda["backend"])
    config = plan["config"]
    run = _run_request(vllm_config, plan, max_model_len)
    steps = run["steps"]
    peak = max(step["blocks_held"] for step in steps)
    after = steps[-1]["blocks_held"]
    at_peak = max(steps, key=lambda s: (s["blocks_held"], s["tokens"]))  # latest on ties
    result: dict[str, Any] = {
        "model": key,
        "architecture": vllm_config.model_config.architecture,
        "block_size": attention_block_size,
        "num_blocks": config.num_blocks,
        "bytes_per_block": plan["bytes_per_block"],
        "padding": round(at_peak["padding"], 4),
        "padding_after_load": round(steps[-1]["padding"], 4),
        "page_padding": round(at_peak["page_padding"], 4),
        "page_padding_after_load": round(steps[-1]["page_padding"], 4),
        "blocks_per_request": peak,
        "blocks_per_request_after_load": after,
        "tokens_that_fit": config.num_blocks // peak * PROMPT_TOKENS,
        "tokens_that_fit_after_load": config.num_blocks // after * PROMPT_TOKENS,
        "kv_cache_layout": plan["layout"],
        "scheduler_block_size": plan["scheduler_block_size"],
        "hash_block_size": plan["hash_block_size"],
        "prefix_hit_grain_tokens": plan["cache_hit_alignment_tokens"],
        "prefix_match_unit": cache_config.prefix_match_unit,
        "mamba_cache_mode": cache_config.mamba_cache_mode if hybrid else None,
        "mamba_block_size": cache_config.mamba_block_size if hybrid else None,
        "mamba_page_size_padded": cache_config.mamba_page_size_padded if hybrid else None,
        "mamba_ssm_cache_dtype": cache_config.mamba_ssm_cache_dtype if hybrid else None,
        "groups": _group_rows(config),
        "steps": steps,
    }
    mate = TEAMMATE[key]
    result["teammate"] = {"block_size": mate[0], "padding_pct": mate[1], "tokens_that_fit_M": mate[2]}
    return result


def markdown(results: list[dict[str, Any]]) -> str:
    lines = [
        "| model | block size | hit grain | num_blocks | blocks/req (peak / after) | padding (peak / after) "
        "| page padding (peak / after) | tokens that fit (peak / after) | groups |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in results:
        groups: dict[tuple[str, int, int, int], int] = {}
        for g in r["groups"]:
            k = (g["kind"], g["layers"], g["block_size"], g["page_bytes"])
            groups[k] = groups.get(k, 0) + 1
        text = "; ".join(
            f"{n}x {kind} {layers}L bs={bs} page={page:,}B" for (kind, layers, bs, page), n in groups.items()
        )
        lines.append(
            f"| {r['model']} | {r['block_size']:,} | {r['prefix_hit_grain_tokens']:,} | {r['num_blocks']:,} "
            f"| {r['blocks_per_request']:,} / {r['blocks_per_request_after_load']:,} "
            f"| {100 * r['padding']:.1f} % / {100 * r['padding_after_load']:.1f} % "
            f"| {100 * r['page_padding']:.1f} % / {100 * r['page_padding_after_load']:.1f} % "
            f"| {r['tokens_that_fit'] / 1e6:.2f} M / {r['tokens_that_fit_after_load'] / 1e6:.2f} M | {text} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--budget-gib", type=float, default=80.0)
    parser.add_argument(
        "--prefix-match-unit",
        type=int,
        default=64,
        help="cache_config.prefix_match_unit for the hybrid (GDN) models; 0 leaves it unset",
    )
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args(argv)
    version = _vllm().__version__
    budget = int(args.budget_gib * GIB)
    results = []
    with tempfile.TemporaryDirectory(prefix="vllm_storage_") as tmp:
        for key in args.models:
            results.append(measure(key, Path(tmp), budget, args.prefix_match_unit or None))
    for r in results:
        r["vllm"] = version
        print(json.dumps(r))
    if args.markdown:
        print()
        print(markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
