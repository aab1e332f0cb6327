"""``flat-kvcache demo``: arguments the run could not finish with are refused before any work,
as one line naming the option with exit status 2, and the output reads as text.
"""

from __future__ import annotations

import contextlib
import io
import re
import sys

import flat_kvcache
import pytest
from flat_kvcache import demo
from helpers import need, run_cli, run_python

# The defaults: page size P=4, window W=8, 12 steps; request A's prompt is 4 pages + 3 tokens = 19.
# Requests run one at a time, so the pool holds A at its peak (SPEC 6 and 8):
#   prefill: 19 tokens in one chunk, ceil(19/4) = 5 pages in both groups           -> 10
#   last decode (computed 29 -> 30; the 12th token is sampled, never computed): full
#   ceil(30/4) = 8; sliding reclaims [0, (29 - 8 + 1) // 4 = 5) first, keeps 8 - 5 = 3 -> 11
#   so 11 pages besides the null page: --num-pages >= 12.
DEFAULT_MINIMUM = 12


def test_the_minimum_pool_is_derived_from_the_spec() -> None:
    assert demo.min_num_pages(page_size=4, window=8, steps=12) == DEFAULT_MINIMUM
    # One step: only the prefill, ceil(19/4) = 5 pages per group.
    assert demo.min_num_pages(page_size=4, window=8, steps=1) == 1 + 2 * 5
    # A window wider than the request: nothing slides out; 19 + 12 - 1 = 30 tokens, 8 pages each.
    assert demo.min_num_pages(page_size=4, window=100, steps=12) == 1 + 2 * 8


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--num-pages", "3"], f"--num-pages 3 is too small: .* --num-pages must be >= {DEFAULT_MINIMUM}"),
        (
            ["--num-pages", str(DEFAULT_MINIMUM - 1)],
            f"--num-pages {DEFAULT_MINIMUM - 1} is too small",
        ),
        (["--num-pages", "0"], "--num-pages must be >= 1"),
        (["--num-pages", "2000000"], "--num-pages must be <= 1048576"),
        (["--page-size", "300"], "--page-size 300 and --steps 12: the longer request would hold 1215 tokens"),
        (["--steps", "2000"], "--page-size 4 and --steps 2000"),
        (["--window", "-1"], "--window must be >= 1"),
    ],
)
def test_bad_arguments_stop_before_any_work(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, argv: list[str], message: str
) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # past the checks the demo would need torch
    status, out, err = run_cli(capsys, "demo", *argv)
    assert (status, out) == (2, "")
    assert err.startswith("flat-kvcache: error: ") and err.count("\n") == 1, err
    assert re.search(message, err), err


def test_no_traceback_as_a_program() -> None:
    result = run_python("-m", "flat_kvcache", "demo", "--num-pages", "3")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith("flat-kvcache: error: --num-pages 3 is too small")
    assert "Traceback" not in result.stderr and result.stderr.count("\n") == 1


def run_demo(*argv: str) -> str:
    torch = need("torch")
    need("transformers")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: one thread is much faster on a shared machine
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            assert demo.main(list(argv)) == 0
    finally:
        torch.set_num_threads(threads)
    return out.getvalue()


@pytest.mark.torch
@pytest.mark.skipif(not flat_kvcache.FLAT_KVCACHE, reason="needs the flat build")
def test_the_minimum_is_tight(monkeypatch: pytest.MonkeyPatch) -> None:
    """At the minimum the demo runs; one page less, unchecked, and the run itself fails."""
    out = run_demo("--num-pages", str(DEFAULT_MINIMUM))
    assert f"pool: {DEFAULT_MINIMUM} pages of 4 tokens" in out
    monkeypatch.setattr(demo, "min_num_pages", lambda **_: 1)
    with pytest.raises(RuntimeError, match=r"request .A. alone does not fit in the pool"):
        run_demo("--num-pages", str(DEFAULT_MINIMUM - 1))


@pytest.mark.torch
@pytest.mark.skipif(not flat_kvcache.FLAT_KVCACHE, reason="needs the flat build")
def test_the_output_reads_as_text() -> None:
    lines = run_demo("--steps", "2").splitlines()
    assert lines[0] == (
        "model: a tiny random GPT-OSS-style model, 2 layers (sliding_attention, full_attention), window 8"
    )
    assert lines[1] == (
        "pool: 48 pages of 4 tokens, groups sliding_attention, full_attention; "
        "K/V slabs: 1 (layer i of every label shares slab i)"
    )
    assert not any("('" in line or "['" in line for line in lines[:2])
