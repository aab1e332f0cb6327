"""Differential sweep of several bad arguments at once: the argument-checking order.

docs/engine-api.md ("Odd inputs", "The checking order") gives both engines one order: every
argument's form (its type, then its value: sign, range, u64/u32, text UTF-8 can encode, hex,
emptiness), one argument at a time in signature order (keyword-only arguments after the
positional ones, in their order); then what the arguments say together (lengths that must
agree, sums); then the cache: that each slot or id names a request the call may use (a slot
that holds no request, an unknown id, a request of the other protocol); then what the call asks
of that request and of the cache (tokens that are known, pages a table holds, a stale match).
A batch is checked entry by entry in the same way.

For every call with two or more arguments this sweep gives two (and, for a few calls, three)
arguments a bad value each, on the native engine and on the pure-Python reference, each on its
own identically prepared cache, and requires

- the same exception type and exactly the same message from both, with nothing changed
  (:func:`robustness_cases.refusal`);
- the error the documented order picks: among the bad values, the one of the earliest stage
  (form, then relation, then request, then state), the earliest argument within it. The
  expected exception and its text are written here from the documentation, never copied from
  an engine.

It runs in about a second on one core (two engines, ~2,800 calls).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import numpy as np
import pytest
from flat_kvcache.errors import UnknownRequestError
from robustness_cases import ENGINES, FREE_SLOT, HASH, PAGE_LEVEL, SLOT_A, Refusal, refusal

# --- stages of the documented order ------------------------------------------------------------

#: The argument itself: its type, then its value.
FORM = 0
#: The arguments together: lengths that must agree, sums.
RELATION = 1
#: The request a slot or id names: held, known, of this protocol.
REQUEST = 2
#: What the call asks of the request and the cache.
STATE = 3

STAGES = {FORM: "form", RELATION: "relation", REQUEST: "request", STATE: "state"}


@dataclass(frozen=True)
class Bad:
    """One bad value of one argument, and what the documentation says it raises."""

    label: str
    make: Callable[[ModuleType], object]
    stage: int
    kind: type[BaseException]
    #: Text the message must contain, or equal when ``exact``.
    text: str
    exact: bool = True


@dataclass(frozen=True)
class Param:
    """One argument in signature order: its good value and its bad ones."""

    name: str
    good: Callable[[ModuleType], object]
    bads: tuple[Bad, ...]
    keyword: bool = False


@dataclass(frozen=True)
class Method:
    """A call of two or more arguments, run on ``busy_cache`` or ``busy_page_cache``."""

    name: str
    params: tuple[Param, ...]
    run: Callable[[ModuleType, Any, list[object], dict[str, object]], object]
    page_level: bool = False
    #: Also give three arguments a bad value each (a few calls: their cost grows fast).
    triples: bool = False
    #: Run on ``busy_arena_cache`` (a cache over an arena, with a state group).
    arena: bool = False
    #: Pairs of bad labels (``"param=label"``) not combined: their errors depend on each other
    #: in a way the stages do not describe (documented where they are listed).
    skip: frozenset[frozenset[str]] = field(default_factory=frozenset)


def _const(value: object) -> Callable[[ModuleType], object]:
    return lambda _api: value


INTS = "ints or a 1-D integer array"


def count_bads(name: str) -> tuple[Bad, ...]:
    """A count: an int >= 0 that fits u64 (docs/engine-api.md "Odd inputs")."""
    return (
        Bad("-1", _const(-1), FORM, ValueError, f"{name} must be >= 0, got -1"),
        Bad(
            "2**64",
            _const(2**64),
            FORM,
            OverflowError,
            f"{name}: value does not fit in an unsigned 64-bit integer",
        ),
        Bad("None", _const(None), FORM, TypeError, f"{name} must be an int, got NoneType"),
        Bad("True", _const(True), FORM, TypeError, f"{name} must be an int, not bool"),
    )


def slot_bads(method: str, name: str = "slot", *, optional: bool = False) -> tuple[Bad, ...]:
    """A slot: a count, then a slot that holds a request (docs/requests-api.md "Slots"); None
    is the omitted value of an ``optional`` slot."""
    return (
        *count_bads(name)[: 2 if optional else 3],
        Bad(
            "free",
            _const(FREE_SLOT),
            REQUEST,
            UnknownRequestError,
            f"{method}: slot {FREE_SLOT} holds no request",
        ),
    )


def slots_bads(method: str) -> tuple[Bad, ...]:
    """A slot array: a batch of ints, each entry a slot."""
    return (
        Bad("[-1]", _const([-1]), FORM, ValueError, "slots[0] must be >= 0, got -1"),
        Bad("[None]", _const([None]), FORM, TypeError, "slots[0] must be an int, got NoneType"),
        Bad("'x'", _const("x"), FORM, TypeError, f"slots must be a sequence of {INTS}, got str"),
        Bad(
            "[free]",
            _const([FREE_SLOT]),
            REQUEST,
            UnknownRequestError,
            f"{method}: slot {FREE_SLOT} holds no request",
        ),
    )


def counts_bads(name: str, length_text: str | None = None, *, optional: bool = False) -> tuple[Bad, ...]:
    """One count per slot; ``[1, 1]`` against one slot is a relation (lengths). None is the
    omitted value of an ``optional`` argument."""
    bads: tuple[Bad, ...] = (
        Bad("[-1]", _const([-1]), FORM, ValueError, f"{name}[0] must be >= 0, got -1"),
        Bad(
            "[2**64]",
            _const([2**64]),
            FORM,
            OverflowError,
            f"{name}[0]: value does not fit in an unsigned 64-bit integer",
        ),
        Bad("None", _const(None), FORM, TypeError, f"{name} must be a sequence of {INTS}, got NoneType"),
    )
    if optional:
        bads = bads[:2]
    if length_text is None:
        return bads
    return (*bads, Bad("[1, 1]", _const([1, 1]), RELATION, ValueError, length_text))


def token_bads(name: str) -> tuple[Bad, ...]:
    """Token ids: a batch of ints, each fitting u32."""
    return (
        Bad("[-1]", _const([-1]), FORM, ValueError, f"{name}[0] = -1 does not fit in u32"),
        Bad("[2**32]", _const([2**32]), FORM, ValueError, f"{name}[0] = 4294967296 does not fit in u32"),
        Bad("None", _const(None), FORM, TypeError, f"{name} must be a sequence of {INTS}, got NoneType"),
        Bad("[1.5]", _const([1.5]), FORM, TypeError, f"{name}[0] must be an int, got float"),
    )


def prompt_bads() -> tuple[Bad, ...]:
    """A prompt: token ids, and not empty (its own value: a form check)."""
    return (
        *token_bads("prompt_token_ids"),
        Bad("[]", _const([]), FORM, ValueError, "prompt_token_ids must not be empty"),
    )


def keys_bads() -> tuple[Bad, ...]:
    """Extra keys: a batch of str UTF-8 can encode."""
    return (
        Bad("'k'", _const("k"), FORM, TypeError, "extra_keys must be a sequence of str, got str"),
        Bad("[1]", _const([1]), FORM, TypeError, "extra_keys[0] must be a str, got int"),
        Bad(
            "[surrogate]", _const(["\ud800"]), FORM, UnicodeEncodeError, "surrogates not allowed", exact=False
        ),
    )


def flag_bads(name: str) -> tuple[Bad, ...]:
    return (
        Bad("None", _const(None), FORM, TypeError, f"{name} must be a bool, got NoneType"),
        Bad("1", _const(1), FORM, TypeError, f"{name} must be a bool, got int"),
    )


def id_bads(unknown: bool = True, *, optional: bool = False) -> tuple[Bad, ...]:
    """A request id of ``PageCache``: a str or an int; ``"x"`` is held by no request. None is
    the omitted value of an ``optional`` id."""
    bads: tuple[Bad, ...] = (
        Bad("[1]", _const([1]), FORM, TypeError, "request ids must be str or int, got list"),
        Bad("1.5", _const(1.5), FORM, TypeError, "request ids must be str or int, got float"),
        Bad("surrogate", _const("\ud800"), FORM, UnicodeEncodeError, "surrogates not allowed", exact=False),
    )
    if not unknown:
        return bads
    return (*bads, Bad("unknown", _const("x"), REQUEST, UnknownRequestError, "unknown request id 'x'"))


def hashes_bads() -> tuple[Bad, ...]:
    return (
        Bad(
            "'x'", _const("x"), FORM, TypeError, "content_hashes must be a sequence of str or bytes, got str"
        ),
        Bad(
            "raw",
            _const(b"\x00" * 32),
            FORM,
            TypeError,
            "content_hashes must be a sequence of str or bytes, got bytes",
        ),
        Bad("[1]", _const([1]), FORM, TypeError, "content_hashes[0] must be a str or bytes, got int"),
        Bad(
            "[bytearray]",
            _const([bytearray(32)]),
            FORM,
            TypeError,
            "content_hashes[0] must be a str or bytes, got bytearray",
        ),
        Bad(
            "[31 bytes]",
            _const([b"\x00" * 31]),
            FORM,
            ValueError,
            "content_hashes[0] must be 32 bytes (a raw content hash), got 31 bytes",
        ),
        Bad(
            "[64 bytes]",
            _const([b"a" * 64]),
            FORM,
            ValueError,
            "content_hashes[0] must be 32 bytes (a raw content hash), got 64 bytes",
        ),
        Bad(
            "[upper]",
            _const(["A" * 64]),
            FORM,
            ValueError,
            f"content_hashes[0] must be a 64-character lowercase hex string, got {'A' * 64!r}",
        ),
    )


def match_bads(method: str) -> tuple[Bad, ...]:
    """A match: a PrefixMatch; then, against the cache, one of its number of groups whose
    real pages still hold the keys they were matched under (docs/engine-api.md, claim)."""
    return (
        Bad("None", _const(None), FORM, TypeError, "match must be a PrefixMatch, got NoneType"),
        Bad(
            "one-group",
            lambda api: api.PrefixMatch(0, [[]], [0]),
            STATE,
            ValueError,
            f"{method}: the match has 1 groups but the cache has 2",
        ),
        Bad(
            "stale",
            # Page 1 is "p"'s, holding no key: not what any match of this cache can hold.
            lambda api: api.PrefixMatch(4, [[1], [0]], [1, 0]),
            STATE,
            ValueError,
            f'{method}: stale match: page 1 of group "full" no longer holds the key it was matched under',
        ),
    )


def _args(values: list[object], params: Sequence[Param]) -> tuple[list[object], dict[str, object]]:
    """Positional and keyword arguments from the values in signature order."""
    args = [v for v, p in zip(values, params, strict=True) if not p.keyword]
    kwargs = {p.name: v for v, p in zip(values, params, strict=True) if p.keyword}
    return args, kwargs


def method(
    name: str, *params: Param, page_level: bool = False, triples: bool = False, **extra: Any
) -> Method:
    """A method of the cache called with its parameters' values."""

    def run(_api: ModuleType, cache: Any, args: list[object], kwargs: dict[str, object]) -> object:
        return getattr(cache, name)(*args, **kwargs)

    return Method(name, params, run, page_level=page_level, triples=triples, **extra)


def function(name: str, *params: Param, triples: bool = False) -> Method:
    """A module-level function (or class) of the engine's module."""

    def run(api: ModuleType, _cache: Any, args: list[object], kwargs: dict[str, object]) -> object:
        return getattr(api, name)(*args, **kwargs)

    return Method(name, params, run, triples=triples)


def _pool_method(name: str, *params: Param) -> Method:
    """A method of a pool of 8 pages with pages 1 to 3 handed out and page 1 cached as ``"k"``."""

    def run(api: ModuleType, _cache: Any, args: list[object], kwargs: dict[str, object]) -> object:
        pool = api.BlockPool(8)
        pool.allocate(3)
        pool.cache(1, "k")
        return getattr(pool, name)(*args, **kwargs)

    return Method(f"BlockPool.{name}", params, run)


def _specs(api: ModuleType) -> list[Any]:
    return [api.KVCacheSpec("full", 4, group_id="full"), api.KVCacheSpec("sliding_window", 4, 8, "swa")]


def _constructor_params(cls: str) -> tuple[Param, ...]:
    """The constructor's arguments, in signature order (``arena=`` is swept on its own in
    test_robustness_differential.py)."""
    params = [
        Param(
            "specs",
            _specs,
            (
                Bad("5", _const(5), FORM, TypeError, "specs must be a sequence of KVCacheSpec, got int"),
                Bad("[]", _const([]), FORM, ValueError, "specs must hold at least one group"),
            ),
        ),
        Param(
            "num_pages",
            _const(16),
            (
                Bad("0", _const(0), FORM, ValueError, "num_pages must be >= 1, got 0"),
                Bad("1.5", _const(1.5), FORM, TypeError, "num_pages must be an int, got float"),
            ),
        ),
        Param("enable_caching", _const(True), flag_bads("enable_caching")[:1], keyword=True),
        Param(
            "eviction_order",
            _const("hybrid"),
            (
                Bad(
                    "'x'",
                    _const("x"),
                    FORM,
                    ValueError,
                    "eviction_order must be 'hybrid' or 'group', got 'x'",
                ),
            ),
            keyword=True,
        ),
        Param("enable_kv_events", _const(False), flag_bads("enable_kv_events")[:1], keyword=True),
        Param("reuse_uncached_first", _const(True), flag_bads("reuse_uncached_first")[:1], keyword=True),
        Param("host_pages", _const(0), count_bads("host_pages")[:1], keyword=True),
        Param(
            "host_store",
            _const("write_through"),
            (
                Bad(
                    "'x'",
                    _const("x"),
                    FORM,
                    ValueError,
                    "host_store must be 'write_through' or 'evict', got 'x'",
                ),
            ),
            keyword=True,
        ),
    ]
    if cls == "FlatKVCache":
        params.append(
            Param(
                "eviction_policy",
                _const("lru"),
                (
                    Bad(
                        "'x'",
                        _const("x"),
                        FORM,
                        ValueError,
                        "eviction_policy must be 'lru' or 'reuse', got 'x'",
                    ),
                ),
                keyword=True,
            )
        )
    if cls == "PageCache":
        params.append(Param("move_state_pages", _const(True), flag_bads("move_state_pages"), keyword=True))
    return tuple(params)


def _constructor(cls: str) -> Method:
    def run(api: ModuleType, _cache: Any, args: list[object], kwargs: dict[str, object]) -> object:
        return getattr(api, cls)(*args, **kwargs)

    return Method(cls, _constructor_params(cls), run)


def _tables(_api: ModuleType) -> dict[str, Any]:
    """Buffers for ``busy_cache``'s groups, 4 rows."""
    return {"full": np.zeros((4, 8), np.int32), "swa": np.zeros((4, 3), np.int32)}


_OUT_BADS = (
    Bad("5", _const(5), FORM, TypeError, "out must be a mapping of group id to int32 array, got int"),
    Bad("{}", _const({}), FORM, ValueError, "out has no table for group", exact=False),
)

#: More tokens than request "a" (slot 0: 10 computed of 11 known) has.
_TOO_MANY = Bad(
    "[100]",
    _const([100]),
    STATE,
    ValueError,
    "schedule: num_new_tokens = 100 for request 'a' (slot 0) asks for more tokens than are known: "
    "10 computed of 11",
)

METHODS: tuple[Method, ...] = (
    # --- the token-level protocol (docs/requests-api.md) ---
    method(
        "add_request",
        Param(
            "req",
            _const("new"),
            (
                *id_bads(unknown=False),
                Bad("'a'", _const("a"), STATE, ValueError, "add_request: request 'a' already exists"),
            ),
        ),
        Param("prompt_token_ids", _const([1, 2]), prompt_bads()),
        Param("extra_keys", _const(()), keys_bads(), keyword=True),
        Param("use_prefix_cache", _const(True), flag_bads("use_prefix_cache"), keyword=True),
        triples=True,
    ),
    method(
        "admit",
        Param(
            "req",
            _const("new"),
            (
                *id_bads(unknown=False),
                Bad("'a'", _const("a"), STATE, ValueError, "admit: request 'a' already exists"),
            ),
        ),
        Param("prompt_token_ids", _const([1, 2]), prompt_bads()),
        Param("max_new_tokens", _const(1), count_bads("max_new_tokens")),
        Param("extra_keys", _const(()), keys_bads(), keyword=True),
        Param("use_prefix_cache", _const(True), flag_bads("use_prefix_cache"), keyword=True),
        triples=True,
    ),
    method(
        "schedule",
        Param("slots", _const([SLOT_A]), slots_bads("schedule")),
        Param(
            "num_new_tokens",
            _const([1]),
            (*counts_bads("num_new_tokens", "num_new_tokens has 2 entries but slots has 1"), _TOO_MANY),
        ),
        Param("lookahead", _const(0), count_bads("lookahead"), keyword=True),
        triples=True,
        # ``[1, 1]`` against a slot array whose own form is bad: lengths compare only once both
        # are read, so the form error wins (stages say so); ``'x'`` is no array to compare.
    ),
    method(
        "append_tokens",
        Param("slots", _const([SLOT_A]), slots_bads("append_tokens")),
        Param("token_ids", _const([5]), token_bads("token_ids")),
        Param(
            "num_tokens",
            _const([1]),
            (
                *counts_bads("num_tokens", "num_tokens has 2 entries but slots has 1", optional=True),
                Bad(
                    "[2]",
                    _const([2]),
                    RELATION,
                    ValueError,
                    "num_tokens adds up to 2 but token_ids has 1 entries",
                ),
            ),
        ),
        triples=True,
    ),
    method(
        "reserve",
        Param("slots", _const([SLOT_A]), slots_bads("reserve")),
        Param("tokens", _const([1]), counts_bads("tokens", "tokens has 2 entries but slots has 1")),
    ),
    method(
        "next_chunk",
        Param("slot", _const(SLOT_A), slot_bads("next_chunk")),
        Param("max_tokens", _const(5), count_bads("max_tokens")),
    ),
    method(
        "pages_needed",
        Param("num_tokens", _const(1), count_bads("num_tokens")),
        Param("slot", _const(SLOT_A), slot_bads("pages_needed", optional=True)),
    ),
    method(
        "block_tables",
        Param("slots", _const([SLOT_A]), slots_bads("block_tables")),
        Param("out", _tables, _OUT_BADS),
    ),
    method(
        "prefix_hit_tokens",
        Param("prompt_token_ids", _const([1, 2, 3, 4, 5]), token_bads("prompt_token_ids")),
        Param("extra_keys", _const(()), keys_bads(), keyword=True),
    ),
    method(
        "pages_needed_to_admit",
        Param("prompt_token_ids", _const([1, 2, 3]), token_bads("prompt_token_ids")),
        Param("num_new_tokens", _const(1), count_bads("num_new_tokens")),
        Param("reserve_tokens", _const(0), count_bads("reserve_tokens")),
        Param("extra_keys", _const(()), keys_bads(), keyword=True),
        triples=True,
    ),
    method(
        "bind_rows",
        Param(
            "tables",
            _tables,
            (
                Bad(
                    "5",
                    _const(5),
                    FORM,
                    TypeError,
                    "tables must be a mapping of group id to int32 array, got int",
                ),
            ),
        ),
        Param(
            "offsets",
            _const(None),
            (
                Bad(
                    "5",
                    _const(5),
                    FORM,
                    TypeError,
                    "offsets must be a mapping of sliding-window group id to int32 array, got int",
                    exact=False,
                ),
            ),
            keyword=True,
        ),
    ),
    # --- the page-level protocol (docs/engine-api.md) ---
    method(
        "claim",
        Param(
            "req",
            _const("new"),
            (
                *id_bads(unknown=False),
                Bad("'p'", _const(PAGE_LEVEL), STATE, ValueError, "claim: request 'p' already holds pages"),
            ),
        ),
        Param("match", lambda api: api.PrefixMatch(0, [[], []], [0, 0]), match_bads("claim")),
        page_level=True,
    ),
    method(
        "acquire",
        Param("req", _const(PAGE_LEVEL), id_bads(unknown=False)),
        Param("num_tokens", _const(1), count_bads("num_tokens")),
        page_level=True,
    ),
    method(
        "acquire_pages",
        Param("req", _const(PAGE_LEVEL), id_bads(unknown=False)),
        Param("num_tokens", _const(1), count_bads("num_tokens")),
        page_level=True,
    ),
    method(
        "register",
        Param("req", _const(PAGE_LEVEL), id_bads()),
        Param("content_hashes", _const([HASH]), hashes_bads()),
        Param(
            "first_slot",
            _const(0),
            (
                *count_bads("first_slot"),
                Bad(
                    "100",
                    _const(100),
                    STATE,
                    ValueError,
                    "register: slots [100, 101) of group 0 run past its table of 2 pages",
                ),
            ),
            keyword=True,
        ),
        Param("end_tokens", _const(None), count_bads("end_tokens")[:2], keyword=True),
        Param(
            "groups",
            _const(None),
            (
                Bad("[-1]", _const([-1]), FORM, ValueError, "groups[0] must be >= 0, got -1"),
                Bad("'x'", _const("x"), FORM, TypeError, f"groups must be a sequence of {INTS}, got str"),
                # The cache's two groups: a relation of the argument and the cache, before the request.
                Bad(
                    "[2]",
                    _const([2]),
                    RELATION,
                    ValueError,
                    "groups[0] = 2 is no group of this cache (it has 2: 0 to 1)",
                ),
                Bad("[0, 0]", _const([0, 0]), RELATION, ValueError, "groups[1] = 0 is listed twice"),
            ),
            keyword=True,
        ),
        page_level=True,
        triples=True,
    ),
    method(
        "reclaim",
        Param("req", _const(PAGE_LEVEL), id_bads()),
        Param("num_computed_tokens", _const(1), count_bads("num_computed_tokens")),
        page_level=True,
    ),
    method(
        "pages_reclaimable",
        Param("req", _const(PAGE_LEVEL), id_bads()),
        Param("num_computed_tokens", _const(1), count_bads("num_computed_tokens")),
        Param("count_uncached", _const(True), flag_bads("count_uncached"), keyword=True),
        page_level=True,
        triples=True,
    ),
    method(
        "prefill_first_chunk",
        Param(
            "req",
            _const("new"),
            (
                *id_bads(unknown=False),
                Bad(
                    "'p'",
                    _const(PAGE_LEVEL),
                    STATE,
                    ValueError,
                    "prefill_first_chunk: request 'p' already holds pages",
                ),
            ),
        ),
        Param("match", lambda api: api.PrefixMatch(0, [[], []], [0, 0]), match_bads("prefill_first_chunk")),
        Param("num_tokens", _const(1), count_bads("num_tokens")),
        page_level=True,
        triples=True,
    ),
    method(
        "prefill_chunk",
        Param("req", _const(PAGE_LEVEL), id_bads()),
        Param("content_hashes", _const([]), hashes_bads()),
        Param("num_tokens", _const(1), count_bads("num_tokens")),
        Param("num_computed_tokens", _const(1), count_bads("num_computed_tokens")),
        page_level=True,
        triples=True,
    ),
    method(
        "decode_step",
        Param("req", _const(PAGE_LEVEL), id_bads()),
        Param("content_hashes", _const([]), hashes_bads()),
        Param("first_page_slot", _const(0), count_bads("first_page_slot")),
        Param("num_tokens", _const(1), count_bads("num_tokens")),
        Param("num_computed_tokens", _const(5), count_bads("num_computed_tokens")),
        page_level=True,
        triples=True,
    ),
    Method(
        "PageCache.pages_needed",
        (
            Param("num_tokens", _const(1), count_bads("num_tokens")),
            Param("req", _const(PAGE_LEVEL), id_bads(optional=True)),
        ),
        lambda _api, c, args, kwargs: c.pages_needed(*args, **kwargs),
        page_level=True,
    ),
    Method(
        "PageCache.block_tables",
        (
            Param(
                "reqs",
                _const([PAGE_LEVEL]),
                (
                    Bad(
                        "'p'", _const("p"), FORM, TypeError, "reqs must be a sequence of request ids, got str"
                    ),
                    Bad(
                        "[None]",
                        _const([None]),
                        FORM,
                        TypeError,
                        "request ids must be str or int, got NoneType",
                    ),
                    Bad("['x']", _const(["x"]), REQUEST, UnknownRequestError, "unknown request id 'x'"),
                ),
            ),
            Param("out", _tables, _OUT_BADS),
        ),
        lambda _api, c, args, kwargs: c.block_tables(*args, **kwargs),
        page_level=True,
    ),
    # --- over an arena (docs/requests-api.md: next_chunk, state_slots) ---
    Method(
        "arena.next_chunk",
        (
            Param("slot", _const(SLOT_A), slot_bads("next_chunk")),
            Param("max_tokens", _const(5), count_bads("max_tokens")),
        ),
        lambda _api, c, args, kwargs: c.next_chunk(*args, **kwargs),
        arena=True,
    ),
    Method(
        "state_slots",
        (
            Param("slots", _const([SLOT_A]), slots_bads("state_slots")),
            Param(
                "num_new_tokens",
                _const([8]),
                (
                    *counts_bads("num_new_tokens", "num_new_tokens has 2 entries but slots has 1"),
                    Bad(
                        "[3]",
                        _const([3]),
                        STATE,
                        ValueError,
                        "state_slots: num_new_tokens 3 is not what the last schedule of request 'a' (slot 0) "
                        "gave it (its last gave 8)",
                    ),
                ),
            ),
        ),
        lambda _api, c, args, kwargs: c.state_slots(*args, **kwargs),
        arena=True,
    ),
    # --- constructors ---
    _constructor("FlatKVCache"),
    _constructor("PageCache"),
    # --- hashing, pool and match (docs/engine-api.md) ---
    function(
        "hash_page",
        Param("tokens", _const([1]), token_bads("tokens")),
        Param(
            "prior",
            _const(""),
            (
                Bad("5", _const(5), FORM, TypeError, "prior must be a str, got int"),
                Bad("'xyz'", _const("xyz"), FORM, ValueError, "prior", exact=False),
            ),
        ),
        Param("extra_keys", _const(()), keys_bads()),
        triples=True,
    ),
    function(
        "hash_pages",
        Param("token_ids", _const([1]), token_bads("token_ids")),
        Param(
            "page_size",
            _const(1),
            (
                Bad("0", _const(0), FORM, ValueError, "page_size must be > 0, got 0"),
                Bad("None", _const(None), FORM, TypeError, "page_size must be an int, got NoneType"),
            ),
        ),
        Param(
            "prior",
            _const(""),
            (Bad("5", _const(5), FORM, TypeError, "prior must be a str, got int"),),
            keyword=True,
        ),
        Param("extra_keys", _const(()), keys_bads(), keyword=True),
        triples=True,
    ),
    function(
        "group_key",
        Param(
            "content_hash",
            _const(HASH),
            (
                Bad("5", _const(5), FORM, TypeError, "content_hash must be a str, got int"),
                Bad(
                    "surrogate",
                    _const("\ud800"),
                    FORM,
                    UnicodeEncodeError,
                    "surrogates not allowed",
                    exact=False,
                ),
            ),
        ),
        Param(
            "group_index",
            _const(1),
            (
                Bad("-1", _const(-1), FORM, ValueError, "group_index = -1 does not fit in u32"),
                Bad("2**32", _const(2**32), FORM, ValueError, "group_index = 4294967296 does not fit in u32"),
                Bad("None", _const(None), FORM, TypeError, "group_index must be an int, got NoneType"),
            ),
        ),
    ),
    function(
        "fold_hashes",
        Param(
            "base_hashes",
            _const([HASH]),
            (
                Bad("'x'", _const("x"), FORM, TypeError, "base_hashes must be a sequence of str, got str"),
                Bad("[1]", _const([1]), FORM, TypeError, "base_hashes[0] must be a str, got int"),
            ),
        ),
        Param("first_base", _const(0), count_bads("first_base")),
        Param(
            "m",
            _const(1),
            (
                Bad("0", _const(0), FORM, ValueError, "m must be > 0, got 0"),
                Bad("None", _const(None), FORM, TypeError, "m must be an int, got NoneType"),
            ),
        ),
        triples=True,
    ),
    function(
        "BlockPool",
        Param(
            "num_blocks",
            _const(8),
            (
                Bad("0", _const(0), FORM, ValueError, "num_blocks must be >= 1, got 0"),
                Bad("None", _const(None), FORM, TypeError, "num_blocks must be an int, got NoneType"),
            ),
        ),
        Param("enable_caching", _const(True), flag_bads("enable_caching"), keyword=True),
        Param("reuse_uncached_first", _const(True), flag_bads("reuse_uncached_first"), keyword=True),
        triples=True,
    ),
    _pool_method(
        "cache",
        Param(
            "page",
            _const(2),
            (
                Bad("-1", _const(-1), FORM, ValueError, "page", exact=False),
                Bad("None", _const(None), FORM, TypeError, "page must be an int, got NoneType"),
                Bad("1", _const(1), STATE, ValueError, "page 1 already holds a key", exact=False),
            ),
        ),
        Param(
            "key",
            _const("k2"),
            (
                Bad("5", _const(5), FORM, TypeError, "key must be a str, got int"),
                Bad(
                    "surrogate",
                    _const("\ud800"),
                    FORM,
                    UnicodeEncodeError,
                    "surrogates not allowed",
                    exact=False,
                ),
            ),
        ),
    ),
    function(
        "PrefixMatch",
        Param("num_common_tokens", _const(0), count_bads("num_common_tokens")),
        Param(
            "pages",
            _const([[], []]),
            (
                Bad(
                    "5", _const(5), FORM, TypeError, "pages must be a sequence of page-id sequences, got int"
                ),
                Bad(
                    "[[-1]]",
                    _const([[-1]]),
                    FORM,
                    ValueError,
                    "pages[0][0] = -1 is not a page id",
                    exact=False,
                ),
            ),
        ),
        Param("num_hit_pages", _const([0, 0]), counts_bads("num_hit_pages")),
        triples=True,
    ),
)


# --- the expectation and the run ----------------------------------------------------------------


@dataclass(frozen=True)
class Combo:
    """One call of ``method`` with bad values at some arguments (by index)."""

    method: Method
    bad: tuple[tuple[int, Bad], ...]

    @property
    def label(self) -> str:
        return ", ".join(f"{self.method.params[i].name}={b.label}" for i, b in self.bad)

    def expected(self) -> tuple[int, Bad]:
        """The documented order's pick: earliest stage, then earliest argument."""
        return min(self.bad, key=lambda pair: (pair[1].stage, pair[0]))

    def call(self, api: ModuleType, cache: Any) -> object:
        values = [p.good(api) for p in self.method.params]
        for index, bad in self.bad:
            values[index] = bad.make(api)
        args, kwargs = _args(values, self.method.params)
        return self.method.run(api, cache, args, kwargs)


def combos(m: Method) -> list[Combo]:
    """Every pair of bad values at two different arguments (and every triple with
    ``m.triples``), except the pairs ``m.skip`` lists."""
    indexed = [(i, b) for i, p in enumerate(m.params) for b in p.bads]
    out = []
    sizes = (2, 3) if m.triples else (2,)
    for size in sizes:
        for chosen in itertools.combinations(indexed, size):
            if len({i for i, _ in chosen}) < size:
                continue
            labels = frozenset(f"{m.params[i].name}={b.label}" for i, b in chosen)
            if any(pair <= labels for pair in m.skip):
                continue
            out.append(Combo(m, tuple(chosen)))
    return out


def problem(combo: Combo) -> str | None:
    """What is wrong with ``combo`` on the two engines, or None."""
    got: list[Refusal] = []
    for api in ENGINES:

        def call(cache: Any, api: ModuleType = api) -> object:
            return combo.call(api, cache)

        try:
            got.append(refusal(api, call, page_level=combo.method.page_level, arena=combo.method.arena))
        except AssertionError as exc:
            return f"{api.__name__}: {exc}"
    native, reference = got
    if native != reference:
        return (
            f"native {native.kind.__name__}: {native.message!r}\n"
            f"      reference {reference.kind.__name__}: {reference.message!r}"
        )
    index, want = combo.expected()
    name = combo.method.params[index].name
    ok_kind = issubclass(native.kind, want.kind)
    ok_text = native.message == want.text if want.exact else want.text in native.message
    if not (ok_kind and ok_text):
        return (
            f"the documented order picks {name}={want.label} ({STAGES[want.stage]}): "
            f"{want.kind.__name__} {want.text!r}; both raised {native.kind.__name__}: {native.message!r}"
        )
    return None


def test_every_bad_value_alone_raises_what_the_sweep_expects() -> None:
    """Each bad value on its own (the rest good) raises the documented error on both engines:
    the single-argument base the combinations build on."""
    problems = []
    for m in METHODS:
        for index, param in enumerate(m.params):
            for bad in param.bads:
                found = problem(Combo(m, ((index, bad),)))
                if found is not None:
                    problems.append(f"{m.name}({param.name}={bad.label}): {found}")
    assert not problems, f"{len(problems)} value(s)\n" + "\n".join(problems)


@pytest.mark.parametrize("m", METHODS, ids=[m.name for m in METHODS])
def test_several_bad_arguments_follow_the_documented_order(m: Method) -> None:
    """Two (and for some calls three) bad arguments at once: both engines raise the same
    error, the one the documented order picks, and change nothing."""
    problems = []
    for combo in combos(m):
        found = problem(combo)
        if found is not None:
            problems.append(f"{m.name}({combo.label}):\n      {found}")
    assert not problems, f"{len(problems)} combination(s)\n" + "\n".join(problems)


def test_the_sweep_covers_every_call_of_two_or_more_arguments() -> None:
    """Every public call with two or more arguments of both protocols is in :data:`METHODS`."""
    names = {m.name for m in METHODS}
    wanted = {
        "add_request", "admit", "schedule", "append_tokens", "reserve", "next_chunk", "pages_needed",
        "block_tables", "prefix_hit_tokens", "pages_needed_to_admit", "bind_rows",
        "claim", "acquire", "acquire_pages", "register", "reclaim", "pages_reclaimable",
        "prefill_first_chunk", "prefill_chunk", "decode_step", "PageCache.pages_needed",
        "PageCache.block_tables",
        "FlatKVCache", "PageCache", "hash_page", "hash_pages", "group_key", "fold_hashes",
        "BlockPool", "BlockPool.cache", "PrefixMatch", "arena.next_chunk", "state_slots",
    }  # fmt: skip
    assert wanted <= names
    assert sum(len(combos(m)) for m in METHODS) >= 1000
