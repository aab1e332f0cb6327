"""Every integer form a caller holds converts like a list of Python ints at the native boundary.

Lists and tuples of numpy integer scalars (what ``list(array)`` gives), numpy integer arrays of
any integer dtype, byte order and stride, and CPU torch integer tensors give the results of the
same values as plain ints; floats and bools are refused with the argument's name.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from flat_kvcache import _native
from flat_kvcache.engine import KVCacheSpec

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


def run_request(prompt: Any, appended: Any) -> tuple[int, list[list[int]], int]:
    """Add a request with ``prompt``, append ``appended``, schedule all: what the engine reports."""
    cache = _native.FlatKVCache([KVCacheSpec("full", 2), KVCacheSpec("sliding_window", 4, 4)], 64)
    cache.add_request("seed", [5, 0, 100, 3, 1, 127, 9, 4])
    assert cache.schedule("seed", 8)
    cache.finish("seed")  # its pages stay cached, so the prompt below has a hit
    hit = cache.add_request("r", prompt)
    cache.append_tokens("r", appended)
    assert cache.schedule("r", cache.num_tokens("r") - cache.num_computed_tokens("r"))
    return hit, cache.page_ids("r"), cache.num_tokens("r")


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
        reqs = [f"r{i}" for i in range(len(SMALL))]
        for req in reqs:
            cache.add_request(req, list(range(200)))
        return [bool(b) for b in cache.schedule_batch(reqs, counts)]

    assert scheduled(value) == scheduled(SMALL), label


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
    with pytest.raises(TypeError, match="num_new_tokens"):
        _native.FlatKVCache([KVCacheSpec("full", 4)], 8).schedule_batch(["a"] * len(value), value)


def test_two_dimensional_arrays_are_refused() -> None:
    with pytest.raises(TypeError, match=r"token_ids must be a 1-D integer array, got a 2-D array"):
        _native.hash_pages(np.zeros((2, 2), np.int64), 2)
