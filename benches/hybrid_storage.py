"""Storage of hybrid models: padding, tokens that fit and the smallest prefix hit (SPEC 13).

For each model (transformers 5.23's config classes with their defaults, bf16 K/V, fp32
recurrent state) and an 80 GiB budget, with one request of 16,384 prompt tokens prefilled in
8,192-token chunks and one decode step as the load, two columns:

- **today**: the library as it stores pages now, measured: ``plan_kv_memory`` (the SPEC 3
  equalized page, one row per page id in every layer's tensor) gives the page size, the bytes
  per page and the pool; the request runs through a real ``FlatKVCache`` over the plan's groups,
  and its pages are counted after every schedule.
- **SPEC 13 design (projected)**: the arena of docs/architecture.md ("Hybrid storage"), planned
  by ``flat_kvcache.plan_arena`` (docs/sizing-api.md "Arena plan"; the engine does not allocate
  from it yet): its unit (one state slot, each state component aligned to 256 bytes, or,
  without state groups, the lcm of the attention pages' bytes when that is at most 4 pages,
  else the largest page), its 16-token attention pages per unit, one working state slot per
  request (plus, during prefill, one while a checkpoint is written). The attention pages are
  counted by the same ``FlatKVCache`` run with 16-token pages and the model's attention groups
  only.

Definitions (both columns), for the request's pages after the load (the figures of the issue
this reproduces), with the peak during prefill beside them in ``--json``: *padding* is the
share of the bytes the request holds that cannot hold its K/V or state (a page's tokens not yet
written, rows of other groups, slack of a unit); *tokens that fit* is
``floor(pool / held) * 16,384``, the pool and what the request holds in the units the storage
hands out (pages today; units in the design, the request's attention pages counted as the
fraction of a unit they fill, since fullest-first placement packs pages of many requests into
shared units); the *smallest prefix hit* is the grain a prefix match ends on (the groups' lcm
page size today; the checkpoint grain ``G = 64`` for state models in the design, the attention
pages' lcm otherwise).

vLLM 0.33's column comes from its own planning code and its own ``KVCacheManager`` in a side
environment: ``benches/vllm_storage.py`` (its docstring says how to install it); ``--vllm-json
FILE`` merges its output (one JSON object per model and line; its after-load figures, the same
definitions as here).

    python benches/hybrid_storage.py              # the table
    python benches/hybrid_storage.py --json       # machine-readable
    /tmp/vllm-venv/bin/python benches/vllm_storage.py > /tmp/vllm_storage.json
    python benches/hybrid_storage.py --vllm-json /tmp/vllm_storage.json

Needs the ``torch`` and ``model`` extras (plan_kv_memory, transformers' config classes); runs on
the CPU in a few seconds.
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # spinning BLAS threads steal a core (benches/README.md)

import argparse
import json
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import flat_kvcache as fk
from flat_kvcache.families import read_model_layers
from flat_kvcache.torch import ModelShape, plan_kv_memory

#: The model ids benches/vllm_storage.py prints.
VLLM_NAMES = {
    "qwen3_next": "Qwen3-Next",
    "qwen3_5": "Qwen3.5",
    "qwen3_5_moe": "Qwen3.5-MoE",
    "gemma3": "Gemma-3",
    "gpt_oss": "GPT-OSS",
}

BUDGET = 80 << 30
PROMPT = 16_384
CHUNK = 8_192
PAGE = 16
CHECKPOINT_GRAIN = 64
#: Working slot plus the one a checkpoint is copied into while it is written.
STATE_SLOTS_AT_PEAK = 2


def _configs() -> dict[str, Callable[[], dict[str, Any]]]:
    import transformers

    def text(cls: Any) -> Callable[[], dict[str, Any]]:
        def make() -> dict[str, Any]:
            cfg = cls().to_dict()
            inner = cfg.get("text_config")
            return dict(inner) if isinstance(inner, dict) else cfg

        return make

    return {
        "Qwen3-Next": text(transformers.Qwen3NextConfig),
        "Qwen3.5": text(transformers.Qwen3_5Config),
        "Qwen3.5-MoE": text(transformers.Qwen3_5MoeConfig),
        "Gemma-3": text(transformers.Gemma3TextConfig),
        "GPT-OSS": text(transformers.GptOssConfig),
    }


def _run_load(specs: list[fk.KVCacheSpec], num_pages: int) -> list[list[int]]:
    """The reference load on a real cache: per schedule, the real pages held per group."""
    cache = fk.FlatKVCache(specs, num_pages, enable_caching=False)
    slot, _ = cache.add_request("load", list(range(PROMPT)))
    held: list[list[int]] = []
    for chunk in (CHUNK, PROMPT - CHUNK):
        if not cache.schedule([slot], [chunk]).all():
            raise RuntimeError("the pool cannot hold the reference request")
        held.append([sum(1 for p in pages if p) for pages in cache.page_ids(slot)])
    cache.append_tokens([slot], [7])
    if not cache.schedule([slot], [1]).all():
        raise RuntimeError("the pool cannot hold the reference request's decode step")
    held.append([sum(1 for p in pages if p) for pages in cache.page_ids(slot)])
    return held


def _layer_bytes(shape: ModelShape) -> tuple[dict[str, int], int]:
    """K/V bytes per token of each attention group (all its layers) and one state slot's bytes."""
    groups = fk.layer_group_ids(shape.layer_types, shape.sliding_window)
    per_token: dict[str, int] = {}
    state_layers = 0
    for label, group in zip(shape.layer_types, groups, strict=True):
        if label == fk.LINEAR_ATTENTION:
            state_layers += 1
        else:
            per_token[group] = per_token.get(group, 0) + shape.kv_bytes_per_slot
    state = state_layers * sum((shape.state_component_bytes or {}).values())
    return per_token, state


def today(shape: ModelShape) -> dict[str, Any]:
    """The library's storage now, measured through plan_kv_memory and the engine."""
    plan = plan_kv_memory(
        shape,
        page_size=PAGE,
        budget_bytes=BUDGET,
        max_live_requests=1,
        max_scheduled_tokens=CHUNK,
        max_context_len=PROMPT + 1,
    )
    specs = fk.kv_cache_specs(plan.groups)
    held = _run_load(specs, plan.num_pages)
    per_token, state = _layer_bytes(shape)
    after = held[-1]
    tokens_in_cache = PROMPT + 1
    useful = 0
    for spec, pages in zip(specs, after, strict=True):
        if spec.kind == "state":
            useful += pages * state  # each held state page holds one snapshot
        else:
            # The request's tokens in the held pages: the table's last `pages` slots.
            first = (math.ceil(tokens_in_cache / spec.page_size) - pages) * spec.page_size
            useful += (tokens_in_cache - first) * per_token[spec.group_id or ""]
    held_bytes = sum(after) * plan.bytes_per_page
    return {
        "page_tokens": plan.page_size,
        "bytes_per_page": plan.bytes_per_page,
        "num_pages": plan.num_pages,
        "pages_held": sum(after),
        "pages_held_peak": max(sum(h) for h in held),
        "padding": 1 - useful / held_bytes,
        "tokens_that_fit": (plan.num_pages - 1) // sum(after) * PROMPT,
        "tokens_that_fit_at_peak": (plan.num_pages - 1) // max(sum(h) for h in held) * PROMPT,
        "smallest_hit": math.lcm(*(spec.page_size for spec in specs)),
    }


def design(shape: ModelShape) -> dict[str, Any]:
    """The SPEC 13 arena, planned by ``plan_arena`` and loaded by a 16-token-page engine run."""
    _, state = _layer_bytes(shape)
    plan = fk.plan_arena(shape.components(), PAGE, BUDGET)
    unit = plan.unit_bytes
    page_bytes = {g.group_id: g.item_bytes for g in plan.groups if g.kind == "pages"}
    per_unit = {g.group_id: g.per_unit for g in plan.groups if g.kind == "pages"}
    groups = fk.group_specs_from_layer_types(
        [label for label in shape.layer_types if label != fk.LINEAR_ATTENTION],
        _attention_window(shape),
        page_size=PAGE,
    )
    specs = fk.kv_cache_specs(groups)
    held = _run_load(specs, 1 << 20)

    def units(pages: list[int], state_slots: int) -> float:
        attention = sum(n / per_unit[spec.group_id or ""] for spec, n in zip(specs, pages, strict=True))
        return attention + (state_slots if state else 0)

    after = units(held[-1], 1)
    peak = max(units(h, STATE_SLOTS_AT_PEAK) for h in held)
    num_units = plan.num_units
    useful = sum(n * page_bytes[spec.group_id or ""] for spec, n in zip(specs, held[-1], strict=True))
    useful += state  # the working slot's state bytes (0 without state groups), alignment not counted
    return {
        "unit_bytes": unit,
        "pages_per_unit": per_unit,
        "num_units": num_units,
        "units_held": after,
        "units_held_peak": peak,
        "padding": 1 - useful / (after * unit),
        "tokens_that_fit": int(num_units // after) * PROMPT,
        "tokens_that_fit_at_peak": int(num_units // peak) * PROMPT,
        "smallest_hit": CHECKPOINT_GRAIN if state else math.lcm(*(s.page_size for s in specs)),
    }


def _attention_window(shape: ModelShape) -> int | list[int | None] | None:
    window = shape.sliding_window
    if isinstance(window, Sequence) and not isinstance(window, str):
        return [w for w, label in zip(window, shape.layer_types, strict=True) if label != fk.LINEAR_ATTENTION]
    return window


def measure(names: Sequence[str] | None = None) -> dict[str, dict[str, Any]]:
    import torch

    out: dict[str, dict[str, Any]] = {}
    for name, make in _configs().items():
        if names and name not in names:
            continue
        cfg = make()
        layers = read_model_layers(cfg)
        shape = ModelShape.from_config(cfg, kv_dtype=torch.bfloat16)
        out[name] = {
            "layers": dict(
                sorted({label: layers.layer_types.count(label) for label in layers.layer_types}.items())
            ),
            "today": today(shape),
            "design": design(shape),
        }
    return out


def _millions(tokens: int) -> str:
    return f"{tokens / 1e6:.2f} M"


def table(results: dict[str, dict[str, Any]], vllm: dict[str, dict[str, Any]] | None) -> str:
    head = (
        "| model | today: page, smallest hit, padding, fit "
        "| SPEC 13 design (projected): unit, hit, padding, fit |"
    )
    rows = [head, "|---|---|---|" + ("---|" if vllm else "")]
    if vllm:
        rows[0] = head + " vLLM 0.33: block, hit, padding, fit |"
    for name, r in results.items():
        t, d = r["today"], r["design"]
        line = (
            f"| {name} | {t['page_tokens']:,} tokens, {t['smallest_hit']:,}, {t['padding']:.1%}, "
            f"{_millions(t['tokens_that_fit'])} | {d['unit_bytes'] / 2**20:.2f} MiB, {d['smallest_hit']}, "
            f"{d['padding']:.1%}, {_millions(d['tokens_that_fit'])} |"
        )
        if vllm:
            v = vllm.get(name)
            line += (
                f" {v['block_size']:,} tokens, {v['prefix_hit_grain_tokens']}, "
                f"{v['padding_after_load']:.1%}, {_millions(v['tokens_that_fit_after_load'])} |"
                if v
                else " n/a |"
            )
        rows.append(line)
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--model", action="append", help="only this model (repeatable)")
    parser.add_argument("--vllm-json", type=Path, help="benches/vllm_storage.py --json output to merge")
    args = parser.parse_args(argv)
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as exc:
        print(
            f"hybrid_storage.py needs torch and transformers: pip install '.[torch,model]' ({exc})",
            file=sys.stderr,
        )
        return 2
    vllm = None
    if args.vllm_json is not None:
        # One JSON object per line, models named by their vLLM ids.
        rows = [
            json.loads(line)
            for line in args.vllm_json.read_text(encoding="utf-8").splitlines()
            if line.strip()
        ]
        vllm = {VLLM_NAMES.get(row["model"], row["model"]): row for row in rows}
    results = measure(args.model)
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print(table(results, vllm))
    return 0


if __name__ == "__main__":
    sys.exit(main())
