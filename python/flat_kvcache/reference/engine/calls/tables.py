"""Flat per-group block tables for a batch (SPEC 8), refused without the ``flat`` build feature (SPEC 10)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from flat_kvcache.errors import FlatUnavailableError
from flat_kvcache.reference.engine.coordinator import Coordinator
from flat_kvcache.reference.engine.table import Table

__all__ = [
    "FLAT_OFF_MESSAGE",
    "BlockTables",
    "check_int32_buffer",
    "cpu_array",
    "flat_build_enabled",
    "out_buffers",
]

FLAT_OFF_MESSAGE = (
    "flat per-group block tables are unavailable: this build of flat_kvcache was compiled "
    "without the `flat` cargo feature"
)


def flat_build_enabled() -> bool:
    """The native build flag, read at call time (SPEC 10); False if the native module is missing."""
    try:
        from flat_kvcache import _native
    except ImportError:
        return False
    return bool(_native.FLAT_KVCACHE)


class BlockTables(Coordinator):
    """What ``block_tables`` does once the requests are named: every group's table of a batch.

    Each class names its requests its own way (``FlatKVCache`` by slot, ``PageCache`` by id)
    and defines the public ``block_tables`` on top of :meth:`_block_tables`.
    """

    @staticmethod
    def _check_flat_build() -> None:
        """Unavailable without the ``flat`` build feature (SPEC 10): never a silent fallback."""
        if not flat_build_enabled():
            raise FlatUnavailableError(FLAT_OFF_MESSAGE)

    def _block_tables(
        self, resolve: Callable[[], list[list[Table]]], name: Callable[[int], str], out: Any
    ) -> Any:
        """Flat per-group block tables for a batch (SPEC 8): ``{group_id: int32 [len(rows), cols]}``.

        ``resolve()`` looks up each row's tables (raising for a request it does not find);
        ``name(r)`` names row ``r``'s request in an error. ``cols`` is the longest of those
        tables in the group; holes are 0 and padding past a row's end is -1; rows follow the
        batch (repeats allowed).

        With ``out`` (a mapping group_id -> writable C-contiguous int32 numpy array or CPU torch
        tensor ``[>= len(rows), cols]`` for every group), row ``r`` of each buffer is written in
        place and ``out`` is returned; rows past the batch are untouched. Every check (the
        buffers, then the requests, then rows and columns) happens before anything is written.
        """
        if out is None:
            rows = resolve()
            result: dict[str, npt.NDArray[np.int32]] = {}
            for group, group_id in enumerate(self._group_ids):
                cols = max((len(tables[group].pages) for tables in rows), default=0)
                array = np.full((len(rows), cols), -1, dtype=np.int32)
                self._fill_rows(array, rows, group)
                result[group_id] = array
            return result
        buffers = out_buffers(out, self._group_ids)
        rows = resolve()
        for group, (group_id, array) in enumerate(zip(self._group_ids, buffers, strict=True)):
            if array.shape[0] < len(rows):
                raise ValueError(
                    f"block_tables: out[{group_id!r}] has {array.shape[0]} rows, "
                    f"fewer than the {len(rows)} requests"
                )
            for row, tables in enumerate(rows):
                if len(tables[group].pages) > array.shape[1]:
                    raise ValueError(
                        f"block_tables: out[{group_id!r}] has {array.shape[1]} columns but "
                        f"{name(row)} has {len(tables[group].pages)} pages in that group"
                    )
        for group, array in enumerate(buffers):
            self._fill_rows(array, rows, group)
        return out

    def _fill_rows(self, array: npt.NDArray[np.int32], rows: list[list[Table]], group: int) -> None:
        """Row ``r`` of ``array`` gets request ``r``'s pages in ``group`` (holes 0), then -1."""
        for row, tables in enumerate(rows):
            pages = self._view_ids(group, tables[group].pages)
            array[row, : len(pages)] = pages
            array[row, len(pages) :] = -1


def cpu_array(item: Any, label: str) -> npt.NDArray[Any]:
    """``item`` as a numpy array: an ndarray as is, a CPU torch tensor through ``.numpy()``,
    which shares its memory (``label`` names it in errors). A masked array is refused: the cache
    would write its data and ignore the mask."""
    if isinstance(item, np.ma.MaskedArray):
        raise TypeError(f"{label} must not be a masked array (its mask would be ignored)")
    if isinstance(item, np.ndarray):
        return item
    if not all(hasattr(item, attr) for attr in ("numpy", "device", "data_ptr")):
        raise TypeError(
            f"{label} must be an int32 numpy array or a CPU torch tensor, got {type(item).__name__}"
        )
    if getattr(item.device, "type", None) != "cpu":
        raise ValueError(f"{label} must be a CPU tensor, got one on device {item.device}")
    array = item.numpy()  # shares the tensor's memory
    if not isinstance(array, np.ndarray):
        raise TypeError(f"{label}.numpy() returned {type(array).__name__}, not a numpy array")
    return array


def check_int32_buffer(item: npt.NDArray[Any], label: str) -> None:
    """A buffer the cache writes: int32, C-contiguous, writable."""
    if item.dtype != np.int32:
        raise TypeError(f"{label} must have dtype int32, got {item.dtype}")
    if not item.flags.c_contiguous:
        raise ValueError(f"{label} must be C-contiguous")
    if not item.flags.writeable:
        raise ValueError(f"{label} must be writable")


def out_buffers(
    out: Any, group_ids: list[str], name: str = "out", method: str = "block_tables"
) -> list[npt.NDArray[np.int32]]:
    """Each group's buffer in the mapping ``out`` (argument ``name`` of ``method``) as a numpy
    view of the caller's memory, checked: int32, 2-D, C-contiguous, writable, no two sharing
    memory."""
    buffers: list[npt.NDArray[np.int32]] = []
    for group_id in group_ids:
        label = f"{name}[{group_id!r}]"
        try:
            item = out[group_id]
        except KeyError:
            raise ValueError(f"{method}: {name} has no table for group {group_id!r}") from None
        except TypeError:
            raise TypeError(
                f"{name} must be a mapping of group id to int32 array, got {type(out).__name__}"
            ) from None
        item = cpu_array(item, label)
        if item.ndim != 2:
            raise ValueError(f"{label} must be 2-D [rows, cols], got {item.ndim} dimension(s)")
        check_int32_buffer(item, label)
        if any(np.shares_memory(item, other) for other in buffers):
            # The native engine's borrow check refuses a buffer some other call holds too.
            raise ValueError(
                f"{label} shares its memory with another group's table (or is borrowed elsewhere)"
            )
        buffers.append(item)
    keys = getattr(out, "keys", None)
    if keys is not None:
        # A buffer under any other key would be silently left unwritten.
        for key in keys():
            if not (isinstance(key, str) and key in group_ids):
                groups = ", ".join(repr(group_id) for group_id in group_ids)
                raise ValueError(f"{method}: {name}[{key!r}] is not a group of this cache (groups: {groups})")
    return buffers
