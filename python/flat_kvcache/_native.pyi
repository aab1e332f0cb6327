"""Type stubs for the native extension `flat_kvcache._native` (hand-written).

Errors: argument errors are builtins whose message names the argument (``TypeError`` for a
wrong type, ``ValueError`` for a bad value, ``OverflowError`` for a size that does not fit the
native integer type). Failures a caller may catch by kind raise the classes of
:mod:`flat_kvcache.errors`: ``ConfigError``, ``FlatUnavailableError`` and ``InvariantError``
(each a ``RuntimeError``) and ``UnknownRequestError`` (a ``KeyError``).
"""

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal, Protocol, SupportsIndex, final, overload

import numpy as np
import numpy.typing as npt
from typing_extensions import disjoint_base

from flat_kvcache._types import ArenaPlan, CacheStats, PoolStats

#: The package version the extension was built as.
__version__: str
#: True when the extension was compiled with the ``flat`` cargo feature (SPEC 10).
FLAT_KVCACHE: bool
# PyO3's declarative module sets __all__ to every #[pymodule_export] (sorted here).
__all__ = [
    "FLAT_KVCACHE",
    "BlockPool",
    "FlatKVCache",
    "PageCache",
    "PrefixMatch",
    "_PagedCacheBase",
    "__version__",
    "components_from_layers",
    "compute_max_logical_pages_for_capture",
    "compute_paged_cache_group_page_counts",
    "equalized_block_size",
    "fold_hashes",
    "group_key",
    "group_specs_from_layer_types",
    "hash_page",
    "hash_pages",
    "hybrid_slab_group_size",
    "layer_group_ids",
    "occurrence_index",
    "plan_arena",
    "plan_component_tensors",
    "plan_tensors",
    "publish_paged_cache_groups",
    "scheduler_ext_flat_kvcache",
    "solve_page_geometry",
    "state_const_bytes",
    "validate_flat_scheduler_config",
]

# --- sizing API and memory plan (SPEC 2, 3, 10; rust/py/src/sizing.rs, plan.rs) ---------------
# Arguments are validated natively (wrong types raise TypeError/ValueError), so they are typed
# loosely here; flat_kvcache.sizing / flat_kvcache.memory carry the precise public hints.

#: (group_id, retention, rows_per_page, entry_stride_tokens, sliding_window_tokens, family)
_SpecTuple = tuple[str, str, int, int, int | None, str]
#: (group_id, layer, component, bytes_per_slot, const_bytes)
_ComponentTuple = tuple[str, int, str, int, int]
#: (slot, group_id, layer, component, nbytes_per_block, row_offset); group_id and component are
#: the objects of the input components.
_BindingTuple = tuple[int, Any, int, Any, int, int]
#: ((block_size, block_bytes, num_blocks), [(name, nbytes, [binding, ...]), ...])
_PlanTuple = tuple[tuple[int, int, int], list[tuple[str, int, list[_BindingTuple]]]]

def scheduler_ext_flat_kvcache() -> bool:
    """Whether the module was built with the ``flat`` cargo feature (the value of ``FLAT_KVCACHE``)."""

def layer_group_ids(layer_types: object, sliding_window_tokens: object = None) -> list[str]:
    """The group id of every layer (SPEC 2).

    ``layer_types`` is a sequence of layer labels; ``sliding_window_tokens`` None, one window
    for every sliding layer, or one entry per layer. A sliding layer's id is
    ``sliding_attention_<window>`` when sliding layers carry several windows, else its label.
    Raises ``TypeError`` / ``ValueError`` naming a malformed argument.
    """

def group_specs_from_layer_types(
    layer_types: object, sliding_window_tokens: object = None, *, page_size: SupportsIndex
) -> list[_SpecTuple]:
    """One spec tuple per distinct group id, in first-appearance order (SPEC 2).

    Each is ``(group_id, retention, rows_per_page, entry_stride_tokens, sliding_window_tokens,
    family)``; ``page_size`` (> 0) is tokens per page. Raises ``TypeError`` / ``ValueError``
    naming a malformed argument.
    """

def compute_paged_cache_group_page_counts(
    specs: Iterable[object],
    *,
    max_live_requests: SupportsIndex,
    max_scheduled_tokens: SupportsIndex,
    max_total_tokens: SupportsIndex,
    max_context_len: SupportsIndex,
    decode_input_tokens: SupportsIndex = 1,
    overlap_schedule_depth: SupportsIndex = 0,
    safety_margin: SupportsIndex = 0,
) -> dict[Any, int]:
    """Pages each group needs under the given limits (SPEC 2), as ``{group_id: pages}``.

    ``specs`` are ``PagedCacheGroupSpec``-like objects; the limits are non-negative ints.
    Raises ``TypeError`` / ``ValueError`` naming a malformed argument, ``OverflowError`` when a
    count does not fit an unsigned 64-bit integer.
    """

def publish_paged_cache_groups(
    *,
    layer_types: object,
    sliding_window_tokens: object,
    page_size: SupportsIndex,
    max_live_requests: SupportsIndex,
    max_scheduled_tokens: SupportsIndex,
    max_total_tokens: SupportsIndex,
    max_context_len: SupportsIndex,
) -> tuple[list[_SpecTuple], dict[str, int]] | None:
    """Publication (SPEC 2): ``(spec tuples, {group_id: pages})`` for the model's layers.

    Returns None when the module was built without the ``flat`` feature (SPEC 10), before any
    argument is checked. Raises ``TypeError`` / ``ValueError`` naming a malformed argument.
    """

def compute_max_logical_pages_for_capture(
    spec: object,
    *,
    max_context_len: SupportsIndex,
    max_tokens_per_req: SupportsIndex = 1,
    overlap_schedule_depth: SupportsIndex = 0,
) -> int:
    """The logical pages one request of a group touches at once (SPEC 2, 12.1).

    A full-history group's table width; a sliding group's *windowed* row width (absolute
    sliding tables keep slid-out holes and need the full-history width). ``spec`` is a
    ``PagedCacheGroupSpec``-like object. Raises ``TypeError`` / ``ValueError`` naming a
    malformed argument.
    """

def hybrid_slab_group_size(layer_types: object, *, sliding_window_tokens: object = None) -> int | None:
    """How many K/V slabs the layers can share (SPEC 2, 11), or None.

    Never raises: arguments that cannot be read, or a build without the ``flat`` feature,
    give None.
    """

def validate_flat_scheduler_config(
    *,
    flat_kvcache_ext: object,
    paged_cache_groups: object,
    attn_backend: object,
    kv_pool: object,
    speculative_algorithm: object = None,
) -> None:
    """Refuse scheduler configurations that would corrupt the flat KV cache (SPEC 2).

    A no-op when ``flat_kvcache_ext`` is false or the module was built without the ``flat``
    feature. Otherwise raises ``ConfigError`` (a ``RuntimeError``) for the first problem found,
    in the contract's order.
    """

def occurrence_index(layer_types: object) -> list[int]:
    """For each layer, the number of earlier layers with the same label (SPEC 3).

    Raises ``TypeError`` when ``layer_types`` is not a sequence of labels.
    """

def state_const_bytes(shape: object, itemsize: SupportsIndex) -> int:
    """Bytes per page of one state component: ``prod(shape) * itemsize`` (SPEC 3).

    Raises ``TypeError`` / ``ValueError`` naming a malformed argument, ``OverflowError`` when
    the product does not fit an unsigned 64-bit integer.
    """

def components_from_layers(
    layer_types: object,
    *,
    kv_bytes_per_slot: SupportsIndex,
    state_component_bytes: object = None,
    sliding_window_tokens: object = None,
) -> list[_ComponentTuple]:
    """The memory components of every layer (SPEC 3).

    Each is ``(group_id, layer, component, bytes_per_slot, const_bytes)``. Raises
    ``TypeError`` / ``ValueError`` naming a malformed argument.
    """

def solve_page_geometry(
    components: Iterable[object], block_size: SupportsIndex, alignment: SupportsIndex
) -> tuple[int, int, int]:
    """Page geometry (SPEC 3) as ``(block_size, block_bytes, 0)``.

    ``components`` are component tuples or objects; ``block_size`` and ``alignment`` are
    positive ints. Raises ``TypeError`` / ``ValueError`` naming a malformed argument.
    """

def equalized_block_size(
    components: Iterable[object], block_size: SupportsIndex, alignment: SupportsIndex | None = None
) -> int:
    """The block size of ``solve_page_geometry``, ``alignment`` defaulting to ``block_size`` (SPEC 3).

    Raises ``TypeError`` / ``ValueError`` naming a malformed argument.
    """

def plan_component_tensors(
    components: Iterable[object],
    block_size: SupportsIndex,
    budget_bytes: SupportsIndex,
    *,
    reserved_bytes_per_block: SupportsIndex = 0,
) -> _PlanTuple:
    """The per-component memory plan (SPEC 3): one tensor per component.

    Returns ``((block_size, block_bytes, num_blocks), [(name, nbytes, bindings), ...])``.
    Raises ``TypeError`` / ``ValueError`` naming a malformed argument.
    """

def plan_tensors(
    components: Iterable[object], block_size: SupportsIndex, budget_bytes: SupportsIndex
) -> _PlanTuple:
    """The slab memory plan (SPEC 3): slot j is one tensor shared by the j-th layer of every group.

    Returns ``((block_size, block_bytes, num_blocks), [(name, nbytes, bindings), ...])``.
    Raises ``TypeError`` / ``ValueError`` naming a malformed argument.
    """

def plan_arena(
    components: Iterable[object],
    page_size: SupportsIndex,
    budget_bytes: SupportsIndex,
    *,
    alignment: SupportsIndex = 256,
    max_live_requests: SupportsIndex = 0,
) -> tuple[int, int, int, int, list[tuple[int, str, int, int, int, int]], list[tuple[int, int]]]:
    """The arena plan of the SPEC 13 storage (docs/sizing-api.md "Arena plan").

    Returns ``(page_size, alignment, unit_bytes, num_units, groups, components)``: per group
    ``(index of its first component, kind, item_bytes, per_unit, num_ids, slack_bytes)``, per
    component ``(offset, nbytes)``. Raises ``TypeError`` / ``ValueError`` / ``OverflowError``
    naming a malformed argument or the size that does not fit, and ``ConfigError`` when a
    model with state groups gets fewer units than ``max_live_requests`` (0: not checked).
    """

# ----- page engine (SPEC 4-8, docs/engine-api.md) ----------------------------------------------

#: Ints from Python: a sequence of ints or numpy integer scalars, or a 1-D integer array of any
#: integer dtype and strides (a CPU torch integer tensor is accepted too, through ``.numpy()``).
#: Floats and bools are a ``TypeError`` naming the argument.
_Tokens = Sequence[SupportsIndex] | npt.NDArray[np.integer[Any]]
_Counts = Sequence[SupportsIndex] | npt.NDArray[np.integer[Any]]
_RequestId = str | int
# A content hash: 64 lowercase hex digits, or its 32 raw bytes (the same hash).
_ContentHash = str | bytes
#: The orders in which a request's pages go back to the free list.
_EvictionOrder = Literal["hybrid", "group"]
#: When pages are copied to the host tier.
_HostStore = Literal["write_through", "evict"]
#: A caller-provided block-table buffer: a writable C-contiguous int32 array or CPU torch tensor.
_TableBuffer = Any
#: One event of ``take_events``: ``flat_kvcache.events.BlockStored | BlockRemoved | AllBlocksCleared``.
_KVEvent = Any

class _GroupSpec(Protocol):
    """What ``FlatKVCache`` reads of a group spec (``flat_kvcache.engine.KVCacheSpec`` has it).

    ``kind`` is ``"full"``, ``"sliding_window"``, ``"state"`` or ``"chunked_local"`` (typed
    ``str``, as ``KVCacheSpec.kind`` is; another name is a ``ValueError``); ``sliding_window`` is
    an int >= 1 for a sliding group and None otherwise; ``chunk_size`` is the chunk of a
    ``chunked_local`` group (a multiple of ``page_size``) and None otherwise; ``group_id`` None
    means ``f"g{index}"``.
    """

    @property
    def kind(self) -> str:
        """The kind name."""

    @property
    def page_size(self) -> int:
        """Tokens per page (> 0)."""

    @property
    def sliding_window(self) -> int | None:
        """The window in tokens of a sliding group, else None."""

    @property
    def group_id(self) -> str | None:
        """The group id, or None for ``f"g{index}"``."""

    @property
    def chunk_size(self) -> int | None:
        """The chunk in tokens of a chunked_local group, else None."""

def hash_page(tokens: _Tokens, prior: str = "", extra_keys: Sequence[str] = ()) -> str:
    """The content hash of one page (SPEC 4), as 64 lowercase hex digits.

    SHA-256 over little-endian u32 fields: ``len(prior raw)``, the prior's raw bytes,
    ``len(tokens)``, each token, then (if ``extra_keys`` is non-empty) their count and each
    key's UTF-8 length and bytes. ``tokens`` is a sequence of ints or a 1-D integer array (each
    must fit u32), ``prior`` is ``""`` or hex text of even length, ``extra_keys`` a sequence of
    str. Raises ``TypeError`` / ``ValueError`` naming the bad argument or element.
    """

def hash_pages(
    token_ids: _Tokens, page_size: int, *, prior: str = "", extra_keys: Sequence[str] = ()
) -> list[str]:
    """The chained content hashes of the full pages of ``token_ids`` (SPEC 4).

    ``h_0 = hash_page(page_0, prior, extra_keys)``, then ``h_i = hash_page(page_i, h_{i-1},
    extra_keys)``; a trailing partial page is ignored. ``page_size`` must be > 0. Releases the
    GIL while hashing. Raises ``TypeError`` / ``ValueError`` naming the bad argument or element.
    """

def group_key(content_hash: str, group_index: int) -> str:
    """The pool key of a content hash in group ``group_index``: the hash text then the group as
    8 hex digits (big-endian u32).

    Raises ``ValueError`` when ``group_index`` is not in ``[0, 2**32)``, ``TypeError`` when it
    is not an int.
    """

def fold_hashes(base_hashes: Sequence[str], first_base: int, m: int) -> list[str]:
    """Fold base-page hashes into the hashes of a group whose page is ``m`` base pages wide.

    ``base_hashes[j]`` is the hash of base page ``first_base + j``. The fold skips to the first
    base page index that is a multiple of ``m``, then folds each complete run of ``m`` hashes
    (``run = ""``, then ``run = hash_page([], run, [h])`` for each ``h``); incomplete runs at
    either end are dropped and ``m == 1`` returns a copy. Raises ``TypeError`` for a non-str
    hash and ``ValueError`` for ``m == 0`` or a negative ``first_base``.
    """

@final
class BlockPool:
    """The page pool of SPEC 5 with string keys.

    Page 0 is the null page (never free, cached or counted); the free list starts as
    ``1..num_blocks-1`` and is the eviction order. Misuse raises ``ValueError`` and changes
    nothing. Safe to share between threads.

    :meth:`with_arena` builds a pool in arena mode (SPEC 13.2): equal units bound to one group
    at a time, each group's pages taken from its own units (see ``rust/core/src/engine/pool/
    arena.rs`` and the reference ``flat_kvcache.reference.engine.pool``).
    """

    def __new__(
        cls, num_blocks: int, *, enable_caching: bool = True, reuse_uncached_first: bool = True
    ) -> BlockPool:
        """A pool of ``num_blocks >= 1`` pages, page 0 included; ``ValueError`` for 0.

        ``reuse_uncached_first``: a released page that holds no key joins the front of the free
        list (handed out before any cached page) instead of the back (SPEC 5's order).
        """

    @staticmethod
    def with_arena(
        unit_bytes: int, num_units: int, page_bytes: Sequence[int], *, enable_caching: bool = True
    ) -> BlockPool:
        """A pool in arena mode: ``num_units`` units of ``unit_bytes`` (unit 0 is null), group
        ``g``'s pages of ``page_bytes[g]`` bytes; every unit starts free.

        Unit ``u`` holds group ``g``'s view pages ``ceil(u*U/s) .. floor((u+1)*U/s) - 1`` (a page
        straddling two units is never handed out); page ``p`` is pool id ``group_base(g) + p``.
        The arguments are checked as ints first (``TypeError`` / ``ValueError`` /
        ``OverflowError`` naming them), then the geometry (``ValueError`` naming the problem):
        ``unit_bytes > 0``, ``2 <= num_units <= 2**31 - 1``, one page size per group, each in
        ``[1, unit_bytes]`` with every unit holding a page, at most ``2**31 - 1`` ids in all, and
        an lcm of the groups' fewest pages per unit of at most ``2**24``.
        """

    @property
    def num_blocks(self) -> int:
        """Total pages, the null page included."""

    @property
    def num_free(self) -> int:
        """Pages on the free list; in arena mode the free credit (a listed page of group ``g``
        counts ``page_cost(g)``, a free or idle unit the lcm of the groups' fewest pages per
        unit)."""

    @property
    def num_total(self) -> int:
        """What ``num_free`` counts when nothing is allocated: the pages but the null page; in
        arena mode the credit of every unit but the null one."""

    def arena_stats(self) -> dict[str, Any] | None:
        """The arena's occupancy, or None without an arena: ``unit_bytes``, ``units_total``,
        ``units_free``, ``units_idle``, ``stranded_bytes``, ``cached_bytes``, and
        ``units_bound``, ``pages_free`` and ``pages_cached`` (lists, one entry per group: the
        units bound to it, idle ones included, and the free pages of its busy units, usable by
        it only, without a key and with one; ``stranded_bytes`` and ``cached_bytes`` are their
        bytes)."""

    @property
    def is_arena(self) -> bool:
        """Whether the pool is in arena mode."""

    def group_base(self, g: int) -> int:
        """The pool id of group ``g``'s view index 0 (0 without an arena); in arena mode ``g``
        must be one of the groups (``ValueError``)."""

    def group_ids(self, g: int) -> int:
        """The ids of group ``g``'s view, the null page included (without an arena: the pool's
        pages)."""

    def page_cost(self, g: int) -> int:
        """What one page of group ``g`` counts in ``num_free``: 1, or its credit in arena mode."""

    def fits(self, needs: Sequence[int] | npt.NDArray[np.integer[Any]]) -> bool:
        """Whether taking ``needs[g]`` pages for each group ``g`` (in group order) succeeds.

        Without an arena: whether their sum is at most ``num_free``. In arena mode ``needs`` may
        be shorter than the groups (the rest need 0), never longer (``ValueError``).
        """

    def fits_after_claim(
        self, claimed: Iterable[int], needs: Sequence[int] | npt.NDArray[np.integer[Any]]
    ) -> bool:
        """Whether claiming ``claimed`` (one more reference on each; any counts, repeats
        allowed, 0 entries skipped) and then taking ``needs[g]`` pages per group succeeds.

        Checked first: each claimed page in range, ``needs`` as in :meth:`fits`, then in arena
        mode each claimed page of count 0 claimable as :meth:`touch` requires. Nothing changes.
        """

    @property
    def num_cached(self) -> int:
        """Pages holding a key."""

    @property
    def num_cached_free(self) -> int:
        """Pages holding a key with reference count 0."""

    @property
    def num_cached_pinned(self) -> int:
        """Pages holding a key with reference count > 0."""

    def allocate(self, n: int, group: int = 0) -> list[int]:
        """Take ``n >= 0`` pages from the front of the free list, all or nothing.

        Returns ``[]`` (and changes nothing) when fewer than ``n`` are free; taking a cached
        page evicts its key. In arena mode the pages are ``group``'s (one of the arena's
        groups, else ``ValueError``), from its units' free pages, then a free unit, then the
        least recently idle unit (all its keys evicted); without an arena ``group`` is checked
        as a count and otherwise ignored.
        """

    def touch(self, page: int) -> None:
        """Claim one more reference on ``page`` (taking it off the free list at count 0).

        Page 0 is a no-op; a page out of range is a ``ValueError``. In arena mode a page of
        count 0 must lie in a unit bound to its group (on its group's free pages, or in an idle
        unit, which becomes busy): any other page is a ``ValueError``.
        """

    def free(self, pages: Iterable[int]) -> None:
        """Release ``pages`` in reverse order (0 entries skipped).

        At count 0 a page goes to the back of the free list with its key intact. Everything is
        validated first: a bad page or a page with count 0 is a ``ValueError`` and nothing
        changes.
        """

    def cache(self, page: int, key: str) -> None:
        """Register ``key`` for ``page`` (a no-op with caching off or for page 0).

        ``ValueError`` when the page already holds a key or is out of range, and in arena mode
        for a page of count 0 that :meth:`touch` could not claim.
        """

    def lookup(self, key: str) -> int | None:
        """The earliest-registered page still holding ``key``, or None."""

    def ref_count(self, page: int) -> int:
        """Reference count of ``page`` (``ValueError`` when out of range)."""

    def is_cached(self, page: int) -> bool:
        """Whether ``page`` holds a key (``ValueError`` when out of range)."""

    def _clear_cached_free(self) -> list[str]:
        """Drop the key of every cached page of count 0 (not evictions); the dropped keys in
        free-list order (arena mode: each group's free pages, then the idle units least
        recently idle first, ids ascending). For tests."""

    def _set_record_evictions(self, on: bool) -> None:
        """Keep (or stop keeping, dropping those kept) the keys allocations evict. For tests."""

    def _take_evicted(self) -> list[str]:
        """The keys evicted since the last call, in eviction order. For tests."""

    def _check(self) -> str | None:
        """The first broken pool invariant, described, or None. For tests."""

@final
class PrefixMatch:
    """The result of ``FlatKVCache.match_prefix``.

    Per group, the matched page of each slot (0 = hole) and the number of real pages, plus
    the token count every group can resume from. A match remembers the key each real page was
    matched under, so a claim refuses it once a page holds another key (or none). Equality
    compares the three public fields only.
    """

    def __new__(
        cls, num_common_tokens: int, pages: Sequence[Sequence[int]], num_hit_pages: Sequence[int]
    ) -> PrefixMatch:
        """Build a match by hand (it remembers no keys).

        ``pages`` is one sequence of page ids per group (each in ``[0, 2**31 - 1)``, else a
        ``ValueError`` naming ``pages[g][i]``); ``num_hit_pages`` one count per group. A claim
        of a hand-built match only requires each real page to hold a key of its group.
        """

    @property
    def num_common_tokens(self) -> int:
        """Tokens every group can resume from (a multiple of the lcm page size)."""

    @property
    def pages(self) -> list[list[int]]:
        """Per group, the matched page of each slot (0 = hole)."""

    @property
    def num_hit_pages(self) -> list[int]:
        """Per group, the number of real (non-hole) matched pages."""

    def __eq__(self, other: object, /) -> bool:
        """Equal when ``num_common_tokens``, ``pages`` and ``num_hit_pages`` are."""

@disjoint_base
class _PagedCacheBase:
    """The state and calls ``FlatKVCache`` (token-level, docs/requests-api.md) and ``PageCache``
    (page-level, docs/engine-api.md) share: the geometry, counters, KV events, the host tier's
    transfers and the invariant check. Calls that name a request are each class's own
    (``FlatKVCache`` names requests by slot, ``PageCache`` by id). Not constructible itself.

    Running out of pages is not an error: the calls that need pages return False and change
    nothing. Safe to share between threads.
    """

    @property
    def base_page_size(self) -> int:
        """The base page size (gcd of the groups' page sizes)."""

    @property
    def lcm_page_size(self) -> int:
        """The lcm of the groups' page sizes."""

    @property
    def num_groups(self) -> int:
        """Number of groups."""

    @property
    def group_ids(self) -> list[str]:
        """Group ids in group order."""

    @property
    def num_free_pages(self) -> int:
        """Pages on the free list."""

    @property
    def num_requests(self) -> int:
        """Number of live requests."""

    def pool_stats(self) -> PoolStats:
        """The pool counters: ``num_blocks num_free num_cached num_cached_free num_cached_pinned``."""

    def check_invariants(self) -> None:
        """Check every engine invariant; ``InvariantError`` (a ``RuntimeError``) names the first
        violation."""

    def arena_stats(self) -> dict[str, Any] | None:
        """The arena's occupancy, or None without arena storage: ``unit_bytes``,
        ``units_total``, ``units_free``, ``units_idle``, ``units_bound``, ``pages_free`` and
        ``pages_cached`` (``{group_id: n}``; a group's free pages are those of its busy units,
        usable by it only: without a key and with one), ``stranded_bytes`` and ``cached_bytes``
        (their bytes)."""

    def stats(self) -> CacheStats:
        """Metrics with stable names (see :class:`flat_kvcache._types.CacheStats`)."""

    def take_transfers(
        self,
    ) -> dict[str, dict[str, tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]]]:
        """The host-tier transfers emitted since the last call, now handed out.

        ``{"store": {group_id: (ids, src, dst)}, "load": {group_id: (ids, src, dst)}}``, int64
        arrays, groups in index order (only groups with transfers), transfers in emission
        order. A store copies device page ``src[i]`` to host page ``dst[i]`` in the layers of
        that group; a load copies host page ``src[i]`` to device page ``dst[i]``. Over an arena
        a device page is the index in the group's view (as in its block tables and
        ``state_slots``) and a host page one of the group's own host pages ``[0, n_g)``; without
        one, host pages are shared by every group. A device page
        being stored is never handed out again until the store is acknowledged; a load's
        destination is already in its request's block tables, and that request cannot be
        scheduled until every load into it is acknowledged. ``{"store": {}, "load": {}}``
        without a tier.
        """

    def ack_transfers(self, ids: _Counts) -> None:
        """Acknowledge finished transfers by id, in any order and any grouping.

        A store makes its host page a hit for later requests; a load registers its device page
        (a device hit from now on, with a ``BlockStored`` event) and unblocks its request once
        its last load is in. A load acknowledged after its request finished, was preempted or
        aborted just releases the page. ``ValueError`` (nothing changes) for an id not in
        flight, not handed out by ``take_transfers`` yet, or listed twice.
        """

    def transfers_in_flight(self) -> int:
        """Transfers emitted and not acknowledged yet (handed out or not)."""

    def take_events(self) -> list[_KVEvent]:
        """The KV events recorded since the last call, oldest first (``[]`` with events off)."""

    def reset_prefix_cache(self) -> int:
        """Drop the key of every cached page with count 0; returns how many keys were dropped.

        The pages stay free; pages held by requests keep their keys. Events: ``AllBlocksCleared``
        when no request held a cached page (no key is left), else one ``BlockRemoved`` per group
        of the dropped keys.
        """

@final
class FlatKVCache(_PagedCacheBase):
    """The token-level protocol (docs/requests-api.md): requests that own their tokens.

    A request enters with ``add_request`` / ``admit`` under an id (``str`` or ``int``; ``5``
    and ``"5"`` differ) and gets a *slot*, the small int every later call names it by: the
    lowest slot no live request holds, which is also its row in the tables bound by
    :meth:`bind_rows`. ``finish`` / ``preempt`` free the slot. A slot that holds no request is
    an ``UnknownRequestError`` (a ``KeyError``). The per-step calls take slot arrays (a
    sequence of ints or a 1-D integer array) and validate everything before changing anything.
    The page-level calls are ``PageCache``'s (absent here); the shared calls are
    :class:`_PagedCacheBase`'s.
    """

    def __new__(
        cls,
        specs: Iterable[_GroupSpec],
        num_pages: int | None = None,
        *,
        arena: ArenaPlan | None = None,
        enable_caching: bool = True,
        eviction_order: _EvictionOrder = "hybrid",
        enable_kv_events: bool = False,
        reuse_uncached_first: bool = True,
        host_pages: int | Mapping[str, int] | None = 0,
        host_store: _HostStore = "write_through",
        eviction_policy: Literal["lru", "reuse"] = "lru",
        register_on_schedule: bool = False,
    ) -> FlatKVCache:
        """The token-level engine over ``specs`` (non-empty) with a pool of ``num_pages >= 1`` pages.

        ``register_on_schedule`` (same-step sharing, docs/requests-api.md): a successful
        ``schedule`` registers at once the full pages of the chunk it takes (otherwise they are
        registered at the request's next ``schedule``, ``finish`` or ``preempt``), so a request
        admitted later in the same step hits them, as vLLM's scheduler does. Exact because the
        forward writes every attention layer's K/V before that layer's attention reads any; the
        caller must run every chunk it scheduled. Ignored for a model with state groups (a
        checkpoint exists only once its chunk is computed).

        ``eviction_policy`` is the state checkpoint policy (SPEC 13.8): both ``"lru"``
        (default) and ``"reuse"`` keep every checkpoint SPEC 13.5 writes until the pool evicts
        it, oldest first; ``"reuse"`` adds the body's end on the sharing grain learned from the
        divergence points of the prompts seen, and whole hybrid prefixes.

        ``eviction_order`` ``"hybrid"`` frees a request's pages by slot end token, descending,
        across all groups (SPEC 12.3); ``"group"`` frees group 0's table tail first, then group
        1's, and so on. ``enable_kv_events`` records KV events for ``take_events``.
        ``reuse_uncached_first``: a released page that holds no key joins the front of the free
        list (handed out before any cached page) instead of the back. Raises
        ``TypeError`` / ``ValueError`` naming a malformed spec (``specs[i].kind`` ...) or option.

        ``host_pages > 0`` adds a host-memory tier of that many pages of the same geometry
        (host page ids ``[0, host_pages)``): pages are copied there and loaded back on a prefix
        hit, through transfers the engine runs (``take_transfers`` / ``ack_transfers``).
        ``host_store``: ``"write_through"`` copies each page as it is registered;
        ``"evict"`` copies a cached page when its last reference goes (it joins the free list
        once the copy is acknowledged). 0 (default): no tier, nothing changes.

        ``arena`` (an :class:`ArenaPlan` from ``plan_arena``, instead of ``num_pages``): the
        pages live in the plan's arena of units (SPEC 13.2, docs/architecture.md "Hybrid
        storage"); each group's page ids index its own view of the arena, and ``budget``,
        ``pages_needed`` and ``stats()["num_free"]`` count arena credits. Not combinable with
        ``reuse_uncached_first=False``. Over an arena the host tier is per group: group ``g``
        has host pages ``[0, n_g)`` of its own page geometry (a state group's: whole state
        slots, so checkpoints are stored and loaded back too); ``host_pages`` is an int (that
        many for every group) or a mapping ``{group_id: n}`` (groups not named get none and are
        not tiered; an unknown group id is a ``ValueError``, a mapping without an arena a
        ``TypeError``); ``stats()``'s ``host_*`` figures are totals over the groups.
        """

    def add_request(
        self,
        req: _RequestId,
        prompt_token_ids: _Tokens,
        *,
        extra_keys: Sequence[str] = (),
        use_prefix_cache: bool = True,
    ) -> tuple[int, int]:
        """Add a token-level request for a non-empty prompt (each token must fit u32).

        Every full base page is hashed (chained, ``extra_keys`` on every page) with the GIL
        released; with caching on and ``use_prefix_cache``, the prefix match over all but the
        last prompt token is claimed. Returns ``(slot, hit)``: the request's slot (the lowest
        free one) and its hit in tokens (its computed tokens). ``ValueError`` for an id already
        in use, an empty prompt, or (with rows bound) every row held.
        """

    def admit(
        self,
        req: _RequestId,
        prompt_token_ids: _Tokens,
        max_new_tokens: int,
        *,
        extra_keys: Sequence[str] = (),
        use_prefix_cache: bool = True,
    ) -> tuple[int, int, int] | None:
        """SPEC 9 admission in one call (one hash, one prefix match).

        The first chunk is the :meth:`next_chunk` cut of the prompt after the capped hit, at
        most ``max_new_tokens`` (``min(len(prompt) - hit, max_new_tokens)`` without state
        groups), with one token of reserve when it completes the prompt. None, with nothing
        changed, when rows are bound and every row is held, or when
        ``pages_needed_to_admit(prompt, chunk, reserve)`` exceeds ``budget()``; otherwise the
        request is added as :meth:`add_request` would add it and the answer is
        ``(slot, hit, chunk)``. Scheduling the chunk is left to the caller. Errors as
        :meth:`add_request`.
        """

    def slot_of(self, req: _RequestId) -> int | None:
        """The slot of live request ``req``, or None."""

    def id_of(self, slot: int) -> str | int:
        """The id the request in ``slot`` was added with."""

    def state_slots(
        self, slots: _Counts, num_new_tokens: _Counts
    ) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int32]]:
        """The read and write state slots of a step (SPEC 13.4), after ``schedule(slots,
        num_new_tokens)``: two int32 arrays of the state group's slot ids.

        The step reads the state after the request's last token before it from ``read[i]``
        (0, the all-zero null slot, for a fresh request) and writes the state after its new
        tokens to ``write[i]``; where they differ, copy ``read[i]`` into ``write[i]`` first and
        run the step in place on ``write[i]`` (``read[i]`` is then a checkpoint: leave it).
        They are equal while the request keeps its working slot (no checkpoint behind it).
        ``ValueError`` unless the model has exactly one state group, or for a count above the
        request's computed tokens or other than its last ``schedule``'s; ``UnknownRequestError``
        for a free slot.
        """

    def schedule(
        self, slots: _Counts, num_new_tokens: _Counts, *, lookahead: int = 0
    ) -> npt.NDArray[np.bool_]:
        """Schedule a step: the request in ``slots[i]`` schedules its next ``num_new_tokens[i]``
        known tokens.

        Each registers its completed full pages, reclaims slid-out pages, then acquires room for
        the tokens plus ``lookahead`` slots, all or nothing, in order. True: the position moved
        and the reserve was released; False: nothing was allocated. Everything is validated
        first and nothing changes on error: ``UnknownRequestError`` for a free slot;
        ``ValueError`` for more tokens than are known (repeats of a slot count together), host
        page loads in flight, or a length mismatch.
        """

    def append_tokens(self, slots: _Counts, token_ids: _Tokens, num_tokens: _Counts | None = None) -> None:
        """Append newly known tokens (a step's samples): the request in ``slots[i]`` gets the next
        ``num_tokens[i]`` entries of the flat ``token_ids``, or exactly one each when
        ``num_tokens`` is None, in order.

        Each base page that fills is hashed once, chained to the previous one. Everything is
        validated first (``ValueError`` for lengths that do not add up, ``UnknownRequestError``
        for a free slot) and nothing changes on error.
        """

    def reserve(self, slots: _Counts, tokens: _Counts) -> None:
        """Promise ``pages_needed(tokens[i], slots[i])`` pages to each request's next decode.

        Replaces the previous reserve (0 clears it; a repeated slot: the last one counts);
        released by a successful ``schedule``, ``finish`` and ``preempt``.
        """

    def finish(self, slots: _Counts) -> None:
        """For each slot: register the request's full pages, free its pages, free the slot and id.

        A free slot (``UnknownRequestError``) or a slot listed twice (``ValueError``) changes
        nothing.
        """

    def preempt(self, slots: _Counts) -> list[list[int]]:
        """``finish``, counted as one preemption per slot; returns each request's whole token list.

        Re-adding a list with ``add_request`` recomputes the request (its registered pages are
        a prefix hit).
        """

    def next_chunk(self, slot: int, max_tokens: int) -> int:
        """How many of its next known tokens the request in ``slot`` should schedule, at most
        ``max_tokens``.

        Without state groups, all that are left. With state groups, whose snapshots are kept
        only where a step ends on their grain (the lcm of their page sizes): the rest up to the
        last boundary before its last token when the rest fits (the tail follows next), else up
        to the last boundary within ``max_tokens``; no cut when no boundary lies ahead. 0 once
        every known token is computed. ``admit`` cuts the first chunk the same way.
        """

    def num_computed_tokens(self, slot: int) -> int:
        """Tokens the request in ``slot`` has computed (its position)."""

    def num_tokens(self, slot: int) -> int:
        """Tokens the request in ``slot`` knows (prompt plus appended)."""

    def page_ids(self, slot: int) -> list[list[int]]:
        """The page ids per group (holes 0) of the request in ``slot``."""

    def tail_available(self, slot: int) -> list[int]:
        """The free token slots in the last page, per group, of the request in ``slot``."""

    def loads_in_flight(self, slot: int) -> int:
        """Host-tier loads into the pages of the request in ``slot`` not acknowledged yet;
        ``schedule`` refuses the slot (``ValueError``) until this is 0."""

    def pages_needed(self, num_tokens: int, slot: int | None = None) -> int:
        """Pages an acquire of ``num_tokens`` would allocate for the request in ``slot`` (fresh
        tables when None)."""

    @overload
    def block_tables(self, slots: _Counts, out: None = None) -> dict[str, npt.NDArray[np.int32]]:
        """Flat per-group block tables of the requests in ``slots``, rows in the order given.

        Without ``out``: ``{group_id: int32 array [len(slots), max_cols]}`` in group order,
        holes 0, padding -1. With ``out`` (``group_id`` -> writable C-contiguous int32 numpy
        array or CPU torch tensor of shape ``[>= len(slots), cols]`` for every group): row r of
        each buffer gets the request's page ids then -1 up to ``cols``, written in place with
        the GIL released, and ``out`` is returned; a table wider than ``cols`` is a
        ``ValueError`` naming the group and nothing is written. Raises
        ``FlatUnavailableError`` (a ``RuntimeError``) in a build without the ``flat`` feature.
        """
    @overload
    def block_tables(self, slots: _Counts, out: Mapping[str, _TableBuffer]) -> Mapping[str, _TableBuffer]: ...
    def bind_rows(
        self, tables: Mapping[str, _TableBuffer], *, offsets: Mapping[str, _TableBuffer] | None = None
    ) -> None:
        """Bind persistent block-table rows (docs/requests-api.md "Persistent rows").

        ``tables``: every group id -> writable C-contiguous int32 numpy array or CPU torch
        tensor ``[max_rows, cols]`` (the same ``max_rows`` for every group); row ``s`` shows
        the request in slot ``s``. ``offsets``: sliding-window group ids -> int32
        ``[max_rows]``; those groups' rows become windowed (a row holds ``cols`` slots of the
        table from ``offsets[g][row]``, the slot of column 0: no real page lies before it and
        the table ends within the row; it stays put while that holds, then moves to 0 if the
        table fits, else to the first real page). The buffers are filled with -1 / 0 and kept.
        While bound, new requests get slots below ``max_rows``; re-binding needs every live
        slot below the new row count.
        """

    def unbind_rows(self) -> None:
        """Forget the bound rows and release the buffers; requests keep their slots."""

    def update_rows(
        self, *, full: bool = False
    ) -> tuple[dict[str, npt.NDArray[np.int32]], dict[str, npt.NDArray[np.int32]]]:
        """Write the cells that changed since the last update; return ``(cells, offsets)``.

        ``cells[g]``: int32 ``[3, n]`` (row, col, value) of every cell written in group ``g``,
        sorted by row then column (apply with ``index_put_`` to a device copy);
        ``offsets[g]`` (windowed groups only): int32 ``[2, m]`` (row, offset) of every row
        whose page offset changed. Only rows whose tables changed are visited; ``full=True``
        compares every cell with the buffers (a repair). A table wider than its row, a
        windowed row with a real page before its first slot, or a bound buffer changed in
        place since ``bind_rows`` (dtype, shape, strides, read-only) is a ``ValueError``
        naming it; a refused update writes nothing and loses nothing: the next update that
        succeeds returns every cell changed since the last one that succeeded.
        """

    def prefix_hit_tokens(self, prompt_token_ids: _Tokens, *, extra_keys: Sequence[str] = ()) -> int:
        """The prefix hit ``add_request`` would get for this prompt (last token recomputed); read-only."""

    def pages_needed_to_admit(
        self,
        prompt_token_ids: _Tokens,
        num_new_tokens: int,
        reserve_tokens: int = 0,
        *,
        extra_keys: Sequence[str] = (),
    ) -> int:
        """Pages admitting this prompt would take (SPEC 9).

        The capped match's claim (its free cached pages) plus
        ``pages_needed(num_new_tokens + reserve_tokens)`` on fresh tables.
        """

    def budget(self, slot: int | None = None) -> int:
        """Free pages minus the reserves of every request other than the one in ``slot`` (may
        be negative)."""

@final
class PageCache(_PagedCacheBase):
    """The page-level protocol (docs/engine-api.md, SPEC 6 to 8) for engines that keep their own
    request state and bring the content hashes.

    An unknown id is an ``UnknownRequestError`` except for ``claim``, ``acquire`` and
    ``prefill_first_chunk``, which create the request. The token-level calls are
    ``FlatKVCache``'s (absent here); the shared calls are :class:`_PagedCacheBase`'s.
    """

    def __new__(
        cls,
        specs: Iterable[_GroupSpec],
        num_pages: int,
        *,
        enable_caching: bool = True,
        eviction_order: _EvictionOrder = "hybrid",
        enable_kv_events: bool = False,
        reuse_uncached_first: bool = True,
        host_pages: int | None = 0,
        host_store: _HostStore = "write_through",
        move_state_pages: bool = True,
    ) -> PageCache:
        """The page-level engine over ``specs`` (non-empty) with a pool of ``num_pages >= 1`` pages.

        ``eviction_order`` ``"hybrid"`` frees a request's pages by slot end token, descending,
        across all groups (SPEC 12.3); ``"group"`` frees group 0's table tail first, then group
        1's, and so on. ``enable_kv_events`` records KV events for ``take_events``.
        ``reuse_uncached_first``: a released page that holds no key joins the front of the free
        list (handed out before any cached page) instead of the back. Raises
        ``TypeError`` / ``ValueError`` naming a malformed spec (``specs[i].kind`` ...) or option.

        ``host_pages > 0`` adds a host-memory tier of that many pages of the same geometry
        (host page ids ``[0, host_pages)``): pages are copied there and loaded back on a prefix
        hit, through transfers the engine runs (``take_transfers`` / ``ack_transfers``).
        ``host_store``: ``"write_through"`` copies each page as it is registered;
        ``"evict"`` copies a cached page when its last reference goes (it joins the free list
        once the copy is acknowledged). 0 (default): no tier, nothing changes.

        ``move_state_pages``: a state group's ``acquire`` moves the request's working page to
        the new last slot when that page holds no key (``True``, default; SPEC 13.4); ``False``
        always takes a fresh page there, the previous one staying in its slot until ``reclaim``
        releases it (vLLM's mamba tables in mode "align"; docs/engine-api.md).
        """

    def match_prefix(self, content_hashes: Sequence[_ContentHash]) -> PrefixMatch:
        """The hybrid prefix match of base-page content hashes (64-char lowercase hex, or the
        hash's 32 raw bytes); read-only.

        Releases the GIL while matching. Raises ``TypeError`` / ``ValueError`` naming a
        malformed hash.
        """

    def claim(self, req: _RequestId, match: PrefixMatch) -> None:
        """Take references on ``match``'s pages and make them ``req``'s tables (created if new).

        ``ValueError`` (and no change) if the tables already hold pages, the match has the
        wrong number of groups, or a matched page no longer holds the key it was matched under.
        """

    def acquire(self, req: _RequestId, num_tokens: int) -> bool:
        """Make room for ``num_tokens`` more tokens in every group of ``req`` (created if new).

        Check-then-act: False (and no change) when the pool has too few free pages.
        """

    def acquire_pages(self, req: _RequestId, num_tokens: int) -> list[list[int]] | None:
        """``acquire``, answering what it appended: per group, the page ids (holes 0) of the
        slots past the table's length before the call (``[]`` where it did not grow), as
        ``page_ids`` shows them; None (and no change) when the pool has too few free pages.

        A caller that mirrors the tables reads only the new slots instead of every table. A
        state group's working page that moves to the new last slot leaves a hole in its old
        slot, which is not repeated here.
        """

    def register(
        self,
        req: _RequestId,
        content_hashes: Sequence[_ContentHash],
        *,
        first_slot: int = 0,
        end_tokens: int | None = None,
        groups: Sequence[int] | None = None,
    ) -> None:
        """Register base-page hashes in every group (a no-op with caching off), or only in the
        groups ``groups`` lists (indices, each once).

        ``content_hashes[j]`` is base page ``first_slot + j`` (64-char lowercase hex, or the
        hash's 32 raw bytes); state groups register only the last key, when the range ends at
        ``end_tokens`` on their page boundary. Raises ``UnknownRequestError`` for an unknown
        ``req``.
        """

    def reclaim(self, req: _RequestId, num_computed_tokens: int) -> None:
        """Free the pages of ``req`` that slid out of every window at ``num_computed_tokens``.

        Raises ``UnknownRequestError`` for an unknown ``req``.
        """

    def free(self, req: _RequestId) -> None:
        """Release all of ``req``'s pages (in the eviction order), drop its reserve and forget it.

        Raises ``UnknownRequestError`` for an unknown ``req``.
        """

    def pages_reclaimable(
        self, req: _RequestId, num_computed_tokens: int, *, count_uncached: bool = True
    ) -> int:
        """Pages ``reclaim(req, num_computed_tokens)`` would put back on the free list.

        Only pages whose last reference is ``req`` count, and only cached ones unless
        ``count_uncached``.
        """

    def pages_consumed_by_claim(self, match: PrefixMatch) -> int:
        """Distinct real pages of ``match`` with count 0 (what a claim takes off the free list)."""

    def prefill_first_chunk(self, req: _RequestId, match: PrefixMatch, num_tokens: int) -> bool:
        """First prefill chunk: ``claim(req, match)`` then ``acquire(req, num_tokens)``.

        On False the claim stays. Raises like ``claim``.
        """

    def prefill_chunk(
        self,
        req: _RequestId,
        content_hashes: Sequence[_ContentHash],
        num_tokens: int,
        num_computed_tokens: int,
    ) -> bool:
        """A later prefill chunk: register, reclaim, then acquire ``num_tokens``.

        ``content_hashes`` start at base page 0 and are cut to ``num_computed_tokens // base``.
        Returns whether the acquire succeeded.
        """

    def decode_step(
        self,
        req: _RequestId,
        content_hashes: Sequence[_ContentHash],
        first_page_slot: int,
        num_tokens: int,
        num_computed_tokens: int,
    ) -> bool:
        """A decode step: register, reclaim, then acquire ``num_tokens``.

        ``content_hashes`` start at base page ``first_page_slot`` and are cut so that
        ``first_page_slot + len <= num_computed_tokens // base``. Returns whether the acquire
        succeeded.
        """

    def has_request(self, req: _RequestId) -> bool:
        """Whether ``req`` has tables."""

    def pages_needed(self, num_tokens: int, req: _RequestId | None = None) -> int:
        """Pages ``acquire(req, num_tokens)`` would allocate (fresh tables when ``req`` is None)."""

    def page_ids(self, req: _RequestId) -> list[list[int]]:
        """``req``'s page ids per group (holes 0); ``UnknownRequestError`` for an unknown id."""

    def tail_available(self, req: _RequestId) -> list[int]:
        """``req``'s free token slots in its last page, per group."""

    @overload
    def block_tables(self, reqs: Sequence[_RequestId], out: None = None) -> dict[str, npt.NDArray[np.int32]]:
        """Flat per-group block tables of a batch, rows in the order given (repeats allowed).

        Without ``out``: ``{group_id: int32 array [len(reqs), max_cols]}`` in group order,
        holes 0, padding -1. With ``out`` (``group_id`` -> writable C-contiguous int32 numpy
        array or CPU torch tensor of shape ``[>= len(reqs), cols]`` for every group): row r of
        each buffer gets the request's page ids then -1 up to ``cols``, written in place with
        the GIL released, and ``out`` is returned; a table wider than ``cols`` is a
        ``ValueError`` naming the group and nothing is written. Raises
        ``FlatUnavailableError`` (a ``RuntimeError``) in a build without the ``flat`` feature.
        """
    @overload
    def block_tables(
        self, reqs: Sequence[_RequestId], out: Mapping[str, _TableBuffer]
    ) -> Mapping[str, _TableBuffer]: ...
    def loads_in_flight(self, req: _RequestId) -> int:
        """Host-tier loads into ``req``'s pages not acknowledged yet."""
