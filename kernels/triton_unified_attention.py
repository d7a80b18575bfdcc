"""Batch-invariant Triton paged attention: one kernel for prefill chunks and decodes, and a
reduction order fixed per query row.

Shapes (``T`` rows, ``S`` sequences, ``Hq`` query heads, ``Hkv`` KV heads, ``G = Hq // Hkv``,
``D`` head dim; the cache layout is :mod:`kernels.paged_attention`'s: K transposed within a
block, V as is):

- ``query`` ``[T, Hq, D]``: sequence ``s`` owns rows ``query_start_loc[s] ..
  query_start_loc[s + 1] - 1``, at positions ``context_len - q_s ..  context_len - 1``;
- ``kv_cache`` ``[2, num_blocks, Hkv, block_size * D]`` already holding this step's K/V;
- ``block_tables`` ``[S, max_blocks]`` int32, ``query_start_loc`` ``[S + 1]`` int32,
  ``context_lens`` ``[S]`` int32 (cached + new tokens; 0 for a padding row: zeros out);
- output ``[T, Hq, D]`` in the query's dtype. Semantics as
  :func:`kernels.paged_attention.paged_attention` (causal within the chunk).

The order a row's sums follow is fixed by its position alone: its keys are cut into segments
of :data:`SEGMENT` tokens from position 0; within a segment, tiles of :data:`BLOCK_N` keys in
order, with FlashAttention-2's online softmax (Dao, 2023; float32 running max, sum and
output, base 2); the segments' partials ``(m, l, acc)`` are then folded left to right with
fused multiply-adds (``m = max(m, m_s)``, ``l = fma(l, 2^(m_old - m), l_s * 2^(m_s - m))``,
the same for ``acc``). Keys past the row's position, in the same tile or in later tiles and
segments, enter as exact zeros (``p = 0``, ``alpha = 1``, an empty partial folds to nothing),
so a token's output is bitwise the same computed as a decode, inside a prefill chunk of any
length, after a prefix-cache hit (its prefix's K/V written by another step) or beside any
other rows: "Defeating Nondeterminism in LLM Inference" (He et al., Thinking Machines, 2025)
asks attention for exactly this, a fixed split *size* instead of a split *count*.

Sliding window ``W`` (``window > 0``): a row at position ``p`` sees keys ``p - W < k <= p``
(transformers' ``sliding_window_overlay``). A tile starts at the segment and the key tile
(both still aligned from position 0) holding its first row's window start, and loads no key
before that start: segments and key tiles wholly before a row's window would enter it as the
exact zeros above, so skipping them keeps every bit, and blocks wholly before every window of
the tile are never read.

Tiles: one program per (tile of ``BLOCK_Q`` query tokens of one sequence, KV head): the
``BLOCK_M = BLOCK_Q * G`` rows of the tile are its tokens times the ``G`` query heads sharing
the KV head, so K/V are read once per KV head (vLLM's unified Triton attention arranges its
tiles the same way and finds a program's sequence by a binary search over
``query_start_loc``; the grid, ``T // BLOCK_Q + S`` tiles, depends on shapes only: no host
sync, CUDA-graph safe). ``BLOCK_M`` is 16 (or ``next_power_of_2(G)`` above 16) whatever the
step, so a decode row and a prefill row go through the same tensor-core instructions; vLLM's
batch-invariant mode fixes its tile the same way.

Split over segments for occupancy (FlashDecoding, Dao et al., 2023): with few sequences the
``S * Hkv`` programs leave most SMs idle, so a decode step may instead run one program per
(tile, KV head, segment), each storing its segment's partial, and a second kernel folds them
in segment order with the same fold: the same bits as the single-program loop, so whether to
split can follow the batch (``num_splits`` of the metadata) without changing a result. vLLM
turns its split ("3D") kernel off in batch-invariant mode; the fixed segment size keeps it.

An int8 cache (:mod:`kernels.kv_quant`, ``QUANT``): its K and V tiles are widened to the
query's dtype (exact: |q| <= 127), each score is the dot product times its key's scale, and
each probability is weighted by its value's scale before the P @ V product (the softmax sum
takes the unweighted ones); the scales are read through the same memory as float32.

Under Triton's interpreter (CPU tensors, tests; ``INTERPRET``) each ``tl.dot`` is
:func:`kernels.triton_matmul.interpreter_dot` (float32 operands, products summed in order per
element: the interpreter's numpy matmul rounds an element differently by its row in the
tile), so the interpreter checks the kernel's structure; the tensor cores' part is checked on
a GPU (``scripts/gpu_check.sh``).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from sluiceway.kernels.triton_launch import (
    check_query_and_cache,
    check_varlen_tables,
    split_scratch,
    window_arg,
)
from sluiceway.kernels.triton_matmul import interpreter_dot

__all__ = ["BLOCK_N", "SEGMENT", "block_m_for", "triton_unified_attention"]

BLOCK_N = 32  # keys per tile
SEGMENT = 256  # keys per segment: the fixed split size (a multiple of BLOCK_N)
_LOG2E = 1.4426950408889634


def block_m_for(group: int) -> int:
    """Rows per tile for ``group`` query heads per KV head: 16, or the next power of two
    above ``group`` (one token per tile) when ``group > 16``. Fixed per model."""
    return max(16, triton.next_power_of_2(group))


@triton.jit
def _find_seq(query_start_loc_ptr, tile_id, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence owning global tile ``tile_id``: the last ``s`` with
    ``query_start_loc[s] // BLOCK_Q + s <= tile_id`` (each sequence's tiles start there)."""
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if start <= tile_id:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _segment(
    q,
    q_pos,
    k_base,
    s_base,
    stride_c_kv,
    table,
    lo,
    hi,
    kv_lo,
    window,
    stride_c_block,
    qk_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    INTERPRET: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    QUANT: tl.constexpr,
):
    """The online-softmax partial ``(m, l, acc)`` of keys ``[lo, hi)`` (key tiles aligned on
    ``BLOCK_N`` from ``lo``, the first the one holding ``kv_lo``; no key below ``kv_lo`` is
    loaded) for the tile's rows, each row seeing keys ``<= q_pos`` and, when ``window > 0``,
    ``> q_pos - window``; empty (-1e30, 0, 0) when nothing is left. ``s_base``: this head's
    first key scale in the float32 view of an int8 cache (``QUANT``)."""
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    d_mask = d < HEAD_DIM
    v_base = k_base + stride_c_kv
    # a finite "minus infinity": exp2 of differences stays finite, never NaN
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    first = tl.maximum(lo, lo + (kv_lo - lo) // BLOCK_N * BLOCK_N)
    for tile_start in range(first, hi, BLOCK_N):
        pos = tile_start + n
        valid = (pos < hi) & (pos >= kv_lo)
        block = tl.load(table + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        block_off = block * stride_c_block  # [BLOCK_N]
        offset = pos % BLOCK_SIZE
        k = tl.load(
            k_base + (block_off + offset)[None, :] + d[:, None] * BLOCK_SIZE,
            mask=d_mask[:, None] & valid[None, :],
            other=0.0,
        )  # [BLOCK_D, BLOCK_N]: K is stored transposed, the layout q @ k wants
        if QUANT:
            k = k.to(tl.float32).to(q.dtype)  # via float32: the interpreter's int -> bf16 is wrong
            scale_off = block_off // 4 + offset  # [BLOCK_N] float32 elements
            k_scale = tl.load(s_base + scale_off, mask=valid, other=0.0)
            v_scale = tl.load(s_base + stride_c_kv // 4 + scale_off, mask=valid, other=0.0)
        zeros = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if INTERPRET:
            scores = interpreter_dot(q, k, zeros)
        else:
            scores = tl.dot(q, k, input_precision=DOT_PRECISION)
        if QUANT:
            scores = scores * k_scale[None, :]
        scores = scores * qk_scale  # [BLOCK_M, BLOCK_N]
        visible = valid[None, :] & (pos[None, :] <= q_pos[:, None])
        visible = visible & ((window <= 0) | (pos[None, :] > q_pos[:, None] - window))
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = tl.fma(l_i, alpha, tl.sum(p, 1))  # explicit: one rounding wherever inlined
        v = tl.load(
            v_base + (block_off + offset * HEAD_DIM)[:, None] + d[None, :],
            mask=valid[:, None] & d_mask[None, :],
            other=0.0,
        )  # [BLOCK_N, BLOCK_D]
        if QUANT:
            v = v.to(tl.float32).to(q.dtype)
            p = p * v_scale[None, :]
        if INTERPRET:
            acc = interpreter_dot(p.to(v.dtype), v, acc * alpha[:, None])
        else:
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _fold(m, l_run, acc, m_s, l_s, acc_s):
    """Fold a segment's partial into the running one (left to right). Explicit ``fma`` so the
    main kernel and the merge kernel round the same way (no compiler contraction choice)."""
    m_new = tl.maximum(m, m_s)
    a = tl.exp2(m - m_new)
    b = tl.exp2(m_s - m_new)
    l_new = tl.fma(l_run, a, l_s * b)
    acc_new = tl.fma(acc, a[:, None], acc_s * b[:, None])
    return m_new, l_new, acc_new


@triton.jit
def _fold_vec(m, l_run, acc, m_s, l_s, acc_s):
    """:func:`_fold` for one row (``acc`` ``[BLOCK_D]``, ``m``/``l_run`` scalars)."""
    m_new = tl.maximum(m, m_s)
    a = tl.exp2(m - m_new)
    b = tl.exp2(m_s - m_new)
    l_new = tl.fma(l_run, a, l_s * b)
    acc_new = tl.fma(acc, a, acc_s * b)
    return m_new, l_new, acc_new


# one compiled kernel for every window (0 included): no specialization on its value
@triton.jit(do_not_specialize=["window"])
def _unified_kernel(
    q_ptr,
    cache_ptr,
    scale_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    context_lens_ptr,
    out_ptr,
    part_ml_ptr,
    part_acc_ptr,
    qk_scale,
    window,
    num_seqs,
    num_segments,
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
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SEGMENT: tl.constexpr,
    PARALLEL: tl.constexpr,
    INTERPRET: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    QUANT: tl.constexpr,
):
    tile_id = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_seq(query_start_loc_ptr, tile_id, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    local_tile = tile_id - (q_start // BLOCK_Q + seq)
    if local_tile * BLOCK_Q >= q_len:
        return
    ctx = tl.load(context_lens_ptr + seq)
    prefix = ctx - q_len  # tokens cached before this chunk

    r = tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    tok = local_tile * BLOCK_Q + r // GROUP  # [BLOCK_M] token of the chunk
    heads = kv_head * GROUP + r % GROUP
    row_mask = (tok < q_len) & (r < BLOCK_Q * GROUP)
    d_mask = d < HEAD_DIM
    rows = (q_start + tok).to(tl.int64)
    q = tl.load(
        q_ptr + rows[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :] * stride_qd,
        mask=row_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    q_pos = prefix + tok
    # keys 0 .. the tile's last position (its causal bound), from its first row's window start
    end = tl.minimum(ctx, prefix + (local_tile + 1) * BLOCK_Q)
    kv_lo = tl.where(window > 0, tl.maximum(prefix + local_tile * BLOCK_Q - window + 1, 0), 0)
    k_base = cache_ptr + kv_head.to(tl.int64) * stride_c_head
    # QUANT: this head's first scale (after a row's values) in the cache's float32 view
    s_base = scale_ptr + (kv_head.to(tl.int64) * stride_c_head + BLOCK_SIZE * HEAD_DIM) // 4
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    out_mask = row_mask[:, None] & d_mask[None, :]

    if PARALLEL:
        segment = tl.program_id(2)
        lo = segment * SEGMENT
        hi = tl.minimum(end, lo + SEGMENT)
        m_s, l_s, acc_s = _segment(
            q, q_pos, k_base, s_base, stride_c_kv, table, lo, hi, kv_lo, window, stride_c_block,
            qk_scale, HEAD_DIM, BLOCK_SIZE, BLOCK_M, BLOCK_D, BLOCK_N, INTERPRET, DOT_PRECISION,
            QUANT,
        )  # fmt: skip
        # partials: ml [T, Hq, num_segments, 2], acc [T, Hq, num_segments, BLOCK_D]
        part = (rows * NUM_HEADS + heads) * num_segments + segment  # [BLOCK_M]
        tl.store(part_ml_ptr + part * 2, m_s, mask=row_mask)
        tl.store(part_ml_ptr + part * 2 + 1, l_s, mask=row_mask)
        tl.store(part_acc_ptr + part[:, None] * BLOCK_D + d[None, :], acc_s, mask=out_mask)
    else:
        m = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
        l_run = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        for lo in range(kv_lo // SEGMENT * SEGMENT, end, SEGMENT):
            hi = tl.minimum(end, lo + SEGMENT)
            m_s, l_s, acc_s = _segment(
                q, q_pos, k_base, s_base, stride_c_kv, table, lo, hi, kv_lo, window,
                stride_c_block, qk_scale, HEAD_DIM, BLOCK_SIZE, BLOCK_M, BLOCK_D, BLOCK_N,
                INTERPRET, DOT_PRECISION, QUANT,
            )  # fmt: skip
            m, l_run, acc = _fold(m, l_run, acc, m_s, l_s, acc_s)
        out = (acc / tl.where(l_run > 0.0, l_run, 1.0)[:, None]).to(out_ptr.dtype.element_ty)
        dst = rows[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :] * stride_od
        tl.store(out_ptr + dst, out, mask=out_mask)


@triton.jit
def _merge_kernel(
    part_ml_ptr,
    part_acc_ptr,
    out_ptr,
    num_segments,
    stride_ot,
    stride_oh,
    stride_od,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    num_heads = tl.num_programs(1)
    d = tl.arange(0, BLOCK_D)
    base = (row * num_heads + head) * num_segments
    m = tl.full([], -1.0e30, dtype=tl.float32)
    l_run = tl.zeros([], dtype=tl.float32)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for segment in range(0, num_segments):  # the main kernel's fold, in the same order
        part = base + segment
        m_s = tl.load(part_ml_ptr + part * 2)
        l_s = tl.load(part_ml_ptr + part * 2 + 1)
        acc_s = tl.load(part_acc_ptr + part * BLOCK_D + d)
        m, l_run, acc = _fold_vec(m, l_run, acc, m_s, l_s, acc_s)
    out = acc / tl.where(l_run > 0.0, l_run, 1.0)
    tl.store(
        out_ptr + row * stride_ot + head * stride_oh + d * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=d < HEAD_DIM,
    )


def triton_unified_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    block_size: int,
    max_context_len: int,
    split: bool = False,
    scale: float | None = None,
    segment: int = SEGMENT,
    out: torch.Tensor | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Attention of a flattened varlen batch (prefill chunks and decodes) over the paged pool,
    each row's result independent of the batch (module docstring).

    Args:
        query: ``[T, Hq, D]`` float32/float16/bfloat16 (the cache's dtype), any strides.
        kv_cache: one layer's ``[2, num_blocks, Hkv, block_size * D]``, last dim contiguous;
            or int8 ``[2, num_blocks, Hkv, block_size * (D + 4)]`` (:mod:`kernels.kv_quant`).
        block_tables: ``[S, max_blocks]`` int32 (entries past a sequence's blocks: valid ids).
        query_start_loc: ``[S + 1]`` int32, row offsets of each chunk.
        context_lens: ``[S]`` int32, ``>= q_s`` (0 only for a 1-row padding chunk).
        block_size: tokens per block.
        max_context_len: an upper bound of ``context_lens`` (a host int); sizes the segment
            grid when ``split`` (unused otherwise).
        split: one program per :data:`SEGMENT` of keys plus a merge kernel (for occupancy
            at small batch) instead of one program looping over them; the same bits.
            Scratch: ``T * Hq * ceil(max_context_len / SEGMENT) * (D + 2)`` float32.
        scale: softmax scale; ``1 / sqrt(D)`` when ``None``.
        segment: keys per segment (part of the reduction order: the backend always uses
            :data:`SEGMENT`, a multiple of :data:`BLOCK_N` so tiles stay full; tests use
            short ones to reach several segments on small contexts).
        out: optional ``[T, Hq, D]`` output buffer.
        sliding_window: ``W``: a row at ``p`` attends to keys ``p - W < k <= p`` only.

    Returns:
        ``[T, Hq, D]`` in the query's dtype; softmax and accumulation in float32.

    Raises:
        ValueError: on inconsistent shapes (checked on shapes only: no device sync), a
            ``segment < 1`` or a window ``< 1``.
    """
    t, hq, d = query.shape
    if segment < 1:
        raise ValueError(f"segment={segment} must be positive")
    window = window_arg(sliding_window)
    s = context_lens.shape[0]
    hkv = check_query_and_cache(query, kv_cache, block_size, int8_ok=True)
    check_varlen_tables(block_tables, query_start_loc, s)
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    if out is None:
        out = torch.empty((t, hq, d), dtype=query.dtype, device=query.device)
    if t == 0 or s == 0:
        return out
    group = hq // hkv
    num_segments = max(1, triton.cdiv(max_context_len, segment)) if split else 1
    block_m, block_q, block_d, grid = _tiling(t, s, group, hkv, d, num_segments, split)
    if split:
        part_ml, part_acc = split_scratch(t, hq, num_segments, block_d, query.device)
    else:
        part_ml = part_acc = out  # unused
    _unified_kernel[grid](
        query,
        kv_cache,
        kv_cache.view(torch.float32) if kv_cache.dtype == torch.int8 else kv_cache,
        block_tables,
        query_start_loc,
        context_lens,
        out,
        part_ml,
        part_acc,
        scale * _LOG2E,
        window,
        s,
        num_segments,
        *query.stride(),
        *out.stride(),
        *kv_cache.stride()[:3],
        block_tables.stride(0),
        NUM_HEADS=hq,
        GROUP=group,
        HEAD_DIM=d,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        BLOCK_D=block_d,
        BLOCK_N=BLOCK_N,
        SEGMENT=segment,
        PARALLEL=split,
        INTERPRET=query.device.type != "cuda",
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        QUANT=kv_cache.dtype == torch.int8,
    )
    if split:
        _merge_segments(part_ml, part_acc, out, num_segments, block_d)
    return out


def _tiling(
    t: int, s: int, group: int, hkv: int, d: int, num_segments: int, split: bool
) -> tuple[int, int, int, tuple[int, ...]]:
    """``(BLOCK_M, BLOCK_Q, BLOCK_D, grid)`` of a launch over ``t`` rows of ``s`` sequences:
    tiles of ``BLOCK_Q`` tokens times the ``group`` query heads of a KV head (``BLOCK_M``
    rows), ``t // BLOCK_Q + s`` tiles (each sequence's last may be partial) by ``hkv``, by
    ``num_segments`` when ``split``; ``BLOCK_D`` covers the head dim ``d``."""
    block_m = block_m_for(group)
    block_q = block_m // group
    block_d = max(16, triton.next_power_of_2(d))
    if split:
        return block_m, block_q, block_d, (t // block_q + s, hkv, num_segments)
    return block_m, block_q, block_d, (t // block_q + s, hkv)


def _merge_segments(
    part_ml: torch.Tensor,
    part_acc: torch.Tensor,
    out: torch.Tensor,
    num_segments: int,
    block_d: int,
) -> None:
    """Launches :func:`_merge_kernel` on the ``(T, Hq)`` grid: folds the ``num_segments``
    partials of each (row, query head), ``part_ml`` ``[T, Hq, num_segments, 2]`` and
    ``part_acc`` ``[T, Hq, num_segments, block_d]`` float32, in segment order into ``out``
    ``[T, Hq, D]``."""
    t, hq, d = out.shape
    _merge_kernel[(t, hq)](
        part_ml,
        part_acc,
        out,
        num_segments,
        out.stride(0),
        out.stride(1),
        out.stride(2),
        HEAD_DIM=d,
        BLOCK_D=block_d,
    )
