"""Differential sweep of odd inputs: every argument of every public engine call, given each
value of :data:`ODD`, on the native engine and the pure-Python reference, each on its own
identically prepared cache (``busy_cache``, or ``busy_page_cache`` for the page-level calls).

The expectation is agreement between the two implementations: the same result and the same
cache afterwards, or the same exception type and exactly the same message with nothing
changed. Where the contract names the exception (docs/engine-api.md, "Odd inputs"), the sweep
checks that too: a str, bytes, bytearray or memoryview is never a batch, nor is a masked array
an integer array (TypeError naming the argument); a str id UTF-8 cannot encode is a
UnicodeEncodeError; a bool, float or None is not an int; a negative count is a ValueError.
"""

from __future__ import annotations

import array
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from types import ModuleType, SimpleNamespace
from typing import Any

import flat_kvcache
import numpy as np
import pytest
from helpers import PAGE_LEVEL_METHODS, normalize
from robustness_cases import ENGINES, HASH, PAGE_LEVEL, busy_cache, busy_page_cache, snapshot

# --- the odd values -----------------------------------------------------------------------------

#: Odd values by label, each made fresh per call (an iterator is used up, arrays may be kept).
ODD: dict[str, Callable[[], object]] = {
    "None": lambda: None,
    "True": lambda: True,
    "np.bool_": lambda: np.bool_(True),
    "1.5": lambda: 1.5,
    "np.float64": lambda: np.float64(2.0),
    "np.float32": lambda: np.float32(1.0),
    "object": object,
    "'3'": lambda: "3",
    "''": lambda: "",
    "lone-surrogate": lambda: "\ud800",
    "b'a'": lambda: b"a",
    "b''": lambda: b"",
    "bytearray": lambda: bytearray(b"\x01"),
    "memoryview": lambda: memoryview(b"\x01"),
    "memoryview-int64": lambda: memoryview(array.array("q", [0, 1])),
    "-1": lambda: -1,
    "np.int64(-1)": lambda: np.int64(-1),
    "2**64": lambda: 2**64,
    "2**200": lambda: 2**200,
    "-2**70": lambda: -(2**70),
    "np.uint64-max": lambda: np.uint64(2**64 - 1),
    "np.int32(3)": lambda: np.int32(3),
    "[]": lambda: [],
    "[[1]]": lambda: [[1]],
    "[1, [2]]": lambda: [1, [2]],
    "[None]": lambda: [None],
    "[True]": lambda: [True],
    "[1.5]": lambda: [1.5],
    "[np.float64]": lambda: [np.float64(1.0)],
    "[np.bool_]": lambda: [np.bool_(True)],
    "[-1]": lambda: [-1],
    "[np.int8(-1)]": lambda: [np.int8(-1)],
    "[2**64]": lambda: [2**64],
    "[2**200]": lambda: [2**200],
    "[np.uint64(5)]": lambda: [np.uint64(5)],
    "['a']": lambda: ["a"],
    "[b'a']": lambda: [b"a"],
    "[lone-surrogate]": lambda: ["\ud800"],
    "[HASH, 1]": lambda: [HASH, 1],
    "[uppercase-hash]": lambda: ["A" * 64],
    "('a',)": lambda: ("a",),
    "{1: 2}": lambda: {1: 2},
    "{1}": lambda: {1},
    "iter([1])": lambda: iter([1]),
    "iter(['a'])": lambda: iter(["a"]),
    "range(2)": lambda: range(2),
    "0-d": lambda: np.array(1),
    "2-D": lambda: np.zeros((1, 1), np.int64),
    "strided": lambda: np.arange(4, dtype=np.int64)[::2],
    "reversed": lambda: np.arange(3, dtype=np.uint32)[::-1],
    "big-endian": lambda: np.array([1], dtype=">i4"),
    "float-array": lambda: np.array([1.0]),
    "str-array": lambda: np.array(["a"]),
    "bool-array": lambda: np.array([True]),
    "masked-none": lambda: np.ma.array([1], mask=[False]),
    "masked-one": lambda: np.ma.array([1, 2], mask=[False, True]),
    "masked-u32": lambda: np.ma.array(np.arange(9, dtype=np.uint32), mask=[False] * 8 + [True]),
    "masked-empty": lambda: np.ma.array([], dtype=np.int64),
}

#: Values that are text or bytes: iterable, but never a batch.
TEXT_OR_BYTES = ("'3'", "''", "lone-surrogate", "b'a'", "b''", "bytearray", "memoryview", "memoryview-int64")
#: Masked arrays: never an integer array (the mask would be ignored).
MASKED = ("masked-none", "masked-one", "masked-u32", "masked-empty")
#: Scalars that are no sequence at all.
NOT_ITERABLE = ("None", "True", "1.5", "np.float64", "object", "-1", "2**64", "np.int32(3)")


# --- every argument of every call ---------------------------------------------------------------

Call = Callable[[ModuleType, Any, object], object]


@dataclass(frozen=True)
class Slot:
    """One argument of one call: its kind, the name its messages use, and the call given it."""

    kind: str
    name: str
    call: Call
    #: The argument takes None (left out or "no value").
    optional: bool = False
    #: A call of ``PageCache`` (docs/engine-api.md), run on ``busy_page_cache``.
    page_level: bool = False


def _pool(api: ModuleType) -> Any:
    """A pool of 8 pages with pages 1 to 3 handed out."""
    pool = api.BlockPool(8)
    pool.allocate(3)
    return pool


def _spec(api: ModuleType) -> Any:
    return api.KVCacheSpec("full", 4)


def _id_slots() -> dict[str, Slot]:
    """Every request-id argument (the messages of a bad type say "request ids")."""
    calls: dict[str, Call] = {
        "has_request": lambda _, c, v: c.has_request(v),
        "finish": lambda _, c, v: c.finish(v),
        "preempt": lambda _, c, v: c.preempt(v),
        "num_tokens": lambda _, c, v: c.num_tokens(v),
        "num_computed_tokens": lambda _, c, v: c.num_computed_tokens(v),
        "page_ids": lambda _, c, v: c.page_ids(v),
        "tail_available": lambda _, c, v: c.tail_available(v),
        "free": lambda _, c, v: c.free(v),
        "budget": lambda _, c, v: c.budget(v),
        "row_of": lambda _, c, v: c.row_of(v),
        "loads_in_flight": lambda _, c, v: c.loads_in_flight(v),
        "acquire": lambda _, c, v: c.acquire(v, 1),
        "claim": lambda _, c, v: c.claim(v, c.match_prefix([])),
        "register": lambda _, c, v: c.register(v, [HASH]),
        "reclaim": lambda _, c, v: c.reclaim(v, 1),
        "pages_needed": lambda _, c, v: c.pages_needed(1, v),
        "pages_reclaimable": lambda _, c, v: c.pages_reclaimable(v, 1),
        "prefill_first_chunk": lambda _, c, v: c.prefill_first_chunk(v, c.match_prefix([]), 1),
        "prefill_chunk": lambda _, c, v: c.prefill_chunk(v, [], 1, 1),
        "decode_step": lambda _, c, v: c.decode_step(v, [], 0, 1, 5),
        "add_request": lambda _, c, v: c.add_request(v, [1, 2]),
        "admit": lambda _, c, v: c.admit(v, [1, 2], 1),
        "append_tokens": lambda _, c, v: c.append_tokens(v, [1]),
        "schedule": lambda _, c, v: c.schedule(v, 1),
        "reserve": lambda _, c, v: c.reserve(v, 1),
    }
    #: Where None is an answer: ``budget()`` of the whole cache, ``pages_needed`` of fresh tables.
    takes_none = {"budget", "pages_needed"}
    return {
        f"{method}.req": Slot("id", "request ids", call, optional=method in takes_none)
        for method, call in calls.items()
    }


SLOTS: dict[str, Slot] = {
    **_id_slots(),
    # batches of request ids
    "block_tables.reqs": Slot("ids", "reqs", lambda _, c, v: c.block_tables(v)),
    "schedule_batch.reqs": Slot("ids", "reqs", lambda _, c, v: c.schedule_batch(v, [1])),
    "append_tokens_batch.reqs": Slot("ids", "reqs", lambda _, c, v: c.append_tokens_batch(v, [1])),
    # counts
    "acquire.num_tokens": Slot("count", "num_tokens", lambda _, c, v: c.acquire(PAGE_LEVEL, v)),
    "register.first_slot": Slot(
        "count", "first_slot", lambda _, c, v: c.register(PAGE_LEVEL, [HASH], first_slot=v)
    ),
    "register.end_tokens": Slot(
        "count", "end_tokens", lambda _, c, v: c.register(PAGE_LEVEL, [HASH], end_tokens=v), optional=True
    ),
    "reclaim.num_computed_tokens": Slot(
        "count", "num_computed_tokens", lambda _, c, v: c.reclaim(PAGE_LEVEL, v)
    ),
    "pages_needed.num_tokens": Slot("count", "num_tokens", lambda _, c, v: c.pages_needed(v)),
    "pages_reclaimable.num_computed_tokens": Slot(
        "count", "num_computed_tokens", lambda _, c, v: c.pages_reclaimable(PAGE_LEVEL, v)
    ),
    "prefill_first_chunk.num_tokens": Slot(
        "count", "num_tokens", lambda _, c, v: c.prefill_first_chunk("new", c.match_prefix([]), v)
    ),
    "prefill_chunk.num_tokens": Slot(
        "count", "num_tokens", lambda _, c, v: c.prefill_chunk(PAGE_LEVEL, [], v, 1)
    ),
    "prefill_chunk.num_computed_tokens": Slot(
        "count", "num_computed_tokens", lambda _, c, v: c.prefill_chunk(PAGE_LEVEL, [], 1, v)
    ),
    "decode_step.first_page_slot": Slot(
        "count", "first_page_slot", lambda _, c, v: c.decode_step(PAGE_LEVEL, [], v, 1, 5)
    ),
    "decode_step.num_tokens": Slot(
        "count", "num_tokens", lambda _, c, v: c.decode_step(PAGE_LEVEL, [], 0, v, 5)
    ),
    "decode_step.num_computed_tokens": Slot(
        "count", "num_computed_tokens", lambda _, c, v: c.decode_step(PAGE_LEVEL, [], 0, 1, v)
    ),
    "add_request.row": Slot(
        "count", "row", lambda _, c, v: c.add_request("new", [1, 2], row=v), optional=True
    ),
    "admit.max_new_tokens": Slot("count", "max_new_tokens", lambda _, c, v: c.admit("new", [1, 2], v)),
    "admit.row": Slot("count", "row", lambda _, c, v: c.admit("new", [1, 2], 1, row=v), optional=True),
    "schedule.num_new_tokens": Slot("count", "num_new_tokens", lambda _, c, v: c.schedule("a", v)),
    "schedule.lookahead": Slot("count", "lookahead", lambda _, c, v: c.schedule("a", 1, lookahead=v)),
    "pages_needed_to_admit.num_new_tokens": Slot(
        "count", "num_new_tokens", lambda _, c, v: c.pages_needed_to_admit([1, 2, 3], v)
    ),
    "pages_needed_to_admit.reserve_tokens": Slot(
        "count", "reserve_tokens", lambda _, c, v: c.pages_needed_to_admit([1, 2, 3], 1, v)
    ),
    "reserve.tokens": Slot("count", "tokens", lambda _, c, v: c.reserve("a", v)),
    "hash_pages.page_size": Slot("count", "page_size", lambda api, _, v: api.hash_pages([1], v)),
    "fold_hashes.first_base": Slot("count", "first_base", lambda api, _, v: api.fold_hashes([HASH], v, 1)),
    "fold_hashes.m": Slot("count", "m", lambda api, _, v: api.fold_hashes([HASH], 0, v)),
    "group_key.group_index": Slot("count", "group_index", lambda api, _, v: api.group_key(HASH, v)),
    "PrefixMatch.num_common_tokens": Slot(
        "count", "num_common_tokens", lambda api, _, v: api.PrefixMatch(v, [[], []], [0, 0])
    ),
    "BlockPool.num_blocks": Slot("count", "num_blocks", lambda api, _, v: api.BlockPool(v)),
    "BlockPool.allocate": Slot("count", "n", lambda api, _, v: _pool(api).allocate(v)),
    "FlatKVCache.num_pages": Slot("count", "num_pages", lambda api, c, v: type(c)([_spec(api)], v)),
    "FlatKVCache.host_pages": Slot(
        "count", "host_pages", lambda api, c, v: type(c)([_spec(api)], 8, host_pages=v), optional=True
    ),
    # page ids
    "BlockPool.touch": Slot("page", "page", lambda api, _, v: _pool(api).touch(v)),
    "BlockPool.cache.page": Slot("page", "page", lambda api, _, v: _pool(api).cache(v, "k")),
    "BlockPool.ref_count": Slot("page", "page", lambda api, _, v: _pool(api).ref_count(v)),
    "BlockPool.is_cached": Slot("page", "page", lambda api, _, v: _pool(api).is_cached(v)),
    # integer arrays: counts, rows, transfer ids, page ids
    "schedule_batch.num_new_tokens": Slot(
        "counts", "num_new_tokens", lambda _, c, v: c.schedule_batch(["a"], v)
    ),
    "append_tokens_batch.num_tokens": Slot(
        "counts", "num_tokens", lambda _, c, v: c.append_tokens_batch(["a"], [1], v), optional=True
    ),
    "schedule_rows.rows": Slot("counts", "rows", lambda _, c, v: c.schedule_rows(v, [1])),
    "schedule_rows.num_new_tokens": Slot("counts", "num_new_tokens", lambda _, c, v: c.schedule_rows([0], v)),
    "append_tokens_rows.rows": Slot("counts", "rows", lambda _, c, v: c.append_tokens_rows(v, [1])),
    "append_tokens_rows.num_tokens": Slot(
        "counts", "num_tokens", lambda _, c, v: c.append_tokens_rows([0], [1], v), optional=True
    ),
    "ack_transfers.ids": Slot("counts", "ids", lambda _, c, v: c.ack_transfers(v)),
    "PrefixMatch.num_hit_pages": Slot(
        "counts", "num_hit_pages", lambda api, _, v: api.PrefixMatch(0, [[], []], v)
    ),
    "PrefixMatch.pages[0]": Slot("counts", "pages[0]", lambda api, _, v: api.PrefixMatch(0, [v, []], [0, 0])),
    "BlockPool.free": Slot("counts", "pages", lambda api, _, v: _pool(api).free(v)),
    # tokens
    "add_request.prompt_token_ids": Slot(
        "counts", "prompt_token_ids", lambda _, c, v: c.add_request("new", v)
    ),
    "admit.prompt_token_ids": Slot("counts", "prompt_token_ids", lambda _, c, v: c.admit("new", v, 1)),
    "append_tokens.token_ids": Slot("counts", "token_ids", lambda _, c, v: c.append_tokens("a", v)),
    "append_tokens_batch.token_ids": Slot(
        "counts", "token_ids", lambda _, c, v: c.append_tokens_batch(["a"], v)
    ),
    "append_tokens_rows.token_ids": Slot("counts", "token_ids", lambda _, c, v: c.append_tokens_rows([0], v)),
    "prefix_hit_tokens.prompt_token_ids": Slot(
        "counts", "prompt_token_ids", lambda _, c, v: c.prefix_hit_tokens(v)
    ),
    "pages_needed_to_admit.prompt_token_ids": Slot(
        "counts", "prompt_token_ids", lambda _, c, v: c.pages_needed_to_admit(v, 1)
    ),
    "hash_page.tokens": Slot("counts", "tokens", lambda api, _, v: api.hash_page(v)),
    "hash_pages.token_ids": Slot("counts", "token_ids", lambda api, _, v: api.hash_pages(v, 1)),
    # content hashes
    "match_prefix.content_hashes": Slot("strs", "content_hashes", lambda _, c, v: c.match_prefix(v)),
    "register.content_hashes": Slot("strs", "content_hashes", lambda _, c, v: c.register(PAGE_LEVEL, v)),
    "prefill_chunk.content_hashes": Slot(
        "strs", "content_hashes", lambda _, c, v: c.prefill_chunk(PAGE_LEVEL, v, 1, 1)
    ),
    "decode_step.content_hashes": Slot(
        "strs", "content_hashes", lambda _, c, v: c.decode_step(PAGE_LEVEL, v, 0, 1, 5)
    ),
    "fold_hashes.base_hashes": Slot("strs", "base_hashes", lambda api, _, v: api.fold_hashes(v, 0, 2)),
    "fold_hashes.base_hashes(m=1)": Slot("strs", "base_hashes", lambda api, _, v: api.fold_hashes(v, 0, 1)),
    # extra keys
    "add_request.extra_keys": Slot(
        "strs", "extra_keys", lambda _, c, v: c.add_request("new", [1, 2], extra_keys=v)
    ),
    "admit.extra_keys": Slot("strs", "extra_keys", lambda _, c, v: c.admit("new", [1, 2], 1, extra_keys=v)),
    "prefix_hit_tokens.extra_keys": Slot(
        "strs", "extra_keys", lambda _, c, v: c.prefix_hit_tokens([1, 2, 3, 4, 5], extra_keys=v)
    ),
    "pages_needed_to_admit.extra_keys": Slot(
        "strs", "extra_keys", lambda _, c, v: c.pages_needed_to_admit([1, 2, 3], 1, extra_keys=v)
    ),
    "hash_page.extra_keys": Slot("strs", "extra_keys", lambda api, _, v: api.hash_page([1], "", v)),
    "hash_pages.extra_keys": Slot(
        "strs", "extra_keys", lambda api, _, v: api.hash_pages([1], 1, extra_keys=v)
    ),
    # other sequences
    "FlatKVCache.specs": Slot("specs", "specs", lambda _, c, v: type(c)(v, 8)),
    "PrefixMatch.pages": Slot("groups", "pages", lambda api, _, v: api.PrefixMatch(0, v, [0, 0])),
    # single str arguments
    "hash_page.prior": Slot("str", "prior", lambda api, _, v: api.hash_page([1], v)),
    "hash_pages.prior": Slot("str", "prior", lambda api, _, v: api.hash_pages([1], 1, prior=v)),
    "group_key.content_hash": Slot("str", "content_hash", lambda api, _, v: api.group_key(v, 1)),
    "BlockPool.cache.key": Slot("str", "key", lambda api, _, v: _pool(api).cache(1, v)),
    "BlockPool.lookup": Slot("str", "key", lambda api, _, v: _pool(api).lookup(v)),
    # matches
    "claim.match": Slot("match", "match", lambda _, c, v: c.claim("new", v)),
    "prefill_first_chunk.match": Slot("match", "match", lambda _, c, v: c.prefill_first_chunk("new", v, 1)),
    "pages_consumed_by_claim.match": Slot("match", "match", lambda _, c, v: c.pages_consumed_by_claim(v)),
    # bools and named choices
    "add_request.use_prefix_cache": Slot(
        "flag", "use_prefix_cache", lambda _, c, v: c.add_request("new", [1, 2], use_prefix_cache=v)
    ),
    "pages_reclaimable.count_uncached": Slot(
        "flag", "count_uncached", lambda _, c, v: c.pages_reclaimable(PAGE_LEVEL, 1, count_uncached=v)
    ),
    "update_rows.full": Slot("flag", "full", lambda _, c, v: c.update_rows(full=v)),
    "FlatKVCache.enable_caching": Slot(
        "flag", "enable_caching", lambda api, c, v: type(c)([_spec(api)], 8, enable_caching=v)
    ),
    "BlockPool.reuse_uncached_first": Slot(
        "flag", "reuse_uncached_first", lambda api, _, v: api.BlockPool(8, reuse_uncached_first=v)
    ),
    "FlatKVCache.eviction_order": Slot(
        "choice", "eviction_order", lambda api, c, v: type(c)([_spec(api)], 8, eviction_order=v)
    ),
    "FlatKVCache.host_store": Slot(
        "choice", "host_store", lambda api, c, v: type(c)([_spec(api)], 8, host_pages=4, host_store=v)
    ),
    # buffers
    "block_tables.out": Slot("out", "out", lambda _, c, v: c.block_tables(["a"], out=v), optional=True),
    "bind_rows.tables": Slot("out", "tables", lambda _, c, v: c.bind_rows(v)),
}

# The page-level protocol's methods (PAGE_LEVEL_METHODS) have their slots run on a ``PageCache``.
SLOTS = {
    where: replace(slot, page_level=where.split(".")[0] in PAGE_LEVEL_METHODS)
    for where, slot in SLOTS.items()
}

#: Kinds whose argument is a sequence (a batch): text, bytes and non-iterables are refused.
BATCH_KINDS = frozenset({"ids", "counts", "strs", "specs", "groups"})


def expected(slot: Slot, label: str) -> type[BaseException] | None:
    """The exception the contract names for ``label`` given to ``slot``, or None where it
    names none (the sweep then checks only that both engines agree)."""
    if slot.optional and label == "None":
        return None
    if slot.kind in BATCH_KINDS:
        if label in TEXT_OR_BYTES or label in NOT_ITERABLE:
            return TypeError
        if label in MASKED and slot.kind == "counts":
            return TypeError
    if slot.kind == "id":
        if label == "lone-surrogate":
            return UnicodeEncodeError
        if label in ("None", "True", "np.bool_", "1.5", "np.float64", "object", "b'a'", "bytearray", "[]"):
            return TypeError
    if slot.kind == "ids" and label == "[lone-surrogate]":
        return UnicodeEncodeError
    if slot.kind in ("count", "page"):
        if label in ("None", "True", "np.bool_", "1.5", "np.float64", "np.float32", "'3'", "b'a'", "[]"):
            return TypeError
        if label in ("-1", "np.int64(-1)", "-2**70"):
            return ValueError
    if slot.kind in ("str", "flag", "match") and label in ("None", "1.5", "b'a'", "[]", "object"):
        return TypeError
    return None


# --- running one value on one engine ------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    """What a call did: its result and the cache afterwards, or the exception it raised."""

    raised: type[BaseException] | None
    message: str
    result: Any = None
    after: Any = None

    def __str__(self) -> str:
        if self.raised is None:
            return f"returned {self.result!r}"[:300]
        return f"{self.raised.__name__}: {self.message}"[:300]


def _plain(result: object) -> object:
    """A result as comparable data (engines and pools are shown by their state)."""
    if hasattr(result, "pool_stats"):
        return (type(result).__name__, result.pool_stats(), result.group_ids)  # type: ignore[attr-defined]
    if hasattr(result, "num_blocks") and hasattr(result, "ref_count"):
        return ("BlockPool", result.num_blocks, result.num_free, result.num_cached)  # type: ignore[attr-defined]
    return normalize(result)


def run(api: ModuleType, slot: Slot, label: str) -> Outcome:
    """``slot`` given ``ODD[label]`` on a fresh busy cache of ``api``. A refused call must
    leave the cache unchanged and record no event."""
    cache = busy_page_cache(api) if slot.page_level else busy_cache(api)
    before = snapshot(cache)
    try:
        result = slot.call(api, cache, ODD[label]())
    except Exception as exc:  # every refusal is compared, whatever its type
        message = str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)
        # A repr of an object shows its address: the same object is two objects here.
        message = re.sub(r" at 0x[0-9a-f]+>", " at 0x...>", message)
        assert snapshot(cache) == before, f"{api.__name__}: a refused call changed the cache"
        assert cache.take_events() == [], f"{api.__name__}: a refused call recorded KV events"
        return Outcome(type(exc), message)
    return Outcome(None, "", _plain(result), (snapshot(cache), normalize(cache.take_events())))


def _check_expected(slot: Slot, label: str, got: Outcome) -> str | None:
    """A problem with ``got`` against the contract, or None."""
    kind = expected(slot, label)
    if kind is None:
        return None
    if got.raised is None or not issubclass(got.raised, kind):
        return f"expected {kind.__name__}, got {got}"
    if kind is TypeError and slot.name not in got.message:
        return f"the TypeError does not name {slot.name!r}: {got.message!r}"
    return None


@pytest.mark.parametrize("where", list(SLOTS))
def test_odd_inputs_same_outcome_on_both_engines(where: str) -> None:
    """Every odd value in this argument: both engines do the same thing, and refuse what the
    contract refuses with the exception it names."""
    slot = SLOTS[where]
    problems = []
    for label in ODD:
        native, reference = (run(api, slot, label) for api in ENGINES)
        if native != reference:
            problems.append(f"{label}:\n    native    {native}\n    reference {reference}")
            continue
        problem = _check_expected(slot, label, native)
        if problem is not None:
            problems.append(f"{label}: {problem}")
    assert not problems, f"{where}: {len(problems)} value(s)\n" + "\n".join(problems)


@pytest.mark.parametrize("cls", ["FlatKVCache", "PageCache"])
def test_specs_must_be_kv_cache_specs_on_both_engines(cls: str) -> None:
    """Only a real ``KVCacheSpec`` is a spec: an object with the same four fields and valid
    values (which native once accepted and the reference refused), or a sizing
    ``PagedCacheGroupSpec`` (an easy mix-up), is a TypeError naming ``specs[i]``."""
    real = flat_kvcache.KVCacheSpec("full", 16, None)
    look_alike = SimpleNamespace(kind="full", page_size=16, sliding_window=None, group_id=None)
    sizing_spec = flat_kvcache.group_specs_from_layer_types(["full_attention"], 8, page_size=16)[0]
    for module in ENGINES:
        assert getattr(module, cls)([real], 8).group_ids == ["g0"]
        for index, bad in ((0, look_alike), (1, sizing_spec)):
            specs = [bad] if index == 0 else [real, bad]
            with pytest.raises(TypeError) as caught:
                getattr(module, cls)(specs, 8)
            assert str(caught.value) == f"specs[{index}] must be a KVCacheSpec, got {type(bad).__name__}"
