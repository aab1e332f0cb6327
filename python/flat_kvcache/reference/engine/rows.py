"""Persistent block-table rows (docs/requests-api.md "Persistent rows"), done plainly.

A token-level request added with ``row=k`` owns row ``k`` of the bound buffers until it is
freed. ``update_rows`` computes every bound row as :meth:`block_tables` would (a windowed
sliding group: ``cols`` slots from the row's offset, which stays while no real page is before
it and the table ends within the row, else becomes 0 if that fits, else the first real
page), diffs it against
the rows it wrote last time (``full=True``: against the buffers themselves), writes the cells
that differ and returns them. The native engine visits only the rows whose tables changed;
doing every row here is what makes the two comparable.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from flat_kvcache.errors import FlatUnavailableError
from flat_kvcache.reference.engine._args import RequestId, as_count, as_flag, as_request_id, shown_id
from flat_kvcache.reference.engine.block_tables import (
    FLAT_OFF_MESSAGE,
    check_int32_buffer,
    cpu_array,
    flat_build_enabled,
    out_buffers,
)
from flat_kvcache.reference.engine.coordinator import Coordinator

__all__ = ["Rows"]

Int32Array = npt.NDArray[np.int32]


@dataclass
class _Binding:
    """The bound buffers and what the last update wrote into them."""

    tables: list[Int32Array]
    offsets: list[Int32Array | None]
    written: list[Int32Array]
    written_offsets: list[Int32Array | None]
    #: row -> the request that owns it
    owners: dict[int, RequestId]


class Rows(Coordinator):
    """``bind_rows``, ``update_rows``, ``row_of`` and ``unbind_rows``."""

    _binding: _Binding | None = None

    def bind_rows(self, tables: Any, *, offsets: Any = None) -> None:
        """Bind ``tables`` (group id -> int32 ``[max_rows, cols]``) and optional windowed ``offsets``.

        The buffers are filled with -1 (tables) and 0 (offsets). Requests that hold a row keep
        it (it must be below the new row count) and are rewritten whole on the next update.
        """
        if not flat_build_enabled():
            raise FlatUnavailableError(FLAT_OFF_MESSAGE)
        buffers = out_buffers(tables, self._group_ids, "tables", "bind_rows")
        max_rows = buffers[0].shape[0]
        for group_id, array in zip(self._group_ids, buffers, strict=True):
            if array.shape[0] != max_rows:
                raise ValueError(
                    f"tables[{group_id!r}] has {array.shape[0]} rows but tables[{self._group_ids[0]!r}] "
                    f"has {max_rows}: every group needs the same rows"
                )
        windows = self._offset_buffers(offsets, max_rows, buffers)
        owners = dict(self._binding.owners) if self._binding is not None else {}
        for row, key in sorted(owners.items()):
            if row >= max_rows:
                raise ValueError(
                    f"bind_rows: request {shown_id(key)} holds row {row}, but the new tables have "
                    f"{max_rows} rows"
                )
        for array in buffers:
            array.fill(-1)
        for window in windows:
            if window is not None:
                window.fill(0)
        self._binding = _Binding(
            tables=buffers,
            offsets=windows,
            written=[array.copy() for array in buffers],
            written_offsets=[None if w is None else w.copy() for w in windows],
            owners=owners,
        )

    def _offset_buffers(
        self, offsets: Any, max_rows: int, tables: list[Int32Array]
    ) -> list[Int32Array | None]:
        """Each group's offsets buffer (None: not windowed), checked."""
        if offsets is None:
            return [None] * len(self._group_ids)
        if not hasattr(offsets, "keys") or not hasattr(offsets, "__getitem__"):
            raise TypeError(
                "offsets must be a mapping of sliding-window group id to int32 array, "
                f"got {type(offsets).__name__}"
            )
        for key in offsets:
            if key not in self._group_ids:
                ids = ", ".join(repr(g) for g in self._group_ids)
                raise ValueError(
                    f"offsets has a buffer for {key!r}, which is not a group of this cache ({ids})"
                )
        result: list[Int32Array | None] = []
        seen: list[Int32Array] = list(tables)
        for spec, group_id in zip(self._specs, self._group_ids, strict=True):
            if group_id not in offsets:
                result.append(None)
                continue
            label = f"offsets[{group_id!r}]"
            if spec.kind != "sliding_window":
                raise ValueError(
                    f"{label}: only sliding-window groups have windowed rows, and {group_id!r} is a "
                    f"{spec.kind} group"
                )
            item = cpu_array(offsets[group_id], label)
            if item.ndim != 1 or item.shape[0] != max_rows:
                raise ValueError(
                    f"{label} must be 1-D with one value per row ({max_rows}), got shape {list(item.shape)}"
                )
            check_int32_buffer(item, label)
            if any(np.shares_memory(item, other) for other in seen):
                raise ValueError(f"{label} shares its memory with another bound buffer")
            seen.append(item)
            result.append(item)
        return result

    def unbind_rows(self) -> None:
        """Forget the bound rows: requests keep no rows."""
        self._binding = None

    def row_of(self, req: RequestId) -> int | None:
        """The row ``req`` holds, or None (``UnknownRequestError`` for an unknown id)."""
        key = as_request_id(req)
        self._tables(key)
        if self._binding is None:
            return None
        return next((row for row, owner in self._binding.owners.items() if owner == key), None)

    def _row_owner(self, method: str, row: int) -> RequestId:
        """The request holding ``row`` (ValueError for ``method`` if none does)."""
        if self._binding is None:
            raise ValueError(f"{method}: no rows are bound (call bind_rows first)")
        owner = self._binding.owners.get(row)
        if owner is None:
            raise ValueError(f"{method}: row {row} holds no request")
        return owner

    def _check_row_free(self, row: object) -> int:
        """The row a new request asks for, checked: bound, in range, not held."""
        index = as_count(row, "row")
        if self._binding is None:
            raise ValueError("row: no rows are bound (call bind_rows first)")
        max_rows = self._binding.tables[0].shape[0]
        if index >= max_rows:
            raise ValueError(f"row must be < {max_rows} (the bound tables' rows), got {index}")
        if index in self._binding.owners:
            raise ValueError(f"row {index} is held by request {shown_id(self._binding.owners[index])}")
        return index

    def _assign_row(self, key: RequestId, row: int) -> None:
        assert self._binding is not None
        self._binding.owners[row] = key

    def _vacate_row(self, key: RequestId) -> None:
        """The request is gone: its row (if any) goes back to padding on the next update."""
        if self._binding is not None:
            for row, owner in list(self._binding.owners.items()):
                if owner == key:
                    del self._binding.owners[row]

    def update_rows(self, *, full: bool = False) -> tuple[dict[str, Int32Array], dict[str, Int32Array]]:
        """Write the cells that changed; return them and the changed offsets.

        ``({g: [3, n] (row, col, value)}, {g: [2, m] (row, offset)})``, as the native engine.
        """
        if not flat_build_enabled():
            raise FlatUnavailableError(FLAT_OFF_MESSAGE)
        repair = as_flag(full, "full")
        binding = self._binding
        if binding is None:
            raise ValueError("update_rows: no rows are bound (call bind_rows first)")
        self._check_bound_buffers(binding)
        wanted = self._wanted_rows(binding)
        cells: dict[str, Int32Array] = {}
        offsets: dict[str, Int32Array] = {}
        for group, group_id in enumerate(self._group_ids):
            table, want = binding.tables[group], wanted[group][0]
            before = table if repair else binding.written[group]
            rows, cols = np.nonzero(before != want)
            table[rows, cols] = want[rows, cols]
            binding.written[group] = want
            cells[group_id] = np.stack([rows, cols, want[rows, cols]]).astype(np.int32).reshape(3, -1)
            window, want_offsets = binding.offsets[group], wanted[group][1]
            if window is not None:
                last = binding.written_offsets[group]
                assert last is not None and want_offsets is not None
                (changed,) = np.nonzero((window if repair else last) != want_offsets)
                window[changed] = want_offsets[changed]
                binding.written_offsets[group] = want_offsets
                offsets[group_id] = np.stack([changed, want_offsets[changed]]).astype(np.int32).reshape(2, -1)
        return cells, offsets

    def _check_bound_buffers(self, binding: _Binding) -> None:
        """Refuse the update before anything is written if a bound buffer changed in place.

        numpy lets a caller change an array's dtype, shape, strides or writability after
        ``bind_rows``; each buffer (tables, then offsets, in group order) must still be a
        writable C-contiguous int32 array of its bound shape.
        """
        max_rows = binding.written[0].shape[0]
        named: list[tuple[str, Int32Array, tuple[int, ...]]] = [
            (f"tables[{group_id!r}]", table, written.shape)
            for group_id, table, written in zip(self._group_ids, binding.tables, binding.written, strict=True)
        ]
        named += [
            (f"offsets[{group_id!r}]", window, (max_rows,))
            for group_id, window in zip(self._group_ids, binding.offsets, strict=True)
            if window is not None
        ]
        for label, array, shape in named:
            if array.dtype != np.int32 or array.shape != shape or not array.flags.c_contiguous:
                raise ValueError(
                    f"update_rows: {label} was changed after bind_rows: it must stay a C-contiguous int32 "
                    f"array of shape {list(shape)} (bind it again)"
                )
            if not array.flags.writeable:
                raise ValueError(f"update_rows: {label} is read-only now (bound buffers must stay writable)")

    def _wanted_rows(self, binding: _Binding) -> list[tuple[Int32Array, Int32Array | None]]:
        """Every group's rows (and offsets) as they should be; errors before anything is written."""
        max_rows = binding.tables[0].shape[0]
        wanted = [
            (
                np.full(table.shape, -1, dtype=np.int32),
                None if window is None else np.zeros(max_rows, np.int32),
            )
            for table, window in zip(binding.tables, binding.offsets, strict=True)
        ]
        for row, key in sorted(binding.owners.items()):
            for group, group_id in enumerate(self._group_ids):
                pages = self._requests[key][group].pages
                cols = binding.tables[group].shape[1]
                offset = 0
                last_offsets = binding.written_offsets[group]
                if last_offsets is not None:
                    # Keep the offset while it fits, else 0, else the first real page.
                    first = next((slot for slot, page in enumerate(pages) if page != 0), len(pages))
                    candidates = (int(last_offsets[row]), 0, first)
                    fits = [o for o in candidates if o <= first and len(pages) - o <= cols]
                    if not fits:
                        raise ValueError(
                            f"update_rows: row {row} (request {shown_id(key)}) of windowed group "
                            f"{group_id!r} shows slots from {len(pages) - cols}, but slot {first} still "
                            f"holds page {pages[first]} (reclaim slid-out pages first, or bind wider rows)"
                        )
                    offset = fits[0]
                elif len(pages) > cols:
                    raise ValueError(
                        f"update_rows: tables[{group_id!r}] has {cols} columns but request {shown_id(key)} "
                        f"(row {row}) has {len(pages)} pages in that group"
                    )
                visible = pages[offset:]
                wanted[group][0][row, : len(visible)] = visible
                window = wanted[group][1]
                if window is not None:
                    window[row] = offset
        return wanted
