"""Plain data types shared by the native-backed API and the pure-Python reference.

These are frozen dataclasses with no behaviour beyond construction, so both implementations
return values that compare equal field by field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypedDict

#: Layer label of a full-attention layer (keeps all history).
FULL_ATTENTION = "full_attention"
#: Layer label of a sliding-window attention layer (keeps the last ``W - 1`` tokens).
SLIDING_ATTENTION = "sliding_attention"
#: Layer label of a linear-attention / mamba / GDN layer (constant-size recurrent state).
LINEAR_ATTENTION = "linear_attention"
#: Layer labels whose layers keep a recurrent state rather than K/V history.
STATE_LAYER_TYPES: frozenset[str] = frozenset({LINEAR_ATTENTION})

#: Retention of a group that keeps every page of history.
FULL_HISTORY = "full_history"
#: Retention of a group that keeps only the pages inside its window.
SLIDING_WINDOW = "sliding_window"
#: Family of a group whose pages hold K/V history rows.
HISTORY = "history"
#: Family of a group whose pages hold recurrent-state snapshots.
STATE = "state"


@dataclass(frozen=True)
class PagedCacheGroupSpec:
    """One paged-cache group: the layers that share a retention rule and window.

    ``raw = rows_per_page * entry_stride_tokens`` is the number of tokens a page covers.
    """

    group_id: str
    retention: str
    rows_per_page: int
    entry_stride_tokens: int
    sliding_window_tokens: int | None
    family: str = HISTORY


@dataclass(frozen=True)
class ComponentSpec:
    """One memory component of one layer: ``bytes_per_slot`` per token plus ``const_bytes`` per page."""

    group_id: str
    layer: int
    component: str
    bytes_per_slot: int
    const_bytes: int


@dataclass(frozen=True)
class BlockGeometry:
    """Page geometry: tokens per page (``block_size``), bytes per page row, and page count."""

    block_size: int
    block_bytes: int
    num_blocks: int = 0


@dataclass(frozen=True)
class LayerBinding:
    """Where one (group, layer, component) lives inside a planned tensor."""

    slot: int
    group_id: str
    layer: int
    component: str
    nbytes_per_block: int
    row_offset: int


@dataclass(frozen=True)
class TensorPlan:
    """One buffer of the memory plan: its name, total size, and the bindings it serves."""

    name: str
    nbytes: int
    bindings: tuple[LayerBinding, ...]


@dataclass(frozen=True)
class FlatMemoryPlan:
    """A complete memory plan: the page geometry and the tensors to allocate."""

    geometry: BlockGeometry
    tensors: tuple[TensorPlan, ...]


class PoolStats(TypedDict):
    """``FlatKVCache.pool_stats()``: the block-pool probes of SPEC 5 (the null page not counted)."""

    num_blocks: int
    num_free: int
    num_cached: int
    num_cached_free: int
    num_cached_pinned: int


class CacheStats(TypedDict):
    """``FlatKVCache.stats()``: Prometheus-friendly counters with stable names (docs/requests-api.md)."""

    pages_total: int
    pages_free: int
    pages_in_use: int
    pages_cached: int
    pages_cached_free: int
    requests: int
    prefix_queries_tokens: int
    prefix_hits_tokens: int
    evictions: int
    preemptions: int
    pages_in_use_by_group: dict[str, int]
