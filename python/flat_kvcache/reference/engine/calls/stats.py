"""Metrics: the pool probes of SPEC 5 and the counters of docs/requests-api.md, with stable names."""

from __future__ import annotations

from typing import Any

from flat_kvcache._types import CacheStats, PoolStats
from flat_kvcache.reference.engine.coordinator import Coordinator

__all__ = ["Stats"]


class Stats(Coordinator):
    """``pool_stats`` and ``stats``."""

    def pool_stats(self) -> PoolStats:
        """The pool probes of SPEC 5."""
        pool = self._pool
        return {
            "num_blocks": pool.num_blocks,
            "num_free": pool.num_free,
            "num_cached": pool.num_cached,
            "num_cached_free": pool.num_cached_free,
            "num_cached_pinned": pool.num_cached_pinned,
        }

    def arena_stats(self) -> dict[str, Any] | None:
        """The arena's occupancy, or None without arena storage (docs/architecture.md
        "Allocation, as built"): units total, free, idle and bound per group, the free pages of
        busy units per group without a key (``pages_free``; their bytes ``stranded_bytes``) and
        with one (``pages_cached``; ``cached_bytes``)."""
        raw = self._pool.arena_stats()
        if raw is None:
            return None
        return {
            "unit_bytes": raw["unit_bytes"],
            "units_total": raw["units_total"],
            "units_free": raw["units_free"],
            "units_idle": raw["units_idle"],
            "units_bound": dict(zip(self._group_ids, raw["units_bound"], strict=True)),
            "pages_free": dict(zip(self._group_ids, raw["pages_free"], strict=True)),
            "stranded_bytes": raw["stranded_bytes"],
            "pages_cached": dict(zip(self._group_ids, raw["pages_cached"], strict=True)),
            "cached_bytes": raw["cached_bytes"],
        }

    def stats(self) -> CacheStats:
        """The metrics of docs/requests-api.md, with their stable names."""
        pool = self._pool
        host = self._host
        total = pool.num_total
        in_use_by_group = {}
        for group, group_id in enumerate(self._group_ids):
            pages = {page for tables in self._requests.values() for page in tables[group].pages if page != 0}
            if self._host is not None:  # pages pinned by host-tier transfers are in use too
                pages.update(op.device for op in self._host.ops.values() if op.group == group)
            in_use_by_group[group_id] = len(pages)
        return {
            "pages_total": total,
            "pages_free": pool.num_free,
            "pages_in_use": total - pool.num_free,
            "pages_cached": pool.num_cached,
            "pages_cached_free": pool.num_cached_free,
            "requests": len(self._requests),
            "prefix_queries_tokens": self._counters["prefix_queries_tokens"],
            "prefix_hits_tokens": self._counters["prefix_hits_tokens"],
            "evictions": pool._evictions,
            "preemptions": self._counters["preemptions"],
            "pages_in_use_by_group": in_use_by_group,
            "host_pages_total": host.num_pages if host is not None else 0,
            "host_pages_used": len(host.map) if host is not None else 0,
            "host_hits_tokens": self._counters["host_hits_tokens"],
            "host_stores": host.counters["stores"] if host is not None else 0,
            "host_stores_skipped": host.counters["stores_skipped"] if host is not None else 0,
            "host_loads": host.counters["loads"] if host is not None else 0,
            "host_evictions": host.counters["evictions"] if host is not None else 0,
            "host_transfers_in_flight": len(host.ops) if host is not None else 0,
            "checkpoints_written": self._counters["checkpoints_written"],
            "checkpoints_hit": self._counters["checkpoints_hit"],
            "checkpoints_evicted": sum(pool._evictions_by_group.get(g, 0) for g in self._state_groups),
        }
