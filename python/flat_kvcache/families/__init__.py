"""The model-family table: how each kind of model's config says which layers keep what.

One table (:data:`FAMILIES`) maps a config's ``model_type`` to the reader of its layers, in both
the form ``transformers`` writes (usually with ``layer_types``) and the form Hub checkpoints ship
(legacy fields, no ``layer_types``); :data:`STATE_KINDS` gives each recurrent state's shapes.
:func:`read_model_layers` is the one path from a config to cache layers: ``flat-kvcache plan
--config``, :func:`flat_kvcache.config.layer_types_from_config`, ``ModelShape.from_config`` and
the model runner all go through it. Nothing falls back to full attention: a config this table
cannot read right is a :class:`~flat_kvcache.errors.ModelConfigError` naming the field, its value
and what is supported. The README's "Model families" table is :func:`family_table_markdown`.

A config of a ``model_type`` not in the table is read only from an explicit ``layer_types`` of
attention labels (``full_attention``, ``sliding_attention``): its labels say everything. A state
label there, or no ``layer_types`` at all, is refused: which state, or which layers, cannot be
known without the family.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping
from pathlib import Path

from flat_kvcache.errors import ModelConfigError
from flat_kvcache.families._base import (
    ATTENTION_LABELS,
    Config,
    Family,
    Layer,
    ModelLayers,
    StateComponent,
    StateKind,
    layers_from_layer_types,
    model_layers,
)
from flat_kvcache.families.attention import ATTENTION_FAMILIES
from flat_kvcache.families.linear import LINEAR_FAMILIES, LINEAR_STATE_KINDS
from flat_kvcache.families.mamba import MAMBA_FAMILIES, MAMBA_STATE_KINDS

__all__ = [
    "FAMILIES",
    "GENERIC",
    "STATE_KINDS",
    "Family",
    "Layer",
    "ModelLayers",
    "StateComponent",
    "StateKind",
    "family_of",
    "family_table_markdown",
    "kv_shape",
    "read_model_layers",
    "state_components",
    "supported_model_types",
    "update_document",
]

#: Every family, attention-only ones first, in the order of the documentation table.
FAMILIES: tuple[Family, ...] = ATTENTION_FAMILIES + LINEAR_FAMILIES + MAMBA_FAMILIES

#: State kinds by name.
STATE_KINDS: Mapping[str, StateKind] = {kind.name: kind for kind in LINEAR_STATE_KINDS + MAMBA_STATE_KINDS}


def _by_model_type() -> dict[str, Family]:
    table: dict[str, Family] = {}
    for family in FAMILIES:
        for model_type in family.model_types:
            if model_type in table:
                raise RuntimeError(f"model_type {model_type!r} is in two families")
            table[model_type] = family
        if family.state is not None and family.state not in STATE_KINDS:
            raise RuntimeError(f"family {family.name} names an unknown state kind {family.state!r}")
    return table


_FAMILY_OF_TYPE = _by_model_type()

#: The family of configs of an unknown ``model_type`` with an explicit ``layer_types`` of
#: attention labels.
GENERIC = Family(
    name="any model with layer_types",
    model_types=(),
    layers=lambda cfg: layers_from_layer_types(cfg, ATTENTION_LABELS),
    reads="`layer_types` (attention labels only), `sliding_window`",
)


def supported_model_types() -> list[str]:
    """Every ``model_type`` the table reads, sorted."""
    return sorted(_FAMILY_OF_TYPE)


def family_of(cfg: Config) -> Family:
    """The family that reads ``cfg``: by its ``model_type``, else :data:`GENERIC` when it has a
    ``layer_types`` list; else a :class:`~flat_kvcache.errors.ModelConfigError`."""
    model_type = cfg.get("model_type")
    if isinstance(model_type, str) and model_type in _FAMILY_OF_TYPE:
        return _FAMILY_OF_TYPE[model_type]
    if cfg.get("layer_types") is not None:
        return GENERIC
    shown = "missing" if model_type is None else repr(model_type)
    raise ModelConfigError(
        f"config model_type is {shown} and the config has no layer_types, so which layers keep "
        f"what cannot be known; supported model types: {', '.join(supported_model_types())} "
        f"(or give layer_types with full_attention / sliding_attention labels)"
    )


def read_model_layers(cfg: Config) -> ModelLayers:
    """The cache layers of a loaded model config (``flat_kvcache.config.load_model_config``).

    Raises :class:`~flat_kvcache.errors.ModelConfigError` (also a ``ValueError``) when the family
    is refused, a field it needs is missing, or a value is not one it reads right.
    """
    family = family_of(cfg)
    model_type = cfg.get("model_type")
    if family.refused is not None:
        raise ModelConfigError(f"config model_type = {model_type!r} ({family.name}): {family.refused}")
    layers = family.layers(cfg)
    if not layers:
        raise ModelConfigError("the model config has no layers")
    if all(layer.kind == "none" for layer in layers):
        raise ModelConfigError(f"no layer of this {family.name} config keeps a KV cache or a state")
    return model_layers(family, model_type if isinstance(model_type, str) else None, layers)


def kv_shape(cfg: Config) -> tuple[int, int] | None:
    """``(K/V heads, head dim)`` of the attention layers of ``cfg`` as its family reads them
    (:attr:`Family.kv_shape`: Zamba2's shared attention block, for one), or None where the
    family follows the Hugging Face conventions (``num_key_value_heads``, ``head_dim``)."""
    family = family_of(cfg)
    return None if family.kv_shape is None else family.kv_shape(cfg)


def state_components(state_kind: str, cfg: Config) -> tuple[StateComponent, ...]:
    """The per-layer state of ``state_kind`` for ``cfg`` (its shapes and dtypes), or a
    :class:`~flat_kvcache.errors.ModelConfigError` when that kind's shapes are not supported."""
    kind = STATE_KINDS[state_kind]
    if kind.components is None:
        raise ModelConfigError(f"{kind.description} state: {kind.refused}")
    return kind.components(cfg)


def family_table_markdown() -> str:
    """The "Model families" table of the README and docs, from :data:`FAMILIES`."""
    rows = [
        "| family | `model_type` | layers read from | state | status |",
        "|---|---|---|---|---|",
    ]
    for family in (*FAMILIES, GENERIC):
        types = ", ".join(f"`{t}`" for t in family.model_types) or "any other"
        state = "none"
        if family.state is not None:
            kind = STATE_KINDS[family.state]
            state = kind.description
            if kind.components is None:
                state += f" (sizing refused: {kind.refused})"
        status = "read" if family.refused is None else f"refused: {family.refused}"
        rows.append(f"| {family.name} | {types} | {family.reads} | {state} | {status} |")
    return "\n".join(rows) + "\n"


#: Where a document holds the generated table.
_MARKED = re.compile(r"(<!-- families:start -->\n).*?(<!-- families:end -->)", re.S)


def update_document(text: str) -> str:
    """``text`` with the table between its ``<!-- families:start -->`` and
    ``<!-- families:end -->`` markers replaced by :func:`family_table_markdown`."""
    if not _MARKED.search(text):
        raise ValueError("no <!-- families:start --> ... <!-- families:end --> markers")
    table = family_table_markdown()
    return _MARKED.sub(lambda m: m.group(1) + table + m.group(2), text)


def _main(argv: list[str]) -> int:
    """``python -m flat_kvcache.families [--update FILE ...]``: print the family table
    (Markdown), or rewrite it in place in each FILE between its markers."""
    if not argv:
        print(family_table_markdown(), end="")
        return 0
    if argv[0] != "--update" or len(argv) < 2:
        print("usage: python -m flat_kvcache.families [--update FILE ...]", file=sys.stderr)
        return 2
    for name in argv[1:]:
        path = Path(name)
        try:
            path.write_text(update_document(path.read_text(encoding="utf-8")), encoding="utf-8")
        except (OSError, ValueError) as exc:
            print(f"python -m flat_kvcache.families: {name}: {exc}", file=sys.stderr)
            return 1
    return 0
