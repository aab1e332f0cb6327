"""SPEC 2 sizing rules and every error of the contract (docs/sizing-api.md), by example.

Every test runs against both implementations (``api`` fixture: native and reference). The
expected numbers are worked out by hand from the SPEC formulas, with the working in comments.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import flat_kvcache
import numpy as np
import pytest
from flat_kvcache._types import PagedCacheGroupSpec
from helpers import publish

FULL, SLIDING, LINEAR = "full_attention", "sliding_attention", "linear_attention"
CHUNKED = "chunked_attention"
KNOWN = "expected one of full_attention, sliding_attention, linear_attention, chunked_attention"

SIZING_NAMES = {
    "CHUNKED_ATTENTION",
    "FULL_ATTENTION",
    "SLIDING_ATTENTION",
    "LINEAR_ATTENTION",
    "STATE_LAYER_TYPES",
    "PagedCacheGroupSpec",
    "scheduler_ext_flat_kvcache",
    "layer_group_ids",
    "group_specs_from_layer_types",
    "compute_paged_cache_group_page_counts",
    "publish_paged_cache_groups",
    "compute_max_logical_pages_for_capture",
    "hybrid_slab_group_size",
    "validate_flat_scheduler_config",
}


def full(gid: str = FULL, rows: int = 16, stride: int = 1) -> PagedCacheGroupSpec:
    return PagedCacheGroupSpec(gid, "full_history", rows, stride, None)


def state(gid: str = LINEAR, rows: int = 16, stride: int = 1) -> PagedCacheGroupSpec:
    return PagedCacheGroupSpec(gid, "full_history", rows, stride, None, "state")


def sliding(window: Any, gid: str = SLIDING, rows: int = 16, stride: int = 1) -> PagedCacheGroupSpec:
    return PagedCacheGroupSpec(gid, "sliding_window", rows, stride, window)


def counts(api: ModuleType, specs: list[PagedCacheGroupSpec], **kwargs: Any) -> dict[str, int]:
    args = {"max_live_requests": 0, "max_scheduled_tokens": 0, "max_total_tokens": 0, "max_context_len": 0}
    args.update(kwargs)
    result: dict[str, int] = api.compute_paged_cache_group_page_counts(specs, **args)
    return result


# --- surface ----------------------------------------------------------------------------------


def test_both_implementations_export_the_contract_names(api: ModuleType) -> None:
    assert set(api.sizing.__all__) == SIZING_NAMES
    for name in SIZING_NAMES:
        assert getattr(api, name) is getattr(api.sizing, name)


def test_constants(api: ModuleType) -> None:
    assert (api.FULL_ATTENTION, api.SLIDING_ATTENTION, api.LINEAR_ATTENTION) == (FULL, SLIDING, LINEAR)
    assert api.CHUNKED_ATTENTION == CHUNKED
    assert frozenset({LINEAR}) == api.STATE_LAYER_TYPES
    assert api.PagedCacheGroupSpec is PagedCacheGroupSpec
    assert PagedCacheGroupSpec("g", "full_history", 1, 1, None).family == "history"


def test_scheduler_ext_is_the_build_flag(api: ModuleType) -> None:
    assert api.scheduler_ext_flat_kvcache() is flat_kvcache._native.FLAT_KVCACHE


# --- layer_group_ids ---------------------------------------------------------------------------


def test_labels_map_to_their_own_group_ids(api: ModuleType) -> None:
    assert api.layer_group_ids([FULL, SLIDING, LINEAR, SLIDING], 64) == [FULL, SLIDING, LINEAR, SLIDING]
    assert api.layer_group_ids((FULL, LINEAR)) == [FULL, LINEAR]
    assert api.layer_group_ids([]) == []


def test_one_distinct_window_keeps_the_bare_label(api: ModuleType) -> None:
    assert api.layer_group_ids([SLIDING, FULL, SLIDING], [128, None, 128]) == [SLIDING, FULL, SLIDING]
    # non-positive entries on full/linear layers are ignored (they get None)
    assert api.layer_group_ids([SLIDING, FULL, LINEAR], [128, 0, -5]) == [SLIDING, FULL, LINEAR]


def test_several_windows_split_the_sliding_layers(api: ModuleType) -> None:
    ids = api.layer_group_ids([SLIDING, SLIDING, FULL, SLIDING], [128, 4096, None, 128])
    assert ids == ["sliding_attention_128", "sliding_attention_4096", FULL, "sliding_attention_128"]


def test_numpy_windows(api: ModuleType) -> None:
    # a 1-D array is a per-layer sequence, a 0-d array (or numpy scalar) an int
    ids = api.layer_group_ids([SLIDING, SLIDING, FULL], np.array([8, 16, 0]))
    assert ids == ["sliding_attention_8", "sliding_attention_16", FULL]
    assert api.layer_group_ids([SLIDING, FULL], np.array(8)) == [SLIDING, FULL]
    assert api.group_specs_from_layer_types([SLIDING], np.array([5]), page_size=4) == [
        PagedCacheGroupSpec(SLIDING, "sliding_window", 4, 1, 5)
    ]
    with pytest.raises(ValueError, match=r"^sliding_window_tokens has 1 entries but layer_types has 2$"):
        api.layer_group_ids([SLIDING, FULL], np.array([8]))


def test_int_window_is_broadcast_to_sliding_layers_only(api: ModuleType) -> None:
    # full/linear layers simply get None; a non-positive int is fine without sliding layers
    assert api.layer_group_ids([FULL, LINEAR], 0) == [FULL, LINEAR]
    assert api.layer_group_ids([FULL, LINEAR], -7) == [FULL, LINEAR]
    assert api.layer_group_ids([SLIDING, FULL], np.int64(32)) == [SLIDING, FULL]


@pytest.mark.parametrize(
    ("layer_types", "window", "error", "message"),
    [
        ("full_attention", None, ValueError, None),
        ([FULL, "mamba"], None, ValueError, f"unknown layer_type 'mamba' at layer 1; {KNOWN}"),
        (["Full_Attention"], None, ValueError, f"unknown layer_type 'Full_Attention' at layer 0; {KNOWN}"),
        (
            [SLIDING],
            "128",
            ValueError,
            "sliding_window_tokens must be None, an int or a per-layer sequence, not str",
        ),
        (
            [SLIDING],
            True,
            ValueError,
            "sliding_window_tokens must be None, an int or a per-layer sequence, not bool",
        ),
        (
            [SLIDING],
            12.0,
            ValueError,
            "sliding_window_tokens must be None, an int or a per-layer sequence, not float",
        ),
        (
            [SLIDING],
            {0: 12},
            ValueError,
            "sliding_window_tokens must be None, an int or a per-layer sequence, not dict",
        ),
        (
            [SLIDING, FULL, FULL],
            [8, None],
            ValueError,
            "sliding_window_tokens has 2 entries but layer_types has 3",
        ),
        ([SLIDING], [8, None], ValueError, "sliding_window_tokens has 2 entries but layer_types has 1"),
        (
            [FULL, SLIDING],
            [None, "8"],
            ValueError,
            "sliding_window_tokens[1] must be None or an int, not str",
        ),
        (
            [FULL, SLIDING],
            [None, True],
            ValueError,
            "sliding_window_tokens[1] must be None or an int, not bool",
        ),
        ([SLIDING], [8.0], ValueError, "sliding_window_tokens[0] must be None or an int, not float"),
        (
            [FULL, SLIDING],
            None,
            ValueError,
            "layer 1 (sliding_attention) needs a positive sliding window, got None",
        ),
        (
            [FULL, SLIDING],
            0,
            ValueError,
            "layer 1 (sliding_attention) needs a positive sliding window, got 0",
        ),
        ([SLIDING], [-3], ValueError, "layer 0 (sliding_attention) needs a positive sliding window, got -3"),
        (
            [SLIDING, SLIDING],
            [4, None],
            ValueError,
            "layer 1 (sliding_attention) needs a positive sliding window, got None",
        ),
        (
            [SLIDING, FULL],
            [8, 8],
            ValueError,
            "layer 1 is labelled full_attention but carries sliding window 8; mislabeled layer_type?",
        ),
        (
            [LINEAR],
            [1],
            ValueError,
            "layer 0 is labelled linear_attention but carries sliding window 1; mislabeled layer_type?",
        ),
    ],
)
def test_layer_group_ids_errors(
    api: ModuleType, layer_types: Any, window: Any, error: type[Exception], message: str | None
) -> None:
    with pytest.raises(error) as info:
        api.layer_group_ids(layer_types, window)
    if message is not None:
        assert str(info.value) == message


# --- group_specs_from_layer_types --------------------------------------------------------------


def test_group_specs_alternating_sliding_and_full(api: ModuleType) -> None:
    specs = api.group_specs_from_layer_types([SLIDING, FULL] * 12, 128, page_size=16)
    assert specs == [
        PagedCacheGroupSpec(SLIDING, "sliding_window", 16, 1, 128, "history"),
        PagedCacheGroupSpec(FULL, "full_history", 16, 1, None, "history"),
    ]


def test_group_specs_linear_layers_are_a_state_group(api: ModuleType) -> None:
    specs = api.group_specs_from_layer_types(([LINEAR] * 3 + [FULL]) * 12, page_size=64)
    assert specs == [
        PagedCacheGroupSpec(LINEAR, "full_history", 64, 1, None, "state"),
        PagedCacheGroupSpec(FULL, "full_history", 64, 1, None, "history"),
    ]


def test_group_specs_one_per_window_in_first_appearance_order(api: ModuleType) -> None:
    specs = api.group_specs_from_layer_types(
        [FULL, SLIDING, SLIDING, LINEAR, SLIDING], [None, 4096, 512, None, 4096], page_size=8
    )
    assert specs == [
        PagedCacheGroupSpec(FULL, "full_history", 8, 1, None, "history"),
        PagedCacheGroupSpec("sliding_attention_4096", "sliding_window", 8, 1, 4096, "history"),
        PagedCacheGroupSpec("sliding_attention_512", "sliding_window", 8, 1, 512, "history"),
        PagedCacheGroupSpec(LINEAR, "full_history", 8, 1, None, "state"),
    ]


def test_group_specs_take_numpy_ints(api: ModuleType) -> None:
    specs = api.group_specs_from_layer_types([SLIDING], [np.int32(5)], page_size=np.uint16(4))
    assert specs == [PagedCacheGroupSpec(SLIDING, "sliding_window", 4, 1, 5, "history")]
    assert type(specs[0].rows_per_page) is int
    assert type(specs[0].sliding_window_tokens) is int


def test_group_specs_of_no_layers(api: ModuleType) -> None:
    assert api.group_specs_from_layer_types([], page_size=16) == []


@pytest.mark.parametrize(
    ("page_size", "error", "message"),
    [
        (0, ValueError, "page_size must be > 0, got 0"),
        (-16, ValueError, "page_size must be > 0, got -16"),
        (True, TypeError, "page_size must be an int, not bool"),
        (16.0, TypeError, None),
        ("16", TypeError, None),
    ],
)
def test_group_specs_page_size_errors(
    api: ModuleType, page_size: Any, error: type[Exception], message: str | None
) -> None:
    with pytest.raises(error, match=r"^page_size must be") as info:
        api.group_specs_from_layer_types([FULL], page_size=page_size)
    if message is not None:
        assert str(info.value) == message


def test_group_specs_pass_on_grouping_errors(api: ModuleType) -> None:
    with pytest.raises(ValueError, match=r"^unknown layer_type 'x' at layer 0; "):
        api.group_specs_from_layer_types(["x"], page_size=16)
    with pytest.raises(ValueError, match=r"^layer 0 \(sliding_attention\) needs a positive sliding window"):
        api.group_specs_from_layer_types([SLIDING], page_size=16)


# --- compute_paged_cache_group_page_counts -----------------------------------------------------


def test_page_counts_worked_example(api: ModuleType) -> None:
    # B=4, S=100, T=1000, C=500, N=1, D=0, M=0, raw=16 -> protected = 4 * ceil(0/16) = 0
    # full:    ceil(1000/16)=63 + B 4 + 0 + 1 + 0                           = 68
    # sliding: B*ceil(min(127, 500)/16) = 4*8 = 32; ceil(min(100,1000)/16) = 7; 32+7+4+0+1 = 44
    # state:   min(2*4 + 1000//16=62 + 0 + 1 + 0 = 71, full 68)              = 68
    result = counts(
        api,
        [full(), sliding(128), state()],
        max_live_requests=4,
        max_scheduled_tokens=100,
        max_total_tokens=1000,
        max_context_len=500,
    )
    assert result == {FULL: 68, SLIDING: 44, LINEAR: 68}


def test_page_counts_state_formula_binds_without_requests(api: ModuleType) -> None:
    # B=0, T=1000, raw=16: full = ceil(1000/16)=63 + 0 + 0 + 1 = 64; state = 0 + 62 + 0 + 1 = 63
    result = counts(api, [full(), state()], max_total_tokens=1000)
    assert result == {FULL: 64, LINEAR: 63}


def test_page_counts_with_overlap_and_speculation(api: ModuleType) -> None:
    # raw = rows 1 * stride 2 = 2; B=5, S=7, T=9, C=4, N=3, D=1, M=2
    # protected = 5 * ceil(1*3/2) = 5*2 = 10
    # full:    ceil(9/2)=5 + 5 + 10 + 1 + 2                       = 23
    # sliding: W=6: 5*ceil(min(5, 4)/2)=5*2=10; ceil(min(7,9)/2)=4; 10+4+5+10+1+2 = 32
    # state:   min(2*5 + 9//2=4 + 10 + 1 + 2 = 27, 23)              = 23
    result = counts(
        api,
        [full(rows=1, stride=2), sliding(6, rows=1, stride=2), state(rows=1, stride=2)],
        max_live_requests=5,
        max_scheduled_tokens=7,
        max_total_tokens=9,
        max_context_len=4,
        decode_input_tokens=3,
        overlap_schedule_depth=1,
        safety_margin=2,
    )
    assert result == {FULL: 23, SLIDING: 32, LINEAR: 23}


def test_page_counts_sliding_window_edges(api: ModuleType) -> None:
    # W=1 keeps no history: 3*ceil(0/16)=0; ceil(min(20, 10)/16)=1; 0+1+3+0+1 = 5
    assert counts(
        api,
        [sliding(1)],
        max_live_requests=3,
        max_scheduled_tokens=20,
        max_total_tokens=10,
        max_context_len=100,
    ) == {SLIDING: 5}
    # C < W caps the resident history: 2*ceil(min(999, 50)/16)=2*4=8; S=0 -> 0; 8+0+2+0+1 = 11
    assert counts(api, [sliding(1000)], max_live_requests=2, max_total_tokens=10**6, max_context_len=50) == {
        SLIDING: 11
    }
    # W=17, P=16: the 16 tokens before the next one fit one page: 1*ceil(16/16)=1; +0 +1 +0 +1 = 3
    assert counts(api, [sliding(17)], max_live_requests=1, max_context_len=100) == {SLIDING: 3}


def test_page_counts_all_zero_is_one_null_page(api: ModuleType) -> None:
    assert counts(api, [full(), sliding(8), state()]) == {FULL: 1, SLIDING: 1, LINEAR: 1}
    assert counts(api, [full(), sliding(8)], safety_margin=5) == {FULL: 6, SLIDING: 6}
    assert counts(api, []) == {}


def test_page_counts_raw_is_the_signed_product(api: ModuleType) -> None:
    # rows -2 * stride -8 = raw 16 (accepted): ceil(32/16)=2 + B 1 + 0 + 1 = 4
    assert counts(api, [full(rows=-2, stride=-8)], max_live_requests=1, max_total_tokens=32) == {FULL: 4}


def test_page_counts_family_rules(api: ModuleType) -> None:
    # family "state" only changes full_history specs; an unknown family counts as history
    odd_family = PagedCacheGroupSpec("odd", "full_history", 16, 1, None, "weird")
    sliding_state = PagedCacheGroupSpec("ss", "sliding_window", 16, 1, 8, "state")
    result = counts(api, [odd_family, sliding_state], max_total_tokens=1000)
    # odd: ceil(1000/16)=63 + 1 = 64 (the full formula, not the state one: 63)
    # ss:  0*... + ceil(min(0, 1000)/16)=0 + 0 + 0 + 1 = 1
    assert result == {"odd": 64, "ss": 1}


def test_page_counts_full_history_ignores_the_window(api: ModuleType) -> None:
    spec = PagedCacheGroupSpec(FULL, "full_history", 16, 1, -5)
    assert counts(api, [spec], max_total_tokens=16) == {FULL: 2}


def test_page_counts_take_numpy_ints(api: ModuleType) -> None:
    result = counts(api, [full()], max_live_requests=np.int64(4), max_total_tokens=np.uint32(1000))
    assert result == {FULL: 68}
    assert type(result[FULL]) is int


@pytest.mark.parametrize(
    "name",
    [
        "max_live_requests",
        "max_scheduled_tokens",
        "max_total_tokens",
        "max_context_len",
        "decode_input_tokens",
        "safety_margin",
    ],
)
def test_page_counts_negative_arguments(api: ModuleType, name: str) -> None:
    with pytest.raises(ValueError) as info:
        counts(api, [full()], **{name: -1})
    assert str(info.value) == f"{name} must be >= 0, got -1"
    with pytest.raises(TypeError) as info_type:
        counts(api, [full()], **{name: True})
    assert str(info_type.value) == f"{name} must be an int, not bool"
    with pytest.raises(TypeError, match=f"^{name} must be an int"):
        counts(api, [full()], **{name: 1.0})


@pytest.mark.parametrize("depth", [2, -1, 10**30])
def test_page_counts_overlap_depth_is_0_or_1(api: ModuleType, depth: int) -> None:
    with pytest.raises(ValueError) as info:
        counts(api, [full()], overlap_schedule_depth=depth)
    assert str(info.value) == f"overlap_schedule_depth must be 0 or 1, got {depth}"


def test_page_counts_overlap_needs_decode_tokens(api: ModuleType) -> None:
    with pytest.raises(ValueError) as info:
        counts(api, [full()], overlap_schedule_depth=1, decode_input_tokens=0)
    assert str(info.value) == "overlap_schedule_depth > 0 needs decode_input_tokens > 0"
    # N=0 is fine without overlap
    assert counts(api, [full()], decode_input_tokens=0) == {FULL: 1}


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (full("g", rows=0), "group g: rows_per_page * entry_stride_tokens must be > 0, got 0"),
        (full("g", rows=16, stride=0), "group g: rows_per_page * entry_stride_tokens must be > 0, got 0"),
        (full("g", rows=-2, stride=3), "group g: rows_per_page * entry_stride_tokens must be > 0, got -6"),
        (
            sliding(None, "s"),
            "group s: sliding_window retention needs a positive sliding_window_tokens, got None",
        ),
        (sliding(0, "s"), "group s: sliding_window retention needs a positive sliding_window_tokens, got 0"),
        (
            sliding(-4, "s"),
            "group s: sliding_window retention needs a positive sliding_window_tokens, got -4",
        ),
        (PagedCacheGroupSpec("g", "bogus", 16, 1, None), "group g: unknown retention 'bogus'"),
        # raw is checked before the window and the retention
        (sliding(None, "s", rows=0), "group s: rows_per_page * entry_stride_tokens must be > 0, got 0"),
        (
            PagedCacheGroupSpec("g", "bogus", 0, 1, None),
            "group g: rows_per_page * entry_stride_tokens must be > 0, got 0",
        ),
    ],
)
def test_page_counts_spec_errors(api: ModuleType, spec: PagedCacheGroupSpec, message: str) -> None:
    with pytest.raises(ValueError) as info:
        counts(api, [full(), spec])
    assert str(info.value) == message


def test_page_counts_check_arguments_before_specs_and_specs_in_order(api: ModuleType) -> None:
    with pytest.raises(ValueError, match=r"^max_context_len must be >= 0, got -1$"):
        counts(api, [full("g", rows=0)], max_context_len=-1)
    with pytest.raises(ValueError, match=r"^group first: "):
        counts(api, [full("first", rows=0), sliding(None, "second")])


# --- publish_paged_cache_groups ------------------------------------------------------------------


def test_publish_specs_and_counts(flat_api: ModuleType) -> None:
    # P=4, B=2, S=5, T=10, C=20, N=1, D=0, M=0 -> protected 0
    # sliding W=8: 2*ceil(min(7, 20)/4)=2*2=4; ceil(min(5,10)/4)=2; 4+2+2+0+1 = 9
    # full:        ceil(10/4)=3 + 2 + 0 + 1                                  = 6
    specs, result = publish(flat_api)
    assert specs == [
        PagedCacheGroupSpec(SLIDING, "sliding_window", 4, 1, 8),
        PagedCacheGroupSpec(FULL, "full_history", 4, 1, None),
    ]
    assert result == {SLIDING: 9, FULL: 6}


def test_publish_clamps_negative_scheduled_tokens(flat_api: ModuleType) -> None:
    # S = max(0, -5) = 0: sliding 4 + ceil(0/4)=0 + 2 + 1 = 7
    _, result = publish(flat_api, max_scheduled_tokens=-5)
    assert result == {SLIDING: 7, FULL: 6}


def test_publish_empty_layer_types_is_one_full_layer(flat_api: ModuleType) -> None:
    specs, result = publish(flat_api, layer_types=[], sliding_window_tokens=None)
    assert specs == [PagedCacheGroupSpec(FULL, "full_history", 4, 1, None)]
    assert result == {FULL: 6}


def test_publish_passes_on_errors(flat_api: ModuleType) -> None:
    with pytest.raises(ValueError, match=r"^unknown layer_type 'x' at layer 0; "):
        publish(flat_api, layer_types=["x"])
    with pytest.raises(ValueError, match=r"^page_size must be > 0, got 0$"):
        publish(flat_api, page_size=0)
    with pytest.raises(ValueError, match=r"^max_live_requests must be >= 0, got -1$"):
        publish(flat_api, max_live_requests=-1)


# --- compute_max_logical_pages_for_capture -----------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "kwargs", "expected"),
    [
        # sliding: ceil((min(W, C) + (D+1)*N) / raw) + 1
        (sliding(128), {"max_context_len": 131072}, 10),  # ceil(129/16)=9, +1
        (sliding(128), {"max_context_len": 100, "max_tokens_per_req": 4, "overlap_schedule_depth": 1}, 8),
        # ceil((100 + 8)/16) = ceil(6.75) = 7, +1
        (sliding(1), {"max_context_len": 0}, 2),  # ceil((0 + 1)/16) = 1, +1
        (sliding(15), {"max_context_len": 1000}, 2),  # ceil(16/16) = 1, +1
        # full history: ceil((C + (D+1)*N) / raw)
        (full(), {"max_context_len": 131072}, 8193),  # ceil(131073/16)
        (full(), {"max_context_len": 131072, "max_tokens_per_req": 4, "overlap_schedule_depth": 1}, 8193),
        (full(), {"max_context_len": 131064, "max_tokens_per_req": 4, "overlap_schedule_depth": 1}, 8192),
        (full(), {"max_context_len": 0}, 1),
        (full(rows=4, stride=2), {"max_context_len": 15}, 2),  # raw 8: ceil(16/8)
        (full(rows=-4, stride=-2), {"max_context_len": 16}, 3),  # raw 8: ceil(17/8)
        (state(), {"max_context_len": 32, "max_tokens_per_req": 3}, 3),  # ceil(35/16)
    ],
)
def test_capture_width(
    api: ModuleType, spec: PagedCacheGroupSpec, kwargs: dict[str, int], expected: int
) -> None:
    assert api.compute_max_logical_pages_for_capture(spec, **kwargs) == expected


@pytest.mark.parametrize(
    ("spec", "kwargs", "error", "message"),
    [
        (full(), {"max_context_len": -1}, ValueError, "max_context_len must be >= 0, got -1"),
        (
            full(),
            {"max_context_len": 1, "max_tokens_per_req": 0},
            ValueError,
            "max_tokens_per_req must be > 0, got 0",
        ),
        (
            full(),
            {"max_context_len": 1, "max_tokens_per_req": -2},
            ValueError,
            "max_tokens_per_req must be > 0, got -2",
        ),
        (
            full(),
            {"max_context_len": 1, "overlap_schedule_depth": 2},
            ValueError,
            "overlap_schedule_depth must be 0 or 1, got 2",
        ),
        (
            full("g", rows=0),
            {"max_context_len": 1},
            ValueError,
            "group g: rows_per_page * entry_stride_tokens must be > 0, got 0",
        ),
        (
            sliding(0, "s"),
            {"max_context_len": 1},
            ValueError,
            "group s: sliding_window retention needs a positive sliding_window_tokens, got 0",
        ),
        (
            PagedCacheGroupSpec("g", "ring", 16, 1, None),
            {"max_context_len": 1},
            ValueError,
            "group g: unknown retention 'ring'",
        ),
        # order: C, N, D, then the spec
        (
            full("g", rows=0),
            {"max_context_len": -1, "max_tokens_per_req": 0},
            ValueError,
            "max_context_len must be >= 0, got -1",
        ),
        (
            full("g", rows=0),
            {"max_context_len": 1, "max_tokens_per_req": 0, "overlap_schedule_depth": 5},
            ValueError,
            "max_tokens_per_req must be > 0, got 0",
        ),
        (
            full("g", rows=0),
            {"max_context_len": 1, "overlap_schedule_depth": 5},
            ValueError,
            "overlap_schedule_depth must be 0 or 1, got 5",
        ),
        (full(), {"max_context_len": True}, TypeError, "max_context_len must be an int, not bool"),
    ],
)
def test_capture_width_errors(
    api: ModuleType, spec: PagedCacheGroupSpec, kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error) as info:
        api.compute_max_logical_pages_for_capture(spec, **kwargs)
    assert str(info.value) == message


# --- hybrid_slab_group_size ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("layer_types", "window", "expected"),
    [
        ([SLIDING, FULL] * 12, 128, 12),
        ([FULL, SLIDING, SLIDING, FULL], 64, 2),
        ([SLIDING, FULL, SLIDING, FULL], [8, None, 8, None], 2),  # one window, in sequence form
        ([SLIDING, FULL], np.array([8, 0]), 1),
        ([SLIDING, FULL], np.array([8, 8]), None),  # the full layer carries a window
        ([SLIDING, FULL], 2**200, 1),  # the window's size does not matter, only that it is one window
        ([SLIDING, SLIDING, FULL], 8, None),  # layer counts differ
        ([SLIDING, SLIDING, FULL, FULL], [8, 16, None, None], None),  # two windows
        ([FULL, LINEAR], None, None),  # a state label
        ([FULL, SLIDING, LINEAR], 8, None),
        ([FULL] * 4, None, None),  # one label
        ([SLIDING] * 4, 8, None),
        ([], None, None),
        # inputs the grouping rejects (SPEC 12.6: the predicate and the grouping agree)
        ([FULL, "mamba"], None, None),
        ([SLIDING, FULL], None, None),  # sliding layer without a window
        ([SLIDING, FULL], 0, None),
        ([SLIDING, FULL], [8, 8], None),  # full layer carrying a window
        ([SLIDING, FULL], [8], None),  # wrong length
        ([SLIDING, FULL], [8, "x"], None),
        ([SLIDING, FULL], [True, None], None),
        ([SLIDING, FULL], True, None),
        ([SLIDING, FULL], "8", None),
        ([SLIDING, FULL], 8.0, None),
        ("sliding_attention", 8, None),
    ],
)
def test_hybrid_slab_group_size(
    flat_api: ModuleType, layer_types: Any, window: Any, expected: int | None
) -> None:
    assert flat_api.hybrid_slab_group_size(layer_types, sliding_window_tokens=window) == expected


def test_hybrid_slab_group_size_never_raises_on_junk(flat_api: ModuleType) -> None:
    class Broken:
        def __len__(self) -> int:
            raise RuntimeError("boom")

        def __getitem__(self, index: int) -> str:
            raise RuntimeError("boom")

    for junk in [None, 5, object(), Broken(), [None], [1, 2], {"a": 1}, b"xy", [SLIDING, FULL, Broken()]]:
        assert flat_api.hybrid_slab_group_size(junk) is None
    for junk in [object(), Broken(), [None], [1, 2], {"a": 1}, b"xy", [Broken(), None], 1j]:
        assert flat_api.hybrid_slab_group_size([SLIDING, FULL], sliding_window_tokens=junk) is None


# --- validate_flat_scheduler_config ------------------------------------------------------------


class Pool:
    pass


class Plain:
    """Defaults: no paged groups, no flat tables, spec-capable."""


class PagedOnly:
    uses_paged_cache_groups = True


class Flat:
    uses_paged_cache_groups = True
    uses_flat_cache_groups = True


class FlatNoSpec(Flat):
    flat_spec_capable = False


class Wrapper:
    def __init__(self, inner: object) -> None:
        self.full_attn_backend = inner


def validate(api: ModuleType, backend: object, groups: Any, algorithm: Any = None, ext: Any = True) -> None:
    api.validate_flat_scheduler_config(
        flat_kvcache_ext=ext,
        paged_cache_groups=groups,
        attn_backend=backend,
        kv_pool=Pool(),
        speculative_algorithm=algorithm,
    )


MSG_PAGED = (
    "flat KV cache: backend {b} uses paged cache groups but does not consume flat per-group tables "
    "(kv_pool Pool)"
)
MSG_SPEC = (
    "flat KV cache: speculative algorithm {s} needs a flat-spec-capable backend; {b} is not (kv_pool Pool)"
)
MSG_DFLASH = "flat KV cache: speculative algorithm DFLASH is not supported (backend {b}, kv_pool Pool)"
MSG_MULTI = (
    "flat KV cache: {n} paged cache groups but backend {b} does not consume flat per-group tables; the "
    "single-table fallback would serve one group's pages to every layer and silently corrupt KV "
    "(kv_pool Pool)"
)
MSG_NONE = (
    "flat KV cache: at least one paged cache group is required; state-only pools publish none "
    "(backend {b}, kv_pool Pool)"
)


@pytest.mark.parametrize(
    ("backend", "groups", "algorithm", "message"),
    [
        (PagedOnly(), ["g"], None, MSG_PAGED.format(b="PagedOnly")),
        (Wrapper(Wrapper(PagedOnly())), ["g"], None, MSG_PAGED.format(b="PagedOnly")),
        (FlatNoSpec(), ["g"], "EAGLE", MSG_SPEC.format(s="EAGLE", b="FlatNoSpec")),
        (Flat(), ["g"], "dflash", MSG_DFLASH.format(b="Flat")),
        (Flat(), ["g"], "DFlash", MSG_DFLASH.format(b="Flat")),
        (Plain(), ["a", "b"], None, MSG_MULTI.format(n=2, b="Plain")),
        (Wrapper(Plain()), ("a", "b", "c"), None, MSG_MULTI.format(n=3, b="Plain")),
        (Flat(), [], None, MSG_NONE.format(b="Flat")),
        (Flat(), None, None, MSG_NONE.format(b="Flat")),
        (Plain(), [], "", MSG_NONE.format(b="Plain")),
        # order: (1) before (2) before (3) before (4) before (5)
        (
            type("PagedNoSpec", (PagedOnly,), {"flat_spec_capable": False})(),
            [],
            "DFLASH",
            MSG_PAGED.format(b="PagedNoSpec"),
        ),
        (FlatNoSpec(), [], "DFLASH", MSG_SPEC.format(s="DFLASH", b="FlatNoSpec")),
        (Plain(), ["a", "b"], "dflash", MSG_DFLASH.format(b="Plain")),
        (Plain(), ["a", "b"], "EAGLE", MSG_MULTI.format(n=2, b="Plain")),
    ],
)
def test_validation_errors(
    flat_api: ModuleType, backend: object, groups: Any, algorithm: Any, message: str
) -> None:
    with pytest.raises(RuntimeError) as info:
        validate(flat_api, backend, groups, algorithm)
    assert str(info.value) == message


def test_validation_accepts_good_configs(flat_api: ModuleType) -> None:
    validate(flat_api, Plain(), ["g"])  # one group: the single table is that group's
    validate(flat_api, Flat(), ["a", "b", "c"], "EAGLE")
    validate(flat_api, Wrapper(Flat()), ["a", "b"], "")
    validate(flat_api, Wrapper(None), ["g"])  # a None full_attn_backend ends the chain
    # a false flat_kvcache_ext turns validation off
    validate(flat_api, PagedOnly(), [], "DFLASH", ext=False)
    validate(flat_api, PagedOnly(), [], "DFLASH", ext=0)


def test_validation_names_the_algorithm_as_given(flat_api: ModuleType) -> None:
    class Algorithm:
        def __str__(self) -> str:
            return "NEXTN"

    with pytest.raises(RuntimeError) as info:
        validate(flat_api, FlatNoSpec(), ["g"], Algorithm())
    assert str(info.value) == MSG_SPEC.format(s="NEXTN", b="FlatNoSpec")


def test_validation_backend_cycle(flat_api: ModuleType) -> None:
    first, second = Wrapper(None), Wrapper(None)
    first.full_attn_backend, second.full_attn_backend = second, first
    with pytest.raises(RuntimeError, match=r"^attn_backend full_attn_backend chain has a cycle$"):
        validate(flat_api, first, ["g"])
    itself = Wrapper(None)
    itself.full_attn_backend = itself
    with pytest.raises(RuntimeError, match=r"^attn_backend full_attn_backend chain has a cycle$"):
        validate(flat_api, itself, ["g"])


# --- u64 limit: native raises OverflowError, the reference is exact ------------------------------


def is_native(api: ModuleType) -> bool:
    return api is flat_kvcache


def test_huge_inputs_whose_count_fits_are_exact(api: ModuleType) -> None:
    # SPEC 2: any int is accepted; T = 2**64 gives full = ceil(2**64/16) + 0 + 0 + 1 = 2**60 + 1
    assert counts(api, [full()], max_total_tokens=2**64) == {FULL: 2**60 + 1}
    # C = 2**64 is not used by a full-history group: 0 + 0 + 0 + 1
    assert counts(api, [full()], max_context_len=2**64) == {FULL: 1}


def test_a_result_beyond_u64_overflows_natively(api: ModuleType) -> None:
    # every input fits u64, the result does not: ceil((2**64-1)/1) + (2**64-1) + 0 + 1 = 2**65 - 1
    big = 2**64 - 1
    if is_native(api):
        with pytest.raises(OverflowError):
            counts(api, [full(rows=1)], max_live_requests=big, max_total_tokens=big)
    else:
        assert counts(api, [full(rows=1)], max_live_requests=big, max_total_tokens=big) == {FULL: 2**65 - 1}


def test_capture_width_at_the_top_of_u64(api: ModuleType) -> None:
    # C = 2**64 - 2, horizon 1: ceil((2**64 - 1)/1) = 2**64 - 1 fits u64 exactly
    assert api.compute_max_logical_pages_for_capture(full(rows=1), max_context_len=2**64 - 2) == 2**64 - 1
    # one more token does not
    if is_native(api):
        with pytest.raises(OverflowError):
            api.compute_max_logical_pages_for_capture(full(rows=1), max_context_len=2**64 - 1)
    else:
        assert api.compute_max_logical_pages_for_capture(full(rows=1), max_context_len=2**64 - 1) == 2**64


def test_huge_negative_arguments_are_value_errors(api: ModuleType) -> None:
    with pytest.raises(ValueError) as info:
        counts(api, [full()], max_live_requests=-(2**200))
    assert str(info.value) == f"max_live_requests must be >= 0, got {-(2**200)}"


# --- chunked local attention (SPEC 6: sized as a sliding window of W = C) -------------------------


def chunked(chunk: Any, gid: str = CHUNKED, rows: int = 16, stride: int = 1) -> PagedCacheGroupSpec:
    return PagedCacheGroupSpec(gid, "chunked_window", rows, stride, chunk)


def test_chunked_layers_take_their_chunk_from_the_window_entry(api: ModuleType) -> None:
    # One distinct chunk: the bare label; several: one group per chunk. Chunks and sliding
    # windows are counted apart: one chunk and one window keep both bare labels.
    assert api.layer_group_ids([CHUNKED, FULL, CHUNKED], [8192, None, 8192]) == [CHUNKED, FULL, CHUNKED]
    assert api.layer_group_ids([CHUNKED, FULL, CHUNKED], [8192, None, 4096]) == [
        "chunked_attention_8192",
        FULL,
        "chunked_attention_4096",
    ]
    assert api.layer_group_ids([CHUNKED, SLIDING], [8192, 128]) == [CHUNKED, SLIDING]
    assert api.layer_group_ids([CHUNKED, SLIDING, SLIDING], [64, 64, 128]) == [
        CHUNKED,
        "sliding_attention_64",
        "sliding_attention_128",
    ]
    # An int is broadcast to the sliding and the chunked layers.
    assert api.group_specs_from_layer_types([CHUNKED, FULL, SLIDING], 64, page_size=16) == [
        PagedCacheGroupSpec(CHUNKED, "chunked_window", 16, 1, 64, "history"),
        PagedCacheGroupSpec(FULL, "full_history", 16, 1, None, "history"),
        PagedCacheGroupSpec(SLIDING, "sliding_window", 16, 1, 64, "history"),
    ]


@pytest.mark.parametrize(
    ("layer_types", "window", "message"),
    [
        (
            [FULL, CHUNKED],
            None,
            "layer 1 (chunked_attention) needs a positive attention chunk in its window entry, got None",
        ),
        (
            [CHUNKED],
            [0],
            "layer 0 (chunked_attention) needs a positive attention chunk in its window entry, got 0",
        ),
        (
            [CHUNKED],
            -8,
            "layer 0 (chunked_attention) needs a positive attention chunk in its window entry, got -8",
        ),
        (
            [FULL, CHUNKED],
            [8, 8],
            "layer 0 is labelled full_attention but carries sliding window 8; mislabeled layer_type?",
        ),
    ],
)
def test_chunked_layer_errors(api: ModuleType, layer_types: list[str], window: Any, message: str) -> None:
    with pytest.raises(ValueError) as info:
        api.layer_group_ids(layer_types, window)
    assert str(info.value) == message


def test_chunked_page_counts_and_capture_widths_are_a_sliding_windows(api: ModuleType) -> None:
    # B=4, S=100, T=1000, C=500, raw=16, chunk 128 as W = 128:
    # B*ceil(min(127, 500)/16) = 32; ceil(100/16) = 7; 32 + 7 + 4 + 0 + 1 = 44 (as sliding(128)).
    args = {
        "max_live_requests": 4,
        "max_scheduled_tokens": 100,
        "max_total_tokens": 1000,
        "max_context_len": 500,
    }
    assert counts(api, [chunked(128), sliding(128, gid="s")], **args) == {CHUNKED: 44, "s": 44}
    # Capture: ceil((min(128, 131072) + 1) / 16) + 1 = 9 + 1.
    assert api.compute_max_logical_pages_for_capture(chunked(128), max_context_len=131072) == 10
    # A chunk past the context: min(W, C) = 100: ceil(101 / 16) + 1 = 8.
    assert api.compute_max_logical_pages_for_capture(chunked(8192), max_context_len=100) == 8
    for bad in (None, 0, -1):
        with pytest.raises(ValueError) as info:
            counts(api, [chunked(bad, gid="c")])
        assert (
            str(info.value)
            == f"group c: chunked_window retention needs a positive sliding_window_tokens, got {bad}"
        )


def test_chunked_layers_share_slabs_like_any_history_label(flat_api: ModuleType) -> None:
    assert flat_api.hybrid_slab_group_size([CHUNKED, FULL, CHUNKED, FULL], sliding_window_tokens=8192) == 2
    # Several chunks: more groups than labels.
    assert (
        flat_api.hybrid_slab_group_size(
            [CHUNKED, FULL, CHUNKED, FULL], sliding_window_tokens=[8, None, 16, None]
        )
        is None
    )
