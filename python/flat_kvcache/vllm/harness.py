"""Drive vLLM's scheduler on the CPU with no model: hand-built configs and fake model outputs.

Used by the differential tests (tests/vllm) and the scheduler benchmark
(benches/vllm_scheduler.py) to feed vLLM's scheduler, with its own KV-cache manager or with
flat-kvcache's, one request stream, and to record what each step decided. Nothing here runs a
model: a ``ModelConfig`` is read from a tiny local ``config.json`` (tokenizer skipped), and each
scheduled request that finished its prefill "samples" a token chosen from its id and position,
so two schedulers that decide the same things see the same tokens.
"""

from __future__ import annotations

import json
import random
import zlib
from collections.abc import Generator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from vllm.config import (  # type: ignore[import-not-found]
    CacheConfig,
    DeviceConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.sampling_params import SamplingParams  # type: ignore[import-not-found]
from vllm.utils.hashing import sha256  # type: ignore[import-not-found]
from vllm.v1.attention.backends.utils import resolve_kv_cache_layout  # type: ignore[import-not-found]
from vllm.v1.core.kv_cache_planning import (  # type: ignore[import-not-found]
    get_global_kv_cache_groups,
    get_kv_cache_configs,
)
from vllm.v1.core.kv_cache_utils import (  # type: ignore[import-not-found]
    generate_scheduler_kv_cache_config,
    get_request_block_hasher,
    init_none_hash,
    resolve_cache_hit_alignment_tokens,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.core.single_type_kv_cache_manager import (  # type: ignore[import-not-found]
    register_all_kvcache_specs,
)
from vllm.v1.kv_cache_interface import (  # type: ignore[import-not-found]
    FullAttentionSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import ModelRunnerOutput  # type: ignore[import-not-found]
from vllm.v1.request import Request, RequestStatus  # type: ignore[import-not-found]
from vllm.v1.structured_output import StructuredOutputManager  # type: ignore[import-not-found]

VOCAB = 32000


def tiny_model_dir(folder: Path) -> Path:
    """Write a small Llama ``config.json`` into ``folder`` (no weights, no tokenizer) and return it."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "vocab_size": VOCAB,
        "max_position_embeddings": 32768,
        "torch_dtype": "float16",
        "rms_norm_eps": 1e-5,
    }
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def hybrid_layer_types(folder: Path, model: str, num_layers: int = 8) -> tuple[str, ...]:
    """The layer pattern of a tiny ``model`` ("qwen3.5" or "qwen3-next") config, as transformers
    writes it (``save_pretrained`` into ``folder``, read back from its ``config.json``; no hub).

    vLLM's ``ModelConfig`` cannot be built over these architectures in a venv without vLLM's
    model dependencies (its registry imports the model class), so the scheduler's model config
    stays the tiny Llama and only the layer pattern (which layers are GDN) comes from here."""
    from transformers import Qwen3_5TextConfig, Qwen3NextConfig

    configs = {"qwen3.5": Qwen3_5TextConfig, "qwen3-next": Qwen3NextConfig}
    if model not in configs:
        raise ValueError(f"model must be one of {sorted(configs)}, got {model!r}")
    configs[model](num_hidden_layers=num_layers).save_pretrained(folder)
    return tuple(json.loads((folder / "config.json").read_text())["layer_types"])


@dataclass(frozen=True)
class SchedulerSetup:
    """One scheduler configuration: pool, budgets, the model's attention layers.

    The layers are ``num_groups`` full-attention layers, or, when ``windows`` is given, one
    layer per entry: ``None`` full attention, an int a sliding window of that many tokens
    (Gemma-2/3 and GPT-OSS interleave the two). vLLM groups them as its engine does
    (:func:`build_scheduler`): layers of one kind share a group, and a hybrid gets one group
    per layer of its repeating pattern. ``retention`` is the cache config's
    ``prefix_cache_retention_interval`` (vLLM's default, 0, when ``"default"``)."""

    model_dir: Path
    num_blocks: int = 2048
    block_size: int = 16
    num_groups: int = 1
    windows: tuple[int | None, ...] = ()
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    max_model_len: int = 1536  # above every stream request (make_stream: at most about 1,320 tokens)
    enable_prefix_caching: bool = True
    long_prefill_token_threshold: int = 0
    watermark: float = 0.0
    policy: str = "fcfs"
    log_stats: bool = True
    retention: int | str | None = "default"
    # A GDN / mamba hybrid (Qwen3.5, Qwen3-Next shapes): one entry per layer, "full_attention" or
    # "linear_attention" (a mamba layer: ``mamba_type`` "gdn" or "mamba2"); the KV cache config is
    # then built by vLLM's own config steps (:func:`hybrid_kv_cache_config`), not by hand.
    layer_types: tuple[str, ...] = ()
    mamba_type: str = "gdn"
    # None: vLLM's default for the prefix-caching setting ("align" with it, "none" without).
    mamba_cache_mode: str | None = None
    # CacheConfig.prefix_cache_retention_interval for hybrids (vLLM's default is 0).
    prefix_cache_retention_interval: int | None = None
    # Speculative decoding (:func:`speculative_config`): None, "ngram" (drafts scheduled with
    # each decode, no lookahead slots) or "draft_model" (``num_speculative_tokens`` lookahead
    # slots too), with this many draft tokens per step.
    speculative_method: str | None = None
    num_speculative_tokens: int = 3
    # ``VllmConfig.additional_config`` (where FlatScheduler reads its options, e.g.
    # ``{"flat_kvcache": {"mamba_checkpoints": "reuse"}}``); None: vLLM's default, empty.
    additional_config: dict[str, Any] | None = None


def kv_cache_spec(block_size: int, window: int | None = None) -> Any:
    """A small fp16 attention spec: full attention, or a sliding window of ``window`` tokens."""
    if window is None:
        return FullAttentionSpec(block_size=block_size, num_kv_heads=2, head_size=16, dtype=torch.float16)
    return SlidingWindowSpec(
        block_size=block_size, num_kv_heads=2, head_size=16, dtype=torch.float16, sliding_window=window
    )


def hybrid_kv_cache_config(vllm_config: Any, setup: SchedulerSetup) -> tuple[Any, int, int]:
    """The scheduler's ``KVCacheConfig`` of a GDN / mamba hybrid, and its (block size, hash block
    size), built by the steps vLLM's ``EngineCore`` takes, minus the model itself.

    ``HybridAttentionMambaModelConfig.verify_and_update_config`` (what ``VllmConfig`` runs for a
    hybrid architecture) picks the mamba cache mode and block size; the per-layer specs are what
    the model's layers return (``MambaBase.get_kv_cache_spec``, with the state shapes and dtypes
    of vLLM's own calculators; mamba2 layers add one prefill checkpoint page, as
    ``MambaMixer2`` does; GDN layers add it only with FlashInfer prefill, a GPU backend); the
    mamba page is padded to the attention page as the platform's ``_align_hybrid_block_size``
    does (the state shapes are small enough that it keeps the block size); then vLLM's own
    ``resolve_kv_cache_layout``, ``get_global_kv_cache_groups``, ``get_kv_cache_configs``,
    ``generate_scheduler_kv_cache_config`` and ``resolve_kv_cache_block_sizes``, as in
    ``EngineCore``. The pool gets ``setup.num_blocks`` blocks (vLLM's would come from profiling)."""
    from dataclasses import replace

    from vllm.model_executor.layers.mamba.mamba_utils import (  # type: ignore[import-not-found]
        MambaStateDtypeCalculator,
        MambaStateShapeCalculator,
    )
    from vllm.model_executor.models.config import (  # type: ignore[import-not-found]
        HybridAttentionMambaModelConfig,
    )
    from vllm.v1.attention.backends.registry import (  # type: ignore[import-not-found]
        MambaAttentionBackendEnum,
    )
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout  # type: ignore[import-not-found,unused-ignore]
    from vllm.v1.core.kv_cache_planning import (  # type: ignore[import-not-found,unused-ignore]
        get_global_kv_cache_groups,
        get_kv_cache_configs,
    )

    cache = vllm_config.cache_config
    if setup.mamba_cache_mode is not None:
        cache.mamba_cache_mode = setup.mamba_cache_mode
    # The CPU and GPU platforms support vLLM's hybrid KV cache manager; the platform of this
    # test venv (no device) reports it unsupported, and VllmConfig switched it off.
    vllm_config.scheduler_config.disable_hybrid_kv_cache_manager = False
    HybridAttentionMambaModelConfig.verify_and_update_config(vllm_config)
    attention = kv_cache_spec(setup.block_size)
    if setup.mamba_type == "gdn":
        shapes = MambaStateShapeCalculator.gated_delta_net_state_shape(1, 1, 1, 8, 8, 4)
        dtypes = MambaStateDtypeCalculator.gated_delta_net_state_dtype(
            vllm_config.model_config.dtype, cache.mamba_cache_dtype, cache.mamba_ssm_cache_dtype
        )
        backend, checkpoints = MambaAttentionBackendEnum.GDN_ATTN, {}
    elif setup.mamba_type == "mamba2":
        shapes = MambaStateShapeCalculator.mamba2_state_shape(1, 16, 1, 1, 8, 4, 4)
        dtypes = MambaStateDtypeCalculator.mamba2_state_dtype(
            vllm_config.model_config.dtype, cache.mamba_cache_dtype, cache.mamba_ssm_cache_dtype
        )
        backend = MambaAttentionBackendEnum.MAMBA2
        checkpoints = {"num_prefill_checkpoint_blocks": 1, "prefill_checkpoint_alignment": 1}
    else:
        raise ValueError(f"mamba_type must be 'gdn' or 'mamba2', got {setup.mamba_type!r}")
    mamba = MambaSpec(
        shapes=tuple(shapes),
        dtypes=tuple(dtypes),
        block_size=cache.mamba_block_size,
        page_size_padded=attention.page_size_bytes,
        mamba_type=backend,
        mamba_cache_mode=cache.mamba_cache_mode,
    )
    if mamba.state_content_size_bytes > attention.page_size_bytes:
        raise ValueError(
            "the mamba state outgrows the attention page: the platform would raise the block size"
        )
    if checkpoints and cache.mamba_cache_mode == "align":
        mamba = replace(mamba, **checkpoints)
    specs = {
        (
            f"model.layers.{i}.self_attn.attn"
            if kind == "full_attention"
            else f"model.layers.{i}.linear_attn"
        ): (attention if kind == "full_attention" else mamba)
        for i, kind in enumerate(setup.layer_types)
    }
    resolve_kv_cache_layout(vllm_config, [["NHD"]], specs.values())
    groups = get_global_kv_cache_groups(vllm_config, [specs])
    configs = get_kv_cache_configs(vllm_config, [specs], [1 << 32], groups)
    kv_cache_config = generate_scheduler_kv_cache_config(configs)
    kv_cache_config.num_blocks = setup.num_blocks
    cache.num_gpu_blocks = setup.num_blocks
    participating = [
        g.kv_cache_spec.block_size
        for g in kv_cache_config.kv_cache_groups
        if g.kv_cache_spec.prefix_cacheable
    ]
    cache.block_size = min(
        participating or [g.kv_cache_spec.block_size for g in kv_cache_config.kv_cache_groups]
    )
    block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    kv_cache_config.hash_block_size = hash_block_size
    return kv_cache_config, block_size, hash_block_size


def speculative_config(setup: SchedulerSetup, model: Any) -> Any:
    """vLLM's ``SpeculativeConfig`` for ``setup.speculative_method`` (None without one): ngram
    prompt lookup (what ``LLM(speculative_config={"method": "ngram", ...})`` builds), or a draft
    model, here the target's own tiny config (its ``num_lookahead_tokens`` is
    ``num_speculative_tokens``; no weights are read: nothing runs a model)."""
    if setup.speculative_method is None:
        return None
    from vllm.config import SpeculativeConfig

    options: dict[str, Any] = {"num_speculative_tokens": setup.num_speculative_tokens}
    if setup.speculative_method == "ngram":
        options.update(method="ngram", prompt_lookup_max=4, prompt_lookup_min=2)
    elif setup.speculative_method == "draft_model":
        options.update(method="draft_model", model=str(setup.model_dir))
    else:
        raise ValueError(
            f"speculative_method must be 'ngram' or 'draft_model', got {setup.speculative_method!r}"
        )
    return SpeculativeConfig(target_model_config=model, target_parallel_config=ParallelConfig(), **options)


def build_configs(setup: SchedulerSetup) -> tuple[Any, Any, int, int]:
    """The ``VllmConfig``, the scheduler's ``KVCacheConfig`` and its block and hash block sizes,
    built by the steps vLLM's ``EngineCore`` takes (``_initialize_kv_caches`` and the scheduler's
    construction in vLLM 0.33): the model's per-layer specs grouped by vLLM, the pool sized by
    ``num_gpu_blocks_override``, the cache config's retention copied into the KV-cache config."""
    model = ModelConfig(
        model=str(setup.model_dir),
        skip_tokenizer_init=True,
        max_model_len=setup.max_model_len,
        dtype="float16",
        seed=0,
    )
    scheduler = SchedulerConfig(
        max_num_seqs=setup.max_num_seqs,
        max_num_batched_tokens=setup.max_num_batched_tokens,
        max_model_len=setup.max_model_len,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
        long_prefill_token_threshold=setup.long_prefill_token_threshold,
        watermark=setup.watermark,
        policy=setup.policy,
    )
    if setup.layer_types:  # a hybrid: its own field (None by default)
        retention: dict[str, Any] = {"prefix_cache_retention_interval": setup.prefix_cache_retention_interval}
    elif setup.retention == "default":
        retention = {}
    else:
        retention = {"prefix_cache_retention_interval": setup.retention}
    cache = CacheConfig(
        block_size=setup.block_size,
        gpu_memory_utilization=0.9,
        cache_dtype="auto",
        enable_prefix_caching=setup.enable_prefix_caching,
        num_gpu_blocks_override=setup.num_blocks,
        **retention,
    )
    vllm_config = VllmConfig(
        model_config=model,
        scheduler_config=scheduler,
        cache_config=cache,
        device_config=DeviceConfig("cpu"),
        speculative_config=speculative_config(setup, model),
        **({"additional_config": setup.additional_config} if setup.additional_config is not None else {}),
    )
    if setup.layer_types:
        # A GDN / mamba hybrid: vLLM's hybrid config steps (hybrid_kv_cache_config).
        kv_cache_config, block_size, hash_block_size = hybrid_kv_cache_config(vllm_config, setup)
        return vllm_config, kv_cache_config, block_size, hash_block_size
    # vLLM here sees no CUDA or CPU build (its UnspecifiedPlatform), which turns the hybrid KV
    # cache manager off and would merge sliding layers into full attention; vLLM's CUDA and CPU
    # platforms keep it on, as a real engine does.
    vllm_config.scheduler_config.disable_hybrid_kv_cache_manager = False
    register_all_kvcache_specs(vllm_config)
    layer_specs = {
        f"model.layers.{i}.self_attn.attn": kv_cache_spec(setup.block_size, window)
        for i, window in enumerate(setup.windows or (None,) * setup.num_groups)
    }
    # The layout the workers would report (no tensor is allocated here; the pool's size is the
    # override), then vLLM's grouping of the model's layers.
    resolve_kv_cache_layout(vllm_config, [["NHD"]], layer_specs.values())
    global_groups = get_global_kv_cache_groups(vllm_config, [layer_specs])
    page_bytes = sum(spec.page_size_bytes for spec in layer_specs.values())
    configs = get_kv_cache_configs(vllm_config, [layer_specs], [page_bytes * setup.num_blocks], global_groups)
    kv_cache_config = generate_scheduler_kv_cache_config(configs)
    cache.num_gpu_blocks = kv_cache_config.num_blocks
    cache.block_size = min(g.kv_cache_spec.block_size for g in kv_cache_config.kv_cache_groups)
    vllm_config.validate_block_size()
    block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    kv_cache_config.hash_block_size = hash_block_size
    kv_cache_config.cache_hit_alignment_tokens = resolve_cache_hit_alignment_tokens(
        kv_cache_config, vllm_config, block_size, hash_block_size
    )
    return vllm_config, kv_cache_config, block_size, hash_block_size


def build_scheduler(cls: type, setup: SchedulerSetup) -> Any:
    """A vLLM scheduler of class ``cls`` (``AsyncScheduler`` or a subclass) built on the CPU from
    the configs :func:`build_configs` makes, as ``EngineCore`` builds it."""
    init_none_hash(sha256)
    vllm_config, kv_cache_config, block_size, hash_block_size = build_configs(setup)
    return cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=block_size,
        hash_block_size=hash_block_size,
        log_stats=setup.log_stats,
    )


@dataclass(frozen=True)
class StreamRequest:
    """One request of a stream: when it arrives, its prompt, its output length, when (if) it is aborted."""

    request_id: str
    arrival_step: int
    prompt: tuple[int, ...]
    max_tokens: int
    abort_step: int | None = None
    cache_salt: str | None = None
    priority: int = 0


def make_stream(
    num_requests: int,
    *,
    seed: int = 0,
    num_prefixes: int = 12,
    prefix_len: tuple[int, int] = (16, 600),
    suffix_len: tuple[int, int] = (1, 400),
    output_len: tuple[int, int] = (1, 160),
    arrivals_per_step: float = 2.0,
    abort_fraction: float = 0.05,
    salt_fraction: float = 0.05,
) -> list[StreamRequest]:
    """A seeded stream: shared prefixes (some a prefix of another), unique suffixes, aborts, salts."""
    rng = random.Random(seed)
    prefixes: list[list[int]] = []
    for _ in range(num_prefixes):
        if prefixes and rng.random() < 0.3:
            base = rng.choice(prefixes)
            prefixes.append(base + [rng.randrange(VOCAB) for _ in range(rng.randint(*prefix_len) // 2)])
        else:
            prefixes.append([rng.randrange(VOCAB) for _ in range(rng.randint(*prefix_len))])
    stream = []
    step = 0.0
    for i in range(num_requests):
        step += rng.expovariate(arrivals_per_step)
        prefix = rng.choice(prefixes) if rng.random() < 0.8 else []
        if prefix and rng.random() < 0.3:
            prefix = prefix[: rng.randint(1, len(prefix))]
        prompt = prefix + [rng.randrange(VOCAB) for _ in range(rng.randint(*suffix_len))]
        arrival = int(step)
        abort = arrival + rng.randint(0, 40) if rng.random() < abort_fraction else None
        salt = f"salt{rng.randrange(3)}" if rng.random() < salt_fraction else None
        priority = rng.randrange(4)
        stream.append(
            StreamRequest(f"r{i}", arrival, tuple(prompt), rng.randint(*output_len), abort, salt, priority)
        )
    return stream


def sampled_token(request_id: str, position: int) -> int:
    """The token a request "samples" at ``position``: the same under any scheduler."""
    return zlib.crc32(f"{request_id}:{position}".encode()) % VOCAB


@dataclass
class StepRecord:
    """What one ``schedule()`` decided, in a form two schedulers' records compare equal on."""

    scheduled: list[tuple[str, int]]
    new_requests: list[tuple[str, int, tuple[tuple[int, ...], ...]]]
    cached_requests: list[tuple[str, int, tuple[tuple[int, ...], ...] | None, bool]]
    preempted: list[str]
    finished: list[str]
    tables: dict[str, tuple[tuple[int, ...], ...]] = field(default_factory=dict)
    cached_tokens: dict[str, int] = field(default_factory=dict)
    usage: float = 0.0
    num_running: int = 0
    num_waiting: int = 0


def _ids(block_ids: Any) -> tuple[tuple[int, ...], ...] | None:
    return None if block_ids is None else tuple(tuple(group) for group in block_ids)


def record_step(scheduler: Any, output: Any, *, tables: bool) -> StepRecord:
    """The step's decisions, and (with ``tables``) every live request's block ids per group."""
    cached = output.scheduled_cached_reqs
    record = StepRecord(
        scheduled=list(output.num_scheduled_tokens.items()),
        new_requests=[
            (r.req_id, r.num_computed_tokens, _ids(r.block_ids) or ()) for r in output.scheduled_new_reqs
        ],
        cached_requests=[
            (rid, cached.num_computed_tokens[i], _ids(cached.new_block_ids[i]), rid in cached.resumed_req_ids)
            for i, rid in enumerate(cached.req_ids)
        ],
        preempted=sorted(output.preempted_req_ids or ()),
        finished=sorted(output.finished_req_ids),
        usage=scheduler.kv_cache_manager.usage,
        num_running=len(scheduler.running),
        num_waiting=len(scheduler.waiting) + len(getattr(scheduler, "skipped_waiting", ())),
    )
    if tables:
        manager = scheduler.kv_cache_manager
        requests = scheduler.requests
        record.tables = {rid: _ids(manager.get_block_ids(rid)) or () for rid in sorted(requests)}
        record.cached_tokens = {
            rid: manager.estimate_cached_tokens(requests[rid]) for rid in sorted(requests)
        }
    return record


def num_accepted_drafts(request_id: str, position: int, num_drafts: int) -> int:
    """How many of ``num_drafts`` scheduled draft tokens the fake model accepts at ``position``:
    pseudo-random in ``[0, num_drafts]``, the same under any scheduler."""
    return zlib.crc32(f"{request_id}:{position}:accept".encode()) % (num_drafts + 1)


def proposed_drafts(request_id: str, position: int, num_speculative_tokens: int) -> list[int]:
    """The draft tokens the fake drafter proposes after ``position``: pseudo-random in number
    (0 to ``num_speculative_tokens``, as an n-gram lookup that may find no match), the same under
    any scheduler."""
    count = zlib.crc32(f"{request_id}:{position}:drafts".encode()) % (num_speculative_tokens + 1)
    return [sampled_token(request_id, position + 1 + i) for i in range(count)]


def fake_model_output(scheduler: Any, output: Any) -> Any:
    """A ``ModelRunnerOutput`` sampling one token for every request past its prefill, plus the
    accepted ones of its scheduled draft tokens (:func:`num_accepted_drafts`): the rejected rest
    roll its ``num_computed_tokens`` back in ``update_from_output``."""
    req_ids = list(output.num_scheduled_tokens)
    spec = output.scheduled_spec_decode_tokens
    sampled: list[list[int]] = []
    for rid in req_ids:
        request = scheduler.requests[rid]
        if request.is_prefill_chunk:
            sampled.append([])
        else:
            position = request.num_output_tokens
            accepted = num_accepted_drafts(rid, position, len(spec.get(rid, ())))
            sampled.append([sampled_token(rid, position + i) for i in range(1 + accepted)])
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
        sampled_token_ids=sampled,
    )


def new_request(item: StreamRequest, block_size: int) -> Any:
    """A fresh vLLM ``Request`` for ``item`` (each scheduler needs its own)."""
    return Request(
        request_id=item.request_id,
        prompt_token_ids=list(item.prompt),
        sampling_params=SamplingParams(max_tokens=item.max_tokens, ignore_eos=True),
        pooling_params=None,
        cache_salt=item.cache_salt,
        priority=item.priority,
        block_hasher=get_request_block_hasher(block_size, sha256),
    )


def run_steps(
    scheduler: Any,
    stream: list[StreamRequest],
    *,
    block_size: int,
    max_steps: int = 1_000_000,
    in_flight: bool = False,
) -> Generator[Any, None, None]:
    """Run ``stream`` through ``scheduler`` to the end, yielding each step's ``SchedulerOutput``
    after ``schedule()`` and before ``update_from_output`` (so two schedulers can run in lockstep).
    Requests arrive and are aborted at the steps the stream says.

    With ``in_flight`` a step's output is handed back only after the next step is scheduled, as
    vLLM's engine core does under async scheduling (one batch executing while the next is
    scheduled): requests are scheduled with tokens in flight, and blocks are cached by
    ``update_from_output`` a step later. The fake model output is taken when its step is
    scheduled."""
    pending = sorted(stream, key=lambda r: r.arrival_step)
    aborts: dict[int, list[str]] = {}
    for item in stream:
        if item.abort_step is not None:
            aborts.setdefault(item.abort_step, []).append(item.request_id)
    index = 0
    executing: tuple[Any, Any] | None = None
    for step in range(max_steps):
        while index < len(pending) and pending[index].arrival_step <= step:
            scheduler.add_request(new_request(pending[index], block_size))
            index += 1
        live = [rid for rid in aborts.pop(step, ()) if rid in scheduler.requests]
        if live:
            scheduler.finish_requests(live, RequestStatus.FINISHED_ABORTED)
        if index >= len(pending) and not scheduler.requests:
            if executing is None:
                return
            scheduler.update_from_output(*executing)
            executing = None
            continue
        output = scheduler.schedule()
        yield output
        model_output = fake_model_output(scheduler, output)
        if executing is not None:
            scheduler.update_from_output(*executing)
            executing = None
        if in_flight:
            # Under async scheduling the scheduler schedules placeholder drafts itself.
            executing = (output, model_output)
        else:
            scheduler.update_from_output(output, model_output)
            if scheduler.num_spec_tokens:
                _propose_drafts(scheduler, output)
    raise RuntimeError(f"the stream did not finish in {max_steps} steps")


def _propose_drafts(scheduler: Any, output: Any) -> None:
    """What vLLM's engine core does after a step without async scheduling: the drafter's
    proposals for the step's requests (:func:`proposed_drafts`) handed to
    ``update_draft_token_ids``, which ignores finished requests and prefill chunks."""
    from vllm.v1.outputs import DraftTokenIds

    req_ids = [rid for rid in output.num_scheduled_tokens if rid in scheduler.requests]
    drafts = [
        proposed_drafts(rid, scheduler.requests[rid].num_tokens, scheduler.num_spec_tokens) for rid in req_ids
    ]
    scheduler.update_draft_token_ids(DraftTokenIds(req_ids, drafts))


def drive(scheduler: Any, stream: list[StreamRequest], *, block_size: int) -> int:
    """Run ``stream`` through ``scheduler`` to the end; the number of steps."""
    return sum(1 for _ in run_steps(scheduler, stream, block_size=block_size))
