"""Argument checks of the reference engine, one function per kind of argument.

Each check names the argument in its error, as the native extraction does: a wrong type is a
``TypeError``, a bad value a ``ValueError``. Python ints never overflow, but the native engine
counts tokens and sizes in ``u64``: a count past that is an ``OverflowError`` here too, so both
engines refuse the same inputs.
"""

from __future__ import annotations

import copy
import operator
import string
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from flat_kvcache._types import CHUNKED, KINDS, SLIDING, KVCacheSpec
from flat_kvcache.reference._checks import as_int, positive

__all__ = [
    "EVICTION_ORDERS",
    "HASH_HEX_LEN",
    "HEX_DIGITS",
    "INTS",
    "MAX_PAGES",
    "U32_MAX",
    "U64_MAX",
    "Counts",
    "RequestId",
    "SlotArray",
    "TokenIds",
    "align_down",
    "as_content_hashes",
    "as_count",
    "as_counts",
    "as_extra_keys",
    "as_flag",
    "as_group_spec",
    "as_page_ids",
    "as_pool_size",
    "as_request_id",
    "as_request_ids",
    "as_slot",
    "as_slots",
    "as_token_ids",
    "batch_items",
    "check_u64",
    "check_u64_total",
    "clipped_repr",
    "debug_str",
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
#: Slots of a token-level batch call (docs/requests-api.md "Slots"): ints or a 1-D integer array.
SlotArray = Sequence[int] | npt.NDArray[np.integer[Any]]
#: One count per entry of a batch call: ints or a 1-D integer array.
Counts = Sequence[int] | npt.NDArray[np.integer[Any]]


def check_u64(value: int, name: str) -> int:
    """Token counts and sizes are u64 in the native engine: larger is an OverflowError naming it."""
    if value > U64_MAX:
        raise OverflowError(f"{name}: value does not fit in an unsigned 64-bit integer")
    return value


def check_u64_total(value: int, what: str) -> int:
    """A sum or size the native engine computes in u64 (``what`` names it, e.g. ``"num_new_tokens +
    reserve_tokens"``): larger is its OverflowError, worded as the native core words it."""
    if value > U64_MAX:
        raise OverflowError(f"{what} does not fit in an unsigned 64-bit integer")
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


#: What an int sequence holds, as messages say it (``<name> must be a sequence of ...``).
INTS = "ints or a 1-D integer array"
#: Text and bytes: iterable, but never a batch (``b"a"`` is not the id or token 97).
_TEXT_OR_BYTES = (str, bytes, bytearray, memoryview)


def batch_items(values: object, name: str, what: str) -> Iterator[object]:
    """The items of the batch argument ``name`` (a sequence of ``what``).

    A str, bytes, bytearray or memoryview, a numpy masked array (its mask would be ignored) or
    anything ``iter()`` refuses is a TypeError naming ``name``, as the native engine says it.
    """
    if isinstance(values, np.ma.MaskedArray):
        raise TypeError(f"{name} must not be a masked array (its mask would be ignored)")
    if isinstance(values, _TEXT_OR_BYTES):
        raise TypeError(f"{name} must be a sequence of {what}, got {type(values).__name__}")
    try:
        return iter(values)  # type: ignore[call-overload,no-any-return]
    except TypeError:
        raise TypeError(f"{name} must be a sequence of {what}, got {type(values).__name__}") from None


def _cpu_tensor_numpy(values: object) -> npt.NDArray[Any] | None:
    """The numpy view of a CPU torch tensor (anything with a ``device`` whose ``type`` is
    ``"cpu"`` and a ``numpy()`` method), or None: for anything else, and for a tensor whose
    ``numpy()`` fails (its items are then read one by one), as the native engine does."""
    device = getattr(values, "device", None)
    if device is None or not hasattr(values, "numpy") or getattr(device, "type", None) != "cpu":
        return None
    try:
        view = values.numpy()
    except Exception:  # whatever numpy() raises, the tensor is read item by item
        return None
    return view if isinstance(view, np.ndarray) else None


def _int_items(values: object, name: str) -> Iterable[object]:
    """The items of an int sequence: a 1-D integer array's values (a numpy array or a CPU
    torch tensor; TypeError for another dtype or shape), or :func:`batch_items`."""
    if not isinstance(values, np.ndarray):
        view = _cpu_tensor_numpy(values)
        if view is not None:
            values = view
    if isinstance(values, np.ndarray) and not isinstance(values, np.ma.MaskedArray):
        # numpy counts timedelta64 among its integers; it is no token or count (dtype kind "m").
        if values.ndim != 1 or values.dtype.kind not in "iu":
            raise TypeError(
                f"{name} must be a 1-D integer array, got a {values.ndim}-D array of dtype {values.dtype}"
            )
        items: list[object] = values.tolist()
        return items
    return batch_items(values, name, INTS)


def clipped_repr(value: object) -> str:
    """``repr(value)`` cut to its first 80 characters, as messages show a bad value."""
    return repr(value)[:80]


def as_token_ids(tokens: object, name: str) -> list[int]:
    """Token ids as Python ints, each checked to fit u32 (ValueError names ``name[i]``)."""
    values = []
    for index, item in enumerate(_int_items(tokens, name)):
        value = as_int(item, f"{name}[{index}]")
        if not 0 <= value <= U32_MAX:
            raise ValueError(f"{name}[{index}] = {value} does not fit in u32")
        values.append(value)
    return values


def as_extra_keys(extra_keys: object) -> list[str]:
    """Extra keys: a sequence of str (see :func:`batch_items`), each one UTF-8 can encode
    (a lone surrogate is a UnicodeEncodeError)."""
    keys: list[str] = []
    for index, key in enumerate(batch_items(extra_keys, "extra_keys", "str")):
        if not isinstance(key, str):
            raise TypeError(f"extra_keys[{index}] must be a str, got {type(key).__name__}")
        key.encode("utf-8")
        keys.append(key)
    return keys


def extra_key_bytes(extra_keys: object) -> list[bytes]:
    """The UTF-8 bytes of each extra key (:func:`as_extra_keys`)."""
    return [key.encode("utf-8") for key in as_extra_keys(extra_keys)]


def as_content_hashes(content_hashes: object) -> list[str]:
    """Base-page content hashes as 64-character lowercase hex strings: each given as such a
    string or as its 32 raw bytes (a ``bytes``, the same hash), ValueError naming
    ``content_hashes[i]`` otherwise (uppercase is refused because folding hashes the text)."""
    hashes: list[str] = []
    for index, value in enumerate(batch_items(content_hashes, "content_hashes", "str or bytes")):
        if isinstance(value, bytes):
            if len(value) != HASH_HEX_LEN // 2:
                raise ValueError(
                    f"content_hashes[{index}] must be {HASH_HEX_LEN // 2} bytes (a raw content hash), "
                    f"got {len(value)} bytes"
                )
            hashes.append(value.hex())
            continue
        if not isinstance(value, str):
            raise TypeError(f"content_hashes[{index}] must be a str or bytes, got {type(value).__name__}")
        if len(value) != HASH_HEX_LEN or not set(value) <= _LOWER_HEX_DIGITS:
            raise ValueError(
                f"content_hashes[{index}] must be a {HASH_HEX_LEN}-character lowercase hex string, "
                f"got {value[:80]!r}"
            )
        hashes.append(value)
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
    ids = []
    for index, item in enumerate(_int_items(values, name)):
        value = as_int(item, f"{name}[{index}]")
        if not 0 <= value < MAX_PAGES:
            raise ValueError(f"{name}[{index}] = {value} is not a page id (0 <= id < {MAX_PAGES})")
        ids.append(value)
    return ids


def as_counts(values: object, name: str) -> list[int]:
    """One count per entry: a sequence of ints or a 1-D integer numpy array."""
    return [as_count(item, f"{name}[{index}]") for index, item in enumerate(_int_items(values, name))]


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


def as_request_ids(reqs: object) -> list[RequestId]:
    """The ids of a batch call: a sequence of request ids (see :func:`batch_items`: text and
    bytes are refused, never split into characters or byte values)."""
    return [as_request_id(req) for req in batch_items(reqs, "reqs", "request ids")]


def as_slot(value: object) -> int:
    """The slot argument of a one-slot call: a count named ``slot`` (TypeError / ValueError /
    OverflowError naming it)."""
    return as_count(value, "slot")


def as_slots(values: object) -> list[int]:
    """The slots of a batch call: counts named ``slots[i]`` (a str, bytes or masked array is
    a TypeError naming ``slots``)."""
    return as_counts(values, "slots")


def debug_str(text: str) -> str:
    """``text`` quoted as the native engine's messages quote a str (Rust's ``{:?}``): in double
    quotes, with backslashes, double quotes and control characters escaped."""
    escapes = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t", "\0": "\\0"}
    out = []
    for char in text:
        if char in escapes:
            out.append(escapes[char])
        elif not char.isprintable() and char != " ":
            out.append(f"\\u{{{ord(char):x}}}")
        else:
            out.append(char)
    return '"' + "".join(out) + '"'


def _kind_choices() -> str:
    """The engine kinds as messages list them: ``'full', 'sliding_window', 'state' or ...``."""
    quoted = [f"'{kind}'" for kind in KINDS]
    return quoted[-1] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"


def as_group_spec(index: int, spec: object) -> KVCacheSpec:
    """``specs[index]``, read field by field as the native engine reads it (a frozen
    ``KVCacheSpec`` can still be changed with ``object.__setattr__``, so its fields are checked
    again): a ``KVCacheSpec``; ``kind`` a str; ``page_size`` an int > 0; ``sliding_window`` and
    ``chunk_size`` None or a count; then the kind with its window and chunk (a known kind first;
    a ``chunked_local`` group needs a chunk >= 1 and no window; another kind no chunk; a sliding
    group a window >= 1, the others none); then ``group_id`` a str or None. Returns a copy with
    the checked values. That the chunk is a multiple of the page size is the coordinator's check.
    """
    name = f"specs[{index}]"
    if not isinstance(spec, KVCacheSpec):
        raise TypeError(f"{name} must be a KVCacheSpec, got {type(spec).__name__}")
    kind = spec.kind
    if not isinstance(kind, str):
        raise TypeError(f"{name}.kind must be a str, got {type(kind).__name__}")
    page_size = check_u64(positive(spec.page_size, f"{name}.page_size"), f"{name}.page_size")
    window_obj: object = spec.sliding_window
    window = None if window_obj is None else as_count(window_obj, f"{name}.sliding_window")
    chunk_obj: object = spec.chunk_size
    chunk = None if chunk_obj is None else as_count(chunk_obj, f"{name}.chunk_size")
    kind.encode("utf-8")
    if kind not in KINDS:
        raise ValueError(f"{name}.kind must be {_kind_choices()}, got {debug_str(kind[:80])}")
    if kind == CHUNKED:
        if chunk is None or chunk == 0:
            raise ValueError(f"{name}.chunk_size must be an int >= 1 for a {kind} group, got {chunk_obj}")
        if window is not None:
            raise ValueError(f"{name}.sliding_window must be None for a {kind} group, got {window_obj}")
    elif chunk is not None:
        raise ValueError(f"{name}.chunk_size must be None for a {kind} group, got {chunk_obj}")
    elif kind == SLIDING:
        if window is None or window == 0:
            raise ValueError(
                f"{name}.sliding_window must be an int >= 1 for a {kind} group, got {window_obj}"
            )
    elif window is not None:
        raise ValueError(f"{name}.sliding_window must be None for a {kind} group, got {window_obj}")
    group_id: object = spec.group_id
    if group_id is not None and not isinstance(group_id, str):
        raise TypeError(f"{name}.group_id must be a str or None, got {type(group_id).__name__}")
    if group_id is not None:
        group_id.encode("utf-8")  # a lone surrogate is a UnicodeEncodeError, as natively
    checked = copy.copy(spec)
    for field, value in (("page_size", page_size), ("sliding_window", window), ("chunk_size", chunk)):
        object.__setattr__(checked, field, value)
    return checked
