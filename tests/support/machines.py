"""The token-level state machine shared by the stateful cross-checks (requests, host tier).

:class:`RequestsMachine` drives the native ``FlatKVCache`` and the pure-Python reference side by
side with the same random scheduler-loop operations and compares them after every step
(tests/requests/test_requests_stateful.py says what it covers and runs it;
tests/host/test_host_stateful.py extends it with a host tier). :func:`replay` applies KV
events to an index as a router would.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
from flat_kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from helpers import normalize
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from strategies import DOCUMENTS, EXTRA_KEYS, REQUEST_IDS, both_caches, configs


def replay(index: Counter[tuple[int, bytes]], events: list[KVCacheEvent], medium: str = "GPU") -> None:
    """Apply the ``medium`` events of ``events`` to ``index`` (cached pages per (group, content
    hash)), as a router does; ``AllBlocksCleared`` is about the device pool only."""
    for item in events:
        if isinstance(item, (BlockStored, BlockRemoved)) and item.medium != medium:
            continue
        if isinstance(item, BlockStored):
            for block_hash in item.block_hashes:
                index[item.group_index, block_hash] += 1
        elif isinstance(item, BlockRemoved):
            for block_hash in item.block_hashes:
                assert index[item.group_index, block_hash] > 0, f"{item} removes a key never stored"
                index[item.group_index, block_hash] -= 1
        else:
            assert isinstance(item, AllBlocksCleared)
            if medium == "GPU":
                index.clear()
    # Counter arithmetic drops the zero counts a removal leaves.
    index -= Counter()


def cached_keys(reference: Any) -> Counter[tuple[int, bytes]]:
    """The reference cache's pages per (group, content hash), read from its pool's key map."""
    held: Counter[tuple[int, bytes]] = Counter()
    for key, pages in reference._pool._key_map().items():
        held[int(key[64:], 16), bytes.fromhex(key[:64])] += len(pages)
    return held


class RequestsMachine(RuleBasedStateMachine):
    """Native and reference caches side by side; every call must agree."""

    def __init__(self) -> None:
        super().__init__()
        self.caches: list[Any] = []
        self.live: list[Any] = []
        self.index: Counter[tuple[int, bytes]] = Counter()

    @initialize(
        config=configs(),
        prompts=st.lists(st.tuples(st.integers(0, len(DOCUMENTS) - 1), st.integers(1, 40)), max_size=3),
    )
    def build(self, config: dict[str, Any], prompts: list[tuple[int, int]]) -> None:
        """Both caches, and a few requests from the start so the request rules can act."""
        self.config = config
        self.caches.extend(both_caches(config, enable_kv_events=True))
        for req, (doc, length) in zip(REQUEST_IDS, prompts, strict=False):
            self.both("add_request", req, DOCUMENTS[doc][:length])
            self.live.append(req)

    # -- helpers ------------------------------------------------------------------------------

    def both(self, method: str, *args: Any, **kwargs: Any) -> tuple[str, Any]:
        """Call ``method`` on both caches; the results (or exception classes) must be equal."""
        outcomes = []
        for cache in self.caches:
            try:
                outcomes.append(("ok", normalize(getattr(cache, method)(*args, **kwargs))))
            except Exception as exc:  # the class is what is compared
                outcomes.append(("raise", type(exc).__name__))
        assert outcomes[0] == outcomes[1], (
            f"{method}{args} {kwargs}: native {outcomes[0]} != reference {outcomes[1]}"
        )
        return outcomes[0]

    def pick(self, index: int) -> Any:
        return self.live[index % len(self.live)]

    def remaining(self, req: Any) -> int:
        native = self.caches[0]
        return int(native.num_tokens(req) - native.num_computed_tokens(req))

    # -- rules --------------------------------------------------------------------------------

    @rule(
        req=st.sampled_from(REQUEST_IDS),
        doc=st.integers(0, len(DOCUMENTS) - 1),
        length=st.integers(0, 40),
        suffix=st.lists(st.integers(0, 50), max_size=6),
        extra=st.sampled_from(EXTRA_KEYS) | st.just(()),
        use_cache=st.booleans() | st.just(True),
        as_array=st.booleans(),
    )
    def add_request(
        self,
        req: Any,
        doc: int,
        length: int,
        suffix: list[int],
        extra: tuple[str, ...],
        use_cache: bool,
        as_array: bool,
    ) -> None:
        prompt: Any = DOCUMENTS[doc][:length] + suffix
        if as_array:
            prompt = np.array(prompt, dtype=np.int64)
        outcome = self.both("add_request", req, prompt, extra_keys=list(extra), use_prefix_cache=use_cache)
        if outcome[0] == "ok":
            self.live.append(req)
            if outcome[1]:
                event("prefix hit")

    @rule(
        req=st.sampled_from(REQUEST_IDS),
        doc=st.integers(0, len(DOCUMENTS) - 1),
        length=st.integers(0, 40),
        extra=st.sampled_from(EXTRA_KEYS) | st.just(()),
        limit=st.integers(0, 48),
        use_cache=st.booleans() | st.just(True),
    )
    def admit(
        self, req: Any, doc: int, length: int, extra: tuple[str, ...], limit: int, use_cache: bool
    ) -> None:
        """``admit`` is the SPEC 9 admission the probes describe: the hit, the first chunk and
        its fit check, then ``add_request``; nothing changes when it does not fit."""
        native = self.caches[0]
        prompt = DOCUMENTS[doc][:length]
        keys = list(extra)
        expected: Any = None
        if prompt and req not in self.live:
            hit = native.prefix_hit_tokens(prompt, extra_keys=keys) if use_cache else 0
            chunk = min(len(prompt) - hit, limit)
            reserve = 1 if hit + chunk == len(prompt) else 0
            need = (
                native.pages_needed_to_admit(prompt, chunk, reserve, extra_keys=keys)
                if use_cache
                else native.pages_needed(chunk + reserve)
            )
            expected = (hit, chunk) if need <= native.budget() else None
        before = native.stats()
        outcome = self.both("admit", req, prompt, limit, extra_keys=keys, use_prefix_cache=use_cache)
        if outcome[0] == "raise":
            assert not prompt or req in self.live, f"admit refused a new request: {outcome}"
            return
        assert outcome[1] == normalize(expected), f"admit gave {outcome[1]}, the probes say {expected}"
        if expected is None:
            event("admit: does not fit")
            assert native.stats() == before
        else:
            event("admit: added")
            self.live.append(req)
            assert native.num_computed_tokens(req) == expected[0]

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 10), tokens=st.lists(st.integers(0, 2000), min_size=0, max_size=9))
    def append_tokens(self, index: int, tokens: list[int]) -> None:
        self.both("append_tokens", self.pick(index), tokens)

    @precondition(lambda self: self.live)
    @rule(
        indices=st.lists(st.integers(0, 10), min_size=0, max_size=4),
        data=st.data(),
        mode=st.sampled_from(["one_each", "counts", "array"]),
    )
    def append_tokens_batch(self, indices: list[int], data: st.DataObject, mode: str) -> None:
        reqs: list[Any] = [self.pick(i) for i in indices]
        if data.draw(st.integers(0, 9)) == 0:
            reqs.append("unknown")
        if mode == "one_each":
            tokens = data.draw(st.lists(st.integers(0, 2000), min_size=len(reqs), max_size=len(reqs)))
            self.both("append_tokens_batch", reqs, tokens)
            return
        counts = data.draw(st.lists(st.integers(0, 5), min_size=len(reqs), max_size=len(reqs)))
        tokens = data.draw(st.lists(st.integers(0, 2000), min_size=sum(counts), max_size=sum(counts)))
        if mode == "array":
            self.both("append_tokens_batch", reqs, np.array(tokens, dtype=np.uint32), np.array(counts))
        else:
            self.both("append_tokens_batch", reqs, tokens, counts)

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 10), finish=st.booleans())
    def run_to_end(self, index: int, finish: bool) -> None:
        """Schedule everything known (a whole prefill), then maybe finish: fills the cache."""
        req = self.pick(index)
        outcome = self.both("schedule", req, self.remaining(req))
        if finish and outcome[1] is True:
            self.both("finish", req)
            self.live.remove(req)

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 10), token=st.integers(0, 2000))
    def decode(self, index: int, token: int) -> None:
        """One generated token: append it, then schedule the tokens not computed yet."""
        req = self.pick(index)
        self.both("append_tokens", req, [token])
        self.both("schedule", req, self.remaining(req), lookahead=1)

    @precondition(lambda self: self.live)
    @rule(
        index=st.integers(0, 10),
        fraction=st.sampled_from([0.0, 0.25, 0.5, 1.0, 1.0]) | st.floats(0, 1.2),
        lookahead=st.integers(0, 5) | st.just(0),
    )
    def schedule(self, index: int, fraction: float, lookahead: int) -> None:
        req = self.pick(index)
        n = int(self.remaining(req) * fraction + 0.5)
        outcome = self.both("schedule", req, n, lookahead=lookahead)
        event(f"schedule -> {outcome[1]}")

    @precondition(lambda self: self.live)
    @rule(
        indices=st.lists(st.integers(0, 10), min_size=0, max_size=4), data=st.data(), as_array=st.booleans()
    )
    def schedule_batch(self, indices: list[int], data: st.DataObject, as_array: bool) -> None:
        reqs = [self.pick(i) for i in indices]
        ns: Any = [
            data.draw(st.integers(0, max(self.remaining(r), 0) // max(len(reqs), 1) + 1)) for r in reqs
        ]
        if data.draw(st.booleans()) and len(reqs) > 0 and data.draw(st.integers(0, 9)) == 0:
            reqs = [*reqs, "unknown"]
            ns = [*ns, 1]
        if as_array:
            ns = np.array(ns, dtype=np.int64)
        self.both("schedule_batch", reqs, ns)

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 10), tokens=st.integers(0, 12))
    def reserve(self, index: int, tokens: int) -> None:
        self.both("reserve", self.pick(index), tokens)

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 10))
    def finish(self, index: int) -> None:
        req = self.pick(index)
        self.both("finish", req)
        self.live.remove(req)

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 10), readd=st.booleans() | st.just(True))
    def preempt(self, index: int, readd: bool) -> None:
        req = self.pick(index)
        status, tokens = self.both("preempt", req)
        assert status == "ok"
        self.live.remove(req)
        if readd:
            outcome = self.both("add_request", req, tokens)
            if outcome[0] == "ok":
                self.live.append(req)
                event(f"re-added after preempt, hit > 0: {bool(outcome[1])}")

    @rule()
    def reset_prefix_cache(self) -> None:
        stats = self.caches[1].stats() if self.caches else None
        if stats and stats["pages_cached"] > stats["pages_cached_free"]:
            event("reset while requests hold cached pages")
        self.both("reset_prefix_cache")

    @rule(
        doc=st.integers(0, len(DOCUMENTS) - 1),
        length=st.integers(0, 40),
        extra=st.sampled_from(EXTRA_KEYS),
        new=st.integers(0, 20),
        ahead=st.integers(0, 8),
    )
    def admission_probes(self, doc: int, length: int, extra: tuple[str, ...], new: int, ahead: int) -> None:
        prompt = DOCUMENTS[doc][:length]
        self.both("prefix_hit_tokens", prompt, extra_keys=list(extra))
        self.both("pages_needed_to_admit", prompt, new, ahead, extra_keys=list(extra))

    @rule(req=st.sampled_from([*REQUEST_IDS, "unknown"]))
    def misuse(self, req: Any) -> None:
        """Calls on a request that may be unknown: the same exception class on both sides."""
        self.both("num_computed_tokens", req)
        self.both("budget", req)
        self.both("schedule", req, 10_000)

    @precondition(lambda self: self.live)
    @rule(
        indices=st.lists(st.integers(0, 10), max_size=4),
        extra_rows=st.integers(0, 2),
        cols=st.integers(0, 12),
    )
    def block_tables(self, indices: list[int], extra_rows: int, cols: int) -> None:
        reqs = [self.pick(i) for i in indices]
        self.both("block_tables", reqs)
        buffers = []
        outcomes = []
        for cache in self.caches:
            out = {
                gid: np.full((len(reqs) + extra_rows, cols), 77, dtype=np.int32) for gid in cache.group_ids
            }
            try:
                returned = cache.block_tables(reqs, out=out)
                assert returned is out
                outcomes.append("ok")
            except Exception as exc:  # the class is what is compared
                outcomes.append(type(exc).__name__)
            buffers.append({gid: array.tolist() for gid, array in out.items()})
        assert outcomes[0] == outcomes[1], f"block_tables(out=) {reqs}: {outcomes}"
        assert buffers[0] == buffers[1], (
            f"block_tables(out=) {reqs}: native {buffers[0]} != reference {buffers[1]}"
        )

    # -- checks after every step --------------------------------------------------------------

    @invariant()
    def agree(self) -> None:
        if not self.caches:
            return
        for cache in self.caches:
            cache.check_invariants()
        for req in self.live:
            self.both("page_ids", req)
            self.both("tail_available", req)
            self.both("num_computed_tokens", req)
            self.both("num_tokens", req)
            self.both("budget", req)
        self.both("budget")
        stats = self.both("stats")[1]
        if stats["evictions"]:
            event("evictions")
        taken = self.both("take_events")[1]
        for item in taken:
            event(type(item).__name__)
        replay(self.index, taken)
        assert self.index == cached_keys(self.caches[1]), "the replayed events disagree with the cache"
        self.check_more_events(taken)

    def check_more_events(self, taken: list[KVCacheEvent]) -> None:
        """Hook for subclasses: more checks on the events of one step (none here)."""
