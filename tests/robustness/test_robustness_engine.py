"""Robustness sweep of the engine's public calls: every bad input or out-of-order call is refused
with the documented exception, which names the argument, leaves the cache unchanged, and is the
same (type and message) on the native engine and the pure-Python reference.

The token-level cache names its requests by slot (docs/requests-api.md, "Slots"): ``"a"`` is in
slot 0, ``7`` in slot 1 and slot 2 is free. The harness is in
``tests/support/robustness_cases.py``; what "unchanged" covers is listed there.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from flat_kvcache.errors import UnknownRequestError
from helpers import normalize
from hypothesis import given, settings
from hypothesis import strategies as st
from robustness_cases import (
    ENGINES,
    FREE_SLOT,
    HASH,
    LIVE_SLOTS,
    PAGE_LEVEL,
    SLOT_7,
    SLOT_A,
    TOKEN_LEVEL,
    Case,
    Refusal,
    busy_cache,
    busy_page_cache,
    check_agree,
    check_case,
    snapshot,
)

# --- int arguments ------------------------------------------------------------------------------

#: Bad values of an int argument: (id, value, exception for a count, exception for a token id).
BAD_INTS: list[tuple[str, object, type[BaseException], type[BaseException]]] = [
    ("2**64", 2**64, OverflowError, ValueError),
    ("2**200", 2**200, OverflowError, ValueError),
    ("-1", -1, ValueError, ValueError),
    ("np.int64(-1)", np.int64(-1), ValueError, ValueError),
    ("True", True, TypeError, TypeError),
    ("1.5", 1.5, TypeError, TypeError),
    ("np.float64(2.0)", np.float64(2.0), TypeError, TypeError),
    ("None", None, TypeError, TypeError),
    ("'3'", "3", TypeError, TypeError),
]


def _count_calls(v: object) -> dict[str, tuple[Any, str]]:
    """Every int (count) argument of the engine, given ``v``: the call and the argument's name."""
    return {
        "acquire": (lambda c: c.acquire(PAGE_LEVEL, v), "num_tokens"),
        "schedule": (lambda c: c.schedule([SLOT_7], [v]), "num_new_tokens[0]"),
        "schedule[1]": (lambda c: c.schedule([SLOT_7, SLOT_A], [0, v]), "num_new_tokens[1]"),
        "reserve": (lambda c: c.reserve([SLOT_A], [v]), "tokens[0]"),
        "reserve[1]": (lambda c: c.reserve([SLOT_A, SLOT_7], [1, v]), "tokens[1]"),
        "reclaim": (lambda c: c.reclaim(PAGE_LEVEL, v), "num_computed_tokens"),
        "pages_needed": (lambda c: c.pages_needed(v), "num_tokens"),
        "pages_needed(slot)": (lambda c: c.pages_needed(v, SLOT_A), "num_tokens"),
        "pages_needed(req)": (lambda c: c.pages_needed(v, PAGE_LEVEL), "num_tokens"),
        "pages_reclaimable": (lambda c: c.pages_reclaimable(PAGE_LEVEL, v), "num_computed_tokens"),
        "register.first_slot": (lambda c: c.register(PAGE_LEVEL, [HASH], first_slot=v), "first_slot"),
        "register.end_tokens": (lambda c: c.register(PAGE_LEVEL, [HASH], end_tokens=v), "end_tokens"),
        "schedule.lookahead": (lambda c: c.schedule([SLOT_7], [1], lookahead=v), "lookahead"),
        "pages_needed_to_admit.reserve_tokens": (
            lambda c: c.pages_needed_to_admit([1, 2, 3], 3, v),
            "reserve_tokens",
        ),
        "decode_step.first_page_slot": (lambda c: c.decode_step(PAGE_LEVEL, [], v, 1, 5), "first_page_slot"),
        "decode_step.num_tokens": (lambda c: c.decode_step(PAGE_LEVEL, [], 0, v, 5), "num_tokens"),
        "decode_step.num_computed_tokens": (
            lambda c: c.decode_step(PAGE_LEVEL, [], 0, 1, v),
            "num_computed_tokens",
        ),
        "prefill_chunk.num_tokens": (lambda c: c.prefill_chunk(PAGE_LEVEL, [], v, 5), "num_tokens"),
        "prefill_chunk.num_computed_tokens": (
            lambda c: c.prefill_chunk(PAGE_LEVEL, [], 1, v),
            "num_computed_tokens",
        ),
        "pages_needed_to_admit.num_new_tokens": (
            lambda c: c.pages_needed_to_admit([1, 2, 3], v),
            "num_new_tokens",
        ),
        "prefill_first_chunk.num_tokens": (
            lambda c: c.prefill_first_chunk("new", c.match_prefix([]), v),
            "num_tokens",
        ),
        "admit.max_new_tokens": (lambda c: c.admit("new", [1, 2, 3], v), "max_new_tokens"),
        "append_tokens.num_tokens[0]": (lambda c: c.append_tokens([SLOT_A], [1], [v]), "num_tokens[0]"),
        "append_tokens.num_tokens[1]": (
            lambda c: c.append_tokens([SLOT_A, SLOT_7], [1], [1, v]),
            "num_tokens[1]",
        ),
    }


#: Count arguments for which None is not a bad value: ``end_tokens`` is optional (None means
#: "state groups register nothing"). The ints with a default (``first_slot``, ``lookahead``,
#: ``reserve_tokens``) take it only when left out: an explicit None is refused.
_NONE_LEFT_OUT = frozenset({"register.end_tokens"})

#: The calls of :func:`_count_calls` that are page-level (run on a ``PageCache``).
_PAGE_LEVEL_COUNTS = frozenset(
    {
        "acquire",
        "reclaim",
        "pages_needed(req)",
        "pages_reclaimable",
        "register",
        "decode_step",
        "prefill_chunk",
        "prefill_first_chunk",
    }
)

COUNT_CASES = [
    pytest.param(
        Case(call, kind, name, page_level=where.split(".")[0] in _PAGE_LEVEL_COUNTS), id=f"{where}={label}"
    )
    for label, value, kind, _ in BAD_INTS
    for where, (call, name) in _count_calls(value).items()
    if not (value is None and where in _NONE_LEFT_OUT)
]


def _slot_calls(v: object) -> dict[str, tuple[Any, str]]:
    """Every slot argument of the token-level cache, given ``v``: the call and the name its
    messages use (a slot array's item is ``slots[i]``)."""
    return {
        "num_tokens": (lambda c: c.num_tokens(v), "slot"),
        "num_computed_tokens": (lambda c: c.num_computed_tokens(v), "slot"),
        "page_ids": (lambda c: c.page_ids(v), "slot"),
        "tail_available": (lambda c: c.tail_available(v), "slot"),
        "loads_in_flight": (lambda c: c.loads_in_flight(v), "slot"),
        "id_of": (lambda c: c.id_of(v), "slot"),
        "budget": (lambda c: c.budget(v), "slot"),
        "pages_needed": (lambda c: c.pages_needed(1, v), "slot"),
        "schedule": (lambda c: c.schedule([v], [1]), "slots[0]"),
        "schedule[1]": (lambda c: c.schedule([SLOT_A, v], [0, 1]), "slots[1]"),
        "append_tokens": (lambda c: c.append_tokens([v], [1]), "slots[0]"),
        "append_tokens[1]": (lambda c: c.append_tokens([SLOT_A, v], [1, 2]), "slots[1]"),
        "reserve": (lambda c: c.reserve([v], [1]), "slots[0]"),
        "finish": (lambda c: c.finish([v]), "slots[0]"),
        "finish[1]": (lambda c: c.finish([SLOT_7, v]), "slots[1]"),
        "preempt": (lambda c: c.preempt([v]), "slots[0]"),
        "block_tables": (lambda c: c.block_tables([SLOT_A, v]), "slots[1]"),
    }


#: Slot arguments for which None is an answer: the whole cache's budget, fresh tables' pages.
_SLOT_NONE_OK = frozenset({"budget", "pages_needed"})

SLOT_CASES = [
    pytest.param(Case(call, kind, name), id=f"{where}={label}")
    for label, value, kind, _ in BAD_INTS
    for where, (call, name) in _slot_calls(value).items()
    if not (value is None and where in _SLOT_NONE_OK)
]


@pytest.mark.parametrize("case", SLOT_CASES)
def test_bad_slot_is_refused(api: ModuleType, case: Case) -> None:
    """A bool, float, None or str slot is a TypeError, a negative one a ValueError, one past
    u64 an OverflowError, each naming ``slot`` or ``slots[i]`` (docs/requests-api.md)."""
    check_case(api, case)


@pytest.mark.parametrize("case", SLOT_CASES)
def test_bad_slot_same_error_on_both_engines(case: Case) -> None:
    check_agree(case)


def _token_calls(v: object) -> dict[str, tuple[Any, str]]:
    """Every token-list argument of the engine, with ``v`` as its second token."""
    return {
        "add_request": (lambda c: c.add_request("new", [1, v]), "prompt_token_ids[1]"),
        "admit": (lambda c: c.admit("new", [1, v], 2), "prompt_token_ids[1]"),
        "append_tokens": (lambda c: c.append_tokens([SLOT_A], [1, v], [2]), "token_ids[1]"),
        "append_tokens(one each)": (lambda c: c.append_tokens([SLOT_A, SLOT_7], [1, v]), "token_ids[1]"),
        "prefix_hit_tokens": (lambda c: c.prefix_hit_tokens([1, v]), "prompt_token_ids[1]"),
        "pages_needed_to_admit": (lambda c: c.pages_needed_to_admit([1, v], 1), "prompt_token_ids[1]"),
    }


TOKEN_CASES = [
    pytest.param(Case(call, kind, name), id=f"{where}={label}")
    for label, value, _, kind in BAD_INTS
    for where, (call, name) in _token_calls(value).items()
]


@pytest.mark.parametrize("case", COUNT_CASES + TOKEN_CASES)
def test_bad_int_is_refused(api: ModuleType, case: Case) -> None:
    check_case(api, case)


@pytest.mark.parametrize("case", COUNT_CASES + TOKEN_CASES)
def test_bad_int_same_error_on_both_engines(case: Case) -> None:
    check_agree(case)


def _new_cache(num_pages: object) -> Any:
    """A case call building a second cache of ``num_pages`` pages next to the busy one."""
    return lambda c: type(c)([_full_spec(c)], num_pages)


#: Bad pool sizes: the BAD_INTS and 0 (a pool holds page 0, so 0 and negatives are "< 1").
NUM_PAGES_CASES = [
    pytest.param(Case(_new_cache(value), kind, "num_pages"), id=f"num_pages={label}")
    for label, value, kind, _ in BAD_INTS
] + [
    pytest.param(Case(_new_cache(value), ValueError, "num_pages must be >= 1"), id=f"num_pages={value}")
    for value in (0, -1, -(2**70))
]


@pytest.mark.parametrize("case", NUM_PAGES_CASES)
def test_bad_num_pages_is_refused(api: ModuleType, case: Case) -> None:
    """The pool size of a new cache (the busy cache it is built next to stays unchanged)."""
    check_case(api, case)


@pytest.mark.parametrize("case", NUM_PAGES_CASES)
def test_bad_num_pages_same_error_on_both_engines(case: Case) -> None:
    check_agree(case)


# --- numpy arrays as tokens and counts ---------------------------------------------------------


def _array(values: list[int], dtype: npt.DTypeLike, *, readonly: bool = False) -> npt.NDArray[Any]:
    array = np.array(values, dtype=dtype)
    array.setflags(write=not readonly)
    return array


ARRAY_CASES = [
    pytest.param(
        Case(
            lambda c: c.add_request("n", np.array([1, 2**40], np.uint64)), ValueError, "prompt_token_ids[1]"
        ),
        id="tokens-u64-too-big",
    ),
    pytest.param(
        Case(lambda c: c.add_request("n", np.array([1, -3], np.int8)), ValueError, "prompt_token_ids[1]"),
        id="tokens-i8-negative",
    ),
    pytest.param(
        Case(lambda c: c.add_request("n", np.array([], np.int64)), ValueError, "prompt_token_ids"),
        id="tokens-empty",
    ),
    pytest.param(Case(lambda c: c.add_request("n", "abc"), TypeError, "prompt_token_ids"), id="tokens-str"),
    pytest.param(
        Case(lambda c: c.add_request("n", np.array([1.0, 2.0])), TypeError, "prompt_token_ids"),
        id="tokens-float-array",
    ),
    pytest.param(
        Case(lambda c: c.append_tokens([SLOT_A], np.array(1)), TypeError, "token_ids"), id="tokens-0-d"
    ),
    pytest.param(
        Case(lambda c: c.schedule([SLOT_7], np.zeros((1, 1), np.int64)), TypeError, "num_new_tokens"),
        id="counts-2-d",
    ),
    pytest.param(
        Case(lambda c: c.schedule(np.zeros((1, 1), np.int64), [1]), TypeError, "slots"),
        id="slots-2-d",
    ),
    pytest.param(
        Case(lambda c: c.finish(np.array([1.0])), TypeError, "slots"),
        id="slots-float-array",
    ),
    pytest.param(
        Case(lambda c: c.block_tables(np.array([True, False])), TypeError, "slots"),
        id="slots-bool-array",
    ),
    pytest.param(
        Case(lambda c: c.finish(np.array([0, -1], np.int8)), ValueError, "slots[1]"),
        id="slots-i8-negative",
    ),
    pytest.param(
        Case(
            lambda c: c.finish(np.array([2**63], np.uint64)),
            UnknownRequestError,
            "finish: slot 9223372036854775808 holds no request",
        ),
        id="slots-u64-past-i64",
    ),
    pytest.param(
        Case(lambda c: c.add_request("n", b"abc"), TypeError, "prompt_token_ids"), id="tokens-bytes"
    ),
    pytest.param(
        Case(
            lambda c: c.append_tokens([SLOT_A], np.array([2**33], np.int64)[::-1]), ValueError, "token_ids[0]"
        ),
        id="append-negative-stride-too-big",
    ),
    pytest.param(
        Case(
            lambda c: c.schedule([SLOT_7], [1, 1]),
            ValueError,
            "num_new_tokens has 2 entries but slots has 1",
        ),
        id="counts-longer-than-slots",
    ),
    pytest.param(
        Case(
            lambda c: c.schedule([SLOT_7, SLOT_A], [1]),
            ValueError,
            "num_new_tokens has 1 entries but slots has 2",
        ),
        id="counts-shorter-than-slots",
    ),
    pytest.param(
        Case(
            lambda c: c.schedule([SLOT_7, SLOT_A], np.array([1, -1], np.int8)),
            ValueError,
            "num_new_tokens[1]",
        ),
        id="counts-i8-negative",
    ),
    pytest.param(
        Case(
            lambda c: c.schedule([SLOT_7, SLOT_A], _array([5, 1], np.int32, readonly=True)[::-1]),
            ValueError,
            "num_new_tokens",
        ),
        id="counts-readonly-reversed-too-many",
    ),
    pytest.param(
        Case(lambda c: c.schedule([SLOT_7, SLOT_A], [1, 5]), ValueError, "request 'a' (slot 0)"),
        id="counts-more-than-known-second",
    ),
    pytest.param(
        Case(lambda c: c.schedule([SLOT_7, SLOT_A], [1, 5]), ValueError, "num_new_tokens"),
        id="counts-more-than-known-names-the-argument",
    ),
    pytest.param(
        Case(lambda c: c.schedule([SLOT_7, SLOT_7], [3, 4]), ValueError, "request 7 (slot 1)"),
        id="counts-repeated-slot-add-up",
    ),
    pytest.param(
        Case(lambda c: c.schedule([SLOT_A], [0], lookahead=2**64 - 1), OverflowError, "lookahead"),
        id="lookahead-sum-past-u64",
    ),
    pytest.param(
        Case(lambda c: c.append_tokens([SLOT_A, SLOT_7], [1, 2, 3]), ValueError, "token_ids"),
        id="batch-tokens-without-counts",
    ),
    pytest.param(
        Case(
            lambda c: c.append_tokens([SLOT_A, SLOT_7], [1, 2, 3], np.array([1, 1], np.uint8)),
            ValueError,
            "num_tokens",
        ),
        id="batch-counts-do-not-add-up",
    ),
    pytest.param(
        Case(lambda c: c.append_tokens([SLOT_A, SLOT_7], [1, 2], [2]), ValueError, "num_tokens"),
        id="batch-counts-shorter-than-slots",
    ),
    pytest.param(
        Case(lambda c: c.append_tokens([SLOT_A, SLOT_7], [1], [2**64 - 1, 2]), OverflowError, ""),
        id="batch-counts-sum-past-u64",
    ),
    pytest.param(
        Case(lambda c: c.append_tokens([SLOT_A, FREE_SLOT], [1, -1]), ValueError, "token_ids[1]"),
        id="token-values-before-held-slots",
    ),
    pytest.param(
        Case(lambda c: c.append_tokens([SLOT_A, FREE_SLOT], [1]), ValueError, "token_ids"),
        id="lengths-before-held-slots",
    ),
    pytest.param(
        Case(lambda c: c.append_tokens([SLOT_A, -1], [1, -1]), ValueError, "slots[1]"),
        id="slot-values-before-token-values",
    ),
    pytest.param(
        Case(lambda c: c.append_tokens([SLOT_A, SLOT_7], [-1, 1], [1, -1]), ValueError, "token_ids[0]"),
        id="token-values-before-counts",
    ),
    pytest.param(
        Case(lambda c: c.reserve([SLOT_A, SLOT_7], [1]), ValueError, "tokens"),
        id="reserve-counts-shorter-than-slots",
    ),
]


def test_lookahead_is_room_past_the_known_tokens(api: ModuleType) -> None:
    """``lookahead`` takes room for tokens not known yet (docs/requests-api.md ``schedule``): it
    is not compared with the known tokens, so scheduling every known token plus a lookahead
    succeeds, moves the position by the scheduled tokens only, and holds pages for the rest."""
    cache = api.FlatKVCache([api.KVCacheSpec("full", 4)], 16)
    slot, _ = cache.add_request("a", list(range(6)))
    assert cache.schedule([slot], [6], lookahead=3).tolist() == [True]
    assert cache.num_computed_tokens(slot) == 6
    assert len(cache.page_ids(slot)[0]) == 3  # ceil((6 + 3) / 4) pages


@pytest.mark.parametrize("case", ARRAY_CASES)
def test_bad_array_is_refused(api: ModuleType, case: Case) -> None:
    check_case(api, case)


@pytest.mark.parametrize("case", ARRAY_CASES)
def test_bad_array_same_error_on_both_engines(case: Case) -> None:
    check_agree(case)


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: _array(list(range(9)), np.int64, readonly=True), id="readonly"),
        pytest.param(lambda: np.arange(9, dtype=np.int32)[::-1][::-1], id="double-reversed"),
        pytest.param(lambda: np.arange(18, dtype=np.uint16)[::2] // 2, id="strided-copy"),
        pytest.param(lambda: np.arange(18, dtype=np.int64)[::2][:9], id="strided-view"),
    ],
)
def test_any_layout_of_an_int_array_is_read(api: ModuleType, make: Any) -> None:
    """Read-only and strided arrays are inputs like any other: read, never written, same result
    as the list of their values (checked against a second cache given the list)."""
    tokens = make()
    before = tokens.copy()
    cache, twin = busy_cache(api), busy_cache(api)
    added = cache.add_request("n", tokens)
    assert added == twin.add_request("n", tokens.tolist()) == (FREE_SLOT, 0)
    slots = _array([FREE_SLOT], np.int64, readonly=True)
    counts = _array([len(tokens)], np.int64, readonly=True)
    assert cache.schedule(slots, counts).tolist() == twin.schedule([FREE_SLOT], [len(tokens)]).tolist()
    assert cache.page_ids(FREE_SLOT) == twin.page_ids(FREE_SLOT)
    assert cache.stats() == twin.stats()
    np.testing.assert_array_equal(tokens, before)


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda s: list(s), id="list"),
        pytest.param(lambda s: tuple(s), id="tuple"),
        pytest.param(lambda s: [np.uint8(v) for v in s], id="list-of-np-uint8"),
        pytest.param(lambda s: [np.int64(v) for v in s], id="list-of-np-int64"),
        pytest.param(lambda s: np.array(s, np.int8), id="int8"),
        pytest.param(lambda s: np.array(s, np.uint16), id="uint16"),
        pytest.param(lambda s: np.array(s, np.int32), id="int32"),
        pytest.param(lambda s: np.array(s, np.uint32), id="uint32"),
        pytest.param(lambda s: np.array(s, np.uint64), id="uint64"),
        pytest.param(lambda s: np.array(s, ">i8"), id="big-endian"),
        pytest.param(lambda s: np.repeat(np.array(s, np.int64), 2)[::2], id="strided"),
        pytest.param(lambda s: np.array(s[::-1], np.int64)[::-1], id="reversed-view"),
    ],
)
def test_every_form_of_a_slot_array_names_the_same_slots(api: ModuleType, make: Any) -> None:
    """A slot array is a sequence of ints or numpy integers, or a 1-D integer array of any
    dtype, byte order and stride: every per-step call reads the same slots from each form."""
    slots = [SLOT_7, SLOT_A]
    cache, twin = busy_cache(api), busy_cache(api)

    def steps(c: Any, form: Any) -> object:
        c.append_tokens(form, [5, 6])
        c.reserve(form, [1, 3])
        done = c.schedule(form, [6, 0]).tolist()
        tables = {g: t.tolist() for g, t in c.block_tables(form).items()}
        return done, tables, c.budget(), c.preempt(form)

    assert steps(cache, make(slots)) == steps(twin, slots)
    assert snapshot(cache) == snapshot(twin)
    cache.check_invariants()


def test_reversed_tokens_are_read_in_reversed_order(api: ModuleType) -> None:
    """A negative stride is honoured: the reversed view hashes like the reversed list."""
    cache = busy_cache(api)
    forward = np.arange(1000, 1013, dtype=np.int64)
    assert cache.add_request("n", forward[::-1]) == (FREE_SLOT, 0)
    assert cache.schedule([FREE_SLOT], [13]).tolist() == [True]
    cache.finish([FREE_SLOT])
    assert cache.prefix_hit_tokens(list(range(1012, 999, -1))) == 12
    assert cache.prefix_hit_tokens(forward) == 0


# --- block_tables(out=) ------------------------------------------------------------------------


def _buffer(rows: int = 3, cols: int = 8, dtype: npt.DTypeLike = np.int32) -> npt.NDArray[Any]:
    return np.zeros((rows, cols), dtype=dtype)


def _readonly(array: npt.NDArray[Any]) -> npt.NDArray[Any]:
    array.setflags(write=False)
    return array


def _tables(out: Any) -> Any:
    return lambda c: c.block_tables(list(LIVE_SLOTS), out=out)


def _shared(make: Any) -> Any:
    """``block_tables`` with ``out`` built from one fresh array per call (two views of it)."""
    return lambda c: c.block_tables(list(LIVE_SLOTS), out=make(_buffer(6, 16)))


OUT_CASES = [
    pytest.param(
        Case(_tables({"full": _buffer(1), "swa": _buffer(1)}), ValueError, "out['full']"), id="too-few-rows"
    ),
    pytest.param(
        Case(_tables({"full": _buffer(3, 2), "swa": _buffer()}), ValueError, "out['full']"), id="too-few-cols"
    ),
    pytest.param(
        Case(_tables({"full": _buffer(), "swa": _buffer(3, 0)}), ValueError, "out['swa']"),
        id="zero-cols-second-group",
    ),
    pytest.param(
        Case(_tables({"full": _buffer(dtype=np.int64), "swa": _buffer()}), TypeError, "out['full']"),
        id="int64",
    ),
    pytest.param(
        Case(_tables({"full": _buffer(), "swa": _buffer(dtype=np.uint32)}), TypeError, "out['swa']"),
        id="uint32",
    ),
    pytest.param(
        Case(_tables({"full": _buffer(dtype=np.float32), "swa": _buffer()}), TypeError, "out['full']"),
        id="float32",
    ),
    pytest.param(
        Case(_tables({"full": _readonly(_buffer()), "swa": _buffer()}), ValueError, "out['full']"),
        id="readonly",
    ),
    pytest.param(
        Case(_tables({"full": _buffer(3, 16)[:, ::2], "swa": _buffer()}), ValueError, "out['full']"),
        id="column-stride",
    ),
    pytest.param(
        Case(_tables({"full": _buffer(6)[::2], "swa": _buffer()}), ValueError, "out['full']"), id="row-stride"
    ),
    pytest.param(
        Case(_tables({"full": _buffer(6)[::-1], "swa": _buffer()}), ValueError, "out['full']"),
        id="reversed-rows",
    ),
    pytest.param(
        Case(_tables({"full": np.asfortranarray(_buffer()), "swa": _buffer()}), ValueError, "out['full']"),
        id="fortran-order",
    ),
    pytest.param(
        Case(_tables({"full": np.zeros(8, np.int32), "swa": _buffer()}), ValueError, "out['full']"), id="1-d"
    ),
    pytest.param(
        Case(_tables({"full": np.zeros((1, 3, 8), np.int32), "swa": _buffer()}), ValueError, "out['full']"),
        id="3-d",
    ),
    pytest.param(
        Case(_tables({"full": np.zeros((), np.int32), "swa": _buffer()}), ValueError, "out['full']"), id="0-d"
    ),
    pytest.param(Case(_tables({"full": _buffer()}), ValueError, "'swa'"), id="missing-group"),
    pytest.param(
        Case(_tables({"full": [[0] * 8] * 3, "swa": _buffer()}), TypeError, "out['full']"), id="nested-list"
    ),
    pytest.param(Case(_tables([_buffer(), _buffer()]), TypeError, "out"), id="not-a-mapping"),
    pytest.param(
        Case(_tables({"full": _buffer(), "swa": _buffer(), "x": _buffer()}), ValueError, "out['x']"),
        id="unknown-group",
    ),
    pytest.param(
        Case(_tables({"full": _buffer(), "swa": _buffer(), 0: _buffer()}), ValueError, "out[0]"),
        id="non-str-key",
    ),
    pytest.param(
        Case(_shared(lambda b: {"full": b[:, :8], "swa": b[:, 8:]}), ValueError, "out['full']"),
        id="column-halves-of-one-array",
    ),
]


@pytest.mark.parametrize("case", OUT_CASES)
def test_bad_out_buffer_is_refused(api: ModuleType, case: Case) -> None:
    check_case(api, case)


@pytest.mark.parametrize("case", OUT_CASES)
def test_bad_out_buffer_same_error_on_both_engines(case: Case) -> None:
    check_agree(case)


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda b: {"full": b, "swa": b}, id="same-array"),
        pytest.param(lambda b: {"full": b[:3], "swa": b[2:5]}, id="overlapping-rows"),
        pytest.param(lambda b: {"full": b[:3], "swa": b[:3]}, id="equal-views"),
    ],
)
def test_overlapping_out_buffers_are_refused(make: Any) -> None:
    """Two groups writing into the same memory would overwrite each other's tables: refused
    alike by both engines, before anything is written."""
    got = []
    for api in ENGINES:
        buffer = _buffer(6, 16)
        got.append(check_case(api, Case(_tables(make(buffer)), ValueError, "out['swa']")))
        assert not buffer.any(), "nothing may be written when the call is refused"
    native, reference = got
    assert native == reference
    assert "shares its memory" in native.message


def test_a_buffer_under_an_unknown_key_is_not_written(api: ModuleType) -> None:
    """The unknown key is found after the group buffers are checked, but before any is written."""
    cache = busy_cache(api)
    full, swa = _buffer(), _buffer()
    with pytest.raises(ValueError, match=r"out\['full '\] is not a group"):
        cache.block_tables(list(LIVE_SLOTS), out={"full": full, "swa": swa, "full ": _buffer()})
    assert not full.any() and not swa.any()


def test_disjoint_row_blocks_of_one_array_are_fine(api: ModuleType) -> None:
    """Non-overlapping row blocks of one array are separate buffers: written like fresh ones."""
    cache = busy_cache(api)
    buffer = _buffer(6)
    out = cache.block_tables(list(LIVE_SLOTS), out={"full": buffer[:3], "swa": buffer[3:]})
    assert out["full"] is not None
    expected = cache.block_tables(list(LIVE_SLOTS))
    rows = len(LIVE_SLOTS)
    for group, table in expected.items():
        np.testing.assert_array_equal(out[group][:rows, : table.shape[1]], table)
        assert (out[group][:rows, table.shape[1] :] == -1).all()
        assert (out[group][rows:] == 0).all()  # rows past len(slots) are untouched


# --- text, bytes and masked arrays are never batches (docs/engine-api.md, "Odd inputs") --------

#: One batch argument per kind: (call given the value, argument name, what its items are).
_BATCHES: dict[str, tuple[Any, str, str]] = {
    "schedule.slots": (lambda c, v: c.schedule(v, [1]), "slots", "ints or a 1-D integer array"),
    "append_tokens.slots": (lambda c, v: c.append_tokens(v, [1]), "slots", "ints or a 1-D integer array"),
    "reserve.slots": (lambda c, v: c.reserve(v, [1]), "slots", "ints or a 1-D integer array"),
    "finish.slots": (lambda c, v: c.finish(v), "slots", "ints or a 1-D integer array"),
    "preempt.slots": (lambda c, v: c.preempt(v), "slots", "ints or a 1-D integer array"),
    "block_tables.slots": (lambda c, v: c.block_tables(v), "slots", "ints or a 1-D integer array"),
    "schedule.num_new_tokens": (
        lambda c, v: c.schedule([SLOT_A], v),
        "num_new_tokens",
        "ints or a 1-D integer array",
    ),
    "append_tokens.token_ids": (
        lambda c, v: c.append_tokens([SLOT_A], v),
        "token_ids",
        "ints or a 1-D integer array",
    ),
    "append_tokens.num_tokens": (
        lambda c, v: c.append_tokens([SLOT_A], [1], v),
        "num_tokens",
        "ints or a 1-D integer array",
    ),
    "reserve.tokens": (lambda c, v: c.reserve([SLOT_A], v), "tokens", "ints or a 1-D integer array"),
    "add_request.prompt_token_ids": (
        lambda c, v: c.add_request("n", v),
        "prompt_token_ids",
        "ints or a 1-D integer array",
    ),
    "ack_transfers.ids": (lambda c, v: c.ack_transfers(v), "ids", "ints or a 1-D integer array"),
    "match_prefix.content_hashes": (lambda c, v: c.match_prefix(v), "content_hashes", "str or bytes"),
    "PageCache.block_tables.reqs": (lambda c, v: c.block_tables(v), "reqs", "request ids"),
    "add_request.extra_keys": (lambda c, v: c.add_request("n", [1], extra_keys=v), "extra_keys", "str"),
}

#: The :data:`_BATCHES` run on a ``PageCache``.
_PAGE_LEVEL_BATCHES = frozenset({"match_prefix.content_hashes", "PageCache.block_tables.reqs"})

#: Text and bytes that would iterate as characters or byte values (b"a" as the id or token 97).
_TEXT_OR_BYTES = {
    "str": "ab",
    "bytes": b"a",
    "bytearray": bytearray(b"\x01"),
    "memoryview": memoryview(b"\x01"),
}


@pytest.mark.parametrize("value", list(_TEXT_OR_BYTES))
@pytest.mark.parametrize("where", list(_BATCHES))
def test_text_or_bytes_is_never_a_batch(api: ModuleType, where: str, value: str) -> None:
    call, name, what = _BATCHES[where]
    page_level = where in _PAGE_LEVEL_BATCHES
    got = check_case(
        api, Case(lambda c: call(c, _TEXT_OR_BYTES[value]), TypeError, name, page_level=page_level)
    )
    assert got == Refusal(TypeError, f"{name} must be a sequence of {what}, got {value}")


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: np.ma.array([1, 2], mask=[False, True]), id="one-masked"),
        pytest.param(lambda: np.ma.array(np.arange(5, dtype=np.uint32)), id="nothing-masked-u32"),
        pytest.param(lambda: np.ma.zeros((2, 2), np.int64), id="2-D"),
    ],
)
@pytest.mark.parametrize("where", [w for w, (_, _, what) in _BATCHES.items() if what != "str"])
def test_a_masked_array_is_refused(api: ModuleType, where: str, make: Any) -> None:
    """The mask would be ignored (native read the data, the masked values included)."""
    call, name, _ = _BATCHES[where]
    page_level = where in _PAGE_LEVEL_BATCHES
    got = check_case(api, Case(lambda c: call(c, make()), TypeError, name, page_level=page_level))
    assert got == Refusal(TypeError, f"{name} must not be a masked array (its mask would be ignored)")


def test_a_masked_prompt_is_refused_after_the_same_prompt_unmasked(api: ModuleType) -> None:
    """A masked u32 prompt equal to the prompt just hashed is refused too (not recalled)."""
    cache = busy_cache(api)
    prompt = np.arange(20, dtype=np.uint32)
    cache.prefix_hit_tokens(prompt)  # hashed and remembered
    with pytest.raises(TypeError, match="prompt_token_ids must not be a masked array"):
        cache.add_request("n", np.ma.array(prompt, mask=[False] * 19 + [True]))
    assert cache.slot_of("n") is None


# --- request ids and slots ----------------------------------------------------------------------


def _add(rid: object) -> Any:
    """``add_request(rid, [1, 2])`` as a case call."""
    return lambda c: c.add_request(rid, [1, 2])


ID_CASES = [
    pytest.param(Case(_add(rid), TypeError, "request ids"), id=f"add-{label}")
    for label, rid in [("bytes", b"a"), ("tuple", ("a",)), ("float", 1.0), ("bool", True), ("None", None)]
] + [
    pytest.param(Case(call, kind, name), id=label)
    for label, call, kind, name in [
        ("finish-7.0", lambda c: c.finish([7.0]), TypeError, "slots[0]"),
        ("finish-True", lambda c: c.finish([True]), TypeError, "slots[0]"),
        ("finish-an-id", lambda c: c.finish(["a"]), TypeError, "slots[0]"),
        ("finish-bare-int", lambda c: c.finish(SLOT_7), TypeError, "slots"),
        ("page_ids-bytes", lambda c: c.page_ids(b"a"), TypeError, "slot"),
        ("page_ids-an-id", lambda c: c.page_ids("a"), TypeError, "slot"),
        ("num_tokens-list", lambda c: c.num_tokens([SLOT_A]), TypeError, "slot"),
        ("schedule-an-id", lambda c: c.schedule(("a",), [1]), TypeError, "slots[0]"),
        ("schedule-float-second", lambda c: c.schedule([SLOT_A, 1.0], [0, 1]), TypeError, "slots[1]"),
        ("slot_of-bytes", lambda c: c.slot_of(b"a"), TypeError, "request ids"),
        ("slot_of-float", lambda c: c.slot_of(7.0), TypeError, "request ids"),
        (
            "add-existing-str",
            lambda c: c.add_request("a", [1, 2]),
            ValueError,
            "add_request: request 'a' already exists",
        ),
        (
            "add-existing-int",
            lambda c: c.add_request(7, [1, 2]),
            ValueError,
            "add_request: request 7 already exists",
        ),
        (
            "add-existing-np-int",
            lambda c: c.add_request(np.int64(7), [1, 2]),
            ValueError,
            "add_request: request 7 already exists",
        ),
        ("admit-existing-str", lambda c: c.admit("a", [1, 2], 1), ValueError, "request 'a' already exists"),
        ("admit-existing-int", lambda c: c.admit(7, [1, 2], 1), ValueError, "request 7 already exists"),
        ("admit-bytes", lambda c: c.admit(b"a", [1, 2], 1), TypeError, "request ids"),
        ("admit-empty-prompt", lambda c: c.admit("new", [], 1), ValueError, "prompt_token_ids"),
        (
            "admit-use_prefix_cache-int",
            lambda c: c.admit("new", [1], 1, use_prefix_cache=1),
            TypeError,
            "use_prefix_cache",
        ),
        ("block_tables-bare-str", lambda c: c.block_tables("a"), TypeError, "slots"),
        ("block_tables-bare-int", lambda c: c.block_tables(SLOT_A), TypeError, "slots"),
    ]
]


@pytest.mark.parametrize("case", ID_CASES)
def test_bad_request_id_is_refused(api: ModuleType, case: Case) -> None:
    check_case(api, case)


@pytest.mark.parametrize("case", ID_CASES)
def test_bad_request_id_same_error_on_both_engines(case: Case) -> None:
    check_agree(case)


@settings(max_examples=60, deadline=None)
@given(st.text(st.characters(blacklist_categories=("Cn", "Cs")), max_size=12))
def test_str_ids_are_quoted_as_python_repr_on_both_engines(rid: str) -> None:
    """Ids of any text (quotes, backslashes, control and non-ASCII characters) are shown the
    way Python's ``repr`` shows them, by both engines: in the token-level cache's messages
    (``request 'a' (slot 0)``, an id already in use) and the page-level cache's unknown id.

    Characters this Python's Unicode database does not assign (Cn) are left out: the native
    engine's table may be newer and print a character that ``repr`` escapes here."""
    messages = []
    for api in ENGINES:
        cache = api.FlatKVCache([api.KVCacheSpec("full", 4)], 8)
        assert tuple(cache.add_request(rid, [1, 2, 3])) == (0, 0)
        assert cache.slot_of(rid) == 0 and cache.id_of(0) == rid
        with pytest.raises(ValueError) as exists:
            cache.add_request(rid, [1])
        with pytest.raises(ValueError) as too_many:
            cache.schedule([0], [4])
        page_cache = api.PageCache([api.KVCacheSpec("full", 4)], 8)
        with pytest.raises(UnknownRequestError) as unknown:
            page_cache.free(rid)
        messages.append((str(exists.value), str(too_many.value), unknown.value.args[0]))
    assert messages[0] == messages[1]
    exists_message, too_many_message, unknown_message = messages[0]
    assert exists_message == f"add_request: request {rid!r} already exists"
    assert f"request {rid!r} (slot 0)" in too_many_message
    assert unknown_message == f"unknown request id {rid!r}"


def test_int_and_str_ids_are_distinct(api: ModuleType) -> None:
    """``7`` and ``"7"`` are two requests; ``np.int64(8)`` is the int 8; ids of any size work.
    Each gets the lowest free slot, and ``slot_of`` / ``id_of`` map between them."""
    cache = busy_cache(api)
    assert cache.add_request("7", [1, 2, 3]) == (2, 0)
    assert cache.add_request(np.int64(8), [4, 5]) == (3, 0)
    assert cache.add_request(-(2**70), [6]) == (4, 0)
    assert cache.slot_of(7) == SLOT_7 and cache.slot_of("7") == 2 and cache.slot_of(8) == 3
    assert cache.slot_of(np.int64(8)) == 3 and cache.slot_of("8") is None
    assert cache.slot_of(-(2**70)) == 4 and cache.slot_of(str(-(2**70))) is None
    assert cache.num_tokens(SLOT_7) == 6 and cache.num_tokens(2) == 3 and cache.num_tokens(3) == 2
    ids = [cache.id_of(s) for s in range(5)]
    assert ids == ["a", 7, "7", 8, -(2**70)]
    assert [type(i) for i in ids] == [str, int, str, int, int]
    cache.finish([2])
    assert cache.slot_of("7") is None and cache.slot_of(7) == SLOT_7
    with pytest.raises(UnknownRequestError) as caught:
        cache.id_of(2)
    assert caught.value.args == ("id_of: slot 2 holds no request",)
    cache.check_invariants()


def test_slots_are_the_lowest_free_and_reused_at_once(api: ModuleType) -> None:
    """The slot is the lowest one no live request holds; ``finish`` and ``preempt`` free it
    for the next ``add_request`` / ``admit`` (docs/requests-api.md, "Slots")."""
    cache = busy_cache(api)
    assert cache.add_request("x", [1, 2, 3]) == (2, 0)
    cache.finish([SLOT_A])
    assert cache.slot_of("a") is None
    assert cache.add_request("y", [9]) == (0, 0)
    assert cache.preempt([SLOT_7]) == [list(range(100, 106))]
    assert cache.slot_of(7) is None
    slot, hit, chunk = cache.admit("z", [4, 4, 4, 4, 4], 3)
    assert (slot, hit, chunk) == (1, 0, 3)
    assert cache.add_request("w", [5]) == (3, 0)
    assert [cache.id_of(s) for s in range(4)] == ["y", "z", "x", "w"]
    assert cache.num_requests == 4
    cache.finish([0, 1, 2, 3])
    assert cache.num_requests == 0
    assert cache.add_request("a", [1]) == (0, 0)
    cache.check_invariants()


def test_results_have_the_documented_types(api: ModuleType) -> None:
    """``add_request`` gives a ``(slot, hit)`` tuple, ``admit`` a ``(slot, hit, chunk)`` one,
    ``schedule`` a numpy bool array with one entry per slot, ``preempt`` one token list per
    slot, in order; ``finish``, ``append_tokens`` and ``reserve`` return None."""
    cache = busy_cache(api)
    added = cache.add_request("n", list(range(10)))
    assert type(added) is tuple and added == (FREE_SLOT, 0)  # "a" registered nothing yet
    assert all(type(v) is int for v in added)
    admitted = cache.admit("m", [50, 51, 52], 2)
    assert type(admitted) is tuple and admitted == (3, 0, 2)
    assert all(type(v) is int for v in admitted)
    done = cache.schedule([FREE_SLOT, SLOT_7, FREE_SLOT], [1, 6, 0])
    assert isinstance(done, np.ndarray) and done.dtype == np.bool_ and done.shape == (3,)
    assert done.tolist() == [True, True, True]
    assert cache.append_tokens([SLOT_7], [9]) is None
    assert cache.reserve([SLOT_7], [1]) is None
    assert type(cache.slot_of("n")) is int and cache.slot_of("missing") is None
    assert cache.preempt([SLOT_7, SLOT_A]) == [[*range(100, 106), 9], [*range(10), 3]]
    assert cache.finish([FREE_SLOT]) is None
    assert cache.num_requests == 1
    cache.check_invariants()


def test_a_failed_schedule_changes_no_position(api: ModuleType) -> None:
    """``schedule`` answers False for a slot it cannot give room and moves only the others;
    the result has one entry per slot, in order."""
    cache = api.FlatKVCache([api.KVCacheSpec("full", 4)], 4)  # 3 real pages
    assert cache.add_request("big", list(range(20))) == (0, 0)
    assert cache.add_request("small", [1, 2]) == (1, 0)
    done = cache.schedule([0, 1], [20, 2])
    assert done.tolist() == [False, True]
    assert cache.num_computed_tokens(0) == 0 and cache.num_computed_tokens(1) == 2
    cache.check_invariants()


# --- calls out of order --------------------------------------------------------------------------

#: The calls of ``ORDER_CASES`` that are page-level (run on a ``PageCache``).
_PAGE_LEVEL_ORDER = frozenset(
    {
        "free-twice",
        "register-unknown",
        "reclaim-unknown",
        "free-unknown",
        "page_ids-unknown-id",
        "tail-unknown-id",
        "pages_needed-unknown-id",
        "decode_step-unknown",
        "prefill_chunk-unknown",
        "register-bad-hash",
        "claim-holding-pages",
        "prefill_first_chunk-holding-pages",
    }
)


def _held(method: str, slot: int) -> str:
    """The message of a slot that holds no request."""
    return f"{method}: slot {slot} holds no request"


def _bind(rows: int) -> Any:
    """A setup binding persistent tables of ``rows`` rows."""
    return lambda c: c.bind_rows(
        {"full": np.zeros((rows, 8), np.int32), "swa": np.zeros((rows, 3), np.int32)}
    )


ORDER_CASES = [
    pytest.param(Case(call, kind, name, setup, page_level=label in _PAGE_LEVEL_ORDER), id=label)
    for label, setup, call, kind, name in [
        (
            "schedule-free-slot",
            None,
            lambda c: c.schedule([FREE_SLOT], [1]),
            UnknownRequestError,
            _held("schedule", 2),
        ),
        (
            "schedule-free-slot-second",
            None,
            lambda c: c.schedule([SLOT_7, FREE_SLOT], [1, 1]),
            UnknownRequestError,
            _held("schedule", 2),
        ),
        (
            "append-free-slot",
            None,
            lambda c: c.append_tokens([FREE_SLOT], [1]),
            UnknownRequestError,
            _held("append_tokens", 2),
        ),
        (
            "reserve-free-slot",
            None,
            lambda c: c.reserve([FREE_SLOT], [1]),
            UnknownRequestError,
            _held("reserve", 2),
        ),
        ("budget-free-slot", None, lambda c: c.budget(FREE_SLOT), UnknownRequestError, _held("budget", 2)),
        (
            "pages_needed-free-slot",
            None,
            lambda c: c.pages_needed(1, FREE_SLOT),
            UnknownRequestError,
            _held("pages_needed", 2),
        ),
        (
            "page_ids-free-slot",
            None,
            lambda c: c.page_ids(FREE_SLOT),
            UnknownRequestError,
            _held("page_ids", 2),
        ),
        (
            "tail-free-slot",
            None,
            lambda c: c.tail_available(FREE_SLOT),
            UnknownRequestError,
            _held("tail_available", 2),
        ),
        (
            "num_tokens-free-slot",
            None,
            lambda c: c.num_tokens(FREE_SLOT),
            UnknownRequestError,
            _held("num_tokens", 2),
        ),
        (
            "num_computed-free-slot",
            None,
            lambda c: c.num_computed_tokens(FREE_SLOT),
            UnknownRequestError,
            _held("num_computed_tokens", 2),
        ),
        (
            "loads-free-slot",
            None,
            lambda c: c.loads_in_flight(FREE_SLOT),
            UnknownRequestError,
            _held("loads_in_flight", 2),
        ),
        ("id_of-free-slot", None, lambda c: c.id_of(FREE_SLOT), UnknownRequestError, _held("id_of", 2)),
        (
            "num_tokens-u64-max",
            None,
            lambda c: c.num_tokens(2**64 - 1),
            UnknownRequestError,
            _held("num_tokens", 2**64 - 1),
        ),
        (
            "finish-twice",
            lambda c: c.finish([SLOT_7]),
            lambda c: c.finish([SLOT_7]),
            UnknownRequestError,
            _held("finish", 1),
        ),
        (
            "preempt-twice",
            lambda c: c.preempt([SLOT_7]),
            lambda c: c.preempt([SLOT_7]),
            UnknownRequestError,
            _held("preempt", 1),
        ),
        (
            "preempt-free-slot",
            None,
            lambda c: c.preempt([FREE_SLOT]),
            UnknownRequestError,
            _held("preempt", 2),
        ),
        (
            "preempt-free-slot-second",
            None,
            lambda c: c.preempt([SLOT_A, FREE_SLOT]),
            UnknownRequestError,
            _held("preempt", 2),
        ),
        (
            "finish-free-slot-second",
            None,
            lambda c: c.finish([SLOT_A, FREE_SLOT]),
            UnknownRequestError,
            _held("finish", 2),
        ),
        (
            "finish-listed-twice",
            None,
            lambda c: c.finish([SLOT_7, SLOT_A, SLOT_7]),
            ValueError,
            "finish: slot 1 is listed twice",
        ),
        (
            "schedule-finished",
            lambda c: c.finish([SLOT_7]),
            lambda c: c.schedule([SLOT_7], [1]),
            UnknownRequestError,
            _held("schedule", 1),
        ),
        (
            "append-finished",
            lambda c: c.finish([SLOT_A]),
            lambda c: c.append_tokens([SLOT_A], [1]),
            UnknownRequestError,
            _held("append_tokens", 0),
        ),
        (
            "block_tables-finished",
            lambda c: c.finish([SLOT_7]),
            lambda c: c.block_tables([SLOT_A, SLOT_7]),
            UnknownRequestError,
            _held("block_tables", 1),
        ),
        (
            "block_tables-out-free-slot",
            None,
            lambda c: c.block_tables(
                [SLOT_A, FREE_SLOT],
                out={"full": np.zeros((2, 8), np.int32), "swa": np.zeros((2, 8), np.int32)},
            ),
            UnknownRequestError,
            _held("block_tables", 2),
        ),
        ("schedule-more-than-known", None, lambda c: c.schedule([SLOT_7], [7]), ValueError, "num_new_tokens"),
        (
            "schedule-more-than-known-names-request",
            None,
            lambda c: c.schedule([SLOT_7], [7]),
            ValueError,
            "request 7 (slot 1)",
        ),
        (
            "add-all-bound-slots-held",
            _bind(2),
            lambda c: c.add_request("n", [1, 2]),
            ValueError,
            "add_request: all 2 slots of the bound rows are held (finish a request or bind more rows)",
        ),
        (
            "bind-fewer-rows-than-a-slot",
            None,
            _bind(1),
            ValueError,
            "bind_rows: request 7 holds slot 1, but the new tables have 1 rows",
        ),
        (
            "bind-fewer-rows-names-the-lowest-slot",
            lambda c: c.add_request("x", [1]),
            _bind(1),
            ValueError,
            "bind_rows: request 7 holds slot 1, but the new tables have 1 rows",
        ),
        ("register-unknown", None, lambda c: c.register("new", [HASH]), UnknownRequestError, "'new'"),
        ("reclaim-unknown", None, lambda c: c.reclaim("new", 1), UnknownRequestError, "'new'"),
        (
            "free-twice",
            lambda c: c.free(PAGE_LEVEL),
            lambda c: c.free(PAGE_LEVEL),
            UnknownRequestError,
            "'p'",
        ),
        ("free-unknown", None, lambda c: c.free("new"), UnknownRequestError, "'new'"),
        ("page_ids-unknown-id", None, lambda c: c.page_ids("new"), UnknownRequestError, "'new'"),
        ("tail-unknown-id", None, lambda c: c.tail_available("new"), UnknownRequestError, "'new'"),
        ("pages_needed-unknown-id", None, lambda c: c.pages_needed(1, "new"), UnknownRequestError, "'new'"),
        (
            "decode_step-unknown",
            None,
            lambda c: c.decode_step("new", [], 0, 1, 1),
            UnknownRequestError,
            "'new'",
        ),
        (
            "prefill_chunk-unknown",
            None,
            lambda c: c.prefill_chunk("new", [], 1, 1),
            UnknownRequestError,
            "'new'",
        ),
        (
            "register-bad-hash",
            None,
            lambda c: c.register(PAGE_LEVEL, ["XYZ"]),
            ValueError,
            "content_hashes[0]",
        ),
        (
            "claim-holding-pages",
            None,
            lambda c: c.claim(PAGE_LEVEL, c.match_prefix([])),
            ValueError,
            "claim: request 'p' already holds pages",
        ),
        (
            "prefill_first_chunk-holding-pages",
            None,
            lambda c: c.prefill_first_chunk(PAGE_LEVEL, c.match_prefix([]), 1),
            ValueError,
            "prefill_first_chunk: request 'p' already holds pages",
        ),
        (
            "eviction-order",
            None,
            lambda c: type(c)([_full_spec(c)], 8, eviction_order="lru"),
            ValueError,
            "eviction_order",
        ),
    ]
]


def _full_spec(cache: Any) -> Any:
    """A full-attention spec of the engine ``cache`` belongs to."""
    module = __import__(type(cache).__module__.rsplit(".", 1)[0], fromlist=["KVCacheSpec"])
    return module.KVCacheSpec("full", 4)


@pytest.mark.parametrize("case", ORDER_CASES)
def test_out_of_order_call_is_refused(api: ModuleType, case: Case) -> None:
    check_case(api, case)


@pytest.mark.parametrize("case", ORDER_CASES)
def test_out_of_order_call_same_error_on_both_engines(case: Case) -> None:
    check_agree(case)


def test_a_free_slot_is_refused_with_the_exact_message(api: ModuleType) -> None:
    """The whole message of a slot that holds no request, and the exception's classes."""
    cache = busy_cache(api)
    with pytest.raises(UnknownRequestError) as caught:
        cache.schedule([SLOT_A, FREE_SLOT], [0, 1])
    assert isinstance(caught.value, KeyError)
    assert caught.value.args == ("schedule: slot 2 holds no request",)
    assert cache.num_computed_tokens(SLOT_A) == 10  # validated first: nothing was scheduled


def test_admit_answers_none_when_every_bound_slot_is_held(api: ModuleType) -> None:
    """With rows bound and all their slots held, ``admit`` answers None and changes nothing;
    once a slot is free it admits into it."""
    cache = busy_cache(api)
    _bind(2)(cache)
    before = snapshot(cache)
    assert cache.admit("n", [1, 2, 3], 3) is None
    assert snapshot(cache) == before
    cache.finish([SLOT_A])
    assert cache.admit("n", [1, 2, 3], 3) == (SLOT_A, 0, 3)
    cache.check_invariants()


def _page_level_calls(req: object) -> dict[str, Any]:
    """Every page-level call that moves pages, on ``req``."""
    return {
        "acquire": lambda c: c.acquire(req, 1),
        "claim": lambda c: c.claim(req, c.match_prefix([])),
        "register": lambda c: c.register(req, [HASH]),
        "reclaim": lambda c: c.reclaim(req, 10),
        "free": lambda c: c.free(req),
        "prefill_first_chunk": lambda c: c.prefill_first_chunk(req, c.match_prefix([]), 1),
        "prefill_chunk": lambda c: c.prefill_chunk(req, [], 1, 10),
        "decode_step": lambda c: c.decode_step(req, [], 0, 1, 10),
        "match_prefix": lambda c: c.match_prefix([]),
        "pages_reclaimable": lambda c: c.pages_reclaimable(req, 1),
        "pages_consumed_by_claim": lambda c: c.pages_consumed_by_claim(None),
        "has_request": lambda c: c.has_request(req),
    }


def _removed_calls() -> dict[str, Any]:
    """The token-level calls the slot API removed (docs/requests-api.md)."""
    return {
        "schedule_batch": lambda c: c.schedule_batch(["a"], [1]),
        "schedule_rows": lambda c: c.schedule_rows([0], [1]),
        "append_tokens_batch": lambda c: c.append_tokens_batch(["a"], [1]),
        "append_tokens_rows": lambda c: c.append_tokens_rows([0], [1]),
        "row_of": lambda c: c.row_of("a"),
    }


def _token_level_calls(req: object) -> dict[str, Any]:
    """Every token-level call (on slot 0, or ``req`` where an id is taken)."""
    return {
        "add_request": lambda c: c.add_request(req, [1, 2]),
        "admit": lambda c: c.admit(req, [1, 2], 1),
        "append_tokens": lambda c: c.append_tokens([0], [1]),
        "schedule": lambda c: c.schedule([0], [1]),
        "finish": lambda c: c.finish([0]),
        "preempt": lambda c: c.preempt([0]),
        "num_tokens": lambda c: c.num_tokens(0),
        "num_computed_tokens": lambda c: c.num_computed_tokens(0),
        "reserve": lambda c: c.reserve([0], [1]),
        "budget": lambda c: c.budget(0),
        "prefix_hit_tokens": lambda c: c.prefix_hit_tokens([1, 2]),
        "pages_needed_to_admit": lambda c: c.pages_needed_to_admit([1, 2], 1),
        "slot_of": lambda c: c.slot_of(req),
        "id_of": lambda c: c.id_of(0),
        "bind_rows": lambda c: c.bind_rows({}),
        "update_rows": lambda c: c.update_rows(),
        "unbind_rows": lambda c: c.unbind_rows(),
        **_removed_calls(),
    }


@pytest.mark.parametrize("method", list(_page_level_calls("a")))
@pytest.mark.parametrize("req", [*TOKEN_LEVEL, SLOT_A])
def test_page_level_calls_are_absent_from_the_token_level_cache(
    api: ModuleType, method: str, req: object
) -> None:
    """``FlatKVCache`` speaks the token-level protocol only: a page-level call (and
    ``has_request``, which ``slot_of`` replaces) is an AttributeError naming the method, and
    nothing changes (docs/requests-api.md)."""
    cache = busy_cache(api)
    before = snapshot(cache)
    with pytest.raises(AttributeError, match=method):
        _page_level_calls(req)[method](cache)
    assert snapshot(cache) == before
    cache.check_invariants()


@pytest.mark.parametrize("method", list(_removed_calls()))
def test_removed_token_level_calls_are_gone(api: ModuleType, method: str) -> None:
    """The id-addressed and row-addressed step calls are gone from ``FlatKVCache``: an
    AttributeError naming the method, nothing changed."""
    cache = busy_cache(api)
    assert not hasattr(cache, method) and not hasattr(api.FlatKVCache, method)
    before = snapshot(cache)
    with pytest.raises(AttributeError, match=method):
        _removed_calls()[method](cache)
    assert snapshot(cache) == before


@pytest.mark.parametrize("method", list(_token_level_calls(PAGE_LEVEL)))
def test_token_level_calls_are_absent_from_the_page_level_cache(api: ModuleType, method: str) -> None:
    """``PageCache`` speaks the page-level protocol only: a token-level call is an
    AttributeError naming the method, and nothing changes (docs/engine-api.md)."""
    cache = busy_page_cache(api)
    before = snapshot(cache)
    with pytest.raises(AttributeError, match=method):
        _token_level_calls(PAGE_LEVEL)[method](cache)
    assert snapshot(cache) == before
    cache.check_invariants()


def test_readers_answer_for_slots(api: ModuleType) -> None:
    """The readers of one slot (``page_ids``, ``tail_available``, ``pages_needed``,
    ``budget``, ``num_tokens``, ``num_computed_tokens``, ``loads_in_flight``) and
    ``block_tables`` of a slot array answer for the request in that slot."""
    cache = busy_cache(api)
    assert cache.page_ids(SLOT_A) == [[1, 2, 3], [4, 5, 6]]
    assert cache.page_ids(np.int64(SLOT_A)) == cache.page_ids(np.uint8(SLOT_A))
    # 10 tokens computed in 4-token pages: 2 free slots in the last page of each group.
    assert cache.tail_available(SLOT_A) == [2, 2]
    assert cache.pages_needed(2, SLOT_A) == 0 and cache.pages_needed(3, SLOT_A) == 2
    assert cache.pages_needed(3) == 2 and cache.pages_needed(5) == 4
    assert cache.page_ids(SLOT_7) == [[], []]
    assert cache.tail_available(SLOT_7) == [0, 0]
    assert (cache.num_tokens(SLOT_A), cache.num_computed_tokens(SLOT_A)) == (11, 10)
    assert (cache.num_tokens(SLOT_7), cache.num_computed_tokens(SLOT_7)) == (6, 0)
    assert cache.loads_in_flight(SLOT_A) == 0
    # "a" reserved 2 tokens: 0 pages (its tails hold them); 7 reserved nothing.
    free = cache.num_free_pages
    assert cache.budget() == cache.budget(SLOT_A) == cache.budget(SLOT_7) == free
    cache.reserve([SLOT_A], [3])  # 2 pages now
    assert cache.budget() == free - 2 and cache.budget(SLOT_A) == free and cache.budget(SLOT_7) == free - 2
    assert cache.block_tables([SLOT_A, SLOT_7])["full"].tolist() == [[1, 2, 3], [-1, -1, -1]]
    assert cache.block_tables([SLOT_7, SLOT_A])["full"].tolist() == [[-1, -1, -1], [1, 2, 3]]
    assert cache.block_tables([SLOT_A, SLOT_A])["swa"].tolist() == [[4, 5, 6]] * 2
    empty = cache.block_tables([])
    assert sorted(empty) == ["full", "swa"] and all(t.shape[0] == 0 for t in empty.values())


def test_finished_id_can_be_reused_as_a_new_request(api: ModuleType) -> None:
    """After ``finish`` the id and the slot are free again: re-adding the id starts a new
    request in the lowest free slot (a prefix hit)."""
    cache = busy_cache(api)
    cache.finish([SLOT_A])
    assert cache.slot_of("a") is None
    assert cache.add_request("a", list(range(10))) == (SLOT_A, 8)
    assert cache.num_computed_tokens(SLOT_A) == 8 and cache.num_tokens(SLOT_A) == 10
    assert cache.slot_of("a") == SLOT_A and cache.id_of(SLOT_A) == "a"
    cache.check_invariants()


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(lambda c: c.preempt([SLOT_7, SLOT_7]), id="preempt-listed-twice"),
        pytest.param(lambda c: c.reserve([SLOT_A, SLOT_A], [9, 1]), id="reserve-repeated-last-counts"),
        pytest.param(lambda c: c.append_tokens([SLOT_7, SLOT_7], [1, 2, 3], [1, 2]), id="append-repeated"),
        pytest.param(lambda c: c.schedule([SLOT_7, SLOT_7], [2, 3], lookahead=1), id="schedule-repeated"),
        pytest.param(lambda c: c.schedule([], []), id="schedule-empty"),
        pytest.param(lambda c: c.finish([]), id="finish-empty"),
        pytest.param(lambda c: c.preempt(np.array([], np.int64)), id="preempt-empty"),
        pytest.param(lambda c: c.append_tokens([], []), id="append-empty"),
        pytest.param(lambda c: c.block_tables(range(2)), id="block_tables-range"),
        pytest.param(lambda c: c.finish(iter([SLOT_7])), id="finish-iterator"),
    ],
)
def test_edge_calls_agree_on_both_engines(call: Any) -> None:
    """Calls at the edges of the contract (repeated slots, empty arrays, any iterable of
    slots): both engines give the same result and leave the same state, or raise alike."""
    outcomes = []
    for api in ENGINES:
        cache = busy_cache(api)
        try:
            result: object = call(cache)
            got: object = ("ok", normalize(result), snapshot(cache), cache.take_events())
        except Exception as exc:  # compared between the engines
            text = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
            got = ("raise", type(exc), text, snapshot(cache))
        cache.check_invariants()
        outcomes.append(got)
    assert outcomes[0] == outcomes[1]


@pytest.mark.parametrize(
    ("call", "kind", "message"),
    [
        pytest.param(
            lambda c: c.num_tokens(True), TypeError, "slot must be an int, not bool", id="slot-bool"
        ),
        pytest.param(lambda c: c.page_ids(1.0), TypeError, "slot must be an int, got float", id="slot-float"),
        pytest.param(lambda c: c.budget("0"), TypeError, "slot must be an int, got str", id="slot-str"),
        pytest.param(lambda c: c.id_of(-1), ValueError, "slot must be >= 0, got -1", id="slot-negative"),
        pytest.param(
            lambda c: c.tail_available(2**64),
            OverflowError,
            "slot: value does not fit in an unsigned 64-bit integer",
            id="slot-past-u64",
        ),
        pytest.param(
            lambda c: c.finish([SLOT_7, np.bool_(True)]),
            TypeError,
            "slots[1] must be an int, got bool",
            id="item-np-bool",
        ),
        pytest.param(
            lambda c: c.schedule([SLOT_7, -3], [0, 0]),
            ValueError,
            "slots[1] must be >= 0, got -3",
            id="item-negative",
        ),
        pytest.param(
            lambda c: c.reserve([2**64], [1]),
            OverflowError,
            "slots[0]: value does not fit in an unsigned 64-bit integer",
            id="item-past-u64",
        ),
        pytest.param(
            lambda c: c.block_tables("01"),
            TypeError,
            "slots must be a sequence of ints or a 1-D integer array, got str",
            id="slots-str",
        ),
        pytest.param(
            lambda c: c.preempt(np.zeros((1, 1), np.int64)),
            TypeError,
            "slots must be a 1-D integer array, got a 2-D array of dtype int64",
            id="slots-2-d",
        ),
        pytest.param(
            lambda c: c.append_tokens(np.ma.array([0]), [1]),
            TypeError,
            "slots must not be a masked array (its mask would be ignored)",
            id="slots-masked",
        ),
    ],
)
def test_bad_slot_messages_are_the_odd_input_wording(
    api: ModuleType, call: Any, kind: type, message: str
) -> None:
    """A slot or slot array is an int argument / int batch of docs/engine-api.md "Odd inputs":
    the whole message is that wording, with the argument named ``slot``, ``slots`` or
    ``slots[i]``."""
    assert check_case(api, Case(call, kind, message)) == Refusal(kind, message)
