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

import flat_kvcache
import flat_kvcache.reference
import pytest
from hypothesis import HealthCheck, settings
from machines import HostMachine
from strategies import examples

EXAMPLES = examples(dev=60, ci=300, variable="HOST_EXAMPLES")


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
