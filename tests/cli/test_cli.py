"""The ``flat-kvcache`` command line, in-process (``main([...])``) and as ``python -m flat_kvcache``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import flat_kvcache
import numpy as np
import pytest
from flat_kvcache.config import (
    layer_types_from_config,
    max_context_len_from_config,
    sliding_window_from_config,
)
from flat_kvcache.presets import DEFAULT_PRESET, get_preset, preset_names
from helpers import REPO_ROOT, run_cli, run_python

FULL, SLIDING, LINEAR = "full_attention", "sliding_attention", "linear_attention"


def plan_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    status, out, err = run_cli(capsys, "plan", "--json", *argv)
    assert (status, err) == (0, "")
    plan: dict[str, Any] = json.loads(out)
    return plan


def table_row(out: str, group_id: str) -> list[str]:
    """The cells of the table row of ``group_id``."""
    [line] = [line for line in out.splitlines() if line.split()[:1] == [group_id]]
    return line.split()


def by_id(plan: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {group["group_id"]: group for group in plan["groups"]}


def write_config(tmp_path: Path, cfg: Any, name: str = "config.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(cfg), encoding="utf-8")
    return path


# --- the default run -----------------------------------------------------------------------------

# gpt-oss-like with the defaults: P=16, B=256, S=8192, T=max(262144, C)=262144, C=131072, N=1, D=0
#   sliding W=128: 256*ceil(127/16)=256*8=2048 + ceil(8192/16)=512 + 256 + 0 + 1 = 2817
#   full:          ceil(262144/16)=16384 + 256 + 0 + 1                        = 16641
#   both at once, sharing the null page: 1 + 2816 + 16640                     = 19457
#   table width (absolute tables, any group): ceil((131072 + 1)/16) = 8193;
#   windowed (SPEC 2's sliding capture width): ceil((128 + 1)/16) + 1 = 10
#   slab: 12 sliding and 12 full layers, one window -> 12 (None without the flat feature)


def test_no_arguments_prints_the_default_preset_as_a_table(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = run_cli(capsys)
    assert (status, err) == (0, "")
    assert DEFAULT_PRESET in out
    assert table_row(out, SLIDING) == [
        SLIDING,
        "sliding_window",
        "128",
        "history",
        "12",
        "2817",
        "8193",
        "10",
    ]
    assert table_row(out, FULL) == [FULL, "full_history", "-", "history", "12", "16641", "8193", "-"]
    if flat_kvcache.FLAT_KVCACHE:
        assert "hybrid slab group size: 12" in out
    else:
        assert "hybrid slab group size: none (built without the flat feature)" in out


def test_table_columns_are_aligned(capsys: pytest.CaptureFixture[str]) -> None:
    _, out, _ = run_cli(capsys, "--preset", "multi-window-demo")
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("group "))
    rows = lines[header : header + 4]
    # right-aligned numbers end in the same column as their header
    for column in ("max pages", "table width"):
        end = rows[0].index(column) + len(column)
        assert all(row[end - 1].isdigit() and row[end : end + 1] in ("", " ") for row in rows[1:])


def test_default_plan_as_json(capsys: pytest.CaptureFixture[str]) -> None:
    plan = plan_json(capsys)
    assert plan["model"]["source"] == f"preset {DEFAULT_PRESET}"
    assert plan["model"]["num_layers"] == 24
    assert plan["model"]["layer_types"] == {SLIDING: 12, FULL: 12}
    assert plan["flat_kvcache"] is flat_kvcache.FLAT_KVCACHE
    assert plan["settings"] == {
        "page_size": 16,
        "max_live_requests": 256,
        "max_scheduled_tokens": 8192,
        "max_total_tokens": 262144,
        "max_context_len": 131072,
        "decode_input_tokens": 1,
        "overlap_schedule_depth": 0,
        "safety_margin": 0,
    }
    assert plan["groups"] == [
        {
            "group_id": SLIDING,
            "retention": "sliding_window",
            "sliding_window_tokens": 128,
            "family": "history",
            "state": False,
            "rows_per_page": 16,
            "entry_stride_tokens": 1,
            "num_layers": 12,
            "max_pages": 2817,
            "table_width": 8193,
            "windowed_width": 10,
        },
        {
            "group_id": FULL,
            "retention": "full_history",
            "sliding_window_tokens": None,
            "family": "history",
            "state": False,
            "rows_per_page": 16,
            "entry_stride_tokens": 1,
            "num_layers": 12,
            "max_pages": 16641,
            "table_width": 8193,
            "windowed_width": None,
        },
    ]
    assert plan["pool"] == {
        "pages_for_all_worst_cases": 19457,
        "num_pages": None,
        "fits": None,
        "max_total_tokens_that_fit": None,
    }
    assert plan["hybrid_slab_group_size"] == (12 if flat_kvcache.FLAT_KVCACHE else None)


# --- every preset, against the public API --------------------------------------------------------

EXPECTED_GROUPS = {
    "gpt-oss-like": [SLIDING, FULL],
    "qwen3.5-like": [LINEAR, FULL],
    "llama3-8b-like": [FULL],
    "multi-window-demo": ["sliding_attention_512", "sliding_attention_4096", FULL],
}


def test_every_preset_has_an_expectation() -> None:
    assert set(EXPECTED_GROUPS) == set(preset_names())


@pytest.mark.parametrize("name", sorted(EXPECTED_GROUPS))
def test_each_preset_matches_the_api(capsys: pytest.CaptureFixture[str], name: str) -> None:
    plan = plan_json(capsys, "--preset", name)
    cfg = get_preset(name)
    layer_types, window = layer_types_from_config(cfg), sliding_window_from_config(cfg)
    context = max_context_len_from_config(cfg)
    specs = flat_kvcache.group_specs_from_layer_types(layer_types, window, page_size=16)
    counts = flat_kvcache.compute_paged_cache_group_page_counts(
        specs,
        max_live_requests=256,
        max_scheduled_tokens=8192,
        max_total_tokens=max(262144, context),
        max_context_len=context,
    )
    assert [group["group_id"] for group in plan["groups"]] == EXPECTED_GROUPS[name]
    for group, spec in zip(plan["groups"], specs, strict=True):
        assert group["retention"] == spec.retention
        assert group["sliding_window_tokens"] == spec.sliding_window_tokens
        assert group["family"] == spec.family
        assert group["state"] is (spec.family == "state")
        assert group["max_pages"] == counts[spec.group_id]
        windowed = flat_kvcache.compute_max_logical_pages_for_capture(spec, max_context_len=context)
        if spec.retention == "sliding_window":
            assert group["windowed_width"] == windowed
            assert group["table_width"] == -(-(context + 1) // 16)  # an absolute table: full width
        else:
            assert (group["table_width"], group["windowed_width"]) == (windowed, None)
    assert plan["pool"]["pages_for_all_worst_cases"] == 1 + sum(count - 1 for count in counts.values())
    assert sum(group["num_layers"] for group in plan["groups"]) == cfg["num_hidden_layers"]
    assert plan["hybrid_slab_group_size"] == flat_kvcache.hybrid_slab_group_size(
        layer_types, sliding_window_tokens=window
    )


def test_state_groups_are_marked(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run_cli(capsys, "--preset", "qwen3.5-like")
    assert status == 0
    # 36 linear + 12 full layers; T = max(262144, C=262144): full 16384 + 256 + 1 = 16641,
    # state min(2*256 + 16384 + 1, 16641) = 16641; table width ceil((262144 + 1)/16) = 16385
    assert table_row(out, LINEAR) == [LINEAR, "full_history", "-", "state", "36", "16641", "16385", "-", "*"]
    assert table_row(out, FULL) == [FULL, "full_history", "-", "history", "12", "16641", "16385", "-"]
    assert "* state group" in out
    assert "hybrid slab group size: none" in out


def test_multi_window_preset_shows_one_group_per_window(capsys: pytest.CaptureFixture[str]) -> None:
    plan = plan_json(capsys, "--preset", "multi-window-demo")
    groups = by_id(plan)
    # C = 32768, T = 262144: W=512: 256*ceil(511/16)=256*32=8192 + 512 + 256 + 1 = 8961
    assert groups["sliding_attention_512"]["max_pages"] == 8961
    assert groups["sliding_attention_512"]["windowed_width"] == 34  # ceil((512 + 1)/16) + 1
    assert groups["sliding_attention_512"]["table_width"] == 2049  # ceil((32768 + 1)/16)
    assert groups["sliding_attention_4096"]["sliding_window_tokens"] == 4096
    assert plan["hybrid_slab_group_size"] is None  # two windows


def test_options_reach_the_formulas(capsys: pytest.CaptureFixture[str]) -> None:
    plan = plan_json(
        capsys,
        "--preset", "llama3-8b-like",
        "--page-size", "32",
        "--max-live-requests", "4",
        "--max-scheduled-tokens", "100",
        "--max-total-tokens", "1000",
        "--max-context-len", "500",
        "--decode-input-tokens", "2",
        "--overlap-schedule-depth", "1",
        "--safety-margin", "3",
    )  # fmt: skip
    # raw 32, protected = 4*ceil(1*2/32) = 4; full = ceil(1000/32)=32 + 4 + 4 + 1 + 3 = 44
    # table width: ceil((500 + (1+1)*2)/32) = ceil(504/32) = 16
    [group] = plan["groups"]
    assert (group["rows_per_page"], group["max_pages"], group["table_width"]) == (32, 44, 16)
    assert plan["settings"]["overlap_schedule_depth"] == 1


def test_max_total_tokens_defaults_to_one_full_context(capsys: pytest.CaptureFixture[str]) -> None:
    assert plan_json(capsys, "--max-context-len", "1000000")["settings"]["max_total_tokens"] == 1000000
    assert plan_json(capsys, "--max-context-len", "1000")["settings"]["max_total_tokens"] == 262144


def test_list_presets(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--list-presets"], ["plan", "--list-presets"]):
        status, out, err = run_cli(capsys, *argv)
        assert (status, err) == (0, "")
        names = [line.split()[0] for line in out.splitlines()]
        assert names == preset_names()
        assert f"{DEFAULT_PRESET} (default)" in out


def test_help_and_version(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run_cli(capsys, "--help")
    assert status == 0 and "plan" in out
    status, out, _ = run_cli(capsys, "plan", "--help")
    assert status == 0 and "--max-live-requests" in out
    status, out, _ = run_cli(capsys, "--version")
    assert (status, out.strip()) == (0, f"flat-kvcache {flat_kvcache.__version__}")


# --- config.json input -----------------------------------------------------------------------------


def test_config_with_layer_types(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = write_config(
        tmp_path,
        {
            "model_type": "toy",
            "num_hidden_layers": 4,
            "layer_types": [SLIDING, FULL, SLIDING, FULL],
            "sliding_window": 64,
            "max_position_embeddings": 4096,
        },
    )
    plan = plan_json(
        capsys, "--config", str(path), "--max-live-requests", "2", "--max-scheduled-tokens", "32"
    )
    # C=4096, T=max(262144, 4096)=262144, B=2, S=32, P=16
    # sliding: 2*ceil(63/16)=8 + ceil(32/16)=2 + 2 + 1 = 13; full: 16384 + 2 + 1 = 16387
    assert plan["model"] == {
        "source": str(path),
        "model_type": "toy",
        "family": "any model with layer_types",  # toy is no family: read from its explicit labels
        "num_layers": 4,
        "num_cache_layers": 4,
        "layer_types": {SLIDING: 2, FULL: 2},
        "state_kind": None,
    }
    assert plan["settings"]["max_context_len"] == 4096
    assert {gid: g["max_pages"] for gid, g in by_id(plan).items()} == {SLIDING: 13, FULL: 16387}
    assert plan["hybrid_slab_group_size"] == (2 if flat_kvcache.FLAT_KVCACHE else None)


def test_config_with_full_attention_interval(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = write_config(
        tmp_path, {"model_type": "qwen3_next", "num_hidden_layers": 8, "full_attention_interval": 4}
    )
    plan = plan_json(capsys, "--config", str(path))
    assert plan["model"]["layer_types"] == {LINEAR: 6, FULL: 2}
    assert [(g["group_id"], g["family"], g["num_layers"]) for g in plan["groups"]] == [
        (LINEAR, "state", 6),
        (FULL, "history", 2),
    ]
    assert plan["settings"]["max_context_len"] == 131072  # no max_position_embeddings


def test_config_with_only_a_layer_count(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = write_config(
        tmp_path, {"model_type": "llama", "num_hidden_layers": 3, "max_position_embeddings": 8192}
    )
    plan = plan_json(capsys, "--config", str(path))
    assert [(g["group_id"], g["num_layers"]) for g in plan["groups"]] == [(FULL, 3)]


def test_config_folder_and_nested_text_config(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    inner = {"num_hidden_layers": 2, "layer_types": [SLIDING, FULL], "sliding_window": 32}
    write_config(tmp_path, {"model_type": "wrapper", "text_config": inner})
    plan = plan_json(capsys, "--config", str(tmp_path))
    assert [g["group_id"] for g in plan["groups"]] == [SLIDING, FULL]


# --- errors: one line on stderr, exit 1 for a bad model, 2 for bad usage ------------------------


def assert_one_line_error(
    capsys: pytest.CaptureFixture[str], argv: list[str], status: int, needle: str
) -> None:
    code, out, err = run_cli(capsys, *argv)
    assert code == status, err
    assert out == ""
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert err.startswith("flat-kvcache: error: "), err
    assert needle in err, err


@pytest.mark.parametrize(
    ("cfg", "needle"),
    [
        ("{not json", "invalid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ({"num_hidden_layers": 2, "layer_types": [FULL, "mamba"]}, "config layer_types[1] = 'mamba'"),
        (
            {"num_hidden_layers": 2, "layer_types": [SLIDING, FULL]},
            "config sliding_window = None: sliding layers need an int window",
        ),
        (
            {"num_hidden_layers": 3, "layer_types": [FULL, FULL]},
            "layer_types has 2 entries but num_hidden_layers is 3",
        ),
        ({"model_type": "empty"}, "config model_type is 'empty' and the config has no layer_types"),
        ({"num_hidden_layers": 4}, "config model_type is missing and the config has no layer_types"),
        ({"model_type": "llama", "num_hidden_layers": 0}, "config num_hidden_layers = 0"),
        ({"model_type": "llama", "num_hidden_layers": -1}, "config num_hidden_layers = -1"),
        (
            {"model_type": "qwen3_next", "num_hidden_layers": 4, "full_attention_interval": 0},
            "config full_attention_interval = 0",
        ),
        (
            {"model_type": "toy", "layer_types": [SLIDING], "sliding_window": "big"},
            "config sliding_window = 'big'",
        ),
    ],
)
def test_bad_config_files(capsys: pytest.CaptureFixture[str], tmp_path: Path, cfg: Any, needle: str) -> None:
    path = tmp_path / "config.json"
    path.write_text(cfg if isinstance(cfg, str) else json.dumps(cfg), encoding="utf-8")
    assert_one_line_error(capsys, ["--config", str(path)], 1, needle)


def test_bad_model_sources(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    missing = tmp_path / "missing.json"
    assert_one_line_error(capsys, ["--config", str(missing)], 1, f"--config {missing}: no such file")
    assert_one_line_error(capsys, ["--config", str(tmp_path)], 1, "the folder has no config.json")
    assert_one_line_error(capsys, ["--preset", "nope"], 1, "--preset nope: unknown preset; known presets: ")


# --- one way to name a model: --config PATH for files, --preset NAME for built-ins ---


def test_preset_takes_only_built_in_names(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = write_config(tmp_path, get_preset("llama3-8b-like"))
    assert_one_line_error(capsys, ["--preset", str(path)], 1, "a config.json goes with --config")
    assert_one_line_error(capsys, ["--config", "llama3-8b-like"], 1, "a built-in preset goes with --preset")
    # The same file through --config plans what the preset plans, under the path's name.
    by_path, by_name = (
        plan_json(capsys, "--config", str(path)),
        plan_json(capsys, "--preset", "llama3-8b-like"),
    )
    assert by_path["groups"] == by_name["groups"] and by_path["model"]["source"] == str(path)


def test_config_named_like_a_preset_is_a_path(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--config NAME`` reads the file ``NAME`` even where a preset of that name exists."""
    folder = tmp_path / "gpt-oss-like"
    folder.mkdir()
    write_config(folder, {"model_type": "llama", "num_hidden_layers": 3})
    monkeypatch.chdir(tmp_path)
    plan = plan_json(capsys, "--config", "gpt-oss-like")
    assert [(g["group_id"], g["num_layers"]) for g in plan["groups"]] == [(FULL, 3)]


@pytest.mark.parametrize("command", ["plan", "simulate"])
def test_every_command_names_a_model_the_same_way(capsys: pytest.CaptureFixture[str], command: str) -> None:
    status, out, _ = run_cli(capsys, command, "--help")
    assert status == 0
    assert "--config PATH" in out and "--preset NAME" in out
    assert "config.json, or the folder that holds it" in " ".join(out.split())
    assert_one_line_error(
        capsys, [command, "--config", "x.json", "--preset", DEFAULT_PRESET], 2, "not allowed"
    )


# --- errors name the option once, JSON where asked --------------------------------


def test_errors_name_the_path_once(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text("{not json", encoding="utf-8")
    for argv in (
        ["--config", str(path)],
        ["--config", str(tmp_path)],
        ["--config", str(tmp_path / "x.json")],
    ):
        _, _, err = run_cli(capsys, *argv)
        assert err.count(str(tmp_path)) == 1, err
    _, _, err = run_cli(capsys, "--config", str(path))
    assert err == f"flat-kvcache: error: --config {path}: invalid JSON: " + err.split("invalid JSON: ")[1]


def test_list_presets_as_json(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = run_cli(capsys, "plan", "--list-presets", "--json")
    assert (status, err) == (0, "")
    presets = json.loads(out)
    assert [p["name"] for p in presets] == preset_names()
    assert [p["name"] for p in presets if p["default"]] == [DEFAULT_PRESET]
    gpt_oss = get_preset("gpt-oss-like")["layer_types"]
    assert presets[0]["layer_types"] == {SLIDING: gpt_oss.count(SLIDING), FULL: gpt_oss.count(FULL)}


def test_extra_hints_install_as_the_readme_does(capsys: pytest.CaptureFixture[str]) -> None:
    """The README installs extras from the source tree (``pip install '.[torch]'``): the hints too."""
    readme = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    status, out, _ = run_cli(capsys, "plan", "--help")
    assert status == 0 and "pip install '.[torch]'" in out and "pip install '.[torch]'" in readme
    status, out, _ = run_cli(capsys, "simulate", "--help")
    assert status == 0 and "pip install '.[plot]'" in out and "pip install '.[plot]'" in readme
    assert "flat-kvcache[" not in out


# --- what the page counts are, and what fits together -----------------------------

# A Gemma-2-like config: 21 sliding (W=4096) + 21 full layers, C=8192; defaults B=256, S=8192,
# T=max(262144, 8192)=262144, P=16:
#   sliding: 256*ceil(min(4095, 8192)/16)=256*256=65536 + ceil(8192/16)=512 + 256 + 1 = 66305
#   full:    ceil(262144/16)=16384 + 256 + 1                                           = 16641
#   every group's worst case at once, the null page counted once: 1 + 66304 + 16640     = 82945
GEMMA2_LIKE = {
    "model_type": "gemma2",
    "num_hidden_layers": 42,
    "layer_types": [SLIDING, FULL] * 21,
    "sliding_window": 4096,
    "max_position_embeddings": 8192,
}


def test_page_counts_are_per_group_bounds_on_one_pool(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = write_config(tmp_path, GEMMA2_LIKE)
    plan = plan_json(capsys, "--config", str(path))
    assert {gid: g["max_pages"] for gid, g in by_id(plan).items()} == {SLIDING: 66305, FULL: 16641}
    assert plan["pool"]["pages_for_all_worst_cases"] == 82945
    assert "one shared pool" in plan["notes"]["max_pages"] and "do not add up" in plan["notes"]["max_pages"]
    status, out, _ = run_cli(capsys, "--config", str(path))
    text = " ".join(out.split())
    header = next(line for line in out.splitlines() if line.startswith("group "))
    assert status == 0 and "max pages" in header
    assert "one shared pool" in text and "do not add up" in text
    assert "a pool of 82945 pages holds every group's worst case at once" in text


# --- block-table widths: absolute tables vs windowed sliding tables ------------------


def test_table_width_is_what_block_tables_out_needs(capsys: pytest.CaptureFixture[str]) -> None:
    """A request at max context fills ``table_width`` columns in every group, the sliding one
    included (an absolute table keeps its slid-out slots as holes); ``windowed_width`` is too
    narrow for ``block_tables(out=)``."""
    plan = plan_json(capsys, "--max-context-len", "1000")
    groups = by_id(plan)
    # ceil((1000 + 1)/16) = 63 for both; windowed ceil((128 + 1)/16) + 1 = 10
    assert [(g["table_width"], g["windowed_width"]) for g in plan["groups"]] == [(63, 10), (63, None)]
    cache = flat_kvcache.cache_from_config(DEFAULT_PRESET, num_pages=1024)
    slot, _ = cache.add_request("r", list(range(999)))
    assert cache.schedule([slot], [999]).all()
    cache.append_tokens([slot], [5])
    assert cache.schedule([slot], [1]).all()  # token 1000; reclaim at 999 first
    out = {gid: np.full((1, g["table_width"]), -7, np.int32) for gid, g in groups.items()}
    cache.block_tables([slot], out=out)
    # Every column holds a slot of a 1000-token table; the sliding group's first
    # (999 - 128 + 1) // 16 = 54 slots have slid out and are holes (0).
    assert (out[FULL][0] > 0).all()
    assert (out[SLIDING][0, :54] == 0).all() and (out[SLIDING][0, 54:] > 0).all()
    narrow = {**out, SLIDING: np.empty((1, groups[SLIDING]["windowed_width"]), np.int32)}
    with pytest.raises(ValueError, match="columns"):
        cache.block_tables([slot], out=narrow)


def test_sizes_beyond_the_native_range(capsys: pytest.CaptureFixture[str]) -> None:
    assert_one_line_error(capsys, ["--max-total-tokens", str(2**70)], 1, "--max-total-tokens")


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--page-size", "0"], "argument --page-size: must be >= 1, got 0"),
        (["--max-live-requests", "-1"], "argument --max-live-requests: must be >= 0, got -1"),
        (["--max-total-tokens", "-5"], "argument --max-total-tokens: must be >= 0"),
        (["--max-context-len", "lots"], "argument --max-context-len: expected an int, got 'lots'"),
        (["--decode-input-tokens", "0"], "argument --decode-input-tokens: must be >= 1"),
        (["--overlap-schedule-depth", "2"], "argument --overlap-schedule-depth"),
        (["--config", "a.json", "--preset", DEFAULT_PRESET], "not allowed with argument"),
        (["--bogus"], "unrecognized arguments: --bogus"),
        (["bogus"], "invalid choice: 'bogus'"),
    ],
)
def test_usage_errors(capsys: pytest.CaptureFixture[str], argv: list[str], needle: str) -> None:
    assert_one_line_error(capsys, argv, 2, needle)


# --- as a program ----------------------------------------------------------------------------------


def run_module(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return run_python("-m", "flat_kvcache", *argv, cwd=cwd)


def test_python_m_plan_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = run_module("plan", "--json", cwd=tmp_path)
    assert (result.returncode, result.stderr) == (0, "")
    assert json.loads(result.stdout) == plan_json(capsys)


def test_python_m_table_and_preset(tmp_path: Path) -> None:
    result = run_module("--preset", "qwen3.5-like", cwd=tmp_path)
    assert (result.returncode, result.stderr) == (0, "")
    assert table_row(result.stdout, LINEAR)[3] == "state"


@pytest.mark.parametrize(
    ("argv", "status"),
    [(["--preset", "nope"], 1), (["--config", "missing.json"], 1), (["--page-size", "-1"], 2)],
)
def test_python_m_errors_have_no_traceback(tmp_path: Path, argv: list[str], status: int) -> None:
    result = run_module(*argv, cwd=tmp_path)
    assert result.returncode == status
    assert result.stdout == ""
    assert result.stderr.startswith("flat-kvcache: error: ") and result.stderr.count("\n") == 1, result.stderr


def test_python_m_with_a_closed_stdout_has_no_traceback(tmp_path: Path) -> None:
    with subprocess.Popen(
        [sys.executable, "-m", "flat_kvcache", "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=tmp_path,
        text=True,
    ) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        proc.stdout.close()  # the reader goes away before the plan is printed, as with `| head`
        err = proc.stderr.read()
        proc.wait(timeout=60)
    assert "Traceback" not in err
    assert proc.returncode in (0, 1)


def test_console_script(tmp_path: Path) -> None:
    script = Path(sys.executable).parent / "flat-kvcache"
    if not script.exists():
        pytest.skip("the flat-kvcache console script is not installed next to this interpreter")
    result = subprocess.run([str(script), "--json"], capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert result.returncode == 0
    assert json.loads(result.stdout)["model"]["source"] == f"preset {DEFAULT_PRESET}"
