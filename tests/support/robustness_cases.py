"""The harness of the robustness sweep (tests/robustness/, tests/rows/test_robustness_rows.py).

Every case is a call on a small, busy cache that must be refused: a token-level
``FlatKVCache`` (:func:`busy_cache`, requests named by slot, docs/requests-api.md "Slots") or,
for a page-level call, a ``PageCache`` (:func:`busy_page_cache`, requests named by id). The
harness runs it on one engine, checks that the exception is the expected kind and names the
argument, and that nothing observable changed: ``stats()``, ``budget()`` (token-level),
``pool_stats()``, which slot holds which id, the block tables, page ids and tail slots of the
live requests, the token positions of the token-level ones, the recorded KV events and
``check_invariants()``. The tests then compare the native engine's exception type and message
with the pure-Python reference's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import flat_kvcache
import flat_kvcache.reference

#: A placeholder content hash (64 lowercase hex digits).
HASH = "0" * 64
#: Token-level requests of :func:`busy_cache` (``"a"`` scheduled, ``7`` admitted only).
TOKEN_LEVEL: tuple[str | int, ...] = ("a", 7)
#: The slots :func:`busy_cache` gives its requests: ``"a"`` slot 0, ``7`` slot 1.
SLOT_A, SLOT_7 = 0, 1
#: The live slots of :func:`busy_cache`, in the order of :data:`TOKEN_LEVEL`.
LIVE_SLOTS: tuple[int, ...] = (SLOT_A, SLOT_7)
#: A slot of :func:`busy_cache` that holds no request (the next ``add_request`` gets it).
FREE_SLOT = 2
#: The page-level request of :func:`busy_page_cache`.
PAGE_LEVEL = "p"
#: Every live request of :func:`busy_cache`.
LIVE: tuple[str | int, ...] = TOKEN_LEVEL
#: Slots :func:`snapshot` looks at (more than any case's cache holds).
PROBED_SLOTS = range(8)

#: Both engines, native first.
ENGINES: tuple[ModuleType, ModuleType] = (flat_kvcache, flat_kvcache.reference)

Call = Callable[[Any], object]


def _specs(api: ModuleType) -> list[Any]:
    """Full P = 4 and sliding P = 4, W = 8."""
    return [api.KVCacheSpec("full", 4, group_id="full"), api.KVCacheSpec("sliding_window", 4, 8, "swa")]


def busy_cache(api: ModuleType) -> Any:
    """A token-level cache of :func:`_specs` over 64 pages, with events on and two live
    requests: ``"a"`` in slot 0 (10-token prompt scheduled, one token appended, 2 tokens
    reserved) and ``7`` in slot 1 (6-token prompt, nothing scheduled). Events so far are taken."""
    cache = api.FlatKVCache(_specs(api), 64, enable_kv_events=True)
    assert tuple(cache.add_request("a", list(range(10)))) == (SLOT_A, 0)
    assert cache.schedule([SLOT_A], [10]).tolist() == [True]
    cache.append_tokens([SLOT_A], [3])
    assert tuple(cache.add_request(7, list(range(100, 106)))) == (SLOT_7, 0)
    cache.reserve([SLOT_A], [2])
    cache.take_events()
    return cache


def busy_page_cache(api: ModuleType) -> Any:
    """A page-level cache of :func:`_specs` over 64 pages, with events on and the live request
    ``"p"`` (room for 5 tokens)."""
    cache = api.PageCache(_specs(api), 64, enable_kv_events=True)
    assert cache.acquire(PAGE_LEVEL, 5)
    cache.take_events()
    return cache


#: The groups of :func:`busy_arena_cache`: full attention P = 4 and a state group G = 8.
ARENA_GROUPS = ("full", "lin")


def arena_components(api: ModuleType) -> list[Any]:
    """The components of :func:`busy_arena_cache`'s model: a K/V layer of 64 bytes per token
    (group ``"full"``) and a 1 KiB state (group ``"lin"``)."""
    return [
        api.ComponentSpec("full", 0, "kv", bytes_per_slot=64, const_bytes=0),
        api.ComponentSpec("lin", 1, "ssm", bytes_per_slot=0, const_bytes=1024),
    ]


def arena_specs(api: ModuleType) -> list[Any]:
    """The engine specs of :func:`busy_arena_cache`."""
    return [api.KVCacheSpec("full", 4, group_id="full"), api.KVCacheSpec("state", 8, group_id="lin")]


def arena_plan(api: ModuleType) -> Any:
    """The arena plan of :func:`busy_arena_cache`: 64 units of 1 KiB (one state slot, or 4
    pages of 4 tokens)."""
    return api.plan_arena(arena_components(api), 4, 64 * 1024)


def busy_arena_cache(api: ModuleType) -> Any:
    """A token-level cache over an arena (docs/sizing-api.md "Arena plan"), with events on and
    two live requests: ``"a"`` in slot 0 (10-token prompt, its first chunk of 8 tokens, cut on
    the state grain, scheduled: ``state_slots([0], [8])`` answers) and ``7`` in slot 1 (6-token
    prompt, nothing scheduled)."""
    cache = api.FlatKVCache(arena_specs(api), arena=arena_plan(api), enable_kv_events=True)
    assert tuple(cache.add_request("a", list(range(10)))) == (SLOT_A, 0)
    assert cache.next_chunk(SLOT_A, 100) == 8
    assert cache.schedule([SLOT_A], [8]).tolist() == [True]
    assert tuple(cache.add_request(7, list(range(100, 106)))) == (SLOT_7, 0)
    cache.take_events()
    return cache


def busy(api: ModuleType, *, page_level: bool = False, arena: bool = False) -> Any:
    """:func:`busy_arena_cache` when ``arena``, :func:`busy_page_cache` when ``page_level``, else
    :func:`busy_cache`."""
    if arena:
        return busy_arena_cache(api)
    return busy_page_cache(api) if page_level else busy_cache(api)


def held_slots(cache: Any) -> dict[int, object]:
    """``{slot: id}`` for every slot of :data:`PROBED_SLOTS` that holds a request."""
    held: dict[int, object] = {}
    for slot in PROBED_SLOTS:
        try:
            held[slot] = cache.id_of(slot)
        except KeyError:
            continue
    return held


def snapshot(cache: Any) -> dict[str, object]:
    """Everything observable about the live requests and the pool, as plain data."""
    if not hasattr(cache, "schedule"):  # a page-level cache: requests named by id
        live = [req for req in (PAGE_LEVEL,) if cache.has_request(req)]
        return {
            "stats": cache.stats(),
            "pool": cache.pool_stats(),
            "tables": {group: table.tolist() for group, table in cache.block_tables(live).items()},
            "pages": [cache.page_ids(req) for req in live],
            "tails": [cache.tail_available(req) for req in live],
            "requests": cache.num_requests,
        }
    held = held_slots(cache)
    slots = list(held)
    return {
        "stats": cache.stats(),
        "budget": [cache.budget(), *(cache.budget(s) for s in slots)],
        "pool": cache.pool_stats(),
        "held": held,
        "slot_of": [cache.slot_of(req) for req in (*LIVE, "new")],
        "tables": {group: table.tolist() for group, table in cache.block_tables(slots).items()},
        "pages": [cache.page_ids(s) for s in slots],
        "tails": [cache.tail_available(s) for s in slots],
        "tokens": [(cache.num_tokens(s), cache.num_computed_tokens(s)) for s in slots],
        "loads": [cache.loads_in_flight(s) for s in slots],
        "requests": cache.num_requests,
    }


@dataclass(frozen=True)
class Refusal:
    """The exception a refused call raised."""

    kind: type[BaseException]
    message: str


def refusal(
    api: ModuleType, call: Call, setup: Call | None = None, *, page_level: bool = False, arena: bool = False
) -> Refusal:
    """Run ``call`` on a fresh :func:`busy_cache` of ``api`` (:func:`busy_page_cache` when
    ``page_level``, :func:`busy_arena_cache` when ``arena``), after ``setup`` when given; it
    must raise, and change nothing."""
    cache = busy(api, page_level=page_level, arena=arena)
    if setup is not None:
        setup(cache)
        cache.take_events()
    before = snapshot(cache)
    try:
        result = call(cache)
    except (TypeError, ValueError, OverflowError, KeyError, RuntimeError, BufferError) as exc:
        caught = Refusal(type(exc), str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc))
    else:
        raise AssertionError(f"{api.__name__}: the call returned {result!r} instead of raising")
    assert snapshot(cache) == before, f"{api.__name__}: a refused call changed the cache"
    assert cache.take_events() == [], f"{api.__name__}: a refused call recorded KV events"
    cache.check_invariants()
    return caught


@dataclass(frozen=True)
class Case:
    """A call to refuse: the exception kind expected and a text its message must contain."""

    call: Call
    kind: type[BaseException]
    names: str
    setup: Call | None = None
    #: Run on :func:`busy_page_cache` (a page-level call) instead of :func:`busy_cache`.
    page_level: bool = False


def check_case(api: ModuleType, case: Case) -> Refusal:
    """:func:`refusal`, plus the expected kind and the argument's name in the message."""
    got = refusal(api, case.call, case.setup, page_level=case.page_level)
    assert issubclass(got.kind, case.kind), f"{api.__name__}: {got}"
    assert case.names in got.message, f"{api.__name__}: message does not name {case.names!r}: {got}"
    return got


def check_agree(case: Case) -> None:
    """Native and reference refuse ``case`` with the same exception type and message."""
    native, reference = (check_case(api, case) for api in ENGINES)
    assert native == reference, f"native {native} != reference {reference}"
