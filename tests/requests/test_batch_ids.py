"""Id-addressed batch calls when the same id objects come back step after step.

``schedule_batch`` and ``append_tokens_batch`` are called once per step with the running
requests' ids, mostly the very same objects in the same order. The native engine remembers
the objects of the last batch and what they resolved to; these cases check that nothing a
scheduler can do to its ids (finish and re-add one, reorder, repeat, pass equal but distinct
strings, subclasses, numpy ints, ids whose ``__index__`` calls back into the cache) makes a
batch act on another request than the one its id names. Each runs on both implementations
(the ``api`` fixture) against values worked out from the contract; messages must match.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np
import pytest
from flat_kvcache import UnknownRequestError


def cache_of(api: ModuleType, num_pages: int = 64) -> Any:
    """One full-attention group, P = 4."""
    return api.FlatKVCache([api.KVCacheSpec("full", 4)], num_pages)


def computed(cache: Any, reqs: list[Any]) -> list[int]:
    return [cache.num_computed_tokens(r) for r in reqs]


def test_reordered_and_repeated_ids_schedule_their_own_requests(api: ModuleType) -> None:
    cache = cache_of(api)
    a, b, c = "alpha", "beta", 7
    for req in (a, b, c):
        cache.add_request(req, list(range(40)))
    assert cache.schedule_batch([a, b, c], [1, 2, 3]).all()
    assert computed(cache, [a, b, c]) == [1, 2, 3]
    # Same objects, other positions: each request moves by its own count.
    assert cache.schedule_batch([c, a, b], [10, 20, 30]).all()
    assert computed(cache, [a, b, c]) == [21, 32, 13]
    # A repeated id asks twice.
    assert cache.schedule_batch([b, b, a], [1, 1, 1]).all()
    assert computed(cache, [a, b, c]) == [22, 34, 13]
    # A shorter batch, then the full one again.
    assert cache.schedule_batch([a], [1]).all()
    assert cache.schedule_batch([a, b, c], [1, 1, 1]).all()
    assert computed(cache, [a, b, c]) == [24, 35, 14]
    cache.check_invariants()


def test_an_id_finished_and_added_again_names_the_new_request(api: ModuleType) -> None:
    """The same id object outlives its request: a batch after ``finish`` and a new
    ``add_request`` with that object acts on the new request, wherever it was placed."""
    cache = cache_of(api)
    a, b = "req-a", "req-b"
    cache.add_request(a, list(range(20)))
    cache.add_request(b, list(range(100, 120)))
    assert cache.schedule_batch([a, b], [8, 8]).all()
    cache.finish(a)
    # Another request takes a's old place first; a comes back with a different prompt.
    cache.add_request("filler", list(range(200, 203)))
    cache.add_request(a, list(range(300, 305)))
    assert cache.schedule_batch([a, b], [2, 1]).all()
    assert computed(cache, [a, b, "filler"]) == [2, 9, 0]
    cache.append_tokens_batch([a, b], [1, 2])
    assert (cache.num_tokens(a), cache.num_tokens(b)) == (6, 21)
    # Finished and not added again: the id is unknown, named in the message.
    cache.finish(a)
    with pytest.raises(KeyError) as schedule_error:
        cache.schedule_batch([b, a], [1, 1])
    with pytest.raises(KeyError) as append_error:
        cache.append_tokens_batch([b, a], [1, 1])
    for info in (schedule_error, append_error):
        assert type(info.value).__name__ == UnknownRequestError.__name__
    assert "req-a" in str(schedule_error.value) and "req-a" in str(append_error.value)
    # Nothing moved: a refused batch changes nothing.
    assert computed(cache, [b]) == [9]
    assert cache.num_tokens(b) == 21
    cache.check_invariants()


def test_preempted_id_readded_continues_with_its_tokens(api: ModuleType) -> None:
    cache = cache_of(api)
    a, b = "x", "y"
    cache.add_request(a, [1, 2, 3])
    cache.add_request(b, [4, 5, 6])
    assert cache.schedule_batch([a, b], [3, 3]).all()
    cache.append_tokens_batch([a, b], [10, 20])
    tokens = cache.preempt(a)
    assert tokens == [1, 2, 3, 10]
    cache.add_request(a, tokens)
    assert cache.schedule_batch([a, b], [4, 1]).all()
    cache.append_tokens_batch([a, b], [11, 21])
    assert (cache.num_tokens(a), cache.num_tokens(b)) == (5, 5)
    assert computed(cache, [a, b]) == [4, 4]


def test_equal_ids_of_other_types_and_objects_name_the_same_request(api: ModuleType) -> None:
    """A fresh but equal str, a str subclass, a numpy int and a huge int name the request
    their value names, whether or not the last batch held another object for it."""

    class Name(str):
        pass

    cache = cache_of(api)
    huge = 2**70 + 5
    cache.add_request("req-1", list(range(30)))
    cache.add_request(12, list(range(30)))
    cache.add_request(huge, list(range(30)))
    assert cache.schedule_batch(["req-1", 12, huge], [1, 1, 1]).all()
    fresh = "".join(["req", "-", "1"])
    assert cache.schedule_batch([fresh, np.int64(12), int(str(huge))], [1, 2, 3]).all()
    assert cache.schedule_batch([Name("req-1"), np.int32(12), huge], [1, 1, 1]).all()
    # A tuple and a generator too (the latter is parsed id by id).
    assert cache.schedule_batch(("req-1", 12, huge), [1, 1, 1]).all()
    assert cache.schedule_batch((r for r in ["req-1", 12, huge]), [1, 1, 1]).all()
    assert computed(cache, ["req-1", 12, huge]) == [5, 6, 7]
    # "12" (str) is another request than 12 (int).
    with pytest.raises(KeyError):
        cache.schedule_batch(["12"], [1])


def test_errors_come_in_batch_order_with_the_same_messages(api: ModuleType) -> None:
    """Ids resolved from the last batch report errors exactly as ids looked up afresh."""
    cache = cache_of(api)
    a, b = "first", "second"
    cache.add_request(a, list(range(8)))
    cache.add_request(b, list(range(8)))
    assert cache.schedule_batch([a, b], [1, 1]).all()
    messages = []
    for reqs, ns in [
        ([a, b], [1, 8]),  # too many tokens for b
        ([a, "nope"], [1, 1]),  # unknown after a known one
        ([b, a], [7, 8]),  # too many for a, counted after b's
    ]:
        with pytest.raises((ValueError, KeyError)) as info:
            cache.schedule_batch(reqs, ns)
        messages.append((type(info.value).__name__, str(info.value)))
    with pytest.raises(KeyError) as append_info:
        cache.append_tokens_batch([a, "nope"], [1, 1])
    messages.append((type(append_info.value).__name__, str(append_info.value)))
    assert computed(cache, [a, b]) == [1, 1]
    kinds = [kind for kind, _ in messages]
    assert kinds == ["ValueError", "UnknownRequestError", "ValueError", "UnknownRequestError"]
    assert "'second'" in messages[0][1] and "'nope'" in messages[1][1]
    assert "'first'" in messages[2][1] and "'nope'" in messages[3][1]
    # The same messages from a cache that never saw these objects in a batch before.
    other = cache_of(api)
    for req in ("".join(["fir", "st"]), "".join(["sec", "ond"])):
        other.add_request(req, list(range(8)))
    assert other.schedule_batch(["".join(["fir", "st"]), "".join(["sec", "ond"])], [1, 1]).all()
    with pytest.raises(ValueError) as fresh:
        other.schedule_batch(["".join(["fir", "st"]), "".join(["sec", "ond"])], [1, 8])
    assert str(fresh.value) == messages[0][1]


def test_an_id_whose_index_calls_back_into_the_cache(api: ModuleType) -> None:
    """Parsing an id may run Python code (``__index__``) that uses the same cache: no
    deadlock, and both batches act on the requests their ids name."""
    cache = cache_of(api)
    cache.add_request(1, list(range(30)))
    cache.add_request(2, list(range(30)))

    class Reentrant:
        calls = 0

        def __index__(self) -> int:
            Reentrant.calls += 1
            assert cache.schedule_batch([1], [1]).all()
            return 2

    assert cache.schedule_batch([1, 2], [1, 1]).all()
    assert cache.schedule_batch([1, Reentrant()], [2, 3]).all()
    assert Reentrant.calls == 1
    assert computed(cache, [1, 2]) == [4, 4]
    cache.append_tokens_batch([Reentrant(), 1], [5, 6])
    assert Reentrant.calls == 2
    assert computed(cache, [1, 2]) == [5, 4]
    assert (cache.num_tokens(1), cache.num_tokens(2)) == (31, 31)
    cache.check_invariants()


def test_a_bad_id_in_a_batch_is_refused_and_changes_nothing(api: ModuleType) -> None:
    cache = cache_of(api)
    cache.add_request("a", list(range(10)))
    assert cache.schedule_batch(["a"], [1]).all()
    for bad in (1.5, None, True, b"a"):
        with pytest.raises(TypeError):
            cache.schedule_batch(["a", bad], [1, 1])
        with pytest.raises(TypeError):
            cache.append_tokens_batch(["a", bad], [1, 1])
    with pytest.raises(TypeError):
        cache.schedule_batch("a", [1])
    assert computed(cache, ["a"]) == [1]
    assert cache.num_tokens("a") == 10


@pytest.mark.parametrize(
    "req",
    [
        "r" * 200,
        "it's " + "x" * 100,
        "both ' and \" quotes" * 10,
        "é" * 81,
        "e" * 80,
        2**300,
        -(2**300),
        -(2**63),
    ],
    ids=["long", "quote", "both-quotes", "non-ascii", "exactly-80", "huge", "huge-negative", "i64-min"],
)
def test_long_ids_are_shown_alike_by_both_engines(req: Any) -> None:
    """Messages show a request id as ``repr`` of its first 80 characters (or digits), then
    ``...`` when cut: the same text from the native engine and the reference."""
    import flat_kvcache
    import flat_kvcache.reference

    def messages(api: ModuleType) -> list[str]:
        cache = cache_of(api)
        out: list[str] = []
        unknown_calls: list[Callable[[], object]] = [
            lambda: cache.schedule_batch([req], [1]),
            lambda: cache.num_tokens(req),
        ]
        for call in unknown_calls:
            with pytest.raises(KeyError) as unknown:
                call()
            out.append(unknown.value.args[0])
        cache.add_request(req, [1, 2, 3])
        invalid_calls: list[Callable[[], object]] = [
            lambda: cache.add_request(req, [1]),
            lambda: cache.schedule_batch([req], [4]),
        ]
        for call in invalid_calls:
            with pytest.raises(ValueError) as invalid:
                call()
            out.append(str(invalid.value))
        # The page-level protocol: unknown, then a claim on tables that already hold pages.
        page = api.PageCache([api.KVCacheSpec("full", 4)], 64)
        with pytest.raises(KeyError) as unknown:
            page.free(req)
        out.append(unknown.value.args[0])
        assert page.acquire(req, 4)
        with pytest.raises(ValueError) as invalid:
            page.claim(req, page.match_prefix([]))
        out.append(str(invalid.value))
        return out

    native, reference = messages(flat_kvcache), messages(flat_kvcache.reference)
    assert native == reference
    text = req if isinstance(req, str) else str(req)
    cut = len(text) > 80
    shown = (repr(text[:80]) if isinstance(req, str) else text[:80]) + ("..." if cut else "")
    assert all(shown in m for m in native), (shown, native)


def test_an_id_utf8_cannot_encode_is_refused_alike() -> None:
    """A str id holding a lone surrogate is a ``UnicodeEncodeError`` (a ``ValueError``) from
    every call, before anything else of a batch is checked, with the same message from both
    engines; nothing is added or moved."""
    import flat_kvcache
    import flat_kvcache.reference

    def outcomes(api: ModuleType) -> list[tuple[str, str]]:
        cache = cache_of(api, 16)
        cache.add_request("x", [1, 2, 3])
        calls: list[Callable[[], object]] = [
            lambda: cache.add_request("a\ud800", [1]),
            lambda: cache.admit("\udc80", [1, 2], 2),
            lambda: cache.schedule_batch(["nope", "\udc80"], [1, 1]),
            lambda: cache.append_tokens_batch(["x", "\ud800b"], [1, 1]),
            lambda: cache.num_tokens("\ud800"),
            lambda: cache.finish("\ud800"),
        ]
        out = []
        for call in calls:
            with pytest.raises(UnicodeEncodeError) as info:
                call()
            out.append((type(info.value).__name__, str(info.value)))
        assert cache.num_tokens("x") == 3 and cache.num_computed_tokens("x") == 0
        assert cache.num_requests == 1
        return out

    assert outcomes(flat_kvcache) == outcomes(flat_kvcache.reference)
