"""Host buffers for the cache's host-memory tier and the executor of its transfers (private).

Public through :mod:`flat_kvcache.torch`.

A ``FlatKVCache(..., host_pages=N)`` never copies memory: it emits transfers
(``take_transfers()``), a store copying device page ``src`` to host page ``dst`` and a load
copying host page ``src`` to device page ``dst``, in every layer of one group, and waits for
``ack_transfers(ids)`` (docs/requests-api.md, "Host-memory tier"). :class:`HostKVBuffers` are
the host pages: one CPU tensor per device buffer of a :class:`~flat_kvcache.torch.KVBuffers`,
of the same layout with ``host_pages`` pages instead of ``num_pages`` (pinned when CUDA is
available, so copies to and from the device are asynchronous). :class:`TransferExecutor` runs
the transfers a cache hands out on those buffers and acknowledges them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
import torch

from flat_kvcache import layer_group_ids
from flat_kvcache._types import CacheStats
from flat_kvcache.torch._checks import as_int
from flat_kvcache.torch.plan import KVBuffers, KVMemoryPlan, TensorSpec

__all__ = ["HostKVBuffers", "TransferCache", "TransferCounts", "TransferExecutor"]


class TransferCache(Protocol):
    """What :class:`TransferExecutor` uses of a cache: ``flat_kvcache.FlatKVCache`` or the
    pure-Python ``flat_kvcache.reference.FlatKVCache``."""

    @property
    def group_ids(self) -> list[str]: ...

    def stats(self) -> CacheStats: ...

    def take_transfers(self) -> Any: ...

    def ack_transfers(self, ids: Any, /) -> None: ...


def _pages_view(tensor: torch.Tensor, spec: TensorSpec, page_size: int) -> torch.Tensor:
    """``tensor`` with pages on dim 0: K/V rows ``[pages * page_size, ...]`` become
    ``[pages, page_size, ...]`` (a view); a state buffer is already ``[pages, ...]``."""
    if spec.role in ("k", "v"):
        return tensor.view(tensor.shape[0] // page_size, page_size, *tensor.shape[1:])
    return tensor


def _host_shape(spec: TensorSpec, plan: KVMemoryPlan, host_pages: int) -> tuple[int, ...]:
    if spec.role in ("k", "v"):
        return (host_pages * plan.page_size, *spec.shape[1:])
    return (host_pages, *spec.shape[1:])


class HostKVBuffers:
    """Host-memory pages mirroring the device buffers of a :class:`KVMemoryPlan`, page for page.

    For every planned buffer (``plan.tensors``: per-layer K/V, shared hybrid slabs, state
    components) one CPU tensor of the same dtype and layout with ``host_pages`` pages: K/V
    ``[host_pages * page_size, num_kv_heads, head_dim]``, state ``[host_pages, *shape]``. Host
    page ``h`` of a buffer is rows ``h * page_size .. (h + 1) * page_size`` (K/V) or row ``h``
    (state), as device page ``p`` is in the device buffer. Host page ids are the cache's,
    ``[0, host_pages)``: there is no null host page.

    Parameters
    ----------
    plan
        The memory plan the device buffers were allocated from.
    host_pages
        Pages of the host tier (``>= 1``): the cache's ``host_pages``.
    pin_memory
        Page-lock the tensors (asynchronous copies to and from CUDA). ``None`` (default):
        pinned when CUDA is available, plain CPU memory otherwise.
    """

    def __init__(self, plan: KVMemoryPlan, host_pages: int, *, pin_memory: bool | None = None) -> None:
        if not isinstance(plan, KVMemoryPlan):
            raise TypeError(f"plan must be a KVMemoryPlan, not {type(plan).__name__}")
        pages = as_int(host_pages, "host_pages", minimum=1)
        if pin_memory is None:
            pin = torch.cuda.is_available()
        elif isinstance(pin_memory, bool):
            pin = pin_memory
        else:
            raise TypeError(f"pin_memory must be a bool or None, not {type(pin_memory).__name__}")
        self._plan = plan
        self._host_pages = pages
        self._pinned = pin
        self._tensors = {
            spec.name: torch.zeros(_host_shape(spec, plan, pages), dtype=spec.dtype, pin_memory=pin)
            for spec in plan.tensors
        }

    @property
    def plan(self) -> KVMemoryPlan:
        return self._plan

    @property
    def host_pages(self) -> int:
        """Pages of the host tier."""
        return self._host_pages

    @property
    def pinned(self) -> bool:
        """Whether the tensors are page-locked."""
        return self._pinned

    @property
    def tensors(self) -> Mapping[str, torch.Tensor]:
        """Every host buffer by the plan name of the device buffer it mirrors, in plan order."""
        return MappingProxyType(self._tensors)

    def nbytes(self) -> int:
        """Bytes held by the host buffers (``host_pages * plan.bytes_per_page``)."""
        return sum(t.numel() * t.element_size() for t in self._tensors.values())

    def __repr__(self) -> str:
        return (
            f"HostKVBuffers(host_pages={self._host_pages}, page_size={self._plan.page_size}, "
            f"tensors={len(self._tensors)}, nbytes={self.nbytes()}, pinned={self._pinned})"
        )


@dataclass(frozen=True)
class TransferCounts:
    """What :meth:`TransferExecutor.run` did (or, as :attr:`TransferExecutor.totals`, every run
    so far): page copies per direction (one per transfer, each over every buffer of its
    group), the transfer ids acknowledged, and the bytes copied each way."""

    stores: int
    loads: int
    acked: int
    store_bytes: int = 0
    load_bytes: int = 0

    def __add__(self, other: TransferCounts) -> TransferCounts:
        return TransferCounts(
            self.stores + other.stores,
            self.loads + other.loads,
            self.acked + other.acked,
            self.store_bytes + other.store_bytes,
            self.load_bytes + other.load_bytes,
        )


_Transfers = Mapping[str, tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]]


class TransferExecutor:
    """Runs the host-tier transfers of ``cache`` between ``device`` and ``host`` buffers.

    :meth:`run` takes every transfer the cache emitted (``cache.take_transfers()``), copies the
    pages in every buffer serving a layer of the transfer's group (a shared slab once), waits
    for the copies and acknowledges them all (``cache.ack_transfers``). On CUDA the copies run on
    a side stream that first waits for the current stream (the forward that wrote the stored
    pages); :meth:`run` synchronises that stream before acknowledging, so an acknowledged load
    is in device memory and the host copy of an acknowledged store is complete. Stores gather
    the device pages with ``index_select`` and land with ``index_copy_`` on the host; loads the
    other way round.

    When to call :meth:`run`: a store emitted by ``schedule`` (write-through) names a page that
    the forward of that step writes, so run after that forward; a request with loads in flight
    (``cache.loads_in_flight(slot) > 0``) cannot be scheduled, so run after ``add_request`` and
    before scheduling it. Running after every forward and before every schedule does both
    (:func:`flat_kvcache.torch.runner.run_greedy` takes an executor and does so).

    Parameters
    ----------
    cache
        A ``FlatKVCache`` (native or reference) with a host tier over ``device.plan.groups``.
    device
        The device buffers (any device).
    host
        The host buffers of the same plan, as many pages as the cache's host tier.
    """

    def __init__(self, cache: TransferCache, device: KVBuffers, host: HostKVBuffers) -> None:
        if not all(hasattr(cache, name) for name in ("take_transfers", "ack_transfers", "stats")):
            raise TypeError(f"cache must be a FlatKVCache, not {type(cache).__name__}")
        if not isinstance(device, KVBuffers):
            raise TypeError(f"device must be KVBuffers, not {type(device).__name__}")
        if not isinstance(host, HostKVBuffers):
            raise TypeError(f"host must be HostKVBuffers, not {type(host).__name__}")
        plan = device.plan
        if host.plan is not plan and host.plan != plan:
            raise ValueError("host buffers were built for another plan than the device buffers")
        groups = [spec.group_id for spec in plan.groups]
        if list(cache.group_ids) != groups:
            raise ValueError(f"cache groups {list(cache.group_ids)} differ from the plan's {groups}")
        stats = cache.stats()
        if int(stats["pages_total"]) + 1 != plan.num_pages:  # pages_total leaves out page 0
            raise ValueError(
                f"the cache has {int(stats['pages_total']) + 1} device pages, the buffers {plan.num_pages}"
            )
        if int(stats["host_pages_total"]) != host.host_pages:
            raise ValueError(
                f"the cache has a host tier of {int(stats['host_pages_total'])} pages, "
                f"the host buffers have {host.host_pages}"
            )
        self.cache = cache
        self.device = device
        self.host = host
        page_size = plan.page_size
        group_of_layer = layer_group_ids(plan.shape.layer_types, plan.shape.sliding_window)
        self._pairs: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {group: [] for group in groups}
        for spec in plan.tensors:
            device_pages = _pages_view(device.tensors[spec.name], spec, page_size)
            host_pages = _pages_view(host.tensors[spec.name], spec, page_size)
            for group in dict.fromkeys(group_of_layer[layer] for layer in spec.layers):
                self._pairs[group].append((device_pages, host_pages))
        self._device = next(iter(device.tensors.values())).device
        #: Everything :meth:`run` did so far (the host tier's byte counts: the cache counts
        #: pages, the executor knows their size).
        self.totals = TransferCounts(0, 0, 0)
        self._stream: torch.cuda.Stream | None = (
            torch.cuda.Stream(self._device)  # type: ignore[no-untyped-call]
            if self._device.type == "cuda"
            else None
        )

    def run(self) -> TransferCounts:
        """Run and acknowledge every transfer emitted so far; returns what was done.

        If a copy raises, nothing is acknowledged: the transfers stay in flight (their pages
        pinned) and the cache must be rebuilt or the error handled by the caller.
        """
        transfers: dict[str, _Transfers] = self.cache.take_transfers()
        stores, loads = transfers["store"], transfers["load"]
        if not stores and not loads:
            return TransferCounts(0, 0, 0)
        ids: list[npt.NDArray[np.int64]] = []
        if self._stream is None:
            moved = self._copy(stores, loads, ids)
        else:
            self._stream.wait_stream(torch.cuda.current_stream(self._device))
            with torch.cuda.stream(self._stream):
                moved = self._copy(stores, loads, ids)
            self._stream.synchronize()
        all_ids = np.concatenate(ids)
        self.cache.ack_transfers(all_ids)
        done = TransferCounts(
            stores=sum(len(v[0]) for v in stores.values()),
            loads=sum(len(v[0]) for v in loads.values()),
            acked=len(all_ids),
            store_bytes=moved[0],
            load_bytes=moved[1],
        )
        self.totals = self.totals + done
        return done

    def _copy(
        self, stores: _Transfers, loads: _Transfers, ids: list[npt.NDArray[np.int64]]
    ) -> tuple[int, int]:
        """Copy every page; returns the bytes stored and loaded."""
        device = self._device
        stored = loaded = 0
        for group, (group_ids, src, dst) in stores.items():
            ids.append(group_ids)
            src_pages = torch.from_numpy(src).to(device)
            dst_pages = torch.from_numpy(dst)
            for device_pages, host_pages in self._pairs[group]:
                # a synchronous copy to the CPU: the host index_copy_ needs the data
                gathered = device_pages.index_select(0, src_pages).to("cpu")
                host_pages.index_copy_(0, dst_pages, gathered)
                stored += gathered.numel() * gathered.element_size()
        for group, (group_ids, src, dst) in loads.items():
            ids.append(group_ids)
            src_pages = torch.from_numpy(src)
            dst_pages = torch.from_numpy(dst).to(device)
            for device_pages, host_pages in self._pairs[group]:
                gathered = host_pages.index_select(0, src_pages)
                if self.host.pinned and device.type == "cuda":
                    gathered = gathered.pin_memory()  # an asynchronous copy to the device
                device_pages.index_copy_(0, dst_pages, gathered.to(device, non_blocking=True))
                loaded += gathered.numel() * gathered.element_size()
        return stored, loaded
