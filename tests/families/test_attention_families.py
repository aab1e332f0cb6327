"""The attention-only families (flat_kvcache.families.attention): each read right from the form
``transformers`` writes (``SomeConfig().to_dict()``) and from the form Hub checkpoints ship
(legacy fields, no ``layer_types``), and every refusal naming its field.

Expectations are not taken from the reader: they come from the ``transformers`` config object's
own ``layer_types`` where the class builds one (Qwen2, Qwen3, Qwen2-MoE, Ministral, Gemma-2,
Gemma-3, GPT-OSS, Olmo3, Llama 4), else from the rule the model's modeling code applies, written out
here (Llama, Gemma, Olmo, Olmo2: every layer full; Mistral, Ministral3, Phi3, Qwen3-MoE: every
layer slides by ``config.sliding_window`` when it is not None).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest
from flat_kvcache.config import load_model_config
from flat_kvcache.errors import ModelConfigError
from flat_kvcache.families import ModelLayers, read_model_layers
from helpers import need

FULL = "full_attention"
SLIDING = "sliding_attention"


@pytest.fixture
def tf() -> ModuleType:
    return need("transformers")


def read(cfg: dict[str, Any]) -> ModelLayers:
    return read_model_layers(load_model_config(cfg))


def expect(ml: ModelLayers, labels: list[str], window: int | None, *, model_type: str) -> None:
    """Every model layer keeps a cache, labelled ``labels``; the sliding ones by ``window``."""
    assert ml.layer_types == tuple(labels)
    assert ml.model_layers == tuple(range(len(labels)))
    assert ml.num_model_layers == len(labels)
    assert ml.sliding_window == (window if SLIDING in labels else None)
    assert ml.state_kind is None
    assert ml.model_type == model_type


def hub_kwargs(hub: dict[str, Any]) -> dict[str, Any]:
    """A Hub config.json's fields as ``__init__`` keyword arguments of its config class."""
    return {k: v for k, v in hub.items() if k != "model_type"}


def every_layer_window(cfg: dict[str, Any]) -> list[str]:
    """The rule of models whose attention takes ``config.sliding_window`` in every layer
    (Mistral, Ministral3, Phi3, Qwen3-MoE): all sliding when it is not None, else all full."""
    n = cfg["num_hidden_layers"]
    return [SLIDING if cfg.get("sliding_window") is not None else FULL] * n


def refused(cfg: dict[str, Any], field: str) -> str:
    """The ModelConfigError message reading ``cfg``, checked to name ``field``."""
    with pytest.raises(ModelConfigError) as info:
        read(cfg)
    message = str(info.value)
    assert re.search(rf"(?<!\w){re.escape(field)}(?!\w)", message), message
    return message


# --- models that read layer_types: compare with the config object's own layer_types --------------

# (config class, __init__ kwargs for the interesting layout, Hub config.json (no layer_types))
LAYER_TYPES_CASES: list[Any] = [
    pytest.param("Qwen2Config", {}, None, id="qwen2-defaults"),
    pytest.param(
        "Qwen2Config",
        {"use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 28},
        None,
        id="qwen2-sliding",
    ),
    # Qwen/Qwen2.5-7B-Instruct config.json: a window that use_sliding_window switches off.
    pytest.param(
        "Qwen2Config",
        {},
        {
            "model_type": "qwen2",
            "num_hidden_layers": 28,
            "use_sliding_window": False,
            "sliding_window": 131072,
            "max_window_layers": 28,
        },
        id="qwen2-hub-qwen2.5-7b",
    ),
    pytest.param(
        "Qwen2Config",
        {},
        {
            "model_type": "qwen2",
            "num_hidden_layers": 28,
            "use_sliding_window": True,
            "sliding_window": 32768,
            "max_window_layers": 21,
        },
        id="qwen2-hub-sliding",
    ),
    pytest.param("Qwen3Config", {}, None, id="qwen3-defaults"),
    # Qwen/Qwen3-8B config.json.
    pytest.param(
        "Qwen3Config",
        {},
        {
            "model_type": "qwen3",
            "num_hidden_layers": 36,
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": 36,
        },
        id="qwen3-hub-qwen3-8b",
    ),
    pytest.param(
        "Qwen3Config",
        {},
        {
            "model_type": "qwen3",
            "num_hidden_layers": 8,
            "use_sliding_window": True,
            "sliding_window": 1024,
            "max_window_layers": 5,
        },
        id="qwen3-hub-sliding",
    ),
    pytest.param("Qwen2MoeConfig", {}, None, id="qwen2_moe-defaults"),
    pytest.param(
        "Qwen2MoeConfig",
        {"use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 9},
        None,
        id="qwen2_moe-sliding",
    ),
    # Qwen/Qwen1.5-MoE-A2.7B config.json.
    pytest.param(
        "Qwen2MoeConfig",
        {},
        {
            "model_type": "qwen2_moe",
            "num_hidden_layers": 24,
            "use_sliding_window": False,
            "sliding_window": 32768,
            "max_window_layers": 21,
        },
        id="qwen2_moe-hub-qwen1.5-moe",
    ),
    pytest.param(
        "Qwen2MoeConfig",
        {},
        {
            "model_type": "qwen2_moe",
            "num_hidden_layers": 24,
            "use_sliding_window": True,
            "sliding_window": 32768,
            "max_window_layers": 13,
        },
        id="qwen2_moe-hub-sliding",
    ),
    pytest.param("MinistralConfig", {}, None, id="ministral-defaults"),
    pytest.param(
        "MinistralConfig",
        {},
        {"model_type": "ministral", "num_hidden_layers": 36, "sliding_window": 32768},
        id="ministral-hub",
    ),
    pytest.param(
        "MinistralConfig",
        {},
        {"model_type": "ministral", "num_hidden_layers": 12, "sliding_window": None},
        id="ministral-hub-no-window",
    ),
    pytest.param("Gemma2Config", {}, None, id="gemma2-defaults"),
    # google/gemma-2-9b config.json.
    pytest.param(
        "Gemma2Config",
        {},
        {"model_type": "gemma2", "num_hidden_layers": 42, "sliding_window": 4096},
        id="gemma2-hub-gemma-2-9b",
    ),
    pytest.param("Gemma3TextConfig", {}, None, id="gemma3_text-defaults"),
    # google/gemma-3-1b-it config.json.
    pytest.param(
        "Gemma3TextConfig",
        {},
        {
            "model_type": "gemma3_text",
            "num_hidden_layers": 26,
            "sliding_window": 512,
            "sliding_window_pattern": 6,
        },
        id="gemma3_text-hub-gemma-3-1b",
    ),
    # No sliding_window_pattern: Gemma3TextConfig reads it as 6.
    pytest.param(
        "Gemma3TextConfig",
        {},
        {"model_type": "gemma3_text", "num_hidden_layers": 13, "sliding_window": 512},
        id="gemma3_text-hub-default-pattern",
    ),
    pytest.param(
        "Gemma3TextConfig",
        {},
        {
            "model_type": "gemma3_text",
            "num_hidden_layers": 10,
            "sliding_window": 256,
            "sliding_window_pattern": 3,
        },
        id="gemma3_text-hub-pattern-3",
    ),
    pytest.param("GptOssConfig", {}, None, id="gpt_oss-defaults"),
    # openai/gpt-oss-20b config.json (which also lists layer_types; here without).
    pytest.param(
        "GptOssConfig",
        {},
        {"model_type": "gpt_oss", "num_hidden_layers": 24, "sliding_window": 128},
        id="gpt_oss-hub-gpt-oss-20b",
    ),
    pytest.param("Olmo3Config", {}, None, id="olmo3-defaults"),
    pytest.param(
        "Olmo3Config",
        {},
        {"model_type": "olmo3", "num_hidden_layers": 30, "sliding_window": 4096},
        id="olmo3-hub",
    ),
]


@pytest.mark.parametrize(("cls_name", "kwargs", "hub"), LAYER_TYPES_CASES)
def test_family_reading_layer_types(
    tf: ModuleType, cls_name: str, kwargs: dict[str, Any], hub: dict[str, Any] | None
) -> None:
    cls = getattr(tf, cls_name)
    config = cls(**(hub_kwargs(hub) if hub is not None else kwargs))
    labels = list(config.layer_types)
    window = config.sliding_window
    if hub is not None:
        window = hub["sliding_window"]
    model_type = config.model_type

    # The transformers form.
    written = config.to_dict()
    assert written["layer_types"] == labels
    expect(read(written), labels, window, model_type=model_type)

    # The Hub form: the same config without layer_types.
    source = hub if hub is not None else {k: v for k, v in written.items() if k != "layer_types"}
    assert "layer_types" not in source
    expect(read(source), labels, window, model_type=model_type)


def test_qwen2_sliding_layers_are_those_from_max_window_layers(tf: ModuleType) -> None:
    config = tf.Qwen2Config(use_sliding_window=True, sliding_window=4096, max_window_layers=28)
    ml = read(config.to_dict())
    sliding = [i for i, label in zip(ml.model_layers, ml.layer_types, strict=True) if label == SLIDING]
    assert sliding == list(range(28, config.num_hidden_layers))
    assert ml.sliding_window == 4096


def test_qwen2_moe_sliding_layers_are_the_even_ones_below_max_window_layers(tf: ModuleType) -> None:
    config = tf.Qwen2MoeConfig(use_sliding_window=True, sliding_window=4096, max_window_layers=9)
    ml = read(config.to_dict())
    sliding = [i for i, label in zip(ml.model_layers, ml.layer_types, strict=True) if label == SLIDING]
    assert sliding == [0, 2, 4, 6, 8]


def test_gemma3_wrapper(tf: ModuleType) -> None:
    """The multimodal ``gemma3`` wrapper: its ``text_config`` is read."""
    config = tf.Gemma3Config()
    text = config.text_config
    expect(read(config.to_dict()), list(text.layer_types), text.sliding_window, model_type="gemma3_text")
    # google/gemma-3-4b-it config.json (text_config fields that set the layout).
    text_hub: dict[str, Any] = {
        "model_type": "gemma3_text",
        "num_hidden_layers": 34,
        "sliding_window": 1024,
        "sliding_window_pattern": 6,
    }
    labels = list(tf.Gemma3TextConfig(**hub_kwargs(text_hub)).layer_types)
    expect(read({"model_type": "gemma3", "text_config": text_hub}), labels, 1024, model_type="gemma3_text")
    # A text_config without its own model_type keeps the wrapper's.
    del text_hub["model_type"]
    expect(read({"model_type": "gemma3", "text_config": text_hub}), labels, 1024, model_type="gemma3")


def test_layer_types_is_followed_as_given(tf: ModuleType) -> None:
    """A family that reads layer_types follows it, whatever its Hub rule says."""
    labels = [FULL, SLIDING, SLIDING, FULL]
    config = tf.Gemma2Config(num_hidden_layers=4, sliding_window=64, layer_types=labels)
    expect(read(config.to_dict()), labels, 64, model_type="gemma2")
    config = tf.Olmo3Config(num_hidden_layers=4, sliding_window=64, layer_types=labels)
    expect(read(config.to_dict()), labels, 64, model_type="olmo3")


# --- models that ignore layer_types: the modeling rule written out -------------------------------

# (config class, __init__ kwargs, rule, Hub config.json)
RULE_CASES: list[Any] = [
    pytest.param("LlamaConfig", {}, None, id="llama-defaults"),
    # meta-llama/Llama-3.1-8B config.json.
    pytest.param("LlamaConfig", {"model_type": "llama", "num_hidden_layers": 32}, None, id="llama-hub"),
    pytest.param("GemmaConfig", {}, None, id="gemma-defaults"),
    # google/gemma-7b config.json.
    pytest.param("GemmaConfig", {"model_type": "gemma", "num_hidden_layers": 28}, None, id="gemma-hub"),
    pytest.param("OlmoConfig", {}, None, id="olmo-defaults"),
    # allenai/OLMo-7B-hf config.json.
    pytest.param("OlmoConfig", {"model_type": "olmo", "num_hidden_layers": 32}, None, id="olmo-hub"),
    pytest.param("Olmo2Config", {}, None, id="olmo2-defaults"),
    # allenai/OLMo-2-1124-7B config.json.
    pytest.param("Olmo2Config", {"model_type": "olmo2", "num_hidden_layers": 32}, None, id="olmo2-hub"),
    pytest.param("MistralConfig", {}, every_layer_window, id="mistral-defaults"),
    # mistralai/Mistral-7B-v0.1 config.json.
    pytest.param(
        "MistralConfig",
        {"model_type": "mistral", "num_hidden_layers": 32, "sliding_window": 4096},
        every_layer_window,
        id="mistral-hub-7b-v0.1",
    ),
    # mistralai/Mistral-7B-Instruct-v0.3 config.json.
    pytest.param(
        "MistralConfig",
        {"model_type": "mistral", "num_hidden_layers": 32, "sliding_window": None},
        every_layer_window,
        id="mistral-hub-7b-v0.3",
    ),
    pytest.param("Ministral3Config", {}, every_layer_window, id="ministral3-defaults"),
    pytest.param(
        "Ministral3Config",
        {"model_type": "ministral3", "num_hidden_layers": 6, "sliding_window": 2048},
        every_layer_window,
        id="ministral3-window",
    ),
    pytest.param("Phi3Config", {}, every_layer_window, id="phi3-defaults"),
    # microsoft/Phi-3-mini-4k-instruct config.json.
    pytest.param(
        "Phi3Config",
        {"model_type": "phi3", "num_hidden_layers": 32, "sliding_window": 2047},
        every_layer_window,
        id="phi3-hub-mini-4k",
    ),
    pytest.param("Qwen3MoeConfig", {}, every_layer_window, id="qwen3_moe-defaults"),
    # Qwen/Qwen3-30B-A3B config.json.
    pytest.param(
        "Qwen3MoeConfig",
        {
            "model_type": "qwen3_moe",
            "num_hidden_layers": 48,
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": 48,
        },
        every_layer_window,
        id="qwen3_moe-hub-30b-a3b",
    ),
    # A window use_sliding_window switches off.
    pytest.param(
        "Qwen3MoeConfig",
        {
            "model_type": "qwen3_moe",
            "num_hidden_layers": 8,
            "use_sliding_window": False,
            "sliding_window": 4096,
        },
        every_layer_window,
        id="qwen3_moe-window-off",
    ),
    pytest.param(
        "Qwen3MoeConfig",
        {
            "model_type": "qwen3_moe",
            "num_hidden_layers": 8,
            "use_sliding_window": True,
            "sliding_window": 4096,
        },
        every_layer_window,
        id="qwen3_moe-window-on",
    ),
]


@pytest.mark.parametrize(("cls_name", "hub", "rule"), RULE_CASES)
def test_family_with_a_fixed_rule(
    tf: ModuleType,
    cls_name: str,
    hub: dict[str, Any],
    rule: Callable[[dict[str, Any]], list[str]] | None,
) -> None:
    config = getattr(tf, cls_name)(**hub_kwargs(hub))
    written = config.to_dict()
    assert "layer_types" not in written
    # The rule reads the config object (after __post_init__: a switched-off Qwen window is None).
    effective = {"num_hidden_layers": config.num_hidden_layers}
    if rule is not None:
        effective["sliding_window"] = config.sliding_window
    labels = rule(effective) if rule is not None else [FULL] * config.num_hidden_layers
    window = effective.get("sliding_window")

    expect(read(written), labels, window, model_type=config.model_type)
    if hub:
        expect(read(hub), labels, window, model_type=config.model_type)
    # A layer_types that agrees with the rule is accepted.
    expect(read({**written, "layer_types": labels}), labels, window, model_type=config.model_type)


def test_mistral3_wrapper(tf: ModuleType) -> None:
    """The multimodal ``mistral3`` wrapper: its ``text_config`` (Mistral) is read."""
    config = tf.Mistral3Config()
    text = config.text_config
    expected = every_layer_window(
        {"num_hidden_layers": text.num_hidden_layers, "sliding_window": text.sliding_window}
    )
    expect(read(config.to_dict()), expected, text.sliding_window, model_type="mistral")
    # mistralai/Mistral-Small-3.1-24B-Instruct-2503 config.json (layout fields of text_config).
    hub = {
        "model_type": "mistral3",
        "text_config": {"model_type": "mistral", "num_hidden_layers": 40, "sliding_window": None},
    }
    expect(read(hub), [FULL] * 40, None, model_type="mistral")


CHUNKED = "chunked_attention"


def expect_llama4(ml: ModelLayers, labels: list[str], chunk: int | None) -> None:
    """Llama 4: every model layer keeps K/V, the chunked ones windowed by their chunk."""
    assert ml.family == "Llama 4"
    assert ml.layer_types == tuple(labels)
    assert ml.model_layers == tuple(range(len(labels)))
    assert ml.num_model_layers == len(labels)
    assert ml.sliding_window == (chunk if CHUNKED in labels else None)
    assert ml.state_kind is None
    assert ml.model_type == "llama4_text"


LLAMA4_CASES: list[Any] = [
    pytest.param({}, id="defaults"),
    pytest.param({"num_hidden_layers": 6, "attention_chunk_size": 64}, id="every-4th-nope"),
    pytest.param({"num_hidden_layers": 6, "no_rope_layer_interval": 3}, id="interval-3"),
    pytest.param({"num_hidden_layers": 4, "no_rope_layers": [1, 0, 1, 0]}, id="explicit-list"),
    pytest.param({"num_hidden_layers": 3, "no_rope_layers": [1, 1, 1]}, id="every-layer-chunked"),
]


@pytest.mark.parametrize("kwargs", LLAMA4_CASES)
def test_llama4_both_forms(tf: ModuleType, kwargs: dict[str, Any]) -> None:
    """Expectations from ``Llama4TextConfig``'s own ``layer_types`` (the model masks layer ``i``
    by ``layer_types[i]``, its first ``num_hidden_layers`` entries); the Hub form drops
    ``layer_types`` and keeps the fields the class builds it from."""
    config = tf.Llama4TextConfig(**kwargs)
    labels = list(config.layer_types[: config.num_hidden_layers])
    chunk = config.attention_chunk_size
    written = config.to_dict()
    expect_llama4(read(written), labels, chunk)
    hub_fields = ("num_hidden_layers", "no_rope_layers", "no_rope_layer_interval", "attention_chunk_size")
    hub = {"model_type": "llama4_text", **{k: v for k, v in kwargs.items() if k in hub_fields}}
    hub.setdefault("num_hidden_layers", config.num_hidden_layers)
    hub.setdefault("attention_chunk_size", chunk)
    expect_llama4(read(hub), labels, chunk)
    # The multimodal wrapper: its text_config is read.
    wrapped = tf.Llama4Config(text_config=kwargs).to_dict()
    expect_llama4(read(wrapped), labels, chunk)


def test_llama4_hub_configs(tf: ModuleType) -> None:
    # meta-llama/Llama-4-Scout-17B-16E-Instruct config.json (layout fields of text_config): an
    # empty no_rope_layers is the class default, every 4th layer NoPE (full attention).
    scout = {
        "model_type": "llama4",
        "text_config": {
            "model_type": "llama4_text",
            "num_hidden_layers": 48,
            "attention_chunk_size": 8192,
            "no_rope_layers": [],
        },
    }
    expected = list(tf.Llama4TextConfig(num_hidden_layers=48, no_rope_layers=[]).layer_types)
    assert expected.count(FULL) == 12
    expect_llama4(read(scout), expected, 8192)
    # A layer_types that says all full needs no chunk; one with chunked layers needs it.
    full = {"model_type": "llama4_text", "num_hidden_layers": 2, "layer_types": [FULL, FULL]}
    expect_llama4(read({**full, "attention_chunk_size": None}), [FULL, FULL], None)
    message = refused(
        {**full, "layer_types": [CHUNKED, FULL], "attention_chunk_size": None}, "attention_chunk_size"
    )
    assert "null" in message and "chunked_attention" in message
    # The model masks by layer_types, not by no_rope_layers, when both are given.
    both = {**full, "layer_types": [CHUNKED, FULL], "no_rope_layers": [0, 1], "attention_chunk_size": 16}
    expect_llama4(read(both), [CHUNKED, FULL], 16)


# --- refusals (no transformers needed) -----------------------------------------------------------

REFUSALS: list[Any] = [
    # sliding_window missing where it decides the layout (class defaults would slide by 4096).
    pytest.param(
        {"model_type": "mistral", "num_hidden_layers": 4}, "sliding_window", id="mistral-missing-window"
    ),
    pytest.param({"model_type": "phi3", "num_hidden_layers": 4}, "sliding_window", id="phi3-missing-window"),
    pytest.param(
        {"model_type": "ministral", "num_hidden_layers": 4}, "sliding_window", id="ministral-missing-window"
    ),
    pytest.param(
        {"model_type": "gemma2", "num_hidden_layers": 4}, "sliding_window", id="gemma2-missing-window"
    ),
    pytest.param(
        {"model_type": "gemma3_text", "num_hidden_layers": 4}, "sliding_window", id="gemma3-missing-window"
    ),
    pytest.param(
        {"model_type": "gpt_oss", "num_hidden_layers": 4}, "sliding_window", id="gpt_oss-missing-window"
    ),
    pytest.param(
        {"model_type": "olmo3", "num_hidden_layers": 4}, "sliding_window", id="olmo3-missing-window"
    ),
    # sliding_window values that are no window.
    pytest.param(
        {"model_type": "mistral", "num_hidden_layers": 4, "sliding_window": 0},
        "sliding_window",
        id="mistral-window-0",
    ),
    pytest.param(
        {"model_type": "phi3", "num_hidden_layers": 4, "sliding_window": "2047"},
        "sliding_window",
        id="phi3-window-str",
    ),
    pytest.param(
        {"model_type": "gemma2", "num_hidden_layers": 4, "sliding_window": True},
        "sliding_window",
        id="gemma2-window-bool",
    ),
    pytest.param(
        {"model_type": "gpt_oss", "num_hidden_layers": 4, "sliding_window": None},
        "sliding_window",
        id="gpt_oss-window-null",
    ),
    pytest.param(
        {
            "model_type": "olmo3",
            "num_hidden_layers": 4,
            "sliding_window": None,
            "layer_types": [SLIDING, FULL, FULL, FULL],
        },
        "sliding_window",
        id="olmo3-layer_types-window-null",
    ),
    # Qwen: use_sliding_window, max_window_layers.
    pytest.param(
        {"model_type": "qwen2", "num_hidden_layers": 4, "sliding_window": 4096, "max_window_layers": 2},
        "use_sliding_window",
        id="qwen2-missing-use_sliding_window",
    ),
    pytest.param(
        {"model_type": "qwen3_moe", "num_hidden_layers": 4, "sliding_window": 4096},
        "use_sliding_window",
        id="qwen3_moe-missing-use_sliding_window",
    ),
    pytest.param(
        {"model_type": "qwen2", "num_hidden_layers": 4, "use_sliding_window": "yes", "sliding_window": 4096},
        "use_sliding_window",
        id="qwen2-use_sliding_window-str",
    ),
    pytest.param(
        {"model_type": "qwen2", "num_hidden_layers": 4, "use_sliding_window": True, "sliding_window": 4096},
        "max_window_layers",
        id="qwen2-missing-max_window_layers",
    ),
    pytest.param(
        {
            "model_type": "qwen3",
            "num_hidden_layers": 4,
            "use_sliding_window": True,
            "sliding_window": 4096,
            "max_window_layers": -1,
        },
        "max_window_layers",
        id="qwen3-max_window_layers-negative",
    ),
    # use_sliding_window true without sliding_window: the classes would slide by their default 4096.
    pytest.param(
        {"model_type": "qwen2", "num_hidden_layers": 4, "use_sliding_window": True, "max_window_layers": 2},
        "sliding_window",
        id="qwen2-use_sliding_window-without-window",
    ),
    pytest.param(
        {"model_type": "qwen3_moe", "num_hidden_layers": 4, "use_sliding_window": True},
        "sliding_window",
        id="qwen3_moe-use_sliding_window-without-window",
    ),
    pytest.param(
        {
            "model_type": "qwen2_moe",
            "num_hidden_layers": 4,
            "use_sliding_window": True,
            "max_window_layers": 4,
        },
        "sliding_window",
        id="qwen2_moe-sliding-without-window",
    ),
    pytest.param(
        {
            "model_type": "qwen2",
            "num_hidden_layers": 2,
            "use_sliding_window": False,
            "sliding_window": 4096,
            "layer_types": [FULL, SLIDING],
        },
        "use_sliding_window",
        id="qwen2-layer_types-sliding-but-switched-off",
    ),
    pytest.param(
        {
            "model_type": "qwen2_moe",
            "num_hidden_layers": 2,
            "sliding_window": 4096,
            "layer_types": [SLIDING, FULL],
        },
        "use_sliding_window",
        id="qwen2_moe-layer_types-sliding-without-use_sliding_window",
    ),
    # A layer_types the model would not follow.
    pytest.param(
        {"model_type": "llama", "num_hidden_layers": 2, "layer_types": [FULL, SLIDING], "sliding_window": 64},
        "layer_types",
        id="llama-layer_types-sliding",
    ),
    pytest.param(
        {
            "model_type": "mistral",
            "num_hidden_layers": 2,
            "sliding_window": 64,
            "layer_types": [SLIDING, FULL],
        },
        "layer_types",
        id="mistral-layer_types-disagrees",
    ),
    pytest.param(
        {
            "model_type": "phi3",
            "num_hidden_layers": 2,
            "sliding_window": None,
            "layer_types": [SLIDING, SLIDING],
        },
        "layer_types",
        id="phi3-layer_types-disagrees",
    ),
    pytest.param(
        {"model_type": "olmo2", "num_hidden_layers": 2, "layer_types": [FULL]},
        "layer_types",
        id="olmo2-layer_types-short",
    ),
    pytest.param(
        {"model_type": "gemma", "num_hidden_layers": 2, "layer_types": "full_attention"},
        "layer_types",
        id="gemma-layer_types-str",
    ),
    pytest.param(
        {
            "model_type": "qwen3_moe",
            "num_hidden_layers": 2,
            "use_sliding_window": True,
            "sliding_window": 64,
            "layer_types": [FULL, FULL],
        },
        "layer_types",
        id="qwen3_moe-layer_types-disagrees",
    ),
    # layer_types labels and length.
    pytest.param(
        {
            "model_type": "gemma3_text",
            "num_hidden_layers": 2,
            "sliding_window": 64,
            "layer_types": [FULL, "chunked_attention"],
        },
        "layer_types[1]",
        id="gemma3-unknown-label",
    ),
    pytest.param(
        {
            "model_type": "gpt_oss",
            "num_hidden_layers": 3,
            "sliding_window": 128,
            "layer_types": [SLIDING, FULL],
        },
        "num_hidden_layers",
        id="gpt_oss-layer_types-length",
    ),
    # Gemma-3's pattern.
    pytest.param(
        {
            "model_type": "gemma3_text",
            "num_hidden_layers": 6,
            "sliding_window": 512,
            "sliding_window_pattern": 0,
        },
        "sliding_window_pattern",
        id="gemma3-pattern-0",
    ),
    pytest.param(
        {
            "model_type": "gemma3_text",
            "num_hidden_layers": 6,
            "sliding_window": 512,
            "sliding_window_pattern": "6",
        },
        "sliding_window_pattern",
        id="gemma3-pattern-str",
    ),
    # Bidirectional (encoder) Gemmas.
    pytest.param(
        {"model_type": "gemma", "num_hidden_layers": 2, "use_bidirectional_attention": True},
        "use_bidirectional_attention",
        id="gemma-bidirectional",
    ),
    pytest.param(
        {
            "model_type": "gemma2",
            "num_hidden_layers": 2,
            "sliding_window": 64,
            "use_bidirectional_attention": True,
        },
        "use_bidirectional_attention",
        id="gemma2-bidirectional",
    ),
    pytest.param(
        {
            "model_type": "gemma3_text",
            "num_hidden_layers": 2,
            "sliding_window": 512,
            "layer_types": [SLIDING, FULL],
            "use_bidirectional_attention": True,
        },
        "use_bidirectional_attention",
        id="gemma3-bidirectional",
    ),
    # num_hidden_layers.
    pytest.param({"model_type": "llama"}, "num_hidden_layers", id="llama-missing-layers"),
    pytest.param({"model_type": "qwen2", "num_hidden_layers": 0}, "num_hidden_layers", id="qwen2-no-layers"),
    pytest.param(
        {"model_type": "mistral", "sliding_window": 4096}, "num_hidden_layers", id="mistral-missing-layers"
    ),
    # Llama 4: chunked layers need their chunk; no_rope_layers and layer_types are checked.
    pytest.param(
        {"model_type": "llama4_text", "num_hidden_layers": 4},
        "attention_chunk_size",
        id="llama4_text-no-chunk",
    ),
    pytest.param(
        {"model_type": "llama4", "num_hidden_layers": 4}, "attention_chunk_size", id="llama4-no-chunk"
    ),
    pytest.param(
        {"model_type": "llama4_text", "num_hidden_layers": 4, "attention_chunk_size": 0},
        "attention_chunk_size",
        id="llama4-chunk-0",
    ),
    pytest.param(
        {
            "model_type": "llama4_text",
            "num_hidden_layers": 4,
            "attention_chunk_size": 8,
            "no_rope_layers": [1, 0],
        },
        "no_rope_layers",
        id="llama4-no_rope_layers-short",
    ),
    pytest.param(
        {
            "model_type": "llama4_text",
            "num_hidden_layers": 2,
            "attention_chunk_size": 8,
            "no_rope_layers": [1, 0, 1],
        },
        "no_rope_layers",
        id="llama4-no_rope_layers-long",
    ),
    pytest.param(
        {
            "model_type": "llama4_text",
            "num_hidden_layers": 2,
            "attention_chunk_size": 8,
            "no_rope_layers": [1, 2],
        },
        "no_rope_layers[1]",
        id="llama4-no_rope_layers-value",
    ),
    pytest.param(
        {
            "model_type": "llama4_text",
            "num_hidden_layers": 2,
            "attention_chunk_size": 8,
            "no_rope_layers": "11",
        },
        "no_rope_layers",
        id="llama4-no_rope_layers-str",
    ),
    pytest.param(
        {
            "model_type": "llama4_text",
            "num_hidden_layers": 2,
            "attention_chunk_size": 8,
            "layer_types": [SLIDING, FULL],
        },
        "layer_types[0]",
        id="llama4-sliding-label",
    ),
    pytest.param(
        {"model_type": "llama4_text", "num_hidden_layers": 4, "no_rope_layer_interval": 0},
        "no_rope_layer_interval",
        id="llama4-interval-0",
    ),
]


@pytest.mark.parametrize(("cfg", "field"), REFUSALS)
def test_refusal_names_the_field(cfg: dict[str, Any], field: str) -> None:
    refused(cfg, field)


def test_refusals_say_what_is_supported() -> None:
    message = refused({"model_type": "mistral", "num_hidden_layers": 4}, "sliding_window")
    assert "null" in message
    message = refused(
        {"model_type": "gemma3_text", "num_hidden_layers": 2, "layer_types": [FULL, "x"]}, "layer_types[1]"
    )
    assert "full_attention" in message and "sliding_attention" in message and "'x'" in message
    message = refused(
        {"model_type": "llama", "num_hidden_layers": 2, "layer_types": [FULL, SLIDING], "sliding_window": 64},
        "layer_types",
    )
    assert "ignores layer_types" in message
    message = refused({"model_type": "llama4", "num_hidden_layers": 4}, "attention_chunk_size")
    assert "missing" in message and "chunked_attention" in message
