"""Host buffers for the cache's host-memory tier and the executor of its transfers (private).

Public through :mod:`flat_kvcache.torch`.

A ``FlatKVCache(..., host_pages=N)`` never copies memory: it emits transfers
(``take_transfers()``), a store copying device page ``src`` to host page ``dst`` and a load
copying host page ``src`` to device page ``dst``, in every layer of one group, and waits for
``ack_transfers(ids)`` (docs/requests-api.md, "Host-memory tier"). The host pages:

- :class:`HostKVBuffers`, over a pool of equal pages (a :class:`~flat_kvcache.torch.KVBuffers`
  of a :class:`~flat_kvcache.torch.KVMemoryPlan`): one CPU tensor per device buffer, of the same
  layout with ``host_pages`` pages instead of ``num_pages``; host page ids are shared by every
  group;
- :class:`ArenaHostBuffers`, over the SPEC 13 arena (an
  :class:`~flat_kvcache.torch.ArenaBuffers`): the tier is per group there, so each group has
  its own host pages of its own page geometry (a page group's page, or a whole state slot), one
  CPU byte tensor ``[n_g, page bytes]`` per group, indexed by the group's host page ids.

Both are pinned when CUDA is available, so copies to and from the device are asynchronous.
:class:`TransferExecutor` runs the transfers a cache hands out on either pair of buffers and
acknowledges them.
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
from flat_kvcache._types import ArenaPlan, CacheStats
from flat_kvcache.torch._checks import as_int
from flat_kvcache.torch.arena import ArenaBuffers
from flat_kvcache.torch.plan import ArenaMemoryPlan, KVBuffers, KVMemoryPlan, TensorSpec

__all__ = ["ArenaHostBuffers", "HostKVBuffers", "TransferCache", "TransferCounts", "TransferExecutor"]

#: Most host pages a cache's tier holds, all groups together (host page ids are int32).
MAX_HOST_PAGES = 2**31 - 1


class TransferCache(Protocol):
    """What :class:`TransferExecutor` uses of a cache: ``flat_kvcache.FlatKVCache`` or the
    pure-Python ``flat_kvcache.reference.FlatKVCache``."""

    @property
    def group_ids(self) -> list[str]: ...

    def stats(self) -> CacheStats: ...

    def arena_stats(self) -> Any: ...

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
        pin = _pinned(pin_memory)
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


def _pinned(pin_memory: object) -> bool:
    """The ``pin_memory`` argument: a bool, or None for "when CUDA is available"."""
    if pin_memory is None:
        return torch.cuda.is_available()
    if isinstance(pin_memory, bool):
        return pin_memory
    raise TypeError(f"pin_memory must be a bool or None, not {type(pin_memory).__name__}")


class ArenaHostBuffers:
    """Host-memory pages of the per-group host tier over a SPEC 13 arena.

    Over an arena each group has its own page geometry, so the cache's host tier is per group
    (``FlatKVCache(specs, arena=plan, host_pages=...)``): group ``g`` has host pages
    ``[0, n_g)`` of its own geometry. Here they are one ``uint8`` CPU tensor per group,
    ``[n_g, item_bytes]``: host page ``h`` of a group is row ``h``, the bytes of one device page
    of the group (a page group: every layer's K and V of the page's tokens, side by side as the
    plan lays them out; a state group: the whole state slot, every state layer's every
    component), as :meth:`ArenaBuffers.pages <flat_kvcache.torch.ArenaBuffers.pages>` gives
    them. A store or load copies whole rows, so every layer of the group moves at once.

    Parameters
    ----------
    plan
        The arena plan the device arena was allocated from (an ``ArenaPlan``, or the
        ``ArenaMemoryPlan`` holding it).
    host_pages
        The cache's ``host_pages``: an int (that many host pages for every group), or a
        mapping ``{group_id: pages}`` (the groups it does not name get none).
    pin_memory
        Page-lock the tensors (asynchronous copies to and from CUDA). ``None`` (default):
        pinned when CUDA is available, plain CPU memory otherwise.
    """

    def __init__(
        self,
        plan: ArenaPlan | ArenaMemoryPlan,
        host_pages: int | Mapping[str, int],
        *,
        pin_memory: bool | None = None,
    ) -> None:
        arena = plan.arena if isinstance(plan, ArenaMemoryPlan) else plan
        if not isinstance(arena, ArenaPlan):
            raise TypeError(f"plan must be an ArenaPlan or an ArenaMemoryPlan, not {type(plan).__name__}")
        groups = [group.group_id for group in arena.groups]
        if isinstance(host_pages, Mapping):
            pages = {gid: 0 for gid in groups}
            for gid, count in host_pages.items():
                if not isinstance(gid, str):
                    raise TypeError(f"host_pages keys must be group ids (str), got {type(gid).__name__}")
                if gid not in pages:
                    raise ValueError(
                        f"host_pages names group {gid!r}, which is not one of the plan's {groups}"
                    )
                pages[gid] = as_int(count, f"host_pages[{gid!r}]", minimum=0)
        else:
            count = as_int(host_pages, "host_pages", minimum=0)
            pages = {gid: count for gid in groups}
        total = sum(pages.values())
        if total > MAX_HOST_PAGES:
            raise OverflowError(
                f"host_pages: the groups' host pages add up to {total}, more than the {MAX_HOST_PAGES} "
                "a host tier holds (host page ids are int32)"
            )
        pin = _pinned(pin_memory)
        self._plan = arena
        self._pages = pages
        self._pinned = pin
        self._tensors = {
            group.group_id: torch.zeros(
                (pages[group.group_id], group.item_bytes), dtype=torch.uint8, pin_memory=pin
            )
            for group in arena.groups
            if pages[group.group_id] > 0
        }

    @property
    def plan(self) -> ArenaPlan:
        return self._plan

    @property
    def host_pages(self) -> Mapping[str, int]:
        """Host pages per group id (0 for a group that is not tiered), in plan order."""
        return MappingProxyType(self._pages)

    @property
    def host_pages_total(self) -> int:
        """Host pages of every group together (the cache's ``stats()["host_pages_total"]``)."""
        return sum(self._pages.values())

    @property
    def pinned(self) -> bool:
        """Whether the tensors are page-locked."""
        return self._pinned

    @property
    def tensors(self) -> Mapping[str, torch.Tensor]:
        """Each tiered group's host pages, ``uint8 [n_g, item_bytes]``, by group id."""
        return MappingProxyType(self._tensors)

    def page(self, group_id: str, page: int) -> torch.Tensor:
        """The bytes of host page ``page`` of ``group_id`` (a ``uint8`` view of one row)."""
        if group_id not in self._pages:
            raise KeyError(f"unknown group {group_id!r}; the plan has {list(self._pages)}")
        index = as_int(page, "page", minimum=0)
        if index >= self._pages[group_id]:
            raise IndexError(
                f"page {index} out of range: group {group_id!r} has {self._pages[group_id]} host pages"
            )
        return self._tensors[group_id][index]

    def nbytes(self) -> int:
        """Bytes held by the host pages (each group's pages times its page bytes)."""
        return sum(t.numel() for t in self._tensors.values())

    def __repr__(self) -> str:
        return (
            f"ArenaHostBuffers(host_pages={dict(self._pages)}, nbytes={self.nbytes()}, pinned={self._pinned})"
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
#: Per group id, the (device pages, host pages) tensor pairs a transfer of the group copies,
#: each with pages on dim 0.
_Pairs = dict[str, list[tuple[torch.Tensor, torch.Tensor]]]
#: Per group id, (device pages, host pages): the ids a transfer of the group may name.
_Limits = dict[str, tuple[int, int]]


def _host_total(cache: TransferCache) -> int:
    return int(cache.stats()["host_pages_total"])


def _paged_pairs(cache: TransferCache, device: KVBuffers, host: HostKVBuffers) -> tuple[_Pairs, _Limits]:
    """The buffers of a pool of equal pages: per group, every device buffer serving one of its
    layers with its host mirror (host page ids shared by every group)."""
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
    total = _host_total(cache)
    if total != host.host_pages:
        raise ValueError(f"the cache has a host tier of {total} pages, the host buffers {host.host_pages}")
    page_size = plan.page_size
    group_of_layer = layer_group_ids(plan.shape.layer_types, plan.shape.sliding_window)
    pairs: _Pairs = {group: [] for group in groups}
    for spec in plan.tensors:
        device_pages = _pages_view(device.tensors[spec.name], spec, page_size)
        host_pages = _pages_view(host.tensors[spec.name], spec, page_size)
        for group in dict.fromkeys(group_of_layer[layer] for layer in spec.layers):
            pairs[group].append((device_pages, host_pages))
    return pairs, {group: (plan.num_pages, host.host_pages) for group in groups}


def _arena_pairs(
    cache: TransferCache, device: ArenaBuffers, host: ArenaHostBuffers
) -> tuple[_Pairs, _Limits]:
    """The buffers of an arena: per tiered group, its device pages as bytes
    (:meth:`ArenaBuffers.pages`) with its host pages (:class:`ArenaHostBuffers`)."""
    plan = device.plan
    if host.plan is not plan and host.plan != plan:
        raise ValueError("host buffers were built for another arena plan than the device arena")
    groups = [group.group_id for group in plan.groups]
    if sorted(cache.group_ids) != sorted(groups):
        raise ValueError(f"cache groups {list(cache.group_ids)} differ from the arena plan's {groups}")
    arena = cache.arena_stats()
    if arena is None:
        raise ValueError(
            "the cache does not allocate from an arena: build it with FlatKVCache(specs, arena=plan)"
        )
    units, unit_bytes = int(arena["units_total"]) + 1, int(arena["unit_bytes"])
    if (unit_bytes, units) != (plan.unit_bytes, plan.num_units):
        raise ValueError(
            f"the cache's arena is {units} units of {unit_bytes} bytes, "
            f"the buffers' {plan.num_units} units of {plan.unit_bytes}"
        )
    if _host_total(cache) != host.host_pages_total:
        raise ValueError(
            f"the cache has a host tier of {_host_total(cache)} pages in all, the host buffers have "
            f"{host.host_pages_total} ({dict(host.host_pages)})"
        )
    pairs: _Pairs = {}
    limits: _Limits = {}
    for gid, host_pages in host.tensors.items():
        device_pages = device.pages(gid)
        pairs[gid] = [(device_pages, host_pages)]
        limits[gid] = (device_pages.shape[0], host_pages.shape[0])
    return pairs, limits


def _check_ids(kind: str, transfers: _Transfers, limits: _Limits) -> None:
    """Refuse, before anything is copied, a transfer of a group the buffers do not hold or one
    naming a page past them (host buffers of another size than the cache's tier)."""
    for group, (_, src, dst) in transfers.items():
        if group not in limits:
            raise ValueError(f"a {kind} of group {group!r}, which has no host buffers")
        device_ids, host_ids = (src, dst) if kind == "store" else (dst, src)
        for name, ids, bound in (
            ("device", device_ids, limits[group][0]),
            ("host", host_ids, limits[group][1]),
        ):
            if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= bound):
                raise ValueError(
                    f"a {kind} of group {group!r} names {name} page {int(ids.max())}, past the buffers' "
                    f"{bound} pages: the buffers do not match the cache"
                )


class TransferExecutor:
    """Runs the host-tier transfers of ``cache`` between ``device`` and ``host`` buffers.

    :meth:`run` takes every transfer the cache emitted (``cache.take_transfers()``), copies the
    pages in every buffer serving a layer of the transfer's group (a shared slab once; over an
    arena, the group's page bytes, every layer at once), waits for the copies and acknowledges
    them all (``cache.ack_transfers``). On CUDA the copies run on
    a side stream that first waits for the current stream (the forward that wrote the stored
    pages); :meth:`run` synchronises that stream before acknowledging, so an acknowledged load
    is in device memory and the host copy of an acknowledged store is complete. Stores gather
    the device pages with ``index_select`` and land with ``index_copy_`` on the host; loads the
    other way round.

    When to call :meth:`run`: a store emitted by ``schedule`` (write-through) names a page that
    the forward of that step writes, so run after that forward; a request with loads in flight
    (``cache.loads_in_flight(slot) > 0``) cannot be scheduled, so run after ``add_request`` and
    before scheduling it. Running after every forward and before every schedule does both
    (:func:`flat_kvcache.torch.runner.run_greedy` takes an executor and does so). Over an arena
    a state group's checkpoint is a page like any other: a load brings it back into the state
    slot the request's first step reads (``state_slots``).

    Parameters
    ----------
    cache
        A ``FlatKVCache`` (native or reference) with a host tier over the buffers' groups.
    device
        The device buffers (any device): :class:`KVBuffers` of a ``KVMemoryPlan``, or the
        :class:`~flat_kvcache.torch.ArenaBuffers` of the cache's arena.
    host
        The host buffers: :class:`HostKVBuffers` of the same plan with as many pages as the
        cache's host tier, or, over an arena, :class:`ArenaHostBuffers` of the same arena plan
        with each group's host pages as the cache has them.
    """

    def __init__(
        self,
        cache: TransferCache,
        device: KVBuffers | ArenaBuffers,
        host: HostKVBuffers | ArenaHostBuffers,
    ) -> None:
        if not all(hasattr(cache, name) for name in ("take_transfers", "ack_transfers", "stats")):
            raise TypeError(f"cache must be a FlatKVCache, not {type(cache).__name__}")
        if isinstance(device, ArenaBuffers):
            if not isinstance(host, ArenaHostBuffers):
                raise TypeError(f"host must be ArenaHostBuffers over ArenaBuffers, not {type(host).__name__}")
            self._pairs, self._limits = _arena_pairs(cache, device, host)
            self._device = device.arena.device
        elif isinstance(device, KVBuffers):
            if not isinstance(host, HostKVBuffers):
                raise TypeError(f"host must be HostKVBuffers over KVBuffers, not {type(host).__name__}")
            self._pairs, self._limits = _paged_pairs(cache, device, host)
            self._device = next(iter(device.tensors.values())).device
        else:
            raise TypeError(f"device must be KVBuffers or ArenaBuffers, not {type(device).__name__}")
        self.cache = cache
        self.device = device
        self.host = host
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
        pinned) and the cache must be rebuilt or the error handled by the caller. A transfer
        naming a page past the buffers (buffers sized for another tier) raises ``ValueError``
        before anything is copied (the transfers taken stay in flight as well).
        """
        transfers: dict[str, _Transfers] = self.cache.take_transfers()
        stores, loads = transfers["store"], transfers["load"]
        if not stores and not loads:
            return TransferCounts(0, 0, 0)
        _check_ids("store", stores, self._limits)
        _check_ids("load", loads, self._limits)
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
