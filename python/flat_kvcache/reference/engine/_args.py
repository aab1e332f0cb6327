"""Argument checks of the reference engine, one function per kind of argument.

Each check names the argument in its error, as the native extraction does: a wrong type is a
``TypeError``, a bad value a ``ValueError``. Python ints never overflow, but the native engine
counts tokens and sizes in ``u64``: a count past that is an ``OverflowError`` here too, so both
engines refuse the same inputs.
"""

from __future__ import annotations

import operator
import string
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from flat_kvcache.reference._checks import as_int

__all__ = [
    "EVICTION_ORDERS",
    "HASH_HEX_LEN",
    "HEX_DIGITS",
    "MAX_PAGES",
    "U32_MAX",
    "U64_MAX",
    "RequestId",
    "TokenIds",
    "align_down",
    "as_content_hashes",
    "as_count",
    "as_counts",
    "as_flag",
    "as_page_ids",
    "as_pool_size",
    "as_request_id",
    "as_request_ids",
    "as_token_ids",
    "check_u64",
    "extra_key_bytes",
]

#: Largest value of a little-endian u32 field of the hash input (SPEC 4).
U32_MAX = 0xFFFF_FFFF
#: Largest token count or size the native engine holds (it counts tokens in u64).
U64_MAX = 0xFFFF_FFFF_FFFF_FFFF
#: Most pages a pool may hold: block tables carry page ids as int32 (SPEC 8).
MAX_PAGES = 2**31 - 1
#: How ``FlatKVCache.free`` orders a request's pages on the free list (docs/requests-api.md).
EVICTION_ORDERS = ("hybrid", "group")
#: Length of a hex-encoded SHA-256 content hash.
HASH_HEX_LEN = 64
#: Characters of a hex string, either case (a ``prior`` hash may be uppercase).
HEX_DIGITS = frozenset(string.hexdigits)
#: Content hashes are lowercase: folding hashes their text, so "AB" and "ab" would fold apart.
_LOWER_HEX_DIGITS = frozenset("0123456789abcdef")

#: A request id: ``5`` and ``"5"`` are different requests.
RequestId = str | int
#: Token ids: a sequence of ints or a 1-D numpy integer array.
TokenIds = Sequence[int] | npt.NDArray[np.integer[Any]]


def check_u64(value: int, name: str) -> int:
    """Token counts and sizes are u64 in the native engine: larger is an OverflowError naming it."""
    if value > U64_MAX:
        raise OverflowError(f"{name}: value does not fit in an unsigned 64-bit integer")
    return value


def as_count(value: object, name: str) -> int:
    """A count argument: an int >= 0 that fits u64 (TypeError / ValueError / OverflowError)."""
    number = as_int(value, name)
    if number < 0:
        raise ValueError(f"{name} must be >= 0, got {number}")
    return check_u64(number, name)


def as_pool_size(value: object, name: str) -> int:
    """A pool size in pages, null page included: an int in ``[1, MAX_PAGES]`` (page ids are int32)."""
    total = check_u64(as_int(value, name), name)
    if total < 1:
        raise ValueError(f"{name} must be >= 1, got {total}")
    if total > MAX_PAGES:
        raise ValueError(f"{name} must be <= {MAX_PAGES} (page ids are int32), got {total}")
    return total


def as_flag(value: object, name: str) -> bool:
    """A switch: a real bool (TypeError otherwise, as the native extraction does)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def align_down(value: int, multiple: int) -> int:
    """``value`` rounded down to a multiple of ``multiple``."""
    return value - value % multiple


def as_token_ids(tokens: object, name: str) -> list[int]:
    """Token ids as Python ints, each checked to fit u32 (ValueError names ``name[i]``)."""
    if isinstance(tokens, np.ndarray):
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise TypeError(
                f"{name} must be a 1-D integer array, got a {tokens.ndim}-D array of dtype {tokens.dtype}"
            )
        items: list[object] = tokens.tolist()
    elif isinstance(tokens, (str, bytes)):
        raise TypeError(f"{name} must be a sequence of ints, got {type(tokens).__name__}")
    elif isinstance(tokens, Iterable):
        items = list(tokens)
    else:
        raise TypeError(f"{name} must be a sequence of ints, got {type(tokens).__name__}")
    values = []
    for index, item in enumerate(items):
        value = as_int(item, f"{name}[{index}]")
        if not 0 <= value <= U32_MAX:
            raise ValueError(f"{name}[{index}] = {value} does not fit in u32")
        values.append(value)
    return values


def extra_key_bytes(extra_keys: object) -> list[bytes]:
    """The UTF-8 bytes of each extra key; a bare str is refused (it is not a sequence of keys)."""
    if isinstance(extra_keys, str):
        raise TypeError("extra_keys must be a sequence of str, not a bare str")
    if not isinstance(extra_keys, Iterable):
        raise TypeError(f"extra_keys must be a sequence of str, got {type(extra_keys).__name__}")
    encoded = []
    for index, key in enumerate(extra_keys):
        if not isinstance(key, str):
            raise TypeError(f"extra_keys[{index}] must be a str, got {type(key).__name__}")
        encoded.append(key.encode("utf-8"))
    return encoded


def as_content_hashes(content_hashes: object) -> list[str]:
    """Base-page content hashes: 64-character lowercase hex strings (ValueError naming
    ``content_hashes[i]``; uppercase is refused because folding hashes the text)."""
    if isinstance(content_hashes, str):
        raise TypeError("content_hashes must be a sequence of str, not a bare str")
    if not isinstance(content_hashes, Iterable):
        raise TypeError(f"content_hashes must be a sequence of str, got {type(content_hashes).__name__}")
    hashes = list(content_hashes)
    for index, value in enumerate(hashes):
        if not isinstance(value, str):
            raise TypeError(f"content_hashes[{index}] must be a str, got {type(value).__name__}")
        if len(value) != HASH_HEX_LEN or not set(value) <= _LOWER_HEX_DIGITS:
            raise ValueError(
                f"content_hashes[{index}] must be a {HASH_HEX_LEN}-character lowercase hex string, "
                f"got {value[:80]!r}"
            )
    return hashes


#: Characters (or digits) of a request id that messages show, as the native engine does.
SHOWN_ID_LIMIT = 80


def shown_id(key: RequestId) -> str:
    """A request id as messages show it: ``repr`` of its first 80 characters (a str) or
    digits (an int, sign included), then ``...`` when it was cut."""
    text = key if isinstance(key, str) else str(key)
    cut = text[:SHOWN_ID_LIMIT]
    more = "..." if len(text) > SHOWN_ID_LIMIT else ""
    return (repr(cut) if isinstance(key, str) else cut) + more


def as_page_ids(values: object, name: str) -> list[int]:
    """Page ids of a hand-built match: ints in ``[0, 2**31 - 1)`` (ValueError naming ``name[i]``)."""
    if isinstance(values, np.ndarray):
        if values.ndim != 1 or not np.issubdtype(values.dtype, np.integer):
            raise TypeError(
                f"{name} must be a 1-D integer array, got a {values.ndim}-D array of dtype {values.dtype}"
            )
        values = values.tolist()
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise TypeError(f"{name} must be a sequence of ints, got {type(values).__name__}")
    ids = []
    for index, item in enumerate(values):
        value = as_int(item, f"{name}[{index}]")
        if not 0 <= value < MAX_PAGES:
            raise ValueError(f"{name}[{index}] = {value} is not a page id (0 <= id < {MAX_PAGES})")
        ids.append(value)
    return ids


def as_counts(values: object, name: str) -> list[int]:
    """One count per entry: a sequence of ints or a 1-D integer numpy array."""
    if isinstance(values, np.ndarray):
        if values.ndim != 1 or not np.issubdtype(values.dtype, np.integer):
            raise TypeError(
                f"{name} must be a 1-D integer array, got a {values.ndim}-D array of dtype {values.dtype}"
            )
        items: list[object] = values.tolist()
    elif isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise TypeError(f"{name} must be a sequence of ints, got {type(values).__name__}")
    else:
        items = list(values)
    return [as_count(item, f"{name}[{index}]") for index, item in enumerate(items)]


def as_request_id(req: object) -> RequestId:
    """A request id: a str, or an int of any size (``5`` and ``"5"`` differ); else TypeError.
    A str that UTF-8 cannot encode (a lone surrogate) raises ``UnicodeEncodeError``, as the
    native engine does."""
    if isinstance(req, str):
        req.encode("utf-8")
        return req
    if isinstance(req, bool):
        raise TypeError("request ids must be str or int, got bool")
    try:
        return operator.index(req)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"request ids must be str or int, got {type(req).__name__}") from None


def as_request_ids(reqs: Iterable[object]) -> list[RequestId]:
    """The ids of a batch call: a sequence of request ids (a bare str is refused, not split)."""
    if isinstance(reqs, (str, bytes)):
        raise TypeError("reqs must be a sequence of request ids, not a bare str")
    return [as_request_id(req) for req in reqs]
