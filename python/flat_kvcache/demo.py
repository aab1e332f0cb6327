"""Generate a few tokens with a tiny random model through the whole stack, and show what the cache did.

``python -m flat_kvcache.demo`` (needs torch and transformers: ``pip install 'flat-kvcache[model]'``).
A GPT-OSS-style model with alternating sliding-window and full-attention layers runs on the CPU
with paged attention over ``FlatKVCache``'s block tables and hybrid-slab K/V buffers. Two
requests share a prefix; per step the demo prints the scheduled tokens, each request's prefix
hit, pages allocated, holes (slid-out sliding pages), free pages, and at the end the largest
logit difference to the model's own forward.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence


def main(argv: list[str] | None = None) -> int:
    """Run the demo; returns the exit status (0 on success)."""
    parser = argparse.ArgumentParser(prog="flat-kvcache demo", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12, help="tokens to generate per request (default 12)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights and prompts")
    parser.add_argument("--page-size", type=int, default=4, help="tokens per page (default 4)")
    parser.add_argument("--window", type=int, default=8, help="sliding window in tokens (default 8)")
    parser.add_argument("--num-pages", type=int, default=48, help="pages in the pool (default 48)")
    args = parser.parse_args(argv)
    for name in ("steps", "page_size", "window", "num_pages"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    try:
        import torch
        import transformers  # noqa: F401  (the runner's models need it)
    except ModuleNotFoundError as exc:
        print(
            f"demo needs torch and transformers (pip install 'flat-kvcache[model]'): {exc}", file=sys.stderr
        )
        return 1

    import flat_kvcache as fk
    from flat_kvcache.torch import allocate_kv_buffers
    from flat_kvcache.torch.runner import (
        PagedModelRunner,
        RequestRecord,
        max_logit_error,
        model_shape,
        plan_for_pages,
        run_greedy,
        tiny_model,
    )

    model = tiny_model("gpt-oss", window=args.window, seed=args.seed, max_position_embeddings=4096)
    shape = model_shape(model.config)
    plan = plan_for_pages(
        shape,
        page_size=args.page_size,
        num_pages=args.num_pages,
        max_live_requests=2,
        max_scheduled_tokens=64,
        max_context_len=1024,
    )
    buffers = allocate_kv_buffers(plan, "cpu")
    cache = fk.FlatKVCache(fk.kv_cache_specs(plan.groups), plan.num_pages)
    runner = PagedModelRunner(model, cache, buffers, poison_new_pages=True)
    groups = list(cache.group_ids)
    print(f"model: {shape.layer_types}, window {args.window}, page size {plan.page_size}")
    print(
        f"pool: {plan.num_pages} pages, groups {groups}, "
        f"K/V slabs: {plan.slab_group_size} (None: per-layer buffers)"
    )

    generator = torch.Generator().manual_seed(args.seed)
    shared = [int(t) for t in torch.randint(1, 64, (4 * plan.page_size,), generator=generator)]
    prompts = {"A": [*shared, 5, 6, 7], "B": [*shared, 9]}
    held: dict[str, dict[str, set[int]]] = {}

    def on_step(
        step: int, reqs: Sequence[str], ns: Sequence[int], records: Mapping[str, RequestRecord]
    ) -> None:
        parts = []
        for req, n in zip(reqs, ns, strict=True):
            record = records[req]
            text = f"{req}: +{n} tok"
            if len(record.computed) == 1:
                text += f" (prefix hit {record.hits[-1]})"
            if cache.has_request(req):
                tables = cache.block_tables([req])
                before = held.setdefault(req, {})
                for group in groups:
                    pages = {int(p) for p in tables[group][0] if p > 0}
                    new = len(pages - before.get(group, set()))
                    holes = int((tables[group][0] == 0).sum())
                    before[group] = pages
                    text += f" | {group}: {len(pages)} pages ({new} new to it), {holes} holes"
            else:
                text += " | finished"
            parts.append(text)
        print(f"step {step:3d}: " + "; ".join(parts) + f"  [free pages {cache.num_free_pages}]")

    records = run_greedy(runner, prompts, args.steps, max_running=1, on_step=on_step)
    for req, record in records.items():
        print(f"{req}: prompt {len(record.prompt)} tokens, generated {record.tokens[len(record.prompt) :]}")
    error = max_logit_error(model, records)
    stats = cache.stats()
    print(f"prefix hits {stats['prefix_hits_tokens']} of {stats['prefix_queries_tokens']} prompt tokens")
    print(f"largest logit difference to the model's own forward: {error:.2e}")
    if not error <= 1e-4:
        print("demo: the paged model does not match its own forward", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
