"""``flat-kvcache simulate`` over Mooncake traces: the reader, the replay, the command line.

The expectations come from the format (kvcache-ai/Mooncake's FAST'25 trace release): each hash
id is one 512-token block, the last one possibly partial; equal ids are equal blocks. A replayed
prefix hit is then the shared blocks' tokens, aligned down to the cache's page size and capped
by SPEC 9's last-token rule (a prompt's last token is always computed, so at most
``(prompt - 1) // P`` pages hit).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flat_kvcache.simulate import (
    MOONCAKE_BLOCK_TOKENS,
    VOCAB,
    SimulationConfig,
    load_trace,
    mooncake_block,
    simulate,
)
from helpers import IN_CI, run_cli

B = MOONCAKE_BLOCK_TOKENS


def write_lines(tmp_path: Path, lines: list[Any], name: str = "mooncake.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def request(
    timestamp: float, hash_ids: list[int], input_length: int, output_length: int = 2
) -> dict[str, Any]:
    return {
        "timestamp": timestamp,
        "input_length": input_length,
        "output_length": output_length,
        "hash_ids": hash_ids,
    }


#: Request 2 shares request 1's first two blocks and then has its own; request 3's whole prompt
#: is those two blocks. Each arrives long after the one before has finished.
THREE = [
    request(0, [0, 1, 2], 2 * B + 476),
    request(10_000, [0, 1, 3], 2 * B + 176),
    request(20_000, [0, 1], 2 * B, output_length=1),
]


def test_equal_ids_give_equal_blocks_and_partial_last_blocks(tmp_path: Path) -> None:
    trace = load_trace(write_lines(tmp_path, THREE), seed=5)
    first, second, third = (r.prompt for r in trace)
    assert [len(p) for p in (first, second, third)] == [2 * B + 476, 2 * B + 176, 2 * B]
    assert all(p.dtype == np.uint32 and int(p.max()) < VOCAB for p in (first, second, third))
    # Each block is its id's tokens; the partial last block is the start of its id's block.
    assert np.array_equal(first[:B], mooncake_block(5, 0)) and np.array_equal(
        first[B : 2 * B], mooncake_block(5, 1)
    )
    assert np.array_equal(first[2 * B :], mooncake_block(5, 2)[:476])
    assert np.array_equal(second[2 * B :], mooncake_block(5, 3)[:176])
    # Equal id prefixes give equal token prefixes; different ids differ.
    assert np.array_equal(first[: 2 * B], second[: 2 * B]) and np.array_equal(first[: 2 * B], third)
    assert not np.array_equal(first[2 * B : 2 * B + 176], second[2 * B :])
    assert not np.array_equal(mooncake_block(5, 0), mooncake_block(5, 1))
    # The seed changes every block; the same seed gives the same trace.
    assert not np.array_equal(mooncake_block(5, 0), mooncake_block(6, 0))
    again = load_trace(write_lines(tmp_path, THREE, "again.jsonl"), seed=5)
    assert all(
        np.array_equal(a.prompt, b.prompt) and np.array_equal(a.output, b.output)
        for a, b in zip(trace, again, strict=True)
    )
    assert [r.output_len for r in trace] == [2, 2, 1]


def test_arrival_steps_are_timestamps_over_ms_per_step(tmp_path: Path) -> None:
    path = write_lines(tmp_path, [*THREE, request(20_075.5, [9], 10)])
    assert [r.arrival_step for r in load_trace(path)] == [0, 200, 400, 401]  # 50 ms per step
    assert [r.arrival_step for r in load_trace(path, ms_per_step=1000)] == [0, 10, 20, 20]


@pytest.mark.parametrize("engine", ["native", "reference"])
@pytest.mark.parametrize("page_size", [16, 48])
def test_shared_blocks_replay_as_a_prefix_hit(tmp_path: Path, engine: str, page_size: int) -> None:
    trace = load_trace(write_lines(tmp_path, THREE))
    config = SimulationConfig(engine=engine, num_pages=2000, page_size=page_size)  # type: ignore[arg-type]
    summary = simulate(trace, config).summary
    assert (summary["finished"], summary["preemptions"], summary["evictions"]) == (3, 0, 0)
    shared = 2 * B  # request 1's first two blocks
    # Request 2: the shared blocks, aligned down to a page (its prompt runs past them, so the
    # last-token rule does not bite). Request 3: its whole prompt is shared, so the rule does.
    hit_2 = min(shared // page_size, (len(trace[1].prompt) - 1) // page_size) * page_size
    hit_3 = min(shared // page_size, (len(trace[2].prompt) - 1) // page_size) * page_size
    assert hit_2 == shared // page_size * page_size and hit_3 == (shared - 1) // page_size * page_size
    assert summary["prefix_hits_tokens"] == hit_2 + hit_3
    assert summary["prefix_queries_tokens"] == sum(len(r.prompt) for r in trace)


@pytest.mark.parametrize(
    ("line", "field"),
    [
        ("{not json", "not valid JSON"),
        ({**THREE[0], "input_length": 3 * B + 1}, "input_length 1537 does not match 3 hash_ids"),
        ({**THREE[0], "input_length": 2 * B}, "input_length 1024 does not match 3 hash_ids"),
        ({**THREE[0], "input_length": "1500"}, "input_length must be an int >= 1"),
        ({**THREE[0], "output_length": 0}, "output_length must be an int >= 1"),
        ({**THREE[0], "hash_ids": []}, "hash_ids must be a non-empty list"),
        ({**THREE[0], "hash_ids": [0, -1, 2]}, r"hash_ids\[1\] = -1"),
        ({**THREE[0], "timestamp": "soon"}, "timestamp must be a finite number"),
        ({**THREE[0], "timestamp": -1}, "timestamp must be a finite number"),
        ('{"timestamp": Infinity, "input_length": 1, "output_length": 1, "hash_ids": [0]}', "timestamp must"),
        ({key: v for key, v in THREE[0].items() if key != "timestamp"}, "timestamp is required"),
        ({**THREE[0], "prompt_len": 4}, r"unknown field.s. prompt_len"),
    ],
)
def test_malformed_lines_name_file_line_and_field(tmp_path: Path, line: Any, field: str) -> None:
    path = write_lines(tmp_path, [THREE[0], line])
    with pytest.raises(ValueError, match=rf"^{path}:2: {field}"):
        load_trace(path)


def test_cli_malformed_line_is_one_error_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = write_lines(tmp_path, ["# a comment", THREE[0], {**THREE[1], "input_length": 5000}])
    status, out, err = run_cli(capsys, "simulate", "--trace", str(path))
    assert (status, out) == (1, "")
    assert err.startswith(f"flat-kvcache: error: --trace: {path}:3: input_length 5000 does not match 3")
    assert err.count("\n") == 1


@pytest.mark.parametrize("trace", ["mooncake", "jsonl", "built-in"])
def test_cli_max_requests_limits_the_run(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, trace: str
) -> None:
    lines = THREE if trace == "mooncake" else [{"prompt_len": 20, "output_len": 2}] * 3
    source = [] if trace == "built-in" else ["--trace", str(write_lines(tmp_path, lines))]
    status, out, err = run_cli(capsys, "simulate", *source, "--max-requests", "2", "--json")
    assert (status, err) == (0, "")
    assert json.loads(out)["requests"] == 2


def test_cli_refuses_a_bad_ms_per_step(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = run_cli(capsys, "simulate", "--ms-per-step", "0")
    assert (status, out) == (2, "")
    assert "--ms-per-step: must be a number > 0" in err


def real_trace() -> Path:
    """The Mooncake conversation trace: ``FLAT_KVCACHE_MOONCAKE_TRACE``, or ``shared/traces/`` in or
    beside the checkout. It is data kept outside the repository, so the test skips without it,
    except in CI."""
    name = "mooncake_conversation.jsonl"
    root = Path(__file__).resolve().parents[2]
    candidates = [root / "shared" / "traces" / name, root.parent / "shared" / "traces" / name]
    if "FLAT_KVCACHE_MOONCAKE_TRACE" in os.environ:
        candidates.insert(0, Path(os.environ["FLAT_KVCACHE_MOONCAKE_TRACE"]))
    for path in candidates:
        if path.is_file():
            return path
    if IN_CI:  # CI runs with shared/ beside the checkout: a missing trace is a broken setup
        pytest.fail(f"{name} not found beside the checkout (CI must run every test)")
    pytest.skip(f"{name} not found (set FLAT_KVCACHE_MOONCAKE_TRACE)")


def test_cli_replays_the_real_trace(capsys: pytest.CaptureFixture[str]) -> None:
    path = real_trace()
    status, out, err = run_cli(capsys, "simulate", "--trace", str(path), "--max-requests", "50", "--json")
    assert (status, err) == (0, "")
    summary = json.loads(out)
    assert (summary["requests"], summary["finished"]) == (50, 50)
    # The first 50 requests all start with hash id 0 (one shared block) and some are follow-ups.
    assert summary["prefix_hits_tokens"] > 0
    with path.open() as lines:
        firsts = [json.loads(next(lines)) for _ in range(50)]
    assert summary["prefix_queries_tokens"] == sum(r["input_length"] for r in firsts)
