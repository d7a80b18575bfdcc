"""Triton prefill / mixed attention of a flattened varlen batch over the paged KV cache.

Shapes (``T`` rows, ``S`` sequences, ``Hq`` query heads, ``Hkv`` KV heads, ``D`` head dim; the
cache layout is the one of :mod:`kernels.paged_attention`: K transposed within a block, V as
is):

- ``query`` ``[T, Hq, D]``: sequence ``s`` owns rows ``query_start_loc[s] ..
  query_start_loc[s + 1] - 1`` (its chunk of ``q_s`` rows);
- ``query_start_loc`` ``[S + 1]`` int32, ``context_lens`` ``[S]`` int32 (cached + new tokens),
  ``block_tables`` ``[S, max_blocks]`` int32;
- ``kv_cache`` ``[2, num_blocks, Hkv, block_size * D]`` already holding this step's K/V;
- output ``[T, Hq, D]`` in the query's dtype.

Semantics (exactly :func:`kernels.paged_attention.paged_attention`'s): row ``j`` of a chunk
sits at position ``context_len - q_s + j`` and attends to keys ``0 .. context_len - q_s + j``:
all of the cached prefix, causally within the chunk; with a sliding window ``W`` only keys
``p - W < k <= p`` of a row at ``p`` (transformers' ``sliding_window_overlay``), and a tile's
key loop starts at its first row's window start (no block wholly before it is read). A chunk
of one row (a decode) is just a
short chunk, so prefills and decodes mix in one launch. Query head ``h`` reads KV head
``h // (Hq // Hkv)``.

Algorithm: FlashAttention-2 (Dao, 2023) forward, one program per (sequence, tile of
``BLOCK_M`` query rows, query head), streaming keys in tiles of ``BLOCK_N`` with the online
softmax (running max and sum in float32, base 2), reading K/V through the block table token by
token as vLLM's paged attention does (Kwon et al., SOSP 2023), so any block size works. The
key loop of a tile stops at its last row's position (the causal bound). The grid is ``(S,
cdiv(max_query_len, BLOCK_M), Hq)``: tiles past a chunk's end run no iteration and store
nothing. ``max_query_len`` is a host int from the step's metadata (no device sync).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from sluiceway.kernels.triton_decode_attention import dot_precision
from sluiceway.kernels.triton_launch import (
    check_query_and_cache,
    check_varlen_tables,
    window_arg,
)

__all__ = ["DEFAULT_BLOCK_N", "triton_prefill_attention"]

DEFAULT_BLOCK_N = 32
_LOG2E = 1.4426950408889634


# one compiled kernel for every window (0 included): no specialization on its value
@triton.jit(do_not_specialize=["window"])
def _prefill_kernel(
    q_ptr,
    cache_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    context_lens_ptr,
    out_ptr,
    qk_scale,
    window,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_c_kv,
    stride_c_block,
    stride_c_head,
    stride_bt,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    tile = tl.program_id(1)
    head = tl.program_id(2)
    kv_head = head // GROUP
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    ctx = tl.load(context_lens_ptr + seq)
    prefix = ctx - q_len  # tokens cached before this chunk

    m = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # rows of the chunk
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    row_mask = m < q_len
    d_mask = d < HEAD_DIM
    rows = (q_start + m).to(tl.int64)
    q = tl.load(
        q_ptr + rows[:, None] * stride_qt + head * stride_qh + d[None, :] * stride_qd,
        mask=row_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    q_pos = prefix + m  # [BLOCK_M], position of each row in its sequence
    # keys 0 .. the tile's last position; none for tiles past the chunk's end
    end = tl.minimum(ctx, prefix + (tile + 1) * BLOCK_M)
    end = tl.where(tile * BLOCK_M < q_len, end, 0)
    kv_lo = tl.where(window > 0, tl.maximum(prefix + tile * BLOCK_M - window + 1, 0), 0)

    # a finite "minus infinity": rows with every key of a tile masked keep alpha = 1, no NaN
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    k_base = cache_ptr + kv_head.to(tl.int64) * stride_c_head
    v_base = k_base + stride_c_kv
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for tile_start in range(kv_lo, end, BLOCK_N):
        pos = tile_start + n
        valid = pos < end
        block = tl.load(table + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        block_off = block * stride_c_block
        offset = pos % BLOCK_SIZE
        k = tl.load(
            k_base + (block_off + offset)[None, :] + d[:, None] * BLOCK_SIZE,
            mask=d_mask[:, None] & valid[None, :],
            other=0.0,
        )  # [BLOCK_D, BLOCK_N]
        scores = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        visible = valid[None, :] & (pos[None, :] <= q_pos[:, None])
        visible = visible & ((window <= 0) | (pos[None, :] > q_pos[:, None] - window))
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_base + (block_off + offset * HEAD_DIM)[:, None] + d[None, :],
            mask=valid[:, None] & d_mask[None, :],
            other=0.0,
        )  # [BLOCK_N, BLOCK_D]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + rows[:, None] * stride_ot + head * stride_oh + d[None, :] * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & d_mask[None, :],
    )


def triton_prefill_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    max_query_len: int,
    block_size: int,
    scale: float | None = None,
    block_m: int | None = None,
    block_n: int = DEFAULT_BLOCK_N,
    out: torch.Tensor | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Attention of a flattened varlen batch (prefill chunks and decodes) over the paged pool.

    Args:
        query: ``[T, Hq, D]`` float32/float16/bfloat16 (the cache's dtype), any strides.
        kv_cache: one layer's ``[2, num_blocks, Hkv, block_size * D]``, last dim contiguous.
        block_tables: ``[S, max_blocks]`` int32 (entries past a sequence's blocks: valid ids).
        query_start_loc: ``[S + 1]`` int32, row offsets of each chunk (``[0] + cumsum``).
        context_lens: ``[S]`` int32, ``>= q_s`` (cached + new tokens).
        max_query_len: the longest chunk, ``max(q_s)`` (a host int: it sizes the grid).
        block_size: tokens per block.
        scale: softmax scale; ``1 / sqrt(D)`` when ``None``.
        block_m: query rows per tile (power of two, >= 16); by default 16, 32 or 64 after
            ``max_query_len``.
        block_n: keys per tile (power of two, >= 16).
        out: optional ``[T, Hq, D]`` output buffer.
        sliding_window: ``W >= 1``: a row at position ``p`` attends to keys
            ``p - W < k <= p`` only; ``None``: all of them.

    Returns:
        ``[T, Hq, D]`` in the query's dtype; softmax and accumulation in float32.

    Raises:
        ValueError: on inconsistent shapes (checked on shapes only: no device sync) or a
            ``sliding_window < 1``.
    """
    t, hq, d = query.shape
    s = context_lens.shape[0]
    hkv = check_query_and_cache(query, kv_cache, block_size)
    check_varlen_tables(block_tables, query_start_loc, s)
    if block_m is None:
        block_m = min(64, max(16, triton.next_power_of_2(max(max_query_len, 1))))
    for name, value in (("block_m", block_m), ("block_n", block_n)):
        if value < 16 or value & (value - 1):
            raise ValueError(f"{name}={value} must be a power of two >= 16")
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    if out is None:
        out = torch.empty((t, hq, d), dtype=query.dtype, device=query.device)
    if t == 0 or s == 0 or max_query_len < 1:
        return out
    grid = (s, triton.cdiv(max_query_len, block_m), hq)
    _prefill_kernel[grid](
        query,
        kv_cache,
        block_tables,
        query_start_loc,
        context_lens,
        out,
        scale * _LOG2E,
        window_arg(sliding_window),
        query.stride(0),
        query.stride(1),
        query.stride(2),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        block_tables.stride(0),
        GROUP=hq // hkv,
        HEAD_DIM=d,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_D=max(16, triton.next_power_of_2(d)),
        BLOCK_N=block_n,
        DOT_PRECISION=dot_precision(query.dtype),
    )
    return out
