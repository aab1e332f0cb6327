"""The workload generator of the checkpoint-policy bench (``flat_kvcache.simulate.workloads``).

Each shape is checked for the property that defines it, read back from the generated Mooncake
records: chained block ids (a block id determines everything before it), the shared prefixes
of the agent shape, the documents and question divergence of document QA, the carried answers of
multi-turn chat, the halfway shift of the mix; then determinism by seed, the project's own
reader, and the answers ``carry_answers`` hands to the replay.
"""

from __future__ import annotations

import itertools
import json
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flat_kvcache.simulate import MOONCAKE_BLOCK_TOKENS, load_trace
from flat_kvcache.simulate.workloads import (
    GENERATED_SHAPES,
    HALVES,
    carry_answers,
    generate,
    read_mooncake,
    write_mooncake,
)

B = MOONCAKE_BLOCK_TOKENS
N = 400

Record = dict[str, Any]


@pytest.fixture(scope="module")
def traces() -> dict[str, list[Record]]:
    return {shape: generate(shape, N, seed=3) for shape in GENERATED_SHAPES}


def _common_blocks(a: list[int], b: list[int]) -> int:
    count = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        count += 1
    return count


@pytest.mark.parametrize("shape", GENERATED_SHAPES)
def test_records_are_mooncake_lines_in_time_order(traces: dict[str, list[Record]], shape: str) -> None:
    records = traces[shape]
    assert len(records) == N
    stamps = [r["timestamp"] for r in records]
    assert stamps == sorted(stamps) and stamps[0] >= 0
    for r in records:
        assert set(r) == {"timestamp", "input_length", "output_length", "hash_ids"}
        assert r["output_length"] >= 1
        # The last block holds 1 to 512 tokens (the format's rule).
        assert 1 <= r["input_length"] - B * (len(r["hash_ids"]) - 1) <= B


@pytest.mark.parametrize("shape", GENERATED_SHAPES)
def test_block_ids_are_chained(traces: dict[str, list[Record]], shape: str) -> None:
    """Mooncake's ids are chained: an id at position k always follows the same k ids (so equal
    ids mean equal prefixes), and ids are numbered in order of first appearance."""
    before: dict[int, tuple[int, ...]] = {}
    next_new = 0
    for r in traces[shape]:
        ids = r["hash_ids"]
        for k, block in enumerate(ids):
            prefix = tuple(ids[:k])
            assert before.setdefault(block, prefix) == prefix
            if block >= next_new:
                assert block == next_new
                next_new += 1
        assert len(set(ids)) == len(ids)


def test_agent_shares_a_few_long_prefixes_and_diverges_in_a_short_tail(
    traces: dict[str, list[Record]],
) -> None:
    records = traces["agent"]
    # A few system prompts: the distinct first blocks (4 applications, at most).
    firsts = Counter(r["hash_ids"][0] for r in records)
    assert 2 <= len(firsts) <= 4
    # System prompt + tool list: at most 8 distinct (application, tool list) prefixes, each at
    # least 3,500 tokens, the most popular one used by many requests.
    prefixes = Counter(tuple(r["hash_ids"][: 3500 // B]) for r in records)
    assert len(prefixes) <= 8
    assert prefixes.most_common(1)[0][1] >= N // 8
    # Tool lists of one application diverge after its system prompt (mid-prompt).
    by_first: dict[int, set[tuple[int, ...]]] = {}
    for prefix in prefixes:
        by_first.setdefault(prefix[0], set()).add(prefix)
    assert any(len(group) > 1 for group in by_first.values())
    # Short tails: what a request shares with the most similar earlier one is most of its prompt.
    shared_share = []
    seen: list[list[int]] = []
    for r in records[:150]:
        best = max((_common_blocks(r["hash_ids"], ids) for ids in seen), default=0)
        shared_share.append(best * B / r["input_length"])
        seen.append(r["hash_ids"])
    assert np.median(shared_share[20:]) > 0.6


def test_doc_qa_has_few_documents_and_diverges_at_the_question(traces: dict[str, list[Record]]) -> None:
    records = traces["doc_qa"]
    # One instruction template: every prompt starts with the same block.
    assert len({r["hash_ids"][0] for r in records}) == 1
    # Group the requests by document: requests on one document share all its whole blocks. The
    # second block (instruction 600 tokens, so block 1 holds the document's start) names the
    # document's group.
    groups: dict[int, list[Record]] = {}
    for r in records:
        groups.setdefault(r["hash_ids"][1], []).append(r)
    assert 2 <= len(groups) <= 40
    assert max(len(g) for g in groups.values()) >= N // 10  # many questions on one document
    for group in groups.values():
        if len(group) < 2:
            continue
        lengths = [len(r["hash_ids"]) for r in group]
        shared = min(_common_blocks(group[0]["hash_ids"], r["hash_ids"]) for r in group[1:])
        # The questions are short: everything but the last block or two is the shared document,
        # and two questions never share the block that holds the question.
        assert shared >= min(lengths) - 2
        last_blocks = Counter(tuple(r["hash_ids"][shared:]) for r in group)
        assert all(count == 1 for count in last_blocks.values())
    # The document ends mid-block, so divergence is at the block that holds the question's
    # start: each group's common prefix ends at the same block for every pair.
    for group in groups.values():
        if len(group) >= 3:
            pairs = {_common_blocks(a["hash_ids"], b["hash_ids"]) for a, b in itertools.pairwise(group)}
            assert len(pairs) == 1


def test_multi_turn_turns_extend_the_previous_turn_and_its_answer(traces: dict[str, list[Record]]) -> None:
    records = traces["multi_turn"]
    continued = 0
    for i, r in enumerate(records):
        ids = r["hash_ids"]
        for later in records[i + 1 :]:
            if later["hash_ids"][: len(ids)] == ids:
                # The next turn holds this prompt whole (its last block too) and the answer.
                assert later["input_length"] >= r["input_length"] + r["output_length"]
                assert later["timestamp"] > r["timestamp"]
                continued += 1
                break
    # Conversations of about 5 turns, 4 of them continued; the trace's window cuts the
    # conversations in progress at its end (a minute or more between turns), so fewer here.
    assert continued >= N // 3
    # Long answers: the median output is several hundred tokens.
    assert np.median([r["output_length"] for r in records]) >= 300


def _continued(records: list[Record]) -> int:
    """How many of ``records`` a later one extends (holds whole, plus more)."""
    return sum(
        any(later["hash_ids"][: len(r["hash_ids"])] == r["hash_ids"] for later in records[i + 1 :])
        for i, r in enumerate(records)
    )


@pytest.mark.parametrize("shape", sorted(HALVES))
def test_the_mixes_shift_shape_halfway(traces: dict[str, list[Record]], shape: str) -> None:
    records = traces[shape]
    halves = {"first": records[: N // 2], "second": records[N // 2 :]}
    # Each half starts with its own template (the chat system prompt, the QA instruction).
    starts = {name: {r["hash_ids"][0] for r in half} for name, half in halves.items()}
    assert len(starts["first"]) == 1 and len(starts["second"]) == 1 and starts["first"] != starts["second"]
    assert max(r["timestamp"] for r in halves["first"]) <= min(r["timestamp"] for r in halves["second"])
    # The multi_turn half continues its turns; the doc_qa half's questions never carry another
    # question whole (each ends in its own last block).
    chat, qa = ("first", "second") if HALVES[shape] == ("multi_turn", "doc_qa") else ("second", "first")
    assert HALVES[shape] in {("multi_turn", "doc_qa"), ("doc_qa", "multi_turn")}
    assert _continued(halves[chat]) >= N // 8
    assert _continued(halves[qa]) == 0


@pytest.mark.parametrize("shape", GENERATED_SHAPES)
def test_same_seed_same_trace_other_seed_other_trace(shape: str) -> None:
    assert generate(shape, 120, seed=7) == generate(shape, 120, seed=7)
    assert generate(shape, 120, seed=7) != generate(shape, 120, seed=8)


def test_a_longer_trace_starts_with_the_shorter_one() -> None:
    """A prefix of the workload is the workload of fewer requests (the bench's prefixes)."""
    for shape in ("agent", "doc_qa"):
        assert generate(shape, 300, seed=1)[:100] == generate(shape, 100, seed=1)


@pytest.mark.parametrize("shape", GENERATED_SHAPES)
def test_the_project_reader_loads_it(tmp_path: Path, shape: str, traces: dict[str, list[Record]]) -> None:
    records = traces[shape]
    path = write_mooncake(records, tmp_path / f"{shape}.jsonl")
    assert read_mooncake(path) == records
    trace = load_trace(path)
    assert len(trace) == N
    by_id = {request.request_id: request for request in trace}
    for index, record in enumerate(records):
        request = by_id[index]
        assert len(request.prompt) == record["input_length"]
        assert request.output_len == record["output_length"]
    # Equal leading ids are equal tokens (the reader's rule), so the chained ids share real content.
    a, b = records[0], next(r for r in records[1:] if r["hash_ids"][0] == records[0]["hash_ids"][0])
    k = _common_blocks(a["hash_ids"], b["hash_ids"])
    tokens = min(k * B, a["input_length"], b["input_length"])
    assert np.array_equal(by_id[0].prompt[:tokens], by_id[records.index(b)].prompt[:tokens])


def test_carry_answers_gives_each_turn_the_answer_the_next_turn_holds(
    tmp_path: Path, traces: dict[str, list[Record]]
) -> None:
    records = traces["multi_turn"]
    trace = load_trace(write_mooncake(records, tmp_path / "chat.jsonl"))
    carried, count = carry_answers(trace, records)
    assert count >= N // 3
    by_id = {request.request_id: request for request in carried}
    checked = 0
    for i, r in enumerate(records):
        later = next(
            (j for j in range(i + 1, N) if records[j]["hash_ids"][: len(r["hash_ids"])] == r["hash_ids"]),
            None,
        )
        mine = by_id[i]
        assert mine.output_len == r["output_length"]
        if later is None:
            continue
        # The output is the tokens the next turn's prompt holds right after this prompt.
        n = r["input_length"]
        assert np.array_equal(mine.output, by_id[later].prompt[n : n + mine.output_len])
        checked += 1
    assert checked == count


def test_carry_answers_leaves_unrelated_requests_alone(tmp_path: Path) -> None:
    records = [
        {"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [0, 1]},
        {"timestamp": 10, "input_length": 700, "output_length": 5, "hash_ids": [0, 2]},
    ]
    path = tmp_path / "two.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    trace = load_trace(path)
    carried, count = carry_answers(trace, records)
    assert count == 0 and carried == trace


def test_unknown_shape_and_missing_trace_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown shape"):
        generate("chat", 10)
    with pytest.raises(ValueError, match="trace"):
        generate("conversation", 10)
