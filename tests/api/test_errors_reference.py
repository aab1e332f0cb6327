"""The reference raises the catchable classes of flat_kvcache.errors in real situations.

Each class must also be the builtin the same failure raised before the classes existed, so old
handlers (``except RuntimeError``, ``except KeyError``) keep catching it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flat_kvcache
import flat_kvcache.reference as ref
import pytest
from flat_kvcache import _native
from flat_kvcache.errors import (
    ConfigError,
    FlatKVCacheError,
    FlatUnavailableError,
    InvariantError,
    UnknownRequestError,
)


class _Backend:
    """A backend that uses paged cache groups but cannot read flat per-group tables."""

    uses_paged_cache_groups = True
    uses_flat_cache_groups = False


def _cache() -> ref.FlatKVCache:
    """A token-level cache whose request "a", in slot 0, holds page 1."""
    cache = ref.FlatKVCache([ref.KVCacheSpec("full", 4)], 8)
    assert cache.add_request("a", [1, 2, 3, 4]) == (0, 0)
    assert cache.schedule([0], [4]).tolist() == [True]
    return cache


def _page_cache() -> ref.PageCache:
    """A page-level cache whose request "a" holds page 1."""
    cache = ref.PageCache([ref.KVCacheSpec("full", 4)], 8)
    assert cache.acquire("a", 4)
    return cache


def test_the_classes_are_exported_from_the_package() -> None:
    for cls in (ConfigError, FlatKVCacheError, FlatUnavailableError, InvariantError, UnknownRequestError):
        assert getattr(flat_kvcache, cls.__name__) is cls
        assert cls.__name__ in flat_kvcache.__all__


def test_config_refusal_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ref.sizing, "_build_flag", lambda: True)
    with pytest.raises(ConfigError, match="does not consume flat per-group tables") as caught:
        ref.validate_flat_scheduler_config(
            flat_kvcache_ext=True, paged_cache_groups=[object()], attn_backend=_Backend(), kv_pool=object()
        )
    assert isinstance(caught.value, RuntimeError)
    assert isinstance(caught.value, FlatKVCacheError)


def test_a_backend_cycle_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ref.sizing, "_build_flag", lambda: True)

    class Looping:
        full_attn_backend: object = None

    first, second = Looping(), Looping()
    first.full_attn_backend, second.full_attn_backend = second, first
    with pytest.raises(ConfigError, match="has a cycle"):
        ref.validate_flat_scheduler_config(
            flat_kvcache_ext=True, paged_cache_groups=[object()], attn_backend=first, kv_pool=object()
        )


def test_block_tables_without_the_flat_feature(monkeypatch: pytest.MonkeyPatch) -> None:
    cache = _cache()
    monkeypatch.setattr(_native, "FLAT_KVCACHE", False)
    with pytest.raises(FlatUnavailableError, match="without the `flat` cargo feature") as caught:
        cache.block_tables([0])
    assert isinstance(caught.value, RuntimeError)
    assert isinstance(caught.value, FlatKVCacheError)
    assert not isinstance(caught.value, ConfigError)


def test_broken_bookkeeping_is_an_invariant_error() -> None:
    cache = _cache()
    cache.check_invariants()
    cache._pool._ref_counts[1] += 1  # a reference no table holds
    with pytest.raises(InvariantError, match="page 1 has ref count 2") as caught:
        cache.check_invariants()
    assert isinstance(caught.value, RuntimeError)
    assert isinstance(caught.value, FlatKVCacheError)


@pytest.mark.parametrize(
    ("make", "call", "message", "known"),
    [
        (_page_cache, lambda cache: cache.free("missing"), "unknown request id 'missing'", "a"),
        (_page_cache, lambda cache: cache.page_ids("missing"), "unknown request id 'missing'", "a"),
        (_page_cache, lambda cache: cache.reclaim("missing", 4), "unknown request id 'missing'", "a"),
        (_cache, lambda cache: cache.page_ids(1), "page_ids: slot 1 holds no request", 0),
        (_cache, lambda cache: cache.budget(1), "budget: slot 1 holds no request", 0),
        (_cache, lambda cache: cache.schedule([0, 1], [0, 1]), "schedule: slot 1 holds no request", 0),
        (_cache, lambda cache: cache.finish([7]), "finish: slot 7 holds no request", 0),
        (_cache, lambda cache: cache.id_of(3), "id_of: slot 3 holds no request", 0),
    ],
)
def test_an_unknown_request_is_an_unknown_request_error(
    make: Callable[[], Any], call: object, message: str, known: object
) -> None:
    cache = make()
    with pytest.raises(UnknownRequestError) as caught:
        call(cache)  # type: ignore[operator]
    assert caught.value.args == (message,)
    assert isinstance(caught.value, KeyError)
    assert isinstance(caught.value, FlatKVCacheError)
    # Nothing changed: the known request keeps its page.
    assert cache.page_ids(known) == [[1]]


def test_except_key_error_still_catches_an_unknown_id() -> None:
    cache = _page_cache()
    try:
        cache.free("missing")
    except KeyError as exc:
        assert exc.args == ("unknown request id 'missing'",)
    else:
        pytest.fail("free of an unknown request did not raise")


def test_reference_and_package_share_one_spec_class() -> None:
    assert ref.KVCacheSpec is flat_kvcache.KVCacheSpec
    assert ref.kv_cache_specs is flat_kvcache.kv_cache_specs
