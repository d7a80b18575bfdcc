"""Attention backends: the torch reference (CPU, and any device) and the Triton kernels (CUDA).

A backend is three operations over the paged KV pool, with the layout of
:mod:`kernels.paged_attention`:

- ``build_metadata(query_lens, context_lens, block_tables, ...)`` once per step (all layers
  share what it returns),
- ``write_kv(key, value, kv_cache, metadata)`` per layer: scatter the step's new K/V,
- ``attention(query, kv_cache, metadata, scale, sliding_window)`` per layer: attention of the
  flattened varlen batch (within the layer's window when it has one).

The worker chooses one at start (``--attention-backend auto|torch|cpu|triton``, see
:func:`get_attention_backend`); ``auto`` is Triton on CUDA when Triton imports, the C++ kernels
(:mod:`kernels.cpu_backend`) on CPU when they build, else the torch reference. A backend whose
``fused_layer_ops`` is true also runs the decoder's elementwise work through its fused ops.
A backend whose ``batch_invariant`` is true computes each row of ``attention`` in an order
fixed per row (independent of the other rows, the chunking and the block layout).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from sluiceway.kernels import cpu_ops, paged_attention

__all__ = [
    "ATTENTION_BACKENDS",
    "AttentionBackend",
    "TorchAttentionBackend",
    "get_attention_backend",
    "triton_available",
]

ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton")


class AttentionBackend(Protocol):
    """What the model's attention layers call. ``metadata`` is whatever ``build_metadata``
    returned; its type is the backend's own."""

    name: str
    fused_layer_ops: bool
    batch_invariant: bool

    def build_metadata(
        self,
        query_lens: Sequence[int],
        context_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        *,
        block_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device | str,
    ) -> Any:
        """Describe one step (see :func:`kernels.paged_attention.build_attention_metadata`)."""
        ...

    def write_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, metadata: Any
    ) -> None:
        """Scatter ``key``/``value`` ``[T, Hkv, D]`` into their slots of one layer's cache."""
        ...

    def attention(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: Any,
        scale: float | None = None,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """``query`` ``[T, Hq, D]`` -> ``[T, Hq, D]`` over the paged pool. ``scale``: the
        softmax scale (None: ``1 / sqrt(D)``). ``sliding_window`` ``W``: a query at ``p``
        sees keys ``p - W < k <= p`` and no block wholly before ``p - W + 1`` is read; None:
        full causal attention."""
        ...


class TorchAttentionBackend:
    """The torch reference of :mod:`kernels.paged_attention` (the oracle; any device)."""

    name = "torch"
    fused_layer_ops = False
    # decode buckets pad to their longest context and prefills run SDPA, whose tiling
    # follows the shapes: a row's rounding depends on the batch
    batch_invariant = False

    def build_metadata(
        self,
        query_lens: Sequence[int],
        context_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        *,
        block_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device | str,
    ) -> paged_attention.AttentionMetadata:
        return paged_attention.build_attention_metadata(
            query_lens,
            context_lens,
            block_tables,
            block_size=block_size,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            device=device,
        )

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: paged_attention.AttentionMetadata,
    ) -> None:
        paged_attention.write_kv(key, value, kv_cache, metadata.slot_mapping)

    def attention(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: paged_attention.AttentionMetadata,
        scale: float | None = None,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        return paged_attention.paged_attention(query, kv_cache, metadata, scale, sliding_window)


def triton_available() -> bool:
    """Whether ``import triton`` would succeed (checked without importing it)."""
    return importlib.util.find_spec("triton") is not None


def get_attention_backend(name: str, device: torch.device | str) -> AttentionBackend:
    """The backend called `name` for `device`, chosen once when the worker starts.

    ``auto``: Triton on CUDA when it is installed; on CPU the C++ kernels when they build
    (:func:`kernels.cpu_ops.available`, which logs why not), else the torch reference.
    ``cpu``: the C++ kernels (CPU only).
    ``triton`` on a CPU device runs the kernels in Triton's interpreter, which must be switched
    on before the kernels are defined (``TRITON_INTERPRET=1`` in the environment); it is for
    tests, thousands of times slower than the torch path.

    Raises:
        ValueError: an unknown name, ``triton`` without Triton installed, ``triton`` on CPU
            without ``TRITON_INTERPRET=1``, or ``cpu`` on another device.
        kernels.cpu_ops.CpuKernelsUnavailable: ``cpu`` when the C++ kernels cannot be built.
    """
    device = torch.device(device)
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend must be one of {ATTENTION_BACKENDS}, got {name!r}")
    if name == "auto":
        if device.type == "cuda":
            name = "triton" if triton_available() else "torch"
        else:
            name = "cpu" if device.type == "cpu" and cpu_ops.available() else "torch"
    if name == "torch":
        return TorchAttentionBackend()
    if name == "cpu":
        if device.type != "cpu":
            raise ValueError(f"--attention-backend cpu runs on the CPU only, not on {device}")
        cpu_ops.load()
        from sluiceway.kernels.cpu_backend import CpuAttentionBackend

        return CpuAttentionBackend()
    if not triton_available():
        raise ValueError(
            "--attention-backend triton needs Triton (pip install triton; it comes with the "
            "CUDA build of torch)"
        )
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            "--attention-backend triton on CPU needs TRITON_INTERPRET=1 in the environment "
            "(the interpreter, for tests only); use --attention-backend torch on CPU"
        )
    from sluiceway.kernels.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend()
