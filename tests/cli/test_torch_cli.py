"""`flat-kvcache plan --memory / --device`: the memory plan in the table and the JSON."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from helpers import missing, run_cli, run_python

try:
    import torch
except ImportError as exc:
    missing("torch", exc)

import flat_kvcache
from flat_kvcache.presets import get_preset
from flat_kvcache.torch import ModelShape, plan_kv_memory

pytestmark = pytest.mark.torch

GiB = 1 << 30


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    status, out, err = run_cli(capsys, "plan", *argv, "--json")
    assert status == 0, err
    result: dict[str, Any] = json.loads(out)
    return result


def expected(preset: str, budget: int, **kwargs: Any) -> dict[str, Any]:
    shape = ModelShape.preset(preset, kv_dtype=kwargs.pop("kv_dtype", None))
    limits = {"max_live_requests": 256, "max_scheduled_tokens": 8192}
    context = get_preset(preset)["max_position_embeddings"]
    plan = plan_kv_memory(
        shape, page_size=16, budget_bytes=budget, max_context_len=context, **{**limits, **kwargs}
    )
    return plan.summary()


def test_memory_in_the_json(capsys: pytest.CaptureFixture[str]) -> None:
    got = run_json(capsys, "--memory", "80GiB")
    memory = got["memory"]
    assert {k: memory[k] for k in expected("gpt-oss-like", 80 * GiB)} == expected("gpt-oss-like", 80 * GiB)
    assert memory["kv_dtype"] == "bfloat16" and memory["device"] is None
    assert memory["requested_page_size"] == 16 and memory["allocator_slack_bytes"] == 0
    assert (memory["slab_saving_bytes"] > 0) is flat_kvcache.FLAT_KVCACHE  # slabs need the flat feature
    # The tokens that fit with every group at its worst case bound the page counts unless
    # --max-total-tokens is given (tests/cli/test_cli_memory.py derives the number).
    assert got["settings"]["max_total_tokens"] == got["pool"]["max_total_tokens_that_fit"]
    assert got["pool"]["fits"] is True and got["pool"]["num_pages"] == memory["num_pages"]
    assert (
        run_json(capsys, "--memory", "80GiB", "--max-total-tokens", "1000")["settings"]["max_total_tokens"]
        == 1000
    )


def test_memory_in_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run_cli(capsys, "plan", "--memory", "80GiB")
    assert status == 0
    want = expected("gpt-oss-like", 80 * GiB)
    memory = out[out.index("\nmemory:") :]
    for label, value in [
        ("bytes per page", want["bytes_per_page"]),
        ("pages", want["num_pages"]),
    ]:
        assert f"  {label}" in memory and str(value) in memory.split(f"  {label}")[1].splitlines()[0]
    # The pool's token slots, on the line under "tokens that fit".
    assert f"{want['tokens_that_fit']} token slots" in memory.split("  tokens that fit")[1].splitlines()[1]
    assert "budget           85899345920 bytes (80.00 GiB)" in memory
    assert "group" in out and "table width" in out  # the group table is still there


def test_a_state_model_gets_the_arena(capsys: pytest.CaptureFixture[str]) -> None:
    """A model with state layers is planned on the SPEC 13 arena unless --storage equalized asks
    for SPEC 3's equal pages: 16-token attention pages, the arena plan_arena_memory plans for
    the budget, and no raised page or pool of pages in the plan."""
    from flat_kvcache.torch import plan_arena_memory

    argv = ["--preset", "qwen3.5-like", "--memory", "40GiB", "--max-live-requests", "8"]
    got = run_json(capsys, *argv)
    memory = got["memory"]
    limits = {"max_live_requests": 8, "max_scheduled_tokens": 8192, "max_context_len": 262144}
    arena = plan_arena_memory(
        ModelShape.preset("qwen3.5-like"), page_size=16, budget_bytes=40 * GiB, **limits
    )
    assert memory["storage"] == "arena" and memory["page_size"] == got["settings"]["page_size"] == 16
    assert (memory["arena"]["unit_bytes"], memory["arena"]["num_units"]) == (
        arena.arena.unit_bytes,
        arena.arena.num_units,
    )
    assert memory["total_bytes"] == arena.total_bytes and "num_pages" not in memory
    assert got["pool"]["num_pages"] is None
    status, out, _ = run_cli(capsys, "plan", *argv)
    assert status == 0 and "memory (storage: arena" in out and "raised from 16" not in out
    assert "--storage equalized for SPEC 3's equal pages, the layout vLLM-style storage uses" in " ".join(
        out.split()
    )


def test_equalized_storage_is_asked_for(capsys: pytest.CaptureFixture[str]) -> None:
    """--storage equalized: SPEC 3's plan, the page raised until it holds a state (the arena of
    the same budget after it)."""
    argv = [
        "--preset",
        "qwen3.5-like",
        "--memory",
        "40GiB",
        "--max-live-requests",
        "8",
        "--storage",
        "equalized",
    ]
    got = run_json(capsys, *argv)
    page_size = got["memory"]["page_size"]
    assert got["memory"]["storage"] == "equalized" and "arena" in got["memory"]
    assert page_size > 16 and got["settings"]["page_size"] == page_size
    assert all(group["rows_per_page"] == page_size for group in got["groups"])
    status, out, _ = run_cli(capsys, "plan", *argv)
    assert status == 0 and f"{page_size} tokens (raised from 16" in out
    assert "equalized (SPEC 3: one pool of equal pages, the layout vLLM-style storage uses)" in out
    # An attention-only model is planned as before: equal pages first, the arena after them.
    plain = run_json(capsys, "--memory", "40GiB")["memory"]
    assert plain["storage"] == "equalized" and plain["page_size"] == 16 and "arena" in plain
    assert plain == run_json(capsys, "--memory", "40GiB", "--storage", "equalized")["memory"]


# state-spaces/mamba-130m-hf (its config.json): 24 mamba layers, nothing keeps K/V.
MAMBA_130M = {
    "model_type": "mamba",
    "num_hidden_layers": 24,
    "hidden_size": 768,
    "state_size": 16,
    "conv_kernel": 4,
    "expand": 2,
    "intermediate_size": 1536,
    "time_step_rank": 48,
}


def test_a_pure_state_model_is_planned_on_the_arena(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A pure Mamba model: --memory plans its arena (a state slot per unit, so every usable unit
    holds one request of any length); --storage equalized is refused naming that option (not
    --device, which was never given)."""
    from flat_kvcache.torch import plan_arena_memory

    path = tmp_path / "config.json"
    path.write_text(json.dumps(MAMBA_130M), encoding="utf-8")
    argv = ["--config", str(path), "--memory", "80GiB", "--kv-dtype", "bfloat16"]
    memory = run_json(capsys, *argv)["memory"]
    shape = ModelShape.from_config(MAMBA_130M, kv_dtype=torch.bfloat16)
    limits = {"max_live_requests": 256, "max_scheduled_tokens": 8192, "max_context_len": 131072}
    plan = plan_arena_memory(shape, page_size=16, budget_bytes=80 * GiB, **limits).arena
    arena = memory["arena"]
    assert memory["storage"] == "arena" and arena["num_units"] == plan.num_units
    assert arena["reference_requests_that_fit"] == plan.num_units - 1
    assert [g["kind"] for g in arena["groups"]] == ["state"]
    status, out, err = run_cli(capsys, "plan", *argv, "--storage", "equalized")
    assert (status, out) == (1, "") and err.count("\n") == 1
    assert err.startswith("flat-kvcache: error: --storage equalized: every one of the 24 cache layers")
    assert "--device" not in err and "leave out --storage equalized" in err


def test_kv_dtype_and_config_path(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(get_preset("llama3-8b-like")))
    bf16 = run_json(capsys, "--config", str(path), "--memory", "8GiB")["memory"]
    fp8 = run_json(capsys, "--config", str(path), "--memory", "8GiB", "--kv-dtype", "fp8_e4m3")["memory"]
    assert fp8["kv_dtype"] == "float8_e4m3fn" and fp8["bytes_per_page"] * 2 == bf16["bytes_per_page"]
    assert bf16 == {**bf16, **expected("llama3-8b-like", 8 * GiB)}


@pytest.mark.parametrize(
    ("size", "nbytes"),
    [("80GiB", 80 * GiB), ("512M", 512 << 20), ("1.5GB", 1_500_000_000), ("100000000", 100_000_000)],
)
def test_memory_sizes(capsys: pytest.CaptureFixture[str], size: str, nbytes: int) -> None:
    assert run_json(capsys, "--memory", size)["memory"]["budget_bytes"] == nbytes


def test_device_budget(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (60 * GiB, 80 * GiB))
    memory = run_json(capsys, "--device", "cuda", "--utilization", "0.5")["memory"]
    assert memory["budget_bytes"] == 60 * GiB - 40 * GiB
    assert memory["device"] == "cuda" and memory["allocator_slack_bytes"] > 0
    assert memory["total_bytes"] <= memory["budget_bytes"] - memory["allocator_slack_bytes"]
    status, out, _ = run_cli(capsys, "plan", "--device", "cuda:0", "--memory", "10GiB")
    assert status == 0 and "on cuda:0" in out and "allocator slack" in out


@pytest.mark.parametrize(
    ("argv", "status", "message"),
    [
        (["--memory", "lots"], 2, "argument --memory: expected a size such as 80GiB"),
        (["--memory", "-1"], 2, "argument --memory: expected a size"),
        (["--memory", "1GiB", "--utilization", "0"], 2, "argument --utilization: must be in (0, 1]"),
        (["--kv-dtype", "fp8"], 2, "--kv-dtype needs --memory or --device"),
        (["--storage", "arena"], 2, "--storage needs --memory or --device"),
        (["--memory", "1GiB", "--storage", "pages"], 2, "argument --storage: invalid choice: 'pages'"),
        (["--device", "cpu"], 1, "--device cpu: only CUDA devices report free memory; pass --memory"),
        (["--device", "nope", "--memory", "1GiB"], 1, "--device nope:"),
        (["--memory", "1000"], 1, "--memory 1000 gives 0 blocks"),
        (["--memory", "1GiB", "--kv-dtype", "int8"], 1, "--kv-dtype must be a floating dtype"),
    ],
)
def test_errors(capsys: pytest.CaptureFixture[str], argv: list[str], status: int, message: str) -> None:
    got, out, err = run_cli(capsys, "plan", *argv)
    assert (got, out) == (status, "")
    assert err.startswith("flat-kvcache: error: ") and message in err and err.count("\n") == 1


def test_cuda_missing(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    status, _, err = run_cli(capsys, "plan", "--device", "cuda")
    assert status == 1 and "CUDA is not available" in err


def without_torch(*argv: str) -> subprocess.CompletedProcess[str]:
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from flat_kvcache.cli import main\n"
        f"status = main({['plan', *argv]!r})\n"
        "assert 'torch' not in sys.modules or sys.modules['torch'] is None\n"
        "sys.exit(status)\n"
    )
    return run_python("-c", code)


def test_torch_is_only_needed_for_memory() -> None:
    plain = without_torch()
    assert plain.returncode == 0, plain.stderr
    assert "memory:" not in plain.stdout
    memory = without_torch("--memory", "80GiB")
    assert memory.returncode == 1
    assert "flat-kvcache: error: --memory/--device:" in memory.stderr
    assert "pip install '.[torch]'" in memory.stderr
