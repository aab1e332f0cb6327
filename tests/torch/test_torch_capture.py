"""CaptureBuffers: SPEC 12.1 widths, fill (padding, same storage) and each of its errors."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from helpers import missing

try:
    import torch
except ImportError as exc:
    missing("torch", exc)

import flat_kvcache
from flat_kvcache import reference as ref
from flat_kvcache.torch import CaptureBuffers, write_locations

pytestmark = pytest.mark.torch

PAGE = 16
LAYERS = ("linear_attention", "sliding_attention", "full_attention")
GROUPS = ref.group_specs_from_layer_types(LAYERS, 64, page_size=PAGE)


def capture(**kwargs: Any) -> CaptureBuffers:
    return CaptureBuffers(GROUPS, **{"max_batch_size": 4, "max_context_len": 1024, **kwargs})


def tables(rows: int = 2, sliding_cols: int = 2, full_cols: int = 3) -> dict[str, np.ndarray]:
    full = np.arange(1, rows * full_cols + 1, dtype=np.int32).reshape(rows, full_cols)
    sliding = np.arange(100, 100 + rows * sliding_cols, dtype=np.int32).reshape(rows, sliding_cols)
    return {"linear_attention": full.copy(), "sliding_attention": sliding, "full_attention": full}


def full_width(tokens: int = 1, depth: int = 0, context: int = 1024) -> int:
    """The full-history capture width of SPEC 2, ceil((C + (D + 1) * N) / P), computed here."""
    return -(-(context + (depth + 1) * tokens) // PAGE)


@pytest.mark.parametrize(("tokens", "depth"), [(1, 0), (1, 1), (4, 1), (3, 0)])
def test_widths_are_the_capture_widths(tokens: int, depth: int) -> None:
    buffers = capture(max_tokens_per_req=tokens, overlap_schedule_depth=depth)
    assert buffers.group_ids == ("sliding_attention", "full_attention")  # the state group is not captured
    # Absolute tables (default): every captured group, sliding included, gets the full-history width.
    for spec in GROUPS[1:]:
        assert buffers.width(spec.group_id) == full_width(tokens, depth)
        assert buffers.buffer(spec.group_id).shape == (4, full_width(tokens, depth))
        assert buffers.buffer(spec.group_id).dtype is torch.int32
    # Never narrower than ceil(C / P) (SPEC 12.1: the reservation horizon needs more).
    assert buffers.width("full_attention") >= 1024 // PAGE
    assert "CaptureBuffers(max_batch_size=4" in repr(buffers)
    # Windowed tables: the sliding group gets the narrow width ceil((min(W, C) + horizon) / P) + 1.
    windowed = capture(max_tokens_per_req=tokens, overlap_schedule_depth=depth, sliding_offsets=True)
    assert windowed.width("sliding_attention") == -(-(64 + (depth + 1) * tokens) // PAGE) + 1
    assert windowed.width("sliding_attention") == ref.compute_max_logical_pages_for_capture(
        GROUPS[1], max_context_len=1024, max_tokens_per_req=tokens, overlap_schedule_depth=depth
    )
    assert windowed.width("full_attention") == full_width(tokens, depth)


def test_fill_copies_and_pads() -> None:
    buffers = capture()
    step = tables()
    step["full_attention"][1, 2] = -1  # a shorter row, padded by block_tables
    buffers.fill(step, batch_size=2)
    full = buffers.buffer("full_attention")
    width = full.shape[1]
    assert full[:2, :3].tolist() == step["full_attention"].tolist()
    assert (full[:2, 3:] == -1).all()
    assert (full[2:] == 0).all()
    sliding = buffers.buffer("sliding_attention")
    assert sliding[:2, :2].tolist() == step["sliding_attention"].tolist()
    assert (sliding[:2, 2:] == -1).all() and (sliding[2:] == 0).all()
    assert width == buffers.width("full_attention")


def test_fill_reuses_the_same_storage_every_step() -> None:
    buffers = capture()
    before = {g: (buffers.buffer(g), buffers.buffer(g).data_ptr()) for g in buffers.group_ids}
    buffers.fill(tables(rows=4, sliding_cols=1, full_cols=5), batch_size=4)
    buffers.fill(tables(rows=1), batch_size=1)
    buffers.fill({g: np.zeros((0, 0), np.int32) for g in buffers.group_ids}, batch_size=0)
    for group_id, (tensor, ptr) in before.items():
        assert buffers.buffer(group_id) is tensor and tensor.data_ptr() == ptr
        assert (tensor == 0).all()  # batch 0: every row is graph padding


def test_fill_accepts_tensors_wider_ints_and_extra_rows() -> None:
    buffers = capture()
    step = {
        "sliding_attention": torch.tensor([[5, 6], [7, 8], [9, 9]]),  # int64, one extra row
        "full_attention": np.array([[1, 2, 3], [4, 5, -1]], dtype=np.int64)[:, ::-1],  # non-contiguous
    }
    buffers.fill(step, batch_size=2)
    assert buffers.buffer("sliding_attention")[:3, :2].tolist() == [[5, 6], [7, 8], [0, 0]]
    assert buffers.buffer("full_attention")[:2, :3].tolist() == [[3, 2, 1], [-1, 5, 4]]


#: Flat per-group block tables need the `flat` cargo feature (SPEC 10); CI builds it on.
needs_flat = pytest.mark.skipif(not flat_kvcache.FLAT_KVCACHE, reason="built without the flat feature")


def flat_step(*reqs: str) -> dict[str, np.ndarray]:
    """Block tables from a flat cache: "a" holds 40 tokens, "b" ran past the 64-token window
    and reclaimed its first two sliding pages."""
    cache = ref.PageCache(ref.kv_cache_specs(GROUPS), 64)
    assert cache.acquire("a", 40) and cache.acquire("b", 100)
    cache.reclaim("b", 100)
    return cache.block_tables(list(reqs or ("a", "b")))


@needs_flat
def test_fill_from_flat_block_tables() -> None:
    step = flat_step("a", "a")
    buffers = capture()
    buffers.fill(step, batch_size=2)
    for group_id in buffers.group_ids:
        table = step[group_id]
        assert buffers.buffer(group_id)[:2, : table.shape[1]].tolist() == table.tolist()


@needs_flat
def test_default_buffers_hold_long_sliding_requests() -> None:
    step = flat_step()
    assert step["sliding_attention"][1, :2].tolist() == [0, 0]  # holes
    assert step["sliding_attention"].shape[1] == 7 > capture(sliding_offsets=True).width("sliding_attention")
    buffers = capture()
    buffers.fill(step, batch_size=2)
    sliding = step["sliding_attention"]
    assert buffers.buffer("sliding_attention")[:2, :7].tolist() == sliding.tolist()
    assert (buffers.buffer("sliding_attention")[:2, 7:] == -1).all()


@needs_flat
def test_default_buffers_hold_a_request_at_the_context_limit() -> None:
    # A request of C = 4096 tokens on a 64-token window, page 16: its sliding table has 256
    # columns (252 of them holes after reclaim), far wider than the window's 6 columns.
    groups = ref.group_specs_from_layer_types(["sliding_attention", "full_attention"], 64, page_size=PAGE)
    cache = ref.PageCache(ref.kv_cache_specs(groups), 600)
    assert cache.acquire("long", 4096)
    cache.reclaim("long", 4096)
    assert cache.acquire("short", 100)
    step = cache.block_tables(["long", "short"])
    assert step["sliding_attention"].shape[1] == 256 and (step["sliding_attention"][0, :252] == 0).all()
    buffers = CaptureBuffers(groups, max_batch_size=2, max_context_len=4096)
    assert buffers.width("sliding_attention") == buffers.width("full_attention") == full_width(context=4096)
    buffers.fill(step, batch_size=2)
    for group_id in buffers.group_ids:
        assert buffers.buffer(group_id)[:, :256].tolist() == step[group_id].tolist()
    with pytest.raises(
        ValueError, match=r"'sliding_attention' has 258 columns, wider than its capture buffer \(257\)"
    ):
        buffers.fill({g: np.ones((2, 258), np.int32) for g in buffers.group_ids}, batch_size=2)


@needs_flat
def test_sliding_offsets_capture_each_rows_tail() -> None:
    step = flat_step()
    buffers = capture(sliding_offsets=True)
    buffers.buffer("sliding_attention").fill_(9)
    buffers.page_offsets("sliding_attention").fill_(9)
    buffers.fill(step, batch_size=2)
    sliding, full = step["sliding_attention"], step["full_attention"]
    assert buffers.page_offsets("sliding_attention").tolist() == [0, 1, 0, 0]
    window = buffers.buffer("sliding_attention")
    assert window[0].tolist() == [*sliding[0, :3].tolist(), -1, -1, -1]  # "a" fits: not shifted
    assert window[1].tolist() == sliding[1, 1:].tolist()  # "b": slots 1..6
    assert (window[2:] == 0).all()
    assert buffers.buffer("full_attention")[:2, : full.shape[1]].tolist() == full.tolist()
    with pytest.raises(KeyError, match="only sliding-window groups"):
        buffers.page_offsets("full_attention")
    # Positions shifted by the offset address the same cache slots as the absolute table.
    positions = torch.tensor([39, 99])
    offsets = buffers.page_offsets("sliding_attention")[:2].long()
    shifted = write_locations(window[:2], positions - offsets * PAGE, PAGE, check=True)
    assert (
        shifted.tolist() == write_locations(torch.from_numpy(sliding), positions, PAGE, check=True).tolist()
    )


@needs_flat
def test_sliding_offsets_refuse_to_drop_a_live_page() -> None:
    cache = ref.PageCache(ref.kv_cache_specs(GROUPS), 64)
    assert cache.acquire("b", 100)  # not reclaimed: slot 0 still holds a page
    step = cache.block_tables(["b"])
    with pytest.raises(
        ValueError, match=r"'sliding_attention': row 0 holds page \d+ at slot 0, before the last 6"
    ):
        capture(sliding_offsets=True).fill(step, batch_size=1)


@pytest.mark.parametrize(
    ("edit", "batch", "match"),
    [
        ({"full_attention": None}, 2, "block table for captured group 'full_attention' is missing"),
        ({"other": np.zeros((2, 1), np.int32)}, 2, "block table for unknown group 'other'"),
        (
            {"sliding_attention": np.zeros((2, 100), np.int32)},
            2,
            "'sliding_attention' has 100 columns, wider than its capture buffer \\(65\\)",
        ),
        (
            {"full_attention": np.zeros((1, 3), np.int32)},
            2,
            "'full_attention' has 1 rows, fewer than batch_size 2",
        ),
        ({"full_attention": np.zeros((2, 3), np.float32)}, 2, "'full_attention' must be integer"),
        ({"full_attention": torch.zeros((2, 3), dtype=torch.bool)}, 2, "'full_attention' must be integer"),
        ({"full_attention": np.zeros(3, np.int32)}, 2, "'full_attention' must be 2-D"),
        ({"full_attention": [[1, 2]]}, 2, "'full_attention' must be a numpy array or torch tensor"),
        ({"full_attention": np.full((2, 3), 1 << 40)}, 2, "'full_attention' holds values outside int32"),
        ({}, 5, "batch_size 5 exceeds max_batch_size 4"),
        ({}, -1, "batch_size must be >= 0"),
    ],
)
def test_fill_errors_change_nothing(edit: dict[str, Any], batch: int, match: str) -> None:
    buffers = capture()
    buffers.fill(tables(), batch_size=2)
    before = {g: buffers.buffer(g).clone() for g in buffers.group_ids}
    step: dict[str, Any] = {**tables(rows=2, sliding_cols=1, full_cols=1), **edit}
    step = {g: t for g, t in step.items() if t is not None}
    with pytest.raises(ValueError, match=match):
        buffers.fill(step, batch_size=batch)
    for group_id, saved in before.items():
        assert torch.equal(buffers.buffer(group_id), saved)


def test_constructor_errors() -> None:
    with pytest.raises(ValueError, match="max_batch_size must be >= 1"):
        capture(max_batch_size=0)
    with pytest.raises(ValueError, match="max_tokens_per_req must be > 0"):
        capture(max_tokens_per_req=0)
    with pytest.raises(ValueError, match="overlap_schedule_depth must be 0 or 1"):
        capture(overlap_schedule_depth=2)
    with pytest.raises(ValueError, match="group 'full_attention' appears twice"):
        CaptureBuffers([*GROUPS, GROUPS[-1]], max_batch_size=1, max_context_len=16)
    with pytest.raises(KeyError, match="no capture buffer for group 'linear_attention'"):
        capture().buffer("linear_attention")
