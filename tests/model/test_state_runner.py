"""State hybrids computed through the SPEC 13 arena match their own forward.

A tiny Qwen3-Next (Gated DeltaNet + full attention, ``transformers``' torch path on the CPU), a
tiny Bamba (mamba2 + full attention), a tiny Falcon-H1 (attention and mamba2 in every layer:
two cache layers per model layer), a tiny Zamba2 (mamba2 layers, and hybrid layers that run
one shared attention block before their mamba2 mixer) and a tiny Jamba (mamba1 + full
attention: chunks that follow a state run one token per forward) run on
``FlatKVCache(arena=)`` through ``flat_kvcache.torch.runner``; the attention-free Mamba and
Mamba-2 run the cases that do not need K/V pages. Attention layers write and read their K/V in
the arena's pages, state layers start each step from the state slot ``state_slots`` names
(copied into the write slot where they differ) and leave their state there. Nothing else
carries state from step to step, so logits equal to the model's own whole forward (one piece,
no cache) prove the slots, checkpoints and tables right. The arena starts NaN-poisoned (all
but unit 0, the null page and slot), so a read of a slot nobody wrote shows.

Expectations come from SPEC 13: checkpoints every ``G`` tokens where chunks end (13.5a), at a
branch point (13.5c), a hit resumes at the latest checkpoint on the prompt's path, never at its
last token; they do not come from the engine's answers. Both engines run every case.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any

import pytest
from helpers import missing, one_thread  # noqa: F401  (an autouse fixture)

try:
    import torch
    import transformers  # noqa: F401  (tiny_model builds its models)
except ImportError as exc:
    missing(exc.name or "torch/transformers", exc)

import flat_kvcache
import flat_kvcache.reference
from flat_kvcache.torch import ArenaBuffers, ArenaHostBuffers, TransferExecutor, allocate_arena
from flat_kvcache.torch.runner import (
    PagedModelRunner,
    RequestRecord,
    arena_for_units,
    arena_specs,
    max_logit_error,
    model_shape,
    run_greedy,
    tiny_model,
)

pytestmark = [
    pytest.mark.torch,
    pytest.mark.skipif(not flat_kvcache.FLAT_KVCACHE, reason="needs the flat build"),
]

#: float32 models; the GDN and mamba2 chunked kernels round a little differently per cut.
TOLERANCE = 1e-3
#: Tokens per K/V page and the state checkpoint grain.
P = 4
G = 8
KINDS = ["qwen3-next", "bamba", "falcon-h1", "zamba2", "jamba"]
#: The hybrids and the attention-free state models. These have no K/V pages: a branch point is
#: not found by a page match, and the tight arenas below are sized to make hybrids preempt and
#: evict, so they run only the cases that need neither.
ALL_KINDS = [*KINDS, "mamba", "mamba2"]
ENGINES = [
    pytest.param(flat_kvcache, id="native"),
    pytest.param(flat_kvcache.reference, id="reference"),
]


_MODELS: dict[str, Any] = {}


def model_of(kind: str) -> Any:
    if kind not in _MODELS:
        _MODELS[kind] = tiny_model(kind, num_layers=4, seed=0)
    return _MODELS[kind]


@dataclass
class Setup:
    model: Any
    cache: Any
    arena: ArenaBuffers
    runner: PagedModelRunner


def setup(
    kind: str,
    engine: ModuleType,
    num_units: int = 64,
    *,
    max_live: int = 1,
    host_pages: int = 0,
    **options: Any,
) -> Setup:
    model = model_of(kind)
    shape = model_shape(model.config)
    plan = arena_for_units(shape, page_size=P, num_units=num_units, max_live_requests=max_live)
    arena = allocate_arena(shape, plan, "cpu")
    arena.arena[plan.unit_bytes :].fill_(0xFF)  # NaN in float32; unit 0 (null page and slot) stays 0
    specs = arena_specs(shape, page_size=P, state_grain=G)
    cache = engine.FlatKVCache(specs, arena=plan, host_pages=host_pages, **options)
    runner = PagedModelRunner(model, cache, arena, poison_new_pages=True)
    return Setup(model, cache, arena, runner)


def host_executor(
    s: Setup, host_pages: int, executor: type[TransferExecutor] = TransferExecutor
) -> TransferExecutor:
    """The executor of ``s``'s host tier: ``host_pages`` pages per group, NaN-poisoned."""
    host = ArenaHostBuffers(s.arena.plan, host_pages)
    for tensor in host.tensors.values():
        tensor.fill_(0xFF)
    return executor(s.cache, s.arena, host)


def tokens(seed: int, n: int) -> list[int]:
    return torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def starts(record: RequestRecord) -> list[int]:
    """The first position of each forward that computed some of the request."""
    return [positions[0] for positions, _ in record.computed]


def exact(s: Setup, records: dict[str, RequestRecord]) -> None:
    error = max_logit_error(s.model, records)
    assert error <= TOLERANCE, error
    s.cache.check_invariants()


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("kind", ALL_KINDS)
def test_one_request_greedy_in_one_prefill(kind: str, engine: ModuleType) -> None:
    s = setup(kind, engine)
    records = run_greedy(s.runner, {"a": tokens(1, 21)}, 8)
    # no chunk limit, but the prefill is cut at the body's end, the last multiple of G before
    # the last prompt token (13.5b: 16 of 21), then one forward per decoded token but the last
    assert starts(records["a"]) == [0, 16, *range(21, 28)]
    exact(s, records)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("kind", ALL_KINDS)
def test_chunked_prefill_writes_checkpoints_on_the_grain(kind: str, engine: ModuleType) -> None:
    s = setup(kind, engine)
    records = run_greedy(s.runner, {"a": tokens(2, 30)}, 4, chunk_size=12)
    # a 12-token limit is cut to the last grain boundary: chunks end at 8, 16, 24, then the rest
    assert starts(records["a"])[:4] == [0, 8, 16, 24]
    # checkpoints where chunks end on the grain before the last prompt token (13.5a-b: 8, 16,
    # 24), and in decode (positions 30, 31, 32 computed) the step that leaves 32 computed (13.5d)
    assert s.cache.stats()["checkpoints_written"] == 4
    exact(s, records)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("kind", ALL_KINDS)
def test_a_second_request_resumes_from_a_checkpoint_and_computes_only_the_rest(
    kind: str, engine: ModuleType
) -> None:
    s = setup(kind, engine)
    base = tokens(3, 30)
    prompts = {"a": base, "b": [*base[:27], 5, 6, 7]}
    records = run_greedy(s.runner, prompts, 3, chunk_size=12, max_running=1)
    # b shares 27 tokens; a left checkpoints at 8, 16 and 24: b resumes at 24
    assert records["b"].hits == [24]
    assert starts(records["b"])[0] == 24
    assert s.cache.stats()["checkpoints_hit"] == 1
    exact(s, records)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("kind", ALL_KINDS)
def test_a_turn_whose_prompt_ends_on_the_grain_resumes_the_next_at_its_end(
    kind: str, engine: ModuleType
) -> None:
    """SPEC 13.5d with a prompt that ends on the grain: turn 1 is 16 tokens (2 G) and 4 greedy
    tokens, 3 of them computed (positions 16..18: no decode step ends on a multiple of 8), so
    the last multiple of G within the computed tokens is the prompt's end. Turn 2 carries turn 1
    and 3 more tokens: it resumes at 16 (not at the body's end, 8) and computes only the rest,
    with the model's own logits: the checkpoint at 16 holds the state after token 15."""
    s = setup(kind, engine)
    first = run_greedy(s.runner, {"turn1": tokens(11, 16)}, 4)
    assert starts(first["turn1"]) == [0, 8, 16, 17, 18]
    follow_up = [*first["turn1"].tokens, 3, 1, 4]
    second = run_greedy(s.runner, {"turn2": follow_up}, 2)
    assert second["turn2"].hits == [16]
    assert starts(second["turn2"])[0] == 16
    exact(s, {**first, **second})


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("kind", KINDS)
def test_a_branch_point_is_checkpointed_and_hit_by_a_third_request(kind: str, engine: ModuleType) -> None:
    s = setup(kind, engine)
    base = tokens(4, 30)
    b = base[:20] + tokens(40, 6)
    c = b[:18] + tokens(41, 5)
    records = run_greedy(s.runner, {"a": base, "b": b, "c": c}, 2, max_running=1)
    # a is prefilled without a chunk limit: its only prompt checkpoint is at its body's end, 24
    assert starts(records["a"])[:2] == [0, 24]
    # b leaves a's path at 20: its K/V pages match 20 tokens, but no checkpoint lies on the
    # path below 24, so it starts from nothing; its first chunk ends at the branch point, 20
    # aligned down to the grain, and leaves a checkpoint there (13.5c), then its body end 24
    assert records["b"].hits == [0]
    assert starts(records["b"])[:3] == [0, 16, 24]
    # c follows b for 18 tokens: it resumes from the branch point's checkpoint
    assert records["c"].hits == [16]
    assert starts(records["c"])[0] == 16
    exact(s, records)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("kind", KINDS)
def test_preemption_under_a_tight_arena_resumes_exactly(kind: str, engine: ModuleType) -> None:
    s = setup(kind, engine, num_units=10, max_live=4)
    prompts = {f"r{i}": tokens(50 + i, 18 + 3 * i) for i in range(5)}
    records = run_greedy(s.runner, prompts, 10, chunk_size=8, max_running=4)
    assert sum(r.preemptions for r in records.values()) > 0
    assert s.cache.stats()["preemptions"] > 0
    exact(s, records)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("kind", KINDS)
def test_an_evicted_checkpoint_falls_back_to_an_earlier_one(kind: str, engine: ModuleType) -> None:
    s = setup(kind, engine, num_units=12, max_live=1)
    base = tokens(6, 30)
    # a leaves checkpoints at 8, 16, 24; b (sharing 10) hits 8 and makes it the most recent;
    # an unrelated request x then fills the arena, evicting the least recently used cached data
    prompts = {"a": base, "b": base[:10] + tokens(60, 10)}
    prompts["x"] = tokens(70, 30)
    prompts["c"] = [*base[:28], 1, 2]
    records = run_greedy(s.runner, prompts, 2, chunk_size=12, max_running=1)
    assert records["b"].hits == [8]
    stats = s.cache.stats()
    assert stats["checkpoints_evicted"] > 0
    # without eviction c would resume at 24; its hit is an earlier checkpoint that survived
    (hit,) = records["c"].hits
    assert hit % G == 0 and 0 < hit < 24, hit
    assert starts(records["c"])[0] == hit
    exact(s, records)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("kind", KINDS)
def test_whole_prefixes_drop_only_pages_no_checkpoint_can_resume(kind: str, engine: ModuleType) -> None:
    # SPEC 13.8c under the reuse policy: a finished request's full-attention pages past its last
    # kept checkpoint lose their keys (no hit can resume there), and when a checkpoint is evicted
    # the pages only its path held go too. Every later hit must still compute exactly.
    s = setup(kind, engine, num_units=12, max_live=1, eviction_policy="reuse", enable_kv_events=True)
    specs = arena_specs(model_shape(s.model.config), page_size=P, state_grain=G)
    full = next(g for g, spec in enumerate(specs) if spec.kind == "full")
    base = tokens(6, 30)
    first = run_greedy(s.runner, {"a": base}, 2, chunk_size=12, max_running=1)
    # a: checkpoints at 8, 16, 24 (chunks cut on the grain; all kept); its 7 full pages of 4
    # tokens hold [0, 28): page 6 ([24, 28)) lies past every checkpoint and is the only one
    # dropped.
    removed = [
        h.hex()
        for e in s.cache.take_events()
        if isinstance(e, flat_kvcache.events.BlockRemoved) and e.group_index == full
        for h in e.block_hashes
    ]
    assert removed == [flat_kvcache.hash_pages(base, P)[6]]
    # Then a follow-up turn (hits 24), an unrelated 50-token request that fills the arena
    # (checkpoints evicted, their paths' pages dropped with them), and the first prompt again.
    rest = {"b": [*base, *tokens(61, 10)], "x": tokens(70, 50), "c": [*base[:28], 1, 2]}
    records = run_greedy(s.runner, rest, 2, chunk_size=12, max_running=1)
    assert records["b"].hits == [24]
    assert s.cache.stats()["checkpoints_evicted"] > 0
    (hit,) = records["c"].hits
    assert hit % G == 0 and starts(records["c"])[0] == hit
    exact(s, {**first, **records})


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("kind", KINDS)
def test_an_earlier_chunk_end_checkpoint_resumes_exactly_under_reuse(kind: str, engine: ModuleType) -> None:
    # SPEC 13.8: a checkpoint at t serves every later prompt that shares at least t tokens, so
    # under reuse a finished request keeps its earlier chunk ends too. a (chunks of 12, cut on
    # the grain) leaves 8, 16 and 24; b shares 18 tokens and diverges before 24: it resumes at
    # 16 and computes only the rest, with the model's own logits.
    s = setup(kind, engine, eviction_policy="reuse")
    base = tokens(8, 30)
    prompts = {"a": base, "b": [*base[:18], *tokens(62, 6)]}
    records = run_greedy(s.runner, prompts, 2, chunk_size=12, max_running=1)
    assert starts(records["a"])[:4] == [0, 8, 16, 24]
    assert records["b"].hits == [16]
    assert starts(records["b"])[0] == 16
    exact(s, records)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("policy", ["lru", "reuse"])
def test_a_finish_checkpoint_the_policy_does_not_keep_is_recomputed_exactly(
    kind: str, engine: ModuleType, policy: str
) -> None:
    """SPEC 13.8b: under reuse a finished request's finish checkpoint (13.5d) is kept until 16
    were left, then only while prompts were seen to resume at finish checkpoints (or their
    ghosts) and as many as the evictions they cause would have served; else it is released (its
    slot back to the pool). w0 and a have 22-token prompts and 3 greedy tokens: a body end at 16 (13.5b) and a
    finish checkpoint at 24 (24 tokens computed). w0's body end is resumed from once (by w1),
    16 short requests each leave a finish checkpoint at 8 and none is resumed from, so a's
    decode writes none (a decode checkpoint is written only while finish checkpoints are kept:
    a writes its body end only), and the next turn b, which carries a's answer, resumes at a's
    body end and recomputes [16, 24) with the model's own logits: no read of a slot that was
    never written. Under lru (13.8: every checkpoint stays until evicted) b resumes at 24. The
    arena is roomy: nothing is evicted, so only the policy can take b's checkpoint away."""
    s = setup(kind, engine, num_units=256, max_live=16, eviction_policy=policy)
    first = tokens(80, 22)
    records = run_greedy(s.runner, {"w0": first}, 3)
    assert starts(records["w0"]) == [0, 16, 22, 23]
    # w1 shares 18 tokens with w0: it resumes at w0's body end
    records |= run_greedy(s.runner, {"w1": [*first[:18], *tokens(81, 4)]}, 1)
    assert records["w1"].hits == [16]
    # 16 unrelated 6-token prompts, 3 greedy tokens each: a finish checkpoint at 8, no body end
    warm = {f"w{i}": tokens(80 + i, 6) for i in range(2, 18)}
    records |= run_greedy(s.runner, warm, 3, max_running=16)
    assert all(records[r].hits == [0] for r in warm)
    written = s.cache.stats()["checkpoints_written"]
    records |= run_greedy(s.runner, {"a": tokens(99, 22)}, 3)
    assert starts(records["a"]) == [0, 16, 22, 23]
    # a's body end at 16, and under lru its finish checkpoint at 24
    assert s.cache.stats()["checkpoints_written"] - written == (2 if policy == "lru" else 1)
    records |= run_greedy(s.runner, {"b": [*records["a"].tokens, 3, 1, 4]}, 1)
    assert s.cache.stats()["checkpoints_evicted"] == 0
    resumed = 24 if policy == "lru" else 16
    assert records["b"].hits == [resumed]
    assert starts(records["b"])[0] == resumed
    exact(s, records)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("policy", ["lru", "reuse"])
def test_a_finish_checkpoint_kept_again_after_its_ghost_was_reached_is_resumed_exactly(
    kind: str, engine: ModuleType, policy: str
) -> None:
    """SPEC 13.8b, the finish rule coming back: w0's body end is resumed from, and 16 short
    requests leave finish checkpoints no prompt resumes at, so under reuse c's decode writes
    none and its finish leaves a ghost at 24. d carries c's answer: it resumes at c's body
    end (16), recomputes [16, 24) and reaches the ghost, so finish checkpoints have served a
    prompt and nothing was evicted: e's decode writes its checkpoint again and f, carrying
    e's answer, resumes at e's finish checkpoint (24), reading the state slot e's decode
    wrote. Under lru every next turn resumes at 24. Every logit equals the unpaged model's."""
    s = setup(kind, engine, num_units=256, max_live=16, eviction_policy=policy)
    # w1 resumes at w0's body end (16): body ends pay, so the rule before this one (finish
    # checkpoints against body ends) released every finish checkpoint from here on for good.
    first = tokens(80, 22)
    records = run_greedy(s.runner, {"w0": first}, 3)
    records |= run_greedy(s.runner, {"w1": [*first[:18], *tokens(81, 4)]}, 1)
    assert records["w1"].hits == [16]
    warm = {f"w{i}": tokens(80 + i, 6) for i in range(2, 18)}
    records |= run_greedy(s.runner, warm, 3, max_running=16)
    for turn, then, seed in (("c", "d", 97), ("e", "f", 98)):
        records |= run_greedy(s.runner, {turn: tokens(seed, 22)}, 3)
        records |= run_greedy(s.runner, {then: [*records[turn].tokens, 2, 7, 1]}, 1)
    assert s.cache.stats()["checkpoints_evicted"] == 0
    assert records["d"].hits == [24 if policy == "lru" else 16]
    assert records["f"].hits == [24]
    assert starts(records["f"])[0] == 24
    exact(s, records)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("kind", KINDS)
def test_decode_checkpoints_evicted_mid_decode_leave_every_logit_exact(kind: str, engine: ModuleType) -> None:
    """SPEC 13.8b (reuse): four requests decode 40 tokens each at once over a 14-unit arena, so
    the pool evicts checkpoints all along, the decoding requests' own among them (each decode
    checkpoint after a request's first is dated at its decode start, the oldest in the order),
    and requests are preempted and recompute. Their next turns carry the answers: the first
    resumes inside its previous turn's answer (a checkpoint decode wrote, kept at the finish),
    every hit sits on the grain (a first admission's below its prompt's last token), and every
    logit equals the unpaged model's."""
    s = setup(kind, engine, num_units=14, max_live=4, eviction_policy="reuse")
    prompts = {f"p{i}": tokens(300 + i, 9 + 3 * i) for i in range(4)}
    records = run_greedy(s.runner, prompts, 40, max_running=4)
    turns = {f"n{i}": [*records[f"p{i}"].tokens, 5, 6] for i in range(4)}
    records |= run_greedy(s.runner, turns, 2, max_running=4)
    assert s.cache.stats()["checkpoints_evicted"] > 0
    assert records["n0"].hits[0] > len(prompts["p0"])
    for req, record in records.items():
        # a preempted request comes back with its computed tokens: its later hits may pass its
        # prompt's end, never its first
        assert all(hit % G == 0 for hit in record.hits) and record.hits[0] < len(record.prompt), req
    exact(s, records)


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_fresh_state_slots_are_poisoned_until_written(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    s = setup(kind, flat_kvcache)
    fresh: list[bool] = []
    seen: set[int] = set()
    load = s.runner._load_state

    def checked(read: int, write: int) -> Any:
        if write not in seen:  # a slot's first step: poison, unless a K/V page used its unit
            seen.add(write)
            layer = s.runner.state_layers[0][0]
            fresh.append(bool(torch.isnan(s.arena.state(layer, "ssm")[write]).all()))
        return load(read, write)

    monkeypatch.setattr(s.runner, "_load_state", checked)
    base = tokens(7, 30)
    records = run_greedy(s.runner, {"a": base, "b": [*base[:26], 3]}, 2, chunk_size=12, max_running=1)
    # b starts from a's checkpoint at 24; a's and b's first steps write slots of units no
    # one used before (the arena hands out never-used units first): they hold the poison
    assert records["b"].hits == [24]
    assert fresh[:2] == [True, True]
    exact(s, records)


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_a_shifted_state_slot_is_caught(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    s = setup(kind, flat_kvcache.reference)  # a Python object: its state_slots can be wrapped
    slots = s.cache.state_slots

    def shifted(slot_list: Any, counts: Any) -> Any:
        read, write = slots(slot_list, counts)
        moved = read.copy()
        moved[moved > 0] += 1  # the slot next to the checkpoint: not this request's state
        return moved, write

    monkeypatch.setattr(s.cache, "state_slots", shifted)
    base = tokens(8, 30)
    records = run_greedy(s.runner, {"a": base, "b": [*base[:26], 3]}, 2, chunk_size=12, max_running=1)
    assert max_logit_error(s.model, records) > TOLERANCE


def test_a_kv_plan_with_a_state_group_is_refused_by_the_runner() -> None:
    from flat_kvcache.torch import allocate_kv_buffers
    from flat_kvcache.torch.runner import plan_for_pages

    model = model_of("qwen3-next")
    shape = model_shape(model.config)
    # Equal pages, asked for: a state shape's default storage is the arena.
    plan = plan_for_pages(
        shape,
        page_size=16,
        num_pages=8,
        max_live_requests=1,
        max_scheduled_tokens=16,
        max_context_len=64,
        storage="equalized",
    )
    cache = flat_kvcache.FlatKVCache(list(flat_kvcache.kv_cache_specs(plan.groups)), plan.num_pages)
    with pytest.raises(ValueError, match="SPEC 13 arena"):
        PagedModelRunner(model, cache, allocate_kv_buffers(plan, "cpu"))


#: Device evictions under a host tier: a, then an unrelated request that evicts a's cached pages
#: and checkpoints from 12 units, then c, which shares 28 of a's tokens.
def evicted_then_resumed(seed: int) -> dict[str, list[int]]:
    base = tokens(seed, 30)
    return {"a": base, "x": tokens(seed + 1, 30), "y": tokens(seed + 2, 30), "c": [*base[:28], 1, 2]}


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("kind", KINDS)
def test_checkpoints_offloaded_to_the_host_tier_come_back_exactly(kind: str, engine: ModuleType) -> None:
    s = setup(kind, engine, num_units=12, host_pages=64)
    executor = host_executor(s, 64)
    records = run_greedy(
        s.runner, evicted_then_resumed(9), 2, chunk_size=12, max_running=1, transfers=executor
    )
    stats = s.cache.stats()
    # a's checkpoints (8, 16, 24) and pages were stored write-through; the device lost them to
    # x and y, and c resumes at 24 (the deepest checkpoint on its 28 shared tokens) from host
    assert stats["checkpoints_evicted"] > 0
    assert records["c"].hits == [24]
    assert stats["host_loads"] > 0 and stats["host_hits_tokens"] > 0
    assert starts(records["c"])[0] == 24
    exact(s, records)


@pytest.mark.parametrize("kind", KINDS)
def test_a_host_load_acknowledged_without_its_copy_is_caught(kind: str) -> None:
    class AckOnly(TransferExecutor):
        """Stores for real, acknowledges loads without copying (the device keeps its poison or
        whatever the unit held)."""

        def _copy(self, stores: Any, loads: Any, ids: list[Any]) -> tuple[int, int]:
            moved = super()._copy(stores, {}, ids)
            ids.extend(group_ids for group_ids, _, _ in loads.values())
            return moved

    s = setup(kind, flat_kvcache, num_units=12, host_pages=64)
    broken = host_executor(s, 64, AckOnly)
    records = run_greedy(s.runner, evicted_then_resumed(9), 2, chunk_size=12, max_running=1, transfers=broken)
    assert records["c"].hits == [24] and s.cache.stats()["host_loads"] > 0
    assert max_logit_error(s.model, records) > TOLERANCE
