"""``--memory`` for every family: the memory plan of each family's default config (as
``transformers`` writes it) is made, or refused by a ``ModelConfigError`` naming why; never
another exception, never a plan that silently ignores a layer."""

from __future__ import annotations

from typing import Any

import pytest
from flat_kvcache.errors import ConfigError, ModelConfigError
from flat_kvcache.families import FAMILIES, STATE_KINDS, read_model_layers
from helpers import need

#: Model types whose config class is not in transformers.
REMOTE_CODE_TYPES = {"minimax_text_01", "minimax_m1"}

#: Model types whose hybrid layers hold attention K/V and a state together (two cache layers
#: each): their default configs must be planned, never refused.
HOLDS_BOTH = {"falcon_h1", "zamba2"}

CASES = [
    pytest.param(family, model_type, id=model_type)
    for family in FAMILIES
    for model_type in family.model_types
]


def default_config(model_type: str) -> dict[str, Any] | None:
    """``SomeConfig().to_dict()`` of ``model_type``, or None where transformers has no class."""
    transformers = need("transformers")
    mapping = transformers.CONFIG_MAPPING
    if model_type not in mapping:
        return None
    return dict(mapping[model_type]().to_dict())


@pytest.mark.parametrize(("family", "model_type"), CASES)
def test_memory_plan_or_a_clear_refusal(family: Any, model_type: str) -> None:
    torch = need("torch")
    from flat_kvcache.config import load_model_config
    from flat_kvcache.torch import ModelShape, plan_arena_memory, plan_kv_memory

    cfg = default_config(model_type)
    if cfg is None:
        # Remote-code model types (their config class ships with the checkpoint); the family's
        # own tests read them from Hub-form configs.
        assert model_type in REMOTE_CODE_TYPES
        return
    loaded = load_model_config(cfg)
    try:
        layers = read_model_layers(loaded)
    except ModelConfigError as exc:
        # Only a family refused as a whole, or a default that lacks its hybrid layout, refuses
        # here; the message names a config field.
        assert model_type not in HOLDS_BOTH, str(exc)
        assert "config " in str(exc), str(exc)
        return
    try:
        shape = ModelShape.from_config(loaded, kv_dtype=torch.bfloat16)
    except ModelConfigError as exc:
        assert model_type not in HOLDS_BOTH, str(exc)
        assert "config " in str(exc) or " state: " in str(exc), str(exc)
        if layers.state_kind is not None and STATE_KINDS[layers.state_kind].components is None:
            refused = STATE_KINDS[layers.state_kind].refused
            assert refused is not None and refused in str(exc)
        return
    assert shape.layer_types == layers.layer_types
    assert shape.model_layers == layers.model_layers
    if model_type in HOLDS_BOTH:
        # Each hybrid layer is its attention cache layer and then its state cache layer, and
        # both have their place in the plans below (every cache layer is checked there).
        both = [i for i in range(layers.num_model_layers) if len(shape.cache_layers(i)) == 2]
        assert both
        for i in both:
            attention, state = shape.cache_layers(i)
            assert (layers.layer_types[attention], layers.layer_types[state]) == (
                "full_attention",
                "linear_attention",
            )
    # The SPEC 13 storage plans every family, pure state models too: every cache layer has its
    # place in the arena, and 64 live requests have their working state slots.
    limits = {"max_live_requests": 64, "max_scheduled_tokens": 8192, "max_context_len": 32768}
    arena = plan_arena_memory(shape, page_size=16, budget_bytes=80 << 30, **limits).arena
    assert {c.layer for c in arena.components} == set(range(len(layers.layer_types)))
    assert arena.num_units >= 65 and arena.num_units * arena.unit_bytes <= 80 << 30
    # SPEC 3's equal pages: asked for explicitly where a model has state layers (the arena is
    # their storage), impossible for a pure state model.
    if all(label == "linear_attention" for label in layers.layer_types):
        with pytest.raises(ModelConfigError, match="pure state model cannot be planned by it"):
            plan_kv_memory(
                shape,
                page_size=16,
                budget_bytes=80 << 30,
                max_live_requests=64,
                max_scheduled_tokens=8192,
                max_context_len=32768,
                storage="equalized",
            )
        return
    if layers.state_kind is not None:
        with pytest.raises(ConfigError, match="storage is the SPEC 13 arena, planned by plan_arena_memory"):
            plan_kv_memory(shape, page_size=16, budget_bytes=80 << 30, **limits)  # type: ignore[arg-type]
    plan = plan_kv_memory(
        shape,
        page_size=16,
        budget_bytes=80 << 30,
        max_live_requests=64,
        max_scheduled_tokens=8192,
        max_context_len=32768,
        storage="equalized",
    )
    # Every cache layer has its buffers: none is dropped by the plan.
    covered = {layer for tensor in plan.tensors for layer in tensor.layers}
    assert covered == set(range(len(layers.layer_types)))
    assert plan.num_pages > 1
