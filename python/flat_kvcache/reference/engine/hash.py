"""Content hashes, group keys and folding (SPEC 4).

A page's hash chains on the previous one: ``h_i = H(page_i tokens, h_{i-1}, extra_keys)`` with
``h_{-1} = ""``. Hashes are taken over base pages (the gcd of the groups' page sizes); a group
whose pages span ``m`` base pages folds each aligned run of ``m`` hashes into one, and its cache
key is that hash followed by the group index.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

from flat_kvcache.reference._checks import as_int, ceil_div, positive
from flat_kvcache.reference.engine._args import (
    HEX_DIGITS,
    U32_MAX,
    TokenIds,
    as_count,
    as_token_ids,
    batch_items,
    check_u64,
    extra_key_bytes,
)

__all__ = ["fold_hashes", "group_key", "hash_page", "hash_pages"]


def _u32(value: int) -> bytes:
    """One little-endian u32 field of the hash input."""
    return struct.pack("<I", value)


def _prior_bytes(prior: object) -> bytes:
    """The raw bytes of the previous hash: ``""`` or an even-length hex string (SPEC 4)."""
    if not isinstance(prior, str):
        raise TypeError(f"prior must be a str, got {type(prior).__name__}")
    if len(prior) % 2 != 0 or not set(prior) <= HEX_DIGITS:
        raise ValueError(f"prior must be '' or a hex string of even length, got {prior[:80]!r}")
    return bytes.fromhex(prior)


def _sha256_page(prior_raw: bytes, tokens: Sequence[int], extra_keys: Sequence[bytes]) -> str:
    """SPEC 4 layout, little-endian u32 fields: prior length, prior bytes, token count, tokens,
    then (only with extra keys) their count and each key as (byte length, bytes)."""
    parts = [_u32(len(prior_raw)), prior_raw, _u32(len(tokens))]
    parts.extend(_u32(token) for token in tokens)
    if extra_keys:
        parts.append(_u32(len(extra_keys)))
        for key in extra_keys:
            parts.append(_u32(len(key)))
            parts.append(key)
    return hashlib.sha256(b"".join(parts)).hexdigest()


def hash_page(tokens: TokenIds, prior: str = "", extra_keys: Sequence[str] = ()) -> str:
    """Content hash of one page, chained on ``prior`` (SPEC 4): lowercase hex SHA-256.

    ``h_i = H(page_i tokens, h_{i-1}, extra_keys)`` with ``h_{-1} = ""``. Extra keys (LoRA
    adapter, cache salt, multimodal hashes) separate otherwise equal token pages.
    """
    values = as_token_ids(tokens, "tokens")
    prior_raw = _prior_bytes(prior)
    keys = extra_key_bytes(extra_keys)
    return _sha256_page(prior_raw, values, keys)


def hash_pages(
    token_ids: TokenIds, page_size: int, *, prior: str = "", extra_keys: Sequence[str] = ()
) -> list[str]:
    """Chained content hashes of every full page of ``token_ids`` (SPEC 4); a partial tail is dropped.

    ``h_0 = hash_page(page_0, prior, extra_keys)``, ``h_i = hash_page(page_i, h_{i-1}, extra_keys)``.
    Every token is checked, including those of the dropped tail.
    """
    values = as_token_ids(token_ids, "token_ids")
    size = check_u64(positive(page_size, "page_size"), "page_size")
    prior_raw = _prior_bytes(prior)
    keys = extra_key_bytes(extra_keys)
    hashes: list[str] = []
    for start in range(0, len(values) - size + 1, size):
        digest = _sha256_page(prior_raw, values[start : start + size], keys)
        hashes.append(digest)
        prior_raw = bytes.fromhex(digest)
    return hashes


def group_key(content_hash: str, group_index: int) -> str:
    """The cache key of a page of group ``group_index``: the hash then 8 hex digits (SPEC 4).

    The group never enters the hash chain, so every group of a model shares one chain.
    """
    if not isinstance(content_hash, str):
        raise TypeError(f"content_hash must be a str, got {type(content_hash).__name__}")
    content_hash.encode("utf-8")  # a lone surrogate is a UnicodeEncodeError, as natively
    index = as_int(group_index, "group_index")
    if not 0 <= index <= U32_MAX:
        raise ValueError(f"group_index = {index} does not fit in u32")
    return f"{content_hash}{index:08x}"


def fold_hashes(base_hashes: Sequence[str], first_base: int, m: int) -> list[str]:
    """Fold aligned runs of ``m`` base-page hashes into one hash per page of a group (SPEC 4).

    ``base_hashes[j]`` is base page ``first_base + j``. Folding starts at the first base page
    whose index is a multiple of ``m``; each complete run folds as ``run = ""`` then
    ``run = hash_page([], run, [h])`` per hash. Incomplete runs at either end are dropped.
    With ``m == 1`` the hashes are the keys (a copy is returned).
    """
    hashes: list[str] = []
    for index, value in enumerate(batch_items(base_hashes, "base_hashes", "str")):
        if not isinstance(value, str):
            raise TypeError(f"base_hashes[{index}] must be a str, got {type(value).__name__}")
        hashes.append(value)
    for value in hashes:
        value.encode("utf-8")  # a lone surrogate is a UnicodeEncodeError, also when m == 1
    first = as_count(first_base, "first_base")
    size = check_u64(positive(m, "m"), "m")
    if size == 1:
        return hashes
    # The first aligned base page is ceil(first / m) * m; skip the hashes before it.
    offset = ceil_div(first, size) * size - first
    folded = []
    for start in range(offset, len(hashes) - size + 1, size):
        run = ""
        for base_hash in hashes[start : start + size]:
            run = hash_page([], run, [base_hash])
        folded.append(run)
    return folded
