"""``flat-kvcache plan --memory``: what fits together in the one pool, the K/V slab layout, and
block-table widths against the buffers ``flat_kvcache.torch`` builds.

Expected numbers are derived here from the model's shape and SPEC 2 / 3, not read off the code.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import flat_kvcache
import pytest
from helpers import JAMBA_V01, missing, run_cli

try:
    import torch
except ImportError as exc:
    missing("torch", exc)

from flat_kvcache.config import group_specs_from_config, load_model_config
from flat_kvcache.presets import get_preset
from flat_kvcache.torch import CaptureBuffers, ModelShape

pytestmark = [
    pytest.mark.torch,
    pytest.mark.skipif(not flat_kvcache.FLAT_KVCACHE, reason="slabs need the flat build"),
]

GiB = 1 << 30
# gpt-oss-like: 24 layers (12 sliding W=128, 12 full), 8 K/V heads of 64, bf16, 16-token pages.
# One page id covers 16 tokens of one layer of each label in a slab pair (K and V):
#   slab bytes per page = 12 slabs x 2 (K, V) x 16 tokens x 8 heads x 64 x 2 bytes = 393216
#   per-layer K/V bytes per page (every layer its own rows) = 2 x 393216 = 786432
#   80 GiB = 85899345920 bytes: 85899345920 // 393216 = 218453 pages; per-layer // 786432 = 109226
NUM_PAGES, PER_LAYER_PAGES = 218453, 109226
# SPEC 2 with B=256, S=8192, C=131072, P=16: sliding = 256*8 + 512 + 256 + 1 = 2817 (T >= S);
# full = ceil(T/16) + 256 + 1. Every worst case at once, the null page counted once:
#   1 + 2816 + (ceil(T/16) + 256) <= 218453  <=>  ceil(T/16) <= 215380  <=>  T <= 215380 * 16
TOKENS_THAT_FIT = 215380 * 16  # 3446080


def plan_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    status, out, err = run_cli(capsys, "plan", "--json", *argv)
    assert status == 0, err
    plan: dict[str, Any] = json.loads(out)
    return plan


def test_pool_and_what_fits_together(capsys: pytest.CaptureFixture[str]) -> None:
    plan = plan_json(capsys, "--memory", "80GiB")
    assert plan["memory"]["num_pages"] == NUM_PAGES
    assert plan["settings"]["max_total_tokens"] == TOKENS_THAT_FIT
    assert {g["group_id"]: g["max_pages"] for g in plan["groups"]} == {
        "sliding_attention": 2817,
        "full_attention": 215380 + 256 + 1,
    }
    assert plan["pool"] == {
        "pages_for_all_worst_cases": NUM_PAGES,
        "num_pages": NUM_PAGES,
        "fits": True,
        "max_total_tokens_that_fit": TOKENS_THAT_FIT,
    }
    # One token more and the worst cases need one page more than the pool.
    over = plan_json(capsys, "--memory", "80GiB", "--max-total-tokens", str(TOKENS_THAT_FIT + 1))
    assert over["pool"]["pages_for_all_worst_cases"] == NUM_PAGES + 1 and over["pool"]["fits"] is False


def test_the_table_says_what_the_numbers_are(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run_cli(capsys, "plan", "--memory", "80GiB")
    text = " ".join(out.split())
    assert status == 0
    assert "one shared pool" in text and "do not add up" in text
    assert f"a pool of {NUM_PAGES} pages holds every group's worst case at once" in text
    assert f"tokens that fit {TOKENS_THAT_FIT} with every group at its worst case at once" in text
    # A max_total_tokens the pool cannot hold: the full group alone wants more than the pool.
    status, out, _ = run_cli(capsys, "plan", "--memory", "80GiB", "--max-total-tokens", "3495232")
    text = " ".join(out.split())
    assert status == 0 and "requests wait or are preempted" in text
    assert "full_attention alone can want more than all of it" in text


def test_slab_layout_says_what_per_layer_buffers_would_fit(capsys: pytest.CaptureFixture[str]) -> None:
    """No "slab saving" of the whole budget: the same budget, two layouts, two page counts."""
    plan = plan_json(capsys, "--memory", "80GiB")
    assert plan["memory"]["per_layer_num_pages"] == PER_LAYER_PAGES
    status, out, _ = run_cli(capsys, "plan", "--memory", "80GiB")
    assert status == 0 and "saving" not in out
    [layout] = [line for line in out.splitlines() if line.strip().startswith("K/V layout")]
    assert "12 slabs" in layout and f"{PER_LAYER_PAGES} pages with per-layer K/V buffers" in layout
    # Without slab pairing (one label) the layout says so and both layouts have the same pages.
    llama = plan_json(capsys, "--preset", "llama3-8b-like", "--memory", "8GiB")
    assert llama["memory"]["per_layer_num_pages"] == llama["memory"]["num_pages"]
    status, out, _ = run_cli(capsys, "plan", "--preset", "llama3-8b-like", "--memory", "8GiB")
    assert status == 0 and "one K and one V buffer per attention layer (no slab pairing)" in out


@pytest.mark.parametrize("context", [1000, 4096])
def test_widths_are_the_capture_buffers(capsys: pytest.CaptureFixture[str], context: int) -> None:
    """``table width`` is what ``CaptureBuffers`` (absolute tables) allocates for every group,
    ``windowed`` what it allocates for a sliding group with ``sliding_offsets=True``."""
    plan = plan_json(capsys, "--max-context-len", str(context))
    from flat_kvcache.config import group_specs_from_config

    groups = group_specs_from_config(get_preset("gpt-oss-like"), page_size=16)
    absolute = CaptureBuffers(groups, max_batch_size=2, max_context_len=context)
    windowed = CaptureBuffers(groups, max_batch_size=2, max_context_len=context, sliding_offsets=True)
    for group in plan["groups"]:
        gid = group["group_id"]
        assert group["table_width"] == absolute.width(gid) == -(-(context + 1) // 16)
        if gid == "sliding_attention":
            assert group["windowed_width"] == windowed.width(gid) == -(-(128 + 1) // 16) + 1
        else:
            assert group["windowed_width"] is None and windowed.width(gid) == group["table_width"]


def test_the_arena_section_for_gpt_oss(capsys: pytest.CaptureFixture[str]) -> None:
    """The SPEC 13 storage of the same 80 GiB: pages of 16 x 12 layers x 2 (K, V) x 8 heads x
    64 x 2 bytes = 393216 bytes in both groups, so the unit is one page (the lcm): 218453 units.
    A 16,384-token request holds 1024 full pages and 8 sliding ones (the window its last token
    attends to, tokens 16256 .. 16383), all written to: no padding; 218452 usable units // 1032
    = 211 such requests fit."""
    status, out, err = run_cli(capsys, "plan", "--preset", "gpt-oss-like", "--memory", "80GiB", "--json")
    assert status == 0, err
    arena = json.loads(out)["memory"]["arena"]
    assert (arena["unit_bytes"], arena["num_units"]) == (393216, 218453)
    assert {g["group_id"]: g["held"] for g in arena["groups"]} == {
        "sliding_attention": 8,
        "full_attention": 1024,
    }
    assert arena["reference_held_bytes"] == 1032 * 393216
    assert arena["reference_padding"] == 0
    assert arena["reference_tokens_that_fit"] == 211 * 16384


def test_the_arena_section_for_a_state_model(capsys: pytest.CaptureFixture[str]) -> None:
    """qwen3.5-like: the unit is the state slot (every state component of the 36 linear layers,
    each aligned); a 16,384-token request holds one working slot and 1024 full pages."""
    status, out, err = run_cli(capsys, "plan", "--preset", "qwen3.5-like", "--memory", "80GiB", "--json")
    assert status == 0, err
    arena = json.loads(out)["memory"]["arena"]
    unit = arena["unit_bytes"]
    page = next(g["item_bytes"] for g in arena["groups"] if g["kind"] == "pages")
    # 12 full layers x 2 (K, V) x 16 tokens x kv heads x head dim x 2 bytes, from the preset.
    cfg = get_preset("qwen3.5-like")
    assert page == 12 * 2 * 16 * cfg["num_key_value_heads"] * cfg["head_dim"] * 2
    assert {g["group_id"]: g["held"] for g in arena["groups"]} == {
        "linear_attention": 1,
        "full_attention": 1024,
    }
    # The unit is 196.5 pages of bytes: units start on a page boundary or half a page in, and
    # hold 196 pages each either way, half a page left over. Pages of many requests share units,
    # so a request takes its slot and 1024 / 196 units: N requests fit while N + ceil(N * 1024 /
    # 196) <= num_units - 1.
    assert 2 * unit == 393 * page
    assert arena["reference_held_bytes"] == round(unit + 1024 * unit / 196)
    usable = arena["num_units"] - 1
    fit = max(n for n in range(usable + 1) if n + -(-n * 1024 // 196) <= usable)
    assert arena["reference_requests_that_fit"] == fit
    assert arena["reference_tokens_that_fit"] == fit * 16384


def test_a_budget_without_a_working_slot_per_live_request_is_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """10 GiB of the qwen3.5-like arena is 138 units: 137 working state slots for 256 live
    requests. The error names the options."""
    status, _, err = run_cli(capsys, "plan", "--preset", "qwen3.5-like", "--memory", "10GiB")
    assert status == 1
    assert "--memory 10737418240 gives 138 units" in err
    assert "137 working state slots, fewer than --max-live-requests 256" in err
    status, _, err = run_cli(
        capsys, "plan", "--preset", "qwen3.5-like", "--memory", "10GiB", "--max-live-requests", "137"
    )
    assert status == 0, err


# --- what the arena holds, measured on the engine ------------------------------------------------

# ai21labs/Jamba-v0.1 (helpers.JAMBA_V01): 4 attention layers of 8 K/V heads of 128 among 32.
# At bf16 a 16-token page is 4 x 2 x 16 x 8 x 128 x 2 = 262144 bytes and the unit (the state
# slot) 61.25 pages of bytes: units hold 60 or 61.
#: The request ``plan --memory`` reports on, and the chunk a scheduler cuts its prompt into.
TOKENS, CHUNK = 16_384, 8_192


def engine_holds(cfg: dict[str, Any], plan: flat_kvcache.ArenaPlan) -> tuple[int, float, list[int]]:
    """Requests of ``TOKENS`` tokens the engine holds at once on ``plan``: each admitted
    (``admit``, a prompt of ``TOKENS - 1`` distinct tokens, ``next_chunk`` cuts of ``CHUNK``)
    and prefilled, then one decode step computes its last token; the next one comes until the
    engine refuses. Returns how many it held, the padding of the units they keep busy (the share
    of their bytes that holds no K/V of a written token and no state), and the ids per group the
    last one holds."""
    specs = [
        dataclasses.replace(spec, page_size=64) if spec.kind == "state" else spec
        for spec in flat_kvcache.kv_cache_specs(group_specs_from_config(cfg, page_size=16))
    ]
    cache = flat_kvcache.FlatKVCache(specs, arena=plan)
    unit = plan.unit_bytes
    state = {g.group_id for g in plan.groups if g.kind == "state"}
    state_bytes = sum(c.nbytes for c in plan.components if c.group_id in state)
    useful, held = 0, 0
    ids: list[int] = []
    for n in range(plan.num_units):
        prompt = [n * TOKENS + i for i in range(TOKENS - 1)]
        admitted = cache.admit(f"r{n}", prompt, CHUNK)
        if admitted is None:
            break
        slot, _, chunk = admitted
        while chunk > 0 and cache.schedule([slot], [chunk])[0]:
            chunk = cache.next_chunk(slot, CHUNK)
        if chunk > 0:
            break
        cache.append_tokens([slot], [7])
        if not cache.schedule([slot], [1])[0]:
            break
        assert cache.num_computed_tokens(slot) == TOKENS
        ids = []
        for group, table in zip(plan.groups, cache.page_ids(slot), strict=True):
            real = {i: page for i, page in enumerate(table) if page}
            ids.append(len(set(real.values())))
            if group.kind == "state":
                useful += len(set(real.values())) * state_bytes
            else:
                written = sum(min(TOKENS, (i + 1) * 16) - i * 16 for i in real)
                useful += written * group.item_bytes // 16
        stats = cache.arena_stats()
        assert stats is not None
        held = (sum(stats["units_bound"].values()) - stats["units_idle"]) * unit
    else:
        raise AssertionError("every unit was taken and the engine still admits")
    return n, 1 - useful / held, ids


@pytest.mark.parametrize("model", ["jamba-v0.1", "qwen3.5-like", "gpt-oss-like"])
def test_the_arena_figures_are_what_the_engine_holds(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, model: str
) -> None:
    """``plan --memory``'s requests that fit, padding and pages held are the engine's, measured:
    the arena it plans is built (``FlatKVCache(specs, arena=plan)``) and filled with such
    requests until it refuses. Jamba's units hold 60 or 61 pages (a page straddling two units
    is never handed out), qwen3.5-like's 196 with half a page left over, gpt-oss-like's one."""
    if model == "jamba-v0.1":
        (tmp_path / "config.json").write_text(json.dumps(JAMBA_V01), encoding="utf-8")
        argv = ["--config", str(tmp_path / "config.json"), "--kv-dtype", "bfloat16"]
        cfg = load_model_config(tmp_path / "config.json")
    else:
        argv = ["--preset", model]
        cfg = load_model_config(model)
    status, out, err = run_cli(capsys, "plan", "--json", "--memory", "80GiB", *argv)
    assert status == 0, err
    arena = json.loads(out)["memory"]["arena"]
    shape = ModelShape.from_config(cfg, kv_dtype=torch.bfloat16 if model == "jamba-v0.1" else None)
    plan = flat_kvcache.plan_arena(shape.components(), 16, 80 * GiB, max_live_requests=256)
    assert (arena["unit_bytes"], arena["num_units"]) == (plan.unit_bytes, plan.num_units)
    fit, padding, ids = engine_holds(cfg, plan)
    assert arena["reference_tokens"] == TOKENS
    assert arena["reference_requests_that_fit"] == fit
    assert arena["reference_tokens_that_fit"] == fit * TOKENS
    assert [g["held"] for g in arena["groups"]] == ids
    assert abs(arena["reference_padding"] - padding) < 5e-4
