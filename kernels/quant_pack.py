"""GGUF-quantized weights repacked once at load for the quantized GEMM
(kernels/csrc/quant_gemm.cpp, :func:`sluiceway.kernels.cpu_ops.quant_linear`).

Every supported type is read as ``w[n][k] = a[n][s] * (u[n][k] - off)`` or
``fma(a[n][s], u[n][k], b[n][s])`` with ``u`` the unsigned quant, ``s = k // group`` and
``a``, ``b`` float32 computed as ``gguf.quants.dequantize`` does (formulas from gguf-py's
quants.py, which follows ggml-quants.c); ``a * u`` is exact in float32, so the kernel's weights
are bitwise gguf's. The quants keep their bits (4, 5, 6 or 8); the scales widen to float32.
"""

from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import torch

__all__ = ["SUPPORTED", "QuantWeight", "pack_gguf", "unpack_blocks"]

Q = gguf.GGMLQuantizationType
TABLE4, TABLE5, BYTES = 0, 1, 2  # the kernel's kinds (quant_gemm.cpp's header)
# type -> (kind, off, a values per 32 K values, has_b)
SUPPORTED: dict[Q, tuple[int, int, int, bool]] = {
    Q.Q8_0: (BYTES, 128, 1, False),
    Q.Q4_0: (TABLE4, 8, 1, False),
    Q.Q4_1: (TABLE4, 0, 1, True),
    Q.Q5_0: (TABLE5, 16, 1, False),
    Q.Q4_K: (TABLE4, 0, 1, True),
    Q.Q6_K: (BYTES, 32, 2, False),  # 6-bit quants widened to int8 (8.5 bits a weight)
}


@dataclasses.dataclass(frozen=True)
class QuantWeight:
    """A ``[n, k]`` weight in the kernel's layout: ``packed`` uint8 ``[n, k / 32, stride]``
    (see quant_gemm.cpp's header), and how to read it."""

    packed: torch.Tensor
    n: int
    k: int
    qtype: Q
    kind: int
    offset: int
    scales: int
    has_b: bool


def _f16(col: np.ndarray) -> np.ndarray:
    return col.copy().view(np.float16).astype(np.float32)[..., 0]


def _nibbles32(qs: np.ndarray) -> np.ndarray:
    """``[B, 16]`` bytes -> ``[B, 32]``: element j < 16 the low nibble of byte j, j >= 16 the
    high nibble of byte j - 16 (Q4_0, Q4_1, Q5_0)."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def unpack_blocks(
    raw: np.ndarray, qtype: Q, k: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """GGUF block bytes of an ``[n, k]`` tensor (``raw`` uint8, ``n * k / block`` blocks in
    row-major order, e.g. ``GGUFReader``'s ``t.data``) -> ``u`` uint8 ``[n, k]``, ``a``
    float32 ``[n, k / group]`` and ``b`` (``None`` for types without a min).

    Raises:
        ValueError: a type not in :data:`SUPPORTED`, or ``k`` not a multiple of its block.
    """
    if qtype not in SUPPORTED:
        raise ValueError(f"no quantized GEMM for {qtype.name}")
    block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    if k % block:
        raise ValueError(f"K {k} is not a multiple of {qtype.name}'s block of {block}")
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1, block_bytes)
    nb, b = blocks.shape[0], None
    u: np.ndarray
    if qtype == Q.Q8_0:
        a, u = _f16(blocks[:, :2]), (blocks[:, 2:].view(np.int8).astype(np.int16) + 128)
        a = a[:, None]
    elif qtype == Q.Q4_0:
        a, u = _f16(blocks[:, :2])[:, None], _nibbles32(blocks[:, 2:])
    elif qtype == Q.Q4_1:
        a, b = _f16(blocks[:, :2])[:, None], _f16(blocks[:, 2:4])[:, None]
        u = _nibbles32(blocks[:, 4:])
    elif qtype == Q.Q5_0:
        a = _f16(blocks[:, :2])[:, None]
        qh = blocks[:, 2:6].copy().view(np.uint32) >> np.arange(32, dtype=np.uint32)
        u = _nibbles32(blocks[:, 6:]) | ((qh & 1).astype(np.uint8) << 4)
    elif qtype == Q.Q4_K:
        d, dmin = _f16(blocks[:, :2])[:, None], _f16(blocks[:, 2:4])[:, None]
        sc, m = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16])
        a, b = d * sc.astype(np.float32), -(dmin * m.astype(np.float32))
        qs = blocks[:, 16:].reshape(nb, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
        u = (qs & 15).reshape(nb, 256)
    else:  # Q6_K: ql[128], qh[64], int8 scales[16], d
        ql = blocks[:, :128].reshape(nb, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
        qh = blocks[:, 128:192].reshape(nb, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(
            1, 1, 4, 1
        )
        u = (ql & 15).reshape(nb, 256) | ((qh & 3).reshape(nb, 256) << 4)
        a = _f16(blocks[:, 208:210])[:, None] * blocks[:, 192:208].view(np.int8).astype(np.float32)
    n = nb * block // k
    u = np.asarray(u, dtype=np.uint8).reshape(n, k)
    a = np.asarray(a, dtype=np.float32).reshape(n, -1)
    return u, a, None if b is None else np.asarray(b, dtype=np.float32).reshape(n, -1)


def pack_gguf(
    raw: np.ndarray, qtype: Q, n: int, k: int, rows: np.ndarray | None = None
) -> QuantWeight:
    """The ``[n, k]`` tensor of GGUF blocks ``raw`` (uint8) -> :class:`QuantWeight`, with its
    rows reordered by ``rows`` (int ``[n]``: output row i is the file's row ``rows[i]``), e.g.
    the inverse of llama.cpp's rotary permutation of Q/K (``model_files.reverse_permute``
    applied to ``np.arange(n)[:, None]``). The file's quant bits (Q6_K's widened to 8), its
    scales as float32: bits a weight 5 (Q4_0), 6 (Q4_1, Q4_K, Q5_0), 9 (Q8_0), 10 (Q6_K).

    Raises:
        ValueError: an unsupported type or shape.
    """
    u, a, b = unpack_blocks(raw, qtype, k)  # raises for an unsupported type
    kind, off, scales, has_b = SUPPORTED[qtype]
    if u.shape[0] != n or k % 32:
        raise ValueError(f"{u.shape[0]} rows of {k}, expected {n} rows of a multiple of 32")
    if rows is not None:
        u, a = u[rows], a[rows]
        b = None if b is None else b[rows]
    subs = k // 32
    u = u.reshape(n, subs, 32)
    parts: list[np.ndarray]
    if kind == BYTES:
        parts = [(u.astype(np.int16) - off).astype(np.int8).view(np.uint8)]
    else:
        parts = [(u[..., :16] & 15) | ((u[..., 16:] & 15) << 4)]
        if kind == TABLE5:
            bits = ((u >> 4) & 1).astype(np.uint32) << np.arange(32, dtype=np.uint32)
            parts.append(bits.sum(axis=-1, dtype=np.uint32)[..., None].view(np.uint8))
    for s in (a, b) if b is not None else (a,):
        parts.append(np.ascontiguousarray(s, dtype=np.float32).reshape(n, subs, -1).view(np.uint8))
    packed = np.concatenate(parts, axis=-1)
    return QuantWeight(
        torch.from_numpy(np.ascontiguousarray(packed)), n, k, qtype, kind, off, scales, has_b
    )
