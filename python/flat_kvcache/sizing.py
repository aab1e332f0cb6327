"""Sizing API (SPEC 2 and 10): group specs, page counts, capture widths, slab pairing, validation.

Every function is computed natively (``flat_kvcache._native``, Rust, checked arithmetic); this
module only converts between the native tuples and the :mod:`flat_kvcache._types` dataclasses.
The contract, errors included, is docs/sizing-api.md; :mod:`flat_kvcache.reference.sizing` is
the pure-Python implementation of the same contract.

Integer arguments accept any ``int`` (or object with ``__index__``), not ``bool``. Checks are
exact for ints of any size; a value, intermediate or result that does not fit an unsigned 64-bit
integer raises ``OverflowError`` naming the argument(s) involved.
"""

from __future__ import annotations

from collections.abc import Sequence

from flat_kvcache import _native
from flat_kvcache._types import (
    CHUNKED_ATTENTION,
    FULL_ATTENTION,
    LINEAR_ATTENTION,
    SLIDING_ATTENTION,
    STATE_LAYER_TYPES,
    PagedCacheGroupSpec,
)

__all__ = [
    "CHUNKED_ATTENTION",
    "FULL_ATTENTION",
    "LINEAR_ATTENTION",
    "SLIDING_ATTENTION",
    "STATE_LAYER_TYPES",
    "PagedCacheGroupSpec",
    "compute_max_logical_pages_for_capture",
    "compute_paged_cache_group_page_counts",
    "group_specs_from_layer_types",
    "hybrid_slab_group_size",
    "layer_group_ids",
    "publish_paged_cache_groups",
    "scheduler_ext_flat_kvcache",
    "validate_flat_scheduler_config",
]

#: A window argument: None, one int for every sliding and chunked layer, or one entry per layer.
_Windows = int | Sequence[int | None] | None


def _spec(fields: tuple[str, str, int, int, int | None, str]) -> PagedCacheGroupSpec:
    group_id, retention, rows_per_page, entry_stride_tokens, window, family = fields
    return PagedCacheGroupSpec(group_id, retention, rows_per_page, entry_stride_tokens, window, family)


def scheduler_ext_flat_kvcache() -> bool:
    """Whether the flat KV-cache scheduler extension is built in.

    Returns
    -------
    bool
        The native build flag ``FLAT_KVCACHE`` (the ``flat`` cargo feature, on by default).
    """
    return _native.scheduler_ext_flat_kvcache()


def layer_group_ids(layer_types: Sequence[str], sliding_window_tokens: _Windows = None) -> list[str]:
    """The paged-cache group id of every layer.

    Parameters
    ----------
    layer_types : sequence of str
        One label per layer: ``full_attention``, ``sliding_attention``, ``linear_attention`` or
        ``chunked_attention``.
    sliding_window_tokens : int, sequence of (int or None), or None
        None; one window broadcast to the sliding and chunked layers; or one entry per layer. A
        chunked layer's entry is its attention chunk ``C``.

    Returns
    -------
    list of str
        A sliding layer's id is ``f"sliding_attention_{window}"`` when the sliding layers carry
        more than one distinct window, else ``"sliding_attention"``; a chunked layer's is
        ``f"chunked_attention_{chunk}"`` when the chunked layers carry more than one distinct
        chunk, else ``"chunked_attention"``; other layers use their label.

    Raises
    ------
    ValueError
        Unknown label, malformed window argument, a sliding layer without a positive window, a
        chunked layer without a positive chunk, or (sequence form) a full/linear layer carrying
        a positive window.
    TypeError
        ``layer_types`` is not a sequence of str.
    """
    return _native.layer_group_ids(layer_types, sliding_window_tokens)


def group_specs_from_layer_types(
    layer_types: Sequence[str], sliding_window_tokens: _Windows = None, *, page_size: int
) -> list[PagedCacheGroupSpec]:
    """One group spec per distinct group id, in first-appearance order.

    Parameters
    ----------
    layer_types : sequence of str
        One label per layer (see :func:`layer_group_ids`).
    sliding_window_tokens : int, sequence of (int or None), or None
        The window argument (see :func:`layer_group_ids`).
    page_size : int
        Tokens per page, > 0; becomes every spec's ``rows_per_page``.

    Returns
    -------
    list of PagedCacheGroupSpec
        ``entry_stride_tokens = 1``, the group's window (a chunked group's chunk; None for full
        and linear groups), retention ``chunked_window`` for chunked groups, and family
        ``state`` for linear-attention groups. Empty ``layer_types`` gives an empty list.

    Raises
    ------
    ValueError
        ``page_size <= 0``, or any error of :func:`layer_group_ids`.
    TypeError
        ``page_size`` is not an int.
    """
    specs = _native.group_specs_from_layer_types(layer_types, sliding_window_tokens, page_size=page_size)
    return [_spec(fields) for fields in specs]


def compute_paged_cache_group_page_counts(
    specs: Sequence[PagedCacheGroupSpec],
    *,
    max_live_requests: int,
    max_scheduled_tokens: int,
    max_total_tokens: int,
    max_context_len: int,
    decode_input_tokens: int = 1,
    overlap_schedule_depth: int = 0,
    safety_margin: int = 0,
) -> dict[str, int]:
    """Pages each group needs (SPEC 2).

    With ``raw = rows_per_page * entry_stride_tokens`` and ``protected = B * ceil(D*N / raw)``:
    full history ``ceil(T/raw) + B + protected + 1 + M``; state ``min(2*B + T // raw + protected
    + 1 + M, full history)``; sliding window ``B * ceil(min(max(W-1, 0), C) / raw) +
    ceil(min(S, T) / raw) + B + protected + 1 + M``; chunked window (retention
    ``chunked_window``) as a sliding window with ``W`` its chunk.

    Parameters
    ----------
    specs : sequence of PagedCacheGroupSpec
        The groups, checked in order.
    max_live_requests, max_scheduled_tokens, max_total_tokens, max_context_len : int
        B, S, T and C, all >= 0.
    decode_input_tokens : int, default 1
        N, >= 0 (> 0 when ``overlap_schedule_depth`` is 1).
    overlap_schedule_depth : int, default 0
        D, 0 or 1.
    safety_margin : int, default 0
        M, extra pages per group, >= 0.

    Returns
    -------
    dict of str to int
        ``{group_id: pages}``.

    Raises
    ------
    ValueError
        A negative argument, a bad depth, a spec with ``raw <= 0``, a sliding or chunked spec
        without a positive window, or an unknown retention.
    TypeError
        A non-int argument or spec field.
    OverflowError
        An operand or a count does not fit an unsigned 64-bit integer.
    """
    return _native.compute_paged_cache_group_page_counts(
        specs,
        max_live_requests=max_live_requests,
        max_scheduled_tokens=max_scheduled_tokens,
        max_total_tokens=max_total_tokens,
        max_context_len=max_context_len,
        decode_input_tokens=decode_input_tokens,
        overlap_schedule_depth=overlap_schedule_depth,
        safety_margin=safety_margin,
    )


def publish_paged_cache_groups(
    *,
    layer_types: Sequence[str],
    sliding_window_tokens: _Windows,
    page_size: int,
    max_live_requests: int,
    max_scheduled_tokens: int,
    max_total_tokens: int,
    max_context_len: int,
) -> tuple[list[PagedCacheGroupSpec], dict[str, int]] | None:
    """The groups and page counts a flat-KV scheduler publishes.

    Parameters
    ----------
    layer_types : sequence of str
        One label per layer; empty stands for one ``full_attention`` layer.
    sliding_window_tokens : int, sequence of (int or None), or None
        The window argument (see :func:`layer_group_ids`).
    page_size : int
        Tokens per page, > 0.
    max_live_requests, max_total_tokens, max_context_len : int
        B, T and C, >= 0.
    max_scheduled_tokens : int
        S; a negative value counts as 0.

    Returns
    -------
    tuple of (list of PagedCacheGroupSpec, dict of str to int) or None
        ``(specs, counts)`` as :func:`group_specs_from_layer_types` and
        :func:`compute_paged_cache_group_page_counts` (N=1, D=0, M=0) give them; None when the
        native module was built without the ``flat`` feature.

    Raises
    ------
    ValueError, TypeError, OverflowError
        As the two functions above.
    """
    published = _native.publish_paged_cache_groups(
        layer_types=layer_types,
        sliding_window_tokens=sliding_window_tokens,
        page_size=page_size,
        max_live_requests=max_live_requests,
        max_scheduled_tokens=max_scheduled_tokens,
        max_total_tokens=max_total_tokens,
        max_context_len=max_context_len,
    )
    if published is None:
        return None
    specs, counts = published
    return [_spec(fields) for fields in specs], counts


def compute_max_logical_pages_for_capture(
    spec: PagedCacheGroupSpec,
    *,
    max_context_len: int,
    max_tokens_per_req: int = 1,
    overlap_schedule_depth: int = 0,
) -> int:
    """The logical pages one request of a group can touch at once (SPEC 2, 12.1).

    With ``horizon = (D+1) * N``: sliding ``ceil((min(W, C) + horizon) / raw) + 1`` (chunked:
    the same with ``W`` its chunk), full history ``ceil((C + horizon) / raw)``. For a
    full-history group this is the width of its block tables. For a sliding group it is the
    width of a *windowed* row (a row that starts at an offset, as ``bind_rows(offsets=)`` and
    ``CaptureBuffers(sliding_offsets=True)`` keep them); absolute tables (``block_tables(out=)``,
    rows without offsets) keep slid-out slots as holes and need the full-history width of the
    same context.

    Parameters
    ----------
    spec : PagedCacheGroupSpec
        The group.
    max_context_len : int
        C, >= 0.
    max_tokens_per_req : int, default 1
        N, > 0.
    overlap_schedule_depth : int, default 0
        D, 0 or 1.

    Returns
    -------
    int
        Logical pages (table columns) one request can touch.

    Raises
    ------
    ValueError
        A bad argument, then the spec errors of :func:`compute_paged_cache_group_page_counts`.
    TypeError
        A non-int argument or spec field.
    OverflowError
        An operand or the width does not fit an unsigned 64-bit integer.
    """
    return _native.compute_max_logical_pages_for_capture(
        spec,
        max_context_len=max_context_len,
        max_tokens_per_req=max_tokens_per_req,
        overlap_schedule_depth=overlap_schedule_depth,
    )


def hybrid_slab_group_size(
    layer_types: Sequence[str], *, sliding_window_tokens: _Windows = None
) -> int | None:
    """How many K/V slabs the layers can share, or None; never raises.

    The i-th layer of every label shares slab i. That needs at least two labels, no state label,
    one group per label (at most one distinct sliding window) and the same layer count for every
    label. Inputs the grouping rejects give None (SPEC 12.6), and so does a build without the
    ``flat`` feature.

    Parameters
    ----------
    layer_types : sequence of str
        One label per layer.
    sliding_window_tokens : int, sequence of (int or None), or None
        The window argument (see :func:`layer_group_ids`).

    Returns
    -------
    int or None
        The common per-label layer count (the number of slabs), or None.
    """
    return _native.hybrid_slab_group_size(layer_types, sliding_window_tokens=sliding_window_tokens)


def validate_flat_scheduler_config(
    *,
    flat_kvcache_ext: object,
    paged_cache_groups: Sequence[object] | None,
    attn_backend: object,
    kv_pool: object,
    speculative_algorithm: object = None,
) -> None:
    """Refuse scheduler configurations that would corrupt the flat KV cache.

    A no-op when ``flat_kvcache_ext`` is false or the native module was built without the
    ``flat`` feature. Otherwise the backend is resolved by following ``full_attn_backend``
    while it is not None, and its ``uses_paged_cache_groups`` (default False),
    ``uses_flat_cache_groups`` (default False) and ``flat_spec_capable`` (default True) decide.

    Parameters
    ----------
    flat_kvcache_ext : object
        Truthy when the scheduler runs the flat KV-cache extension.
    paged_cache_groups : sequence or None
        The published groups (None means none).
    attn_backend : object
        The attention backend (possibly wrapping another through ``full_attn_backend``).
    kv_pool : object
        The KV pool; only its class name is used, in messages.
    speculative_algorithm : object, optional
        The speculative decoding algorithm; falsy means none.

    Raises
    ------
    RuntimeError
        In this order: a backend that uses paged groups but not flat per-group tables; a
        speculative algorithm with a backend that is not flat-spec-capable; speculative
        algorithm DFLASH; several groups with a backend that does not consume flat per-group
        tables; no group at all. Also a ``full_attn_backend`` cycle.
    """
    _native.validate_flat_scheduler_config(
        flat_kvcache_ext=flat_kvcache_ext,
        paged_cache_groups=paged_cache_groups,
        attn_backend=attn_backend,
        kv_pool=kv_pool,
        speculative_algorithm=speculative_algorithm,
    )
