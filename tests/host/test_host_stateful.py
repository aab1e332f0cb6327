"""Stateful cross-check of the host-memory tier: native vs reference.

The token-level state machine (``RequestsMachine`` of tests/support/machines.py, run alone by
tests/requests/test_requests_stateful.py) runs with a host tier (a few to a few dozen host
pages, ``host_store`` write-through or store-on-eviction) and gains three rules:
``take_transfers`` (both must hand out the same stores and loads), acknowledging a
random subset of the transfers handed out in a random order (so loads and stores finish late,
after their request finished, was preempted or aborted, and in any order), and bad
acknowledgements (unknown, not yet handed out, repeated ids), which must be refused by both
with the same message and change nothing.

After every step, besides everything the base machine compares (page ids, positions,
``stats()`` with its ``host_*`` figures, ``budget()``, the events, GPU-medium ones replayed
into an index), the CPU-medium events replayed must name exactly the findable host pages, and
both must agree on each live request's loads in flight and the transfers in flight, and both
``check_invariants()``: every transfer pins its device page, no page is lost, no host page is
read before its store is acknowledged. Scheduling a request whose loads are in flight must
fail the same way on both.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import flat_kvcache
import flat_kvcache.reference
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule
from machines import RequestsMachine, replay
from strategies import DOCUMENTS, REQUEST_IDS, both_caches, configs, examples

EXAMPLES = examples(dev=60, ci=300, variable="HOST_EXAMPLES")


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
        host = self.caches[1]._host
        findable: Counter[tuple[int, bytes]] = Counter(
            (int(key[64:], 16), bytes.fromhex(key[:64]))
            for page, key in enumerate(host.keys)
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
        device (a request takes every free page by lookahead, then finishes), and re-add the
        prompt: the hit now comes from the host (loads), if the host kept the pages."""
        free_ids = [r for r in REQUEST_IDS if r not in self.live]
        if not free_ids:
            return
        req = data.draw(st.sampled_from(free_ids))
        prompt = DOCUMENTS[doc][:length]
        if not self.added(req, prompt, self.both("add_request", req, prompt)):
            return
        slot = self.live[req]
        done = self.both("schedule", [slot], [length - int(self.caches[0].num_computed_tokens(slot))])
        if done == ("ok", ("ndarray", "bool", (1,), [True])):
            self.both("finish", [slot])
            self.released([slot])
        self.take_transfers()
        order = data.draw(st.permutations(self.handed_out))
        self.both("ack_transfers", list(order))
        self.handed_out.clear()
        if data.draw(st.booleans()):
            self.both("reset_prefix_cache")
        else:
            # The evictor computes nothing (so registers nothing): its lookahead takes the pages.
            lcm = self.caches[1].lcm_page_size
            added = self.both("add_request", "evictor", [0], use_prefix_cache=False)
            assert added[0] == "ok" and added[1][0] == self.next_slot(), added
            evictor = added[1][0]
            for k in range(1, 65):
                took = self.both("schedule", [evictor], [0], lookahead=k * lcm)
                if took != ("ok", ("ndarray", "bool", (1,), [True])):
                    break
            self.both("finish", [evictor])
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


HostMachine.TestCase.settings = settings(
    max_examples=EXAMPLES,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)

TestHostCrossCheck = HostMachine.TestCase


def test_cpu_medium_events_and_host_stats() -> None:
    """A write-through tier of 2 host pages over one full group of page size 4 (docs/requests-api.md,
    "Host-memory tier"): a 13-token prompt registers 3 pages; the host takes the first 2 and
    skips the third; each acknowledged store is a CPU-medium ``BlockStored``; a later store
    evicts the least recently used host page (a CPU-medium ``BlockRemoved``); a re-added
    prompt whose pages left the device loads them back and counts host hit tokens."""
    from flat_kvcache.events import BlockRemoved, BlockStored

    for module in (flat_kvcache, flat_kvcache.reference):
        c = module.FlatKVCache([module.KVCacheSpec("full", 4)], 5, host_pages=2, enable_kv_events=True)
        assert c.stats()["host_pages_total"] == 2
        assert c.add_request("a", list(range(13))) == (0, 0)
        assert c.schedule([0], [13]).tolist() == [True]
        c.finish([0])
        gpu = c.take_events()
        assert [type(e) for e in gpu] == [BlockStored] and gpu[0].medium == "GPU"
        assert len(gpu[0].block_hashes) == 3
        stats = c.stats()
        assert (stats["host_stores"], stats["host_stores_skipped"], stats["host_pages_used"]) == (2, 1, 2)
        assert stats["host_transfers_in_flight"] == 2
        ids, _, _ = c.take_transfers()["store"]["g0"]
        c.ack_transfers(ids[::-1])
        cpu = c.take_events()
        assert [(type(e), e.medium) for e in cpu] == [(BlockStored, "CPU")] * 2
        # Acknowledged in reverse order: the events follow the acknowledgements.
        assert [e.block_hashes[0] for e in cpu] == [gpu[0].block_hashes[1], gpu[0].block_hashes[0]]
        assert all(e.parent_block_hash is None and e.token_ids == [] for e in cpu)
        # Take every device page (evicting the 3 cached ones), then give them back: a request
        # whose lookahead holds 16 tokens' pages and computes none, so it registers nothing.
        assert c.add_request("evictor", [0], use_prefix_cache=False) == (0, 0)
        assert c.schedule([0], [0], lookahead=16).tolist() == [True]
        c.finish([0])
        assert [(type(e), e.medium) for e in c.take_events()] == [(BlockRemoved, "GPU")]
        # The first 2 pages come back from the host: 8 tokens, all of them host hits.
        assert c.add_request("b", list(range(13))) == (0, 8)
        assert c.loads_in_flight(0) == 2
        # Nothing reads a page before its load is acknowledged: schedule names the request.
        with pytest.raises(ValueError, match=r"request 'b' \(slot 0\)"):
            c.schedule([0], [1])
        stats = c.stats()
        assert (stats["host_loads"], stats["host_hits_tokens"], stats["prefix_hits_tokens"]) == (2, 8, 8)
        ids, _, _ = c.take_transfers()["load"]["g0"]
        c.ack_transfers(ids)
        assert [(type(e), e.medium) for e in c.take_events()] == [(BlockStored, "GPU")] * 2
        # A new prompt's page is stored (at its registration, before its GPU event) over the
        # least recently used host page: the loads were acknowledged page 0 first.
        assert c.loads_in_flight(0) == 0
        assert c.add_request("c", list(range(100, 105))) == (1, 0)
        assert c.schedule([1], [5]).tolist() == [True]
        c.finish([1])
        events = c.take_events()
        assert [(type(e), e.medium) for e in events] == [(BlockRemoved, "CPU"), (BlockStored, "GPU")]
        assert events[0].block_hashes == [gpu[0].block_hashes[0]]
        ids, _, _ = c.take_transfers()["store"]["g0"]
        assert c.stats()["host_evictions"] == 1
        c.ack_transfers(ids)
        c.check_invariants()
