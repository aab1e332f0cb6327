"""An offline upper bound on a hybrid's prefix hit rate at a budget (issue 38, bench only).

Issue 38 asks for hybrid / attention-only >= 0.85 at B25 and B50 on every workload of
``benches/policy_matrix.py``, or, where that is beyond reach, the reason measured: what a policy
that knows the future hits in the same bytes. This bench computes that for the same replay
(workload, prefix of requests, budget Bx) without running the engine: Python and numpy over the
trace (the preset's byte costs come from ``policy_matrix.preset_costs``, which needs the torch
extra, as the matrix does).

**The model.** Requests in arrival order (``load_trace`` of the workload's Mooncake file, then
``carry_answers``, as ``policy_matrix.py`` replays them), each a token sequence: its prompt, then
its output (the tokens a later prompt carries where ``carry_answers`` found one). Prefix identity
is a hash chain over 16-token pages of those tokens (what the engine hashes; Mooncake's 512-token
block ids would miss the partial last blocks and the carried answers). A request runs, as in
``working_set_bytes``, from its arrival step for ``ceil(prompt / 8192)`` prefill steps and one
step per output token, on an engine never short of anything.

- *Items*: a page (its K/V in every attention layer: 16 x 24,576 bytes) and a checkpoint at
  ANY multiple of G = 64 tokens of any request's path (the state slot, 77,266,944 bytes): a
  superset of what SPEC 13.5 places, so the bound holds for every placement rule.
- *Hit*: the deepest b, a multiple of G, b <= prompt - 1 (the engine never hits a whole prompt),
  with the checkpoint at b and the pages of [0, b) resident at the arrival; attention only: the
  deepest cached page prefix, at most ``(prompt - 1) // 16`` pages (SPEC 9). Hit rate = hit
  tokens / prompt tokens, as the matrix counts it.
- *Producers*: every request computes its whole path, so each page and each checkpoint on it is
  produced by every request that passes through it, whatever the cache did. An item is
  available from the step its producer computes it (a prompt's page at the end of its prefill
  chunk, an output page when decoded) and costs the cache nothing while a producer holding it
  runs (it is part of that request's memory). Otherwise, to serve request r it must stay cached
  from the latest finish of a producer before r's arrival up to that arrival: an interval that
  serves r alone (r produces the item again), so **the choices of different requests share
  nothing but memory**: the offline problem is to give each request r a depth k_r with
  sum over r of the bytes of r's items whose intervals hold step t <= C(t) at every step t, and
  the most hit tokens. (Checkpoints cost from their producer's finish, not from when it wrote
  them: generous.)
- *Capacity* C(t) (``--capacity``, both by default): ``running``: Bx less the least the running
  requests hold at step t in this model: a state slot each (hybrid), the K/V of their prompts'
  full pages after prefill counted once across requests that share them, their partial last
  pages and their output as decoded. It is >= Bx - W (W: the peak of the running requests'
  bytes with nothing shared, ``policy_matrix.working_set_bytes``), so it gives the cache every
  byte the engine could give it. ``cache``: the constant Bx - W = x % of the unique blocks'
  attention-only K/V (the bytes the budget adds for the cache; tighter, and no bound on the
  engine, which uses W's slack when fewer requests run).

**The bound.** The problem is a packing integer program (a knapsack over time with prefix
structure; NP-hard in general). Its Lagrangian relaxation: with a price lambda_s >= 0 per byte on
each time segment s (between consecutive arrival / finish steps, where the usage is constant),
``UB(lambda) = sum_s lambda_s C_s + sum_r max(0, max_k [hit(k) - priced bytes of r's items at
depth k])``: for every lambda an upper bound on the relaxation's optimum, hence on the integer
optimum (weak duality). ``UB`` is minimised by projected subgradient steps (Polyak step toward the
best feasible value), and the smallest UB seen is reported: **bound**. A feasible offline
schedule (**offline**): requests in order of hit tokens per priced byte at the last prices,
each given the deepest depth that still fits under C at every step (then a second pass that
deepens where room is left); so the offline optimum of the model lies in [offline, bound].

**Where the model is generous or approximate** (each error raises the bound unless said):
checkpoints anywhere, free while their producer runs and charged only from its finish; items
available at the end of the producer's prefill chunk; hit pages of a running request counted
once across requests; no preemption, no queueing, no pages or slots lost to fragmentation. Not
a strict bound on the engine in one respect: the timing is the unconstrained engine's, while
the engine may run a request longer (contention) or later (queueing), which moves the
intervals either way.

**A check of the model** (not a bound): ``model_lru`` replays an online LRU over the attention
layers alone in the same model (same pages, timing and capacity), to set beside the engine's
measured attention-only ``lru`` (``--matrix``): where they agree, the model's memory and timing
are the engine's.

**The online counterpart of the offline schedule** (not a bound): ``model_lru`` of the hybrid
(``model_lru_hybrid``) keeps what the offline schedule keeps, each request's path and the
checkpoint its continuation resumes from (its decode checkpoint, SPEC 13.5d, and a branch point,
13.5c), and evicts the least recently used item instead of knowing the future. Bound minus it is
what knowing the future adds to that keeping; it minus the engine's ``reuse`` is what the engine
loses to everything the model leaves out (its other checkpoints, its allocator, its timing).
The same with the decode hold charged (``model lru hybrid, decode held``): the engine keeps a
decoding request's latest decode checkpoint (SPEC 13.5d, the finish checkpoint in the making) in
a state slot beside the working one from the first boundary decode reaches to the finish, which
the model above and the bound charge only from the finish; this column takes a state slot per
such request off C(t).

    python benches/hybrid_bound.py                                # 3 workloads x 4 prefixes x B25, B50
    python benches/hybrid_bound.py --matrix matrix.json           # with the measured hit rates
    python benches/hybrid_bound.py --workload multi_turn --prefix 0.1 --budget 25
    python benches/hybrid_bound.py --json > bound.json
    python benches/hybrid_bound.py --smoke                        # under a second

``--matrix FILE`` (repeatable) reads ``policy_matrix.py --json`` output and adds the measured
attention-only / lru / reuse hit rates of the same cells. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import sys
import tempfile
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from flat_kvcache.simulate import (
    DEFAULT_MAX_SCHEDULED_TOKENS,
    DEFAULT_MS_PER_STEP,
    MOONCAKE_BLOCK_TOKENS,
    load_trace,
)
from flat_kvcache.simulate.workloads import SHAPES, carry_answers, generate, write_mooncake

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hybrid_hits import TRACE_NAME, _find_trace
from policy_matrix import PREFIXES, preset_costs, working_set_bytes

#: The workloads whose hybrid / attention-only ratio is below 0.85 in the 2026-12-06 matrix.
MISSED = ("conversation", "multi_turn", "mix")
FRACTIONS = (0.25, 0.50)
PAGE = 16
GRAIN = 64
#: ``qwen3.5-like``'s state slot and its attention layers' K/V per token, as the policy matrix
#: computes them (its JSON records them as ``state_bytes``, ``attention_kv_bytes_per_token``;
#: ``--matrix`` checks them against the file).
STATE_BYTES, KV_BYTES_PER_TOKEN = preset_costs()

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]


@dataclass
class Replay:
    """One prefix of a workload, reduced to what the bound needs.

    Request r (in arrival order) may use its first ``usable[r]`` pages: ``start[o[r] + j]`` is
    the step from which page j must stay cached to serve r (``== arrival[r]``: free, a running
    producer holds it), ``o = offsets``. Steps: ``hold_pages[t]`` the least K/V the running
    requests hold at step t, ``running[t]`` how many run, ``decoding[t]`` how many of them hold
    a decode checkpoint (SPEC 13.5d: from the decode step that reaches the first multiple of G
    at or past the prompt's end to the finish, a state slot beside the working one)."""

    arrival: IntArray
    finish: IntArray
    prompt_len: IntArray
    offsets: IntArray  # len(requests) + 1
    start: IntArray  # flat, one per usable page
    hold_pages: FloatArray
    running: IntArray
    decoding: IntArray
    prompt_tokens: int
    unique_blocks: int
    working_set: int
    carried: int
    paths: list[list[int]]  # per request, the page hashes of prompt and output


def _page_hashes(tokens: npt.NDArray[np.uint32]) -> list[int]:
    """A hash chain over the full 16-token pages of ``tokens`` (the engine's prefix identity)."""
    data = tokens.astype(np.uint32).tobytes()
    width = 4 * PAGE
    chain = 0
    out = []
    for j in range(len(tokens) // PAGE):
        chain = hash((chain, data[width * j : width * (j + 1)]))
        out.append(chain)
    return out


def build_replay(path: Path, records: list[dict[str, Any]], count: int, ms_per_step: float) -> Replay:
    """The first ``count`` requests of the Mooncake file ``path`` (``records`` its lines)."""
    trace = load_trace(path, max_requests=count, ms_per_step=ms_per_step)
    trace, carried = carry_answers(trace, records[:count])
    arrival = np.array([request.arrival_step for request in trace], dtype=np.int64)
    prompt_len = np.array([len(request.prompt) for request in trace], dtype=np.int64)
    output_len = np.array([len(request.output) for request in trace], dtype=np.int64)
    prefill = -(-prompt_len // DEFAULT_MAX_SCHEDULED_TOKENS)
    finish = arrival + prefill + output_len
    horizon = int(finish.max()) + 2
    # Producers: page hash -> the latest finish of a producer that has computed it by now.
    latest: dict[int, int] = {}
    pending: list[tuple[int, int, int]] = []  # (step computed, finish, hash): not yet computed
    offsets = [0]
    starts: list[int] = []
    paths: list[list[int]] = []
    # The running requests' prompt pages, merged per hash over the requests holding them.
    held: dict[int, list[int]] = {}
    hold_diff = np.zeros(horizon + 2, dtype=np.float64)
    slope = np.zeros(horizon + 2, dtype=np.float64)
    running_diff = np.zeros(horizon + 2, dtype=np.int64)
    decoding_diff = np.zeros(horizon + 2, dtype=np.int64)
    page_bytes = PAGE * KV_BYTES_PER_TOKEN
    for r, request in enumerate(trace):
        t = int(arrival[r])
        while pending and pending[0][0] <= t:
            _, done, key = heapq.heappop(pending)
            if latest.get(key, -1) < done:
                latest[key] = done
        length = int(prompt_len[r])
        hashes = _page_hashes(np.concatenate([request.prompt, request.output]))
        paths.append(hashes)
        for j in range((length - 1) // PAGE):
            found = latest.get(hashes[j])
            if found is None:
                break
            starts.append(t if found > t else found)  # a producer runs at t: free
        offsets.append(len(starts))
        # r produces its whole path.
        a, p, f = t, int(prefill[r]), int(finish[r])
        full_prompt = length // PAGE
        for j, key in enumerate(hashes):
            end_token = PAGE * (j + 1)
            if end_token <= length:
                computed = a + -(-end_token // DEFAULT_MAX_SCHEDULED_TOKENS) - 1
            else:
                computed = a + p + (end_token - length) - 1
            if computed <= t:
                if latest.get(key, -1) < f:
                    latest[key] = f
            else:
                heapq.heappush(pending, (computed, f, key))
            if j < full_prompt:  # held by r from the end of its prefill to its finish
                lo = a + p - 1
                span = held.get(key)
                if span is None or lo > span[1]:
                    if span is not None:
                        hold_diff[span[0]] += page_bytes
                        hold_diff[span[1]] -= page_bytes
                    held[key] = [lo, f]
                else:
                    span[0] = min(span[0], lo)
                    span[1] = max(span[1], f)
        # Unshared: the partial last prompt page, and the output as it is decoded.
        partial = (length % PAGE) * KV_BYTES_PER_TOKEN
        hold_diff[a + p - 1] += partial
        hold_diff[f] -= partial
        slope[a + p] += KV_BYTES_PER_TOKEN
        slope[f] -= KV_BYTES_PER_TOKEN
        hold_diff[f] -= KV_BYTES_PER_TOKEN * (f - a - p)
        running_diff[a] += 1
        running_diff[f] -= 1
        # The decode checkpoint: boundary b, computed by decode step b - length (step 1 when the
        # prompt ends on it: "once a token follows"), if the finish's computed tokens reach it.
        boundary = -(-length // GRAIN) * GRAIN
        if boundary <= length + int(output_len[r]) - 1:
            decoding_diff[a + p + max(1, boundary - length) - 1] += 1
            decoding_diff[f] -= 1
    for lo, hi in held.values():
        hold_diff[lo] += page_bytes
        hold_diff[hi] -= page_bytes
    hold_pages = np.cumsum(hold_diff + np.cumsum(slope))[:horizon]
    running = np.cumsum(running_diff)[:horizon]
    decoding = np.cumsum(decoding_diff)[:horizon]
    blocks: set[int] = set()
    for record in records[:count]:
        blocks.update(record["hash_ids"])
    return Replay(
        arrival=arrival,
        finish=finish,
        prompt_len=prompt_len,
        offsets=np.array(offsets, dtype=np.int64),
        start=np.array(starts, dtype=np.int64),
        hold_pages=hold_pages,
        running=running,
        decoding=decoding,
        prompt_tokens=int(prompt_len.sum()),
        unique_blocks=len(blocks),
        working_set=working_set_bytes(records[:count], ms_per_step, STATE_BYTES, KV_BYTES_PER_TOKEN),
        carried=carried,
        paths=paths,
    )


@dataclass
class Problem:
    """The packing problem of one replay, model and capacity, on time segments.

    Entries (one per usable page of a request, flat): ``lo`` / ``hi`` the segments
    ``[lo, hi)`` the page must stay cached for its request; ``value`` the hit tokens of the
    depth that ends with it (``-inf`` where no hit may end: not a multiple of G for the
    hybrid); ``ckpt`` the bytes added on the same segments by the checkpoint at that depth."""

    capacity: FloatArray  # per segment
    owner: IntArray  # entry -> request index among the requests with entries
    first: IntArray  # request -> its first entry
    lo: IntArray
    hi: IntArray
    value: FloatArray
    ckpt: float
    page_bytes: float
    prompt_tokens: int


def _capacity_steps(replay: Replay, budget: int, hybrid: bool, capacity: str) -> FloatArray:
    """C(t) per step (``--capacity``)."""
    if capacity == "running":
        held = replay.hold_pages + (STATE_BYTES * replay.running if hybrid else 0)
        return np.maximum(budget - held, 0.0).astype(np.float64)
    return np.full(len(replay.hold_pages), float(budget - replay.working_set))


def _events(replay: Replay) -> list[tuple[int, int, int]]:
    """Every request's arrival ``(step, 1, r)`` and finish ``(step, 0, r)`` in step order,
    finishes before arrivals at one step."""
    return sorted(
        [(int(replay.arrival[r]), 1, r) for r in range(len(replay.paths))]
        + [(int(replay.finish[r]), 0, r) for r in range(len(replay.paths))]
    )


def _release(running: dict[Any, int], keys: Any) -> None:
    """A finished request lets go of its pages: each key's count of running holders drops by one
    (the key leaves ``running`` at zero)."""
    for key in keys:
        count = running[key] - 1
        if count:
            running[key] = count
        else:
            del running[key]


def model_lru(replay: Replay, budget: int, capacity: str) -> float:
    """The attention-only model's hit rate under an online LRU (a check of the model against the
    engine's measured attention-only ``lru``, not a bound): at arrival the hit is the deepest
    page prefix cached or held by a running request; the prompt's pages move to the request
    (held, as the bound counts them, in the running requests' bytes); at finish its path's
    pages go back to the cache, deepest first in eviction order; the least recently used page
    is evicted while the cache exceeds C(t), checked at each arrival and finish."""
    cap = _capacity_steps(replay, budget, False, capacity)
    page_bytes = PAGE * KV_BYTES_PER_TOKEN
    cache: OrderedDict[int, None] = OrderedDict()
    running: dict[int, int] = {}  # prompt page hash -> running requests holding it
    events = _events(replay)
    hits = 0
    for step, kind, r in events:
        path = replay.paths[r]
        length = int(replay.prompt_len[r])
        full = length // PAGE
        if kind == 1:
            limit = (length - 1) // PAGE
            depth = 0
            while depth < limit and (path[depth] in cache or path[depth] in running):
                depth += 1
            hits += PAGE * depth
            for key in path[:full]:
                cache.pop(key, None)
                running[key] = running.get(key, 0) + 1
        else:
            _release(running, path[:full])
            for key in reversed(path):
                cache[key] = None
                cache.move_to_end(key)
        room = cap[min(step, len(cap) - 1)] // page_bytes
        while len(cache) > room:
            cache.popitem(last=False)
    return hits / replay.prompt_tokens


def model_lru_hybrid(replay: Replay, budget: int, capacity: str, *, decode_held: bool = False) -> float:
    """The hybrid model's hit rate under an online LRU that keeps what the offline schedule
    keeps, a request's path and the checkpoint its continuation resumes from, but evicts the
    least recently used item instead of knowing the future (not a bound: what the best-shaped
    online keeping gets in the model). At arrival the hit is the deepest multiple of G, at
    most prompt - 1, whose checkpoint is cached with every page below it cached or held by a
    running request; the hit checkpoint becomes the most recently used; a request whose pages
    match past its hit writes a branch checkpoint at the deepest matched multiple of G (SPEC
    13.5c). At finish its path's pages go back to the cache deepest first, then its branch
    checkpoint, then its decode checkpoint at the last multiple of G within prompt + output -
    1 (13.5d), the most recently used. Items (a page of 16 x K/V, a checkpoint of a state
    slot) are evicted least recently used first while the cache exceeds C(t) (hybrid), checked
    at each arrival and finish. ``decode_held``: C(t) less a state slot per request holding a
    decode checkpoint (``Replay.decoding``), as the engine holds one (SPEC 13.5d) where the
    bound charges a checkpoint only from its producer's finish."""
    cap = _capacity_steps(replay, budget, True, capacity)
    if decode_held:
        cap = np.maximum(cap - STATE_BYTES * replay.decoding.astype(np.float64), 0.0)
    page_bytes = PAGE * KV_BYTES_PER_TOKEN
    output_len = replay.finish - replay.arrival - -(-replay.prompt_len // DEFAULT_MAX_SCHEDULED_TOKENS)
    cache: OrderedDict[tuple[int, int], int] = OrderedDict()  # (kind 0 page / 1 checkpoint, hash) -> bytes
    used = 0
    running: dict[int, int] = {}
    branch: dict[int, int] = {}  # request -> depth of the branch checkpoint it writes
    events = _events(replay)
    hits = 0

    def put(key: tuple[int, int], size: int) -> None:
        nonlocal used
        if key in cache:
            cache.move_to_end(key)
        else:
            cache[key] = size
            used += size

    for step, kind, r in events:
        path = replay.paths[r]
        length = int(replay.prompt_len[r])
        full = length // PAGE
        if kind == 1:
            limit = (length - 1) // PAGE
            depth = 0
            while depth < limit and ((0, path[depth]) in cache or path[depth] in running):
                depth += 1
            hit = (depth * PAGE) // GRAIN * GRAIN
            while hit > 0 and (1, path[hit // PAGE - 1]) not in cache:
                hit -= GRAIN
            hits += hit
            if hit > 0:
                cache.move_to_end((1, path[hit // PAGE - 1]))
            deepest = (depth * PAGE) // GRAIN * GRAIN
            if deepest > hit:
                branch[r] = deepest
            for j in range(full):
                key = path[j]
                if (0, key) in cache:
                    used -= cache.pop((0, key))
                running[key] = running.get(key, 0) + 1
        else:
            _release(running, path[:full])
            for key in reversed(path):
                put((0, key), page_bytes)
            tip = (length + int(output_len[r]) - 1) // GRAIN * GRAIN
            for at in (branch.pop(r, 0), min(tip, len(path) * PAGE // GRAIN * GRAIN)):
                if at > 0:
                    put((1, path[at // PAGE - 1]), STATE_BYTES)
        room = cap[min(step, len(cap) - 1)]
        while used > room and cache:
            _, size = cache.popitem(last=False)
            used -= size
    return hits / replay.prompt_tokens


def make_problem(replay: Replay, budget: int, hybrid: bool, capacity: str) -> Problem:
    steps = len(replay.hold_pages)
    cap_steps = _capacity_steps(replay, budget, hybrid, capacity)
    bounds = np.unique(np.concatenate([[0, steps], replay.arrival, replay.finish]))
    bounds = bounds[bounds <= steps]
    cap_seg = np.minimum.reduceat(cap_steps, bounds[:-1]).astype(np.float64)
    counts = np.diff(replay.offsets)
    if hybrid:
        counts = counts - counts % (GRAIN // PAGE)  # deeper pages serve no checkpoint hit
    keep = counts > 0
    index = np.repeat(np.arange(len(counts)), counts)
    local = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    flat = replay.offsets[:-1][index] + local
    owner = np.repeat(np.arange(int(keep.sum())), counts[keep])
    first = np.concatenate([[0], np.cumsum(counts[keep])[:-1]]).astype(np.int64)
    lo = np.searchsorted(bounds, replay.start[flat], side="right") - 1
    hi = np.searchsorted(bounds, replay.arrival[index], side="right") - 1
    lo = np.minimum(lo, hi)
    depth = PAGE * (local + 1)
    value = depth.astype(np.float64)
    if hybrid:
        value[depth % GRAIN != 0] = -np.inf
    return Problem(
        capacity=cap_seg,
        owner=owner.astype(np.int64),
        first=first,
        lo=lo.astype(np.int64),
        hi=hi.astype(np.int64),
        value=value,
        ckpt=float(STATE_BYTES if hybrid else 0),
        page_bytes=float(PAGE * KV_BYTES_PER_TOKEN),
        prompt_tokens=replay.prompt_tokens,
    )


def _choose(problem: Problem, price: FloatArray) -> tuple[float, IntArray, FloatArray]:
    """Each request's best depth at ``price``: (sum of max(0, profit), chosen last entry per
    request or -1, the usage per segment of that choice)."""
    segments = len(problem.capacity)
    if len(problem.owner) == 0:
        return 0.0, np.zeros(0, dtype=np.int64), np.zeros(segments)
    cumulative = np.concatenate([[0.0], np.cumsum(price)])
    interval = cumulative[problem.hi] - cumulative[problem.lo]  # priced segments of each page
    pages = problem.page_bytes * interval
    paid = np.cumsum(pages)
    sizes = np.diff(np.concatenate([problem.first, [len(problem.owner)]]))
    paid -= np.repeat(paid[problem.first] - pages[problem.first], sizes)  # per request
    profit = problem.value - paid - problem.ckpt * interval
    best = np.maximum.reduceat(profit, problem.first)
    where = np.where(profit == best[problem.owner], np.arange(len(profit)), len(profit))
    last = np.minimum.reduceat(where, problem.first)
    last = np.where(best > 0, last, -1)
    return float(np.maximum(best, 0.0).sum()), last, _usage(problem, last)


def _usage(problem: Problem, last: IntArray) -> FloatArray:
    """Bytes per segment of the choice ``last`` (per request its deepest entry, or -1)."""
    segments = len(problem.capacity)
    chosen = last[problem.owner]
    on = np.arange(len(problem.owner)) <= chosen
    weights = np.where(on, problem.page_bytes, 0.0)
    diff = np.bincount(problem.lo, weights, segments + 1) - np.bincount(problem.hi, weights, segments + 1)
    picked = last[last >= 0]
    if problem.ckpt and len(picked):
        starts = np.bincount(problem.lo[picked], None, segments + 1) * problem.ckpt
        diff = diff + starts - np.bincount(problem.hi[picked], None, segments + 1) * problem.ckpt
    usage: FloatArray = np.cumsum(diff)[:segments].astype(np.float64)
    return usage


def _hits(problem: Problem, last: IntArray) -> float:
    picked = last[last >= 0]
    return float(problem.value[picked].sum())


def feasible(problem: Problem, order: IntArray, want: IntArray) -> IntArray:
    """A schedule that fits: requests in ``order``, each the deepest entry <= ``want`` whose
    items fit under the capacity at every segment (given those placed before), then a second
    pass deepening each as far as it still fits. Fitting is monotone in depth (a deeper choice
    holds more pages, and its checkpoint and deepest page over a longer interval: a page's
    latest producer is never later than a shallower page's), so a binary search finds it."""
    used = np.zeros(len(problem.capacity))
    last = np.full(len(problem.first), -1, dtype=np.int64)
    ends = np.concatenate([problem.first[1:], [len(problem.owner)]])
    finite = np.isfinite(problem.value)

    def delta(r: int, e: int) -> tuple[int, FloatArray]:
        """(first segment, bytes added per segment from there to r's arrival) of moving r from
        ``last[r]`` to entry ``e``."""
        a, base = int(problem.first[r]), int(last[r])
        hi = int(problem.hi[a])
        low = int(problem.lo[e])
        if low >= hi:
            return hi, np.zeros(0)
        new = problem.lo[max(a, base + 1) : e + 1]
        new = new[new < hi]
        counts = np.cumsum(np.bincount(new - low, None, hi - low)[: hi - low])
        extra: FloatArray = (counts * problem.page_bytes).astype(np.float64)
        if problem.ckpt:
            old = int(problem.lo[base]) if base >= a else hi
            extra[: max(min(old, hi) - low, 0)] += problem.ckpt
        return low, extra

    for second in (False, True):
        for r in order:
            r = int(r)
            a, b = int(problem.first[r]), int(ends[r])
            base = int(last[r])
            top = b - 1 if second else int(want[r])
            begin = max(a, base + 1)
            if top < begin:
                continue
            options = begin + np.flatnonzero(finite[begin : top + 1])
            low_i, high_i, found = 0, len(options) - 1, -1
            while low_i <= high_i:
                mid = (low_i + high_i) // 2
                low, extra = delta(r, int(options[mid]))
                hi = low + len(extra)
                if np.all(used[low:hi] + extra <= problem.capacity[low:hi] * (1 + 1e-12)):
                    found, low_i = mid, mid + 1
                else:
                    high_i = mid - 1
            if found >= 0:
                e = int(options[found])
                low, extra = delta(r, e)
                used[low : low + len(extra)] += extra
                last[r] = e
    return last


def bound(problem: Problem, iterations: int) -> dict[str, float]:
    """The Lagrangian bound (the smallest UB over the subgradient iterations) and the best
    feasible schedule's hits (:func:`feasible`), both as hit rates of the prompt tokens; and
    ``demand``: the most, over time, that the hits with no memory limit would hold over the
    capacity (below 1: memory never binds, the bound is every request's deepest usable hit)."""
    price = np.zeros(len(problem.capacity))
    best_ub = _hits_max(problem)  # no memory limit: every request at its deepest usable depth
    _, _, unlimited = _choose(problem, price)
    held = problem.capacity > 0
    demand = float(np.max(unlimited[held] / problem.capacity[held], initial=0.0))
    if np.any(unlimited[~held] > 0):
        demand = math.inf
    best_lb = 0.0
    theta = 1.0
    stale = 0
    for iteration in range(iterations):
        profits, last, usage = _choose(problem, price)
        ub = float(price @ problem.capacity) + profits
        if ub < best_ub * (1 - 1e-9):
            best_ub, stale = ub, 0
        else:
            stale += 1
            if stale >= 10:
                theta, stale = theta / 2, 0
        gradient = problem.capacity - usage
        if np.all(gradient >= 0):  # the choice fits: a schedule too
            best_lb = max(best_lb, _hits(problem, last))
        if iteration % 30 == 0 or iteration == iterations - 1:
            best_lb = max(best_lb, _schedule(problem, price, last))
        if best_ub - best_lb <= 1e-6 * max(best_ub, 1.0):
            break
        gradient = np.where((price <= 0) & (gradient > 0), 0.0, gradient)
        norm = float(gradient @ gradient)
        if norm <= 0:
            break
        step = theta * (best_ub - best_lb) / norm
        price = np.maximum(price - step * gradient, 0.0)
    return {
        "bound": best_ub / problem.prompt_tokens,
        "offline": best_lb / problem.prompt_tokens,
        "unlimited": _hits_max(problem) / problem.prompt_tokens,
        "demand": demand,
    }


def _hits_max(problem: Problem) -> float:
    """Every request at its deepest usable depth (the hits with no memory limit)."""
    if len(problem.first) == 0:
        return 0.0
    masked = np.where(np.isfinite(problem.value), problem.value, 0.0)
    return float(np.maximum.reduceat(masked, problem.first).sum())


def _schedule(problem: Problem, price: FloatArray, want: IntArray) -> float:
    """The hits of :func:`feasible` with requests ordered by hit tokens per priced byte."""
    if len(problem.first) == 0:
        return 0.0
    cumulative = np.concatenate([[0.0], np.cumsum(price)])
    deepest = np.where(want >= 0, want, problem.first)
    span = (cumulative[problem.hi[deepest]] - cumulative[problem.lo[deepest]]) + 1e-30
    worth = np.where(want >= 0, problem.value[deepest], 0.0) / span
    order = np.argsort(-worth, kind="stable")
    return _hits(problem, feasible(problem, order, want))


def budget_bytes(fraction: float, replay: Replay) -> int:
    """Bx of ``policy_matrix.py``: W + x % of the unique 512-token blocks' attention-only K/V."""
    return replay.working_set + math.ceil(fraction * replay.unique_blocks * MOONCAKE_BLOCK_TOKENS) * (
        KV_BYTES_PER_TOKEN
    )


def load_matrix(paths: list[Path]) -> dict[tuple[str, int, int, float], dict[str, Any]]:
    """``(workload, its requests, the prefix's requests, fraction) -> row`` of
    ``policy_matrix.py --json`` files."""
    rows: dict[tuple[str, int, int, float], dict[str, Any]] = {}
    for path in paths:
        data = json.loads(path.read_text(encoding="utf-8"))
        if (
            data.get("state_bytes") != STATE_BYTES
            or data.get("attention_kv_bytes_per_token") != KV_BYTES_PER_TOKEN
        ):
            print(f"{path}: another model's bytes; its rows are compared anyway", file=sys.stderr)
        for workload in data["workloads"]:
            for row in workload["rows"]:
                key = (workload["workload"], workload["requests"], row["requests"], round(row["fraction"], 4))
                rows[key] = row
    return rows


def measure(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    matrix = load_matrix(args.matrix)
    cells = []
    start = time.perf_counter()
    for shape in args.workload:
        records = generate(shape, args.num_requests, seed=args.seed, trace=args.trace)
        path = write_mooncake(records, folder / f"{shape}.jsonl")
        for prefix in args.prefix:
            count = max(1, round(prefix * len(records)))
            replay = build_replay(path, records, count, args.ms_per_step)
            print(
                f"{shape} {round(100 * prefix)}%: {count} requests, {len(replay.start)} usable pages "
                f"(elapsed {time.perf_counter() - start:.1f} s)",
                file=sys.stderr,
                flush=True,
            )
            for fraction in args.budget:
                budget = budget_bytes(fraction, replay)
                result: dict[str, Any] = {
                    "workload": shape,
                    "prefix": prefix,
                    "requests": count,
                    "fraction": fraction,
                    "budget_bytes": budget,
                    "working_set_bytes": replay.working_set,
                    "unique_blocks": replay.unique_blocks,
                    "prompt_tokens": replay.prompt_tokens,
                    "carried_answers": replay.carried,
                }
                for capacity in args.capacity:
                    result[capacity] = {}
                    for key, hybrid in (("hybrid", True), ("attention", False)):
                        bounds = bound(make_problem(replay, budget, hybrid, capacity), args.iterations)
                        if hybrid:
                            bounds["model_lru"] = model_lru_hybrid(replay, budget, capacity)
                            bounds["model_lru_decode_held"] = model_lru_hybrid(
                                replay, budget, capacity, decode_held=True
                            )
                        else:
                            bounds["model_lru"] = model_lru(replay, budget, capacity)
                        result[capacity][key] = bounds
                measured = matrix.get((shape, len(records), count, round(fraction, 4)))
                if measured is not None:
                    result["measured"] = dict(measured["hit_rates"])
                    if measured.get("budget_bytes") != budget:
                        print(
                            f"  matrix budget {measured.get('budget_bytes')} != {budget}",
                            file=sys.stderr,
                        )
                cells.append(result)
                for capacity in args.capacity:
                    hyb, att = result[capacity]["hybrid"], result[capacity]["attention"]
                    print(
                        f"  B{round(100 * fraction)} {capacity}: hybrid bound {100 * hyb['bound']:.2f}% "
                        f"(offline {100 * hyb['offline']:.2f}%), attention bound "
                        f"{100 * att['bound']:.2f}% (offline {100 * att['offline']:.2f}%), demand / capacity "
                        f"{hyb['demand']:.2f} / {att['demand']:.2f} "
                        f"(elapsed {time.perf_counter() - start:.1f} s)",
                        file=sys.stderr,
                        flush=True,
                    )
    return {
        "grain": GRAIN,
        "page_size": PAGE,
        "state_bytes": STATE_BYTES,
        "attention_kv_bytes_per_token": KV_BYTES_PER_TOKEN,
        "num_requests": args.num_requests,
        "seed": args.seed,
        "ms_per_step": args.ms_per_step,
        "capacities": args.capacity,
        "iterations": args.iterations,
        "cells": cells,
    }


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.2f} %"


def _ratio(a: float | None, b: float | None) -> str:
    return "n/a" if a is None or not b else f"{a / b:.2f}"


def format_table(result: dict[str, Any]) -> str:
    """One markdown table, a row per workload, prefix and budget: the bounds under each
    capacity, the measured hit rates (``--matrix``) and the ratios the issue reads."""
    capacities = result["capacities"]
    head = ["workload", "prefix (requests)", "budget"]
    for capacity in capacities:
        head += [
            f"bound hybrid ({capacity})",
            f"offline hybrid ({capacity})",
            f"bound attention ({capacity})",
        ]
    head += [f"model lru attention ({capacity})" for capacity in capacities]
    head += [f"model lru hybrid ({capacity})" for capacity in capacities]
    head += [f"model lru hybrid, decode held ({capacity})" for capacity in capacities]
    head += ["measured attention", "lru", "reuse"]
    head += [f"bound hybrid ({capacity}) / measured attention" for capacity in capacities]
    head += [f"reuse / bound hybrid ({capacity})" for capacity in capacities]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for cell in result["cells"]:
        measured = cell.get("measured", {})
        row = [
            cell["workload"],
            f"{round(100 * cell['prefix'])} % ({cell['requests']})",
            f"B{round(100 * cell['fraction'])}",
        ]
        for capacity in capacities:
            row += [
                _pct(cell[capacity]["hybrid"]["bound"]),
                _pct(cell[capacity]["hybrid"]["offline"]),
                _pct(cell[capacity]["attention"]["bound"]),
            ]
        row += [_pct(cell[capacity]["attention"]["model_lru"]) for capacity in capacities]
        row += [_pct(cell[capacity]["hybrid"].get("model_lru")) for capacity in capacities]
        row += [_pct(cell[capacity]["hybrid"].get("model_lru_decode_held")) for capacity in capacities]
        row += [_pct(measured.get("attention")), _pct(measured.get("lru")), _pct(measured.get("reuse"))]
        row += [
            _ratio(cell[capacity]["hybrid"]["bound"], measured.get("attention")) for capacity in capacities
        ]
        row += [_ratio(measured.get("reuse"), cell[capacity]["hybrid"]["bound"]) for capacity in capacities]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument(
        "--workload", action="append", choices=SHAPES, default=None, help=f"repeatable (default: {MISSED})"
    )
    parser.add_argument(
        "--prefix", action="append", type=float, default=None, help="0.1, 0.25, 0.5, 1 (repeatable)"
    )
    parser.add_argument(
        "--budget", action="append", type=int, default=None, help="x of Bx: 10, 25, 50 (repeatable; 25, 50)"
    )
    parser.add_argument(
        "--capacity",
        action="append",
        choices=("running", "cache"),
        default=None,
        help="running: Bx less the least the running requests hold (the bound); cache: Bx - W "
        "(repeatable; default both)",
    )
    parser.add_argument(
        "--matrix", action="append", type=Path, default=[], help="policy_matrix.py --json output"
    )
    parser.add_argument("--iterations", type=int, default=150, help="subgradient steps per bound (150)")
    parser.add_argument("--num-requests", type=int, default=2000, help="requests per workload (2000)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the generated workloads (0)")
    parser.add_argument("--trace", type=Path, default=None, help="the conversation workload's trace")
    parser.add_argument("--ms-per-step", type=float, default=DEFAULT_MS_PER_STEP, help="trace ms per step")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--smoke", action="store_true", help="multi_turn, 60 requests, B50: does it run")
    args = parser.parse_args(argv)
    if args.smoke:
        args.workload = args.workload or ["multi_turn"]
        args.num_requests = min(args.num_requests, 60)
        args.prefix = args.prefix or [1.0]
        args.budget = args.budget or [50]
        args.iterations = min(args.iterations, 40)
    args.workload = args.workload or list(MISSED)
    args.capacity = args.capacity or ["running", "cache"]
    args.prefix = args.prefix or list(PREFIXES)
    args.budget = [x / 100 for x in (args.budget or [round(100 * f) for f in FRACTIONS])]
    if args.trace is None:
        args.trace = _find_trace()
    if args.trace is None and "conversation" in args.workload:
        parser.error(f"{TRACE_NAME} not found beside the checkout; pass --trace")
    begin = time.perf_counter()
    with tempfile.TemporaryDirectory() as temporary:
        result = measure(args, Path(temporary))
    result["total_seconds"] = round(time.perf_counter() - begin, 2)
    if args.json:
        json.dump(result, sys.stdout, indent=2)
        print()
    else:
        print(format_table(result))
        print(f"total {result['total_seconds']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
