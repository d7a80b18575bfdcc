"""Per-row Triton RMSNorm, and the residual add fused with it, for the batch-invariant CUDA path.

Shapes: ``hidden`` and ``residual`` ``[T, H]`` (rows contiguous), ``weight`` ``[H]``; any
float dtype, the math in float32.

- :func:`triton_rms_norm`: ``hidden * rsqrt(mean(hidden^2) + eps) * weight``, rounded once
  to the input's dtype (as ``F.rms_norm`` and :func:`kernels.cpu_ops.rms_norm`).
- :func:`triton_fused_add_rms_norm`, in place like :func:`kernels.cpu_ops.fused_add_rms_norm`:
  ``residual <- hidden + residual`` rounded to the dtype (what the unfused ``hidden +
  residual`` gives), then ``hidden <- rms_norm(residual)``.

On CUDA one program per row holds the whole row (``BLOCK = next_power_of_2(H)`` lanes) and
sums its squares with one ``tl.sum``, whose reduction tree depends only on ``BLOCK`` and the
warp count, both set by ``H``: a row's result does not depend on the other rows (vLLM's and
Thinking Machines' batch-invariant RMSNorm work the same way). torch's CUDA norm kernels
choose their launch after the tensor's shape, which is not promised invariant. Triton's
interpreter (CPU tensors, tests) runs :data:`INTERPRETER_ROWS` rows per program instead, the
same per-row reduction (the interpreter's cost is per program).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["INTERPRETER_ROWS", "triton_fused_add_rms_norm", "triton_rms_norm"]

INTERPRETER_ROWS = 16


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    n_cols,
    stride_x,
    stride_r,
    stride_o,
    eps,
    n_rows,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
):
    row = (tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS))[:, None]  # [ROWS, 1]
    cols = tl.arange(0, BLOCK)[None, :]
    mask = (cols < n_cols) & (row < n_rows)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        s = (x + r).to(res_ptr.dtype.element_ty)  # the residual stream keeps the model dtype
        tl.store(res_ptr + row * stride_r + cols, s, mask=mask)
        x = s.to(tl.float32)
    mean_sq = tl.sum(x * x, 1) / n_cols  # [ROWS], each row's own sum
    rstd = 1.0 / tl.sqrt(mean_sq + eps)
    w = tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    y = x * rstd[:, None] * w
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _check(x: torch.Tensor, weight: torch.Tensor, name: str) -> None:
    if x.dim() != 2 or x.stride(1) != 1 or weight.shape != (x.shape[1],):
        raise ValueError(
            f"{name} {tuple(x.shape)} (strides {x.stride()}) and weight {tuple(weight.shape)}:"
            " need [T, H] with contiguous rows and [H]"
        )


def _launch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    out: torch.Tensor,
    eps: float,
) -> None:
    t, h = x.shape
    if t == 0:
        return
    block = triton.next_power_of_2(h)
    rows = 1 if x.device.type == "cuda" else INTERPRETER_ROWS
    _rms_norm_kernel[(triton.cdiv(t, rows),)](
        x,
        residual if residual is not None else x,
        weight,
        out,
        h,
        x.stride(0),
        residual.stride(0) if residual is not None else 0,
        out.stride(0),
        eps,
        t,
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        ROWS=rows,
        num_warps=min(16, max(1, block // 256)),
    )


def triton_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of ``x`` ``[T, H]`` -> a new ``[T, H]`` tensor in ``x``'s dtype.

    Raises:
        ValueError: ``x`` not 2-D with contiguous rows, or ``weight`` not ``[H]``.
    """
    _check(x, weight, "x")
    out = torch.empty_like(x)
    _launch(x, None, weight, out, eps)
    return out


def triton_fused_add_rms_norm(
    hidden: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> None:
    """In place: ``residual <- hidden + residual``, ``hidden <- rms_norm(residual)`` (each
    ``[T, H]``, same dtype; each row read whole before it is written).

    Raises:
        ValueError: mismatched shapes or dtypes, rows not contiguous, ``weight`` not ``[H]``.
    """
    _check(hidden, weight, "hidden")
    _check(residual, weight, "residual")
    if hidden.shape != residual.shape or hidden.dtype != residual.dtype:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} {hidden.dtype} and residual "
            f"{tuple(residual.shape)} {residual.dtype} differ"
        )
    _launch(hidden, residual, weight, hidden, eps)
