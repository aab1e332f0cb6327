"""The linear-attention / recurrent families of the family table (flat_kvcache/families/linear.py).

For each family: the form ``transformers`` writes (``SomeConfig().to_dict()``) and the Hub form
without ``layer_types`` are read to the layers transformers itself builds (its
``config.layer_types`` / ``layers_block_type``, computed by its own config class, never by this
library); every refusal names its field; and each state kind's shapes and dtypes are checked
against the state tensors the model's own cache allocates for a tiny model on CPU.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import pytest
from flat_kvcache.config import load_model_config
from flat_kvcache.errors import ModelConfigError
from flat_kvcache.families import STATE_KINDS, family_of, read_model_layers, state_components
from helpers import need

transformers = need("transformers")
torch = need("torch")

#: What each transformers label is in this library's layer_types.
_CACHE_LABEL = {
    "full_attention": "full_attention",
    "sliding_attention": "sliding_attention",
    "linear_attention": "linear_attention",
    "conv": "linear_attention",  # LFM2 / LFM3 short-conv layers
}


def _check(
    cfg: Mapping[str, Any],
    hf_labels: list[str],
    *,
    state_kind: str,
    window: int | None = None,
) -> None:
    """``cfg`` reads to one cache layer per model layer, labelled as transformers labels it."""
    got = read_model_layers(load_model_config(cfg))
    assert got.layer_types == tuple(_CACHE_LABEL[label] for label in hf_labels)
    assert got.model_layers == tuple(range(len(hf_labels)))
    assert got.num_model_layers == len(hf_labels)
    assert got.sliding_window == (window if "sliding_attention" in got.layer_types else None)
    assert got.state_kind == (state_kind if "linear_attention" in got.layer_types else None)
    assert "linear_attention" in got.layer_types  # every case here is a hybrid


def _without_layer_types(cfg: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in cfg.items() if k != "layer_types"}


# --- (1) the form transformers writes ---------------------------------------------------------------


def test_qwen3_next_transformers_form() -> None:
    config = transformers.Qwen3NextConfig()
    _check(config.to_dict(), config.layer_types, state_kind="gdn")


@pytest.mark.parametrize("name", ["Qwen3_5Config", "Qwen3_5MoeConfig"])
def test_qwen3_5_multimodal_transformers_form(name: str) -> None:
    config = getattr(transformers, name)()
    cfg = config.to_dict()
    assert load_model_config(cfg)["model_type"] in {"qwen3_5_text", "qwen3_5_moe_text"}
    _check(cfg, config.text_config.layer_types, state_kind="gdn")


@pytest.mark.parametrize("name", ["Qwen3_5TextConfig", "Qwen3_5MoeTextConfig"])
def test_qwen3_5_text_transformers_form(name: str) -> None:
    config = getattr(transformers, name)()
    _check(config.to_dict(), config.layer_types, state_kind="gdn")


def test_olmo_hybrid_transformers_form() -> None:
    config = transformers.OlmoHybridConfig()
    _check(config.to_dict(), config.layer_types, state_kind="olmo_hybrid_gdn")


def test_kimi_linear_transformers_form() -> None:
    config = transformers.KimiLinearConfig()
    _check(config.to_dict(), config.layer_types, state_kind="kda")


def test_minimax_transformers_form() -> None:
    config = transformers.MiniMaxConfig()
    _check(config.to_dict(), config.layer_types, state_kind="lightning")


def test_minimax_sliding_window_windows_the_softmax_layers() -> None:
    # MiniMaxAttention passes config.sliding_window to the attention and MiniMaxModel builds a
    # sliding-window mask for every full_attention layer when it is set.
    config = transformers.MiniMaxConfig(num_hidden_layers=4, sliding_window=64)
    got = read_model_layers(load_model_config(config.to_dict()))
    assert got.layer_types == ("sliding_attention", "linear_attention") * 2
    assert got.sliding_window == 64


#: LiquidAI/LFM2-1.2B (config.json): 16 layers, attention at full_attn_idxs; Lfm2Config()'s
#: own default makes every layer full attention, so the hybrid layout comes from the checkpoint.
_LFM2_1_2B = {"num_hidden_layers": 16, "full_attn_idxs": [2, 5, 8, 10, 12, 14], "hidden_size": 2048}


def test_lfm2_transformers_form() -> None:
    config = transformers.Lfm2Config(**_LFM2_1_2B)
    _check(config.to_dict(), config.layer_types, state_kind="short_conv")


def test_lfm2_vl_transformers_form() -> None:
    config = transformers.Lfm2VlConfig(text_config={"model_type": "lfm2", **_LFM2_1_2B})
    _check(config.to_dict(), config.text_config.layer_types, state_kind="short_conv")


def test_lfm2_moe_transformers_form() -> None:
    # Lfm2MoeConfig() has no layer_types at all (its model reads config.layer_types as given):
    # a hybrid layout chosen for the test, LFM2's label set.
    labels = ["conv", "conv", "full_attention", "conv", "conv", "conv", "full_attention", "conv"]
    config = transformers.Lfm2MoeConfig(num_hidden_layers=8, layer_types=labels)
    _check(config.to_dict(), config.layer_types, state_kind="short_conv")


def test_lfm3_transformers_form() -> None:
    config = transformers.Lfm3Config()
    assert "sliding_attention" in config.layer_types
    _check(config.to_dict(), config.layer_types, state_kind="short_conv", window=config.sliding_window)


def test_recurrent_gemma_transformers_form() -> None:
    config = transformers.RecurrentGemmaConfig()
    # RecurrentGemmaConfig maps layer_types to layers_block_type: linear_attention for a
    # recurrent block, sliding_attention for a local-attention block.
    assert config.layer_types == config.layers_block_type
    _check(
        config.to_dict(), config.layers_block_type, state_kind="rg_lru", window=config.attention_window_size
    )


# --- (2) the Hub form: legacy fields, no layer_types ------------------------------------------------


@pytest.mark.parametrize(("layers", "interval"), [(48, 4), (48, None), (10, 3)])
def test_qwen3_next_hub_form(layers: int, interval: int | None) -> None:
    # Qwen/Qwen3-Next-80B-A3B-Instruct ships num_hidden_layers 48, full_attention_interval 4.
    hub: dict[str, Any] = {"model_type": "qwen3_next", "num_hidden_layers": layers}
    if interval is not None:
        hub["full_attention_interval"] = interval
    _check(hub, transformers.Qwen3NextConfig(**hub).layer_types, state_kind="gdn")


def test_qwen3_next_hub_form_interval_one_is_all_full_attention() -> None:
    hub = {"model_type": "qwen3_next", "num_hidden_layers": 5, "full_attention_interval": 1}
    assert transformers.Qwen3NextConfig(**hub).layer_types == ["full_attention"] * 5
    got = read_model_layers(hub)
    assert (got.layer_types, got.state_kind) == (("full_attention",) * 5, None)


def test_qwen3_5_hub_form_nested_text_config() -> None:
    text = {"model_type": "qwen3_5_text", "num_hidden_layers": 24, "full_attention_interval": 4}
    hub = {"model_type": "qwen3_5", "text_config": text}
    hf = transformers.Qwen3_5Config(text_config=dict(text))
    _check(hub, hf.text_config.layer_types, state_kind="gdn")
    # A text_config without its own model_type keeps the wrapper's.
    _check(
        {"model_type": "qwen3_5_moe", "text_config": {"num_hidden_layers": 8}},
        transformers.Qwen3_5MoeTextConfig(num_hidden_layers=8).layer_types,
        state_kind="gdn",
    )


@pytest.mark.parametrize("layers", [32, 8, 3, 2])
def test_olmo_hybrid_hub_form(layers: int) -> None:
    hub = {"model_type": "olmo_hybrid", "num_hidden_layers": layers}
    _check(
        hub, transformers.OlmoHybridConfig(num_hidden_layers=layers).layer_types, state_kind="olmo_hybrid_gdn"
    )


#: moonshotai/Kimi-Linear-48B-A3B-Instruct (config.json): 27 layers, full attention at the
#: 1-based layers 4, 8, ..., 24 and 27, KDA elsewhere.
_KIMI_48B_FULL = [4, 8, 12, 16, 20, 24, 27]
_KIMI_48B = {
    "model_type": "kimi_linear",
    "num_hidden_layers": 27,
    "linear_attn_config": {
        "full_attn_layers": _KIMI_48B_FULL,
        "kda_layers": [i for i in range(1, 28) if i not in _KIMI_48B_FULL],
        "num_heads": 32,
        "head_dim": 128,
        "short_conv_kernel_size": 4,
    },
}


def test_kimi_linear_hub_form() -> None:
    hf = transformers.KimiLinearConfig(**_KIMI_48B)
    _check(_KIMI_48B, hf.layer_types, state_kind="kda")
    # ... and the form transformers writes from it reads the same.
    _check(hf.to_dict(), hf.layer_types, state_kind="kda")


def test_kimi_linear_hub_form_without_lists_is_the_class_default() -> None:
    hub = {"model_type": "kimi_linear", "num_hidden_layers": 13, "linear_attn_config": {"num_heads": 4}}
    _check(hub, transformers.KimiLinearConfig(**hub).layer_types, state_kind="kda")


def test_minimax_hub_form_attn_type_list() -> None:
    # MiniMaxAI/MiniMax-Text-01 (config.json, model_type minimax_text_01): 80 layers, a softmax
    # attention layer (1) after every 7 lightning-attention layers (0). Its modeling code, and
    # vLLM's and SGLang's, make layer i lightning attention when attn_type_list[i] == 0.
    types = ([0] * 7 + [1]) * 10
    labels = ["linear_attention" if t == 0 else "full_attention" for t in types]
    for model_type in ("minimax_text_01", "minimax_m1"):
        _check(
            {"model_type": model_type, "num_hidden_layers": 80, "attn_type_list": types},
            labels,
            state_kind="lightning",
        )


def test_minimax_attn_type_list_that_transformers_would_ignore_is_refused() -> None:
    # model_type minimax is transformers' MiniMaxConfig: it has no attn_type_list and builds its
    # own alternation (layer i full attention when i is even), whatever the list says.
    types = ([0] * 7 + [1]) * 10
    with pytest.raises(ModelConfigError, match=r"attn_type_list = .*ignores attn_type_list"):
        read_model_layers({"model_type": "minimax", "num_hidden_layers": 80, "attn_type_list": types})
    # A list that says what the class builds is read.
    agreeing = [1 - i % 2 for i in range(6)]
    hub = {"model_type": "minimax", "num_hidden_layers": 6}
    _check(
        {**hub, "attn_type_list": agreeing},
        transformers.MiniMaxConfig(**hub).layer_types,
        state_kind="lightning",
    )


def test_minimax_hub_form_without_either_list_is_the_class_default() -> None:
    hub = {"model_type": "minimax", "num_hidden_layers": 6}
    _check(hub, transformers.MiniMaxConfig(**hub).layer_types, state_kind="lightning")


def test_lfm2_hub_form() -> None:
    hub = {"model_type": "lfm2", **_LFM2_1_2B}
    _check(hub, transformers.Lfm2Config(**hub).layer_types, state_kind="short_conv")
    hf = transformers.Lfm2Config(**_LFM2_1_2B)
    # The form transformers writes carries both; layer_types is what the model reads.
    assert hf.to_dict()["full_attn_idxs"] == _LFM2_1_2B["full_attn_idxs"]


def test_lfm3_hub_form() -> None:
    hub = {"model_type": "lfm3", "num_hidden_layers": 12, "sliding_window": 128}
    hf = transformers.Lfm3Config(**hub)
    _check(hub, hf.layer_types, state_kind="short_conv", window=128)


@pytest.mark.parametrize(
    ("layers", "blocks"),
    [
        (26, ["recurrent", "recurrent", "attention"]),  # google/recurrentgemma-2b (config.json)
        (38, ["recurrent", "recurrent", "attention"]),  # google/recurrentgemma-9b (config.json)
        (5, ["attention", "recurrent"]),
    ],
)
def test_recurrent_gemma_hub_form(layers: int, blocks: list[str]) -> None:
    hub = {
        "model_type": "recurrent_gemma",
        "num_hidden_layers": layers,
        "block_types": blocks,
        "attention_window_size": 2048,
    }
    hf = transformers.RecurrentGemmaConfig(**hub)
    _check(hub, hf.layers_block_type, state_kind="rg_lru", window=2048)


# --- (3) refusals name the field --------------------------------------------------------------------


def _kimi(**sub: Any) -> dict[str, Any]:
    return {"model_type": "kimi_linear", "num_hidden_layers": 4, "linear_attn_config": sub}


@pytest.mark.parametrize(
    ("cfg", "match"),
    [
        (
            {"model_type": "qwen3_next", "layer_types": ["linear_attention", "mamba"]},
            r"config layer_types\[1\] = 'mamba': supported labels: full_attention, linear_attention",
        ),
        (
            {"model_type": "qwen3_next", "num_hidden_layers": 4, "full_attention_interval": 0},
            "config full_attention_interval = 0",
        ),
        ({"model_type": "qwen3_5_text"}, "config num_hidden_layers is missing"),
        (
            {"model_type": "qwen3_next", "num_hidden_layers": 3, "layer_types": ["full_attention"] * 2},
            "config layer_types has 2 entries but num_hidden_layers is 3",
        ),
        (
            {"model_type": "olmo_hybrid", "layer_types": ["linear_attention"] * 4},
            "config layer_types = .*at least one linear_attention and one full_attention",
        ),
        (
            {"model_type": "olmo_hybrid", "num_hidden_layers": 1},
            "config num_hidden_layers = 1: OLMo-Hybrid needs at least one",
        ),
        (_kimi(full_attn_layers=[4]), "config linear_attn_config.kda_layers is missing"),
        (_kimi(kda_layers=[1, 2, 3]), "config linear_attn_config.full_attn_layers is missing"),
        (
            _kimi(full_attn_layers=[0], kda_layers=[1, 2, 3]),
            r"config linear_attn_config.full_attn_layers\[0\] = 0: a layer number in 1..4",
        ),
        (
            _kimi(full_attn_layers=[4], kda_layers=[1, 2, 3, 4]),
            "config linear_attn_config.kda_layers = .*layer 4 is in both",
        ),
        (
            _kimi(full_attn_layers=[4], kda_layers=[1, 2]),
            "config linear_attn_config.kda_layers = .*layer 3 is in neither",
        ),
        (
            _kimi(full_attn_layers="4", kda_layers=[1, 2, 3]),
            "config linear_attn_config.full_attn_layers = '4'",
        ),
        (
            {"model_type": "kimi_linear", "num_hidden_layers": 4, "linear_attn_config": [1]},
            r"config linear_attn_config = \[1\]",
        ),
        (
            {"model_type": "minimax", "num_hidden_layers": 4, "attn_type_list": [0, 0, 0, 2]},
            r"config attn_type_list\[3\] = 2: 0 \(lightning attention\) or 1",
        ),
        (
            {"model_type": "minimax", "num_hidden_layers": 4, "attn_type_list": [0, 1]},
            "config attn_type_list has 2 entries but num_hidden_layers is 4",
        ),
        ({"model_type": "minimax_text_01", "num_hidden_layers": 4}, "config attn_type_list is missing"),
        (
            {"model_type": "minimax", "num_hidden_layers": 4, "sliding_window": 0},
            "config sliding_window = 0",
        ),
        (
            {"model_type": "minimax", "layer_types": ["sliding_attention"], "sliding_window": 8},
            r"config layer_types\[0\] = 'sliding_attention'",
        ),
        ({"model_type": "lfm2", "num_hidden_layers": 4}, "config full_attn_idxs is missing"),
        (
            {"model_type": "lfm2", "num_hidden_layers": 4, "full_attn_idxs": [1, 9]},
            r"config full_attn_idxs\[1\] = 9",
        ),
        (
            {"model_type": "lfm2", "num_hidden_layers": 4, "full_attn_idxs": [-1]},
            r"config full_attn_idxs\[0\] = -1",
        ),
        (
            {"model_type": "lfm2_moe", "num_hidden_layers": 4, "full_attn_idxs": [1]},
            "config layer_types is missing: an lfm2_moe config",
        ),
        ({"model_type": "lfm2", "layer_types": ["conv", "mamba"]}, r"config layer_types\[1\] = 'mamba'"),
        ({"model_type": "lfm3", "num_hidden_layers": 8}, "config sliding_window = None"),
        (
            {
                "model_type": "recurrent_gemma",
                "num_hidden_layers": 3,
                "attention_window_size": 8,
                "block_types": ["mlp"],
            },
            r"config block_types\[0\] = 'mlp': supported: attention, recurrent",
        ),
        (
            {
                "model_type": "recurrent_gemma",
                "num_hidden_layers": 3,
                "attention_window_size": 8,
                "block_types": [],
            },
            r"config block_types = \[\]",
        ),
        (
            {"model_type": "recurrent_gemma", "num_hidden_layers": 3},
            "config attention_window_size is missing",
        ),
    ],
)
def test_layer_refusals_name_the_field(cfg: dict[str, Any], match: str) -> None:
    with pytest.raises(ModelConfigError, match=match):
        read_model_layers(load_model_config(cfg))


_GDN = {
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_value_head_dim": 128,
    "linear_num_value_heads": 32,
}


@pytest.mark.parametrize(
    ("kind", "cfg", "match"),
    [
        ("gdn", {**_GDN, "linear_key_head_dim": None}, "config linear_key_head_dim is missing"),
        ("gdn", {**_GDN, "linear_conv_kernel_dim": 0}, "config linear_conv_kernel_dim = 0"),
        ("gdn", {**_GDN, "mamba_ssm_dtype": 32}, "config mamba_ssm_dtype = 32"),
        (
            "olmo_hybrid_gdn",
            {"hidden_size": 64, "linear_conv_kernel_dim": 4},
            "config num_attention_heads is missing",
        ),
        (
            "olmo_hybrid_gdn",
            {"num_attention_heads": 4, "linear_conv_kernel_dim": 4},
            "config hidden_size is missing",
        ),
        (
            "olmo_hybrid_gdn",
            {"num_attention_heads": 4, "hidden_size": 64},
            "config linear_conv_kernel_dim is missing",
        ),
        (
            "kda",
            {"linear_head_dim": 8, "linear_conv_kernel_dim": 4},
            r"config linear_num_heads \(or linear_attn_config.num_heads\) is missing",
        ),
        (
            "kda",
            {"linear_attn_config": {"num_heads": 2, "head_dim": 0, "short_conv_kernel_size": 4}},
            "config linear_attn_config.head_dim = 0",
        ),
        ("lightning", {"hidden_size": 64}, "config num_attention_heads is missing"),
        ("lightning", {"num_attention_heads": 4}, "config hidden_size is missing"),
        ("lightning", {"num_attention_heads": 128, "hidden_size": 64}, "config hidden_size = 64: too small"),
        ("short_conv", {"hidden_size": 64}, "config conv_L_cache is missing"),
        ("rg_lru", {"hidden_size": 64}, "config conv1d_width is missing"),
        (
            "rg_lru",
            {"hidden_size": 64, "lru_width": 32, "conv1d_width": 4},
            r"config lru_width = 32: only lru_width == hidden_size \(64\)",
        ),
    ],
)
def test_state_refusals_name_the_field(kind: str, cfg: dict[str, Any], match: str) -> None:
    with pytest.raises(ModelConfigError, match=match):
        state_components(kind, cfg)


def test_every_family_here_is_read_and_every_state_kind_sized() -> None:
    for model_type in (
        "qwen3_next",
        "olmo_hybrid",
        "kimi_linear",
        "minimax",
        "lfm2",
        "lfm3",
        "recurrent_gemma",
    ):
        family = family_of({"model_type": model_type})
        assert family.refused is None
        assert family.state is not None
        assert STATE_KINDS[family.state].components is not None


# --- (4) state shapes against the model's own cache -------------------------------------------------

_DTYPE = torch.bfloat16  # a model dtype distinct from the float32 states


def _torch_dtype(name: str) -> Any:
    return _DTYPE if name == "model" else getattr(torch, name)


def _run(model: Any, *, tokens: int = 5) -> Any:
    """A bf16 forward pass with a cache; the cache the model returns."""
    model = model.to(_DTYPE).eval()
    with torch.no_grad():
        out = model(input_ids=torch.arange(tokens).unsqueeze(0) % 17, use_cache=True)
    return out.past_key_values


def _dynamic_cache_state(cache: Any, layer: int) -> dict[str, tuple[tuple[int, ...], Any]]:
    """The state tensors transformers' ``LinearAttentionLayer`` allocated for ``layer`` (batch
    dimension dropped)."""
    entry = cache.layers[layer]
    found: dict[str, tuple[tuple[int, ...], Any]] = {}
    conv = entry.conv_states[0]
    found["conv"] = (tuple(conv.shape[1:]), conv.dtype)
    ssm = entry.recurrent_states[0]
    if ssm is not None:
        found["ssm"] = (tuple(ssm.shape[1:]), ssm.dtype)
    return found


def _compare(
    ours: tuple[Any, ...],
    model: dict[str, tuple[tuple[int, ...], Any]],
    *,
    conv_minus_one: bool,
) -> None:
    """Our components against the model's: same names, dtypes and shapes, except that this
    library's conv keeps one column less where ``conv_minus_one`` (the kind's ``layout``)."""
    assert {c.name for c in ours} == set(model)
    for component in ours:
        shape, dtype = model[component.name]
        assert _torch_dtype(component.dtype) == dtype, component.name
        if component.name == "conv" and conv_minus_one:
            assert component.shape == (*shape[:-1], shape[-1] - 1)
        else:
            assert component.shape == shape, component.name


def _tiny(factory: Callable[..., Any], **kwargs: Any) -> Any:
    base = {
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 32,
        "num_attention_heads": 2,
        "pad_token_id": None,
        "bos_token_id": None,
        "eos_token_id": None,
    }
    return factory(**{**base, **kwargs})


_QWEN_TINY = {
    "num_hidden_layers": 4,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 12,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
}


@pytest.mark.parametrize(
    ("config_name", "model_name", "extra"),
    [
        (
            "Qwen3NextConfig",
            "Qwen3NextModel",
            {
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 16,
                "shared_expert_intermediate_size": 16,
            },
        ),
        ("Qwen3_5TextConfig", "Qwen3_5TextModel", {}),
        (
            "Qwen3_5MoeTextConfig",
            "Qwen3_5MoeTextModel",
            {
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 16,
                "shared_expert_intermediate_size": 16,
            },
        ),
    ],
)
def test_gdn_state_matches_the_model_cache(config_name: str, model_name: str, extra: dict[str, Any]) -> None:
    config = _tiny(getattr(transformers, config_name), **_QWEN_TINY, **extra)
    cache = _run(getattr(transformers, model_name)(config))
    cfg = load_model_config(config.to_dict())
    layers = read_model_layers(cfg)
    state_layer = layers.layer_types.index("linear_attention")
    ours = state_components("gdn", cfg)
    _compare(ours, _dynamic_cache_state(cache, state_layer), conv_minus_one=True)
    # mamba_ssm_dtype, when a checkpoint ships it, sets the recurrent state's dtype.
    assert state_components("gdn", {**cfg, "mamba_ssm_dtype": "bfloat16"})[1].dtype == "bfloat16"


def test_olmo_hybrid_gdn_state_matches_the_model_cache() -> None:
    config = _tiny(transformers.OlmoHybridConfig, num_hidden_layers=4, num_key_value_heads=1)
    cache = _run(transformers.OlmoHybridModel(config))
    cfg = load_model_config(config.to_dict())
    model_state = _dynamic_cache_state(cache, 0)
    _compare(state_components("olmo_hybrid_gdn", cfg), model_state, conv_minus_one=True)
    # The Hub form without the linear_* dims derives them as OlmoHybridConfig does.
    bare = {k: v for k, v in cfg.items() if not k.startswith("linear_") or k == "linear_conv_kernel_dim"}
    assert "linear_key_head_dim" not in bare
    _compare(state_components("olmo_hybrid_gdn", bare), model_state, conv_minus_one=True)


def test_kda_state_matches_the_model_cache() -> None:
    config = _tiny(
        transformers.KimiLinearConfig,
        num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
        num_key_value_heads=2,
        kv_lora_rank=16,
        q_lora_rank=None,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        linear_head_dim=8,
        linear_num_heads=3,
        linear_conv_kernel_dim=3,
        moe_intermediate_size=16,
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    cache = _run(transformers.KimiLinearModel(config))
    cfg = load_model_config(config.to_dict())
    model_state = _dynamic_cache_state(cache, 0)
    _compare(state_components("kda", cfg), model_state, conv_minus_one=True)
    # The Hub form carries the dims in linear_attn_config (which wins over the top level).
    hub = {
        "linear_num_heads": 99,
        "linear_attn_config": {"num_heads": 3, "head_dim": 8, "short_conv_kernel_size": 3},
    }
    _compare(state_components("kda", hub), model_state, conv_minus_one=True)


@pytest.mark.parametrize("head_dim", [None, 8])
def test_lightning_state_matches_the_model_cache(head_dim: int | None) -> None:
    config = _tiny(
        transformers.MiniMaxConfig,
        num_hidden_layers=2,
        num_key_value_heads=1,
        head_dim=head_dim,
        num_local_experts=2,
        num_experts_per_tok=1,
        block_size=4,
    )
    cache = _run(transformers.MiniMaxModel(config))
    cfg = load_model_config(config.to_dict())
    layer = config.layer_types.index("linear_attention")
    state = cache.linear_cache[layer]
    _compare(
        state_components("lightning", cfg),
        {"ssm": (tuple(state.shape[1:]), state.dtype)},
        conv_minus_one=False,
    )


@pytest.mark.parametrize(
    ("config_name", "model_name", "extra"),
    [
        ("Lfm2Config", "Lfm2Model", {"num_hidden_layers": 3, "full_attn_idxs": [1], "conv_L_cache": 3}),
        (
            "Lfm2MoeConfig",
            "Lfm2MoeModel",
            {
                "num_hidden_layers": 2,
                "layer_types": ["conv", "full_attention"],
                "conv_L_cache": 3,
                "num_dense_layers": 1,
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 16,
            },
        ),
        (
            "Lfm3Config",
            "Lfm3Model",
            {"num_hidden_layers": 3, "head_dim": 16, "conv_L_cache": 5, "sliding_window": 8},
        ),
    ],
)
def test_short_conv_state_matches_the_model_cache(
    config_name: str, model_name: str, extra: dict[str, Any]
) -> None:
    config = _tiny(getattr(transformers, config_name), num_key_value_heads=1, **extra)
    cache = _run(getattr(transformers, model_name)(config))
    cfg = load_model_config(config.to_dict())
    layer = config.layer_types.index("conv")
    _compare(state_components("short_conv", cfg), _dynamic_cache_state(cache, layer), conv_minus_one=True)


def test_rg_lru_state_matches_the_model_cache() -> None:
    config = _tiny(
        transformers.RecurrentGemmaConfig, num_hidden_layers=3, conv1d_width=4, attention_window_size=8
    )
    model = transformers.RecurrentGemmaModel(config).to(_DTYPE)
    model._setup_cache(config, 1, torch.device("cpu"), _DTYPE)  # what its forward allocates
    block = model.layers[config.layers_block_type.index("linear_attention")].temporal_block
    model_state = {
        "conv": (tuple(block.conv1d_state.shape[1:]), block.conv1d_state.dtype),
        "ssm": (tuple(block.rg_lru.recurrent_states.shape[1:]), block.rg_lru.recurrent_states.dtype),
    }
    cfg = load_model_config(config.to_dict())
    _compare(state_components("rg_lru", cfg), model_state, conv_minus_one=False)
