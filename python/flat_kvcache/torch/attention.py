"""Reference paged attention over the flat cache's block tables (private).

Public through :mod:`flat_kvcache.torch`.

This module is the executable definition of the page layout that an attention kernel
(FlashInfer, FlashAttention, a Triton kernel...) must match to run on the tables of
:class:`flat_kvcache.FlatKVCache` and the buffers of :func:`flat_kvcache.torch.allocate_kv_buffers`
(SPEC 1, 8 and 11):

* K/V buffers are ``[num_pages * P, kv_heads, head_dim]``; with hybrid slabs several layers
  share one tensor, which is safe because a page belongs to one group at a time. The SPEC 13
  arena's views (:meth:`~flat_kvcache.torch.ArenaBuffers.k`) are ``[num_pages, P, kv_heads,
  head_dim]`` with a page stride of their own; every function here takes either form, a slot
  ``s`` being row ``s % P`` of page ``s // P`` in the second.
* The cache slot of token position ``pos`` of request ``r`` is
  ``table[r, pos // P] * P + pos % P``, where ``table`` is the request's row of its layer's group
  (int32; holes are the null page 0, padding past the row is -1).
* New K/V rows are written at those slots (:func:`write_kv` with
  :func:`~flat_kvcache.torch.write_locations` / :func:`~flat_kvcache.torch.extend_locations`)
  before the attention reads them.
* A request holds ``seq_lens[r]`` tokens, its ``query_lens[r]`` queries are the last ones
  (positions ``seq_lens[r] - query_lens[r] .. seq_lens[r] - 1``), and query ``q`` attends to key
  positions ``p <= q`` (causal inside the step), with a sliding window ``W`` only to
  ``p > q - W`` (the query and the ``W - 1`` tokens before it: what the cache keeps), and with
  a local-attention chunk ``C`` (Llama 4's chunked layers) only to ``p >= q - q % C`` (the
  tokens of the query's own chunk, positions ``[q - q % C, q]``: what the cache keeps).

Every slot inside the attended range must be a real page (> 0). A hole or padding there means
the cache and the kernel disagree (or a page was reclaimed too early); with ``check=True`` it is
a ``ValueError`` naming the row and position, and with ``check=False`` (graph capture, no host
synchronisation) the queries that would read it get NaN outputs. It is never silent data.

The implementation is plain torch (CPU and CUDA) with static shapes for a fixed table width, so
it can be captured in a CUDA graph with ``check=False``. It gathers every slot of a row's table
and masks, which is simple, not fast: it is for tests and for checking real kernels.
"""

from __future__ import annotations

import math

import torch

from flat_kvcache.torch._checks import as_int

__all__ = ["paged_attention", "write_kv"]


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
) -> None:
    """Store new K/V rows at cache ``slots`` (from ``write_locations`` / ``extend_locations``).

    ``key`` and ``value`` are ``[tokens, kv_heads, head_dim]``, ``slots`` is ``[tokens]`` (any
    shape with that many elements). Graph-capturable (``index_copy_``).
    """
    flat = slots.reshape(-1)
    if key.shape != value.shape or key.dim() != 3 or key.shape[0] != flat.shape[0]:
        raise ValueError(
            f"key and value must both be [tokens, kv_heads, head_dim] with tokens = {flat.shape[0]} "
            f"(the slots), got {tuple(key.shape)} and {tuple(value.shape)}"
        )
    _check_paged_pair(k_cache, v_cache)
    if k_cache.shape[-2:] != key.shape[1:] or v_cache.shape[-2:] != value.shape[1:]:
        raise ValueError(
            f"cache rows are {tuple(k_cache.shape[-2:])} / {tuple(v_cache.shape[-2:])}, "
            f"the new rows {tuple(key.shape[1:])}"
        )
    index = flat.long()
    if k_cache.dim() == 4:  # [pages, P, kv_heads, head_dim]: slot s is row s % P of page s // P
        size = int(k_cache.shape[1])
        at = (index // size, index % size)
        k_cache.index_put_(at, key.to(k_cache.dtype))
        v_cache.index_put_(at, value.to(v_cache.dtype))
        return
    k_cache.index_copy_(0, index, key.to(k_cache.dtype))
    v_cache.index_copy_(0, index, value.to(v_cache.dtype))


def _check_paged_pair(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """K and V caches of one of the two forms (module docstring), the same shape."""
    if k_cache.dim() not in (3, 4) or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache and v_cache must both be [slots, kv_heads, head_dim] or [pages, page_size, "
            f"kv_heads, head_dim], got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_lens: torch.Tensor,
    page_size: int,
    *,
    scale: float | None = None,
    sliding_window: int | None = None,
    chunk_size: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
    check: bool = True,
) -> torch.Tensor:
    """Attention of packed queries over the paged cache; returns ``[tokens, heads, head_dim]``.

    Parameters
    ----------
    query
        ``[tokens, heads, head_dim]``: the queries of every request, concatenated in row order
        (``tokens == sum(query_lens)``).
    k_cache, v_cache
        ``[num_pages * page_size, kv_heads, head_dim]`` (``KVBuffers.k(layer)`` / ``.v(layer)``)
        or ``[num_pages, page_size, kv_heads, head_dim]`` (``ArenaBuffers.k(layer)``);
        ``heads`` must be a multiple of ``kv_heads`` (grouped-query attention).
    block_table
        int ``[rows, cols]``: the layer's group table (``FlatKVCache.block_tables`` or a
        ``CaptureBuffers`` buffer). In windowed capture mode pass the shifted row and shifted
        ``seq_lens`` (``seq_lens - page_offsets * page_size``); the window mask is relative, so
        the result is the same. The chunk mask is not relative (it needs absolute positions):
        a chunked layer's table must be the absolute one.
    seq_lens, query_lens
        int ``[rows]``: tokens in the cache after this step's write, and this step's queries.
    page_size
        Tokens per page ``P``.
    scale
        Softmax scale (default ``head_dim ** -0.5``).
    sliding_window
        ``W`` for a sliding-window layer (None: full attention).
    chunk_size
        ``C`` for a chunked local attention layer (Llama 4's ``attention_chunk_size``): the
        query at position ``t`` attends positions ``[t - t % C, t]``, its own chunk (None: no
        chunk). With ``sliding_window`` too, both masks apply.
    sinks
        Optional ``[heads]`` attention-sink logits (GPT-OSS): an extra softmax column per head
        that takes probability mass and contributes no value.
    softcap
        Attention logit soft-capping (Gemma-2): scaled logits ``x`` become
        ``softcap * tanh(x / softcap)`` before masking (None: no cap).
    check
        Validate lengths and raise ``ValueError`` for a hole or padding inside an attended range
        (synchronises with the device). With False, such queries produce NaN instead.
    """
    size = as_int(page_size, "page_size", minimum=1)
    if query.dim() != 3:
        raise ValueError(f"query must be [tokens, heads, head_dim], got shape {tuple(query.shape)}")
    _check_paged_pair(k_cache, v_cache)
    if k_cache.dim() == 4 and int(k_cache.shape[1]) != size:
        raise ValueError(f"k_cache holds pages of {int(k_cache.shape[1])} rows, page_size is {size}")
    tokens, heads, head_dim = (int(d) for d in query.shape)
    kv_heads = int(k_cache.shape[-2])
    if int(k_cache.shape[-1]) != head_dim or heads % kv_heads:
        raise ValueError(
            f"query has {heads} heads of {head_dim}; the cache has {kv_heads} heads of "
            f"{int(k_cache.shape[-1])} "
            "(heads must be a multiple of kv_heads, head dims equal)"
        )
    if block_table.dim() != 2:
        raise ValueError(f"block_table must be 2-D [rows, cols], got shape {tuple(block_table.shape)}")
    rows, cols = (int(d) for d in block_table.shape)
    for name, lens in (("seq_lens", seq_lens), ("query_lens", query_lens)):
        if lens.dim() != 1 or int(lens.shape[0]) != rows:
            raise ValueError(f"{name} must be [rows] with rows = {rows}, got shape {tuple(lens.shape)}")
    window = None if sliding_window is None else as_int(sliding_window, "sliding_window", minimum=1)
    chunk = None if chunk_size is None else as_int(chunk_size, "chunk_size", minimum=1)
    if softcap is not None and (isinstance(softcap, bool) or not float(softcap) > 0):
        raise ValueError(f"softcap must be a positive number or None, got {softcap!r}")
    if sinks is not None and tuple(sinks.shape) != (heads,):
        raise ValueError(f"sinks must be [heads] = [{heads}], got shape {tuple(sinks.shape)}")
    if check:
        _check_lengths(seq_lens, query_lens, tokens, cols * size)

    device = query.device
    q_lens = query_lens.to(device=device, dtype=torch.long)
    s_lens = seq_lens.to(device=device, dtype=torch.long)
    row_of = torch.repeat_interleave(torch.arange(rows, device=device), q_lens, output_size=tokens)
    starts = torch.cumsum(q_lens, 0) - q_lens
    q_pos = s_lens[row_of] - q_lens[row_of] + (torch.arange(tokens, device=device) - starts[row_of])

    span = cols * size
    k_pos = torch.arange(span, device=device)
    table = block_table.to(device=device, dtype=torch.long)
    pages = table[:, k_pos // size]  # [rows, span]
    slots = pages.clamp(min=0) * size + k_pos % size
    attended = k_pos[None, :] <= q_pos[:, None]  # [tokens, span]
    if window is not None:
        attended &= k_pos[None, :] > q_pos[:, None] - window
    if chunk is not None:
        attended &= k_pos[None, :] >= q_pos[:, None] - q_pos[:, None] % chunk
    unbacked = attended & (pages[row_of] <= 0)
    if check and bool(unbacked.any()):
        token, pos = (int(i) for i in torch.nonzero(unbacked)[0])
        row, page = int(row_of[token]), int(pages[row_of[token], pos])
        what = "the null page 0 (a hole)" if page == 0 else f"padding ({page})"
        raise ValueError(
            f"row {row}: query at position {int(q_pos[token])} attends position {pos}, whose page slot "
            f"{pos // size} holds {what}"
        )

    if k_cache.dim() == 4:
        at = (pages.clamp(min=0), (k_pos % size)[None, :].expand(rows, span))
        keys, values = k_cache[at].to(torch.float32), v_cache[at].to(torch.float32)
    else:
        keys = k_cache[slots].to(torch.float32)  # [rows, span, kv_heads, head_dim]
        values = v_cache[slots].to(torch.float32)
    group = heads // kv_heads
    keys = keys.repeat_interleave(group, dim=2)[row_of]  # [tokens, span, heads, head_dim]
    values = values.repeat_interleave(group, dim=2)[row_of]
    # Zero the rows a query does not attend, so that unwritten slots (garbage, NaN) never mix in.
    keep = attended[:, :, None, None]
    keys = torch.where(keep, keys, torch.zeros((), device=device))
    values = torch.where(keep, values, torch.zeros((), device=device))
    softmax_scale = head_dim**-0.5 if scale is None else float(scale)
    logits = torch.einsum("thd,tshd->ths", query.to(torch.float32), keys) * softmax_scale
    if softcap is not None:
        cap = float(softcap)
        logits = torch.tanh(logits / cap) * cap
    logits = logits.masked_fill(~attended[:, None, :], -math.inf)
    if sinks is not None:
        sink = sinks.to(device=device, dtype=torch.float32)[None, :, None].expand(tokens, heads, 1)
        logits = torch.cat([logits, sink], dim=-1)
        logits = logits - logits.amax(dim=-1, keepdim=True)
        weights = torch.softmax(logits, dim=-1)[..., :-1]
    else:
        weights = torch.softmax(logits, dim=-1)
    out = torch.einsum("ths,tshd->thd", weights, values)
    if not check:
        poisoned = unbacked.any(dim=1)[:, None, None]
        out = torch.where(poisoned, torch.full((), math.nan, device=device), out)
    return out.to(query.dtype)


def _check_lengths(seq_lens: torch.Tensor, query_lens: torch.Tensor, tokens: int, span: int) -> None:
    q = query_lens.detach().to("cpu", torch.long)
    s = seq_lens.detach().to("cpu", torch.long)
    if int(q.sum()) != tokens:
        raise ValueError(f"sum(query_lens) = {int(q.sum())} but query holds {tokens} tokens")
    for row in range(int(q.shape[0])):
        qn, sn = int(q[row]), int(s[row])
        if qn < 0 or qn > sn:
            raise ValueError(f"row {row}: query_lens {qn} must be in [0, seq_lens = {sn}]")
        if sn > span:
            raise ValueError(f"row {row}: seq_lens {sn} is past the table's {span} slots")
