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


def test_state_model_plans_with_the_raised_page_size(capsys: pytest.CaptureFixture[str]) -> None:
    got = run_json(capsys, "--preset", "qwen3.5-like", "--memory", "40GiB", "--max-live-requests", "8")
    page_size = got["memory"]["page_size"]
    assert page_size > 16 and got["settings"]["page_size"] == page_size
    assert all(group["rows_per_page"] == page_size for group in got["groups"])
    status, out, _ = run_cli(capsys, "plan", "--preset", "qwen3.5-like", "--memory", "40GiB")
    assert status == 0 and f"{page_size} tokens (raised from 16" in out


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
