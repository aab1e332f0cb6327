"""Persistent block-table rows (docs/requests-api.md "Persistent rows"), done plainly.

Row ``s`` of the bound buffers shows the token-level request in slot ``s`` (a free slot's row
is padding). While rows are bound every live slot is below ``max_rows``: a new request that
would get a slot past the rows is refused (``add_request``) or not admitted (``admit``), and
binding fewer rows than a live request's slot is refused; unbinding keeps the slots.
``update_rows`` computes every bound row as ``block_tables`` would (a windowed sliding group:
``cols`` slots from the row's offset, which stays while no real page is before it and the
table ends within the row, else becomes 0 if that fits, else the first real page), diffs it
against the rows it wrote last time (``full=True``: against the buffers themselves), writes the
cells that differ and returns them. The native engine visits only the rows whose tables
changed; doing every row here is what makes the two comparable. A row whose slot was taken or
freed since the last update that succeeded is diffed against the buffer itself, as the native
engine compares a row it rewrites whole: a refused update in between leaves that row pending,
and the next good one makes a finished request's row padding whatever the buffer holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from flat_kvcache.errors import FlatUnavailableError
from flat_kvcache.reference.engine._args import as_flag, shown_id
from flat_kvcache.reference.engine.calls.tables import (
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


class Rows(Coordinator):
    """``bind_rows``, ``update_rows`` and ``unbind_rows``, and the slot limit bound rows set."""

    _binding: _Binding | None = None

    def bind_rows(self, tables: Any, *, offsets: Any = None) -> None:
        """Bind ``tables`` (group id -> int32 ``[max_rows, cols]``) and optional windowed ``offsets``.

        The buffers are filled with -1 (tables) and 0 (offsets). Row ``s`` shows the request in
        slot ``s``: every live slot must be below the new row count (ValueError naming the
        lowest one that is not); the live rows are written whole on the next update.
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
        outside = [slot for slot in self._id_at if slot >= max_rows]
        if outside:
            slot = min(outside)
            raise ValueError(
                f"bind_rows: request {shown_id(self._id_at[slot])} holds slot {slot}, but the new "
                f"tables have {max_rows} rows"
            )
        for array in buffers:
            array.fill(-1)
        for window in windows:
            if window is not None:
                window.fill(0)
        self._rows_handed.clear()
        self._binding = _Binding(
            tables=buffers,
            offsets=windows,
            written=[array.copy() for array in buffers],
            written_offsets=[None if w is None else w.copy() for w in windows],
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
        """Forget the bound rows; requests keep their slots."""
        self._binding = None

    @staticmethod
    def _max_rows(binding: _Binding) -> int:
        """The rows bound (as bound: a buffer's shape changed in place does not count)."""
        return int(binding.written[0].shape[0])

    def _slot_available(self) -> bool:
        """Whether a new request can take the next slot (with rows bound: one below ``max_rows``)."""
        return self._binding is None or self._next_slot() < self._max_rows(self._binding)

    def _check_slot_free(self, method: str) -> None:
        """ValueError for ``method`` when rows are bound and all their slots are held."""
        if not self._slot_available():
            assert self._binding is not None
            max_rows = self._max_rows(self._binding)
            raise ValueError(
                f"{method}: all {max_rows} slots of the bound rows are held (finish a request or "
                "bind more rows)"
            )

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
        max_rows = binding.tables[0].shape[0]
        handed = sorted(row for row in self._rows_handed if row < max_rows)
        self._rows_handed.clear()
        cells: dict[str, Int32Array] = {}
        offsets: dict[str, Int32Array] = {}
        for group, group_id in enumerate(self._group_ids):
            table, want = binding.tables[group], wanted[group][0]
            before = table if repair else binding.written[group].copy()
            if not repair and handed:
                before[handed] = table[handed]
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
        for row, key in sorted(self._id_at.items()):
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
                visible = self._view_ids(group, pages[offset:])
                wanted[group][0][row, : len(visible)] = visible
                window = wanted[group][1]
                if window is not None:
                    window[row] = offset
        return wanted
