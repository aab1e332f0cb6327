"""Slots of the token-level API (docs/requests-api.md, "Slots" and "Requests that own their tokens").

A request of a ``FlatKVCache`` enters by id (``add_request``, ``admit``) and gets the lowest
slot no live request holds; every later call names it by that slot, one slot or an array of
them (a list, a tuple, a 1-D numpy integer array). These cases check the slot rule (assignment,
reuse after ``finish`` / ``preempt``, rows bound), ``slot_of`` / ``id_of``, the refusal of a free
slot and of arguments that are no slot, repeated slots, the order in which a call validates
its arguments (nothing changes when one is refused), and how messages show a request. Each
runs on both implementations (the ``api`` fixture) against values worked out from the contract;
the tests without the fixture compare the two engines' messages directly.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import flat_kvcache
import flat_kvcache.reference
import numpy as np
import pytest
from flat_kvcache import UnknownRequestError
from slots import computed, outcome_of, running


def cache_of(api: ModuleType, num_pages: int = 64, **options: Any) -> Any:
    """One full-attention group, P = 4."""
    return api.FlatKVCache([api.KVCacheSpec("full", 4)], num_pages, **options)


def state(cache: Any, slots: list[int]) -> tuple[Any, ...]:
    """What a refused call must leave as it was: pool figures, and per slot its id, tokens,
    position and pages."""
    return (
        cache.stats(),
        cache.budget(),
        cache.num_requests,
        [
            (
                cache.id_of(s),
                cache.num_tokens(s),
                cache.num_computed_tokens(s),
                cache.page_ids(s),
                cache.budget(s),
            )
            for s in slots
        ],
    )


# ----- the slot rule ----------------------------------------------------------------------------


def test_each_request_gets_the_lowest_free_slot(api: ModuleType) -> None:
    cache = cache_of(api)
    assert [cache.add_request(r, [1, 2, 3])[0] for r in ("a", "b", "c")] == [0, 1, 2]
    cache.finish([1])
    assert cache.add_request("d", [4])[0] == 1  # the freed slot, at once
    assert cache.add_request("e", [5])[0] == 3
    assert cache.preempt([0]) == [[1, 2, 3]]
    assert cache.add_request("f", [6]) == (0, 0)
    cache.finish(np.array([3, 0, 2]))
    # Slots 0, 2, 3 are free again: they are handed out lowest first.
    assert [cache.add_request(r, [7])[0] for r in ("g", "h", "i", "j")] == [0, 2, 3, 4]
    assert {cache.id_of(s) for s in range(5)} == {"g", "d", "h", "i", "j"}
    assert cache.id_of(1) == "d"
    assert cache.num_requests == 5
    cache.check_invariants()


def test_admit_takes_the_lowest_free_slot_too(api: ModuleType) -> None:
    cache = cache_of(api)
    for req in ("a", "b", "c"):
        cache.add_request(req, [1])
    cache.finish([0, 1])
    # Fresh tables, no hit: the chunk is the whole prompt, plus one reserved token's page.
    assert cache.admit("x", list(range(10)), 16) == (0, 0, 10)
    assert cache.admit("y", list(range(100, 110)), 4) == (1, 0, 4)
    assert cache.admit("z", [5], 4) == (3, 0, 1)
    assert (cache.slot_of("x"), cache.slot_of("y"), cache.slot_of("z"), cache.slot_of("c")) == (0, 1, 3, 2)
    assert cache.schedule([0, 1], [10, 4]).tolist() == [True, True]


def test_a_refused_add_request_takes_no_slot(api: ModuleType) -> None:
    cache = cache_of(api)
    cache.add_request("a", [1])
    with pytest.raises(ValueError, match="add_request: request 'a' already exists"):
        cache.add_request("a", [2])
    with pytest.raises(ValueError, match="must not be empty"):
        cache.add_request("b", [])
    assert cache.admit("c", [1, 2], 2, extra_keys=["k"]) == (1, 0, 2)
    # admit that does not fit: None, no slot taken.
    small = cache_of(api, 3)  # 2 real pages
    assert small.add_request("a", [1]) == (0, 0)
    assert small.admit("big", list(range(20)), 20) is None
    assert small.slot_of("big") is None
    assert small.add_request("b", [2]) == (1, 0)


def test_slot_of_and_id_of(api: ModuleType) -> None:
    cache = cache_of(api)
    big = 2**70 + 5
    for req in (5, "5", big, -3):
        cache.add_request(req, [1, 2])
    assert [cache.slot_of(r) for r in (5, "5", big, -3)] == [0, 1, 2, 3]
    assert cache.slot_of("nope") is None and cache.slot_of(6) is None and cache.slot_of(str(big)) is None
    # id_of gives back the id as it was added: 5 and "5" are different requests.
    assert cache.id_of(0) == 5 and isinstance(cache.id_of(0), int)
    assert cache.id_of(1) == "5" and isinstance(cache.id_of(1), str)
    assert cache.id_of(np.int64(2)) == big and cache.id_of(3) == -3
    cache.finish([1])
    assert cache.slot_of("5") is None
    with pytest.raises(UnknownRequestError) as info:
        cache.id_of(1)
    assert isinstance(info.value, KeyError)
    assert info.value.args[0] == "id_of: slot 1 holds no request"
    # A finished id may be added again, and takes the lowest free slot.
    assert cache.add_request("5", [9]) == (1, 0)
    assert cache.id_of(1) == "5"


# ----- slots that hold no request, and arguments that are no slot --------------------------------

FREE_SLOT_CALLS: dict[str, Callable[[Any, int], object]] = {
    "schedule": lambda c, s: c.schedule([0, s], [0, 0]),
    "append_tokens": lambda c, s: c.append_tokens([0, s], [1, 2]),
    "reserve": lambda c, s: c.reserve([0, s], [1, 1]),
    "finish": lambda c, s: c.finish([0, s]),
    "preempt": lambda c, s: c.preempt([0, s]),
    "num_computed_tokens": lambda c, s: c.num_computed_tokens(s),
    "num_tokens": lambda c, s: c.num_tokens(s),
    "page_ids": lambda c, s: c.page_ids(s),
    "tail_available": lambda c, s: c.tail_available(s),
    "loads_in_flight": lambda c, s: c.loads_in_flight(s),
    "pages_needed": lambda c, s: c.pages_needed(4, s),
    "budget": lambda c, s: c.budget(s),
    "id_of": lambda c, s: c.id_of(s),
}


@pytest.mark.parametrize("method", list(FREE_SLOT_CALLS))
@pytest.mark.parametrize("slot", [1, 2, 99, 2**63])
def test_a_free_slot_is_unknown_request_error_naming_method_and_slot(
    api: ModuleType, method: str, slot: int
) -> None:
    """Slot 1 was finished, 2 was preempted, 99 and 2**63 never held a request."""
    cache = cache_of(api)
    for req in ("a", "b", "c"):
        running(cache, req, [1, 2, 3, 4, 5])
    cache.finish([1])
    cache.preempt([2])
    before = state(cache, [0])
    with pytest.raises(UnknownRequestError) as info:
        FREE_SLOT_CALLS[method](cache, slot)
    assert isinstance(info.value, KeyError)
    assert info.value.args[0] == f"{method}: slot {slot} holds no request"
    assert state(cache, [0]) == before
    cache.check_invariants()


def test_block_tables_of_a_free_slot(flat_api: ModuleType) -> None:
    cache = cache_of(flat_api)
    running(cache, "a", [1, 2, 3, 4, 5])
    with pytest.raises(UnknownRequestError) as info:
        cache.block_tables([0, 1])
    assert info.value.args[0] == "block_tables: slot 1 holds no request"
    out = {"g0": np.full((2, 4), 7, np.int32)}
    with pytest.raises(UnknownRequestError):
        cache.block_tables([0, 3], out=out)
    assert (out["g0"] == 7).all()


@pytest.mark.parametrize(
    ("bad", "error"),
    [
        (True, TypeError),
        (1.0, TypeError),
        (None, TypeError),
        (b"0", TypeError),
        ("0", TypeError),
        (-1, ValueError),
        (2**64, OverflowError),
    ],
    ids=["bool", "float", "None", "bytes", "str", "negative", "past-u64"],
)
def test_an_argument_that_is_no_slot_is_refused_naming_it(
    api: ModuleType, bad: object, error: type[Exception]
) -> None:
    cache = cache_of(api)
    running(cache, "a", list(range(8)))
    cache.add_request("b", list(range(8)))
    before = state(cache, [0, 1])
    array_calls: list[Callable[[], object]] = [
        lambda: cache.schedule([0, bad], [1, 1]),
        lambda: cache.append_tokens([0, bad], [1, 1]),
        lambda: cache.reserve([0, bad], [1, 1]),
        lambda: cache.finish([0, bad]),
        lambda: cache.preempt([0, bad]),
    ]
    for call in array_calls:
        with pytest.raises(error, match=r"slots\[1\]"):
            call()
    one_calls: list[Callable[[], object]] = [
        lambda: cache.num_tokens(bad),
        lambda: cache.num_computed_tokens(bad),
        lambda: cache.page_ids(bad),
        lambda: cache.id_of(bad),
    ]
    for call in one_calls:
        with pytest.raises(error, match="slot"):
            call()
    assert state(cache, [0, 1]) == before


@pytest.mark.parametrize(
    "slots",
    [
        "01",
        b"\x00",
        np.ma.masked_array(np.array([0, 1])),
        np.array([0.0, 1.0]),
        np.array([[0, 1]]),
    ],
    ids=["str", "bytes", "masked", "float-array", "2-d"],
)
def test_a_slot_array_of_the_wrong_kind_is_refused(api: ModuleType, slots: object) -> None:
    cache = cache_of(api)
    cache.add_request("a", list(range(8)))
    cache.add_request("b", list(range(8)))
    before = state(cache, [0, 1])
    calls: list[Callable[[], object]] = [
        lambda: cache.schedule(slots, [1, 1]),
        lambda: cache.append_tokens(slots, [1, 1]),
        lambda: cache.finish(slots),
    ]
    for call in calls:
        with pytest.raises((TypeError, ValueError), match="slots"):
            call()
    assert state(cache, [0, 1]) == before


def test_slot_arrays_of_any_integer_kind(api: ModuleType) -> None:
    """Lists, tuples, numpy integer arrays of any dtype and numpy integer scalars are slots."""
    cache = cache_of(api)
    for req in ("a", "b", "c"):
        cache.add_request(req, list(range(40)))
    forms: list[Any] = [
        [0, 1, 2],
        (0, 1, 2),
        np.array([0, 1, 2], dtype=np.int64),
        np.array([0, 1, 2], dtype=np.uint8),
        np.array([0, 1, 2], dtype=np.int32),
        [np.int64(0), np.uint16(1), np.int8(2)],
        np.array([0, 9, 1, 9, 2, 9])[::2],  # a strided view
    ]
    for form in forms:
        assert cache.schedule(form, [1, 1, 1]).tolist() == [True, True, True]
    assert computed(cache, [0, 1, 2]) == [len(forms)] * 3
    assert cache.num_tokens(np.int32(1)) == 40 and cache.num_computed_tokens(np.uint64(2)) == len(forms)
    assert cache.schedule([], []).shape == (0,)
    assert cache.schedule(np.array([], dtype=np.int64), np.array([], dtype=np.int64)).dtype == np.bool_


# ----- repeated slots, order of validation ------------------------------------------------------


def test_reordered_and_repeated_slots_schedule_their_own_requests(api: ModuleType) -> None:
    cache = cache_of(api)
    a, b, c = (cache.add_request(req, list(range(40)))[0] for req in ("alpha", "beta", 7))
    assert (a, b, c) == (0, 1, 2)
    assert cache.schedule([a, b, c], [1, 2, 3]).all()
    assert computed(cache, [a, b, c]) == [1, 2, 3]
    # Other positions: each request moves by its own count.
    assert cache.schedule([c, a, b], [10, 20, 30]).all()
    assert computed(cache, [a, b, c]) == [21, 32, 13]
    # A repeated slot asks twice.
    assert cache.schedule([b, b, a], [1, 1, 1]).all()
    assert computed(cache, [a, b, c]) == [22, 34, 13]
    assert cache.schedule(np.array([a]), [1]).all()
    assert cache.schedule((a, b, c), np.array([1, 1, 1], dtype=np.uint8)).all()
    assert computed(cache, [a, b, c]) == [24, 35, 14]
    cache.check_invariants()


def test_a_slot_finished_and_given_again_names_the_new_request(api: ModuleType) -> None:
    """After ``finish`` the slot may hold another request at once: calls on it act on that one."""
    cache = cache_of(api)
    a = cache.add_request("req-a", list(range(20)))[0]
    b = cache.add_request("req-b", list(range(100, 120)))[0]
    assert cache.schedule([a, b], [8, 8]).all()
    cache.finish([a])
    filler = cache.add_request("filler", list(range(200, 203)))[0]
    assert filler == a == 0
    again = cache.add_request("req-a", list(range(300, 305)))[0]
    assert again == 2
    assert cache.schedule([again, b], [2, 1]).all()
    assert computed(cache, [again, b, filler]) == [2, 9, 0]
    cache.append_tokens([again, b], [1, 2])
    assert (cache.num_tokens(again), cache.num_tokens(b), cache.num_tokens(filler)) == (6, 21, 3)
    cache.finish([again])
    calls: list[Callable[[], object]] = [
        lambda: cache.schedule([b, again], [1, 1]),
        lambda: cache.append_tokens([b, again], [1, 1]),
    ]
    for call in calls:
        with pytest.raises(UnknownRequestError, match="slot 2 holds no request"):
            call()
    assert computed(cache, [b]) == [9] and cache.num_tokens(b) == 21
    cache.check_invariants()


def test_finish_and_preempt_with_a_repeated_slot_change_nothing(api: ModuleType) -> None:
    cache = cache_of(api, enable_kv_events=True)
    for req in ("a", "b", "c"):
        running(cache, req, list(range(9)))
    cache.take_events()
    before = state(cache, [0, 1, 2])
    with pytest.raises(ValueError) as info:
        cache.finish([0, 1, 0])
    assert str(info.value) == "finish: slot 0 is listed twice"
    with pytest.raises(ValueError, match="slot 2 is listed twice"):
        cache.finish(np.array([2, 2]))
    with pytest.raises(ValueError, match=r"^preempt: slot 1 is listed twice$"):
        cache.preempt([1, 2, 1])
    # A free slot after held ones: refused before any is finished.
    with pytest.raises(UnknownRequestError):
        cache.finish([0, 1, 5])
    with pytest.raises(UnknownRequestError):
        cache.preempt([2, 3])
    assert state(cache, [0, 1, 2]) == before
    assert cache.stats()["preemptions"] == 0
    assert cache.take_events() == []
    cache.finish([])
    assert cache.preempt([]) == []
    cache.finish([2, 0])
    assert cache.num_requests == 1 and cache.slot_of("b") == 1
    cache.check_invariants()


def test_preempt_returns_each_requests_tokens_in_order(api: ModuleType) -> None:
    cache = cache_of(api)
    prompts = {"a": [1, 2, 3], "b": list(range(10, 19)), "c": [7]}
    for req, prompt in prompts.items():
        running(cache, req, prompt)
    cache.append_tokens([0, 2, 0, 1], [100, 101, 200, 300, 301], [2, 1, 0, 2])
    assert cache.preempt(np.array([2, 0])) == [[7, 200], [1, 2, 3, 100, 101]]
    assert cache.stats()["preemptions"] == 2
    assert (cache.slot_of("a"), cache.slot_of("b"), cache.slot_of("c")) == (None, 1, None)
    assert cache.preempt([1]) == [[*range(10, 19), 300, 301]]
    assert cache.stats()["preemptions"] == 3 and cache.num_requests == 0


def test_reserve_takes_slot_arrays(api: ModuleType) -> None:
    cache = cache_of(api, 9)  # 8 real pages
    running(cache, "a", list(range(8)))  # 2 pages, the tail full
    cache.add_request("b", list(range(50, 53)))  # no pages yet
    assert cache.budget() == 6
    # a: the next 4 tokens need 1 page; b: 8 tokens on empty tables need 2.
    cache.reserve(np.array([0, 1], dtype=np.int64), np.array([4, 8], dtype=np.uint16))
    assert (cache.budget(), cache.budget(0), cache.budget(1)) == (3, 4, 5)
    # A repeated slot: the last one counts (a's reserve is cleared).
    cache.reserve([0, 1, 0], [40, 4, 0])
    assert (cache.budget(), cache.budget(0), cache.budget(1)) == (5, 5, 6)
    cache.reserve((1,), (0,))
    assert cache.budget() == 6
    cache.reserve([], [])
    before = state(cache, [0, 1])
    with pytest.raises(ValueError):
        cache.reserve([0, 1], [4])
    with pytest.raises(ValueError, match=r"\[1\]"):
        cache.reserve([0, 1], [4, -1])
    with pytest.raises(TypeError):
        cache.reserve([0, 1], [4, 1.5])
    with pytest.raises(UnknownRequestError):
        cache.reserve([0, 2], [4, 4])
    assert state(cache, [0, 1]) == before
    cache.reserve([0], [4])
    assert cache.budget() == 5
    cache.append_tokens([0], [8])
    assert cache.schedule([0], [1]).tolist() == [True]  # releases a's reserve, takes 1 page
    assert (cache.num_free_pages, cache.budget()) == (5, 5)


def test_errors_come_in_slot_order_and_name_the_request(api: ModuleType) -> None:
    cache = cache_of(api)
    first = cache.add_request("first", list(range(8)))[0]
    second = cache.add_request("second", list(range(8)))[0]
    assert cache.schedule([first, second], [1, 1]).all()
    with pytest.raises(ValueError) as too_many:
        cache.schedule([first, second], [1, 8])
    message = str(too_many.value)
    assert "request 'second' (slot 1)" in message and "num_new_tokens" in message
    assert "'first'" not in message
    with pytest.raises(UnknownRequestError) as unknown:
        cache.schedule([first, 2], [1, 1])
    assert unknown.value.args[0] == "schedule: slot 2 holds no request"
    # The second entry for a slot counts with the first: 7 + 8 > 7 left for "first".
    with pytest.raises(ValueError, match=r"request 'first' \(slot 0\)"):
        cache.schedule([second, first, first], [7, 0, 8])
    with pytest.raises(ValueError, match="num_new_tokens has 1 entries but slots has 2"):
        cache.schedule([first, second], [1])
    with pytest.raises(UnknownRequestError) as append_unknown:
        cache.append_tokens([first, 2], [1, 1])
    assert append_unknown.value.args[0] == "append_tokens: slot 2 holds no request"
    # append_tokens checks token values and lengths before whether each slot is held.
    with pytest.raises(ValueError, match=r"token_ids\[1\]"):
        cache.append_tokens([first, 9], [1, -1])
    with pytest.raises(ValueError, match="but slots has 2"):
        cache.append_tokens([first, 9], [1])
    assert computed(cache, [first, second]) == [1, 1]
    assert (cache.num_tokens(first), cache.num_tokens(second)) == (8, 8)


def test_messages_agree_between_engines() -> None:
    """The same refused calls give the same exception classes and messages on both engines."""

    def messages(api: ModuleType) -> list[tuple[str, Any]]:
        cache = cache_of(api)
        cache.add_request("first", list(range(8)))
        cache.add_request(2, list(range(8)))
        calls: list[Callable[[], object]] = [
            lambda: cache.schedule([0, 1], [1, 9]),
            lambda: cache.schedule([0, 1, 0], [5, 0, 4]),
            lambda: cache.schedule([0, 4], [1, 1]),
            lambda: cache.schedule([0], [1, 2]),
            lambda: cache.schedule([0], [0], lookahead=-1),
            lambda: cache.schedule([0], [9], lookahead=0),
            lambda: cache.append_tokens([0, 1], [1]),
            lambda: cache.append_tokens([0, 1], [1, 2], [2]),
            lambda: cache.append_tokens([0, 1], [1, 2], [1, 2]),
            lambda: cache.append_tokens([0, 1], [1, 2], [2**64 - 1, 1]),
            lambda: cache.append_tokens([0, 7], [1, 2]),
            lambda: cache.reserve([0, 7], [1, 2]),
            lambda: cache.reserve([0], [1, 2]),
            lambda: cache.finish([1, 1]),
            lambda: cache.preempt([0, 0]),
            lambda: cache.finish([True]),
            lambda: cache.id_of(3),
            lambda: cache.num_tokens(-1),
            lambda: cache.add_request("first", [1]),
            lambda: cache.add_request(2, [1]),
            lambda: cache.admit("first", [1], 2),
        ]
        return [outcome_of(call) for call in calls]

    native, reference = messages(flat_kvcache), messages(flat_kvcache.reference)
    for index, (got, want) in enumerate(zip(native, reference, strict=True)):
        assert got == want, f"call {index}: native {got} != reference {want}"
    assert all(status == "raise" for status, _ in native)


@pytest.mark.parametrize(
    "req",
    [
        "r" * 200,
        "it's " + "x" * 100,
        "both ' and \" quotes" * 10,
        "é" * 81,
        "e" * 80,
        2**300,
        -(2**300),
        -(2**63),
    ],
    ids=["long", "quote", "both-quotes", "non-ascii", "exactly-80", "huge", "huge-negative", "i64-min"],
)
def test_long_ids_are_shown_alike_by_both_engines(req: Any) -> None:
    """Messages show a request id as ``repr`` of its first 80 characters (or digits), then
    ``...`` when cut, then its slot: the same text from the native engine and the reference."""

    def messages(api: ModuleType) -> list[str]:
        cache = cache_of(api)
        cache.add_request("other", [1])
        out: list[str] = []
        assert cache.slot_of(req) is None
        assert cache.add_request(req, [1, 2, 3]) == (1, 0)
        assert cache.id_of(1) == req
        with pytest.raises(ValueError) as exists:
            cache.add_request(req, [1])
        out.append(str(exists.value))
        with pytest.raises(ValueError) as too_many:
            cache.schedule([1], [4])
        out.append(str(too_many.value))
        # The page-level protocol names requests by id: unknown, then a claim on tables that
        # already hold pages.
        page = api.PageCache([api.KVCacheSpec("full", 4)], 64)
        with pytest.raises(KeyError) as unknown:
            page.free(req)
        out.append(unknown.value.args[0])
        assert page.acquire(req, 4)
        with pytest.raises(ValueError) as invalid:
            page.claim(req, page.match_prefix([]))
        out.append(str(invalid.value))
        return out

    native, reference = messages(flat_kvcache), messages(flat_kvcache.reference)
    assert native == reference
    text = req if isinstance(req, str) else str(req)
    cut = len(text) > 80
    shown = (repr(text[:80]) if isinstance(req, str) else text[:80]) + ("..." if cut else "")
    assert all(shown in m for m in native), (shown, native)
    assert f"{shown} (slot 1)" in native[1], native[1]


def test_an_id_utf8_cannot_encode_is_refused_alike() -> None:
    """A str id holding a lone surrogate is a ``UnicodeEncodeError`` (a ``ValueError``) from
    ``add_request``, ``admit`` and ``slot_of``, with the same message from both engines; nothing is added and
    no slot taken."""

    def outcomes(api: ModuleType) -> list[tuple[str, str]]:
        cache = cache_of(api, 16)
        cache.add_request("x", [1, 2, 3])
        calls: list[Callable[[], object]] = [
            lambda: cache.add_request("a\ud800", [1]),
            lambda: cache.admit("\udc80", [1, 2], 2),
            lambda: cache.slot_of("x\ud800"),
        ]
        out = []
        for call in calls:
            with pytest.raises(UnicodeEncodeError) as info:
                call()
            out.append((type(info.value).__name__, str(info.value)))
        assert cache.num_tokens(0) == 3 and cache.num_computed_tokens(0) == 0
        assert cache.num_requests == 1
        assert cache.add_request("y", [1]) == (1, 0)
        return out

    assert outcomes(flat_kvcache) == outcomes(flat_kvcache.reference)


def test_a_slot_whose_index_calls_back_into_the_cache() -> None:
    """Reading a slot may run Python code (``__index__``) that uses the same cache: no deadlock,
    and both engines do the same (accept it as the slot it names, or refuse it alike)."""

    def run(api: ModuleType) -> list[Any]:
        cache = cache_of(api)
        cache.add_request(1, list(range(30)))
        cache.add_request(2, list(range(30)))

        class Reentrant:
            calls = 0

            def __index__(self) -> int:
                Reentrant.calls += 1
                assert cache.schedule([0], [1]).all()
                return 1

        got = [
            outcome_of(lambda: cache.schedule([0, Reentrant()], [2, 3])),
            outcome_of(lambda: cache.append_tokens([Reentrant(), 0], [5, 6])),
            outcome_of(lambda: cache.num_tokens(Reentrant())),
        ]
        cache.check_invariants()
        return [*got, computed(cache, [0, 1]), cache.num_tokens(0), cache.num_tokens(1)]

    assert run(flat_kvcache) == run(flat_kvcache.reference)


# ----- rows bound: every slot below max_rows ----------------------------------------------------


def tables(rows: int, cols: int = 8) -> dict[str, Any]:
    return {"g0": np.zeros((rows, cols), np.int32)}


def test_rows_bound_refuse_a_request_when_every_row_is_held(api: ModuleType) -> None:
    cache = cache_of(api)
    cache.bind_rows(tables(2))
    assert cache.add_request("a", list(range(6))) == (0, 0)
    assert cache.admit("b", list(range(6)), 8) == (1, 0, 6)
    before = state(cache, [0, 1])
    with pytest.raises(ValueError) as info:
        cache.add_request("c", [1, 2])
    assert str(info.value) == (
        "add_request: all 2 slots of the bound rows are held (finish a request or bind more rows)"
    )
    assert cache.admit("c", [1, 2], 2) is None  # fits the pool, but no row is free
    assert cache.slot_of("c") is None
    assert state(cache, [0, 1]) == before
    # A finished request's slot is free at once: the next request gets its row.
    cache.finish([0])
    assert cache.add_request("c", [1, 2]) == (0, 0)
    cache.update_rows()
    assert cache.id_of(0) == "c"
    # More rows: more requests.
    cache.bind_rows(tables(3))
    assert cache.add_request("d", [3]) == (2, 0)
    cache.check_invariants()


def test_bind_rows_refuses_fewer_rows_than_a_live_slot(api: ModuleType) -> None:
    cache = cache_of(api)
    for req in ("a", "b", "c", "d"):
        cache.add_request(req, [1, 2, 3])
    cache.finish([1])
    # Slots 0, 2 and 3 are held: two rows are too few (the lowest slot without a row is 2).
    with pytest.raises(ValueError) as info:
        cache.bind_rows(tables(2))
    assert str(info.value) == "bind_rows: request 'c' holds slot 2, but the new tables have 2 rows"
    with pytest.raises(ValueError, match="request 'd' holds slot 3, but the new tables have 3 rows"):
        cache.bind_rows(tables(3))
    with pytest.raises(ValueError, match="bind_rows first"):
        cache.update_rows()  # nothing was bound
    cache.bind_rows(tables(4))
    assert cache.add_request("e", [4]) == (1, 0)
    with pytest.raises(ValueError, match="all 4 slots"):
        cache.add_request("f", [5])
    # unbind_rows keeps every slot, and lifts the limit.
    cache.unbind_rows()
    assert [cache.id_of(s) for s in range(4)] == ["a", "e", "c", "d"]
    assert cache.add_request("f", [5]) == (4, 0)
    with pytest.raises(ValueError, match="request 'f' holds slot 4, but the new tables have 4 rows"):
        cache.bind_rows(tables(4))
    cache.finish([4])
    cache.bind_rows(tables(4))
    cache.check_invariants()
