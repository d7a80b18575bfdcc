"""A batch-invariant Triton matmul for the linear layers and the logits: ``x @ weight.T + bias``.

Shapes: ``x`` ``[M, K]``, ``weight`` ``[N, K]`` (the ``nn.Linear`` layout, row-major), optional
``bias`` ``[N]``; output ``[M, N]``. bfloat16 in (float16 and float32 work too), float32
accumulation, output in ``x``'s dtype (the linear layers) or float32 (``out_dtype``: the
logits, which are never rounded to bfloat16).

Why not cuBLAS: ``F.linear`` picks its kernel, its tile and its split-K by shape, so a row's
float32 sum over K is ordered differently at M 1 and at M 256, and its bfloat16 rounding
differs in the last bit now and then ("Defeating Nondeterminism in LLM Inference", He et al.,
Thinking Machines 2025; their ``batch_invariant_ops`` and vLLM's ``VLLM_BATCH_INVARIANT`` mode
replace the matmul the same way). Here the tile config is one constant (:data:`CONFIG`), never
chosen after M: each program owns a ``BLOCK_M x BLOCK_N`` output tile, walks K from 0 upwards
in ``BLOCK_K`` steps (no split-K, no atomics), each step one ``tl.dot`` into the float32
accumulator, and adds the bias once at the end. A row's output element is then the same
sequence of tensor-core operations on the same operands whatever M is and wherever the row
sits in its tile; rows past M are masked to zero and touch nothing else. ``M`` is not
specialized on (``do_not_specialize``), so M 1 and M 16 run the same compiled kernel.

Cost: a 64 x 64 tile gives ``N / 64`` programs at M 1 (64 for a 4096-wide output on a
132-SM H200), where cuBLAS splits K to fill the GPU: decode GEMVs are expected slower, by how
much is not measured yet (``scripts/gpu_check.sh``, step ``invariance``, times it against
cuBLAS at M 1, 32 and 256 for 7B-shaped layers).

Under Triton's interpreter (CPU tensors, tests; ``INTERPRET``) every ``tl.dot`` becomes
:func:`interpreter_dot`: operands widened to float32 (the interpreter multiplies bfloat16 bit
patterns as integers) and each product summed over K in order, one element at a time. The
interpreter's own dot is numpy's matmul (OpenBLAS), whose float32 sum for an element depends
on the element's row within the tile (measured: 2,280 of 4,096 placements of a row in a
64 x 64 tile gave other bits), which would hide or fake what the kernel's tiling does. So
the interpreter proves the kernels' structure invariant (tiles, masks, K order, segment
folds); that a tensor-core ``tl.dot`` gives an output element the same bits in any row of its
tile is checked on a GPU (``scripts/gpu_check.sh``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["CONFIG", "interpreter_dot", "triton_linear"]

# The one tile config, for every M (what makes the result batch invariant); changing it
# changes the rounding of every row the same way.
CONFIG = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 4}


@triton.jit
def interpreter_dot(a, b, acc):
    """``acc + a @ b`` in float32, each element summing its products in K order (``a``
    ``[M, K]``, ``b`` ``[K, N]``): the interpreter's stand-in for ``tl.dot``."""
    prod = a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :]
    return acc + tl.sum(prod, 1)


@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_om,
    stride_on,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    INTERPRET: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_mask = rows < M
    col_mask = cols < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):  # one fixed, ascending order over K
        k = k0 + ks
        k_mask = k < K
        a = tl.load(
            x_ptr + rows[:, None] * stride_xm + k[None, :] * stride_xk,
            mask=row_mask[:, None] & k_mask[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_K]
        b = tl.load(
            w_ptr + cols[None, :] * stride_wn + k[:, None] * stride_wk,
            mask=k_mask[:, None] & col_mask[None, :],
            other=0.0,
        )  # [BLOCK_K, BLOCK_N]: the weight's rows are the output columns
        if INTERPRET:
            acc = interpreter_dot(a, b, acc)
        else:
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(
        out_ptr + rows[:, None] * stride_om + cols[None, :] * stride_on,
        acc.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & col_mask[None, :],
    )


def triton_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    out_dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ weight.T + bias`` with a reduction order per row that does not depend on M.

    Args:
        x: ``[M, K]`` (any strides), the weight's dtype.
        weight: ``[N, K]``, the ``nn.Linear`` layout (any strides).
        bias: optional ``[N]``, added in float32 before the output's rounding.
        out_dtype: the output's dtype; ``x.dtype`` when None (float32 for logits).
        out: optional ``[M, N]`` buffer of ``out_dtype`` to write into.

    Returns:
        ``[M, N]``: float32 sums of exact products (bfloat16/float16; float32 inputs use an
        exact float32 dot), rounded once to ``out_dtype``.

    Raises:
        ValueError: shapes or dtypes that do not match, or tensors on different devices.
    """
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} and weight {tuple(weight.shape)} do not match")
    if x.dtype != weight.dtype or x.device != weight.device:
        raise ValueError(
            f"x ({x.dtype} on {x.device}) and weight ({weight.dtype} on {weight.device}) differ"
        )
    m, k = x.shape
    n = weight.shape[0]
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias {tuple(bias.shape)} is not [{n}]")
    out_dtype = out_dtype or x.dtype
    if out is None:
        out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    elif out.shape != (m, n) or out.dtype != out_dtype:
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} is not [{m}, {n}] {out_dtype}")
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.copy_(bias.expand(m, n) if bias is not None else torch.zeros_like(out))
    cfg = CONFIG
    grid = (triton.cdiv(n, cfg["BLOCK_N"]), triton.cdiv(m, cfg["BLOCK_M"]))
    interpreted = x.device.type != "cuda"
    _matmul_kernel[grid](
        x,
        weight,
        bias if bias is not None else x,  # unused without HAS_BIAS
        out,
        m,
        n,
        k,
        x.stride(0),
        x.stride(1),
        weight.stride(0),
        weight.stride(1),
        out.stride(0),
        out.stride(1),
        HAS_BIAS=bias is not None,
        BLOCK_M=cfg["BLOCK_M"],
        BLOCK_N=cfg["BLOCK_N"],
        BLOCK_K=cfg["BLOCK_K"],
        INTERPRET=interpreted,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    return out
