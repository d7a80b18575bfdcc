"""The quantized KV caches (``--kv-cache-dtype int8|fp8_e4m3``): their pool layout, the
quantization rules and the torch reference of their write and attention.

Layout
------
The pool is one int8 tensor ``[num_layers, 2, num_blocks, Hkv, block_size * (D + 4)]``: the
row of one (layer, K|V, block, KV head) holds the ``block_size * D`` int8 values in the float
layout of :mod:`kernels.paged_attention` (K transposed ``[D, block_size]``, V ``[block_size,
D]``), then ``block_size`` float32 scales (one per token, little-endian bytes), so a block's
values and scales travel together in every block copy (``worker.kv_pool.copy_blocks``, shared
pools, CUDA IPC) and the pool's dtype and shape describe it. ``block_size * D`` must be a
multiple of 4 (the scales stay 4-byte aligned).

The rule
--------
Each written row (one token of one KV head, K and V apart) is quantized from its own values
only, so a token's bits do not depend on the batch, the chunking or the block it lands in:
``x`` widened to float32, ``scale = amax(|x|) / 127`` (float32), ``q = round_half_even(x /
scale)`` clamped to ``[-127, 127]`` (0 where ``scale`` is 0); it reads back as ``q * scale``.
(Per-token scales as vLLM's CPU int8 KV path and KIVI's value quantization; symmetric, no
zero point.) ``fp8_e4m3``: the same layout in ``torch.float8_e4m3fn`` (one byte a value),
``scale = amax(|x|) / 448`` (e4m3's largest finite value), ``q = float8_e4m3fn(x / scale)``
(torch's and c10's cast: round to nearest even, saturating), read back as ``q * scale``.
Half the bytes of bfloat16 plus 4 bytes per token per head: at ``D = 64``
``2 * 64 / 68`` = 1.88x the blocks of bfloat16 in the same memory, 3.76x those of float32.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from sluiceway.kernels.backend import AttentionBackend
    from sluiceway.kernels.paged_attention import AttentionMetadata

__all__ = [
    "KV_CACHE_DTYPES",
    "SCALE_BYTES",
    "attention_quantized",
    "check_kv_cache_backend",
    "dequantize_rows",
    "is_quantized",
    "kv_cache_torch_dtype",
    "kv_row_width",
    "quantize_rows",
    "split_blocks",
    "write_kv_quantized",
]

KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3")
QUANTIZED = (torch.int8, torch.float8_e4m3fn)  # pool dtypes with scales inside the rows
_QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
SCALE_BYTES = 4  # one float32 scale per token per KV head


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pool tensor's dtype for ``--kv-cache-dtype``: ``auto`` the model's, ``int8``
    ``torch.int8``, ``fp8_e4m3`` ``torch.float8_e4m3fn`` (the layout above).

    Raises:
        ValueError: another name.
    """
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype == "int8":
        return torch.int8
    if kv_cache_dtype == "fp8_e4m3":
        return torch.float8_e4m3fn
    raise ValueError(f"--kv-cache-dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")


def check_kv_cache_backend(kv_dtype: torch.dtype, backend: AttentionBackend) -> None:
    """Refuses a quantized KV pool the attention ``backend`` cannot read: fp8 on Triton, int8
    on Triton's separate decode/prefill kernels (``SLUICEWAY_BATCH_INVARIANT=0``).

    Raises:
        ValueError: naming both flags.
    """
    if kv_dtype == torch.float8_e4m3fn and backend.name == "triton":
        raise ValueError(
            "--kv-cache-dtype fp8_e4m3 is not implemented in the Triton kernels (--attention-"
            "backend triton, auto's choice on CUDA): use int8, or --attention-backend torch"
        )
    if kv_dtype == torch.int8 and backend.name == "triton" and not backend.batch_invariant:
        raise ValueError(
            "--kv-cache-dtype int8 with --attention-backend triton needs the batch-invariant "
            "unified kernel: unset SLUICEWAY_BATCH_INVARIANT=0 (its decode and prefill "
            "kernels read no int8 cache)"
        )


def is_quantized(kv_cache: torch.Tensor) -> bool:
    """Whether a pool (or one layer's cache) is a quantized layout (int8 or fp8_e4m3)."""
    return kv_cache.dtype in QUANTIZED


def kv_row_width(block_size: int, head_dim: int, dtype: torch.dtype) -> int:
    """Elements of one (block, KV head) row: ``block_size * D``, or ``block_size * (D + 4)``
    for int8 and fp8 (values then scales).

    Raises:
        ValueError: int8/fp8 with ``block_size * D`` not a multiple of 4.
    """
    if dtype not in QUANTIZED:
        return block_size * head_dim
    if block_size * head_dim % SCALE_BYTES:
        raise ValueError(
            f"a quantized KV cache needs block_size * head_dim a multiple of 4, got "
            f"{block_size} * {head_dim}"
        )
    return block_size * (head_dim + SCALE_BYTES)


def split_blocks(
    kv_cache: torch.Tensor, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views of one layer's quantized cache ``[2, num_blocks, Hkv, block_size * (D + 4)]``:
    keys ``[num_blocks, Hkv, D, block_size]`` and values ``[num_blocks, Hkv, block_size, D]``
    in the cache's dtype, key scales and value scales ``[num_blocks, Hkv, block_size]``
    float32."""
    _, nb, hkv, width = kv_cache.shape
    bs = width // (head_dim + SCALE_BYTES)
    values = kv_cache[..., : bs * head_dim]
    scales = kv_cache[..., bs * head_dim :].view(torch.float32)
    return (
        values[0].view(nb, hkv, head_dim, bs),
        values[1].view(nb, hkv, bs, head_dim),
        scales[0],
        scales[1],
    )


def quantize_rows(
    x: torch.Tensor, dtype: torch.dtype = torch.int8
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[..., D]`` (any float dtype) -> ``(q [..., D] in dtype, scale [...] float32)``
    by the rule of the module docstring for ``dtype`` (int8 or float8_e4m3fn; each row from
    its own values)."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1) / _QMAX[dtype]
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    if dtype == torch.float8_e4m3fn:  # a zero row divides 0 by 1: zeros
        return (xf / safe[..., None]).to(dtype), scale
    q = torch.round(xf / safe[..., None]).clamp_(-127, 127)
    q = torch.where(scale[..., None] > 0, q, torch.zeros_like(q))
    return q.to(torch.int8), scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``q`` int8/float8 ``[..., D]`` and ``scale`` ``[...]`` -> float32 ``q * scale``."""
    return q.float() * scale[..., None]


def write_kv_quantized(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Quantize ``key``/``value`` ``[T, Hkv, D]`` row by row and scatter values and scales to
    their slots (``[T]`` int64, distinct) of one layer's quantized cache, in place."""
    d = key.shape[-1]
    keys, values, key_scales, value_scales = split_blocks(kv_cache, d)
    bs = keys.shape[-1]
    blocks = torch.div(slot_mapping, bs, rounding_mode="floor")
    offsets = slot_mapping - blocks * bs
    kq, ks = quantize_rows(key, kv_cache.dtype)
    vq, vs = quantize_rows(value, kv_cache.dtype)
    keys[blocks, :, :, offsets] = kq
    values[blocks, :, offsets] = vq
    key_scales[blocks, :, offsets] = ks
    value_scales[blocks, :, offsets] = vs


def attention_quantized(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """The reference attention over a quantized cache (the oracle of the C++ kernel's):
    per sequence, its blocks dequantized to float32, one masked ``scaled_dot_product_attention``
    in float32 (float64 for a float64 ``query``: the tests' exact oracle, whose result does not
    hang on the order the CPU's SDPA sums in), causal, within ``sliding_window`` when given; the
    output rounded once to ``query``'s dtype. Shapes as
    :func:`kernels.paged_attention.paged_attention`."""
    t, hq, d = query.shape
    keys, values, key_scales, value_scales = split_blocks(kv_cache, d)
    hkv = keys.shape[1]
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    assert metadata.step is not None, "metadata built without its step indices"
    step = metadata.step
    compute = torch.promote_types(query.dtype, torch.float32)  # float64 stays float64
    out = torch.empty_like(query)
    start = 0
    for i, (q_len, c) in enumerate(zip(step.query_lens, step.context_lens, strict=True)):
        blocks = step.tables[i, : step.used[i]].to(query.device)
        k = dequantize_rows(keys[blocks].transpose(-1, -2), key_scales[blocks])
        v = dequantize_rows(values[blocks], value_scales[blocks])
        k = k.transpose(0, 1).reshape(hkv, -1, d)[:, :c]  # [Hkv, c, D]
        v = v.transpose(0, 1).reshape(hkv, -1, d)[:, :c]
        kpos = torch.arange(c, device=query.device)
        qpos = torch.arange(c - q_len, c, device=query.device)
        visible = kpos[None, :] <= qpos[:, None]
        if sliding_window is not None:
            visible &= kpos[None, :] > qpos[:, None] - sliding_window
        q = query[start : start + q_len].transpose(0, 1).to(compute).unsqueeze(0)
        o = F.scaled_dot_product_attention(
            q,
            k.to(compute).unsqueeze(0),
            v.to(compute).unsqueeze(0),
            attn_mask=visible[None, None],
            scale=scale,
            enable_gqa=hq != hkv,
        )
        out[start : start + q_len] = o[0].transpose(0, 1).to(query.dtype)
        start += q_len
    assert start == t
    return out
