"""Model configs: load a Hugging Face style ``config.json`` (or a preset) and read what sizing needs.

Only the keys the sizing API uses are interpreted here (``layer_types``, ``sliding_window``,
``num_hidden_layers``, ``full_attention_interval``, ``max_position_embeddings``); everything
else is kept as loaded, for callers that derive tensor shapes from the same dict. Multimodal
wrappers that nest the language model under ``text_config`` are flattened: the text model's
keys are copied over the top level.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from flat_kvcache.presets import PRESETS, get_preset, preset_names

__all__ = [
    "DEFAULT_MAX_CONTEXT_LEN",
    "layer_types_from_config",
    "load_model_config",
    "max_context_len_from_config",
    "sliding_window_from_config",
]

#: Context length assumed when a config has no ``max_position_embeddings``.
DEFAULT_MAX_CONTEXT_LEN = 131072


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
    """The per-layer labels of a model config.

    ``layer_types`` when present (its length must match ``num_hidden_layers`` if both are
    given); else, with ``full_attention_interval`` k, every k-th layer (1-based k, 2k, ...) is
    ``full_attention`` and the others ``linear_attention``; else ``num_hidden_layers``
    ``full_attention`` layers. Labels are not checked here: the sizing API rejects unknown ones.
    """
    layer_types = cfg.get("layer_types")
    if layer_types is not None:
        if isinstance(layer_types, str) or not isinstance(layer_types, list | tuple):
            raise ValueError(f"config layer_types must be a list of str, got {type(layer_types).__name__}")
        labels = list(layer_types)
        for i, label in enumerate(labels):
            if not isinstance(label, str):
                raise ValueError(f"config layer_types[{i}] must be a str, got {label!r}")
        if cfg.get("num_hidden_layers") is not None:
            num_layers = _int_field(cfg, "num_hidden_layers", minimum=0)
            if num_layers != len(labels):
                raise ValueError(
                    f"config layer_types has {len(labels)} entries but num_hidden_layers is {num_layers}"
                )
        return labels
    if cfg.get("num_hidden_layers") is None:
        raise ValueError("config has neither layer_types nor num_hidden_layers")
    num_layers = _int_field(cfg, "num_hidden_layers", minimum=0)
    if cfg.get("full_attention_interval") is not None:
        interval = _int_field(cfg, "full_attention_interval", minimum=1)
        return [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)
        ]
    return ["full_attention"] * num_layers


def sliding_window_from_config(cfg: Mapping[str, Any]) -> int | list[int | None] | None:
    """The config's ``sliding_window``: None, one int for every sliding layer, or one entry per layer."""
    window = cfg.get("sliding_window")
    if window is None:
        return None
    if isinstance(window, list | tuple):
        for i, entry in enumerate(window):
            if entry is not None and (isinstance(entry, bool) or not isinstance(entry, int)):
                raise ValueError(f"config sliding_window[{i}] must be None or an int, got {entry!r}")
        return list(window)
    if isinstance(window, bool) or not isinstance(window, int):
        raise ValueError(f"config sliding_window must be None, an int or a list, got {window!r}")
    return window


def max_context_len_from_config(cfg: Mapping[str, Any]) -> int:
    """The config's ``max_position_embeddings``, or :data:`DEFAULT_MAX_CONTEXT_LEN` without one."""
    if cfg.get("max_position_embeddings") is None:
        return DEFAULT_MAX_CONTEXT_LEN
    return _int_field(cfg, "max_position_embeddings", minimum=0)
