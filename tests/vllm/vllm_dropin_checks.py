"""vLLM's own scheduler with its own KV-cache manager and with flat-kvcache's, step by step.

This file needs vLLM, which lives in a venv of its own (requirements/vllm.txt), so its name does
not match ``test_*.py``: the main test command (``pytest``) never collects or imports it, and it
runs only when named, where it never skips (``.ci/run``'s vLLM drop-in step)::

    pytest tests/vllm/vllm_dropin_checks.py

Both schedulers get the same request stream (shared and nested prefixes, cache salts, chunked
prefill, aborts, and pools tight enough to preempt) and run in lockstep; after every
``schedule()`` the two outputs must agree exactly: which requests run with how many tokens, the
prefix hit each admitted request starts from, the new block ids handed to the model, who was
preempted or finished, the pool usage, and every live request's block ids in every group and
cached-token estimate. Models of full-attention groups, of full plus sliding-window groups
(Gemma-2/3, GPT-OSS shapes) and of full plus GDN / mamba groups (Qwen3.5, Qwen3-Next shapes, their
KV cache config built by vLLM's own config steps) are covered, with prefix caching on and off,
some with each step's output handed back only after the next is scheduled (async scheduling).
"""

from __future__ import annotations

import copy
import dataclasses
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from flat_kvcache.vllm import FlatKVCacheManager, FlatScheduler, UnsupportedVllmConfigError, check_supported
from flat_kvcache.vllm.harness import (
    SchedulerSetup,
    StepRecord,
    StreamRequest,
    build_configs,
    build_scheduler,
    hybrid_layer_types,
    kv_cache_spec,
    make_stream,
    record_step,
    run_steps,
    tiny_model_dir,
)
from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # type: ignore[import-not-found]
from vllm.v1.core.kv_cache_utils import KVCacheBlock  # type: ignore[import-not-found]
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # type: ignore[import-not-found]
from vllm.v1.core.sched.scheduler import Scheduler  # type: ignore[import-not-found]
from vllm.v1.kv_cache_interface import (  # type: ignore[import-not-found]
    ChunkedLocalAttentionSpec,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.structured_output import StructuredOutputManager  # type: ignore[import-not-found]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("vllm-model"))


def _first_difference(ours: StepRecord, theirs: StepRecord) -> str:
    for name in StepRecord.__dataclass_fields__:
        a, b = getattr(theirs, name), getattr(ours, name)
        if a == b:
            continue
        if isinstance(a, dict):
            for key in sorted(set(a) | set(b)):
                if a.get(key) != b.get(key):
                    return f"{name}[{key!r}]: vLLM {a.get(key)} vs flat {b.get(key)}"
        return f"{name}: vLLM {a} vs flat {b}"
    return ""


def _count_mamba_paths(scheduler: Any, covered: dict[str, int]) -> None:
    """Count, on vLLM's own manager, the mamba paths a hybrid run takes: admissions whose
    full-attention hit runs past the mamba hit (a shared-prefix boundary, where the scheduler
    ends the chunk) and hits deferred because their mamba state was cached in the same step."""
    manager = scheduler.kv_cache_manager
    covered["boundaries"] = covered["deferred"] = covered["unkeyed_crossings"] = 0
    lookup = manager.get_computed_blocks

    def get_computed_blocks(*args: Any, **kwargs: Any) -> Any:
        result = lookup(*args, **kwargs)
        covered["boundaries"] += result[2] > 0
        return result

    manager.get_computed_blocks = get_computed_blocks
    for single in manager.coordinator.single_type_managers:
        if isinstance(single.kv_cache_spec, MambaSpec):
            count = single.get_num_blocks_to_allocate

            def get_num_blocks_to_allocate(*args: Any, _count: Any = count, **kwargs: Any) -> int:
                need = _count(*args, **kwargs)
                covered["deferred"] += need > manager.block_pool.num_gpu_blocks
                return int(need)

            single.get_num_blocks_to_allocate = get_num_blocks_to_allocate
            allocate = single.allocate_new_blocks

            def allocate_new_blocks(
                request_id: str, num_tokens: int, *args: Any, _allocate: Any = allocate, _m: Any = single
            ) -> Any:
                # A running state page not yet cached when the table grows past it (vLLM caches it
                # right after): under async scheduling, at every decode block boundary.
                blocks = _m.req_to_blocks.get(request_id, [])
                if blocks and -(-num_tokens // _m.block_size) > len(blocks):
                    last = blocks[-1]
                    covered["unkeyed_crossings"] += not last.is_null and last.block_hash is None
                return _allocate(request_id, num_tokens, *args)

            single.allocate_new_blocks = allocate_new_blocks
            break  # one mamba group suffices: all of them decide alike


def _case_setup(model_dir: Path, options: dict[str, Any]) -> tuple[SchedulerSetup, bool]:
    """A case's scheduler setup (32 running requests and 512 tokens a step unless the case says
    otherwise) and whether its outputs come back a step late (its ``in_flight`` option)."""
    options = dict(options)
    in_flight = bool(options.pop("in_flight", False))
    limits = {"max_num_seqs": 32, "max_num_batched_tokens": 512}
    return SchedulerSetup(model_dir=model_dir, **{**limits, **options}), in_flight


def run_lockstep(
    setup: SchedulerSetup,
    num_requests: int,
    seed: int,
    *,
    tables: bool = True,
    in_flight: bool = False,
    tables_every: int = 1,
) -> dict[str, int]:
    """Both schedulers over one stream; asserts every step equal; returns what the run covered.

    Every step's decisions (scheduled tokens, new requests with their block ids, new block ids,
    preemptions, finishes, usage) are compared; with ``tables`` also every live request's whole
    table and cached-token estimate, on every ``tables_every``-th step and on every step that
    preempts (the few-thousand-request runs take 8: reading every table of 64 live requests on
    both sides each step was half their time, and a table that diverges stays diverged until
    its request ends, which is seldom within 8 steps)."""
    stream = make_stream(num_requests, seed=seed)
    theirs = build_scheduler(AsyncScheduler, setup)
    ours = build_scheduler(FlatScheduler, setup)
    assert isinstance(ours.kv_cache_manager, FlatKVCacheManager)
    covered = {"steps": 0, "preemptions": 0, "hit_tokens": 0, "aborted": 0, "null_hits": 0, "null_slots": 0}
    covered["table_steps"] = 0
    if setup.layer_types:
        _count_mamba_paths(theirs, covered)
    their_steps = run_steps(theirs, stream, block_size=setup.block_size, in_flight=in_flight)
    our_steps = run_steps(ours, stream, block_size=setup.block_size, in_flight=in_flight)
    for step, (their_out, our_out) in enumerate(zip(their_steps, our_steps, strict=True)):
        full = tables and (step % tables_every == 0 or bool(their_out.preempted_req_ids))
        a = record_step(theirs, their_out, tables=full)
        b = record_step(ours, our_out, tables=full)
        assert a == b, f"step {step}: {_first_difference(b, a)}"
        covered["steps"] += 1
        covered["table_steps"] += full
        covered["preemptions"] += len(a.preempted)
        covered["hit_tokens"] += sum(hit for _, hit, _ in a.new_requests)
        # Sliding-window hits start with null blocks (block id 0) in a sliding group's table;
        # slid-out slots become null blocks in live tables.
        covered["null_hits"] += sum(1 for _, hit, ids in a.new_requests if hit and any(0 in g for g in ids))
        covered["null_slots"] += sum(g.count(0) for ids in a.tables.values() for g in ids)
    covered["aborted"] = sum(1 for r in stream if r.abort_step is not None)
    return covered


# Pools from generous to tight (a few hundred preemptions), models of several full-attention
# layers (one group of them, as vLLM groups them) and of several full-attention groups beside a
# sliding one, a long-prefill cap, a watermark, 32-token blocks, 256 running requests. Every
# config is built by vLLM's EngineCore steps (harness.build_configs) on vLLM's defaults,
# prefix_cache_retention_interval = 0 included, unless a case says otherwise.
CASES: dict[str, dict[str, Any]] = {
    "tight-pool": dict(num_blocks=300),
    "roomy-pool": dict(num_blocks=2000),
    "two-layers": dict(num_groups=2, num_blocks=450),
    "two-full-groups-and-sliding": dict(windows=(None, None, 1024), num_blocks=1500, retention=None),
    "long-prefill-cap": dict(long_prefill_token_threshold=128, num_blocks=600),
    "watermark": dict(watermark=0.05, num_blocks=600),
    "block-32": dict(block_size=32, num_blocks=400),
    "256-running": dict(max_num_seqs=256, max_num_batched_tokens=2048, num_blocks=1500),
    "priority-policy": dict(policy="priority", num_blocks=300),
}


# Full attention plus sliding window (each entry of ``windows``: None a full-attention group, an
# int a sliding-window group of that many tokens), 16-token blocks unless said: windows shorter
# than the prompts so hits start with null blocks and tables lose slid-out pages, pools tight
# enough to preempt, chunked prefill (512-token budget), aborts. 100, 40 and 37 are not
# multiples of the block size; two groups of one window are one spec group in vLLM's hybrid
# coordinator (one joint lookup), two windows make its lookup a fixed point over three kinds.
# Dense prefix-cache retention (``prefix_cache_retention_interval=None``); vLLM's default sparse
# retention (0) and intervals are SPARSE_CASES, at the end.
SLIDING_CASES: dict[str, dict[str, Any]] = {
    "sliding-tight-pool": dict(windows=(None, 128), num_blocks=250),
    "sliding-two-same-windows": dict(windows=(None, 100, 100), num_blocks=400),
    "sliding-two-windows-prefill-cap": dict(
        windows=(100, None, 40, 37), num_blocks=500, long_prefill_token_threshold=64
    ),
    "sliding-block-32-window-17": dict(windows=(None, 17), block_size=32, num_blocks=250),
    "sliding-only": dict(windows=(128,), num_blocks=200),
}
for _case in SLIDING_CASES.values():
    _case["retention"] = None


# GDN / mamba hybrids, their KV cache config built by vLLM's own config steps
# (``harness.hybrid_kv_cache_config``): Qwen3.5 and Qwen3-Next interleave three linear-attention
# (GDN) layers with one full-attention layer, so vLLM makes three MambaSpec groups and one
# full-attention group of two layers each. Mode "align" (prefix caching on; dense retention, which
# vLLM's prefix_cache_retention_interval=None selects): shared and nested prefixes make mamba hits
# (null blocks before the hit state) and shared-prefix boundaries (the full-attention hit running
# past the mamba hit, where vLLM's scheduler ends the chunk), states cached in the same step defer
# a hit, tight pools preempt. Mode "none" (prefix caching off): one block of max_model_len tokens
# per request and group. Mamba2 layers (MambaMixer2) serve in mode "none" only (their prefill
# checkpoint pages are refused in "align", below).
QWEN35_LAYERS = ("linear_attention", "linear_attention", "linear_attention", "full_attention") * 2


@pytest.mark.parametrize("model", ["qwen3.5", "qwen3-next"])
def test_layer_pattern_is_transformers(tmp_path: Path, model: str) -> None:
    """The cases' layer pattern is what transformers writes for tiny Qwen3.5 and Qwen3-Next
    configs (``save_pretrained``, no hub)."""
    assert hybrid_layer_types(tmp_path, model) == QWEN35_LAYERS


# The "async" cases hand each step's output back after the next step is scheduled, as vLLM's
# engine core does under async scheduling (``run_steps(in_flight=True)``): a running mamba state
# is then still uncached when its table grows past it, at every decode block boundary.
MAMBA_CASES: dict[str, dict[str, Any]] = {
    "gdn-align-tight-pool": dict(layer_types=QWEN35_LAYERS, num_blocks=400),
    "gdn-align-tight-pool-async": dict(layer_types=QWEN35_LAYERS, num_blocks=400, in_flight=True),
    "gdn-align-prefill-cap-async": dict(
        layer_types=QWEN35_LAYERS, num_blocks=700, long_prefill_token_threshold=64, in_flight=True
    ),
    "gdn-align-block-32-async": dict(
        layer_types=QWEN35_LAYERS, num_blocks=300, block_size=32, in_flight=True
    ),
    "gdn-align-one-to-one-priority": dict(
        layer_types=("linear_attention", "full_attention") * 2, num_blocks=300, policy="priority"
    ),
    "gdn-none-tight-pool-async": dict(
        layer_types=QWEN35_LAYERS, num_blocks=300, enable_prefix_caching=False, in_flight=True
    ),
    "mamba2-none-tight-pool": dict(
        layer_types=QWEN35_LAYERS, num_blocks=300, enable_prefix_caching=False, mamba_type="mamba2"
    ),
}


@pytest.mark.parametrize("case", list(MAMBA_CASES))
def test_mamba_hybrid_same_steps_as_vllm(model_dir: Path, case: str) -> None:
    options = dict(MAMBA_CASES[case])
    setup, in_flight = _case_setup(model_dir, options)
    covered = run_lockstep(setup, 500, seed=5, in_flight=in_flight)
    assert covered["preemptions"] > 0 and covered["aborted"] > 0, covered
    if setup.enable_prefix_caching:
        assert covered["hit_tokens"] > 0 and covered["null_hits"] > 20, covered
        assert covered["boundaries"] > 100 and covered["deferred"] > 0, covered
        assert (covered["unkeyed_crossings"] > 100) == in_flight, covered
    else:
        assert covered["hit_tokens"] == 0, covered


def test_mamba_hybrid_few_thousand_requests(model_dir: Path) -> None:
    setup = SchedulerSetup(
        model_dir=model_dir,
        layer_types=QWEN35_LAYERS,
        num_blocks=700,
        max_num_seqs=64,
        max_num_batched_tokens=1024,
    )
    covered = run_lockstep(setup, 1500, seed=17, in_flight=True, tables_every=8)
    assert covered["table_steps"] > covered["steps"] // 8, covered
    assert covered["preemptions"] > 20 and covered["aborted"] > 30, covered
    assert covered["boundaries"] > 500 and covered["deferred"] > 5, covered
    assert covered["unkeyed_crossings"] > 1000, covered


@pytest.mark.parametrize("windows", [(), (None, 128, 40)], ids=["full", "full-sliding"])
def test_in_flight_same_steps(model_dir: Path, windows: tuple[int | None, ...]) -> None:
    """Under async scheduling's timing (one step's output handed back after the next is
    scheduled) the full and sliding-window mappings stay identical too."""
    setup = SchedulerSetup(
        model_dir=model_dir,
        windows=windows,
        num_blocks=300,
        max_num_seqs=32,
        max_num_batched_tokens=512,
        retention=None,  # dense retention: what a sliding group is served with
    )
    covered = run_lockstep(setup, 500, seed=9, in_flight=True)
    assert covered["preemptions"] > 0 and covered["hit_tokens"] > 0 and covered["aborted"] > 0, covered


def _hybrid_configs(model_dir: Path, **kwargs: Any) -> tuple[Any, Any, int]:
    """The vLLM config, KV-cache config and block size of a GDN hybrid built by vLLM's steps."""
    setup = SchedulerSetup(model_dir=model_dir, layer_types=QWEN35_LAYERS, num_blocks=128, **kwargs)
    theirs = build_scheduler(AsyncScheduler, setup)
    return theirs.vllm_config, theirs.kv_cache_config, theirs.block_size


def test_mamba_groups_built_as_vllm_builds_them(model_dir: Path) -> None:
    """The differential's hybrids are vLLM's own: three GDN groups before one full group, mode and
    block size from vLLM's config hook, and FlatScheduler serves them."""
    vllm_config, kv_cache_config, block_size = _hybrid_configs(model_dir)
    kinds = [type(g.kv_cache_spec).__name__ for g in kv_cache_config.kv_cache_groups]
    assert kinds == ["MambaSpec", "MambaSpec", "MambaSpec", "FullAttentionSpec"]
    assert all(len(g.layer_names) == 2 for g in kv_cache_config.kv_cache_groups)
    mamba = kv_cache_config.kv_cache_groups[0].kv_cache_spec
    assert (mamba.mamba_cache_mode, mamba.block_size, block_size) == ("align", 16, 16)
    ours = _build_flat(vllm_config, kv_cache_config, block_size)
    assert isinstance(ours.kv_cache_manager, FlatKVCacheManager)
    off_config, off, off_block_size = _hybrid_configs(model_dir, enable_prefix_caching=False)
    mamba = off.kv_cache_groups[0].kv_cache_spec
    # Mode "none": one mamba block holds the whole sequence, and the scheduler's block is the
    # lcm of the groups' (the attention block divides max_model_len here).
    longest = off_config.model_config.max_model_len
    assert (mamba.mamba_cache_mode, mamba.block_size, off_block_size) == ("none", longest, longest)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(mamba_type="mamba2"), r"group 0 \(MambaSpec.*mamba prefill checkpoint pages"),
    ],
    ids=["mamba2-align"],
)
def test_mamba_variants_refused(model_dir: Path, kwargs: dict[str, Any], message: str) -> None:
    vllm_config, kv_cache_config, block_size = _hybrid_configs(model_dir, **kwargs)
    with pytest.raises(UnsupportedVllmConfigError, match=message):
        _build_flat(vllm_config, kv_cache_config, block_size)


@pytest.mark.parametrize("case", list(SLIDING_CASES))
def test_sliding_window_same_steps_as_vllm(model_dir: Path, case: str) -> None:
    setup = SchedulerSetup(
        model_dir=model_dir, **{"max_num_seqs": 32, "max_num_batched_tokens": 512, **SLIDING_CASES[case]}
    )
    covered = run_lockstep(setup, 700, seed=5)
    assert covered["preemptions"] > 0 and covered["aborted"] > 0, covered
    assert covered["null_hits"] > 20 and covered["null_slots"] > 1000, covered


def test_sliding_window_few_thousand_requests(model_dir: Path) -> None:
    setup = SchedulerSetup(
        model_dir=model_dir,
        windows=(None, 128, 128),
        retention=None,
        num_blocks=1000,
        max_num_seqs=64,
        max_num_batched_tokens=1024,
    )
    covered = run_lockstep(setup, 3000, seed=13, tables_every=8)
    assert covered["table_steps"] > covered["steps"] // 8, covered
    assert covered["preemptions"] > 20 and covered["null_hits"] > 500 and covered["aborted"] > 50, covered


@pytest.mark.parametrize("case", list(CASES))
def test_same_steps_as_vllm(model_dir: Path, case: str) -> None:
    setup = SchedulerSetup(
        model_dir=model_dir, **{"max_num_seqs": 32, "max_num_batched_tokens": 512, **CASES[case]}
    )
    covered = run_lockstep(setup, 1500, seed=7)
    assert covered["hit_tokens"] > 0
    if case in ("tight-pool", "two-layers", "long-prefill-cap", "256-running", "priority-policy"):
        assert covered["preemptions"] > 0, covered


def test_block_hashes_of_another_length_same_steps(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's 32-byte block hashes reach the engine as they are; a hash function of another
    length (16 bytes here) has each hash's SHA-256 digest taken once instead: the same steps."""
    import flat_kvcache.vllm.harness as harness

    sha256 = vars(harness)["sha256"]  # vLLM's, as the harness hashes blocks with it
    monkeypatch.setattr(harness, "sha256", lambda value: sha256(value)[:16])
    setup = SchedulerSetup(model_dir=model_dir, num_blocks=300, max_num_seqs=32, max_num_batched_tokens=512)
    managers: list[Any] = []
    build = harness.build_scheduler

    def keep(cls: type, setup: SchedulerSetup) -> Any:
        scheduler = build(cls, setup)
        managers.append(scheduler.kv_cache_manager)
        return scheduler

    monkeypatch.setitem(globals(), "build_scheduler", keep)
    covered = run_lockstep(setup, 300, seed=7)
    assert covered["hit_tokens"] > 0 and covered["preemptions"] > 0, covered
    ours = [m for m in managers if isinstance(m, FlatKVCacheManager)]
    assert len(ours) == 1 and ours[0]._raw_hashes is False


def test_few_thousand_requests(model_dir: Path) -> None:
    setup = SchedulerSetup(model_dir=model_dir, num_blocks=700, max_num_seqs=64, max_num_batched_tokens=1024)
    covered = run_lockstep(setup, 4000, seed=11, tables_every=8)
    assert covered["table_steps"] > covered["steps"] // 8, covered
    assert covered["preemptions"] > 50 and covered["hit_tokens"] > 100_000 and covered["aborted"] > 50, (
        covered
    )


@pytest.mark.parametrize("windows", [(), (None, 128, 40)], ids=["full", "full-sliding"])
def test_prefix_caching_off_same_steps(model_dir: Path, windows: tuple[int | None, ...]) -> None:
    """Without prefix caching every page is uncached: freed and slid-out pages return to the
    front of the free list, tail first, as in vLLM, so the block ids are identical too. vLLM's
    default sparse retention (0) caches nothing either then, so it is served as is."""
    setup = SchedulerSetup(
        model_dir=model_dir,
        enable_prefix_caching=False,
        windows=windows,
        num_blocks=500,
        max_num_seqs=32,
        max_num_batched_tokens=512,
    )
    covered = run_lockstep(setup, 800, seed=3)
    assert covered["preemptions"] > 0 and covered["hit_tokens"] == 0, covered


def test_engine_core_path_builds_vllm_groups(model_dir: Path) -> None:
    """The configs are vLLM's own: a hybrid gets one group per layer of its pattern, several
    full-attention layers alone share one group, and the cache config's default retention (0)
    reaches the KV-cache config as EngineCore copies it."""
    _, config, block_size, hash_block_size = build_configs(
        SchedulerSetup(model_dir=model_dir, windows=(None, None, 1024), retention=None)
    )
    kinds = [type(g.kv_cache_spec).__name__ for g in config.kv_cache_groups]
    assert kinds == ["FullAttentionSpec", "FullAttentionSpec", "SlidingWindowSpec"]
    assert (block_size, hash_block_size, config.prefix_cache_retention_interval) == (16, 16, None)
    _, config, _, _ = build_configs(SchedulerSetup(model_dir=model_dir, num_groups=3))
    assert [len(g.layer_names) for g in config.kv_cache_groups] == [3]
    assert config.prefix_cache_retention_interval == 0


def test_returns_vllm_block_objects(model_dir: Path) -> None:
    setup = SchedulerSetup(model_dir=model_dir, num_blocks=200)
    ours = build_scheduler(FlatScheduler, setup)
    steps = run_steps(ours, make_stream(5, seed=1, abort_fraction=0.0), block_size=16)
    output = next(steps)
    assert output.scheduled_new_reqs
    rid = output.scheduled_new_reqs[0].req_id
    blocks = ours.kv_cache_manager.get_blocks(rid)
    assert isinstance(blocks, KVCacheBlocks)
    assert all(isinstance(b, KVCacheBlock) and 0 < b.block_id < 200 for b in blocks.blocks[0])
    assert blocks.get_block_ids() == output.scheduled_new_reqs[0].block_ids
    assert isinstance(ours, AsyncScheduler) and isinstance(ours, Scheduler)
    for _ in steps:
        pass
    assert ours.kv_cache_manager.usage == 0.0
    assert ours.kv_cache_manager.reset_prefix_cache() is True


def _configs(model_dir: Path) -> tuple[Any, Any]:
    """The vLLM config and KV-cache config of a small supported setup (vLLM's own scheduler)."""
    theirs = build_scheduler(AsyncScheduler, SchedulerSetup(model_dir=model_dir, num_blocks=128))
    return theirs.vllm_config, theirs.kv_cache_config


def _build_flat(vllm_config: Any, kv_cache_config: Any, block_size: int = 16, **kwargs: Any) -> Any:
    return FlatScheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=block_size,
        **kwargs,
    )


@pytest.mark.parametrize(
    ("mode", "full", "message"),
    [
        ("none", True, "mamba_cache_mode 'none' with prefix caching"),
        ("align", False, "mamba groups without a full-attention group"),
    ],
    ids=["none-with-caching", "no-full-attention"],
)
def test_mamba_group_refused_naming_it(model_dir: Path, mode: str, full: bool, message: str) -> None:
    """Hand-built hybrids vLLM's config steps never make (or that no test covers) are refused,
    naming the group and why."""
    vllm_config, kv_cache_config = _configs(model_dir)
    mamba = MambaSpec(block_size=16, shapes=((4, 8),), dtypes=(torch.float16,), mamba_cache_mode=mode)
    hybrid = copy.copy(kv_cache_config)
    hybrid.prefix_cache_retention_interval = None  # dense: the refusal named is the group's shape
    hybrid.kv_cache_groups = [
        *(kv_cache_config.kv_cache_groups if full else []),
        KVCacheGroupSpec(["model.layers.1.linear_attn"], mamba),
    ]
    index = 1 if full else 0
    with pytest.raises(
        UnsupportedVllmConfigError,
        match=rf"KV cache group {index} \(MambaSpec, layers \[model.layers.1.linear_attn\]\): {message}",
    ):
        _build_flat(vllm_config, hybrid)


def _with_groups(kv_cache_config: Any, *specs: Any) -> Any:
    """``kv_cache_config`` with these groups, and dense retention (what sliding groups are served with)."""
    changed = copy.copy(kv_cache_config)
    changed.prefix_cache_retention_interval = None
    changed.kv_cache_groups = [
        KVCacheGroupSpec([f"model.layers.{i}.self_attn.attn"], spec) for i, spec in enumerate(specs)
    ]
    return changed


def test_sliding_window_group_served(model_dir: Path) -> None:
    vllm_config, kv_cache_config = _configs(model_dir)
    hybrid = _with_groups(kv_cache_config, kv_cache_spec(16), kv_cache_spec(16, 128))
    ours = _build_flat(vllm_config, hybrid)
    assert isinstance(ours.kv_cache_manager, FlatKVCacheManager)


def test_chunked_local_group_refused(model_dir: Path) -> None:
    vllm_config, kv_cache_config = _configs(model_dir)
    local = ChunkedLocalAttentionSpec(
        block_size=16, num_kv_heads=2, head_size=16, dtype=torch.float16, attention_chunk_size=64
    )
    hybrid = _with_groups(kv_cache_config, kv_cache_spec(16), local)
    with pytest.raises(
        UnsupportedVllmConfigError,
        match=r"group 1 \(ChunkedLocalAttentionSpec.*only full-attention, sliding-window and mamba groups",
    ):
        _build_flat(vllm_config, hybrid)


def test_sliding_window_of_another_block_size_refused(model_dir: Path) -> None:
    """vLLM schedules a hybrid of two block sizes at their lcm with partial-block hashing; refused."""
    vllm_config, kv_cache_config = _configs(model_dir)
    hybrid = _with_groups(kv_cache_config, kv_cache_spec(16), kv_cache_spec(32, 128))
    with pytest.raises(
        UnsupportedVllmConfigError,
        match=r"group 1 \(SlidingWindowSpec.*block size 32 differs from the scheduler's 16",
    ):
        check_supported(vllm_config, hybrid, 16, None)


def test_groups_of_two_block_sizes_name_the_group_on_the_engine_core_path(model_dir: Path) -> None:
    """vLLM's EngineCore hands a scheduler over groups of 16- and 32-token blocks the lcm, 32, as
    its block size and the gcd, 16, as its hash block size: the refusal still names the group whose
    block size differs (docs/vllm.md), not the hash block size."""
    vllm_config, kv_cache_config = _configs(model_dir)
    hybrid = _with_groups(kv_cache_config, kv_cache_spec(16), kv_cache_spec(32, 128))
    with pytest.raises(
        UnsupportedVllmConfigError,
        match=r"group 0 \(FullAttentionSpec.*block size 16 differs from the scheduler's 32",
    ):
        check_supported(vllm_config, hybrid, 32, 16)


@pytest.mark.parametrize(
    ("spec", "retention", "message"),
    [
        (kv_cache_spec(16, 1), None, "sliding_window = 1 .a window of fewer than 2 tokens"),
        (
            SlidingWindowSpec(
                block_size=16,
                num_kv_heads=2,
                head_size=16,
                dtype=torch.float16,
                sliding_window=128,
                extra_retained_tokens=3,
            ),
            None,
            "extra retained tokens",
        ),
    ],
    ids=["window-1", "extra-retained"],
)
def test_sliding_window_variants_refused(
    model_dir: Path, spec: Any, retention: int | None, message: str
) -> None:
    vllm_config, kv_cache_config = _configs(model_dir)
    hybrid = _with_groups(kv_cache_config, kv_cache_spec(16), spec)
    hybrid.prefix_cache_retention_interval = retention
    with pytest.raises(UnsupportedVllmConfigError, match=message):
        check_supported(vllm_config, hybrid, 16, None)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("kv_transfer_config", object(), "KV connectors"),
        ("ec_transfer_config", object(), "encoder-cache connectors"),
    ],
)
def test_features_refused(model_dir: Path, field: str, value: object, message: str) -> None:
    vllm_config, kv_cache_config = _configs(model_dir)
    changed = copy.copy(vllm_config)
    object.__setattr__(changed, field, value)
    with pytest.raises(UnsupportedVllmConfigError, match=message):
        check_supported(changed, kv_cache_config, 16, None)


def test_partial_hash_blocks_refused(model_dir: Path) -> None:
    vllm_config, kv_cache_config = _configs(model_dir)
    with pytest.raises(UnsupportedVllmConfigError, match="hash block size"):
        _build_flat(vllm_config, kv_cache_config, hash_block_size=8)


# -- Speculative decoding ---------------------------------------------------------------------
#
# Draft tokens reach the KV-cache manager as scheduled tokens (``num_new_tokens`` counts a
# request's drafts; only ``request.num_tokens``, the verified ones, are cached) and, for a draft
# model, as ``num_lookahead_tokens`` slots past them; rejected drafts roll
# ``num_computed_tokens`` back in ``update_from_output`` and leave their slots allocated. The fake
# model accepts a pseudo-random number of each request's scheduled drafts
# (``harness.num_accepted_drafts``, the same on both sides). Without async scheduling the fake
# drafter proposes 0 to K drafts after each step (``harness.proposed_drafts``, handed to
# ``update_draft_token_ids`` as vLLM's engine core does), and vLLM's own side is the plain
# ``Scheduler``, the class vLLM builds then (ngram on the V1 model runner turns async scheduling
# off), against FlatScheduler (an ``AsyncScheduler``), the pairing a user gets; with
# ``in_flight`` (async scheduling: ngram_gpu, draft models, the V2 model runner) each step's
# output comes back after the next is scheduled, the scheduler schedules K placeholder drafts
# itself, and vLLM's side is its ``AsyncScheduler``.
SPEC_CASES: dict[str, dict[str, Any]] = {
    "ngram-tight-pool": dict(speculative_method="ngram", num_blocks=300),
    "ngram-tight-pool-async": dict(speculative_method="ngram", num_blocks=300, in_flight=True),
    "draft-model-lookahead": dict(speculative_method="draft_model", num_blocks=300),
    "draft-model-lookahead-async": dict(speculative_method="draft_model", num_blocks=300, in_flight=True),
    "ngram-k5-block-32-prefill-cap": dict(
        speculative_method="ngram",
        num_speculative_tokens=5,
        block_size=32,
        num_blocks=200,
        long_prefill_token_threshold=64,
    ),
    "ngram-priority": dict(speculative_method="ngram", num_blocks=300, policy="priority"),
    "ngram-sliding": dict(
        speculative_method="ngram", windows=(None, 128, 40), retention=None, num_blocks=300
    ),
    "draft-model-sliding-async": dict(
        speculative_method="draft_model", windows=(None, 100), retention=None, num_blocks=300, in_flight=True
    ),
    "ngram-caching-off": dict(speculative_method="ngram", enable_prefix_caching=False, num_blocks=400),
}


def run_spec_lockstep(
    setup: SchedulerSetup, num_requests: int, seed: int, *, in_flight: bool
) -> dict[str, int]:
    """:func:`run_lockstep` with draft tokens: vLLM's side is the scheduler class vLLM's engine
    builds for the timing (``Scheduler`` without async scheduling); also counts what the drafts
    did on vLLM's side (drafts scheduled, rejected, tables holding slots past the computed
    tokens: rejected drafts' and lookahead slots)."""
    from flat_kvcache.vllm.harness import num_accepted_drafts

    stream = make_stream(num_requests, seed=seed)
    theirs = build_scheduler(AsyncScheduler if in_flight else Scheduler, setup)
    ours = build_scheduler(FlatScheduler, setup)
    assert type(theirs) is (AsyncScheduler if in_flight else Scheduler)
    assert theirs.num_spec_tokens == setup.num_speculative_tokens
    lookahead = setup.num_speculative_tokens if setup.speculative_method == "draft_model" else 0
    assert theirs.num_lookahead_tokens == ours.num_lookahead_tokens == lookahead
    covered = {
        "steps": 0,
        "preemptions": 0,
        "hit_tokens": 0,
        "null_slots": 0,
        "drafts": 0,
        "rejected": 0,
        "slots_past_computed": 0,
    }
    their_steps = run_steps(theirs, stream, block_size=setup.block_size, in_flight=in_flight)
    our_steps = run_steps(ours, stream, block_size=setup.block_size, in_flight=in_flight)
    for step, (their_out, our_out) in enumerate(zip(their_steps, our_steps, strict=True)):
        a = record_step(theirs, their_out, tables=True)
        b = record_step(ours, our_out, tables=True)
        assert a == b, f"step {step}: {_first_difference(b, a)}"
        assert their_out.scheduled_spec_decode_tokens == our_out.scheduled_spec_decode_tokens, step
        covered["steps"] += 1
        covered["preemptions"] += len(a.preempted)
        covered["hit_tokens"] += sum(hit for _, hit, _ in a.new_requests)
        covered["null_slots"] += sum(g.count(0) for ids in a.tables.values() for g in ids)
        for rid, drafts in their_out.scheduled_spec_decode_tokens.items():
            position = theirs.requests[rid].num_output_tokens
            covered["drafts"] += len(drafts)
            covered["rejected"] += len(drafts) - num_accepted_drafts(rid, position, len(drafts))
        for rid, ids in a.tables.items():
            computed = theirs.requests[rid].num_computed_tokens
            covered["slots_past_computed"] += len(ids[0]) > -(-computed // setup.block_size)
    covered["aborted"] = sum(1 for r in stream if r.abort_step is not None)
    return covered


@pytest.mark.parametrize("case", list(SPEC_CASES))
def test_speculative_decoding_same_steps_as_vllm(model_dir: Path, case: str) -> None:
    options = dict(SPEC_CASES[case])
    setup, in_flight = _case_setup(model_dir, options)
    covered = run_spec_lockstep(setup, 600, seed=21, in_flight=in_flight)
    assert covered["preemptions"] > 0 and covered["aborted"] > 0, covered
    assert covered["drafts"] > 1000 and covered["rejected"] > 300, covered
    # Tables holding slots past the computed tokens: after a rollback of rejected drafts (the
    # slots stay allocated, as in vLLM), and lookahead slots. Under async scheduling a rollback
    # lands after the next step has scheduled its own drafts on top, so with no lookahead a
    # table rarely stays past them.
    assert covered["slots_past_computed"] > (10 if in_flight and "ngram" in case else 100), covered
    if setup.enable_prefix_caching:
        assert covered["hit_tokens"] > 0, covered
    if setup.windows:
        assert covered["null_slots"] > 1000, covered


@pytest.mark.parametrize(
    ("method", "message"),
    [
        ("eagle", "method 'eagle' .the EAGLE family drops the trailing block of a prefix hit"),
        ("mtp", "method 'mtp' .the EAGLE family"),
        ("custom_class", "method 'custom_class' .not checked against vLLM's manager"),
    ],
)
def test_speculative_methods_refused(model_dir: Path, method: str, message: str) -> None:
    """Only the methods the differential covers are served; the EAGLE family also drops hit
    blocks and reads prefill tokens ahead, which the adapter does not map. (vLLM's config for
    these needs a draft model of their kind; the method is the only thing the check reads, so
    it is set on a copy of a served ngram config.)"""
    setup = SchedulerSetup(model_dir=model_dir, num_blocks=128, speculative_method="ngram")
    vllm_config, kv_cache_config, _, _ = build_configs(setup)
    check_supported(vllm_config, kv_cache_config, 16, None)  # ngram itself is served
    changed = copy.copy(vllm_config)
    speculative = copy.copy(vllm_config.speculative_config)
    object.__setattr__(speculative, "method", method)
    object.__setattr__(changed, "speculative_config", speculative)
    with pytest.raises(UnsupportedVllmConfigError, match=f"speculative decoding with {message}"):
        check_supported(changed, kv_cache_config, 16, None)


def test_speculative_decoding_beside_mamba_refused(model_dir: Path) -> None:
    """A GDN hybrid (built by vLLM's config steps) with ngram drafting: vLLM's MambaManager keeps
    speculative state blocks there, not mapped; refused naming the group."""
    vllm_config, kv_cache_config, block_size = _hybrid_configs(model_dir, speculative_method="ngram")
    assert vllm_config.speculative_config.method == "ngram"
    with pytest.raises(
        UnsupportedVllmConfigError,
        match=r"KV cache group 0 \(MambaSpec.*speculative decoding beside mamba groups",
    ):
        _build_flat(vllm_config, kv_cache_config, block_size)


# -- KV cache events (kv_events_config.enable_kv_cache_events) --------------------------------
#
# With vLLM's KV events on, FlatKVCacheManager.take_events() returns vLLM's own event objects
# (BlockStored / BlockRemoved / AllBlocksCleared of vllm.distributed.kv_events). Both schedulers
# publish each step's events as one KVEventBatch (Scheduler.update_from_output); a recording
# publisher takes them, and every step the two must hold the same events in the same order, and
# encode (msgspec's msgpack encoder, vLLM's publisher's) to the same bytes that decode with
# vLLM's own KVEventBatch type back to the same events. The streams add prefix-cache resets
# (reset_running_requests=True: every request preempted, then AllBlocksCleared) and requests
# reporting their hits in full (kv_cache_report_mode="full", which re-stores a hit's blocks).


class _RecordingPublisher:
    """Stands in for the scheduler's KV event publisher: keeps every published batch."""

    def __init__(self) -> None:
        self.batches: list[Any] = []

    def publish(self, batch: Any) -> None:
        self.batches.append(batch)

    def shutdown(self) -> None:
        pass

    def get_publisher_config(self) -> Any:
        return None


def _build_with_events(cls: type, setup: SchedulerSetup) -> Any:
    """:func:`build_scheduler` with ``kv_events_config`` set, as ``--kv-events-config`` does."""
    from vllm.config import KVEventsConfig  # type: ignore[import-not-found]
    from vllm.utils.hashing import sha256  # type: ignore[import-not-found]
    from vllm.v1.core.kv_cache_utils import init_none_hash

    init_none_hash(sha256)
    vllm_config, kv_cache_config, block_size, hash_block_size = build_configs(setup)
    vllm_config.kv_events_config = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    scheduler = cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=block_size,
        hash_block_size=hash_block_size,
        log_stats=setup.log_stats,
    )
    scheduler.kv_event_publisher = _RecordingPublisher()
    return scheduler


def _with_resets_and_full_reports(scheduler: Any, reset_every: int, covered: dict[str, int] | None) -> None:
    """Every ``reset_every`` steps, before ``schedule()``, reset the prefix cache with every
    running request preempted (as ``LLM.reset_prefix_cache(reset_running_requests=True)``);
    every fourth request reports its hits in full (``kv_cache_report_mode="full"``)."""
    schedule = scheduler.schedule
    add_request = scheduler.add_request
    steps = [0]

    def scheduled() -> Any:
        steps[0] += 1
        if steps[0] % reset_every == 0:
            assert scheduler.reset_prefix_cache(reset_running_requests=True)
            if covered is not None:
                covered["resets"] += 1
        return schedule()

    def added(request: Any) -> None:
        if int(request.request_id[1:]) % 4 == 0:
            request.kv_cache_report_mode = "full"
        add_request(request)

    scheduler.schedule = scheduled
    scheduler.add_request = added


def _events_lockstep(
    setup: SchedulerSetup, num_requests: int, seed: int, *, in_flight: bool, reset_every: int = 61
) -> dict[str, int]:
    """Both schedulers with KV events over one stream: every step's decisions and published
    event batches equal. Returns what vLLM's run emitted."""
    import msgspec
    from vllm.distributed.kv_events import (  # type: ignore[import-not-found]
        AllBlocksCleared,
        BlockRemoved,
        BlockStored,
        KVEventBatch,
    )

    stream = make_stream(num_requests, seed=seed)
    theirs = _build_with_events(AsyncScheduler, setup)
    ours = _build_with_events(FlatScheduler, setup)
    assert isinstance(ours.kv_cache_manager, FlatKVCacheManager)
    covered = dict.fromkeys(
        ("steps", "preemptions", "stored", "stored_hashes", "stored_empty", "stored_with_nulls",
         "extra_keys", "removed", "removed_mixed_runs", "cleared", "resets", "full_reports",
         "bytes_hashes"),
        0,
    )  # fmt: skip
    _with_resets_and_full_reports(theirs, reset_every, covered)
    _with_resets_and_full_reports(ours, reset_every, None)
    report = theirs.kv_cache_manager.coordinator.emit_cached_block_events

    def emit_cached_block_events(request: Any, blocks: Any) -> None:
        covered["full_reports"] += 1
        report(request, blocks)

    theirs.kv_cache_manager.coordinator.emit_cached_block_events = emit_cached_block_events
    encoder = msgspec.msgpack.Encoder()
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    their_pub, our_pub = theirs.kv_event_publisher, ours.kv_event_publisher
    seen = 0
    their_steps = run_steps(theirs, stream, block_size=setup.block_size, in_flight=in_flight)
    our_steps = run_steps(ours, stream, block_size=setup.block_size, in_flight=in_flight)
    for step, (their_out, our_out) in enumerate(zip(their_steps, our_steps, strict=True)):
        a = record_step(theirs, their_out, tables=True)
        b = record_step(ours, our_out, tables=True)
        assert a == b, f"step {step}: {_first_difference(b, a)}"
        covered["steps"] += 1
        covered["preemptions"] += len(a.preempted)
        assert len(their_pub.batches) == len(our_pub.batches), f"step {step}: batch counts differ"
        for their_batch, our_batch in zip(their_pub.batches[seen:], our_pub.batches[seen:], strict=True):
            for i, (x, y) in enumerate(zip(their_batch.events, our_batch.events, strict=False)):
                assert type(x) is type(y) and x == y, f"step {step}, event {i}: vLLM {x!r} vs flat {y!r}"
            assert len(their_batch.events) == len(our_batch.events), f"step {step}: event counts differ"
            # vLLM's wire form: the same bytes, decoded by vLLM's own KVEventBatch type.
            their_bytes = encoder.encode(KVEventBatch(ts=0.0, events=their_batch.events))
            our_bytes = encoder.encode(KVEventBatch(ts=0.0, events=our_batch.events))
            assert our_bytes == their_bytes, f"step {step}: encoded batches differ"
            assert (
                decoder.decode(our_bytes)
                == decoder.decode(their_bytes)
                == KVEventBatch(ts=0.0, events=their_batch.events)
            )
            run: list[int] = []
            for event in [*their_batch.events, None]:
                if isinstance(event, BlockRemoved):
                    covered["removed"] += 1
                    run.append(event.group_idx)
                    continue
                # A run of removals whose groups are not contiguous (a group's allocation
                # evicting keys of several groups in turn): per-group batches would reorder it.
                covered["removed_mixed_runs"] += run != sorted(run, key=run.index)
                run = []
                if isinstance(event, BlockStored):
                    covered["stored"] += 1
                    if event.block_hashes:
                        covered["bytes_hashes"] = isinstance(event.block_hashes[0], bytes)
                    covered["stored_hashes"] += len(event.block_hashes)
                    covered["stored_empty"] += not event.block_hashes
                    covered["stored_with_nulls"] += (
                        len(event.token_ids) > len(event.block_hashes) * event.block_size
                    )
                    covered["extra_keys"] += event.extra_keys is not None and any(event.extra_keys)
                elif isinstance(event, AllBlocksCleared):
                    covered["cleared"] += 1
        seen = len(their_pub.batches)
    assert ours.kv_cache_manager.take_events() == theirs.kv_cache_manager.take_events() == []
    return covered


EVENT_CASES: dict[str, dict[str, Any]] = {
    "full-tight-pool": dict(num_blocks=300),
    "full-tight-pool-async": dict(num_blocks=300, in_flight=True),
    "full-sliding": dict(windows=(None, 128, 40), num_blocks=300, retention=None),
    "full-sliding-async": dict(windows=(None, 128, 40), num_blocks=300, retention=None, in_flight=True),
    "gdn-align": dict(layer_types=QWEN35_LAYERS, num_blocks=400),
    "gdn-align-async": dict(layer_types=QWEN35_LAYERS, num_blocks=400, in_flight=True),
    "full-caching-off": dict(num_blocks=300, enable_prefix_caching=False),
    # Block hashes as vLLM's bytes (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0) instead of its default
    # 64-bit ints.
    "full-sliding-bytes-hashes": dict(windows=(None, 128), num_blocks=250, retention=None, bytes_hashes=True),
    # vLLM's default sparse retention (0): a sliding or mamba group's block outside its
    # reachable mask is neither stored nor, later, removed.
    "full-sliding-sparse": dict(windows=(None, 128, 40), num_blocks=300),
    "gdn-align-sparse-async": dict(
        layer_types=QWEN35_LAYERS, num_blocks=400, prefix_cache_retention_interval=0, in_flight=True
    ),
}


@pytest.mark.parametrize("case", list(EVENT_CASES))
def test_kv_events_same_as_vllm(model_dir: Path, case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    options = dict(EVENT_CASES[case])
    bytes_hashes = bool(options.pop("bytes_hashes", False))
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0" if bytes_hashes else "1")
    setup, in_flight = _case_setup(model_dir, options)
    covered = _events_lockstep(setup, 400, seed=5, in_flight=in_flight)
    print(case, covered)
    assert covered["preemptions"] > 0 and covered["resets"] > 3, covered
    assert covered["cleared"] == covered["resets"], covered
    if not setup.enable_prefix_caching:
        assert covered["stored"] == covered["removed"] == 0, covered
        return
    assert covered["stored_hashes"] > 1000 and covered["removed"] > 100, covered
    assert covered["bytes_hashes"] == bytes_hashes, covered
    assert covered["extra_keys"] > 0 and covered["full_reports"] > 10, covered
    if setup.windows or setup.layer_types:
        assert covered["removed_mixed_runs"] > 0, covered
    if setup.layer_types:
        # Mamba ranges with null blocks: their tokens are stored, their hashes are not.
        assert covered["stored_with_nulls"] > 1000, covered


# -- Sparse prefix-cache retention (vLLM's default) --------------------------------------------
#
# vLLM 0.32/0.33 default prefix_cache_retention_interval to 0 and EngineCore copies it into the
# KVCacheConfig: a sliding-window or mamba group then keys a block only where a later request can
# resume (``reachable_block_mask``: the tail before the last prompt token, before a shared-prefix
# junction, and with an interval one tail or state per interval), while full-attention groups
# key every block. FlatKVCacheManager registers each group only where vLLM does
# (``register(groups=)``) and its mamba tables never move an unkeyed running page
# (``PageCache(move_state_pages=False)``). Each case runs in lockstep with vLLM's own manager
# (every step's decisions, block ids and cached-token estimates equal), and on each side the
# number of pages holding a key after every ``schedule()`` must agree too; on vLLM's side the
# blocks its mask leaves unkeyed (and keys) are counted per group kind, so each case proves the
# masked registrations happened.
SPARSE_CASES: dict[str, dict[str, Any]] = {
    "sliding-default-retention": dict(windows=(None, 128), num_blocks=250),
    "sliding-two-windows-retention-64": dict(
        windows=(100, None, 40, 37), num_blocks=500, long_prefill_token_threshold=64, retention=64
    ),
    "sliding-same-windows-retention-128": dict(windows=(None, 100, 100), num_blocks=400, retention=128),
    "sliding-only-default-retention": dict(windows=(128,), num_blocks=200),
    "gdn-default-retention-async": dict(
        layer_types=QWEN35_LAYERS, num_blocks=400, prefix_cache_retention_interval=0, in_flight=True
    ),
    "gdn-retention-64": dict(layer_types=QWEN35_LAYERS, num_blocks=400, prefix_cache_retention_interval=64),
    "gdn-retention-128-block-32-async": dict(
        layer_types=QWEN35_LAYERS,
        num_blocks=300,
        block_size=32,
        prefix_cache_retention_interval=128,
        in_flight=True,
    ),
}


def _count_keys(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Make ``run_lockstep``'s schedulers record, after every ``schedule()``, how many pages hold
    a key (vLLM's blocks with a hash; the engine's ``num_cached``), and on vLLM's side count the
    non-null blocks ``cache_full_blocks`` keys and leaves unkeyed by its mask, per spec kind."""
    record: dict[str, Any] = {"vllm": [], "flat": [], "masked": {}}
    build = build_scheduler

    def counting_build(cls: type, setup: SchedulerSetup) -> Any:
        scheduler = build(cls, setup)
        manager = scheduler.kv_cache_manager
        flat = isinstance(manager, FlatKVCacheManager)
        side = "flat" if flat else "vllm"

        def count() -> int:
            if flat:
                return int(manager.cache.pool_stats()["num_cached"])
            return sum(b.block_hash is not None for b in manager.block_pool.blocks)

        if not flat:
            pool = manager.block_pool
            groups = scheduler.kv_cache_config.kv_cache_groups
            cache_full_blocks = pool.cache_full_blocks

            def counted(*args: Any, **kwargs: Any) -> Any:
                mask = kwargs.get("block_mask")
                if mask is not None:
                    kind = type(groups[kwargs["kv_cache_group_id"]].kv_cache_spec).__name__
                    blocks, first = kwargs["blocks"], kwargs["num_cached_blocks"]
                    for i, keyed in enumerate(mask):
                        if not blocks[first + i].is_null:
                            name = f"{kind}.{'keyed' if keyed else 'unkeyed'}"
                            record["masked"][name] = record["masked"].get(name, 0) + 1
                return cache_full_blocks(*args, **kwargs)

            pool.cache_full_blocks = counted
        schedule = scheduler.schedule

        def counted_schedule(*args: Any, **kwargs: Any) -> Any:
            output = schedule(*args, **kwargs)
            record[side].append(count())
            return output

        scheduler.schedule = counted_schedule
        return scheduler

    monkeypatch.setattr(sys.modules[__name__], "build_scheduler", counting_build, raising=True)
    return record


@pytest.mark.parametrize("case", list(SPARSE_CASES))
def test_sparse_retention_same_steps_as_vllm(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    options = dict(SPARSE_CASES[case])
    setup, in_flight = _case_setup(model_dir, options)
    _, kv_cache_config, _, _ = build_configs(setup)
    expected = options.get("retention", options.get("prefix_cache_retention_interval", 0))
    assert kv_cache_config.prefix_cache_retention_interval == expected  # EngineCore's copy
    record = _count_keys(monkeypatch)
    covered = run_lockstep(setup, 400, seed=5, in_flight=in_flight)
    assert covered["preemptions"] > 0 and covered["aborted"] > 0 and covered["hit_tokens"] > 0, covered
    assert record["flat"] == record["vllm"] and max(record["vllm"]) > 0
    kind = "MambaSpec" if setup.layer_types else "SlidingWindowSpec"
    masked = record["masked"]
    assert masked.get(f"{kind}.unkeyed", 0) > 100 and masked.get(f"{kind}.keyed", 0) > 20, masked
    if setup.layer_types:
        assert covered["boundaries"] > 100 and covered["deferred"] > 0, covered
        # A running state the mask leaves unkeyed when its table grows (synchronous or not):
        # where the engine's state group would have moved it, vLLM takes a fresh block.
        assert covered["unkeyed_crossings"] > 100, covered
    else:
        assert covered["null_hits"] > 0, covered


def test_sparse_retention_default_served(model_dir: Path) -> None:
    """vLLM's default config (retention 0, prefix caching on) of a sliding-window model and of a
    GDN hybrid builds FlatScheduler (both were refused before the masks were mapped)."""
    setup = SchedulerSetup(model_dir=model_dir, windows=(None, 128), num_blocks=400)
    assert isinstance(build_scheduler(FlatScheduler, setup).kv_cache_manager, FlatKVCacheManager)
    vllm_config, kv_cache_config, block_size = _hybrid_configs(model_dir, prefix_cache_retention_interval=0)
    assert kv_cache_config.prefix_cache_retention_interval == 0
    ours = _build_flat(vllm_config, kv_cache_config, block_size)
    assert isinstance(ours.kv_cache_manager, FlatKVCacheManager)
    vllm_config, kv_cache_config = _configs(model_dir)
    hybrid = _with_groups(kv_cache_config, kv_cache_spec(16), kv_cache_spec(16, 128))
    hybrid.prefix_cache_retention_interval = 64
    check_supported(vllm_config, hybrid, 16, None)


def test_sparse_retention_of_sliding_specs_without_full_group_refused(model_dir: Path) -> None:
    """Sliding groups of two windows and no full-attention group under sparse retention: vLLM pins
    the junction at the first sliding spec's own hit, which the adapter does not look up."""
    vllm_config, kv_cache_config = _configs(model_dir)
    hybrid = _with_groups(kv_cache_config, kv_cache_spec(16, 128), kv_cache_spec(16, 64))
    hybrid.prefix_cache_retention_interval = 0
    with pytest.raises(UnsupportedVllmConfigError, match=r"several specs without a full-attention group"):
        check_supported(vllm_config, hybrid, 16, None)
    hybrid.prefix_cache_retention_interval = None
    check_supported(vllm_config, hybrid, 16, None)


def test_sparse_retention_hits_against_dense(model_dir: Path) -> None:
    """What sparse retention changes, on vLLM's manager and ours alike (each run in lockstep): the
    same stream hits fewer tokens under retention 0 than under dense retention (only reachable
    tails stay keyed), and an interval recovers some."""
    hits = {}
    for retention in (None, 0, 64):
        setup = SchedulerSetup(
            model_dir=model_dir,
            windows=(None, 128),
            num_blocks=250,
            retention=retention,
            max_num_seqs=32,
            max_num_batched_tokens=512,
        )
        hits[retention] = run_lockstep(setup, 300, seed=5)["hit_tokens"]
    assert hits[0] < hits[64] <= hits[None], hits


# Speculative decoding (served since the specdec merge) under vLLM's default sparse retention:
# drafts and lookahead slots beside sliding groups whose blocks are keyed only where reachable.
SPARSE_SPEC_CASES: dict[str, dict[str, Any]] = {
    "ngram-sliding-default-retention": dict(
        speculative_method="ngram", windows=(None, 128, 40), num_blocks=300
    ),
    "draft-model-sliding-retention-64-async": dict(
        speculative_method="draft_model", windows=(None, 100), retention=64, num_blocks=300, in_flight=True
    ),
}


@pytest.mark.parametrize("case", list(SPARSE_SPEC_CASES))
def test_sparse_retention_with_speculative_decoding(model_dir: Path, case: str) -> None:
    options = dict(SPARSE_SPEC_CASES[case])
    setup, in_flight = _case_setup(model_dir, options)
    covered = run_spec_lockstep(setup, 400, seed=21, in_flight=in_flight)
    assert covered["preemptions"] > 0 and covered["hit_tokens"] > 0, covered
    assert covered["drafts"] > 1000 and covered["rejected"] > 300, covered


# -- the ``mamba_checkpoints`` option (issue 36 item 3): the reuse policy in vLLM's storage -------

REUSE_CONFIG = {"flat_kvcache": {"mamba_checkpoints": "reuse"}}


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"flat_kvcache": {"mamba_checkpoints": "lru"}}, "'lru'"),
        ({"flat_kvcache": {"mamba_checkpoint": "reuse"}}, "'mamba_checkpoint'"),
        ({"flat_kvcache": {"mamba_checkpoints": "reuse", "grain": 512}}, "'grain'"),
        ({"flat_kvcache": "reuse"}, "'reuse'"),
        ({"flat_kvcache": {"arena_page_size": 0}}, "arena_page_size = 0"),
        ({"flat_kvcache": {"arena_page_size": True}}, "arena_page_size = True"),
        ({"flat_kvcache": {"arena_page_size": "32"}}, "arena_page_size = '32'"),
        # The arena's ids index the views ArenaCPUWorker binds: with vLLM's own worker, refused.
        ({"flat_kvcache": {"arena_page_size": 32}}, "worker_cls='auto'"),
    ],
)
def test_mamba_checkpoints_bad_option_refused(model_dir: Path, extra: dict[str, Any], named: str) -> None:
    """A key or value under additional_config["flat_kvcache"] the adapter does not know is refused
    at construction, named, on the path vLLM's engine takes (the scheduler's keyword arguments)."""
    setup = SchedulerSetup(
        model_dir=model_dir, layer_types=QWEN35_LAYERS, num_blocks=128, additional_config=extra
    )
    with pytest.raises(UnsupportedVllmConfigError, match=named):
        build_scheduler(FlatScheduler, setup)


def test_mamba_checkpoints_reuse_beside_sliding_refused(model_dir: Path) -> None:
    """The option decides mamba states' keys only: beside sliding-window groups it is refused
    (naming the group), not silently half applied."""
    setup = SchedulerSetup(
        model_dir=model_dir, windows=(None, 128), num_blocks=400, additional_config=REUSE_CONFIG
    )
    with pytest.raises(UnsupportedVllmConfigError, match=r"SlidingWindowSpec.*mamba_checkpoints 'reuse'"):
        build_scheduler(FlatScheduler, setup)


def test_mamba_checkpoints_read_from_additional_config(model_dir: Path) -> None:
    """FlatScheduler reads the option from ``vllm_config.additional_config`` (what ``LLM(...,
    additional_config=...)`` and ``--additional-config`` set), leaving other plugins' entries
    alone; absent or "vllm" it is off. A model without mamba groups accepts it and is unchanged."""
    other = {"some_plugin": {"x": 1}}
    for extra, value, on in [
        (None, "vllm", False),
        ({**other, "flat_kvcache": {"mamba_checkpoints": "vllm"}}, "vllm", False),
        ({**other, **REUSE_CONFIG}, "reuse", True),
    ]:
        setup = SchedulerSetup(
            model_dir=model_dir, layer_types=QWEN35_LAYERS, num_blocks=128, additional_config=extra
        )
        manager = build_scheduler(FlatScheduler, setup).kv_cache_manager
        assert (manager.mamba_checkpoints, manager._reuse) == (value, on)
    setup = SchedulerSetup(model_dir=model_dir, num_blocks=128, additional_config=REUSE_CONFIG)
    manager = build_scheduler(FlatScheduler, setup).kv_cache_manager
    assert manager.mamba_checkpoints == "reuse" and not manager._reuse


def test_mamba_checkpoints_vllm_explicit_same_steps(model_dir: Path) -> None:
    """The option spelled out as its default ("vllm") is vLLM's manager, step by step (GDN hybrid,
    vLLM's default retention, async timing): the differential with the option present."""
    setup = SchedulerSetup(
        model_dir=model_dir,
        layer_types=QWEN35_LAYERS,
        num_blocks=400,
        max_num_seqs=32,
        max_num_batched_tokens=512,
        prefix_cache_retention_interval=0,
        additional_config={"flat_kvcache": {"mamba_checkpoints": "vllm"}},
    )
    covered = run_lockstep(setup, 200, seed=5, in_flight=True)
    assert covered["preemptions"] > 0 and covered["hit_tokens"] > 0, covered


_TURN_BLOCK = 128  # tokens per content block of the conversation scenario below


def _conversation_stream(num_conversations: int, seed: int) -> tuple[list[StreamRequest], dict[str, int]]:
    """Conversations of three turns, served one request at a time (each arrives after the previous
    one finished): every prompt is a shared 128-token system block, then whole 128-token blocks,
    then a partial block of 17 to 127 tokens; a turn's next one keeps all its whole blocks (not
    the partial one) and adds 1 to 4 new ones and a new partial block. All first turns come
    first, then all second turns, then all third turns. Returns the stream and, per request,
    the whole-block tokens its next turn shares (its body's end on a 128-token grain)."""
    import random as _random

    rng = _random.Random(seed)

    def blocks(count: int) -> list[int]:
        return [rng.randrange(32000) for _ in range(count * _TURN_BLOCK)]

    system = blocks(1)
    bodies = [system + blocks(rng.randint(1, 4)) for _ in range(num_conversations)]
    stream: list[StreamRequest] = []
    shared: dict[str, int] = {}
    step = 0
    for turn in range(3):
        for c in range(num_conversations):
            if turn:
                bodies[c] = bodies[c] + blocks(rng.randint(1, 4))
            partial = [rng.randrange(32000) for _ in range(rng.randint(17, 127))]
            rid = f"c{c}t{turn}"
            stream.append(StreamRequest(rid, step, tuple(bodies[c] + partial), rng.randint(20, 60)))
            shared[rid] = len(bodies[c])
            step += 120  # one request at a time: at most 3 prefill chunks and 60 decode steps
    return stream, shared


def _first_hits(scheduler: Any, stream: list[StreamRequest], setup: SchedulerSetup) -> dict[str, int]:
    hits: dict[str, int] = {}
    for output in run_steps(scheduler, stream, block_size=setup.block_size):
        assert len(scheduler.requests) <= 1  # one request at a time, as the scenario says
        for new in output.scheduled_new_reqs:
            hits.setdefault(new.req_id, new.num_computed_tokens)
    return hits


def test_mamba_checkpoints_reuse_places_and_keeps(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The reuse policy in vLLM's storage, against vLLM's own manager on the same conversations
    (roomy pool, nothing evicted, vLLM's default retention 0 for both):

    - the sharing grain is learned from divergence points: the first turns' full-attention hits
      stop at the shared system block (128 tokens, a multiple of 128 and of no larger power-of-two
      grain), so after 16 of them S = 128 (``ReuseEvidence``);
    - placement: every later turn's state is cached at its body's end on S (the last multiple of
      128 before its last token, where FlatScheduler's boundary makes vLLM's scheduler end a
      chunk), so the next turn hits all it shares with its previous turn;
    - vLLM's rule keys the replay boundary (the prompt's last block, beyond what a next turn
      shares: each partial block is at least 17 tokens) and the shared-prefix junction, so its
      second turns hit the system block (the first turns' junction) and its third turns the first
      turn's whole blocks (the second turns' junction): one turn behind;
    - decode states: one per request, keyed at the last block boundary it reaches, for every
      request (SPEC 13.8 drops no checkpoint on a guess of whether a prompt will come for it;
      vLLM's eviction order decides)."""
    stream, shared = _conversation_stream(20, seed=3)
    stock_setup = SchedulerSetup(
        model_dir=model_dir,
        layer_types=QWEN35_LAYERS,
        num_blocks=3000,
        max_num_seqs=8,
        max_num_batched_tokens=512,
        prefix_cache_retention_interval=0,
        max_model_len=2048,
    )
    stock = _first_hits(build_scheduler(AsyncScheduler, stock_setup), stream, stock_setup)
    setup = dataclasses.replace(stock_setup, additional_config=REUSE_CONFIG)
    scheduler = build_scheduler(FlatScheduler, setup)
    manager = scheduler.kv_cache_manager
    keyed: list[tuple[str, int]] = []
    key_state = manager._key_state

    def recording(request_id: str, tables: Any, hashes: Any, slot: int) -> None:
        keyed.append((request_id, (slot + 1) * setup.block_size))
        key_state(request_id, tables, hashes, slot)

    monkeypatch.setattr(manager, "_key_state", recording)
    reuse = _first_hits(scheduler, stream, setup)

    assert manager._evidence.sharing_grain(setup.block_size) == _TURN_BLOCK
    by_id = {r.request_id: r for r in stream}
    position = {r.request_id: i for i, r in enumerate(stream)}
    for rid in by_id:
        c, turn = rid[1:].split("t")
        if turn == "0":
            continue
        previous = f"c{c}t{int(turn) - 1}"
        # vLLM: the previous turn's junction (the system block for second turns).
        expected_stock = _TURN_BLOCK if turn == "1" else shared[f"c{c}t0"]
        assert stock[rid] == expected_stock, rid
        # Every request but the very first observes one divergence point when admitted, so the
        # request at stream position i is placed on S = 128 once i >= MIN_OBSERVATIONS (16);
        # before that S is the block size, and the body's end is vLLM's replay boundary.
        if position[previous] >= 16:
            assert reuse[rid] == shared[previous], rid  # the previous turn's body end on S
        else:
            assert reuse[rid] == expected_stock, rid
    assert sum(reuse.values()) > 1.3 * sum(stock.values())

    # What was keyed: placed prompt points (below the prompt's end) or decode states.
    decode = [(rid, end) for rid, end in keyed if end >= len(by_id[rid].prompt)]
    for rid, end in decode:
        request = by_id[rid]
        assert end == (len(request.prompt) + request.max_tokens - 1) // setup.block_size * setup.block_size
    # Every request runs to max_tokens here: each keys its one decode state.
    assert sorted(rid for rid, _ in decode) == sorted(by_id)
    prompt_keys = [(rid, end) for rid, end in keyed if end < len(by_id[rid].prompt)]
    for rid, end in prompt_keys:
        assert end % setup.block_size == 0 and end <= len(by_id[rid].prompt) - 1
    # vLLM's dense retention keys every chunk end and decode block: far more states.
    assert len(keyed) < 3 * len(stream)


def test_mamba_checkpoints_reuse_runs_tight_pools(model_dir: Path) -> None:
    """The option on a tight pool under vLLM's timing variants (synchronous and async, dense and
    sparse retention settings, KV events on): preemptions, hits, aborts, and no adapter error
    (no running state that could move, no store of a slot the policy left unkeyed)."""
    for retention, in_flight in [(0, True), (None, False)]:
        setup = SchedulerSetup(
            model_dir=model_dir,
            layer_types=QWEN35_LAYERS,
            num_blocks=400,
            max_num_seqs=32,
            max_num_batched_tokens=512,
            prefix_cache_retention_interval=retention,
            additional_config=REUSE_CONFIG,
        )
        scheduler = _build_with_events(FlatScheduler, setup)
        assert scheduler.kv_cache_manager._reuse
        stream = make_stream(300, seed=9)
        preempted = hits = 0
        for output in run_steps(scheduler, stream, block_size=setup.block_size, in_flight=in_flight):
            preempted += len(output.preempted_req_ids or ())
            hits += sum(new.num_computed_tokens for new in output.scheduled_new_reqs)
            scheduler.kv_cache_manager.take_events()
        assert preempted > 0 and hits > 0, (preempted, hits)
        assert scheduler.kv_cache_manager.cache.num_free_pages == setup.num_blocks - 1


# -- the arena's CUDA worker (issue 37 item 5), checked on vLLM 0.33's CUDA build without a GPU ---


def test_arena_gpu_runner_takes_the_mixin_methods() -> None:
    """``ArenaGPUModelRunner`` resolves the arena's methods from the mixin the CPU runner takes
    them from, and vLLM's ``GPUModelRunner`` has methods of those names with the same parameters
    (a vLLM upgrade that renames one, or moves it off the runner, fails here); the zeroing table
    the GPU runner rebuilds is vLLM's ``KVBlockZeroer``, called with parameters it has."""
    import inspect

    from flat_kvcache.vllm._arena_runner import ArenaRunnerMixin
    from flat_kvcache.vllm.arena_gpu import ArenaGPUModelRunner, ArenaGPUWorker
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner  # type: ignore[import-not-found,unused-ignore]
    from vllm.v1.worker.gpu_worker import Worker  # type: ignore[import-not-found,unused-ignore]
    from vllm.v1.worker.utils import KVBlockZeroer  # type: ignore[import-not-found,unused-ignore]

    assert ArenaGPUModelRunner.__mro__[1:3] == (ArenaRunnerMixin, GPUModelRunner)
    assert ArenaGPUWorker.__mro__[1] is Worker
    for name in ("initialize_kv_cache", "initialize_kv_cache_tensors"):
        assert getattr(ArenaGPUModelRunner, name) is getattr(ArenaRunnerMixin, name), name
        assert name in vars(GPUModelRunner), name
        theirs = list(inspect.signature(getattr(GPUModelRunner, name)).parameters)
        ours = list(inspect.signature(getattr(ArenaRunnerMixin, name)).parameters)
        assert ours == theirs, (name, ours, theirs)
    assert "_init_kv_zero_meta" in vars(GPUModelRunner)
    assert list(inspect.signature(GPUModelRunner._init_kv_zero_meta).parameters) == ["self"]
    zeroer = set(inspect.signature(KVBlockZeroer).parameters)
    assert {
        "device",
        "attn_groups_iter",
        "kernel_block_sizes",
        "static_forward_context",
        "num_blocks",
        "runner_only_attn_layers",
    } <= zeroer
    assert "init_device" in vars(Worker) and "_make_model_runner" in vars(Worker)


def test_arena_views_are_what_flash_attention_reads(model_dir: Path) -> None:
    """On a CPU tensor, the views the GPU runner binds (the mixin's, vLLM's ids) have the shape
    and strides of vLLM 0.33's own ``allocate_kv_cache`` views of the same Qwen3.5 config for each
    layout whose page interior is one run (the others are refused, naming the layout), and split
    into FlashAttention's key and value caches (``[blocks, tokens, heads, head_size]``, the last
    dimension contiguous) as its forward splits them. The arena's 32-token page is a kernel block
    FlashAttention takes unsplit."""
    from flat_kvcache.vllm._arena_runner import arena_layer_views, layout_for_vllm_ids
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend  # type: ignore[import-not-found,unused-ignore]
    from vllm.v1.kv_cache_interface import FullAttentionSpec  # type: ignore[import-not-found,unused-ignore]
    from vllm.v1.kv_cache_layout import KVCacheLayout  # type: ignore[import-not-found,unused-ignore]
    from vllm.v1.worker.utils import (  # type: ignore[import-not-found,unused-ignore]
        allocate_kv_cache,
        select_common_block_size,
    )

    setup = SchedulerSetup(model_dir=model_dir, layer_types=QWEN35_LAYERS, num_blocks=128)
    _, kv_cache_config, _, _ = build_configs(setup)
    attention = [
        (name, group.kv_cache_spec)
        for group in kv_cache_config.kv_cache_groups
        if isinstance(group.kv_cache_spec, FullAttentionSpec)
        for name in group.layer_names
    ]
    assert attention
    arena = layout_for_vllm_ids(kv_cache_config)
    served = []
    for layout in KVCacheLayout:
        buffer = torch.zeros(arena.total_bytes, dtype=torch.int8)
        if set(layout.stride_order[-3:]) != {2, 3, 4}:
            with pytest.raises(UnsupportedVllmConfigError, match=layout.name):
                arena_layer_views(buffer, arena, kv_cache_config, layout)
            continue
        ours = arena_layer_views(buffer, arena, kv_cache_config, layout)
        theirs = allocate_kv_cache(kv_cache_config, torch.device("cpu"), layout)
        for name, spec in attention:
            assert ours[name].shape == theirs[name].shape, (layout.name, name)
            assert ours[name].dtype == theirs[name].dtype
            # Within a block the strides are vLLM's; from block to block, one arena unit.
            assert ours[name].stride()[1:] == theirs[name].stride()[1:], (layout.name, name)
            assert ours[name].stride(0) * ours[name].element_size() == arena.unit_bytes
            key, value = torch.split(ours[name].transpose(1, 2), spec.head_size, dim=-1)
            blocks = arena.num_units
            assert key.shape == value.shape == (blocks, spec.block_size, spec.num_kv_heads, spec.head_size)
            assert key.stride(-1) == value.stride(-1) == 1
        served.append(layout.name)
    assert "LBNHC" in served and "LBHNC" in served
    spec = attention[0][1]
    assert (
        select_common_block_size(32, [FlashAttentionBackend], [dataclasses.replace(spec, block_size=32)])
        == 32
    )


def test_arena_gpu_zeroing_table_indexes_pages(model_dir: Path) -> None:
    """The CUDA build zeroes new attention ids with ``KVBlockZeroer``, built from the config's
    ``num_blocks``: on the arena's own ids (``arena_page_size``; with ``ArenaGPUWorker``, which
    the scheduler-side plan accepts on vLLM 0.33) an attention id is a page, several a unit, so
    vLLM's table would zero ``pages_per_unit`` pages from ``id * pages_per_unit``.
    ``ArenaGPUModelRunner._init_kv_zero_meta`` (run here on a stand-in runner holding the arena's
    views of a CPU buffer) builds it one page per id: every segment steps one page stride and
    spans the layer's page, so the bytes zeroed for page ``p`` are exactly row ``p`` of the view."""
    import types

    from flat_kvcache.vllm._arena import ARENA_GPU_WORKER, plan_vllm_arena
    from flat_kvcache.vllm._arena_runner import paged_arena_views
    from flat_kvcache.vllm.arena_gpu import ArenaGPUModelRunner
    from vllm.v1.kv_cache_layout import KVCacheLayout  # type: ignore[import-not-found,unused-ignore]
    from vllm.v1.worker.utils import KVBlockZeroer  # type: ignore[import-not-found,unused-ignore]

    setup = SchedulerSetup(
        model_dir=model_dir,
        layer_types=QWEN35_LAYERS,
        num_blocks=128,
        max_num_seqs=16,
        enable_prefix_caching=False,
        additional_config={"flat_kvcache": {"arena_page_size": 2}},
    )
    vllm_config, kv_cache_config, _, _ = build_configs(setup)
    vllm_config.parallel_config.worker_cls = ARENA_GPU_WORKER
    vllm_config.scheduler_config.async_scheduling = False
    # 2-token pages, so the harness's tiny model (small GDN states) has several in a unit; the
    # zeroing table's arithmetic does not depend on the page size.
    arena = plan_vllm_arena(vllm_config, kv_cache_config, 2)
    assert arena.pages_per_unit > 1
    buffer = torch.zeros(arena.total_bytes, dtype=torch.int8)
    views = paged_arena_views(buffer, arena, KVCacheLayout.LBNHC)
    config = arena.kv_cache_config
    groups = [
        types.SimpleNamespace(
            kv_cache_spec=group.kv_cache_spec,
            kv_cache_group_id=g,
            layer_names=group.layer_names,
            kernel_block_stride=0,
        )
        for g, group in enumerate(config.kv_cache_groups)
    ]
    pages = [g for g, (kind, _) in enumerate(arena.group_roles) if kind == "pages"]
    assert len(pages) == 1
    forward = {name: types.SimpleNamespace(kv_cache=view) for name, view in views.items()}
    runner: Any = types.SimpleNamespace(
        _flat_paged=arena,
        device=torch.device("cpu"),
        _kv_cache_spec_attn_group_iterator=lambda: iter(groups),
        _kernel_block_sizes=[group.kv_cache_spec.block_size for group in config.kv_cache_groups],
        compilation_config=types.SimpleNamespace(static_forward_context=forward),
        runner_only_attn_layers=set(),
    )
    ArenaGPUModelRunner._init_kv_zero_meta(runner)
    addrs, strides, sizes, *_ = runner._kv_block_zeroer._meta
    attention_layers = config.kv_cache_groups[pages[0]].layer_names
    assert len(addrs) == len(attention_layers)
    base = buffer.data_ptr()
    for name, addr, stride, size in zip(
        attention_layers, addrs.tolist(), strides.tolist(), sizes.tolist(), strict=True
    ):
        view = views[name]
        last = view.shape[0] - 1
        assert addr == view.data_ptr() and stride * 4 == arena.page_stride
        assert size * 4 == view[0].numel() * view.element_size()
        # The bytes zeroed for the last page are its row, inside the buffer.
        assert addr + last * stride * 4 == view[last].data_ptr()
        assert view[last].data_ptr() + size * 4 <= base + arena.total_bytes
    # vLLM's own table (num_blocks from the config: the units) steps several pages per id.
    stock = KVBlockZeroer(
        runner.device,
        attn_groups_iter=iter(groups),
        kernel_block_sizes=runner._kernel_block_sizes,
        static_forward_context=forward,
        num_blocks=config.num_blocks,
    )
    assert set(stock._meta[1].tolist()) == {arena.page_stride * arena.pages_per_unit // 4}


@pytest.mark.parametrize("as_class", [False, True], ids=["name", "class"])
def test_arena_runner_refuses_a_scheduler_that_is_not_flat(model_dir: Path, as_class: bool) -> None:
    """With ``arena_page_size`` the runner's views are indexed by the arena's own ids, which only
    FlatScheduler's manager hands out: the mixin's ``initialize_kv_cache`` refuses vLLM's own
    scheduler before planning anything, naming it, whether vLLM's config holds it as its dotted
    name or as the class."""
    import types

    from flat_kvcache.vllm._arena_runner import ArenaRunnerMixin

    setup = SchedulerSetup(
        model_dir=model_dir,
        layer_types=QWEN35_LAYERS,
        num_blocks=128,
        additional_config={"flat_kvcache": {"arena_page_size": 32}},
    )
    vllm_config, kv_cache_config, _, _ = build_configs(setup)
    vllm_config.scheduler_config.scheduler_cls = (
        Scheduler if as_class else f"{Scheduler.__module__}.{Scheduler.__qualname__}"
    )
    runner: Any = types.SimpleNamespace(vllm_config=vllm_config)
    with pytest.raises(
        UnsupportedVllmConfigError, match=r"not 'vllm\.v1\.core\.sched\.scheduler\.Scheduler'"
    ):
        ArenaRunnerMixin.initialize_kv_cache(runner, kv_cache_config)
