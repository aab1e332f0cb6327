"""ModelShape: what the KV cache needs to know about a model, from a config.json or a preset (private).

Public through :mod:`flat_kvcache.torch`.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal, TypeAlias

import torch

from flat_kvcache import (
    STATE_LAYER_TYPES,
    ComponentSpec,
    components_from_layers,
    layer_group_ids,
    state_const_bytes,
)
from flat_kvcache.config import load_model_config
from flat_kvcache.errors import ModelConfigError
from flat_kvcache.families import kv_shape, read_model_layers, state_components
from flat_kvcache.presets import PRESETS, get_preset, preset_names
from flat_kvcache.torch._checks import as_dtype, as_int, storage_dtype

__all__ = ["ModelShape"]

#: A sliding window: None, one int for every sliding (and chunked) layer, or one entry per layer
#: (a chunked layer's entry is its attention chunk).
SlidingWindow: TypeAlias = "int | Sequence[int | None] | None"

#: Which of a model layer's cache layers :meth:`ModelShape.cache_layer` is asked for.
CacheLayerKind: TypeAlias = Literal["attention", "state"]


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """What the KV cache needs to know about a model: its layers, K/V geometry and state shapes.

    Parameters
    ----------
    layer_types
        One label per layer: ``full_attention``, ``sliding_attention``, ``chunked_attention``
        (Llama 4's chunked local attention) or ``linear_attention``.
    sliding_window
        None, an int (broadcast to the sliding and chunked layers) or one entry per layer
        (SPEC 2). A chunked layer's entry is its attention chunk ``C``: it is sized as a sliding
        window of ``W = C``, and its memory components are K/V per token like a sliding
        layer's.
    num_kv_heads, head_dim
        K/V heads per attention layer and their size. K and V are separate tensors.
    kv_dtype
        Dtype of K/V (a ``torch.dtype`` or a name such as ``"bfloat16"`` or ``"fp8_e4m3"``).
        One-byte floats are stored as ``uint8``.
    state_shapes, state_dtypes
        For models with ``linear_attention`` layers: per state component (e.g. ``"conv"``,
        ``"ssm"``, in this order) the per-layer shape and dtype. Both mappings must name the same
        components.
    model_layers
        None (cache layer ``i`` is model layer ``i``), or the model's layer index of each cache
        layer: increasing, MLP-only model layers missing, and an index repeated only by a model
        layer that holds both attention K/V and a state (Falcon-H1, Zamba2's hybrid layers),
        which is two adjacent cache layers, its attention's first and then its state's
        (:class:`flat_kvcache.families.ModelLayers`). :meth:`cache_layer` maps back.
    """

    layer_types: tuple[str, ...]
    sliding_window: SlidingWindow = None
    num_kv_heads: int
    head_dim: int
    kv_dtype: torch.dtype
    state_shapes: Mapping[str, tuple[int, ...]] | None = field(default=None, hash=False)
    state_dtypes: Mapping[str, torch.dtype] | None = field(default=None, hash=False)
    model_layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.layer_types, str) or not isinstance(self.layer_types, Sequence):
            raise TypeError("layer_types must be a sequence of layer labels, not a str")
        layer_types = tuple(self.layer_types)
        if not layer_types:
            raise ValueError("layer_types is empty: a model needs at least one layer")
        window = self.sliding_window
        if isinstance(window, Sequence) and not isinstance(window, str):
            window = tuple(window)
        # The grouping validates every label and window (SPEC 2) with messages naming the layer.
        layer_group_ids(layer_types, window)
        set_ = object.__setattr__
        set_(self, "layer_types", layer_types)
        set_(self, "sliding_window", window)
        set_(self, "num_kv_heads", as_int(self.num_kv_heads, "num_kv_heads", minimum=1))
        set_(self, "head_dim", as_int(self.head_dim, "head_dim", minimum=1))
        set_(self, "kv_dtype", as_dtype(self.kv_dtype, "kv_dtype"))
        shapes, dtypes = self._state_fields(layer_types)
        set_(self, "state_shapes", shapes)
        set_(self, "state_dtypes", dtypes)
        set_(self, "model_layers", self._model_layers(layer_types))

    def _model_layers(self, layer_types: tuple[str, ...]) -> tuple[int, ...] | None:
        if self.model_layers is None:
            return None
        if isinstance(self.model_layers, str) or not isinstance(self.model_layers, Sequence):
            raise TypeError("model_layers must be a sequence of ints")
        indices = tuple(as_int(v, f"model_layers[{i}]", minimum=0) for i, v in enumerate(self.model_layers))
        if len(indices) != len(layer_types):
            raise ValueError(
                f"model_layers has {len(indices)} entries but layer_types has {len(layer_types)}"
            )
        for i, (a, b) in enumerate(itertools.pairwise(indices)):
            if b > a:
                continue
            both = (
                b == a and layer_types[i] not in STATE_LAYER_TYPES and layer_types[i + 1] in STATE_LAYER_TYPES
            )
            if not both:
                raise ValueError(
                    f"model_layers must be increasing, an index repeated only by a model layer that "
                    f"holds both K/V and a state (its attention cache layer, then its state cache "
                    f"layer); got model_layers[{i}] = {a} ({layer_types[i]}) and model_layers[{i + 1}] "
                    f"= {b} ({layer_types[i + 1]}) in {list(indices)}"
                )
        return indices

    def cache_layers(self, model_layer: int) -> tuple[int, ...]:
        """The indices in ``layer_types`` of model layer ``model_layer``'s cache layers: none for
        a layer that keeps no cache, one, or two for a layer that holds both (its attention's,
        then its state's)."""
        if self.model_layers is None:
            return (model_layer,) if 0 <= model_layer < len(self.layer_types) else ()
        return tuple(i for i, index in enumerate(self.model_layers) if index == model_layer)

    def cache_layer(self, model_layer: int, kind: CacheLayerKind | None = None) -> int:
        """The index in ``layer_types`` of model layer ``model_layer``'s cache layer.

        ``kind`` asks for its attention cache layer (``"attention"``: a full, sliding or chunked
        label) or its state cache layer (``"state"``: ``linear_attention``); None takes its only
        cache layer, whichever it is. A ``ValueError`` for a layer that keeps no cache, none of
        ``kind``, or, with ``kind`` None, two (a layer that holds both: which one is meant cannot
        be known).
        """
        if kind not in (None, "attention", "state"):
            raise ValueError(f"kind must be 'attention', 'state' or None, got {kind!r}")
        found = self.cache_layers(model_layer)
        if not found:
            raise ValueError(f"model layer {model_layer} keeps no KV cache or state in this model")
        if kind is None:
            if len(found) > 1:
                raise ValueError(
                    f"model layer {model_layer} holds both attention K/V (cache layer {found[0]}) and a "
                    f"state (cache layer {found[1]}): pass kind='attention' or kind='state'"
                )
            return found[0]
        wanted = [i for i in found if (self.layer_types[i] in STATE_LAYER_TYPES) == (kind == "state")]
        if not wanted:
            kept, missing = (
                ("a state", "attention K/V") if kind == "attention" else ("attention K/V", "state")
            )
            raise ValueError(
                f"model layer {model_layer} keeps no {missing} in this model: its one cache layer "
                f"({found[0]}, {self.layer_types[found[0]]}) holds {kept}"
            )
        return wanted[0]

    def _state_fields(
        self, layer_types: tuple[str, ...]
    ) -> tuple[Mapping[str, tuple[int, ...]] | None, Mapping[str, torch.dtype] | None]:
        has_state = any(label in STATE_LAYER_TYPES for label in layer_types)
        if not self.state_shapes and not self.state_dtypes:
            if has_state:
                raise ValueError(
                    "layer_types has linear_attention layers: state_shapes and state_dtypes are "
                    "required (e.g. {'conv': (conv_dim, kernel - 1), 'ssm': (heads, key_dim, value_dim)})"
                )
            return None, None
        if not has_state:
            raise ValueError("state_shapes/state_dtypes given but layer_types has no linear_attention layer")
        if not isinstance(self.state_shapes, Mapping) or not isinstance(self.state_dtypes, Mapping):
            raise TypeError("state_shapes and state_dtypes must both be mappings of component name")
        if set(self.state_shapes) != set(self.state_dtypes):
            raise ValueError(
                f"state_shapes names components {sorted(self.state_shapes)} but state_dtypes names "
                f"{sorted(self.state_dtypes)}"
            )
        shapes: dict[str, tuple[int, ...]] = {}
        for name, shape in self.state_shapes.items():
            if not isinstance(name, str) or not name:
                raise TypeError(f"state component names must be non-empty str, got {name!r}")
            if isinstance(shape, str) or not isinstance(shape, Sequence):
                raise TypeError(f"state_shapes[{name!r}] must be a sequence of ints")
            shapes[name] = tuple(
                as_int(dim, f"state_shapes[{name!r}][{i}]", minimum=0) for i, dim in enumerate(shape)
            )
        dtypes = {name: as_dtype(self.state_dtypes[name], f"state_dtypes[{name!r}]") for name in shapes}
        return MappingProxyType(shapes), MappingProxyType(dtypes)

    # -- derived sizes ------------------------------------------------------------------------

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def kv_storage_dtype(self) -> torch.dtype:
        """The dtype K/V tensors are allocated with (``uint8`` for fp8)."""
        return storage_dtype(self.kv_dtype)

    @property
    def kv_bytes_per_slot(self) -> int:
        """Bytes one token takes in one attention layer: K and V, ``2 * heads * head_dim * itemsize``."""
        return 2 * self.num_kv_heads * self.head_dim * self.kv_dtype.itemsize

    @property
    def state_component_bytes(self) -> dict[str, int] | None:
        """Bytes per page of each state component of one state layer (native ``state_const_bytes``)."""
        if self.state_shapes is None or self.state_dtypes is None:
            return None
        return {
            name: state_const_bytes(shape, self.state_dtypes[name].itemsize)
            for name, shape in self.state_shapes.items()
        }

    def components(self) -> list[ComponentSpec]:
        """The SPEC 3 memory components of every layer (native ``components_from_layers``)."""
        return components_from_layers(
            self.layer_types,
            kv_bytes_per_slot=self.kv_bytes_per_slot,
            state_component_bytes=self.state_component_bytes,
            sliding_window_tokens=self.sliding_window,
        )

    # -- loaders ------------------------------------------------------------------------------

    @classmethod
    def from_config(
        cls, source: str | os.PathLike[str] | Mapping[str, Any], *, kv_dtype: object = None
    ) -> ModelShape:
        """Build a shape from a Hugging Face style ``config.json`` (a path or the parsed dict).

        The layers, windows and state kind are the config's family's reading
        (:func:`flat_kvcache.families.read_model_layers`); state shapes come from the state
        kind (:data:`flat_kvcache.families.STATE_KINDS`), so an unsupported family or state is
        a ``ModelConfigError`` (a ``ValueError``) naming the field. The K/V heads and head dim
        are the family's where it reads them itself (:func:`flat_kvcache.families.kv_shape`:
        Zamba2), else ``num_key_value_heads`` defaulting to ``num_attention_heads`` and
        ``head_dim`` to ``hidden_size // num_attention_heads`` (the Hugging Face conventions).
        The K/V dtype is ``kv_dtype`` if given (e.g. ``"fp8_e4m3"``), else the model dtype
        (``torch_dtype``, or ``dtype`` in newer configs). A config without a model dtype (as
        ``transformers`` writes one built in code) needs ``kv_dtype``, which then is the dtype of
        the state components kept in the model dtype too, unless it is a one-byte (fp8) type.
        """
        cfg = load_model_config(source)
        layers = read_model_layers(cfg)
        # The model dtype is needed for K/V unless kv_dtype overrides it.
        model_dtype = _config_dtype(cfg, required=kv_dtype is None)
        kv = as_dtype(model_dtype if kv_dtype is None else kv_dtype, "kv_dtype")
        state_shapes: dict[str, tuple[int, ...]] | None = None
        state_dtypes: dict[str, torch.dtype] | None = None
        if layers.state_kind is not None:
            state_shapes, state_dtypes = _state(layers.state_kind, cfg, model_dtype, kv)
        has_attention = any(label not in STATE_LAYER_TYPES for label in layers.layer_types)
        if has_attention and cfg.get("kv_lora_rank") is not None:
            raise ModelConfigError(
                f"config kv_lora_rank = {cfg['kv_lora_rank']!r}: the attention layers are multi-head "
                f"latent attention (MLA), whose latent K/V this library does not size yet"
            )
        num_kv_heads, head_dim = 1, 1
        if has_attention:
            own = kv_shape(cfg)
            num_kv_heads, head_dim = (
                own if own is not None else (_config_kv_heads(cfg), _config_head_dim(cfg))
            )
        return cls(
            layer_types=layers.layer_types,
            sliding_window=layers.sliding_window,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            kv_dtype=kv,
            state_shapes=state_shapes,
            state_dtypes=state_dtypes,
            model_layers=layers.model_layers,
        )

    @classmethod
    def preset(cls, name: str, *, kv_dtype: object = None) -> ModelShape:
        """The shape of a bundled preset (``flat_kvcache.presets``), e.g. ``"qwen3.5-like"``."""
        if not isinstance(name, str) or name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(preset_names())}")
        return cls.from_config(get_preset(name), kv_dtype=kv_dtype)


def _config_int(cfg: Mapping[str, Any], key: str) -> int:
    if key not in cfg or cfg[key] is None:
        raise ValueError(f"config is missing {key!r}")
    value = cfg[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"config key {key!r} must be a positive int, got {value!r}")
    if value <= 0:
        raise ValueError(f"config key {key!r} must be a positive int, got {value!r}")
    return value


def _config_kv_heads(cfg: Mapping[str, Any]) -> int:
    if cfg.get("num_key_value_heads") is not None:
        return _config_int(cfg, "num_key_value_heads")
    if cfg.get("num_attention_heads") is not None:
        return _config_int(cfg, "num_attention_heads")
    raise ValueError("config is missing 'num_key_value_heads' (and 'num_attention_heads' to default it from)")


def _config_head_dim(cfg: Mapping[str, Any]) -> int:
    if cfg.get("head_dim") is not None:
        return _config_int(cfg, "head_dim")
    if cfg.get("hidden_size") is not None and cfg.get("num_attention_heads") is not None:
        hidden, heads = _config_int(cfg, "hidden_size"), _config_int(cfg, "num_attention_heads")
        if hidden % heads:
            raise ValueError(
                f"config is missing 'head_dim' and hidden_size={hidden} is not a multiple of "
                f"num_attention_heads={heads}"
            )
        return hidden // heads
    raise ValueError("config is missing 'head_dim' (and 'hidden_size'/'num_attention_heads' to derive it)")


def _config_dtype(cfg: Mapping[str, Any], *, required: bool) -> torch.dtype | None:
    """The model dtype of a config (``torch_dtype``, or ``dtype`` in newer configs); None when the
    config has neither and it is not ``required``."""
    for key in ("torch_dtype", "dtype"):
        if cfg.get(key) is not None:
            try:
                return as_dtype(cfg[key], f"config key {key!r}")
            except TypeError as exc:
                raise ValueError(str(exc)) from exc
    if required:
        raise ValueError("config is missing 'torch_dtype' (the model dtype); pass kv_dtype= to choose one")
    return None


def _conv_dtype(model_dtype: torch.dtype | None, kv_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the linear-attention conv state: the model's, else the K/V dtype unless that
    is a one-byte (fp8) type, which cannot hold the state."""
    if model_dtype is not None:
        return model_dtype
    if kv_dtype.itemsize == 1:
        raise ValueError(
            f"config is missing 'torch_dtype' (the model dtype), which the linear-attention conv "
            f"state is stored in, and kv_dtype {kv_dtype} is a one-byte type that cannot hold it; "
            f"add 'torch_dtype' to the config"
        )
    return kv_dtype


def _state(
    state_kind: str, cfg: Mapping[str, Any], model_dtype: torch.dtype | None, kv_dtype: torch.dtype
) -> tuple[dict[str, tuple[int, ...]], dict[str, torch.dtype]]:
    """The per-layer state of ``state_kind`` (:data:`flat_kvcache.families.STATE_KINDS`) with torch
    dtypes; ``"model"`` components take the model dtype (:func:`_conv_dtype`)."""
    shapes: dict[str, tuple[int, ...]] = {}
    dtypes: dict[str, torch.dtype] = {}
    for component in state_components(state_kind, cfg):
        shapes[component.name] = component.shape
        if component.dtype == "model":
            dtypes[component.name] = _conv_dtype(model_dtype, kv_dtype)
        else:
            try:
                dtypes[component.name] = as_dtype(component.dtype, f"the {component.name} state's dtype")
            except TypeError as exc:
                raise ValueError(str(exc)) from exc
    return shapes, dtypes
