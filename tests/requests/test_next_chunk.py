"""``next_chunk`` and the first chunk of ``admit``: where a scheduler cuts its chunks so that the
state groups' snapshots are kept (SPEC 13.5a-c with today's snapshot grain, the lcm of the
state groups' page sizes; docs/requests-api.md).

Expectations are worked out from the rule, by hand or by ``slots.chunk_cut`` (an independent
spelling of it), on both engines (the ``api`` fixture).
"""

from __future__ import annotations

import math
from types import ModuleType
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from slots import chunk_cut


def hybrid(api: ModuleType, state_pages: tuple[int, ...] = (64,), **options: Any) -> Any:
    specs = [api.KVCacheSpec("full", 16)]
    specs += [api.KVCacheSpec("state", size, group_id=f"s{i}") for i, size in enumerate(state_pages)]
    return api.FlatKVCache(specs, 4096, **options)


def test_a_prompt_is_cut_at_its_body_then_its_tail(api: ModuleType) -> None:
    cache = hybrid(api)
    slot, _ = cache.add_request("a", list(range(300)))
    # The rest fits: the body ends at 256 (the last multiple of 64 before token 299).
    assert cache.next_chunk(slot, 1000) == 256
    assert cache.schedule([slot], [256]).tolist() == [True]
    assert cache.next_chunk(slot, 1000) == 44  # the tail: no boundary before token 299 ahead
    # A chunk limit: the last boundary within it, or no cut when none is ahead.
    assert [cache.next_chunk(slot, m) for m in (0, 1, 20, 44)] == [0, 1, 20, 44]
    assert cache.schedule([slot], [44]).tolist() == [True]
    assert cache.next_chunk(slot, 1000) == 0  # every known token is computed


def test_long_prompts_are_chunked_on_boundaries(api: ModuleType) -> None:
    cache = hybrid(api)
    slot, _ = cache.add_request("a", list(range(1000)))
    assert [cache.next_chunk(slot, m) for m in (63, 64, 100, 200, 999, 1000)] == [63, 64, 64, 192, 960, 960]


def test_the_snapshot_at_the_body_end_is_a_hit_for_the_next_turn(api: ModuleType) -> None:
    """What the cut is for: a second turn sharing the first turn's prompt resumes at the body's
    end, where a single-chunk prefill (no cut) would leave no snapshot to resume from."""
    first = list(range(300))
    for cut in (True, False):
        cache = hybrid(api)
        slot, _ = cache.add_request("a", first)
        n = cache.next_chunk(slot, 1000) if cut else 300
        assert cache.schedule([slot], [n]).tolist() == [True]
        while cache.num_computed_tokens(slot) < 300:
            rest = cache.next_chunk(slot, 1000)
            assert cache.schedule([slot], [rest]).tolist() == [True]
        cache.finish([slot])
        _, hit = cache.add_request("b", [*first, 7, 8, 9])
        assert hit == (256 if cut else 0)


def run_prompt(cache: Any, slot: int, limit: int = 1000) -> None:
    """Schedule a request's prompt to the end, chunk by chunk as ``next_chunk`` cuts it."""
    while (n := cache.next_chunk(slot, limit)) > 0:
        assert cache.schedule([slot], [n]).tolist() == [True]


@pytest.mark.parametrize("use_admit", [False, True])
def test_a_branch_point_gets_a_checkpoint(api: ModuleType, use_admit: bool) -> None:
    """SPEC 13.5c. Full P = 16, state P = 64. A (300 tokens) leaves checkpoints at 256 (its
    body end) only. B shares A's first 200 tokens: its full pages match 12 pages (192 tokens,
    a multiple of 64), but no checkpoint lies at or below 192 on its path, so its hit is 0 and
    192 is a branch point: B's first chunk ends there (not at its body end, 320), and the
    checkpoint written there is C's hit, C sharing the same 200 tokens."""
    a = list(range(300))
    cache = hybrid(api)
    slot, _ = cache.add_request("a", a)
    run_prompt(cache, slot)
    cache.finish([slot])
    b = [*a[:200], *range(5000, 5150)]
    # Limits: the branch point when it lies within the limit, else the usual cut within it.
    probe, _ = cache.add_request("probe", b)
    assert [cache.next_chunk(probe, m) for m in (100, 191, 192, 1000)] == [64, 128, 192, 192]
    cache.finish([probe])
    if use_admit:
        admitted = cache.admit("b", b, 1000)
        assert admitted is not None
        slot_b, hit_b, chunk = admitted
    else:
        slot_b, hit_b = cache.add_request("b", b)
        chunk = cache.next_chunk(slot_b, 1000)
    assert (hit_b, chunk) == (0, 192)
    assert chunk != chunk_cut(0, len(b), 1000, 64)  # 320 without the branch point
    # Past the branch point the rule is the usual one: B's body ends at 320.
    assert cache.schedule([slot_b], [chunk]).tolist() == [True]
    assert cache.next_chunk(slot_b, 1000) == 320 - 192
    run_prompt(cache, slot_b)
    cache.finish([slot_b])
    _, hit_c = cache.add_request("c", [*a[:200], *range(9000, 9100)])
    assert hit_c == 192
    assert cache.stats()["checkpoints_hit"] == 1


def test_admit_cuts_the_first_chunk_the_same_way(api: ModuleType) -> None:
    cache = hybrid(api)
    assert cache.admit("a", list(range(300)), 1000) == (0, 0, 256)
    assert cache.admit("b", list(range(1000, 1100)), 50) == (1, 0, 50)  # no boundary within 50
    plain = api.FlatKVCache([api.KVCacheSpec("full", 16)], 4096)
    assert plain.admit("a", list(range(300)), 1000) == (0, 0, 300)  # no state group: no cut
    slot, _ = plain.add_request("b", list(range(300)))
    assert [plain.next_chunk(slot, m) for m in (0, 100, 1000)] == [0, 100, 300]


def test_several_state_groups_cut_on_the_lcm_of_their_pages(api: ModuleType) -> None:
    cache = hybrid(api, (32, 48))  # lcm 96
    slot, _ = cache.add_request("a", list(range(500)))
    assert cache.next_chunk(slot, 1000) == 480
    assert cache.next_chunk(slot, 200) == 192


def test_bad_arguments_are_named(api: ModuleType) -> None:
    cache = hybrid(api)
    slot, _ = cache.add_request("a", list(range(10)))
    with pytest.raises(ValueError, match="max_tokens"):
        cache.next_chunk(slot, -1)
    with pytest.raises(KeyError, match="next_chunk: slot 5 holds no request"):
        cache.next_chunk(5, 10)
    with pytest.raises(TypeError, match="slot"):
        cache.next_chunk("a", 10)


@given(
    prompt=st.integers(1, 400),
    done=st.integers(0, 400),
    limit=st.integers(0, 500),
    pages=st.sampled_from([None, (16,), (32,), (16, 48), (64,)]),
)
def test_next_chunk_follows_the_rule(
    prompt: int, done: int, limit: int, pages: tuple[int, ...] | None
) -> None:
    import flat_kvcache
    import flat_kvcache.reference

    grain = None if pages is None else math.lcm(*pages)
    results = []
    for api in (flat_kvcache, flat_kvcache.reference):
        cache = api.FlatKVCache([api.KVCacheSpec("full", 16)], 4096) if pages is None else hybrid(api, pages)
        slot, _ = cache.add_request("a", list(range(prompt)), use_prefix_cache=False)
        computed = min(done, prompt)
        assert cache.schedule([slot], [computed]).tolist() == [True]
        results.append(cache.next_chunk(slot, limit))
    assert results[0] == results[1] == chunk_cut(min(done, prompt), prompt, limit, grain)


def test_the_prompt_end_is_the_first_decode_checkpoint_and_decode_keeps_its_latest(api: ModuleType) -> None:
    """SPEC 13.5b, d. A 128-token prompt (state P = 64) is cut into its body (64, checkpointed)
    and its tail (64 tokens, ending on the grain at the prompt's end). The state after the tail is
    what decode starts from: once a token follows it, it is the first decode checkpoint. Decode
    checkpoints where a step ends on the grain but keeps only its latest: after 150 generated
    tokens (278 in all) the checkpoints at 128 and 192 were dropped for the one at 256. A request
    never holds more than two state slots (the checkpoint a step reads and its working slot)."""
    cache = hybrid(api, enable_kv_events=True)
    slot, _ = cache.add_request("a", list(range(128)))
    run_prompt(cache, slot)
    assert cache.stats()["checkpoints_written"] == 1  # 64: nothing follows the prompt's end yet
    state = list(cache.group_ids).index("s0")
    generated = [1000 + t for t in range(150)]
    for token in generated:
        cache.append_tokens([slot], [token])
        assert cache.schedule([slot], [1]).tolist() == [True]
        assert sum(1 for page in cache.page_ids(slot)[state] if page) <= 2
    assert cache.stats()["checkpoints_written"] == 4  # 64, 128, 192, 256
    removed = [e for e in cache.take_events() if type(e).__name__ == "BlockRemoved"]
    # 128's dropped for 192's, then 192's for 256's; the body end's (a prompt checkpoint) stays.
    assert len(removed) == 2 and {e.group_index for e in removed} == {state}
    cache.finish([slot])
    turn = [*range(128), *generated]
    # The next turn resumes at 256; a prompt leaving the path at 200 finds 64, not 192.
    assert cache.add_request("b", [*turn, 5])[1] == 256
    assert cache.add_request("c", [*turn[:200], 7, 7])[1] == 64


@pytest.mark.parametrize("computed_output", [0, 1, 4, 63])
def test_a_turn_that_ends_its_prompt_on_the_grain_resumes_there(
    api: ModuleType, computed_output: int
) -> None:
    """SPEC 13.5d when the prompt ends exactly on the grain: turn 1 is a 128-token prompt and
    ``computed_output + 1`` sampled tokens (the last never computed); no decode step ends on a
    multiple of 64, so the last multiple of 64 within the computed tokens is the prompt's end,
    and turn 2 (turn 1's tokens and 3 more) resumes there, at 128, not at the body's end (64)."""
    cache = hybrid(api)
    slot, _ = cache.add_request("a", list(range(128)))
    run_prompt(cache, slot)
    generated = [1000 + t for t in range(computed_output + 1)]
    for token in generated[:-1]:
        cache.append_tokens([slot], [token])
        assert cache.schedule([slot], [1]).tolist() == [True]
    cache.append_tokens([slot], [generated[-1]])
    assert cache.num_computed_tokens(slot) == 128 + computed_output
    cache.finish([slot])
    assert cache.add_request("b", [*range(128), *generated, 7, 8, 9])[1] == 128


def test_a_prompt_finished_on_the_grain_with_nothing_after_it_keeps_no_end_checkpoint(
    api: ModuleType,
) -> None:
    """The other side of the rule: a request finished right after its prompt with no token after
    it (no decode follows the prompt's end) leaves the body's end as its deepest checkpoint; the
    same prompt again is hit at 64 (a hit never covers the whole prompt either way)."""
    cache = hybrid(api)
    slot, _ = cache.add_request("a", list(range(128)))
    run_prompt(cache, slot)
    cache.finish([slot])
    assert cache.stats()["checkpoints_written"] == 1
    assert cache.add_request("b", [*range(128), 5])[1] == 64
