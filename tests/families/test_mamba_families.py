"""The mamba families (Jamba, Mamba, Mamba2, Bamba, Nemotron-H, Granite 4.0; Falcon-H1 and Zamba2
refused) and the mamba1 / mamba2 state kinds, checked against transformers itself.

- Layers: each family in the form transformers writes (``SomeConfig(...).to_dict()``) and the form
  Hub checkpoints ship (a trimmed ``config.json`` of a named public checkpoint, read from a file),
  both against the layout transformers builds from the same values (its ``layers_block_type`` /
  ``layer_types``, computed by the model's own rule).
- Refusals name the field.
- States: a tiny model of each family runs a few tokens on CPU with a cache; the state tensors
  that cache allocates are compared with the state kind's components, and the cache's layer
  classes with the family's reading of the layers.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from flat_kvcache.config import load_model_config
from flat_kvcache.errors import ModelConfigError
from flat_kvcache.families import STATE_KINDS, family_of, read_model_layers, state_components
from helpers import need

transformers = need("transformers")

#: transformers' labels (5.x and legacy) as cache labels; MLP-only blocks keep no cache (None).
_LABEL = {
    "linear_attention": "linear_attention",
    "mamba": "linear_attention",
    "full_attention": "full_attention",
    "attention": "full_attention",
    "moe": None,
    "mlp": None,
}


def _expected(blocks: Sequence[str]) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """The cache labels and model layer indices of transformers' per-layer block list."""
    kept = [(i, _LABEL[block]) for i, block in enumerate(blocks) if _LABEL[block] is not None]
    return tuple(str(label) for _, label in kept), tuple(i for i, _ in kept)


def _write(tmp_path: Path, cfg: Mapping[str, Any]) -> dict[str, Any]:
    """``cfg`` as a Hub ``config.json`` on disk, loaded back through ``load_model_config``."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg), encoding="utf-8")
    return load_model_config(path)


# --- Hub checkpoints (trimmed config.json: the fields the layout and the state read) -------------

# ai21labs/Jamba-v0.1
JAMBA_V01 = {
    "model_type": "jamba",
    "num_hidden_layers": 32,
    "attn_layer_period": 8,
    "attn_layer_offset": 4,
    "expert_layer_period": 2,
    "expert_layer_offset": 1,
    "num_experts": 16,
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "mamba_d_state": 16,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "mamba_dt_rank": 256,
}

# state-spaces/mamba-130m-hf
MAMBA_130M = {
    "model_type": "mamba",
    "num_hidden_layers": 24,
    "hidden_size": 768,
    "state_size": 16,
    "conv_kernel": 4,
    "expand": 2,
    "intermediate_size": 1536,
    "time_step_rank": 48,
}

# mistralai/Mamba-Codestral-7B-v0.1
MAMBA_CODESTRAL = {
    "model_type": "mamba2",
    "num_hidden_layers": 64,
    "hidden_size": 4096,
    "num_heads": 128,
    "head_dim": 64,
    "state_size": 128,
    "n_groups": 8,
    "conv_kernel": 4,
    "expand": 2,
}

# ibm-ai-platform/Bamba-9B
BAMBA_9B = {
    "model_type": "bamba",
    "num_hidden_layers": 32,
    "attn_layer_indices": [9, 18, 27],
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "mamba_n_heads": 128,
    "mamba_d_head": 64,
    "mamba_n_groups": 1,
    "mamba_d_state": 128,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
}

# nvidia/Nemotron-H-8B-Base-8K
NEMOTRON_H_8B = {
    "model_type": "nemotron_h",
    "num_hidden_layers": 52,
    "hybrid_override_pattern": "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "mamba_num_heads": 128,
    "mamba_head_dim": 64,
    "ssm_state_size": 128,
    "n_groups": 8,
    "conv_kernel": 4,
    "expand": 2,
}

# ibm-granite/granite-4.0-h-tiny (legacy labels, as the checkpoint ships them)
GRANITE_4_H_TINY = {
    "model_type": "granitemoehybrid",
    "num_hidden_layers": 40,
    "layer_types": ["mamba"] * 5
    + ["attention"]
    + ["mamba"] * 9
    + ["attention"]
    + ["mamba"] * 9
    + ["attention"]
    + ["mamba"] * 9
    + ["attention"]
    + ["mamba"] * 4,
    "hidden_size": 1536,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "num_local_experts": 64,
    "num_experts_per_tok": 6,
    "mamba_n_heads": 48,
    "mamba_d_head": 64,
    "mamba_n_groups": 1,
    "mamba_d_state": 128,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
}


def _blocks_jamba(c: Any) -> list[str]:
    return list(c.layers_block_type)


def _blocks_layer_types(c: Any) -> list[str]:
    return list(c.layer_types)


#: family name, config class, Hub checkpoint, transformers' per-layer blocks of a config, state.
FAMILY_CASES: list[tuple[str, str, dict[str, Any], Callable[[Any], list[str]], str]] = [
    ("jamba", "JambaConfig", JAMBA_V01, _blocks_jamba, "mamba1"),
    ("mamba", "MambaConfig", MAMBA_130M, _blocks_layer_types, "mamba1"),
    ("mamba2", "Mamba2Config", MAMBA_CODESTRAL, _blocks_layer_types, "mamba2"),
    ("bamba", "BambaConfig", BAMBA_9B, _blocks_jamba, "mamba2"),
    ("nemotron_h", "NemotronHConfig", NEMOTRON_H_8B, _blocks_jamba, "mamba2"),
    ("granitemoehybrid", "GraniteMoeHybridConfig", GRANITE_4_H_TINY, _blocks_jamba, "mamba2"),
]
FAMILY_IDS = [case[0] for case in FAMILY_CASES]


def _config_of(class_name: str, hub: Mapping[str, Any]) -> Any:
    """transformers' config object built from the Hub values (as ``from_pretrained`` does)."""
    values = {k: v for k, v in hub.items() if k != "model_type"}
    return getattr(transformers, class_name)(**values)


@pytest.mark.parametrize(("model_type", "class_name", "hub", "blocks", "state"), FAMILY_CASES, ids=FAMILY_IDS)
def test_the_hub_form_reads_as_transformers_builds_it(
    tmp_path: Path,
    model_type: str,
    class_name: str,
    hub: dict[str, Any],
    blocks: Callable[[Any], list[str]],
    state: str,
) -> None:
    expected_labels, expected_layers = _expected(blocks(_config_of(class_name, hub)))
    got = read_model_layers(_write(tmp_path, hub))
    assert got.model_type == model_type
    assert got.layer_types == expected_labels
    assert got.model_layers == expected_layers
    assert got.num_model_layers == hub["num_hidden_layers"]
    assert got.sliding_window is None
    assert got.state_kind == state


@pytest.mark.parametrize(("model_type", "class_name", "hub", "blocks", "state"), FAMILY_CASES, ids=FAMILY_IDS)
def test_the_transformers_form_of_a_checkpoint_reads_the_same_as_its_hub_form(
    tmp_path: Path,
    model_type: str,
    class_name: str,
    hub: dict[str, Any],
    blocks: Callable[[Any], list[str]],
    state: str,
) -> None:
    written = _config_of(class_name, hub).to_dict()
    assert written["model_type"] == model_type
    from_transformers = read_model_layers(load_model_config(written))
    assert from_transformers == read_model_layers(_write(tmp_path, hub))
    assert from_transformers.state_kind == state
    # The state of the same checkpoint, from either form.
    assert state_components(state, load_model_config(written)) == state_components(
        state, _write(tmp_path, hub)
    )


@pytest.mark.parametrize(("model_type", "class_name", "hub", "blocks", "state"), FAMILY_CASES, ids=FAMILY_IDS)
def test_the_transformers_defaults_read_as_transformers_builds_them(
    model_type: str,
    class_name: str,
    hub: dict[str, Any],
    blocks: Callable[[Any], list[str]],
    state: str,
) -> None:
    config = getattr(transformers, class_name)()
    labels, layers = _expected(blocks(config))
    got = read_model_layers(load_model_config(config.to_dict()))
    assert (got.layer_types, got.model_layers, got.state_kind) == (labels, layers, state)
    assert got.num_model_layers == len(blocks(config))


def test_the_expected_layouts_by_hand() -> None:
    """The layouts above spelled out, so a change in transformers' rules shows up here too."""
    jamba = read_model_layers(load_model_config(JAMBA_V01))
    assert [
        i for i, t in zip(jamba.model_layers, jamba.layer_types, strict=True) if t == "full_attention"
    ] == [
        4,
        12,
        20,
        28,
    ]
    bamba = read_model_layers(load_model_config(BAMBA_9B))
    assert [
        i for i, t in zip(bamba.model_layers, bamba.layer_types, strict=True) if t == "full_attention"
    ] == [9, 18, 27]
    nemotron = read_model_layers(load_model_config(NEMOTRON_H_8B))
    assert len(nemotron.layer_types) == 28  # 24 mamba2 + 4 attention; the 24 MLP layers keep nothing
    assert nemotron.layer_types.count("full_attention") == 4
    assert nemotron.model_layers[:5] == (0, 2, 4, 6, 7)
    assert nemotron.num_model_layers == 52
    granite = read_model_layers(load_model_config(GRANITE_4_H_TINY))
    assert [
        i for i, t in zip(granite.model_layers, granite.layer_types, strict=True) if t == "full_attention"
    ] == [
        5,
        15,
        25,
        35,
    ]
    nemotron_default = read_model_layers(load_model_config(transformers.NemotronHConfig().to_dict()))
    assert nemotron_default.layer_types == ("linear_attention", "full_attention")
    assert nemotron_default.model_layers == (0, 2)


def test_an_explicit_list_that_agrees_with_the_rule_is_read() -> None:
    blocks = transformers.JambaConfig(**{k: v for k, v in JAMBA_V01.items() if k != "model_type"}).layer_types
    legacy = ["attention" if block == "full_attention" else "mamba" for block in blocks]
    with_list = {**JAMBA_V01, "layer_types": list(blocks), "layers_block_type": legacy}
    assert read_model_layers(load_model_config(with_list)) == read_model_layers(load_model_config(JAMBA_V01))
    # NemotronH: the list wins over the pattern, as in NemotronHConfig.
    listed = {
        **NEMOTRON_H_8B,
        "layers_block_type": ["mamba", "mlp", "attention", "moe"],
        "num_hidden_layers": None,
    }
    got = read_model_layers(load_model_config(listed))
    assert (got.layer_types, got.model_layers) == (("linear_attention", "full_attention"), (0, 2))


# --- refusals ------------------------------------------------------------------------------------


def _refused(model_type: str, class_name: str) -> dict[str, Any]:
    return {"model_type": model_type, **getattr(transformers, class_name)().to_dict()}


REFUSALS: list[tuple[str, dict[str, Any], Sequence[str]]] = [
    ("jamba-offset", {**JAMBA_V01, "attn_layer_offset": 8}, ["attn_layer_offset", "8", "attn_layer_period"]),
    ("jamba-period", {**JAMBA_V01, "attn_layer_period": 0}, ["attn_layer_period", "0"]),
    ("jamba-layers", {**JAMBA_V01, "num_hidden_layers": None}, ["num_hidden_layers"]),
    (
        "jamba-list",
        {**JAMBA_V01, "layer_types": ["mamba"] * 32},
        ["layer_types", "attn_layer_period = 8", "attn_layer_offset = 4", "[4, 12, 20, 28]"],
    ),
    (
        "jamba-label",
        {**JAMBA_V01, "layers_block_type": ["mamba"] * 31 + ["ssm"]},
        ["layers_block_type[31]", "ssm"],
    ),
    (
        "mamba-attention",
        {**MAMBA_130M, "layer_types": ["mamba", "attention"], "num_hidden_layers": 2},
        ["layer_types[1]", "attention"],
    ),
    (
        "mamba-count",
        {**MAMBA_130M, "layer_types": ["mamba"] * 3},
        ["layer_types", "3 entries", "num_hidden_layers is 24"],
    ),
    ("mamba2-layers", {**MAMBA_CODESTRAL, "num_hidden_layers": None}, ["num_hidden_layers"]),
    (
        "bamba-index",
        {**BAMBA_9B, "attn_layer_indices": [9, 32]},
        ["attn_layer_indices[1]", "32", "num_hidden_layers = 32"],
    ),
    ("bamba-indices", {**BAMBA_9B, "attn_layer_indices": "9,18"}, ["attn_layer_indices", "'9,18'"]),
    (
        "bamba-list",
        {**BAMBA_9B, "layers_block_type": ["mamba"] * 32},
        ["layers_block_type", "attn_layer_indices = [9, 18, 27]"],
    ),
    (
        "nemotron-char",
        {**NEMOTRON_H_8B, "hybrid_override_pattern": "M*X", "num_hidden_layers": 3},
        ["hybrid_override_pattern[2]", "'X'"],
    ),
    (
        "nemotron-length",
        {**NEMOTRON_H_8B, "num_hidden_layers": 50},
        ["hybrid_override_pattern", "52", "num_hidden_layers is 50"],
    ),
    (
        "nemotron-missing",
        {**NEMOTRON_H_8B, "hybrid_override_pattern": None},
        ["hybrid_override_pattern", "layers_block_type"],
    ),
    (
        "nemotron-type",
        {**NEMOTRON_H_8B, "hybrid_override_pattern": ["M"]},
        ["hybrid_override_pattern", "['M']"],
    ),
    (
        "nemotron-label",
        {"model_type": "nemotron_h", "layers_block_type": ["ssm"]},
        ["layers_block_type[0]", "ssm"],
    ),
    (
        "nemotron-two-lists",
        {
            "model_type": "nemotron_h",
            "layer_types": ["mamba", "attention"],
            "layers_block_type": ["mamba", "mamba"],
        },
        ["layers_block_type", "disagrees with layer_types"],
    ),
    (
        "nemotron-no-cache",
        {"model_type": "nemotron_h", "hybrid_override_pattern": "-E"},
        ["no layer", "keeps a KV cache or a state"],
    ),
    ("granite-label", {**GRANITE_4_H_TINY, "layer_types": ["hybrid"] * 40}, ["layer_types[0]", "hybrid"]),
    (
        "granite-count",
        {**GRANITE_4_H_TINY, "num_hidden_layers": 41},
        ["layer_types", "40 entries", "num_hidden_layers is 41"],
    ),
    (
        "granite-layers",
        {**GRANITE_4_H_TINY, "layer_types": None, "num_hidden_layers": None},
        ["num_hidden_layers"],
    ),
    (
        "falcon_h1",
        _refused("falcon_h1", "FalconH1Config"),
        ["falcon_h1", "layers_block_type", "hybrid", "both"],
    ),
    ("zamba2", _refused("zamba2", "Zamba2Config"), ["zamba2", "layers_block_type", "hybrid", "same layer"]),
    (
        # Zyphra/Zamba2-1.2B ships legacy labels; trimmed to its first 7 layers.
        "zamba2-hub",
        {"model_type": "zamba2", "num_hidden_layers": 7, "layers_block_type": ["mamba"] * 6 + ["hybrid"]},
        ["zamba2", "layers_block_type", "hybrid"],
    ),
]


@pytest.mark.parametrize(
    ("cfg", "fields"), [case[1:] for case in REFUSALS], ids=[case[0] for case in REFUSALS]
)
def test_a_config_the_family_cannot_read_right_is_refused_naming_the_field(
    cfg: dict[str, Any], fields: Sequence[str]
) -> None:
    with pytest.raises(ModelConfigError) as info:
        read_model_layers(load_model_config(cfg))
    for field in fields:
        assert field in str(info.value)


def test_falcon_h1_and_zamba2_are_refused_as_families() -> None:
    for model_type in ("falcon_h1", "zamba2"):
        family = family_of({"model_type": model_type})
        assert family.refused is not None
        assert "layers_block_type" in family.refused
        assert family.state == "mamba2"


STATE_REFUSALS: list[tuple[str, str, dict[str, Any], Sequence[str]]] = [
    ("mamba1-missing", "mamba1", {**MAMBA_130M, "state_size": None}, ["state_size", "missing"]),
    ("mamba1-kernel", "mamba1", {**JAMBA_V01, "mamba_d_conv": 1}, ["mamba_d_conv", "1"]),
    ("mamba1-expand", "mamba1", {**MAMBA_130M, "expand": 1.5}, ["expand", "1.5"]),
    (
        "mamba1-type",
        "mamba1",
        {**MAMBA_130M, "model_type": "bamba"},
        ["model_type", "'bamba'", "jamba, mamba"],
    ),
    (
        "mamba2-heads",
        "mamba2",
        {**MAMBA_CODESTRAL, "num_heads": 64},
        ["num_heads = 64", "head_dim = 64", "8192"],
    ),
    ("mamba2-groups", "mamba2", {**MAMBA_CODESTRAL, "n_groups": 3}, ["n_groups = 3", "num_heads = 128"]),
    (
        "mamba2-auto",
        "mamba2",
        {**BAMBA_9B, "mamba_d_head": "auto", "mamba_n_heads": 100},
        ["mamba_n_heads", "100"],
    ),
    ("mamba2-alias", "mamba2", {**NEMOTRON_H_8B, "mamba_n_groups": 4}, ["mamba_n_groups", "n_groups = 8"]),
    (
        "mamba2-alias-missing",
        "mamba2",
        {**NEMOTRON_H_8B, "conv_kernel": None},
        ["conv_kernel / mamba_d_conv", "missing"],
    ),
    (
        "mamba2-dtype",
        "mamba2",
        {**NEMOTRON_H_8B, "mamba_ssm_cache_dtype": "fp8"},
        ["mamba_ssm_cache_dtype", "'fp8'"],
    ),
    ("mamba2-falcon", "mamba2", _refused("falcon_h1", "FalconH1Config"), ["model_type", "'falcon_h1'"]),
]


@pytest.mark.parametrize(
    ("kind", "cfg", "fields"), [case[1:] for case in STATE_REFUSALS], ids=[case[0] for case in STATE_REFUSALS]
)
def test_a_state_that_cannot_be_sized_right_is_refused_naming_the_field(
    kind: str, cfg: dict[str, Any], fields: Sequence[str]
) -> None:
    with pytest.raises(ModelConfigError) as info:
        state_components(kind, load_model_config(cfg))
    for field in fields:
        assert field in str(info.value)


# --- state shapes ----------------------------------------------------------------------------------


def test_state_components_of_checkpoints_by_the_modeling_formulas() -> None:
    """Full-size states by the mixers' formulas (``MambaMixer``: conv over ``expand * hidden``
    channels, ssm ``(expand * hidden, state_size)``; ``Mamba2Mixer`` and kin: conv over
    ``inner + 2 * n_groups * state`` channels, ssm ``(heads, head_dim, state)``); conv keeps
    ``kernel - 1`` columns (``StateKind.layout``)."""
    table = {
        "mamba130m": ("mamba1", MAMBA_130M, (1536, 3), (1536, 16)),
        "jamba": ("mamba1", JAMBA_V01, (8192, 3), (8192, 16)),
        "codestral": ("mamba2", MAMBA_CODESTRAL, (8192 + 2 * 8 * 128, 3), (128, 64, 128)),
        "bamba": ("mamba2", BAMBA_9B, (8192 + 2 * 1 * 128, 3), (128, 64, 128)),
        "nemotron": ("mamba2", NEMOTRON_H_8B, (8192 + 2 * 8 * 128, 3), (128, 64, 128)),
        "granite": ("mamba2", GRANITE_4_H_TINY, (3072 + 2 * 1 * 128, 3), (48, 64, 128)),
        "granite-auto": (
            "mamba2",
            {**GRANITE_4_H_TINY, "mamba_d_head": "auto"},
            (3072 + 256, 3),
            (48, 64, 128),
        ),
    }
    for name, (kind, cfg, conv, ssm) in table.items():
        got = {c.name: (c.shape, c.dtype) for c in state_components(kind, load_model_config(cfg))}
        assert got == {"conv": (conv, "model"), "ssm": (ssm, "float32")}, name
    assert "kernel - 1" in STATE_KINDS["mamba1"].layout
    assert "kernel - 1" in STATE_KINDS["mamba2"].layout


def test_a_configured_ssm_cache_dtype_is_kept() -> None:
    default = transformers.NemotronHConfig().to_dict()
    assert default["mamba_ssm_cache_dtype"] == "float32"
    ssm = {c.name: c.dtype for c in state_components("mamba2", load_model_config(default))}["ssm"]
    assert ssm == "float32"
    bf16 = {**default, "mamba_ssm_cache_dtype": "bfloat16"}
    assert {c.name: c.dtype for c in state_components("mamba2", load_model_config(bf16))}["ssm"] == "bfloat16"


_SMALL_ATTENTION = {"vocab_size": 64, "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2}
_SMALL_MAMBA2 = {
    "mamba_n_heads": 4,
    "mamba_d_head": 16,
    "mamba_n_groups": 2,
    "mamba_d_state": 8,
    "mamba_d_conv": 3,
}

#: Tiny models (2-4 layers, small sizes, conv kernel 3 so kernel and kernel - 1 differ from the
#: defaults): config class, kwargs, model class.
TINY: dict[str, tuple[str, dict[str, Any], str]] = {
    "mamba": (
        "MambaConfig",
        {
            "vocab_size": 64,
            "hidden_size": 32,
            "state_size": 8,
            "num_hidden_layers": 2,
            "conv_kernel": 3,
            "time_step_rank": 4,
        },
        "MambaForCausalLM",
    ),
    "jamba": (
        "JambaConfig",
        {
            **_SMALL_ATTENTION,
            "intermediate_size": 16,
            "num_hidden_layers": 4,
            "attn_layer_period": 2,
            "attn_layer_offset": 1,
            "num_experts": 2,
            "mamba_d_state": 8,
            "mamba_d_conv": 3,
            "mamba_dt_rank": 4,
        },
        "JambaForCausalLM",
    ),
    "mamba2": (
        "Mamba2Config",
        {
            "vocab_size": 64,
            "hidden_size": 32,
            "state_size": 8,
            "num_hidden_layers": 2,
            "conv_kernel": 3,
            "num_heads": 8,
            "head_dim": 8,
            "n_groups": 2,
            "chunk_size": 4,
        },
        "Mamba2ForCausalLM",
    ),
    "bamba": (
        "BambaConfig",
        {
            **_SMALL_ATTENTION,
            **_SMALL_MAMBA2,
            "intermediate_size": 16,
            "num_hidden_layers": 3,
            "attn_layer_indices": [1],
            "mamba_chunk_size": 4,
        },
        "BambaForCausalLM",
    ),
    "nemotron_h": (
        "NemotronHConfig",
        {
            **_SMALL_ATTENTION,
            "head_dim": 8,
            "intermediate_size": 16,
            "layers_block_type": ["mamba", "mlp", "attention", "moe"],
            "ssm_state_size": 8,
            "mamba_num_heads": 4,
            "mamba_head_dim": 16,
            "n_groups": 2,
            "conv_kernel": 3,
            "chunk_size": 4,
            "n_routed_experts": 2,
            "moe_intermediate_size": 8,
            "moe_shared_expert_intermediate_size": 8,
            "num_experts_per_tok": 1,
        },
        "NemotronHForCausalLM",
    ),
    "granitemoehybrid": (
        "GraniteMoeHybridConfig",
        {
            **_SMALL_ATTENTION,
            **_SMALL_MAMBA2,
            "intermediate_size": 16,
            "num_hidden_layers": 3,
            "layer_types": ["mamba", "attention", "mamba"],
            "mamba_chunk_size": 4,
            "num_local_experts": 2,
            "num_experts_per_tok": 1,
            "shared_intermediate_size": 8,
        },
        "GraniteMoeHybridForCausalLM",
    ),
    "zamba2": (
        "Zamba2Config",
        {
            "vocab_size": 64,
            "hidden_size": 32,
            "num_attention_heads": 4,
            "num_hidden_layers": 4,
            "layers_block_type": ["mamba", "hybrid", "mamba", "hybrid"],
            "mamba_d_state": 8,
            "mamba_d_conv": 3,
            "mamba_ngroups": 2,
            "n_mamba_heads": 4,
            "intermediate_size": 16,
            "chunk_size": 4,
        },
        "Zamba2ForCausalLM",
    ),
    "falcon_h1": (
        "FalconH1Config",
        {
            **_SMALL_ATTENTION,
            "num_hidden_layers": 2,
            "intermediate_size": 16,
            "mamba_d_ssm": 64,
            **_SMALL_MAMBA2,
            "mamba_chunk_size": 4,
        },
        "FalconH1ForCausalLM",
    ),
}


def _run_tiny(name: str) -> tuple[Any, list[Any]]:
    """The tiny model's config, and its cache's layers after 5 prompt tokens and 1 decoded (the
    mixers allocate the states lazily, from what they hand the cache)."""
    torch = need("torch")
    class_name, kwargs, model_name = TINY[name]
    config = getattr(transformers, class_name)(**kwargs)
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).to(torch.bfloat16).eval()
    with torch.no_grad():
        out = model(input_ids=torch.tensor([[1, 2, 3, 4, 5]]), use_cache=True)
        cache = out.past_key_values if getattr(out, "past_key_values", None) is not None else out.cache_params
        key = "past_key_values" if getattr(out, "past_key_values", None) is not None else "cache_params"
        model(input_ids=torch.tensor([[6]]), use_cache=True, **{key: cache})
    return config, list(cache.layers)


@pytest.mark.torch
@pytest.mark.parametrize("name", ["mamba", "jamba", "mamba2", "bamba", "nemotron_h", "granitemoehybrid"])
def test_state_components_match_the_states_the_models_own_cache_allocates(name: str) -> None:
    torch = need("torch")
    cache_utils = need("transformers.cache_utils")
    config, layers = _run_tiny(name)
    cfg = load_model_config(config.to_dict())
    read = read_model_layers(cfg)
    assert read.num_model_layers == len(layers)

    # The cache's layer classes are the family's reading of the layers.
    kinds = dict(zip(read.model_layers, read.layer_types, strict=True))
    for i, layer in enumerate(layers):
        label = kinds.get(i)
        if label == "linear_attention":
            assert type(layer) is cache_utils.LinearAttentionLayer, i
        elif label == "full_attention":
            assert type(layer) is cache_utils.DynamicLayer, i
        else:
            assert type(layer) is cache_utils.DummyLayer, i

    # The states it allocated (batch 1) are the state kind's components.
    assert read.state_kind is not None
    components = {c.name: c for c in state_components(read.state_kind, cfg)}
    assert set(components) == {"conv", "ssm"}
    for i, label in kinds.items():
        if label != "linear_attention":
            continue
        conv, ssm = layers[i].conv_states[0], layers[i].recurrent_states[0]
        assert conv.shape[0] == 1 and ssm.shape[0] == 1
        channels, kernel = conv.shape[1:]
        assert components["conv"].shape == (channels, kernel - 1)  # layout: kernel - 1 columns
        assert conv.dtype == torch.bfloat16 and components["conv"].dtype == "model"
        assert components["ssm"].shape == tuple(ssm.shape[1:])
        assert components["ssm"].dtype == str(ssm.dtype).removeprefix("torch.")


@pytest.mark.torch
@pytest.mark.parametrize("name", ["zamba2", "falcon_h1"])
def test_the_refused_families_keep_attention_and_mamba2_state_in_one_cache_layer(name: str) -> None:
    """Why Falcon-H1 and Zamba2 are refused: their hybrid layers are one cache layer holding both
    K/V and a mamba2 state."""
    cache_utils = need("transformers.cache_utils")
    config, layers = _run_tiny(name)
    hybrid = [i for i, block in enumerate(config.layers_block_type) if block == "hybrid"]
    assert hybrid
    for i in hybrid:
        layer = layers[i]
        assert isinstance(layer, cache_utils.LinearAttentionAndFullAttentionLayer)
        assert layer.conv_states[0] is not None and layer.recurrent_states[0] is not None
        assert layer.keys is not None and layer.keys.numel() > 0
    with pytest.raises(ModelConfigError, match="layers_block_type"):
        read_model_layers(load_model_config(config.to_dict()))
