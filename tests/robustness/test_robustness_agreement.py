"""Native and reference agree where a hidden differential sweep found them apart (issue 35,
items 7 to 9), each expectation written from the contract (docs/engine-api.md "Odd inputs",
docs/requests-api.md "Persistent rows"), on both engines.

The checking order (items 4 and 5) is swept in test_robustness_multiarg.py.
"""

from __future__ import annotations

import textwrap
from types import ModuleType
from typing import Any

import flat_kvcache
import flat_kvcache.reference
import numpy as np
import pytest
from helpers import run_python

ENGINES = [pytest.param(flat_kvcache, id="native"), pytest.param(flat_kvcache.reference, id="reference")]

#: Python's message for the lone surrogate "\ud800" at the start of a str.
SURROGATE = "'utf-8' codec can't encode character '\\ud800' in position 0: surrogates not allowed"


@pytest.mark.parametrize("api", ENGINES)
@pytest.mark.parametrize("cls", ["FlatKVCache", "PageCache"])
def test_a_group_id_utf8_cannot_encode_is_refused(api: ModuleType, cls: str) -> None:
    """Item 7: every str argument is text UTF-8 can encode, a spec's group id too (as a
    request id): ``UnicodeEncodeError`` with Python's message, on both engines."""
    specs = [api.KVCacheSpec("full", 4, group_id="\ud800")]
    with pytest.raises(UnicodeEncodeError) as caught:
        getattr(api, cls)(specs, 8)
    assert str(caught.value) == SURROGATE


def _arena_specs(api: ModuleType) -> list[Any]:
    return [api.KVCacheSpec("full", 4, group_id="full"), api.KVCacheSpec("state", 8, group_id="lin")]


def _plan() -> Any:
    components = [
        flat_kvcache.ComponentSpec("full", 0, "kv", bytes_per_slot=64, const_bytes=0),
        flat_kvcache.ComponentSpec("lin", 1, "ssm", bytes_per_slot=0, const_bytes=1024),
    ]
    return flat_kvcache.plan_arena(components, 4, 64 * 1024)


@pytest.mark.parametrize("api", ENGINES)
def test_a_host_pages_group_utf8_cannot_encode_is_refused(api: ModuleType) -> None:
    """Item 9: a lone surrogate in a ``host_pages`` key was shown mangled natively (and named
    as an unknown group); it is a ``UnicodeEncodeError`` on both engines."""
    with pytest.raises(UnicodeEncodeError) as caught:
        api.FlatKVCache(_arena_specs(api), arena=_plan(), host_pages={"\ud800": 1})
    assert str(caught.value) == SURROGATE


@pytest.mark.parametrize("api", ENGINES)
def test_a_refused_update_then_finish_leaves_the_row_padding(api: ModuleType) -> None:
    """Item 8: bind one row of one column; a request whose table outgrows it is refused (nothing
    written, the cell we put there stays); once it finishes, the next update returns the row to
    padding (-1), as "a finished request's row goes back to -1 on the next update" says, and
    returns that cell, so the buffer and the deltas tell the same story."""
    cache = api.FlatKVCache([api.KVCacheSpec("full", 4)], 16)
    tables = {"g0": np.zeros((1, 1), np.int32)}
    cache.bind_rows(tables)
    assert tables["g0"].tolist() == [[-1]]
    slot, _ = cache.add_request("a", list(range(8)))
    assert cache.schedule([slot], [8]).tolist() == [True]  # 2 pages of 4 tokens: 1 column is too few
    tables["g0"][0, 0] = 12345
    with pytest.raises(ValueError, match="has 1 columns but request 'a' \\(row 0\\) has 2 pages"):
        cache.update_rows()
    assert tables["g0"].tolist() == [[12345]], "a refused update wrote a buffer"
    cache.finish([slot])
    cells, offsets = cache.update_rows()
    assert {g: a.tolist() for g, a in cells.items()} == {"g0": [[0], [0], [-1]]}
    assert offsets == {}
    assert tables["g0"].tolist() == [[-1]]
    # Nothing is pending any more.
    cells, _ = cache.update_rows()
    assert cells["g0"].tolist() == [[], [], []]


@pytest.mark.parametrize("api", ENGINES)
@pytest.mark.parametrize("method", ["claim", "prefill_first_chunk"])
def test_claim_refusals_name_the_call_in_one_sentence(api: ModuleType, method: str) -> None:
    """Item 9: a match with the wrong number of groups and a stale match say the same thing on
    both engines, naming the call that was given the match."""
    cache = api.PageCache([api.KVCacheSpec("full", 4, group_id="full"), api.KVCacheSpec("full", 8)], 32)
    assert cache.acquire("p", 8)
    args = (1,) if method == "prefill_first_chunk" else ()
    with pytest.raises(ValueError) as caught:
        getattr(cache, method)("new", api.PrefixMatch(0, [[]], [0]), *args)
    assert str(caught.value) == f"{method}: the match has 1 groups but the cache has 2"
    # Page 1 is "p"'s and holds no key: no match of this cache can hold it.
    stale = api.PrefixMatch(8, [[1, 0], [0]], [1, 0])
    with pytest.raises(ValueError) as caught:
        getattr(cache, method)("new", stale, *args)
    assert str(caught.value) == (
        f'{method}: stale match: page 1 of group "full" no longer holds the key it was matched under'
    )


@pytest.mark.parametrize("api", ENGINES)
@pytest.mark.parametrize(
    ("cls", "call", "message"),
    [
        (
            "PageCache",
            lambda c: c([], 8, foo=1),
            "PageCache.__new__() got an unexpected keyword argument 'foo'",
        ),
        (
            "FlatKVCache",
            lambda c: c([], 8, foo=1),
            "FlatKVCache.__new__() got an unexpected keyword argument 'foo'",
        ),
        (
            "PageCache",
            lambda c: c(),
            "PageCache.__new__() missing 2 required positional arguments: 'specs' and 'num_pages'",
        ),
        (
            "FlatKVCache",
            lambda c: c(),
            "FlatKVCache.__new__() missing 1 required positional argument: 'specs'",
        ),
        (
            "PageCache",
            lambda c: c([], 8, 1),
            "PageCache.__new__() takes 2 positional arguments but 3 were given",
        ),
        (
            "FlatKVCache",
            lambda c: c([], 8, 1),
            "FlatKVCache.__new__() takes from 1 to 2 positional arguments but 3 were given",
        ),
        (
            "FlatKVCache",
            lambda c: c([], specs=[]),
            "FlatKVCache.__new__() got multiple values for argument 'specs'",
        ),
    ],
)
def test_constructor_argument_errors_name_the_class(
    api: ModuleType, cls: str, call: Any, message: str
) -> None:
    """Item 9: Python's own argument errors name ``<class>.__new__()`` on both engines (the
    reference said ``PageCache.__init__()``, or ``Coordinator.__init__()`` for FlatKVCache)."""
    with pytest.raises(TypeError) as caught:
        call(getattr(api, cls))
    assert str(caught.value) == message


@pytest.mark.parametrize("api", ENGINES)
@pytest.mark.parametrize("unit", ["m8", "m8[s]"])
def test_timedelta_arrays_are_no_integer_arrays(api: ModuleType, unit: str) -> None:
    """Item 9: numpy counts timedelta64 among its integers; it is no token array (the reference
    read ``m8[s]`` as ``datetime.timedelta`` items and accepted plain ``m8`` as ints)."""
    tokens = np.array([1, 2], dtype=unit)
    dtype = np.dtype(unit)
    with pytest.raises(TypeError) as caught:
        api.hash_page(tokens)
    assert str(caught.value) == f"tokens must be a 1-D integer array, got a 1-D array of dtype {dtype}"
    cache = api.FlatKVCache([api.KVCacheSpec("full", 4)], 8)
    with pytest.raises(TypeError) as caught:
        cache.add_request("a", tokens)
    assert (
        str(caught.value) == f"prompt_token_ids must be a 1-D integer array, got a 1-D array of dtype {dtype}"
    )
    assert cache.num_requests == 0


@pytest.mark.parametrize("api", ENGINES)
def test_an_lcm_past_u64_names_the_page_sizes(api: ModuleType) -> None:
    """Item 9: the lcm overflow says what overflowed, in the words of every u64 overflow."""
    sizes = [2**40 - 87, 2**40 - 111]
    with pytest.raises(OverflowError) as caught:
        api.PageCache([api.KVCacheSpec("full", p) for p in sizes], 8)
    assert str(caught.value) == (
        f"specs: the lcm of the page sizes {sizes} does not fit in an unsigned 64-bit integer"
    )


@pytest.mark.parametrize("engine", ["flat_kvcache", "flat_kvcache.reference"])
def test_memory_errors_say_what_did_not_fit(engine: str) -> None:
    """Item 9: a pool or host tier that cannot be allocated is a ``MemoryError`` saying what did
    not fit (the reference raised an empty one). Run in a fresh interpreter whose address
    space is capped at 1 GiB, so the allocation fails at once instead of swapping."""
    code = textwrap.dedent(
        f"""
        import resource
        import {engine} as api
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
        for call in (
            lambda: api.BlockPool(2**31 - 1),
            lambda: api.FlatKVCache([api.KVCacheSpec("full", 4)], 2**31 - 1),
            lambda: api.FlatKVCache([api.KVCacheSpec("full", 4)], 8, host_pages=2**31 - 1),
        ):
            try:
                call()
            except MemoryError as exc:
                print(exc)
            else:
                print("no error")
        """
    )
    done = run_python("-c", code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "out of memory: num_blocks = 2147483647: the page pool does not fit in memory",
        "out of memory: num_blocks = 2147483647: the page pool does not fit in memory",
        "out of memory: host_pages = 2147483647: the host tier does not fit in memory",
    ]
