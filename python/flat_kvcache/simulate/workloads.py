"""Mooncake-format workloads of several shapes, for checkpoint policies beyond one trace (issue 38).

Each shape is a set of *sessions*. A session is one token stream, a list of segments (a system
prompt, a tool list, a document, a user turn, an answer, ...); its requests are cuts of that
stream: a request's prompt is the stream up to the start of an answer segment and its output is
that answer. Hash ids model content the way Mooncake's trace release does: the stream is cut into
512-token blocks (:data:`~flat_kvcache.simulate.trace.MOONCAKE_BLOCK_TOKENS`), and a block's id is
chained, ``id(prefix id, the block's content)``, numbered in order of first appearance. So two
prompts share a block id exactly when they hold the same tokens up to that block's end, and a
block that straddles a divergence (a shared document, then one request's own question) belongs
to one request only. A prompt's last block may be partial: it takes the id of the stream's whole
block there, whose first tokens it holds (``load_trace`` reads a partial block as the first
tokens of its id's block), so a prompt the next turn carries on is a token prefix of the next
turn's prompt, up to the token, as real conversations are. (Mooncake's own traces hash a
partial block's tokens alone, which rounds every such continuation down to 512 tokens.)

Outputs: the Mooncake format has no output tokens, and ``load_trace`` draws them from its seed.
:func:`carry_answers` gives a request the tokens a later prompt holds right after its own prompt
(the answer that later turn carries), where one does, so a replay sees an answer come back as a
real client's next turn would send it. It reads only the loaded trace, so it applies to any
trace (the shared conversation trace too, where hardly any prompt is carried whole).

The shapes (parameters from what such workloads are, not fitted to any cache policy; every
length is a log-normal draw given as median and sigma, clipped to a range):

- ``conversation``: the shared trace (``shared/traces/mooncake_conversation.jsonl``), passed
  through: its first ``num_requests`` lines, unchanged.
- ``agent`` (tool use): 4 applications, each with a system prompt of 1,500 to 5,000 tokens
  (uniform) and 2 tool lists of 2,000 to 12,000 tokens (JSON schemas of some 10 to 60 tools at
  ~200 tokens each); the 8 (application, tool list) pairs are picked Zipf(1) by popularity. Two
  tool lists of one application share its system prompt and diverge at the tool list (a
  mid-prompt divergence). A task is a user request (median 200, sigma 1.0, 20 to 3,000 tokens)
  run as a loop of model calls, geometric with mean 3 (at most 12): each call but the last emits
  a tool call (median 60, sigma 0.7, 10 to 400 tokens) and gets a tool result (median 300, sigma
  1.0, 20 to 4,000) that the next call's prompt carries; the last call answers (median 150,
  sigma 0.8, 10 to 1,000). The next call arrives after the tool ran (median 2 s, sigma 1.0,
  0.2 to 60 s). So prompts are 3.5 k to 17 k tokens of shared prefix and short divergent tails.
- ``doc_qa`` (document question answering): one instruction template of 600 tokens, then one
  of 40 documents (median 10,000 tokens, sigma 0.7, 2,000 to 60,000: a report or a paper),
  then a question (median 40, sigma 0.8, 5 to 400 tokens); answers median 200 (sigma 0.7, 20
  to 1,500). Documents are picked Zipf(1) by popularity; a user asks 1 + geometric questions
  about one document (mean 3, at most 20), independently (no history carried), each after the
  previous answer and a read/think time (median 20 s, sigma 1.0, 2 to 300 s). Every request
  shares the template's blocks; those on one document share its blocks and diverge at the
  question.
- ``multi_turn`` (chat with long answers): one system prompt of 800 tokens, then turns of user
  text (median 150, sigma 1.2, 10 to 4,000 tokens: some paste code or text) and long answers
  (median 700, sigma 0.6, 100 to 3,000 tokens); turn k's prompt is turn k-1's prompt, its
  answer and the new user text. Turns per conversation geometric with mean 5 (at most 30; a
  conversation stops once its prompt would pass 100 k tokens). The next turn arrives after the
  answer has been generated and read (median 60 s, sigma 1.0, 5 to 600 s: the shared trace's
  median gap between turns is 93 s).
- ``mix``: the first half of the requests is ``multi_turn``, the second ``doc_qa`` (its
  sessions start when the first half's last request arrives): the sharing shifts from
  continuation to mid-prompt halfway.
- ``mix_reversed``: the same shift the other way, ``doc_qa`` then ``multi_turn``: a policy that
  learned in the first half that finish checkpoints are never resumed from must notice in the
  second half that every next turn resumes at one (issue 38: it once stayed below LRU there).

Arrivals: sessions start as a Poisson process whose rate gives about
:data:`REQUESTS_PER_SECOND` requests per second (the shared trace's mean rate, 12,031 requests in
3,537 s), so every shape loads the replay like the shared trace does. A follow-up request's
timestamp also counts the time its predecessor's answer takes: one decode step of
:data:`~flat_kvcache.simulate.trace.DEFAULT_MS_PER_STEP` ms per token, and its prefill at
:data:`~flat_kvcache.simulate.loop.DEFAULT_MAX_SCHEDULED_TOKENS` tokens a step (an idle
engine: a loaded replay can be slower, as a real engine's clients would then wait longer).

Everything is drawn from ``seed`` (one generator per shape, ``[seed, shape index]``); the same
seed and sizes give the same lines.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from flat_kvcache.simulate.loop import DEFAULT_MAX_SCHEDULED_TOKENS
from flat_kvcache.simulate.trace import DEFAULT_MS_PER_STEP, MOONCAKE_BLOCK_TOKENS, TraceRequest

__all__ = [
    "GENERATED_SHAPES",
    "HALVES",
    "REQUESTS_PER_SECOND",
    "SHAPES",
    "carry_answers",
    "generate",
    "read_mooncake",
    "write_mooncake",
]

#: Every shape, in the order the benches report them.
SHAPES = ("conversation", "agent", "doc_qa", "multi_turn", "mix", "mix_reversed")
#: The shapes whose halves differ, with the shape of each half.
HALVES = {"mix": ("multi_turn", "doc_qa"), "mix_reversed": ("doc_qa", "multi_turn")}
#: The shapes this module makes up (``conversation`` is read from a file).
GENERATED_SHAPES = SHAPES[1:]
#: Mean arrival rate of every generated shape (the shared conversation trace's).
REQUESTS_PER_SECOND = 3.4

B = MOONCAKE_BLOCK_TOKENS

#: A segment's key names its content: equal keys are equal tokens.
Key = tuple[Any, ...]


@dataclass(frozen=True)
class _Segment:
    key: Key
    length: int


@dataclass
class _Stream:
    """One session's token stream and the block ids of its windows, computed as far as asked."""

    segments: list[_Segment]
    ids: list[int] = field(default_factory=list)

    @property
    def length(self) -> int:
        return sum(segment.length for segment in self.segments)


@dataclass(frozen=True)
class _Request:
    timestamp_ms: float
    stream: _Stream
    input_length: int
    output_length: int


class _BlockIds:
    """Chained block ids, numbered in order of first appearance (as Mooncake numbers them)."""

    def __init__(self) -> None:
        self.table: dict[tuple[int, tuple[tuple[Key, int, int], ...]], int] = {}

    def extend(self, stream: _Stream, tokens: int) -> list[int]:
        """The ids of the blocks of ``stream`` that cover its first ``tokens`` tokens."""
        wanted = math.ceil(tokens / B)
        if len(stream.ids) < wanted:
            starts = np.cumsum([0] + [s.length for s in stream.segments])
            for block in range(len(stream.ids), wanted):
                lo, hi = block * B, (block + 1) * B
                first = int(np.searchsorted(starts, lo, side="right")) - 1
                pieces = []
                for index in range(first, len(stream.segments)):
                    start = int(starts[index])
                    if start >= hi:
                        break
                    segment = stream.segments[index]
                    a, b = max(lo, start) - start, min(hi, start + segment.length) - start
                    if b > a:
                        pieces.append((segment.key, a, b))
                prev = stream.ids[-1] if stream.ids else -1
                key = (prev, tuple(pieces))
                stream.ids.append(self.table.setdefault(key, len(self.table)))
        return stream.ids[:wanted]


class _Draw:
    """The shape generators' random draws."""

    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng

    def lognormal(self, median: float, sigma: float, low: float, high: float) -> float:
        return float(np.clip(median * math.exp(sigma * self.rng.standard_normal()), low, high))

    def tokens(self, median: float, sigma: float, low: int, high: int) -> int:
        return round(self.lognormal(median, sigma, low, high))

    def geometric(self, mean: float, cap: int) -> int:
        """A count >= 1 with the given mean (before the cap)."""
        return min(int(self.rng.geometric(1.0 / mean)), cap)

    def zipf_choice(self, count: int, s: float = 1.0) -> int:
        weights = 1.0 / np.arange(1, count + 1) ** s
        return int(self.rng.choice(count, p=weights / weights.sum()))

    def uniform_int(self, low: int, high: int) -> int:
        return int(self.rng.integers(low, high, endpoint=True))


def _answer_ms(prompt: int, output: int) -> float:
    """How long an idle engine takes to prefill ``prompt`` tokens and generate ``output``."""
    steps = math.ceil(prompt / DEFAULT_MAX_SCHEDULED_TOKENS) + output
    return steps * DEFAULT_MS_PER_STEP


def _requests_of(stream: _Stream, start_ms: float, gaps_ms: Sequence[float]) -> list[_Request]:
    """A request before every answer segment (key ``(..., "answer", ...)``) of ``stream``; the
    first at ``start_ms``, each later one when its predecessor's answer is done plus its gap."""
    requests: list[_Request] = []
    offset, now = 0, start_ms
    answers = 0
    for segment in stream.segments:
        if segment.key[1] == "answer":
            if answers:
                previous = requests[-1]
                now += _answer_ms(previous.input_length, previous.output_length) + gaps_ms[answers - 1]
            requests.append(_Request(now, stream, offset, segment.length))
            answers += 1
        offset += segment.length
    return requests


def _sessions(
    shape: str, draw: _Draw, num_requests: int, mean_requests: float, start_ms: float = 0.0
) -> list[_Request]:
    """Sessions of ``shape`` starting as a Poisson process at ``start_ms`` until the first
    ``num_requests`` requests by timestamp are known; those, in timestamp order."""
    maker = {"agent": _agent_session, "doc_qa": _doc_qa_session, "multi_turn": _multi_turn_session}[shape]
    session_gap_ms = 1000.0 * mean_requests / REQUESTS_PER_SECOND
    world = _world(shape, draw)
    requests: list[_Request] = []
    now = start_ms
    index = 0
    while True:
        now += draw.rng.exponential(session_gap_ms)
        if sum(1 for r in requests if r.timestamp_ms < now) >= num_requests:
            break
        requests.extend(maker(world, draw, index, now))
        index += 1
    requests.sort(key=lambda r: r.timestamp_ms)
    return requests[:num_requests]


def _world(shape: str, draw: _Draw) -> dict[str, Any]:
    """What a shape's sessions share: system prompts, tool lists, documents."""
    if shape == "agent":
        apps = [draw.uniform_int(1500, 5000) for _ in range(4)]
        tools = [[draw.uniform_int(2000, 12000) for _ in range(2)] for _ in apps]
        order = [int(i) for i in draw.rng.permutation(len(apps) * 2)]  # popularity rank -> pair
        return {"apps": apps, "tools": tools, "order": order}
    if shape == "doc_qa":
        docs = [draw.tokens(10_000, 0.7, 2_000, 60_000) for _ in range(40)]
        order = [int(i) for i in draw.rng.permutation(len(docs))]
        return {"docs": docs, "order": order}
    return {}


def _agent_session(world: dict[str, Any], draw: _Draw, index: int, start_ms: float) -> list[_Request]:
    pair = world["order"][draw.zipf_choice(len(world["order"]))]
    app, tool = divmod(pair, 2)
    segments = [
        _Segment(("agent", "system", app), world["apps"][app]),
        _Segment(("agent", "tools", app, tool), world["tools"][app][tool]),
        _Segment(("agent", "task", index), draw.tokens(200, 1.0, 20, 3000)),
    ]
    calls = draw.geometric(3, 12)
    gaps = []
    for call in range(calls - 1):
        segments.append(_Segment(("agent", "answer", index, call), draw.tokens(60, 0.7, 10, 400)))
        segments.append(_Segment(("agent", "result", index, call), draw.tokens(300, 1.0, 20, 4000)))
        gaps.append(1000.0 * draw.lognormal(2.0, 1.0, 0.2, 60.0))
    segments.append(_Segment(("agent", "answer", index, calls - 1), draw.tokens(150, 0.8, 10, 1000)))
    return _requests_of(_Stream(segments), start_ms, gaps)


DOC_QA_INSTRUCTION = 600


def _doc_qa_session(world: dict[str, Any], draw: _Draw, index: int, start_ms: float) -> list[_Request]:
    doc = world["order"][draw.zipf_choice(len(world["order"]))]
    requests: list[_Request] = []
    now = start_ms
    for question in range(draw.geometric(3, 20)):
        segments = [
            _Segment(("doc_qa", "instruction"), DOC_QA_INSTRUCTION),
            _Segment(("doc_qa", "document", doc), world["docs"][doc]),
            _Segment(("doc_qa", "question", index, question), draw.tokens(40, 0.8, 5, 400)),
            _Segment(("doc_qa", "answer", index, question), draw.tokens(200, 0.7, 20, 1500)),
        ]
        if requests:
            previous = requests[-1]
            now += _answer_ms(previous.input_length, previous.output_length)
            now += 1000.0 * draw.lognormal(20.0, 1.0, 2.0, 300.0)
        requests.extend(_requests_of(_Stream(segments), now, []))
    return requests


MULTI_TURN_SYSTEM = 800
MULTI_TURN_MAX_PROMPT = 100_000


def _multi_turn_session(world: dict[str, Any], draw: _Draw, index: int, start_ms: float) -> list[_Request]:
    segments = [_Segment(("multi_turn", "system"), MULTI_TURN_SYSTEM)]
    gaps = []
    length = MULTI_TURN_SYSTEM
    for turn in range(draw.geometric(5, 30)):
        user = draw.tokens(150, 1.2, 10, 4000)
        answer = draw.tokens(700, 0.6, 100, 3000)
        if turn and length + user > MULTI_TURN_MAX_PROMPT:
            break
        segments.append(_Segment(("multi_turn", "user", index, turn), user))
        segments.append(_Segment(("multi_turn", "answer", index, turn), answer))
        length += user + answer
        gaps.append(1000.0 * draw.lognormal(60.0, 1.0, 5.0, 600.0))
    return _requests_of(_Stream(segments), start_ms, gaps)


#: Mean requests per session of each generated shape (the session rate is the request rate over it).
_MEAN_REQUESTS = {"agent": 3.0, "doc_qa": 3.0, "multi_turn": 5.0}


def _records(requests: Iterable[_Request]) -> list[dict[str, Any]]:
    ids = _BlockIds()
    return [
        {
            "timestamp": round(r.timestamp_ms),
            "input_length": r.input_length,
            "output_length": r.output_length,
            "hash_ids": ids.extend(r.stream, r.input_length),
        }
        for r in requests
    ]


def generate(
    shape: str, num_requests: int = 3000, *, seed: int = 0, trace: str | os.PathLike[str] | None = None
) -> list[dict[str, Any]]:
    """The first ``num_requests`` requests of ``shape`` (one of :data:`SHAPES`) as Mooncake
    records (``timestamp``, ``input_length``, ``output_length``, ``hash_ids``), in timestamp
    order. ``conversation`` reads them from ``trace`` (the shared conversation trace)."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    if shape == "conversation":
        if trace is None:
            raise ValueError("the conversation shape is the shared trace: pass its path as trace")
        return read_mooncake(trace, num_requests)
    draw = _Draw(np.random.default_rng([seed, SHAPES.index(shape)]))
    if shape not in HALVES:
        return _records(_sessions(shape, draw, num_requests, _MEAN_REQUESTS[shape]))
    one, two = HALVES[shape]
    first = _sessions(one, draw, num_requests // 2 or 1, _MEAN_REQUESTS[one])
    second = _sessions(two, draw, num_requests - len(first), _MEAN_REQUESTS[two], first[-1].timestamp_ms)
    return _records(first + second)


def read_mooncake(path: str | os.PathLike[str], num_requests: int | None = None) -> list[dict[str, Any]]:
    """The first ``num_requests`` request lines of a Mooncake trace file, as dicts."""
    records: list[dict[str, Any]] = []
    with open(path, encoding="utf-8") as file:
        for line in file:
            text = line.strip()
            if not text or text.startswith("#"):
                continue
            if num_requests is not None and len(records) >= num_requests:
                break
            records.append(json.loads(text))
    return records


def write_mooncake(records: Iterable[dict[str, Any]], path: str | os.PathLike[str]) -> Path:
    """Write Mooncake records, one JSON object a line; returns the path."""
    path = Path(path)
    with open(path, "w", encoding="utf-8") as file:
        for record in records:
            file.write(json.dumps(record) + "\n")
    return path


def _extensions(records: Sequence[dict[str, Any]]) -> Iterator[tuple[int, int]]:
    """``(i, j)``: request ``j`` is the first after ``i`` in file order whose hash ids start with
    all of ``i``'s (chained ids: its last id at the same position) and whose prompt holds
    ``i``'s prompt and output."""
    later: dict[tuple[int, int], int] = {}
    for i in range(len(records) - 1, -1, -1):
        ids = records[i]["hash_ids"]
        j = later.get((len(ids) - 1, ids[-1]))
        if (
            j is not None
            and records[j]["hash_ids"][: len(ids)] == ids
            and records[j]["input_length"] >= records[i]["input_length"] + records[i]["output_length"]
        ):
            yield i, j
        for position, hash_id in enumerate(ids):
            later[(position, hash_id)] = i


def carry_answers(
    trace: Sequence[TraceRequest], records: Sequence[dict[str, Any]]
) -> tuple[list[TraceRequest], int]:
    """``trace`` (``load_trace`` of ``records``, so ``request_id`` is the line index) with each
    request's output replaced by the tokens the first later prompt that extends its prompt holds
    right after it (the answer that later turn carries); and how many were replaced. A request
    whose prompt no later prompt extends by at least its output keeps its drawn output."""
    by_id = {request.request_id: request for request in trace}
    replaced: dict[int, TraceRequest] = {}
    for i, j in _extensions(records):
        if i not in by_id or j not in by_id:
            continue
        mine, theirs = by_id[i], by_id[j]
        n = len(mine.prompt)
        if not np.array_equal(theirs.prompt[:n], mine.prompt):
            continue
        replaced[i] = replace(mine, output=theirs.prompt[n : n + mine.output_len].copy())
    return [replaced.get(request.request_id, request) for request in trace], len(replaced)
