"""GGUF-quantized weights repacked once at load for the quantized GEMM
(kernels/csrc/quant_gemm.cpp, :func:`sluiceway.kernels.cpu_ops.quant_linear`), which
dequantizes them tile by tile into bfloat16 pairs for bf16_gemm's micro-kernel.

Every supported type is read as ``w[n][k] = fma(a, u, b)`` (Q4_1, Q4_K) or ``a * q`` with ``u``
the unsigned quant, ``q = u - offset`` and ``a``, ``b`` per column and 32 (Q6_K: 16) K values,
as ``gguf.quants.dequantize`` computes them (gguf-py's quants.py, which follows
ggml-quants.c): the kernel's float32 weights are bitwise gguf's. The quants keep their bits
(Q6_K's widened to 8); the scales stay float16 where the file's are (Q8_0, Q4_0, Q4_1, Q5_0)
and are float32 products where they are not (Q4_K ``d * sc``, ``dmin * m``; Q6_K ``d * scale``).
The ``"a8"`` layout (``--quantization gguf_a8``) keeps the same scales and regroups the quants
four K values to a 32-bit lane for kernels/csrc/quant_gemm_a8.cpp's int8 dot products.
"""

from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import torch

__all__ = ["BITS", "LAYOUTS", "SUPPORTED", "QuantWeight", "merge_row_parts", "pack_gguf"]

Q = gguf.GGMLQuantizationType
SUPPORTED = (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q4_K, Q.Q6_K)
LAYOUTS = ("tile", "a8")
# Bits a weight in the packed "tile" layout (N a multiple of 16): quants, then scales.
BITS = {Q.Q8_0: 8.5, Q.Q4_0: 4.5, Q.Q4_1: 5.0, Q.Q5_0: 5.5, Q.Q4_K: 6.0, Q.Q6_K: 10.0}


@dataclasses.dataclass(frozen=True)
class QuantWeight:
    """A ``[n, k]`` weight in quant_gemm.cpp's layout (``"tile"``: dequantized per tile for
    bfloat16 or float32 activations) or quant_gemm_a8.cpp's (``"a8"``: int8 activations):
    ``packed`` uint8 ``[ceil(n / 16), k / 32, chunk]`` (a chunk per 16 columns per 32 K
    values: see the .cpp files' headers)."""

    packed: torch.Tensor
    n: int
    k: int
    qtype: Q
    layout: str = "tile"  # or "a8": quant_gemm_a8.cpp's (LAYOUTS)

    @property
    def nbytes(self) -> int:
        """Bytes held (the packed tensor)."""
        return self.packed.numel()


def _f16(col: np.ndarray) -> np.ndarray:
    return col.copy().view(np.float16)[..., 0]


def _nibbles32(qs: np.ndarray) -> np.ndarray:
    """``[B, 16]`` bytes -> ``[B, 32]``: element j < 16 the low nibble of byte j, j >= 16 the
    high nibble of byte j - 16 (Q4_0, Q4_1, Q5_0)."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _unpack_blocks(raw: np.ndarray, qtype: Q, k: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """GGUF block bytes of an ``[n, k]`` tensor -> the quants uint8 ``[n, k]`` as packed (``u``,
    or for Q8_0 and Q6_K the int8 bits of ``q``) and the scale arrays ``[n, k / group]``
    (float16 or float32: ``a``, then ``b`` if any)."""
    block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1, block_bytes)
    nb = blocks.shape[0]
    u: np.ndarray
    if qtype == Q.Q8_0:
        scales, u = [_f16(blocks[:, :2])], blocks[:, 2:]  # q = u - 128 as int8: the file's bytes
    elif qtype == Q.Q4_0:
        scales, u = [_f16(blocks[:, :2])], _nibbles32(blocks[:, 2:])
    elif qtype == Q.Q4_1:
        scales, u = [_f16(blocks[:, :2]), _f16(blocks[:, 2:4])], _nibbles32(blocks[:, 4:])
    elif qtype == Q.Q5_0:
        qh = blocks[:, 2:6].copy().view(np.uint32) >> np.arange(32, dtype=np.uint32)
        u = _nibbles32(blocks[:, 6:]) | ((qh & 1).astype(np.uint8) << 4)
        scales = [_f16(blocks[:, :2])]
    elif qtype == Q.Q4_K:
        d = _f16(blocks[:, :2]).astype(np.float32)[:, None]
        dmin = _f16(blocks[:, 2:4]).astype(np.float32)[:, None]
        sc, m = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16])
        scales = [d * sc.astype(np.float32), -(dmin * m.astype(np.float32))]
        qs = blocks[:, 16:].reshape(nb, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
        u = (qs & 15).reshape(nb, 256)
    else:  # Q6_K: ql[128], qh[64], int8 scales[16], d
        ql = blocks[:, :128].reshape(nb, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
        qh = blocks[:, 128:192].reshape(nb, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(
            1, 1, 4, 1
        )
        u = (ql & 15).reshape(nb, 256) | ((qh & 3).reshape(nb, 256) << 4)
        u = u - np.uint8(32)  # q = u - 32 as int8 (mod 256)
        d = _f16(blocks[:, 208:210]).astype(np.float32)[:, None]
        scales = [d * blocks[:, 192:208].view(np.int8).astype(np.float32)]
    n = nb * block // k
    return np.asarray(u, dtype=np.uint8).reshape(n, k), [s.reshape(n, -1) for s in scales]


def pack_gguf(
    raw: np.ndarray,
    qtype: Q,
    n: int,
    k: int,
    rows: np.ndarray | None = None,
    layout: str = "tile",
) -> QuantWeight:
    """The ``[n, k]`` tensor of GGUF blocks ``raw`` (uint8, row-major blocks, e.g.
    ``GGUFReader``'s ``t.data``) -> :class:`QuantWeight`, with its rows reordered by ``rows``
    (int ``[n]``: output row i is the file's row ``rows[i]``), e.g. the inverse of llama.cpp's
    rotary permutation of Q/K (``gguf_blocks.reverse_permute`` applied to
    ``np.arange(n)[:, None]``). Bits a weight: :data:`BITS` (plus N's padding to 16); in the
    ``"a8"`` layout Q5_0's quants take 8 bits (quant_gemm_a8.cpp reads bytes).

    Raises:
        ValueError: a type not in :data:`SUPPORTED`, ``k`` not a positive multiple of 32 (and
            of the type's block), ``raw`` not ``n`` rows of ``k``, or a layout not in
            :data:`LAYOUTS`.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r} is not one of {', '.join(LAYOUTS)}")
    if qtype not in SUPPORTED:
        raise ValueError(f"no quantized GEMM for {qtype.name}")
    block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    if k <= 0 or k % 32 or k % block:
        raise ValueError(f"K {k} is not a positive multiple of 32 and of {qtype.name}'s {block}")
    if np.asarray(raw).size != n * k // block * block_bytes:
        raise ValueError(f"{np.asarray(raw).size} bytes are not {n} rows of {k} {qtype.name}")
    u, scales = _unpack_blocks(raw, qtype, k)
    if rows is not None:
        u, scales = u[rows], [s[rows] for s in scales]
    groups, subs, pad = -(-n // 16), k // 32, -n % 16
    u = np.pad(u, ((0, pad), (0, 0)))  # padding: quants and scales 0
    parts: list[np.ndarray]
    if layout == "a8":
        parts = [_a8_quants(u, qtype, groups, subs)]
    else:
        parts = _tile_quants(u, qtype, groups, subs)
    for s in scales:  # [n, subs * vecs] -> [groups, subs, vecs, 16]
        s = np.pad(s, ((0, pad), (0, 0)))
        vecs = s.shape[1] // subs
        s = np.ascontiguousarray(s.reshape(groups, 16, subs, vecs).transpose(0, 2, 3, 1))
        parts.append(s.view(np.uint8).reshape(groups, subs, -1))
    packed = np.ascontiguousarray(np.concatenate(parts, axis=-1))
    return QuantWeight(torch.from_numpy(packed), n, k, qtype, layout)


def _a8_quants(u: np.ndarray, qtype: Q, groups: int, subs: int) -> np.ndarray:
    """Quants ``u`` ``[16 groups, 32 subs]`` -> quant_gemm_a8.cpp's ``[groups, subs, bytes]``:
    64-byte vectors whose 4-byte lane c holds column c's K values four at a time; nibble types
    pair vector i's K 8 i + j (low) with 8 i + 4 + j (high); Q8_0 and Q6_K as ``q + 128``."""
    if qtype in (Q.Q8_0, Q.Q6_K):
        u = u ^ np.uint8(128)  # int8 bits of q -> q + 128
    w = u.reshape(groups, 16, subs, 32).transpose(0, 2, 1, 3)  # [g, s, column, K]
    if qtype in (Q.Q4_0, Q.Q4_1, Q.Q4_K):
        w = w.reshape(groups, subs, 16, 4, 2, 4)  # column, i, low/high, j
        w = w[..., 0, :] | (w[..., 1, :] << 4)
        return np.ascontiguousarray(w.transpose(0, 1, 3, 2, 4)).reshape(groups, subs, 256)
    w = w.reshape(groups, subs, 16, 8, 4)  # column, i, j
    return np.ascontiguousarray(w.transpose(0, 1, 3, 2, 4)).reshape(groups, subs, 512)


def _tile_quants(u: np.ndarray, qtype: Q, groups: int, subs: int) -> list[np.ndarray]:
    """Quants ``u`` ``[16 groups, 32 subs]`` -> quant_gemm.cpp's pairs (see its layout)."""
    # values v[g, s, p, j]: column 16 g + j // 2, K 32 s + 2 p + j % 2
    v = u.reshape(groups, 16, subs, 16, 2).transpose(0, 2, 3, 1, 4).reshape(groups, subs, 16, 32)
    parts: list[np.ndarray]
    if qtype in (Q.Q8_0, Q.Q6_K):
        parts = [v.reshape(groups, subs, 512)]
    else:
        parts = [((v[..., :16] & 15) | ((v[..., 16:] & 15) << 4)).reshape(groups, subs, 256)]
        if qtype == Q.Q5_0:
            bits = ((v >> 4) & 1).astype(np.uint32) << np.arange(32, dtype=np.uint32)
            parts.append(
                bits.sum(axis=-1, dtype=np.uint32).view(np.uint8).reshape(groups, subs, 64)
            )
    return parts


def merge_row_parts(parts: list[QuantWeight]) -> list[QuantWeight]:
    """A fused weight's parts (q, k, v or gate, up, in row order) with each run of adjacent
    parts of one type and K joined into one weight (their chunk groups concatenated), so that
    one GEMM call computes them: ``[Q4_1 576, Q4_1 192, Q4_1 192]`` becomes one ``Q4_1 960``.
    A part whose ``n`` is not a multiple of 16 ends its run (its last group is padded). An
    output column's value does not depend on the other columns (quant_gemm.cpp reduces each
    over K alone), so the merged GEMM's columns are bitwise the parts'."""
    merged: list[QuantWeight] = []
    for part in parts:
        last = merged[-1] if merged else None
        if (
            last is not None
            and (last.qtype, last.k, last.layout) == (part.qtype, part.k, part.layout)
            and last.n % 16 == 0
        ):
            packed = torch.cat((last.packed, part.packed))
            merged[-1] = QuantWeight(packed, last.n + part.n, last.k, last.qtype, last.layout)
        else:
            merged.append(part)
    return merged
