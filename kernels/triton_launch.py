"""What the Triton attention launchers share: their shape checks and the split scratch.

The checks read shapes and strides only (no device sync: a launcher may run inside a CUDA
graph capture). Layouts as in :mod:`kernels.paged_attention`.
"""

from __future__ import annotations

import torch

__all__ = ["check_query_and_cache", "check_varlen_tables", "split_scratch", "window_arg"]


def check_query_and_cache(
    query: torch.Tensor, kv_cache: torch.Tensor, block_size: int, int8_ok: bool = False
) -> int:
    """Checks ``query`` ``[T, Hq, D]`` against one layer's ``kv_cache`` ``[2, num_blocks, Hkv,
    block_size * D]`` (last dimension contiguous; with ``int8_ok`` also an int8 cache of
    :mod:`kernels.kv_quant`, ``block_size * (D + 4)`` wide) and returns ``Hkv``.

    Raises:
        ValueError: ``Hq`` not a multiple of ``Hkv``, a cache of another last dimension or
            with a strided one, or an int8 cache where the kernel reads none.
    """
    _, hq, d = query.shape
    hkv = kv_cache.shape[2]
    if hq % hkv:
        raise ValueError(f"{hq} query heads is not a multiple of {hkv} KV heads")
    quant = kv_cache.dtype == torch.int8
    if quant and not int8_ok:
        raise ValueError("this Triton kernel reads no int8 KV cache (the unified kernel does)")
    width = block_size * (d + 4) if quant else block_size * d
    if kv_cache.shape[3] != width or kv_cache.stride(3) != 1:
        raise ValueError(
            f"kv_cache {tuple(kv_cache.shape)} is not [2, blocks, Hkv, {block_size} * {d}]"
        )
    return hkv


def check_varlen_tables(
    block_tables: torch.Tensor, query_start_loc: torch.Tensor, num_seqs: int
) -> None:
    """Checks that ``block_tables`` is ``[S, max_blocks]`` and ``query_start_loc`` ``[S + 1]``
    for ``S = num_seqs``.

    Raises:
        ValueError: another shape.
    """
    s = num_seqs
    if block_tables.dim() != 2 or block_tables.shape[0] != s or query_start_loc.shape != (s + 1,):
        raise ValueError(
            f"block_tables {tuple(block_tables.shape)} / query_start_loc "
            f"{tuple(query_start_loc.shape)} do not match {s} sequences"
        )


def split_scratch(
    rows: int, num_heads: int, num_splits: int, block_d: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialized float32 scratch for the partials of a split-K launch and its merge:
    ``(m, l)`` pairs ``[rows, num_heads, num_splits, 2]`` and unnormalized outputs ``[rows,
    num_heads, num_splits, block_d]``."""
    part_ml = torch.empty((rows, num_heads, num_splits, 2), dtype=torch.float32, device=device)
    part_acc = torch.empty(
        (rows, num_heads, num_splits, block_d), dtype=torch.float32, device=device
    )
    return part_ml, part_acc


def window_arg(sliding_window: int | None) -> int:
    """The kernels' ``window`` argument: ``sliding_window`` ``W`` (a row at ``p`` attends to
    keys ``p - W < k <= p``), or 0 for ``None`` (full causal attention).

    Raises:
        ValueError: ``sliding_window < 1``.
    """
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be at least 1, got {sliding_window}")
    return sliding_window or 0
