"""The pieces of the model-family table (:mod:`flat_kvcache.families`): what one family entry says
and how a config is turned into cache layers.

A *family* maps the config fields of one kind of model (by ``model_type``) to a kind per model
layer: full attention, sliding-window attention with its window, chunked local attention with
its chunk (Llama 4), a recurrent state of a named *state kind*, attention and a state together
(a layer that runs both, as in Falcon-H1 and Zamba2: it becomes two cache layers), or no cache
at all (an MLP-only layer). The readers never guess: a field they need
that is missing or holds a value they do not know is a :class:`~flat_kvcache.errors.ModelConfigError`
naming the field, the value and what is supported.

This module imports neither torch nor the native extension.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from flat_kvcache._types import CHUNKED_ATTENTION, FULL_ATTENTION, LINEAR_ATTENTION, SLIDING_ATTENTION
from flat_kvcache.errors import ModelConfigError

__all__ = [
    "ATTENTION_LABELS",
    "Config",
    "Family",
    "Layer",
    "LayerKind",
    "ModelLayers",
    "StateComponent",
    "StateKind",
    "config_bool",
    "config_int",
    "config_int_list",
    "config_str",
    "layers_from_layer_types",
    "num_layers",
    "refuse",
]

#: A loaded model config (``text_config`` already merged over the top level).
Config = Mapping[str, Any]

#: What a model layer keeps between steps. ``"full+state"`` and ``"sliding+state"`` are a layer
#: that runs attention and a recurrent mixer side by side and keeps both K/V and a state: it
#: becomes two cache layers, its attention's and then its state's (:func:`model_layers`).
LayerKind = Literal["full", "sliding", "chunked", "state", "full+state", "sliding+state", "none"]


@dataclass(frozen=True)
class Layer:
    """One model layer as the cache sees it: its kind, and its window when sliding (also
    ``"sliding+state"``: its attention's window) or its attention chunk ``C`` when chunked (the
    token at ``t`` attends ``[t - t % C, t]``)."""

    kind: LayerKind
    window: int | None = None


@dataclass(frozen=True)
class StateComponent:
    """One tensor of a state layer's state: its per-layer shape and dtype.

    ``dtype`` is a torch dtype name (``"float32"``, ``"bfloat16"``...) or ``"model"``, the
    model's own dtype (``torch_dtype``).
    """

    name: str
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class StateKind:
    """A kind of recurrent state (GDN, mamba1, mamba2, ...).

    ``components`` computes the per-layer state from a config, laid out as the model's own cache
    stores it (``layout`` says where this library's layout differs, if it does); None when its
    shapes are not supported yet, with ``refused`` saying why (sizing the memory then raises
    :class:`~flat_kvcache.errors.ModelConfigError` with that reason).
    """

    name: str
    description: str
    components: Callable[[Config], tuple[StateComponent, ...]] | None
    refused: str | None = None
    layout: str = ""


@dataclass(frozen=True)
class Family:
    """One row of the family table.

    ``layers`` reads every model layer's kind from a config of this family (both the form
    ``transformers`` writes and the form Hub checkpoints ship); ``reads`` names the fields it
    reads, for the documentation table; ``state`` is the family's state kind, if it has state
    layers. ``kv_shape`` gives ``(K/V heads, head dim)`` of its attention layers where the
    Hugging Face conventions (``num_key_value_heads``, else ``num_attention_heads``;
    ``head_dim``, else ``hidden_size // num_attention_heads``) are not what its model stores;
    None where they are. A family that cannot be served yet has ``refused`` set: reading its
    config raises :class:`~flat_kvcache.errors.ModelConfigError` with that reason.
    """

    name: str
    model_types: tuple[str, ...]
    layers: Callable[[Config], list[Layer]]
    reads: str
    state: str | None = None
    refused: str | None = None
    kv_shape: Callable[[Config], tuple[int, int]] | None = None


@dataclass(frozen=True)
class ModelLayers:
    """The cache layers of a model config: the result of :func:`flat_kvcache.families.read_model_layers`.

    ``layer_types`` has one label per *cache layer* (``full_attention``, ``sliding_attention``,
    ``chunked_attention``, ``linear_attention``), in model order; ``model_layers`` the model's
    layer index of each. A model layer that keeps one cache is one cache layer; an MLP-only layer
    is none (its index is missing); a model layer that holds both attention K/V and a state
    (Falcon-H1, Zamba2's hybrid layers) is two adjacent cache layers with the same index: its
    attention's (``full_attention`` or ``sliding_attention``) first, then its state's
    (``linear_attention``). So ``model_layers`` is increasing, an index repeated only by such a
    pair. ``sliding_window`` is None, one int for every sliding and chunked layer, or one entry
    per cache layer (a chunked layer's entry is its chunk, as the sizing API reads it);
    ``state_kind`` names the state of the ``linear_attention`` layers. ``num_model_layers``
    counts the model's layers (MLP-only ones included).
    """

    family: str
    model_type: str | None
    layer_types: tuple[str, ...]
    model_layers: tuple[int, ...]
    sliding_window: int | tuple[int | None, ...] | None
    state_kind: str | None
    num_model_layers: int


#: The attention labels most families write in ``layer_types``, with their layer kinds.
ATTENTION_LABELS: Mapping[str, LayerKind] = {"full_attention": "full", "sliding_attention": "sliding"}

_LABEL_OF_KIND: dict[str, str] = {
    "full": FULL_ATTENTION,
    "sliding": SLIDING_ATTENTION,
    "chunked": CHUNKED_ATTENTION,
    "state": LINEAR_ATTENTION,
}

#: The kinds whose layers carry a window entry: a sliding window, or an attention chunk.
_WINDOWED_KINDS = frozenset({"sliding", "chunked"})

#: The cache layers of a model layer of each kind, in order: a layer that holds both is its
#: attention's cache layer, then its state's.
_CACHE_KINDS: Mapping[str, tuple[str, ...]] = {
    "full": ("full",),
    "sliding": ("sliding",),
    "chunked": ("chunked",),
    "state": ("state",),
    "full+state": ("full", "state"),
    "sliding+state": ("sliding", "state"),
    "none": (),
}


def model_layers(family: Family, model_type: str | None, layers: Sequence[Layer]) -> ModelLayers:
    """Cache layers from every model layer's kind (windows collapsed to one int when they agree;
    a chunked layer's entry is its chunk). A layer that holds both becomes two cache layers with
    its index: its attention's (with its window, if it slides), then its state's."""
    kept = [
        (i, kind, layer.window if kind in _WINDOWED_KINDS else None)
        for i, layer in enumerate(layers)
        for kind in _CACHE_KINDS[layer.kind]
    ]
    windows = {entry for _, kind, entry in kept if kind in _WINDOWED_KINDS}
    window: int | tuple[int | None, ...] | None
    if not windows:
        window = None
    elif len(windows) == 1:
        window = next(iter(windows))
    else:
        window = tuple(entry for _, _, entry in kept)
    has_state = any(kind == "state" for _, kind, _ in kept)
    return ModelLayers(
        family=family.name,
        model_type=model_type,
        layer_types=tuple(_LABEL_OF_KIND[kind] for _, kind, _ in kept),
        model_layers=tuple(i for i, _, _ in kept),
        sliding_window=window,
        state_kind=family.state if has_state else None,
        num_model_layers=len(layers),
    )


# --- field readers: each names the field in its error -------------------------------------------


def refuse(field: str, value: object, supported: str) -> ModelConfigError:
    """The error for a config field whose value this library cannot read right."""
    return ModelConfigError(f"config {field} = {value!r}: {supported}")


def config_int(cfg: Config, key: str, *, minimum: int = 0, default: int | None = None) -> int:
    """``cfg[key]`` as an int (not a bool) >= ``minimum``; ``default`` when missing or None
    (without a default, a missing key is an error)."""
    value = cfg.get(key)
    if value is None:
        if default is not None:
            return default
        raise ModelConfigError(f"config {key} is missing (an int >= {minimum} is needed)")
    if isinstance(value, bool) or not isinstance(value, int):
        raise refuse(key, value, f"an int >= {minimum} is needed")
    if value < minimum:
        raise refuse(key, value, f"an int >= {minimum} is needed")
    return value


def config_bool(cfg: Config, key: str, *, default: bool) -> bool:
    """``cfg[key]`` as a bool; ``default`` when missing or None."""
    value = cfg.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise refuse(key, value, "true or false is needed")
    return value


def config_str(cfg: Config, key: str) -> str | None:
    """``cfg[key]`` as a str, or None when missing."""
    value = cfg.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise refuse(key, value, "a string is needed")
    return value


def config_int_list(cfg: Config, key: str, *, minimum: int = 0) -> list[int] | None:
    """``cfg[key]`` as a list of ints >= ``minimum``, or None when missing."""
    value = cfg.get(key)
    if value is None:
        return None
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise refuse(key, value, "a list of ints is needed")
    out: list[int] = []
    for i, item in enumerate(value):
        if isinstance(item, bool) or not isinstance(item, int) or item < minimum:
            raise refuse(f"{key}[{i}]", item, f"an int >= {minimum} is needed")
        out.append(item)
    return out


def num_layers(cfg: Config) -> int:
    """``num_hidden_layers`` (required, >= 1)."""
    return config_int(cfg, "num_hidden_layers", minimum=1)


def _window(cfg: Config) -> int:
    """The config's single ``sliding_window`` (an int >= 1) for its sliding layers."""
    value = cfg.get("sliding_window")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise refuse("sliding_window", value, "sliding layers need an int window >= 1")
    return value


def layers_from_layer_types(
    cfg: Config,
    labels: Mapping[str, LayerKind],
    *,
    window: Callable[[Config, int], int | None] | None = None,
) -> list[Layer]:
    """Layers from an explicit ``layer_types`` list: each label through ``labels`` (its kind),
    sliding layers windowed by ``window(cfg, layer)`` (default: the config's ``sliding_window``;
    a per-layer list is read per layer). Its length must match ``num_hidden_layers`` when both
    are given; an unknown label is refused, naming the supported ones."""
    raw = cfg.get("layer_types")
    if isinstance(raw, str) or not isinstance(raw, Sequence):
        raise refuse("layer_types", raw, "a list of layer labels is needed")
    if cfg.get("num_hidden_layers") is not None and num_layers(cfg) != len(raw):
        raise ModelConfigError(
            f"config layer_types has {len(raw)} entries but num_hidden_layers is {cfg['num_hidden_layers']}"
        )
    out: list[Layer] = []
    for i, label in enumerate(raw):
        kind = labels.get(label) if isinstance(label, str) else None
        if kind is None:
            raise refuse(f"layer_types[{i}]", label, f"supported labels: {', '.join(sorted(labels))}")
        if kind == "sliding":
            out.append(Layer("sliding", window(cfg, i) if window is not None else _layer_window(cfg, i)))
        else:
            out.append(Layer(kind))
    if not out:
        raise ModelConfigError("config layer_types is empty: a model needs at least one layer")
    return out


def _layer_window(cfg: Config, layer: int) -> int:
    """The window of sliding layer ``layer``: the config's ``sliding_window``, or its entry
    ``layer`` when it is a per-layer list."""
    value = cfg.get("sliding_window")
    if isinstance(value, Sequence) and not isinstance(value, str):
        if layer >= len(value):
            raise refuse("sliding_window", value, f"a per-layer list needs an entry for layer {layer}")
        entry = value[layer]
        if isinstance(entry, bool) or not isinstance(entry, int) or entry < 1:
            raise refuse(f"sliding_window[{layer}]", entry, "a sliding layer needs an int window >= 1")
        return entry
    return _window(cfg)
