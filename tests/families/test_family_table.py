"""The model-family table as a whole: how a config finds its family, and the documentation
tables generated from it (README.md, docs/model-families.md)."""

from __future__ import annotations

import re
from typing import Any

import pytest
from flat_kvcache.errors import ModelConfigError
from flat_kvcache.families import (
    FAMILIES,
    GENERIC,
    STATE_KINDS,
    family_of,
    family_table_markdown,
    read_model_layers,
)
from helpers import REPO_ROOT

FULL, SLIDING, LINEAR = "full_attention", "sliding_attention", "linear_attention"
MARKED = re.compile(r"<!-- families:start -->\n(.*?)<!-- families:end -->", re.S)


@pytest.mark.parametrize("doc", ["README.md", "docs/model-families.md"])
def test_documented_table_is_the_generated_one(doc: str) -> None:
    """The table between the markers is exactly ``family_table_markdown()``: regenerate it
    (``python -m flat_kvcache.families``) when the families change."""
    text = (REPO_ROOT / doc).read_text(encoding="utf-8")
    found = MARKED.search(text)
    assert found is not None, f"{doc} lacks the families markers"
    assert found.group(1) == family_table_markdown()


def test_every_family_is_a_row_and_every_state_kind_is_named() -> None:
    table = family_table_markdown()
    for family in (*FAMILIES, GENERIC):
        assert f"| {family.name} |" in table
    for family in FAMILIES:
        if family.state is not None:
            assert family.state in STATE_KINDS
            assert STATE_KINDS[family.state].description in table


def test_model_types_are_unique_across_families() -> None:
    seen: dict[str, str] = {}
    for family in FAMILIES:
        for model_type in family.model_types:
            assert model_type not in seen, f"{model_type} in {seen.get(model_type)} and {family.name}"
            seen[model_type] = family.name


@pytest.mark.parametrize(
    ("cfg", "labels", "window"),
    [
        ({"model_type": "toy", "layer_types": [SLIDING, FULL], "sliding_window": 8}, (SLIDING, FULL), 8),
        ({"layer_types": [FULL, FULL]}, (FULL, FULL), None),
        (
            {"model_type": "toy", "layer_types": [SLIDING, SLIDING, FULL], "sliding_window": [4, 8, None]},
            (SLIDING, SLIDING, FULL),
            (4, 8, None),
        ),
    ],
)
def test_an_unknown_model_type_is_read_from_its_explicit_attention_labels(
    cfg: dict[str, Any], labels: tuple[str, ...], window: object
) -> None:
    assert family_of(cfg) is GENERIC
    read = read_model_layers(cfg)
    assert (read.layer_types, read.sliding_window, read.state_kind) == (labels, window, None)
    assert read.model_layers == tuple(range(len(labels)))


@pytest.mark.parametrize(
    ("cfg", "needle"),
    [
        ({"num_hidden_layers": 4}, "config model_type is missing and the config has no layer_types"),
        ({"model_type": "toy", "num_hidden_layers": 4}, "config model_type is 'toy' and the config has no"),
        ({"model_type": "toy", "layer_types": [FULL, LINEAR]}, "config layer_types[1] = 'linear_attention'"),
        ({"model_type": "toy", "layer_types": [SLIDING]}, "config sliding_window = None"),
    ],
)
def test_nothing_falls_back_to_full_attention(cfg: dict[str, Any], needle: str) -> None:
    """Without a family or explicit attention labels the layers are unknown: an error naming the
    field, never "every layer is full attention"."""
    with pytest.raises(ModelConfigError) as info:
        read_model_layers(cfg)
    assert str(info.value).startswith(needle), str(info.value)
