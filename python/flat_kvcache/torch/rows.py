"""Persistent block-table rows on the device, kept current by the cache's deltas.

:class:`DeviceRows` binds host int32 tables to a :class:`~flat_kvcache.FlatKVCache`
(``bind_rows``), keeps a device copy of each, and every step applies what ``update_rows()``
returns with one ``index_put_`` per group: only the cells that changed cross to the device.
Sliding-window groups can be windowed (each row holds ``width`` slots of the table from a
per-row page offset, the slot of column 0; a kernel then sees positions shifted by
``offset * page_size``, as with ``CaptureBuffers(sliding_offsets=True)``). Chunked local
attention groups are never windowed (``bind_rows`` refuses it: their chunk mask needs absolute
positions).

Row ``s`` is the request in slot ``s``: the cache gives every request the lowest free slot
(below ``max_rows`` while rows are bound, ``add_request`` refuses a request past that), so the
slot ``add_request`` returns is the row to read, and a finished or preempted request's row goes
back to -1 on the next update::

    rows = DeviceRows(cache, max_rows=256, widths={"full_attention": 2049, "sliding_attention": 66},
                      windowed=["sliding_attention"], device="cuda")
    slot, hit = cache.add_request(req, prompt)  # slot = its row
    ...                                         # every step, after cache.schedule(slots, ns):
    rows.update()                               # the deltas, applied on the device
    table = rows.tables["full_attention"][torch.as_tensor(slots)]   # what the kernel reads
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch

from flat_kvcache.torch._checks import as_int

__all__ = ["DeviceRows"]


class DeviceRows:
    """Host tables bound to ``cache`` and their device copies, updated by deltas.

    ``widths`` gives every group's row width (columns); ``windowed`` names the sliding-window
    groups whose rows are windowed. The host tables and offsets are pinned when ``device`` is a
    CUDA device, so the deltas copy without staging.
    """

    def __init__(
        self,
        cache: Any,
        max_rows: int,
        widths: Mapping[str, int],
        *,
        windowed: Iterable[str] = (),
        device: torch.device | str = "cpu",
    ) -> None:
        rows = as_int(max_rows, "max_rows", minimum=1)
        groups = list(cache.group_ids)
        if set(widths) != set(groups):
            raise ValueError(f"widths must name every group of the cache {groups}, got {sorted(widths)}")
        windowed_groups = list(windowed)
        unknown = [g for g in windowed_groups if g not in groups]
        if unknown:
            raise ValueError(f"windowed names groups the cache does not have: {unknown}")
        self.cache = cache
        self.device = torch.device(device)
        pin = self.device.type == "cuda"
        self.host: dict[str, np.ndarray] = {}
        self.tables: dict[str, torch.Tensor] = {}
        for group in groups:
            width = as_int(widths[group], f"widths[{group!r}]", minimum=1)
            host = torch.empty((rows, width), dtype=torch.int32, pin_memory=pin)
            self.host[group] = host.numpy()
            self.tables[group] = torch.full((rows, width), -1, dtype=torch.int32, device=self.device)
        self.host_offsets = {
            group: torch.empty(rows, dtype=torch.int32, pin_memory=pin).numpy() for group in windowed_groups
        }
        self.offsets = {
            group: torch.zeros(rows, dtype=torch.int32, device=self.device) for group in windowed_groups
        }
        cache.bind_rows(self.host, offsets=self.host_offsets)
        #: Rows of every table: the slots a request may hold while these rows are bound.
        self.max_rows = rows
        #: Cells copied to the device by the last :meth:`update`.
        self.last_cells = 0

    def update(self) -> int:
        """``cache.update_rows()`` and the same deltas applied to the device copies; returns
        how many cells changed."""
        cells, moved = self.cache.update_rows()
        total = 0
        for group, delta in cells.items():
            count = int(delta.shape[1])
            if count:
                rows, cols, values = torch.from_numpy(delta).to(self.device, non_blocking=True)
                self.tables[group].index_put_((rows.long(), cols.long()), values)
                total += count
        for group, delta in moved.items():
            if delta.shape[1]:
                rows, values = torch.from_numpy(delta).to(self.device, non_blocking=True)
                self.offsets[group][rows.long()] = values
        self.last_cells = total
        return total

    def __repr__(self) -> str:
        widths = {g: int(t.shape[1]) for g, t in self.tables.items()}
        return f"DeviceRows(max_rows={self.max_rows}, widths={widths}, windowed={list(self.offsets)})"
