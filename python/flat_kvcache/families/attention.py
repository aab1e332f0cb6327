"""Attention-only families: every layer keeps K/V, for all of history or within a window.

Two kinds of reader, following what each model's ``transformers`` code reads (and Llama 4,
whose chunked local attention layers keep the tokens of their current chunk):

- Models that read ``layer_types`` (Qwen2, Qwen3, Qwen2-MoE, Ministral, Gemma-2, Gemma-3,
  GPT-OSS, Olmo3): an explicit ``layer_types`` is taken as it is; without one (the Hub form) the
  layout is rebuilt by the rule the config class's ``__post_init__`` uses.
- Models that ignore ``layer_types`` (Llama, Gemma, Olmo, Olmo2, Mistral, Ministral3, Phi3,
  Qwen3-MoE): the layout comes from the family's own fields; a ``layer_types`` in such a config is
  accepted only when it says the same, since the model would not follow it.

A missing field the layout depends on is refused, never replaced by a ``transformers`` class
default: ``sliding_window`` defaults to 4096 in several classes, so a missing one is not a null
one (null: no window).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from flat_kvcache.errors import ModelConfigError
from flat_kvcache.families._base import (
    ATTENTION_LABELS,
    Config,
    Family,
    Layer,
    LayerKind,
    config_bool,
    config_int,
    layers_from_layer_types,
    num_layers,
    refuse,
)

__all__ = ["ATTENTION_FAMILIES"]

_LABEL: dict[LayerKind, str] = {"full": "full_attention", "sliding": "sliding_attention"}


# --- shared pieces ------------------------------------------------------------------------------


def _sliding_window(cfg: Config) -> int:
    """The config's ``sliding_window`` for its sliding layers: required, an int >= 1."""
    if "sliding_window" not in cfg:
        raise ModelConfigError(
            "config sliding_window is missing: this config has sliding layers, which need an int window >= 1"
        )
    value = cfg["sliding_window"]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise refuse("sliding_window", value, "sliding layers need an int window >= 1")
    return value


def _window_or_none(cfg: Config) -> int | None:
    """``sliding_window`` where null means no window; a missing key is refused (several
    ``transformers`` classes default it to a window, so missing is not the same as null)."""
    if "sliding_window" not in cfg:
        raise ModelConfigError(
            "config sliding_window is missing: give the window (an int >= 1) or null for full attention"
        )
    if cfg["sliding_window"] is None:
        return None
    return _sliding_window(cfg)


def _pattern(cfg: Config, sliding: Callable[[int], bool]) -> list[Layer]:
    """``num_hidden_layers`` layers, layer ``i`` sliding (by the config's window) when
    ``sliding(i)``, else full."""
    slides = [sliding(i) for i in range(num_layers(cfg))]
    window = _sliding_window(cfg) if any(slides) else None
    return [Layer("sliding", window) if s else Layer("full") for s in slides]


def _layer_types_or(cfg: Config, rule: Callable[[Config], list[Layer]]) -> list[Layer]:
    """For a model that reads ``layer_types``: that list when given, else ``rule`` (the Hub form)."""
    if cfg.get("layer_types") is not None:
        return layers_from_layer_types(cfg, ATTENTION_LABELS)
    return rule(cfg)


def _ignoring_layer_types(cfg: Config, layers: list[Layer], rule: str) -> list[Layer]:
    """For a model that ignores ``layer_types``: ``layers`` (read by ``rule``), refusing a
    ``layer_types`` that says otherwise."""
    raw = cfg.get("layer_types")
    if raw is None:
        return layers
    expected = [_LABEL.get(layer.kind, layer.kind) for layer in layers]
    if isinstance(raw, str) or not isinstance(raw, Sequence) or list(raw) != expected:
        kinds = sorted(set(expected))
        raise refuse(
            "layer_types",
            raw,
            f"this model ignores layer_types and reads its layers from {rule}, which gives "
            f"{len(expected)} layers of {' / '.join(kinds)}; a layer_types that disagrees cannot be served",
        )
    return layers


def _all_full(rule: str) -> Callable[[Config], list[Layer]]:
    """Every layer full attention (a model with no sliding window)."""

    def read(cfg: Config) -> list[Layer]:
        return _ignoring_layer_types(cfg, [Layer("full")] * num_layers(cfg), rule)

    return read


def _causal(read: Callable[[Config], list[Layer]]) -> Callable[[Config], list[Layer]]:
    """``read``, refusing ``use_bidirectional_attention: true`` (Gemma encoders: not a causal
    model, no decode cache)."""

    def checked(cfg: Config) -> list[Layer]:
        if config_bool(cfg, "use_bidirectional_attention", default=False):
            raise refuse(
                "use_bidirectional_attention",
                True,
                "a bidirectional (encoder) model keeps no decode cache; only causal models (false) are read",
            )
        return read(cfg)

    return checked


# --- Mistral, Ministral3, Phi3: one window for every layer, or none -----------------------------


def _every_layer_window(cfg: Config) -> list[Layer]:
    """``sliding_window`` an int: every layer slides by it; null: every layer full."""
    window = _window_or_none(cfg)
    layer = Layer("full") if window is None else Layer("sliding", window)
    return _ignoring_layer_types(cfg, [layer] * num_layers(cfg), "sliding_window")


def _ministral(cfg: Config) -> list[Layer]:
    """``layer_types``; the Hub form: every layer slides when ``sliding_window`` is set."""
    if cfg.get("layer_types") is not None:
        return layers_from_layer_types(cfg, ATTENTION_LABELS)
    window = _window_or_none(cfg)
    return [Layer("full") if window is None else Layer("sliding", window)] * num_layers(cfg)


# --- Qwen: use_sliding_window gates sliding_window ----------------------------------------------


def _use_sliding_window(cfg: Config) -> bool:
    """``use_sliding_window``; needed whenever ``sliding_window`` is set (the Qwen configs drop
    the window unless it is true)."""
    if cfg.get("use_sliding_window") is None:
        if cfg.get("sliding_window") is None:
            return False
        raise ModelConfigError(
            f"config use_sliding_window is missing while sliding_window = {cfg['sliding_window']!r}: "
            "whether layers slide cannot be known (true or false is needed)"
        )
    return config_bool(cfg, "use_sliding_window", default=False)


def _qwen_window(cfg: Config, layer: int) -> int:
    """The window of a ``layer_types`` sliding layer of a Qwen config: only with
    ``use_sliding_window`` true (else the config drops ``sliding_window``)."""
    if cfg.get("use_sliding_window") is not True:
        raise refuse(
            "use_sliding_window",
            cfg.get("use_sliding_window"),
            f"layer_types[{layer}] is sliding_attention, but the model keeps sliding_window only "
            "when use_sliding_window is true",
        )
    return _sliding_window(cfg)


def _qwen_layers(sliding: Callable[[Config, int], bool]) -> Callable[[Config], list[Layer]]:
    """A Qwen reader: ``layer_types`` when given (sliding layers need ``use_sliding_window``);
    else, when ``use_sliding_window`` is true, layer ``i`` slides where ``sliding(cfg, i)``."""

    def read(cfg: Config) -> list[Layer]:
        if cfg.get("layer_types") is not None:
            return layers_from_layer_types(cfg, ATTENTION_LABELS, window=_qwen_window)
        if not _use_sliding_window(cfg):
            return [Layer("full")] * num_layers(cfg)
        return _pattern(cfg, lambda i: sliding(cfg, i))

    return read


def _max_window_layers(cfg: Config) -> int:
    return config_int(cfg, "max_window_layers")


#: Qwen2 / Qwen3 (``Qwen2Config.__post_init__``): layers from ``max_window_layers`` on slide,
#: when ``sliding_window`` is not null (a missing one is refused: the class default is 4096).
_qwen2 = _qwen_layers(lambda cfg, i: _window_or_none(cfg) is not None and i >= _max_window_layers(cfg))

#: Qwen2-MoE (``Qwen2MoeConfig.__post_init__``): even layers below ``max_window_layers`` slide.
_qwen2_moe = _qwen_layers(lambda cfg, i: i % 2 == 0 and i < _max_window_layers(cfg))


def _qwen3_moe(cfg: Config) -> list[Layer]:
    """Qwen3-MoE has no ``layer_types``: with ``use_sliding_window`` true and a window, every
    layer slides (its attention takes ``config.sliding_window`` in every layer)."""
    n = num_layers(cfg)
    window = _window_or_none(cfg) if _use_sliding_window(cfg) else None
    layers = [Layer("full") if window is None else Layer("sliding", window)] * n
    return _ignoring_layer_types(cfg, layers, "use_sliding_window and sliding_window")


# --- interleaved sliding/full: Gemma-2, Gemma-3, GPT-OSS, Olmo3 ---------------------------------


def _every_other(cfg: Config) -> list[Layer]:
    """Hub form of Gemma-2 and GPT-OSS: sliding and full alternating, sliding first."""
    return _pattern(cfg, lambda i: i % 2 == 0)


def _gemma3_hub(cfg: Config) -> list[Layer]:
    """Hub form of Gemma-3: every ``sliding_window_pattern``-th layer full (default 6, as
    ``Gemma3TextConfig`` reads it), the others sliding."""
    period = config_int(cfg, "sliding_window_pattern", minimum=1, default=6)
    return _pattern(cfg, lambda i: (i + 1) % period != 0)


def _olmo3_hub(cfg: Config) -> list[Layer]:
    """Hub form of Olmo3: every 4th layer full, the others sliding (``Olmo3Config``)."""
    return _pattern(cfg, lambda i: (i + 1) % 4 != 0)


# --- Llama 4: chunked local attention -----------------------------------------------------------

_LLAMA4_LABELS: dict[str, LayerKind] = {"full_attention": "full", "chunked_attention": "chunked"}


def _attention_chunk_size(cfg: Config) -> int:
    """``attention_chunk_size``: required (an int >= 1) when some layer is chunked (the model's
    chunked mask refuses a null one; a missing one is not the class default of 8192)."""
    if cfg.get("attention_chunk_size") is None:
        shown = "missing" if "attention_chunk_size" not in cfg else "null"
        raise ModelConfigError(
            f"config attention_chunk_size is {shown}: this config has chunked_attention layers, "
            "which need the attention chunk (an int >= 1)"
        )
    return config_int(cfg, "attention_chunk_size", minimum=1)


def _no_rope_layers(cfg: Config) -> list[bool]:
    """Per model layer, whether it uses RoPE (and so chunked attention): ``no_rope_layers`` when
    it is a non-empty list (1: RoPE, 0: NoPE; one entry per layer, as the class's
    ``layer_types`` check needs), else ``Llama4TextConfig.__post_init__``'s rule: every
    ``no_rope_layer_interval``-th layer (default 4) is NoPE."""
    n = num_layers(cfg)
    raw = cfg.get("no_rope_layers")
    if raw is not None and (isinstance(raw, str) or not isinstance(raw, Sequence)):
        raise refuse("no_rope_layers", raw, "a list of 0 / 1 per layer is needed")
    if raw:  # None or an empty list: the class builds the default (it tests the list's truth)
        if len(raw) != n:
            raise refuse(
                "no_rope_layers",
                raw,
                f"one entry (0 / 1) for each of the {n} layers (num_hidden_layers) is needed",
            )
        flags: list[bool] = []
        for i, value in enumerate(raw):
            if isinstance(value, bool) or value not in (0, 1):
                raise refuse(
                    f"no_rope_layers[{i}]", value, "0 (a NoPE, full attention layer) or 1 (RoPE, chunked)"
                )
            flags.append(value == 1)
        return flags
    interval = config_int(cfg, "no_rope_layer_interval", minimum=1, default=4)
    return [(i + 1) % interval != 0 for i in range(n)]


def _llama4(cfg: Config) -> list[Layer]:
    """Llama 4 (``Llama4TextModel``): each layer's mask is ``layer_types[i]``
    (``chunked_attention`` or ``full_attention``); the Hub form has no ``layer_types`` and the
    class builds it from ``no_rope_layers`` (RoPE layers chunked, NoPE layers full). Chunked
    layers attend ``attention_chunk_size`` tokens."""
    if cfg.get("layer_types") is not None:
        layers = layers_from_layer_types(cfg, _LLAMA4_LABELS)
    else:
        layers = [Layer("chunked") if rope else Layer("full") for rope in _no_rope_layers(cfg)]
    if not any(layer.kind == "chunked" for layer in layers):
        return layers
    chunk = _attention_chunk_size(cfg)
    return [Layer("chunked", chunk) if layer.kind == "chunked" else layer for layer in layers]


# --- the table ----------------------------------------------------------------------------------

ATTENTION_FAMILIES: tuple[Family, ...] = (
    Family(
        "Llama",
        ("llama",),
        _all_full("num_hidden_layers"),
        "`num_hidden_layers` (all full; a `layer_types` must agree)",
    ),
    Family(
        "Mistral",
        ("mistral", "mistral3", "ministral3"),
        _every_layer_window,
        "`sliding_window` (int: every layer slides; null: all full; a `layer_types` must agree)",
    ),
    Family(
        "Ministral",
        ("ministral",),
        _ministral,
        "`layer_types`; Hub form: `sliding_window` (int: every layer slides; null: all full)",
    ),
    Family(
        "Phi-3",
        ("phi3",),
        _every_layer_window,
        "`sliding_window` (int: every layer slides; null: all full; a `layer_types` must agree)",
    ),
    Family(
        "Qwen2 / Qwen3",
        ("qwen2", "qwen3"),
        _qwen2,
        "`layer_types` (sliding needs `use_sliding_window`); Hub form: `use_sliding_window`, "
        "`sliding_window`, layers from `max_window_layers` on slide",
    ),
    Family(
        "Qwen2-MoE",
        ("qwen2_moe",),
        _qwen2_moe,
        "`layer_types` (sliding needs `use_sliding_window`); Hub form: `use_sliding_window`, "
        "`sliding_window`, even layers below `max_window_layers` slide",
    ),
    Family(
        "Qwen3-MoE",
        ("qwen3_moe",),
        _qwen3_moe,
        "`use_sliding_window` and `sliding_window` (every layer slides, or none; a `layer_types` must agree)",
    ),
    Family(
        "Gemma",
        ("gemma",),
        _causal(_all_full("num_hidden_layers")),
        "`num_hidden_layers` (all full), `use_bidirectional_attention` (refused when true)",
    ),
    Family(
        "Gemma-2",
        ("gemma2",),
        _causal(lambda cfg: _layer_types_or(cfg, _every_other)),
        "`layer_types`; Hub form: sliding and full alternating, `sliding_window`; "
        "`use_bidirectional_attention` (refused when true)",
    ),
    Family(
        "Gemma-3",
        ("gemma3_text", "gemma3"),
        _causal(lambda cfg: _layer_types_or(cfg, _gemma3_hub)),
        "`layer_types`; Hub form: every `sliding_window_pattern`-th layer full (default 6), "
        "`sliding_window`; `use_bidirectional_attention` (refused when true)",
    ),
    Family(
        "GPT-OSS",
        ("gpt_oss",),
        lambda cfg: _layer_types_or(cfg, _every_other),
        "`layer_types`; Hub form: sliding and full alternating, `sliding_window`",
    ),
    Family(
        "Olmo / Olmo2",
        ("olmo", "olmo2"),
        _all_full("num_hidden_layers"),
        "`num_hidden_layers` (all full; a `layer_types` must agree)",
    ),
    Family(
        "Olmo3",
        ("olmo3",),
        lambda cfg: _layer_types_or(cfg, _olmo3_hub),
        "`layer_types`; Hub form: every 4th layer full, `sliding_window`",
    ),
    Family(
        "Llama 4",
        ("llama4", "llama4_text"),
        _llama4,
        "`layer_types` (`chunked_attention` / `full_attention`), `attention_chunk_size`; Hub form: "
        "`no_rope_layers` (1: chunked, 0: full; empty: every `no_rope_layer_interval`-th layer "
        "full, default 4)",
    ),
)
