"""The host-memory tier over arena storage (SPEC 13): per group, native vs reference.

Over an arena each group has its own page geometry (a state group's page is a whole state slot),
so the host tier is per group: group ``g`` has host pages ``[0, n_g)`` of its own geometry,
``host_pages`` an int (that many for every group) or a mapping ``{group_id: n}`` (groups not
named get none and are not tiered). A transfer names its group, the device page as the index
in the group's view and the host page in the group's host space.

- :class:`ArenaHostCrossCheck`: ``machines.ArenaHostMachine``, the host tier's state machine
  (tests/host/test_host_stateful.py) over the arena machine's caches
  (tests/requests/test_arena_stateful.py): transfers taken and acknowledged in random order,
  state checkpoints stored and loaded back, everything compared after every step.
  ``HYPOTHESIS_PROFILE=ci`` runs 300 examples (``ARENA_HOST_EXAMPLES`` overrides).
- Hand-derived scenarios, on both engines: a state checkpoint stored to host, evicted on the
  device and loaded back as the state a new request's first step reads; the ``host_pages``
  forms and their errors.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest
from flat_kvcache import ArenaGroup, ArenaPlan
from hypothesis import HealthCheck, settings
from machines import ArenaHostMachine
from strategies import examples

EXAMPLES = examples(dev=60, ci=300, variable="ARENA_HOST_EXAMPLES")

ArenaHostMachine.TestCase.settings = settings(
    max_examples=EXAMPLES,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)

TestArenaHostCrossCheck = ArenaHostMachine.TestCase

#: Full attention (P = 4, 40-byte pages: 3 per 120-byte unit) and one state group (P = G = 8,
#: its page a whole unit, one state slot) over 8 units (unit 0 null).
PLAN = ArenaPlan(
    page_size=4,
    alignment=1,
    unit_bytes=120,
    num_units=8,
    groups=(
        ArenaGroup(group_id="full", kind="pages", item_bytes=40, per_unit=3, num_ids=24, slack_bytes=0),
        ArenaGroup(group_id="state", kind="state", item_bytes=120, per_unit=1, num_ids=8, slack_bytes=0),
    ),
    components=(),
)


def cache(api: ModuleType, host_pages: Any, **options: Any) -> Any:
    specs = [api.KVCacheSpec("full", 4, group_id="full"), api.KVCacheSpec("state", 8, group_id="state")]
    return api.FlatKVCache(specs, arena=PLAN, host_pages=host_pages, enable_kv_events=True, **options)


def transfers(c: Any, kind: str) -> dict[str, list[tuple[int, int, int]]]:
    """``take_transfers()[kind]`` as ``{group_id: [(id, src, dst), ...]}``."""
    taken = c.take_transfers()
    return {
        gid: list(zip(ids.tolist(), src.tolist(), dst.tolist(), strict=True))
        for gid, (ids, src, dst) in taken[kind].items()
    }


@pytest.mark.parametrize("host_store", ["write_through", "evict"])
def test_a_checkpoint_offloaded_to_host_is_what_the_next_request_reads(
    api: ModuleType, host_store: str
) -> None:
    """Request A computes 20 tokens in two steps (16, then 4): the second step's schedule registers the 4
    full pages of tokens 0..16 and the state checkpoint at 16 (A's state page, unit 3 of the arena = state
    slot 3). Write-through stores each at registration (the full pages to full host pages 0..3, the
    checkpoint to state host page 0); store-on-eviction stores them when A finishes. Finishing registers
    the 5th full page (host page 4), not the prompt's end: no token follows it (SPEC 13.5d). The device
    forgets every key (``reset_prefix_cache``); B, a prompt of 24 sharing the 20 tokens, matches 5 full
    pages on the host, and the deepest checkpoint within them, 16, is there too: a hit of 16 tokens, with
    4 full loads and the checkpoint's load into B's state slot. B cannot be scheduled until they are
    acknowledged; its first step then reads that slot (``state_slots``) and writes another."""
    c = cache(api, {"full": 8, "state": 2}, host_store=host_store)
    assert c.stats()["host_pages_total"] == 10
    assert c.add_request("a", list(range(20))) == (0, 0)
    assert c.schedule([0], [16]).tolist() == [True]
    assert c.schedule([0], [4]).tolist() == [True]
    assert [list(p) for p in c.page_ids(0)] == [[3, 4, 5, 6, 7], [0, 3, 4]]
    stores = transfers(c, "store")
    if host_store == "write_through":
        assert stores == {
            "full": [(1, 3, 0), (2, 4, 1), (3, 5, 2), (4, 6, 3)],
            "state": [(5, 3, 0)],
        }
        c.finish([0])
        stores["full"] += transfers(c, "store")["full"]
        assert stores["full"][-1][1:] == (7, 4)
    else:
        assert stores == {}, "pages held by a request are not stored on eviction"
        c.finish([0])
        stores = transfers(c, "store")
        assert sorted(dst for _, _, dst in stores["full"]) == [0, 1, 2, 3, 4]
        assert [src for _, src, _ in stores["state"]] == [3]
    stats = c.stats()
    assert (stats["host_stores"], stats["host_pages_used"], stats["host_transfers_in_flight"]) == (6, 6, 6)
    c.check_invariants()
    c.ack_transfers([i for group in stores.values() for i, _, _ in group][::-1])
    assert c.reset_prefix_cache() == 6
    c.check_invariants()

    slot, hit = c.add_request("b", list(range(24)))
    assert (slot, hit) == (0, 16)
    assert c.loads_in_flight(0) == 5
    with pytest.raises(ValueError, match=r"request 'b' \(slot 0\) has 5 host page load\(s\) in flight"):
        c.schedule([0], [8])
    loads = transfers(c, "load")
    full_ids, state_ids = (list(p) for p in c.page_ids(0))
    # Each load reads the host page A's page of that slot was stored to.
    host_of = {src: dst for _, src, dst in stores["full"]}
    wanted = [host_of[page] for page in (3, 4, 5, 6)]
    assert [(src, dst) for _, src, dst in loads["full"]] == list(zip(wanted, full_ids, strict=True))
    ((_, host_page, state_slot),) = loads["state"]
    assert host_page == 0 and state_ids == [0, state_slot], "the checkpoint lands in B's state slot"
    stats = c.stats()
    assert (stats["host_loads"], stats["host_hits_tokens"], stats["checkpoints_hit"]) == (5, 16, 1)
    c.ack_transfers([i for group in loads.values() for i, _, _ in group])
    assert c.loads_in_flight(0) == 0
    assert c.schedule([0], [8]).tolist() == [True]
    read, write = c.state_slots([0], [8])
    assert read.tolist() == [state_slot], "the first step reads the loaded checkpoint"
    assert write.tolist() != [state_slot]
    c.check_invariants()


def test_a_group_left_out_of_the_mapping_is_not_tiered(api: ModuleType) -> None:
    """``host_pages={"full": 8}``: the state group has no host pages, so its checkpoint is never
    stored (nor counted as skipped); once the device forgets it nothing can restore a state, and
    the hit is 0 although the full pages are on the host (SPEC 13.6)."""
    c = cache(api, {"full": 8})
    assert c.stats()["host_pages_total"] == 8
    c.add_request("a", list(range(20)))
    c.schedule([0], [16])
    c.schedule([0], [4])
    c.finish([0])
    stores = transfers(c, "store")
    assert list(stores) == ["full"] and len(stores["full"]) == 5
    assert c.stats()["host_stores_skipped"] == 0
    c.ack_transfers([i for i, _, _ in stores["full"]])
    c.reset_prefix_cache()
    assert c.add_request("b", list(range(24))) == (0, 0)
    assert c.loads_in_flight(0) == 0
    c.check_invariants()


def test_an_int_gives_every_group_its_own_host_pages(api: ModuleType) -> None:
    """``host_pages=2`` over an arena is 2 pages per group (4 in all), each group's numbered
    0 and 1: the state group's store takes its own page 0 while the full group uses its two,
    and the full group's third page is skipped for lack of a page of its own."""
    c = cache(api, 2)
    assert c.stats()["host_pages_total"] == 4
    c.add_request("a", list(range(20)))
    c.schedule([0], [16])
    c.schedule([0], [4])
    stores = transfers(c, "store")
    assert [dst for _, _, dst in stores["full"]] == [0, 1]
    assert [dst for _, _, dst in stores["state"]] == [0]
    assert c.stats()["host_stores_skipped"] == 2
    c.check_invariants()


def test_zero_host_pages_is_no_tier(api: ModuleType) -> None:
    for host_pages in (0, None, {}, {"full": 0, "state": 0}):
        c = cache(api, host_pages)
        assert c.stats()["host_pages_total"] == 0
        c.add_request("a", list(range(20)))
        c.schedule([0], [16])
        assert transfers(c, "store") == {}
        with pytest.raises(ValueError, match="this cache has no host tier"):
            c.ack_transfers([1])


@pytest.mark.parametrize(
    ("host_pages", "error", "message"),
    [
        ({"attn": 2}, ValueError, 'host_pages names group "attn", which is not one of the cache\'s groups'),
        ({0: 2}, TypeError, r"host_pages keys must be group ids \(str\), got int"),
        ({"state": "2"}, TypeError, 'host_pages\\["state"\\] must be an int, got str'),
        ({"state": -1}, ValueError, 'host_pages\\["state"\\] must be >= 0, got -1'),
        ({"state": 2**64}, OverflowError, 'host_pages\\["state"\\]'),
        (-1, ValueError, "host_pages must be >= 0, got -1"),
        ("2", TypeError, "host_pages must be an int"),
        (
            2**30,
            ValueError,
            r"host_pages: the groups' host pages add up to 2147483648, which must be in \[1, ",
        ),
        (
            {"full": 2**31 - 1, "state": 1},
            ValueError,
            "host_pages: the groups' host pages add up to 2147483648",
        ),
    ],
)
def test_bad_host_pages_over_an_arena_name_the_argument(
    api: ModuleType, host_pages: Any, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        cache(api, host_pages)


def test_a_mapping_needs_an_arena(api: ModuleType) -> None:
    """Without an arena the host tier is one space of the pool's page geometry: ``host_pages``
    is an int, and a mapping is a ``TypeError`` naming it."""
    specs = [api.KVCacheSpec("full", 4)]
    with pytest.raises(TypeError, match=r"host_pages must be an int without arena= .*got dict"):
        api.FlatKVCache(specs, 8, host_pages={"g0": 2})
    with pytest.raises(TypeError, match="host_pages must be an int without arena="):
        api.PageCache(specs, 8, host_pages={"g0": 2})
    assert api.FlatKVCache(specs, 8, host_pages=3).stats()["host_pages_total"] == 3
