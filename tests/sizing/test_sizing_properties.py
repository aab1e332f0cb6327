"""Hypothesis: the native sizing API agrees with the reference on random inputs (SPEC 2, 10).

Inputs range far past ``u64`` (SPEC 2: Python ints of any size are accepted). Native gives the
reference's result, or the same exception class and message; it raises ``OverflowError`` (naming
an argument) exactly when a count or width the reference computes does not fit ``u64``. Values a
result only hands back (a spec's page size or window) are returned exactly (see ``assert_exact``).
"""

from __future__ import annotations

import functools
from typing import Any

import flat_kvcache
import flat_kvcache.reference as reference
import pytest
from flat_kvcache._types import PagedCacheGroupSpec
from helpers import Outcome, assert_exact, fits_i32, ints_in, outcome
from hypothesis import example, given
from hypothesis import strategies as st
from strategies import U64_MAX, i32, mostly_valid, signed_sizes, wide_signed_sizes

pytestmark = pytest.mark.properties

FULL, SLIDING, LINEAR = "full_attention", "sliding_attention", "linear_attention"
CHUNKED = "chunked_attention"
LABELS = [FULL, SLIDING, LINEAR, CHUNKED]
#: Labels whose layers carry a window entry (a chunked layer's is its chunk).
WINDOWED = (SLIDING, CHUNKED)
COUNT_ARGS = [
    "max_live_requests",
    "max_scheduled_tokens",
    "max_total_tokens",
    "max_context_len",
    "decode_input_tokens",
    "overlap_schedule_depth",
    "safety_margin",
]
SPEC_FIELDS = ["rows_per_page", "entry_stride_tokens", "sliding_window_tokens"]
JUNK = ["8", "", True, False, 1.5, b"ab", {"w": 8}, object()]


# --- strategies ------------------------------------------------------------------------------------

known_layer_types = st.lists(st.sampled_from(LABELS), max_size=12)
any_layer_types = st.one_of(
    known_layer_types,
    st.lists(st.one_of(st.sampled_from(LABELS), st.text(max_size=6)), max_size=6),
    st.lists(st.sampled_from(LABELS), max_size=6).map(tuple),
)


FEW_WINDOWS = st.sampled_from([8, 16, 4096])
NOT_SLIDING_WINDOWS = st.sampled_from([None, 0, -1])
WINDOW_INTS = signed_sizes(small=64)
JUNK_VALUES = st.sampled_from(JUNK)
WINDOW_FORMS = st.integers(0, 7)
LENGTH_SLACK = st.integers(-2, 2)


@functools.cache
def window_entries(ints: st.SearchStrategy[int]) -> tuple[st.SearchStrategy[Any], ...]:
    """Strategies for per-layer window entries (None or an int), for the windows of sliding layers
    and for entries that may be junk; built once per ``ints``."""
    entry = st.one_of(st.none(), FEW_WINDOWS, ints)
    return entry, st.one_of(FEW_WINDOWS, ints), st.one_of(entry, JUNK_VALUES)


@st.composite
def layers_and_window(
    draw: st.DrawFn,
    layer_types: st.SearchStrategy[Any] = any_layer_types,
    ints: st.SearchStrategy[int] = WINDOW_INTS,
) -> tuple[Any, Any]:
    """Layer types and a window argument for them: None, an int, per-layer sequences (plausible,
    multi-window, random, wrong length, junk entries) or junk."""
    types = draw(layer_types)
    entry, sliding, entry_or_junk = window_entries(ints)
    form = draw(WINDOW_FORMS)
    window: Any
    if form == 0:
        window = None
    elif form == 1:
        window = draw(ints)
    elif form in (2, 3):  # a window on every sliding layer, as a list or a tuple
        window = [draw(sliding) if t in WINDOWED else draw(NOT_SLIDING_WINDOWS) for t in types]
        window = tuple(window) if form == 3 else window
    elif form == 4:
        window = [draw(entry) for _ in types]
    elif form == 5:  # maybe the wrong length
        window = [draw(entry) for _ in range(max(0, len(types) + draw(LENGTH_SLACK)))]
    elif form == 6:
        window = [draw(entry_or_junk) for _ in types]
    else:
        window = draw(JUNK_VALUES)
    return types, window


def spec_of(ints: st.SearchStrategy[int]) -> st.SearchStrategy[PagedCacheGroupSpec]:
    """Group specs with every retention (and an unknown one), odd and signed rows and strides."""
    return st.builds(
        PagedCacheGroupSpec,
        group_id=st.sampled_from(["g0", "g1", "g2", FULL, SLIDING, CHUNKED]),
        retention=st.sampled_from(
            ["full_history", "full_history", "sliding_window", "sliding_window", "chunked_window", "ring"]
        ),
        rows_per_page=st.one_of(st.integers(1, 64), ints),
        entry_stride_tokens=st.one_of(st.just(1), st.integers(1, 7), ints),
        sliding_window_tokens=st.one_of(st.none(), st.integers(1, 4096), ints),
        family=st.sampled_from(["history", "state"]),
    )


def specs_of(ints: st.SearchStrategy[int]) -> st.SearchStrategy[list[PagedCacheGroupSpec]]:
    return st.lists(spec_of(ints), max_size=4, unique_by=lambda s: s.group_id)


def count_args_of(ints: st.SearchStrategy[int]) -> st.SearchStrategy[dict[str, int]]:
    depth = st.one_of(st.sampled_from([0, 1]), ints)
    return st.fixed_dictionaries(
        {name: depth if name == "overlap_schedule_depth" else ints for name in COUNT_ARGS}
    )


i32_sizes = i32(low=-4)  # 32-bit ints, mostly non-negative


# --- properties ------------------------------------------------------------------------------------


@given(case=layers_and_window(ints=wide_signed_sizes()))
@example(case=([SLIDING, SLIDING, FULL], [8, 16, None]))
@example(case=([SLIDING, SLIDING], [2**64, 2**64 + 1]))
@example(case=([SLIDING, FULL], 2**64))
@example(case=([SLIDING, SLIDING], [2**200, 8]))
@example(case=([FULL], [2**64]))  # a huge window on a full layer: mislabeled
@example(case=([FULL], [-(2**200)]))  # ignored: full layers get None
@example(case=([SLIDING], [-(2**64)]))
@example(case=([], []))
@example(case=([FULL, "x'y"], None))
@example(case=("full_attention", None))
def test_layer_group_ids_agree(case: tuple[Any, Any]) -> None:
    layer_types, window = case
    native = outcome(lambda: flat_kvcache.layer_group_ids(layer_types, window))
    ref = outcome(lambda: reference.layer_group_ids(layer_types, window))
    assert_exact(native, ref, computed=[], names=[])


@given(case=layers_and_window(ints=wide_signed_sizes()), page_size=mostly_valid)
@example(case=([SLIDING, LINEAR, FULL], 128), page_size=16)
@example(case=([FULL], None), page_size=2**64)
@example(case=([], None), page_size=2**64)
@example(case=([], None), page_size=0)
@example(case=([SLIDING, SLIDING], [4, 2**70]), page_size=1)
def test_group_specs_agree(case: tuple[Any, Any], page_size: int) -> None:
    layer_types, window = case
    native = outcome(
        lambda: flat_kvcache.group_specs_from_layer_types(layer_types, window, page_size=page_size)
    )
    ref = outcome(lambda: reference.group_specs_from_layer_types(layer_types, window, page_size=page_size))
    assert_exact(native, ref, computed=[], names=[])


def check_page_counts(specs: list[PagedCacheGroupSpec], args: dict[str, int]) -> Outcome:
    """Native and reference page counts agree; returns the native outcome."""
    native = outcome(lambda: flat_kvcache.compute_paged_cache_group_page_counts(specs, **args))
    ref = outcome(lambda: reference.compute_paged_cache_group_page_counts(specs, **args))
    counts = [] if ref.value is None else list(ref.value.values())
    assert_exact(native, ref, computed=counts, names=COUNT_ARGS + SPEC_FIELDS)
    return native


ZEROS = dict.fromkeys(COUNT_ARGS, 0)


@given(specs=specs_of(wide_signed_sizes()), args=count_args_of(mostly_valid))
@example(  # C beyond u64 is not used by a full-history group
    specs=[PagedCacheGroupSpec("g", "full_history", 16, 1, None)],
    args=ZEROS | {"max_context_len": 2**64},
)
@example(  # C beyond u64 loses min(W - 1, C)
    specs=[PagedCacheGroupSpec("w", "sliding_window", 16, 1, 4096)],
    args=ZEROS | {"max_live_requests": 3, "max_scheduled_tokens": 100, "max_context_len": 2**200},
)
@example(  # W beyond u64 loses min(W - 1, C)
    specs=[PagedCacheGroupSpec("w", "sliding_window", 16, 1, 2**200)],
    args=ZEROS | {"max_live_requests": 3, "max_context_len": 4096},
)
@example(  # T beyond u64 loses min(S, T) and B = 0 drops the resident history
    specs=[PagedCacheGroupSpec("w", "sliding_window", 16, 1, 2**100)],
    args=ZEROS | {"max_scheduled_tokens": 64, "max_total_tokens": 2**200, "max_context_len": 2**200},
)
@example(  # S beyond u64 loses min(S, T)
    specs=[PagedCacheGroupSpec("w", "sliding_window", 16, 1, 8)],
    args=ZEROS | {"max_scheduled_tokens": 2**64 + 1, "max_total_tokens": 100},
)
@example(  # N beyond u64 with D = 0 is unused; with D = 1, B = 0 multiplies it by zero
    specs=[PagedCacheGroupSpec("g", "full_history", 16, 1, None)],
    args=ZEROS | {"decode_input_tokens": 2**200},
)
@example(
    specs=[PagedCacheGroupSpec("g", "full_history", 16, 1, None, "state")],
    args=ZEROS | {"decode_input_tokens": 2**200, "overlap_schedule_depth": 1},
)
@example(  # raw beyond u64 only divides
    specs=[PagedCacheGroupSpec("g", "full_history", 2**100, 2**100, None)],
    args=ZEROS | {"max_live_requests": 5, "max_total_tokens": 2**210, "decode_input_tokens": 2**199},
)
@example(  # the state formula is the smaller of two counts that both need T beyond u64
    specs=[PagedCacheGroupSpec("g", "full_history", 2**64, 1, None, "state")],
    args=ZEROS | {"max_live_requests": 2**62, "max_total_tokens": 2**130},
)
@example(  # M beyond u64 always reaches the count
    specs=[PagedCacheGroupSpec("g", "full_history", 16, 1, None)],
    args=ZEROS | {"safety_margin": 2**64},
)
@example(  # T = 2**64: ceil(2**64 / 16) + 1 fits
    specs=[PagedCacheGroupSpec("g", "full_history", 16, 1, None)],
    args=dict.fromkeys(COUNT_ARGS, 0) | {"max_total_tokens": 2**64},
)
@example(
    specs=[PagedCacheGroupSpec("g", "full_history", 1, 1, None)],
    args=dict.fromkeys(COUNT_ARGS, 0) | {"max_live_requests": U64_MAX, "max_total_tokens": U64_MAX},
)
@example(  # the state formula overflows while the full-history count it is capped by fits
    specs=[PagedCacheGroupSpec("g", "full_history", 1, 1, None, "state")],
    args=dict.fromkeys(COUNT_ARGS, 0) | {"max_live_requests": 2**62, "max_total_tokens": 2**63},
)
@example(  # raw beyond u64 with a later spec error
    specs=[
        PagedCacheGroupSpec("a", "full_history", 2**40, 2**40, None),
        PagedCacheGroupSpec("b", "ring", 1, 1, None),
    ],
    args=dict.fromkeys(COUNT_ARGS, 0),
)
@example(  # a negative raw beyond u64
    specs=[PagedCacheGroupSpec("a", "full_history", -(2**40), 2**40, None)],
    args=dict.fromkeys(COUNT_ARGS, 0),
)
@example(  # a huge window in a full-history spec is not used
    specs=[PagedCacheGroupSpec("a", "full_history", 16, 1, 2**200)],
    args=dict.fromkeys(COUNT_ARGS, 1) | {"overlap_schedule_depth": 0},
)
@example(
    specs=[PagedCacheGroupSpec("s", "sliding_window", 3, 5, 2**200)],
    args=dict.fromkeys(COUNT_ARGS, 1),
)
@example(
    specs=[PagedCacheGroupSpec("g", "full_history", 16, 1, None)],
    args=dict.fromkeys(COUNT_ARGS, 0) | {"decode_input_tokens": 0, "overlap_schedule_depth": 1},
)
@example(
    specs=[PagedCacheGroupSpec("g", "full_history", 16, 1, None)],
    args=dict.fromkeys(COUNT_ARGS, 0) | {"overlap_schedule_depth": 2**64},
)
@example(
    specs=[],
    args=dict.fromkeys(COUNT_ARGS, 0) | {"safety_margin": -(2**200)},
)
def test_page_counts_agree(specs: list[PagedCacheGroupSpec], args: dict[str, int]) -> None:
    check_page_counts(specs, args)


@given(specs=specs_of(i32()), args=count_args_of(i32_sizes))
@example(  # every input at the top of i32
    specs=[
        PagedCacheGroupSpec("s", "sliding_window", 1, 1, 2**31 - 1),
        PagedCacheGroupSpec("f", "full_history", 1, 1, None, "state"),
    ],
    args=dict.fromkeys(COUNT_ARGS, 2**31 - 1) | {"overlap_schedule_depth": 1},
)
def test_page_counts_never_overflow_on_32_bit_inputs(
    specs: list[PagedCacheGroupSpec], args: dict[str, int]
) -> None:
    assert fits_i32(specs, args)
    native = check_page_counts(specs, args)
    assert native.error is not OverflowError, native


def check_capture(spec: PagedCacheGroupSpec, c: int, n: int, d: int) -> Outcome:
    """Native and reference capture widths agree; returns the native outcome."""

    def call(api: Any) -> Any:
        return api.compute_max_logical_pages_for_capture(
            spec, max_context_len=c, max_tokens_per_req=n, overlap_schedule_depth=d
        )

    native, ref = outcome(lambda: call(flat_kvcache)), outcome(lambda: call(reference))
    names = ["max_context_len", "max_tokens_per_req", "overlap_schedule_depth", *SPEC_FIELDS]
    assert_exact(native, ref, computed=ints_in(ref.value), names=names)
    return native


capture_specs = spec_of(wide_signed_sizes())


@given(
    spec=capture_specs,
    c=mostly_valid,
    n=st.one_of(st.integers(1, 8), mostly_valid),
    d=st.one_of(st.sampled_from([0, 1]), signed_sizes()),
)
@example(spec=PagedCacheGroupSpec("g", "full_history", 1, 1, None), c=U64_MAX - 1, n=1, d=0)
@example(spec=PagedCacheGroupSpec("g", "full_history", 1, 1, None), c=U64_MAX, n=1, d=0)
@example(spec=PagedCacheGroupSpec("g", "full_history", 1, 1, None), c=0, n=2**63, d=1)
@example(spec=PagedCacheGroupSpec("s", "sliding_window", 1, 1, 2**200), c=5, n=1, d=0)
@example(spec=PagedCacheGroupSpec("s", "sliding_window", 1, 1, U64_MAX), c=U64_MAX, n=1, d=0)
@example(spec=PagedCacheGroupSpec("g", "full_history", 1, 1, None), c=-(2**200), n=1, d=0)
@example(spec=PagedCacheGroupSpec("s", "sliding_window", 16, 1, 8), c=2**64, n=1, d=0)  # C loses min(W, C)
@example(spec=PagedCacheGroupSpec("s", "sliding_window", 2**100, 1, 2**200), c=2**200, n=2**64, d=1)
@example(spec=PagedCacheGroupSpec("g", "full_history", 2**190, 2**10, None), c=2**200, n=2**199, d=1)
def test_capture_width_agrees(spec: PagedCacheGroupSpec, c: int, n: int, d: int) -> None:
    check_capture(spec, c, n, d)


@given(spec=spec_of(i32()), c=i32_sizes, n=i32_sizes, d=i32_sizes)
def test_capture_width_never_overflows_on_32_bit_inputs(
    spec: PagedCacheGroupSpec, c: int, n: int, d: int
) -> None:
    native = check_capture(spec, c, n, d)
    assert native.error is not OverflowError, native


def check_publish(layer_types: Any, window: Any, page_size: int, args: dict[str, int]) -> Outcome:
    """Native and reference publication agree; returns the native outcome."""

    def call(api: Any) -> Any:
        return api.publish_paged_cache_groups(
            layer_types=layer_types, sliding_window_tokens=window, page_size=page_size, **args
        )

    native, ref = outcome(lambda: call(flat_kvcache)), outcome(lambda: call(reference))
    counts = [] if ref.value is None else list(ref.value[1].values())
    assert_exact(native, ref, computed=counts, names=["page_size", *COUNT_ARGS, *SPEC_FIELDS])
    return native


publish_args = st.fixed_dictionaries(
    {
        "max_live_requests": mostly_valid,
        "max_scheduled_tokens": wide_signed_sizes(),
        "max_total_tokens": mostly_valid,
        "max_context_len": mostly_valid,
    }
)


@given(case=layers_and_window(ints=wide_signed_sizes()), page_size=mostly_valid, args=publish_args)
@example(  # a window beyond u64 is handed back exactly and loses min(W - 1, C)
    case=(["sliding_attention", "full_attention"], 2**64),
    page_size=16,
    args={"max_live_requests": 2, "max_scheduled_tokens": 5, "max_total_tokens": 10, "max_context_len": 20},
)
@example(  # a page size beyond u64 only divides
    case=(["full_attention"], None),
    page_size=2**100,
    args={
        "max_live_requests": 2,
        "max_scheduled_tokens": 5,
        "max_total_tokens": 2**90,
        "max_context_len": 20,
    },
)
@example(  # C beyond u64 for the stand-in full layer: unused
    case=([], None),
    page_size=16,
    args={"max_live_requests": 0, "max_scheduled_tokens": 0, "max_total_tokens": 0, "max_context_len": 2**64},
)
@example(
    case=([], None),
    page_size=16,
    args={
        "max_live_requests": 1,
        "max_scheduled_tokens": -(2**200),
        "max_total_tokens": 1,
        "max_context_len": 1,
    },
)
@example(
    case=([], []),  # empty layer_types stands for one full layer; the window then has the wrong length
    page_size=16,
    args={"max_live_requests": 1, "max_scheduled_tokens": 1, "max_total_tokens": 1, "max_context_len": 1},
)
def test_publish_agrees(case: tuple[Any, Any], page_size: int, args: dict[str, int]) -> None:
    layer_types, window = case
    check_publish(layer_types, window, page_size, args)


@given(case=layers_and_window(layer_types=known_layer_types, ints=i32_sizes), page_size=i32_sizes)
def test_publish_never_overflows_on_32_bit_inputs(case: tuple[Any, Any], page_size: int) -> None:
    layer_types, window = case
    args = {"max_live_requests": 2**31 - 1, "max_scheduled_tokens": 2**31 - 1}
    args |= {"max_total_tokens": 2**31 - 1, "max_context_len": 2**31 - 1}
    native = check_publish(layer_types, window, page_size, args)
    assert native.error is not OverflowError, native


@given(
    layer_types=st.one_of(
        any_layer_types, st.sampled_from([None, 5, "full_attention", b"xy", [1, 2], [None]])
    ),
    window=st.one_of(signed_sizes(), st.sampled_from([*JUNK, None, 1j])),
)
@example(layer_types=[SLIDING, FULL], window=2**200)
@example(layer_types=[SLIDING, FULL, SLIDING, FULL], window=U64_MAX + 1)
@example(layer_types=[SLIDING, FULL], window=-(2**200))
def test_hybrid_slab_group_size_agrees_and_never_raises(layer_types: Any, window: Any) -> None:
    native = outcome(lambda: flat_kvcache.hybrid_slab_group_size(layer_types, sliding_window_tokens=window))
    ref = outcome(lambda: reference.hybrid_slab_group_size(layer_types, sliding_window_tokens=window))
    assert native.error is None, native
    assert ref.error is None, ref
    assert native == ref


@given(case=layers_and_window())
@example(case=([SLIDING, FULL, SLIDING, FULL], [2**200, None, 2**200, None]))
@example(case=([SLIDING, FULL], [8, 2**200]))
def test_hybrid_slab_group_size_with_per_layer_windows(case: tuple[Any, Any]) -> None:
    layer_types, window = case
    native = outcome(lambda: flat_kvcache.hybrid_slab_group_size(layer_types, sliding_window_tokens=window))
    ref = outcome(lambda: reference.hybrid_slab_group_size(layer_types, sliding_window_tokens=window))
    assert native.error is None, native
    assert native == ref
    # SPEC 12.6: whatever the grouping rejects, the slab predicate rejects too
    if outcome(lambda: reference.layer_group_ids(layer_types, window)).error is not None:
        assert ref.value is None


# --- validation ------------------------------------------------------------------------------------


def make_backend(attrs: dict[str, bool | None], depth: int) -> object:
    """A backend class with the given attributes (None: absent), wrapped ``depth`` times."""
    cls = type("Backend", (), {key: value for key, value in attrs.items() if value is not None})
    backend: object = cls()
    for _ in range(depth):
        backend = type("Wrapper", (), {"full_attn_backend": backend})()
    return backend


flags = st.one_of(st.none(), st.booleans())
backends = st.builds(
    make_backend,
    st.fixed_dictionaries(
        {"uses_paged_cache_groups": flags, "uses_flat_cache_groups": flags, "flat_spec_capable": flags}
    ),
    st.integers(0, 2),
)


@given(
    ext=st.one_of(st.booleans(), st.sampled_from([0, 1, None])),
    backend=backends,
    groups=st.one_of(
        st.none(), st.lists(st.just("g"), max_size=3), st.lists(st.just("g"), max_size=3).map(tuple)
    ),
    algorithm=st.sampled_from([None, "", "EAGLE", "eagle3", "dflash", "DFLASH", "DFlash", "medusa", 0]),
)
def test_validation_agrees(ext: Any, backend: object, groups: Any, algorithm: Any) -> None:
    def call(api: Any) -> Any:
        return api.validate_flat_scheduler_config(
            flat_kvcache_ext=ext,
            paged_cache_groups=groups,
            attn_backend=backend,
            kv_pool=object(),
            speculative_algorithm=algorithm,
        )

    native, ref = outcome(lambda: call(flat_kvcache)), outcome(lambda: call(reference))
    assert native == ref, f"native {native}, reference {ref}"
