"""Every config is read as ``transformers`` itself builds the model's cache.

An independent oracle for the family table: ``transformers.DynamicCache(config=...)`` makes one
cache layer per model layer from the config the model class reads (its own ``__post_init__``
rules for legacy fields), and its layer classes say what each layer keeps:

- ``DynamicLayer``: full attention K/V;
- ``DynamicSlidingWindowLayer``: the last ``sliding_window`` tokens (a sliding window, or Llama
  4's chunk, which keeps at most a chunk);
- ``LinearAttentionLayer``: a recurrent state (mamba, GDN, KDA, lightning, short conv, RG-LRU);
- ``LinearAttentionAndFullAttentionLayer``: both (Falcon-H1, Zamba2's hybrid layers);
- ``DummyLayer``: nothing (Nemotron-H's MLP and MoE layers).

:func:`flat_kvcache.families.read_model_layers` must give each model layer the same: the same
kinds and the same windows, for every ``model_type`` the table reads with the config class's
defaults, and for the Hub form (legacy fields, no ``layer_types``) of the families whose layout
lives in such fields.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
from helpers import need

transformers = need("transformers")

from flat_kvcache.errors import ModelConfigError  # noqa: E402
from flat_kvcache.families import read_model_layers, supported_model_types  # noqa: E402

#: What a ``transformers`` cache layer class keeps, as the labels of our cache layers.
_KEEPS = {
    "DynamicLayer": ("full_attention",),
    "DynamicSlidingWindowLayer": ("windowed",),
    "LinearAttentionLayer": ("linear_attention",),
    "LinearAttentionAndFullAttentionLayer": ("full_attention", "linear_attention"),
    "LinearAttentionAndSlidingWindowAttentionLayer": ("windowed", "linear_attention"),
    "DummyLayer": (),
}

#: Model types the table reads that ``transformers`` has no config class for (remote-code
#: checkpoints), so there is nothing to build.
_NO_CONFIG_CLASS = {"minimax_text_01", "minimax_m1"}

#: Hub-form configs (legacy fields, no ``layer_types``), small but in the checkpoints' own
#: patterns: Jamba's period/offset (ai21labs/Jamba-v0.1: 8 / 4), Bamba's attention indices,
#: Nemotron-H's pattern string with MLP (-) and MoE (E) layers, LFM2's attention indices,
#: windows given only as ``sliding_window`` (Mistral 7B v0.1: 4096, Phi-3-mini: 2047), Gemma-2
#: and Gemma-3 without layer types, Llama 4's NoPE layers (its full-attention ones), RecurrentGemma's
#: block types, Qwen3-Next's interval, Kimi-Linear's 1-based lists, Zamba2's block types with
#: hybrid ids, Granite 4.0's legacy labels, Olmo3's pattern, Qwen2's max_window_layers, and
#: Falcon-H1 (every layer both).
HUB_FORMS: dict[str, dict[str, Any]] = {
    "jamba": {"num_hidden_layers": 16, "attn_layer_period": 8, "attn_layer_offset": 4},
    "bamba": {"num_hidden_layers": 8, "attn_layer_indices": [2, 5]},
    "nemotron_h": {"num_hidden_layers": 8, "hybrid_override_pattern": "M-M*-M*E"},
    "lfm2": {"num_hidden_layers": 6, "full_attn_idxs": [2, 5]},
    "mistral": {"num_hidden_layers": 4, "sliding_window": 4096},
    "phi3": {"num_hidden_layers": 4, "sliding_window": 2047},
    "gemma2": {"num_hidden_layers": 4, "sliding_window": 4096},
    "gemma3_text": {"num_hidden_layers": 8, "sliding_window": 512, "sliding_window_pattern": 6},
    "llama4_text": {
        "num_hidden_layers": 8,
        "no_rope_layers": [1, 1, 1, 0, 1, 1, 1, 0],
        "attention_chunk_size": 8192,
    },
    "recurrent_gemma": {
        "num_hidden_layers": 5,
        "block_types": ["recurrent", "recurrent", "attention"],
        "attention_window_size": 2048,
    },
    "qwen3_next": {"num_hidden_layers": 8, "full_attention_interval": 4},
    "kimi_linear": {
        "num_hidden_layers": 4,
        "linear_attn_config": {"full_attn_layers": [4], "kda_layers": [1, 2, 3]},
    },
    "zamba2": {
        "num_hidden_layers": 4,
        "layers_block_type": ["mamba", "hybrid", "mamba", "hybrid"],
        "hybrid_layer_ids": [1, 3],
    },
    "granitemoehybrid": {"num_hidden_layers": 4, "layer_types": ["mamba", "attention", "mamba", "attention"]},
    "olmo3": {"num_hidden_layers": 8, "sliding_window": 4096},
    "qwen2": {
        "num_hidden_layers": 4,
        "use_sliding_window": True,
        "sliding_window": 4096,
        "max_window_layers": 2,
    },
    "falcon_h1": {"num_hidden_layers": 3},
}


def transformers_layers(config: Any) -> list[tuple[tuple[str, ...], int | None]]:
    """Per model layer, what ``transformers``' own cache keeps and its window (None unless
    windowed)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cache = transformers.DynamicCache(config=config)
    out = []
    for layer in cache.layers:
        keeps = _KEEPS[type(layer).__name__]
        window = getattr(layer, "sliding_window", None) if "windowed" in keeps else None
        out.append((keeps, window))
    return out


def our_layers(cfg: dict[str, Any], num_model_layers: int) -> list[tuple[tuple[str, ...], int | None]]:
    """Per model layer, the labels of our cache layers (sliding and chunked as ``windowed``) and
    the window."""
    read = read_model_layers(cfg)
    windows = read.sliding_window
    per_layer: list[list[str]] = [[] for _ in range(num_model_layers)]
    window_of: list[int | None] = [None] * num_model_layers
    for index, (label, model_layer) in enumerate(zip(read.layer_types, read.model_layers, strict=True)):
        windowed = label in ("sliding_attention", "chunked_attention")
        per_layer[model_layer].append("windowed" if windowed else label)
        if windowed:
            window_of[model_layer] = windows[index] if isinstance(windows, list | tuple) else windows
    return [(tuple(labels), window) for labels, window in zip(per_layer, window_of, strict=True)]


def as_built(config: Any) -> dict[str, Any]:
    text = config.get_text_config(decoder=True)
    return dict(text.to_dict())


@pytest.mark.parametrize("model_type", sorted(set(supported_model_types()) - _NO_CONFIG_CLASS))
def test_class_defaults_are_read_as_transformers_builds_them(model_type: str) -> None:
    config = transformers.AutoConfig.for_model(model_type)
    theirs = transformers_layers(config)
    try:
        ours = our_layers(as_built(config), len(theirs))
    except ModelConfigError as exc:
        # Refused, never misread: only where the class's default is a layout its checkpoints
        # never have (the table's row says why).
        assert model_type in {"lfm2_moe"}, exc
        return
    assert ours == theirs


@pytest.mark.parametrize("model_type", sorted(HUB_FORMS))
def test_hub_forms_are_read_as_transformers_builds_them(model_type: str) -> None:
    hub = {"model_type": model_type, **HUB_FORMS[model_type]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = transformers.AutoConfig.for_model(**hub)
    theirs = transformers_layers(config)
    # Our reader sees the config.json as shipped, not transformers' rewrite of it.
    assert our_layers(hub, len(theirs)) == theirs


def test_the_oracle_tells_a_misread_apart() -> None:
    """A config read as all full attention (the misread this table exists to prevent) differs."""
    config = transformers.AutoConfig.for_model(**{"model_type": "jamba", **HUB_FORMS["jamba"]})
    all_full = [(("full_attention",), None)] * 16
    assert transformers_layers(config) != all_full
