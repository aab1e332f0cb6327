"""Every model family the runner's tests build gives its own whole unpaged forward's logits, or
is refused when the runner is built (issue 35).

Each family runs a request whose prompt is longer than a chunk (so later chunks start from
what earlier ones left: K/V pages, and a state slot for state models), then a second request
that shares most of the prompt and resumes from a prefix hit (a checkpoint for state models).
Every computed position is compared with the model's forward over the whole token sequence
in one piece, no cache and no cut, computed here: a reference cut where the paged run's
forwards started would share a flaw of the model's own cache path (``transformers``' mamba1
mixers start a multi-token step's scan from zero whatever the cache holds) and hide it.
"""

from __future__ import annotations

from typing import Any

import pytest
from helpers import missing, one_thread  # noqa: F401  (an autouse fixture)

try:
    import torch
    import transformers  # noqa: F401  (tiny_model builds its models)
except ImportError as exc:
    missing(exc.name or "torch/transformers", exc)

import flat_kvcache as fk
from flat_kvcache.torch import ArenaBuffers, KVBuffers, allocate_arena, allocate_kv_buffers
from flat_kvcache.torch.runner import (
    PagedModelRunner,
    RequestRecord,
    arena_for_units,
    arena_specs,
    max_logit_error,
    model_shape,
    plan_for_pages,
    run_greedy,
    tiny_model,
)

pytestmark = [pytest.mark.torch, pytest.mark.skipif(not fk.FLAT_KVCACHE, reason="needs the flat build")]

TOLERANCE = 1e-3
#: Tokens per K/V page, the state checkpoint grain, the prefill chunk limit, and the window of
#: the sliding (and Llama 4's chunk) kinds.
P = 4
G = 8
CHUNK = 12
WINDOW = 8


def tokens(seed: int, n: int) -> list[int]:
    return torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def build_runner_parts(model: Any) -> tuple[fk.FlatKVCache, KVBuffers | ArenaBuffers]:
    """The cache and buffers of ``model``: SPEC 3 buffers for an attention-only model, the
    SPEC 13 arena for a state model (every unit but the null one NaN-poisoned)."""
    shape = model_shape(model.config)
    if shape.state_shapes is None:
        plan = plan_for_pages(
            shape, page_size=P, num_pages=64, max_live_requests=1, max_scheduled_tokens=64, max_context_len=64
        )
        cache = fk.FlatKVCache(list(fk.kv_cache_specs(plan.groups)), plan.num_pages)
        return cache, allocate_kv_buffers(plan, "cpu")
    arena_plan = arena_for_units(shape, page_size=P, num_units=64)
    arena = allocate_arena(shape, arena_plan, "cpu")
    arena.arena[arena_plan.unit_bytes :].fill_(0xFF)  # NaN in float32
    return fk.FlatKVCache(arena_specs(shape, page_size=P, state_grain=G), arena=arena_plan), arena


def build_runner(model: Any) -> PagedModelRunner:
    """The runner of ``model`` on :func:`build_runner_parts`, every fresh K/V page NaN-poisoned."""
    return PagedModelRunner(model, *build_runner_parts(model), poison_new_pages=True)


def whole_forward(model: Any, sequence: list[int]) -> torch.Tensor:
    """The model's own forward over ``sequence`` in one piece, without a cache."""
    with torch.no_grad():
        out = model(input_ids=torch.tensor([sequence]), use_cache=False)
    logits: torch.Tensor = out.logits[0].float()
    return logits


def worst_error(model: Any, record: RequestRecord) -> float:
    last = max(positions[-1] for positions, _ in record.computed)
    reference = whole_forward(model, record.tokens[: last + 1])
    worst = 0.0
    for positions, logits in record.computed:
        diff = float((logits - reference[positions]).abs().max())
        worst = max(worst, diff if diff == diff else float("inf"))  # NaN: a poisoned read
    return worst


def test_max_logit_error_does_not_feed_the_last_sampled_token() -> None:
    # The last sampled token was never computed: the reference forward ends at the last
    # computed position.
    model = tiny_model("llama", num_layers=2, seed=0)
    records = run_greedy(build_runner(model), {"a": tokens(13, 10)}, 3)
    assert len(records["a"].tokens) == 13  # positions 0..11 computed, 12 sampled last
    lengths: list[int] = []

    def spy(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        lengths.append(int(kwargs["input_ids"].shape[1]))

    hook = model.register_forward_pre_hook(spy, with_kwargs=True)
    try:
        assert max_logit_error(model, records) <= TOLERANCE
    finally:
        hook.remove()
    assert lengths == [12]
