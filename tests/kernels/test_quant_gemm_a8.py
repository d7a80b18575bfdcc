"""The int8-activation GEMM of GGUF-quantized weights (kernels/csrc/quant_gemm_a8.cpp, the
``"a8"`` layout, ``--quantization gguf_a8``): bitwise the torch reference below (x quantized
per 32 K values, exact integer dot products, the header's float32 steps in order) at
SmolLM2's and Gemma 3 270M's shapes and every supported type, M 1 to 2,048 (so batch
invariant: a row's result is the reference's whatever M), with bias, float32/bfloat16 out and
into a column slice; ``quant_embedding`` of the a8 layout bitwise ``gguf.quants.dequantize``'s
rows; and how far it lands from the float32 GEMM of the dequantized weights."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from sluiceway.kernels import cpu_ops
from sluiceway.kernels.quant_pack import SUPPORTED, _unpack_blocks, merge_row_parts, pack_gguf
from sluiceway.worker.quantized import quant_linear_parts
from tests.kernels.test_quant_gemm import SMOL, bits, dequantized, random_blocks

Q = gguf.GGMLQuantizationType
if not cpu_ops.quant_gemm_a8_supported():
    pytest.skip(
        "quant_gemm_a8 needs a CPU with AVX512-VNNI and AVX512-BF16", allow_module_level=True
    )

_OFFSET = {Q.Q4_0: 8, Q.Q5_0: 16}  # q = u - offset; Q8_0, Q6_K: q is the int8 bits


def quantize_x(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[M, K]`` -> (q float64 ``[M, K / 32, 32]`` integers in [-127, 127], d float32
    ``[M, K / 32]``): per 32 K values amax = max |x|, d = amax / 127, q = round-half-even(x *
    (127 / amax)), 0 where amax is 0; every step a float32 op."""
    xb = x.float().reshape(x.shape[0], -1, 32)
    amax = xb.abs().amax(-1)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros(()))
    q = torch.round(xb * inv[..., None]).clamp(-127, 127)
    return q.double(), amax / torch.tensor(127.0)


def a8_reference(
    x: torch.Tensor,
    raw: np.ndarray,
    qtype: Q,
    n: int,
    k: int,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """The header's steps in torch: per sub-block s, ``t = a dot + b sumq`` (Q4_1, Q4_K), ``a
    (dot - off sumq)`` (Q4_0, Q5_0, Q8_0), ``a_lo dot_lo + a_hi dot_hi`` (Q6_K, signed q), ``acc
    = acc + t d``, then ``+ bias``; integer sums exact in float64."""
    u8, scales = _unpack_blocks(raw, qtype, k)
    has_b = qtype in (Q.Q4_1, Q.Q4_K)
    if qtype in (Q.Q8_0, Q.Q6_K):
        w = torch.from_numpy(u8.view(np.int8).astype(np.float64))
    else:
        w = torch.from_numpy(u8.astype(np.float64)) - _OFFSET.get(qtype, 0)
    a = torch.from_numpy(scales[0].astype(np.float32))
    b = torch.from_numpy(scales[1].astype(np.float32)) if has_b else None
    q, d = quantize_x(x)
    acc = torch.zeros(x.shape[0], n, dtype=torch.float32)
    halves = 2 if qtype == Q.Q6_K else 1
    for s in range(k // 32):
        t = None
        for h in range(halves):
            lo, hi = 32 * s + 32 // halves * h, 32 * s + 32 // halves * (h + 1)
            dot = (q[:, s, lo - 32 * s : hi - 32 * s] @ w[:, lo:hi].T).float()
            term = a[:, halves * s + h] * dot
            t = term if t is None else t + term
        assert t is not None
        if b is not None:
            sumq = q[:, s].sum(-1).float()[:, None]
            t = t + b[:, s] * sumq
        acc = acc + t * d[:, s, None]
    if bias is not None:
        acc = acc + bias
    return acc.to(out_dtype)


SMALL_M, ALL_M = (1, 2, 5, 31, 200), (1, 2, 5, 31, 200, 2048)
# (type, N, K, Ms): SmolLM2's four layer shapes in its Q4_1 with all Ms, the others with a few;
# its Q8_0 LM head; Gemma 3 270M's K-quant shapes (K a multiple of 256); N not a multiple of 16
CASES = [
    *[(Q.Q4_1, n, k, ALL_M) for n, k in SMOL],
    *[(q, n, k, SMALL_M) for q in (Q.Q8_0, Q.Q4_0, Q.Q5_0) for n, k in SMOL[:2]],
    (Q.Q8_0, 49152, 576, (1, 5)),
    (Q.Q5_0, 2048, 640, ALL_M),
    (Q.Q4_K, 640, 1024, ALL_M),
    (Q.Q6_K, 640, 2048, ALL_M),
    (Q.Q4_K, 1024, 640 - 128, SMALL_M),
    (Q.Q6_K, 256, 512, SMALL_M),
    (Q.Q4_1, 100, 576, SMALL_M),
    (Q.Q6_K, 40, 256, SMALL_M),
]


@pytest.mark.parametrize(("qtype", "n", "k", "ms"), CASES, ids=lambda c: str(getattr(c, "name", c)))
def test_bitwise_the_reference_and_gguf_rows(qtype: Q, n: int, k: int, ms: tuple[int, ...]) -> None:
    raw = random_blocks(qtype, n, k, seed=n + k)
    weight = pack_gguf(raw, qtype, n, k, layout="a8")
    torch.manual_seed(0)
    x = torch.randn(max(ms), k).bfloat16()
    x[0, :32] = 0  # a sub-block of zeros: amax 0, q 0
    want = a8_reference(x, raw, qtype, n, k)
    for m in ms:
        got = cpu_ops.quant_linear(x[:m], weight)
        assert torch.equal(bits(got), bits(want[:m])), (qtype.name, n, k, m)
    ids = torch.tensor([0, n - 1, n // 2, 7 % n])
    rows = cpu_ops.quant_embedding(weight, ids)
    assert torch.equal(bits(rows), bits(dequantized(raw, qtype, n, k)[ids]))


@pytest.mark.parametrize("qtype", SUPPORTED, ids=lambda q: q.name)
def test_bias_out_dtype_float32_x_and_column_slice(qtype: Q) -> None:
    n, k = 72, 256
    raw = random_blocks(qtype, n, k, seed=3)
    weight = pack_gguf(raw, qtype, n, k, layout="a8")
    torch.manual_seed(1)
    x = torch.randn(9, k)
    bias = torch.randn(n)
    want = a8_reference(x, raw, qtype, n, k, bias, out_dtype=torch.float32)
    got = cpu_ops.quant_linear(x, weight, bias)
    assert got.dtype == torch.float32 and torch.equal(bits(got), bits(want))
    got16 = cpu_ops.quant_linear(x.bfloat16(), weight, bias, out_dtype=torch.bfloat16)
    want16 = a8_reference(x.bfloat16(), raw, qtype, n, k, bias)
    assert torch.equal(bits(got16), bits(want16))
    wide = torch.full((9, n + 40), 7.0)
    cpu_ops.quant_linear(x, weight, bias, out=wide[:, 16 : 16 + n])
    assert torch.equal(bits(wide[:, 16 : 16 + n]), bits(want))
    assert (wide[:, :16] == 7).all() and (wide[:, 16 + n :] == 7).all()


@pytest.mark.parametrize("m", [1, 5, 300])
def test_merged_parts_are_the_parts_bitwise(m: int) -> None:
    k, ns = 576, (576, 192, 192)
    raws = [random_blocks(Q.Q4_1, n, k, seed=n + i) for i, n in enumerate(ns)]
    parts = [pack_gguf(r, Q.Q4_1, n, k, layout="a8") for r, n in zip(raws, ns, strict=True)]
    merged = merge_row_parts(parts)
    assert len(merged) == 1 and merged[0].layout == "a8"
    x = torch.randn(m, k).bfloat16()
    got = quant_linear_parts(x, merged, None)
    want = torch.cat([cpu_ops.quant_linear(x, p) for p in parts], dim=1)
    assert torch.equal(bits(got), bits(want))
    tile = pack_gguf(raws[0], Q.Q4_1, ns[0], k)
    assert len(merge_row_parts([tile, parts[1]])) == 2  # layouts never merge


def test_close_to_the_float32_gemm_of_the_dequantized_weights() -> None:
    """int8 activations cost precision: against x @ W^T in float32 (gguf's weights), the error
    is a small fraction of the output's scale (llama.cpp's Q8 activations do the same)."""
    n, k = 576, 1536
    raw = random_blocks(Q.Q4_1, n, k, seed=5)
    torch.manual_seed(2)
    x = torch.randn(64, k)
    got = cpu_ops.quant_linear(x, pack_gguf(raw, Q.Q4_1, n, k, layout="a8"))
    exact = x.double() @ dequantized(raw, Q.Q4_1, n, k).double().T
    rel = ((got.double() - exact).norm() / exact.norm()).item()
    assert 1e-4 < rel < 1e-2, rel


def test_refused_layout_shapes_and_types() -> None:
    raw = random_blocks(Q.Q8_0, 32, 64, seed=1)
    with pytest.raises(ValueError, match="layout 'bf16'"):
        pack_gguf(raw, Q.Q8_0, 32, 64, layout="bf16")
    weight = pack_gguf(raw, Q.Q8_0, 32, 64, layout="a8")
    with pytest.raises(RuntimeError, match="a8 layout"):
        torch.ops.sluiceway.quant_gemm_a8(
            torch.empty(2, 32), torch.randn(2, 96), weight.packed, int(Q.Q8_0), None
        )
    with pytest.raises(RuntimeError, match="no int8-activation GEMM for ggml type 1"):
        torch.ops.sluiceway.quant_gemm_a8(
            torch.empty(2, 32), torch.randn(2, 64), weight.packed, 1, None
        )
    with pytest.raises(RuntimeError, match="out of range"):
        cpu_ops.quant_embedding(weight, torch.tensor([32]))
