"""The demo generates through the whole stack, prints what the cache did, and exits 0."""

from __future__ import annotations

import pytest
from helpers import missing

try:
    import torch  # noqa: F401
    import transformers  # noqa: F401
except ImportError as exc:
    missing(exc.name or "torch/transformers", exc)

import flat_kvcache
from flat_kvcache.demo import main

pytestmark = [
    pytest.mark.torch,
    pytest.mark.skipif(not flat_kvcache.FLAT_KVCACHE, reason="needs the flat build"),
]


def test_demo_runs_and_reports_the_cache(capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: one thread is much faster on a shared machine
    try:
        status = main(["--steps", "3", "--seed", "1"])
    finally:
        torch.set_num_threads(threads)
    assert status == 0
    out = capsys.readouterr().out
    assert "step   0: A: +19 tok (prefix hit 0)" in out
    assert "B: +1 tok (prefix hit 16)" in out  # B's shared 16-token prefix is not recomputed
    assert "holes" in out and "free pages" in out
    assert "largest logit difference to the model's own forward" in out


def test_demo_rejects_bad_arguments() -> None:
    with pytest.raises(SystemExit):
        main(["--steps", "0"])


def test_cli_hands_demo_arguments_to_the_demo(capsys: pytest.CaptureFixture[str]) -> None:
    from flat_kvcache.cli import main as cli_main

    assert cli_main(["demo", "--steps", "0"]) == 2  # the demo's own parser saw --steps
    assert "--steps must be >= 1" in capsys.readouterr().err
    assert cli_main(["demo", "--help"]) == 0
    assert "--num-pages" in capsys.readouterr().out


@pytest.mark.parametrize("model", ["qwen3-next", "bamba"])
def test_state_hybrid_demo_resumes_b_from_a_checkpoint(
    model: str, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        status = main(["--model", model, "--steps", "3", "--seed", "1"])
    finally:
        torch.set_num_threads(threads)
    assert status == 0
    out = capsys.readouterr().out
    # A's 19-token prompt is cut at its body's end, 16 (the last multiple of the grain 8 before
    # its last token, SPEC 13.5b), where a checkpoint is written; B shares those 16 tokens
    assert "step   0: A: +16 tok (prefix hit 0) | state read none (fresh)" in out
    assert "B: +1 tok (prefix hit 16) | state read checkpoint" in out
    assert "checkpoints written 1, hit 1, evicted 0" in out
    assert "largest logit difference to the model's own forward" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "qwen3-next", "--window", "4"], "--window is not an option of --model qwen3-next"),
        (["--model", "bamba", "--num-pages", "40"], "--num-pages is not an option of --model bamba"),
        (["--num-units", "40"], "--num-units is not an option of --model gpt-oss"),
        (["--model", "bamba", "--state-grain", "6"], "--state-grain 6 must be a multiple of --page-size 4"),
        (["--model", "bamba", "--num-units", "3"], "--num-units must be in 4.."),
        (["--model", "qwen3-next", "--num-units", "4"], "--num-units 4 is too small"),
    ],
)
def test_state_hybrid_demo_refuses_options_by_name(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from flat_kvcache.cli import main as cli_main

    assert cli_main(["demo", *argv]) == 2
    assert message in capsys.readouterr().err
