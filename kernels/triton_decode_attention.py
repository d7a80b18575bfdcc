"""Triton paged-attention decode: one query token per sequence over the paged KV cache.

Shapes (``S`` sequences, ``Hq`` query heads, ``Hkv`` KV heads, ``G = Hq // Hkv``, ``D`` head
dim; the cache layout is the one of :mod:`kernels.paged_attention`: K transposed within a
block, V as is):

- ``query`` ``[S, Hq, D]``: row ``s`` is the new token of sequence ``s``;
- ``kv_cache`` ``[2, num_blocks, Hkv, block_size * D]`` holding every token of the contexts,
  this step's included (write them first);
- ``block_tables`` ``[S, max_blocks]`` int32, ``context_lens`` ``[S]`` int32;
- output ``[S, Hq, D]`` in the query's dtype.

Algorithm: vLLM's paged attention decode (Kwon et al., SOSP 2023) reads K/V through the block
table; each program streams its context in tiles of ``BLOCK_N`` tokens with the online softmax
of FlashAttention-2 (Dao, 2023): a running max ``m``, sum ``l`` and unnormalized output, all in
float32, in base 2 (``exp2`` with the scale folded into ``log2(e)``). One program per
(sequence, KV head, split) handles the ``G`` query heads that share the KV head (grouped-query
attention): the ``[G, D]`` query tile (``G`` padded to >= 16 rows with masks, as ``tl.dot``
wants) meets each K/V tile once, so K/V are read once per KV head, not once per query head.
Tokens of a tile are gathered one by one through the block table, so a tile may span several
blocks and any block size works.

Split-K (FlashDecoding, Dao et al. 2023): with few sequences the ``S * Hkv`` programs leave
most of a GPU idle, so the context is cut into ``num_splits`` contiguous ranges, each program
writes a partial ``(m, l, acc)`` and a second kernel merges them. The split ranges are computed
in the kernel from the loaded context length, so the grid depends only on shapes and
``num_splits``: no host synchronization, safe to capture in a CUDA graph.

Sliding window ``W``: the token at position ``p = context_len - 1`` attends to keys
``p - W < k <= p`` (transformers' ``sliding_window_overlay``): the splits cut that range only,
so no block wholly before it is read.

A sequence with ``context_len == 0`` (a padding row) reads nothing and outputs zeros.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from sluiceway.kernels.triton_launch import check_query_and_cache, split_scratch, window_arg

__all__ = ["DEFAULT_BLOCK_N", "dot_precision", "triton_decode_attention"]

DEFAULT_BLOCK_N = 32
_LOG2E = 1.4426950408889634


# one compiled kernel for every window (0 included): no specialization on its value
@triton.jit(do_not_specialize=["window"])
def _decode_kernel(
    q_ptr,
    cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    out_ptr,
    part_ml_ptr,
    part_acc_ptr,
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
    NUM_SPLITS: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_kv_heads = tl.num_programs(1)
    seq64 = seq.to(tl.int64)
    ctx = tl.load(context_lens_ptr + seq)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    heads = kv_head * GROUP + g
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    q = tl.load(
        q_ptr + seq64 * stride_qt + heads[:, None] * stride_qh + d[None, :] * stride_qd,
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )

    # the keys [kv_lo, ctx) (the window's, or all), in tiles of BLOCK_N cut evenly by split
    kv_lo = tl.where(window > 0, tl.maximum(ctx - window, 0), 0)
    per_split = tl.cdiv(tl.cdiv(ctx - kv_lo, BLOCK_N), NUM_SPLITS)
    start = kv_lo + split * per_split * BLOCK_N
    end = tl.minimum(ctx, kv_lo + (split + 1) * per_split * BLOCK_N)

    # a finite "minus infinity": exp2(m_i - m_new) stays 1, never NaN, before any valid score
    m_i = tl.full([BLOCK_G], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    k_base = cache_ptr + kv_head.to(tl.int64) * stride_c_head
    v_base = k_base + stride_c_kv
    table = block_tables_ptr + seq64 * stride_bt
    for tile_start in range(start, end, BLOCK_N):
        pos = tile_start + n
        valid = pos < end
        block = tl.load(table + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        block_off = block * stride_c_block  # [BLOCK_N]
        offset = pos % BLOCK_SIZE
        k = tl.load(
            k_base + (block_off + offset)[None, :] + d[:, None] * BLOCK_SIZE,
            mask=d_mask[:, None] & valid[None, :],
            other=0.0,
        )  # [BLOCK_D, BLOCK_N]: K is stored transposed, the layout q @ k wants
        scores = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_G, BLOCK_N]
        scores = tl.where(valid[None, :], scores, float("-inf"))
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

    out_mask = g_mask[:, None] & d_mask[None, :]
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + seq64 * stride_ot + heads[:, None] * stride_oh + d[None, :] * stride_od,
            out.to(out_ptr.dtype.element_ty),
            mask=out_mask,
        )
    else:
        # partials: ml [S, Hq, NUM_SPLITS, 2] (m, l), acc [S, Hq, NUM_SPLITS, BLOCK_D]
        row = (seq64 * num_kv_heads * GROUP + heads) * NUM_SPLITS + split  # [BLOCK_G]
        tl.store(part_ml_ptr + row * 2, m_i, mask=g_mask)
        tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=g_mask)
        tl.store(part_acc_ptr + row[:, None] * BLOCK_D + d[None, :], acc, mask=out_mask)


@triton.jit
def _merge_kernel(
    part_ml_ptr,
    part_acc_ptr,
    out_ptr,
    stride_ot,
    stride_oh,
    stride_od,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_SPLITS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    num_heads = tl.num_programs(1)
    i = tl.arange(0, BLOCK_SPLITS)
    d = tl.arange(0, BLOCK_D)
    i_mask = i < NUM_SPLITS
    row = (seq.to(tl.int64) * num_heads + head) * NUM_SPLITS + i  # [BLOCK_SPLITS]
    m = tl.load(part_ml_ptr + row * 2, mask=i_mask, other=-1.0e30)
    l_part = tl.load(part_ml_ptr + row * 2 + 1, mask=i_mask, other=0.0)
    acc = tl.load(
        part_acc_ptr + row[:, None] * BLOCK_D + d[None, :], mask=i_mask[:, None], other=0.0
    )
    w = tl.exp2(m - tl.max(m, 0))  # empty splits have l = 0 and acc = 0: weight irrelevant
    total = tl.sum(l_part * w, 0)
    out = tl.sum(acc * w[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(
        out_ptr + seq.to(tl.int64) * stride_ot + head * stride_oh + d * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=d < HEAD_DIM,
    )


def triton_decode_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    block_size: int,
    scale: float | None = None,
    num_splits: int = 1,
    block_n: int = DEFAULT_BLOCK_N,
    out: torch.Tensor | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Decode attention: ``query`` ``[S, Hq, D]`` (one token per sequence) -> ``[S, Hq, D]``.

    Args:
        query: ``[S, Hq, D]`` float32/float16/bfloat16 (the cache's dtype), any strides.
        kv_cache: one layer's ``[2, num_blocks, Hkv, block_size * D]`` (layout in
            :mod:`kernels.paged_attention`), last dimension contiguous.
        block_tables: ``[S, max_blocks]`` int32, physical block ids; entries past a
            sequence's last block are never read (but keep them valid ids).
        context_lens: ``[S]`` int32, tokens of each sequence in the cache (0: padding row,
            output zeros).
        block_size: tokens per block.
        scale: softmax scale; ``1 / sqrt(D)`` when ``None``.
        num_splits: context splits per (sequence, KV head) (FlashDecoding); ``> 1`` adds a
            merge kernel and ``S * Hq * num_splits * (D + 2)`` float32 of scratch.
        block_n: tokens per tile (a power of two, >= 16).
        out: optional ``[S, Hq, D]`` output buffer (e.g. a CUDA graph's static tensor).
        sliding_window: ``W >= 1``: each token attends to its last ``W`` keys (itself
            included) only; ``None``: all of them.

    Returns:
        ``[S, Hq, D]`` in the query's dtype; softmax and accumulation in float32.

    Raises:
        ValueError: on inconsistent shapes (checked on shapes only: no device sync) or a
            ``sliding_window < 1``.
    """
    s, hq, d = query.shape
    hkv = check_query_and_cache(query, kv_cache, block_size)
    if block_tables.dim() != 2 or block_tables.shape[0] != s or context_lens.shape != (s,):
        raise ValueError(
            f"block_tables {tuple(block_tables.shape)} / context_lens {tuple(context_lens.shape)}"
            f" do not match {s} sequences"
        )
    if num_splits < 1 or block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"bad num_splits={num_splits} or block_n={block_n}")
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    if out is None:
        out = torch.empty((s, hq, d), dtype=query.dtype, device=query.device)
    if s == 0:
        return out
    group = hq // hkv
    block_d = max(16, triton.next_power_of_2(d))
    if num_splits > 1:
        part_ml, part_acc = split_scratch(s, hq, num_splits, block_d, query.device)
    else:
        part_ml = part_acc = out  # unused
    _decode_kernel[(s, hkv, num_splits)](
        query,
        kv_cache,
        block_tables,
        context_lens,
        out,
        part_ml,
        part_acc,
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
        GROUP=group,
        HEAD_DIM=d,
        BLOCK_SIZE=block_size,
        NUM_SPLITS=num_splits,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_D=block_d,
        BLOCK_N=block_n,
        DOT_PRECISION=dot_precision(query.dtype),
    )
    if num_splits > 1:
        _merge_splits(part_ml, part_acc, out, num_splits, block_d)
    return out


def _merge_splits(
    part_ml: torch.Tensor,
    part_acc: torch.Tensor,
    out: torch.Tensor,
    num_splits: int,
    block_d: int,
) -> None:
    """Launches :func:`_merge_kernel` on the ``(S, Hq)`` grid: folds the ``num_splits``
    partials of each (sequence, query head), ``part_ml`` ``[S, Hq, num_splits, 2]`` and
    ``part_acc`` ``[S, Hq, num_splits, block_d]`` float32, into ``out`` ``[S, Hq, D]``."""
    s, hq, d = out.shape
    _merge_kernel[(s, hq)](
        part_ml,
        part_acc,
        out,
        out.stride(0),
        out.stride(1),
        out.stride(2),
        HEAD_DIM=d,
        NUM_SPLITS=num_splits,
        BLOCK_SPLITS=triton.next_power_of_2(num_splits),
        BLOCK_D=block_d,
    )


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` input precision: exact ``ieee`` for float32 (TF32 would cost ~1e-3 of
    accuracy), the tensor-core default otherwise (float16/bfloat16 are exact inputs to it)."""
    return "ieee" if dtype == torch.float32 else "tf32"
