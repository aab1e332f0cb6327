"""The decision digest of ``flat-kvcache simulate`` (``flat_kvcache.simulate.decisions``).

Two loops did the same work only if their digests match, so the digest must be deterministic,
must change when one decision changes, and must be the fold of the per-step records that
``--decisions`` writes (which the first-difference search reads). ``benches/vllm_compare.py
--check-digest`` checks the vLLM side in the vLLM drop-in CI step.
"""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flat_kvcache.simulate import (
    DecisionLog,
    SimulationConfig,
    TraceRequest,
    default_trace,
    first_difference,
    read_decisions,
    simulate,
)
from flat_kvcache.simulate.decisions import main as decisions_diff
from helpers import run_cli

ENGINES = ["native", "reference"]


def run(trace: list[TraceRequest], **config: Any) -> tuple[dict[str, Any], list[str]]:
    """A run's summary and its decision records (the JSONL lines)."""
    sink = io.StringIO()
    summary = simulate(trace, SimulationConfig(**config), decisions=sink).summary
    return summary, sink.getvalue().splitlines()


def pressure_trace() -> list[TraceRequest]:
    """40 short requests, 20 sharing 256 tokens: on 240 pages with 1024 tokens per step they
    queue, hit, are evicted and preempted (as in test_simulate's native-vs-reference test)."""
    return default_trace(40, seed=1, prompt_len=(128, 512), shared_prefix_len=256, output_len=128)


PRESSURE = {"num_pages": 240, "max_scheduled_tokens": 1024}


def two_short_requests() -> list[TraceRequest]:
    """Two 32-token prompts (no shared tokens) arriving at step 0, 2 output tokens each."""
    return [
        TraceRequest(
            rid, np.arange(rid * 100, rid * 100 + 32, dtype=np.uint32), np.array([7, 8], dtype=np.uint32)
        )
        for rid in (0, 1)
    ]


@pytest.mark.parametrize("engine", ENGINES)
def test_the_digest_is_deterministic_and_the_fold_of_the_records(engine: str) -> None:
    first, records = run(pressure_trace(), engine=engine, **PRESSURE)
    again, records_again = run(pressure_trace(), engine=engine, **PRESSURE)
    assert records == records_again and first["decisions"] == again["decisions"]
    # The digest is BLAKE2b-128 over the records' lines, one per step run.
    digest = hashlib.blake2b(digest_size=16)
    for line in records:
        digest.update(line.encode() + b"\n")
    assert first["decisions"] == {"digest": digest.hexdigest(), "steps": first["steps"]}
    assert len(records) == first["steps"]
    # The records are what the run did: their totals are the summary's counts.
    steps = [json.loads(line) for line in records]
    assert sum(len(s["finished"]) for s in steps) == first["finished"] == 40
    assert sum(len(s["preempted"]) for s in steps) == first["preemptions"] > 0
    assert sum(len(s["aborted"]) for s in steps) == first["aborted"]
    assert sum(hit for s in steps for _, hit, _ in s["admitted"]) == first["prefix_hits_tokens"] > 0
    scheduled = sum(n for s in steps for _, n in s["scheduled"]) + sum(
        chunk for s in steps for _, _, chunk in s["admitted"]
    )
    assert scheduled == first["scheduled_tokens"]
    # Every request is admitted once more than it is preempted, and finishes once.
    admitted = [rid for s in steps for rid, _, _ in s["admitted"]]
    preempted = [rid for s in steps for rid in s["preempted"]]
    assert sorted(admitted) == sorted(list(range(40)) + preempted)
    assert sorted(rid for s in steps for rid in s["finished"]) == list(range(40))


def test_both_engines_decide_alike() -> None:
    native, native_records = run(pressure_trace(), engine="native", **PRESSURE)
    reference, reference_records = run(pressure_trace(), engine="reference", **PRESSURE)
    assert native["decisions"] == reference["decisions"]
    assert native_records == reference_records


@pytest.mark.parametrize("engine", ENGINES)
def test_one_page_less_changes_one_admission(engine: str) -> None:
    """gpt-oss-like (two groups, P=16). Step 0: A's 32-token prompt is one chunk that completes
    it, so admit() checks 32 tokens plus one of reserve: 3 pages per group, 6; A then holds 2
    per group, 4. B needs the same 6: with 11 pages (10 free) 10 - 4 = 6 fits, with 10 pages
    (9 free) 5 does not, and B waits for A to finish (step 1) and is admitted at step 2."""
    roomy, roomy_records = run(two_short_requests(), engine=engine, num_pages=11)
    tight, tight_records = run(two_short_requests(), engine=engine, num_pages=10)
    assert roomy["decisions"] != tight["decisions"]
    difference = first_difference(map(json.loads, roomy_records), map(json.loads, tight_records))
    assert difference is not None and difference.index == 0 and difference.fields == ("admitted",)
    assert difference.left is not None and difference.right is not None
    assert difference.left["admitted"] == [[0, 0, 32], [1, 0, 32]]
    assert difference.right["admitted"] == [[0, 0, 32]]
    assert [json.loads(line)["admitted"] for line in tight_records][2] == [[1, 0, 32]]
    assert "admitted" in difference.describe("roomy", "tight")


def test_first_difference_names_the_first_differing_step_and_fields() -> None:
    log = DecisionLog(keep=True)
    log.record(0, admitted=[(0, 0, 32)])
    log.record(1, scheduled=[(0, 1)], finished=[0])
    log.record(2)
    records = log.records or []
    assert first_difference(records, records) is None
    changed = [dict(r) for r in records]
    changed[1] = {**changed[1], "scheduled": [[0, 2]], "preempted": [0]}
    difference = first_difference(records, changed)
    assert difference is not None and difference.index == 1
    assert difference.fields == ("scheduled", "preempted")
    shorter = first_difference(records, records[:2])
    assert shorter is not None and shorter.index == 2 and shorter.right is None
    assert "ended" in shorter.describe()
    # The digest folds every record: one decision changed, one digest changed.
    other = DecisionLog()
    other.record(0, admitted=[(0, 0, 32)])
    other.record(1, scheduled=[(0, 2)], finished=[0])
    other.record(2)
    assert other.summary()["steps"] == log.summary()["steps"] == 3
    assert other.summary()["digest"] != log.summary()["digest"]


def test_cli_writes_the_records_and_the_diff_names_the_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    files = []
    for pages in (11, 10):
        trace = tmp_path / "trace.jsonl"
        trace.write_text(
            "".join(
                json.dumps({"prompt": r.prompt.tolist(), "output_len": 2}) + "\n"
                for r in two_short_requests()
            )
        )
        path = tmp_path / f"decisions-{pages}.jsonl"
        status, out, _ = run_cli(
            capsys,
            "simulate",
            "--trace",
            str(trace),
            "--num-pages",
            str(pages),
            "--json",
            "--decisions",
            str(path),
        )
        assert status == 0
        summary = json.loads(out)
        assert len(read_decisions(path)) == summary["steps"] == summary["decisions"]["steps"]
        files.append(path)
    assert decisions_diff([str(files[0]), str(files[0])]) == 0
    assert "same decisions" in capsys.readouterr().out
    assert decisions_diff([str(files[0]), str(files[1])]) == 1
    assert "step #0" in capsys.readouterr().out
    # One engine's loop only: the records of a cluster's workers would interleave.
    status, _, err = run_cli(
        capsys, "simulate", "--num-requests", "4", "--workers", "2", "--decisions", str(tmp_path / "x.jsonl")
    )
    assert status == 1 and "--decisions" in err
