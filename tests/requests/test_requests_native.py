"""Native-only tests of the token-level scheduler API (docs/requests-api.md).

What the stateful cross-check against the reference cannot see: ``block_tables(out=...)``
writes the caller's numpy array / torch tensor in place (same memory, right values, rows past
the slots untouched), argument errors name their argument, a thread hammer on one shared
cache (each thread by its own slots), KV events as ``flat_kvcache.events`` dataclasses, and
the build-flag behaviour.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import flat_kvcache
import numpy as np
import pytest
from flat_kvcache._types import CacheStats
from flat_kvcache.engine import hash_pages
from flat_kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored
from helpers import native_hybrid, native_page_hybrid, need
from slots import running

needs_flat = pytest.mark.skipif(not flat_kvcache.FLAT_KVCACHE, reason="built without the `flat` feature")

GROUPS = ("full", "swa")


def buffers(rows: int, cols: int, fill: int = 7) -> dict[str, np.ndarray]:
    return {g: np.full((rows, cols), fill, dtype=np.int32) for g in GROUPS}


# ----- block_tables(out=...) writes the caller's buffers in place -------------------------------


@needs_flat
def test_out_numpy_is_written_in_place() -> None:
    cache = native_hybrid()
    a = running(cache, "a", list(range(20)))
    b = running(cache, "b", list(range(100, 105)))
    assert (a, b) == (0, 1)
    cache.append_tokens([a], [20])
    assert cache.schedule([a], [1]).all()  # the sliding window slides: holes in a's swa row
    out = buffers(4, 9)
    views = {g: out[g] for g in GROUPS}
    pointers = {g: out[g].__array_interface__["data"][0] for g in GROUPS}
    result = cache.block_tables(np.array([b, a, b]), out=out)
    assert result is out
    expected = cache.block_tables([b, a, b])
    for g in GROUPS:
        assert out[g] is views[g] and out[g].__array_interface__["data"][0] == pointers[g]
        assert np.shares_memory(result[g], views[g])
        width = expected[g].shape[1]
        np.testing.assert_array_equal(out[g][:3, :width], expected[g])
        assert (out[g][:3, width:] == -1).all()
        assert (out[g][3] == 7).all(), "rows past len(reqs) are untouched"
    assert (out["swa"][1, :3] == 0).all() and (out["swa"][1, 3:6] > 0).all()


@needs_flat
@pytest.mark.torch
def test_out_torch_cpu_tensor_is_written_in_place() -> None:
    torch = need("torch")
    cache = native_hybrid()
    slot = running(cache, "a", list(range(13)))
    out = {g: torch.full((2, 6), 7, dtype=torch.int32) for g in GROUPS}
    ptrs = {g: out[g].data_ptr() for g in GROUPS}
    assert cache.block_tables([slot], out=out) is out
    ids = cache.page_ids(slot)
    for index, g in enumerate(GROUPS):
        assert out[g].data_ptr() == ptrs[g]
        assert out[g][0].tolist() == ids[index] + [-1] * (6 - len(ids[index]))
        assert out[g][1].tolist() == [7] * 6
    # A tensor that is not C-contiguous (a transposed view) is refused by name.
    bad = {"full": torch.zeros((6, 2), dtype=torch.int32).t(), "swa": out["swa"]}
    with pytest.raises(ValueError, match=r"out\['full'\] must be C-contiguous"):
        cache.block_tables([slot], out=bad)
    wrong = {"full": out["full"], "swa": torch.zeros((2, 6), dtype=torch.int64)}
    with pytest.raises(TypeError, match=r"out\['swa'\] must have dtype int32"):
        cache.block_tables([slot], out=wrong)


class _FakeCudaTensor:
    """Looks like a torch tensor on a CUDA device (no GPU needed to test the refusal)."""

    class device:  # mirrors torch's lowercase attribute
        type = "cuda"

    def numpy(self) -> np.ndarray:
        raise AssertionError("must not be viewed")

    def data_ptr(self) -> int:
        return 0


@needs_flat
def test_out_errors_name_the_group_and_write_nothing() -> None:
    cache = native_hybrid()
    slot = running(cache, "a", list(range(20)))  # 5 pages per group
    good = buffers(2, 8)

    def call(**replace: Any) -> None:
        out: dict[str, Any] = {**good, **replace}
        for g in GROUPS:
            if replace.get(g, good[g]) is None:
                del out[g]
        cache.block_tables([slot], out=out)

    with pytest.raises(ValueError, match=r"out has no table for group 'swa'"):
        call(swa=None)
    with pytest.raises(TypeError, match=r"out\['full'\] must have dtype int32, got int64"):
        call(full=np.zeros((2, 8), dtype=np.int64))
    with pytest.raises(ValueError, match=r"out\['full'\] must be 2-D"):
        call(full=np.zeros(16, dtype=np.int32))
    with pytest.raises(ValueError, match=r"out\['swa'\] must be C-contiguous"):
        call(swa=np.zeros((8, 2), dtype=np.int32).T)
    read_only = np.zeros((2, 8), dtype=np.int32)
    read_only.flags.writeable = False
    with pytest.raises(ValueError, match=r"out\['full'\] must be writable"):
        call(full=read_only)
    with pytest.raises(TypeError, match=r"out\['swa'\] must be an int32 numpy array or a CPU torch tensor"):
        call(swa=[[0] * 8] * 2)
    with pytest.raises(ValueError, match=r"out\['swa'\] must be a CPU tensor"):
        call(swa=_FakeCudaTensor())
    with pytest.raises(ValueError, match=r"out\[.full.\] has 0 rows, fewer than the 1 "):
        call(full=np.zeros((0, 8), dtype=np.int32))
    shared = np.zeros((2, 8), dtype=np.int32)
    with pytest.raises(ValueError, match=r"out\['swa'\] shares its memory"):
        call(full=shared, swa=shared)
    with pytest.raises(TypeError, match="out must be a mapping"):
        cache.block_tables([slot], out=[good["full"], good["swa"]])  # type: ignore[call-overload]
    # Too narrow for a's 5 pages: an error naming the group, nothing written anywhere.
    narrow = {"full": np.full((2, 8), 7, np.int32), "swa": np.full((2, 4), 7, np.int32)}
    with pytest.raises(
        ValueError, match=r"out\[.swa.\] has 4 columns but request 'a' \(slot 0\) has 5 pages"
    ):
        cache.block_tables([slot], out=narrow)
    assert all((v == 7).all() for v in narrow.values())
    with pytest.raises(KeyError, match="block_tables: slot 1 holds no request"):
        cache.block_tables([slot, 1], out=good)
    assert (good["full"] == 7).all()
    # A key that is not a group would be left unwritten: refused, naming it, nothing written.
    extra = {**buffers(1, 5), "other": np.zeros(3)}
    with pytest.raises(ValueError, match=r"out\['other'\] is not a group of this cache"):
        cache.block_tables([slot], out=extra)
    assert (extra["full"] == 7).all()
    # An empty batch writes nothing.
    exact = buffers(1, 5)
    assert cache.block_tables([], out=exact) is exact
    assert (exact["full"] == 7).all()


@pytest.mark.flag
def test_block_tables_follow_the_build_flag() -> None:
    """Both forms raise the RuntimeError naming the build when the `flat` feature is off."""
    cache = native_hybrid()
    slot = running(cache, "a", list(range(6)))
    if flat_kvcache.FLAT_KVCACHE:
        assert cache.block_tables([slot], out=buffers(1, 4))["full"][0, 0] > 0
        return
    message = "compiled without the `flat` cargo feature"
    with pytest.raises(RuntimeError, match=message):
        cache.block_tables([slot])
    out = buffers(1, 4)
    with pytest.raises(RuntimeError, match=message):
        cache.block_tables([slot], out=out)
    assert (out["full"] == 7).all()


# ----- the token-level API from Python ------------------------------------------------------------


def test_add_schedule_append_preempt_round_trip() -> None:
    cache = native_hybrid(enable_kv_events=True)
    added = cache.add_request("a", np.arange(10, dtype=np.uint32))
    assert added == (0, 0) and isinstance(added, tuple)
    numpy_slot: Any = np.int64(0)  # a numpy integer is a slot
    assert cache.num_tokens(0) == 10 and cache.num_computed_tokens(numpy_slot) == 0
    assert cache.schedule([0], [10], lookahead=2).tolist() == [True]
    cache.append_tokens(np.array([0], dtype=np.int64), np.array([10, 11], dtype=np.int64), [2])
    got = cache.schedule(np.array([0], dtype=np.int32), np.array([2], dtype=np.int32))
    assert got.dtype == np.bool_ and got.tolist() == [True]
    assert cache.num_computed_tokens(0) == 12
    (tokens,) = cache.preempt([0])
    assert tokens == list(range(12)) and isinstance(tokens, list)
    assert cache.slot_of("a") is None
    # (12 - 1) // 4 = 2 pages of the re-added prompt come back from the cache.
    assert cache.prefix_hit_tokens(tokens) == 8
    assert cache.add_request("a", tokens) == (0, 8)
    stats = cache.stats()
    assert stats["preemptions"] == 1 and stats["prefix_hits_tokens"] == 8
    cache.check_invariants()


def test_stats_have_the_documented_names() -> None:
    cache = native_hybrid()
    running(cache, "a", list(range(9)))
    stats = cache.stats()
    assert set(stats) == {
        "pages_total",
        "pages_free",
        "pages_in_use",
        "pages_cached",
        "pages_cached_free",
        "requests",
        "prefix_queries_tokens",
        "prefix_hits_tokens",
        "evictions",
        "preemptions",
        "pages_in_use_by_group",
        "host_pages_total",
        "host_pages_used",
        "host_hits_tokens",
        "host_stores",
        "host_stores_skipped",
        "host_loads",
        "host_evictions",
        "host_transfers_in_flight",
        "checkpoints_written",
        "checkpoints_hit",
        "checkpoints_evicted",
    }
    assert set(stats) == set(CacheStats.__annotations__)
    # Without a host tier every host figure is 0; without state groups every checkpoint one.
    assert all(value == 0 for name, value in stats.items() if name.startswith(("host_", "checkpoints_")))
    assert stats["pages_total"] == 63 and stats["requests"] == 1
    assert stats["pages_in_use_by_group"] == {"full": 3, "swa": 3}  # ceil(9 / 4) each
    assert stats["pages_free"] + stats["pages_in_use"] == stats["pages_total"]


def test_events_are_the_shared_dataclasses() -> None:
    assert native_hybrid().take_events() == []
    cache = native_hybrid(num_pages=5, enable_kv_events=True)  # 4 pages
    running(cache, "a", list(range(8)))  # 2 + 2 pages
    cache.finish([0])  # registers both base pages in both groups
    hashes = [bytes.fromhex(h) for h in hash_pages(list(range(8)), 4)]
    stored = cache.take_events()
    assert stored == [
        BlockStored(hashes, None, list(range(8)), 4, 0, "full", None, []),
        BlockStored(hashes, None, list(range(8)), 4, 1, "sliding_window", 8, []),
    ]
    assert all(len(h) == 32 for event in stored for h in event.block_hashes)
    # b gets a's slot, free again, and evicts the two oldest free pages (hybrid order).
    assert running(cache, "b", [100, 101, 102, 103]) == 0
    removed = cache.take_events()
    assert all(isinstance(e, BlockRemoved) for e in removed) and removed
    assert cache.reset_prefix_cache() == 2
    assert cache.take_events() == [AllBlocksCleared()]


def test_admission_accounting() -> None:
    cache = native_hybrid(21)  # 20 pages
    slot = running(cache, "a", list(range(6)))
    assert cache.budget() == 16
    cache.reserve([slot], [3])  # tail 2, then 1 page per group
    assert (cache.budget(), cache.budget(slot), cache.budget(None)) == (14, 16, 14)
    assert cache.pages_needed(3, slot) == 2 and cache.pages_needed(3) == 2
    assert cache.pages_needed(2, slot) == 0  # the tail holds 2 more tokens in each group
    assert cache.pages_needed_to_admit(list(range(50, 59)), 8, 5) == 8
    assert cache.pages_needed_to_admit(list(range(50, 59)), 8) == 4
    cache.reserve(np.array([slot]), np.array([40]))
    assert cache.budget() == 16 - 20  # may go negative


def test_argument_errors_name_the_argument() -> None:
    cache = native_hybrid()
    slot = running(cache, "a", list(range(8)))
    with pytest.raises(ValueError, match="add_request: request 'a' already exists"):
        cache.add_request("a", [1])
    with pytest.raises(ValueError, match="must not be empty"):
        cache.add_request("e", [])
    with pytest.raises(ValueError, match=r"prompt_token_ids\[1\] = -1 does not fit in u32"):
        cache.add_request("e", [1, -1])
    with pytest.raises(TypeError, match="extra_keys must be a sequence of str, got str"):
        cache.add_request("e", [1], extra_keys="lora")
    with pytest.raises(TypeError, match="request ids must be str or int"):
        cache.add_request(1.5, [1])  # type: ignore[arg-type]
    assert cache.slot_of("e") is None and cache.num_requests == 1
    assert not hasattr(cache, "has_request")
    with pytest.raises(ValueError, match=r"request 'a' \(slot 0\) asks for more tokens than are known"):
        cache.schedule([slot], [1])
    with pytest.raises(ValueError, match="lookahead must be >= 0"):
        cache.schedule([slot], [0], lookahead=-1)
    with pytest.raises(KeyError, match="schedule: slot 1 holds no request"):
        cache.schedule([1], [0])
    with pytest.raises(ValueError, match="eviction_order must be 'hybrid' or 'group', got 'lru'"):
        native_hybrid(eviction_order="lru")
    with pytest.raises(ValueError, match="eviction_order must be 'hybrid' or 'group', got None"):
        native_hybrid(eviction_order=None)
    with pytest.raises(ValueError, match=r"content_hashes\[0\] must be a 64-character lowercase hex"):
        native_page_hybrid().match_prefix([hash_pages([1, 2, 3, 4], 4)[0].upper()])


def test_schedule_validates_everything_first() -> None:
    cache = native_hybrid()
    cache.add_request("a", list(range(8)))
    cache.add_request("b", list(range(8)))
    before = (cache.stats(), cache.page_ids(0), cache.page_ids(1))
    with pytest.raises(ValueError, match="num_new_tokens has 1 entries but slots has 2"):
        cache.schedule([0, 1], [1])
    with pytest.raises(ValueError, match=r"num_new_tokens\[1\] must be >= 0, got -1"):
        cache.schedule([0, 1], np.array([1, -1]))
    with pytest.raises(ValueError, match=r"num_new_tokens\[1\] must be >= 0, got -1"):
        cache.schedule([0, 1], [1, -1])
    with pytest.raises(TypeError, match="num_new_tokens must be a 1-D integer array"):
        cache.schedule([0, 1], np.array([1.0, 1.0]))
    with pytest.raises(TypeError, match=r"num_new_tokens\[0\] must be an int, not bool"):
        cache.schedule([0], [True])
    with pytest.raises(KeyError, match="schedule: slot 2 holds no request"):
        cache.schedule([0, 2], [1, 1])
    with pytest.raises(ValueError, match=r"request 'b' \(slot 1\) asks for more tokens"):
        cache.schedule([0, 1], [1, 9])
    with pytest.raises(ValueError, match=r"request 'a' \(slot 0\) asks for more tokens"):
        cache.schedule([0, 0], [5, 4])  # repeats count together
    with pytest.raises(TypeError, match="slots"):
        cache.schedule("ab", [1, 1])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"slots\[1\]"):
        cache.schedule([0, 1.0], [1, 1])  # type: ignore[list-item]
    assert (cache.stats(), cache.page_ids(0), cache.page_ids(1)) == before
    assert cache.num_computed_tokens(0) == 0
    for ns in ([4, 4], (4, 4), np.array([4, 4], dtype=np.uint8), np.array([4, 4], dtype=np.int64)):
        cache2 = native_hybrid()
        cache2.add_request("a", list(range(8)))
        cache2.add_request("b", list(range(8)))
        assert cache2.schedule(np.array([0, 1], dtype=np.uint32), ns).tolist() == [True, True]
    assert native_hybrid().schedule([], []).shape == (0,)


def test_append_tokens_validates_everything_first() -> None:
    cache = native_hybrid()
    cache.add_request("a", list(range(8)))
    cache.add_request("b", list(range(8)))
    before = (cache.num_tokens(0), cache.num_tokens(1))
    with pytest.raises(ValueError, match="token_ids has 1 entries but slots has 2"):
        cache.append_tokens([0, 1], [1])
    with pytest.raises(ValueError, match="num_tokens has 1 entries but slots has 2"):
        cache.append_tokens([0, 1], [1, 2], [2])
    with pytest.raises(ValueError, match="num_tokens adds up to 3 but token_ids has 2 entries"):
        cache.append_tokens([0, 1], [1, 2], [1, 2])
    with pytest.raises(OverflowError, match="num_tokens"):
        cache.append_tokens([0, 1], [1, 2], [2**64 - 1, 1])
    with pytest.raises(ValueError, match=r"token_ids\[1\] = -1 does not fit in u32"):
        cache.append_tokens([0, 1], [1, -1])
    with pytest.raises(ValueError, match=r"num_tokens\[0\] must be >= 0, got -1"):
        cache.append_tokens([0, 1], [1, 2], np.array([-1, 3]))
    with pytest.raises(KeyError, match="append_tokens: slot 2 holds no request"):
        cache.append_tokens([0, 2], [1, 2])
    with pytest.raises(TypeError, match="slots"):
        cache.append_tokens("ab", [1, 2])  # type: ignore[arg-type]
    # Slot values come before token values: a negative slot is named first.
    with pytest.raises(ValueError, match=r"slots\[1\]"):
        cache.append_tokens([0, -1], [1, -1])
    assert (cache.num_tokens(0), cache.num_tokens(1)) == before
    # Arrays of any integer dtype; None is one token each.
    cache.append_tokens([], np.array([], dtype=np.uint32))
    cache.append_tokens([0, 1], np.array([8, 9], dtype=np.int64), None)
    counts = np.array([2, 1], dtype=np.uint8)
    cache.append_tokens(np.array([1, 0]), np.array([10, 11, 12], dtype=np.uint32), counts)
    assert cache.preempt([0, 1]) == [[*range(8), 8, 12], [*range(8), 9, 10, 11]]


# ----- threads --------------------------------------------------------------------------------------


def test_thread_hammer_on_one_shared_cache() -> None:
    """Eight threads run their own requests through the whole API on one cache, each by the
    slots its ``add_request`` calls returned; the engine's invariants hold throughout, no two
    live requests share a slot, and every page comes back."""
    cache = native_hybrid(num_pages=400, enable_kv_events=True)
    errors: list[BaseException] = []
    start = threading.Barrier(8)

    def worker(t: int) -> None:
        try:
            start.wait()
            reqs = [f"t{t}-{i}" for i in range(4)]
            out = buffers(4, 64)
            for round_ in range(15):
                slots = [cache.add_request(req, [t, i, round_ % 3] * 5)[0] for i, req in enumerate(reqs)]
                for req, slot in zip(reqs, slots, strict=True):
                    assert cache.slot_of(req) == slot and cache.id_of(slot) == req, (req, slot)
                for _ in range(6):
                    left = [cache.num_tokens(s) - cache.num_computed_tokens(s) for s in slots]
                    cache.schedule(slots, left)
                    if flat_kvcache.FLAT_KVCACHE:
                        cache.block_tables(slots, out=out)
                    if round_ % 2:
                        cache.append_tokens(np.array(slots), [round_] * len(slots))
                    else:
                        for s in slots:
                            cache.append_tokens([s], [round_])
                    cache.stats()
                    cache.take_events()
                cache.finish(slots[:2])
                # Each request got exactly its own prompt and this thread's 6 tokens.
                got = cache.preempt(slots[2:])
                for i, tokens in enumerate(got, start=2):
                    assert tokens == [t, i, round_ % 3] * 5 + [round_] * 6, (reqs[i], tokens)
                    again, _ = cache.add_request(f"{reqs[i]}-again", tokens)
                    cache.finish([again])
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(worker, range(8)))
    assert not errors, errors
    cache.check_invariants()
    stats = cache.stats()
    assert stats["requests"] == 0 and stats["pages_in_use"] == 0
    assert stats["pages_free"] == stats["pages_total"]
    # At most 8 threads x 4 requests were live at once: slots stay below 32.
    assert cache.add_request("last", [1]) == (0, 0)
