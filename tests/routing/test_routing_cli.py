"""``flat-kvcache simulate --workers N --router ... --worker-memory ...``: runs and argument errors."""

from __future__ import annotations

import json

import pytest
from helpers import missing, run_cli

try:
    import dynamo._core  # noqa: F401 (the dynamo extra must be installed; CI installs it)
except ImportError as exc:
    missing("dynamo", exc)


def test_kv_cluster_run_prints_its_summary(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run_cli(
        capsys, "simulate", "--preset", "llama3-8b-like", "--max-requests", "40", "--workers", "2",
        "--router", "kv", "--num-pages", "3001", "--json",
    )  # fmt: skip
    assert status == 0
    summary = json.loads(out)
    assert summary["router"] == "kv" and summary["workers"] == 2 and summary["finished"] == 40
    assert summary["num_pages_per_worker"] == 1501  # 1/N of the usable pages, plus the null page
    assert summary["exact_at_admit"] == 1.0


def test_worker_memory_and_round_robin(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run_cli(
        capsys, "simulate", "--preset", "llama3-8b-like", "--max-requests", "10", "--workers", "3",
        "--worker-memory", "2000", "--json",
    )  # fmt: skip
    assert status == 0
    summary = json.loads(out)
    assert summary["router"] == "round-robin" and summary["num_pages_per_worker"] == 2000
    assert summary["requests_per_worker"] == [4, 3, 3]


def test_hybrid_arena_cluster(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run_cli(
        capsys, "simulate", "--preset", "qwen3.5-like", "--max-requests", "12", "--workers", "2",
        "--router", "kv", "--arena", "6GiB", "--json",
    )  # fmt: skip
    assert status == 0
    summary = json.loads(out)
    assert summary["finished"] == 12 and summary["exact_at_admit"] == 1.0
    assert summary["arena_units_per_worker"] is not None


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--workers", "0"], "--workers"),
        (["--workers", "2", "--router", "random"], "--router"),
        (["--workers", "2", "--router", "kv"], "--router kv"),  # the default preset has a sliding window
        (["--preset", "llama3-8b-like", "--workers", "2", "--worker-memory", "lots"], "--worker-memory"),
        (
            ["--preset", "qwen3.5-like", "--arena", "6GiB", "--workers", "2", "--worker-memory", "x"],
            "--worker-memory",
        ),
        (
            ["--preset", "llama3-8b-like", "--workers", "2", "--router", "kv", "--host-pages", "8"],
            "--host-pages",
        ),
        (["--preset", "llama3-8b-like", "--workers", "2", "--engine", "reference"], "--engine"),
        (["--preset", "llama3-8b-like", "--workers", "2", "--plot", "x.png"], "--plot"),
        (["--preset", "llama3-8b-like", "--workers", "2", "--kv-overlap-weight", "1"], "--kv-overlap-weight"),
        (
            ["--preset", "llama3-8b-like", "--workers", "2", "--router", "kv", "--kv-overlap-weight", "-1"],
            "--kv-overlap-weight",
        ),
    ],
)
def test_argument_errors_name_the_option(
    capsys: pytest.CaptureFixture[str], argv: list[str], named: str
) -> None:
    status, out, err = run_cli(capsys, "simulate", "--max-requests", "5", *argv)
    assert status != 0 and out == ""
    assert named in err
