"""The C++ ops Gemma 3 and Qwen3 add (kernels/csrc/elementwise.cpp) against torch: GELU-tanh
and mul, the per-head q/k norm, the norms with float32 ``1 + w`` weights; and each row bitwise
the same whatever the batch (bfloat16)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sluiceway.kernels import cpu_ops
from sluiceway.worker.layers import gemma_rms_norm

cpu_ops.load()


def _tol(dtype: torch.dtype) -> dict[str, float]:
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.05, "rtol": 0.02}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_tanh_and_mul_matches_torch(dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    n = 2048 + 7  # a vector body and a scalar tail
    x = (torch.randn(19, 2 * n) * 4).to(dtype)
    x[0, :5] = torch.tensor([-100.0, 100.0, 0.0, -0.0, -5.0])
    gate, up = x[:, :n].float(), x[:, n:].float()
    ref = F.gelu(gate, approximate="tanh") * up
    out = cpu_ops.gelu_tanh_and_mul(x)
    assert out.dtype == dtype and out.shape == (19, n)
    torch.testing.assert_close(out.float(), ref, **_tol(dtype))
    # saturated: gelu(-100) = 0, gelu(100) = 100 exactly; gelu(0) = 0
    assert out[0, [0, 2, 3]].float().tolist() == [0.0, 0.0, 0.0]
    assert out[0, 1] == (100.0 * up[0, 1]).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms_take_float32_one_plus_w(dtype: torch.dtype) -> None:
    torch.manual_seed(2)
    x, res = torch.randn(37, 640).to(dtype), torch.randn(37, 640).to(dtype)
    w = (torch.rand(640) - 0.5).to(dtype)
    scale = 1.0 + w.float()
    torch.testing.assert_close(
        cpu_ops.rms_norm(x, scale, 1e-6), gemma_rms_norm(x, w, 1e-6), **_tol(dtype)
    )
    xx, rr = x.clone(), res.clone()
    cpu_ops.fused_add_rms_norm(xx, rr, scale, 1e-6)
    assert torch.equal(rr, x + res)
    torch.testing.assert_close(xx, gemma_rms_norm(x + res, w, 1e-6), **_tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qk_rms_norm_matches_per_head_norms(dtype: torch.dtype) -> None:
    torch.manual_seed(3)
    hq, hkv, d, t = 4, 1, 256, 9
    qkv = torch.randn(t, (hq + 2 * hkv) * d).to(dtype)
    qw, kw = (torch.rand(d) - 0.5).to(dtype), (torch.rand(d) - 0.5).to(dtype)
    heads = qkv.view(t, hq + 2 * hkv, d)
    ref_q = gemma_rms_norm(heads[:, :hq], qw, 1e-6)
    ref_k = gemma_rms_norm(heads[:, hq : hq + hkv], kw, 1e-6)
    v = heads[:, hq + hkv :].clone()
    cpu_ops.qk_rms_norm(qkv, 1.0 + qw.float(), 1.0 + kw.float(), hq, hkv, 1e-6)
    torch.testing.assert_close(heads[:, :hq], ref_q, **_tol(dtype))
    torch.testing.assert_close(heads[:, hq : hq + hkv], ref_k, **_tol(dtype))
    assert torch.equal(heads[:, hq + hkv :], v)  # v untouched


def test_rows_do_not_depend_on_the_batch() -> None:
    """bfloat16: each op's row computed among 64 rows is bitwise the row computed alone."""
    torch.manual_seed(4)
    dt = torch.bfloat16
    x = (torch.randn(64, 2 * 2048) * 3).to(dt)
    qkv = torch.randn(64, 6 * 256).to(dt)
    scale = 1.0 + (torch.rand(640) - 0.5)
    h, res = torch.randn(64, 640).to(dt), torch.randn(64, 640).to(dt)
    qs, ks = 1.0 + torch.rand(256), 1.0 + torch.rand(256)
    batch_qkv = qkv.clone()
    cpu_ops.qk_rms_norm(batch_qkv, qs, ks, 4, 1, 1e-6)
    hh, rr = h.clone(), res.clone()
    cpu_ops.fused_add_rms_norm(hh, rr, scale, 1e-6)
    gelu, normed = cpu_ops.gelu_tanh_and_mul(x), cpu_ops.rms_norm(h, scale, 1e-6)
    for r in (0, 17, 63):
        one = qkv[r : r + 1].clone()
        cpu_ops.qk_rms_norm(one, qs, ks, 4, 1, 1e-6)
        assert torch.equal(one[0], batch_qkv[r])
        h1, r1 = h[r : r + 1].clone(), res[r : r + 1].clone()
        cpu_ops.fused_add_rms_norm(h1, r1, scale, 1e-6)
        assert torch.equal(h1[0], hh[r]) and torch.equal(r1[0], rr[r])
        assert torch.equal(cpu_ops.gelu_tanh_and_mul(x[r : r + 1])[0], gelu[r])
        assert torch.equal(cpu_ops.rms_norm(h[r : r + 1], scale, 1e-6)[0], normed[r])


def test_bad_arguments() -> None:
    with pytest.raises(RuntimeError, match="weight must be a contiguous"):
        cpu_ops.rms_norm(torch.randn(2, 8), torch.ones(8, dtype=torch.float64), 1e-6)
    with pytest.raises(RuntimeError, match="q_weight and k_weight must be contiguous float32"):
        cpu_ops.qk_rms_norm(torch.randn(2, 24), torch.ones(8), torch.ones(4), 1, 1, 1e-6)
    with pytest.raises(RuntimeError, match=r"x must be \[T, 2 I\]"):
        cpu_ops.gelu_tanh_and_mul(torch.randn(3, 5))
