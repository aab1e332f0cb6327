"""Pure-Python reference of the page engine: SPEC sections 4 to 8, contract ``docs/engine-api.md``.

Written to be read next to the SPEC, not to be fast. One module per concern, in the order they
build on each other (no module imports one listed after it):

- ``_args``: argument checks shared by every public entry point;
- ``hash``: content hashes, group keys and folding (SPEC 4);
- ``pool``: the page pool with prefix caching (SPEC 5), :class:`BlockPool`;
- ``table``: a request's page table per group, and a token-level request's tokens;
- ``group``: one manager per engine kind (SPEC 6), the kind's rules in the kind's module
  (``full``, ``sliding``, ``state``);
- ``events``: the KV events the cache records, and the calls that hand them out;
- ``host``: the host-memory tier, its pages, LRU and transfers;
- ``coordinator``: the cache's state, and match / claim / acquire / register across groups
  (SPEC 7);
- ``calls``: the mixins that add the cache's calls on top of the coordinator, one module per
  concern (its docstring lists them), in this order: ``tables`` (flat per-group block tables,
  SPEC 8, 10), ``page`` (what both protocols share, and the page-level protocol by id, SPEC 6
  to 8), ``rows`` (persistent block-table rows), ``token`` (requests that own their tokens,
  named by slot, docs/requests-api.md), ``admission`` (admission accounting, ``admit`` and
  reserves, SPEC 9), ``stats`` and ``invariants`` (metrics and the SPEC 1 checks).

Two classes speak the two protocols, as the native ones do: :class:`FlatKVCache`, the
token-level one (docs/requests-api.md), whose requests are named by slot after they are added,
and :class:`PageCache`, the page-level one (docs/engine-api.md), whose requests are named by
id; a method of one is absent from the other, and a reader both have (``page_ids``,
``tail_available``, ``pages_needed``, ``loads_in_flight``, ``block_tables``) takes a slot on
one and an id on the other. Both are assembled from mixins, one per module, rather than by
composition: each module adds methods to the one object that holds the state, so a call such
as ``decode_step`` or ``schedule`` runs exactly the code it ran as a single class (method
lookup through the MRO is cached by the interpreter), with no forwarding layer on the hot
path, and ``self._pool`` stays the attribute the tests and the invariant checks read. The
mixins form chains where one needs another's calls (``Admission`` -> ``TokenApi`` ->
``PageTables`` + ``Rows`` for ``FlatKVCache``; ``PageApi`` -> ``PageTables`` for
``PageCache``; ``PageTables`` -> ``BlockTables`` -> ``Coordinator``, ``Rows`` ->
``Coordinator``); the independent ones (``Stats``, ``Invariants``) sit directly on
``Coordinator``, and ``KVEvents`` only declares the attributes it reads.

The only native thing the reference reads is the build flag ``flat_kvcache._native.FLAT_KVCACHE``,
looked up at call time (see ``calls.tables``) so tests can switch it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Self

from flat_kvcache._types import KVCacheSpec, kv_cache_specs
from flat_kvcache.reference.engine.calls.admission import Admission
from flat_kvcache.reference.engine.calls.invariants import Invariants
from flat_kvcache.reference.engine.calls.page import PageApi
from flat_kvcache.reference.engine.calls.stats import Stats
from flat_kvcache.reference.engine.coordinator import PrefixMatch
from flat_kvcache.reference.engine.events import KVEvents
from flat_kvcache.reference.engine.hash import fold_hashes, group_key, hash_page, hash_pages
from flat_kvcache.reference.engine.pool import DEFAULT_REUSE_UNCACHED_FIRST, BlockPool

__all__ = [
    "BlockPool",
    "FlatKVCache",
    "KVCacheSpec",
    "PageCache",
    "PrefixMatch",
    "fold_hashes",
    "group_key",
    "hash_page",
    "hash_pages",
    "kv_cache_specs",
]


def _flat_kv_cache_arguments(
    specs: object,
    num_pages: object = None,
    *,
    arena: object = None,
    enable_caching: object = True,
    eviction_order: object = "hybrid",
    enable_kv_events: object = False,
    reuse_uncached_first: object = True,
    host_pages: object = 0,
    host_store: object = "write_through",
    eviction_policy: object = "lru",
    register_on_schedule: object = False,
) -> None:
    """``FlatKVCache``'s parameters: binding them raises Python's ``TypeError`` for a missing,
    repeated or unexpected argument, named ``FlatKVCache.__new__()`` as the native class
    names it (``Coordinator.__init__()`` is no name a user knows)."""


def _page_cache_arguments(
    specs: object,
    num_pages: object,
    *,
    enable_caching: object = True,
    eviction_order: object = "hybrid",
    enable_kv_events: object = False,
    reuse_uncached_first: object = True,
    host_pages: object = 0,
    host_store: object = "write_through",
    move_state_pages: object = True,
) -> None:
    """``PageCache``'s parameters (see :func:`_flat_kv_cache_arguments`)."""


_flat_kv_cache_arguments.__qualname__ = "FlatKVCache.__new__"
_page_cache_arguments.__qualname__ = "PageCache.__new__"


class FlatKVCache(Admission, KVEvents, Stats, Invariants):
    """Every attention group of one model over one shared page pool (SPEC 6 to 9), with
    requests that own their tokens: the token-level protocol (docs/requests-api.md). A request
    enters by id (``add_request``, ``admit``) and gets the lowest free slot; every later call
    names it by that slot.

    ``base`` (gcd) and ``lcm`` of the page sizes tie the groups together: content hashes are
    per base page, a group of page size ``P_g`` folds ``m_g = P_g / base`` of them per key, and
    a prefix match ends on a multiple of ``lcm`` so every group's pages are whole. Groups keep
    their index order everywhere; no group stands for the request (SPEC 12.5).

    The calls come from the mixins listed in the module docstring; the constructor is
    :class:`~flat_kvcache.reference.engine.coordinator.Coordinator`'s.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Self:
        _flat_kv_cache_arguments(*args, **kwargs)
        return super().__new__(cls)


class PageCache(PageApi, KVEvents, Stats, Invariants):
    """Every attention group of one model over one shared page pool (SPEC 6 to 8), for engines
    that keep their own request state: the page-level protocol (docs/engine-api.md).

    The caller hashes the tokens and says where each request stands (``claim``, ``acquire``,
    ``register``, ``reclaim``, ``free`` and the step operations). The constructor is
    :class:`~flat_kvcache.reference.engine.coordinator.Coordinator`'s without ``arena`` (the
    arena storage serves the token-level protocol only), ``num_pages`` required.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Self:
        _page_cache_arguments(*args, **kwargs)
        return super().__new__(cls)

    def __init__(
        self,
        specs: Sequence[KVCacheSpec],
        num_pages: int,
        *,
        enable_caching: bool = True,
        eviction_order: str = "hybrid",
        enable_kv_events: bool = False,
        reuse_uncached_first: bool = DEFAULT_REUSE_UNCACHED_FIRST,
        host_pages: int | None = 0,
        host_store: str = "write_through",
        move_state_pages: bool = True,
    ) -> None:
        super().__init__(
            specs,
            num_pages,
            enable_caching=enable_caching,
            eviction_order=eviction_order,
            enable_kv_events=enable_kv_events,
            reuse_uncached_first=reuse_uncached_first,
            host_pages=host_pages,
            host_store=host_store,
            move_state_pages=move_state_pages,
        )
