"""The Triton attention backend: :class:`kernels.backend.AttentionBackend` on Triton kernels.

- ``write_kv`` -> :func:`kernels.triton_kv_write.triton_write_kv`;
- ``attention``, batch invariant (the default, :mod:`kernels.batch_invariant`) ->
  :func:`kernels.triton_unified_attention.triton_unified_attention` for every step: one kernel
  and one reduction order per row for prefill chunks and decodes; split over fixed-size
  segments (for occupancy) in decode steps whose ``num_splits`` is above 1, with the same
  bits as unsplit;
- ``attention`` with ``SLUICEWAY_BATCH_INVARIANT=0`` ->
  :func:`kernels.triton_decode_attention.triton_decode_attention` when every sequence of the
  step has one query token (a pure decode step; its split count follows the batch), else
  :func:`kernels.triton_prefill_attention.triton_prefill_attention` (prefill chunks and decodes
  mixed; its tile follows the longest chunk).

Metadata: :class:`kernels.varlen_metadata.VarlenMetadata` (also the CUDA graphs' static
buffers). On CPU the kernels run only in Triton's interpreter (``TRITON_INTERPRET=1``, tests).
"""

from __future__ import annotations

import torch

from sluiceway.kernels.batch_invariant import enabled as batch_invariant_enabled
from sluiceway.kernels.triton_decode_attention import triton_decode_attention
from sluiceway.kernels.triton_kv_write import triton_write_kv
from sluiceway.kernels.triton_prefill_attention import triton_prefill_attention
from sluiceway.kernels.triton_unified_attention import triton_unified_attention
from sluiceway.kernels.varlen_metadata import VarlenMetadata, VarlenMetadataBuilder

__all__ = ["TritonAttentionBackend"]


class TritonAttentionBackend(VarlenMetadataBuilder):
    """:class:`kernels.backend.AttentionBackend` on the Triton kernels (CUDA; CPU only in the
    interpreter).

    ``batch_invariant``: the unified kernel (default: :func:`kernels.batch_invariant.enabled`,
    the ``SLUICEWAY_BATCH_INVARIANT`` environment variable); False: the separate decode and
    prefill kernels, whose rounding depends on the batch.
    """

    name = "triton"
    fused_layer_ops = False

    def __init__(self, batch_invariant: bool | None = None) -> None:
        self.batch_invariant = (
            batch_invariant_enabled() if batch_invariant is None else batch_invariant
        )

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: VarlenMetadata,
    ) -> None:
        """Scatter ``key``/``value`` ``[T, Hkv, D]`` to ``metadata.slot_mapping`` (-1: skip)."""
        triton_write_kv(key, value, kv_cache, metadata.slot_mapping)

    def attention(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: VarlenMetadata,
        scale: float | None = None,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """``query`` ``[T, Hq, D]`` -> ``[T, Hq, D]``. Batch invariant: the unified kernel
        (split over segments when ``max_query_len == 1`` and ``num_splits > 1``). Else the
        decode kernel when ``max_query_len == 1`` (row ``s`` is sequence ``s``), else the
        prefill kernel."""
        if sliding_window is not None:  # the window-kernels task brings them
            raise NotImplementedError(f"{self.name} attention has no sliding window yet")
        if self.batch_invariant:
            return triton_unified_attention(
                query,
                kv_cache,
                metadata.block_tables,
                metadata.query_start_loc,
                metadata.context_lens,
                block_size=metadata.block_size,
                max_context_len=metadata.max_context_len,
                split=metadata.max_query_len == 1 and metadata.num_splits > 1,
                scale=scale,
            )
        if metadata.max_query_len == 1:
            return triton_decode_attention(
                query,
                kv_cache,
                metadata.block_tables,
                metadata.context_lens,
                block_size=metadata.block_size,
                scale=scale,
                num_splits=metadata.num_splits,
            )
        return triton_prefill_attention(
            query,
            kv_cache,
            metadata.block_tables,
            metadata.query_start_loc,
            metadata.context_lens,
            max_query_len=metadata.max_query_len,
            block_size=metadata.block_size,
            scale=scale,
        )
