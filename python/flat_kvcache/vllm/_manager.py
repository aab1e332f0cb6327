"""The KV-cache manager vLLM's scheduler talks to, over flat-kvcache's page-level engine.

vLLM 0.33's ``Scheduler`` calls its ``kv_cache_manager`` once per request (``allocate_slots``
per running request per step, ``get_computed_blocks`` per admission); this class answers those
calls with the same results as vLLM's own ``KVCacheManager`` (the same block ids, hits and
refusals, checked step by step by tests/vllm), keeping per request only what the scheduler reads
back: the ``KVCacheBlock`` lists of its tables. The pages, their counts, the free list and the
prefix-cache keys live in :class:`flat_kvcache.PageCache`. Content hashes are vLLM's own
``request.block_hashes`` (so salts, LoRA and multimodal keys are vLLM's), handed to the engine
as the 32-byte ``bytes`` they are (SHA-256, vLLM's default; other lengths as their SHA-256).

Full-attention groups map to ``"full"`` engine groups and sliding-window groups to
``"sliding_window"`` ones with the same window: the engine's hybrid match is vLLM's hybrid
coordinator's fixed point, its ``reclaim`` is vLLM's ``remove_skipped_blocks`` (called where
vLLM's ``allocate_slots`` calls it, on the processed-token count), and its ``"group"`` eviction
order frees and reclaims pages in vLLM's order. Mamba (GDN, mamba2) groups map to ``"state"``
groups: one page per allocation in the table's last slot, null gaps before it, older states
reclaimed once processed (mode "align"), or one page of ``max_model_len`` tokens per request
(mode "none"); what vLLM's ``MambaManager`` decides beyond that (the one-page count, hits deferred
on a state cached in the same step, the shared-prefix boundary) is done here (docs/vllm.md).

A step in which no running request crosses a page boundary makes no native call at all: a table
only grows, so the pages a request needs are counted here (``cdiv(tokens, P) - len``), the
position at which a sliding table next loses a page is known here too, and the engine is asked
only to allocate (``acquire``), to register newly full pages (``register``), to release pages
that slid out of a window (``reclaim``), to look up a waiting request's prefix
(``match_prefix``) and to free.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # type: ignore[import-not-found]
from vllm.v1.core.kv_cache_utils import KVCacheBlock  # type: ignore[import-not-found]
from vllm.v1.kv_cache_interface import (  # type: ignore[import-not-found]
    FullAttentionSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from vllm.v1.metrics.stats import PrefixCacheStats  # type: ignore[import-not-found]
from vllm.v1.request import RequestStatus  # type: ignore[import-not-found]

from flat_kvcache import KVCacheSpec, PageCache
from flat_kvcache.reference.engine.policy import ReuseEvidence
from flat_kvcache.vllm._events import VllmEventLog

# Exactly these spec types are served; their subclasses (sink, hidden-state, RSWA, sliding-window
# MLA, DSV41 bounded replay, ...) behave differently in vLLM and are refused.
_FULL_SPECS = (FullAttentionSpec, MLAAttentionSpec)
_SLIDING_SPECS = (SlidingWindowSpec,)

# A position no request reaches: "no sliding page is due to be reclaimed".
_NEVER = 1 << 62


class UnsupportedVllmConfigError(ValueError):
    """A vLLM configuration :class:`FlatScheduler` does not serve; raised at construction."""


#: The values of the ``mamba_checkpoints`` option (``additional_config={"flat_kvcache":
#: {"mamba_checkpoints": ...}}``): ``"vllm"`` (the default) makes vLLM's own decisions; ``"reuse"``
#: places and keeps mamba state checkpoints by the project's reuse policy (docs/vllm.md).
MAMBA_CHECKPOINTS = ("vllm", "reuse")


def adapter_options(vllm_config: Any) -> dict[str, Any]:
    """This adapter's options, read from ``vllm_config.additional_config["flat_kvcache"]``.

    Returns ``{"mamba_checkpoints": "vllm" | "reuse", "arena_page_size": int | None}``
    (``"vllm"`` and None when absent). ``arena_page_size`` (tokens per attention page, > 0) turns
    on the SPEC 13 arena under vLLM's ids (``flat_kvcache.vllm._arena``; the scheduler and
    ``ArenaCPUWorker`` both read it). Any other key, or another value, is an
    :class:`UnsupportedVllmConfigError` naming it; the other entries of ``additional_config``
    belong to other plugins and are not read."""
    options: dict[str, Any] = {"mamba_checkpoints": "vllm", "arena_page_size": None}
    extra = getattr(vllm_config, "additional_config", None)
    if not isinstance(extra, dict) or "flat_kvcache" not in extra:
        return options
    ours = extra["flat_kvcache"]
    prefix = "flat_kvcache.vllm.FlatScheduler does not support"
    if not isinstance(ours, dict):
        raise UnsupportedVllmConfigError(
            f"{prefix} additional_config['flat_kvcache'] = {ours!r} (a dict of options is expected, "
            "e.g. {'mamba_checkpoints': 'reuse'})"
        )
    for key, value in ours.items():
        if key == "arena_page_size":
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise UnsupportedVllmConfigError(
                    f"{prefix} arena_page_size = {value!r} (additional_config['flat_kvcache']; "
                    "tokens per attention page, an int > 0)"
                )
        elif key != "mamba_checkpoints":
            raise UnsupportedVllmConfigError(
                f"{prefix} the option additional_config['flat_kvcache'][{key!r}] "
                "(known: 'mamba_checkpoints', 'arena_page_size')"
            )
        elif value not in MAMBA_CHECKPOINTS:
            raise UnsupportedVllmConfigError(
                f"{prefix} mamba_checkpoints = {value!r} (additional_config['flat_kvcache']; "
                f"one of {', '.join(repr(v) for v in MAMBA_CHECKPOINTS)})"
            )
        options[key] = value
    return options


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _group_label(group: Any, index: int) -> str:
    names = list(getattr(group, "layer_names", ()))
    shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
    return f"KV cache group {index} ({type(group.kv_cache_spec).__name__}, layers [{shown}])"


def check_supported(
    vllm_config: Any, kv_cache_config: Any, block_size: int, hash_block_size: int | None
) -> None:
    """Raise :class:`UnsupportedVllmConfigError` naming the first feature flat-kvcache does not serve.

    Everything refused here would otherwise reach a ``kv_cache_manager`` call or attribute this
    adapter does not answer the way vLLM's manager does, so it is refused before anything runs.
    """

    def refuse(what: str) -> None:
        raise UnsupportedVllmConfigError(f"flat_kvcache.vllm.FlatScheduler does not support {what}")

    if vllm_config.kv_transfer_config is not None:
        refuse("KV connectors (kv_transfer_config is set)")
    if vllm_config.speculative_config is not None:
        _check_speculative(vllm_config, kv_cache_config, refuse)
    if vllm_config.ec_transfer_config is not None:
        refuse("encoder-cache connectors (ec_transfer_config is set)")
    if vllm_config.observability_config.kv_cache_metrics:
        refuse("KV cache residency metrics (observability_config.kv_cache_metrics)")
    if vllm_config.aux_output_config.enabled:
        refuse("aux output connectors (aux_output_config.enabled)")
    if vllm_config.model_config.is_encoder_decoder:
        refuse("encoder-decoder models (cross-attention groups)")
    parallel = vllm_config.parallel_config
    if parallel.decode_context_parallel_size > 1 or parallel.prefill_context_parallel_size > 1:
        refuse("decode/prefill context parallelism (sharded blocks)")
    if getattr(vllm_config, "num_hash_lookahead_tokens", 0) or getattr(
        vllm_config, "num_prefill_lookahead_tokens", 0
    ):
        refuse("hash or prefill lookahead tokens (multi-token-prediction drafting)")
    if kv_cache_config.hisparse_host_num_blocks is not None:
        refuse("HiSparse host pools (hisparse_host_num_blocks is set)")
    if not kv_cache_config.kv_cache_groups:
        refuse("a model with no KV cache groups")
    groups = kv_cache_config.kv_cache_groups
    if adapter_options(vllm_config)["mamba_checkpoints"] == "reuse":
        for index, group in enumerate(groups):
            if type(group.kv_cache_spec) in _SLIDING_SPECS:
                # The option decides mamba states' keys only; a sliding group's keys would still
                # follow the retention setting, beside placements it was not checked with.
                refuse(
                    f"{_group_label(group, index)}: mamba_checkpoints 'reuse' beside sliding-window "
                    "groups (the option places mamba state checkpoints only; not mapped)"
                )
    has_mamba = any(isinstance(group.kv_cache_spec, MambaSpec) for group in groups)
    if has_mamba:
        _check_mamba_groups(vllm_config, kv_cache_config, block_size, refuse)
    # With mamba_cache_mode "none" a mamba group's block is the whole sequence (vLLM makes it
    # max_model_len), the scheduler's block size the lcm; the attention groups share their own.
    page_size = next(
        (g.kv_cache_spec.block_size for g in groups if not isinstance(g.kv_cache_spec, MambaSpec)),
        block_size,
    )
    for index, group in enumerate(groups):
        spec = group.kv_cache_spec
        if isinstance(spec, MambaSpec):
            continue  # checked above
        if type(spec) in _SLIDING_SPECS:
            if spec.sliding_window < 2:
                # vLLM caches no block of a window-1 group and matches it differently.
                refuse(
                    f"{_group_label(group, index)}: sliding_window = {spec.sliding_window} "
                    "(a window of fewer than 2 tokens)"
                )
            if spec.extra_retained_tokens:
                refuse(
                    f"{_group_label(group, index)}: extra retained tokens below the window "
                    f"({spec.extra_retained_tokens}, multi-token-prediction re-prefill)"
                )
        elif type(spec) not in _FULL_SPECS:
            refuse(
                f"{_group_label(group, index)}: only full-attention, sliding-window and mamba groups "
                "are served"
            )
        if spec.block_size != block_size and not (has_mamba and spec.block_size == page_size):
            refuse(
                f"{_group_label(group, index)}: its block size {spec.block_size} differs from the "
                f"scheduler's {block_size}"
            )
    _check_sparse_retention(vllm_config, kv_cache_config, refuse)
    # After the groups: vLLM's EngineCore gives a model whose groups differ in block size the lcm
    # as the scheduler's block size and their gcd as the hash block size, and the group named
    # above says more than the hash block size would.
    if hash_block_size is not None and hash_block_size != block_size:
        refuse(
            f"a hash block size ({hash_block_size}) other than the block size ({block_size}): "
            "partial-block prefix hits"
        )


# Speculative methods whose drafts reach the KV-cache manager only as scheduled tokens (rolled
# back when rejected) and, for a draft model, as ``num_lookahead_tokens`` slots: both are what
# ``allocate_slots`` maps. The EAGLE family (eagle, eagle3, mtp, dflash, dspark) also drops the
# trailing block of a prefix hit and shifts prefill chunks and block hashes by the drafter's
# read-ahead; ``custom_class`` and ``extract_hidden_states`` are not checked.
_SERVED_SPECULATIVE_METHODS = ("ngram", "ngram_gpu", "suffix", "draft_model")


def _check_speculative(vllm_config: Any, kv_cache_config: Any, refuse: Any) -> None:
    """Speculative decoding served (docs/vllm.md): draft tokens scheduled with a request,
    rejected ones rolling ``num_computed_tokens`` back, lookahead slots allocated but never
    cached, over full-attention and sliding-window groups."""
    spec = vllm_config.speculative_config
    method = spec.method
    if spec.use_eagle() or method not in _SERVED_SPECULATIVE_METHODS:
        why = (
            "the EAGLE family drops the trailing block of a prefix hit and reads prefill tokens "
            "ahead (hash and prefill lookahead), which are not mapped"
            if spec.use_eagle()
            else "not checked against vLLM's manager"
        )
        refuse(
            f"speculative decoding with method {method!r} ({why}; served: "
            f"{', '.join(_SERVED_SPECULATIVE_METHODS)})"
        )
    for index, group in enumerate(kv_cache_config.kv_cache_groups):
        if isinstance(group.kv_cache_spec, MambaSpec):
            refuse(
                f"{_group_label(group, index)}: speculative decoding beside mamba groups (vLLM's "
                "MambaManager then keeps speculative state blocks, num_speculative_blocks, and "
                "allocates no lookahead slots; not mapped)"
            )


def _check_sparse_retention(vllm_config: Any, kv_cache_config: Any, refuse: Any) -> None:
    """Sparse prefix-cache retention (``prefix_cache_retention_interval`` 0, vLLM's default, or
    a positive interval) with prefix caching on: served (docs/vllm.md), but for sliding-window
    groups of several specs without a full-attention group. vLLM itself validates the value
    (a multiple of the block size) when the base class builds its manager."""
    if kv_cache_config.prefix_cache_retention_interval is None:
        return
    if not vllm_config.cache_config.enable_prefix_caching:
        return  # nothing is cached: the setting changes nothing
    groups = kv_cache_config.kv_cache_groups
    if any(type(g.kv_cache_spec) in _FULL_SPECS for g in groups):
        return
    sliding = [g.kv_cache_spec for g in groups if type(g.kv_cache_spec) in _SLIDING_SPECS]
    if any(spec != sliding[0] for spec in sliding[1:]):
        # vLLM then pins the shared-prefix junction at the first sliding spec's own hit, which
        # this adapter does not look up (it mirrors full-attention keys only).
        refuse(
            "sparse prefix-cache retention of sliding-window groups of several specs without a "
            f"full-attention group (prefix_cache_retention_interval = "
            f"{kv_cache_config.prefix_cache_retention_interval}): pass "
            "prefix_cache_retention_interval=None (dense retention) to serve this model"
        )


def _check_mamba_groups(vllm_config: Any, kv_cache_config: Any, block_size: int, refuse: Any) -> None:
    """The mamba / linear-attention (GDN, mamba2) groups this adapter serves (docs/vllm.md):
    vLLM's ``MambaManager`` in mode "align" with dense retention and no prefill checkpoint
    pages, and in mode "none", beside full-attention groups."""
    groups = kv_cache_config.kv_cache_groups
    mamba = [(i, g) for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, MambaSpec)]
    caching = bool(vllm_config.cache_config.enable_prefix_caching)
    first_index, first = mamba[0]
    for index, group in mamba:
        spec = group.kv_cache_spec
        label = _group_label(group, index)
        if spec != first.kv_cache_spec:
            refuse(
                f"{label}: mamba groups of different specs in one model (vLLM looks them up as "
                f"separate groups; not checked), unlike {_group_label(first, first_index)}"
            )
        if spec.num_speculative_blocks:
            refuse(f"{label}: speculative mamba state blocks (num_speculative_blocks)")
        mode = spec.mamba_cache_mode
        if mode == "align":
            if not caching:
                # vLLM's config steps turn "align" into "none" without prefix caching; uncached
                # running states would move in the engine where vLLM's stay (below).
                refuse(f"{label}: mamba_cache_mode 'align' without prefix caching")
            if spec.num_prefill_checkpoint_blocks:
                refuse(
                    f"{label}: mamba prefill checkpoint pages (num_prefill_checkpoint_blocks = "
                    f"{spec.num_prefill_checkpoint_blocks}: mamba2, FlashInfer GDN); vLLM allocates the "
                    "checkpoint page and the running state page in one step, the engine's state "
                    "group one page per step"
                )
            if spec.block_size != block_size:
                refuse(
                    f"{label}: its block size {spec.block_size} differs from the scheduler's "
                    f"{block_size} (mamba_cache_mode 'align')"
                )
        elif mode == "none":
            if caching:
                refuse(f"{label}: mamba_cache_mode 'none' with prefix caching (vLLM refuses it too)")
        else:
            refuse(f"{label}: mamba_cache_mode {mode!r}")
    others = [g for g in groups if not isinstance(g.kv_cache_spec, MambaSpec)]
    if not any(type(g.kv_cache_spec) in _FULL_SPECS for g in others):
        refuse(
            f"{_group_label(first, first_index)}: mamba groups without a full-attention group "
            "(a pure state model; not checked)"
        )
    for index, group in enumerate(groups):
        if type(group.kv_cache_spec) in _SLIDING_SPECS:
            refuse(
                f"{_group_label(group, index)}: sliding-window groups beside mamba groups "
                "(vLLM's hybrid lookup over three kinds; not checked)"
            )
    sizes = {g.kv_cache_spec.block_size for g in others}
    if len(sizes) > 1:
        refuse(f"attention groups of different block sizes {sorted(sizes)} beside mamba groups")


def _sliding_mask(
    window: int, page: int, retention: int | None, boundaries: Sequence[int], start: int, end: int
) -> list[bool] | None:
    """vLLM's ``SlidingWindowManager.reachable_block_mask`` for blocks ``[start, end)`` (no
    EAGLE, the hit alignment one block): the ``cdiv(W - 1, P)`` blocks before each reachable
    boundary and, with an interval, the last that many blocks of each interval. None: all."""
    need = _cdiv(window - 1, page)
    mask = [False] * (end - start)
    if retention:
        per_segment = retention // page
        if need >= per_segment:
            return None
        for i in range(start, end):
            mask[i - start] = i % per_segment >= per_segment - need
    for boundary in boundaries:
        last = boundary // page  # the boundary aligned down, in blocks
        for j in range(max(start, last - need), min(end, last)):
            mask[j - start] = True
    return mask


def _mamba_mask(
    page: int, retention: int | None, boundaries: Sequence[int], start: int, end: int
) -> list[bool] | None:
    """vLLM's ``MambaManager.reachable_block_mask`` for blocks ``[start, end)``: the state
    block ending on each reachable boundary (aligned down to a block) and, with an interval,
    the block ending each interval. None: all."""
    mask = [False] * (end - start)
    if retention:
        per_segment = retention // page
        if per_segment <= 1:
            return None
        for i in range(start, end):
            mask[i - start] = (i + 1) % per_segment == 0
    for boundary in boundaries:
        block = boundary // page - 1
        if start <= block < end:
            mask[block - start] = True
    return mask


def _runs(mask: list[bool] | None, start: int, end: int) -> list[tuple[int, int]]:
    """The ``[first, end)`` slot ranges where ``mask`` (over slots ``[start, end)``) is True."""
    if mask is None:
        return [(start, end)] if end > start else []
    runs: list[tuple[int, int]] = []
    first = None
    for i, on in enumerate(mask, start):
        if on and first is None:
            first = i
        elif not on and first is not None:
            runs.append((first, i))
            first = None
    if first is not None:
        runs.append((first, end))
    return runs


class _ManagerView:
    """What vLLM reads off ``coordinator.single_type_managers[i]`` outside the manager."""

    __slots__ = ("block_size", "kv_cache_group_id", "kv_cache_spec")

    def __init__(self, spec: Any, group_id: int) -> None:
        self.kv_cache_spec = spec
        self.block_size = spec.block_size
        self.kv_cache_group_id = group_id


class _CoordinatorView:
    """The coordinator attributes vLLM's scheduler and engine core read at construction."""

    def __init__(self, kv_cache_config: Any) -> None:
        self.single_type_managers = [
            _ManagerView(group.kv_cache_spec, i) for i, group in enumerate(kv_cache_config.kv_cache_groups)
        ]
        self.enable_partial_hash_hits = False
        self.eagle_group_ids: tuple[int, ...] = ()
        self.num_reprefillable_tokens = 0

    def get_num_blocks_to_allocate(self, *args: Any, **kwargs: Any) -> int:
        # Called only for async KV loads, which need a KV connector (refused at construction).
        raise NotImplementedError("flat_kvcache.vllm: KV connectors are not supported")


class _Tables:
    """One request's tables as vLLM sees them, and how far they are sized and registered."""

    __slots__ = ("blocks", "capacity", "due", "holes", "keyed", "keyed_states", "live", "num_cached", "slots")

    def __init__(self, num_groups: int) -> None:
        self.blocks: list[list[Any]] = [[] for _ in range(num_groups)]
        self.slots = 0  # tokens the engine's tables were asked for (claimed + acquired)
        self.capacity = 0  # tokens the pages hold: len(table) * page size, every group alike
        self.num_cached = 0  # full pages registered (vLLM's ``num_cached_block``)
        # Per group, the leading null blocks (slots that slid out of a window or were skipped by
        # a hit): nulls are always a prefix, in vLLM's tables as in the engine's.
        self.holes = [0] * num_groups
        # The smallest processed-token count at which ``reclaim`` would null another page.
        self.due = _NEVER
        # The slots of the mamba ("align") tables that hold a page, ascending: the running state
        # and the states before it not yet released (every mamba group alike). Nulls are not a
        # prefix there: vLLM leaves null gaps between states.
        self.live: list[int] = []
        # Sparse retention only (``FlatKVCacheManager._sparse``): per sliding group the highest
        # slot whose page holds a key (-1: none), and the mamba slots whose state holds one.
        self.keyed = [-1] * num_groups
        self.keyed_states: set[int] = set()


class _Placement:
    """The prompt checkpoints the reuse policy placed for one request (``mamba_checkpoints``
    "reuse"): the positions (tokens, multiples of the block size, ascending) whose states are
    kept, and whether the decode checkpoint was decided."""

    __slots__ = ("decided_decode", "points")

    def __init__(self, points: tuple[int, ...]) -> None:
        self.points = points
        self.decided_decode = False


class FlatKVCacheManager:
    """vLLM's ``KVCacheManager`` interface (the part its scheduler uses) over a ``PageCache``."""

    def __init__(
        self,
        kv_cache_config: Any,
        *,
        max_model_len: int,
        block_size: int,
        enable_caching: bool = True,
        log_stats: bool = False,
        watermark: float = 0.0,
        max_in_flight_tokens: int | None = None,
        enable_kv_cache_events: bool = False,
        mamba_checkpoints: str = "vllm",
    ) -> None:
        if mamba_checkpoints not in MAMBA_CHECKPOINTS:
            raise UnsupportedVllmConfigError(
                f"flat_kvcache.vllm.FlatScheduler does not support mamba_checkpoints = {mamba_checkpoints!r} "
                f"(one of {', '.join(repr(v) for v in MAMBA_CHECKPOINTS)})"
            )
        self.kv_cache_config = kv_cache_config
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.enable_kv_cache_events = enable_kv_cache_events
        # vLLM's KV cache events (_events.py), recorded only when enabled: None keeps every
        # call's event work to one attribute test.
        self._events: VllmEventLog | None = VllmEventLog(kv_cache_config) if enable_kv_cache_events else None
        # The first slot of a store range a mamba table registered before it grew (see
        # _key_running_state): vLLM stores that range with the rest, after its allocation.
        self._store_from: int | None = None
        self.log_stats = log_stats
        self.use_eagle = False
        self.mamba_shared_prefix_checkpoint = False
        self.block_size = block_size
        self.num_blocks: int = kv_cache_config.num_blocks
        self.num_kv_cache_groups = len(kv_cache_config.kv_cache_groups)
        self.watermark_blocks = int(watermark * kv_cache_config.num_blocks)
        # Without a watermark a running request that needs no new page always fits.
        self._fast_path = self.watermark_blocks == 0
        self.prefix_cache_stats: Any = PrefixCacheStats() if log_stats else None
        self.coordinator = _CoordinatorView(kv_cache_config)
        # Per group, the sliding window W (None: full attention), and the recycling-aware cap on
        # the blocks a sliding group reserves when the whole sequence must fit (vLLM's
        # SlidingWindowSpec.max_admission_blocks_per_request; None: no cap).
        if max_in_flight_tokens is None:
            max_in_flight_tokens = max_model_len
        groups = kv_cache_config.kv_cache_groups
        # The attention groups' page size: the scheduler's block size, except beside mamba
        # groups in mode "none", whose one block holds the whole sequence (the scheduler's block
        # size is then the lcm).
        self._page = next(
            (g.kv_cache_spec.block_size for g in groups if not isinstance(g.kv_cache_spec, MambaSpec)),
            block_size,
        )
        self._page_sizes = [g.kv_cache_spec.block_size for g in groups]
        self._windows: list[int | None] = []
        self._admission_caps: list[int | None] = []
        # Mamba groups in mode "align" (their tables are sparse: one page per allocation, null
        # gaps between states) and in mode "none" (one page per request, caching off).
        self._state: list[int] = []
        self._state_none: list[int] = []
        specs = []
        for i, group in enumerate(groups):
            spec = group.kv_cache_spec
            if isinstance(spec, MambaSpec):
                (self._state if spec.mamba_cache_mode == "align" else self._state_none).append(i)
                self._windows.append(None)
                self._admission_caps.append(None)
                specs.append(KVCacheSpec("state", spec.block_size, group_id=f"g{i}"))
            elif isinstance(spec, SlidingWindowSpec):
                window = spec.sliding_window
                self._windows.append(window)
                self._admission_caps.append(
                    _cdiv(min(window - 1 + max_in_flight_tokens, max_model_len), self._page) + 1
                )
                specs.append(
                    KVCacheSpec("sliding_window", self._page, sliding_window=window, group_id=f"g{i}")
                )
            else:
                self._windows.append(None)
                self._admission_caps.append(None)
                specs.append(KVCacheSpec("full", self._page, group_id=f"g{i}"))
        self._sliding = [(g, w) for g, w in enumerate(self._windows) if w is not None]
        # No mamba groups: a running request's page crossing takes the short path.
        self._plain = not self._state and not self._state_none
        # vLLM's hybrid lookup reports, beside the hit every group agrees on, the hit of the first
        # full-attention spec group alone (its shared-prefix boundary, where the scheduler ends a
        # chunk so the mamba state there is kept). The engine's match gives only the joint hit,
        # so with mamba groups the keys of those full groups are mirrored here from the engine's
        # own KV events (stored and evicted keys, counted per page).
        self._full_mirror: dict[int, dict[bytes, int]] = {}
        # Sparse prefix-cache retention (vLLM's default, 0, or an interval in tokens): vLLM keys
        # a sliding or mamba group's block only where a later request can resume (docs/vllm.md).
        self._retention: int | None = kv_cache_config.prefix_cache_retention_interval
        self._sparse = bool(enable_caching and self._retention is not None and (self._sliding or self._state))
        # The ``mamba_checkpoints="reuse"`` option (docs/vllm.md): with mamba groups in mode
        # "align" and prefix caching, the reuse policy (SPEC 13.5, 13.8) places and keys the mamba
        # states instead of vLLM's retention rule; the registration is the sparse one (per group,
        # running states never moved), whatever the retention setting.
        self.mamba_checkpoints = mamba_checkpoints
        self._reuse = bool(mamba_checkpoints == "reuse" and enable_caching and self._state)
        if self._reuse:
            if self._sliding:
                raise UnsupportedVllmConfigError(
                    "flat_kvcache.vllm.FlatScheduler does not support mamba_checkpoints 'reuse' "
                    "beside sliding-window groups"
                )
            self._sparse = True
        # What the reuse policy learned (the sharing grain, decode checkpoints' hits), and per
        # request the checkpoints it placed in the prompt (_Placement).
        self._evidence = ReuseEvidence()
        self._placements: dict[str, _Placement] = {}
        first = next((g for g in groups if type(g.kv_cache_spec) in _FULL_SPECS), None)
        if (self._state or self._sparse) and enable_caching and first is not None:
            self._full_mirror = {
                i: {}
                for i, g in enumerate(groups)
                if type(g.kv_cache_spec) is type(first.kv_cache_spec)
                and g.kv_cache_spec == first.kv_cache_spec
            }
        # Hashes of the mamba blocks cached during the current ``schedule()`` (vLLM's
        # ``MambaManager.cached_blocks_this_step``): a hit ending on one waits a step.
        self._state_cached_this_step: set[bytes] = set()
        # With these two options freed and reclaimed pages return to the free list where vLLM's
        # pool puts them (docs/engine-api.md, eviction_order "group").
        self.cache = PageCache(
            specs,
            kv_cache_config.num_blocks,
            enable_caching=enable_caching,
            eviction_order="group",
            reuse_uncached_first=True,
            enable_kv_events=bool(self._full_mirror),
            # vLLM's mamba "align" tables keep a running state that holds no key (sparse
            # retention) in its slot and take a fresh block for the next one.
            move_state_pages=not (self._sparse and bool(self._state)),
        )
        # One vLLM block object per page id, handed out in every KVCacheBlocks; page 0 is the
        # null block. Only ``block_id`` (and ``is_null``) is meaningful on them.
        self._page_blocks = [KVCacheBlock(block_id=i) for i in range(kv_cache_config.num_blocks)]
        self._page_blocks[0].is_null = True
        self.empty_kv_cache_blocks = KVCacheBlocks(tuple(() for _ in range(self.num_kv_cache_groups)))
        self._tables: dict[str, _Tables] = {}
        # request id -> (the KVCacheBlocks get_computed_blocks returned, its PrefixMatch)
        self._pending_hits: dict[str, tuple[Any, Any]] = {}
        # Whether vLLM's block hashes are 32 bytes, the engine's content hashes as they are
        # (None until the first is seen: one hash function makes them all one length); if not,
        # request id -> their SHA-256 digests, each converted once.
        self._raw_hashes: bool | None = None
        self._digests: dict[str, list[bytes]] = {}
        self._record_new_block_ids = bool(kv_cache_config.needs_kv_cache_zeroing)
        # vLLM zeroes new attention blocks only, not mamba state blocks.
        self._zeroed_groups = [
            g for g in range(self.num_kv_cache_groups) if g not in self._state and g not in self._state_none
        ]
        # Per group, as vLLM's managers keep them (take_new_block_ids concatenates in group order).
        self._new_block_ids: list[list[int]] = [[] for _ in range(self.num_kv_cache_groups)]

    # -- hashes --------------------------------------------------------------------------------

    def _hashes(self, request: Any, count: int) -> Sequence[bytes]:
        """``request.block_hashes`` as the engine's content hashes, at least the first ``count``
        (the list itself when they are 32 bytes: slice it, never copy it whole)."""
        source = request.block_hashes
        if self._raw_hashes is None and source:
            self._raw_hashes = len(source[0]) == 32
        if self._raw_hashes:
            return source  # type: ignore[no-any-return]
        done = self._digests.get(request.request_id)
        if done is None or len(done) > len(source):
            done = self._digests[request.request_id] = []
        for raw in source[len(done) : count]:
            done.append(hashlib.sha256(bytes(raw)).digest())
        return done

    # -- stats, usage, events ------------------------------------------------------------------

    @property
    def usage(self) -> float:
        total = self.num_blocks - 1
        if not total:
            return 0
        return 1.0 - (self.cache.num_free_pages / total)

    def make_prefix_cache_stats(self) -> Any:
        if not self.log_stats:
            return None
        stats = self.prefix_cache_stats
        self.prefix_cache_stats = PrefixCacheStats()
        return stats

    def prefix_cache_lookup_enabled(self, request: Any) -> bool:
        return self.enable_caching and not request.skip_reading_prefix_cache

    def record_prefix_cache_stats(self, request: Any, num_hits: int) -> None:
        if not self.log_stats or not self.prefix_cache_lookup_enabled(request):
            return
        self.prefix_cache_stats.record(
            num_tokens=request.num_tokens, num_hits=num_hits, preempted=request.num_preemptions > 0
        )

    def take_events(self) -> list[Any]:
        """vLLM's KV cache events since the last call (``[]`` unless enabled), vLLM's objects in
        vLLM's order (_events.py)."""
        events = self._events
        return [] if events is None else events.take()

    def take_new_block_ids(self) -> list[int]:
        ids = [block_id for group in self._new_block_ids for block_id in group]
        self._new_block_ids = [[] for _ in range(self.num_kv_cache_groups)]
        return ids

    def take_kv_cache_block_copies(self) -> tuple[list[Any], list[Any]]:
        return [], []  # copies come from partial hits and mamba groups, neither served

    def take_boundary_state_offloads(self) -> dict[str, list[tuple[int, int, int]]]:
        return {}

    def new_step_starts(self) -> None:
        self._state_cached_this_step.clear()

    # -- the full-attention keys, for the shared-prefix boundary ------------------------------

    def _sync_full_mirror(self) -> None:
        """Apply the engine's KV events since the last call to the mirrored full-group keys."""
        mirror = self._full_mirror
        for event in self.cache.take_events():
            kind = type(event).__name__
            if kind == "AllBlocksCleared":
                for keys in mirror.values():
                    keys.clear()
                continue
            held = mirror.get(event.group_index)
            if held is None:
                continue
            keys = held
            if kind == "BlockStored":
                for key in event.block_hashes:
                    keys[key] = keys.get(key, 0) + 1
            elif kind == "BlockRemoved":
                for key in event.block_hashes:
                    left = keys[key] - 1
                    if left:
                        keys[key] = left
                    else:
                        del keys[key]
            else:
                raise RuntimeError(f"flat_kvcache.vllm: unexpected KV event {event!r}")

    def _full_hit_pages(self, hashes: Sequence[bytes], start: int) -> int:
        """vLLM's full-attention hit alone: the leading pages every mirrored group holds a key
        for. The first ``start`` are known to (the joint hit's pages), so the scan starts there."""
        self._sync_full_mirror()
        count = start
        end = len(hashes)
        for keys in self._full_mirror.values():
            stop = start
            while stop < end and hashes[stop] in keys:
                stop += 1
            end = stop
        return max(count, end)

    # -- lookup --------------------------------------------------------------------------------

    def get_computed_blocks(
        self, request: Any, max_cache_hit_length: int | None = None
    ) -> tuple[Any, int, int]:
        """The cached prefix of a waiting request: (blocks, hit tokens, shared-prefix boundary 0)."""
        if not self.prefix_cache_lookup_enabled(request):
            return self.empty_kv_cache_blocks, 0, 0
        if max_cache_hit_length is None:
            max_cache_hit_length = request.num_tokens - 1
        count = min(max_cache_hit_length // self.block_size, len(request.block_hashes))
        if count <= 0:
            return self.empty_kv_cache_blocks, 0, 0
        hashes = self._hashes(request, count)[:count]
        match = self.cache.match_prefix(hashes)
        hit = match.num_common_tokens
        # vLLM's shared-prefix boundary: the full-attention hit where it runs past the hit every
        # group agrees on (only mamba groups lag it here), else 0.
        boundary = 0
        if self._full_mirror:
            full = self._full_hit_pages(hashes, hit // self._page) * self._page
            if full > hit:
                boundary = full
            if self._reuse:
                boundary = self._place(request, hit, full, count * self._page)
        if hit == 0:
            return self.empty_kv_cache_blocks, 0, boundary
        pages = self._page_blocks
        blocks = KVCacheBlocks(tuple([pages[p] for p in group] for group in match.pages))
        self._pending_hits[request.request_id] = (blocks, match)
        if self._events is not None and getattr(request, "kv_cache_report_mode", "incremental") == "full":
            self._events.hit(request, [len(group) for group in match.pages])
        return blocks, hit, boundary

    # -- the reuse policy's checkpoints (mamba_checkpoints "reuse") ------------------------------

    def _body_end(self, request: Any, hit: int) -> int:
        """SPEC 13.5b on the sharing grain ``S``: the last multiple of ``S`` before the prompt's
        last token, or of the block size when no multiple of ``S`` lies past the hit."""
        page = self._page
        last: int = request.num_prompt_tokens - 1
        grain = self._evidence.sharing_grain(page)
        body = last // grain * grain
        return body if body > hit else last // page * page

    def _place(self, request: Any, hit: int, full: int, cap: int) -> int:
        """Where the reuse policy checkpoints a request being admitted, and the first of those
        positions as ``get_computed_blocks``' third value (the scheduler ends a chunk there).

        The full-attention hit ``full`` (from the mirrored keys) is a divergence point when it
        stops short of the capped prompt ``cap`` (observed once per admission); the points are the
        branch point (``full`` where it runs past the joint hit ``hit``: vLLM's Marconi junction)
        and the body's end on the learned sharing grain. The scheduler stops a chunk at one
        boundary; ``_register_reachable`` moves it to the next point once the first is cached."""
        request_id = request.request_id
        page = self._page
        if 0 < full < cap and request_id not in self._placements:
            self._evidence.observe(full, page)
        points = {self._body_end(request, hit)}
        if full > hit:
            points.add(full)
        ahead = tuple(sorted(p for p in points if p > hit and p % page == 0))
        self._placements[request_id] = _Placement(ahead)
        return ahead[0] if ahead else 0

    def _placement(self, request: Any) -> _Placement:
        """The request's placed checkpoints (the body's end alone for a request admitted with
        no lookup)."""
        placement = self._placements.get(request.request_id)
        if placement is None:
            placement = self._placements[request.request_id] = _Placement((self._body_end(request, 0),))
        return placement

    def _reuse_keeps(self, request: Any, placement: _Placement, slot: int) -> bool:
        """Whether the reuse policy keys the mamba state ending at slot ``slot``: a placed prompt
        checkpoint, or the decode checkpoint (the last block boundary the request can reach with
        ``max_tokens``; none for a request that stops earlier), kept like any cached block
        (SPEC 13.8: eviction decides). Other states stay unkeyed."""
        page = self._page
        end = (slot + 1) * page
        if end in placement.points:
            return True
        if end < request.num_prompt_tokens or placement.decided_decode:
            return False
        reach = min(request.num_prompt_tokens + request.max_tokens, self.max_model_len) - 1
        if end != reach // page * page:
            return False
        placement.decided_decode = True
        return True

    # -- allocation ----------------------------------------------------------------------------

    def _pages_to_allocate(
        self, tables: _Tables | None, held: Sequence[int], num_tokens: int, *, capped: bool = False
    ) -> int:
        """vLLM's ``get_num_blocks_to_allocate`` less the hit pages on the free list.

        A group's table (or hit) never has fewer slots than the blocks its window skipped, so
        vLLM's ``max(skipped, held)`` is ``held``; ``capped`` applies the sliding groups'
        admission cap (the full-sequence check)."""
        need = 0
        required = _cdiv(num_tokens, self._page)
        for g, cap in enumerate(self._admission_caps):
            have = len(tables.blocks[g]) if tables is not None else held[g]
            if g in self._state_none:
                need += max(_cdiv(num_tokens, self._page_sizes[g]) - have, 0)
            elif g in self._state:
                # vLLM's MambaManager ("align"): one page for the new running state, whatever the
                # number of blocks the chunk spans (the others stay null).
                need += min(max(required - have, 0), 1)
            else:
                need += max((min(required, cap) if capped and cap is not None else required) - have, 0)
        return need

    def _set_due(self, tables: _Tables) -> None:
        """When the next ``reclaim`` would null a page: the smallest ``n`` with
        ``(n - W + 1) // P > holes`` over the sliding groups that have a page past their holes."""
        due = _NEVER
        size = self._page
        for g, window in self._sliding:
            holes = tables.holes[g]
            if len(tables.blocks[g]) > holes:
                due = min(due, (holes + 1) * size + window - 1)
        if self._state and tables.live:
            # vLLM's mamba remove_skipped_blocks: the page of slot s goes once (n - 1) // P > s.
            due = min(due, (tables.live[0] + 1) * size + 1)
        tables.due = due

    def _reclaim(self, request_id: str, tables: _Tables, num_tokens: int) -> None:
        """vLLM's ``remove_skipped_blocks`` at ``num_tokens`` processed tokens: each sliding
        group's slots ``[0, min((n - W + 1) // P, len))`` become null blocks and their pages are
        released (the engine's ``reclaim``, in vLLM's order under eviction order "group")."""
        if num_tokens < tables.due:
            return
        self.cache.reclaim(request_id, num_tokens)
        null = self._page_blocks[0]
        for g, window in self._sliding:
            blocks = tables.blocks[g]
            k = min((num_tokens - window + 1) // self._page, len(blocks))
            holes = tables.holes[g]
            if k > holes:
                blocks[holes:k] = [null] * (k - holes)
                tables.holes[g] = k
        if self._state and tables.live:
            # Mamba ("align"): the state pages of slots below (n - 1) // P are released (a window
            # of 2 tokens, the engine's state group).
            k = (num_tokens - 1) // self._page
            live = tables.live
            while live and live[0] < k:
                slot = live.pop(0)
                for g in self._state:
                    tables.blocks[g][slot] = null
        self._set_due(tables)

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
        """Room for ``num_new_tokens`` more tokens (after a prefix hit): the new blocks, or None."""
        request_id = request.request_id
        tables = self._tables.get(request_id)
        if (
            tables is not None
            and self._fast_path
            and num_new_tokens > 0
            and not (
                num_new_computed_tokens
                or reserved_blocks
                or full_sequence_must_fit
                or num_external_computed_tokens
                or num_encoder_tokens
                or delay_cache_blocks
            )
        ):
            # A running request (once per request per step): no hit, watermark or reserve.
            if request.num_computed_tokens + num_new_tokens + num_lookahead_tokens <= tables.capacity:
                # Its last page has room (the common case): nothing to check and no native
                # call, unless pages became full or slid out.
                if tables.due < _NEVER:
                    computed = min(request.num_computed_tokens, self.max_model_len)
                    self._reclaim(request_id, tables, max(0, computed - request.num_in_flight_tokens))
                if self.enable_caching and len(request.block_hashes) > tables.num_cached:
                    computed = min(request.num_computed_tokens, self.max_model_len)
                    filled = min(computed + num_new_tokens, request.num_tokens)
                    # vLLM hashes a block once its tokens are known, a step or more before
                    # they are computed: call only when a page is full (_cache_filled's test,
                    # inline: this runs for every running request every step).
                    if filled // self.block_size > tables.num_cached:
                        self._cache_full_pages(request, tables, filled)
                return self.empty_kv_cache_blocks
            if self._plain:
                # It crosses a page boundary (once per page per request).
                return self._grow_running(request, tables, num_new_tokens, num_lookahead_tokens)
        if num_new_tokens == 0 and num_external_computed_tokens == 0 and num_new_computed_tokens == 0:
            raise ValueError(
                "num_new_tokens must be greater than 0 when there are no computed tokens to adopt"
            )
        if num_external_computed_tokens or num_encoder_tokens or delay_cache_blocks:
            raise NotImplementedError(
                "flat_kvcache.vllm: external (connector) tokens and cross-attention are not supported"
            )
        match = None
        held: Sequence[int] = (0,) * self.num_kv_cache_groups
        if new_computed_blocks is not None and any(new_computed_blocks.blocks):
            pending = self._pending_hits.pop(request_id, None)
            if pending is None or pending[0] is not new_computed_blocks or tables is not None:
                raise RuntimeError(
                    f"flat_kvcache.vllm: blocks for {request_id!r} do not come from get_computed_blocks"
                )
            match = pending[1]
            held = [len(group) for group in new_computed_blocks.blocks]
            state_hit = held[self._state[0]] if self._state else 0
            if state_hit and self._hashes(request, state_hit)[state_hit - 1] in self._state_cached_this_step:
                # vLLM's MambaManager: a state another request cached in this very step is not
                # written yet, so the request waits (its count says "more than the pool").
                return None

        num_local_computed_tokens = request.num_computed_tokens + num_new_computed_tokens
        total_computed_tokens = min(num_local_computed_tokens, self.max_model_len)
        watermark_blocks = 0
        if has_scheduled_reqs and request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            watermark_blocks = self.watermark_blocks
        # Hit pages nobody holds are on the free list: claiming them takes them off it.
        evictable = self.cache.pages_consumed_by_claim(match) if match is not None else 0
        if full_sequence_must_fit:
            full_num_tokens = min(request.num_tokens, self.max_model_len)
            needed = self._pages_to_allocate(tables, held, full_num_tokens, capped=True) + evictable
            if needed + watermark_blocks > self.cache.num_free_pages:
                return None
        num_tokens_main_model = total_computed_tokens + num_new_tokens
        num_tokens_need_slot = min(num_tokens_main_model + num_lookahead_tokens, self.max_model_len)
        if tables is not None:
            # vLLM frees the blocks that slid out of the window before it counts, whether or not
            # the request then fits, on the processed-token basis.
            self._reclaim(request_id, tables, max(0, total_computed_tokens - request.num_in_flight_tokens))
        needed = self._pages_to_allocate(tables, held, num_tokens_need_slot) + evictable
        if needed + watermark_blocks > self.cache.num_free_pages - reserved_blocks:
            return None

        cache = self.cache
        if tables is None:
            tables = self._tables[request_id] = _Tables(self.num_kv_cache_groups)
        if match is not None:
            cache.claim(request_id, match)
            tables.blocks = [list(group) for group in new_computed_blocks.blocks]
            hit_pages = max(held)
            tables.num_cached = hit_pages
            tables.slots = tables.capacity = hit_pages * self._page
            if self._state:
                tables.live = [hit_pages - 1]  # the hit state; the slots before it are null
            for g, _ in self._sliding:
                blocks = tables.blocks[g]
                holes = 0
                while holes < len(blocks) and blocks[holes].is_null:
                    holes += 1
                tables.holes[g] = holes
            if self._sparse:
                self._note_hit_keys(request, tables)
        new_blocks: tuple[list[Any], ...] | None = None
        if num_tokens_need_slot > tables.capacity:
            if self._state and tables.live and not self._sparse:
                self._key_running_state(
                    request, tables, min(total_computed_tokens + num_new_tokens, request.num_tokens)
                )
            new_blocks = self._grow(request_id, tables, num_tokens_need_slot)
        if self._sliding or self._state:
            self._set_due(tables)

        if not delay_cache_blocks:
            self._cache_filled(
                request, tables, min(total_computed_tokens + num_new_tokens, request.num_tokens)
            )
        if new_blocks is None:
            return self.empty_kv_cache_blocks
        return KVCacheBlocks(new_blocks)

    def _grow_running(
        self, request: Any, tables: _Tables, num_new_tokens: int, num_lookahead_tokens: int
    ) -> Any:
        """``allocate_slots`` of a running request that crosses a page boundary, without mamba
        groups: the general path's steps less what cannot apply (no hit, watermark, reserve or
        admission cap), so every group needs ``cdiv(need, P) - len`` pages, holes included."""
        request_id = request.request_id
        computed = min(request.num_computed_tokens, self.max_model_len)
        if tables.due < _NEVER:
            self._reclaim(request_id, tables, max(0, computed - request.num_in_flight_tokens))
        need = min(computed + num_new_tokens + num_lookahead_tokens, self.max_model_len)
        required = _cdiv(need, self._page)
        needed = 0
        for blocks in tables.blocks:
            if required > len(blocks):
                needed += required - len(blocks)
        if needed > self.cache.num_free_pages:
            return None
        new_blocks = self._grow(request_id, tables, need) if need > tables.capacity else None
        if self._sliding:
            self._set_due(tables)
        self._cache_filled(request, tables, min(computed + num_new_tokens, request.num_tokens))
        if new_blocks is None:
            return self.empty_kv_cache_blocks
        return KVCacheBlocks(new_blocks)

    def _grow(self, request_id: str, tables: _Tables, need: int) -> tuple[list[Any], ...] | None:
        """Take the request's tables to ``need`` tokens (more than they hold): the engine
        allocates ``cdiv(need, P) - len`` pages per group (one, the last, in a mamba group) and
        answers each table's new slots (the mirror's tables are as long as the engine's before
        the call). The new blocks per group, or None if none has any."""
        capacity = _cdiv(need, self._page) * self._page
        # The engine is told the whole last page at once (the same pages), so the tokens that
        # fill it later need no acquire before they are registered; never past max_model_len
        # (a mamba "none" group's one page holds that many).
        target = min(capacity, self.max_model_len)
        appended = self.cache.acquire_pages(request_id, target - tables.slots)
        if appended is None:
            raise RuntimeError("flat_kvcache.vllm: acquire failed after the free-page check")
        tables.slots = target
        tables.capacity = capacity
        if self._state:
            tables.live.append(capacity // self._page - 1)
        pages = self._page_blocks
        events = self._events
        grown = []
        for g, (group_blocks, new_ids) in enumerate(zip(tables.blocks, appended, strict=True)):
            if events is not None:
                events.handed_out(new_ids)
            fresh = [pages[p] for p in new_ids]
            group_blocks.extend(fresh)
            grown.append(fresh)
            if self._record_new_block_ids and g in self._zeroed_groups:
                self._new_block_ids[g].extend(new_ids)
        return tuple(grown) if any(grown) else None

    def _cache_filled(self, request: Any, tables: _Tables, num_tokens: int) -> None:
        """:meth:`_cache_full_pages` at ``num_tokens``, called only when it has something to do:
        a page made full that has a hash, or a store to record.

        The one test of "a page to register": a hash the table has not registered
        (``len(request.block_hashes) > tables.num_cached``) whose page ``num_tokens`` fills
        (``num_tokens // block_size > tables.num_cached``). ``allocate_slots``' fast path and
        :meth:`cache_blocks` inline it (each runs once per running request per step). A
        pending store (``_store_from``) exists only inside ``allocate_slots``' general path,
        between :meth:`_key_running_state` and the call here that records it, so only this
        caller sees one."""
        if not self.enable_caching:
            return
        if self._store_from is not None or (
            len(request.block_hashes) > tables.num_cached
            and num_tokens // self.block_size > tables.num_cached
        ):
            self._cache_full_pages(request, tables, num_tokens)

    def _key_running_state(self, request: Any, tables: _Tables, num_tokens: int) -> None:
        """Before a mamba table grows past its last page: register the pages already there that
        ``num_tokens`` fills, as vLLM's ``cache_blocks`` does right after its allocation.

        vLLM allocates a fresh page for the new running state and keeps the previous one until
        it is processed; the engine's state group does the same for a page that holds a key, and
        moves one that holds none. Registering first (the same keys on the same pages, only
        earlier within one ``allocate_slots``, which the free list does not see) keeps them the
        same. A running state whose block cannot be keyed yet would move: refused loudly."""
        self._cache_full_pages(request, tables, num_tokens, within_table=True)
        if tables.live[-1] >= tables.num_cached:
            raise RuntimeError(
                f"flat_kvcache.vllm: request {request.request_id!r} crosses a mamba block boundary "
                f"with its running state (slot {tables.live[-1]}) not cached; vLLM would allocate "
                "a fresh page where the engine's state group moves this one"
            )

    def _cache_full_pages(
        self, request: Any, tables: _Tables, num_tokens: int, *, within_table: bool = False
    ) -> None:
        if not self.enable_caching:
            return
        num_full = min(num_tokens, len(request.block_hashes) * self.block_size) // self.block_size
        if within_table:
            num_full = min(num_full, tables.capacity // self._page)
        start = tables.num_cached
        if num_full <= start:
            if self._store_from is not None and not within_table:
                self._stored(request, tables, start, start)
            return
        hashes = self._hashes(request, num_full)
        filled = num_full * self.block_size
        if filled > tables.slots:
            # The engine registers a table's last page only once it counts it full: hand it the
            # tokens that filled it (room the pages already have, so nothing is allocated).
            self.cache.acquire(request.request_id, filled - tables.slots)
            tables.slots = filled
        if self._sparse:
            self._register_reachable(request, tables, hashes, start, num_full)
        elif self._state:
            # vLLM caches every mamba page in the range; the engine's state group only the one
            # at its end (the running state's), so no other may be there.
            live = tables.live
            if any(start <= slot < num_full - 1 for slot in live):
                raise RuntimeError(
                    f"flat_kvcache.vllm: request {request.request_id!r} would cache mamba states "
                    f"at slots {[slot for slot in live if start <= slot < num_full]} at once"
                )
            if num_full - 1 in live:
                self._state_cached_this_step.add(hashes[num_full - 1])
            self.cache.register(
                request.request_id, hashes[start:num_full], first_slot=start, end_tokens=filled
            )
        else:
            self.cache.register(request.request_id, hashes[start:num_full], first_slot=start)
        tables.num_cached = num_full
        if self._events is not None:
            if within_table:
                # Registered before the table grows; vLLM stores the range after its allocation,
                # with whatever the same call then fills: one store per group, later.
                if self._store_from is None:
                    self._store_from = start
            else:
                self._stored(request, tables, start, num_full)

    def _stored(self, request: Any, tables: _Tables, start: int, end: int) -> None:
        """Record vLLM's ``BlockStored`` events of slots ``[start, end)`` just registered, from
        the first slot registered before the table grew if there was one."""
        assert self._events is not None
        if self._store_from is not None:
            start = self._store_from
            self._store_from = None
        # Under sparse retention vLLM's pool skips the blocks a group's mask leaves out, as it
        # skips null blocks: no store, and so no removal later.
        masks = self._reachable_masks(request, start, end) if self._sparse else None
        self._events.stored(request, tables.blocks, start, end, masks)

    def cache_blocks(self, request: Any, num_computed_tokens: int) -> None:
        """Register the request's pages made full by ``num_computed_tokens`` (async scheduling)."""
        if not self.enable_caching:
            return
        tables = self._tables.get(request.request_id)
        if (
            tables is not None
            and len(request.block_hashes) > tables.num_cached
            and num_computed_tokens // self.block_size > tables.num_cached
        ):
            self._cache_full_pages(request, tables, num_computed_tokens)

    # -- sparse prefix-cache retention ----------------------------------------------------------

    def _register_reachable(
        self, request: Any, tables: _Tables, hashes: Sequence[bytes], start: int, num_full: int
    ) -> None:
        """vLLM's ``cache_blocks`` under sparse retention for slots ``[start, num_full)``: full
        groups key every block, sliding and mamba groups only the blocks of their
        ``reachable_block_mask`` (``register(groups=)`` names the groups of each call).

        The reachable boundaries are vLLM's: the replay boundary (the last prompt token) and the
        shared-prefix junction the scheduler stored on the request from ``get_computed_blocks``."""
        request_id = request.request_id
        cache = self.cache
        page = self._page
        boundaries = self._reachable_boundaries(request)
        full = [
            g
            for g, window in enumerate(self._windows)
            if window is None and g not in self._state and g not in self._state_none
        ]
        if full:
            cache.register(request_id, hashes[start:num_full], first_slot=start, groups=full)
        windows: dict[int, list[int]] = {}
        for g, window in self._sliding:
            windows.setdefault(window, []).append(g)
        for window, same in windows.items():
            mask = _sliding_mask(window, page, self._retention, boundaries, start, num_full)
            for first, end in _runs(mask, start, num_full):
                cache.register(request_id, hashes[first:end], first_slot=first, groups=same)
                for g in same:
                    # Nulls are a prefix of a sliding table: the run's last slot holds a page
                    # unless it already slid out.
                    if end - 1 >= tables.holes[g]:
                        tables.keyed[g] = max(tables.keyed[g], end - 1)
        if self._reuse:
            self._register_reuse(request, tables, hashes, start, num_full)
        elif self._state:
            mask = _mamba_mask(page, self._retention, boundaries, start, num_full)
            for slot in tables.live:
                if start <= slot < num_full and (mask is None or mask[slot - start]):
                    self._key_state(request_id, tables, hashes, slot)

    def _key_state(self, request_id: str, tables: _Tables, hashes: Sequence[bytes], slot: int) -> None:
        self.cache.register(
            request_id,
            hashes[slot : slot + 1],
            first_slot=slot,
            end_tokens=(slot + 1) * self._page,
            groups=self._state,
        )
        tables.keyed_states.add(slot)
        self._state_cached_this_step.add(hashes[slot])

    def _register_reuse(
        self, request: Any, tables: _Tables, hashes: Sequence[bytes], start: int, num_full: int
    ) -> None:
        """The mamba states of slots ``[start, num_full)`` the reuse policy keeps
        (:meth:`_reuse_keeps`), keyed; then the scheduler's next chunk stop moved to the next
        placed checkpoint past the registered pages."""
        placement = self._placement(request)
        for slot in tables.live:
            if start <= slot < num_full and self._reuse_keeps(request, placement, slot):
                self._key_state(request.request_id, tables, hashes, slot)
        reached = num_full * self._page
        following = next((p for p in placement.points if p > reached), 0)
        if following:
            request.shared_prefix_boundary = following

    @staticmethod
    def _reachable_boundaries(request: Any) -> list[int]:
        """vLLM's reachable boundaries of a request: its replay boundary (the last prompt token)
        and the shared-prefix junction the scheduler stored from ``get_computed_blocks``."""
        boundaries = [request.num_prompt_tokens - 1]
        if request.shared_prefix_boundary:
            boundaries.append(request.shared_prefix_boundary)
        return boundaries

    def _reachable_masks(self, request: Any, start: int, end: int) -> list[list[bool] | None]:
        """Per group, the blocks of slots ``[start, end)`` vLLM caches under sparse retention
        (None: every block), as :meth:`_register_reachable` registers them."""
        boundaries = self._reachable_boundaries(request)
        page = self._page
        masks: list[list[bool] | None] = []
        tables = self._tables.get(request.request_id)
        for g, window in enumerate(self._windows):
            if self._reuse and g in self._state:
                keyed = tables.keyed_states if tables is not None else set()
                masks.append([slot in keyed for slot in range(start, end)])
            elif window is not None:
                masks.append(_sliding_mask(window, page, self._retention, boundaries, start, end))
            elif g in self._state:
                masks.append(_mamba_mask(page, self._retention, boundaries, start, end))
            else:
                masks.append(None)
        return masks

    def _note_hit_keys(self, request: Any, tables: _Tables) -> None:
        """After a claim: the hit's pages hold keys (a sliding group's last hit slot, the mamba
        groups' hit state)."""
        for g, _ in self._sliding:
            blocks = tables.blocks[g]
            tables.keyed[g] = len(blocks) - 1 if blocks and not blocks[-1].is_null else -1
        tables.keyed_states = set(tables.live)

    def _estimate_sparse(self, tables: _Tables) -> int:
        """vLLM's ``estimate_cached_tokens`` (the least over groups of the largest token count a
        held block's key covers) where sliding and mamba groups key only some blocks."""
        page = self._page
        full = any(w is None and g not in self._state for g, w in enumerate(self._windows))
        least = tables.num_cached * page if full else None
        for g, _ in self._sliding:
            top = tables.keyed[g]
            tokens = (top + 1) * page if top >= tables.holes[g] else 0
            least = tokens if least is None else min(least, tokens)
        if self._state:
            keyed = tables.keyed_states
            tokens = max(((slot + 1) * page for slot in tables.live if slot in keyed), default=0)
            least = tokens if least is None else min(least, tokens)
        return least or 0

    # -- reading and freeing -------------------------------------------------------------------

    def get_blocks(self, request_id: str) -> Any:
        tables = self._tables.get(request_id)
        if tables is None or not any(tables.blocks):
            return self.empty_kv_cache_blocks
        return KVCacheBlocks(tuple(tables.blocks))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return tuple([block.block_id for block in group] for group in self.get_blocks(request_id).blocks)

    def get_block_ids_for_computed_tokens(
        self, request_id: str, num_computed_tokens: int
    ) -> tuple[list[int], ...]:
        keep = _cdiv(num_computed_tokens, self._page)
        return tuple(
            ids if g in self._state or g in self._state_none else ids[:keep]
            for g, ids in enumerate(self.get_block_ids(request_id))
        )

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        return [0] * self.num_kv_cache_groups

    def estimate_cached_tokens(self, request: Any) -> int:
        """vLLM's: the least, over groups, of the token count the last hashed block of the
        group's table covers. A table's registered pages are its first ``num_cached``; a sliding
        table whose page ``num_cached - 1`` slid out holds no hashed block (nulls are a prefix)."""
        tables = self._tables.get(request.request_id)
        if tables is None or not tables.num_cached:
            return 0
        if self._sparse:
            return self._estimate_sparse(tables)
        last = tables.num_cached - 1
        for g, _ in self._sliding:
            if tables.blocks[g][last].is_null:
                return 0
        if self._state:
            # A mamba table's newest hashed block is its highest cached state still held.
            return max(((slot + 1) * self._page for slot in tables.live if slot <= last), default=0)
        return tables.num_cached * self._page

    def remove_skipped_blocks(
        self, request_id: str, processed_computed_tokens: int, num_prompt_tokens: int | None = None
    ) -> None:
        """Null and release the blocks that slid out of the sliding windows (none in full groups)."""
        tables = self._tables.get(request_id)
        if tables is not None:
            self._reclaim(request_id, tables, processed_computed_tokens)

    def free(self, request: Any) -> None:
        """Release the request's pages, each table tail first, group 0 first, cached pages to the
        back of the free list and uncached ones to its front (vLLM's order)."""
        request_id = request.request_id
        self._pending_hits.pop(request_id, None)
        self._digests.pop(request_id, None)
        self._placements.pop(request_id, None)
        if self._tables.pop(request_id, None) is not None:
            self.cache.free(request_id)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; refused (False) while any page is held, as in vLLM."""
        if self.cache.num_free_pages != self.num_blocks - 1:
            return False
        self.cache.reset_prefix_cache()
        if self._full_mirror:
            self._sync_full_mirror()
        if self._events is not None:
            self._events.cleared()
        if self.log_stats:
            self.prefix_cache_stats.reset = True
        return True

    def pop_blocks_for_free(self, request: Any) -> list[Any]:
        raise NotImplementedError("flat_kvcache.vllm: deferred frees need a KV connector (not supported)")

    def evict_blocks(self, block_ids: set[int]) -> None:
        raise NotImplementedError("flat_kvcache.vllm: evicting by block id needs a KV connector")
