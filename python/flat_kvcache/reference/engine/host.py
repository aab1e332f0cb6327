"""The host-memory tier, plainly: host pages, their keys, an LRU, and transfers.

The cache never copies memory. It emits transfers that the engine runs and acknowledges in
any order:

- a *store* copies device page ``d`` to host page ``h``: while in flight ``d`` holds one
  extra reference (never handed out again) and ``h`` is reserved under the key but not yet
  findable; the acknowledgement makes ``h`` findable and drops the reference;
- a *load* copies findable host page ``h`` into device page ``d``, allocated for the request
  that hit ``h``: ``d`` holds one extra reference and ``h`` is pinned until acknowledged;
  the acknowledgement registers ``d`` under the key and drops both pins. A request with loads
  in flight cannot be scheduled.

Host pages live in *spaces*: over a pool of equal pages one space serves every group; over an
arena, whose groups' pages differ, each group with host pages has a space of its own, of pages
of its geometry, and a group without any is not tiered (nothing of it is stored). A space's
pages are numbered ``[0, size)`` in transfers; here the spaces are laid end to end in one list
of pages (``keys``, ``ready``, ``readers``), so the key map and the transfers are shared, and
each space keeps its never-used pages and its LRU list.

Store policy: ``"write_through"`` stores each page as it is registered; ``"evict"`` stores a
cached page when its last reference goes (when it would become evictable). A store takes a
never-used page of its group's space first, else the least recently used findable page of that
space no load reads (its key is dropped); with neither the store is skipped. A key already on
the host is never stored twice.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from flat_kvcache.events import BlockStored

__all__ = ["HOST_BIT", "HOST_STORES", "HostTier", "Op", "Space"]

#: Tag of a host page id inside a tiered match (device page ids are below 2**31).
HOST_BIT = 1 << 31

#: The ``host_store`` policies.
HOST_STORES = ("write_through", "evict")

#: Largest host tier, every space together (host page ids stay below ``HOST_BIT``).
MAX_HOST_PAGES = HOST_BIT - 1


@dataclass
class Op:
    """A transfer in flight: ``kind`` is ``"store"`` or ``"load"``; ``owner`` is a load's
    request tables (compared by identity, so a late acknowledgement after the request ended
    counts for no one); ``event`` is the ``BlockStored`` a load's registration records."""

    kind: str
    group: int
    device: int
    host: int
    key: str
    taken: bool = False
    owner_key: Any = None
    owner: Any = None
    event: BlockStored | None = None


@dataclass
class Space:
    """Host pages ``[base, base + size)`` of the tier's list: the pages never used yet are
    ``[base + next_unused, base + size)``; ``lru`` holds the findable ones no load reads, front
    = least recently used = next to evict."""

    base: int
    size: int
    next_unused: int = 0
    lru: OrderedDict[int, None] = field(default_factory=OrderedDict)


class HostTier:
    """Host pages in spaces; each page holds at most one key, each key at most one page.

    ``pages`` is an int: one space of that many pages shared by every group; or a list: group
    ``g`` has a space of ``pages[g]`` pages (none when 0), the tier over an arena.
    """

    def __init__(self, pages: int | list[int], policy: str) -> None:
        self.policy = policy
        sizes = [pages] if isinstance(pages, int) else [n for n in pages if n > 0]
        self.spaces: list[Space] = []
        base = 0
        for size in sizes:
            self.spaces.append(Space(base, size))
            base += size
        space_of: list[int | None] | None = None
        if not isinstance(pages, int):
            space_of = []
            for n in pages:
                space_of.append(None if n == 0 else sum(1 for m in space_of if m is not None))
        #: Per group, its space (None: no host pages); None for one space shared by all groups.
        self.space_of = space_of
        self.num_pages = base
        try:
            self.keys: list[str | None] = [None] * base
            self.ready = [False] * base
            self.readers = [0] * base
        except MemoryError:
            # Say what did not fit, as the native tier does.
            raise MemoryError(
                f"out of memory: host_pages = {base}: the host tier does not fit in memory"
            ) from None
        self.map: dict[str, int] = {}
        self.ops: dict[int, Op] = {}
        self.untaken: list[int] = []
        self.next_id = 1
        #: Keys a store's host eviction dropped, not yet turned into events by the coordinator.
        self.evicted: list[str] = []
        self.counters = {
            "stores": 0,
            "stores_done": 0,
            "stores_skipped": 0,
            "loads": 0,
            "loads_done": 0,
            "evictions": 0,
        }

    def space(self, group: int) -> Space | None:
        """The space serving ``group``, if it has host pages."""
        if self.space_of is None:
            return self.spaces[0]
        index = self.space_of[group]
        return None if index is None else self.spaces[index]

    def on_lru(self, page: int) -> bool:
        """Whether host ``page`` is on the LRU list of the space it lies in."""
        return any(page in space.lru for space in self.spaces if space.base <= page < space.base + space.size)

    def lookup(self, key: str) -> int | None:
        """The findable host page holding ``key``, or None."""
        page = self.map.get(key)
        return page if page is not None and self.ready[page] else None

    def _take_page(self, space: Space) -> int | None:
        if space.next_unused < space.size:
            space.next_unused += 1
            return space.base + space.next_unused - 1
        if not space.lru:
            return None
        page, _ = space.lru.popitem(last=False)
        key = self.keys[page]
        assert key is not None, "a page on the LRU list holds a key"
        del self.map[key]
        self.evicted.append(key)
        self.keys[page] = None
        self.ready[page] = False
        self.counters["evictions"] += 1
        return page

    def _push(self, op: Op) -> None:
        self.ops[self.next_id] = op
        self.untaken.append(self.next_id)
        self.next_id += 1

    def store(self, device: int, key: str, group: int) -> bool:
        """Emit a store unless the group has no host pages, the key is on the host, or no page
        of the group's space is free; True if emitted."""
        space = self.space(group)
        if space is None or key in self.map:
            return False
        host = self._take_page(space)
        if host is None:
            self.counters["stores_skipped"] += 1
            return False
        self.keys[host] = key
        self.map[key] = host
        self.counters["stores"] += 1
        self._push(Op("store", group, device, host, key))
        return True

    def load(self, host: int, device: int, owner_key: Any, owner: Any, event: BlockStored | None) -> None:
        """Emit a load of findable ``host`` into ``device`` and pin ``host``."""
        key = self.keys[host]
        assert key is not None and self.ready[host], "loads read findable pages only"
        group = int(key[-8:], 16)
        space = self.space(group)
        assert space is not None, "a host page lies in its group's space"
        space.lru.pop(host, None)
        self.readers[host] += 1
        self.counters["loads"] += 1
        self._push(Op("load", group, device, host, key, owner_key=owner_key, owner=owner, event=event))

    def take(self) -> list[tuple[int, Op]]:
        """The transfers emitted since the last call, in emission order, now handed out."""
        out = []
        for op_id in self.untaken:
            op = self.ops[op_id]
            op.taken = True
            out.append((op_id, op))
        self.untaken = []
        return out

    def check_ack(self, ids: list[int]) -> None:
        """ValueError unless every id is in flight, handed out, and listed once."""
        seen: set[int] = set()
        for op_id in ids:
            op = self.ops.get(op_id)
            if op is None:
                raise ValueError(
                    f"ack_transfers: transfer {op_id} is not in flight (unknown or already acknowledged)"
                )
            if not op.taken:
                raise ValueError(
                    f"ack_transfers: transfer {op_id} was not handed out yet (call take_transfers first)"
                )
            if op_id in seen:
                raise ValueError(f"ack_transfers: transfer {op_id} is listed twice")
            seen.add(op_id)

    def finish(self, op_id: int) -> Op:
        """Finish ``op_id`` on the host side: a store's page becomes findable, a load's source
        is unpinned; a findable page no load reads becomes the most recently used."""
        op = self.ops.pop(op_id)
        if op.kind == "store":
            self.ready[op.host] = True
            self.counters["stores_done"] += 1
        else:
            self.readers[op.host] -= 1
            self.counters["loads_done"] += 1
        space = self.space(op.group)
        assert space is not None, "a transfer's host page lies in its group's space"
        if self.ready[op.host] and self.readers[op.host] == 0 and op.host not in space.lru:
            space.lru[op.host] = None
        return op

    def space_page(self, group: int, page: int) -> int:
        """Host ``page`` (of the tier's list) as a page of ``group``'s space, as transfers name it."""
        space = self.space(group)
        return page if space is None else page - space.base
