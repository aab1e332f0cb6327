"""Families with mamba layers (mamba1 or mamba2 mixers, alone, next to attention, or in the same
layer as attention: Falcon-H1, Zamba2's hybrid layers), and the two mamba state kinds: the
per-layer state as the model's own cache stores it.

Layer layouts follow each model's own rule in ``transformers`` (its config class and modeling
file), in both config forms: the one ``transformers`` writes (``SomeConfig().to_dict()``) and the
one Hub checkpoints ship (legacy fields such as ``hybrid_override_pattern``, legacy labels
``mamba`` / ``attention``, which ``transformers`` remaps to ``linear_attention`` /
``full_attention``). State shapes are those the mixers hand to the model's cache
(``transformers.cache_utils.LinearAttentionLayer``: ``conv_states`` and ``recurrent_states``).
A layer that runs attention and a mamba2 mixer (``transformers`` labels it ``hybrid``; its cache
layer is a ``LinearAttentionAndFullAttentionLayer`` holding both) is read as ``"full+state"``:
two cache layers, its attention's and then its state's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

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
    num_layers,
    refuse,
)

__all__ = ["MAMBA_FAMILIES", "MAMBA_STATE_KINDS"]

# --- layer layouts ------------------------------------------------------------------------------

#: Labels of a mamba/attention hybrid's ``layer_types`` / ``layers_block_type``: the
#: ``transformers`` 5 names and the legacy ones Hub checkpoints ship.
_HYBRID_LABELS: dict[str, LayerKind] = {
    "linear_attention": "state",
    "mamba": "state",
    "full_attention": "full",
    "attention": "full",
}

#: Labels of an all-mamba model's (optional) ``layer_types``.
_MAMBA_ONLY_LABELS: dict[str, LayerKind] = {"linear_attention": "state", "mamba": "state"}

#: NemotronH's ``layers_block_type`` labels: ``moe`` and ``mlp`` blocks keep no cache.
_NEMOTRON_H_LABELS: dict[str, LayerKind] = {**_HYBRID_LABELS, "moe": "none", "mlp": "none"}

#: NemotronH's Hub-form ``hybrid_override_pattern``, one character per layer.
_NEMOTRON_H_PATTERN: dict[str, LayerKind] = {"M": "state", "*": "full", "-": "none", "E": "none"}

#: The keys an explicit per-layer list can have (``transformers`` aliases one to the other).
_LIST_KEYS = ("layer_types", "layers_block_type")


def _labelled(cfg: Config, key: str, labels: Mapping[str, LayerKind]) -> list[Layer] | None:
    """The layers of the label list ``cfg[key]`` (None when missing): each label through
    ``labels``; its length must match ``num_hidden_layers`` when that is given."""
    raw = cfg.get(key)
    if raw is None:
        return None
    if isinstance(raw, str) or not isinstance(raw, Sequence):
        raise refuse(key, raw, "a list of layer labels is needed")
    if not raw:
        raise ModelConfigError(f"config {key} is empty: a model needs at least one layer")
    out: list[Layer] = []
    for i, label in enumerate(raw):
        kind = labels.get(label) if isinstance(label, str) else None
        if kind is None:
            raise refuse(f"{key}[{i}]", label, f"supported labels: {', '.join(sorted(labels))}")
        out.append(Layer(kind))
    if cfg.get("num_hidden_layers") is not None and num_layers(cfg) != len(out):
        raise ModelConfigError(
            f"config {key} has {len(out)} entries but num_hidden_layers is {cfg['num_hidden_layers']}"
        )
    return out


def _listed(cfg: Config, labels: Mapping[str, LayerKind]) -> tuple[str, list[Layer]] | None:
    """The layers of an explicit ``layer_types`` or ``layers_block_type`` list, with the key read
    (None when the config has neither); when it has both, they must agree."""
    found = [(key, layers) for key in _LIST_KEYS if (layers := _labelled(cfg, key, labels)) is not None]
    if not found:
        return None
    (key, layers), *others = found
    for other, other_layers in others:
        if other_layers != layers:
            raise refuse(other, cfg[other], f"it disagrees with {key} = {cfg[key]!r}")
    return key, layers


def _attention_at(layers: Sequence[Layer]) -> list[int]:
    return [i for i, layer in enumerate(layers) if layer.kind == "full"]


def _agree(
    cfg: Config, listed: tuple[str, list[Layer]] | None, rule: list[Layer], fields: str
) -> list[Layer]:
    """``rule`` (the layers the model builds from ``fields``), after checking that an explicit
    list, when the config also has one, says the same."""
    if listed is not None and listed[1] != rule:
        key = listed[0]
        raise refuse(
            key,
            cfg[key],
            f"it disagrees with {fields}, from which the model builds its layers "
            f"(attention at layers {_attention_at(rule)} of {len(rule)})",
        )
    return rule


def _jamba(cfg: Config) -> list[Layer]:
    """Attention where ``i % attn_layer_period == attn_layer_offset``, mamba1 elsewhere
    (``JambaConfig.layers_block_type``; defaults 8 and 4 as in ``JambaConfig``)."""
    listed = _listed(cfg, _HYBRID_LABELS)
    period = config_int(cfg, "attn_layer_period", minimum=1, default=8)
    offset = config_int(cfg, "attn_layer_offset", minimum=0, default=4)
    if offset >= period:
        raise refuse("attn_layer_offset", offset, f"it must be smaller than attn_layer_period = {period}")
    rule = [Layer("full") if i % period == offset else Layer("state") for i in range(num_layers(cfg))]
    return _agree(cfg, listed, rule, f"attn_layer_period = {period} and attn_layer_offset = {offset}")


def _all_state(cfg: Config) -> list[Layer]:
    """Every layer a mamba mixer (Mamba, Mamba2): ``num_hidden_layers`` of them; an explicit
    list, when given, must say so too."""
    listed = _listed(cfg, _MAMBA_ONLY_LABELS)
    if listed is not None:
        return listed[1]
    return [Layer("state")] * num_layers(cfg)


def _bamba(cfg: Config) -> list[Layer]:
    """Attention at ``attn_layer_indices`` (none when missing, as in ``BambaConfig``), mamba2
    elsewhere (``BambaConfig.layers_block_type``)."""
    listed = _listed(cfg, _HYBRID_LABELS)
    count = num_layers(cfg)
    indices = config_int_list(cfg, "attn_layer_indices") or []
    for i, index in enumerate(indices):
        if index >= count:
            raise refuse(
                f"attn_layer_indices[{i}]",
                index,
                f"a layer index below num_hidden_layers = {count} is needed",
            )
    rule = [Layer("full") if i in indices else Layer("state") for i in range(count)]
    return _agree(cfg, listed, rule, f"attn_layer_indices = {indices}")


def _nemotron_h(cfg: Config) -> list[Layer]:
    """``layers_block_type`` (or its alias ``layer_types``); Hub form: ``hybrid_override_pattern``,
    one character per layer (``M`` mamba2, ``*`` attention, ``-`` MLP and ``E`` MoE without a
    cache), as ``NemotronHConfig._pattern_to_list`` reads it. The list wins over the pattern, as
    in ``NemotronHConfig``; a pattern whose length is not ``num_hidden_layers`` is refused."""
    listed = _listed(cfg, _NEMOTRON_H_LABELS)
    if listed is not None:
        return listed[1]
    pattern = cfg.get("hybrid_override_pattern")
    if pattern is None:
        raise ModelConfigError(
            "config layers_block_type (transformers form) and hybrid_override_pattern (Hub form) "
            "are both missing: which NemotronH layers are mamba2, attention or MLP cannot be known"
        )
    if not isinstance(pattern, str) or not pattern:
        raise refuse("hybrid_override_pattern", pattern, "a non-empty string of M, *, - and E is needed")
    out: list[Layer] = []
    for i, char in enumerate(pattern):
        kind = _NEMOTRON_H_PATTERN.get(char)
        if kind is None:
            raise refuse(
                f"hybrid_override_pattern[{i}]",
                char,
                "supported: M (mamba2), * (attention), - (MLP), E (MoE)",
            )
        out.append(Layer(kind))
    if cfg.get("num_hidden_layers") is not None and num_layers(cfg) != len(out):
        raise ModelConfigError(
            f"config hybrid_override_pattern has {len(out)} layers but num_hidden_layers is "
            f"{cfg['num_hidden_layers']}"
        )
    return out


def _granite_moe_hybrid(cfg: Config) -> list[Layer]:
    """``layer_types`` (or its alias ``layers_block_type``); when missing, every layer mamba2, as
    ``GraniteMoeHybridConfig`` builds it."""
    listed = _listed(cfg, _HYBRID_LABELS)
    if listed is not None:
        return listed[1]
    return [Layer("state")] * num_layers(cfg)


def _no_window(cfg: Config, family: str) -> None:
    """Refuse a ``sliding_window``: the family's attention attends the whole history in
    ``transformers`` (a full causal mask, a ``hybrid`` cache layer, never ``hybrid_sliding``),
    so what a window in its config would mean cannot be known."""
    value = cfg.get("sliding_window")
    if value is not None:
        raise refuse(
            "sliding_window",
            value,
            f"{family}'s attention attends the whole history in transformers (its cache layers are "
            f"'hybrid', never 'hybrid_sliding'); a windowed {family} is not supported (null or "
            f"missing is)",
        )


#: Falcon-H1's per-layer labels: every layer is ``hybrid`` (``FalconH1Config.layers_block_type``).
_FALCON_H1_LABELS: dict[str, LayerKind] = {"hybrid": "full+state"}


def _falcon_h1(cfg: Config) -> list[Layer]:
    """Every one of the ``num_hidden_layers`` layers runs attention and a mamba2 mixer side by
    side (``FalconH1DecoderLayer``; ``FalconH1Config.layers_block_type`` is ``'hybrid'`` for each,
    and no field makes a layer one or the other). A ``layers_block_type`` / ``layer_types`` list,
    which ``FalconH1Config`` cannot take (a read-only property), may only say so too; an
    ``attn_layer_indices`` that is not null is refused (the model ignores it and runs attention
    in every layer), as is a ``sliding_window``."""
    _no_window(cfg, "Falcon-H1")
    indices = cfg.get("attn_layer_indices")
    if indices is not None:
        raise refuse(
            "attn_layer_indices",
            indices,
            "Falcon-H1 runs attention and a mamba2 mixer in every layer (FalconH1Config has no such "
            "field and the model ignores it), so which layers it would pick cannot be known; null "
            "or missing is supported",
        )
    listed = _listed(cfg, _FALCON_H1_LABELS)
    if listed is not None:
        return listed[1]
    return [Layer("full+state")] * num_layers(cfg)


#: Zamba2's ``layers_block_type`` labels: ``hybrid`` (its shared attention block, then a mamba2
#: mixer), and a mamba2 layer under its ``transformers`` 5 name and the legacy one Hub
#: checkpoints ship (``Zamba2Config`` remaps ``mamba`` to ``linear_attention``).
_ZAMBA2_LABELS: dict[str, LayerKind] = {
    "linear_attention": "state",
    "mamba": "state",
    "hybrid": "full+state",
}


def _zamba2(cfg: Config) -> list[Layer]:
    """``layers_block_type`` (or its alias ``layer_types``): ``hybrid`` layers run the shared
    attention block (its K/V cached per hybrid layer: ``Zamba2Attention`` updates the cache at the
    layer's own index) and then a mamba2 mixer; ``mamba`` / ``linear_attention`` layers the mixer
    alone (``Zamba2Model.get_layers``). A missing list is refused (``Zamba2Config`` would build
    Zamba2-2.7B's 54-layer default whatever ``num_hidden_layers`` says); the Hub form's
    ``hybrid_layer_ids``, which the model's adapters are keyed by, must name the same layers."""
    _no_window(cfg, "Zamba2")
    listed = _listed(cfg, _ZAMBA2_LABELS)
    if listed is None:
        raise ModelConfigError(
            "config layers_block_type (or layer_types) is missing: which Zamba2 layers are 'hybrid' "
            "(shared attention + mamba2) and which 'mamba' cannot be known (Zamba2Config would build "
            "Zamba2-2.7B's 54-layer default, whatever num_hidden_layers and hybrid_layer_ids say)"
        )
    key, layers = listed
    hybrid = [i for i, layer in enumerate(layers) if layer.kind == "full+state"]
    ids = config_int_list(cfg, "hybrid_layer_ids")
    if ids is not None and ids != hybrid:
        raise refuse(
            "hybrid_layer_ids",
            ids,
            f"it disagrees with {key}, whose 'hybrid' layers are {hybrid} (the model builds its "
            f"layers from {key} and keys its shared-attention adapters by hybrid_layer_ids)",
        )
    return layers


#: Zamba2's attention head dim and its alias (``Zamba2Config.attribute_map``).
_ZAMBA2_HEAD_DIM_KEYS = ("attention_head_dim", "head_dim")


def _zamba2_kv_shape(cfg: Config) -> tuple[int, int]:
    """``Zamba2Attention``'s K/V: ``num_key_value_heads`` heads (default ``num_attention_heads``)
    of ``attention_head_dim`` (alias ``head_dim``), which ``Zamba2Config`` sets to
    ``2 * hidden_size // num_attention_heads`` when the config does not give it: the shared block
    attends over the hidden state concatenated with the embeddings (``attention_hidden_size =
    2 * hidden_size``), not over ``hidden_size``."""
    heads = config_int(cfg, "num_attention_heads", minimum=1)
    kv_heads = config_int(cfg, "num_key_value_heads", minimum=1, default=heads)
    if heads % kv_heads:
        raise refuse("num_key_value_heads", kv_heads, f"it must divide num_attention_heads = {heads}")
    if any(cfg.get(key) is not None for key in _ZAMBA2_HEAD_DIM_KEYS):
        return kv_heads, _aliased_int(cfg, _ZAMBA2_HEAD_DIM_KEYS)
    hidden = config_int(cfg, "hidden_size", minimum=1)
    if 2 * hidden < heads:
        raise refuse(
            "num_attention_heads",
            heads,
            f"2 * hidden_size = {2 * hidden} over it is a head dim of 0 (give attention_head_dim)",
        )
    return kv_heads, 2 * hidden // heads


MAMBA_FAMILIES: tuple[Family, ...] = (
    Family(
        "Jamba",
        ("jamba",),
        _jamba,
        "`attn_layer_period` / `attn_layer_offset` (defaults 8 / 4) and `num_hidden_layers`, both "
        "forms; a `layer_types` / `layers_block_type` list, if given, must agree",
        state="mamba1",
    ),
    Family(
        "Mamba",
        ("mamba",),
        _all_state,
        "`num_hidden_layers`, every layer mamba1 (a `layer_types` list, if given, must say so)",
        state="mamba1",
    ),
    Family(
        "Mamba-2",
        ("mamba2",),
        _all_state,
        "`num_hidden_layers`, every layer mamba2 (a `layer_types` list, if given, must say so)",
        state="mamba2",
    ),
    Family(
        "Bamba",
        ("bamba",),
        _bamba,
        "`attn_layer_indices` (missing: none) and `num_hidden_layers`, both forms; a `layer_types` / "
        "`layers_block_type` list, if given, must agree",
        state="mamba2",
    ),
    Family(
        "Nemotron-H",
        ("nemotron_h",),
        _nemotron_h,
        "`layers_block_type` (or `layer_types`); Hub form: `hybrid_override_pattern` (`M` mamba2, "
        "`*` attention, `-` MLP and `E` MoE without a cache), matching `num_hidden_layers`",
        state="mamba2",
    ),
    Family(
        "GraniteMoeHybrid (Granite 4.0)",
        ("granitemoehybrid",),
        _granite_moe_hybrid,
        "`layer_types` (or `layers_block_type`; labels `mamba` / `linear_attention`, `attention` / "
        "`full_attention`), both forms; missing: every layer mamba2",
        state="mamba2",
    ),
    Family(
        "Falcon-H1",
        ("falcon_h1",),
        _falcon_h1,
        "`num_hidden_layers`, both forms: every layer attention + mamba2, two cache layers each "
        "(full, then state); `sliding_window` and `attn_layer_indices` refused unless null",
        state="mamba2",
    ),
    Family(
        "Zamba2",
        ("zamba2",),
        _zamba2,
        "`layers_block_type` (or `layer_types`; required), both forms: `mamba` / `linear_attention` "
        "mamba2, `hybrid` shared attention + mamba2 (two cache layers: full, then state); a "
        "`hybrid_layer_ids` must agree; K/V heads of `attention_head_dim` (default `2 * hidden_size "
        "// num_attention_heads`)",
        state="mamba2",
        kv_shape=_zamba2_kv_shape,
    ),
)

# --- state kinds --------------------------------------------------------------------------------

_SSM_DTYPES = ("float32", "bfloat16", "float16")


def _ssm_dtype(cfg: Config) -> str:
    """The recurrent state's dtype: float32, the dtype of the scan's final state that the mixers
    hand to the cache, unless the config names one (``mamba_ssm_cache_dtype``, NemotronH;
    ``mamba_ssm_dtype``)."""
    for key in ("mamba_ssm_cache_dtype", "mamba_ssm_dtype"):
        value = config_str(cfg, key)
        if value is not None:
            if value not in _SSM_DTYPES:
                raise refuse(key, value, f"supported: {', '.join(_SSM_DTYPES)}")
            return value
    return "float32"


def _aliased_int(cfg: Config, keys: tuple[str, ...], *, minimum: int = 1) -> int:
    """The int of the first of ``keys`` the config has (aliases of one field); they must agree
    when it has several."""
    present = [key for key in keys if cfg.get(key) is not None]
    if not present:
        raise ModelConfigError(f"config {' / '.join(keys)} is missing (an int >= {minimum} is needed)")
    first = config_int(cfg, present[0], minimum=minimum)
    for other in present[1:]:
        if config_int(cfg, other, minimum=minimum) != first:
            raise refuse(other, cfg[other], f"it disagrees with {present[0]} = {first}")
    return first


def _expanded(cfg: Config, expand_key: str) -> int:
    """``expand * hidden_size``: the mixer's inner size in Mamba, Jamba, Bamba and Granite."""
    return config_int(cfg, expand_key, minimum=1) * config_int(cfg, "hidden_size", minimum=1)


def _model_type(cfg: Config, kind: str, readers: Mapping[str, object]) -> str:
    model_type = cfg.get("model_type")
    if not isinstance(model_type, str) or model_type not in readers:
        raise refuse("model_type", model_type, f"the {kind} state is read for: {', '.join(sorted(readers))}")
    return model_type


#: Mamba1 sizes per model_type: (inner size, state size, conv kernel).
_MAMBA1_SIZES: dict[str, Callable[[Config], tuple[int, int, int]]] = {
    # MambaMixer: intermediate_size = int(expand * hidden_size) (MambaConfig.__post_init__
    # overwrites any intermediate_size in config.json), state_size, conv_kernel.
    "mamba": lambda cfg: (
        _expanded(cfg, "expand"),
        config_int(cfg, "state_size", minimum=1),
        config_int(cfg, "conv_kernel", minimum=2),
    ),
    # JambaMambaMixer: mamba_expand * hidden_size, mamba_d_state, mamba_d_conv.
    "jamba": lambda cfg: (
        _expanded(cfg, "mamba_expand"),
        config_int(cfg, "mamba_d_state", minimum=1),
        config_int(cfg, "mamba_d_conv", minimum=2),
    ),
}


def _mamba1(cfg: Config) -> tuple[StateComponent, ...]:
    """Mamba1 (Mamba, Jamba): a causal-conv window over the inner channels, and the selective
    scan's state per inner channel."""
    inner, state, kernel = _MAMBA1_SIZES[_model_type(cfg, "mamba1", _MAMBA1_SIZES)](cfg)
    return (
        StateComponent("conv", (inner, kernel - 1), "model"),
        StateComponent("ssm", (inner, state), _ssm_dtype(cfg)),
    )


def _mamba2_head_dim(
    cfg: Config,
    inner: int,
    heads: int,
    *,
    key: str = "mamba_d_head",
    heads_key: str = "mamba_n_heads",
    inner_name: str = "mamba_expand * hidden_size",
    auto: bool = True,
) -> int:
    """The mixer's head dim ``cfg[key]`` (``mamba_d_head`` in Bamba, Granite and Falcon-H1): an
    int, or when missing (or ``"auto"``, where ``auto``) ``inner // heads``, as the configs'
    ``__post_init__`` computes it; ``heads`` must then divide ``inner``."""
    value = cfg.get(key)
    if value is None or (auto and value == "auto"):
        if inner % heads:
            raise refuse(heads_key, heads, f"it must divide {inner_name} = {inner}")
        return inner // heads
    return config_int(cfg, key, minimum=1)


def _bamba_sizes(cfg: Config) -> tuple[int, int, int, int, int, int]:
    # BambaMixer / GraniteMoeHybridMambaLayer: intermediate_size = int(mamba_expand * hidden_size).
    inner = _expanded(cfg, "mamba_expand")
    heads = config_int(cfg, "mamba_n_heads", minimum=1)
    return (
        inner,
        heads,
        _mamba2_head_dim(cfg, inner, heads),
        config_int(cfg, "mamba_n_groups", minimum=1),
        config_int(cfg, "mamba_d_state", minimum=1),
        config_int(cfg, "mamba_d_conv", minimum=2),
    )


def _falcon_h1_sizes(cfg: Config) -> tuple[int, int, int, int, int, int]:
    # FalconH1Mixer: intermediate_size = mamba_d_ssm, or int(mamba_expand * hidden_size) when it is
    # null; otherwise Bamba's fields.
    if cfg.get("mamba_d_ssm") is not None:
        inner, inner_name = config_int(cfg, "mamba_d_ssm", minimum=1), "mamba_d_ssm"
    else:
        inner, inner_name = _expanded(cfg, "mamba_expand"), "mamba_expand * hidden_size"
    heads = config_int(cfg, "mamba_n_heads", minimum=1)
    return (
        inner,
        heads,
        _mamba2_head_dim(cfg, inner, heads, inner_name=inner_name),
        config_int(cfg, "mamba_n_groups", minimum=1),
        config_int(cfg, "mamba_d_state", minimum=1),
        config_int(cfg, "mamba_d_conv", minimum=2),
    )


def _zamba2_sizes(cfg: Config) -> tuple[int, int, int, int, int, int]:
    # Zamba2MambaMixer: intermediate_size = int(mamba_expand * hidden_size), n_mamba_heads heads of
    # mamba_headdim (Zamba2Config: that size // n_mamba_heads when missing), mamba_ngroups groups.
    inner = _expanded(cfg, "mamba_expand")
    heads = config_int(cfg, "n_mamba_heads", minimum=1)
    return (
        inner,
        heads,
        _mamba2_head_dim(cfg, inner, heads, key="mamba_headdim", heads_key="n_mamba_heads", auto=False),
        config_int(cfg, "mamba_ngroups", minimum=1),
        config_int(cfg, "mamba_d_state", minimum=1),
        config_int(cfg, "mamba_d_conv", minimum=2),
    )


def _nemotron_h_sizes(cfg: Config) -> tuple[int, int, int, int, int, int]:
    # NemotronHMamba2Mixer: intermediate_size = mamba_num_heads * mamba_head_dim; n_groups and
    # conv_kernel may come under their legacy names (NemotronHConfig.__post_init__).
    heads = config_int(cfg, "mamba_num_heads", minimum=1)
    head_dim = config_int(cfg, "mamba_head_dim", minimum=1)
    return (
        heads * head_dim,
        heads,
        head_dim,
        _aliased_int(cfg, ("n_groups", "mamba_n_groups")),
        config_int(cfg, "ssm_state_size", minimum=1),
        _aliased_int(cfg, ("conv_kernel", "mamba_d_conv"), minimum=2),
    )


#: Mamba2 sizes per model_type: (inner size, heads, head dim, groups, state size, conv kernel).
_MAMBA2_SIZES: dict[str, Callable[[Config], tuple[int, int, int, int, int, int]]] = {
    # Mamba2Mixer: intermediate_size = int(expand * hidden_size).
    "mamba2": lambda cfg: (
        _expanded(cfg, "expand"),
        config_int(cfg, "num_heads", minimum=1),
        config_int(cfg, "head_dim", minimum=1),
        config_int(cfg, "n_groups", minimum=1),
        config_int(cfg, "state_size", minimum=1),
        config_int(cfg, "conv_kernel", minimum=2),
    ),
    "bamba": _bamba_sizes,
    "granitemoehybrid": _bamba_sizes,
    "nemotron_h": _nemotron_h_sizes,
    "falcon_h1": _falcon_h1_sizes,
    "zamba2": _zamba2_sizes,
}


#: Mamba2's field names per model_type: (heads, head dim, groups), for the errors.
_MAMBA2_FIELDS: dict[str, tuple[str, str, str]] = {
    "mamba2": ("num_heads", "head_dim", "n_groups"),
    "bamba": ("mamba_n_heads", "mamba_d_head", "mamba_n_groups"),
    "granitemoehybrid": ("mamba_n_heads", "mamba_d_head", "mamba_n_groups"),
    "nemotron_h": ("mamba_num_heads", "mamba_head_dim", "n_groups"),
    "falcon_h1": ("mamba_n_heads", "mamba_d_head", "mamba_n_groups"),
    "zamba2": ("n_mamba_heads", "mamba_headdim", "mamba_ngroups"),
}


def _mamba2(cfg: Config) -> tuple[StateComponent, ...]:
    """Mamba2 (Mamba2, Bamba, Nemotron-H, Granite 4.0, Falcon-H1, Zamba2): a causal-conv window
    over x, B and C (``inner + 2 * groups * state`` channels), and the SSD state per head."""
    model_type = _model_type(cfg, "mamba2", _MAMBA2_SIZES)
    inner, heads, head_dim, groups, state, kernel = _MAMBA2_SIZES[model_type](cfg)
    heads_key, head_dim_key, groups_key = _MAMBA2_FIELDS[model_type]
    if heads * head_dim != inner:
        raise ModelConfigError(
            f"config {heads_key} = {heads} times {head_dim_key} = {head_dim} is {heads * head_dim}, "
            f"not the mixer's inner size {inner}: the model could not run this config"
        )
    if heads % groups:
        raise refuse(groups_key, groups, f"it must divide {heads_key} = {heads}")
    return (
        StateComponent("conv", (inner + 2 * groups * state, kernel - 1), "model"),
        StateComponent("ssm", (heads, head_dim, state), _ssm_dtype(cfg)),
    )


_CONV_LAYOUT = (
    "conv keeps `kernel - 1` columns (the model's own cache, transformers' LinearAttentionLayer, keeps "
    "`kernel`: the last `kernel` inputs)"
)

MAMBA_STATE_KINDS: tuple[StateKind, ...] = (
    StateKind(
        "mamba1",
        "Mamba (selective scan)",
        _mamba1,
        layout=_CONV_LAYOUT,
    ),
    StateKind(
        "mamba2",
        "Mamba-2 (SSD)",
        _mamba2,
        layout=_CONV_LAYOUT,
    ),
)
