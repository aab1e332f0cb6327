"""The ``reuse`` checkpoint policy (SPEC 13.8), hand-derived on both engines.

A model with one full-attention group (4-token pages) and one state group (checkpoint grain
G = 8) over an arena roomy enough that nothing is evicted, so every difference below comes from
the policy's own rules:

- every checkpoint SPEC 13.5 writes stays cached until the pool evicts it, under both policies:
  a checkpoint at t serves every later prompt that shares at least t tokens, wherever it
  diverges after t (no drop at finish);
- the sharing grain S is the largest G * 2**k dividing 9 in 10 of the divergence points seen,
  once 16 were seen (G before);
- under S > G a prompt's body ends at the last multiple of S before its last token;
- body ends are written until 16 were, then while prompts resume at them per body end written
  at least as often as at finish checkpoints per finish checkpoint left, and at least p_M (below)
  per body end written charged min(N_B, E) evictions; a checkpoint counts for its role at its
  first resume only;
- at a request's finish its finish checkpoint is kept until 16 were left, then while the prompts
  resumed at finish checkpoints or their ghosts (one not kept is remembered by its boundary)
  are more than none and at least p_M * C, p_M the prompts that reached an evicted
  checkpoint's ghost per such eviction, C such evictions (of checkpoints not of the finish
  role: decode checkpoints, kept finish checkpoints) the finish role caused, each counted as
  the role's share of the cached checkpoints; in decode a decode checkpoint is written only
  while that holds;
- a decode checkpoint after a request's first is dated, in the pool's eviction order, at the
  first one's date (the request's decode start), and a kept finish checkpoint at the finish;
- each of its chunk ends still cached is kept until 16 were kept, then while prompts resume at
  chunk ends per chunk end kept at least as often as at body ends per body end written (else
  released, uncached);
- the counts those rules compare decay by 1 - 1/slots per admitted prompt (slots: the state
  pages; the arenas here are roomy, so the decay is small).

``lru`` keeps today's rules (the same calls give the SPEC 13.5 cuts and hits).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import flat_kvcache
import flat_kvcache.reference
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

P, G = 4, 8
ENGINES = [
    pytest.param(flat_kvcache, id="native"),
    pytest.param(flat_kvcache.reference, id="reference"),
]


def make(engine: ModuleType, policy: str, arena_bytes: int = 400 * 1024, live: int = 4) -> Any:
    components = [
        flat_kvcache.ComponentSpec("full", 0, "kv", bytes_per_slot=64, const_bytes=0),
        flat_kvcache.ComponentSpec("lin", 1, "ssm", bytes_per_slot=0, const_bytes=1024),
    ]
    plan = flat_kvcache.plan_arena(components, P, arena_bytes, max_live_requests=live)
    specs = [
        flat_kvcache.KVCacheSpec("full", P, group_id="full"),
        flat_kvcache.KVCacheSpec("state", G, group_id="lin"),
    ]
    return engine.FlatKVCache(specs, arena=plan, eviction_policy=policy, enable_kv_events=True)


def run(
    cache: Any, req: str, prompt: list[int], limit: int = 1 << 20, decode: int = 0
) -> tuple[int, list[int]]:
    """Add, compute the prompt in next_chunk cuts of at most ``limit``, decode ``decode``
    tokens, finish; returns the hit and the chunk sizes."""
    slot, hit = cache.add_request(req, prompt)
    chunks = []
    while (n := cache.next_chunk(slot, limit)) > 0:
        assert cache.schedule([slot], [n])[0]
        chunks.append(n)
    for i in range(decode):
        cache.append_tokens([slot], [10_000 + i])
        assert cache.schedule([slot], [1])[0]
    cache.finish([slot])
    return int(hit), chunks


def base(n: int, seed: int = 0) -> list[int]:
    return [1000 * seed + i for i in range(n)]


def teach(cache: Any, count: int = 16) -> None:
    """``count`` prompts that follow a cached 40-token prompt for exactly 32 tokens (a multiple
    of 32 but not of 64): divergence points at 32."""
    run(cache, "taught", base(40))
    for i in range(count):
        run(cache, f"d{i}", [*base(32), *base(9, seed=i + 1)])


@pytest.mark.parametrize("engine", ENGINES)
def test_the_body_ends_on_the_learned_sharing_grain(engine: ModuleType) -> None:
    reuse, lru = make(engine, "reuse"), make(engine, "lru")
    teach(reuse, 15)
    teach(lru, 15)
    prompt = base(50, seed=99)
    # 15 divergence points: too few, S is still G: the body ends at 48 (last multiple of 8 < 49)
    assert run(reuse, "early", prompt)[1] == [48, 2]
    teach(reuse, 1)  # the 16th point (the taught prompt again is a full match, not a point)
    # 16 points, every one a multiple of 32, none of 64: S = 32, the body ends at 32
    assert run(reuse, "late", base(50, seed=98))[1] == [32, 18]
    assert run(lru, "late", base(50, seed=98))[1] == [48, 2]


@pytest.mark.parametrize("engine", ENGINES)
def test_every_prompt_checkpoint_serves_the_prompts_that_reach_it(engine: ModuleType) -> None:
    reuse, lru = make(engine, "reuse"), make(engine, "lru")
    teach(reuse)
    teach(lru)
    prompt = base(70, seed=50)
    # chunks of at most 16: cut at the grain 16, 32, 48, then the body's end (64 under S = 32,
    # 64 under G = 8 too), then the tail; checkpoints at 16, 32, 48 and 64
    assert run(reuse, "long", prompt, limit=16)[1] == [16, 16, 16, 16, 6]
    assert run(lru, "long", prompt, limit=16)[1] == [16, 16, 16, 16, 6]
    # A prompt sharing 52 tokens reaches the checkpoints at 16, 32 and 48 and diverges past 48:
    # the deepest, 48, serves it under both policies (SPEC 13.8: none is dropped at finish).
    follower = [*prompt[:52], *base(5, seed=51)]
    assert run(lru, "follower", follower)[0] == 48
    assert run(reuse, "follower", follower)[0] == 48
    # One sharing 20 tokens diverges past 16 only: 16 serves it.
    assert run(reuse, "short", [*prompt[:20], *base(5, seed=53)])[0] == 16
    # the next turn resumes at the last under both
    turn = [*prompt, *base(5, seed=52)]
    assert run(lru, "turn", turn)[0] == 64
    assert run(reuse, "turn", turn)[0] == 64


@pytest.mark.parametrize("engine", ENGINES)
def test_every_decode_checkpoint_stays_for_the_next_turn(engine: ModuleType) -> None:
    # Each request: a 9-token prompt, then 16 decoded tokens: decode's latest checkpoint is at
    # 24 (computed reaches 24 after the 15th decode step; the 16th token is not computed). A
    # next turn carrying the answer shares 24 + tokens with it: it resumes at 24, for every
    # request (SPEC 13.5d, 13.8: no request's decode checkpoint is dropped at finish).
    for policy in ("reuse", "lru"):
        cache = make(engine, policy)
        prompts = [base(9, seed=200 + i) for i in range(9)]
        for i, prompt in enumerate(prompts):
            run(cache, f"r{i}", prompt, decode=16)
        answers = [[*p, *(10_000 + j for j in range(15))] for p in prompts]
        hits = [run(cache, f"again{i}", [*answers[i], 7])[0] for i in range(9)]
        assert hits == [24] * 9, policy


@pytest.mark.parametrize("engine", ENGINES)
def test_issue_38_an_earlier_chunk_end_serves_a_prompt_diverging_past_it(engine: ModuleType) -> None:
    # Issue 38's reproduction on the qwen3.5-like preset over a 40 GiB arena (nothing evicted):
    # a 4,000-token prompt computed in 1,024-token chunks leaves checkpoints at 1,024, 2,048
    # and 3,072 (13.5a) and at its body's end; a prompt of its first 3,000 tokens and 100
    # others shares at least 2,048 tokens and diverges before 3,072, so the checkpoint at
    # 2,048 serves it, under either policy (it used to be 0 under reuse).
    import dataclasses

    from flat_kvcache import plan_arena
    from flat_kvcache._types import STATE, kv_cache_specs
    from flat_kvcache.config import group_specs_from_config
    from flat_kvcache.presets import get_preset
    from flat_kvcache.torch import ModelShape

    cfg = get_preset("qwen3.5-like")
    arena = plan_arena(ModelShape.from_config(cfg).components(), 16, 40 * 2**30)
    # 16-token attention pages, state checkpoints every 64 tokens (cache_from_config's default).
    specs = [
        dataclasses.replace(spec, page_size=64) if spec.kind == STATE else spec
        for spec in kv_cache_specs(group_specs_from_config(cfg, page_size=16))
    ]
    prompt = base(4000, seed=3)
    for policy in ("reuse", "lru"):
        cache = engine.FlatKVCache(specs, arena=arena, eviction_policy=policy)
        slot, _ = cache.add_request("long", prompt)
        while (n := cache.next_chunk(slot, 1024)) > 0:
            assert cache.schedule([slot], [n])[0]
        cache.finish([slot])
        assert cache.prefix_hit_tokens([*prompt[:3000], *base(100, seed=4)]) == 2048, policy


@pytest.mark.parametrize("engine", ENGINES)
def test_an_unknown_policy_is_refused_by_name(engine: ModuleType) -> None:
    with pytest.raises(ValueError, match="eviction_policy must be 'lru' or 'reuse', got 'LRU'"):
        make(engine, "LRU")


# --- whole hybrid prefixes --------------------------------------------------------------------


def hashes_of(tokens: list[int]) -> list[str]:
    return list(flat_kvcache.hash_pages(tokens, P))


def removed_full(cache: Any) -> list[str]:
    """The full-attention page hashes (hex) the events since the last call removed."""
    return [
        h.hex()
        for e in cache.take_events()
        if isinstance(e, flat_kvcache.events.BlockRemoved) and e.group_index == 0
        for h in e.block_hashes
    ]


@pytest.mark.parametrize("engine", ENGINES)
def test_a_finished_requests_pages_past_its_last_checkpoint_are_dropped(engine: ModuleType) -> None:
    # 70 tokens in chunks of 16: checkpoints at 16, 32, 48, 64 (all on S = G = 8, so all kept).
    # Base pages are 4 tokens: page 16 ([64, 68)) lies on no kept checkpoint's path [0, t), so
    # under reuse it can never be hit and is dropped when the request finishes; lru keeps it.
    prompt = base(70, seed=7)
    reuse, lru = make(engine, "reuse"), make(engine, "lru")
    for cache in (reuse, lru):
        run(cache, "a", prompt, limit=16)
    assert removed_full(reuse) == [hashes_of(prompt)[16]]
    assert removed_full(lru) == []
    # The hit is the same (it stops at the checkpoint at 64 either way).
    follower = [*prompt, 5, 6, 7]
    assert run(reuse, "b", follower)[0] == run(lru, "b", follower)[0] == 64


@pytest.mark.parametrize("engine", ENGINES)
def test_a_finished_requests_pages_on_another_kept_path_stay(engine: ModuleType) -> None:
    # p (40 tokens, S = G = 8) keeps its body end, 32: its path holds pages 0 to 7 ([0, 32)).
    # r shares p's first 20 tokens: it resumes at 0 (no checkpoint within its match), cuts its
    # branch point at 16 and keeps it; its pages past 16 are [16, 20) (page 4, on p's path) and
    # a partial one. Page 4 is past r's deepest checkpoint but p's path holds it: it stays.
    cache = make(engine, "reuse")
    prompt = base(40, seed=80)
    run(cache, "p", prompt)
    assert removed_full(cache) == hashes_of(prompt)[8:10]  # past 32: no path holds them
    assert run(cache, "r", [*prompt[:20], 7]) == (0, [16, 5])
    assert removed_full(cache) == []
    # p's next turn still resumes at 32 (it would stop at r's 16 had page 4 been dropped).
    assert run(cache, "p2", [*prompt, 1, 2, 3])[0] == 32


def tight(engine: ModuleType, policy: str) -> Any:
    """:func:`make` over an arena of 14 KiB for one live request: checkpoints get evicted."""
    return make(engine, policy, 14 * 1024, live=1)


def dead_pages(cache: Any, prompts: list[list[int]], index: dict[int, set[str]]) -> set[str]:
    """Cached full-attention pages (from the replayed events) on the path ``[0, t)`` of no cached
    checkpoint of any prompt: pages no prefix hit can ever use."""
    for e in cache.take_events():
        if isinstance(e, flat_kvcache.events.BlockStored):
            index[e.group_index].update(h.hex() for h in e.block_hashes)
        elif isinstance(e, flat_kvcache.events.BlockRemoved):
            index[e.group_index].difference_update(h.hex() for h in e.block_hashes)
    live: set[str] = set()
    for prompt in prompts:
        pages = hashes_of(prompt)
        keys = flat_kvcache.fold_hashes(pages, 0, G // P)  # the checkpoint at (i + 1) * G
        for i, key in enumerate(keys):
            if key in index[1]:
                live.update(pages[: (i + 1) * G // P])
    return index[0] - live


@pytest.mark.parametrize("engine", ENGINES)
def test_an_evicted_checkpoint_takes_the_pages_only_its_path_held(engine: ModuleType) -> None:
    # One request at a time over a tight arena: three conversations of two turns each, the
    # second turn extending the first. Checkpoints get evicted; under reuse no cached full-
    # attention page is ever left that no cached checkpoint's path holds (SPEC 13.8, whole
    # hybrid prefixes), under lru such pages pile up.
    turns = []
    for c in range(3):
        first = base(60, seed=400 + c)
        turns += [first, [*first, *base(30, seed=500 + c)]]
    order = [turns[0], turns[2], turns[1], turns[4], turns[3], turns[5]]
    found: dict[str, list[int]] = {}
    for policy in ("reuse", "lru"):
        cache = tight(engine, policy)
        index: dict[int, set[str]] = {0: set(), 1: set()}
        dead = []
        for i, prompt in enumerate(order):
            run(cache, f"r{i}", prompt, limit=16)
            dead.append(len(dead_pages(cache, turns, index)))
        assert cache.stats()["checkpoints_evicted"] > 0
        found[policy] = dead
    assert found["reuse"] == [0] * 6
    assert max(found["lru"]) > 0


def event_stream(cache: Any) -> list[tuple[str, int, list[str]]]:
    """The stored and removed pages of the events since the last call, in order."""
    out = []
    for e in cache.take_events():
        if isinstance(e, (flat_kvcache.events.BlockStored, flat_kvcache.events.BlockRemoved)):
            out.append((type(e).__name__, e.group_index, [h.hex() for h in e.block_hashes]))
    return out


@settings(max_examples=40, deadline=None)
@given(
    data=st.data(),
    conversations=st.integers(1, 4),
    turns=st.integers(2, 5),
    arena_kib=st.sampled_from([14, 20, 400]),
)
def test_multi_turn_conversations_drop_the_same_pages_in_both_engines(
    data: st.DataObject, conversations: int, turns: int, arena_kib: int
) -> None:
    # Each turn resumes from the checkpoint its conversation's previous turn kept, so its path
    # runs through that one's: the native engine keeps the paths as a radix tree while the
    # reference counts every whole path per hash; the pages they drop, and when, must agree
    # event for event. Conversations may share a prefix, so paths part and split the native
    # engine's edges.
    prompts: list[list[int]] = []
    order = []
    for c in range(conversations):
        # Later conversations may open with a prefix of the first one's (branches in the tree).
        shared = data.draw(st.integers(0, 40), label="shared") if c else 0
        prompt = [*base(shared, seed=600), *base(data.draw(st.integers(1, 40), label="first"), seed=600 + c)]
        for t in range(turns):
            if t:
                extra = data.draw(st.integers(1, 30), label="extension")
                prompt = [*prompt, *base(extra, seed=700 + 10 * c + t)]
            prompts.append(prompt)
            order.append((c, t, len(prompts) - 1))
    # Interleave the conversations, keeping each one's turns in order.
    shuffled = data.draw(st.permutations(order), label="interleaving")
    queue: dict[int, list[int]] = {}
    for c, _, i in order:
        queue.setdefault(c, []).append(i)
    sequence = []
    for c, _, _ in shuffled:
        sequence.append(queue[c].pop(0))
    limit = data.draw(st.sampled_from([8, 16, 1 << 20]), label="chunk limit")
    results = []
    for engine in (flat_kvcache, flat_kvcache.reference):
        cache = make(engine, "reuse", arena_kib * 1024, live=1)
        hits, events = [], []
        for n, i in enumerate(sequence):
            hits.append(run(cache, f"r{n}", prompts[i], limit=limit)[0])
            events.append(event_stream(cache))
        results.append((hits, events, cache.stats()["checkpoints_evicted"]))
    assert results[0] == results[1]


# SPEC 13.8b, the body-end rule: a body end is worth the recompute it saves the prompts that
# share at least its depth of the path and diverge before the request's finish checkpoint; a
# next turn that carries the answer resumes at the finish checkpoint and gains nothing from it.
# `reuse` writes body ends until 16 were written, then while one written is resumed from at
# least as often as a finish checkpoint; `lru` always writes them.


def conversation(cache: Any, i: int, follow: str) -> list[int]:
    """Conversation ``i``: a 21-token first turn (body end 16) with 11 decoded tokens (its
    finish checkpoint at 32); then, with ``follow="answer"``, a next turn carrying the prompt,
    the answer and 13 new tokens (45 tokens: it resumes at the finish checkpoint, 32, and
    writes its own body end, 40); with ``follow="body"``, a prompt sharing the first 18
    tokens only (it resumes at the body end, 16, and, with no multiple of 8 ahead before its
    last token but 16, writes none). Returns the first turn's chunks."""
    first = base(21, seed=300 + i)
    chunks = run(cache, f"c{i}", first, decode=11)[1]
    if follow == "answer":
        turn = [*first, *(10_000 + j for j in range(11)), *base(13, seed=400 + i)]
        assert run(cache, f"t{i}", turn)[0] == 32
    else:
        assert run(cache, f"t{i}", [*first[:18], *base(5, seed=400 + i)])[0] == 16
    return chunks


@pytest.mark.parametrize("engine", ENGINES)
def test_body_ends_stop_where_next_turns_carry_the_answer(engine: ModuleType) -> None:
    reuse, lru = make(engine, "reuse"), make(engine, "lru")
    # Each conversation writes two body ends (16 and 40), none resumed from, and one finish
    # checkpoint (the next turn decodes nothing), resumed from once: after 8 conversations 16
    # body ends were written with no hit, against 8 finish checkpoints with 8, so they stop.
    seen = [conversation(reuse, i, "answer") for i in range(10)]
    assert seen[:8] == [[16, 5]] * 8
    assert seen[8:] == [[21]] * 2
    assert [conversation(lru, i, "answer") for i in range(10)] == [[16, 5]] * 10


@pytest.mark.parametrize("engine", ENGINES)
def test_body_ends_stay_where_prompts_resume_at_them(engine: ModuleType) -> None:
    reuse, lru = make(engine, "reuse"), make(engine, "lru")
    # Each conversation writes one body end, resumed from once, and one finish checkpoint,
    # never resumed from: body ends are worth more, and keep being written.
    assert [conversation(reuse, i, "body") for i in range(24)] == [[16, 5]] * 24
    assert [conversation(lru, i, "body") for i in range(24)] == [[16, 5]] * 24


def shared_resume(cache: Any, j: int) -> int:
    """A prompt sharing the first 18 tokens of the shared 21-token prompt ``base(21, seed=299)``
    (body end 16) and adding 5 of its own; returns its hit (16, at that body end)."""
    return run(cache, f"s{j}", [*base(21, seed=299)[:18], *base(5, seed=900 + j)])[0]


@pytest.mark.parametrize("engine", ENGINES)
def test_a_shared_prefix_resumed_again_and_again_counts_once_for_its_role(engine: ModuleType) -> None:
    # SPEC 13.8b: a checkpoint counts for its role at its first resume only. A shared prefix's
    # body end that every other prompt resumes at says nothing of what the next body end
    # written will serve: its later resumes come whether or not more are written. Here one
    # shared body end (16) is resumed at twice before each conversation, whose own body ends
    # nobody resumes at and whose finish checkpoint its next turn resumes at once. Every
    # divergence point is a multiple of 16 (the shared prompts part at the page 16, next
    # turns at 32), so from the 16th on S = 16 and only first turns write a body end (16; a
    # next turn's would be 32, its hit): the 16th body end is the 10th conversation's. Counted
    # once, body ends then served 1 prompt per 16 written against 9 per 9 finish checkpoints
    # left, so they stop; counted at every resume (20 per 16) they would go on. The shared
    # body end itself keeps serving.
    reuse = make(engine, "reuse")
    assert run(reuse, "shared", base(21, seed=299))[1] == [16, 5]
    seen = []
    for i in range(12):
        assert [shared_resume(reuse, 2 * i), shared_resume(reuse, 2 * i + 1)] == [16, 16]
        seen.append(conversation(reuse, i, "answer"))
    assert seen == [[16, 5]] * 10 + [[21]] * 2


@settings(max_examples=40, deadline=None)
@given(
    turns=st.lists(
        st.tuples(st.integers(0, 5), st.integers(0, 60), st.integers(1, 30), st.integers(0, 20)),
        min_size=20,
        max_size=60,
    ),
    roomy=st.booleans(),
)
def test_the_body_end_rule_decides_alike_in_both_engines(
    turns: list[tuple[int, int, int, int]], roomy: bool
) -> None:
    # Prompts that take a prefix of a growing per-topic history (which carries earlier answers)
    # and add new tokens, so prompts resume at body ends, finish checkpoints and elsewhere;
    # tight memory evicts checkpoints, so state pages change role and evicted checkpoints leave
    # ghosts that prompts reach (the finish rule turns both ways within a run). Both engines give the same
    # hits and cuts, turn by turn.
    arena = 400 * 1024 if roomy else 40 * 1024
    caches = [make(flat_kvcache, "reuse", arena), make(flat_kvcache.reference, "reuse", arena)]
    history: dict[int, list[int]] = {}
    for i, (topic, keep, new, decode) in enumerate(turns):
        past = history.get(topic, base(8, seed=500 + topic))
        prompt = [*past[: min(keep, len(past))], *base(new, seed=600 + i)]
        seen = [run(cache, f"r{i}", prompt, limit=24, decode=decode) for cache in caches]
        assert seen[0] == seen[1], i
        history[topic] = [*prompt, *(10_000 + j for j in range(decode))]


# SPEC 13.8b, the finish and chunk-end rules: a request's finish checkpoint and its earlier
# chunk ends are worth the recompute they save the prompts that resume at them; where prompts
# resume at body ends instead, they only hold state memory. `reuse` keeps each at its request's
# finish until 16 of its role were kept, then while one kept is resumed from at least as often
# as a body end written; `lru` keeps every one until evicted.


def answer_probe(cache: Any, i: int) -> int:
    """The hit of conversation ``i``'s next turn carrying its answer (see :func:`conversation`):
    32 at its finish checkpoint, 16 at its body end once the finish checkpoint was released."""
    first = base(21, seed=300 + i)
    return int(cache.prefix_hit_tokens([*first, *(10_000 + j for j in range(11)), *base(13, seed=400 + i)]))


@pytest.mark.parametrize("engine", ENGINES)
def test_finish_checkpoints_are_released_where_prompts_resume_at_body_ends(engine: ModuleType) -> None:
    reuse, lru = make(engine, "reuse"), make(engine, "lru")
    # Each conversation leaves one finish checkpoint (32), never resumed from, and one body end
    # (16), resumed from once: the first 16 finish checkpoints are kept, the next released.
    seen = []
    for i in range(20):
        conversation(reuse, i, "body")
        seen.append(answer_probe(reuse, i))
    assert seen == [32] * 16 + [16] * 4
    for i in range(20):
        conversation(lru, i, "body")
        assert answer_probe(lru, i) == 32


def answer_turn(cache: Any, i: int) -> int:
    """Conversation ``i``'s first turn (21 tokens, 11 decoded: body end 16, finish boundary 32)
    then its next turn carrying the answer; returns the next turn's hit (32 at the finish
    checkpoint, 16 at the body end where none was kept)."""
    first = base(21, seed=300 + i)
    run(cache, f"c{i}", first, decode=11)
    return run(cache, f"t{i}", [*first, *(10_000 + j for j in range(11)), *base(13, seed=400 + i)])[0]


@pytest.mark.parametrize("engine", ENGINES)
def test_finish_checkpoints_come_back_when_next_turns_carry_the_answer(engine: ModuleType) -> None:
    # Issue 38's shift (document questions, then conversations): 16 finish checkpoints never
    # resumed from turn the finish role off. A finish checkpoint not kept is still remembered
    # (a ghost at its boundary), so the first next turn that carries its answer, resuming at
    # the body end (16) where the ghost lay at 32, is a prompt a finish checkpoint would have
    # served: finish checkpoints now have worth, nothing was evicted (a slot kept costs no
    # other hit), so the next conversations' finish checkpoints are kept and resumed from.
    reuse, lru = make(engine, "reuse"), make(engine, "lru")
    for i in range(16):
        conversation(reuse, i, "body")
        conversation(lru, i, "body")
    assert answer_probe(reuse, 15) == 32 and decode_checkpoints(reuse, 703) == 0
    assert [answer_turn(reuse, i) for i in range(20, 24)] == [16, 32, 32, 32]
    assert [answer_turn(lru, i) for i in range(20, 24)] == [32] * 4


def decode_checkpoints(cache: Any, seed: int) -> int:
    """Checkpoints written while a 21-token prompt decodes 11 tokens and finishes (computed
    reaches 32, so decode crosses the boundaries 24 and 32 of G = 8: SPEC 13.5d writes one at
    each, the one at 32 when the finish registers the last computed page)."""
    slot, _ = cache.add_request(f"probe{seed}", base(21, seed=seed))
    while (n := cache.next_chunk(slot, 1 << 20)) > 0:
        assert cache.schedule([slot], [n])[0]
    before = cache.stats()["checkpoints_written"]
    for i in range(11):
        cache.append_tokens([slot], [10_000 + i])
        assert cache.schedule([slot], [1])[0]
    cache.finish([slot])
    return int(cache.stats()["checkpoints_written"] - before)


@pytest.mark.parametrize("engine", ENGINES)
def test_decode_writes_no_checkpoint_once_finish_checkpoints_are_released(engine: ModuleType) -> None:
    # SPEC 13.8b: a decode checkpoint is the finish checkpoint in the making; once finish
    # checkpoints are released at finish (they do not pay against body ends), writing one
    # would hold a second state slot through the decode for nothing, so none is written.
    reuse, lru = make(engine, "reuse"), make(engine, "lru")
    assert decode_checkpoints(reuse, 700) == 2  # nothing learned yet: both boundaries
    for i in range(16):
        conversation(reuse, i, "body")
        conversation(lru, i, "body")
    assert decode_checkpoints(lru, 701) == 2
    assert decode_checkpoints(reuse, 701) == 0
    # The next turn carrying that answer resumes at its body end (16), recomputing the rest.
    turn = [*base(21, seed=701), *(10_000 + j for j in range(11)), *base(13, seed=702)]
    assert int(reuse.prefix_hit_tokens(turn)) == 16
    assert int(lru.prefix_hit_tokens(turn)) == 32


def checkpoint_names(paths: dict[str, list[int]]) -> dict[str, str]:
    """State keys of the checkpoints on each named token path: key -> "name@t" (t a multiple of
    G), from the path's page hashes folded G / P at a time (SPEC 13.6)."""
    names = {}
    for name, tokens in paths.items():
        for i, key in enumerate(flat_kvcache.fold_hashes(hashes_of(tokens), 0, G // P)):
            names[key] = f"{name}@{(i + 1) * G}"
    return names


def removed_checkpoints(cache: Any, names: dict[str, str]) -> list[str]:
    """The state checkpoints removed (evicted or dropped) since the last call, by name."""
    return [
        names.get(h, "?")
        for kind, group, hashes in event_stream(cache)
        if kind == "BlockRemoved" and group == 1
        for h in hashes
    ]


@pytest.mark.parametrize("engine", ENGINES)
def test_a_decode_checkpoint_ages_from_its_requests_decode_start(engine: ModuleType) -> None:
    # SPEC 13.8b (reuse): a decode checkpoint serves no prompt while its request decodes, so
    # rewriting it a grain on is no use of the cache: each one after the first takes the first
    # one's date in the eviction order (the decode start), and a kept finish checkpoint is
    # dated at the finish. Under lru each is as new as its write. An 11 KiB arena, 2 live.
    # A (9-token prompt) decodes 10 tokens: its body end A@8 is cached at the end of its
    # prefill, its first decode checkpoint A@16 when decode passes 16. B (9 tokens) runs and
    # finishes after 10 decoded tokens: B@8, then its finish checkpoint B@16, both newer than
    # A's decode start. A decodes 10 more: A@24 replaces A@16 (dropped).
    names = checkpoint_names(
        {
            "A": [*base(9, seed=1), *(10_000 + j for j in range(40))],
            "B": [*base(9, seed=2), *(10_000 + j for j in range(40))],
        }
    )
    found = {}
    for policy in ("reuse", "lru"):
        cache = make(engine, policy, 11 * 1024, live=2)
        slot, _ = cache.add_request("A", base(9, seed=1))
        for n in (8, 1):  # cut at the body end (SPEC 13.5b), as next_chunk cuts it
            assert cache.next_chunk(slot, 1 << 20) == n and cache.schedule([slot], [n])[0]
        decoded = 0

        def decode(n: int, cache: Any = cache, slot: int = slot) -> None:
            nonlocal decoded
            for _ in range(n):
                cache.append_tokens([slot], [10_000 + decoded])
                decoded += 1
                assert cache.schedule([slot], [1])[0]

        decode(10)
        run(cache, "B", base(9, seed=2), decode=10)
        decode(10)
        assert removed_checkpoints(cache, names) == ["A@16"], policy
        # C needs two state slots: the two oldest checkpoints go. By date: A@8, then (reuse)
        # A@24 dated at A's decode start, before B@8 and B@16; (lru) B@8, A@24 being the newest.
        run(cache, "C", base(9, seed=10))
        after_c = removed_checkpoints(cache, names)
        # A decodes 15 more and finishes at 44: decode passed 40 three tokens before, so A@40
        # was cached (and, under reuse, dated at A's decode start) while A decoded; it is A's
        # finish checkpoint (kept: fewer than 16 were left), dated at the finish under reuse.
        decode(15)
        cache.finish([slot])
        removed_checkpoints(cache, names)
        # D needs a slot: under reuse the oldest is B@16 (A@40 is newer, dated at A's finish);
        # A's next turn resumes at A@40.
        run(cache, "D", base(9, seed=11))
        after_d = removed_checkpoints(cache, names)
        turn = [*base(9, seed=1), *(10_000 + j for j in range(31)), 7]
        found[policy] = (after_c, after_d, int(cache.prefix_hit_tokens(turn)))
    assert found["reuse"] == (["A@8", "A@24"], ["B@16"], 40)
    assert found["lru"][0] == ["A@8", "B@8"]


def long_prompt(cache: Any, i: int, follow: int) -> tuple[int, int]:
    """A 37-token prompt computed in chunks of at most 8: chunk ends 8, 16 and 24, body end 32;
    then a prompt sharing its first ``follow`` tokens and 3 others, decoding nothing. Returns
    the hit of a prompt sharing its first 20 tokens, probed before the follower runs, and the
    follower's hit."""
    first = base(37, seed=700 + i)
    assert run(cache, f"l{i}", first, limit=8)[1] == [8, 8, 8, 8, 5]
    probe = int(cache.prefix_hit_tokens([*first[:20], *base(5, seed=800 + i)]))
    return probe, run(cache, f"f{i}", [*first[:follow], *base(3, seed=900 + i)])[0]


@pytest.mark.parametrize("engine", ENGINES)
def test_chunk_ends_stay_where_prompts_resume_at_them(engine: ModuleType) -> None:
    # Each follower shares 20 tokens and resumes at the chunk end at 16; its own body end (16 +
    # 8 = 24) is never resumed from: chunk ends are worth more, and all are kept.
    for policy in ("reuse", "lru"):
        cache = make(engine, policy)
        assert [long_prompt(cache, i, 20) for i in range(12)] == [(16, 16)] * 12, policy


@pytest.mark.parametrize("engine", ENGINES)
def test_chunk_ends_are_released_where_prompts_never_resume_at_them(engine: ModuleType) -> None:
    # Each follower shares 34 tokens and resumes at the body end (32); no prompt resumes at a
    # chunk end. Five prompts keep 15 chunk ends; the sixth keeps its 16th (8) and releases
    # 16 and 24; from the seventh on every chunk end is released at finish.
    reuse, lru = make(engine, "reuse"), make(engine, "lru")
    assert [long_prompt(reuse, i, 34) for i in range(9)] == [(16, 32)] * 5 + [(8, 32)] + [(0, 32)] * 3
    assert [long_prompt(lru, i, 34) for i in range(9)] == [(16, 32)] * 9


def test_the_finish_rule_weighs_finish_hits_against_the_evictions_they_cause() -> None:
    # SPEC 13.8b on the reference's evidence, hand-computed: finish checkpoints are kept while
    # the prompts that resume at them (kept or ghost) are more than none and at least the
    # prompts the evictions they cause would have served: p_M * C, p_M the share of evicted
    # checkpoints (not of the finish role) a later prompt reached, C each such eviction times
    # the finish role's share of the cached checkpoints then (its own evicted cost no other
    # prompt).
    from flat_kvcache.reference.engine.policy import FINISH, ReuseEvidence

    e = ReuseEvidence()
    for page in range(16):
        assert e.keep_finish()  # warm-up
        e.wrote(100 + page, FINISH)
    assert not e.keep_finish()  # 16 left, none resumed from: worth nothing
    e.left_ghost("g1", 4)
    assert e.ghost_resumed(["x", "g1"], 0, 8, 4, 4)  # would have resumed at 8 > 0
    assert e.keep_finish()  # 1 hit of 17, nothing evicted: a slot costs nothing
    e.note_boundary("f0", "bf0", True)  # two decode checkpoints cached (the finish role)
    e.note_boundary("f1", "bf1", True)
    for i in range(4):
        e.note_boundary(f"k{i}", f"b{i}", False)
    for i in range(4):
        e.evicted(f"k{i}", 8)  # of 6, 5, 4, 3 cached: C += 2/6, 2/5, 2/4, 2/3, 1.9 in all
    for i in range(3):
        assert not e.ghost_resumed([f"b{i}"], 0, 4, 4, 4)  # a marginal hit, no finish hit
    assert not e.keep_finish()  # 1 < 3/4 * 1.9
    assert not e.ghost_resumed(["b0"], 0, 4, 4, 4)  # a ghost is taken once
    e.resumed(100)
    e.resumed(101)
    assert e.keep_finish()  # 3 >= 3/4 * 1.9
    e.note_boundary("f2", "bf2", True)
    for key in ("f0", "f1", "f2"):
        e.evicted(key, 8)  # the role's own checkpoints (share 1 each): no charge, no ghost
    assert not e.ghost_resumed(["bf0"], 0, 4, 4, 4)
    assert e.keep_finish()  # 3 >= 3/4 * 1.9 (charged, C would be 4.9: 3 < 3.675, released)
    e.note_boundary("f3", "bf3", True)
    e.forget_boundary("f3")  # released by the policy: no eviction, the role holds nothing now
    e.note_boundary("k9", "b9", False)
    e.evicted("k9", 8)  # share 0: C stays 1.9
    assert not e.ghost_resumed(["g-none", "b9"], 0, 8, 4, 4)  # a marginal hit: 4 of 5
    assert e.keep_finish()  # 3 * 5 >= 4 * 1.9
    assert e.recent[-1] == pytest.approx(1.9)


def test_body_ends_are_written_while_one_serves_what_an_eviction_costs() -> None:
    # SPEC 13.8b on the reference's evidence, hand-computed: past the warm-up, body ends are
    # written while one written is resumed from at least as often as a finish checkpoint left,
    # and at least as often as an eviction costs: H_B * E >= E_H * min(N_B, E), p_M = E_H / E
    # the prompts that reached an evicted checkpoint's ghost per eviction, each body end
    # written charged one eviction but never more than the evictions there were.
    from flat_kvcache.reference.engine.policy import BODY, ReuseEvidence

    e = ReuseEvidence()
    for page in range(16):
        assert e.writes_body_end()  # warm-up
        e.wrote(page, BODY)
    e.resumed(0)
    e.resumed(1)
    assert e.writes_body_end()  # 2 of 16 served, no finish checkpoint left, nothing evicted
    for i in range(4):
        e.note_boundary(f"k{i}", f"b{i}", False)
        e.evicted(f"k{i}", 64)
    assert not e.ghost_resumed(["b0"], 0, 4, 4, 4)  # a prompt an eviction cost
    assert not e.ghost_resumed(["b1"], 0, 4, 4, 4)
    assert e.writes_body_end()  # 2 * 4 >= 2 * min(16, 4)
    assert not e.ghost_resumed(["b2"], 0, 4, 4, 4)
    assert not e.writes_body_end()  # 2 * 4 < 3 * 4
    e.resumed(2)
    assert e.writes_body_end()  # 3 * 4 >= 3 * 4
    for i in range(4, 24):
        e.note_boundary(f"k{i}", f"b{i}", False)
        e.evicted(f"k{i}", 64)
    assert not e.ghost_resumed(["b3"], 0, 4, 4, 4)
    # 24 evictions, 4 of them cost a prompt: 16 body ends are charged 16 of them, not 24.
    assert e.writes_body_end()  # 3 * 24 >= 4 * min(16, 24) (against 24: 72 < 96)
    e.resumed(2)  # a second resume of the same checkpoint counts for nothing
    assert e.body_hits == 3
