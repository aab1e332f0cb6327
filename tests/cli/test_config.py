"""Model configs (flat_kvcache.config) and the presets they can name (flat_kvcache.presets)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import flat_kvcache
import pytest
from flat_kvcache.config import (
    DEFAULT_MAX_CONTEXT_LEN,
    layer_types_from_config,
    load_model_config,
    max_context_len_from_config,
    sliding_window_from_config,
)
from flat_kvcache.errors import ModelConfigError
from flat_kvcache.presets import DEFAULT_PRESET, PRESETS, get_preset, preset_names

FULL, SLIDING, LINEAR = "full_attention", "sliding_attention", "linear_attention"
REQUIRED_KEYS = {
    "model_type",
    "num_hidden_layers",
    "layer_types",
    "num_key_value_heads",
    "head_dim",
    "torch_dtype",
    "max_position_embeddings",
    "sliding_window",
}


# --- presets ---------------------------------------------------------------------------------------


def test_preset_names_default_first() -> None:
    assert DEFAULT_PRESET == "gpt-oss-like"
    assert preset_names()[0] == DEFAULT_PRESET
    assert set(preset_names()) == set(PRESETS) >= {"gpt-oss-like", "qwen3.5-like", "llama3-8b-like"}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_has_the_shape_keys(name: str) -> None:
    cfg = get_preset(name)
    assert set(cfg) >= REQUIRED_KEYS
    assert len(cfg["layer_types"]) == cfg["num_hidden_layers"]
    assert cfg["torch_dtype"] == "bfloat16"
    # and the sizing API accepts it
    flat_kvcache.group_specs_from_layer_types(cfg["layer_types"], cfg["sliding_window"], page_size=16)


def test_gpt_oss_like() -> None:
    cfg = get_preset("gpt-oss-like")
    assert cfg["layer_types"] == [SLIDING, FULL] * 12
    assert (cfg["sliding_window"], cfg["num_key_value_heads"], cfg["head_dim"]) == (128, 8, 64)
    assert cfg["max_position_embeddings"] == 131072


def test_qwen3_5_like() -> None:
    cfg = get_preset("qwen3.5-like")
    assert cfg["layer_types"] == [LINEAR, LINEAR, LINEAR, FULL] * 12
    assert (cfg["num_key_value_heads"], cfg["head_dim"], cfg["max_position_embeddings"]) == (2, 256, 262144)
    assert cfg["sliding_window"] is None
    linear = {key: cfg[key] for key in cfg if key.startswith("linear_")}
    assert linear == {
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_value_head_dim": 128,
        "linear_num_value_heads": 32,
    }
    assert cfg["mamba_ssm_dtype"] == "float32"
    # its full_attention_interval derives the same layer types
    derived = layer_types_from_config(
        {
            "model_type": cfg["model_type"],
            "num_hidden_layers": 48,
            "full_attention_interval": cfg["full_attention_interval"],
        }
    )
    assert derived == cfg["layer_types"]


def test_llama3_8b_like() -> None:
    cfg = get_preset("llama3-8b-like")
    assert cfg["layer_types"] == [FULL] * 32
    assert (cfg["num_key_value_heads"], cfg["head_dim"], cfg["sliding_window"]) == (8, 128, None)


def test_multi_window_demo_has_two_windows() -> None:
    cfg = get_preset("multi-window-demo")
    ids = flat_kvcache.layer_group_ids(cfg["layer_types"], cfg["sliding_window"])
    assert {gid for gid in ids if gid.startswith(SLIDING)} == {
        "sliding_attention_512",
        "sliding_attention_4096",
    }


def test_presets_are_handed_out_as_copies() -> None:
    cfg = get_preset(DEFAULT_PRESET)
    cfg["layer_types"].append("junk")
    cfg["num_hidden_layers"] = 0
    assert get_preset(DEFAULT_PRESET)["num_hidden_layers"] == 24
    assert len(load_model_config(DEFAULT_PRESET)["layer_types"]) == 24
    with pytest.raises(TypeError):
        PRESETS["new"] = {}  # type: ignore[index]
    with pytest.raises(KeyError, match="known presets: gpt-oss-like"):
        get_preset("nope")


# --- load_model_config -----------------------------------------------------------------------------


def test_load_from_a_mapping_copies_it() -> None:
    source = {"num_hidden_layers": 2}
    cfg = load_model_config(source)
    assert cfg == source and cfg is not source


def test_load_from_paths(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 3}), encoding="utf-8")
    for source in (tmp_path / "config.json", str(tmp_path / "config.json"), tmp_path, str(tmp_path)):
        assert load_model_config(source) == {"num_hidden_layers": 3}


def test_load_merges_a_nested_text_config() -> None:
    cfg = load_model_config(
        {"model_type": "vl", "text_config": {"num_hidden_layers": 2, "model_type": "text"}}
    )
    assert cfg["num_hidden_layers"] == 2
    assert cfg["model_type"] == "text"


@pytest.mark.parametrize(
    ("source", "error", "needle"),
    [
        ("nope", ValueError, "unknown preset 'nope' (and no such file); known presets: gpt-oss-like"),
        ("missing.json", FileNotFoundError, "config file not found: missing.json"),
        ("some/dir/config.json", FileNotFoundError, "config file not found"),
        (5, TypeError, "model config must be a preset name, a path or a mapping, not int"),
    ],
)
def test_load_errors(source: Any, error: type[Exception], needle: str) -> None:
    with pytest.raises(error) as info:
        load_model_config(source)
    assert needle in str(info.value)


@pytest.mark.parametrize(
    ("text", "needle"),
    [("{", "invalid JSON"), ("[]", "expected a JSON object, got list"), ("\xff", "invalid JSON")],
)
def test_load_bad_files(tmp_path: Path, text: str, needle: str) -> None:
    path = tmp_path / "config.json"
    path.write_bytes(text.encode("latin-1"))
    with pytest.raises(ValueError, match=needle):
        load_model_config(path)


# --- reading the sizing inputs -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cfg", "expected"),
    [
        # an explicit layer_types of attention labels reads the same under any model_type
        ({"layer_types": [SLIDING, FULL], "num_hidden_layers": 2, "sliding_window": 8}, [SLIDING, FULL]),
        ({"model_type": "toy", "layer_types": [FULL, FULL]}, [FULL, FULL]),
        # a GDN family's Hub form: every full_attention_interval-th layer is full attention
        (
            {"model_type": "qwen3_next", "num_hidden_layers": 8, "full_attention_interval": 4},
            [LINEAR] * 3 + [FULL] + [LINEAR] * 3 + [FULL],
        ),
        (
            {"model_type": "qwen3_next", "num_hidden_layers": 5, "full_attention_interval": 2},
            [LINEAR, FULL, LINEAR, FULL, LINEAR],
        ),
        ({"model_type": "qwen3_next", "num_hidden_layers": 2, "full_attention_interval": 1}, [FULL, FULL]),
        ({"model_type": "llama", "num_hidden_layers": 3}, [FULL] * 3),
        ({"model_type": "llama", "num_hidden_layers": 3, "layer_types": None}, [FULL] * 3),
    ],
)
def test_layer_types_from_config(cfg: dict[str, Any], expected: list[str]) -> None:
    assert layer_types_from_config(cfg) == expected


@pytest.mark.parametrize(
    ("cfg", "needle"),
    [
        # no family and no layer_types: which layers keep what is unknown, never "all full"
        ({}, "config model_type is missing and the config has no layer_types"),
        ({"num_hidden_layers": 3}, "config model_type is missing and the config has no layer_types"),
        ({"model_type": "toy", "num_hidden_layers": 3}, "config model_type is 'toy' and the config has no"),
        ({"layer_types": "full_attention"}, "config layer_types = 'full_attention': a list of layer labels"),
        ({"layer_types": [FULL, 3]}, "config layer_types[1] = 3: supported labels: full_attention, sliding"),
        # a state label needs the family that says which state it is
        ({"model_type": "toy", "layer_types": [FULL, LINEAR]}, "config layer_types[1] = 'linear_attention'"),
        (
            {"layer_types": [FULL], "num_hidden_layers": 2},
            "config layer_types has 1 entries but num_hidden_layers is 2",
        ),
        ({"model_type": "llama", "num_hidden_layers": -1}, "config num_hidden_layers = -1: an int >= 1"),
        ({"model_type": "llama", "num_hidden_layers": 0}, "config num_hidden_layers = 0: an int >= 1"),
        ({"model_type": "llama", "num_hidden_layers": "4"}, "config num_hidden_layers = '4': an int >= 1"),
        ({"model_type": "llama", "num_hidden_layers": True}, "config num_hidden_layers = True: an int >= 1"),
        (
            {"model_type": "qwen3_next", "num_hidden_layers": 4, "full_attention_interval": 0},
            "config full_attention_interval = 0: an int >= 1",
        ),
    ],
)
def test_layer_types_from_config_errors(cfg: dict[str, Any], needle: str) -> None:
    with pytest.raises(ModelConfigError) as info:
        layer_types_from_config(cfg)
    assert str(info.value).startswith(needle), str(info.value)
    assert isinstance(info.value, ValueError)  # config errors were ValueErrors before the class


def test_sliding_window_from_config() -> None:
    def window(value: object) -> object:
        return sliding_window_from_config({"layer_types": [SLIDING, FULL], "sliding_window": value})

    assert sliding_window_from_config({"layer_types": [FULL]}) is None
    assert window(4096) == 4096
    assert window([8, None]) == 8  # one window for every sliding layer collapses to an int
    assert sliding_window_from_config(
        {"layer_types": [SLIDING, SLIDING, FULL], "sliding_window": [8, 16, None]}
    ) == [8, 16, None]
    for bad in (None, True, "4096", 1.5, ["x", 8], [False, 8], 0):
        with pytest.raises(ModelConfigError, match="config sliding_window"):
            window(bad)


def test_max_context_len_from_config() -> None:
    assert DEFAULT_MAX_CONTEXT_LEN == 131072
    assert max_context_len_from_config({}) == 131072
    assert max_context_len_from_config({"max_position_embeddings": None}) == 131072
    assert max_context_len_from_config({"max_position_embeddings": 4096}) == 4096
    with pytest.raises(ValueError, match="config max_position_embeddings must be >= 0, got -1"):
        max_context_len_from_config({"max_position_embeddings": -1})
