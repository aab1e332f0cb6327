"""Plain data types and the one kind vocabulary shared by the native-backed API and the reference.

The dataclasses are frozen and carry no behaviour beyond construction checks, so both
implementations return values that compare equal field by field.

Kinds are spelled in four vocabularies, and :data:`LAYER_KINDS` is the one table that ties them:

- ``full_attention``: retention ``full_history``, family ``history``, engine kind ``full``,
  spec kind ``full_attention``;
- ``sliding_attention``: retention ``sliding_window``, family ``history``, engine kind
  ``sliding_window``, spec kind ``sliding_window``;
- ``linear_attention``: retention ``full_history``, family ``state``, engine kind ``state``,
  spec kind ``mamba``;
- ``chunked_attention``: retention ``chunked_window``, family ``history``, engine kind
  ``chunked_local``, spec kind ``chunked_local_attention`` (a token attends its own chunk of
  ``C`` tokens; the sizing API's ``sliding_window_tokens`` carries ``C`` for these layers).

Layer labels come from the model config (SPEC 2); retention and family describe a sizing group
(:class:`PagedCacheGroupSpec`); the engine kind is :attr:`KVCacheSpec.kind` and the
``group_kind`` of a ``BlockStored`` event; the spec kind is vLLM's ``KVCacheSpecKind`` word
that :mod:`flat_kvcache.events` puts on the wire.

This module imports nothing of the package, so every other module may import it.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple, SupportsIndex, TypedDict, cast

#: Layer label of a full-attention layer (keeps all history).
FULL_ATTENTION = "full_attention"
#: Layer label of a sliding-window attention layer (keeps the last ``W - 1`` tokens).
SLIDING_ATTENTION = "sliding_attention"
#: Layer label of a linear-attention / mamba / GDN layer (constant-size recurrent state).
LINEAR_ATTENTION = "linear_attention"
#: Layer label of a chunked local attention layer (Llama 4): a token attends its own chunk.
CHUNKED_ATTENTION = "chunked_attention"

#: Retention of a group that keeps every page of history.
FULL_HISTORY = "full_history"
#: Retention of a group that keeps only the pages inside its window.
SLIDING_WINDOW = "sliding_window"
#: Retention of a group that keeps only the pages of each request's current chunk.
CHUNKED_WINDOW = "chunked_window"
#: Family of a group whose pages hold K/V history rows.
HISTORY = "history"
#: Family of a group whose pages hold recurrent-state snapshots. It is also the engine kind of
#: such a group: the two vocabularies spell it the same way.
STATE = "state"

#: Engine kind (:attr:`KVCacheSpec.kind`) of a full-attention group: prefix-closed, keeps all pages.
FULL = "full"
#: Engine kind of a sliding-window group: keeps the pages of its window, not prefix-closed.
SLIDING = "sliding_window"
#: Engine kind of a chunked local attention group: keeps the pages of the current chunk.
CHUNKED = "chunked_local"
#: The engine kinds, in the order the native core lists them.
KINDS: tuple[str, ...] = (FULL, SLIDING, STATE, CHUNKED)


class LayerKind(NamedTuple):
    """One row of :data:`LAYER_KINDS`: a layer label and what it is called everywhere else."""

    label: str
    retention: str
    family: str
    kind: str
    event_kind: str


#: The kind table: one row per layer label (see the module docstring).
LAYER_KINDS: tuple[LayerKind, ...] = (
    LayerKind(FULL_ATTENTION, FULL_HISTORY, HISTORY, FULL, "full_attention"),
    LayerKind(SLIDING_ATTENTION, SLIDING_WINDOW, HISTORY, SLIDING, "sliding_window"),
    LayerKind(LINEAR_ATTENTION, FULL_HISTORY, STATE, STATE, "mamba"),
    LayerKind(CHUNKED_ATTENTION, CHUNKED_WINDOW, HISTORY, CHUNKED, "chunked_local_attention"),
)

_KIND_OF_GROUP = {(row.retention, row.family): row.kind for row in LAYER_KINDS}

#: The layer labels SPEC 2 knows, in table order.
LAYER_LABELS: tuple[str, ...] = tuple(row.label for row in LAYER_KINDS)
#: Layer labels whose layers keep a recurrent state rather than K/V history.
STATE_LAYER_TYPES: frozenset[str] = frozenset(row.label for row in LAYER_KINDS if row.family == STATE)


def _row(column: str, value: str) -> LayerKind:
    """The row of :data:`LAYER_KINDS` whose ``column`` is ``value`` (``ValueError`` naming the
    values the column knows if there is none)."""
    for row in LAYER_KINDS:
        if getattr(row, column) == value:
            return row
    known = ", ".join(getattr(row, column) for row in LAYER_KINDS)
    raise ValueError(f"unknown {column} {value!r}; expected one of {known}")


def layer_kind(label: str) -> LayerKind:
    """The table row of layer label ``label`` (``ValueError`` naming the known labels if none)."""
    return _row("label", label)


def engine_kind(retention: str, family: str) -> str:
    """The engine kind of a sizing group with ``retention`` and ``family`` (SPEC 2 -> SPEC 7).

    A pair of the table gives its kind. Any other pair follows the retention: a sliding window
    is ``"sliding_window"``, anything else ``"full"``.
    """
    kind = _KIND_OF_GROUP.get((retention, family))
    if kind is not None:
        return kind
    return SLIDING if retention == SLIDING_WINDOW else FULL


def event_kind(kind: str) -> str:
    """vLLM's ``KVCacheSpecKind`` word for engine kind ``kind`` (``ValueError`` if unknown)."""
    return _row("kind", kind).event_kind


def as_int(value: object, name: str) -> int:
    """``value`` as an int: anything with ``__index__`` except ``bool`` (``TypeError`` naming ``name``).

    A bool is refused: ``True`` as a page, token or count is a bug, not a 1.
    """
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, not bool")
    try:
        return operator.index(cast("SupportsIndex", value))
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None


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


@dataclass(frozen=True)
class ArenaGroup:
    """One group of an :class:`ArenaPlan`: a page group (``kind="pages"``, ``item_bytes`` a page's
    bytes) or a state group (``kind="state"``, ``item_bytes`` the state slot's bytes, one slot per
    unit); at most ``per_unit`` items fit a unit, leaving at least ``slack_bytes`` (pages are
    addressed by byte offset and a page that straddles two units is never used, so a unit
    holds ``per_unit`` or ``per_unit - 1`` pages); ``num_ids`` is the size of the group's id
    space (views are indexed by ids below it)."""

    group_id: str
    kind: str
    item_bytes: int
    per_unit: int
    num_ids: int
    slack_bytes: int


@dataclass(frozen=True)
class ArenaComponent:
    """Where one component of one layer lies inside its page (page groups) or state slot."""

    group_id: str
    layer: int
    component: str
    offset: int
    nbytes: int


@dataclass(frozen=True)
class ArenaPlan:
    """The SPEC 13 arena (docs/sizing-api.md "Arena plan"): ``num_units`` units of
    ``unit_bytes`` (unit 0 null), each bound to one group while in use."""

    page_size: int
    alignment: int
    unit_bytes: int
    num_units: int
    groups: tuple[ArenaGroup, ...]
    components: tuple[ArenaComponent, ...]


@dataclass(frozen=True)
class KVCacheSpec:
    """One attention group as the page engine sees it: its kind, page size and window (SPEC 7).

    ``kind`` is one of :data:`KINDS`; ``page_size`` (> 0) is tokens per page; ``sliding_window``
    is an int >= 1 for a sliding group and None otherwise; ``group_id`` None means
    ``f"g{index}"`` by position in the cache; ``chunk_size`` is the chunk ``C`` of a
    ``chunked_local`` group (an int >= 1, a multiple of ``page_size``) and None otherwise. The
    native ``FlatKVCache`` and the reference one both read these five fields.
    """

    kind: str
    page_size: int
    sliding_window: int | None = None
    group_id: str | None = None
    chunk_size: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}; got {self.kind!r}")
        if as_int(self.page_size, "page_size") <= 0:
            raise ValueError(f"page_size must be > 0, got {self.page_size}")
        window = self.sliding_window
        if self.kind == SLIDING:
            if isinstance(window, bool) or not isinstance(window, int) or window < 1:
                raise ValueError(
                    f"sliding_window must be an int >= 1 for a sliding_window group, got {window!r}"
                )
        elif window is not None:
            raise ValueError(f"sliding_window must be None for a {self.kind} group, got {window!r}")
        chunk = self.chunk_size
        if self.kind == CHUNKED:
            if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
                raise ValueError(f"chunk_size must be an int >= 1 for a chunked_local group, got {chunk!r}")
            if chunk % self.page_size:
                raise ValueError(f"chunk_size must be a multiple of page_size {self.page_size}, got {chunk}")
        elif chunk is not None:
            raise ValueError(f"chunk_size must be None for a {self.kind} group, got {chunk!r}")
        if self.group_id is not None and not isinstance(self.group_id, str):
            raise TypeError(f"group_id must be a str or None, got {type(self.group_id).__name__}")


def kv_cache_specs(
    group_specs: Iterable[PagedCacheGroupSpec], page_size: int | None = None
) -> list[KVCacheSpec]:
    """Engine specs from the sizing group specs (SPEC 2 -> SPEC 7), kinds by :func:`engine_kind`.

    ``page_size`` defaults to each spec's ``rows_per_page * entry_stride_tokens``. A sliding
    group keeps its window, a chunked group its chunk (its ``sliding_window_tokens``); group ids
    are kept.
    """
    specs = []
    for index, group in enumerate(group_specs):
        if not isinstance(group, PagedCacheGroupSpec):
            raise TypeError(f"group_specs[{index}] must be a PagedCacheGroupSpec, got {type(group).__name__}")
        size = group.rows_per_page * group.entry_stride_tokens if page_size is None else page_size
        kind = engine_kind(group.retention, group.family)
        window = group.sliding_window_tokens if kind == SLIDING else None
        chunk = group.sliding_window_tokens if kind == CHUNKED else None
        specs.append(KVCacheSpec(kind, size, window, group.group_id, chunk))
    return specs


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
    #: Host-memory tier (docs/requests-api.md, "Host-memory tier"); all 0 without one.
    host_pages_total: int
    host_pages_used: int
    host_hits_tokens: int
    host_stores: int
    host_stores_skipped: int
    host_loads: int
    host_evictions: int
    host_transfers_in_flight: int
    #: State checkpoints (SPEC 13.5); all 0 without state groups.
    checkpoints_written: int
    checkpoints_hit: int
    checkpoints_evicted: int
