"""ModelShape: construction, validation, the config.json / preset loaders and their errors."""

from __future__ import annotations

import json
import pkgutil
from pathlib import Path
from typing import Any

import pytest
from helpers import missing, run_python

try:
    import torch
except ImportError as exc:
    missing("torch", exc)

import flat_kvcache
from flat_kvcache import reference as ref
from flat_kvcache.presets import PRESETS, get_preset
from flat_kvcache.torch import ModelShape

pytestmark = pytest.mark.torch

ALTERNATING = ("sliding_attention", "full_attention") * 3


def shape(**overrides: Any) -> ModelShape:
    fields: dict[str, Any] = {
        "layer_types": ALTERNATING,
        "sliding_window": 128,
        "num_kv_heads": 4,
        "head_dim": 64,
        "kv_dtype": torch.bfloat16,
    }
    fields.update(overrides)
    return ModelShape(**fields)


# -- import hygiene ---------------------------------------------------------------------------


def test_import_without_torch_names_the_extra() -> None:
    result = run_python("-c", "import sys; sys.modules['torch'] = None; import flat_kvcache.torch")
    assert result.returncode != 0
    assert "ImportError" in result.stderr
    assert "'.[torch]'" in result.stderr


def test_no_other_module_imports_torch() -> None:
    modules = [
        info.name
        for info in pkgutil.walk_packages(flat_kvcache.__path__, "flat_kvcache.")
        if not info.name.endswith("__main__")
        and info.name != "flat_kvcache.torch"
        and not info.name.startswith("flat_kvcache.torch.")
        # The vLLM drop-in's modules import vLLM (and so torch); its package imports neither.
        and not info.name.startswith("flat_kvcache.vllm.")
    ]
    assert "flat_kvcache.sizing" in modules and "flat_kvcache.torch.shape" not in modules
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    result = run_python("-c", code)
    assert result.returncode == 0, result.stderr


# -- construction -----------------------------------------------------------------------------


def test_fields_are_normalised() -> None:
    made = shape(layer_types=list(ALTERNATING), sliding_window=[128, None] * 3, kv_dtype="bf16")
    assert made.layer_types == ALTERNATING
    assert made.sliding_window == (128, None) * 3
    assert made.kv_dtype is torch.bfloat16
    assert made.num_layers == 6
    assert made.kv_bytes_per_slot == 2 * 4 * 64 * 2
    assert made.state_shapes is None and made.state_component_bytes is None
    assert shape(kv_dtype="torch.bfloat16") == shape()
    assert hash(shape()) == hash(shape())


@pytest.mark.parametrize(
    ("name", "dtype"),
    [
        ("bfloat16", torch.bfloat16),
        ("float16", torch.float16),
        ("fp32", torch.float32),
        ("fp8", torch.float8_e4m3fn),
        ("fp8_e5m2", torch.float8_e5m2),
        (torch.float8_e4m3fn, torch.float8_e4m3fn),
    ],
)
def test_kv_dtypes_and_fp8_storage(name: object, dtype: torch.dtype) -> None:
    made = shape(kv_dtype=name)
    assert made.kv_dtype is dtype
    assert made.kv_storage_dtype is (torch.uint8 if dtype.itemsize == 1 else dtype)
    assert made.kv_bytes_per_slot == 2 * 4 * 64 * dtype.itemsize


@pytest.mark.parametrize(
    ("overrides", "error", "match"),
    [
        ({"layer_types": ()}, ValueError, "layer_types is empty"),
        ({"layer_types": "full_attention"}, TypeError, "not a str"),
        ({"layer_types": ("full_attention", "mlp")}, ValueError, "unknown layer_type 'mlp' at layer 1"),
        ({"sliding_window": None}, ValueError, "layer 0 .* needs a positive sliding window"),
        ({"sliding_window": [128, 64]}, ValueError, "2 entries but layer_types has 6"),
        ({"num_kv_heads": 0}, ValueError, "num_kv_heads must be >= 1"),
        ({"num_kv_heads": True}, TypeError, "num_kv_heads must be an int"),
        ({"head_dim": 64.0}, TypeError, "head_dim must be an int"),
        ({"kv_dtype": torch.int8}, ValueError, "kv_dtype must be a floating dtype"),
        ({"kv_dtype": "float99"}, ValueError, "kv_dtype: unknown dtype 'float99'"),
        ({"kv_dtype": 2}, TypeError, "kv_dtype must be a torch.dtype"),
        (
            {"state_shapes": {"conv": (4, 3)}, "state_dtypes": {"conv": torch.float32}},
            ValueError,
            "no linear",
        ),
    ],
)
def test_invalid_fields(overrides: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        shape(**overrides)


STATE_LAYERS = ("linear_attention", "linear_attention", "full_attention")


@pytest.mark.parametrize(
    ("shapes", "dtypes", "error", "match"),
    [
        (None, None, ValueError, "state_shapes and state_dtypes are required"),
        ({"conv": (8, 3)}, {"ssm": torch.float32}, ValueError, r"components \['conv'\] but state_dtypes"),
        ({"conv": (8, -1)}, {"conv": torch.float32}, ValueError, r"state_shapes\['conv'\]\[1\] must be >= 0"),
        ({"conv": "83"}, {"conv": torch.float32}, TypeError, "must be a sequence of ints"),
        ({"conv": (8, 3)}, {"conv": "int32"}, ValueError, "must be a floating dtype"),
        ({"conv": (8, 3)}, None, TypeError, "must both be mappings"),
    ],
)
def test_invalid_state(shapes: Any, dtypes: Any, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        shape(layer_types=STATE_LAYERS, sliding_window=None, state_shapes=shapes, state_dtypes=dtypes)


def test_state_fields_are_read_only_and_sized_natively() -> None:
    made = shape(
        layer_types=STATE_LAYERS,
        sliding_window=None,
        state_shapes={"conv": [8, 3], "ssm": (2, 4, 4)},
        state_dtypes={"conv": "bfloat16", "ssm": torch.float32},
    )
    assert made.state_shapes == {"conv": (8, 3), "ssm": (2, 4, 4)}
    assert made.state_component_bytes == {"conv": 8 * 3 * 2, "ssm": 2 * 4 * 4 * 4}
    with pytest.raises(TypeError):
        made.state_shapes["conv"] = (1,)  # type: ignore[index]
    assert made.components() == ref.components_from_layers(
        STATE_LAYERS,
        kv_bytes_per_slot=made.kv_bytes_per_slot,
        state_component_bytes=made.state_component_bytes,
    )


# -- model layers: MLP-only layers keep none, a layer that holds both keeps two --------------------

STATE = {"state_shapes": {"conv": (8, 3), "ssm": (2, 4, 4)}, "state_dtypes": {"conv": "bf16", "ssm": "fp32"}}

#: Model layers 0 and 3 hold attention + a state, 1 a state, 2 nothing (MLP), 4 attention.
BOTH = ("full_attention", "linear_attention", "linear_attention", "full_attention", "linear_attention")
BOTH_MODEL_LAYERS = (0, 0, 1, 3, 3)


def both_shape(**overrides: Any) -> ModelShape:
    fields: dict[str, Any] = {"layer_types": BOTH, "sliding_window": None, "model_layers": BOTH_MODEL_LAYERS}
    return shape(**{**fields, **STATE, **overrides})


def test_a_model_layer_that_holds_both_is_two_cache_layers() -> None:
    made = both_shape()
    assert made.model_layers == BOTH_MODEL_LAYERS
    assert [made.cache_layers(i) for i in range(5)] == [(0, 1), (2,), (), (3, 4), ()]
    assert (made.cache_layer(0, "attention"), made.cache_layer(0, "state")) == (0, 1)
    assert (made.cache_layer(3, kind="attention"), made.cache_layer(3, kind="state")) == (3, 4)
    # A model layer of one cache layer: that one, asked for by its kind or by none.
    assert made.cache_layer(1) == made.cache_layer(1, "state") == 2
    # Without model_layers, cache layer i is model layer i.
    plain = shape()
    assert plain.cache_layer(5) == plain.cache_layer(5, "attention") == 5
    assert plain.cache_layers(6) == ()


@pytest.mark.parametrize(
    ("model_layer", "kind", "match"),
    [
        (
            0,
            None,
            r"model layer 0 holds both attention K/V \(cache layer 0\) and a state \(cache layer 1\): "
            r"pass kind='attention' or kind='state'",
        ),
        (1, "attention", r"model layer 1 keeps no attention K/V .*cache layer \(2, linear_attention\)"),
        (2, None, "model layer 2 keeps no KV cache or state"),
        (2, "state", "model layer 2 keeps no KV cache or state"),
        (7, "attention", "model layer 7 keeps no KV cache or state"),
        (0, "kv", "kind must be 'attention', 'state' or None, got 'kv'"),
    ],
)
def test_cache_layer_never_picks_one_of_two(model_layer: int, kind: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        both_shape().cache_layer(model_layer, kind)


@pytest.mark.parametrize(
    ("layer_types", "model_layers", "match"),
    [
        # The state first, then the attention: not the order of a layer that holds both.
        (
            ("linear_attention", "full_attention"),
            (0, 0),
            r"model_layers\[0\] = 0 \(linear_attention\) and model_layers\[1\] = 0 \(full_attention\)",
        ),
        (("full_attention", "full_attention"), (2, 2), r"model_layers\[0\] = 2 \(full_attention\)"),
        (("linear_attention", "linear_attention"), (2, 2), "an index repeated only by a model layer"),
        (
            ("full_attention", "linear_attention", "linear_attention"),
            (1, 1, 1),
            r"model_layers\[1\] = 1 \(linear_attention\) and model_layers\[2\] = 1",
        ),
        (("full_attention", "linear_attention"), (3, 1), "must be increasing"),
        (("full_attention", "linear_attention"), (0,), "model_layers has 1 entries but layer_types has 2"),
    ],
)
def test_model_layers_repeat_only_as_attention_then_state(
    layer_types: tuple[str, ...], model_layers: tuple[int, ...], match: str
) -> None:
    state = STATE if "linear_attention" in layer_types else {"state_shapes": None, "state_dtypes": None}
    with pytest.raises(ValueError, match=match):
        both_shape(layer_types=layer_types, model_layers=model_layers, **state)


# -- loaders ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_loads(name: str) -> None:
    cfg = get_preset(name)
    made = ModelShape.preset(name)
    assert made == ModelShape.from_config(cfg) == ModelShape.from_config(name)
    assert len(made.layer_types) == cfg["num_hidden_layers"]
    assert made.num_kv_heads == cfg["num_key_value_heads"]
    assert made.head_dim == cfg["head_dim"]
    assert made.kv_dtype is getattr(torch, cfg["torch_dtype"])


def test_unknown_preset() -> None:
    with pytest.raises(ValueError, match="unknown preset 'nope'; known presets: gpt-oss-like"):
        ModelShape.preset("nope")


def test_qwen35_gdn_state_shapes() -> None:
    made = ModelShape.preset("qwen3.5-like")
    conv_dim = 2 * 16 * 128 + 32 * 128
    assert dict(made.state_shapes or {}) == {"conv": (conv_dim, 3), "ssm": (32, 128, 128)}
    assert list(made.state_shapes or {}) == ["conv", "ssm"]
    assert dict(made.state_dtypes or {}) == {"conv": torch.bfloat16, "ssm": torch.float32}


def test_gdn_ssm_dtype_defaults_to_float32_and_conv_follows_the_model() -> None:
    cfg = get_preset("qwen3.5-like")
    del cfg["mamba_ssm_dtype"]
    cfg["torch_dtype"] = "float16"
    made = ModelShape.from_config(cfg, kv_dtype="fp8_e4m3")
    assert made.state_dtypes == {"conv": torch.float16, "ssm": torch.float32}
    assert made.kv_dtype is torch.float8_e4m3fn


def test_from_config_file_and_folder(tmp_path: Path) -> None:
    cfg = get_preset("gpt-oss-like")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    assert (
        ModelShape.from_config(path)
        == ModelShape.from_config(str(tmp_path))
        == ModelShape.preset("gpt-oss-like")
    )


def test_from_config_hf_defaults() -> None:
    cfg = {
        "model_type": "llama",
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "hidden_size": 512,
        "torch_dtype": "float16",
    }
    made = ModelShape.from_config(cfg)
    assert (made.num_kv_heads, made.head_dim, made.kv_dtype) == (8, 64, torch.float16)
    assert made.layer_types == ("full_attention",) * 2
    assert (
        ModelShape.from_config({**cfg, "torch_dtype": None, "dtype": "bfloat16"}).kv_dtype is torch.bfloat16
    )
    # kv_dtype stands in for a missing model dtype when no state needs it.
    assert (
        ModelShape.from_config({**cfg, "torch_dtype": None}, kv_dtype="fp8").kv_dtype is torch.float8_e4m3fn
    )


#: Small hybrid configs, as transformers writes them (the fields ModelShape reads).
FALCON_H1 = {
    "model_type": "falcon_h1",
    "num_hidden_layers": 2,
    "hidden_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "mamba_d_ssm": 48,
    "mamba_n_heads": 4,
    "mamba_d_head": 12,
    "mamba_n_groups": 2,
    "mamba_d_state": 8,
    "mamba_d_conv": 3,
    "mamba_expand": 2,
    "torch_dtype": "bfloat16",
}
ZAMBA2 = {
    "model_type": "zamba2",
    "num_hidden_layers": 3,
    "layers_block_type": ["linear_attention", "hybrid", "linear_attention"],
    "hidden_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "mamba_d_state": 8,
    "mamba_d_conv": 3,
    "mamba_expand": 2,
    "mamba_ngroups": 2,
    "n_mamba_heads": 4,
    "torch_dtype": "bfloat16",
}


def test_from_config_of_the_families_whose_layers_hold_both() -> None:
    falcon = ModelShape.from_config(FALCON_H1)
    assert falcon.layer_types == ("full_attention", "linear_attention") * 2
    assert falcon.model_layers == (0, 0, 1, 1)
    # Hugging Face conventions: head_dim defaults to hidden_size // num_attention_heads.
    assert (falcon.num_kv_heads, falcon.head_dim) == (2, 8)
    assert ModelShape.from_config({**FALCON_H1, "head_dim": 16}).head_dim == 16
    # mamba2 over mamba_d_ssm = 48 channels: conv over 48 + 2 * 2 * 8, ssm of 4 heads of 12.
    assert dict(falcon.state_shapes or {}) == {"conv": (80, 2), "ssm": (4, 12, 8)}
    assert dict(falcon.state_dtypes or {}) == {"conv": torch.bfloat16, "ssm": torch.float32}
    assert (falcon.cache_layer(1, "attention"), falcon.cache_layer(1, "state")) == (2, 3)

    zamba = ModelShape.from_config(ZAMBA2)
    assert zamba.layer_types == ("linear_attention", "full_attention", "linear_attention", "linear_attention")
    assert zamba.model_layers == (0, 1, 1, 2)
    # The shared attention attends over 2 * hidden_size: head dim 2 * 32 // 4 = 16, not 8.
    assert (zamba.num_kv_heads, zamba.head_dim) == (2, 16)
    assert ModelShape.from_config({**ZAMBA2, "attention_head_dim": 24}).head_dim == 24
    # mamba2 over mamba_expand * hidden_size = 64 channels: 4 heads of 16.
    assert dict(zamba.state_shapes or {}) == {"conv": (96, 2), "ssm": (4, 16, 8)}
    assert zamba.kv_bytes_per_slot == 2 * 2 * 16 * 2


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        ({"num_key_value_heads": None, "num_attention_heads": None}, "missing 'num_key_value_heads'"),
        ({"num_key_value_heads": 0}, "'num_key_value_heads' must be a positive int, got 0"),
        ({"num_key_value_heads": "2"}, "'num_key_value_heads' must be a positive int"),
        ({"head_dim": None, "hidden_size": None}, "missing 'head_dim'"),
        ({"head_dim": None, "hidden_size": 1000, "num_attention_heads": 7}, "not a multiple"),
        ({"torch_dtype": None}, "missing 'torch_dtype'"),
        ({"torch_dtype": "int8"}, "'torch_dtype' must be a floating dtype"),
        ({"torch_dtype": 16}, "'torch_dtype' must be a torch.dtype"),
        ({"linear_key_head_dim": None}, "config linear_key_head_dim is missing"),
        ({"linear_num_value_heads": -1}, "config linear_num_value_heads = -1"),
        ({"linear_conv_kernel_dim": True}, "config linear_conv_kernel_dim = True"),
        ({"mamba_ssm_dtype": "float77"}, "ssm state's dtype.*float77"),
        ({"layer_types": ["full_attention"] * 47 + ["mlp"]}, r"config layer_types\[47\] = 'mlp'"),
        ({"layer_types": None, "num_hidden_layers": None}, "config num_hidden_layers is missing"),
    ],
)
def test_from_config_errors_name_the_key(edit: dict[str, Any], match: str) -> None:
    cfg = {**get_preset("qwen3.5-like"), **edit}
    with pytest.raises(ValueError, match=match):
        ModelShape.from_config(cfg)


def test_from_config_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        ModelShape.from_config(tmp_path / "missing.json")
