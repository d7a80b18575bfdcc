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
# type -> (group, nbits, off, has_b)
SUPPORTED: dict[Q, tuple[int, int, int, bool]] = {
    Q.Q8_0: (32, 8, 128, False),
    Q.Q4_0: (32, 4, 8, False),
    Q.Q4_1: (32, 4, 0, True),
    Q.Q5_0: (32, 5, 16, False),
    Q.Q4_K: (32, 4, 0, True),
    Q.Q6_K: (16, 6, 32, False),
}


@dataclasses.dataclass(frozen=True)
class QuantWeight:
    """A ``[n, k]`` weight in the kernel's layout: ``packed`` uint8
    ``[ceil(n / 16), k / group, stride]`` (see quant_gemm.cpp's header), and how to read it."""

    packed: torch.Tensor
    n: int
    k: int
    qtype: Q
    group: int
    nbits: int
    offset: int
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
    applied to ``np.arange(n)[:, None]``). Same bits as the file, scales as float32:
    ``ceil(n / 16) * 16 * (k * nbits / 8 + 4 * (1 + has_b) * k / group)`` bytes.

    Raises:
        ValueError: an unsupported type or shape.
    """
    u, a, b = unpack_blocks(raw, qtype, k)  # raises for an unsupported type
    group, nbits, off, has_b = SUPPORTED[qtype]
    if u.shape[0] != n:
        raise ValueError(f"{u.shape[0]} rows of {k}, expected {n}")
    if rows is not None:
        u, a = u[rows], a[rows]
        b = None if b is None else b[rows]
    pad = -n % 16
    groups, subs = (n + pad) // 16, k // group
    u = np.pad(u, ((0, pad), (0, 0))).reshape(groups, 16, subs, group).transpose(0, 2, 3, 1)
    parts = [(u[:, :, 0::2] & 15) | ((u[:, :, 1::2] & 15) << 4)]  # [G, S, group/2, 16]
    for p in range(nbits - 4):
        bits = ((u >> (4 + p)) & 1).astype(np.uint16) << np.arange(16, dtype=np.uint16)
        parts.append(bits.sum(axis=-1, dtype=np.uint16).view(np.uint8))  # [G, S, group * 2]
    for s in (a, b) if b is not None else (a,):
        s = np.pad(s, ((0, pad), (0, 0))).reshape(groups, 16, subs).transpose(0, 2, 1)
        parts.append(np.ascontiguousarray(s, dtype=np.float32).view(np.uint8))
    packed = np.concatenate([p.reshape(groups, subs, -1) for p in parts], axis=-1)
    return QuantWeight(
        torch.from_numpy(np.ascontiguousarray(packed)), n, k, qtype, group, nbits, off, has_b
    )
