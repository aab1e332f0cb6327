"""On a GPU machine: ``vllm.LLM`` with vLLM's scheduler and with ``FlatScheduler``, same outputs.

Greedy generation of the same prompts (several sharing long prefixes, so prefix-cache hits are
taken) twice, in two fresh processes: once with vLLM's default scheduler and once with the one
config line that switches to flat-kvcache::

    LLM(model, scheduler_cls="flat_kvcache.vllm.FlatScheduler")

The generated token ids must be equal; the script prints both wall times and exits 1 on any
difference. Not run in CI (it needs a GPU, vLLM with its CUDA torch, and a model)::

    pip install vllm==0.33.0 && pip install .       # or PYTHONPATH=python with a built extension
    python benches/vllm_llm_gpu.py --model Qwen/Qwen3-0.6B
    python benches/vllm_llm_gpu.py --model /path/to/local/model --num-prompts 64 --max-tokens 128

A small ``--gpu-memory-utilization`` makes the pool small enough to preempt, which exercises
recomputation too.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import random
import sys
import time
from typing import Any

FLAT = "flat_kvcache.vllm.FlatScheduler"


def prompts(num: int, seed: int) -> list[list[int]]:
    """Token-id prompts: a few long shared prefixes, each continued by its own suffix."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(100, 20000) for _ in range(rng.randint(200, 1200))] for _ in range(4)]
    out = []
    for _ in range(num):
        prefix = rng.choice(prefixes) if rng.random() < 0.8 else []
        out.append(prefix + [rng.randrange(100, 20000) for _ in range(rng.randint(8, 300))])
    return out


def generate(args: argparse.Namespace, scheduler_cls: str | None, queue: Any) -> None:
    """One engine in this process: greedy outputs and the wall time, put on ``queue``."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    extra: dict[str, Any] = {}
    if scheduler_cls is not None:
        extra["scheduler_cls"] = scheduler_cls
    llm = LLM(
        model=args.model,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=args.max_model_len,
        enable_prefix_caching=True,
        seed=0,
        **extra,
    )
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    batch = [TokensPrompt(prompt_token_ids=p) for p in prompts(args.num_prompts, args.seed)]
    llm.generate(batch[:2], params)  # warm-up
    start = time.perf_counter()
    results = llm.generate(batch, params)
    elapsed = time.perf_counter() - start
    queue.put({"tokens": [list(r.outputs[0].token_ids) for r in results], "seconds": elapsed})


def run(args: argparse.Namespace, scheduler_cls: str | None) -> dict[str, Any]:
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=generate, args=(args, scheduler_cls, queue))
    process.start()
    result: dict[str, Any] = queue.get()
    process.join()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="Qwen/Qwen3-0.6B")
    parser.add_argument("--num-prompts", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    theirs = run(args, None)
    ours = run(args, FLAT)
    same = theirs["tokens"] == ours["tokens"]
    differing = [i for i, (a, b) in enumerate(zip(theirs["tokens"], ours["tokens"], strict=True)) if a != b]
    print(
        json.dumps(
            {
                "model": args.model,
                "prompts": args.num_prompts,
                "max_tokens": args.max_tokens,
                "outputs_equal": same,
                "differing_prompts": differing[:20],
                "vllm_scheduler_s": round(theirs["seconds"], 3),
                "flat_scheduler_s": round(ours["seconds"], 3),
            },
            indent=2,
        )
    )
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
