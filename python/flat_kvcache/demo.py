"""Generate a few tokens with a tiny random model through the whole stack, and show what the cache did.

``flat-kvcache demo`` or ``python -m flat_kvcache.demo`` (needs torch and transformers, the ``model``
extra: ``pip install '.[model]'`` in the source tree).
By default (``--model gpt-oss``) a GPT-OSS-style model with alternating sliding-window and
full-attention layers runs on the CPU with paged attention over ``FlatKVCache``'s block tables
and hybrid-slab K/V buffers. Two requests share a prefix; per step the demo prints the scheduled
tokens, each request's prefix hit, pages allocated, holes (slid-out sliding pages), free pages,
and at the end the largest logit difference to the model's own forward.

``--model qwen3-next`` (Gated DeltaNet + full attention) and ``--model bamba`` (mamba2 + full
attention) are state hybrids on the SPEC 13 arena (``FlatKVCache(arena=)``): per step the demo
prints each request's state slots (the one read, the one written) and the checkpoints written
so far; the second request resumes from the first one's checkpoint.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flat_kvcache.torch.runner import RequestRecord

#: Each request's prompt: a prefix of four pages that both share, then these tokens of its own.
OWN_TOKENS = {"A": [5, 6, 7], "B": [9]}
#: The longest request the demo plans for (prompt and generated tokens).
MAX_CONTEXT_LEN = 1024
#: The largest pool and the most memory its K/V buffers may take.
MAX_NUM_PAGES = 1 << 20
MAX_BUFFER_BYTES = 1 << 30
#: The models: the attention-only default, and the state hybrids (on the SPEC 13 arena).
MODELS = ("gpt-oss", "qwen3-next", "bamba")
STATE_MODELS = ("qwen3-next", "bamba")
#: The state hybrids' defaults: arena units and the state checkpoint grain (tokens).
DEFAULT_NUM_UNITS = 48
DEFAULT_STATE_GRAIN = 8
MAX_NUM_UNITS = 1 << 16


def longest_prompt(page_size: int) -> int:
    """Tokens in the longer prompt (A's)."""
    return 4 * page_size + max(len(own) for own in OWN_TOKENS.values())


def min_num_pages(*, page_size: int, window: int, steps: int) -> int:
    """The smallest pool (page 0 included) that runs the demo.

    Requests run one at a time, so the pool must hold the longest one (A) at its peak. Its prompt
    is one chunk (nothing has slid out yet: ``ceil(prompt / P)`` pages in both groups); each later
    step computes one token at ``computed`` tokens: the sliding group first reclaims its pages
    ``[0, (computed - W + 1) // P)`` (SPEC 6 and 8), then both groups cover ``computed + 1``
    tokens. The last generated token is never computed.
    """
    prompt = longest_prompt(page_size)
    peak = 2 * math.ceil(prompt / page_size)
    for computed in range(prompt, prompt + steps - 1):
        pages = math.ceil((computed + 1) / page_size)
        slid = max(0, (computed - window + 1) // page_size)
        peak = max(peak, pages + pages - slid)
    return 1 + peak


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flat-kvcache demo",
        description=__doc__.splitlines()[0],
        epilog=f"Request A's prompt is 4 pages + 3 tokens; with its steps it must stay within "
        f"{MAX_CONTEXT_LEN} tokens. Arguments the run could not finish with are refused before it starts.",
    )
    parser.add_argument(
        "--steps", type=int, default=12, metavar="N", help="tokens to generate per request (12)"
    )
    parser.add_argument(
        "--seed", type=int, default=0, metavar="S", help="seed of the random weights and prompts (0)"
    )
    parser.add_argument(
        "--model",
        choices=MODELS,
        default="gpt-oss",
        help="gpt-oss (sliding + full attention, the default), or a state hybrid on the SPEC 13 "
        "arena: qwen3-next (Gated DeltaNet + full attention) or bamba (mamba2 + full attention)",
    )
    parser.add_argument("--page-size", type=int, default=4, metavar="P", help="tokens per page (4)")
    parser.add_argument(
        "--window", type=int, default=None, metavar="W", help="sliding window in tokens (8; gpt-oss only)"
    )
    parser.add_argument(
        "--num-pages",
        type=int,
        default=None,
        metavar="N",
        help="pages in the pool, page 0 included (48; gpt-oss only); at least what the longer "
        "request needs alone",
    )
    parser.add_argument(
        "--num-units",
        type=int,
        default=None,
        metavar="N",
        help=f"arena units, unit 0 included ({DEFAULT_NUM_UNITS}; state hybrids only)",
    )
    parser.add_argument(
        "--state-grain",
        type=int,
        default=None,
        metavar="G",
        help=f"tokens between state checkpoints, a multiple of --page-size ({DEFAULT_STATE_GRAIN}; "
        "state hybrids only)",
    )
    return parser


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse, before any work, arguments the run could not finish with (``parser.error``: one
    line naming the option, exit status 2). Fills in the defaults of the model's options."""
    state = args.model in STATE_MODELS
    mine, others = (("num_units", "state_grain"), ("window", "num_pages"))
    if not state:
        mine, others = others, mine
    for name in others:
        if getattr(args, name) is not None:
            parser.error(f"--{name.replace('_', '-')} is not an option of --model {args.model}")
    defaults = {
        "window": 8,
        "num_pages": 48,
        "num_units": DEFAULT_NUM_UNITS,
        "state_grain": DEFAULT_STATE_GRAIN,
    }
    for name in mine:
        if getattr(args, name) is None:
            setattr(args, name, defaults[name])
    for name in ("steps", "page_size", *mine):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if state:
        _check_state(parser, args)
        return
    if args.num_pages > MAX_NUM_PAGES:
        parser.error(f"--num-pages must be <= {MAX_NUM_PAGES}, got {args.num_pages}")
    longest = longest_prompt(args.page_size) + args.steps
    if longest > MAX_CONTEXT_LEN:
        parser.error(
            f"--page-size {args.page_size} and --steps {args.steps}: the longer request would hold "
            f"{longest} tokens (a prompt of 4 pages + 3 tokens, then the steps); the demo plans for "
            f"at most {MAX_CONTEXT_LEN}"
        )
    need = min_num_pages(page_size=args.page_size, window=args.window, steps=args.steps)
    if args.num_pages < need:
        parser.error(
            f"--num-pages {args.num_pages} is too small: request A (a {longest - args.steps}-token "
            f"prompt, {args.steps} steps, {args.page_size} tokens per page, window {args.window}) "
            f"holds {need - 1} pages at its peak besides the null page 0, so --num-pages must be >= {need}"
        )


def _prompts(page_size: int, seed: int) -> dict[str, list[int]]:
    """Each request's prompt: a shared prefix of four pages of random tokens, then its own."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    shared = [int(t) for t in torch.randint(1, 64, (4 * page_size,), generator=generator)]
    return {req: [*shared, *own] for req, own in OWN_TOKENS.items()}


def _scheduled(req: str, n: int, record: RequestRecord) -> str:
    """A step's line for one request: its tokens, and its prefix hit on its first forward."""
    text = f"{req}: +{n} tok"
    if len(record.computed) == 1:
        text += f" (prefix hit {record.hits[-1]})"
    return text


def _report(
    records: Mapping[str, RequestRecord], error: float, stats: Mapping[str, Any], bound: float, *extra: str
) -> int:
    """Print what each request generated, ``extra`` lines, the hits and ``error``; 1 (and a line
    on stderr) when ``error`` is above ``bound``, else 0."""
    for req, record in records.items():
        print(f"{req}: prompt {len(record.prompt)} tokens, generated {record.tokens[len(record.prompt) :]}")
    for line in extra:
        print(line)
    print(f"prefix hits {stats['prefix_hits_tokens']} of {stats['prefix_queries_tokens']} prompt tokens")
    print(f"largest logit difference to the model's own forward: {error:.2e}")
    if not error <= bound:
        print("demo: the paged model does not match its own forward", file=sys.stderr)
        return 1
    return 0


def _check_state(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The state hybrids' arguments (the arena is sized by ``--num-units``; a pool too small
    for request A alone is reported when the run finds it)."""
    if args.num_units < 4 or args.num_units > MAX_NUM_UNITS:
        parser.error(f"--num-units must be in 4..{MAX_NUM_UNITS}, got {args.num_units}")
    if args.state_grain % args.page_size:
        parser.error(
            f"--state-grain {args.state_grain} must be a multiple of --page-size {args.page_size} "
            "(a checkpoint lies on a page boundary)"
        )
    longest = longest_prompt(args.page_size) + args.steps
    if longest > MAX_CONTEXT_LEN:
        parser.error(
            f"--page-size {args.page_size} and --steps {args.steps}: the longer request would hold "
            f"{longest} tokens; the demo plans for at most {MAX_CONTEXT_LEN}"
        )


def _run_state_model(args: argparse.Namespace) -> int:
    """The state hybrid demo: the model on the SPEC 13 arena, its state slots per step."""

    import flat_kvcache as fk
    from flat_kvcache.torch import allocate_arena
    from flat_kvcache.torch.runner import (
        PagedModelRunner,
        arena_for_units,
        arena_specs,
        max_logit_error,
        model_shape,
        run_greedy,
        tiny_model,
    )

    model = tiny_model(args.model, num_layers=4, seed=args.seed, max_position_embeddings=4096)
    shape = model_shape(model.config)
    plan = arena_for_units(shape, page_size=args.page_size, num_units=args.num_units, max_live_requests=1)
    if plan.num_units * plan.unit_bytes > MAX_BUFFER_BYTES:
        print(
            f"demo: --num-units {args.num_units}: the arena would take {plan.num_units * plan.unit_bytes} "
            f"bytes, more than the demo allows ({MAX_BUFFER_BYTES})",
            file=sys.stderr,
        )
        return 2
    arena = allocate_arena(shape, plan, "cpu")
    arena.arena[plan.unit_bytes :].fill_(0xFF)  # NaN: a read of a slot nobody wrote would show
    cache = fk.FlatKVCache(
        arena_specs(shape, page_size=args.page_size, state_grain=args.state_grain), arena=plan
    )
    runner = PagedModelRunner(model, cache, arena, poison_new_pages=True)
    kinds = sorted(set(shape.layer_types))
    print(
        f"model: a tiny random {args.model} model, {shape.num_layers} layers "
        f"({', '.join(shape.layer_types)}); "
        f"state components {dict(shape.state_shapes or {})}"
    )
    print(
        f"arena: {plan.num_units} units of {plan.unit_bytes} bytes (a unit is one state slot or "
        f"several K/V pages of {args.page_size} tokens); state checkpoint every {args.state_grain} "
        f"tokens; layer kinds {', '.join(kinds)}"
    )
    prompts = _prompts(args.page_size, args.seed)
    slot_of: dict[str, int] = {}  # a request's slot, kept after it finished (its last step)

    def on_step(
        step: int, reqs: Sequence[str], ns: Sequence[int], records: Mapping[str, RequestRecord]
    ) -> None:
        parts = []
        for req, n in zip(reqs, ns, strict=True):
            record = records[req]
            text = _scheduled(req, n, record)
            if record.slot is not None:
                slot_of[req] = record.slot
            slots = runner.last_state_slots.get(slot_of[req])
            if slots is not None:
                read, write = slots
                source = "none (fresh)" if read == 0 else ("checkpoint " if read != write else "") + str(read)
                text += f" | state read {source}, written {write}"
            parts.append(text)
        stats = cache.stats()
        print(
            f"step {step:3d}: "
            + "; ".join(parts)
            + f"  [checkpoints written {stats['checkpoints_written']}, "
            f"hit {stats['checkpoints_hit']}]"
        )

    try:
        records = run_greedy(runner, prompts, args.steps, max_running=1, on_step=on_step)
    except RuntimeError as exc:
        print(f"demo: --num-units {args.num_units} is too small: {exc}", file=sys.stderr)
        return 2
    stats = cache.stats()
    checkpoints = (
        f"checkpoints written {stats['checkpoints_written']}, hit {stats['checkpoints_hit']}, "
        f"evicted {stats['checkpoints_evicted']}"
    )
    return _report(records, max_logit_error(model, records), stats, 1e-3, checkpoints)


def main(argv: list[str] | None = None) -> int:
    """Run the demo; returns the exit status (0 on success)."""
    parser = _parser()
    args = parser.parse_args(argv)
    _check(parser, args)
    try:
        import torch  # noqa: F401  (checked here, used by the helpers)
        import transformers  # noqa: F401  (the runner's models need it)
    except ModuleNotFoundError as exc:
        print(
            f"demo needs torch and transformers, the model extra (pip install '.[model]'): {exc}",
            file=sys.stderr,
        )
        return 1
    if args.model in STATE_MODELS:
        return _run_state_model(args)

    import flat_kvcache as fk
    from flat_kvcache.torch import allocate_kv_buffers
    from flat_kvcache.torch.runner import (
        PagedModelRunner,
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
        max_context_len=MAX_CONTEXT_LEN,
    )
    if plan.total_bytes > MAX_BUFFER_BYTES:
        parser.error(
            f"--num-pages {args.num_pages}: the K/V buffers would take {plan.total_bytes} bytes "
            f"({plan.bytes_per_page} per page), more than the demo allows ({MAX_BUFFER_BYTES})"
        )
    buffers = allocate_kv_buffers(plan, "cpu")
    cache = fk.cache_from_config(plan)  # the plan's groups over the plan's pages
    runner = PagedModelRunner(model, cache, buffers, poison_new_pages=True)
    groups = list(cache.group_ids)
    layout = (
        f"K/V slabs: {plan.slab_group_size} (layer i of every label shares slab i)"
        if plan.slab_group_size
        else "one K and one V buffer per layer"
    )
    print(
        f"model: a tiny random GPT-OSS-style model, {shape.num_layers} layers "
        f"({', '.join(shape.layer_types)}), window {args.window}"
    )
    print(f"pool: {plan.num_pages} pages of {plan.page_size} tokens, groups {', '.join(groups)}; {layout}")

    prompts = _prompts(plan.page_size, args.seed)
    held: dict[str, dict[str, set[int]]] = {}

    def on_step(
        step: int, reqs: Sequence[str], ns: Sequence[int], records: Mapping[str, RequestRecord]
    ) -> None:
        parts = []
        for req, n in zip(reqs, ns, strict=True):
            record = records[req]
            text = _scheduled(req, n, record)
            slot = cache.slot_of(req)  # None once it finished
            if slot is not None:
                tables = cache.block_tables([slot])
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
    return _report(records, max_logit_error(model, records), cache.stats(), 1e-4)


if __name__ == "__main__":
    sys.exit(main())
