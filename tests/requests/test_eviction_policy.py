"""The ``reuse`` checkpoint policy (SPEC 13.8), hand-derived on both engines.

A model with one full-attention group (4-token pages) and one state group (checkpoint grain
G = 8) over an arena roomy enough that nothing is evicted, so every difference below comes from
the policy's own rules:

- the sharing grain S is the largest G * 2**k dividing 9 in 10 of the divergence points seen,
  once 16 were seen (G before);
- under S > G a prompt's body ends at the last multiple of S before its last token;
- at finish, prompt checkpoints neither on S nor the branch point are dropped;
- at finish, a decode checkpoint is kept on the first request (a probe), then on every 8th,
  and on every one once a kept one was hit.

``lru`` keeps today's rules (the same calls give the SPEC 13.5 cuts and hits).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import flat_kvcache
import flat_kvcache.reference
import pytest

P, G = 4, 8
ENGINES = [
    pytest.param(flat_kvcache, id="native"),
    pytest.param(flat_kvcache.reference, id="reference"),
]


def make(engine: ModuleType, policy: str) -> Any:
    components = [
        flat_kvcache.ComponentSpec("full", 0, "kv", bytes_per_slot=64, const_bytes=0),
        flat_kvcache.ComponentSpec("lin", 1, "ssm", bytes_per_slot=0, const_bytes=1024),
    ]
    plan = flat_kvcache.plan_arena(components, P, 400 * 1024, max_live_requests=4)
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
def test_probationary_prompt_checkpoints_are_dropped_at_finish(engine: ModuleType) -> None:
    reuse, lru = make(engine, "reuse"), make(engine, "lru")
    teach(reuse)
    teach(lru)
    prompt = base(70, seed=50)
    # chunks of at most 16: cut at the grain 16, 32, 48, then the body's end (64 under S = 32,
    # 64 under G = 8 too), then the tail; checkpoints at 16, 32, 48 and 64
    assert run(reuse, "long", prompt, limit=16)[1] == [16, 16, 16, 16, 6]
    assert run(lru, "long", prompt, limit=16)[1] == [16, 16, 16, 16, 6]
    follower = [*prompt[:52], *base(5, seed=51)]
    # lru kept 48; reuse dropped 16 and 48 (not multiples of 32) at finish: it resumes at 32
    assert run(lru, "follower", follower)[0] == 48
    assert run(reuse, "follower", follower)[0] == 32


@pytest.mark.parametrize("engine", ENGINES)
def test_decode_checkpoints_are_kept_on_probes_then_on_evidence(engine: ModuleType) -> None:
    cache = make(engine, "reuse")
    # Each request: a 9-token prompt, then 16 decoded tokens: decode's latest checkpoint is at
    # 24 (computed reaches 24 after the 15th decode step; the 16th token is not computed).
    prompts = [base(9, seed=200 + i) for i in range(9)]
    answers = [[*p, *(10_000 + j for j in range(15))] for p in prompts]
    for i, prompt in enumerate(prompts):
        run(cache, f"r{i}", prompt, decode=16)
    # The first request was a probe (kept), the next seven were not, the ninth is a probe.
    hits = [run(cache, f"again{i}", [*answers[i], 7])[0] for i in range(9)]
    assert hits == [24, 8, 8, 8, 8, 8, 8, 8, 24]
    # The probe's checkpoint was hit (again0): evidence; from now on every one is kept.
    run(cache, "after", base(9, seed=300), decode=16)
    assert run(cache, "after-again", [*base(9, seed=300), *(10_000 + j for j in range(15)), 7])[0] == 24


@pytest.mark.parametrize("engine", ENGINES)
def test_an_unknown_policy_is_refused_by_name(engine: ModuleType) -> None:
    with pytest.raises(ValueError, match="eviction_policy must be 'lru' or 'reuse', got 'LRU'"):
        make(engine, "LRU")
