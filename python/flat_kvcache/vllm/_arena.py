"""The SPEC 13 arena under vLLM's ids: one plan both vLLM processes compute, and the managers that
hand out its ids (issue 37, stage 3: prefix caching off, and on).

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

Prefix caching (``enable_prefix_caching=True``, ``async_scheduling=False``):
:class:`ArenaPrefixKVCacheManager` drives :class:`flat_kvcache.FlatKVCache` on an arena plan of
exactly this geometry (a page one page stride, a state slot one unit; the ids must be the
views' rows, checked), so hits, checkpoints and state slots are the engine's (SPEC 13): hits end
on a multiple of the checkpoint grain ``G`` (``state_grain``, 64) that has a checkpoint, and
FlatScheduler cuts prefill chunks where the engine checkpoints (``next_chunk``), since vLLM's
CPU GDN kernels export a state only at a chunk's end. The rewritten ``KVCacheConfig`` gives the
mamba groups block size ``G`` in vLLM's mode "align": each mamba group's row is the engine's
state table (column ``c`` the state after token ``(c + 1) * G``), vLLM's runner runs each step
on column ``(seq_len - 1) // G`` and copies last step's column into it when the column changed,
which is the engine's read -> write copy (checked on every schedule). docs/vllm.md, "Prefix
caching in the arena".
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # type: ignore[import-not-found]
from vllm.v1.core.kv_cache_utils import KVCacheBlock  # type: ignore[import-not-found]
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec  # type: ignore[import-not-found]
from vllm.v1.metrics.stats import PrefixCacheStats  # type: ignore[import-not-found]

from flat_kvcache import ArenaPlan, BlockPool, ComponentSpec, FlatKVCache, KVCacheSpec, plan_arena
from flat_kvcache.vllm._manager import UnsupportedVllmConfigError, _CoordinatorView, adapter_options

__all__ = [
    "ARENA_ALIGN",
    "ArenaKVCacheManager",
    "ArenaPrefixKVCacheManager",
    "VllmArena",
    "arena_page_size",
    "plan_vllm_arena",
]

#: Bytes every page stride and state component is a multiple of (a cache line; each dtype's
#: itemsize divides it, so every view's offset and stride are whole elements).
ARENA_ALIGN = 64

_STATE_GROUP = "state"
_PAGE_GROUP = "pages"

#: Tokens vLLM's CPU GDN prefill kernel chunks at: checkpoints (chunk ends) at its multiples keep
#: a resumed prefill's chunks where an uncut one has them.
STATE_GRAIN = 64

#: The worker that binds the arena's views on vLLM's CPU build (flat_kvcache.vllm.arena_plugin).
ARENA_WORKER = "flat_kvcache.vllm.arena_plugin.ArenaCPUWorker"
#: The one on vLLM's CUDA build (flat_kvcache.vllm.arena_gpu).
ARENA_GPU_WORKER = "flat_kvcache.vllm.arena_gpu.ArenaGPUWorker"


def class_path(value: Any) -> str:
    """The qualified name of a class vLLM's config holds as a class or as its dotted name
    (``worker_cls``, ``scheduler_cls``)."""
    return value if isinstance(value, str) else f"{value.__module__}.{value.__qualname__}"


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
    #: The checkpoint grain G (tokens): prefix hits and checkpoints at its multiples.
    state_grain: int = 0
    prefix_caching: bool = False

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

    Refused (:class:`UnsupportedVllmConfigError`): async scheduling with prefix caching (the
    engine hashes the tokens it schedules), mamba cache modes other than "none" (prefix caching
    off) or "align" (on), speculative decoding,
    groups other than full attention and mamba, more than one attention group (vLLM's CPU
    runner zeroes one flat id list in every full-attention layer, so a second group's ids would
    zero the first's pages), a worker other than ``ArenaCPUWorker`` or ``ArenaGPUWorker``.
    """

    def refuse(what: str) -> None:
        raise UnsupportedVllmConfigError(f"the flat_kvcache arena (arena_page_size) does not support {what}")

    worker_name = class_path(vllm_config.parallel_config.worker_cls)
    if worker_name not in (ARENA_WORKER, ARENA_GPU_WORKER):
        refuse(
            f"worker_cls={worker_name!r}: the ids index the arena's views, which {ARENA_WORKER} "
            f"(vLLM's CPU build) or {ARENA_GPU_WORKER} (its CUDA build) binds"
        )
    caching = bool(vllm_config.cache_config.enable_prefix_caching)
    if caching and vllm_config.scheduler_config.async_scheduling:
        # The engine hashes the tokens it schedules: a decode scheduled before its input token is
        # sampled (async scheduling's placeholder) has nothing to hash yet.
        refuse("async scheduling with prefix caching (async_scheduling=False)")
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
            # Prefix caching on: vLLM's mode "align" (its runner copies a state from the previous
            # block column to the current one, the read -> write copy); off: mode "none".
            if spec.mamba_cache_mode != ("align" if caching else "none"):
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
    # The checkpoint grain G (SPEC 13): a multiple of the page and of the 64 tokens vLLM's CPU
    # GDN prefill chunks at. With prefix caching the mamba groups' block is G, so vLLM's mode
    # "align" reads column (seq_len - 1) // G of the state table, where the engine puts the
    # request's working slot (a checkpoint at boundary b sits in column b // G - 1).
    grain = math.lcm(page_size, STATE_GRAIN)
    new_groups = []
    for group in groups:
        spec = group.kv_cache_spec
        if type(spec) is FullAttentionSpec:
            spec = dataclasses.replace(spec, block_size=page_size, page_size_padded=None)
        elif caching:
            spec = dataclasses.replace(spec, block_size=grain, page_size_padded=None)
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
        state_grain=grain,
        prefix_caching=caching,
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
        self._pages = [g for g, (kind, _) in enumerate(arena.group_roles) if kind == "pages"]
        self._states = [g for g, (kind, _) in enumerate(arena.group_roles) if kind == "state"]
        self._page_arena = arena.group_roles[self._pages[0]][1] if self._pages else -1
        self._state_arena = arena.group_roles[self._states[0]][1] if self._states else -1
        self._page = arena.plan.page_size
        self._requests: dict[str, _Request] = {}
        self.empty_kv_cache_blocks = KVCacheBlocks(tuple(() for _ in range(self.num_kv_cache_groups)))
        self._record_new_block_ids = bool(self.kv_cache_config.needs_kv_cache_zeroing)
        self._new_block_ids: list[int] = []
        self._bind_ids()

    def _bind_ids(self) -> None:
        """The allocator of the ids: here a :class:`flat_kvcache.BlockPool` on the arena's units,
        checked to hand out exactly the rows of the worker's views."""
        arena = self.arena
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


class _CachedRequest:
    """One request of :class:`ArenaPrefixKVCacheManager`: its engine slot and, per vLLM group,
    the blocks vLLM has been handed (the worker's row: appended, never rewritten)."""

    __slots__ = ("blocks", "scheduled", "slot")

    def __init__(self, slot: int, num_groups: int) -> None:
        self.slot = slot
        self.blocks: list[list[Any]] = [[] for _ in range(num_groups)]
        self.scheduled = False  # a chunk of it was scheduled (vLLM then owns its row)


class ArenaPrefixKVCacheManager(ArenaKVCacheManager):
    """The arena's ids with prefix caching: vLLM's ``KVCacheManager`` interface over
    :class:`flat_kvcache.FlatKVCache` on the arena (SPEC 13: hits on checkpoints at multiples of
    the grain G, checkpoints at chunk ends, sparse state slots).

    The engine owns the tokens: a request is added with every token vLLM knows when vLLM looks
    up its hit (``get_computed_blocks``), sampled tokens are appended before each schedule, and
    ``finish`` (on finish and on preemption) registers its pages and its finish checkpoint.

    Ids. An attention group's blocks are the engine's page ids of its page group; every mamba
    group's blocks are the engine's state table: column ``c`` holds the slot of the state after
    token ``(c + 1) * G`` (a checkpoint) or the working slot, holes the null slot 0. vLLM's mode
    "align" with block size G runs each step on column ``(seq_len - 1) // G`` and, when that
    column differs from last step's, copies last step's column into it first: exactly the
    engine's read -> write copy (``state_slots``), because the engine's working slot moves only
    after a chunk that ended on a checkpoint, into a column vLLM has not been handed yet. Each
    schedule checks that (a ``RuntimeError`` otherwise, never a wrong state).

    Chunks. ``chunk`` (FlatScheduler's ``_mamba_block_aligned_split``) cuts each prefill chunk
    where the engine says (``next_chunk``): at multiples of G, at the body's end, at a branch
    point; vLLM's CPU GDN kernels export a state only at a chunk's end.
    """

    def __init__(self, arena: VllmArena, *, max_model_len: int, log_stats: bool = False) -> None:
        super().__init__(arena, max_model_len=max_model_len, log_stats=log_stats)
        self.enable_caching = True
        self._columns = {_PAGE_GROUP: 0, _STATE_GROUP: 1 if self._pages else 0}
        self._cached: dict[str, _CachedRequest] = {}
        self.grain = arena.state_grain

    def _bind_ids(self) -> None:
        """The allocator of the ids: :class:`flat_kvcache.FlatKVCache` on an arena plan of the
        worker's geometry, checked to hand out exactly the rows of its views (no BlockPool)."""
        arena = self.arena
        # The engine's plan: the vLLM layer's geometry (a page is one page stride, a state slot
        # one unit), so its ids are the rows of the worker's views.
        components: list[ComponentSpec] = []
        specs: list[Any] = []
        if self._pages:
            components.append(ComponentSpec(_PAGE_GROUP, 0, "kv", arena.page_stride // self._page, 0))
            specs.append(KVCacheSpec("full", self._page, group_id=_PAGE_GROUP))
        if self._states:
            components.append(ComponentSpec(_STATE_GROUP, 1, "state", 0, arena.unit_bytes))
            specs.append(KVCacheSpec("state", arena.state_grain, group_id=_STATE_GROUP))
        if self._pages and arena.page_stride % self._page:
            raise UnsupportedVllmConfigError(
                f"the flat_kvcache arena: a page stride of {arena.page_stride} bytes is not whole tokens"
            )
        plan = plan_arena(components, self._page, arena.total_bytes, alignment=ARENA_ALIGN)
        index = {group.group_id: group for group in plan.groups}
        for g, (kind, _) in enumerate(arena.group_roles):
            engine_group = index[_PAGE_GROUP if kind == "pages" else _STATE_GROUP]
            # The engine's ids of each group must be exactly the rows of the worker's views.
            if engine_group.num_ids != arena.num_ids(g) or plan.unit_bytes != arena.unit_bytes:
                raise RuntimeError(
                    f"flat_kvcache arena: the engine has {engine_group.num_ids} ids for KV cache "
                    f"group {g} in units of {plan.unit_bytes} bytes, the worker's views "
                    f"{arena.num_ids(g)} rows in units of {arena.unit_bytes}"
                )
        self.engine_plan = plan
        self.cache = FlatKVCache(specs, arena=plan)

    # -- stats -------------------------------------------------------------------------------

    @property
    def usage(self) -> float:
        stats = self.cache.arena_stats() or {}
        total = int(stats.get("units_total", 0))
        return 1.0 - int(stats.get("units_free", 0)) / total if total else 0.0

    def prefix_cache_lookup_enabled(self, request: Any) -> bool:
        return not request.skip_reading_prefix_cache

    def record_prefix_cache_stats(self, request: Any, num_hits: int) -> None:
        if not self.log_stats or not self.prefix_cache_lookup_enabled(request):
            return
        self.prefix_cache_stats.record(
            num_tokens=request.num_tokens, num_hits=num_hits, preempted=request.num_preemptions > 0
        )

    # -- the engine's tables as vLLM's blocks ------------------------------------------------

    def _table(self, entry: _CachedRequest, group: int) -> list[int]:
        ids = self.cache.page_ids(entry.slot)
        column = self._columns[_STATE_GROUP if group in self._states else _PAGE_GROUP]
        return ids[column]

    def _sync_tokens(self, request: Any, entry: _CachedRequest) -> None:
        """Append the tokens vLLM knows and the engine does not yet (the sampled ones)."""
        known = self.cache.num_tokens(entry.slot)
        tokens = request.all_token_ids
        if len(tokens) > known:
            new = list(tokens[known:])
            self.cache.append_tokens([entry.slot], new, [len(new)])

    def _add(self, request: Any, use_prefix_cache: bool) -> tuple[_CachedRequest, int]:
        slot, hit = self.cache.add_request(
            request.request_id, list(request.all_token_ids), use_prefix_cache=use_prefix_cache
        )
        entry = self._cached[request.request_id] = _CachedRequest(slot, self.num_kv_cache_groups)
        return entry, hit

    def get_computed_blocks(
        self, request: Any, max_cache_hit_length: int | None = None
    ) -> tuple[Any, int, int]:
        """The request's hit (the engine's: the deepest checkpoint on its path, SPEC 13.6) and
        its blocks; the request joins the engine here, holding its hit until it is scheduled
        (or, if vLLM cannot schedule it this step, until ``allocate_slots`` refuses it)."""
        entry = self._cached.get(request.request_id)
        if entry is None:
            entry, _ = self._add(request, self.prefix_cache_lookup_enabled(request))
        hit = self.cache.num_computed_tokens(entry.slot)
        if max_cache_hit_length is not None and hit > max_cache_hit_length:
            raise NotImplementedError("flat_kvcache arena: a capped prefix hit (max_cache_hit_length)")
        blocks = []
        for g in range(self.num_kv_cache_groups):
            grain = self.grain if g in self._states else self._page
            blocks.append([KVCacheBlock(block_id=i) for i in self._table(entry, g)[: _cdiv(hit, grain)]])
        return KVCacheBlocks(tuple(blocks)), hit, 0

    def chunk(self, request: Any, num_new_tokens: int) -> int:
        """Where the request's next chunk ends, at most ``num_new_tokens`` (SPEC 13.5): prefill
        chunks end where the engine checkpoints; decode is not cut."""
        entry = self._cached.get(request.request_id)
        if entry is None or not self._states:
            return num_new_tokens
        self._sync_tokens(request, entry)
        return int(self.cache.next_chunk(entry.slot, num_new_tokens))

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
        """Schedule ``num_new_tokens`` in the engine: the blocks vLLM has not been handed yet per
        group, or None (nothing taken; a request never scheduled leaves the engine)."""
        if num_external_computed_tokens or num_encoder_tokens:
            raise NotImplementedError("flat_kvcache arena: no connectors or cross-attention")
        if reserved_blocks:
            raise NotImplementedError("flat_kvcache arena: reserved blocks are counted in vLLM's blocks")
        entry = self._cached.get(request.request_id)
        if entry is None:
            entry, _ = self._add(request, False)
        cache, slot = self.cache, entry.slot
        before = cache.num_computed_tokens(slot)
        if before != request.num_computed_tokens + num_new_computed_tokens:
            raise RuntimeError(
                f"flat_kvcache arena: request {request.request_id!r} has computed {before} tokens "
                f"in the engine, {request.num_computed_tokens + num_new_computed_tokens} in vLLM"
            )
        if not entry.scheduled:
            entry.blocks = [
                list(group) for group in (new_computed_blocks or self.empty_kv_cache_blocks).blocks
            ]
            while len(entry.blocks) < self.num_kv_cache_groups:
                entry.blocks.append([])
        self._sync_tokens(request, entry)

        def refuse() -> None:
            if not entry.scheduled:
                # vLLM keeps the request waiting and looks its hit up again next time.
                cache.finish([slot])
                del self._cached[request.request_id]

        if full_sequence_must_fit and cache.pages_needed(request.num_tokens, slot) > cache.budget(slot):
            refuse()
            return None
        if not num_new_tokens and not num_lookahead_tokens:
            return self.empty_kv_cache_blocks
        if not bool(cache.schedule([slot], [num_new_tokens], lookahead=num_lookahead_tokens)[0]):
            refuse()
            return None
        entry.scheduled = True
        grown: list[list[Any]] = []
        for g in range(self.num_kv_cache_groups):
            table = self._table(entry, g)
            have = entry.blocks[g]
            fresh = [KVCacheBlock(block_id=i) for i in table[len(have) :]]
            have.extend(fresh)
            grown.append(fresh)
            if g in self._pages and self._record_new_block_ids and g not in skip_zeroing_group_ids:
                self._new_block_ids.extend(block.block_id for block in fresh)
        if self._states and num_new_tokens:
            self._check_state_columns(request.request_id, entry, before, num_new_tokens)
        return KVCacheBlocks(tuple(grown))

    def _check_state_columns(self, request_id: str, entry: _CachedRequest, before: int, n: int) -> None:
        """vLLM's mode "align" reads column ``(before - 1) // G`` and writes ``(before + n - 1) //
        G`` of the row it was handed: they must hold the engine's read and write slots."""
        read, write = (int(a[0]) for a in self.cache.state_slots([entry.slot], [n]))
        row = [block.block_id for block in entry.blocks[self._states[0]]]
        column_w = (before + n - 1) // self.grain
        column_r = (before - 1) // self.grain if before else -1
        got_w = row[column_w] if column_w < len(row) else None
        got_r = row[column_r] if 0 <= column_r < len(row) else 0
        if got_w != write or got_r != read or (column_r == column_w and read != write):
            raise RuntimeError(
                f"flat_kvcache arena: request {request_id!r} at {before}+{n} tokens: the engine reads "
                f"slot {read} and writes {write}; vLLM's row {row} gives {got_r} (column {column_r}) "
                f"and {got_w} (column {column_w})"
            )

    def get_blocks(self, request_id: str) -> Any:
        entry = self._cached.get(request_id)
        if entry is None:
            return self.empty_kv_cache_blocks
        return KVCacheBlocks(tuple(entry.blocks))

    def free(self, request: Any) -> None:
        """Finish (or preempt) the request: the engine registers its full pages and its finish
        checkpoint (SPEC 13.5d) and frees the rest."""
        entry = self._cached.pop(request.request_id, None)
        if entry is not None:
            self.cache.finish([entry.slot])

    def reset_prefix_cache(self) -> bool:
        if self._cached:
            return False
        self.cache.reset_prefix_cache()
        return True
