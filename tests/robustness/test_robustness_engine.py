"""Robustness sweep of the engine's public calls: every bad input or out-of-order call is refused
with the documented exception, which names the argument, leaves the cache unchanged, and is the
same (type and message) on the native engine and the pure-Python reference.

The harness is in ``tests/support/robustness_cases.py``; what "unchanged" covers is listed there.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from flat_kvcache.errors import UnknownRequestError
from hypothesis import given, settings
from hypothesis import strategies as st
from robustness_cases import (
    ENGINES,
    HASH,
    LIVE,
    PAGE_LEVEL,
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
        "schedule": (lambda c: c.schedule(7, v), "num_new_tokens"),
        "reserve": (lambda c: c.reserve("a", v), "tokens"),
        "reclaim": (lambda c: c.reclaim(PAGE_LEVEL, v), "num_computed_tokens"),
        "pages_needed": (lambda c: c.pages_needed(v), "num_tokens"),
        "pages_needed(req)": (lambda c: c.pages_needed(v, PAGE_LEVEL), "num_tokens"),
        "pages_reclaimable": (lambda c: c.pages_reclaimable(PAGE_LEVEL, v), "num_computed_tokens"),
        "register.first_slot": (lambda c: c.register(PAGE_LEVEL, [HASH], first_slot=v), "first_slot"),
        "register.end_tokens": (lambda c: c.register(PAGE_LEVEL, [HASH], end_tokens=v), "end_tokens"),
        "schedule.lookahead": (lambda c: c.schedule(7, 1, lookahead=v), "lookahead"),
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
        "admit.row": (lambda c: c.admit("new", [1, 2, 3], 2, row=v), "row"),
        "schedule_batch[0]": (lambda c: c.schedule_batch([7], [v]), "num_new_tokens[0]"),
        "append_tokens_batch.num_tokens[0]": (
            lambda c: c.append_tokens_batch(["a"], [1], [v]),
            "num_tokens[0]",
        ),
    }


#: Count arguments for which None is not a bad value: ``end_tokens`` is optional (None means
#: "state groups register nothing") and so is ``admit``'s ``row`` (None: no row). The ints
#: with a default (``first_slot``, ``lookahead``, ``reserve_tokens``) take it only when left
#: out: an explicit None is refused.
_NONE_LEFT_OUT = frozenset({"register.end_tokens", "admit.row"})

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
    }
    | {"prefill_first_chunk"}
)

COUNT_CASES = [
    pytest.param(
        Case(call, kind, name, page_level=where.split(".")[0] in _PAGE_LEVEL_COUNTS), id=f"{where}={label}"
    )
    for label, value, kind, _ in BAD_INTS
    for where, (call, name) in _count_calls(value).items()
    if not (value is None and where in _NONE_LEFT_OUT)
]


def _token_calls(v: object) -> dict[str, tuple[Any, str]]:
    """Every token-list argument of the engine, with ``v`` as its second token."""
    return {
        "add_request": (lambda c: c.add_request("new", [1, v]), "prompt_token_ids[1]"),
        "admit": (lambda c: c.admit("new", [1, v], 2), "prompt_token_ids[1]"),
        "append_tokens": (lambda c: c.append_tokens("a", [1, v]), "token_ids[1]"),
        "append_tokens_batch": (lambda c: c.append_tokens_batch(["a", 7], [1, v]), "token_ids[1]"),
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
    pytest.param(Case(lambda c: c.append_tokens("a", np.array(1)), TypeError, "token_ids"), id="tokens-0-d"),
    pytest.param(
        Case(lambda c: c.schedule_batch([7], np.zeros((1, 1), np.int64)), TypeError, "num_new_tokens"),
        id="counts-2-d",
    ),
    pytest.param(
        Case(lambda c: c.add_request("n", b"abc"), TypeError, "prompt_token_ids"), id="tokens-bytes"
    ),
    pytest.param(
        Case(lambda c: c.append_tokens("a", np.array([2**33], np.int64)[::-1]), ValueError, "token_ids[0]"),
        id="append-negative-stride-too-big",
    ),
    pytest.param(
        Case(lambda c: c.schedule_batch([7], [1, 1]), ValueError, "num_new_tokens"),
        id="counts-longer-than-reqs",
    ),
    pytest.param(
        Case(
            lambda c: c.schedule_batch([7, "a"], np.array([1, -1], np.int8)), ValueError, "num_new_tokens[1]"
        ),
        id="counts-i8-negative",
    ),
    pytest.param(
        Case(
            lambda c: c.schedule_batch([7, "a"], _array([5, 1], np.int32, readonly=True)[::-1]),
            ValueError,
            "num_new_tokens",
        ),
        id="counts-readonly-reversed-too-many",
    ),
    pytest.param(
        Case(lambda c: c.schedule_batch([7, "a"], [1, 5]), ValueError, "num_new_tokens"),
        id="counts-more-than-known-second",
    ),
    pytest.param(
        Case(lambda c: c.append_tokens_batch(["a", 7], [1, 2, 3]), ValueError, "token_ids"),
        id="batch-tokens-without-counts",
    ),
    pytest.param(
        Case(
            lambda c: c.append_tokens_batch(["a", 7], [1, 2, 3], np.array([1, 1], np.uint8)),
            ValueError,
            "num_tokens",
        ),
        id="batch-counts-do-not-add-up",
    ),
]


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
    assert cache.add_request("n", tokens) == twin.add_request("n", tokens.tolist())
    counts = _array([len(tokens)], np.int64, readonly=True)
    assert cache.schedule_batch(["n"], counts).tolist() == twin.schedule_batch(["n"], [len(tokens)]).tolist()
    assert cache.page_ids("n") == twin.page_ids("n")
    assert cache.stats() == twin.stats()
    np.testing.assert_array_equal(tokens, before)


def test_reversed_tokens_are_read_in_reversed_order(api: ModuleType) -> None:
    """A negative stride is honoured: the reversed view hashes like the reversed list."""
    cache = busy_cache(api)
    forward = np.arange(1000, 1013, dtype=np.int64)
    assert cache.add_request("n", forward[::-1]) == 0
    assert cache.schedule("n", 13)
    cache.finish("n")
    assert cache.prefix_hit_tokens(list(range(1012, 999, -1))) == 12
    assert cache.prefix_hit_tokens(forward) == 0


# --- block_tables(out=) ------------------------------------------------------------------------


def _buffer(rows: int = 3, cols: int = 8, dtype: npt.DTypeLike = np.int32) -> npt.NDArray[Any]:
    return np.zeros((rows, cols), dtype=dtype)


def _readonly(array: npt.NDArray[Any]) -> npt.NDArray[Any]:
    array.setflags(write=False)
    return array


def _tables(out: Any) -> Any:
    return lambda c: c.block_tables(list(LIVE), out=out)


def _shared(make: Any) -> Any:
    """``block_tables`` with ``out`` built from one fresh array per call (two views of it)."""
    return lambda c: c.block_tables(list(LIVE), out=make(_buffer(6, 16)))


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
        cache.block_tables(list(LIVE), out={"full": full, "swa": swa, "full ": _buffer()})
    assert not full.any() and not swa.any()


def test_disjoint_row_blocks_of_one_array_are_fine(api: ModuleType) -> None:
    """Non-overlapping row blocks of one array are separate buffers: written like fresh ones."""
    cache = busy_cache(api)
    buffer = _buffer(6)
    out = cache.block_tables(list(LIVE), out={"full": buffer[:3], "swa": buffer[3:]})
    expected = cache.block_tables(list(LIVE))
    rows = len(LIVE)
    for group, table in expected.items():
        np.testing.assert_array_equal(out[group][:rows, : table.shape[1]], table)
        assert (out[group][:rows, table.shape[1] :] == -1).all()
        assert (out[group][rows:] == 0).all()  # rows past len(reqs) are untouched


# --- text, bytes and masked arrays are never batches (docs/engine-api.md, "Odd inputs") --------

#: One batch argument per kind: (call given the value, argument name, what its items are).
_BATCHES: dict[str, tuple[Any, str, str]] = {
    "schedule_batch.reqs": (lambda c, v: c.schedule_batch(v, [1]), "reqs", "request ids"),
    "block_tables.reqs": (lambda c, v: c.block_tables(v), "reqs", "request ids"),
    "append_tokens_batch.reqs": (lambda c, v: c.append_tokens_batch(v, [1]), "reqs", "request ids"),
    "schedule_batch.num_new_tokens": (
        lambda c, v: c.schedule_batch(["a"], v),
        "num_new_tokens",
        "ints or a 1-D integer array",
    ),
    "add_request.prompt_token_ids": (
        lambda c, v: c.add_request("n", v),
        "prompt_token_ids",
        "ints or a 1-D integer array",
    ),
    "schedule_rows.rows": (lambda c, v: c.schedule_rows(v, [1]), "rows", "ints or a 1-D integer array"),
    "ack_transfers.ids": (lambda c, v: c.ack_transfers(v), "ids", "ints or a 1-D integer array"),
    "match_prefix.content_hashes": (lambda c, v: c.match_prefix(v), "content_hashes", "str"),
    "add_request.extra_keys": (lambda c, v: c.add_request("n", [1], extra_keys=v), "extra_keys", "str"),
}

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
    page_level = where.startswith("match_prefix")
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
    got = check_case(api, Case(lambda c: call(c, make()), TypeError, name))
    assert got == Refusal(TypeError, f"{name} must not be a masked array (its mask would be ignored)")


def test_a_masked_prompt_is_refused_after_the_same_prompt_unmasked(api: ModuleType) -> None:
    """A masked u32 prompt equal to the prompt just hashed is refused too (not recalled)."""
    cache = busy_cache(api)
    prompt = np.arange(20, dtype=np.uint32)
    cache.prefix_hit_tokens(prompt)  # hashed and remembered
    with pytest.raises(TypeError, match="prompt_token_ids must not be a masked array"):
        cache.add_request("n", np.ma.array(prompt, mask=[False] * 19 + [True]))
    assert not cache.has_request("n")


# --- request ids --------------------------------------------------------------------------------


def _add(rid: object) -> Any:
    """``add_request(rid, [1, 2])`` as a case call."""
    return lambda c: c.add_request(rid, [1, 2])


ID_CASES = [
    pytest.param(Case(_add(rid), TypeError, "request ids"), id=f"add-{label}")
    for label, rid in [("bytes", b"a"), ("tuple", ("a",)), ("float", 1.0), ("bool", True), ("None", None)]
] + [
    pytest.param(Case(call, kind, name), id=label)
    for label, call, kind, name in [
        ("finish-7.0", lambda c: c.finish(7.0), TypeError, "request ids"),
        ("finish-True", lambda c: c.finish(True), TypeError, "request ids"),
        ("page_ids-bytes", lambda c: c.page_ids(b"a"), TypeError, "request ids"),
        ("schedule-tuple", lambda c: c.schedule(("a",), 1), TypeError, "request ids"),
        ("batch-float-second", lambda c: c.schedule_batch(["a", 7.0], [0, 1]), TypeError, "request ids"),
        ("finish-'7'", lambda c: c.finish("7"), UnknownRequestError, "'7'"),
        (
            "finish-b'a'-as-str",
            lambda c: c.finish("b'a'"),
            UnknownRequestError,
            "unknown request id \"b'a'\"",
        ),
        ("finish-both-quotes", lambda c: c.finish("'\""), UnknownRequestError, "unknown request id '\\'\"'"),
        ("add-existing-str", lambda c: c.add_request("a", [1, 2]), ValueError, "'a'"),
        ("add-existing-int", lambda c: c.add_request(7, [1, 2]), ValueError, "7"),
        ("admit-existing-str", lambda c: c.admit("a", [1, 2], 1), ValueError, "'a'"),
        ("admit-existing-int", lambda c: c.admit(7, [1, 2], 1), ValueError, "7"),
        ("admit-bytes", lambda c: c.admit(b"a", [1, 2], 1), TypeError, "request ids"),
        ("admit-empty-prompt", lambda c: c.admit("new", [], 1), ValueError, "prompt_token_ids"),
        (
            "admit-use_prefix_cache-int",
            lambda c: c.admit("new", [1], 1, use_prefix_cache=1),
            TypeError,
            "use_prefix_cache",
        ),
        ("block_tables-bare-str", lambda c: c.block_tables("a"), TypeError, "reqs"),
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
def test_unknown_str_id_is_quoted_as_python_repr_on_both_engines(rid: str) -> None:
    """Ids of any text (quotes, backslashes, control and non-ASCII characters) are shown the
    way Python's ``repr`` shows them, by both engines.

    Characters this Python's Unicode database does not assign (Cn) are left out: the native
    engine's table may be newer and print a character that ``repr`` escapes here."""
    messages = []
    for api in ENGINES:
        cache = api.FlatKVCache([api.KVCacheSpec("full", 4)], 8)
        with pytest.raises(UnknownRequestError) as info:
            cache.finish(rid)
        messages.append(info.value.args[0])
    assert messages == [f"unknown request id {rid!r}"] * 2


def test_int_and_str_ids_are_distinct(api: ModuleType) -> None:
    """``7`` and ``"7"`` are two requests; ``np.int64(8)`` is the int 8; ids of any size work."""
    cache = busy_cache(api)
    cache.add_request("7", [1, 2, 3])
    cache.add_request(np.int64(8), [4, 5])
    cache.add_request(-(2**70), [6])
    assert cache.num_tokens(7) == 6 and cache.num_tokens("7") == 3 and cache.num_tokens(8) == 2
    assert cache.has_request(-(2**70)) and not cache.has_request(str(-(2**70)))
    cache.finish("7")
    assert cache.has_request(7)
    cache.check_invariants()


# --- calls out of order --------------------------------------------------------------------------

#: The calls of ``ORDER_CASES`` that are page-level (run on a ``PageCache``).
_PAGE_LEVEL_ORDER = frozenset(
    {
        "free-twice",
        "register-unknown",
        "reclaim-unknown",
        "free-unknown",
        "decode_step-unknown",
        "prefill_chunk-unknown",
        "register-bad-hash",
        "claim-holding-pages",
        "prefill_first_chunk-holding-pages",
    }
)

ORDER_CASES = [
    pytest.param(Case(call, kind, name, setup, page_level=label in _PAGE_LEVEL_ORDER), id=label)
    for label, setup, call, kind, name in [
        ("schedule-before-add", None, lambda c: c.schedule("new", 1), UnknownRequestError, "'new'"),
        (
            "schedule_batch-before-add",
            None,
            lambda c: c.schedule_batch([7, "new"], [1, 1]),
            UnknownRequestError,
            "'new'",
        ),
        ("append-before-add", None, lambda c: c.append_tokens("new", [1]), UnknownRequestError, "'new'"),
        ("reserve-before-add", None, lambda c: c.reserve("new", 1), UnknownRequestError, "'new'"),
        ("budget-of-unknown", None, lambda c: c.budget("new"), UnknownRequestError, "'new'"),
        ("finish-twice", lambda c: c.finish(7), lambda c: c.finish(7), UnknownRequestError, "7"),
        ("preempt-twice", lambda c: c.preempt(7), lambda c: c.preempt(7), UnknownRequestError, "7"),
        ("preempt-unknown", None, lambda c: c.preempt("new"), UnknownRequestError, "'new'"),
        ("schedule-finished", lambda c: c.finish(7), lambda c: c.schedule(7, 1), UnknownRequestError, "7"),
        (
            "append-finished",
            lambda c: c.finish("a"),
            lambda c: c.append_tokens("a", [1]),
            UnknownRequestError,
            "'a'",
        ),
        (
            "free-twice",
            lambda c: c.free(PAGE_LEVEL),
            lambda c: c.free(PAGE_LEVEL),
            UnknownRequestError,
            "'p'",
        ),
        ("schedule-more-than-known", None, lambda c: c.schedule(7, 7), ValueError, "num_new_tokens"),
        ("register-unknown", None, lambda c: c.register("new", [HASH]), UnknownRequestError, "'new'"),
        ("reclaim-unknown", None, lambda c: c.reclaim("new", 1), UnknownRequestError, "'new'"),
        ("free-unknown", None, lambda c: c.free("new"), UnknownRequestError, "'new'"),
        ("page_ids-unknown", None, lambda c: c.page_ids("new"), UnknownRequestError, "'new'"),
        ("tail-unknown", None, lambda c: c.tail_available("new"), UnknownRequestError, "'new'"),
        ("pages_needed-unknown", None, lambda c: c.pages_needed(1, "new"), UnknownRequestError, "'new'"),
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
            "block_tables-finished",
            lambda c: c.finish(7),
            lambda c: c.block_tables(["a", 7]),
            UnknownRequestError,
            "7",
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
    }


def _token_level_calls(req: object) -> dict[str, Any]:
    """Every token-level call on ``req`` (or, for the probes, on a prompt)."""
    return {
        "add_request": lambda c: c.add_request(req, [1, 2]),
        "admit": lambda c: c.admit(req, [1, 2], 1),
        "append_tokens": lambda c: c.append_tokens(req, [1]),
        "append_tokens_batch": lambda c: c.append_tokens_batch([req], [1]),
        "append_tokens_rows": lambda c: c.append_tokens_rows([0], [1]),
        "schedule": lambda c: c.schedule(req, 1),
        "schedule_batch": lambda c: c.schedule_batch([req], [1]),
        "schedule_rows": lambda c: c.schedule_rows([0], [1]),
        "finish": lambda c: c.finish(req),
        "preempt": lambda c: c.preempt(req),
        "num_tokens": lambda c: c.num_tokens(req),
        "num_computed_tokens": lambda c: c.num_computed_tokens(req),
        "reserve": lambda c: c.reserve(req, 1),
        "budget": lambda c: c.budget(req),
        "prefix_hit_tokens": lambda c: c.prefix_hit_tokens([1, 2]),
        "pages_needed_to_admit": lambda c: c.pages_needed_to_admit([1, 2], 1),
        "row_of": lambda c: c.row_of(req),
        "bind_rows": lambda c: c.bind_rows({}),
        "update_rows": lambda c: c.update_rows(),
        "unbind_rows": lambda c: c.unbind_rows(),
    }


@pytest.mark.parametrize("method", list(_page_level_calls("a")))
@pytest.mark.parametrize("req", TOKEN_LEVEL)
def test_page_level_calls_are_absent_from_the_token_level_cache(
    api: ModuleType, method: str, req: object
) -> None:
    """``FlatKVCache`` speaks the token-level protocol only: a page-level call is an
    AttributeError naming the method, and nothing changes (docs/requests-api.md)."""
    cache = busy_cache(api)
    before = snapshot(cache)
    with pytest.raises(AttributeError, match=method):
        _page_level_calls(req)[method](cache)
    assert snapshot(cache) == before
    cache.check_invariants()


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


def test_shared_readers_answer_for_token_level_requests(api: ModuleType) -> None:
    """The readers both classes share (``page_ids``, ``tail_available``, ``pages_needed``,
    ``block_tables``) answer for token-level requests."""
    cache = busy_cache(api)
    assert cache.page_ids("a") == [[1, 2, 3], [4, 5, 6]]
    # 10 tokens computed in 4-token pages: 2 free slots in the last page of each group.
    assert cache.tail_available("a") == [2, 2]
    assert cache.pages_needed(2, "a") == 0 and cache.pages_needed(3, "a") == 2
    assert cache.page_ids(7) == [[], []]
    assert cache.block_tables(["a", 7])["full"].tolist() == [[1, 2, 3], [-1, -1, -1]]


def test_finished_id_can_be_reused_as_a_new_request(api: ModuleType) -> None:
    """After ``finish`` the id is free again: re-adding it starts a new request (a prefix hit)."""
    cache = busy_cache(api)
    cache.finish("a")
    assert cache.add_request("a", list(range(10))) == 8
    assert cache.num_computed_tokens("a") == 8 and cache.num_tokens("a") == 10
    cache.check_invariants()
