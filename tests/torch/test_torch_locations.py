"""write_locations / extend_locations against a plain Python loop, and their checks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from helpers import missing
from hypothesis import given, settings
from hypothesis import strategies as st

try:
    import torch
except ImportError as exc:
    missing("torch", exc)

from flat_kvcache.torch import extend_locations, write_locations

pytestmark = pytest.mark.torch

#: The same functions, typed for what these tests pass them besides tensors: the lists and numpy
#: arrays they accept, and the wrong types the error tests need.
write_any: Callable[..., torch.Tensor] = write_locations
extend_any: Callable[..., torch.Tensor] = extend_locations


def slot(table: list[list[int]], row: int, pos: int, page_size: int) -> int:
    return table[row][pos // page_size] * page_size + pos % page_size


@st.composite
def tables(draw: st.DrawFn) -> tuple[list[list[int]], list[int], int]:
    """A block table (real pages, -1 padding at the row ends), each row's length in tokens, P."""
    page_size = draw(st.integers(1, 32))
    rows = draw(st.integers(0, 6))
    lengths = [draw(st.integers(0, 5 * page_size)) for _ in range(rows)]
    pages_per_row = [-(-n // page_size) for n in lengths]
    cols = max(pages_per_row, default=0)
    table = [[draw(st.integers(1, 10_000)) for _ in range(n)] + [-1] * (cols - n) for n in pages_per_row]
    return table, lengths, page_size


def as_tensor(table: list[list[int]]) -> torch.Tensor:
    cols = max((len(row) for row in table), default=0)
    return torch.tensor(table, dtype=torch.int32).reshape(len(table), cols)


@settings(deadline=None)
@given(case=tables(), data=st.data())
def test_write_locations_match_a_loop(
    case: tuple[list[list[int]], list[int], int], data: st.DataObject
) -> None:
    table, lengths, page_size = case
    rows = [r for r, n in enumerate(lengths) if n > 0]
    table = [table[r] for r in rows]
    positions = [data.draw(st.integers(0, lengths[r] - 1)) for r in rows]
    got = write_locations(as_tensor(table), torch.tensor(positions, dtype=torch.int64), page_size, check=True)
    assert got.dtype is torch.int64
    assert got.tolist() == [slot(table, i, pos, page_size) for i, pos in enumerate(positions)]
    unchecked = write_any(as_tensor(table).numpy(), positions, page_size)  # numpy, list
    assert unchecked.tolist() == got.tolist()


@settings(deadline=None)
@given(case=tables(), data=st.data())
def test_extend_locations_match_a_loop(
    case: tuple[list[list[int]], list[int], int], data: st.DataObject
) -> None:
    table, lengths, page_size = case
    prefix = [data.draw(st.integers(0, n)) for n in lengths]
    extend = [n - p for n, p in zip(lengths, prefix, strict=True)]
    expected = [
        slot(table, r, pos, page_size) for r in range(len(table)) for pos in range(prefix[r], lengths[r])
    ]
    got = extend_locations(
        as_tensor(table), torch.tensor(prefix), torch.tensor(extend), page_size, check=True
    )
    assert got.dtype is torch.int64 and got.shape == (sum(extend),)
    assert got.tolist() == expected
    assert extend_any(as_tensor(table), prefix, extend, page_size).tolist() == expected


def test_decode_positions_per_row_and_several_tokens_per_row() -> None:
    table = torch.tensor([[3, 7, -1], [5, 6, 9]], dtype=torch.int32)
    assert write_locations(table, torch.tensor([17, 40]), 16).tolist() == [7 * 16 + 1, 9 * 16 + 8]
    spec = write_locations(table, torch.tensor([[15, 16], [31, 32]]), 16, check=True)
    assert spec.tolist() == [[3 * 16 + 15, 7 * 16], [6 * 16 + 15, 9 * 16]]


def test_shifted_table_with_offsets() -> None:
    # A sliding row captured from slot 2 on: positions shifted by 2 pages hit the same slots.
    absolute = torch.tensor([[0, 0, 4, 8]], dtype=torch.int32)
    window = absolute[:, 2:]
    pos = torch.tensor([50])
    assert write_locations(window, pos - 2 * 16, 16).tolist() == write_locations(absolute, pos, 16).tolist()


@pytest.mark.parametrize(
    ("positions", "match"),
    [
        ([20, 3], "row 1: position 3 is in page slot 0, which holds the null page 0 \\(a hole\\)"),
        ([20, 40], "row 1: position 40 is in page slot 2, which holds padding \\(-1\\)"),
        ([48, 16], "row 0: position 48 is in page slot 3, past the table's 3 columns"),
        ([-1, 16], "row 0: position -1 is negative"),
    ],
)
def test_write_check_names_the_row(positions: list[int], match: str) -> None:
    table = torch.tensor([[3, 7, 8], [0, 9, -1]], dtype=torch.int32)
    with pytest.raises(ValueError, match=match):
        write_locations(table, torch.tensor(positions), 16, check=True)


@pytest.mark.parametrize(
    ("prefix", "extend", "match"),
    [
        ([0, 0], [16, 1], "row 1: position 0 is in page slot 0, which holds the null page 0"),
        ([40, 16], [10, 1], "row 0: position 48 is in page slot 3, past the table's 3 columns"),
        ([0, 30], [1, 3], "row 1: position 32 is in page slot 2, which holds padding"),
        ([0, 0], [-1, 0], "row 0: extend_lens\\[0\\] = -1 is negative"),
        ([0, -2], [0, 0], "row 1: prefix_lens\\[1\\] = -2 is negative"),
    ],
)
def test_extend_check_names_the_row(prefix: list[int], extend: list[int], match: str) -> None:
    table = torch.tensor([[3, 7, 8], [0, 9, -1]], dtype=torch.int32)
    with pytest.raises(ValueError, match=match):
        extend_locations(table, torch.tensor(prefix), torch.tensor(extend), 16, check=True)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda t: write_locations(t, torch.tensor([1]), 16), ValueError, "positions must be \\[rows\\]"),
        (
            lambda t: write_locations(t, torch.tensor([1.0, 2.0]), 16),
            ValueError,
            "positions must hold integers",
        ),
        (lambda t: write_locations(t[0], torch.tensor([1]), 16), ValueError, "table must be 2-D"),
        (lambda t: write_locations(t.float(), torch.tensor([1, 2]), 16), ValueError, "integer page ids"),
        (lambda t: write_any([[1]], [1], 16), TypeError, "table must be a torch tensor"),
        (lambda t: write_locations(t, torch.tensor([1, 2]), 0), ValueError, "page_size must be >= 1"),
        (lambda t: extend_any(t, [0], [0, 0], 16), ValueError, "prefix_lens must be \\[rows\\]"),
        (lambda t: extend_any(t, [0, 0], [[0, 0]], 16), ValueError, "extend_lens must be \\[rows\\]"),
    ],
)
def test_argument_errors(call: Any, error: type[Exception], match: str) -> None:
    table = torch.tensor([[3, 7, 8], [0, 9, -1]], dtype=torch.int32)
    with pytest.raises(error, match=match):
        call(table)


def test_positions_on_another_device_are_refused() -> None:
    table = torch.tensor([[3]], dtype=torch.int32)
    positions = torch.tensor([0], device="meta")
    with pytest.raises(ValueError, match="positions is on meta but the table is on cpu"):
        write_locations(table, positions, 16)


def test_empty_batches() -> None:
    empty = torch.zeros((0, 0), dtype=torch.int32)
    assert write_locations(empty, torch.zeros(0, dtype=torch.int64), 16, check=True).shape == (0,)
    assert extend_any(empty, [], [], 16, check=True).shape == (0,)
