"""The mamba families (Jamba, Mamba, Mamba2, Bamba, Nemotron-H, Granite 4.0, and Falcon-H1 and
Zamba2, whose hybrid layers hold attention K/V and a mamba2 state together) and the mamba1 /
mamba2 state kinds, checked against transformers itself.

- Layers: each family in the form transformers writes (``SomeConfig(...).to_dict()``) and the form
  Hub checkpoints ship (a trimmed ``config.json`` of a named public checkpoint, read from a file),
  both against the layout transformers builds from the same values (its ``layers_block_type`` /
  ``layer_types``, computed by the model's own rule); the hybrid families' layouts also by hand.
  A ``hybrid`` layer is two cache layers with its index: its attention's, then its state's.
- Refusals name the field.
- States: a tiny model of each family runs a few tokens on CPU with a cache; the state tensors
  that cache allocates are compared with the state kind's components, and the cache's layer
  classes with the family's reading of the layers; for the hybrid families also the K/V the
  cache holds, against ``ModelShape.from_config``'s heads and head dim.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from flat_kvcache.config import load_model_config
from flat_kvcache.errors import ModelConfigError
from flat_kvcache.families import (
    STATE_KINDS,
    Family,
    Layer,
    family_of,
    kv_shape,
    read_model_layers,
    state_components,
)
from flat_kvcache.families._base import model_layers
from helpers import JAMBA_V01, need, run_cli

transformers = need("transformers")

FULL, LINEAR = "full_attention", "linear_attention"

#: transformers' labels (5.x and legacy) as cache labels: MLP-only blocks keep no cache, and a
#: ``hybrid`` block (attention and a mamba2 mixer) keeps K/V and a state, its attention's first.
_LABEL: dict[str, tuple[str, ...]] = {
    "linear_attention": (LINEAR,),
    "mamba": (LINEAR,),
    "full_attention": (FULL,),
    "attention": (FULL,),
    "hybrid": (FULL, LINEAR),
    "moe": (),
    "mlp": (),
}


def _expected(blocks: Sequence[str]) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """The cache labels and model layer indices of transformers' per-layer block list."""
    kept = [(i, label) for i, block in enumerate(blocks) for label in _LABEL[block]]
    return tuple(label for _, label in kept), tuple(i for i, _ in kept)


def _write(tmp_path: Path, cfg: Mapping[str, Any]) -> dict[str, Any]:
    """``cfg`` as a Hub ``config.json`` on disk, loaded back through ``load_model_config``."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg), encoding="utf-8")
    return load_model_config(path)


# --- Hub checkpoints (trimmed config.json: the fields the layout and the state read) -------------


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


# tiiuae/Falcon-H1-0.5B-Instruct (its published config.json, trimmed; written from the checkpoint's
# values: 36 layers of attention + mamba2, 8 query / 2 K/V heads of head_dim 64 where
# hidden_size // num_attention_heads would be 128, a mamba2 mixer of mamba_d_ssm = 24 x 64 = 1536
# channels rather than mamba_expand * hidden_size = 2048; no sliding window, attn_layer_indices null)
FALCON_H1_05B = {
    "model_type": "falcon_h1",
    "num_hidden_layers": 36,
    "hidden_size": 1024,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "attn_layer_indices": None,
    "mamba_d_ssm": 1536,
    "mamba_n_heads": 24,
    "mamba_d_head": 64,
    "mamba_n_groups": 1,
    "mamba_d_state": 128,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "max_position_embeddings": 16384,
}

#: The hybrid layers of Zyphra/Zamba2-1.2B: its shared attention block runs before the mamba2
#: mixer of every sixth layer.
ZAMBA2_12B_HYBRID = [6, 12, 18, 24, 30, 36]

# Zyphra/Zamba2-1.2B (its published config.json, trimmed; written from the checkpoint's values:
# 38 layers with the legacy labels "mamba" / "hybrid" and hybrid_layer_ids; the shared attention
# has 32 heads of attention_head_dim = 2 * 2048 / 32 = 128 over attention_hidden_size = 4096, not
# kv_channels = 64; 64 mamba2 heads of mamba_headdim 64 over mamba_expand * hidden_size = 4096)
ZAMBA2_12B = {
    "model_type": "zamba2",
    "num_hidden_layers": 38,
    "layers_block_type": ["hybrid" if i in ZAMBA2_12B_HYBRID else "mamba" for i in range(38)],
    "hybrid_layer_ids": ZAMBA2_12B_HYBRID,
    "hidden_size": 2048,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "attention_hidden_size": 4096,
    "attention_head_dim": 128,
    "kv_channels": 64,
    "num_query_groups": 32,
    "num_mem_blocks": 1,
    "use_shared_attention_adapter": True,
    "adapter_rank": 128,
    "use_mem_rope": False,
    "mamba_d_state": 128,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "mamba_ngroups": 1,
    "n_mamba_heads": 64,
    "mamba_headdim": 64,
    "max_position_embeddings": 4096,
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
    ("falcon_h1", "FalconH1Config", FALCON_H1_05B, _blocks_jamba, "mamba2"),
    ("zamba2", "Zamba2Config", ZAMBA2_12B, _blocks_jamba, "mamba2"),
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
        "falcon_h1-window",
        {**FALCON_H1_05B, "sliding_window": 4096},
        ["sliding_window = 4096", "Falcon-H1", "whole history", "null or missing"],
    ),
    (
        "falcon_h1-default-window",
        {**_refused("falcon_h1", "FalconH1Config"), "sliding_window": 512},
        ["sliding_window = 512", "Falcon-H1"],
    ),
    (
        "falcon_h1-attn-indices",
        {**FALCON_H1_05B, "attn_layer_indices": [1, 2]},
        ["attn_layer_indices = [1, 2]", "every layer"],
    ),
    (
        "falcon_h1-label",
        {**FALCON_H1_05B, "num_hidden_layers": 2, "layers_block_type": ["hybrid", "mamba"]},
        ["layers_block_type[1] = 'mamba'", "supported labels: hybrid"],
    ),
    (
        "falcon_h1-list-count",
        {**FALCON_H1_05B, "layer_types": ["hybrid"] * 35},
        ["layer_types has 35 entries", "num_hidden_layers is 36"],
    ),
    ("falcon_h1-layers", {**FALCON_H1_05B, "num_hidden_layers": None}, ["num_hidden_layers", "missing"]),
    (
        "zamba2-label",
        {**ZAMBA2_12B, "layers_block_type": ["mamba", "attention"] * 19},
        ["layers_block_type[1] = 'attention'", "hybrid, linear_attention, mamba"],
    ),
    (
        "zamba2-hybrid-ids",
        {**ZAMBA2_12B, "hybrid_layer_ids": [6, 12]},
        ["hybrid_layer_ids = [6, 12]", "layers_block_type", "[6, 12, 18, 24, 30, 36]"],
    ),
    (
        "zamba2-missing",
        {**ZAMBA2_12B, "layers_block_type": None},
        ["layers_block_type (or layer_types) is missing", "54-layer default"],
    ),
    (
        "zamba2-count",
        {**ZAMBA2_12B, "num_hidden_layers": 40},
        ["layers_block_type has 38 entries", "num_hidden_layers is 40"],
    ),
    (
        "zamba2-two-lists",
        {**ZAMBA2_12B, "layer_types": ["mamba"] * 38},
        ["layers_block_type", "disagrees with layer_types"],
    ),
    ("zamba2-window", {**ZAMBA2_12B, "sliding_window": 2048}, ["sliding_window = 2048", "Zamba2"]),
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


def test_falcon_h1_and_zamba2_are_read_as_families() -> None:
    for model_type in ("falcon_h1", "zamba2"):
        family = family_of({"model_type": model_type})
        assert family.refused is None
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
    (
        "mamba2-type",
        "mamba2",
        {**FALCON_H1_05B, "model_type": "jamba"},
        ["model_type", "'jamba'", "falcon_h1", "zamba2"],
    ),
    (
        "falcon_h1-d-ssm",
        "mamba2",
        {**FALCON_H1_05B, "mamba_d_head": 32},
        ["mamba_n_heads = 24 times mamba_d_head = 32 is 768", "inner size 1536"],
    ),
    (
        "falcon_h1-auto",
        "mamba2",
        {**FALCON_H1_05B, "mamba_d_head": "auto", "mamba_n_heads": 100},
        ["mamba_n_heads = 100", "mamba_d_ssm = 1536"],
    ),
    (
        "falcon_h1-auto-expand",
        "mamba2",
        {**FALCON_H1_05B, "mamba_d_ssm": None, "mamba_d_head": "auto", "mamba_n_heads": 100},
        ["mamba_n_heads = 100", "mamba_expand * hidden_size = 2048"],
    ),
    ("falcon_h1-groups", "mamba2", {**FALCON_H1_05B, "mamba_n_groups": 5}, ["mamba_n_groups = 5"]),
    (
        "zamba2-heads",
        "mamba2",
        {**ZAMBA2_12B, "mamba_headdim": None, "n_mamba_heads": 100},
        ["n_mamba_heads = 100", "mamba_expand * hidden_size = 4096"],
    ),
    (
        "zamba2-head-dim",
        "mamba2",
        {**ZAMBA2_12B, "mamba_headdim": 32},
        ["n_mamba_heads = 64 times mamba_headdim = 32 is 2048", "inner size 4096"],
    ),
    (
        "zamba2-groups",
        "mamba2",
        {**ZAMBA2_12B, "mamba_ngroups": 3},
        ["mamba_ngroups = 3", "n_mamba_heads = 64"],
    ),
    ("zamba2-missing", "mamba2", {**ZAMBA2_12B, "mamba_d_state": None}, ["mamba_d_state is missing"]),
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
        # FalconH1Mixer: inner size mamba_d_ssm (1536), not mamba_expand * hidden_size (2048).
        "falcon_h1": ("mamba2", FALCON_H1_05B, (1536 + 2 * 1 * 128, 3), (24, 64, 128)),
        "falcon_h1-auto": (
            "mamba2",
            {**FALCON_H1_05B, "mamba_d_head": "auto"},
            (1536 + 2 * 1 * 128, 3),
            (24, 64, 128),
        ),
        "falcon_h1-no-d-ssm": (
            "mamba2",
            {**FALCON_H1_05B, "mamba_d_ssm": None, "mamba_d_head": "auto", "mamba_n_heads": 32},
            (2048 + 2 * 1 * 128, 3),
            (32, 64, 128),
        ),
        # Zamba2MambaMixer: inner size mamba_expand * hidden_size (4096), mamba_headdim 64.
        "zamba2": ("mamba2", ZAMBA2_12B, (4096 + 2 * 1 * 128, 3), (64, 64, 128)),
        "zamba2-no-head-dim": (
            "mamba2",
            {**ZAMBA2_12B, "mamba_headdim": None},
            (4096 + 2 * 1 * 128, 3),
            (64, 64, 128),
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
    # mamba_d_ssm 48 (4 heads of 12) is not mamba_expand * hidden_size = 64, and head_dim 16 is not
    # hidden_size // num_attention_heads = 8: the readers must take the fields the model takes.
    "falcon_h1": (
        "FalconH1Config",
        {
            **_SMALL_ATTENTION,
            "head_dim": 16,
            "num_hidden_layers": 2,
            "intermediate_size": 16,
            **_SMALL_MAMBA2,
            "mamba_d_ssm": 48,
            "mamba_d_head": 12,
            "mamba_chunk_size": 4,
        },
        "FalconH1ForCausalLM",
    ),
    # No head_dim: hidden_size // num_attention_heads; mamba_d_head "auto": mamba_d_ssm // heads.
    "falcon_h1-derived": (
        "FalconH1Config",
        {
            **_SMALL_ATTENTION,
            "num_hidden_layers": 3,
            "intermediate_size": 16,
            **_SMALL_MAMBA2,
            "mamba_d_ssm": 48,
            "mamba_d_head": "auto",
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
@pytest.mark.parametrize("name", ["zamba2", "falcon_h1", "falcon_h1-derived"])
def test_a_hybrid_layer_is_its_attention_then_its_state_as_the_models_own_cache_holds_them(
    name: str,
) -> None:
    """The model's own cache keeps a hybrid layer's K/V and mamba2 state in one cache layer (a
    LinearAttentionAndFullAttentionLayer); the reading is two cache layers with its index, the
    attention's first, whose K/V heads / head dim and state shapes are those the cache holds."""
    torch = need("torch")
    cache_utils = need("transformers.cache_utils")
    shape_module = need("flat_kvcache.torch")
    config, layers = _run_tiny(name)
    cfg = load_model_config(config.to_dict())
    read = read_model_layers(cfg)
    assert read.num_model_layers == len(layers)
    assert read.state_kind == "mamba2"
    shape = shape_module.ModelShape.from_config(cfg, kv_dtype=torch.bfloat16)
    assert shape.model_layers == read.model_layers
    components = {c.name: c for c in state_components("mamba2", cfg)}
    hybrid = 0
    for i, layer in enumerate(layers):
        found = shape.cache_layers(i)
        labels = tuple(read.layer_types[j] for j in found)
        conv, ssm = layer.conv_states[0], layer.recurrent_states[0]
        channels, kernel = conv.shape[1:]
        assert components["conv"].shape == (channels, kernel - 1)  # layout: kernel - 1 columns
        assert conv.dtype == torch.bfloat16 and components["conv"].dtype == "model"
        assert components["ssm"].shape == tuple(ssm.shape[1:])
        assert components["ssm"].dtype == str(ssm.dtype).removeprefix("torch.")
        if type(layer) is cache_utils.LinearAttentionAndFullAttentionLayer:
            hybrid += 1
            assert labels == (FULL, LINEAR), i
            assert (shape.cache_layer(i, "attention"), shape.cache_layer(i, "state")) == found
            # K/V as the cache holds them: [batch, K/V heads, tokens, head dim], 6 tokens so far.
            assert tuple(layer.keys.shape) == (1, shape.num_kv_heads, 6, shape.head_dim), i
            assert tuple(layer.values.shape) == tuple(layer.keys.shape)
        else:
            assert type(layer) is cache_utils.LinearAttentionLayer, i
            assert labels == (LINEAR,), i
    assert hybrid == sum(1 for label in read.layer_types if label == FULL) > 0


def test_the_hybrid_layouts_by_hand() -> None:
    """The layouts spelled out from what the configs mean: a Falcon-H1 layer is attention +
    mamba2, every one of them; a Zamba2 layer is attention + mamba2 where its block is hybrid."""
    falcon = read_model_layers(load_model_config(FALCON_H1_05B))
    assert falcon.layer_types == (FULL, LINEAR) * 36
    assert falcon.model_layers == tuple(i for layer in range(36) for i in (layer, layer))
    assert (falcon.num_model_layers, falcon.sliding_window, falcon.state_kind) == (36, None, "mamba2")
    falcon_default = read_model_layers(load_model_config(transformers.FalconH1Config().to_dict()))
    assert falcon_default.layer_types == (FULL, LINEAR) * 32  # FalconH1Config: 32 layers
    assert falcon_default.model_layers == tuple(i // 2 for i in range(64))

    zamba = read_model_layers(load_model_config(ZAMBA2_12B))
    labels: list[str] = []
    indices: list[int] = []
    for layer in range(38):
        kept = [FULL, LINEAR] if layer in (6, 12, 18, 24, 30, 36) else [LINEAR]
        labels += kept
        indices += [layer] * len(kept)
    assert zamba.layer_types == tuple(labels)
    assert zamba.model_layers == tuple(indices)
    assert (zamba.num_model_layers, len(zamba.layer_types), zamba.state_kind) == (38, 44, "mamba2")
    # Zamba2Config's default (Zamba2-2.7B): 54 layers, hybrid at 6, 12, ..., 42, then 47 and 51.
    zamba_default = read_model_layers(load_model_config(transformers.Zamba2Config().to_dict()))
    attention_at = [
        i for i, t in zip(zamba_default.model_layers, zamba_default.layer_types, strict=True) if t == FULL
    ]
    assert attention_at == [6, 12, 18, 24, 30, 36, 42, 47, 51]
    assert (zamba_default.num_model_layers, len(zamba_default.layer_types)) == (54, 63)


def test_the_layer_list_may_come_under_either_key() -> None:
    """Zamba2Config writes ``layers_block_type`` (its ``layer_types`` is an alias, never
    written); FalconH1Config writes neither (a read-only ``layers_block_type`` property). Either
    key, or both when they agree, reads the same; legacy and transformers 5 labels alike."""
    written = transformers.Zamba2Config(
        **{k: v for k, v in ZAMBA2_12B.items() if k != "model_type"}
    ).to_dict()
    assert "layer_types" not in written
    assert written["layers_block_type"][:7] == ["linear_attention"] * 6 + ["hybrid"]
    hub = read_model_layers(load_model_config(ZAMBA2_12B))
    blocks = written["layers_block_type"]
    for listed in (
        {"layers_block_type": blocks},
        {"layers_block_type": None, "layer_types": blocks},
        {"layers_block_type": blocks, "layer_types": ZAMBA2_12B["layers_block_type"]},
    ):
        assert read_model_layers(load_model_config({**written, **listed})) == hub
    falcon = transformers.FalconH1Config(
        **{k: v for k, v in FALCON_H1_05B.items() if k != "model_type"}
    ).to_dict()
    assert "layer_types" not in falcon and "layers_block_type" not in falcon
    expected = read_model_layers(load_model_config(FALCON_H1_05B))
    assert read_model_layers(load_model_config(falcon)) == expected
    assert read_model_layers(load_model_config({**falcon, "layers_block_type": ["hybrid"] * 36})) == expected


def test_the_hybrid_families_attention_shapes() -> None:
    """Falcon-H1 keeps the Hugging Face conventions (its ``head_dim``, here not ``hidden_size //
    num_attention_heads``); Zamba2's shared attention reads its own fields."""
    assert kv_shape(load_model_config(FALCON_H1_05B)) is None
    assert kv_shape(load_model_config(ZAMBA2_12B)) == (32, 128)
    # Missing: 2 * hidden_size // num_attention_heads, not kv_channels; K/V heads default to the heads.
    derived = {**ZAMBA2_12B, "attention_head_dim": None, "num_key_value_heads": None}
    assert kv_shape(load_model_config(derived)) == (32, 128)
    assert kv_shape(load_model_config({**derived, "head_dim": 96})) == (32, 96)  # the alias


@pytest.mark.parametrize(
    ("edit", "fields"),
    [
        ({"head_dim": 64}, ["head_dim = 64", "attention_head_dim = 128"]),
        ({"num_key_value_heads": 5}, ["num_key_value_heads = 5", "num_attention_heads = 32"]),
        ({"attention_head_dim": 0}, ["attention_head_dim = 0"]),
        (
            {"attention_head_dim": None, "hidden_size": 8, "num_key_value_heads": 16},
            ["num_attention_heads = 32", "head dim of 0"],
        ),
    ],
)
def test_a_zamba2_attention_shape_that_cannot_be_read_right_is_refused(
    edit: dict[str, Any], fields: Sequence[str]
) -> None:
    with pytest.raises(ModelConfigError) as info:
        kv_shape(load_model_config({**ZAMBA2_12B, **edit}))
    for field in fields:
        assert field in str(info.value)


def test_a_layer_that_holds_both_is_its_attention_then_its_state() -> None:
    """``model_layers`` on a family of every layer kind: a sliding + state layer's attention
    cache layer carries its window, its state cache layer none."""
    family = Family("toy", ("toy",), lambda cfg: [], "", state="mamba2")
    kinds = [
        Layer("full+state"),
        Layer("none"),
        Layer("sliding+state", 64),
        Layer("state"),
        Layer("sliding", 32),
        Layer("full"),
    ]
    read = model_layers(family, "toy", kinds)
    assert read.layer_types == (FULL, LINEAR, "sliding_attention", LINEAR, LINEAR, "sliding_attention", FULL)
    assert read.model_layers == (0, 0, 2, 2, 3, 4, 5)
    assert read.sliding_window == (None, None, 64, None, None, 32, None)
    assert (read.state_kind, read.num_model_layers) == ("mamba2", 6)
    one_window = model_layers(family, "toy", [Layer("sliding+state", 64), Layer("sliding", 64)])
    assert one_window.sliding_window == 64
    assert one_window.layer_types == ("sliding_attention", LINEAR, "sliding_attention")


# --- plan --config, with and without --memory --------------------------------------------------


@pytest.mark.parametrize(
    ("hub", "class_name", "counts"),
    [
        (FALCON_H1_05B, "FalconH1Config", {FULL: 36, LINEAR: 36}),
        (ZAMBA2_12B, "Zamba2Config", {LINEAR: 38, FULL: 6}),
    ],
    ids=["falcon_h1", "zamba2"],
)
@pytest.mark.parametrize("form", ["hub", "transformers"])
def test_plan_config_reads_the_hybrid_families(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    hub: dict[str, Any],
    class_name: str,
    counts: dict[str, int],
    form: str,
) -> None:
    cfg = hub if form == "hub" else _config_of(class_name, hub).to_dict()
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**cfg, "torch_dtype": "bfloat16"}), encoding="utf-8")
    status, out, err = run_cli(capsys, "plan", "--json", "--config", str(path))
    assert (status, err) == (0, "")
    plan = json.loads(out)
    assert plan["model"]["num_layers"] == hub["num_hidden_layers"]
    assert plan["model"]["num_cache_layers"] == sum(counts.values())
    assert plan["model"]["layer_types"] == counts
    assert plan["model"]["state_kind"] == "mamba2"
    assert {g["group_id"]: (g["family"], g["num_layers"]) for g in plan["groups"]} == {
        FULL: ("history", counts[FULL]),
        LINEAR: ("state", counts[LINEAR]),
    }
    status, out, err = run_cli(capsys, "plan", "--config", str(path))
    assert (status, err) == (0, "")
    assert "a layer holding both K/V and a state is two" in out.splitlines()[0]


@pytest.mark.torch
@pytest.mark.parametrize(
    ("hub", "class_name"),
    [(FALCON_H1_05B, "FalconH1Config"), (ZAMBA2_12B, "Zamba2Config")],
    ids=["falcon_h1", "zamba2"],
)
@pytest.mark.parametrize("form", ["hub", "transformers"])
def test_plan_memory_sizes_both_cache_layers_of_a_hybrid_layer(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, hub: dict[str, Any], class_name: str, form: str
) -> None:
    """``--memory 8GiB --storage equalized``: a page holds K and V (bf16) of every attention cache
    layer, by the family's heads and head dim (Falcon-H1-0.5B: 2 x 64; Zamba2-1.2B: 32 x 128), and the mamba2
    state (conv in bf16, ssm in fp32) of every state cache layer: both halves of each hybrid
    layer."""
    need("torch")
    cfg = hub if form == "hub" else _config_of(class_name, hub).to_dict()
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**cfg, "torch_dtype": "bfloat16"}), encoding="utf-8")
    # The SPEC 3 plan (equal pages), asked for: a state model's default is the arena.
    argv = ["plan", "--json", "--config", str(path), "--memory", "8GiB", "--max-live-requests", "16"]
    argv += ["--storage", "equalized"]
    status, out, err = run_cli(capsys, *argv)
    assert (status, err) == (0, "")
    plan = json.loads(out)
    read = read_model_layers(load_model_config(hub))
    attention = read.layer_types.count(FULL)
    heads, head_dim = (2, 64) if hub is FALCON_H1_05B else (32, 128)
    page = plan["memory"]["page_size"]
    # One page: K and V of every attention layer (bf16), and one mamba2 state per state layer.
    conv, ssm = (c.shape for c in state_components("mamba2", load_model_config(hub)))
    state_bytes = conv[0] * conv[1] * 2 + ssm[0] * ssm[1] * ssm[2] * 4
    assert plan["memory"]["bytes_per_page"] == (
        attention * page * 2 * heads * head_dim * 2 + read.layer_types.count(LINEAR) * state_bytes
    )
    assert plan["memory"]["num_pages"] > 1
    assert plan["memory"]["arena"] is not None
    status, out, err = run_cli(capsys, *[a for a in argv if a != "--json"])
    assert (status, err) == (0, "")
    assert "memory:" in out and "arena" in out
