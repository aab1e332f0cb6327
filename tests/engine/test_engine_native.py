"""Smoke tests of the native page engine (``flat_kvcache._native`` through ``flat_kvcache.engine``).

Native only: imports, basic operations, error classes, a thread-safety hammer, the flat block
table arrays, and the build-flag behaviour. The cross-checks against the reference live in the
other ``test_engine_*`` files.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import flat_kvcache
import flat_kvcache.reference
import numpy as np
import pytest
from flat_kvcache import _native
from flat_kvcache.engine import (
    BlockPool,
    KVCacheSpec,
    PageCache,
    PrefixMatch,
    fold_hashes,
    group_key,
    hash_page,
    hash_pages,
)
from helpers import native_page_hybrid


def manual_hash(tokens: list[int], prior: str = "", extra: tuple[str, ...] = ()) -> str:
    """SPEC 4 byte layout built field by field with hashlib."""
    raw = bytes.fromhex(prior)
    data = struct.pack("<I", len(raw)) + raw + struct.pack("<I", len(tokens))
    data += b"".join(struct.pack("<I", t) for t in tokens)
    if extra:
        data += struct.pack("<I", len(extra))
        for key in extra:
            encoded = key.encode()
            data += struct.pack("<I", len(encoded)) + encoded
    return hashlib.sha256(data).hexdigest()


# ----- import and hashing -------------------------------------------------------------------------


def test_public_names_are_the_native_objects() -> None:
    assert flat_kvcache.PageCache is _native.PageCache
    assert flat_kvcache.FlatKVCache is _native.FlatKVCache
    assert flat_kvcache.hash_pages is _native.hash_pages
    for name in ("BlockPool", "FlatKVCache", "PageCache", "KVCacheSpec", "PrefixMatch", "kv_cache_specs"):
        assert name in flat_kvcache.engine.__all__


def test_hashes_follow_the_spec_layout() -> None:
    assert hash_page([1, 2, 3]) == manual_hash([1, 2, 3])
    expected = manual_hash([0, 2**32 - 1], "abcd", ("lora", "é"))
    assert hash_page([0, 2**32 - 1], "ABcd", ["lora", "é"]) == expected
    tokens = list(range(37))
    hashes = hash_pages(tokens, 8, extra_keys=["salt"])
    assert len(hashes) == 4
    prior = ""
    for i, h in enumerate(hashes):
        assert h == manual_hash(tokens[i * 8 : (i + 1) * 8], prior, ("salt",))
        prior = h
    for dtype in (np.int64, np.uint32, np.int16, np.uint8):
        assert hash_pages(np.arange(37, dtype=dtype), 8, extra_keys=["salt"]) == hashes
    assert hash_pages(np.arange(74)[::2] // 2, 8, extra_keys=("salt",)) == hashes  # strided view


def test_group_key_and_fold() -> None:
    assert group_key("ab", 0x1F) == "ab0000001f"
    hashes = hash_pages(list(range(64)), 4)  # 16 base pages
    folded = fold_hashes(hashes, 1, 4)  # skip 3, runs [4..8), [8..12), [12..16)
    assert len(folded) == 3
    run = ""
    for h in hashes[3:7]:
        run = manual_hash([], run, (h,))
    assert folded[0] == run
    assert fold_hashes(hashes, 5, 1) == hashes
    assert fold_hashes(hashes[:2], 0, 3) == []


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: hash_page([-1]), ValueError, r"tokens\[0\] = -1 does not fit in u32"),
        (lambda: hash_page([1, 2**32]), ValueError, r"tokens\[1\] = 4294967296"),
        (lambda: hash_pages([1, 2**40], 1), ValueError, r"token_ids\[1\]"),
        (lambda: hash_page("abc"), TypeError, "tokens"),  # type: ignore[arg-type]
        (lambda: hash_page(np.zeros((2, 2), dtype=np.int32)), TypeError, "1-D"),
        (lambda: hash_page(np.zeros(2, dtype=np.float32)), TypeError, "integer"),
        (lambda: hash_page([1], "abc"), ValueError, "prior"),
        (lambda: hash_page([1], "zz"), ValueError, "prior"),
        (lambda: hash_page([1], extra_keys="abc"), TypeError, "extra_keys"),
        (lambda: hash_page([1], extra_keys=[1]), TypeError, r"extra_keys\[0\]"),  # type: ignore[list-item]
        (lambda: hash_pages([1], 0), ValueError, "page_size"),
        (lambda: group_key("a", 2**32), ValueError, "group_index"),
        (lambda: group_key("a", -1), ValueError, "group_index"),
        (lambda: fold_hashes(["a"], 0, 0), ValueError, "m"),
        (lambda: fold_hashes(["a"], -1, 2), ValueError, "first_base"),
    ],
)
def test_hashing_errors_name_their_argument(call: object, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        call()  # type: ignore[operator]


# ----- BlockPool ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        ((4, [[-1]], [1]), ValueError, r"pages\[0\]\[0\] = -1 is not a page id"),
        ((4, [[1, 2**31 - 1]], [2]), ValueError, r"pages\[0\]\[1\] = 2147483647 is not a page id"),
        ((4, [[1], [2**80]], [1, 1]), ValueError, r"pages\[1\]\[0\] = \d+ is not a page id"),
        ((4, [np.array([1, -2])], [1]), ValueError, r"pages\[0\]\[1\] = -2 is not a page id"),
        ((4, [[1.5]], [1]), TypeError, r"pages\[0\]\[0\] must be an int"),
        ((4, [[True]], [1]), TypeError, r"pages\[0\]\[0\] must be an int, not bool"),
        ((4, [np.array([1.0])], [1]), TypeError, r"pages\[0\] must be a 1-D integer array"),
        ((4, "ab", [1]), TypeError, "pages must be a sequence of page-id sequences"),
        ((4, [[1]], [-1]), ValueError, r"num_hit_pages\[0\] must be >= 0, got -1"),
        ((4, [[1]], [2**64]), OverflowError, r"num_hit_pages\[0\]"),
        ((-1, [[1]], [1]), ValueError, "num_common_tokens must be >= 0, got -1"),
    ],
)
def test_hand_built_prefix_match_names_the_bad_argument(
    args: tuple[object, object, object], error: type[Exception], match: str
) -> None:
    """Page ids are int32 table entries: anything outside [0, 2**31 - 1) is a ValueError naming
    the element, whatever its size (never an OverflowError from a failed u32 conversion), and
    the reference says exactly the same."""
    with pytest.raises(error, match=match) as native:
        PrefixMatch(*args)  # type: ignore[arg-type]
    with pytest.raises(error) as reference:
        flat_kvcache.reference.PrefixMatch(*args)  # type: ignore[arg-type]
    assert str(native.value) == str(reference.value)
    # Arrays and tuples are accepted like lists.
    from_arrays: Callable[..., PrefixMatch] = PrefixMatch  # typed for arrays, which it also takes
    assert from_arrays(4, (np.array([1, 0, 3]),), np.array([2])) == PrefixMatch(4, [[1, 0, 3]], [2])


def test_block_pool_basics_and_misuse() -> None:
    pool = BlockPool(6)
    assert (pool.num_blocks, pool.num_free) == (6, 5)
    assert pool.allocate(2) == [1, 2]
    assert pool.allocate(9) == []
    pool.cache(1, "k")
    pool.free([1, 2])  # reverse: 2 then 1 to the back
    assert pool.lookup("k") == 1
    assert (pool.num_cached, pool.num_cached_free, pool.num_cached_pinned) == (1, 1, 0)
    pool.touch(1)
    assert pool.ref_count(1) == 1 and pool.num_cached_pinned == 1
    with pytest.raises(ValueError, match="page 7 is out of range"):
        pool.touch(7)
    with pytest.raises(ValueError, match="page -1"):
        pool.free([-1])
    with pytest.raises(ValueError):
        pool.free([1, 1])  # count 1, released twice: nothing changes
    assert pool.ref_count(1) == 1
    with pytest.raises(ValueError, match="already holds a key"):
        pool.cache(1, "other")
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)
    assert repr(pool) == "BlockPool(num_blocks=6, num_free=4, num_cached=1)"


# ----- PageCache --------------------------------------------------------------------------------


def test_prefill_decode_free_and_prefix_reuse() -> None:
    cache = native_page_hybrid()
    assert (cache.base_page_size, cache.lcm_page_size, cache.group_ids) == (4, 4, ["full", "swa"])
    hashes = hash_pages(list(range(16)), 4)
    empty = cache.match_prefix(hashes)
    assert empty.num_common_tokens == 0
    assert cache.prefill_first_chunk("a", empty, 16)
    assert cache.decode_step("a", hashes, 0, 1, 16)
    # (16 - 8 + 1) // 4 = 2 slid-out sliding pages became holes.
    assert cache.page_ids("a")[1][:2] == [0, 0]
    assert cache.tail_available("a") == [3, 3]
    cache.check_invariants()
    cache.free("a")
    match = cache.match_prefix(hashes)
    assert match.num_common_tokens == 16
    assert match.num_hit_pages == [4, 2]
    assert match == PrefixMatch(match.num_common_tokens, match.pages, match.num_hit_pages)
    assert cache.pages_consumed_by_claim(match) == 6
    assert cache.prefill_first_chunk(7, match, 1)
    assert cache.page_ids(7)[0][:4] == match.pages[0]
    cache.check_invariants()
    assert cache.pool_stats()["num_cached_pinned"] == 6
    assert "PageCache(group_ids=['full', 'swa']" in repr(cache)


def test_request_ids_str_int_and_big_int_are_distinct() -> None:
    cache = native_page_hybrid()
    big = 10**40
    ids: tuple[object, ...] = (5, "5", big, -big, np.int64(6))
    for req in ids:
        assert cache.acquire(req, 4)  # type: ignore[arg-type]
    assert cache.num_requests == 5
    assert cache.has_request(6) and cache.has_request(big) and not cache.has_request(str(big))
    assert cache.page_ids(5) != cache.page_ids("5")
    for bad in (5.0, None, b"5", (5,), True):
        with pytest.raises(TypeError, match="request ids"):
            cache.acquire(bad, 1)  # type: ignore[arg-type]
    with pytest.raises(KeyError):
        cache.free("missing")
    with pytest.raises(KeyError):
        cache.decode_step(99, [], 0, 1, 0)


def test_argument_errors_change_nothing() -> None:
    cache = native_page_hybrid(8)
    assert cache.acquire("a", 8)
    before = (cache.page_ids("a"), cache.pool_stats())
    with pytest.raises(ValueError, match=r"content_hashes\[0\]"):
        cache.register("a", ["xyz"])
    with pytest.raises(ValueError, match="num_tokens"):
        cache.acquire("a", -1)
    with pytest.raises(TypeError, match="num_tokens"):
        cache.acquire("a", 1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="run past its table"):
        cache.register("a", hash_pages(list(range(12)), 4))
    assert not cache.acquire("a", 64)  # not enough pages: all or nothing
    with pytest.raises(ValueError, match="already hold"):
        cache.claim("a", cache.match_prefix([]))
    assert (cache.page_ids("a"), cache.pool_stats()) == before
    with pytest.raises(ValueError):
        PageCache([], 8)
    with pytest.raises(TypeError, match="KVCacheSpec"):
        PageCache([object()], 8)  # type: ignore[list-item]
    with pytest.raises(ValueError, match=r"distinct|more than once"):
        PageCache([KVCacheSpec("full", 4, group_id="x"), KVCacheSpec("state", 4, group_id="x")], 8)
    with pytest.raises(OverflowError, match="specs"):
        PageCache([KVCacheSpec("full", 2**63 - 25), KVCacheSpec("full", 2**63 - 49)], 8)
    with pytest.raises(ValueError, match="sliding_window"):
        KVCacheSpec("sliding_window", 4)


def test_caching_off_matches_and_registers_nothing() -> None:
    cache = native_page_hybrid(enable_caching=False)
    hashes = hash_pages(list(range(16)), 4)
    assert cache.acquire("a", 16)
    cache.register("a", hashes, end_tokens=16)
    assert cache.pool_stats()["num_cached"] == 0
    match = cache.match_prefix(hashes)
    assert (match.num_common_tokens, match.pages, match.num_hit_pages) == (0, [[], []], [0, 0])


# ----- flat block tables and the build flag -------------------------------------------------------


@pytest.mark.flag
def test_block_tables_dtype_shape_holes_and_padding() -> None:
    cache = native_page_hybrid()
    assert cache.acquire("long", 20)
    assert cache.acquire("short", 4)
    cache.reclaim("long", 20)  # (20 - 7) // 4 = 3 slots slid out
    if not flat_kvcache.FLAT_KVCACHE:
        with pytest.raises(RuntimeError, match="compiled without the `flat` cargo feature"):
            cache.block_tables(["long"])
        return
    tables = cache.block_tables(["short", "long", "short"])
    assert list(tables) == ["full", "swa"]
    swa = tables["swa"]
    assert swa.dtype == np.int32 and swa.shape == (3, 5)
    assert swa.flags.writeable and swa.flags.c_contiguous
    assert swa[1].tolist() == cache.page_ids("long")[1]
    assert swa[1, :3].tolist() == [0, 0, 0]
    assert swa[0, 1:].tolist() == [-1, -1, -1, -1]
    assert (swa[0] == swa[2]).all()
    empty = cache.block_tables([])
    assert all(a.shape == (0, 0) and a.dtype == np.int32 for a in empty.values())
    with pytest.raises(KeyError):
        cache.block_tables(["short", "nope"])


# ----- threads ------------------------------------------------------------------------------------


def test_threads_share_one_cache_safely() -> None:
    """Many threads drive their own requests through one cache; accounting must balance."""
    cache = native_page_hybrid(num_pages=512)
    prompt = hash_pages(list(range(64)), 4)

    def worker(t: int) -> int:
        done = 0
        for i in range(40):
            req = f"t{t}-{i}"
            match = cache.match_prefix(prompt)
            if not cache.prefill_first_chunk(req, match, 64 - match.num_common_tokens):
                cache.free(req)
                continue
            computed = 64
            for _ in range(6):
                if not cache.decode_step(req, prompt, 0, 1, computed):
                    break
                computed += 1
            if flat_kvcache.FLAT_KVCACHE:
                cache.block_tables([req])
            cache.free(req)
            done += 1
        return done

    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(worker, range(8)))
    assert sum(results) > 0
    cache.check_invariants()
    stats = cache.pool_stats()
    assert cache.num_requests == 0
    assert stats["num_free"] == stats["num_blocks"] - 1
    assert stats["num_cached_pinned"] == 0


def test_threads_share_one_block_pool_safely() -> None:
    pool = BlockPool(257)

    def worker(t: int) -> None:
        for i in range(200):
            pages = pool.allocate(1 + (i + t) % 4)
            for page in pages:
                if (page + i) % 3 == 0:
                    pool.cache(page, f"{t}-{i}-{page}")
            pool.free(pages)

    with ThreadPoolExecutor(max_workers=8) as executor:
        list(executor.map(worker, range(8)))
    assert pool.num_free == 256
    assert pool.num_cached_pinned == 0
