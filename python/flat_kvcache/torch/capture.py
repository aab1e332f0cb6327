"""CUDA-graph capture buffers for the flat block tables, and cache write locations (private).

Public through :mod:`flat_kvcache.torch`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from flat_kvcache import PagedCacheGroupSpec, compute_max_logical_pages_for_capture
from flat_kvcache._types import CHUNKED_WINDOW, FULL_HISTORY, SLIDING_WINDOW, STATE
from flat_kvcache.torch._checks import DeviceLike, as_device, as_int, is_integer_dtype

__all__ = ["CaptureBuffers", "extend_locations", "write_locations"]


_INT32 = torch.iinfo(torch.int32)


class CaptureBuffers:
    """Fixed int32 block-table buffers for CUDA-graph capture, one per non-state group.

    Each buffer is ``[max_batch_size, width]``; :meth:`fill` copies a step's tables into the same
    storage every step, so a captured graph can read them. Two modes, two widths:

    * Absolute tables (the default). Rows are the cache's tables as they are, as
      ``block_tables(out=)`` writes them: slot ``i`` covers tokens ``[i * P, (i + 1) * P)`` in
      every group, holes included. A sliding-window table keeps growing (with holes in front) as
      a request runs past its window, so every non-state group's buffer, the sliding ones
      included, is as wide as the full-history capture width ``ceil((C + (D + 1) * N) / P)``
      (SPEC 2 and 12.1: the reservation horizon, not ``ceil(C / P)``), the width
      ``block_tables(out=)`` buffers and ``bind_rows`` tables need too. Any kernel that reads
      absolute tables works unchanged.
    * Windowed tables (``sliding_offsets=True``). A sliding group's buffer has the narrow sliding
      capture width of SPEC 2 (``compute_max_logical_pages_for_capture`` for the sliding spec,
      ``ceil((min(W, C) + horizon) / P) + 1``) and holds each row's last ``width`` slots;
      :meth:`page_offsets` gives, per row, the logical page of column 0. A kernel then sees
      positions shifted by ``offset * P``: pass it ``seq_lens - offset * P`` (the window mask is
      relative, so the attention is the same) and write at ``positions - offset * P`` with
      :func:`write_locations`. Full-history groups keep the full width. This narrow width is not
      a ``block_tables(out=)`` width: ``out=`` rows are absolute (``bind_rows(offsets=)`` is the
      windowed layout for persistent rows).

    A chunked local attention group (retention ``chunked_window``, Llama 4) is captured like a
    sliding group in the absolute mode: its table grows with holes in front, so its buffer has
    the full-history width. It is never windowed, even with ``sliding_offsets=True`` (its chunk
    mask ``p >= q - q % C`` needs absolute positions, which a shift by ``offset * P`` breaks
    unless the offset is a multiple of ``C / P``): windowed rows and offsets are sliding-only.

    ``flat-kvcache plan`` prints both widths of every group (``table width`` and ``windowed``).
    """

    def __init__(
        self,
        groups: Sequence[PagedCacheGroupSpec],
        max_batch_size: int,
        max_context_len: int,
        max_tokens_per_req: int = 1,
        overlap_schedule_depth: int = 0,
        *,
        device: DeviceLike | None = None,
        sliding_offsets: bool = False,
    ) -> None:
        self._max_batch_size = as_int(max_batch_size, "max_batch_size", minimum=1)
        target = torch.device("cpu") if device is None else as_device(device)
        self._state_groups = frozenset(g.group_id for g in groups if g.family == STATE)
        self._sliding = frozenset(g.group_id for g in groups if g.retention == SLIDING_WINDOW)
        # Tables that grow with holes in front: absolute ones need the full-history width.
        self._windowed_retention = frozenset(
            g.group_id for g in groups if g.retention in (SLIDING_WINDOW, CHUNKED_WINDOW)
        )
        self._buffers: dict[str, torch.Tensor] = {}
        self._offsets: dict[str, torch.Tensor] = {}
        for spec in groups:
            if spec.family == STATE:
                continue
            if spec.group_id in self._buffers:
                raise ValueError(f"group {spec.group_id!r} appears twice")
            windowed = sliding_offsets and spec.group_id in self._sliding
            # Absolute sliding (and chunked) tables grow like full-history ones: size them with
            # the full width.
            absolute_growing = not windowed and spec.group_id in self._windowed_retention
            sized = _as_full_history(spec) if absolute_growing else spec
            width = compute_max_logical_pages_for_capture(
                sized,
                max_context_len=max_context_len,
                max_tokens_per_req=max_tokens_per_req,
                overlap_schedule_depth=overlap_schedule_depth,
            )
            shape = (self._max_batch_size, width)
            self._buffers[spec.group_id] = torch.zeros(shape, dtype=torch.int32, device=target)
            if windowed:
                offsets = torch.zeros(self._max_batch_size, dtype=torch.int32, device=target)
                self._offsets[spec.group_id] = offsets

    @property
    def group_ids(self) -> tuple[str, ...]:
        """The captured (non-state) groups, in the given order."""
        return tuple(self._buffers)

    @property
    def max_batch_size(self) -> int:
        return self._max_batch_size

    def width(self, group_id: str) -> int:
        """Columns of a group's buffer."""
        return int(self.buffer(group_id).shape[1])

    def buffer(self, group_id: str) -> torch.Tensor:
        """The capture buffer of a group (the same tensor for the buffers' whole life)."""
        try:
            return self._buffers[group_id]
        except KeyError:
            raise KeyError(
                f"no capture buffer for group {group_id!r}; captured groups: {list(self._buffers)}"
            ) from None

    def page_offsets(self, group_id: str) -> torch.Tensor:
        """``[max_batch_size]`` int32: the logical page in column 0 of each row of a sliding group.

        Only with ``sliding_offsets=True`` and only for sliding-window groups (a chunked group is
        never windowed); 0 for rows that fit and for padding rows.
        """
        try:
            return self._offsets[group_id]
        except KeyError:
            raise KeyError(
                f"no page offsets for group {group_id!r}: only sliding-window groups have them, "
                "with sliding_offsets=True"
            ) from None

    def fill(self, tables: Mapping[str, Any], batch_size: int) -> None:
        """Copy a step's block tables (``FlatKVCache.block_tables``) into the buffers.

        Rows ``[0, batch_size)`` get each table's first ``batch_size`` rows with the columns
        past the table padded with -1; rows ``[batch_size, max_batch_size)`` (graph padding) get
        the null page 0. Tables of state groups are ignored. Everything is validated before
        anything is written, so a failing call leaves the buffers as they were.

        Raises
        ------
        ValueError
            ``batch_size`` out of range; a captured group without a table; a table for an unknown
            group; a table that is not a 2-D integer array, has fewer than ``batch_size`` rows,
            holds values outside int32, or is wider than its buffer (with ``sliding_offsets``: a
            sliding row whose live pages do not fit in the buffer). Messages name the group.
        """
        batch = as_int(batch_size, "batch_size", minimum=0)
        if batch > self._max_batch_size:
            raise ValueError(f"batch_size {batch} exceeds max_batch_size {self._max_batch_size}")
        for group_id in tables:
            if group_id not in self._buffers and group_id not in self._state_groups:
                raise ValueError(
                    f"block table for unknown group {group_id!r}; captured groups: {list(self._buffers)}"
                )
        prepared: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
        for group_id, buffer in self._buffers.items():
            if group_id not in tables:
                raise ValueError(f"block table for captured group {group_id!r} is missing")
            rows = _table_rows(tables[group_id], group_id, batch)
            width = int(buffer.shape[1])
            if group_id in self._offsets:
                prepared[group_id] = _tail_window(rows, group_id, width)
            elif rows.shape[1] > width:
                raise ValueError(
                    f"block table for group {group_id!r} has {rows.shape[1]} columns, wider than its "
                    f"capture buffer ({width}): a request longer than the max_context_len it was "
                    "built for?"
                )
            else:
                prepared[group_id] = (rows, None)
        for group_id, (rows, starts) in prepared.items():
            buffer = self._buffers[group_id]
            cols = int(rows.shape[1])
            buffer[:batch, :cols].copy_(rows)
            buffer[:batch, cols:].fill_(-1)
            buffer[batch:].fill_(0)
            if starts is not None:
                offsets = self._offsets[group_id]
                offsets[:batch].copy_(starts)
                offsets[batch:].fill_(0)

    def __repr__(self) -> str:
        widths = {g: int(b.shape[1]) for g, b in self._buffers.items()}
        return f"CaptureBuffers(max_batch_size={self._max_batch_size}, widths={widths})"


def _as_full_history(spec: PagedCacheGroupSpec) -> PagedCacheGroupSpec:
    """The same group with full-history retention: the capture width of an absolute table."""
    return dataclasses.replace(spec, retention=FULL_HISTORY, sliding_window_tokens=None)


def _table_rows(table: Any, group_id: str, batch: int) -> torch.Tensor:
    """The first ``batch`` rows of a block table as a tensor, checked for :meth:`CaptureBuffers.fill`."""
    if isinstance(table, np.ndarray):
        if not np.issubdtype(table.dtype, np.integer):
            raise ValueError(f"block table for group {group_id!r} must be integer, got dtype {table.dtype}")
        source = torch.from_numpy(np.ascontiguousarray(table))
    elif isinstance(table, torch.Tensor):
        if not is_integer_dtype(table.dtype):
            raise ValueError(f"block table for group {group_id!r} must be integer, got dtype {table.dtype}")
        source = table
    else:
        raise ValueError(
            f"block table for group {group_id!r} must be a numpy array or torch tensor, "
            f"not {type(table).__name__}"
        )
    if source.dim() != 2:
        raise ValueError(f"block table for group {group_id!r} must be 2-D, got shape {tuple(source.shape)}")
    if source.shape[0] < batch:
        raise ValueError(
            f"block table for group {group_id!r} has {source.shape[0]} rows, fewer than batch_size {batch}"
        )
    source = source[:batch]
    if source.dtype != torch.int32 and source.numel():
        low, high = int(source.min()), int(source.max())
        if low < _INT32.min or high > _INT32.max:
            raise ValueError(
                f"block table for group {group_id!r} holds values outside int32 (from {low} to {high})"
            )
    return source


def _tail_window(rows: torch.Tensor, group_id: str, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's last ``width`` slots and the slot they start at; earlier slots must be holes."""
    count, cols = int(rows.shape[0]), int(rows.shape[1])
    if cols <= width:
        return rows, torch.zeros(count, dtype=torch.int32, device=rows.device)
    lengths = (rows != -1).sum(dim=1)  # padding (-1) sits at the end of shorter rows
    starts = (lengths - width).clamp(min=0)
    slots = torch.arange(cols, device=rows.device)
    dropped = (slots[None, :] < starts[:, None]) & (rows > 0)
    if bool(dropped.any()):
        row, slot = (int(i) for i in torch.nonzero(dropped)[0])
        raise ValueError(
            f"block table for group {group_id!r}: row {row} holds page {int(rows[row, slot])} at slot "
            f"{slot}, before the last {width} slots its capture buffer holds (reclaim slid-out pages first)"
        )
    index = starts[:, None] + torch.arange(width, device=rows.device)[None, :]
    window = torch.gather(rows, 1, index.clamp(max=cols - 1))
    window = torch.where(index < cols, window, torch.full_like(window, -1))
    return window, starts.to(torch.int32)


# ---------------------------------------------------------------------------------------------
# Write locations
# ---------------------------------------------------------------------------------------------


def _as_table(table: Any) -> torch.Tensor:
    source = torch.from_numpy(np.ascontiguousarray(table)) if isinstance(table, np.ndarray) else table
    if not isinstance(source, torch.Tensor):
        raise TypeError(f"table must be a torch tensor or numpy array, not {type(table).__name__}")
    if source.dim() != 2:
        raise ValueError(f"table must be 2-D [rows, pages], got shape {tuple(source.shape)}")
    if not is_integer_dtype(source.dtype):
        raise ValueError(f"table must hold integer page ids, got dtype {source.dtype}")
    return source


def _as_index(value: Any, name: str, device: torch.device) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        if value.device != device:
            raise ValueError(f"{name} is on {value.device} but the table is on {device}")
        tensor = value
    else:
        tensor = torch.as_tensor(np.asarray(value), device=device)
    if not is_integer_dtype(tensor.dtype) and tensor.numel():  # an empty list is float by default
        raise ValueError(f"{name} must hold integers, got dtype {tensor.dtype}")
    return tensor.long()


def _check_pages(
    table: torch.Tensor, row_of: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    """The page of every (row, position), raising ValueError for the first one a write may not use."""
    cols = table.shape[1]
    inside = (slots >= 0) & (slots < cols)
    pages = table[row_of, slots.clamp(0, max(cols - 1, 0))].long() if cols else torch.zeros_like(slots)
    bad = ~inside | (pages <= 0)
    if bool(bad.any()):
        i = int(torch.nonzero(bad)[0, 0])
        row, pos, slot = int(row_of[i]), int(positions[i]), int(slots[i])
        if pos < 0:
            raise ValueError(f"row {row}: position {pos} is negative")
        if not bool(inside[i]):
            raise ValueError(
                f"row {row}: position {pos} is in page slot {slot}, past the table's {cols} columns"
            )
        page = int(pages[i])
        what = "the null page 0 (a hole)" if page == 0 else f"padding ({page})"
        raise ValueError(f"row {row}: position {pos} is in page slot {slot}, which holds {what}")
    return pages


def write_locations(
    table: torch.Tensor, positions: torch.Tensor, page_size: int, *, check: bool = False
) -> torch.Tensor:
    """Cache slots to write: ``table[r, pos // P] * P + pos % P`` for every position of row ``r``.

    ``positions`` is ``[rows]`` (decode: one token per row) or ``[rows, n]`` (n tokens per row).
    The result is int64 with the shape of ``positions``, on the table's device. With
    ``check=True`` every written page must be a real page (> 0) inside the row, else ValueError
    names the row (this synchronises with the device; leave it off in the hot path).
    """
    table = _as_table(table)
    pos = _as_index(positions, "positions", table.device)
    size = as_int(page_size, "page_size", minimum=1)
    if pos.dim() not in (1, 2) or pos.shape[0] != table.shape[0]:
        raise ValueError(
            f"positions must be [rows] or [rows, n] with rows = {table.shape[0]} (the table's rows), "
            f"got shape {tuple(pos.shape)}"
        )
    flat = pos if pos.dim() == 2 else pos.unsqueeze(1)
    slots = torch.div(flat, size, rounding_mode="floor")
    if check:
        row_of = torch.arange(flat.shape[0], device=table.device).repeat_interleave(flat.shape[1])
        pages = _check_pages(table, row_of, flat.reshape(-1), slots.reshape(-1)).view_as(flat)
    else:
        pages = torch.gather(table, 1, slots).long()
    return (pages * size + flat.remainder(size)).view_as(pos)


def extend_locations(
    table: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    page_size: int,
    *,
    check: bool = False,
) -> torch.Tensor:
    """Cache slots of an extend (prefill) step, all rows concatenated.

    Row ``r`` writes positions ``prefix_lens[r] .. prefix_lens[r] + extend_lens[r] - 1``; the
    result is the int64 ``[sum(extend_lens)]`` vector of their slots in row order. ``check=True``
    as in :func:`write_locations`, and also rejects negative lengths. The output length is data
    dependent, so on CUDA this waits for the device once (it is not for graph capture; decode
    steps use :func:`write_locations`, which is).
    """
    table = _as_table(table)
    prefix = _as_index(prefix_lens, "prefix_lens", table.device)
    extend = _as_index(extend_lens, "extend_lens", table.device)
    size = as_int(page_size, "page_size", minimum=1)
    rows = table.shape[0]
    for name, lens in (("prefix_lens", prefix), ("extend_lens", extend)):
        if lens.dim() != 1 or lens.shape[0] != rows:
            raise ValueError(f"{name} must be [rows] with rows = {rows}, got shape {tuple(lens.shape)}")
    if check:
        for name, lens in (("prefix_lens", prefix), ("extend_lens", extend)):
            negative = torch.nonzero(lens < 0)
            if negative.numel():
                row = int(negative[0, 0])
                raise ValueError(f"row {row}: {name}[{row}] = {int(lens[row])} is negative")
    row_of = torch.repeat_interleave(torch.arange(rows, device=table.device), extend)
    starts = torch.cumsum(extend, 0) - extend
    offsets = torch.arange(row_of.shape[0], device=table.device) - starts[row_of]
    positions = prefix[row_of] + offsets
    slots = torch.div(positions, size, rounding_mode="floor")
    pages = _check_pages(table, row_of, positions, slots) if check else table[row_of, slots].long()
    return pages * size + positions.remainder(size)
