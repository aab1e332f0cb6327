"""Slot bookkeeping shared by the token-level tests (docs/requests-api.md, "Slots").

A ``FlatKVCache`` names each live request by its slot: the lowest slot no live request holds
when the request enters. :func:`lowest_free` is that rule, written from the contract, so tests
can check the slots both engines hand out; :func:`running` adds a request and computes its
prompt; :func:`outcome_of` records what a call did (its value, or its exception class and
message) for comparing engines.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
from helpers import normalize


def lowest_free(held: Iterable[int]) -> int:
    """The slot the next request gets: the lowest one not in ``held``."""
    taken = set(held)
    slot = 0
    while slot in taken:
        slot += 1
    return slot


def running(cache: Any, req: Any, prompt: Any, **options: Any) -> int:
    """Add ``req`` with ``prompt`` and schedule its whole prompt; returns its slot."""
    slot, hit = cache.add_request(req, prompt, **options)
    assert cache.schedule([slot], [len(prompt) - hit]).tolist() == [True]
    return int(slot)


def computed(cache: Any, slots: Iterable[int]) -> list[int]:
    """``num_computed_tokens`` of each slot."""
    return [int(cache.num_computed_tokens(s)) for s in slots]


def outcome_of(call: Callable[[], Any]) -> tuple[str, Any]:
    """``("ok", normalized result)`` or ``("raise", "Class: message")`` (a ``KeyError``'s
    message is its first argument, not its quoted ``str``)."""
    try:
        return ("ok", normalize(call()))
    except Exception as exc:  # the class and message are what is compared
        text = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
        return ("raise", f"{type(exc).__name__}: {text}")


def as_slot_array(slots: list[int], kind: str) -> Any:
    """``slots`` as a list, a tuple or a numpy array of ``kind`` (``"list"``, ``"tuple"``,
    ``"int64"``, ``"uint32"``, ``"int32"``)."""
    if kind == "list":
        return list(slots)
    if kind == "tuple":
        return tuple(slots)
    return np.array(slots, dtype=np.dtype(kind))


def chunk_cut(computed: int, known: int, limit: int, grain: int | None) -> int:
    """``next_chunk``'s rule (docs/requests-api.md), spelled independently of both engines:
    everything left (at most ``limit``) without state groups (``grain`` None); with them, end
    on the last multiple of ``grain`` before the last known token when the rest fits, else on
    the last one within the limit, and do not cut when no such boundary lies ahead."""
    rest = known - computed
    take = min(rest, limit)
    if grain is None:
        return take
    last = known - 1 if rest <= limit else computed + limit
    boundaries = [b for b in range(computed + 1, last + 1) if b % grain == 0]
    return boundaries[-1] - computed if boundaries else take


def chunk_choices(computed: int, known: int, limit: int, grain: int | None) -> list[int]:
    """The chunks ``next_chunk`` (and ``admit``) may answer: :func:`chunk_cut` first, then with
    state groups every cut at a branch point (SPEC 13.5c: a multiple of ``grain`` ahead, within
    ``limit``, before the last known token), which depends on what the cache holds beyond the
    hit (hand-derived cases pin it down: tests/requests/test_next_chunk.py)."""
    first = chunk_cut(computed, known, limit, grain)
    if grain is None:
        return [first]
    branches = [b - computed for b in range(computed + 1, known) if b % grain == 0 and b - computed <= limit]
    return [first, *(n for n in branches if n != first)]


def state_grain(groups: list[tuple[str, int, int | None]]) -> int | None:
    """The snapshot grain of a machine config's groups: the lcm of the state groups' pages."""
    import math

    sizes = [size for kind, size, _ in groups if kind == "state"]
    return math.lcm(*sizes) if sizes else None
