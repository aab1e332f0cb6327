"""``simulate_cluster``: the router's predicted hit is the hit the worker serves, and kv routing
finds prefixes that round-robin scatters (docs/routing.md)."""

from __future__ import annotations

from typing import Any

from helpers import missing

try:
    import dynamo._core  # noqa: F401 (the dynamo extra must be installed; CI installs it)
except ImportError as exc:
    missing("dynamo", exc)

import numpy as np
import pytest
from flat_kvcache import plan_arena
from flat_kvcache.presets import get_preset
from flat_kvcache.simulate import SimulationConfig, TraceRequest, default_trace, simulate_cluster
from flat_kvcache.torch import ModelShape

ATTENTION = {"layer_types": ["full_attention"] * 4}
HYBRID = get_preset("qwen3.5-like")


def attention_config(num_pages: int) -> SimulationConfig:
    return SimulationConfig(model=ATTENTION, num_pages=num_pages)


def hybrid_config(arena_bytes: int) -> SimulationConfig:
    arena = plan_arena(ModelShape.from_config(HYBRID).components(), 16, arena_bytes)
    return SimulationConfig(model=HYBRID, arena=arena, state_page_size=64)


def families_trace() -> list[TraceRequest]:
    """Three prompt families X, Y, Z of 641 identical tokens each, arriving X Y Z X Y Z, 40 steps
    apart (each request finishes long before the next arrives), two output tokens each."""
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 50_000, 641, dtype=np.uint32) for _ in range(3)]
    output = np.array([1, 2], dtype=np.uint32)
    return [TraceRequest(i, prompts[i % 3], output, arrival_step=40 * i) for i in range(6)]


CONFIGS = {"attention": lambda: attention_config(2000), "hybrid": lambda: hybrid_config(4 * 2**30)}


@pytest.mark.parametrize("model", list(CONFIGS))
def test_kv_routing_finds_the_prefixes_round_robin_scatters(model: str) -> None:
    trace = families_trace()
    # Round-robin over 2 workers: X0 Y0 Z0 X1 Y1 Z1 = 0 1 0 1 0 1, and no second request of a
    # family meets its first: no hit at all.
    rr = simulate_cluster(trace, CONFIGS[model](), workers=2, router="round-robin")
    assert [a.worker for a in rr.admissions] == [0, 1, 0, 1, 0, 1]
    assert [a.served for a in rr.admissions] == [0] * 6
    # kv: nothing is cached anywhere for X, Y, Z and both workers are idle (load 0), so the lowest
    # id takes them; the second round finds each family on worker 0. A 641-token prompt resumes
    # at 640: 40 full pages (attention), and the checkpoint its prefill chunk ended on (hybrid:
    # the chunk is cut at the last multiple of the 64-token grain before the final token).
    kv = simulate_cluster(trace, CONFIGS[model](), workers=2, router="kv")
    assert [a.worker for a in kv.admissions] == [0] * 6
    assert [a.served for a in kv.admissions] == [0, 0, 0, 640, 640, 640]
    assert [a.routed_prediction for a in kv.admissions] == [0, 0, 0, 640, 640, 640]
    assert [a.admit_prediction for a in kv.admissions] == [0, 0, 0, 640, 640, 640]
    assert kv.summary["routed_hits_tokens"] == 3 * 640 > rr.summary["routed_hits_tokens"] == 0
    assert kv.summary["exact_at_admit"] == kv.summary["exact_at_routing"] == 1.0


@pytest.mark.parametrize("model", list(CONFIGS))
def test_extra_keys_separate_equal_tokens(model: str) -> None:
    # The same 641 tokens under two extra keys (say two LoRA adapters) are different prefixes.
    prompt = families_trace()[0].prompt
    output = np.array([1, 2], dtype=np.uint32)
    keys = [("lora-a",), ("lora-b",), ("lora-a",), ()]
    trace = [TraceRequest(i, prompt, output, 40 * i, extra) for i, extra in enumerate(keys)]
    kv = simulate_cluster(trace, CONFIGS[model](), workers=2, router="kv")
    assert [a.worker for a in kv.admissions] == [0, 0, 0, 0]  # ties (nothing hit): lowest id
    assert [a.served for a in kv.admissions] == [0, 0, 640, 0]
    assert [a.routed_prediction for a in kv.admissions] == [0, 0, 640, 0]


def check_exact(result: Any) -> None:
    assert result.admissions, "nothing was admitted"
    wrong = [a for a in result.admissions if a.admit_prediction != a.served]
    assert wrong == []
    assert result.summary["exact_at_admit"] == 1.0


def test_prediction_is_exact_under_eviction_attention() -> None:
    # 150 requests, half sharing a 1024-token prefix, on 3 small workers: pages are evicted and
    # requests preempted, and every admission's prediction is still the hit served.
    trace = default_trace(150, seed=2, output_len=64)
    result = simulate_cluster(trace, attention_config(500), workers=3, router="kv")
    check_exact(result)
    assert sum(w["evictions"] for w in result.workers) > 0
    assert result.summary["preemptions"] > 0  # re-admissions are predicted too
    assert result.summary["routed_hits_tokens"] > 0


def test_prediction_is_exact_under_eviction_hybrid() -> None:
    trace = default_trace(120, seed=4, output_len=70)  # decodes cross a 64-token grain
    result = simulate_cluster(trace, hybrid_config(int(1.2 * 2**30)), workers=3, router="kv")
    check_exact(result)
    assert sum(w["evictions"] for w in result.workers) > 0
    assert sum(w["checkpoints"]["evicted"] for w in result.workers) > 0
    assert result.summary["preemptions"] > 0
    assert result.summary["routed_hits_tokens"] > 0


def test_refusals_name_what_is_refused() -> None:
    trace = families_trace()
    with pytest.raises(ValueError, match="group 'sliding_attention'"):
        simulate_cluster(trace, SimulationConfig(model="gpt-oss-like", num_pages=500), workers=2, router="kv")
    with pytest.raises(ValueError, match="host-memory tier"):
        simulate_cluster(
            trace, SimulationConfig(model=ATTENTION, num_pages=500, host_pages=10), workers=2, router="kv"
        )
    with pytest.raises(ValueError, match="workers must be >= 1"):
        simulate_cluster(trace, attention_config(500), workers=0)
    with pytest.raises(ValueError, match="router must be"):
        simulate_cluster(trace, attention_config(500), workers=2, router="random")


def test_round_robin_runs_any_model_and_splits_the_default_pool() -> None:
    trace = default_trace(20, seed=1, output_len=4)
    result = simulate_cluster(trace, SimulationConfig(model="gpt-oss-like"), workers=2, router="round-robin")
    assert result.summary["finished"] == 20 and result.summary["requests_per_worker"] == [10, 10]
    assert result.summary["exact_at_admit"] is None


@pytest.mark.parametrize("model", list(CONFIGS))
def test_dynamos_cost_weighs_load_against_overlap(model: str) -> None:
    # X0 runs alone on worker 0 and finishes; then four more X arrive in one step. 641 tokens are
    # 41 blocks of 16; worker 0 would serve 640 (40 blocks), worker 1 nothing. Overlap first sends
    # all four to worker 0. Dynamo's cost at weight 1, w x prefill blocks + active blocks (the
    # blocks of the requests routed there and not yet finished), is for each in turn:
    #   X1: worker 0: 1 + 0 = 1,   worker 1: 41 + 0 = 41   -> 0
    #   X2: worker 0: 1 + 41 = 42, worker 1: 41            -> 1
    #   X3: worker 0: 42,          worker 1: 41 + 41 = 82  -> 0
    #   X4: worker 0: 1 + 82 = 83, worker 1: 82            -> 1
    prompt = families_trace()[0].prompt
    output = np.array([1, 2], dtype=np.uint32)
    trace = [TraceRequest(i, prompt, output, arrival_step=0 if i == 0 else 40) for i in range(5)]
    first = simulate_cluster(trace, CONFIGS[model](), workers=2, router="kv")
    assert [a.worker for a in first.admissions] == [0] * 5
    assert first.summary["overlap_weight"] is None
    cost = simulate_cluster(trace, CONFIGS[model](), workers=2, router="kv", overlap_weight=1.0)
    firsts = {a.request_id: a for a in reversed(cost.admissions)}
    assert [firsts[i].worker for i in range(5)] == [0, 0, 1, 0, 1]
    assert [firsts[i].routed_prediction for i in range(5)] == [0, 640, 0, 640, 0]
    check_exact(cost)
    assert cost.summary["overlap_weight"] == 1.0
    assert cost.summary["requests_per_worker"] == [3, 2]
    # A heavy weight makes overlap win again: worker 0 costs 10 x 1 + 41k, worker 1 10 x 41.
    heavy = simulate_cluster(trace, CONFIGS[model](), workers=2, router="kv", overlap_weight=10.0)
    assert [a.worker for a in heavy.admissions] == [0] * 5
    with pytest.raises(ValueError, match="overlap_weight is a kv router setting"):
        simulate_cluster(trace, CONFIGS[model](), workers=2, router="round-robin", overlap_weight=1.0)
