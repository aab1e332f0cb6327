"""Families whose state layers are linear attention or other non-mamba recurrences (Gated
DeltaNet, KDA, lightning attention, short convolutions, RG-LRU), and those state kinds: the
per-layer state as the model's own cache stores it.

Each reader follows the model's own config class in ``transformers`` (5.23): an explicit
``layer_types`` first, else the legacy fields Hub checkpoints ship, else the class's own default
pattern -- except where that default would make every layer full attention (LFM2 without
``full_attn_idxs``), which is refused rather than guessed. Sizes (windows, state dimensions) are
not defaulted -- a missing one is a :class:`~flat_kvcache.errors.ModelConfigError` -- except
where the config class derives them from other fields (OLMo-Hybrid's GDN heads and dims,
RecurrentGemma's ``lru_width``), which is done the same way here.

The conv states here keep ``kernel - 1`` columns, the previous inputs a causal convolution needs
for its next token (what vLLM keeps); ``transformers``' ``LinearAttentionLayer`` keeps ``kernel``
(its last write pads or slices to the kernel size). Each kind's ``layout`` says so where it differs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from flat_kvcache.errors import ModelConfigError
from flat_kvcache.families._base import (
    Config,
    Family,
    Layer,
    LayerKind,
    StateComponent,
    StateKind,
    config_int,
    config_int_list,
    config_str,
    layers_from_layer_types,
    num_layers,
    refuse,
)

__all__ = ["LINEAR_FAMILIES", "LINEAR_STATE_KINDS"]

#: ``layer_types`` labels of the families whose recurrent layers transformers labels
#: ``linear_attention``.
_LINEAR_LABELS: dict[str, LayerKind] = {"full_attention": "full", "linear_attention": "state"}


# --- Qwen3-Next / Qwen3.5 (Gated DeltaNet) --------------------------------------------------------


def _qwen3_next(cfg: Config) -> list[Layer]:
    """``layer_types`` (``linear_attention`` is a GDN layer); Hub form: every
    ``full_attention_interval``-th layer full attention, the others GDN (``Qwen3NextConfig`` /
    ``Qwen3_5TextConfig`` / ``Qwen3_5MoeTextConfig.__post_init__``, default interval 4)."""
    if cfg.get("layer_types") is not None:
        return layers_from_layer_types(cfg, _LINEAR_LABELS)
    interval = config_int(cfg, "full_attention_interval", minimum=1, default=4)
    return [Layer("full") if (i + 1) % interval == 0 else Layer("state") for i in range(num_layers(cfg))]


# --- OLMo-Hybrid (Gated DeltaNet) -------------------------------------------------------------------


def _olmo_hybrid(cfg: Config) -> list[Layer]:
    """``layer_types``; Hub form: ``OlmoHybridConfig.__post_init__``'s rule (every 4th layer,
    ``i % 4 == 3``, full attention; the last one when that gives none). Like its
    ``validate_architecture``, a model needs at least one layer of each kind."""
    if cfg.get("layer_types") is not None:
        layers = layers_from_layer_types(cfg, _LINEAR_LABELS)
        field = "layer_types"
    else:
        count = num_layers(cfg)
        layers = [Layer("full") if i % 4 == 3 else Layer("state") for i in range(count)]
        if all(layer.kind == "state" for layer in layers):
            layers[-1] = Layer("full")
        field = "num_hidden_layers"
    kinds = {layer.kind for layer in layers}
    if kinds != {"full", "state"}:
        shown = cfg.get(field)
        raise refuse(
            field, shown, "OLMo-Hybrid needs at least one linear_attention and one full_attention layer"
        )
    return layers


# --- Kimi-Linear (KDA) ------------------------------------------------------------------------------


def _sub_config(cfg: Config, key: str) -> Mapping[str, object]:
    """``cfg[key]`` as a mapping (empty when missing)."""
    value = cfg.get(key)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise refuse(key, value, "a mapping is needed")
    return value


def _one_based_layers(sub: Mapping[str, object], key: str, count: int) -> list[int]:
    """``linear_attn_config[key]``: 1-based layer numbers in ``1..count``, as 0-based indices."""
    field = f"linear_attn_config.{key}"
    value = sub.get(key)
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise refuse(field, value, "a list of 1-based layer numbers is needed")
    out: list[int] = []
    for i, item in enumerate(value):
        if isinstance(item, bool) or not isinstance(item, int) or not 1 <= item <= count:
            raise refuse(f"{field}[{i}]", item, f"a layer number in 1..{count} (num_hidden_layers) is needed")
        out.append(item - 1)
    return out


def _kimi_linear(cfg: Config) -> list[Layer]:
    """``layer_types``; Hub form: ``linear_attn_config.full_attn_layers`` / ``kda_layers``
    (1-based, every layer in exactly one); neither list: ``KimiLinearConfig.__post_init__``'s
    default (layer ``i`` full attention when ``i > 0 and i % 4 == 0``)."""
    if cfg.get("layer_types") is not None:
        return layers_from_layer_types(cfg, _LINEAR_LABELS)
    count = num_layers(cfg)
    sub = _sub_config(cfg, "linear_attn_config")
    has_full, has_kda = sub.get("full_attn_layers") is not None, sub.get("kda_layers") is not None
    if not has_full and not has_kda:
        return [Layer("full") if i and i % 4 == 0 else Layer("state") for i in range(count)]
    if not (has_full and has_kda):
        missing = "kda_layers" if has_full else "full_attn_layers"
        raise ModelConfigError(
            f"config linear_attn_config.{missing} is missing: both full_attn_layers and kda_layers "
            f"are needed (transformers ignores one list alone)"
        )
    kinds: list[LayerKind | None] = [None] * count
    lists: tuple[tuple[str, LayerKind], ...] = (("full_attn_layers", "full"), ("kda_layers", "state"))
    for key, kind in lists:
        for index in _one_based_layers(sub, key, count):
            if kinds[index] is not None:
                raise refuse(
                    f"linear_attn_config.{key}",
                    sub.get(key),
                    f"layer {index + 1} is in both full_attn_layers and kda_layers",
                )
            kinds[index] = kind
    out: list[Layer] = []
    for index, layer_kind in enumerate(kinds):
        if layer_kind is None:
            raise refuse(
                "linear_attn_config.kda_layers",
                sub.get("kda_layers"),
                f"layer {index + 1} is in neither full_attn_layers nor kda_layers",
            )
        out.append(Layer(layer_kind))
    return out


# --- MiniMax (lightning attention) ------------------------------------------------------------------


def _minimax_attention(cfg: Config) -> Layer:
    """MiniMax's softmax-attention layer: windowed by ``sliding_window`` when the config sets one
    (``MiniMaxAttention`` passes it to the attention and the model builds a sliding-window mask),
    else full attention."""
    if cfg.get("sliding_window") is None:
        return Layer("full")
    return Layer("sliding", config_int(cfg, "sliding_window", minimum=1))


def _minimax(cfg: Config) -> list[Layer]:
    """``layer_types``; Hub form: ``attn_type_list`` (0 lightning attention, 1 softmax
    attention, the remote-code ``MiniMaxText01`` / ``MiniMaxM1`` configs); neither, for
    ``model_type`` ``minimax``: ``MiniMaxConfig.__post_init__``'s default (even layers full)."""
    attention = _minimax_attention(cfg)
    if cfg.get("layer_types") is not None:
        labels: dict[str, LayerKind] = {"full_attention": attention.kind, "linear_attention": "state"}
        return layers_from_layer_types(cfg, labels)
    count = num_layers(cfg)
    types = config_int_list(cfg, "attn_type_list")
    if types is None:
        if cfg.get("model_type") != "minimax":
            raise ModelConfigError(
                "config attn_type_list is missing and there is no layer_types: which layers are "
                "lightning attention cannot be known"
            )
        return [attention if i % 2 == 0 else Layer("state") for i in range(count)]
    if len(types) != count:
        raise ModelConfigError(
            f"config attn_type_list has {len(types)} entries but num_hidden_layers is {count}"
        )
    out: list[Layer] = []
    for i, kind in enumerate(types):
        if kind not in (0, 1):
            raise refuse(
                f"attn_type_list[{i}]", kind, "0 (lightning attention) or 1 (softmax attention) is needed"
            )
        out.append(attention if kind == 1 else Layer("state"))
    if cfg.get("model_type") == "minimax" and types != [1 - i % 2 for i in range(count)]:
        # transformers' MiniMaxConfig has no attn_type_list: it builds its default alternation.
        raise refuse(
            "attn_type_list",
            types,
            "model_type 'minimax' is transformers' MiniMaxConfig, which ignores attn_type_list and "
            "builds even layers full attention, odd layers lightning; the model it runs would not "
            "have these layers (give layer_types, or the remote-code model_type minimax_text_01)",
        )
    return out


# --- LFM2 / LFM3 (short convolutions) ---------------------------------------------------------------


def _lfm2(cfg: Config) -> list[Layer]:
    """``layer_types`` (``conv`` is a short-conv layer); Hub form: ``full_attn_idxs`` (0-based
    attention layers, ``Lfm2Config.__post_init__``). Without it transformers makes every layer
    full attention, which is refused here; ``lfm2_moe`` has no such rule and needs
    ``layer_types``."""
    labels: dict[str, LayerKind] = {"full_attention": "full", "conv": "state"}
    if cfg.get("layer_types") is not None:
        return layers_from_layer_types(cfg, labels)
    if cfg.get("model_type") == "lfm2_moe":
        raise ModelConfigError(
            "config layer_types is missing: an lfm2_moe config (Lfm2MoeConfig) names its conv "
            "and full_attention layers only there"
        )
    count = num_layers(cfg)
    full = config_int_list(cfg, "full_attn_idxs")
    if full is None:
        raise ModelConfigError(
            "config full_attn_idxs is missing and there is no layer_types: transformers would "
            "make every layer full attention; give layer_types or full_attn_idxs"
        )
    for i, index in enumerate(full):
        if index >= count:
            raise refuse(
                f"full_attn_idxs[{i}]", index, f"a layer index < num_hidden_layers ({count}) is needed"
            )
    chosen = set(full)
    return [Layer("full") if i in chosen else Layer("state") for i in range(count)]


def _lfm3(cfg: Config) -> list[Layer]:
    """``layer_types`` (``conv``, ``sliding_attention`` windowed by ``sliding_window``,
    ``full_attention``); Hub form: ``Lfm3Config.__post_init__``'s default (layer ``i`` full when
    ``i % 4 == 2``, sliding when ``i % 4 == 0 and i > 0``, else conv)."""
    labels: dict[str, LayerKind] = {"full_attention": "full", "sliding_attention": "sliding", "conv": "state"}
    if cfg.get("layer_types") is not None:
        return layers_from_layer_types(cfg, labels)
    pattern = [
        "full_attention" if i % 4 == 2 else "sliding_attention" if i % 4 == 0 and i > 0 else "conv"
        for i in range(num_layers(cfg))
    ]
    return layers_from_layer_types({**cfg, "layer_types": pattern}, labels)


# --- RecurrentGemma (RG-LRU) ------------------------------------------------------------------------


def _recurrent_gemma(cfg: Config) -> list[Layer]:
    """``block_types`` repeated over ``num_hidden_layers`` (``RecurrentGemmaConfig.layers_block_type``;
    default ``recurrent, recurrent, attention``): ``recurrent`` is an RG-LRU layer, ``attention``
    local attention over ``attention_window_size`` tokens."""
    count = num_layers(cfg)
    raw = cfg.get("block_types")
    blocks: Sequence[object] = ("recurrent", "recurrent", "attention") if raw is None else raw
    if isinstance(blocks, str) or not isinstance(blocks, Sequence) or not blocks:
        raise refuse("block_types", raw, "a non-empty list of 'recurrent' / 'attention' is needed")
    window = config_int(cfg, "attention_window_size", minimum=1)
    out: list[Layer] = []
    for i in range(count):
        block = blocks[i % len(blocks)]
        if block == "recurrent":
            out.append(Layer("state"))
        elif block == "attention":
            out.append(Layer("sliding", window))
        else:
            raise refuse(f"block_types[{i % len(blocks)}]", block, "supported: attention, recurrent")
    return out


LINEAR_FAMILIES: tuple[Family, ...] = (
    Family(
        "Qwen3-Next / Qwen3.5",
        ("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"),
        _qwen3_next,
        "`layer_types`; Hub form: `full_attention_interval` (default 4)",
        state="gdn",
    ),
    Family(
        "OLMo-Hybrid",
        ("olmo_hybrid",),
        _olmo_hybrid,
        "`layer_types`; Hub form: every 4th layer full attention (the class's default)",
        state="olmo_hybrid_gdn",
    ),
    Family(
        "Kimi-Linear",
        ("kimi_linear",),
        _kimi_linear,
        "`layer_types`; Hub form: `linear_attn_config.full_attn_layers` / `kda_layers` (1-based)",
        state="kda",
    ),
    Family(
        "MiniMax",
        ("minimax", "minimax_text_01", "minimax_m1"),
        _minimax,
        "`layer_types`; Hub form: `attn_type_list` (0 lightning, 1 softmax; with `model_type` "
        "`minimax`, transformers' class, only the class's own alternation); `sliding_window` "
        "windows the softmax layers when set",
        state="lightning",
    ),
    Family(
        "LFM2",
        ("lfm2", "lfm2_vl", "lfm2_moe"),
        _lfm2,
        "`layer_types` (`conv`, `full_attention`); Hub form: `full_attn_idxs` (required)",
        state="short_conv",
    ),
    Family(
        "LFM3",
        ("lfm3", "lfm3_vl"),
        _lfm3,
        "`layer_types` (`conv`, `sliding_attention`, `full_attention`), `sliding_window`; Hub "
        "form: the class's default pattern",
        state="short_conv",
    ),
    Family(
        "RecurrentGemma",
        ("recurrent_gemma",),
        _recurrent_gemma,
        "`block_types` repeated over `num_hidden_layers` (both forms), `attention_window_size`",
        state="rg_lru",
    ),
)


# --- state kinds ------------------------------------------------------------------------------------


def _ssm_dtype(cfg: Config) -> str:
    """The recurrent state's dtype: float32, as the model's own cache keeps it, unless the
    config's ``mamba_ssm_dtype`` says otherwise (Qwen3.5 checkpoints ship it; vLLM and SGLang
    size the GDN / KDA state with it)."""
    return config_str(cfg, "mamba_ssm_dtype") or "float32"


def _gdn_from(
    cfg: Config, kernel: int, key_dim: int, key_heads: int, value_dim: int, value_heads: int
) -> tuple[StateComponent, ...]:
    conv_dim = 2 * key_heads * key_dim + value_heads * value_dim
    return (
        StateComponent("conv", (conv_dim, kernel - 1), "model"),
        StateComponent("ssm", (value_heads, key_dim, value_dim), _ssm_dtype(cfg)),
    )


def _gdn(cfg: Config) -> tuple[StateComponent, ...]:
    """Gated DeltaNet (Qwen3-Next, Qwen3.5): a causal-conv window over the q, k and v
    projections (``conv_dim = 2 * key_heads * key_dim + value_heads * value_dim`` channels, the
    activations' dtype), and the recurrent state per value head, float32 (the torch gated-delta
    rule computes and returns it in float32; see :func:`_ssm_dtype`)."""
    return _gdn_from(
        cfg,
        config_int(cfg, "linear_conv_kernel_dim", minimum=1),
        config_int(cfg, "linear_key_head_dim", minimum=1),
        config_int(cfg, "linear_num_key_heads", minimum=1),
        config_int(cfg, "linear_value_head_dim", minimum=1),
        config_int(cfg, "linear_num_value_heads", minimum=1),
    )


def _heads_or_attention_heads(cfg: Config, key: str) -> int:
    """``cfg[key]``, else ``num_attention_heads``."""
    if cfg.get(key) is not None:
        return config_int(cfg, key, minimum=1)
    return config_int(cfg, "num_attention_heads", minimum=1)


def _olmo_hybrid_gdn(cfg: Config) -> tuple[StateComponent, ...]:
    """OLMo-Hybrid's Gated DeltaNet: as :func:`_gdn`, its head counts and dims defaulted the way
    ``OlmoHybridConfig.__post_init__`` does (heads: ``num_attention_heads``; key dim:
    ``int(0.75 * hidden_size / key_heads)``; value dim: twice the key dim)."""
    key_heads = _heads_or_attention_heads(cfg, "linear_num_key_heads")
    value_heads = _heads_or_attention_heads(cfg, "linear_num_value_heads")
    if cfg.get("linear_key_head_dim") is None:
        key_dim = int(0.75 * config_int(cfg, "hidden_size", minimum=1) / key_heads)
        if key_dim < 1:
            raise refuse("hidden_size", cfg.get("hidden_size"), "too small for a key head dim >= 1")
    else:
        key_dim = config_int(cfg, "linear_key_head_dim", minimum=1)
    value_dim = config_int(cfg, "linear_value_head_dim", minimum=1, default=2 * key_dim)
    return _gdn_from(
        cfg,
        config_int(cfg, "linear_conv_kernel_dim", minimum=1),
        key_dim,
        key_heads,
        value_dim,
        value_heads,
    )


def _kda_field(cfg: Config, sub_key: str, key: str) -> int:
    """``linear_attn_config[sub_key]`` when given (it wins, as in ``KimiLinearConfig``), else
    ``cfg[key]``."""
    sub = _sub_config(cfg, "linear_attn_config")
    if sub.get(sub_key) is not None:
        return config_int(
            {f"linear_attn_config.{sub_key}": sub[sub_key]}, f"linear_attn_config.{sub_key}", minimum=1
        )
    if cfg.get(key) is None:
        raise ModelConfigError(
            f"config {key} (or linear_attn_config.{sub_key}) is missing (an int >= 1 is needed)"
        )
    return config_int(cfg, key, minimum=1)


def _kda(cfg: Config) -> tuple[StateComponent, ...]:
    """Kimi Delta Attention: one causal conv over the q, k and v projections (``3 * heads *
    head_dim`` channels, the activations' dtype) and a float32 ``head_dim x head_dim`` state per
    head (``KimiLinearDeltaAttention`` stores it ``.to(torch.float32)``; see :func:`_ssm_dtype`)."""
    heads = _kda_field(cfg, "num_heads", "linear_num_heads")
    head_dim = _kda_field(cfg, "head_dim", "linear_head_dim")
    kernel = _kda_field(cfg, "short_conv_kernel_size", "linear_conv_kernel_dim")
    return (
        StateComponent("conv", (3 * heads * head_dim, kernel - 1), "model"),
        StateComponent("ssm", (heads, head_dim, head_dim), _ssm_dtype(cfg)),
    )


def _lightning(cfg: Config) -> tuple[StateComponent, ...]:
    """MiniMax lightning attention: the decayed ``K^T V`` sum per attention head,
    ``head_dim x head_dim`` (``head_dim``, else ``hidden_size // num_attention_heads``), in the
    activations' dtype (``MiniMaxLightningAttention`` allocates it with ``value_states.dtype``)."""
    heads = config_int(cfg, "num_attention_heads", minimum=1)
    if cfg.get("head_dim") is not None:
        head_dim = config_int(cfg, "head_dim", minimum=1)
    else:
        head_dim = config_int(cfg, "hidden_size", minimum=1) // heads
        if head_dim < 1:
            raise refuse("hidden_size", cfg.get("hidden_size"), f"too small for {heads} heads")
    return (StateComponent("ssm", (heads, head_dim, head_dim), "model"),)


def _short_conv(cfg: Config) -> tuple[StateComponent, ...]:
    """LFM2 / LFM3 short convolution: a causal conv over ``B * x`` (``hidden_size`` channels,
    kernel ``conv_L_cache``), the activations' dtype; no recurrent state."""
    hidden = config_int(cfg, "hidden_size", minimum=1)
    kernel = config_int(cfg, "conv_L_cache", minimum=1)
    return (StateComponent("conv", (hidden, kernel - 1), "model"),)


def _rg_lru(cfg: Config) -> tuple[StateComponent, ...]:
    """RecurrentGemma recurrent block: the conv1d window (``conv1d_width - 1`` columns, the
    activations' dtype) and the RG-LRU hidden state (``lru_width``, float32), as
    ``RecurrentGemmaRecurrentBlock._setup_cache`` allocates them."""
    hidden = config_int(cfg, "hidden_size", minimum=1)
    lru_width = config_int(cfg, "lru_width", minimum=1, default=hidden)
    if lru_width != hidden:
        raise refuse(
            "lru_width",
            lru_width,
            f"only lru_width == hidden_size ({hidden}) is supported: the model's cache allocates "
            f"its conv1d state with hidden_size channels while its conv1d has lru_width",
        )
    width = config_int(cfg, "conv1d_width", minimum=1)
    return (
        StateComponent("conv", (hidden, width - 1), "model"),
        StateComponent("ssm", (lru_width,), "float32"),
    )


_CONV_LAYOUT = "conv keeps `{kernel} - 1` columns (the model's own cache keeps `{kernel}`)"

LINEAR_STATE_KINDS: tuple[StateKind, ...] = (
    StateKind(
        "gdn",
        "Gated DeltaNet",
        _gdn,
        layout=_CONV_LAYOUT.format(kernel="linear_conv_kernel_dim"),
    ),
    StateKind(
        "olmo_hybrid_gdn",
        "Gated DeltaNet (OLMo-Hybrid)",
        _olmo_hybrid_gdn,
        layout=_CONV_LAYOUT.format(kernel="linear_conv_kernel_dim"),
    ),
    StateKind(
        "kda",
        "Kimi Delta Attention",
        _kda,
        layout=_CONV_LAYOUT.format(kernel="short_conv_kernel_size")
        + "; q, k and v in one conv state, as the model keeps them",
    ),
    StateKind("lightning", "lightning attention", _lightning),
    StateKind(
        "short_conv",
        "short convolution",
        _short_conv,
        layout=_CONV_LAYOUT.format(kernel="conv_L_cache"),
    ),
    StateKind("rg_lru", "RG-LRU", _rg_lru),
)
