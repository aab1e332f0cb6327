"""Reference sizing API: group specs, page counts, capture widths, slab pairing, validation.

A plain pure-Python implementation of SPEC sections 2 and 10, following docs/sizing-api.md
(the exact contract the native module also implements). All arithmetic uses Python ints, so
results are exact at any size. The only native name read is the build flag
``flat_kvcache._native.FLAT_KVCACHE``, looked up on every call by :func:`_build_flag`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import NamedTuple, cast

from flat_kvcache._types import (
    CHUNKED_ATTENTION,
    CHUNKED_WINDOW,
    FULL_ATTENTION,
    FULL_HISTORY,
    LAYER_LABELS,
    LINEAR_ATTENTION,
    SLIDING_ATTENTION,
    SLIDING_WINDOW,
    STATE,
    STATE_LAYER_TYPES,
    PagedCacheGroupSpec,
    layer_kind,
)
from flat_kvcache.errors import ConfigError
from flat_kvcache.reference._checks import as_int, ceil_div, is_sequence, non_negative, positive

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

_KNOWN_LABELS = ", ".join(LAYER_LABELS)
#: Labels whose layers carry a window entry: a sliding window, or a chunked layer's chunk.
_WINDOWED_LABELS = (SLIDING_ATTENTION, CHUNKED_ATTENTION)
#: Retentions sized as a sliding window of ``sliding_window_tokens`` (a chunk ``C`` is sized
#: as ``W = C``: the most history one of its tokens attends).
_WINDOWED_RETENTIONS = (SLIDING_WINDOW, CHUNKED_WINDOW)

#: A window argument: None, one int for every sliding and chunked layer, or one entry per layer.
WindowArg = int | Sequence[int | None] | None


def _build_flag() -> bool:
    """SPEC 10: the native build flag ``FLAT_KVCACHE`` (False if the native module is missing).

    Read at call time, so tests can exercise both branches by monkeypatching this function.
    """
    try:
        from flat_kvcache import _native
    except ImportError:
        return False
    return bool(_native.FLAT_KVCACHE)


def scheduler_ext_flat_kvcache() -> bool:
    """SPEC 2: whether the flat KV-cache scheduler extension is built in (the build flag)."""
    return _build_flag()


# --- per-layer grouping ------------------------------------------------------------------------


def layer_labels(layer_types: object) -> list[str]:
    """``layer_types`` as a list of str: any sequence of str, but not a bare ``str``.

    Labels are not checked against the known ones here (``occurrence_index`` takes any label).
    """
    if isinstance(layer_types, str):
        raise ValueError("layer_types must be a sequence of str, not str")
    if not is_sequence(layer_types):
        raise TypeError(f"layer_types must be a sequence of str, not {type(layer_types).__name__}")
    labels: list[str] = []
    for i, label in enumerate(cast("Sequence[object]", layer_types)):
        if not isinstance(label, str):
            raise TypeError(f"layer_types[{i}] must be a str, not {type(label).__name__}")
        labels.append(str(label))
    return labels


def _known_labels(layer_types: object) -> list[str]:
    """SPEC 2: every label must be a known one (``LAYER_LABELS``)."""
    labels = layer_labels(layer_types)
    for i, label in enumerate(labels):
        if label not in LAYER_LABELS:
            raise ValueError(f"unknown layer_type '{label}' at layer {i}; expected one of {_KNOWN_LABELS}")
    return labels


def _window_entries(sliding_window_tokens: object, labels: list[str]) -> list[int | None]:
    """One raw window per layer from the window argument (shape and types only).

    An int is broadcast to the sliding and chunked layers (other layers get None); a sequence
    must have one entry per layer, each None or an int.
    """
    window = sliding_window_tokens
    if window is None:
        return [None] * len(labels)
    # A sequence first: a numpy array's type has ``__index__`` too, but only a 0-d one is an int.
    per_layer = is_sequence(window)
    if isinstance(window, str | bool) or not (per_layer or hasattr(type(window), "__index__")):
        raise ValueError(
            f"sliding_window_tokens must be None, an int or a per-layer sequence, not {type(window).__name__}"
        )
    if not per_layer:
        value = as_int(window, "sliding_window_tokens")
        return [value if label in _WINDOWED_LABELS else None for label in labels]
    entries = list(cast("Sequence[object]", window))
    if len(entries) != len(labels):
        raise ValueError(
            f"sliding_window_tokens has {len(entries)} entries but layer_types has {len(labels)}"
        )
    windows: list[int | None] = []
    for i, entry in enumerate(entries):
        if entry is None:
            windows.append(None)
        elif isinstance(entry, bool) or not hasattr(type(entry), "__index__"):
            raise ValueError(f"sliding_window_tokens[{i}] must be None or an int, not {type(entry).__name__}")
        else:
            windows.append(as_int(entry, f"sliding_window_tokens[{i}]"))
    return windows


class _Layer(NamedTuple):
    """One validated layer: its label, its window (its chunk for a chunked layer; None for the
    others) and its group id."""

    label: str
    window: int | None
    group_id: str


def _grouped_layers(layer_types: object, sliding_window_tokens: object) -> list[_Layer]:
    """SPEC 2 per-layer grouping: validate labels and windows, then assign group ids.

    Checks run in this order: labels, the window argument's shape and entry types, then each
    layer's window (a sliding layer needs a positive one, a chunked layer a positive chunk; in
    sequence form a full or linear layer must not carry a positive one).
    """
    labels = _known_labels(layer_types)
    windows = _window_entries(sliding_window_tokens, labels)
    for i, (label, window) in enumerate(zip(labels, windows, strict=True)):
        if label == SLIDING_ATTENTION:
            if window is None or window <= 0:
                raise ValueError(
                    f"layer {i} (sliding_attention) needs a positive sliding window, got {window}"
                )
        elif label == CHUNKED_ATTENTION:
            if window is None or window <= 0:
                raise ValueError(
                    f"layer {i} (chunked_attention) needs a positive attention chunk in its window "
                    f"entry, got {window}"
                )
        elif window is not None and window > 0:
            raise ValueError(
                f"layer {i} is labelled {label} but carries sliding window {window}; mislabeled layer_type?"
            )
    # Full and linear layers get window None, whatever non-positive entry they carried.
    windows = [
        window if label in _WINDOWED_LABELS else None for label, window in zip(labels, windows, strict=True)
    ]
    # Several distinct windows (chunks) split the sliding (chunked) layers into one group per
    # window (chunk); each label is counted apart.
    several = {
        kind: len({w for label, w in zip(labels, windows, strict=True) if label == kind}) > 1
        for kind in _WINDOWED_LABELS
    }
    return [
        _Layer(label, window, f"{label}_{window}" if window is not None and several[label] else label)
        for label, window in zip(labels, windows, strict=True)
    ]


def layer_group_ids(layer_types: Sequence[str], sliding_window_tokens: WindowArg = None) -> list[str]:
    """SPEC 2: the group id of every layer.

    A sliding layer's id is ``f"sliding_attention_{window}"`` when the sliding layers carry more
    than one distinct window, else ``"sliding_attention"``; a chunked layer's is
    ``f"chunked_attention_{chunk}"`` when the chunked layers carry more than one distinct chunk,
    else ``"chunked_attention"``; other layers use their label.
    """
    return [layer.group_id for layer in _grouped_layers(layer_types, sliding_window_tokens)]


def group_specs_from_layer_types(
    layer_types: Sequence[str], sliding_window_tokens: WindowArg = None, *, page_size: int
) -> list[PagedCacheGroupSpec]:
    """SPEC 2: one spec per distinct group id, in first-appearance order.

    Each spec has ``rows_per_page = page_size``, ``entry_stride_tokens = 1``, the group's window
    (a chunked group's chunk; None for full and linear groups) and family ``state`` for
    linear-attention layers.
    """
    page_size = positive(page_size, "page_size")
    specs: dict[str, PagedCacheGroupSpec] = {}
    for layer in _grouped_layers(layer_types, sliding_window_tokens):
        if layer.group_id not in specs:
            row = layer_kind(layer.label)
            specs[layer.group_id] = PagedCacheGroupSpec(
                group_id=layer.group_id,
                retention=row.retention,
                rows_per_page=page_size,
                entry_stride_tokens=1,
                sliding_window_tokens=layer.window,
                family=row.family,
            )
    return list(specs.values())


# --- page counts and capture widths ------------------------------------------------------------


def _spec_geometry(spec: PagedCacheGroupSpec) -> tuple[int, int | None]:
    """A spec's ``raw`` tokens per page and its window (None unless sliding or chunked), checked.

    SPEC 2 errors, in this order: ``raw = rows_per_page * entry_stride_tokens`` (the exact signed
    product) must be > 0; a sliding or chunked spec needs a positive window (a chunked group is
    sized as a sliding window of ``W = C``); the retention must be known.
    """
    gid = spec.group_id
    rows = as_int(spec.rows_per_page, f"group {gid}: rows_per_page")
    stride = as_int(spec.entry_stride_tokens, f"group {gid}: entry_stride_tokens")
    raw = rows * stride
    if raw <= 0:
        raise ValueError(f"group {gid}: rows_per_page * entry_stride_tokens must be > 0, got {raw}")
    if spec.retention in _WINDOWED_RETENTIONS:
        window = spec.sliding_window_tokens
        if window is not None:
            window = as_int(window, f"group {gid}: sliding_window_tokens")
        if window is None or window <= 0:
            raise ValueError(
                f"group {gid}: {spec.retention} retention needs a positive sliding_window_tokens, "
                f"got {window}"
            )
        return raw, window
    if spec.retention != FULL_HISTORY:
        raise ValueError(f"group {gid}: unknown retention '{spec.retention}'")
    return raw, None


def _overlap_depth(value: object) -> int:
    """D, the overlap schedule depth: 0 or 1."""
    depth = as_int(value, "overlap_schedule_depth")
    if depth not in (0, 1):
        raise ValueError(f"overlap_schedule_depth must be 0 or 1, got {depth}")
    return depth


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
    """SPEC 2: pages each group needs, ``{group_id: pages}``.

    With ``protected = B * ceil(D*N / raw)`` (pages held back for the overlap horizon):

    - full history: ``ceil(T/raw) + B + protected + 1 + M`` (the 1 is the null page);
    - state (family ``state``, retention full_history): ``min(2*B + T // raw + protected + 1 + M,
      full-history count)``: two live pages per request plus snapshots, bounded by the page space;
    - sliding window: ``B * ceil(min(max(W-1, 0), C) / raw) + ceil(min(S, T) / raw) + B +
      protected + 1 + M``: resident history per request plus one step's scheduled tokens.
    - chunked window (retention ``chunked_window``): as a sliding window of ``W = C``, its chunk.

    Arguments are checked first (B, S, T, C, N, M must be >= 0; D in {0, 1}; D > 0 needs N > 0),
    then the specs in order.
    """
    b = non_negative(max_live_requests, "max_live_requests")
    s = non_negative(max_scheduled_tokens, "max_scheduled_tokens")
    t = non_negative(max_total_tokens, "max_total_tokens")
    c = non_negative(max_context_len, "max_context_len")
    n = non_negative(decode_input_tokens, "decode_input_tokens")
    m = non_negative(safety_margin, "safety_margin")
    d = _overlap_depth(overlap_schedule_depth)
    if d > 0 and n == 0:
        raise ValueError("overlap_schedule_depth > 0 needs decode_input_tokens > 0")

    counts: dict[str, int] = {}
    for spec in specs:
        raw, window = _spec_geometry(spec)
        protected = b * ceil_div(d * n, raw)
        if window is None:
            full = ceil_div(t, raw) + b + protected + 1 + m
            if spec.family == STATE:
                counts[spec.group_id] = min(2 * b + t // raw + protected + 1 + m, full)
            else:
                counts[spec.group_id] = full
        else:
            resident = min(max(window - 1, 0), c)
            counts[spec.group_id] = (
                b * ceil_div(resident, raw) + ceil_div(min(s, t), raw) + b + protected + 1 + m
            )
    return counts


def publish_paged_cache_groups(
    *,
    layer_types: Sequence[str],
    sliding_window_tokens: WindowArg,
    page_size: int,
    max_live_requests: int,
    max_scheduled_tokens: int,
    max_total_tokens: int,
    max_context_len: int,
) -> tuple[list[PagedCacheGroupSpec], dict[str, int]] | None:
    """SPEC 2 publication: ``(specs, counts)``, or None when the build flag is off (SPEC 10).

    Empty ``layer_types`` stands for one full-attention layer; a negative ``max_scheduled_tokens``
    counts as 0; N, D and M keep their defaults (1, 0, 0).
    """
    if not _build_flag():
        return None
    labels = layer_labels(layer_types) or [FULL_ATTENTION]
    specs = group_specs_from_layer_types(labels, sliding_window_tokens, page_size=page_size)
    counts = compute_paged_cache_group_page_counts(
        specs,
        max_live_requests=max_live_requests,
        max_scheduled_tokens=max(0, as_int(max_scheduled_tokens, "max_scheduled_tokens")),
        max_total_tokens=max_total_tokens,
        max_context_len=max_context_len,
    )
    return specs, counts


def compute_max_logical_pages_for_capture(
    spec: PagedCacheGroupSpec,
    *,
    max_context_len: int,
    max_tokens_per_req: int = 1,
    overlap_schedule_depth: int = 0,
) -> int:
    """SPEC 2 (and 12.1): the block-table width a CUDA-graph capture buffer needs for one group.

    With ``horizon = (D+1) * N``: sliding ``ceil((min(W, C) + horizon) / raw) + 1`` (chunked: the
    same with ``W`` its chunk); full history ``ceil((C + horizon) / raw)``.
    """
    c = non_negative(max_context_len, "max_context_len")
    n = positive(max_tokens_per_req, "max_tokens_per_req")
    d = _overlap_depth(overlap_schedule_depth)
    raw, window = _spec_geometry(spec)
    horizon = (d + 1) * n
    if window is None:
        return ceil_div(c + horizon, raw)
    return ceil_div(min(window, c) + horizon, raw) + 1


# --- slab pairing and scheduler validation ------------------------------------------------------


def hybrid_slab_group_size(
    layer_types: Sequence[str], *, sliding_window_tokens: WindowArg = None
) -> int | None:
    """SPEC 2 / 11: how many K/V slabs the layers can share, or None; never raises.

    The i-th layer of every label shares slab i, which needs at least two labels, no state
    labels, one group per label (so at most one distinct sliding window) and the same layer
    count for every label. Inputs the grouping rejects give None (SPEC 12.6: the predicate and
    the grouping agree), and so does a build without the flag (SPEC 10).
    """
    if not _build_flag():
        return None
    try:
        layers = _grouped_layers(layer_types, sliding_window_tokens)
    except Exception:  # any input the grouping refuses, including junk that breaks len() or iteration
        return None
    labels = Counter(layer.label for layer in layers)
    if len(labels) < 2 or any(label in STATE_LAYER_TYPES for label in labels):
        return None
    if len({layer.group_id for layer in layers}) != len(labels):  # several sliding windows
        return None
    sizes = set(labels.values())
    return sizes.pop() if len(sizes) == 1 else None


def _resolve_backend(attn_backend: object) -> object:
    """Follow ``full_attn_backend`` while it is not None (a cycle is a ConfigError)."""
    backend = attn_backend
    seen = {id(backend)}
    while (inner := getattr(backend, "full_attn_backend", None)) is not None:
        if id(inner) in seen:
            raise ConfigError("attn_backend full_attn_backend chain has a cycle")
        seen.add(id(inner))
        backend = inner
    return backend


def validate_flat_scheduler_config(
    *,
    flat_kvcache_ext: object,
    paged_cache_groups: Sequence[object] | None,
    attn_backend: object,
    kv_pool: object,
    speculative_algorithm: object = None,
) -> None:
    """SPEC 2: refuse scheduler configurations that would corrupt the flat KV cache.

    A no-op when ``flat_kvcache_ext`` is false or the build flag is off (SPEC 10). Otherwise the
    resolved backend's ``uses_paged_cache_groups`` (default False), ``uses_flat_cache_groups``
    (default False) and ``flat_spec_capable`` (default True) are checked, raising
    :class:`~flat_kvcache.errors.ConfigError` (a ``RuntimeError``) for the first problem in the
    contract's order.
    """
    if not flat_kvcache_ext or not _build_flag():
        return
    backend = _resolve_backend(attn_backend)
    uses_paged = bool(getattr(backend, "uses_paged_cache_groups", False))
    uses_flat = bool(getattr(backend, "uses_flat_cache_groups", False))
    spec_capable = bool(getattr(backend, "flat_spec_capable", True))
    b = type(backend).__name__
    p = type(kv_pool).__name__
    algorithm = str(speculative_algorithm) if speculative_algorithm else None

    if uses_paged and not uses_flat:
        raise ConfigError(
            f"flat KV cache: backend {b} uses paged cache groups but does not consume flat per-group "
            f"tables (kv_pool {p})"
        )
    if algorithm is not None and not spec_capable:
        raise ConfigError(
            f"flat KV cache: speculative algorithm {algorithm} needs a flat-spec-capable backend; "
            f"{b} is not (kv_pool {p})"
        )
    if algorithm is not None and algorithm.upper() == "DFLASH":
        raise ConfigError(
            f"flat KV cache: speculative algorithm DFLASH is not supported (backend {b}, kv_pool {p})"
        )
    num_groups = 0 if paged_cache_groups is None else len(paged_cache_groups)
    if num_groups > 1 and not uses_flat:
        raise ConfigError(
            f"flat KV cache: {num_groups} paged cache groups but backend {b} does not consume flat "
            "per-group tables; the single-table fallback would serve one group's pages to every layer "
            f"and silently corrupt KV (kv_pool {p})"
        )
    if num_groups == 0:
        raise ConfigError(
            "flat KV cache: at least one paged cache group is required; state-only pools publish none "
            f"(backend {b}, kv_pool {p})"
        )
