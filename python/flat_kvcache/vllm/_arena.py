"""The SPEC 13 arena under vLLM's ids: one plan both vLLM processes compute, and the manager that
hands out its ids (issue 37, stage 3, first slice: prefix caching off).

Turned on by one option both sides read from vLLM's ``additional_config``::

    LLM(model,
        scheduler_cls="flat_kvcache.vllm.FlatScheduler",
        worker_cls="flat_kvcache.vllm.arena_plugin.ArenaCPUWorker",
        additional_config={"flat_kvcache": {"arena_page_size": 32}})

:func:`plan_vllm_arena` turns the engine core's ``KVCacheConfig`` (the scheduler and the worker
are both given it) and the ``VllmConfig`` into a :class:`VllmArena`: ``flat_kvcache.plan_arena``
over the groups' layers (every attention group a page group of ``arena_page_size``-token pages,
its layers side by side in a page; every mamba / GDN layer's state together in ONE state slot),
on the bytes vLLM's own allocation takes, and the ``KVCacheConfig`` both sides then run on: the
attention groups' block size is the page size (the attention kernel's block, 32 on vLLM's CPU
build, instead of the block vLLM grew until one page held a mamba state). The same inputs give
the same plan in both processes, so the ids agree with no message between them.

Ids. Each group's block ids index its own view of the one arena buffer: an attention group's id
``p`` is its page ``p`` (byte ``p * page_stride``), a mamba group's id ``s`` is state slot ``s``
(unit ``s``, byte ``s * unit_bytes``), and every mamba group of a request holds the same slot
(the slot holds every GDN layer's state). Index 0 of every view is the null page / slot.
:class:`ArenaKVCacheManager` allocates them from :class:`flat_kvcache.BlockPool` in arena mode
(units bound to one group while in use).

The page stride. ``plan_arena`` places page ``p`` at ``p * page_bytes``, so a page that straddles
two units is lost; with a handful of pages per unit (the tiny test models: 3.14 pages of bytes
per unit) that loses a third of every attention unit. Here the unit holds exactly ``K = unit //
page_bytes`` pages, each ``page_stride = ceil(unit / K)`` bytes (rounded up to 64), the unit
growing to ``K * page_stride``: the loss is the fraction of a page, at most, per unit.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # type: ignore[import-not-found]
from vllm.v1.core.kv_cache_utils import KVCacheBlock  # type: ignore[import-not-found]
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec  # type: ignore[import-not-found]
from vllm.v1.metrics.stats import PrefixCacheStats  # type: ignore[import-not-found]

from flat_kvcache import ArenaPlan, BlockPool, ComponentSpec, plan_arena
from flat_kvcache.vllm._manager import UnsupportedVllmConfigError, _CoordinatorView, adapter_options

__all__ = ["ARENA_ALIGN", "ArenaKVCacheManager", "VllmArena", "arena_page_size", "plan_vllm_arena"]

#: Bytes every page stride and state component is a multiple of (a cache line; each dtype's
#: itemsize divides it, so every view's offset and stride are whole elements).
ARENA_ALIGN = 64

_STATE_GROUP = "state"

#: The worker that binds the arena's views (flat_kvcache.vllm.arena_plugin).
ARENA_WORKER = "flat_kvcache.vllm.arena_plugin.ArenaCPUWorker"


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def arena_page_size(vllm_config: Any) -> int | None:
    """The ``arena_page_size`` option (tokens per attention page), or None: the arena is off."""
    return adapter_options(vllm_config)["arena_page_size"]  # type: ignore[no-any-return]


@dataclass(frozen=True)
class VllmArena:
    """The arena both vLLM processes run on (:func:`plan_vllm_arena`)."""

    plan: ArenaPlan
    #: The ``KVCacheConfig`` the scheduler's manager and the worker's runner use: the engine
    #: core's, the attention groups' block size made the page size, ``num_blocks`` the units.
    kv_cache_config: Any
    unit_bytes: int  # the plan's unit, grown to whole page strides
    num_units: int
    page_stride: int  # bytes from one attention page to the next (0: no attention group)
    pages_per_unit: int
    #: vLLM group index -> its place: ("pages", arena group index) or ("state", arena group index)
    group_roles: tuple[tuple[str, int], ...]
    #: layer name -> (byte offset in its page or state slot, bytes)
    layer_offsets: dict[str, tuple[int, int]]
    budget_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.unit_bytes * self.num_units

    @property
    def arena_page_bytes(self) -> list[int]:
        """Per arena group (pool order), what one of its ids takes: the page stride, the slot."""
        sizes = []
        for group in self.plan.groups:
            sizes.append(self.page_stride if group.kind == "pages" else self.unit_bytes)
        return sizes

    def num_ids(self, vllm_group: int) -> int:
        """Rows of the group's view, the null one included."""
        kind, _ = self.group_roles[vllm_group]
        if kind == "pages":
            return self.num_units * self.pages_per_unit
        return self.num_units

    def request_units(self, num_tokens: int) -> float:
        """Units one request of ``num_tokens`` tokens takes (its state slot, its pages), the
        pages of many requests sharing units."""
        has_state = any(kind == "state" for kind, _ in self.group_roles)
        pages = sum(1 for kind, _ in self.group_roles if kind == "pages") * _cdiv(
            num_tokens, self.plan.page_size
        )
        return int(has_state) + (pages / self.pages_per_unit if self.pages_per_unit else 0.0)

    def capacity_tokens(self, max_model_len: int) -> int:
        """The KV capacity by vLLM's formula (``get_kv_cache_capacity``: requests of
        ``max_model_len`` tokens held at once, times ``max_model_len``), the null unit aside."""
        return int((self.num_units - 1) / self.request_units(max_model_len) * max_model_len)


def plan_vllm_arena(vllm_config: Any, kv_cache_config: Any, page_size: int) -> VllmArena:
    """The arena for ``kv_cache_config`` (the engine core's, as the scheduler and the worker
    receive it) with ``page_size``-token attention pages, on the bytes vLLM's allocation takes.

    Refused (:class:`UnsupportedVllmConfigError`): prefix caching (the state grain and its
    checkpoints are the next step), mamba cache modes other than "none", speculative decoding,
    groups other than full attention and mamba, more than one attention group (vLLM's CPU
    runner zeroes one flat id list in every full-attention layer, so a second group's ids would
    zero the first's pages), a worker other than ``ArenaCPUWorker``.
    """

    def refuse(what: str) -> None:
        raise UnsupportedVllmConfigError(f"the flat_kvcache arena (arena_page_size) does not support {what}")

    worker = vllm_config.parallel_config.worker_cls
    worker_name = worker if isinstance(worker, str) else f"{worker.__module__}.{worker.__qualname__}"
    if worker_name != ARENA_WORKER:
        refuse(f"worker_cls={worker_name!r}: the ids index the arena's views, which {ARENA_WORKER} binds")
    if vllm_config.cache_config.enable_prefix_caching:
        refuse("prefix caching yet (enable_prefix_caching=False; docs/vllm.md, the next stage)")
    if vllm_config.speculative_config is not None:
        refuse("speculative decoding (a mamba group then holds several state slots per request)")
    if vllm_config.scheduler_config.watermark:
        refuse("a watermark (counted in vLLM's blocks)")
    groups = kv_cache_config.kv_cache_groups
    components: list[ComponentSpec] = []
    names: list[str] = []
    roles: list[tuple[str, str]] = []
    attention = 0
    for index, group in enumerate(groups):
        spec = group.kv_cache_spec
        if getattr(group, "host_resident", False) or getattr(group, "is_eagle_group", False):
            refuse(f"KV cache group {index}: host-resident or draft-model groups")
        if type(spec) is FullAttentionSpec:
            attention += 1
            if spec.real_page_size_bytes % spec.block_size:
                refuse(f"KV cache group {index}: a page that is not whole tokens")
            per_token = spec.real_page_size_bytes // spec.block_size
            for layer, name in enumerate(group.layer_names):
                components.append(ComponentSpec(f"g{index}", layer, "kv", per_token, 0))
                names.append(name)
            roles.append(("pages", f"g{index}"))
        elif type(spec) is MambaSpec:
            if spec.mamba_cache_mode != "none":
                refuse(f"KV cache group {index}: mamba cache mode {spec.mamba_cache_mode!r}")
            for name in group.layer_names:
                components.append(
                    ComponentSpec(_STATE_GROUP, len(names), "state", 0, int(spec.state_content_size_bytes))
                )
                names.append(name)
            roles.append(("state", _STATE_GROUP))
        else:
            refuse(f"KV cache group {index} ({type(spec).__name__}): only full attention and mamba groups")
    if attention > 1:
        refuse(f"{attention} attention groups (vLLM's CPU runner zeroes one id list in all of them)")
    # vLLM places every KVCacheTensor in one backing allocation of ``size`` bytes: the budget.
    budget = max((int(t.size) for t in kv_cache_config.kv_cache_tensors), default=0)
    plan = plan_arena(
        components,
        page_size,
        budget,
        alignment=ARENA_ALIGN,
        max_live_requests=int(vllm_config.scheduler_config.max_num_seqs),
    )
    arena_groups = [g.group_id for g in plan.groups]
    page_group = next((g for g in plan.groups if g.kind == "pages"), None)
    unit = plan.unit_bytes
    stride = per_unit = 0
    if page_group is not None:
        per_unit = unit // page_group.item_bytes
        stride = _cdiv(_cdiv(unit, per_unit), ARENA_ALIGN) * ARENA_ALIGN
        unit = per_unit * stride
    num_units = budget // unit
    if num_units - 1 < int(vllm_config.scheduler_config.max_num_seqs) and any(r == "state" for r, _ in roles):
        refuse(
            f"{budget} bytes: {num_units - 1} state slots of {unit} bytes, fewer than max_num_seqs "
            f"({vllm_config.scheduler_config.max_num_seqs})"
        )
    offsets = {name: (comp.offset, comp.nbytes) for name, comp in zip(names, plan.components, strict=True)}
    new_groups = []
    for group in groups:
        spec = group.kv_cache_spec
        if type(spec) is FullAttentionSpec:
            spec = dataclasses.replace(spec, block_size=page_size, page_size_padded=None)
        new_groups.append(dataclasses.replace(group, kv_cache_spec=spec))
    config = dataclasses.replace(kv_cache_config, num_blocks=num_units, kv_cache_groups=new_groups)
    return VllmArena(
        plan=plan,
        kv_cache_config=config,
        unit_bytes=unit,
        num_units=num_units,
        page_stride=stride,
        pages_per_unit=per_unit,
        group_roles=tuple((kind, arena_groups.index(gid)) for kind, gid in roles),
        layer_offsets=offsets,
        budget_bytes=budget,
    )


class _Request:
    """One request's ids: per vLLM group its blocks, the pool ids it holds."""

    __slots__ = ("blocks", "pages", "pool_ids", "slot")

    def __init__(self, num_groups: int) -> None:
        self.blocks: list[list[Any]] = [[] for _ in range(num_groups)]
        self.pool_ids: list[int] = []
        self.pages = 0  # attention pages per attention group
        self.slot = 0  # the state slot (0: none yet)


class ArenaKVCacheManager:
    """vLLM's ``KVCacheManager`` interface (the part its scheduler uses, prefix caching off) over
    the arena's :class:`flat_kvcache.BlockPool`: per-group id spaces in one pool of units.

    A request takes, when first allocated, one state slot (every mamba group's table holds it:
    the slot holds every GDN layer's state, as vLLM's mode "none" holds one block per group) and
    ``cdiv(tokens, page_size)`` pages per attention group, all or nothing; it frees them when it
    finishes or is preempted. vLLM's scheduler decides the rest (admission, preemption order) on
    the answers, as with its own manager.
    """

    def __init__(self, arena: VllmArena, *, max_model_len: int, log_stats: bool = False) -> None:
        self.arena = arena
        self.kv_cache_config = arena.kv_cache_config
        self.max_model_len = max_model_len
        self.enable_caching = False
        self.enable_kv_cache_events = False
        self.log_stats = log_stats
        self.use_eagle = False
        self.mamba_shared_prefix_checkpoint = False
        self.block_size = arena.plan.page_size
        self.num_blocks = arena.num_units
        self.num_kv_cache_groups = len(self.kv_cache_config.kv_cache_groups)
        self.watermark_blocks = 0
        self.prefix_cache_stats: Any = PrefixCacheStats() if log_stats else None
        self.coordinator = _CoordinatorView(self.kv_cache_config)
        self.pool = BlockPool.with_arena(
            arena.unit_bytes, arena.num_units, arena.arena_page_bytes, enable_caching=False
        )
        self._bases = [self.pool.group_base(g) for g in range(len(arena.plan.groups))]
        for g, (_, place) in enumerate(arena.group_roles):
            # The pool's ids of each group must be exactly the rows of the worker's views.
            if self.pool.group_ids(place) != arena.num_ids(g):
                raise RuntimeError(
                    f"flat_kvcache arena: the pool has {self.pool.group_ids(place)} ids for KV cache "
                    f"group {g}, the worker's views {arena.num_ids(g)} rows"
                )
        self._pages = [g for g, (kind, _) in enumerate(arena.group_roles) if kind == "pages"]
        self._states = [g for g, (kind, _) in enumerate(arena.group_roles) if kind == "state"]
        self._page_arena = arena.group_roles[self._pages[0]][1] if self._pages else -1
        self._state_arena = arena.group_roles[self._states[0]][1] if self._states else -1
        self._page = arena.plan.page_size
        self._requests: dict[str, _Request] = {}
        self.empty_kv_cache_blocks = KVCacheBlocks(tuple(() for _ in range(self.num_kv_cache_groups)))
        self._record_new_block_ids = bool(self.kv_cache_config.needs_kv_cache_zeroing)
        self._new_block_ids: list[int] = []

    # -- stats -------------------------------------------------------------------------------

    @property
    def usage(self) -> float:
        total = self.pool.num_total
        return 1.0 - self.pool.num_free / total if total else 0.0

    def make_prefix_cache_stats(self) -> Any:
        if not self.log_stats:
            return None
        stats = self.prefix_cache_stats
        self.prefix_cache_stats = PrefixCacheStats()
        return stats

    def prefix_cache_lookup_enabled(self, request: Any) -> bool:
        return False

    def record_prefix_cache_stats(self, request: Any, num_hits: int) -> None:
        return None

    def take_events(self) -> list[Any]:
        return []

    def take_new_block_ids(self) -> list[int]:
        ids, self._new_block_ids = self._new_block_ids, []
        return ids

    def take_kv_cache_block_copies(self) -> tuple[list[Any], list[Any]]:
        return [], []

    def take_boundary_state_offloads(self) -> dict[str, list[tuple[int, int, int]]]:
        return {}

    def new_step_starts(self) -> None:
        return None

    # -- lookup and allocation ---------------------------------------------------------------

    def get_computed_blocks(
        self, request: Any, max_cache_hit_length: int | None = None
    ) -> tuple[Any, int, int]:
        return self.empty_kv_cache_blocks, 0, 0

    def allocate_slots(
        self,
        request: Any,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Any = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        num_encoder_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        reserved_blocks: int = 0,
        has_scheduled_reqs: bool = True,
        skip_zeroing_group_ids: tuple[int, ...] = (),
    ) -> Any:
        """Room for ``num_new_tokens`` more tokens: the new blocks per group, or None (nothing
        taken) when the arena cannot hold them."""
        if num_external_computed_tokens or num_encoder_tokens or num_new_computed_tokens:
            raise NotImplementedError("flat_kvcache arena: no prefix hits, connectors or cross-attention")
        if reserved_blocks:
            raise NotImplementedError("flat_kvcache arena: reserved blocks are counted in vLLM's blocks")
        request_id = request.request_id
        entry = self._requests.get(request_id)
        computed = min(request.num_computed_tokens, self.max_model_len)
        need = min(computed + num_new_tokens + num_lookahead_tokens, self.max_model_len)
        have = entry.pages if entry is not None else 0
        pages = max(0, _cdiv(need, self._page) - have) if self._pages else 0
        slot = 1 if self._states and (entry is None or not entry.slot) else 0
        # vLLM's ``full_sequence_must_fit``: admit only if the whole sequence would fit, take
        # what this step needs.
        check = pages
        if full_sequence_must_fit and self._pages:
            check = max(pages, _cdiv(min(request.num_tokens, self.max_model_len), self._page) - have)
        if not check and not slot:
            return self.empty_kv_cache_blocks
        needs = [0] * len(self.arena.plan.groups)
        if self._pages:
            needs[self._page_arena] = check * len(self._pages)
        if slot:
            needs[self._state_arena] = 1
        if not self.pool.fits(needs):
            return None
        if not pages and not slot:
            return self.empty_kv_cache_blocks
        if entry is None:
            entry = self._requests[request_id] = _Request(self.num_kv_cache_groups)
        grown: list[list[Any]] = [[] for _ in range(self.num_kv_cache_groups)]
        if slot:
            (pool_id,) = self.pool.allocate(1, self._state_arena)
            entry.pool_ids.append(pool_id)
            entry.slot = pool_id - self._bases[self._state_arena]
            for g in self._states:
                block = KVCacheBlock(block_id=entry.slot)
                entry.blocks[g].append(block)
                grown[g].append(block)
        if pages:
            for g in self._pages:
                taken = self.pool.allocate(pages, self._page_arena)
                if len(taken) != pages:
                    raise RuntimeError("flat_kvcache arena: allocation failed after the fit check")
                entry.pool_ids.extend(taken)
                base = self._bases[self._page_arena]
                ids = [p - base for p in taken]
                if self._record_new_block_ids and g not in skip_zeroing_group_ids:
                    self._new_block_ids.extend(ids)
                fresh = [KVCacheBlock(block_id=i) for i in ids]
                entry.blocks[g].extend(fresh)
                grown[g].extend(fresh)
            entry.pages += pages
        return KVCacheBlocks(tuple(grown))

    def cache_blocks(self, request: Any, num_computed_tokens: int) -> None:
        return None

    def get_blocks(self, request_id: str) -> Any:
        entry = self._requests.get(request_id)
        if entry is None:
            return self.empty_kv_cache_blocks
        return KVCacheBlocks(tuple(entry.blocks))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return tuple([block.block_id for block in group] for group in self.get_blocks(request_id).blocks)

    def get_block_ids_for_computed_tokens(
        self, request_id: str, num_computed_tokens: int
    ) -> tuple[list[int], ...]:
        keep = _cdiv(num_computed_tokens, self._page)
        return tuple(
            ids if g in self._states else ids[:keep] for g, ids in enumerate(self.get_block_ids(request_id))
        )

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        return [0] * self.num_kv_cache_groups

    def estimate_cached_tokens(self, request: Any) -> int:
        return 0

    def remove_skipped_blocks(
        self, request_id: str, processed_computed_tokens: int, num_prompt_tokens: int | None = None
    ) -> None:
        return None

    def free(self, request: Any) -> None:
        entry = self._requests.pop(request.request_id, None)
        if entry is not None:
            self.pool.free(entry.pool_ids)

    def reset_prefix_cache(self) -> bool:
        return not self._requests

    def pop_blocks_for_free(self, request: Any) -> list[Any]:
        raise NotImplementedError("flat_kvcache arena: deferred frees need a KV connector (not supported)")

    def evict_blocks(self, block_ids: set[int]) -> None:
        raise NotImplementedError("flat_kvcache arena: evicting by block id needs a KV connector")
