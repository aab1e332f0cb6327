"""Families with mamba layers (mamba1 or mamba2 mixers, alone or next to attention), and the two
mamba state kinds: the per-layer state as the model's own cache stores it.

Layer layouts follow each model's own rule in ``transformers`` (its config class and modeling
file), in both config forms: the one ``transformers`` writes (``SomeConfig().to_dict()``) and the
one Hub checkpoints ship (legacy fields such as ``hybrid_override_pattern``, legacy labels
``mamba`` / ``attention``, which ``transformers`` remaps to ``linear_attention`` /
``full_attention``). State shapes are those the mixers hand to the model's cache
(``transformers.cache_utils.LinearAttentionLayer``: ``conv_states`` and ``recurrent_states``).
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


_FALCON_H1_REFUSED = (
    "every layer runs attention and a mamba2 mixer in parallel (FalconH1Config.layers_block_type is "
    "'hybrid' for each of the num_hidden_layers layers; no config field makes a layer one or the "
    "other), so each layer holds attention K/V and a mamba2 state together, and the engine has no "
    "layer kind that holds both yet"
)

_ZAMBA2_REFUSED = (
    "the 'hybrid' layers of layers_block_type (Hub form: layers_block_type with 'mamba' / 'hybrid', "
    "hybrid_layer_ids) run a shared attention block before their mamba2 mixer, and the model's cache "
    "keeps that block's K/V and the mamba2 state in the same layer (LinearAttentionAndFullAttentionLayer "
    "in transformers); the engine has no layer kind that holds both yet, and one model layer cannot be "
    "two cache layers"
)


def _refused(reason: str) -> Callable[[Config], list[Layer]]:
    """The reader of a refused family (never reached: the refusal comes first)."""

    def read(cfg: Config) -> list[Layer]:
        del cfg
        raise ModelConfigError(reason)

    return read


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
        _refused(_FALCON_H1_REFUSED),
        "`num_hidden_layers` (every layer attention + mamba2)",
        state="mamba2",
        refused=_FALCON_H1_REFUSED,
    ),
    Family(
        "Zamba2",
        ("zamba2",),
        _refused(_ZAMBA2_REFUSED),
        "`layers_block_type` (`mamba` / `linear_attention`, `hybrid`)",
        state="mamba2",
        refused=_ZAMBA2_REFUSED,
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


def _mamba2_head_dim(cfg: Config, inner: int, heads: int) -> int:
    """``mamba_d_head`` (Bamba, Granite): an int, or ``"auto"`` (the default when missing) for
    ``inner // mamba_n_heads``, as the configs' ``__post_init__`` computes it."""
    if cfg.get("mamba_d_head") in (None, "auto"):
        if inner % heads:
            raise refuse("mamba_n_heads", heads, f"it must divide mamba_expand * hidden_size = {inner}")
        return inner // heads
    return config_int(cfg, "mamba_d_head", minimum=1)


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
}


#: Mamba2's field names per model_type: (heads, head dim, groups), for the errors.
_MAMBA2_FIELDS: dict[str, tuple[str, str, str]] = {
    "mamba2": ("num_heads", "head_dim", "n_groups"),
    "bamba": ("mamba_n_heads", "mamba_d_head", "mamba_n_groups"),
    "granitemoehybrid": ("mamba_n_heads", "mamba_d_head", "mamba_n_groups"),
    "nemotron_h": ("mamba_num_heads", "mamba_head_dim", "n_groups"),
}


def _mamba2(cfg: Config) -> tuple[StateComponent, ...]:
    """Mamba2 (Mamba2, Bamba, Nemotron-H, Granite 4.0): a causal-conv window over x, B and C
    (``inner + 2 * groups * state`` channels), and the SSD state per head."""
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
