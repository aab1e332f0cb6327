"""Storage of hybrid models: padding, tokens that fit and the smallest prefix hit (SPEC 13).

For each model (transformers 5.23's config classes with their defaults, bf16 K/V, fp32
recurrent state) and an 80 GiB budget, with one request of 16,384 prompt tokens prefilled in
8,192-token chunks and one decode step as the load, two columns:

- **today**: SPEC 3's equal pages, measured: ``plan_kv_memory(..., storage="equalized")`` (the
  equalized page, one row per page id in every layer's tensor; the layout vLLM-style storage
  uses, and no longer what a state model gets by default) gives the page size, the bytes
  per page and the pool; the request runs through a real ``FlatKVCache`` over the plan's groups,
  and its pages are counted after every schedule.
- **SPEC 13 (built)**: the arena of docs/architecture.md ("Hybrid storage"), planned by
  ``flat_kvcache.plan_arena`` (docs/sizing-api.md "Arena plan") and measured: the load runs
  through ``FlatKVCache(specs, arena=plan)`` (the plan's groups; 16-token attention pages, state
  pages of the checkpoint grain ``G = 64``, with prefix caching on), its prefill chunks cut by
  ``next_chunk(slot, 8,192)`` as a scheduler cuts them (8,192 + 8,128 + 64 for the state models:
  a chunk ends on a multiple of ``G``, the prompt's last token follows alone), then one decode
  step. The unit is one state slot (each state component aligned to 256 bytes) or, without
  state groups, the lcm of the attention pages' bytes when that is at most 4 pages, else the
  largest page.

Definitions, for what the request holds after the load (the figures of the issue this
reproduces), with the peak over the load's schedules beside them in ``--json``:

- *padding* is the share of the bytes the request holds that cannot hold its K/V or state.
  Today: its pages (one row per page id in every layer's tensor): tokens not yet written, rows
  of other groups. Built: the distinct real ids in its ``page_ids`` tables, an attention page at
  its page bytes (``ArenaGroup.item_bytes``) and a state slot at a unit; what is not padding is
  the K/V of the tokens written in its attention pages and the state's own bytes in each state
  slot (so a page's unwritten token slots and a slot's alignment are padding). The slack of the
  units the attention pages lie in (under a page per unit) is left out of ``padding`` (it is not
  the request's page bytes) and counted in ``padding_with_unit_slack`` (``--json``) and in the
  units behind *tokens that fit*.
- *tokens that fit* is ``floor(pool / held) * 16,384``, the pool and what the request holds in
  the units the storage hands out: pages today (the pool is the plan's pages but the null
  one); units built (the pool ``arena_stats()["units_total"]``, the plan's units but the null
  one; a state slot one unit, an attention page ``1 / pages_per_unit`` of one, since
  fullest-first placement packs the pages of many requests into shared units). The units the
  engine bound for this one request (``units_bound``, idle units of cached pages included) and
  the stranded bytes are in ``--json``.
- *smallest prefix hit*: today, the grain a prefix match ends on (the groups' lcm page size).
  Built, measured: after the load finishes, a second request shares its first ``G`` tokens (the
  attention pages' lcm without state groups) and one more; its chunks are cut by
  ``next_chunk(slot, G)`` (its first ends at ``G``), it finishes, and the column is
  ``prefix_hit_tokens`` of a third prompt sharing those tokens and one more. The second
  request's own hit at admission is ``hit_after_load`` in ``--json`` (0 for the state models:
  the load wrote no checkpoint at ``G``).

One state-model detail the built column shows: the load's 16,384 tokens are a multiple of
``G``, so the prompt's end is the request's first decode checkpoint (SPEC 13.5d); after the
decode step the request still holds it (a state group is a 2-token window, and the step read
it) beside its working slot, 2 state slots; it leaves the request's table at the next step.
The table gives that next step's tokens that fit in brackets where they differ; ``--json``
has them with its units (``units_held_next_decode``, ``tokens_that_fit_next_decode``).

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
import dataclasses
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
        storage="equalized",  # SPEC 3's equal pages, asked for: a state model's default is the arena
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


def _arena_specs(shape: ModelShape, plan: fk.ArenaPlan) -> list[fk.KVCacheSpec]:
    """The engine specs over the plan's groups: 16-token attention pages, state pages of the
    checkpoint grain (as ``simulate``'s ``engine_specs`` + ``state_page_size`` build them)."""
    groups = fk.group_specs_from_layer_types(list(shape.layer_types), shape.sliding_window, page_size=PAGE)
    specs = [
        dataclasses.replace(spec, page_size=CHECKPOINT_GRAIN) if spec.kind == "state" else spec
        for spec in fk.kv_cache_specs(groups)
    ]
    if [spec.group_id for spec in specs] != [group.group_id for group in plan.groups]:
        raise RuntimeError(
            f"the engine's groups {[s.group_id for s in specs]} are not the arena plan's "
            f"{[g.group_id for g in plan.groups]}"
        )
    return specs


class _Held:
    """What the request in ``slot`` holds now, read from the engine: its real page ids per group
    (distinct, holes 0 left out) and the bytes they take."""

    def __init__(self, cache: fk.FlatKVCache, slot: int, plan: fk.ArenaPlan, per_token: dict[str, int]):
        groups = plan.groups
        unit = plan.unit_bytes
        state_bytes = {
            g.group_id: sum(c.nbytes for c in plan.components if c.group_id == g.group_id)
            for g in groups
            if g.kind == "state"
        }
        tokens = cache.num_computed_tokens(slot)
        #: Real ids per group (attention pages or state slots).
        self.ids: dict[str, int] = {}
        self.held_bytes = 0  # pages at their page bytes, state slots at a unit each
        self.useful_bytes = 0  # K/V of the tokens written in the pages, the state's own bytes
        self.units = 0.0  # state slots whole, attention pages as the share of a unit they fill
        for group, table in zip(groups, cache.page_ids(slot), strict=True):
            real = {i: page for i, page in enumerate(table) if page}
            n = len(set(real.values()))
            self.ids[group.group_id] = n
            if group.kind == "state":
                self.held_bytes += n * unit
                self.useful_bytes += n * state_bytes[group.group_id]  # each slot holds one state
                self.units += n
            else:
                self.held_bytes += n * group.item_bytes
                written = sum(min(tokens, (i + 1) * PAGE) - i * PAGE for i in real)
                self.useful_bytes += written * per_token[group.group_id]
                self.units += n / group.per_unit
        #: The same bytes with each attention page's share of its unit's slack added.
        self.unit_bytes_held = self.units * unit

    @property
    def padding(self) -> float:
        return 1 - self.useful_bytes / self.held_bytes

    @property
    def padding_with_unit_slack(self) -> float:
        return 1 - self.useful_bytes / self.unit_bytes_held


def _run_chunks(cache: fk.FlatKVCache, slot: int, limit: int, after: Callable[[], None]) -> list[int]:
    """Prefill the request in ``slot`` in the chunks ``next_chunk(slot, limit)`` cuts, calling
    ``after`` after each schedule; returns the chunks."""
    chunks = []
    while (chunk := cache.next_chunk(slot, limit)) > 0:
        if not cache.schedule([slot], [chunk]).all():
            raise RuntimeError("the arena cannot hold the reference request")
        chunks.append(chunk)
        after()
    return chunks


def built(shape: ModelShape) -> dict[str, Any]:
    """The SPEC 13 arena, measured: the load runs through ``FlatKVCache(specs, arena=plan)``."""
    plan = fk.plan_arena(shape.components(), PAGE, BUDGET)
    specs = _arena_specs(shape, plan)
    per_token, _ = _layer_bytes(shape)
    has_state = any(spec.kind == "state" for spec in specs)
    cache = fk.FlatKVCache(specs, arena=plan)

    def arena() -> dict[str, Any]:
        stats = cache.arena_stats()
        if stats is None:
            raise RuntimeError("FlatKVCache(arena=...) reported no arena")
        return stats

    prompt = list(range(PROMPT))
    slot, _ = cache.add_request("load", prompt)
    steps: list[_Held] = []
    stranded: list[int] = []

    def record() -> None:
        steps.append(_Held(cache, slot, plan, per_token))
        stranded.append(arena()["stranded_bytes"])

    chunks = _run_chunks(cache, slot, CHUNK, record)
    cache.append_tokens([slot], [PROMPT])
    if not cache.schedule([slot], [1]).all():
        raise RuntimeError("the arena cannot hold the reference request's decode step")
    record()
    after, stats = steps[-1], arena()
    pool = stats["units_total"]  # the units but the null one: num_units - 1
    at_peak = max(steps, key=lambda step: step.units)
    peak = at_peak.units
    # One decode step more: the state checkpoint of the prompt's end slides out of the request's
    # table (a state group is a 2-token window), leaving its working slot.
    cache.append_tokens([slot], [PROMPT + 1])
    if not cache.schedule([slot], [1]).all():
        raise RuntimeError("the arena cannot hold the reference request's second decode step")
    next_decode = _Held(cache, slot, plan, per_token)
    cache.finish([slot])

    # Smallest prefix hit: a second request sharing the load's first `grain` tokens and one more.
    grain = CHECKPOINT_GRAIN if has_state else math.lcm(*(s.page_size for s in specs if s.kind != "state"))
    second = [*prompt[:grain], PROMPT + 2]
    slot, hit_after_load = cache.add_request("second", second)
    probe_chunks = _run_chunks(cache, slot, grain, lambda: None)
    cache.finish([slot])
    smallest_hit = cache.prefix_hit_tokens([*prompt[:grain], PROMPT + 3])
    return {
        "unit_bytes": plan.unit_bytes,
        "num_units": plan.num_units,
        "units_total": pool,
        "pages_per_unit": {g.group_id: g.per_unit for g in plan.groups if g.kind == "pages"},
        "page_bytes": {g.group_id: g.item_bytes for g in plan.groups if g.kind == "pages"},
        "state_page_tokens": CHECKPOINT_GRAIN if has_state else None,
        "chunks": chunks,
        "ids_held": after.ids,
        "held_bytes": after.held_bytes,
        "useful_bytes": after.useful_bytes,
        "padding": after.padding,
        "padding_with_unit_slack": after.padding_with_unit_slack,
        "padding_at_peak": at_peak.padding,
        "units_held": after.units,
        "units_held_peak": peak,
        "tokens_that_fit": int(pool // after.units) * PROMPT,
        "tokens_that_fit_at_peak": int(pool // peak) * PROMPT,
        "units_held_next_decode": next_decode.units,
        "tokens_that_fit_next_decode": int(pool // next_decode.units) * PROMPT,
        "units_bound": stats["units_bound"],
        "units_idle": stats["units_idle"],
        "units_free": stats["units_free"],
        "pages_free": stats["pages_free"],
        "stranded_bytes": stats["stranded_bytes"],
        "stranded_bytes_peak": max(stranded),
        "hit_probe_tokens": grain,
        "hit_after_load": hit_after_load,
        "hit_probe_chunks": probe_chunks,
        "smallest_hit": smallest_hit,
    }


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
            "built": built(shape),
        }
    return out


def _millions(tokens: int) -> str:
    return f"{tokens / 1e6:.2f} M"


def _next_decode(built: dict[str, Any]) -> str:
    """The tokens that fit one decode step later, in brackets, where they differ."""
    later = built["tokens_that_fit_next_decode"]
    return "" if later == built["tokens_that_fit"] else f" ({_millions(later)})"


def table(results: dict[str, dict[str, Any]], vllm: dict[str, dict[str, Any]] | None) -> str:
    head = "| model | today: page, smallest hit, padding, fit | SPEC 13 (built): unit, hit, padding, fit |"
    rows = [head, "|---|---|---|" + ("---|" if vllm else "")]
    if vllm:
        rows[0] = head + " vLLM 0.33: block, hit, padding, fit |"
    for name, r in results.items():
        t, d = r["today"], r["built"]
        line = (
            f"| {name} | {t['page_tokens']:,} tokens, {t['smallest_hit']:,}, {t['padding']:.1%}, "
            f"{_millions(t['tokens_that_fit'])} | {d['unit_bytes'] / 2**20:.2f} MiB, {d['smallest_hit']}, "
            f"{d['padding']:.1%}, {_millions(d['tokens_that_fit'])}{_next_decode(d)} |"
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
