"""The CPU attention backend: :class:`kernels.backend.AttentionBackend` on the C++ kernels of
:mod:`kernels.cpu_ops`.

One kernel serves prefill chunks and decode tokens of a step alike
(:func:`kernels.cpu_ops.paged_attention`), over :class:`kernels.varlen_metadata.VarlenMetadata`.
``fused_layer_ops`` tells the decoder to run its elementwise work through the fused C++ ops
too (RoPE + KV write, add + RMSNorm, SiLU-and-mul).
"""

from __future__ import annotations

import math

import torch

from sluiceway.kernels import cpu_ops
from sluiceway.kernels.paged_attention import write_kv
from sluiceway.kernels.varlen_metadata import VarlenMetadata, VarlenMetadataBuilder

__all__ = ["CpuAttentionBackend"]


class CpuAttentionBackend(VarlenMetadataBuilder):
    """The C++ paged attention (CPU tensors only); create after :func:`kernels.cpu_ops.load`."""

    name = "cpu"
    fused_layer_ops = True
    batch_invariant = True  # one kernel, a fixed order per row (kernels/csrc/paged_attention.cpp)

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: VarlenMetadata,
    ) -> None:
        """Scatter ``key``/``value`` ``[T, Hkv, D]`` to ``metadata.slot_mapping`` (the torch
        reference; the decoder fuses this with RoPE instead)."""
        write_kv(key, value, kv_cache, metadata.slot_mapping)

    def attention(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: VarlenMetadata,
        scale: float | None = None,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """``query`` ``[T, Hq, D]`` (heads contiguous) -> ``[T, Hq, D]`` contiguous."""
        if sliding_window is not None:  # the window-kernels task brings them
            raise NotImplementedError(f"{self.name} attention has no sliding window yet")
        if scale is None:
            scale = 1.0 / math.sqrt(query.shape[-1])
        return cpu_ops.paged_attention(
            query,
            kv_cache,
            metadata.block_tables,
            metadata.context_lens,
            metadata.query_start_loc,
            scale,
        )
