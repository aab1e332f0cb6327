"""Model configs: load a Hugging Face style ``config.json`` (or a preset), read what sizing needs,
and build the page engine of a model (:func:`cache_from_config`, exported as
``flat_kvcache.cache_from_config``).

Which layers keep what is read by the model-family table (:mod:`flat_kvcache.families`, by
``model_type``: each family's own fields, in the form ``transformers`` writes and the form Hub
checkpoints ship); a config it cannot read right is a
:class:`~flat_kvcache.errors.ModelConfigError` (a ``ValueError``) naming the field. Everything
else is kept as loaded, for callers that derive tensor shapes from the same dict. Multimodal
wrappers that nest the language model under ``text_config`` are flattened: the text model's
keys are copied over the top level.
"""

from __future__ import annotations

import json
import operator
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, Protocol, SupportsIndex, TypedDict, Unpack

from flat_kvcache._types import ArenaPlan, PagedCacheGroupSpec, kv_cache_specs
from flat_kvcache.engine import FlatKVCache
from flat_kvcache.families import read_model_layers
from flat_kvcache.presets import PRESETS, get_preset, preset_names
from flat_kvcache.sizing import group_specs_from_layer_types

__all__ = [
    "DEFAULT_MAX_CONTEXT_LEN",
    "DEFAULT_PAGE_SIZE",
    "CacheOptions",
    "MemoryPlanLike",
    "cache_from_config",
    "group_specs_from_config",
    "layer_types_from_config",
    "load_model_config",
    "max_context_len_from_config",
    "sliding_window_from_config",
]

#: Context length assumed when a config has no ``max_position_embeddings``.
DEFAULT_MAX_CONTEXT_LEN = 131072
#: Tokens per page of :func:`cache_from_config` when none is given (also the command line's).
DEFAULT_PAGE_SIZE = 16


def load_model_config(source: str | os.PathLike[str] | Mapping[str, Any]) -> dict[str, Any]:
    """A model config dict from a preset name, a path to ``config.json`` (or its folder), or a mapping.

    Raises ``FileNotFoundError`` for a missing file and ``ValueError`` for an unknown preset,
    invalid JSON, or a JSON document that is not an object.
    """
    if isinstance(source, Mapping):
        return _flatten(dict(source))
    if isinstance(source, str) and source in PRESETS:
        return _flatten(get_preset(source))
    if not isinstance(source, str | os.PathLike):
        raise TypeError(
            f"model config must be a preset name, a path or a mapping, not {type(source).__name__}"
        )
    path = Path(source)
    if isinstance(source, str) and not path.exists() and not _looks_like_path(source):
        raise ValueError(
            f"unknown preset {source!r} (and no such file); known presets: {', '.join(preset_names())}"
        )
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"config file not found: {path}")
    try:
        loaded = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: invalid JSON: {exc}") from None
    if not isinstance(loaded, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(loaded).__name__}")
    return _flatten(loaded)


def _looks_like_path(text: str) -> bool:
    """True if ``text`` names a file rather than a preset (a separator or a ``.json`` suffix)."""
    return os.sep in text or "/" in text or text.endswith(".json")


def _flatten(cfg: dict[str, Any]) -> dict[str, Any]:
    """Copy a nested ``text_config`` (multimodal wrappers) over the top level."""
    text_config = cfg.get("text_config")
    if isinstance(text_config, Mapping):
        return {**cfg, **text_config}
    return cfg


def _int_field(cfg: Mapping[str, Any], key: str, *, minimum: int) -> int:
    """``cfg[key]`` as an int (not a bool) >= ``minimum``."""
    value = cfg[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"config {key} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"config {key} must be >= {minimum}, got {value}")
    return value


def layer_types_from_config(cfg: Mapping[str, Any]) -> list[str]:
    """The labels of the layers that keep a cache (``full_attention``, ``sliding_attention``,
    ``linear_attention``), in model order, as the config's family reads them
    (:func:`flat_kvcache.families.read_model_layers`; MLP-only layers have none).

    Raises :class:`~flat_kvcache.errors.ModelConfigError` (a ``ValueError``) for a config the
    family table cannot read right, naming the field.
    """
    return list(read_model_layers(cfg).layer_types)


def sliding_window_from_config(cfg: Mapping[str, Any]) -> int | list[int | None] | None:
    """The window of the config's sliding layers: None, one int for every sliding layer, or one
    entry per cache layer (None for the others), as its family reads it."""
    window = read_model_layers(cfg).sliding_window
    return list(window) if isinstance(window, tuple) else window


def max_context_len_from_config(cfg: Mapping[str, Any]) -> int:
    """The config's ``max_position_embeddings``, or :data:`DEFAULT_MAX_CONTEXT_LEN` without one."""
    if cfg.get("max_position_embeddings") is None:
        return DEFAULT_MAX_CONTEXT_LEN
    return _int_field(cfg, "max_position_embeddings", minimum=0)


# --- from a config to the page engine ---------------------------------------------------------


def group_specs_from_config(cfg: Mapping[str, Any], *, page_size: int) -> list[PagedCacheGroupSpec]:
    """The paged-cache groups of a loaded model config (:func:`load_model_config`), SPEC 2.

    ``group_specs_from_layer_types`` over the cache layers and windows the config's family reads
    (:func:`flat_kvcache.families.read_model_layers`). Raises ``ValueError`` (a
    :class:`~flat_kvcache.errors.ModelConfigError` for the config) and for ``page_size <= 0``.
    """
    layers = read_model_layers(cfg)
    return group_specs_from_layer_types(list(layers.layer_types), layers.sliding_window, page_size=page_size)


class MemoryPlanLike(Protocol):
    """What :func:`cache_from_config` reads from a memory plan: the groups and the page count
    (``flat_kvcache.torch.KVMemoryPlan`` has both)."""

    @property
    def groups(self) -> Sequence[PagedCacheGroupSpec]: ...

    @property
    def num_pages(self) -> int: ...


class CacheOptions(TypedDict, total=False):
    """The engine options :func:`cache_from_config` hands to ``FlatKVCache`` unchanged (its
    defaults apply to those left out; docs/engine-api.md)."""

    enable_caching: bool
    eviction_order: Literal["hybrid", "group"]
    enable_kv_events: bool
    reuse_uncached_first: bool
    host_pages: int | None
    host_store: Literal["write_through", "evict"]
    arena: ArenaPlan | None
    eviction_policy: Literal["lru", "reuse"]


def cache_from_config(
    model: str | os.PathLike[str] | Mapping[str, Any] | MemoryPlanLike,
    *,
    num_pages: int | None = None,
    page_size: int | None = None,
    **options: Unpack[CacheOptions],
) -> FlatKVCache:
    """The page engine (``FlatKVCache``) of a model: one group per distinct layer kind and window,
    all drawing on one pool of ``num_pages`` pages.

    Parameters
    ----------
    model : str, os.PathLike, mapping, or memory plan
        A preset name (``flat-kvcache plan --list-presets``), a path to a Hugging Face style
        ``config.json`` or its folder, a config dict, or a memory plan from
        ``flat_kvcache.torch.plan_kv_memory`` (its groups and page count, so that the engine's
        pages are the plan's buffers' pages).
    num_pages : int
        Pages in the pool, page 0 (the null page) included; required with a model config, left
        out with a plan (the plan's ``num_pages``).
    page_size : int, default 16
        Tokens per page of every group, with a model config; left out with a plan (its groups
        carry their page size, raised where a state layer needed it).
    **options
        ``enable_caching``, ``eviction_order``, ``enable_kv_events``, ``reuse_uncached_first``,
        ``host_pages``, ``host_store``, ``arena``, ``eviction_policy``: passed to ``FlatKVCache`` as given
        (:class:`CacheOptions`). With ``arena=`` (a plan from ``plan_arena`` for the same model),
        leave ``num_pages`` out: the arena sizes the pool (SPEC 13).

    Returns
    -------
    FlatKVCache
        Its ``group_ids`` are the config's group ids in layer order (``sliding_attention``,
        ``full_attention``, ``linear_attention``, or ``sliding_attention_<W>`` with several windows).

    Raises
    ------
    TypeError
        ``model`` of another type; ``num_pages`` missing with a config or given with a plan;
        a non-int size or a bad option type (the engine's message, naming it).
    ValueError
        A model config that cannot be loaded or grouped (the message starts ``model: ``), or a
        bad size or option (``num_pages``, ``page_size``, ``eviction_order``...).
    FileNotFoundError
        ``model`` names a ``config.json`` (or a folder) that does not exist.
    """
    if isinstance(model, Mapping | str | os.PathLike):
        if num_pages is None and options.get("arena") is None:
            raise TypeError(
                "cache_from_config() needs num_pages= with a model config (the pages in the pool, "
                "page 0 included) or arena= (an ArenaPlan, which sizes the pool)"
            )
        size = _page_size(DEFAULT_PAGE_SIZE if page_size is None else page_size)
        try:
            groups = group_specs_from_config(load_model_config(model), page_size=size)
        except FileNotFoundError as exc:
            raise FileNotFoundError(f"model: {exc}") from None
        except ValueError as exc:
            raise ValueError(f"model: {exc}") from None
        return FlatKVCache(kv_cache_specs(groups), num_pages, **options)
    if not (hasattr(model, "groups") and hasattr(model, "num_pages")):
        raise TypeError(
            "model must be a preset name, a config.json path, a config mapping or a memory plan, "
            f"not {type(model).__name__}"
        )
    for name, value in (("num_pages", num_pages), ("page_size", page_size)):
        if value is not None:
            raise TypeError(f"cache_from_config() takes no {name}= with a memory plan: the plan sets it")
    return FlatKVCache(kv_cache_specs(model.groups), model.num_pages, **options)


def _page_size(value: object) -> int:
    """``page_size`` checked here, so that a config's own errors can be told apart (``model: ``)."""
    if isinstance(value, bool) or not isinstance(value, SupportsIndex):
        raise TypeError(f"page_size must be an int, not {type(value).__name__}")
    size = operator.index(value)
    if size <= 0:
        raise ValueError(f"page_size must be > 0, got {size}")
    return size
