"""paged_attention with a local-attention chunk (Llama 4's chunked layers) against a direct dense
computation from the definition, and the chunked group in the plan and the capture buffers.

The expected output never goes through the pages: each request's K/V are dense tensors, and the
query at position ``t`` attends exactly positions ``[t - t % C, t]`` (SPEC 6, "Chunked local
attention"), computed in float64 one query at a time.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
from helpers import missing

try:
    import torch
except ImportError as exc:
    missing("torch", exc)

import flat_kvcache
from flat_kvcache.torch import CaptureBuffers, ModelShape, paged_attention, plan_kv_memory

pytestmark = pytest.mark.torch

PAGE = 4
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8


def dense_expected(
    query: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    seq_lens: list[int],
    query_lens: list[int],
    chunk: int | None,
    window: int | None = None,
) -> torch.Tensor:
    """From the definition: query ``t`` of request ``r`` attends every position ``p <= t`` with
    ``p >= t - t % chunk`` (and ``p > t - window``), softmax(q . k / sqrt(d)) v in float64."""
    out = torch.empty(query.shape, dtype=torch.float64)
    group = HEADS // KV_HEADS
    token = 0
    for r, (seq, qn) in enumerate(zip(seq_lens, query_lens, strict=True)):
        for t in range(seq - qn, seq):
            lo = 0 if chunk is None else t - t % chunk
            if window is not None:
                lo = max(lo, t - window + 1)
            for h in range(HEADS):
                k = keys[r][lo : t + 1, h // group].double()  # [n, d]
                v = values[r][lo : t + 1, h // group].double()
                logits = k @ query[token, h].double() / math.sqrt(HEAD_DIM)
                out[token, h] = torch.softmax(logits, 0) @ v
            token += 1
    return out


def paged(
    keys: list[torch.Tensor], values: list[torch.Tensor], holes: list[int] | None = None, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """K/V caches and a block table holding each request's dense K/V on shuffled pages; the
    first ``holes[r]`` pages of row ``r`` are holes (page 0) and padding is -1."""
    generator = torch.Generator().manual_seed(seed)
    cols = max(-(-len(k) // PAGE) for k in keys)
    total = sum(-(-len(k) // PAGE) for k in keys)
    order = (torch.randperm(total, generator=generator) + 1).tolist()
    k_cache = torch.full(((total + 1) * PAGE, KV_HEADS, HEAD_DIM), math.nan)
    v_cache = torch.full_like(k_cache, math.nan)
    k_cache[:PAGE] = 0  # the null page is zero
    v_cache[:PAGE] = 0
    table = torch.full((len(keys), cols), -1, dtype=torch.int32)
    for r, (k, v) in enumerate(zip(keys, values, strict=True)):
        for slot in range(-(-len(k) // PAGE)):
            page = order.pop()
            if holes is not None and slot < holes[r]:
                table[r, slot] = 0
                continue
            table[r, slot] = page
            rows = slice(slot * PAGE, min((slot + 1) * PAGE, len(k)))
            n = rows.stop - rows.start
            k_cache[page * PAGE : page * PAGE + n] = k[rows]
            v_cache[page * PAGE : page * PAGE + n] = v[rows]
    return k_cache, v_cache, table


def case(
    seq_lens: list[int], query_lens: list[int], seed: int
) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    keys = [torch.randn(n, KV_HEADS, HEAD_DIM, generator=generator) for n in seq_lens]
    values = [torch.randn(n, KV_HEADS, HEAD_DIM, generator=generator) for n in seq_lens]
    query = torch.randn(sum(query_lens), HEADS, HEAD_DIM, generator=generator)
    return query, keys, values


def lens(seq_lens: list[int], query_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor(seq_lens), torch.tensor(query_lens)


# (seq_lens, query_lens): prefill from 0 across several chunks, a prefill resumed mid-chunk,
# decode on a chunk start, decode at a chunk's last token, a one-token request.
BATCHES: list[Any] = [
    pytest.param([21, 9, 16, 1], [21, 4, 1, 1], id="mixed"),
    pytest.param([17, 24], [1, 1], id="decode"),
    pytest.param([30], [13], id="resumed-prefill"),
]


@pytest.mark.parametrize("chunk", [4, 8, 12, 6])
@pytest.mark.parametrize(("seq_lens", "query_lens"), BATCHES)
def test_chunked_attention_matches_the_dense_definition(
    chunk: int, seq_lens: list[int], query_lens: list[int]
) -> None:
    query, keys, values = case(seq_lens, query_lens, seed=chunk)
    k_cache, v_cache, table = paged(keys, values)
    seq, qlen = lens(seq_lens, query_lens)
    got = paged_attention(query, k_cache, v_cache, table, seq, qlen, PAGE, chunk_size=chunk)
    expected = dense_expected(query, keys, values, seq_lens, query_lens, chunk)
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)
    # The chunk changes the result (a query past the first chunk attends less than causal).
    causal = dense_expected(query, keys, values, seq_lens, query_lens, None)
    assert (expected - causal).abs().max() > 1e-2
    full = paged_attention(query, k_cache, v_cache, table, seq, qlen, PAGE)
    torch.testing.assert_close(full.double(), causal, atol=1e-5, rtol=1e-5)


def test_chunk_and_window_both_apply() -> None:
    seq_lens, query_lens = [27, 19], [11, 1]
    query, keys, values = case(seq_lens, query_lens, seed=3)
    k_cache, v_cache, table = paged(keys, values)
    seq, qlen = lens(seq_lens, query_lens)
    got = paged_attention(query, k_cache, v_cache, table, seq, qlen, PAGE, chunk_size=12, sliding_window=5)
    expected = dense_expected(query, keys, values, seq_lens, query_lens, 12, window=5)
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)


def test_pages_of_finished_chunks_may_be_holes() -> None:
    """What the cache reclaims (the pages of finished chunks) is never read; without the chunk
    the same table reads a hole, which the check names."""
    chunk = 8
    seq_lens, query_lens = [23, 17], [3, 1]  # queries in the chunks [16, 24) and [16, 24)
    query, keys, values = case(seq_lens, query_lens, seed=5)
    k_cache, v_cache, table = paged(keys, values, holes=[4, 4])  # tokens [0, 16) reclaimed
    seq, qlen = lens(seq_lens, query_lens)
    got = paged_attention(query, k_cache, v_cache, table, seq, qlen, PAGE, chunk_size=chunk)
    expected = dense_expected(query, keys, values, seq_lens, query_lens, chunk)
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"row 0: query at position 20 attends position 0.*a hole"):
        paged_attention(query, k_cache, v_cache, table, seq, qlen, PAGE)
    unchecked = paged_attention(query, k_cache, v_cache, table, seq, qlen, PAGE, check=False)
    assert unchecked.isnan().all()  # every query here would read a hole: NaN, never silent data


@pytest.mark.parametrize(("chunk", "error"), [(0, ValueError), (True, TypeError), (2.0, TypeError)])
def test_bad_chunk_size(chunk: Any, error: type[Exception]) -> None:
    query, keys, values = case([4], [1], seed=0)
    k_cache, v_cache, table = paged(keys, values)
    with pytest.raises(error, match="chunk_size"):
        paged_attention(query, k_cache, v_cache, table, *lens([4], [1]), PAGE, chunk_size=chunk)


# --- the chunked group in the plan and the capture buffers ---------------------------------------


def llama4_like(**overrides: Any) -> ModelShape:
    fields: dict[str, Any] = {
        "layer_types": ("chunked_attention",) * 3 + ("full_attention",),
        "sliding_window": 64,  # the chunk of the chunked layers
        "num_kv_heads": 2,
        "head_dim": 16,
        "kv_dtype": torch.bfloat16,
    }
    return ModelShape(**{**fields, **overrides})


@pytest.mark.skipif(not flat_kvcache.FLAT_KVCACHE, reason="needs the flat build")
def test_chunked_layers_plan_kv_per_token_and_a_chunked_window_group() -> None:
    shape = llama4_like()
    kv = 2 * 2 * 16 * 2
    assert [(c.group_id, c.component, c.bytes_per_slot, c.const_bytes) for c in shape.components()] == [
        ("chunked_attention", "kv", kv, 0),
        ("chunked_attention", "kv", kv, 0),
        ("chunked_attention", "kv", kv, 0),
        ("full_attention", "kv", kv, 0),
    ]
    limits: dict[str, Any] = {"max_live_requests": 4, "max_scheduled_tokens": 32, "max_context_len": 1024}
    got = plan_kv_memory(shape, page_size=16, budget_bytes=1 << 24, **limits)
    assert got.bytes_per_page == 4 * kv * 16  # per-layer K/V (3 + 1 layers: no slabs)
    assert [t.name for t in got.tensors] == [f"layer{i}.{r}" for i in range(4) for r in "kv"]
    chunked, full = got.groups
    assert (chunked.group_id, chunked.retention, chunked.sliding_window_tokens) == (
        "chunked_attention",
        "chunked_window",
        64,
    )
    assert full.retention == "full_history"
    # Sized as a sliding window of W = C.
    sliding = plan_kv_memory(
        llama4_like(layer_types=("sliding_attention",) * 3 + ("full_attention",)),
        page_size=16,
        budget_bytes=1 << 24,
        **limits,
    )
    assert got.page_counts["chunked_attention"] == sliding.page_counts["sliding_attention"]
    assert got.page_counts["chunked_attention"] < got.page_counts["full_attention"]


@pytest.mark.skipif(not flat_kvcache.FLAT_KVCACHE, reason="needs the flat build")
@pytest.mark.parametrize("sliding_offsets", [False, True])
def test_capture_buffers_keep_chunked_tables_absolute(sliding_offsets: bool) -> None:
    """A chunked table grows with holes in front: its buffer has the full-history width, and it
    is never windowed (its mask needs absolute positions)."""
    groups = plan_kv_memory(
        llama4_like(),
        page_size=16,
        budget_bytes=1 << 24,
        max_live_requests=4,
        max_scheduled_tokens=32,
        max_context_len=1024,
    ).groups
    buffers = CaptureBuffers(groups, max_batch_size=2, max_context_len=1024, sliding_offsets=sliding_offsets)
    assert buffers.width("chunked_attention") == buffers.width("full_attention") == -(-(1024 + 1) // 16)
    with pytest.raises(KeyError, match="only sliding-window groups"):
        buffers.page_offsets("chunked_attention")


def strided_pages(cache: torch.Tensor) -> torch.Tensor:
    """``cache`` as ``[pages, PAGE, kv_heads, head_dim]`` with a page stride of its own (pages
    inside a wider buffer, as the SPEC 13 arena lays them out), holding the same values."""
    pages = cache.shape[0] // PAGE
    wide = torch.full((pages, 3 * PAGE, KV_HEADS, HEAD_DIM), 7.0)
    view = wide[:, PAGE : 2 * PAGE]
    view.copy_(cache.view(pages, PAGE, KV_HEADS, HEAD_DIM))
    return view


@pytest.mark.parametrize(("seq_lens", "query_lens"), BATCHES)
def test_arena_page_views_read_and_write_like_flat_slots(seq_lens: list[int], query_lens: list[int]) -> None:
    """The arena's ``[pages, P, kv_heads, head_dim]`` views: slot ``s`` is row ``s % P`` of page
    ``s // P``, for the attention and for :func:`write_kv` alike."""
    from flat_kvcache.torch import write_kv

    query, keys, values = case(seq_lens, query_lens, seed=11)
    k_cache, v_cache, table = paged(keys, values)
    seq, qlen = lens(seq_lens, query_lens)
    k_pages, v_pages = strided_pages(k_cache), strided_pages(v_cache)
    assert not k_pages.is_contiguous()
    for window, chunk in ((None, None), (5, None), (None, 8)):
        flat = paged_attention(
            query, k_cache, v_cache, table, seq, qlen, PAGE, sliding_window=window, chunk_size=chunk
        )
        got = paged_attention(
            query, k_pages, v_pages, table, seq, qlen, PAGE, sliding_window=window, chunk_size=chunk
        )
        torch.testing.assert_close(got, flat, atol=0, rtol=0)
    slots = torch.tensor([5, 9, 14, 2])
    new_k, new_v = torch.randn(4, KV_HEADS, HEAD_DIM), torch.randn(4, KV_HEADS, HEAD_DIM)
    write_kv(k_cache, v_cache, slots, new_k, new_v)
    write_kv(k_pages, v_pages, slots, new_k, new_v)
    # NaN marks the slots nobody wrote, in both forms alike
    torch.testing.assert_close(
        k_pages.reshape(-1, KV_HEADS, HEAD_DIM), k_cache, atol=0, rtol=0, equal_nan=True
    )
    torch.testing.assert_close(
        v_pages.reshape(-1, KV_HEADS, HEAD_DIM), v_cache, atol=0, rtol=0, equal_nan=True
    )
    with pytest.raises(ValueError, match="pages of 4 rows, page_size is 2"):
        paged_attention(query, k_pages, v_pages, table, seq, qlen, 2)
