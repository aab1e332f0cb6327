"""SPEC 10: the ``flat`` build flag and the behaviour it gates, in whichever build is installed.

CI runs this file (``pytest -m flag``) against the default build and against a build with
``--no-default-features``; each test asserts the branch that matches ``FLAT_KVCACHE``. The
reference reads the same flag at call time, and is also checked in both states by patching it.
"""

from __future__ import annotations

from types import ModuleType

import flat_kvcache
import flat_kvcache.reference as reference
import flat_kvcache.reference.sizing as reference_sizing
import pytest
from flat_kvcache import _native
from flat_kvcache._types import PagedCacheGroupSpec
from helpers import publish

pytestmark = pytest.mark.flag

FULL, SLIDING = "full_attention", "sliding_attention"
FLAT = flat_kvcache.FLAT_KVCACHE


class PagedOnly:
    """A backend that would silently corrupt KV under the flat layout (SPEC 2 check 1)."""

    uses_paged_cache_groups = True


def validate_bad_config(api: ModuleType) -> None:
    api.validate_flat_scheduler_config(
        flat_kvcache_ext=True, paged_cache_groups=[], attn_backend=PagedOnly(), kv_pool=object()
    )


def check_flag_behaviour(api: ModuleType, flat: bool) -> None:
    """Every SPEC 10 behaviour of ``api`` when the build flag is ``flat``."""
    assert api.scheduler_ext_flat_kvcache() is flat
    if flat:
        # publication: sliding W=8, P=4, B=2, S=5, T=10, C=20: 2*ceil(7/4) + ceil(5/4) + 2 + 1 = 9;
        # full: ceil(10/4) + 2 + 1 = 6
        assert publish(api) == (
            [
                PagedCacheGroupSpec(SLIDING, "sliding_window", 4, 1, 8),
                PagedCacheGroupSpec(FULL, "full_history", 4, 1, None),
            ],
            {SLIDING: 9, FULL: 6},
        )
        assert api.hybrid_slab_group_size([SLIDING, FULL] * 3, sliding_window_tokens=8) == 3
        with pytest.raises(
            RuntimeError, match="uses paged cache groups but does not consume flat per-group tables"
        ):
            validate_bad_config(api)
    else:
        assert publish(api) is None
        assert publish(api, layer_types=[]) is None
        assert api.hybrid_slab_group_size([SLIDING, FULL] * 3, sliding_window_tokens=8) is None
        validate_bad_config(api)  # a no-op


def test_flag_is_a_bool_from_the_native_module() -> None:
    assert isinstance(flat_kvcache.FLAT_KVCACHE, bool)
    assert isinstance(_native.FLAT_KVCACHE, bool)
    assert flat_kvcache.FLAT_KVCACHE is _native.FLAT_KVCACHE
    assert "FLAT_KVCACHE" in flat_kvcache.__all__


def test_native_follows_its_build_flag() -> None:
    check_flag_behaviour(flat_kvcache, FLAT)


def test_reference_reads_the_native_flag() -> None:
    check_flag_behaviour(reference, FLAT)


@pytest.mark.parametrize("flat", [True, False], ids=["flat-on", "flat-off"])
def test_reference_in_both_flag_states(monkeypatch: pytest.MonkeyPatch, flat: bool) -> None:
    monkeypatch.setattr(reference_sizing, "_build_flag", lambda: flat)
    check_flag_behaviour(reference, flat)


@pytest.mark.parametrize("flat", [True, False], ids=["flat-on", "flat-off"])
def test_reference_reads_the_flag_at_call_time(monkeypatch: pytest.MonkeyPatch, flat: bool) -> None:
    monkeypatch.setattr(_native, "FLAT_KVCACHE", flat)
    assert reference.scheduler_ext_flat_kvcache() is flat
    assert (reference.hybrid_slab_group_size([SLIDING, FULL], sliding_window_tokens=8) is None) is not flat


def test_without_the_flag_nothing_is_validated() -> None:
    # with the flag off, publication returns None and slab pairing gives None before any check
    if FLAT:
        pytest.skip("the `flat` feature is on in this build")
    assert publish(flat_kvcache, page_size=0) is None
    assert flat_kvcache.hybrid_slab_group_size("junk") is None


def test_validation_is_off_when_the_extension_is_off() -> None:
    # flat_kvcache_ext=False is a no-op in either build
    for api in (flat_kvcache, reference):
        api.validate_flat_scheduler_config(
            flat_kvcache_ext=False, paged_cache_groups=[], attn_backend=PagedOnly(), kv_pool=object()
        )


def test_flag_independent_sizing_works_in_either_build() -> None:
    # grouping, page counts and capture widths do not depend on the flag
    specs = flat_kvcache.group_specs_from_layer_types([SLIDING, FULL], 8, page_size=4)
    assert flat_kvcache.compute_paged_cache_group_page_counts(
        specs, max_live_requests=2, max_scheduled_tokens=5, max_total_tokens=10, max_context_len=20
    ) == {SLIDING: 9, FULL: 6}
    assert flat_kvcache.compute_max_logical_pages_for_capture(specs[1], max_context_len=20) == 6  # ceil(21/4)
