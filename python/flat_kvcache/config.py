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

import dataclasses
import json
import math
import operator
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, Protocol, SupportsIndex, TypedDict, Unpack

from flat_kvcache._types import STATE, ArenaPlan, KVCacheSpec, PagedCacheGroupSpec, kv_cache_specs
from flat_kvcache.engine import FlatKVCache
from flat_kvcache.errors import ConfigError
from flat_kvcache.families import read_model_layers
from flat_kvcache.presets import PRESETS, get_preset, preset_names
from flat_kvcache.sizing import group_specs_from_layer_types

__all__ = [
    "DEFAULT_MAX_CONTEXT_LEN",
    "DEFAULT_PAGE_SIZE",
    "DEFAULT_STATE_GRAIN",
    "ArenaMemoryPlanLike",
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


class ArenaMemoryPlanLike(Protocol):
    """What :func:`cache_from_config` reads from an arena memory plan
    (``flat_kvcache.torch.ArenaMemoryPlan``): its arena and the shape it was planned for."""

    @property
    def arena(self) -> ArenaPlan: ...

    @property
    def shape(self) -> Any: ...


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
    register_on_schedule: bool


def cache_from_config(
    model: str | os.PathLike[str] | Mapping[str, Any] | MemoryPlanLike | ArenaMemoryPlanLike,
    *,
    num_pages: int | None = None,
    page_size: int | None = None,
    storage: Literal["equalized"] | None = None,
    state_grain: int | None = None,
    **options: Unpack[CacheOptions],
) -> FlatKVCache:
    """The page engine (``FlatKVCache``) of a model: one group per distinct layer kind and window,
    all drawing on one pool: the SPEC 13 arena (``arena=``, or an arena memory plan) or
    ``num_pages`` equal pages.

    A model with state layers is built over an arena unless ``storage="equalized"`` asks for
    ``num_pages`` equal pages (each page id a row in every layer's buffer, the layout vLLM-style
    storage uses); ``num_pages`` alone is refused for it. Attention-only models take either.

    Parameters
    ----------
    model : str, os.PathLike, mapping, or memory plan
        A preset name (``flat-kvcache plan --list-presets``), a path to a Hugging Face style
        ``config.json`` or its folder, a config dict, or a memory plan:
        ``flat_kvcache.torch.plan_arena_memory``'s (its shape's groups over its arena: the
        engine's ids index the plan's views) or ``flat_kvcache.torch.plan_kv_memory``'s (its
        groups and page count, so that the engine's pages are the plan's buffers' pages).
    num_pages : int
        Pages in the pool, page 0 (the null page) included, with a model config and no
        ``arena=``; left out with a plan (the plan's ``num_pages``) or an arena.
    page_size : int, default 16
        Tokens per page of every group (of every attention group over an arena), with a model
        config; left out with a plan (its groups carry their page size, raised where a state
        layer needed it; an arena plan its own).
    storage : ``"equalized"``, optional
        With a model config that has state layers, asks for ``num_pages`` equal pages instead of
        the arena.
    state_grain : int, optional
        Over an arena (``arena=`` or an arena memory plan), the state groups' page size in
        tokens: the checkpoint grain of SPEC 13 (default: the least multiple of the page size
        that is a multiple of 64, where the state kernels' chunked prefill aligns).
    **options
        ``enable_caching``, ``eviction_order``, ``enable_kv_events``, ``reuse_uncached_first``,
        ``host_pages``, ``host_store``, ``arena``, ``eviction_policy``, ``register_on_schedule``:
        passed to ``FlatKVCache`` as given
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
        bad size or option (``num_pages``, ``page_size``, ``storage``, ``state_grain``,
        ``eviction_order``...).
    ConfigError
        A model config with state layers, ``num_pages`` and neither ``arena=`` nor
        ``storage="equalized"``.
    FileNotFoundError
        ``model`` names a ``config.json`` (or a folder) that does not exist.
    """
    if storage is not None and storage != "equalized":
        raise ValueError(f"storage must be None or 'equalized', got {storage!r}")
    if isinstance(model, Mapping | str | os.PathLike):
        arena = options.get("arena")
        if num_pages is None and arena is None:
            raise TypeError(
                "cache_from_config() needs num_pages= with a model config (the pages in the pool, "
                "page 0 included) or arena= (an ArenaPlan, which sizes the pool)"
            )
        if arena is not None and storage is not None:
            raise ValueError("storage='equalized' is a pool of num_pages equal pages: it takes no arena=")
        if arena is None and state_grain is not None:
            raise ValueError("state_grain is the state groups' page size over an arena: pass arena= too")
        size = _page_size(DEFAULT_PAGE_SIZE if page_size is None else page_size)
        try:
            groups = group_specs_from_config(load_model_config(model), page_size=size)
        except FileNotFoundError as exc:
            raise FileNotFoundError(f"model: {exc}") from None
        except ValueError as exc:
            raise ValueError(f"model: {exc}") from None
        if arena is not None:
            return FlatKVCache(_over_arena(kv_cache_specs(groups), size, state_grain), **options)
        state = [group.group_id for group in groups if group.family == "state"]
        if state and storage is None:
            raise ConfigError(
                f"model: the state group {state[0]!r} keeps recurrent states, whose storage is the "
                "SPEC 13 arena: pass arena= (flat_kvcache.plan_arena, or a "
                "flat_kvcache.torch.plan_arena_memory plan as the model) instead of num_pages=, or "
                "storage='equalized' for num_pages equal pages (the layout vLLM-style storage uses)"
            )
        return FlatKVCache(kv_cache_specs(groups), num_pages, **options)
    is_arena_plan = hasattr(model, "arena") and hasattr(model, "shape")
    if not is_arena_plan and not (hasattr(model, "groups") and hasattr(model, "num_pages")):
        raise TypeError(
            "model must be a preset name, a config.json path, a config mapping or a memory plan, "
            f"not {type(model).__name__}"
        )
    for name, value in (("num_pages", num_pages), ("page_size", page_size), ("storage", storage)):
        if value is not None:
            raise TypeError(f"cache_from_config() takes no {name}= with a memory plan: the plan sets it")
    if is_arena_plan:
        if options.get("arena") is not None:
            raise TypeError("cache_from_config() takes no arena= with an arena memory plan: it is the plan's")
        plan: Any = model
        shape = plan.shape
        groups = group_specs_from_layer_types(
            list(shape.layer_types), shape.sliding_window, page_size=plan.arena.page_size
        )
        specs = _over_arena(kv_cache_specs(groups), plan.arena.page_size, state_grain)
        return FlatKVCache(specs, **{**options, "arena": plan.arena})
    if state_grain is not None:
        raise TypeError(
            "cache_from_config() takes no state_grain= with a plan of equal pages: it has no arena"
        )
    pages: MemoryPlanLike = model  # type: ignore[assignment]
    return FlatKVCache(kv_cache_specs(pages.groups), pages.num_pages, **options)


#: The state checkpoint grain over an arena (SPEC 13: 64, where the state kernels' chunked
#: prefill aligns; rounded up to a multiple of the page size).
DEFAULT_STATE_GRAIN = 64


def _over_arena(specs: list[KVCacheSpec], page_size: int, state_grain: int | None) -> list[KVCacheSpec]:
    """``specs`` over an arena: the state groups' pages are ``state_grain`` tokens (default the
    least common multiple of 64 and ``page_size``), the others ``page_size``."""
    if state_grain is None:
        grain = math.lcm(DEFAULT_STATE_GRAIN, page_size)
    else:
        if isinstance(state_grain, bool) or not isinstance(state_grain, SupportsIndex):
            raise TypeError(f"state_grain must be an int, not {type(state_grain).__name__}")
        grain = operator.index(state_grain)
        if grain <= 0 or grain % page_size:
            raise ValueError(
                f"state_grain must be a positive multiple of the page size {page_size}, got {grain}"
            )
    return [dataclasses.replace(spec, page_size=grain) if spec.kind == STATE else spec for spec in specs]


def _page_size(value: object) -> int:
    """``page_size`` checked here, so that a config's own errors can be told apart (``model: ``)."""
    if isinstance(value, bool) or not isinstance(value, SupportsIndex):
        raise TypeError(f"page_size must be an int, not {type(value).__name__}")
    size = operator.index(value)
    if size <= 0:
        raise ValueError(f"page_size must be > 0, got {size}")
    return size
