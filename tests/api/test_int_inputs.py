"""Every integer form a caller holds converts like a list of Python ints at the native boundary.

Lists and tuples of numpy integer scalars (what ``list(array)`` gives), numpy integer arrays of
any integer dtype, byte order and stride, and CPU torch integer tensors give the results of the
same values as plain ints; floats and bools are refused with the argument's name.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from helpers import missing

try:
    import torch
except ImportError as exc:
    missing("torch", exc)

from flat_kvcache import _native
from flat_kvcache.engine import KVCacheSpec
from hypothesis import given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.torch

TOKENS = [5, 0, 70000, 3, 1, 2**31 + 7, 9, 4, 11, 8, 12, 6, 40000, 255]
SMALL = [5, 0, 100, 3, 1, 127, 9, 4, 11, 8, 12, 6, 40, 2]  # fits every integer dtype

INT_DTYPES = [np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64]


def forms(values: list[int]) -> list[tuple[str, Any]]:
    """``values`` in every integer form the boundary accepts (the values must fit the dtypes)."""
    out: list[tuple[str, Any]] = []
    for dtype in INT_DTYPES:
        arr = np.array(values, dtype=dtype)
        name = np.dtype(dtype).name
        out.append((f"list[{name}]", list(arr)))
        out.append((f"tuple[{name}]", tuple(arr)))
        out.append((f"array[{name}]", arr))
        out.append((f"array[{name}, swapped]", arr.astype(arr.dtype.newbyteorder("S"))))
        doubled = np.repeat(arr, 2)[::2]  # strided view of the same values
        assert not doubled.flags.c_contiguous or len(values) <= 1
        out.append((f"array[{name}, strided]", doubled))
    for tdtype in (torch.int32, torch.int64, torch.int16, torch.uint8):
        tensor = torch.tensor(values, dtype=tdtype)
        out.append((f"tensor[{tdtype}]", tensor))
        out.append((f"tensor[{tdtype}, strided]", torch.repeat_interleave(tensor, 2)[::2]))
    return out


def run_request(prompt: Any, appended: Any) -> tuple[tuple[int, int], list[list[int]], int]:
    """Add a request with ``prompt``, append ``appended``, schedule all: what the engine reports."""
    cache = _native.FlatKVCache([KVCacheSpec("full", 2), KVCacheSpec("sliding_window", 4, 4)], 64)
    seed, _ = cache.add_request("seed", [5, 0, 100, 3, 1, 127, 9, 4])
    assert cache.schedule([seed], [8]).tolist() == [True]
    cache.finish([seed])  # its pages stay cached, so the prompt below has a hit
    added = cache.add_request("r", prompt)
    slot = added[0]
    cache.append_tokens([slot], appended, [len(appended)])
    assert cache.schedule([slot], [cache.num_tokens(slot) - cache.num_computed_tokens(slot)]).tolist() == [
        True
    ]
    return added, cache.page_ids(slot), cache.num_tokens(slot)


@pytest.mark.parametrize(("label", "value"), forms(SMALL), ids=lambda v: v if isinstance(v, str) else "")
def test_token_inputs_match_python_ints(label: str, value: Any) -> None:
    expected_hashes = _native.hash_pages(SMALL, 4)
    assert _native.hash_pages(value, 4) == expected_hashes, label
    assert _native.hash_page(value, "", ["k"]) == _native.hash_page(SMALL, "", ["k"]), label
    assert run_request(value, value) == run_request(SMALL, SMALL), label


@pytest.mark.parametrize(("label", "value"), forms(SMALL), ids=lambda v: v if isinstance(v, str) else "")
def test_count_inputs_match_python_ints(label: str, value: Any) -> None:
    def scheduled(counts: Any) -> list[bool]:
        cache = _native.FlatKVCache([KVCacheSpec("full", 4)], 24)
        slots = [cache.add_request(f"r{i}", list(range(200)))[0] for i in range(len(SMALL))]
        return [bool(b) for b in cache.schedule(slots, counts)]

    assert scheduled(value) == scheduled(SMALL), label


def _many_requests() -> Any:
    """A cache with 128 requests in slots 0 to 127 (SMALL's values), each of one token
    scheduled (so each holds one page)."""
    cache = _native.FlatKVCache([KVCacheSpec("full", 4)], 256)
    for i in range(128):
        assert cache.add_request(f"r{i}", [i]) == (i, 0)
    assert cache.schedule(list(range(128)), [1] * 128).all()
    return cache


@pytest.mark.parametrize(("label", "value"), forms(SMALL), ids=lambda v: v if isinstance(v, str) else "")
def test_slot_inputs_match_python_ints(label: str, value: Any) -> None:
    """A slot array in any integer form names the slots of its values."""
    cache = _many_requests()
    expected = cache.block_tables(SMALL)["g0"].tolist()
    assert cache.block_tables(value)["g0"].tolist() == expected, label
    assert [row[0] for row in expected] == [s + 1 for s in SMALL]  # page s + 1 went to slot s
    cache.reserve(value, [1] * len(SMALL))
    cache.append_tokens(value, list(range(len(SMALL))))
    assert [cache.num_tokens(s) for s in SMALL] == [2] * len(SMALL), label
    assert cache.preempt(value) == [[s, i] for i, s in enumerate(SMALL)], label


def test_wide_token_values_from_numpy_scalars() -> None:
    arr = np.array(TOKENS, dtype=np.int64)
    expected = _native.hash_pages(TOKENS, 2)
    assert _native.hash_pages(list(arr), 2) == expected
    assert _native.hash_pages(list(arr.astype(np.uint32)), 2) == expected
    assert _native.hash_pages(np.repeat(arr, 2)[::2], 2) == expected


@pytest.mark.parametrize(
    "value",
    [
        [np.int64(3), np.int64(-1)],
        (np.int32(3), np.int32(-1)),
        np.array([3, -1], dtype=np.int64),
        torch.tensor([3, -1]),
    ],
    ids=["list", "tuple", "array", "tensor"],
)
def test_values_out_of_range_are_named(value: Any) -> None:
    with pytest.raises(ValueError, match=r"token_ids\[1\] = -1 does not fit in u32"):
        _native.hash_pages(value, 2)


@pytest.mark.parametrize(
    "value",
    [
        [np.float64(1.0), np.float64(2.0)],
        (np.float32(1.0),),
        [np.bool_(True)],
        [True],
        np.array([1.0, 2.0]),
        np.array([True, False]),
        torch.tensor([1.0, 2.0]),
        torch.tensor([True, False]),
    ],
    ids=[
        "list-f64",
        "tuple-f32",
        "list-np-bool",
        "list-bool",
        "array-f64",
        "array-bool",
        "tensor-f32",
        "tensor-bool",
    ],
)
def test_floats_and_bools_are_refused_with_the_argument_name(value: Any) -> None:
    with pytest.raises(TypeError, match="token_ids"):
        _native.hash_pages(value, 2)
    cache = _native.FlatKVCache([KVCacheSpec("full", 4)], 8)
    slot, _ = cache.add_request("a", [1, 2, 3])
    with pytest.raises(TypeError, match="num_new_tokens"):
        cache.schedule([slot] * len(value), value)
    with pytest.raises(TypeError, match="slots"):
        cache.finish(value)
    assert cache.slot_of("a") == slot  # nothing finished


def test_two_dimensional_arrays_are_refused() -> None:
    with pytest.raises(TypeError, match=r"token_ids must be a 1-D integer array, got a 2-D array"):
        _native.hash_pages(np.zeros((2, 2), np.int64), 2)


#: numpy's C integer scalar types (every sized name such as ``np.int64`` is one of them).
C_INT_TYPES = [
    np.byte,
    np.ubyte,
    np.short,
    np.ushort,
    np.intc,
    np.uintc,
    np.int_,
    np.uint,
    np.longlong,
    np.ulonglong,
]


class _Int64Subclass(np.int64):
    """A subclass of a numpy scalar type: read through ``__index__``, never in place."""


def _outcome(call: Any) -> object:
    """The result of ``call()``, or the exception's type and message."""
    try:
        return call()
    except (TypeError, ValueError, OverflowError, KeyError) as exc:
        return (type(exc), str(exc))


@st.composite
def _scalar_lists(draw: st.DrawFn) -> tuple[list[Any], list[int]]:
    """A list of numpy integer scalars of random C types (any value the type holds, so some
    are negative or past u32), Python ints and subclass instances, and the same values as ints."""
    items: list[Any] = []
    for _ in range(draw(st.integers(1, 12))):
        kind: Any = draw(st.sampled_from([*C_INT_TYPES, int, _Int64Subclass]))
        if kind is int:
            items.append(draw(st.integers(-(2**65), 2**65)))
            continue
        info = np.iinfo(np.int64 if kind is _Int64Subclass else kind)
        items.append(kind(draw(st.integers(int(info.min), int(info.max)))))
    return items, [int(item) for item in items]


@settings(max_examples=150, deadline=None)
@given(_scalar_lists())
def test_numpy_scalars_read_in_place_convert_like_their_ints(lists: tuple[list[Any], list[int]]) -> None:
    """The in-place read of numpy scalars accepts and refuses exactly what the ints would: the
    same tokens (hash_pages), counts (schedule) and slots (block_tables), or the same error
    naming the index."""
    items, ints = lists
    expected = _outcome(lambda: _native.hash_pages(ints, 2))
    for form in (items, tuple(items)):
        assert _outcome(lambda f=form: _native.hash_pages(f, 2)) == expected

    def scheduled(counts: Any) -> object:
        cache = _native.FlatKVCache([KVCacheSpec("full", 4)], 4096)
        slots = [cache.add_request(f"r{i}", list(range(300)))[0] for i in range(len(ints))]
        return _outcome(lambda: cache.schedule(slots, counts).tolist())

    assert scheduled(items) == scheduled(ints)

    def tables(slots: Any) -> object:
        cache = _native.FlatKVCache([KVCacheSpec("full", 4)], 64)
        for i in range(3):
            cache.add_request(f"r{i}", [i])
        return _outcome(lambda: cache.block_tables(slots)["g0"].tolist())

    assert tables(items) == tables(ints)
    assert tables(tuple(items)) == tables(ints)


def test_numpy_bools_and_floats_among_scalars_are_still_refused() -> None:
    """After numpy integer scalars of one type, a numpy bool or float is still refused."""
    with_bool: list[Any] = [np.int64(1), np.int64(2), np.bool_(True)]
    with pytest.raises(TypeError, match=r"token_ids\[2\] must be an int, got bool"):
        _native.hash_pages(with_bool, 2)
    with_float: list[Any] = [np.int64(1), np.float64(2.0)]
    with pytest.raises(TypeError, match=r"token_ids\[1\] must be an int, got float64"):
        _native.hash_pages(with_float, 2)
