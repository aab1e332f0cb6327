"""Type stubs for the native extension `flat_kvcache._native` (hand-written)."""

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, SupportsIndex, final, overload

import numpy as np
import numpy.typing as npt

__version__: str
FLAT_KVCACHE: bool
# PyO3's declarative module sets __all__ to every #[pymodule_export] (sorted here).
__all__ = [
    "FLAT_KVCACHE",
    "BlockPool",
    "FlatKVCache",
    "PrefixMatch",
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

def scheduler_ext_flat_kvcache() -> bool: ...
def layer_group_ids(layer_types: object, sliding_window_tokens: object = None) -> list[str]: ...
def group_specs_from_layer_types(
    layer_types: object, sliding_window_tokens: object = None, *, page_size: SupportsIndex
) -> list[_SpecTuple]: ...
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
) -> dict[Any, int]: ...
def publish_paged_cache_groups(
    *,
    layer_types: object,
    sliding_window_tokens: object,
    page_size: SupportsIndex,
    max_live_requests: SupportsIndex,
    max_scheduled_tokens: SupportsIndex,
    max_total_tokens: SupportsIndex,
    max_context_len: SupportsIndex,
) -> tuple[list[_SpecTuple], dict[str, int]] | None: ...
def compute_max_logical_pages_for_capture(
    spec: object,
    *,
    max_context_len: SupportsIndex,
    max_tokens_per_req: SupportsIndex = 1,
    overlap_schedule_depth: SupportsIndex = 0,
) -> int: ...
def hybrid_slab_group_size(layer_types: object, *, sliding_window_tokens: object = None) -> int | None: ...
def validate_flat_scheduler_config(
    *,
    flat_kvcache_ext: object,
    paged_cache_groups: object,
    attn_backend: object,
    kv_pool: object,
    speculative_algorithm: object = None,
) -> None: ...
def occurrence_index(layer_types: object) -> list[int]: ...
def state_const_bytes(shape: object, itemsize: SupportsIndex) -> int: ...
def components_from_layers(
    layer_types: object,
    *,
    kv_bytes_per_slot: SupportsIndex,
    state_component_bytes: object = None,
    sliding_window_tokens: object = None,
) -> list[_ComponentTuple]: ...
def solve_page_geometry(
    components: Iterable[object], block_size: SupportsIndex, alignment: SupportsIndex
) -> tuple[int, int, int]: ...
def equalized_block_size(
    components: Iterable[object], block_size: SupportsIndex, alignment: SupportsIndex | None = None
) -> int: ...
def plan_component_tensors(
    components: Iterable[object],
    block_size: SupportsIndex,
    budget_bytes: SupportsIndex,
    *,
    reserved_bytes_per_block: SupportsIndex = 0,
) -> _PlanTuple: ...
def plan_tensors(
    components: Iterable[object], block_size: SupportsIndex, budget_bytes: SupportsIndex
) -> _PlanTuple: ...

# ----- page engine (SPEC 4-8, docs/engine-api.md) ----------------------------------------------

_Tokens = Sequence[int] | npt.NDArray[np.integer[Any]]
_RequestId = str | int
#: A caller-provided block-table buffer: a writable C-contiguous int32 array or CPU torch tensor.
_TableBuffer = Any
#: One event of ``take_events``: ``flat_kvcache.events.BlockStored | BlockRemoved | AllBlocksCleared``.
_KVEvent = Any

def hash_page(tokens: _Tokens, prior: str = "", extra_keys: Sequence[str] = ()) -> str: ...
def hash_pages(
    token_ids: _Tokens, page_size: int, *, prior: str = "", extra_keys: Sequence[str] = ()
) -> list[str]: ...
def group_key(content_hash: str, group_index: int) -> str: ...
def fold_hashes(base_hashes: Sequence[str], first_base: int, m: int) -> list[str]: ...

@final
class BlockPool:
    def __new__(cls, num_blocks: int, *, enable_caching: bool = True) -> BlockPool: ...
    @property
    def num_blocks(self) -> int: ...
    @property
    def num_free(self) -> int: ...
    @property
    def num_cached(self) -> int: ...
    @property
    def num_cached_free(self) -> int: ...
    @property
    def num_cached_pinned(self) -> int: ...
    def allocate(self, n: int) -> list[int]: ...
    def touch(self, page: int) -> None: ...
    def free(self, pages: Iterable[int]) -> None: ...
    def cache(self, page: int, key: str) -> None: ...
    def lookup(self, key: str) -> int | None: ...
    def ref_count(self, page: int) -> int: ...
    def is_cached(self, page: int) -> bool: ...

@final
class PrefixMatch:
    def __new__(
        cls, num_common_tokens: int, pages: Sequence[Sequence[int]], num_hit_pages: Sequence[int]
    ) -> PrefixMatch: ...
    @property
    def num_common_tokens(self) -> int: ...
    @property
    def pages(self) -> list[list[int]]: ...
    @property
    def num_hit_pages(self) -> list[int]: ...
    def __eq__(self, other: object, /) -> bool: ...

@final
class FlatKVCache:
    def __new__(
        cls,
        specs: Iterable[Any],
        num_pages: int,
        *,
        enable_caching: bool = True,
        eviction_order: str = "hybrid",
        enable_kv_events: bool = False,
    ) -> FlatKVCache: ...
    @property
    def base_page_size(self) -> int: ...
    @property
    def lcm_page_size(self) -> int: ...
    @property
    def num_groups(self) -> int: ...
    @property
    def group_ids(self) -> list[str]: ...
    @property
    def num_free_pages(self) -> int: ...
    @property
    def num_requests(self) -> int: ...
    def pool_stats(self) -> dict[str, int]: ...
    def has_request(self, req: _RequestId) -> bool: ...
    def match_prefix(self, content_hashes: Sequence[str]) -> PrefixMatch: ...
    def claim(self, req: _RequestId, match: PrefixMatch) -> None: ...
    def acquire(self, req: _RequestId, num_tokens: int) -> bool: ...
    def register(
        self,
        req: _RequestId,
        content_hashes: Sequence[str],
        *,
        first_slot: int = 0,
        end_tokens: int | None = None,
    ) -> None: ...
    def reclaim(self, req: _RequestId, num_computed_tokens: int) -> None: ...
    def free(self, req: _RequestId) -> None: ...
    def pages_needed(self, num_tokens: int, req: _RequestId | None = None) -> int: ...
    def pages_reclaimable(
        self, req: _RequestId, num_computed_tokens: int, *, count_uncached: bool = True
    ) -> int: ...
    def pages_consumed_by_claim(self, match: PrefixMatch) -> int: ...
    def page_ids(self, req: _RequestId) -> list[list[int]]: ...
    def tail_available(self, req: _RequestId) -> list[int]: ...
    def prefill_first_chunk(self, req: _RequestId, match: PrefixMatch, num_tokens: int) -> bool: ...
    def prefill_chunk(
        self, req: _RequestId, content_hashes: Sequence[str], num_tokens: int, num_computed_tokens: int
    ) -> bool: ...
    def decode_step(
        self,
        req: _RequestId,
        content_hashes: Sequence[str],
        first_page_slot: int,
        num_tokens: int,
        num_computed_tokens: int,
    ) -> bool: ...
    @overload
    def block_tables(
        self, reqs: Sequence[_RequestId], out: None = None
    ) -> dict[str, npt.NDArray[np.int32]]: ...
    @overload
    def block_tables(
        self, reqs: Sequence[_RequestId], out: Mapping[str, _TableBuffer]
    ) -> Mapping[str, _TableBuffer]: ...
    def check_invariants(self) -> None: ...
    # token-level requests (docs/requests-api.md)
    def add_request(
        self,
        req: _RequestId,
        prompt_token_ids: _Tokens,
        *,
        extra_keys: Sequence[str] = (),
        use_prefix_cache: bool = True,
    ) -> int: ...
    def append_tokens(self, req: _RequestId, token_ids: _Tokens) -> None: ...
    def append_tokens_batch(
        self,
        reqs: Sequence[_RequestId],
        token_ids: _Tokens,
        num_tokens: Sequence[int] | npt.NDArray[np.integer[Any]] | None = None,
    ) -> None: ...
    def schedule(self, req: _RequestId, num_new_tokens: int, *, lookahead: int = 0) -> bool: ...
    def schedule_batch(
        self, reqs: Sequence[_RequestId], num_new_tokens: Sequence[int] | npt.NDArray[np.integer[Any]]
    ) -> npt.NDArray[np.bool_]: ...
    def finish(self, req: _RequestId) -> None: ...
    def preempt(self, req: _RequestId) -> list[int]: ...
    def num_computed_tokens(self, req: _RequestId) -> int: ...
    def num_tokens(self, req: _RequestId) -> int: ...
    # admission accounting (SPEC 9)
    def prefix_hit_tokens(self, prompt_token_ids: _Tokens, *, extra_keys: Sequence[str] = ()) -> int: ...
    def pages_needed_to_admit(
        self,
        prompt_token_ids: _Tokens,
        num_new_tokens: int,
        reserve_tokens: int = 0,
        *,
        extra_keys: Sequence[str] = (),
    ) -> int: ...
    def reserve(self, req: _RequestId, tokens: int) -> None: ...
    def budget(self, req: _RequestId | None = None) -> int: ...
    # metrics and KV events
    def stats(self) -> dict[str, Any]: ...
    def take_events(self) -> list[_KVEvent]: ...
    def reset_prefix_cache(self) -> int: ...
