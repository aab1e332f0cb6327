"""Tiny random-weight GDN hybrids for the vLLM end-to-end checks (tests/vllm/vllm_e2e_checks.py,
tests/vllm/vllm_arena_checks.py), built at test time with a fixed seed and saved with
``save_pretrained`` (no hub, no tokenizer). Needs only torch and transformers, so it imports in
vLLM's CPU venv."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers

VOCAB = 512

#: The GDN hybrids' shapes: three linear-attention (GDN) layers before one full-attention layer,
#: GDN head dim 128 (what vLLM's CPU GDN kernels take). Four 128-wide KV heads make an attention
#: token 2 KiB in bf16, so vLLM's hybrid config step sizes the attention block to hold one GDN
#: state (about 70 KiB) at 64 tokens, and prompts of a few hundred tokens hit the prefix cache.
GDN_SHAPE: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    head_dim=128,
    linear_num_key_heads=1,
    linear_num_value_heads=2,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
    layer_types=["linear_attention"] * 3 + ["full_attention"],
)


def save(cls: Any, config: Any, folder: Path) -> Path:
    """``cls(config)`` with seed-0 random weights, saved in fp32 to ``folder``."""
    torch.manual_seed(0)
    config.dtype = torch.float32
    model = cls(config)
    model.save_pretrained(folder)
    return folder


def qwen35(folder: Path) -> Path:
    """Qwen3.5's text model: GDN and gated full attention, dense MLP."""
    return save(transformers.Qwen3_5ForCausalLM, transformers.Qwen3_5TextConfig(**GDN_SHAPE), folder)


def qwen3_next(folder: Path) -> Path:
    """Qwen3-Next: the same layer pattern with a mixture-of-experts MLP in every layer."""
    config = transformers.Qwen3NextConfig(
        **GDN_SHAPE,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        decoder_sparse_step=1,
    )
    return save(transformers.Qwen3NextForCausalLM, config, folder)


#: A thin attention layer beside the GDN states: one 32-wide KV head (128 bytes a token in bf16)
#: and four GDN value heads (135,680-byte states), so vLLM's hybrid config step grows the
#: attention block to 1,088 tokens to hold one state, and stock prefix caching hits nothing in a
#: prompt shorter than that.
THIN_SHAPE: dict[str, Any] = dict(GDN_SHAPE, num_key_value_heads=1, head_dim=32, linear_num_value_heads=4)


def qwen35_thin(folder: Path) -> Path:
    """Qwen3.5's text model in :data:`THIN_SHAPE`."""
    return save(transformers.Qwen3_5ForCausalLM, transformers.Qwen3_5TextConfig(**THIN_SHAPE), folder)
