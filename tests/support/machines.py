"""The token-level state machines shared by the stateful cross-checks (requests, arena, host tier).

:class:`RequestsMachine` drives the native ``FlatKVCache`` and the pure-Python reference side by
side with the same random scheduler-loop operations on slots (docs/requests-api.md, "Slots")
and compares them after every step (tests/requests/test_requests_stateful.py says what it
covers and runs it). The model keeps each live request's slot (the lowest free one when it
entered, checked against both engines) and its tokens. :func:`replay` applies KV events to an
index as a router would. The variants: :class:`ArenaRequestsMachine` over the SPEC 13 arena
(tests/requests/test_arena_stateful.py), :class:`HostMachine` with a host tier
(tests/host/test_host_stateful.py), and :class:`ArenaHostMachine`, both at once: a host tier
per group over an arena (tests/host/test_arena_host.py).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
from flat_kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from slots import as_slot_array, chunk_choices, lowest_free, outcome_of, state_grain
from strategies import (
    DOCUMENTS,
    EXTRA_KEYS,
    REQUEST_IDS,
    arena_configs,
    arena_host_pages,
    both_arena_caches,
    both_caches,
    configs,
)


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


#: Slot arguments that are not a slot: refused alike by both engines (TypeError, ValueError,
#: OverflowError), each naming the argument.
BAD_SLOTS: list[Any] = [-1, True, 1.5, None, "0", 2**64]
#: How a slot array is passed: a list, a tuple, or a numpy array of one of these dtypes.
SLOT_ARRAY_KINDS = ["list", "tuple", "int64", "uint32", "int32"]


class RequestsMachine(RuleBasedStateMachine):
    """Native and reference caches side by side; every call must agree (value, or exception
    class and message), and the slots must be the ones the contract assigns."""

    def __init__(self) -> None:
        super().__init__()
        self.caches: list[Any] = []
        #: Live request id -> its slot (the same on both engines).
        self.live: dict[Any, int] = {}
        #: Live request id -> every token it knows (prompt, then appended ones).
        self.tokens: dict[Any, list[int]] = {}
        self.index: Counter[tuple[int, bytes]] = Counter()

    @initialize(
        config=configs(),
        prompts=st.lists(st.tuples(st.integers(0, len(DOCUMENTS) - 1), st.integers(1, 40)), max_size=3),
    )
    def build(self, config: dict[str, Any], prompts: list[tuple[int, int]]) -> None:
        """Both caches, and a few requests from the start so the request rules can act."""
        self.config = config
        self.caches.extend(both_caches(config, enable_kv_events=True))
        self.add_initial(prompts)

    def add_initial(self, prompts: list[tuple[int, int]]) -> None:
        for req, (doc, length) in zip(REQUEST_IDS, prompts, strict=False):
            self.added(req, DOCUMENTS[doc][:length], self.both("add_request", req, DOCUMENTS[doc][:length]))

    # -- helpers ------------------------------------------------------------------------------

    def both(self, method: str, *args: Any, **kwargs: Any) -> tuple[str, Any]:
        """Call ``method`` on both caches; the results (or exception classes and messages) must
        be equal. Returns ``("ok", normalized result)`` or ``("raise", "Class: message")``."""
        outcomes = [outcome_of(partial(getattr(cache, method), *args, **kwargs)) for cache in self.caches]
        assert outcomes[0] == outcomes[1], (
            f"{method}{args} {kwargs}: native {outcomes[0]} != reference {outcomes[1]}"
        )
        return outcomes[0]

    def next_slot(self) -> int:
        """The slot the contract gives the next request: the lowest one no live request holds."""
        return lowest_free(self.live.values())

    def added(self, req: Any, prompt: Any, outcome: tuple[str, Any], *, admit: bool = False) -> bool:
        """Record a request ``add_request`` (or ``admit``) added: it must have the lowest free
        slot. Returns whether it was added."""
        if outcome[0] != "ok" or outcome[1] is None:
            return False
        slot = outcome[1][0]
        assert slot == self.next_slot(), f"{req!r} got slot {slot}, the lowest free one is {self.next_slot()}"
        if slot < max(self.live.values(), default=-1):
            event("a freed slot below a live one reused")
        self.live[req] = slot
        self.tokens[req] = [int(t) for t in prompt]
        return True

    def released(self, slots: list[int]) -> None:
        """Forget the requests of ``slots`` (finished or preempted)."""
        owners = {slot: req for req, slot in self.live.items()}
        for slot in slots:
            req = owners[slot]
            del self.live[req]
            del self.tokens[req]

    def pick(self, index: int) -> Any:
        """A live request id."""
        reqs = list(self.live)
        return reqs[index % len(reqs)]

    def slot(self, index: int) -> int:
        """A live request's slot."""
        return self.live[self.pick(index)]

    def free_slot(self, choice: int) -> int:
        """A slot no request holds: the lowest free one, or one far past every live slot."""
        return self.next_slot() if choice % 2 == 0 else max(self.live.values(), default=0) + 7

    def remaining(self, slot: int) -> int:
        native = self.caches[0]
        return int(native.num_tokens(slot) - native.num_computed_tokens(slot))

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
        tokens = DOCUMENTS[doc][:length] + suffix
        prompt: Any = np.array(tokens, dtype=np.int64) if as_array else tokens
        outcome = self.both("add_request", req, prompt, extra_keys=list(extra), use_prefix_cache=use_cache)
        if outcome[0] == "raise":
            assert req in self.live or not tokens, f"add_request refused a new request: {outcome}"
            return
        assert req not in self.live, f"add_request accepted {req!r}, which is live"
        self.added(req, tokens, outcome)
        if outcome[1][1]:
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
        its fit check, then ``add_request`` (the lowest free slot); nothing changes when it does
        not fit. The chunk is ``next_chunk``'s rule or, with state groups, a branch point cut
        (:func:`slots.chunk_choices`); with it the probes' fit check must pass. In arena mode
        the credit is an estimate: admit may refuse what it lets through (the units decide)."""
        native = self.caches[0]
        prompt = DOCUMENTS[doc][:length]
        keys = list(extra)
        fits: dict[int, bool] = {}
        hit = 0
        if prompt and req not in self.live:
            hit = native.prefix_hit_tokens(prompt, extra_keys=keys) if use_cache else 0
            for chunk in chunk_choices(hit, len(prompt), limit, state_grain(self.config["groups"])):
                reserve = 1 if hit + chunk == len(prompt) else 0
                need = (
                    native.pages_needed_to_admit(prompt, chunk, reserve, extra_keys=keys)
                    if use_cache
                    else native.pages_needed(chunk + reserve)
                )
                fits[chunk] = need <= native.budget()
        slot = self.next_slot()
        before = native.stats()
        outcome = self.both("admit", req, prompt, limit, extra_keys=keys, use_prefix_cache=use_cache)
        if outcome[0] == "raise":
            assert not prompt or req in self.live, f"admit refused a new request: {outcome}"
            return
        if outcome[1] is None:
            event("admit: does not fit")
            assert native.stats() == before
            first = next(iter(fits))
            if len(fits) == 1 and native.arena_stats() is None:
                assert not fits[first], f"admit gave None, the probes say chunk {first} fits"
            return
        got_slot, got_hit, got_chunk = outcome[1]
        assert [got_slot, got_hit] == [slot, hit], f"admit gave {outcome[1]}, the probes say {slot}, {hit}"
        assert got_chunk in fits, f"admit cut {got_chunk}, not one of {list(fits)}"
        assert fits[got_chunk], f"admit took chunk {got_chunk}, which the probes say does not fit"
        if got_chunk != next(iter(fits)):
            event("admit: cut at a branch point")
        event("admit: added")
        self.added(req, prompt, outcome, admit=True)
        assert native.num_computed_tokens(slot) == hit

    @precondition(lambda self: self.live)
    @rule(
        indices=st.lists(st.integers(0, 10), min_size=0, max_size=4),
        data=st.data(),
        mode=st.sampled_from(["one_each", "counts", "array"]),
        kind=st.sampled_from(SLOT_ARRAY_KINDS),
    )
    def append_tokens(self, indices: list[int], data: st.DataObject, mode: str, kind: str) -> None:
        """Tokens for some slots (repeats append in order); now and then a free slot, which is
        refused with nothing appended."""
        reqs: list[Any] = [self.pick(i) for i in indices]
        slots = [self.live[r] for r in reqs]
        unknown = data.draw(st.integers(0, 9)) == 0
        if unknown:
            slots.append(self.free_slot(data.draw(st.integers(0, 1))))
        if mode == "one_each":
            counts = [1] * len(slots)
            tokens = data.draw(st.lists(st.integers(0, 2000), min_size=len(slots), max_size=len(slots)))
            outcome = self.both("append_tokens", as_slot_array(slots, kind), tokens)
        else:
            counts = data.draw(st.lists(st.integers(0, 5), min_size=len(slots), max_size=len(slots)))
            tokens = data.draw(st.lists(st.integers(0, 2000), min_size=sum(counts), max_size=sum(counts)))
            if mode == "array":
                outcome = self.both(
                    "append_tokens",
                    as_slot_array(slots, kind),
                    np.array(tokens, dtype=np.uint32),
                    np.array(counts, dtype=np.int64),
                )
            else:
                outcome = self.both("append_tokens", as_slot_array(slots, kind), tokens, counts)
        if unknown:
            assert outcome[0] == "raise" and outcome[1].startswith("UnknownRequestError"), outcome
            event("append_tokens: free slot refused")
            return
        assert outcome[0] == "ok", outcome
        start = 0
        for req, count in zip(reqs, counts, strict=False):
            self.tokens[req].extend(tokens[start : start + count])
            start += count

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 10), finish=st.booleans())
    def run_to_end(self, index: int, finish: bool) -> None:
        """Schedule everything known (a whole prefill), then maybe finish: fills the cache."""
        slot = self.slot(index)
        outcome = self.both("schedule", [slot], [self.remaining(slot)])
        if finish and outcome == ("ok", ("ndarray", "bool", (1,), [True])):
            assert self.both("finish", [slot])[0] == "ok"
            self.released([slot])

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 10), token=st.integers(0, 2000))
    def decode(self, index: int, token: int) -> None:
        """One generated token: append it, then schedule the tokens not computed yet."""
        req = self.pick(index)
        slot = self.live[req]
        assert self.both("append_tokens", [slot], [token])[0] == "ok"
        self.tokens[req].append(token)
        self.both("schedule", np.array([slot]), [self.remaining(slot)], lookahead=1)

    @precondition(lambda self: self.live)
    @rule(
        indices=st.lists(st.integers(0, 10), min_size=0, max_size=4),
        data=st.data(),
        as_array=st.booleans(),
        kind=st.sampled_from(SLOT_ARRAY_KINDS),
        lookahead=st.integers(0, 5) | st.just(0),
    )
    def schedule(
        self, indices: list[int], data: st.DataObject, as_array: bool, kind: str, lookahead: int
    ) -> None:
        """Some slots (repeats count together), each a random share of what it has left."""
        slots = [self.slot(i) for i in indices]
        ns: Any = [
            data.draw(st.integers(0, max(self.remaining(s), 0) // max(len(slots), 1) + 1)) for s in slots
        ]
        if data.draw(st.booleans()) and len(slots) > 0 and data.draw(st.integers(0, 9)) == 0:
            slots = [*slots, self.free_slot(data.draw(st.integers(0, 1)))]
            ns = [*ns, 1]
        if as_array:
            ns = np.array(ns, dtype=np.int64)
        outcome = self.both("schedule", as_slot_array(slots, kind), ns, lookahead=lookahead)
        event(f"schedule {'raised' if outcome[0] == 'raise' else 'ran'}")
        if outcome[0] == "ok":
            event(f"schedule -> {sorted(set(outcome[1][3]))}")

    @precondition(lambda self: self.live)
    @rule(
        index=st.integers(0, 10),
        fraction=st.sampled_from([0.0, 0.25, 0.5, 1.0, 1.0]) | st.floats(0, 1.2),
        lookahead=st.integers(0, 5) | st.just(0),
    )
    def schedule_one(self, index: int, fraction: float, lookahead: int) -> None:
        """One slot, a share of what it has left (past 1.0: too many, refused)."""
        slot = self.slot(index)
        n = int(self.remaining(slot) * fraction + 0.5)
        self.both("schedule", [slot], [n], lookahead=lookahead)

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 10), limit=st.integers(0, 40) | st.integers(0, 2000), take=st.booleans())
    def next_chunk(self, index: int, limit: int, take: bool) -> None:
        """The chunk cut is the rule's on both engines; sometimes it is then scheduled, so the
        requests move the way a scheduler that follows it moves them."""
        slot = self.slot(index)
        native = self.caches[0]
        computed, known = native.num_computed_tokens(slot), native.num_tokens(slot)
        outcome = self.both("next_chunk", slot, limit)
        choices = chunk_choices(computed, known, limit, state_grain(self.config["groups"]))
        assert outcome[0] == "ok" and outcome[1] in choices, (outcome, choices)
        if outcome[1] != choices[0]:
            event("next_chunk: cut at a branch point")
        if take and outcome[1]:
            self.both("schedule", [slot], [outcome[1]])

    @precondition(lambda self: self.live)
    @rule(
        indices=st.lists(st.integers(0, 10), min_size=0, max_size=3),
        tokens=st.lists(st.integers(0, 12), min_size=3, max_size=3),
        as_array=st.booleans(),
    )
    def reserve(self, indices: list[int], tokens: list[int], as_array: bool) -> None:
        """Reserves for some slots (a repeated slot: the last one counts)."""
        slots = [self.slot(i) for i in indices]
        counts: Any = tokens[: len(slots)]
        if as_array:
            counts = np.array(counts, dtype=np.int64)
        assert self.both("reserve", as_slot_array(slots, "int64" if as_array else "list"), counts)[0] == "ok"

    @precondition(lambda self: self.live)
    @rule(indices=st.lists(st.integers(0, 10), min_size=1, max_size=3), repeat=st.integers(0, 6))
    def finish(self, indices: list[int], repeat: int) -> None:
        """Finish some slots; one listed twice is refused with nothing finished."""
        slots = list(dict.fromkeys(self.slot(i) for i in indices))
        if repeat == 0:
            slots.append(slots[0])
            outcome = self.both("finish", slots)
            assert outcome == ("raise", f"ValueError: finish: slot {slots[0]} is listed twice"), outcome
            event("finish: repeated slot refused")
            return
        assert self.both("finish", slots)[0] == "ok"
        self.released(slots)

    @precondition(lambda self: self.live)
    @rule(
        indices=st.lists(st.integers(0, 10), min_size=1, max_size=3),
        readd=st.booleans() | st.just(True),
        repeat=st.integers(0, 6),
    )
    def preempt(self, indices: list[int], readd: bool, repeat: int) -> None:
        """Preempt some slots: each request's whole token list comes back, in order; then maybe
        re-add them (the first gets the lowest freed slot, and a prefix hit)."""
        reqs = list(dict.fromkeys(self.pick(i) for i in indices))
        slots = [self.live[r] for r in reqs]
        if repeat == 0:
            outcome = self.both("preempt", [*slots, slots[-1]])
            assert outcome[0] == "raise" and outcome[1].startswith("ValueError"), outcome
            assert f"slot {slots[-1]} is listed twice" in outcome[1], outcome
            event("preempt: repeated slot refused")
            return
        status, lists = self.both("preempt", slots)
        assert status == "ok"
        assert lists == [self.tokens[r] for r in reqs], "preempt must return each request's tokens"
        self.released(slots)
        if readd:
            for req, tokens in zip(reqs, lists, strict=True):
                if self.added(req, tokens, self.both("add_request", req, tokens)):
                    event("re-added after preempt")

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

    @rule(choice=st.integers(0, 1), req=st.sampled_from([*REQUEST_IDS, "unknown"]))
    def misuse(self, choice: int, req: Any) -> None:
        """Calls on a slot no request holds: ``UnknownRequestError`` naming the method and slot,
        the same from both; ``slot_of`` of an id not live is None."""
        slot = self.free_slot(choice)
        calls: list[tuple[str, Callable[[], tuple[str, Any]]]] = [
            ("num_computed_tokens", lambda: self.both("num_computed_tokens", slot)),
            ("budget", lambda: self.both("budget", slot)),
            ("id_of", lambda: self.both("id_of", slot)),
            ("page_ids", lambda: self.both("page_ids", slot)),
            ("schedule", lambda: self.both("schedule", [slot], [10_000])),
            ("finish", lambda: self.both("finish", [slot])),
        ]
        for method, call in calls:
            outcome = call()
            assert outcome == ("raise", f"UnknownRequestError: {method}: slot {slot} holds no request"), (
                outcome
            )
        if req not in self.live:
            assert self.both("slot_of", req) == ("ok", None)

    @rule(bad=st.sampled_from(BAD_SLOTS), method=st.sampled_from(["schedule", "finish", "num_tokens"]))
    def bad_slot(self, bad: Any, method: str) -> None:
        """A slot that is no slot: refused alike (class and message), nothing changes."""
        if method == "schedule":
            outcome = self.both("schedule", [bad], [0])
        elif method == "finish":
            outcome = self.both("finish", [bad])
        else:
            outcome = self.both("num_tokens", bad)
        assert outcome[0] == "raise", outcome
        assert outcome[1].split(":")[0] in {"TypeError", "ValueError", "OverflowError"}, outcome
        assert ("slot" if method == "num_tokens" else "slots[0]") in outcome[1], outcome

    @precondition(lambda self: self.live)
    @rule(
        indices=st.lists(st.integers(0, 10), max_size=4),
        extra_rows=st.integers(0, 2),
        cols=st.integers(0, 12),
    )
    def block_tables(self, indices: list[int], extra_rows: int, cols: int) -> None:
        slots = [self.slot(i) for i in indices]
        self.both("block_tables", slots)
        buffers = []
        outcomes = []
        for cache in self.caches:
            out = {
                gid: np.full((len(slots) + extra_rows, cols), 77, dtype=np.int32) for gid in cache.group_ids
            }
            try:
                returned = cache.block_tables(np.array(slots, dtype=np.int64), out=out)
                assert returned is out
                outcomes.append("ok")
            except Exception as exc:  # the class and message are what is compared
                outcomes.append(f"{type(exc).__name__}: {exc}")
            buffers.append({gid: array.tolist() for gid, array in out.items()})
        assert outcomes[0] == outcomes[1], f"block_tables(out=) {slots}: {outcomes}"
        assert buffers[0] == buffers[1], (
            f"block_tables(out=) {slots}: native {buffers[0]} != reference {buffers[1]}"
        )

    # -- checks after every step --------------------------------------------------------------

    @invariant()
    def agree(self) -> None:
        if not self.caches:
            return
        for cache in self.caches:
            cache.check_invariants()
        for req, slot in self.live.items():
            self.both("page_ids", slot)
            self.both("tail_available", slot)
            self.both("num_computed_tokens", slot)
            self.both("budget", slot)
            self.both("pages_needed", 5, slot)
            assert self.both("num_tokens", slot) == ("ok", len(self.tokens[req]))
            assert self.both("slot_of", req) == ("ok", slot)
            assert self.both("id_of", slot) == ("ok", req)
        assert [cache.num_requests for cache in self.caches] == [len(self.live)] * 2
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


class ArenaRequestsMachine(RequestsMachine):
    """:class:`RequestsMachine` over the SPEC 13 storage: both caches lay their pages out in the
    same arena (``FlatKVCache(arena=)``, :func:`strategies.arena_configs`), and the step's state
    slots (``state_slots``) must agree too."""

    @initialize(
        config=arena_configs(),
        prompts=st.lists(st.tuples(st.integers(0, len(DOCUMENTS) - 1), st.integers(1, 40)), max_size=3),
        policy=st.sampled_from(["lru", "reuse"]),
    )
    def build(self, config: dict[str, Any], prompts: list[tuple[int, int]], policy: str) -> None:
        self.config = config
        event(f"eviction_policy {policy}")
        self.caches.extend(both_arena_caches(config, enable_kv_events=True, eviction_policy=policy))
        self.add_initial(prompts)

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 10), back=st.integers(0, 3), over=st.booleans())
    def state_slots(self, index: int, back: int, over: bool) -> None:
        """The read and write slots of a step that scheduled up to the request's computed
        tokens: a count other than the last schedule's is refused (the slots are what that
        schedule did), and so is one more than computed; both caches must refuse alike. A model
        without exactly one state group refuses."""
        slot = self.slot(index)
        computed = self.caches[0].num_computed_tokens(slot)
        n = computed + 1 if over else max(computed - back, 0)
        outcome = self.both("state_slots", [slot], [n])
        event(f"state_slots {'raised' if outcome[0] == 'raise' else 'ran'}")

    @invariant()
    def arena_agrees(self) -> None:
        if self.caches:
            self.both("arena_stats")


def transfer_ids(taken: Any) -> list[int]:
    """Every id in a normalized ``take_transfers`` result."""
    ids: list[int] = []
    for per_group in taken.values():
        for arrays in per_group.values():
            ids.extend(arrays[0][3])  # ("ndarray", dtype, shape, values)
    return ids


class HostMachine(RequestsMachine):
    """The requests machine with a host tier and the transfer rules."""

    def __init__(self) -> None:
        super().__init__()
        self.handed_out: list[int] = []
        self.host_index: Counter[tuple[int, bytes]] = Counter()

    def check_more_events(self, taken: list[Any]) -> None:
        """The CPU-medium events, replayed, name exactly the findable host pages' keys; the
        host figures of ``stats()`` (compared between engines by the base machine) add up."""
        replay(self.host_index, taken, medium="CPU")
        host = self.caches[1]._host  # None when no group has host pages (an arena's mapping)
        findable: Counter[tuple[int, bytes]] = Counter(
            (int(key[64:], 16), bytes.fromhex(key[:64]))
            for page, key in enumerate([] if host is None else host.keys)
            if key is not None and host.ready[page]
        )
        assert self.host_index == findable, "the CPU-medium events disagree with the host tier"
        stats = self.caches[1].stats()
        assert stats["host_pages_used"] <= stats["host_pages_total"]
        assert stats["host_hits_tokens"] <= stats["prefix_hits_tokens"]
        assert stats["host_evictions"] <= stats["host_stores"]
        if stats["host_hits_tokens"]:
            event("host hits counted")
        if stats["host_evictions"]:
            event("host evictions")

    @initialize(
        config=configs(),
        host_pages=st.integers(1, 40),
        host_store=st.sampled_from(["write_through", "evict"]),
        prompts=st.lists(st.tuples(st.integers(0, len(DOCUMENTS) - 1), st.integers(1, 40)), max_size=3),
    )
    def build(
        self, config: dict[str, Any], host_pages: int, host_store: str, prompts: list[tuple[int, int]]
    ) -> None:
        self.config = config
        self.caches.extend(
            both_caches(config, enable_kv_events=True, host_pages=host_pages, host_store=host_store)
        )
        self.add_initial(prompts)

    @rule()
    def take_transfers(self) -> None:
        taken = self.both("take_transfers")[1]
        ids = transfer_ids(taken)
        if taken["load"]:
            event("loads handed out")
        if taken["store"]:
            event("stores handed out")
        self.handed_out.extend(ids)

    def ack_all(self, data: st.DataObject) -> None:
        """Take every transfer emitted and acknowledge every one handed out, in a random order."""
        self.take_transfers()
        order = data.draw(st.permutations(self.handed_out))
        self.both("ack_transfers", list(order))
        self.handed_out.clear()

    @precondition(lambda self: self.handed_out)
    @rule(data=st.data())
    def ack_some(self, data: st.DataObject) -> None:
        chosen = data.draw(st.lists(st.sampled_from(self.handed_out), unique=True, max_size=8))
        order = data.draw(st.permutations(chosen))
        status, _ = self.both("ack_transfers", list(order))
        assert status == "ok"
        for op_id in order:
            self.handed_out.remove(op_id)

    @rule(data=st.data())
    def ack_bad(self, data: st.DataObject) -> None:
        """Unknown, repeated or not-yet-handed-out ids: refused alike, nothing changes."""
        bad = data.draw(st.sampled_from(["unknown", "twice", "untaken"]))
        if bad == "twice" and self.handed_out:
            op_id = self.handed_out[0]
            self.both("ack_transfers", [op_id, op_id])
        elif bad == "untaken":
            pending = self.caches[0].transfers_in_flight()
            # The next id any cache would emit has not been handed out.
            self.both("ack_transfers", [10**6 + pending])
        else:
            self.both("ack_transfers", [10**9])

    @rule(doc=st.integers(0, len(DOCUMENTS) - 1), length=st.integers(2, 40), data=st.data())
    def round_trip(self, doc: int, length: int, data: st.DataObject) -> None:
        """Compute and finish a prompt, acknowledge what is handed out, push its pages off the
        device (a request takes every free page by lookahead, then finishes; or, where a
        lookahead is refused, as with state groups, or drawn so, ``reset_prefix_cache``), and
        re-add the prompt: the hit now comes from the host (loads), if the host kept the pages.
        The prompt is computed in ``next_chunk``'s chunks, so a state group writes its
        checkpoints (SPEC 13.5) and a re-added prompt resumes from one loaded back."""
        free_ids = [r for r in REQUEST_IDS if r not in self.live]
        if not free_ids:
            return
        req = data.draw(st.sampled_from(free_ids))
        prompt = DOCUMENTS[doc][:length]
        if not self.added(req, prompt, self.both("add_request", req, prompt)):
            return
        slot = self.live[req]
        self.ack_all(data)  # the prompt's own hit may have loads in flight
        ran = ("ok", ("ndarray", "bool", (1,), [True]))
        for _ in range(8):
            status, chunk = self.both("next_chunk", slot, 10**6)
            if status != "ok" or not chunk or self.both("schedule", [slot], [chunk]) != ran:
                break
        if self.remaining(slot) == 0:
            self.both("finish", [slot])
            self.released([slot])
        self.ack_all(data)
        evicted = False
        if data.draw(st.booleans()):
            # The evictor computes nothing (so registers nothing): its lookahead takes the pages.
            lcm = self.caches[1].lcm_page_size
            added = self.both("add_request", "evictor", [0], use_prefix_cache=False)
            assert added[0] == "ok" and added[1][0] == self.next_slot(), added
            evictor = added[1][0]
            for k in range(1, 65):
                took = self.both("schedule", [evictor], [0], lookahead=k * lcm)
                if took != ran:
                    break
                evicted = True
            self.both("finish", [evictor])
        if not evicted:
            self.both("reset_prefix_cache")
        if req in self.live:
            return
        if data.draw(st.booleans()):
            # admit sizes the claim's loads like pages_needed_to_admit, then adds as add_request.
            back = self.added(req, prompt, self.both("admit", req, prompt, data.draw(st.integers(0, 48))))
        else:
            back = self.added(req, prompt, self.both("add_request", req, prompt))
        if back and self.caches[0].loads_in_flight(self.live[req]):
            event("hit loaded from the host")

    @invariant()
    def transfers_agree(self) -> None:
        if not self.caches:
            return
        self.both("transfers_in_flight")
        for slot in self.live.values():
            status, loads = self.both("loads_in_flight", slot)
            assert status == "ok"
            if loads:
                event("request waiting for loads")
                refused = self.both("schedule", [slot], [0])
                assert refused[0] == "raise" and refused[1].startswith("ValueError"), refused


class ArenaHostMachine(HostMachine, ArenaRequestsMachine):
    """:class:`HostMachine` over the SPEC 13 arena: the host tier is per group, each group's
    host pages of its own page geometry (``host_pages`` an int for every group, or a mapping
    naming some groups, the others untiered), and :class:`ArenaRequestsMachine`'s state slots
    and ``arena_stats()`` must agree too. A state group's checkpoints are stored and loaded
    back like any other page, and a re-added prompt must resume from a loaded checkpoint."""

    @initialize(
        config=arena_configs(),
        more_units=st.integers(0, 12),
        host_pages=arena_host_pages(),
        host_store=st.sampled_from(["write_through", "evict"]),
        prompts=st.lists(st.tuples(st.integers(0, len(DOCUMENTS) - 1), st.integers(1, 40)), max_size=3),
    )
    def build(
        self,
        config: dict[str, Any],
        more_units: int,
        host_pages: Any,
        host_store: str,
        prompts: list[tuple[int, int]],
    ) -> None:
        # Loads need device room beside the requests: up to 24 units rather than 12; and a tier
        # does nothing without the prefix cache (the host machine covers that case).
        config = {**config, "num_units": config["num_units"] + more_units, "enable_caching": True}
        self.config = config
        if isinstance(host_pages, dict):
            # Only the cache's groups: an unknown id is refused (tests/host/test_arena_host.py).
            host_pages = {gid: n for gid, n in host_pages.items() if int(gid[1:]) < len(config["groups"])}
        self.caches.extend(
            both_arena_caches(config, enable_kv_events=True, host_pages=host_pages, host_store=host_store)
        )
        self.add_initial(prompts)

    def check_more_events(self, taken: list[Any]) -> None:
        super().check_more_events(taken)
        host = self.caches[1]._host
        states = [g for g, group in enumerate(self.config["groups"]) if group[0] == "state"]
        if host is not None and any(op.kind == "load" and op.group in states for op in host.ops.values()):
            event("a state checkpoint loading from the host")
