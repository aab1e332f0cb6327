"""The native module raises the catchable classes of ``flat_kvcache.errors``.

Each class subclasses the builtin the same failure raised before the classes existed, so callers
that catch ``KeyError`` or ``RuntimeError`` keep working, and ``FlatKVCacheError`` catches all
of them. Only the native engine is exercised here.
"""

from __future__ import annotations

import flat_kvcache
import flat_kvcache.errors as errors
import numpy as np
import pytest
from flat_kvcache import _native
from flat_kvcache.engine import KVCacheSpec
from flat_kvcache.errors import (
    ConfigError,
    FlatKVCacheError,
    FlatUnavailableError,
    InvariantError,
    UnknownRequestError,
)

FULL, SLIDING = "full_attention", "sliding_attention"


def hybrid_cache() -> _native.FlatKVCache:
    """A full and a sliding-window group of 4-token pages over a 32-page pool."""
    specs = [KVCacheSpec("full", 4, group_id="full"), KVCacheSpec("sliding_window", 4, 8, "swa")]
    return _native.FlatKVCache(specs, 32)


def hybrid_page_cache() -> _native.PageCache:
    """:func:`hybrid_cache` as a page-level cache."""
    specs = [KVCacheSpec("full", 4, group_id="full"), KVCacheSpec("sliding_window", 4, 8, "swa")]
    return _native.PageCache(specs, 32)


class PagedOnly:
    """A backend that reads paged cache groups but not flat per-group tables (SPEC 2, check 1)."""

    uses_paged_cache_groups = True


def test_every_class_is_exported_and_derives_from_its_builtin() -> None:
    assert set(errors.__all__) == {
        "ConfigError",
        "FlatKVCacheError",
        "FlatUnavailableError",
        "InvariantError",
        "ModelConfigError",
        "UnknownRequestError",
    }
    assert issubclass(FlatKVCacheError, Exception)
    # A model config the family table cannot read: a ConfigError, and a ValueError as config
    # errors were before the class existed.
    assert issubclass(errors.ModelConfigError, ConfigError)
    assert issubclass(errors.ModelConfigError, ValueError)
    for cls in (ConfigError, FlatUnavailableError, InvariantError):
        assert issubclass(cls, RuntimeError)
        assert issubclass(cls, FlatKVCacheError)
    assert issubclass(UnknownRequestError, KeyError)
    assert issubclass(UnknownRequestError, FlatKVCacheError)


def test_invariant_error_is_a_runtime_error_and_a_healthy_cache_raises_none() -> None:
    # check_invariants cannot be broken from Python; it raises InvariantError, which an
    # `except RuntimeError` written before the class existed still catches.
    cache = hybrid_cache()
    slot, hit = cache.add_request("a", list(range(10)))
    assert (slot, hit) == (0, 0)
    assert cache.schedule([slot], [10]).tolist() == [True]
    cache.check_invariants()
    with pytest.raises(RuntimeError) as caught:
        raise InvariantError("invariant violated: example")
    assert isinstance(caught.value, FlatKVCacheError)


@pytest.mark.parametrize(
    "slot", [1, 7, 2**64 - 1, np.uint64(3)], ids=["next", "small", "u64-max", "np-uint64"]
)
def test_a_free_slot_on_a_token_level_call(slot: int) -> None:
    cache = hybrid_cache()
    assert cache.add_request("a", [1, 2, 3]) == (0, 0)
    with pytest.raises(UnknownRequestError) as caught:
        cache.num_tokens(slot)
    assert isinstance(caught.value, KeyError)
    assert isinstance(caught.value, FlatKVCacheError)
    assert caught.value.args == (f"num_tokens: slot {int(slot)} holds no request",)


@pytest.mark.parametrize("req", ["missing", 7, 2**70], ids=["str", "int", "big-int"])
def test_an_unknown_id_has_no_slot(req: str | int) -> None:
    """Ids only enter a token-level cache; looking one up is ``slot_of``, None when unknown."""
    cache = hybrid_cache()
    assert cache.slot_of(req) is None
    slot, _ = cache.add_request(req, [1, 2])
    assert cache.slot_of(req) == slot == 0 and cache.id_of(slot) == req
    cache.finish([slot])
    assert cache.slot_of(req) is None
    with pytest.raises(UnknownRequestError) as caught:
        cache.id_of(slot)
    assert caught.value.args == ("id_of: slot 0 holds no request",)


def test_unknown_request_on_a_page_level_call() -> None:
    cache = hybrid_page_cache()
    assert cache.acquire("known", 4)  # page-level calls create ids, so one live id is not enough
    for call in (lambda: cache.page_ids("other"), lambda: cache.reclaim("other", 0), lambda: cache.free(3)):
        with pytest.raises(UnknownRequestError) as caught:
            call()
        assert isinstance(caught.value, KeyError)
        assert isinstance(caught.value, FlatKVCacheError)
    assert cache.page_ids("known") == [[1], [2]]  # nothing changed for the live request


def test_a_free_slot_in_a_slot_array_is_still_caught_as_key_error() -> None:
    cache = hybrid_cache()
    assert cache.add_request("a", [1, 2, 3]) == (0, 0)
    try:
        cache.schedule([0, 5], np.array([1, 1]))
    except KeyError as err:  # the way callers caught it before the class existed
        assert isinstance(err, UnknownRequestError)
        assert err.args == ("schedule: slot 5 holds no request",)
    else:
        pytest.fail("a free slot in a slot array must raise")
    assert cache.num_computed_tokens(0) == 0  # validated first: nothing was scheduled


def test_a_refused_scheduler_config_is_a_config_error() -> None:
    if not flat_kvcache.FLAT_KVCACHE:
        pytest.skip("without the `flat` feature the check is a no-op")
    with pytest.raises(ConfigError, match="does not consume flat per-group tables") as caught:
        _native.validate_flat_scheduler_config(
            flat_kvcache_ext=True, paged_cache_groups=[], attn_backend=PagedOnly(), kv_pool=object()
        )
    assert isinstance(caught.value, RuntimeError)
    assert isinstance(caught.value, FlatKVCacheError)


def test_argument_errors_stay_plain_builtins() -> None:
    cache = hybrid_cache()
    for bad in (1.5, True, "0"):
        with pytest.raises(TypeError, match="slot") as type_error:
            cache.num_tokens(bad)  # type: ignore[arg-type]
        assert not isinstance(type_error.value, FlatKVCacheError)
    with pytest.raises(ValueError) as value_error:
        cache.pages_needed(-1)
    assert not isinstance(value_error.value, FlatKVCacheError)
    with pytest.raises(ValueError, match=r"slots\[0\]") as negative_slot:
        cache.finish([-1])
    assert not isinstance(negative_slot.value, FlatKVCacheError)
    with pytest.raises(OverflowError, match="slot") as huge_slot:
        cache.page_ids(2**64)
    assert not isinstance(huge_slot.value, FlatKVCacheError)


@pytest.mark.flag
def test_block_tables_without_the_flag_is_a_flat_unavailable_error() -> None:
    if flat_kvcache.FLAT_KVCACHE:
        pytest.skip("the `flat` feature is on in this build")
    cache = hybrid_page_cache()
    assert cache.acquire("a", 4)
    with pytest.raises(FlatUnavailableError) as caught:
        cache.block_tables(["a"])
    assert isinstance(caught.value, RuntimeError)
    assert isinstance(caught.value, FlatKVCacheError)
    out = {"full": np.zeros((1, 4), np.int32), "swa": np.zeros((1, 4), np.int32)}
    with pytest.raises(FlatUnavailableError):
        cache.block_tables(["a"], out=out)
    token_cache = hybrid_cache()
    slot, _ = token_cache.add_request("a", [1, 2, 3])
    assert token_cache.schedule([slot], [3]).tolist() == [True]
    with pytest.raises(FlatUnavailableError):
        token_cache.block_tables([slot])
    with pytest.raises(FlatUnavailableError):
        token_cache.block_tables([slot], out=out)
