"""``flat-kvcache simulate``: traces, the scheduler loop on both engines, the command line.

The loop's counts are checked two ways: on a two-request trace whose every step is worked out
by hand below (on both engines), and on a 40-request trace under memory pressure (with
preemptions), where the native engine must give exactly what the pure-Python reference gives
in the same test: same steps, finishes, preemptions, hit tokens, evictions, peak pages.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import re
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flat_kvcache.simulate import (
    SimulationConfig,
    TraceRequest,
    default_num_pages,
    default_trace,
    engine_specs,
    format_summary,
    load_trace,
    simulate,
)
from helpers import need, run_cli, run_python

ENGINES = ["native", "reference"]


def write_trace(tmp_path: Path, lines: list[Any], name: str = "trace.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def without_timing(summary: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in summary.items() if key not in ("timing", "engine", "tables")}


# --- traces -----------------------------------------------------------------------------------


def test_default_trace_shape_and_determinism() -> None:
    trace = default_trace(200, seed=3)
    assert [r.request_id for r in trace] == list(range(200))
    assert all(r.arrival_step == 0 and r.output_len == 128 and r.extra_keys == () for r in trace)
    lengths = [len(r.prompt) for r in trace]
    assert min(lengths) >= 512 and max(lengths) <= 4096
    assert all(r.prompt.dtype == np.uint32 and r.output.dtype == np.uint32 for r in trace)
    # One common 1024-token prefix on roughly half of the requests; those prompts are >= 1024 + 256.
    starts = Counter(r.prompt[:1024].tobytes() for r in trace)
    prefix, count = starts.most_common(1)[0]
    assert 70 <= count <= 130 and len(starts) == 200 - count + 1
    assert min(len(r.prompt) for r in trace if r.prompt[:1024].tobytes() == prefix) >= 1024 + 256
    again = default_trace(200, seed=3)
    assert all(
        np.array_equal(a.prompt, b.prompt) and np.array_equal(a.output, b.output)
        for a, b in zip(trace, again, strict=True)
    )
    other = default_trace(200, seed=4)
    assert not all(np.array_equal(a.prompt, b.prompt) for a, b in zip(trace, other, strict=True))


def test_load_trace_fields(tmp_path: Path) -> None:
    path = write_trace(
        tmp_path,
        [
            "# a comment, then a blank line",
            "",
            {"prompt": [5, 6, 7], "output_len": 2, "arrival_step": 4},
            {"prompt_len": 40, "output_len": 1, "prefix_id": "sys", "prefix_len": 32},
            {
                "prompt_len": 50,
                "output_len": 3,
                "prefix_id": "sys",
                "prefix_len": 20,
                "extra_keys": ["lora:a"],
            },
            {"prompt_len": 50, "output_len": 3, "prefix_id": 7, "prefix_len": 20},
        ],
    )
    trace = load_trace(path, seed=1)
    # Sorted by arrival step, file order kept within a step.
    assert [(len(r.prompt), r.output_len, r.arrival_step) for r in trace] == [
        (40, 1, 0),
        (50, 3, 0),
        (50, 3, 0),
        (3, 2, 4),
    ]
    assert trace[3].prompt.tolist() == [5, 6, 7]
    assert trace[1].extra_keys == ("lora:a",)
    # The same prefix id shares its stream; another id does not.
    assert np.array_equal(trace[0].prompt[:20], trace[1].prompt[:20])
    assert not np.array_equal(trace[1].prompt[:20], trace[2].prompt[:20])
    assert not np.array_equal(trace[0].prompt[20:32], trace[1].prompt[20:32])  # past prefix_len: own tokens
    again = load_trace(path, seed=1)
    assert all(np.array_equal(a.prompt, b.prompt) for a, b in zip(trace, again, strict=True))


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ({"prompt_len": 4}, "output_len is required"),
        ({"prompt_len": 4, "output_len": 0}, "output_len must be an int >= 1"),
        ({"prompt_len": 4, "output_len": True}, "output_len must be an int >= 1"),
        ({"output_len": 4}, "exactly one of prompt"),
        ({"prompt": [1], "prompt_len": 1, "output_len": 1}, "exactly one of prompt"),
        ({"prompt": [], "output_len": 1}, "non-empty list"),
        ({"prompt": [1, -1], "output_len": 1}, r"prompt\[1\] = -1"),
        ({"prompt": [2**32], "output_len": 1}, r"prompt\[0\]"),
        ({"prompt_len": 8, "output_len": 1, "prefix_id": "a"}, "prefix_len is required"),
        (
            {"prompt_len": 8, "output_len": 1, "prefix_id": "a", "prefix_len": 8},
            "prefix_len .8. must be < prompt_len",
        ),
        ({"prompt_len": 8, "output_len": 1, "prefix_id": [1], "prefix_len": 2}, "prefix_id must be"),
        ({"prompt": [1, 2], "output_len": 1, "prefix_id": "a", "prefix_len": 1}, "go with prompt_len"),
        ({"prompt_len": 8, "output_len": 1, "arrival_step": -1}, "arrival_step must be an int >= 0"),
        ({"prompt_len": 8, "output_len": 1, "extra_keys": "lora"}, "extra_keys must be a list of strings"),
        ({"prompt_len": 8, "output_len": 1, "colour": "red"}, "unknown field.s. colour"),
    ],
)
def test_bad_trace_lines_name_file_and_line(tmp_path: Path, line: Any, message: str) -> None:
    path = write_trace(tmp_path, [{"prompt_len": 4, "output_len": 1}, line])
    with pytest.raises(ValueError, match=message) as info:
        load_trace(path)
    assert str(info.value).startswith(f"{path}:2: ")


def test_an_empty_trace_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no requests"):
        load_trace(write_trace(tmp_path, ["# nothing"]))


def test_default_pool_is_under_pressure_but_fits_the_largest_request() -> None:
    import flat_kvcache

    specs = engine_specs(flat_kvcache, "gpt-oss-like", 16)
    trace = default_trace(40, seed=0)
    pages = default_num_pages(trace, specs, max_running=256)
    full_need = sum(-(-(len(r.prompt) + r.output_len) // 16) for r in trace)
    assert pages < full_need  # less than the full-attention group alone needs for all of them
    largest = max(len(r.prompt) + r.output_len for r in trace)
    assert pages > 2 * -(-largest // 16)


# --- the loop ---------------------------------------------------------------------------------


def two_request_trace() -> list[TraceRequest]:
    """A: 100 prompt tokens, 3 outputs, at step 0. B: A's first 96 tokens + 20 own, 2 outputs, at step 10."""
    prompt_a = np.arange(100, dtype=np.uint32)
    prompt_b = np.concatenate([prompt_a[:96], np.arange(1000, 1020, dtype=np.uint32)])
    return [
        TraceRequest(0, prompt_a, np.array([7, 8, 9], dtype=np.uint32)),
        TraceRequest(1, prompt_b, np.array([5, 6], dtype=np.uint32), arrival_step=10),
    ]


@pytest.mark.parametrize("engine", ENGINES)
def test_two_requests_worked_out_by_hand(engine: str) -> None:
    """gpt-oss-like (sliding W=128 and full, both P=16), a roomy pool, 8192 tokens per step.

    step 0: A admitted, no hit, its 100 tokens in one chunk (7 pages per group); samples token 1
    step 1, 2: A decodes (101, 102 tokens: still 7 pages); token 3 is its last, so A finishes,
            registering its 6 full pages (96 tokens) in both groups (nothing slid out: 102 < 128)
    steps 3-9: idle, skipped; B arrives at step 10
    step 10: B's cap is (116 - 1) // 16 = 7 pages; pages 0-5 hit in the full group and, as a run
             reaching slot 0, in the sliding group: 96 hit tokens. Chunk 20 (2 more pages per
             group: 8 each), then token 1
    step 11: B decodes and finishes.
    """
    config = SimulationConfig(engine=engine, num_pages=1000)  # type: ignore[arg-type]
    summary = simulate(two_request_trace(), config).summary
    assert summary["steps"] == 5
    assert (summary["finished"], summary["aborted"], summary["preemptions"]) == (2, 0, 0)
    assert (summary["prefix_hits_tokens"], summary["prefix_queries_tokens"]) == (96, 216)
    assert summary["prefix_hit_rate"] == round(96 / 216, 6)
    assert summary["scheduled_tokens"] == 100 + 1 + 1 + 20 + 1
    assert summary["generated_tokens"] == 5
    assert summary["peak_pages_by_group"] == {"sliding_attention": 8, "full_attention": 8}
    assert summary["peak_running"] == 1
    assert summary["evictions"] == 0
    assert summary["timing"]["per_decode_step"]["steps"] == 3  # steps 1, 2 and 11


@pytest.mark.parametrize(
    ("order", "reuse_uncached_first"), [("hybrid", True), ("group", True), ("hybrid", False)]
)
def test_native_equals_reference_under_memory_pressure(order: str, reuse_uncached_first: bool) -> None:
    # 40 short requests (128 to 512 prompt tokens, 20 of them sharing 256) on a 240-page pool
    # with 1024 tokens per step: requests queue, fill the pool while decoding, and get preempted.
    trace = default_trace(40, seed=1, prompt_len=(128, 512), shared_prefix_len=256, output_len=128)
    config = {
        "num_pages": 240,
        "max_scheduled_tokens": 1024,
        "eviction_order": order,
        "reuse_uncached_first": reuse_uncached_first,
    }
    reference = simulate(trace, SimulationConfig(engine="reference", **config)).summary  # type: ignore[arg-type]
    native = simulate(trace, SimulationConfig(engine="native", **config)).summary  # type: ignore[arg-type]
    assert without_timing(native) == without_timing(reference)
    assert reference["reuse_uncached_first"] is reuse_uncached_first
    # What the run must have exercised, whatever the exact numbers:
    assert (reference["finished"], reference["aborted"]) == (40, 0)
    assert reference["preemptions"] > 0
    assert reference["prefix_hits_tokens"] > 0
    assert reference["evictions"] > 0
    assert reference["generated_tokens"] == 128 * 40  # a preempted request keeps what it generated
    assert reference["peak_pages_in_use"] <= 239


@pytest.mark.parametrize("budget_gib", [1, 4])
def test_native_equals_reference_on_the_arena(budget_gib: int) -> None:
    """The SPEC 13 storage (``SimulationConfig(arena=...)``, state checkpoints every 64 tokens)
    on the qwen3.5-like preset: 30 requests, 15 of them sharing a 256-token prefix. At 1 GiB
    (12 usable units of 77 MB: the state slot) requests are preempted and units evicted; at
    4 GiB nothing is preempted and a prompt whose body ends at 256 leaves the shared prefix's
    checkpoint, so later requests hit it. Both engines must give the same summary."""
    from flat_kvcache import plan_arena
    from flat_kvcache.presets import get_preset
    from flat_kvcache.torch import ModelShape

    cfg = get_preset("qwen3.5-like")
    arena = plan_arena(ModelShape.from_config(cfg).components(), 16, budget_gib * 2**30)
    trace = default_trace(30, seed=1, prompt_len=(128, 512), shared_prefix_len=256, output_len=32)
    summaries = [
        simulate(
            trace,
            SimulationConfig(model=cfg, engine=engine, page_size=16, arena=arena, state_page_size=64),  # type: ignore[arg-type]
        ).summary
        for engine in ENGINES
    ]
    native, reference = (without_timing(s) for s in summaries)
    assert native == reference
    assert (reference["finished"], reference["aborted"]) == (30, 0)
    assert reference["num_pages"] is None
    assert reference["arena"]["units"] == arena.num_units - 1
    assert 0 <= reference["arena"]["stranded_share_mean"] <= reference["arena"]["stranded_share_max"] < 1
    # A state model hits only at its checkpoints: whole 64-token grains.
    assert reference["prefix_hits_tokens"] % 64 == 0
    if budget_gib == 1:
        assert reference["preemptions"] > 0 and reference["evictions"] > 0
    else:
        assert reference["preemptions"] == 0 and reference["prefix_hits_tokens"] >= 256


@pytest.mark.parametrize("engine", ENGINES)
def test_requests_that_never_fit_are_aborted(engine: str) -> None:
    # 59 usable pages; the smallest prompt (512 tokens) needs 32 pages in each of the 2 groups.
    # SPEC 9: nothing holds pages and the queue head does not fit for two steps -> abort it.
    summary = simulate(default_trace(5, seed=0), SimulationConfig(engine=engine, num_pages=60)).summary  # type: ignore[arg-type]
    assert (summary["finished"], summary["aborted"], summary["preemptions"]) == (0, 5, 0)
    assert summary["steps"] == 6  # two stuck steps before the first abort, then one per step


@pytest.mark.parametrize("engine", ENGINES)
def test_a_pool_without_room_for_one_token_is_refused(engine: str) -> None:
    """gpt-oss-like has two groups: one token needs a page in each besides the null page, so
    2 pages could never schedule anything (every request would be aborted)."""
    with pytest.raises(ValueError, match=r"num_pages=2 is too small: .* num_pages must be >= 3"):
        simulate(default_trace(1, seed=0), SimulationConfig(engine=engine, num_pages=2))  # type: ignore[arg-type]
    # An empty trace gets a default pool that could hold a token, and runs nothing.
    summary = simulate(default_trace(0, seed=0), SimulationConfig(engine=engine)).summary  # type: ignore[arg-type]
    assert (summary["num_pages"], summary["requests"], summary["finished"]) == (3, 0, 0)


def test_prefix_caching_off_gets_no_hits() -> None:
    trace = default_trace(10, seed=2)
    summary = simulate(trace, SimulationConfig(enable_caching=False)).summary
    assert (summary["prefix_hits_tokens"], summary["finished"]) == (0, 10)


def test_format_summary_names_every_figure() -> None:
    text = format_summary(simulate(default_trace(5, seed=0)).summary)
    for label in (
        "steps",
        "preemptions",
        "prefix hit rate",
        "peak pages",
        "cache time / step",
        "median",
        "p99",
    ):
        assert label in text


# --- the command line -------------------------------------------------------------------------


def test_cli_smoke_json_as_a_module() -> None:
    result = run_python("-m", "flat_kvcache", "simulate", "--num-requests", "30", "--json")
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""  # no progress bar when stderr is not a terminal
    summary = json.loads(result.stdout)
    assert (summary["requests"], summary["finished"] + summary["aborted"]) == (30, 30)
    assert summary["engine"] == "native"
    assert set(summary["peak_pages_by_group"]) == {"sliding_attention", "full_attention"}


def test_cli_table_progress_and_trace(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = write_trace(tmp_path, [{"prompt_len": 64, "output_len": 4}, {"prompt_len": 80, "output_len": 2}])
    status, out, err = run_cli(
        capsys, "simulate", "--trace", str(path), "--progress", "--engine", "reference"
    )
    assert status == 0
    assert re.search(r"^requests +2: 2 finished, 0 aborted$", out, re.MULTILINE)
    assert err.startswith("\r[") and err.endswith("\n") and "2/2 requests" in err


def test_cli_plot_writes_a_png(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    need("matplotlib")
    target = tmp_path / "run.png"
    status, _, err = run_cli(capsys, "simulate", "--num-requests", "8", "--plot", str(target))
    assert (status, err) == (0, "")
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_plot_without_matplotlib_names_the_extra(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.backend_bases", None)
    status, out, err = run_cli(capsys, "simulate", "--num-requests", "2", "--plot", str(tmp_path / "x.png"))
    assert (status, out) == (1, "")
    assert "pip install '.[plot]'" in err and err.count("\n") == 1


@pytest.mark.parametrize(
    ("argv", "status", "message"),
    [
        (["--num-pages", "0"], 2, "--num-pages: must be >= 1"),
        (["--max-scheduled-tokens", "x"], 2, "expected an int"),
        (["--engine", "gpu"], 2, "invalid choice"),
        (["--eviction-order", "lru"], 2, "invalid choice"),
        (["--preset", "nope"], 1, "--preset nope: unknown preset"),
        (["--num-pages", "2"], 2, "--num-pages 2 is too small"),
        (["--trace", "/does/not/exist.jsonl"], 1, "No such file"),
    ],
)
def test_cli_bad_input_is_one_error_line(
    capsys: pytest.CaptureFixture[str], argv: list[str], status: int, message: str
) -> None:
    got, out, err = run_cli(capsys, "simulate", *argv)
    assert (got, out) == (status, "")
    assert err.startswith("flat-kvcache: error: ") and message in err and err.count("\n") == 1


def test_cli_model_from_a_config_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """``--config PATH`` for a config.json, ``--preset NAME`` for built-ins only."""
    import flat_kvcache.presets

    path = tmp_path / "config.json"
    path.write_text(json.dumps(flat_kvcache.presets.get_preset("llama3-8b-like")), encoding="utf-8")
    status, out, err = run_cli(capsys, "simulate", "--config", str(tmp_path), "--num-requests", "3", "--json")
    assert (status, err) == (0, "")
    summary = json.loads(out)
    assert summary["model"] == str(tmp_path) and [g["group_id"] for g in summary["groups"]] == [
        "full_attention"
    ]
    status, out, err = run_cli(capsys, "simulate", "--preset", str(path))
    assert (status, out) == (1, "") and "a config.json goes with --config" in err


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("no/such/folder/run.png", "no such folder: {tmp}/no/such/folder"),
        (".", "is a folder"),
        ("run.xyz", "must end in an image format matplotlib writes"),
        ("run", "must end in an image format matplotlib writes"),
    ],
)
def test_cli_plot_target_is_checked_before_the_run(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    name: str,
    message: str,
) -> None:
    """A ``--plot`` file that cannot be written is a usage error (2) found before the run."""
    need("matplotlib")
    import flat_kvcache.simulate

    def no_run(*args: object, **kwargs: object) -> None:
        raise AssertionError("the run started")

    monkeypatch.setattr(flat_kvcache.simulate, "simulate", no_run)
    target = tmp_path / name
    status, out, err = run_cli(capsys, "simulate", "--plot", str(target))
    assert (status, out) == (2, "")
    assert err.startswith(f"flat-kvcache: error: --plot {target}: ") and message.format(tmp=tmp_path) in err
    assert err.count("\n") == 1


def test_native_runs_build_the_cache_with_cache_from_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """The simulator builds the native engine the documented way."""
    import flat_kvcache.simulate.loop as loop
    from flat_kvcache import cache_from_config as real

    calls: list[tuple[object, dict[str, object]]] = []

    def spy(model: Any, **kwargs: Any) -> Any:
        calls.append((model, kwargs))
        return real(model, **kwargs)

    monkeypatch.setattr(loop, "cache_from_config", spy)
    summary = simulate(default_trace(2, seed=0), SimulationConfig(num_pages=500, host_pages=7)).summary
    assert summary["finished"] == 2 and summary["host_pages"] == 7
    [(model, kwargs)] = calls
    assert isinstance(model, dict) and model["model_type"] == "gpt_oss"
    assert kwargs == {
        "num_pages": 500,
        "page_size": 16,
        "enable_caching": True,
        "eviction_order": "hybrid",
        "reuse_uncached_first": True,
        "host_pages": 7,
        "eviction_policy": "lru",
        "register_on_schedule": False,
    }


def test_cli_bad_trace_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = write_trace(tmp_path, [{"prompt_len": 8, "output_len": 1}, {"prompt_len": 8}])
    status, out, err = run_cli(capsys, "simulate", "--trace", str(path))
    assert (status, out) == (1, "")
    assert err == f"flat-kvcache: error: --trace: {path}:2: output_len is required\n"


def test_reuse_uncached_first_default_is_the_engines_default() -> None:
    """The simulate default, the reference's and the native constructor's agree."""
    import inspect

    import flat_kvcache
    from flat_kvcache.reference.engine.pool import DEFAULT_REUSE_UNCACHED_FIRST
    from flat_kvcache.simulate import DEFAULT_REUSE_UNCACHED_FIRST as SIMULATE_DEFAULT

    native = inspect.signature(flat_kvcache.FlatKVCache).parameters["reuse_uncached_first"].default
    pool = inspect.signature(flat_kvcache.BlockPool).parameters["reuse_uncached_first"].default
    assert native is pool is DEFAULT_REUSE_UNCACHED_FIRST is SIMULATE_DEFAULT is True


def test_host_tier_keeps_evicted_prefixes_and_engines_agree() -> None:
    """``--host-pages``: under memory pressure, device-evicted prefix pages come back from the
    host tier (transfers acknowledged at once), so the hit rate is at least the device-only
    one; native and reference report the same run."""
    trace = default_trace(40, seed=1, prompt_len=(128, 512), shared_prefix_len=256, output_len=128)
    config = {"num_pages": 240, "max_scheduled_tokens": 1024}
    device_only = simulate(trace, SimulationConfig(engine="native", **config)).summary  # type: ignore[arg-type]
    tiered = {
        engine: simulate(trace, SimulationConfig(engine=engine, host_pages=400, **config)).summary  # type: ignore[arg-type]
        for engine in ENGINES
    }
    assert without_timing(tiered["native"]) == without_timing(tiered["reference"])
    summary = tiered["native"]
    assert (summary["finished"], summary["aborted"]) == (40, 0)
    assert summary["host_stores"] > 0 and summary["host_loads"] > 0
    assert 0 < summary["host_hits_tokens"] <= summary["prefix_hits_tokens"]
    assert summary["prefix_hit_rate"] >= device_only["prefix_hit_rate"]
    assert device_only["host_hits_tokens"] == 0 and device_only["host_pages"] == 0


@pytest.mark.parametrize("engine", ENGINES)
def test_persistent_rows_follow_every_step_and_change_nothing_else(engine: str) -> None:
    """``tables="rows"`` (bind_rows, update_rows) runs the same loop as ``tables="full"`` (a full
    block_tables(slots, out=) rewrite), preemptions and slot reuse included, and after every
    step each running request's row (its slot) is its block_tables row."""
    from flat_kvcache.simulate.loop import _Loop

    trace = default_trace(24, seed=2, prompt_len=(64, 256), shared_prefix_len=64, output_len=48)
    config = {"engine": engine, "num_pages": 120, "max_scheduled_tokens": 512, "max_running": 8}
    full = simulate(trace, SimulationConfig(tables="full", **config)).summary  # type: ignore[arg-type]
    loop = _Loop(trace, SimulationConfig(tables="rows", **config))  # type: ignore[arg-type]
    while loop.pending or loop.waiting or loop.running:
        loop.one_step()
        loop.cache.update_rows()  # rows of requests not scheduled this step may lag one update
        owners = {live.slot: live.rid for live in loop.running}
        assert len(owners) == len(loop.running), "two running requests share a slot"
        assert all(loop.cache.slot_of(rid) == slot for slot, rid in owners.items())
        assert loop.cache.num_requests == len(owners)  # finished and preempted ones let go of theirs
        for gid, buffer in loop.out.items():
            for row in range(buffer.shape[0]):
                want = np.full(buffer.shape[1], -1, np.int32)
                if row in owners:
                    pages = loop.cache.block_tables([row])[gid][0]
                    want[: len(pages)] = pages
                np.testing.assert_array_equal(buffer[row], want, err_msg=f"{gid} row {row}")
    rows = loop._summary(0)
    assert without_timing(rows) == without_timing(full)
    assert (rows["tables"], full["tables"]) == ("rows", "full")
    assert rows["preemptions"] > 0 and rows["finished"] == 24


def test_simulate_arena_reports_stranded_memory_and_checkpoints(capsys: pytest.CaptureFixture[str]) -> None:
    """``simulate --arena SIZE``: the SPEC 13 storage over SIZE bytes (state grain 64 by
    default); the summary has the arena's units and stranded memory and the checkpoint counts,
    the native and the reference engine agreeing on them."""
    need("torch")
    argv = ["simulate", "--preset", "qwen3.5-like", "--num-requests", "12", "--arena", "6GiB", "--json"]
    status, out, err = run_cli(capsys, *argv)
    assert status == 0, err
    native = json.loads(out)
    status, out, err = run_cli(capsys, *argv, "--engine", "reference")
    assert status == 0, err
    assert without_timing(json.loads(out)) == without_timing(native)
    assert native["num_pages"] is None and native["arena"]["units"] > 0
    assert {g["group_id"]: g["page_size"] for g in native["groups"]} == {
        "linear_attention": 64,
        "full_attention": 16,
    }
    assert native["checkpoints"]["written"] > 0
    status, out, _ = run_cli(capsys, *argv[:-1])
    assert status == 0
    assert re.search(r"^arena +\d+ units of \d+ bytes; stranded", out, re.M)
    assert re.search(r"^checkpoints +\d+ written, \d+ hit, \d+ evicted", out, re.M)


def test_simulate_arena_conflicts_are_named(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "--num-requests", "2", "--arena", "6GiB", "--num-pages", "100"]
    status, _, err = run_cli(capsys, *argv)
    assert status == 2 and "--arena sizes the pool itself: it cannot be combined with --num-pages" in err


def test_simulate_arena_with_a_host_tier_per_group(capsys: pytest.CaptureFixture[str]) -> None:
    """``simulate --arena SIZE --host-pages N``: a host tier of N pages per group, each of its
    group's own geometry (a state group's a whole state slot); native and reference agree."""
    need("torch")
    argv = ["simulate", "--preset", "qwen3.5-like", "--num-requests", "12", "--arena", "3GiB", "--json"]
    status, out, err = run_cli(capsys, *argv, "--host-pages", "40")
    assert status == 0, err
    native = json.loads(out)
    status, out, err = run_cli(capsys, *argv, "--host-pages", "40", "--engine", "reference")
    assert status == 0, err
    assert without_timing(json.loads(out)) == without_timing(native)
    assert native["host_pages"] == 40 and native["host_stores"] > 0


def test_simulate_arena_too_small_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    need("torch")
    argv = ["simulate", "--preset", "qwen3.5-like", "--num-requests", "2", "--arena", "1MiB"]
    status, _, err = run_cli(capsys, *argv)
    assert status == 1 and "--arena 1048576: budget_bytes=1048576 gives 0 units" in err


def test_a_state_model_replays_on_the_arena_by_default(capsys: pytest.CaptureFixture[str]) -> None:
    """``simulate --preset qwen3.5-like`` runs on the SPEC 13 arena without --arena: state
    checkpoints every 64 tokens, the arena sized as the default pool is (half of what the first
    --max-running requests take at full length: a working state slot each and their attention
    pages packed into units, at least the largest request alone); native and reference agree.
    --storage equalized asks for equal pages; an attention-only model keeps them by default."""
    need("torch")
    from flat_kvcache import plan_arena
    from flat_kvcache.presets import get_preset
    from flat_kvcache.torch import ModelShape

    argv = ["simulate", "--preset", "qwen3.5-like", "--num-requests", "12", "--json"]
    status, out, err = run_cli(capsys, *argv)
    assert status == 0, err
    native = json.loads(out)
    status, out, err = run_cli(capsys, *argv, "--engine", "reference")
    assert status == 0, err
    assert without_timing(json.loads(out)) == without_timing(native)
    assert native["storage"] == "arena" and native["num_pages"] is None
    assert {g["group_id"]: g["page_size"] for g in native["groups"]} == {
        "linear_attention": 64,
        "full_attention": 16,
    }
    probe = plan_arena(ModelShape.from_config(get_preset("qwen3.5-like")).components(), 16, 1 << 50)
    page = next(g for g in probe.groups if g.kind == "pages")
    sizes = [len(r.prompt) + r.output_len for r in default_trace(12, seed=0)]
    pages = [math.ceil(n / 16) for n in sizes]
    together = sum(1 + count * page.item_bytes / probe.unit_bytes for count in pages)
    # Alone: a working slot, a checkpoint, and its pages where units hold a page less (they
    # straddle: 196.5 pages of bytes per unit).
    alone = max(2 + math.ceil(count / (page.per_unit - 1)) for count in pages)
    assert native["arena"]["units"] == max(math.ceil(together / 2), alone)
    assert native["finished"] == 12 and native["checkpoints"]["written"] > 0

    equalized = json.loads(run_cli(capsys, *argv, "--storage", "equalized")[1])
    assert equalized["storage"] == "equalized" and equalized["arena"] is None
    assert equalized["num_pages"] > 1
    plain = json.loads(run_cli(capsys, "simulate", "--num-requests", "12", "--json")[1])
    assert plain["storage"] == "equalized" and plain["arena"] is None


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--num-pages", "5000"], "--num-pages 5000: a model with state layers runs on the SPEC 13 arena"),
        (
            ["--storage", "equalized", "--arena", "1GiB"],
            "--storage equalized runs on --num-pages equal pages",
        ),
        (["--storage", "arena", "--num-pages", "500"], "--storage arena sizes the pool in units"),
    ],
)
def test_simulate_storage_conflicts_are_named(
    capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    status, out, err = run_cli(capsys, "simulate", "--preset", "qwen3.5-like", "--num-requests", "2", *extra)
    assert (status, out) == (2, "") and err.startswith(f"flat-kvcache: error: {message}")


def test_equal_pages_for_a_state_model_are_asked_for() -> None:
    """The library says the same: ``num_pages`` for a model with state layers needs
    ``storage="equalized"``."""
    from flat_kvcache.errors import ConfigError

    trace = default_trace(2, seed=0)
    with pytest.raises(ConfigError, match="storage='equalized' for num_pages equal pages"):
        simulate(trace, SimulationConfig(model="qwen3.5-like", num_pages=5000))
    summary = simulate(
        trace, SimulationConfig(model="qwen3.5-like", num_pages=5000, storage="equalized")
    ).summary
    assert summary["storage"] == "equalized" and summary["finished"] == 2


# --- same-step sharing (SimulationConfig.register_on_schedule) ----------------------------------


@pytest.mark.parametrize("model", ["gpt-oss-like", "llama3-8b-like"])
def test_same_step_sharing_native_equals_reference_and_hits_in_the_admission_step(model: str) -> None:
    """Three requests with one 64-token prefix arrive together and are all admitted in step 0:
    with ``register_on_schedule`` the second and third hit the 4 pages (16 tokens each) the
    first one's chunk fills in that step (their capped hit: the whole shared prefix); without
    it they hit nothing. The native and the reference loops decide alike either way, and under
    memory pressure (preemptions) on the option too."""
    rng = np.random.default_rng(5)
    shared = rng.integers(0, 1000, 64, dtype=np.uint32)
    trace = [
        TraceRequest(
            i,
            np.concatenate([shared, rng.integers(0, 1000, 20 + i, dtype=np.uint32)]),
            np.arange(3, dtype=np.uint32),
        )
        for i in range(3)
    ]
    for flag, hits in ((False, [0, 0, 0]), (True, [0, 64, 64])):
        records: dict[str, list[dict[str, Any]]] = {}
        summaries = {}
        for engine in ("native", "reference"):
            sink = io.StringIO()
            config = SimulationConfig(model=model, engine=engine, num_pages=200, register_on_schedule=flag)
            summaries[engine] = simulate(trace, config, decisions=sink).summary
            records[engine] = [json.loads(line) for line in sink.getvalue().splitlines()]
        assert without_timing(summaries["native"]) == without_timing(summaries["reference"])
        assert summaries["native"]["register_on_schedule"] is flag
        first = records["native"][0]
        assert [hit for _, hit, _ in first["admitted"]] == hits
    pressure = default_trace(40, seed=1, prompt_len=(128, 512), shared_prefix_len=256, output_len=128)
    pressed = SimulationConfig(num_pages=240, max_scheduled_tokens=1024, register_on_schedule=True)
    reference = simulate(pressure, dataclasses.replace(pressed, engine="reference")).summary
    native = simulate(pressure, pressed).summary
    assert without_timing(native) == without_timing(reference)
    assert reference["preemptions"] > 0 and reference["finished"] == 40
