"""Run a Hugging Face causal LM on the flat cache's pages, and a greedy scheduler loop (private).

Public through :mod:`flat_kvcache.torch.runner` (it needs ``transformers``, the ``model`` extra).

:class:`PagedModelRunner` registers :func:`~flat_kvcache.torch.paged_attention` as a
``transformers`` attention implementation. Each :meth:`~PagedModelRunner.step` runs the model
once over the new tokens of a batch of requests (named by their cache slots), packed into one
sequence: every attention layer
writes its new K/V rows at the slots the cache's block tables give (``extend_locations``) into the
:class:`~flat_kvcache.torch.KVBuffers` of its layer and reads its history back through the
tables. Nothing else keeps K/V, so a model that matches its own plain forward proves that the
tables, write locations and buffers agree (docs/model-runner.md).

:func:`run_greedy` is a small scheduler loop on ``FlatKVCache``'s slot API (chunked prefill,
decode, prefix hits, preemption when the pool runs dry; one ``schedule`` and one
``append_tokens`` call per step) that records the logits of
every computed position, and :func:`reference_logits` is the model's own forward to compare with.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import inspect
import math
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from flat_kvcache import (
    ArenaPlan,
    FlatKVCache,
    KVCacheSpec,
    group_specs_from_layer_types,
    kv_cache_specs,
    layer_group_ids,
    plan_arena,
)
from flat_kvcache._types import CHUNKED_WINDOW, SLIDING_WINDOW, STATE, STATE_LAYER_TYPES
from flat_kvcache.torch._checks import as_int
from flat_kvcache.torch.arena import ArenaBuffers
from flat_kvcache.torch.attention import paged_attention, write_kv
from flat_kvcache.torch.capture import CaptureBuffers, extend_locations
from flat_kvcache.torch.host import TransferExecutor
from flat_kvcache.torch.plan import KVBuffers, KVMemoryPlan, plan_kv_memory
from flat_kvcache.torch.rows import DeviceRows
from flat_kvcache.torch.shape import ModelShape

__all__ = [
    "ATTN_IMPLEMENTATION",
    "TINY_MODEL_KINDS",
    "DecodeGraph",
    "PagedModelRunner",
    "RequestRecord",
    "arena_for_units",
    "arena_specs",
    "max_logit_error",
    "model_shape",
    "plan_for_pages",
    "reference_logits",
    "run_decode_graph",
    "run_greedy",
    "tiny_model",
]

#: The name under which the paged attention is registered with ``transformers``.
ATTN_IMPLEMENTATION = "flat_kvcache_paged"


#: The device buffers a runner reads and writes: SPEC 3 buffers, or the SPEC 13 arena (the only
#: storage of state groups).
Buffers = KVBuffers | ArenaBuffers

#: The state components the runner moves between the arena and a model's own cache layer: the
#: conv inputs (``kernel - 1`` columns here, ``kernel`` in ``transformers``) and the recurrent state.
_STATE_COMPONENTS = ("conv", "ssm")

#: State kinds (:data:`flat_kvcache.families.STATE_KINDS`) whose ``transformers`` mixers resume
#: a cached recurrent state only on one-token steps. The mamba1 mixers (``MambaMixer``,
#: ``FalconMambaMixer``, ``JambaMambaMixer``; transformers 5.x) read the cached state only when
#: the step has one token: a longer step carries the conv inputs over but starts its selective
#: scan from a zero state, whatever the cache holds. The runner feeds them a chunk that follows
#: a state one token at a time, each token a forward of its own through the model's own code.
_ONE_TOKEN_RESUME_KINDS = frozenset({"mamba1"})

#: The state kinds whose ``transformers`` models keep their state in the cache the runner loads
#: and reads back (``LinearAttentionLayer``: conv inputs and recurrent state), checked against
#: the models' own whole forward (tests/model/test_runner_families.py): Qwen3-Next's and
#: OLMo-Hybrid's Gated DeltaNet, Kimi Delta Attention, mamba1 (Jamba, Mamba), mamba2 (Mamba-2,
#: Bamba, Nemotron-H, Granite 4.0, Falcon-H1, Zamba2). Any other kind is refused.
_RUNNER_STATE_KINDS = frozenset({"gdn", "olmo_hybrid_gdn", "kda", "mamba1", "mamba2"})

#: Why a state kind with conv + ssm components is not run, where the reason is known.
_REFUSED_STATE_KINDS = {
    "rg_lru": "RecurrentGemma keeps its recurrent and conv state in its own modules (the "
    "temporal block's recurrent_states and conv1d_state), not in the transformers cache the "
    "runner loads before a step and reads back after it",
}


@dataclass
class _StepContext:
    buffers: Buffers
    cache_layer: Mapping[int, int]
    group_of_layer: Sequence[str]
    windows: Mapping[str, int | None]
    chunks: Mapping[str, int | None]
    page_size: int
    tables: dict[str, torch.Tensor]
    seq_lens: dict[str, torch.Tensor]
    slots: dict[str, torch.Tensor]
    query_lens: torch.Tensor
    check: bool


_ACTIVE: contextvars.ContextVar[_StepContext | None] = contextvars.ContextVar(
    "flat_kvcache_step", default=None
)

#: The model layer a shared attention block runs for (Zamba2: one attention module, whose
#: ``layer_idx`` is -1, serves every hybrid layer; the hybrid layer passes its own index).
_SHARED_LAYER: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "flat_kvcache_shared_layer", default=None
)


def _note_shared_layer(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Forward pre-hook of a layer that runs a shared attention block: remember its index (its
    ``layer_idx`` argument, positional or by name)."""
    index = inspect.signature(module.forward).bind_partial(*args, **kwargs).arguments.get("layer_idx")
    _SHARED_LAYER.set(int(index) if index is not None else None)


#: Keyword arguments ``transformers`` passes to an attention function that cannot change its
#: result here: positions and masks the paged tables already encode, and flags of other kernels.
_IGNORED_KWARGS = frozenset(
    {
        "position_ids",
        "cache_position",
        "is_causal",
        "output_attentions",
        "use_cache",
        "past_key_values",
        "past_key_value",
        "cu_seq_lens_q",
        "cu_seq_lens_k",
        "max_length_q",
        "max_length_k",
        "position_embeddings",
    }
)


def _paged_attention_forward(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    s_aux: torch.Tensor | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The ``transformers`` attention function: write this step's K/V, then attend over the pages.

    It honours what the model passes (``scaling``, ``sliding_window``, GPT-OSS's sinks
    ``s_aux``, Gemma-2's ``softcap``); any other argument with a value (a number, a tensor) is
    refused by name rather than ignored. Flags (bools, None) and :data:`_IGNORED_KWARGS`, which
    the paged tables already encode, pass. A chunked local attention layer (Llama 4) passes its
    chunk only through the attention mask, which this forward does not read: the chunk is the
    one of the layer's cache group in the plan (``attention_chunk_size``).
    """
    unknown = sorted(
        key
        for key, value in kwargs.items()
        if key not in _IGNORED_KWARGS and value is not None and not isinstance(value, bool)
    )
    if unknown:
        raise ValueError(
            f"the paged attention does not implement {', '.join(unknown)} (passed by "
            f"{type(module).__name__}); it would give a different result, so it is refused"
        )
    if dropout:
        raise ValueError(
            f"the paged attention does not implement dropout (dropout={dropout}): use model.eval()"
        )
    step = _ACTIVE.get()
    if step is None:
        raise RuntimeError(
            f"attention implementation {ATTN_IMPLEMENTATION!r} called outside PagedModelRunner.step"
        )
    if query.shape[0] != 1:
        raise ValueError(f"the paged forward packs every request into batch 1, got batch {query.shape[0]}")
    model_layer = int(module.layer_idx)
    if model_layer < 0:  # a shared block: the hybrid layer running it said which (_note_shared_layer)
        shared = _SHARED_LAYER.get()
        if shared is None:
            raise ValueError(
                f"{type(module).__name__} has layer_idx {model_layer} and no layer said it runs it"
            )
        model_layer = shared
    if model_layer not in step.cache_layer:
        raise ValueError(f"model layer {model_layer} attends, but its config gives it no KV cache")
    layer = step.cache_layer[model_layer]
    group = step.group_of_layer[layer]
    if sliding_window != step.windows[group]:
        raise ValueError(
            f"layer {layer} attends with sliding_window={sliding_window} but its cache group {group!r} "
            f"keeps window {step.windows[group]}"
        )
    k_cache, v_cache = step.buffers.k(layer), step.buffers.v(layer)
    write_kv(k_cache, v_cache, step.slots[group], key[0].transpose(0, 1), value[0].transpose(0, 1))
    out = paged_attention(
        query[0].transpose(0, 1),
        k_cache,
        v_cache,
        step.tables[group],
        step.seq_lens[group],
        step.query_lens,
        step.page_size,
        scale=scaling,
        sliding_window=sliding_window,
        chunk_size=step.chunks[group],
        sinks=s_aux,
        softcap=softcap,
        check=step.check,
    )
    return out.unsqueeze(0), None


def _check_temperature_tuning(config: Any, packed_tokens: int, max_position: int) -> None:
    """Refuse a forward that Llama 4's query temperature tuning would scale wrongly.

    Its NoPE layers scale the queries by ``1 + attn_scale * log1p(floor((pos + 1) /
    floor_scale))``, but the model takes ``pos`` from its own cache (none here) and the packed
    token index, not from ``position_ids``. Both give a scale of 1 while every position and
    every packed index is below ``floor_scale - 1``; past that the paged forward would differ
    from the model's, so it is refused.
    """
    if not getattr(config, "attn_temperature_tuning", False):
        return
    if all(getattr(config, "no_rope_layers", None) or [1]):  # no NoPE layer, nothing scaled
        return
    floor = getattr(config, "floor_scale", None)
    if isinstance(floor, int | float) and max(packed_tokens, max_position + 1) >= floor:
        raise ValueError(
            f"attn_temperature_tuning scales the queries of the NoPE layers by position, which the "
            f"model reads from the packed token index: with {packed_tokens} packed tokens and "
            f"positions up to {max_position} (floor_scale {floor}) the paged forward would differ "
            "from the model's; keep both below floor_scale - 1 or set attn_temperature_tuning=False"
        )


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, _paged_attention_forward)


def _state_kind(config: Any) -> str | None:
    """The state kind of a ``transformers`` config's state layers as the family table reads
    it (:func:`flat_kvcache.families.read_model_layers`), or None (no state layer)."""
    from flat_kvcache.config import load_model_config
    from flat_kvcache.families import read_model_layers

    cfg = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    return read_model_layers(load_model_config(cfg)).state_kind


def model_shape(config: Any, kv_dtype: torch.dtype = torch.float32) -> ModelShape:
    """The :class:`ModelShape` of a ``transformers`` config, its layers read by the model-family
    table (:func:`flat_kvcache.families.read_model_layers`), as ``plan --config`` reads them."""
    cfg = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    return ModelShape.from_config({**cfg, "torch_dtype": None, "dtype": None}, kv_dtype=kv_dtype)


#: The ``kind`` names :func:`tiny_model` builds.
TINY_MODEL_KINDS = (
    "gpt-oss",
    "qwen2",
    "llama",
    "gemma2",
    "mistral",
    "llama4",
    "qwen3-next",
    "bamba",
    "falcon-h1",
    "zamba2",
    "jamba",
    "mamba",
    "mamba2",
)

# The budget of the one-page plan that :func:`plan_for_pages` reads ``bytes_per_page`` from.
_PROBE_BUDGET_BYTES = 1 << 24
# The budget of the probe arena that :func:`arena_for_units` reads ``unit_bytes`` from.
_ARENA_PROBE_BYTES = 1 << 30


def tiny_model(
    kind: str,
    *,
    window: int = 8,
    num_layers: int = 2,
    seed: int = 0,
    device: torch.device | str = "cpu",
    intermediate_size: int | None = None,
    max_position_embeddings: int = 1024,
) -> Any:
    """A tiny random-weight ``transformers`` causal LM in eval mode on ``device``.

    Every kind has a vocabulary of 64 tokens, hidden size 32, 4 query and 2 K/V heads;
    ``torch.manual_seed(seed)`` is set just before the weights are drawn, so a kind, seed and
    size always give the same model.

    - ``"gpt-oss"``: GPT-OSS style, sliding/full alternation with attention sinks and a mixture
      of 4 experts (2 per token), head dim 8, MLP size 32 unless ``intermediate_size`` is given.
    - ``"qwen2"``: Mistral-style sliding/full alternation without experts (graph-capturable),
      MLP size 48 unless given.
    - ``"llama"``: full attention only (``window`` is not used), MLP size 48 unless given.
    - ``"gemma2"``: Gemma-2 style sliding/full alternation with attention logit soft-capping
      (a cap of 1.0, with weights drawn ten times wider than the default so the cap changes the
      scores: without it the logits differ by about 1.4) and its query scaling, MLP size 48 unless given.
    - ``"mistral"``: every layer sliding with ``window``, given as Mistral does (a
      ``sliding_window`` and no ``layer_types``), MLP size 48 unless given.
    - ``"llama4"``: Llama 4 text (``Llama4ForCausalLM``): chunked local attention with
      ``attention_chunk_size=window`` (RoPE and QK L2-norm) in every layer but the last, which
      is full attention without RoPE (NoPE, with the default query temperature tuning, a scale
      of 1 below position 8191); head dim 8, dense MLPs of size 48 unless given (no MoE layer).
    - ``"qwen3-next"``: Qwen3-Next (``Qwen3NextForCausalLM``): Gated DeltaNet and full
      attention alternating (GDN first), GDN with 2 key and 4 value heads of 8, conv kernel 4,
      attention head dim 8, dense MLPs of size 48 unless given (no MoE layer); ``window`` is
      not used. Its GDN runs ``transformers``' torch path on the CPU.
    - ``"bamba"``: Bamba (``BambaForCausalLM``): mamba2 and full attention alternating (mamba2
      first), mamba2 with 4 heads of 16, state 8, 1 group, conv kernel 4, scan chunk 16; MLP
      size 48 unless given; ``window`` is not used.
    - ``"falcon-h1"``: Falcon-H1 (``FalconH1ForCausalLM``): every layer runs full attention
      (head dim 8) and a mamba2 mixer (``mamba_d_ssm`` 32: 4 heads of 8, state 8, 1 group, conv
      kernel 4, scan chunk 16) side by side, two cache layers per model layer; MLP size 48
      unless given; ``window`` is not used.
    - ``"zamba2"``: Zamba2 (``Zamba2ForCausalLM``): mamba2 and hybrid layers alternating (mamba2
      first); a hybrid layer runs the one shared attention block (4 heads of 16 over the hidden
      state concatenated with the embeddings, RoPE) and then its mamba2 mixer (4 heads of 16,
      state 8, 1 group, conv kernel 4, scan chunk 16), two cache layers per hybrid layer; MLP
      size 48 unless given; ``window`` is not used. The shared block's ``layer_idx`` is -1:
      the runner learns the layer from the hybrid layer that runs it.
    - ``"jamba"``: Jamba (``JambaForCausalLM``): mamba1 and full attention alternating (mamba1
      first), mamba1 with inner size 64, state 8, conv kernel 4, time-step rank 4; one expert
      (dense MLPs) of size 48 unless given; weights drawn ten times wider than the default
      (initializer range 0.2): with the default the recurrent state's share of the logits is
      about 1e-5, too little for a dropped state to show. ``window`` is not used.
    - ``"mamba"``: Mamba (``MambaForCausalLM``): mamba1 layers only (inner size 64, state 8, conv
      kernel 4, time-step rank 4), no attention and no MLP; ``window`` and
      ``intermediate_size`` are not used.
    - ``"mamba2"``: Mamba-2 (``Mamba2ForCausalLM``): mamba2 layers only (4 heads of 16, state 8,
      1 group, conv kernel 4, scan chunk 16), no attention and no MLP; ``window`` and
      ``intermediate_size`` are not used.

    The alternating kinds (``"qwen3-next"``, ``"bamba"``, ``"zamba2"`` and ``"jamba"`` too) need
    an even ``num_layers``, the sliding ones have ``sliding_window=window``; ``"llama4"`` needs at
    least 2 layers.
    Needs ``transformers``.
    """
    if kind not in TINY_MODEL_KINDS:
        raise ValueError(f"kind must be one of {TINY_MODEL_KINDS}, got {kind!r}")
    as_int(num_layers, "num_layers", minimum=1)
    as_int(window, "window", minimum=1)
    if intermediate_size is None:
        mlp = 32 if kind == "gpt-oss" else 48
    else:
        mlp = as_int(intermediate_size, "intermediate_size", minimum=1)
    alternating = kind in ("gpt-oss", "qwen2", "gemma2")
    if (alternating or kind in ("qwen3-next", "bamba", "zamba2", "jamba")) and num_layers % 2:
        raise ValueError(
            f"a {kind} model alternates sliding and full layers: num_layers must be even, got {num_layers}"
        )
    if kind == "llama4" and num_layers < 2:
        raise ValueError(
            "a llama4 model has chunked layers and a full last layer: num_layers must be >= 2, "
            f"got {num_layers}"
        )
    import transformers

    common: dict[str, Any] = {
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": mlp,
        "num_hidden_layers": num_layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": max_position_embeddings,
    }
    if alternating:
        common["sliding_window"] = window
        common["layer_types"] = ["sliding_attention", "full_attention"] * (num_layers // 2)
    torch.manual_seed(seed)
    model: Any
    if kind == "gpt-oss":
        config = transformers.GptOssConfig(
            **common,
            head_dim=8,
            num_local_experts=4,
            num_experts_per_tok=2,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
        model = transformers.GptOssForCausalLM(config)
    elif kind == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common, use_sliding_window=True))
    elif kind == "gemma2":
        gemma = transformers.Gemma2Config(
            **common, head_dim=8, query_pre_attn_scalar=8, attn_logit_softcapping=1.0, initializer_range=0.2
        )
        model = transformers.Gemma2ForCausalLM(gemma)
    elif kind == "llama4":
        llama4 = transformers.Llama4TextConfig(
            **common,
            head_dim=8,
            intermediate_size_mlp=mlp,
            attention_chunk_size=window,
            no_rope_layers=[1] * (num_layers - 1) + [0],  # layer_types: chunked..., full
            moe_layers=[],  # every layer a dense MLP
            num_local_experts=1,
        )
        model = transformers.Llama4ForCausalLM(llama4)
    elif kind == "mistral":
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**common, sliding_window=window))
    elif kind == "qwen3-next":
        qwen3_next = transformers.Qwen3NextConfig(
            **common,
            head_dim=8,
            layer_types=["linear_attention", "full_attention"] * (num_layers // 2),
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            linear_conv_kernel_dim=4,
            num_experts=0,
            mlp_only_layers=list(range(num_layers)),  # every layer a dense MLP
        )
        model = transformers.Qwen3NextForCausalLM(qwen3_next)
    elif kind == "falcon-h1":
        falcon = transformers.FalconH1Config(  # head dim hidden_size // heads = 8
            **common,
            mamba_d_ssm=32,
            mamba_n_heads=4,
            mamba_d_head=8,
            mamba_n_groups=1,
            mamba_d_state=8,
            mamba_d_conv=4,
            mamba_chunk_size=16,
        )
        model = transformers.FalconH1ForCausalLM(falcon)
    elif kind == "zamba2":
        zamba = transformers.Zamba2Config(
            **{**common, "num_key_value_heads": 4},
            layers_block_type=["mamba", "hybrid"] * (num_layers // 2),
            mamba_d_state=8,
            mamba_d_conv=4,
            mamba_expand=2,
            n_mamba_heads=4,
            mamba_ngroups=1,
            chunk_size=16,
            num_mem_blocks=1,
            use_shared_attention_adapter=False,
            use_mem_rope=True,
        )
        model = transformers.Zamba2ForCausalLM(zamba)
    elif kind == "bamba":
        bamba = transformers.BambaConfig(
            **common,
            attn_layer_indices=list(range(1, num_layers, 2)),
            mamba_n_heads=4,
            mamba_d_head=16,
            mamba_n_groups=1,
            mamba_d_state=8,
            mamba_d_conv=4,
            mamba_expand=2,
            mamba_chunk_size=16,
        )
        model = transformers.BambaForCausalLM(bamba)
    elif kind == "jamba":
        jamba = transformers.JambaConfig(
            **common,
            attn_layer_period=2,
            attn_layer_offset=1,
            num_experts=1,
            expert_layer_period=1,
            expert_layer_offset=0,
            mamba_d_state=8,
            mamba_d_conv=4,
            mamba_expand=2,
            mamba_dt_rank=4,
            initializer_range=0.2,
        )
        model = transformers.JambaForCausalLM(jamba)
    elif kind == "mamba":
        mamba = transformers.MambaConfig(
            vocab_size=64,
            hidden_size=32,
            num_hidden_layers=num_layers,
            state_size=8,
            conv_kernel=4,
            expand=2,
            time_step_rank=4,
        )
        model = transformers.MambaForCausalLM(mamba)
    elif kind == "mamba2":
        mamba2 = transformers.Mamba2Config(
            vocab_size=64,
            hidden_size=32,
            num_hidden_layers=num_layers,
            num_heads=4,
            head_dim=16,
            n_groups=1,
            state_size=8,
            conv_kernel=4,
            expand=2,
            chunk_size=16,
        )
        model = transformers.Mamba2ForCausalLM(mamba2)
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    return model.eval().to(device)


def plan_for_pages(
    shape: ModelShape,
    *,
    page_size: int,
    num_pages: int,
    max_live_requests: int,
    max_scheduled_tokens: int,
    max_context_len: int,
    storage: Literal["equalized"] | None = None,
) -> KVMemoryPlan:
    """A :func:`~flat_kvcache.torch.plan_kv_memory` plan of exactly ``num_pages`` pages (page 0
    included) instead of a byte budget; ``storage`` is ``plan_kv_memory``'s (a shape with state
    layers is planned only with ``storage="equalized"``: its storage is the arena,
    :func:`arena_for_units`).

    A one-page probe plan gives the bytes one page takes (the same for any budget); the budget
    of the real plan is then ``num_pages`` times that. The probe needs a page under 16 MiB,
    which the small models of tests and demos have.
    """
    pages = as_int(num_pages, "num_pages", minimum=2)
    try:
        probe = plan_kv_memory(
            shape,
            page_size=page_size,
            budget_bytes=_PROBE_BUDGET_BYTES,
            max_live_requests=1,
            max_scheduled_tokens=1,
            max_context_len=1,
            storage=storage,
        )
    except ValueError as exc:
        raise ValueError(
            f"cannot size one page of this shape from a {_PROBE_BUDGET_BYTES}-byte probe: {exc}"
        ) from exc
    plan = plan_kv_memory(
        shape,
        page_size=page_size,
        budget_bytes=probe.bytes_per_page * pages,
        max_live_requests=max_live_requests,
        max_scheduled_tokens=max_scheduled_tokens,
        max_context_len=max_context_len,
        storage=storage,
    )
    if plan.num_pages != pages:  # pragma: no cover - a CPU budget of n pages plans n pages
        raise RuntimeError(f"asked for {pages} pages, the plan has {plan.num_pages}")
    return plan


def arena_for_units(
    shape: ModelShape, *, page_size: int, num_units: int, max_live_requests: int = 1
) -> ArenaPlan:
    """A :func:`flat_kvcache.plan_arena` plan of exactly ``num_units`` units (unit 0 included)
    instead of a byte budget: a probe plan gives the unit's bytes, the real plan's budget is
    ``num_units`` of them."""
    units = as_int(num_units, "num_units", minimum=2)
    components = shape.components()
    unit_bytes = plan_arena(components, page_size, _ARENA_PROBE_BYTES).unit_bytes
    plan = plan_arena(components, page_size, unit_bytes * units, max_live_requests=max_live_requests)
    if plan.num_units != units:  # pragma: no cover - a budget of n units plans n units
        raise RuntimeError(f"asked for {units} units, the plan has {plan.num_units}")
    return plan


def arena_specs(shape: ModelShape, *, page_size: int, state_grain: int) -> list[KVCacheSpec]:
    """The engine's group specs of ``shape`` over an arena: every group pages ``page_size``
    tokens, except the state groups, whose page (a checkpoint's spacing) is ``state_grain``
    tokens (SPEC 13.5)."""
    grain = as_int(state_grain, "state_grain", minimum=1)
    groups = group_specs_from_layer_types(shape.layer_types, shape.sliding_window, page_size=page_size)
    return [
        dataclasses.replace(spec, page_size=grain) if spec.kind == "state" else spec
        for spec in kv_cache_specs(groups)
    ]


class PagedModelRunner:
    """Runs ``model`` over a :class:`~flat_kvcache.FlatKVCache`'s pages and ``buffers``.

    Attention-only models run every step as one packed forward. A model with state layers
    (Qwen3-Next's Gated DeltaNet, mamba2 hybrids such as Bamba and Granite 4.0, Jamba's mamba1,
    and the attention-free Mamba and Mamba-2) runs on the SPEC 13 arena
    (:class:`~flat_kvcache.torch.ArenaBuffers`): each scheduled request then gets a forward of
    its own, whose state layers start from the state slot ``cache.state_slots`` says the step
    reads (copied into the slot it writes where they differ, SPEC 13.4) and leave the state after
    the step in the write slot. The state travels through the model's own ``transformers``
    cache (``past_key_values``, or ``cache_params`` for Mamba and Mamba-2; loaded before, read
    back after), so the model's own recurrence code computes it; the arena keeps the conv
    inputs' last ``kernel - 1`` columns, where that layer keeps ``kernel`` (the first is never
    read again). A mamba1 model resumes a state only on one-token steps, so a chunk of more than
    one token that follows a state runs one token per forward (``one_token_resume``).

    Refused when built, naming why: a model whose layers are not those the buffers were planned
    for (or whose family the family table does not read, e.g. Falcon-Mamba), a SPEC 3 plan with
    a state group, state components other than conv + ssm, a state kind whose model keeps its
    state outside the ``transformers`` cache (RecurrentGemma's RG-LRU) or that was never checked
    here, ``capture``/``rows`` with state layers, a state model whose forward takes no cache
    argument, an attention model whose forward takes no ``position_ids``.

    Parameters
    ----------
    model
        A ``transformers`` causal LM whose attention layers call the attention-function registry
        (Llama, Qwen2, Mistral, Gemma, GPT-OSS, Qwen3-Next, Bamba, Jamba...), or a Mamba /
        Mamba-2 model. Its layers must be those ``buffers`` were planned for.
    cache
        The page manager, built from the same groups (``buffers.plan.groups``; with an arena,
        ``FlatKVCache(specs, arena=buffers.plan)``).
    buffers
        The K/V buffers (per layer or hybrid slabs), or the arena's views.
    capture
        Optional :class:`CaptureBuffers` (attention-only models): every step fills them and the
        attention reads their rows (in windowed mode, ``sliding_offsets=True``, with the row
        offsets applied).
    rows
        Optional :class:`~flat_kvcache.torch.rows.DeviceRows` bound to ``cache`` (attention-only
        models): row ``s`` is the request in slot ``s``, every step applies ``update_rows()``'s
        deltas to the device tables and the attention reads those rows (windowed groups with
        their offsets applied). Not with ``capture``.
    check
        Check write locations and attended slots (ValueError on a hole or padding).
    poison_new_pages
        Fill every K/V page a request gets from the pool with NaN before its first use (claimed
        prefix-hit pages keep their content), so a read of an unwritten slot shows up as NaN.
        (State slots: poison the arena once, ``buffers.arena[plan.unit_bytes:].fill_(255)``;
        a step never reads a slot it did not get from the cache.)
    """

    def __init__(
        self,
        model: Any,
        cache: FlatKVCache,
        buffers: Buffers,
        *,
        capture: CaptureBuffers | None = None,
        rows: DeviceRows | None = None,
        check: bool = True,
        poison_new_pages: bool = False,
    ) -> None:
        _register()
        if capture is not None and rows is not None:
            raise ValueError("pass capture or rows, not both: each is a source of the tables")
        if rows is not None and rows.cache is not cache:
            raise ValueError("rows must be bound to the runner's cache")
        self.rows = rows
        self.model = model
        self.cache = cache
        self.buffers = buffers
        self.capture = capture
        self.check = check
        self.poison_new_pages = poison_new_pages
        if isinstance(buffers, ArenaBuffers):
            shape = buffers.shape
            self.page_size = buffers.plan.page_size
            groups = group_specs_from_layer_types(
                shape.layer_types, shape.sliding_window, page_size=self.page_size
            )
            self.device = buffers.arena.device
        else:
            shape = buffers.plan.shape
            self.page_size = buffers.plan.page_size
            groups = list(buffers.plan.groups)
            if any(spec.family == STATE for spec in groups):
                raise ValueError(
                    "the plan has a state group: state layers run on the SPEC 13 arena "
                    "(buffers from allocate_kv_buffers(plan_arena_memory(...)) or allocate_arena)"
                )
            self.device = next(iter(buffers.tensors.values())).device
        expected = model_shape(model.config, shape.kv_dtype)
        mine = (expected.layer_types, expected.sliding_window, expected.model_layers)
        if mine != (shape.layer_types, shape.sliding_window, shape.model_layers):
            raise ValueError(
                f"the model's layers {expected.layer_types} (window {expected.sliding_window}) are not "
                f"those the buffers were planned for: {shape.layer_types} (window {shape.sliding_window})"
            )
        if list(cache.group_ids) != [spec.group_id for spec in groups]:
            raise ValueError(
                f"cache groups {list(cache.group_ids)} differ from the plan's "
                f"{[spec.group_id for spec in groups]}"
            )
        self.group_of_layer = layer_group_ids(shape.layer_types, shape.sliding_window)
        model_layers = shape.model_layers or tuple(range(len(shape.layer_types)))
        #: Model layer -> its attention cache layer, and (cache layer, model layer) of each state layer.
        self.cache_layer: dict[int, int] = {}
        self.state_layers: list[tuple[int, int]] = []
        for layer, (label, model_layer) in enumerate(zip(shape.layer_types, model_layers, strict=True)):
            if label in STATE_LAYER_TYPES:
                self.state_layers.append((layer, model_layer))
            else:
                self.cache_layer[model_layer] = layer
        forward = inspect.signature(model.forward).parameters
        #: Whether the model's forward takes ``position_ids`` (pure Mamba / Mamba2 have no
        #: positional layer and take none).
        self._takes_positions = "position_ids" in forward
        if self.cache_layer and not self._takes_positions:
            raise ValueError(
                f"{type(model).__name__}.forward takes no position_ids: its attention layers would "
                "number the packed new tokens from 0, not from their positions in the request"
            )
        #: The forward's argument for the model's own cache (``cache_params`` in Mamba / Mamba2).
        self._cache_argument = "past_key_values"
        #: Whether a chunk that follows a state runs one token per forward (mamba1 models).
        self.one_token_resume = False
        if self.state_layers:
            self._check_state_model(shape, capture, rows)
            if "past_key_values" not in forward:
                if "cache_params" not in forward:
                    raise ValueError(
                        f"{type(model).__name__}.forward takes neither past_key_values nor "
                        "cache_params: the runner cannot hand its state layers their state"
                    )
                self._cache_argument = "cache_params"
            kind = _state_kind(model.config)
            if kind not in _RUNNER_STATE_KINDS:
                reason = _REFUSED_STATE_KINDS.get(
                    str(kind), "the runner has not been checked against this kind's own forward"
                )
                raise ValueError(
                    f"{type(model).__name__}: state layers of kind {kind!r} are refused: {reason}; "
                    f"the runner runs {', '.join(sorted(_RUNNER_STATE_KINDS))}"
                )
            self.one_token_resume = kind in _ONE_TOKEN_RESUME_KINDS
        self.windows: dict[str, int | None] = {
            spec.group_id: spec.sliding_window_tokens if spec.retention == SLIDING_WINDOW else None
            for spec in groups
        }
        # A chunked group's chunk is its window entry (SPEC 6): what its layers attend.
        self.chunks: dict[str, int | None] = {
            spec.group_id: spec.sliding_window_tokens if spec.retention == CHUNKED_WINDOW else None
            for spec in groups
        }
        # Chunked tables are absolute in every source: CaptureBuffers never windows them and
        # bind_rows refuses offsets for them (the chunk mask needs absolute positions).
        #: The attention layers of each attention group (state groups have no table to read).
        self.layers_of_group: dict[str, list[int]] = {}
        for layer in sorted(self.cache_layer.values()):
            self.layers_of_group.setdefault(self.group_of_layer[layer], []).append(layer)
        # Per slot: the pages of each group it has seen (poisoned once, when first seen).
        self._known: dict[int, dict[str, set[int]]] = {}
        #: The ``(read, write)`` state slots of each request (by cache slot) of the last step.
        self.last_state_slots: dict[int, tuple[int, int]] = {}

    def _check_state_model(
        self, shape: ModelShape, capture: CaptureBuffers | None, rows: DeviceRows | None
    ) -> None:
        """Refuse what the per-request state path does not do, naming it."""
        if capture is not None or rows is not None:
            raise ValueError(
                "a model with state layers runs one forward per request from its state slots: "
                "capture= and rows= are for attention-only models"
            )
        components = tuple(sorted(shape.state_shapes or {}))
        if components != _STATE_COMPONENTS:
            raise ValueError(
                f"the runner moves conv + ssm states (Gated DeltaNet, mamba1, mamba2); this model's state "
                f"components are {list(components)}"
            )

    # -- request bookkeeping ------------------------------------------------------------------

    def add_request(self, req: str, tokens: Sequence[int]) -> tuple[int, int]:
        """``cache.add_request``; returns ``(slot, hit)``: the request's slot, which every later
        call takes (its row of ``rows``), and the prefix hit in tokens (not recomputed)."""
        slot, hit = self.cache.add_request(req, list(tokens))
        tables = self.cache.block_tables([slot])
        self._known[slot] = {g: {int(p) for p in t[0] if p > 0} for g, t in tables.items()}
        return int(slot), int(hit)

    def release(self, slot: int, *, preempt: bool = False) -> list[int] | None:
        """``cache.finish([slot])`` (or ``cache.preempt([slot])``, whose folded token list is
        returned). The slot is free afterwards: the next ``add_request`` may get it."""
        self._known.pop(slot, None)
        if preempt:
            folded: list[int] = self.cache.preempt([slot])[0]
            return folded
        self.cache.finish([slot])
        return None

    @contextlib.contextmanager
    def _paged(self) -> Iterator[None]:
        previous = self.model.config._attn_implementation
        self.model.set_attn_implementation(ATTN_IMPLEMENTATION)
        # Layers that run a shared attention block (Zamba2's hybrid layers) say which they are.
        hooks = [
            module.register_forward_pre_hook(_note_shared_layer, with_kwargs=True)
            for module in self.model.modules()
            if hasattr(module, "shared_transformer")
        ]
        try:
            yield
        finally:
            for hook in hooks:
                hook.remove()
            self.model.set_attn_implementation(previous)

    def _page_rows(self, tensor: torch.Tensor, page: int) -> torch.Tensor:
        """The rows of ``page`` in a K or V cache of either form (``paged_attention``'s)."""
        if tensor.dim() == 4:
            return tensor[page]
        return tensor[page * self.page_size : (page + 1) * self.page_size]

    def _poison(self, slots: Sequence[int], tables: Mapping[str, np.ndarray]) -> None:
        for row, slot in enumerate(slots):
            known = self._known.setdefault(slot, {})
            for group, layers in self.layers_of_group.items():
                seen = known.setdefault(group, set())
                for page in (int(p) for p in tables[group][row] if p > 0):
                    if page in seen:
                        continue
                    seen.add(page)
                    if self.poison_new_pages:
                        for layer in layers:
                            self._page_rows(self.buffers.k(layer), page).fill_(math.nan)
                            self._page_rows(self.buffers.v(layer), page).fill_(math.nan)

    # -- state slots --------------------------------------------------------------------------

    def _arena(self) -> ArenaBuffers:
        assert isinstance(self.buffers, ArenaBuffers)  # checked at construction for state models
        return self.buffers

    def _load_state(self, read: int, write: int) -> Any:
        """The model's own cache for one request's step: its state layers hold the state of slot
        ``read`` (copied into ``write`` first where they differ; none for a fresh request, read
        0), its attention layers nothing (the pages hold their K/V)."""
        from transformers import DynamicCache
        from transformers.cache_utils import LinearAttentionLayer

        arena = self._arena()
        if read != write and read != 0:
            for layer, _ in self.state_layers:
                for component in _STATE_COMPONENTS:
                    view = arena.state(layer, component)
                    view[write] = view[read]
        own = DynamicCache(config=self.model.config)
        if read == 0:
            return own
        for layer, model_layer in self.state_layers:
            target = own.layers[model_layer]
            if not isinstance(target, LinearAttentionLayer):
                raise TypeError(
                    f"model layer {model_layer} is a state layer here but its transformers cache layer "
                    f"is a {type(target).__name__}, not a LinearAttentionLayer"
                )
            conv = arena.state(layer, "conv")[write]
            ssm = arena.state(layer, "ssm")[write]
            kernel_inputs = torch.zeros(
                (1, conv.shape[0], conv.shape[1] + 1), dtype=conv.dtype, device=conv.device
            )
            kernel_inputs[0, :, 1:] = conv  # column 0 (the oldest input) is never read again
            target.lazy_initialization(
                conv_states=kernel_inputs, recurrent_states=ssm[None], conv_kernel_size=conv.shape[1] + 1
            )
            conv_state, recurrent_state = target.conv_states[0], target.recurrent_states[0]
            assert conv_state is not None and recurrent_state is not None  # initialized just above
            conv_state.copy_(kernel_inputs)
            recurrent_state.copy_(ssm[None])
            target.has_previous_state[0] = True
        return own

    def _store_state(self, own: Any, write: int) -> None:
        """Slot ``write`` takes the state the step left in the model's own cache layers."""
        arena = self._arena()
        for layer, model_layer in self.state_layers:
            source = own.layers[model_layer]
            if not (source.is_conv_states_initialized[0] and source.is_recurrent_states_initialized[0]):
                raise RuntimeError(f"model layer {model_layer} left no state in its cache layer")
            conv = arena.state(layer, "conv")
            columns = int(conv.shape[-1])
            inputs = source.conv_states[0][0]
            conv[write] = inputs[:, inputs.shape[-1] - columns :]
            arena.state(layer, "ssm")[write] = source.recurrent_states[0][0]

    # -- one forward --------------------------------------------------------------------------

    def step(self, slots: Sequence[int], new_tokens: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Compute the logits of ``new_tokens[i]`` for the request in ``slots[i]``, already scheduled.

        Call after ``cache.schedule(slots, [len(t) for t in new_tokens])`` succeeded for all of
        them: slot ``i``'s new tokens are its positions ``computed - len(new_tokens[i]) ..
        computed - 1``. Returns one ``[len(new_tokens[i]), vocab]`` float tensor per slot.
        """
        if len(slots) != len(new_tokens):
            raise ValueError(f"{len(slots)} slots but {len(new_tokens)} token lists")
        if not slots:
            return []
        lens = [len(t) for t in new_tokens]
        if min(lens) < 1:
            raise ValueError("every scheduled request needs at least one new token")
        if not self.state_layers:
            return self._forward(slots, new_tokens, None)
        read, write = self.cache.state_slots(list(slots), lens)
        self.last_state_slots = {int(s): (int(r), int(w)) for s, r, w in zip(slots, read, write, strict=True)}
        out: list[torch.Tensor] = []
        for i, slot in enumerate(slots):
            r, w = int(read[i]), int(write[i])
            if self.one_token_resume and r != 0 and lens[i] > 1:
                # The model resumes a state on one-token steps only (_ONE_TOKEN_RESUME_KINDS):
                # one forward per token, each from the write slot the previous one left (a
                # fresh own cache each time, so its attention layers see only their new token).
                start = self.cache.num_computed_tokens(slot) - lens[i]
                pieces = []
                for j, token in enumerate(new_tokens[i]):
                    own = self._load_state(r if j == 0 else w, w)
                    pieces.extend(self._forward([slot], [[token]], own, ends=[start + j + 1]))
                    self._store_state(own, w)
                out.append(torch.cat(pieces))
            else:
                own = self._load_state(r, w)
                out.extend(self._forward([slot], [new_tokens[i]], own))
                self._store_state(own, w)
        return out

    def _forward(
        self,
        slots: Sequence[int],
        new_tokens: Sequence[Sequence[int]],
        own: Any,
        *,
        ends: Sequence[int] | None = None,
    ) -> list[torch.Tensor]:
        """One forward over the packed new tokens of ``slots``; ``own`` is the model's own cache
        holding the state layers' state (a single request), or None (no state layers).

        Slot ``i``'s new tokens end at ``ends[i]`` (default: its computed tokens, the end of
        what was scheduled); a one-token-resume step passes the end of each of its tokens.
        """
        lens = [len(t) for t in new_tokens]
        computed = (
            [self.cache.num_computed_tokens(s) for s in slots] if ends is None else [int(e) for e in ends]
        )
        _check_temperature_tuning(self.model.config, sum(lens), max(computed) - 1)
        tables_np = self.cache.block_tables(list(slots))
        self._poison(slots, tables_np)
        device = self.device
        seq = torch.tensor(computed, dtype=torch.long, device=device)
        qlen = torch.tensor(lens, dtype=torch.long, device=device)
        tables: dict[str, torch.Tensor] = {}
        seq_lens: dict[str, torch.Tensor] = {}
        write_slots: dict[str, torch.Tensor] = {}
        if self.capture is not None:
            self.capture.fill(tables_np, batch_size=len(slots))
        row_index = None
        if self.rows is not None:
            self.rows.update()
            row_index = torch.tensor(list(slots), dtype=torch.long, device=device)  # row s = slot s
        for group in self.layers_of_group:
            shift = torch.zeros_like(seq)
            if self.rows is not None and row_index is not None:
                table = self.rows.tables[group][row_index]
                if group in self.rows.offsets:
                    shift = self.rows.offsets[group][row_index].long() * self.page_size
            elif self.capture is not None:
                table = self.capture.buffer(group)[: len(slots)].to(device)
                with contextlib.suppress(KeyError):
                    shift = self.capture.page_offsets(group)[: len(slots)].to(device).long() * self.page_size
            else:
                table = torch.from_numpy(tables_np[group]).to(device)
            tables[group] = table
            seq_lens[group] = seq - shift
            write_slots[group] = extend_locations(
                table, seq - shift - qlen, qlen, self.page_size, check=self.check
            )
        ids = torch.tensor([t for toks in new_tokens for t in toks], dtype=torch.long, device=device)
        positions = torch.cat(
            [torch.arange(c - n, c, device=device) for c, n in zip(computed, lens, strict=True)]
        )
        context = _StepContext(
            buffers=self.buffers,
            cache_layer=self.cache_layer,
            group_of_layer=self.group_of_layer,
            windows=self.windows,
            chunks=self.chunks,
            page_size=self.page_size,
            tables=tables,
            seq_lens=seq_lens,
            slots=write_slots,
            query_lens=qlen,
            check=self.check,
        )
        inputs: dict[str, Any] = {"input_ids": ids[None], "use_cache": own is not None}
        if self._takes_positions:
            inputs["position_ids"] = positions[None]
        if own is not None:
            inputs[self._cache_argument] = own
        token = _ACTIVE.set(context)
        try:
            with self._paged(), torch.no_grad():
                out = self.model(**inputs)
        finally:
            _ACTIVE.reset(token)
        logits: torch.Tensor = out.logits[0].float()
        return list(torch.split(logits, lens))


def reference_logits(model: Any, tokens: Sequence[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """``[len(tokens), vocab]``: the model's own forward over the whole sequence, in one piece
    (eager attention, no cache).

    Deliberately never cut where a paged run's forwards started: a reference cut the same way
    would share a flaw of the model's own cache path (``transformers``' mamba1 mixers restart a
    multi-token step's scan from zero) and hide it. Chunked recurrences (Gated DeltaNet,
    mamba2) round a little differently for other cuts; float32 keeps that far below the
    runner tests' bound (1e-3).
    """
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            ids = torch.tensor([list(tokens)], dtype=torch.long, device=device)
            out = model(input_ids=ids, use_cache=False)
            logits: torch.Tensor = out.logits[0].float()
            return logits
    finally:
        model.set_attn_implementation(previous)


@dataclass
class RequestRecord:
    """What :func:`run_greedy` did for one request."""

    prompt: list[int]
    tokens: list[int]
    #: ``(positions, logits)`` of every forward that computed some of the request's tokens.
    computed: list[tuple[list[int], torch.Tensor]] = field(default_factory=list)
    #: Prefix hits (tokens) of each ``add_request`` (more than one after a preemption).
    hits: list[int] = field(default_factory=list)
    preemptions: int = 0
    #: The cache slot while the request runs (``None`` while it waits and once it finished).
    slot: int | None = None


StepHook = Callable[[int, Sequence[str], Sequence[int], Mapping[str, "RequestRecord"]], None]


def run_greedy(
    runner: PagedModelRunner,
    prompts: Mapping[str, Sequence[int]],
    max_new_tokens: int,
    *,
    chunk_size: int = 1 << 30,
    max_running: int = 1 << 30,
    on_step: StepHook | None = None,
    max_steps: int = 100_000,
    transfers: TransferExecutor | None = None,
) -> dict[str, RequestRecord]:
    """Generate ``max_new_tokens`` greedy tokens per prompt through ``runner``.

    Requests are admitted in order while fewer than ``max_running`` run, each keeping the slot
    ``add_request`` returned (``RequestRecord.slot``); each step schedules
    ``min(chunk_size, tokens not computed)`` tokens per running request with one
    ``schedule(slots, ns)`` call (for a model with state layers, cut by ``cache.next_chunk`` so
    that checkpoints land on the grain); a request that does not fit is preempted (its folded tokens
    re-added later, a prefix hit), and when none fits the newest running request is retracted
    to make room (SPEC 9), no request being admitted until a step schedules again; only a
    request that does not fit alone fails the run. The sampled tokens go
    to the cache in one ``append_tokens(slots, tokens)`` call. ``on_step(step, reqs, ns,
    records)`` is called after each forward with the request ids it computed.

    With a host tier, ``transfers`` runs the cache's transfers: ``transfers.run()`` is called
    before every ``schedule`` (after admitting requests, so that their host loads land first,
    and after the previous forward, which wrote the pages the previous schedule stored) and
    once at the end (the stores of the last forward).
    """
    records = {req: RequestRecord(prompt=list(p), tokens=list(p)) for req, p in prompts.items()}
    waiting: deque[str] = deque(prompts)
    running: list[str] = []
    # A request was retracted to make room: admit no one until a step schedules again.
    retracted = False

    def slot_of(req: str) -> int:
        slot = records[req].slot
        assert slot is not None, req
        return slot

    for step in range(max_steps):
        if not waiting and not running:
            if transfers is not None:
                transfers.run()
            return records
        while waiting and len(running) < max_running and not retracted:
            req = waiting.popleft()
            slot, hit = runner.add_request(req, records[req].tokens)
            records[req].slot = slot
            records[req].hits.append(hit)
            running.append(req)
        if transfers is not None:
            transfers.run()
        slots = [slot_of(r) for r in running]
        ns = [
            min(chunk_size, len(records[r].tokens) - runner.cache.num_computed_tokens(s))
            for r, s in zip(running, slots, strict=True)
        ]
        if runner.state_layers:  # cut where the state groups keep checkpoints (SPEC 13.5)
            ns = [int(runner.cache.next_chunk(s, n)) for s, n in zip(slots, ns, strict=True)]
        ok = runner.cache.schedule(slots, ns).tolist()
        failed = [r for r, good in zip(running, ok, strict=True) if not good]
        scheduled = [(r, n) for r, n, good in zip(running, ns, ok, strict=True) if good]
        if not scheduled:
            if len(running) == 1:
                raise RuntimeError(
                    f"step {step}: request {running[0]!r} alone does not fit in the pool "
                    f"({runner.cache.num_free_pages} free pages)"
                )
            # SPEC 9 retraction: free the newest running request and try the others again.
            failed = running[-1:]
            scheduled = []
        retracted = bool(failed)
        for req in reversed(failed):
            runner.release(slot_of(req), preempt=True)
            records[req].slot = None
            records[req].preemptions += 1
            running.remove(req)
            waiting.appendleft(req)
        if not scheduled:
            continue
        reqs = [r for r, _ in scheduled]
        step_slots = [slot_of(r) for r in reqs]
        ends = [runner.cache.num_computed_tokens(s) for s in step_slots]
        chunks = [records[req].tokens[end - n : end] for (req, n), end in zip(scheduled, ends, strict=True)]
        logits = runner.step(step_slots, chunks)
        sampled_reqs: list[str] = []
        sampled: list[int] = []
        for (req, n), end, out in zip(scheduled, ends, logits, strict=True):
            record = records[req]
            record.computed.append((list(range(end - n, end)), out))
            if end == len(record.tokens):
                sampled_reqs.append(req)
                sampled.append(int(out[-1].argmax()))
        if sampled_reqs:
            runner.cache.append_tokens([slot_of(r) for r in sampled_reqs], sampled)
        for req, token in zip(sampled_reqs, sampled, strict=True):
            record = records[req]
            record.tokens.append(token)
            if len(record.tokens) - len(record.prompt) >= max_new_tokens:
                runner.release(slot_of(req))
                record.slot = None
                running.remove(req)
        if on_step is not None:
            on_step(step, reqs, [n for _, n in scheduled], records)
    raise RuntimeError(f"run_greedy did not finish within {max_steps} steps")


def max_logit_error(
    model: Any, records: Mapping[str, RequestRecord], device: torch.device | str = "cpu"
) -> float:
    """Largest ``|paged - reference|`` over every computed position of every request (``inf`` for
    a non-finite difference).

    The reference is the model's whole unpaged forward (:func:`reference_logits`) over the
    request's tokens up to its last computed position: the last sampled token, never computed,
    is not fed to it."""
    worst = 0.0
    for record in records.values():
        if not record.computed:
            continue
        last = max(positions[-1] for positions, _ in record.computed)
        reference = reference_logits(model, record.tokens[: last + 1], device)
        for positions, logits in record.computed:
            diff = (logits.to(reference.device) - reference[positions]).abs().max()
            worst = max(worst, float(diff) if bool(torch.isfinite(diff)) else math.inf)
    return worst


class DecodeGraph:
    """One-token decode steps of ``runner`` over fixed tensors, optionally as a captured CUDA graph.

    Needs ``runner.capture``: the attention reads the capture buffers' rows (in either mode), and
    every other input (token ids, positions, sequence lengths, write slots) lives in a tensor
    allocated once and updated in place, with ``check=False`` attention (NaN, never silent data,
    for a hole read). With ``use_graph=True`` (CUDA) the model forward is captured once and each
    :meth:`step` replays it; with False it runs eagerly on the same tensors (the CPU check of the
    same path). Rows past the batch are graph padding: page 0, position 0, output ignored.
    """

    def __init__(self, runner: PagedModelRunner, *, use_graph: bool) -> None:
        if runner.capture is None:
            raise ValueError("DecodeGraph needs a runner built with capture buffers")
        self.runner = runner
        self.capture = runner.capture
        size = self.capture.max_batch_size
        device = runner.device
        self.ids = torch.zeros(size, dtype=torch.long, device=device)
        self.positions = torch.zeros(size, dtype=torch.long, device=device)
        self.query_lens = torch.ones(size, dtype=torch.long, device=device)
        self.seq_lens = {g: torch.ones(size, dtype=torch.long, device=device) for g in runner.layers_of_group}
        self.slots = {g: torch.zeros(size, dtype=torch.long, device=device) for g in runner.layers_of_group}
        self.context = _StepContext(
            buffers=runner.buffers,
            cache_layer=runner.cache_layer,
            group_of_layer=runner.group_of_layer,
            windows=runner.windows,
            chunks=runner.chunks,
            page_size=runner.page_size,
            tables={g: self.capture.buffer(g) for g in runner.layers_of_group},
            seq_lens=self.seq_lens,
            slots=self.slots,
            query_lens=self.query_lens,
            check=False,
        )
        self.graph: Any = None
        self.logits: torch.Tensor | None = None
        if use_graph:
            if device.type != "cuda":
                raise ValueError(f"a CUDA graph needs CUDA buffers, these are on {device}")
            stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up outside the graph
                    self._forward()
            torch.cuda.current_stream(device).wait_stream(stream)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.logits = self._forward()

    def _forward(self) -> torch.Tensor:
        token = _ACTIVE.set(self.context)
        try:
            with self.runner._paged(), torch.no_grad():
                out = self.runner.model(
                    input_ids=self.ids[None], position_ids=self.positions[None], use_cache=False
                )
        finally:
            _ACTIVE.reset(token)
        logits: torch.Tensor = out.logits[0]
        return logits

    def step(self, slots: Sequence[int], tokens: Sequence[int]) -> torch.Tensor:
        """Logits ``[len(slots), vocab]`` of one decode token per slot, already scheduled."""
        runner, batch = self.runner, len(slots)
        if batch != len(tokens) or batch > self.capture.max_batch_size:
            raise ValueError(f"{batch} slots, {len(tokens)} tokens, max batch {self.capture.max_batch_size}")
        tables = runner.cache.block_tables(list(slots))
        runner._poison(slots, tables)
        self.capture.fill(tables, batch_size=batch)
        computed = torch.tensor([runner.cache.num_computed_tokens(s) for s in slots], dtype=torch.long)
        last = int(computed.max()) - 1 if batch else 0
        _check_temperature_tuning(runner.model.config, self.capture.max_batch_size, last)
        self.ids.zero_()
        self.ids[:batch] = torch.tensor(list(tokens), dtype=torch.long)
        self.positions.zero_()
        self.positions[:batch] = computed - 1
        for group in runner.layers_of_group:
            shift = torch.zeros(batch, dtype=torch.long, device=runner.device)
            with contextlib.suppress(KeyError):
                shift = self.capture.page_offsets(group)[:batch].long() * runner.page_size
            seq = computed.to(runner.device) - shift
            self.seq_lens[group].fill_(1)
            self.seq_lens[group][:batch] = seq
            table = self.capture.buffer(group)
            self.slots[group].zero_()
            self.slots[group][:batch] = write_locations_rows(table[:batch], seq - 1, runner.page_size)
        if self.graph is not None:
            self.graph.replay()
            assert self.logits is not None
            return self.logits[:batch].float().clone()
        return self._forward()[:batch].float()


def write_locations_rows(table: torch.Tensor, positions: torch.Tensor, page_size: int) -> torch.Tensor:
    """``write_locations`` with the write checked (every decode write must hit a real page)."""
    from flat_kvcache.torch.capture import write_locations

    return write_locations(table, positions, page_size, check=True)


def run_decode_graph(
    runner: PagedModelRunner, prompts: Mapping[str, Sequence[int]], steps: int, *, use_graph: bool
) -> dict[str, RequestRecord]:
    """Prefill ``prompts`` with :meth:`PagedModelRunner.step`, then decode ``steps`` greedy tokens
    per request through a :class:`DecodeGraph` (every request decodes each step)."""
    reqs = list(prompts)
    records = {r: RequestRecord(prompt=list(p), tokens=list(p)) for r, p in prompts.items()}
    slots: list[int] = []
    for req in reqs:
        slot, hit = runner.add_request(req, records[req].tokens)
        records[req].slot = slot
        records[req].hits.append(hit)
        slots.append(slot)
    ns = [
        len(records[r].tokens) - runner.cache.num_computed_tokens(s) for r, s in zip(reqs, slots, strict=True)
    ]
    if not runner.cache.schedule(slots, ns).all():
        raise RuntimeError("the prompts do not fit in the pool")
    chunks = [records[r].tokens[len(records[r].tokens) - n :] for r, n in zip(reqs, ns, strict=True)]
    graph: DecodeGraph | None = None
    capture, runner.capture = runner.capture, None  # a whole prompt may not fit a windowed buffer
    try:
        prefill = runner.step(slots, chunks)
    finally:
        runner.capture = capture
    for req, n, out in zip(reqs, ns, prefill, strict=True):
        end = len(records[req].tokens)
        records[req].computed.append((list(range(end - n, end)), out))
    for _ in range(steps):
        sampled = [int(records[r].computed[-1][1][-1].argmax()) for r in reqs]
        runner.cache.append_tokens(slots, sampled)
        for req, token in zip(reqs, sampled, strict=True):
            records[req].tokens.append(token)
        if not runner.cache.schedule(slots, [1] * len(slots)).all():
            raise RuntimeError("a decode step does not fit in the pool")
        if graph is None:
            graph = DecodeGraph(runner, use_graph=use_graph)
        logits = graph.step(slots, sampled)
        for row, req in enumerate(reqs):
            end = len(records[req].tokens)
            records[req].computed.append(([end - 1], logits[row : row + 1]))
    for req, slot in zip(reqs, slots, strict=True):
        runner.release(slot)
        records[req].slot = None
    return records
