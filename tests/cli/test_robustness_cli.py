"""Robustness sweep of the command line: every bad input is one ``flat-kvcache: error:`` line on
stderr naming the option, with a non-zero exit status and no traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import need, run_cli

#: (arguments, the option the message must name, exit status).
BAD_PLAN = [
    (["--kv-dtype", "nope", "--memory", "1GiB"], "--kv-dtype", 1),
    (["--kv-dtype", "int8", "--memory", "1GiB"], "--kv-dtype", 1),
    (["--kv-dtype", "bf16"], "--kv-dtype", 2),
    (["--memory", "abc"], "--memory", 2),
    (["--memory", "-1"], "--memory", 2),
    (["--memory", "1"], "--memory", 1),
    (["--page-size", "0"], "--page-size", 2),
    (["--page-size", "1.5"], "--page-size", 2),
    (["--utilization", "2", "--device", "cuda"], "--utilization", 2),
    (["--max-live-requests", "-1"], "--max-live-requests", 2),
    (["--overlap-schedule-depth", "2"], "--overlap-schedule-depth", 2),
    (["--device", "cpu"], "--device", 1),
    (["--preset", "nope"], "--preset", 1),
    (["--config", "/nonexistent/config.json"], "--config", 1),
    (["--preset", "gpt-oss-like", "--config", "x.json"], "--config", 2),
]


#: The cases that build a memory plan need torch (the ``torch`` marker).
BAD_PLAN_CASES = [
    pytest.param(
        *case,
        marks=[pytest.mark.torch] if {"--memory", "--kv-dtype"} & set(case[0]) else [],
        id=" ".join(case[0]),
    )
    for case in BAD_PLAN
]


def _check_one_line(status: int, err: str, option: str, expected_status: int) -> None:
    assert status == expected_status, err
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("flat-kvcache: error: "), err
    assert option in lines[0], f"the message does not name {option}: {err}"


@pytest.mark.parametrize(("argv", "option", "expected"), BAD_PLAN_CASES)
def test_bad_plan_option_is_one_line(
    capsys: pytest.CaptureFixture[str], argv: list[str], option: str, expected: int
) -> None:
    if "--memory" in argv or "--kv-dtype" in argv:
        need("torch")
    status, out, err = run_cli(capsys, "plan", *argv)
    _check_one_line(status, err, option, expected)
    assert out == ""


@pytest.mark.parametrize(
    "content", ["{bad", "[1]", '{"layer_types": "full_attention"}'], ids=["invalid", "list", "str-layers"]
)
def test_bad_config_file_names_the_option(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, content: str
) -> None:
    path = tmp_path / "config.json"
    path.write_text(content, encoding="utf-8")
    status, _, err = run_cli(capsys, "plan", "--config", str(path))
    _check_one_line(status, err, "--config", 1)


def test_bad_demo_option_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    status, _, err = run_cli(capsys, "demo", "--bogus")
    _check_one_line(status, err, "--bogus", 2)
    status, _, err = run_cli(capsys, "demo", "--num-pages", "3")
    _check_one_line(status, err, "--num-pages", 2)


def _qwen3_next_config(tmp_path: Path) -> Path:
    """A Qwen3-Next config as transformers writes one built in code: no dtype key."""
    transformers = need("transformers")
    path = tmp_path / "config.json"
    transformers.Qwen3NextConfig().to_json_file(str(path))
    cfg = json.loads(path.read_text(encoding="utf-8"))
    assert cfg.get("torch_dtype") is None and cfg.get("dtype") is None
    return path


@pytest.mark.torch
def test_kv_dtype_option_serves_a_config_without_dtype(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """--kv-dtype is the K/V dtype and, for lack of a model dtype, the conv state's too."""
    need("torch")
    path = _qwen3_next_config(tmp_path)
    status, out, err = run_cli(
        capsys, "plan", "--config", str(path), "--memory", "80GiB", "--kv-dtype", "bfloat16", "--json"
    )
    assert status == 0, err
    memory = json.loads(out)["memory"]
    assert memory["kv_dtype"] == "bfloat16"
    assert memory["arena"]["unit_bytes"] > 0 and memory["arena"]["num_units"] > 1


@pytest.mark.torch
def test_config_without_dtype_needs_the_option(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    need("torch")
    path = _qwen3_next_config(tmp_path)
    status, _, err = run_cli(capsys, "plan", "--config", str(path), "--memory", "80GiB")
    _check_one_line(status, err, "--kv-dtype", 1)
    assert "kv_dtype=" not in err


@pytest.mark.torch
def test_fp8_cannot_hold_the_conv_state(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """A one-byte K/V dtype is not a state dtype: the message says what to add."""
    need("torch")
    path = _qwen3_next_config(tmp_path)
    status, _, err = run_cli(capsys, "plan", "--config", str(path), "--memory", "80GiB", "--kv-dtype", "fp8")
    _check_one_line(status, err, "--kv-dtype", 1)
    assert "torch_dtype" in err


@pytest.mark.torch
def test_shape_from_config_without_dtype_takes_kv_dtype(tmp_path: Path) -> None:
    """The library call behind the option: conv state in the K/V dtype, ssm state in float32."""
    torch = need("torch")
    from flat_kvcache.torch import ModelShape

    path = _qwen3_next_config(tmp_path)
    shape = ModelShape.from_config(path, kv_dtype="float16")
    assert shape.state_dtypes is not None
    assert shape.kv_dtype == torch.float16
    assert dict(shape.state_dtypes) == {"conv": torch.float16, "ssm": torch.float32}
    with pytest.raises(ValueError, match="kv_dtype="):
        ModelShape.from_config(path)


#: Bad ``simulate`` inputs: (arguments, the option the message must name, exit status).
BAD_SIMULATE = [
    (["--trace", "/nonexistent/trace.jsonl"], "--trace", 1),
    (["--preset", "nope"], "--preset", 1),
    (["--preset", "/nonexistent/config.json"], "--preset", 1),
    (["--config", "/nonexistent/config.json"], "--config", 1),
    # A pool that cannot hold one token of a request (a page per group besides page 0): refused
    # before the run, as a usage error.
    (["--num-pages", "2", "--num-requests", "3"], "--num-pages", 2),
    # One that holds a token but never a whole prompt: every request aborted, nothing measured.
    (["--num-pages", "60", "--num-requests", "3"], "--num-pages", 1),
    (["--plot", "/nonexistent/folder/run.png", "--num-requests", "3"], "--plot", 2),
]


@pytest.mark.parametrize(
    ("argv", "option", "expected"), BAD_SIMULATE, ids=[" ".join(a) for a, _, _ in BAD_SIMULATE]
)
def test_bad_simulate_input_is_one_line(
    capsys: pytest.CaptureFixture[str], argv: list[str], option: str, expected: int
) -> None:
    if "--plot" in argv:
        need("matplotlib")
    status, out, err = run_cli(capsys, "simulate", *argv)
    _check_one_line(status, err, option, expected)
    assert out == ""


@pytest.mark.parametrize(
    ("content", "where"),
    [("{bad\n", "trace.jsonl:1"), ('{"prompt_len": 4}\n', "output_len"), ("", "no requests")],
    ids=["invalid-json", "missing-field", "empty"],
)
def test_bad_trace_file_names_the_option_and_the_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, content: str, where: str
) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text(content, encoding="utf-8")
    status, _, err = run_cli(capsys, "simulate", "--trace", str(path))
    _check_one_line(status, err, "--trace", 1)
    assert where in err


def test_too_small_pool_states_the_minimum(capsys: pytest.CaptureFixture[str]) -> None:
    """gpt-oss-like has two groups: one token needs a page in each, plus the null page."""
    status, _, err = run_cli(capsys, "simulate", "--num-pages", "2", "--num-requests", "3")
    _check_one_line(status, err, "--num-pages must be >= 3", 2)
    status, out, err = run_cli(capsys, "simulate", "--num-pages", "3", "--num-requests", "0")
    assert (status, err) == (0, ""), err
    assert "requests             0" in out


def test_a_run_that_finishes_something_exits_zero(capsys: pytest.CaptureFixture[str]) -> None:
    """The default pool fits the largest request, so a run finishes its requests."""
    status, out, err = run_cli(capsys, "simulate", "--num-requests", "3", "--json")
    assert status == 0, err
    summary = json.loads(out)
    assert summary["finished"] == 3 and summary["aborted"] == 0
