"""The SPEC 1 core invariants, checked from scratch against the tables and the pool."""

from __future__ import annotations

from flat_kvcache.errors import InvariantError
from flat_kvcache.reference.engine.coordinator import Coordinator

__all__ = ["Invariants"]


class Invariants(Coordinator):
    """``check_invariants``."""

    def check_invariants(self) -> None:
        """``InvariantError`` (a ``RuntimeError``) naming the first broken invariant (SPEC 1, in
        contract order).

        A page in two groups' tables; a page count differing from its table references; a free
        page missing from the free list or a referenced one in it; a key-map entry pointing at a
        page that does not hold that key; ``free + in_use + 1 != num_pages``.
        """
        pool = self._pool
        total = pool.num_blocks
        references = [0] * total
        owner: dict[int, int] = {}
        for tables in self._requests.values():
            for group, table in enumerate(tables):
                for page in table.pages:
                    if page == 0:
                        continue
                    if not 0 < page < total:
                        raise InvariantError(
                            f"group {self._group_ids[group]} holds page {page} outside the pool"
                        )
                    if pool.is_arena and pool._arena_group_of(page) != group:
                        raise InvariantError(
                            f"group {self._group_ids[group]} holds page {page} of another group's units"
                        )
                    first_group = owner.setdefault(page, group)
                    if first_group != group:
                        raise InvariantError(
                            f"page {page} is in the tables of groups "
                            f"{self._group_ids[first_group]} and {self._group_ids[group]}"
                        )
                    references[page] += 1
        if self._host is not None:
            self._check_host(references, owner)
        for page in range(total):
            if pool.ref_count(page) != references[page]:
                raise InvariantError(
                    f"page {page} has ref count {pool.ref_count(page)} "
                    f"but {references[page]} table and transfer references"
                )
        for key, pages in pool._key_map().items():
            for page in pages:
                if pool._key_held_by(page) != key:
                    raise InvariantError(
                        f"key map entry {key!r} points at page {page}, which does not hold it"
                    )
        if pool.is_arena:
            # The arena's lists and unit counts (its free pages live in units, not on one list).
            problem = pool._arena_check()
            if problem is not None:
                raise InvariantError(problem)
            return
        free_list = pool._free_list()
        free_set = set(free_list)
        if len(free_set) != len(free_list) or 0 in free_set:
            raise InvariantError("the free list holds a page twice or holds the null page")
        for page in range(1, total):
            count = pool.ref_count(page)
            if count == 0 and page not in free_set:
                raise InvariantError(f"page {page} has count 0 but is missing from the free list")
            if count > 0 and page in free_set:
                raise InvariantError(f"page {page} has count {count} but is on the free list")
        in_use = sum(1 for page in range(1, total) if pool.ref_count(page) > 0)
        if pool.num_free + in_use + 1 != total:
            raise InvariantError(f"accounting: free {pool.num_free} + in use {in_use} + 1 != {total} pages")

    def _check_host(self, references: list[int], owner: dict[int, int]) -> None:
        """Host tier: each transfer in flight holds one reference on its device page (of its
        group); each request counts exactly its loads; the tier's own bookkeeping agrees."""
        host = self._host
        assert host is not None
        loading: dict[object, int] = {}
        readers = [0] * host.num_pages
        for op in host.ops.values():
            if owner.setdefault(op.device, op.group) != op.group:
                raise InvariantError(f"page {op.device} is pinned by a transfer of another group")
            references[op.device] += 1
            if host.keys[op.host] != op.key:
                raise InvariantError(f"host page {op.host} does not hold the key of its transfer")
            if op.kind == "load":
                readers[op.host] += 1
                if self._requests.get(op.owner_key) is op.owner:
                    loading[op.owner_key] = loading.get(op.owner_key, 0) + 1
            elif host.ready[op.host]:
                raise InvariantError(f"host page {op.host} is findable while its store is in flight")
        if loading != self._loading:
            raise InvariantError(f"requests count loads {self._loading} but {loading} are in flight")
        for page in range(host.num_pages):
            if readers[page] != host.readers[page]:
                raise InvariantError(
                    f"host page {page} counts {host.readers[page]} readers, {readers[page]} loads"
                )
            if readers[page] and not host.ready[page]:
                raise InvariantError(f"host page {page} is read before its store was acknowledged")
            on_lru = host.on_lru(page)
            if on_lru != (host.ready[page] and readers[page] == 0):
                raise InvariantError(f"host page {page} is on the LRU list: {on_lru}")
            key = host.keys[page]
            if key is not None and host.map.get(key) != page:
                raise InvariantError(f"the host key map does not point at host page {page}")
        if len(host.map) != sum(1 for key in host.keys if key is not None):
            raise InvariantError("the host key map and the host pages disagree")
        for space in host.spaces:
            if any(not space.base <= page < space.base + space.size for page in space.lru):
                raise InvariantError("a host LRU list holds a page of another space")
        for page, key in enumerate(host.keys):
            if key is None:
                continue
            serving = host.space(int(key[-8:], 16))
            if serving is None or not serving.base <= page < serving.base + serving.size:
                raise InvariantError(f"host page {page} holds a key of a group it does not serve")
