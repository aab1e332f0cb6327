"""Model presets: Hugging Face style ``config.json`` dicts with the shapes of public models.

Every preset carries at least ``model_type``, ``num_hidden_layers``, ``layer_types``,
``num_key_value_heads``, ``head_dim``, ``torch_dtype``, ``max_position_embeddings`` and
``sliding_window`` (None where the model has none), so sizing and tensor shapes can both be
derived from it. :func:`get_preset` hands out a deep copy; the table itself is read-only.
"""

from __future__ import annotations

import copy
from types import MappingProxyType
from typing import Any, TypeVar

__all__ = ["DEFAULT_PRESET", "PRESETS", "get_preset", "preset_names"]

_T = TypeVar("_T")


def _repeat(pattern: list[_T], num_layers: int) -> list[_T]:
    """``pattern`` repeated over ``num_layers`` layers."""
    return [pattern[i % len(pattern)] for i in range(num_layers)]


_GPT_OSS_LIKE: dict[str, Any] = {
    "model_type": "gpt_oss",
    "num_hidden_layers": 24,
    "layer_types": _repeat(["sliding_attention", "full_attention"], 24),
    "sliding_window": 128,
    "hidden_size": 2880,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "torch_dtype": "bfloat16",
    "max_position_embeddings": 131072,
}

_QWEN3_5_LIKE: dict[str, Any] = {
    "model_type": "qwen3_5_text",
    "num_hidden_layers": 48,
    "layer_types": _repeat(["linear_attention"] * 3 + ["full_attention"], 48),
    "full_attention_interval": 4,
    "sliding_window": None,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "torch_dtype": "bfloat16",
    "max_position_embeddings": 262144,
    # Gated DeltaNet (linear attention) state: a conv window and a recurrent state per layer.
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_value_head_dim": 128,
    "linear_num_value_heads": 32,
    "mamba_ssm_dtype": "float32",
}

_LLAMA3_8B_LIKE: dict[str, Any] = {
    "model_type": "llama",
    "num_hidden_layers": 32,
    "layer_types": ["full_attention"] * 32,
    "sliding_window": None,
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "torch_dtype": "bfloat16",
    "max_position_embeddings": 131072,
}

# Two sliding windows (512 and 4096) plus full attention: sliding layers split into one group
# per window (group ids ``sliding_attention_512`` and ``sliding_attention_4096``). The window
# is given per layer (None for full-attention layers).
_MULTI_WINDOW_LAYERS = _repeat(["sliding_attention", "sliding_attention", "full_attention"], 12)
_MULTI_WINDOW_DEMO: dict[str, Any] = {
    "model_type": "multi_window_demo",
    "num_hidden_layers": 12,
    "layer_types": _MULTI_WINDOW_LAYERS,
    "sliding_window": _repeat([512, 4096, None], 12),
    "num_key_value_heads": 4,
    "head_dim": 128,
    "torch_dtype": "bfloat16",
    "max_position_embeddings": 32768,
}

#: The preset ``flat-kvcache plan`` uses when given no model.
DEFAULT_PRESET = "gpt-oss-like"

#: Preset name -> config dict (read-only; use :func:`get_preset` for a copy to modify).
PRESETS: MappingProxyType[str, dict[str, Any]] = MappingProxyType(
    {
        "gpt-oss-like": _GPT_OSS_LIKE,
        "qwen3.5-like": _QWEN3_5_LIKE,
        "llama3-8b-like": _LLAMA3_8B_LIKE,
        "multi-window-demo": _MULTI_WINDOW_DEMO,
    }
)


def preset_names() -> list[str]:
    """The preset names, default first."""
    return [DEFAULT_PRESET, *(name for name in PRESETS if name != DEFAULT_PRESET)]


def get_preset(name: str) -> dict[str, Any]:
    """A deep copy of preset ``name`` (``KeyError`` naming the known presets if there is none)."""
    try:
        return copy.deepcopy(PRESETS[name])
    except KeyError:
        raise KeyError(f"unknown preset {name!r}; known presets: {', '.join(preset_names())}") from None
