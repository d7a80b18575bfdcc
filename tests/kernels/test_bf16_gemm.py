"""The bfloat16 GEMM of the linear layers and the logits (kernels/csrc/bf16_gemm.cpp) against
the float64 oracle, in float32 and bfloat16 out, with and without bias; its batch invariance
(bitwise); the model's choice between it and oneDNN."""

from __future__ import annotations

import pathlib

import pytest
import torch

from sluiceway.kernels import cpu_ops

cpu_ops.load()
needs_bf16 = pytest.mark.skipif(
    not cpu_ops.bf16_gemm_supported(), reason="this CPU has no AVX512-BF16"
)


def _oracle(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.double() @ weight.double().T


def f32(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    return cpu_ops.bf16_linear(x, packed, n, out_dtype=torch.float32)


@needs_bf16
@pytest.mark.parametrize(
    ("m", "n", "k"),
    [
        (1, 64, 576),  # SmolLM2's hidden size, one tile
        (13, 200, 64),  # 2 row groups of 6 and a tail of 1; N not a multiple of 64 (3 + 8 cols)
        (6, 16, 130),  # two K blocks and a pair past them
        (5, 37, 7),  # odd K: the last pair's second half is zero; N tail of 5
        (250, 100, 40),  # more rows than one row block (240)
        (3, 1, 2),
    ],
)
def test_matches_float64(m: int, n: int, k: int) -> None:
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    weight = torch.randn(n, k, generator=g).bfloat16()
    x = torch.randn(m, k, generator=g).bfloat16()
    out = f32(x, cpu_ops.pack_bf16_pairs(weight), n)
    assert out.shape == (m, n) and out.dtype == torch.float32
    ref = _oracle(x, weight)
    # float32 summation of exact products: error ~ k * eps32 * sum|x w|
    bound = 4 * k * 2**-24 * (x.double().abs() @ weight.double().abs().T) + 1e-30
    assert ((out.double() - ref).abs() <= bound).all()
    # bfloat16 out, with a bias: the float32 result + bias, rounded once (to nearest even)
    bias = torch.randn(n, generator=g).bfloat16()
    rounded = cpu_ops.bf16_linear(x, cpu_ops.pack_bf16_pairs(weight), n, bias)
    assert rounded.dtype == torch.bfloat16
    wide = cpu_ops.bf16_linear(x, cpu_ops.pack_bf16_pairs(weight), n, bias, out_dtype=torch.float32)
    assert torch.equal(rounded, wide.bfloat16())
    assert torch.equal(wide, out + bias.float())


@needs_bf16
def test_no_bfloat16_rounding_of_the_results() -> None:
    """Two logits 2**-12 apart (the same bfloat16) stay apart in float32."""
    weight = torch.zeros(2, 4, dtype=torch.bfloat16)
    weight[0, 0] = 1.0
    weight[1, 0], weight[1, 1] = 1.0, 2**-12
    x = torch.tensor([[1.0, 1.0, 0.0, 0.0]]).bfloat16()
    out = f32(x, cpu_ops.pack_bf16_pairs(weight), 2)
    assert out.tolist() == [[1.0, 1.0 + 2**-12]]
    assert torch.nn.functional.linear(x, weight).tolist() == [[1.0, 1.0]]  # what bf16 gives


@needs_bf16
def test_a_row_is_bitwise_the_same_whatever_else_is_in_the_batch() -> None:
    g = torch.Generator().manual_seed(5)
    weight = (torch.randn(1000, 576, generator=g) * 0.05).bfloat16()
    packed = cpu_ops.pack_bf16_pairs(weight)
    rows = torch.randn(300, 576, generator=g).bfloat16()
    alone = f32(rows[:1], packed, 1000)
    for m in (2, 5, 6, 7, 64, 241, 300):
        batch = f32(rows[:m], packed, 1000)
        assert torch.equal(batch[:1], alone), m
    # strided rows (a slice of a wider hidden state) read the same values
    wide = torch.zeros(4, 600, dtype=torch.bfloat16)
    wide[:, :576] = rows[:4]
    strided = f32(wide[:, :576], packed, 1000)
    assert torch.equal(strided, f32(rows[:4], packed, 1000))


@needs_bf16
def test_rejects_bad_arguments() -> None:
    packed = cpu_ops.pack_bf16_pairs(torch.randn(32, 8).bfloat16())
    with pytest.raises(RuntimeError, match="x must be bfloat16"):
        f32(torch.randn(2, 8), packed, 32)
    with pytest.raises(RuntimeError, match="packed holds 8 K values, x has K = 10"):
        f32(torch.randn(2, 10).bfloat16(), packed, 32)
    with pytest.raises(RuntimeError, match="ceil"):
        f32(torch.randn(2, 8).bfloat16(), packed, 33)
    with pytest.raises(RuntimeError, match="ceil"):
        f32(torch.randn(2, 8).bfloat16(), packed, 16)  # a weight of 32 rows, N 16
    x = torch.randn(2, 32).bfloat16()
    square = cpu_ops.pack_bf16_pairs(torch.randn(32, 32).bfloat16())
    with pytest.raises(RuntimeError, match="single memory location"):
        cpu_ops.bf16_linear(x, square, 32, out=x)  # out aliasing x
    with pytest.raises(RuntimeError, match="packed must be"):
        f32(torch.randn(2, 8).bfloat16(), packed.float(), 32)
    with pytest.raises(RuntimeError, match="bias must be"):
        cpu_ops.bf16_linear(torch.randn(2, 8).bfloat16(), packed, 32, torch.zeros(31))
    with pytest.raises(RuntimeError, match="out must be"):
        cpu_ops.bf16_linear(torch.randn(2, 8).bfloat16(), packed, 32, out=torch.empty(2, 32).half())


def test_pack_layout() -> None:
    weight = torch.arange(20 * 3, dtype=torch.float32).view(20, 3).bfloat16()
    packed = cpu_ops.pack_bf16_pairs(weight)
    assert packed.shape == (2, 2, 16, 2) and packed.dtype == torch.bfloat16
    assert packed[1, 0, 3].tolist() == weight[19, 0:2].tolist()
    assert packed[1, 1, 3].tolist() == [weight[19, 2].item(), 0.0]  # K padded with zero
    assert packed[1, 0, 4:].abs().sum().item() == 0.0  # N padded with zeros


@pytest.mark.parametrize("bf16_kernel", [True, False])
def test_model_logits_kernel_choice(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, bf16_kernel: bool
) -> None:
    """bfloat16 model: the pairs kernel for every linear where the CPU has AVX512-BF16 (and
    the runner says it is batch invariant), else oneDNN, float32 logits from a float32 copy;
    both float32 logits within float32 rounding of the float64 oracle, and the reused buffer
    gives the same values as a fresh tensor."""
    if bf16_kernel and not cpu_ops.bf16_gemm_supported():
        pytest.skip("this CPU has no AVX512-BF16")
    if not bf16_kernel:
        monkeypatch.setattr(cpu_ops, "bf16_gemm_supported", lambda: False)
    from sluiceway.worker.model_runner import ModelRunner
    from tests.worker.tiny_models import make_tiny_model

    model_dir = make_tiny_model(tmp_path / "llama", "llama-untied", seed=3)
    runner = ModelRunner(
        model_dir, dtype="bfloat16", block_size=16, kv_cache_memory=1 << 20,
        attention_backend="cpu",
    )  # fmt: skip
    model = runner.model
    assert model.bf16_pairs is bf16_kernel and runner.batch_invariant is bf16_kernel
    assert all(layer.bf16_pairs is bf16_kernel for layer in model.layers)
    assert model.lm_head_weight is not None
    vocab, hidden_size = model.lm_head_weight.shape
    assert model.packed_lm_head_bytes == vocab * hidden_size * (2 if bf16_kernel else 4)
    hidden = torch.randn(9, hidden_size).bfloat16()
    fresh = model.compute_logits(hidden)
    reused = model.compute_logits(hidden, reuse_buffer=True)
    assert fresh.dtype == reused.dtype == torch.float32 and torch.equal(fresh, reused)
    ref = _oracle(hidden, model.lm_head_weight)
    torch.testing.assert_close(fresh.double(), ref, atol=1e-4, rtol=1e-5)
    # fewer rows next time: a view of the same buffer, the values of those rows
    again = model.compute_logits(hidden[:3], reuse_buffer=True)
    assert torch.equal(again, fresh[:3])


@needs_bf16
def test_k_zero_gives_the_bias() -> None:
    """An empty reduction (K 0; it crashed with SIGFPE): zeros, or the bias."""
    packed = cpu_ops.pack_bf16_pairs(torch.zeros(20, 0, dtype=torch.bfloat16))
    x = torch.zeros(3, 0, dtype=torch.bfloat16)
    assert torch.equal(cpu_ops.bf16_linear(x, packed, 20, out_dtype=torch.float32),
                       torch.zeros(3, 20))  # fmt: skip
    bias = torch.arange(20.0)
    assert torch.equal(cpu_ops.bf16_linear(x, packed, 20, bias), bias.bfloat16().expand(3, 20))
