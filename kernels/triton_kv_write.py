"""Triton KV scatter: a step's new keys/values into their slots of one layer's paged cache.

The layout is the one of :mod:`kernels.paged_attention` (the torch reference,
:func:`kernels.paged_attention.write_kv`): one layer's cache is ``[2, num_blocks, Hkv,
block_size * D]``; within a (block, KV head) K is stored transposed (element ``(t, d)`` at
``d * block_size + t``) and V as is (at ``t * D + d``). This is the ``reshape_and_cache``
step of vLLM's paged attention (Kwon et al., "Efficient Memory Management for Large Language
Model Serving with PagedAttention", SOSP 2023), which also writes K in a layout the attention
kernel's dot products read well.

One program per token writes all its KV heads (a ``[Hkv, D]`` tile, padded to powers of two
with masks). An int8 cache (:mod:`kernels.kv_quant`) gets each head's values quantized by
that module's rule (``scale = amax / 127``, ``round_half_even(x / scale)``: the float32
magic-number rounding, exact below 2**22) and its float32 scale after the row's values. A negative slot marks a padding row (e.g. the unused rows of a CUDA-graph batch)
and writes nothing. No host synchronization: safe inside a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["triton_write_kv"]


@triton.jit
def _quantize(x):
    """``x`` ``[BLOCK_H, BLOCK_D]`` (masked lanes 0) -> int8 values and float32 scales
    ``[BLOCK_H]`` by :func:`kernels.kv_quant.quantize_rows`'s rule."""
    xf = x.to(tl.float32)
    scale = tl.max(tl.abs(xf), axis=1) / 127.0
    safe = tl.where(scale > 0.0, scale, 1.0)
    y = xf / safe[:, None]
    r = (y + 12582912.0) - 12582912.0  # 1.5 * 2**23: round to nearest, ties to even
    r = tl.minimum(tl.maximum(r, -127.0), 127.0)
    r = tl.where(scale[:, None] > 0.0, r, 0.0)
    return r.to(tl.int8), scale


@triton.jit
def _kv_write_kernel(
    key_ptr,
    value_ptr,
    cache_ptr,
    scale_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_c_kv,
    stride_c_block,
    stride_c_head,
    num_kv_heads,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    QUANT: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    # (compare the broadcast slot: the interpreter turns block & scalar-bool into ints)
    mask = (h < num_kv_heads) & (d < HEAD_DIM) & ((d * 0 + slot) >= 0)
    safe_slot = tl.maximum(slot, 0)  # padding rows: in-bounds addresses, never stored to
    block = safe_slot // BLOCK_SIZE
    offset = safe_slot % BLOCK_SIZE
    t64 = t.to(tl.int64)
    k = tl.load(key_ptr + t64 * stride_kt + h * stride_kh + d * stride_kd, mask=mask, other=0.0)
    v = tl.load(value_ptr + t64 * stride_vt + h * stride_vh + d * stride_vd, mask=mask, other=0.0)
    row = block * stride_c_block + h * stride_c_head  # [BLOCK_H, 1]
    base = cache_ptr + row
    if QUANT:
        kq, ks = _quantize(k)
        vq, vs = _quantize(v)
        tl.store(base + d * BLOCK_SIZE + offset, kq, mask=mask)
        tl.store(base + stride_c_kv + offset * HEAD_DIM + d, vq, mask=mask)
        # the scales: scale_ptr is the cache as float32, every stride a multiple of 4 bytes
        scales = scale_ptr + (row + BLOCK_SIZE * HEAD_DIM) // 4 + offset
        head_mask = (h < num_kv_heads) & ((h * 0 + slot) >= 0)
        tl.store(scales, ks[:, None], mask=head_mask)
        tl.store(scales + stride_c_kv // 4, vs[:, None], mask=head_mask)
    else:
        dtype = cache_ptr.dtype.element_ty
        tl.store(base + d * BLOCK_SIZE + offset, k.to(dtype), mask=mask)
        tl.store(base + stride_c_kv + offset * HEAD_DIM + d, v.to(dtype), mask=mask)


def triton_write_kv(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter new K/V into their slots of one layer's cache, in place.

    Args:
        key: ``[T, Hkv, D]``, any strides (e.g. a view into the fused QKV projection); cast to
            the cache's dtype on store.
        value: ``[T, Hkv, D]``, any strides.
        kv_cache: ``[2, num_blocks, Hkv, block_size * D]``, last dimension contiguous; float32,
            float16 or bfloat16; or int8 ``[2, num_blocks, Hkv, block_size * (D + 4)]``
            (:mod:`kernels.kv_quant`, contiguous), each row quantized.
        slot_mapping: ``[T]`` int64 (or int32), ``block_id * block_size + offset`` per token,
            distinct; ``< 0`` writes nothing for that token.

    Raises:
        ValueError: on inconsistent shapes (checked on shapes only: no device sync).
    """
    t, hkv, d = key.shape
    if value.shape != key.shape:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} differ")
    if kv_cache.dim() != 4 or kv_cache.shape[0] != 2 or kv_cache.shape[2] != hkv:
        raise ValueError(f"kv_cache {tuple(kv_cache.shape)} is not [2, blocks, {hkv}, bs * {d}]")
    quant = kv_cache.dtype == torch.int8
    row = d + 4 if quant else d  # an int8 token: D values and a 4-byte scale
    if (
        kv_cache.shape[3] % row
        or kv_cache.stride(3) != 1
        or (quant and not kv_cache.is_contiguous())
    ):
        raise ValueError("kv_cache's last dimension must be contiguous block_size * head_dim")
    if slot_mapping.shape != (t,):
        raise ValueError(f"slot_mapping {tuple(slot_mapping.shape)} is not [{t}]")
    if t == 0:
        return
    _kv_write_kernel[(t,)](
        key,
        value,
        kv_cache,
        kv_cache.view(torch.float32) if quant else kv_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        key.stride(2),
        value.stride(0),
        value.stride(1),
        value.stride(2),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        hkv,
        HEAD_DIM=d,
        BLOCK_SIZE=kv_cache.shape[3] // row,
        BLOCK_H=triton.next_power_of_2(hkv),
        BLOCK_D=triton.next_power_of_2(d),
        QUANT=quant,
    )
