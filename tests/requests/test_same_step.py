"""Same-step sharing: ``FlatKVCache(register_on_schedule=True)`` (docs/requests-api.md).

A successful ``schedule`` registers at once the full pages of the chunk it takes, so a request
added later in the same step hits them (the forward writes each attention layer's K/V before
that layer's attention reads any: tests/model/test_model_paged.py checks the logits). Off by
default; ignored with state groups (a checkpoint exists only once its chunk is computed). Both
engines, with expectations worked out from the contract: a hit is the capped prefix match
(``(len - 1) // base`` base pages) over registered pages, a page is registered once full.
The random cross-check of the option is the token-level state machine (tests/support,
``configs()`` draws it).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import flat_kvcache
import flat_kvcache.reference
import pytest
from flat_kvcache.events import BlockStored

ENGINES = [pytest.param(flat_kvcache, id="native"), pytest.param(flat_kvcache.reference, id="reference")]

PROMPT = list(range(100, 116))  # 16 tokens: 4 pages of 4, the capped hit is 3 pages (12 tokens)


def hybrid(module: ModuleType, **options: Any) -> Any:
    """Full P = 4 and sliding P = 4, W = 8 (a hit needs the sliding page before its boundary)."""
    specs = [module.KVCacheSpec("full", 4, None), module.KVCacheSpec("sliding_window", 4, 8)]
    return module.FlatKVCache(specs, 64, **options)


@pytest.mark.parametrize("module", ENGINES)
def test_a_request_added_after_a_schedule_hits_the_pages_the_chunk_fills(module: ModuleType) -> None:
    cache = hybrid(module, register_on_schedule=True)
    a, _ = cache.add_request("a", PROMPT)
    assert cache.schedule([a], [10]).tolist() == [True]
    # [0, 8) is full after the chunk; [8, 12) holds 2 of its 4 tokens and is not registered.
    b, hit = cache.add_request("b", PROMPT)
    assert hit == 8
    assert cache.page_ids(b) == [cache.page_ids(a)[0][:2], cache.page_ids(a)[1][:2]]
    # The hitter's chunk starts after its hit.
    assert cache.num_computed_tokens(b) == 8
    assert cache.schedule([a, b], [6, 8]).tolist() == [True, True]
    _, third = cache.add_request("c", PROMPT)
    assert third == 12
    cache.check_invariants()


@pytest.mark.parametrize("module", ENGINES)
def test_off_by_default_pages_register_at_the_writers_next_call(module: ModuleType) -> None:
    cache = hybrid(module)
    a, _ = cache.add_request("a", PROMPT)
    cache.schedule([a], [10])
    assert cache.add_request("b", PROMPT)[1] == 0
    cache.schedule([a], [0])  # the next schedule registers [0, 10)'s full pages
    assert cache.add_request("c", PROMPT)[1] == 8
    cache.check_invariants()


@pytest.mark.parametrize("module", ENGINES)
def test_admit_in_the_same_step_counts_the_hit(module: ModuleType) -> None:
    cache = hybrid(module, register_on_schedule=True)
    a, hit, chunk = cache.admit("a", PROMPT, 64)
    assert (hit, chunk) == (0, 16)
    cache.schedule([a], [chunk])
    _, hit, chunk = cache.admit("b", PROMPT, 64)
    assert (hit, chunk) == (12, 4)
    stats = cache.stats()
    assert (stats["prefix_queries_tokens"], stats["prefix_hits_tokens"]) == (32, 12)


@pytest.mark.parametrize("module", ENGINES)
def test_decode_registers_the_page_its_token_completes(module: ModuleType) -> None:
    cache = hybrid(module, register_on_schedule=True)
    a, _ = cache.add_request("a", PROMPT[:14])
    cache.schedule([a], [14])
    cache.append_tokens([a], [PROMPT[14]])
    cache.schedule([a], [1])  # token 14: page [12, 16) still holds 3 of 4
    assert cache.add_request("b", [*PROMPT, 7])[1] == 12
    cache.append_tokens([a], [PROMPT[15]])
    cache.schedule([a], [1])  # token 15 fills it: registered by this schedule
    assert cache.add_request("c", [*PROMPT, 7])[1] == 16
    cache.check_invariants()


@pytest.mark.parametrize("module", ENGINES)
def test_a_failed_schedule_registers_nothing_new(module: ModuleType) -> None:
    specs = [module.KVCacheSpec("full", 4, None)]
    # 3 pages and the null page: "a" takes all three, "b" cannot get its next page.
    cache = module.FlatKVCache(specs, 4, register_on_schedule=True)
    a, _ = cache.add_request("a", PROMPT[:12])
    assert cache.schedule([a], [12]).tolist() == [True]
    b, hit = cache.add_request("b", [9, 9, 9, 9, 9, 9])
    assert hit == 0
    assert cache.schedule([b], [6]).tolist() == [False]
    assert cache.add_request("c", [9, 9, 9, 9, 9, 9, 9])[1] == 0
    assert cache.add_request("d", [*PROMPT[:12], 1])[1] == 12
    cache.check_invariants()


@pytest.mark.parametrize("module", ENGINES)
def test_the_block_stored_events_come_from_the_schedule(module: ModuleType) -> None:
    cache = hybrid(module, register_on_schedule=True, enable_kv_events=True)
    a, _ = cache.add_request("a", PROMPT)
    cache.take_events()
    cache.schedule([a], [10])
    stored = [e for e in cache.take_events() if isinstance(e, BlockStored)]
    assert sorted((e.group_index, len(e.block_hashes)) for e in stored) == [(0, 2), (1, 2)]
    assert all(e.token_ids == PROMPT[:8] for e in stored)


@pytest.mark.parametrize("module", ENGINES)
def test_state_groups_ignore_the_option(module: ModuleType) -> None:
    """A hit with a state group ends on a checkpoint, which only a computed chunk writes: the
    option must change nothing, call for call."""
    results = []
    for flag in (False, True):
        specs = [module.KVCacheSpec("full", 4, None), module.KVCacheSpec("state", 4, None)]
        cache = module.FlatKVCache(specs, 64, register_on_schedule=flag, enable_kv_events=True)
        a, _ = cache.add_request("a", PROMPT)
        cache.schedule([a], [8])
        seen: list[Any] = [cache.add_request("b", PROMPT)]
        cache.schedule([a], [7])
        seen.append(cache.add_request("c", PROMPT))
        seen.append([cache.page_ids(s) for s in range(3)])
        seen.append(len(cache.take_events()))
        results.append(seen)
    assert results[0] == results[1]
    assert results[0][0] == (1, 0)


@pytest.mark.parametrize("module", ENGINES)
@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_the_option_must_be_a_bool(module: ModuleType, bad: object) -> None:
    with pytest.raises(TypeError, match="register_on_schedule must be a bool"):
        hybrid(module, register_on_schedule=bad)


@pytest.mark.parametrize("module", ENGINES)
def test_the_page_level_cache_has_no_such_option(module: ModuleType) -> None:
    with pytest.raises(TypeError, match="register_on_schedule"):
        module.PageCache([module.KVCacheSpec("full", 4, None)], 8, register_on_schedule=True)


@pytest.mark.parametrize("module", ENGINES)
def test_the_option_is_checked_after_the_ones_before_it_in_the_signature(module: ModuleType) -> None:
    """docs/engine-api.md, "The checking order": ``register_on_schedule`` is the last keyword."""
    with pytest.raises(ValueError, match="eviction_policy"):
        hybrid(module, eviction_policy="often", register_on_schedule="yes")
    with pytest.raises(TypeError, match="enable_kv_events"):
        hybrid(module, enable_kv_events=2, register_on_schedule="yes")


@pytest.mark.parametrize("module", ENGINES)
@pytest.mark.parametrize("flag", [False, True])
def test_a_scheduled_chunk_counts_as_computed_with_or_without_the_option(
    module: ModuleType, flag: bool
) -> None:
    """The promise the option relies on is the protocol's own (docs/requests-api.md): a
    successful ``schedule`` moves the position past its chunk, and ``preempt`` registers every
    full page below the position. So a writer preempted right after its schedule leaves its
    chunk's pages keyed either way; the option only lets a request added before that preempt,
    in the same step, hit them too. A caller that drops a scheduled chunk from the forward
    breaks the cache with or without the option."""
    cache = hybrid(module, register_on_schedule=flag)
    a, _ = cache.add_request("a", PROMPT)
    cache.schedule([a], [10])
    same_step_hit = cache.add_request("b", PROMPT)[1]
    assert same_step_hit == (8 if flag else 0)
    cache.preempt([a])
    assert cache.add_request("c", PROMPT)[1] == 8
    cache.check_invariants()
