"""What every decoder block shares: the fused linear weights and their kernels, the norms, the
rotary embedding and the attention half of a block (q/k/v, q/k norm, RoPE, the KV write,
paged attention with the layer's window and scale).

Families differ around it: :class:`worker.model.DecoderLayer` (Llama, Mistral, Qwen2/3: pre-norm
SwiGLU) and :class:`worker.gemma3.Gemma3DecoderLayer` (Gemma 3: four norms, GELU-tanh).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sluiceway.kernels import cpu_ops, onednn_linear
from sluiceway.kernels.backend import AttentionBackend
from sluiceway.kernels.quant_pack import QuantWeight
from sluiceway.worker.model_config import ModelConfig
from sluiceway.worker.parallel import TensorParallelGroup
from sluiceway.worker.quantized import quant_linear_parts

__all__ = [
    "LINEAR_WEIGHTS",
    "AttentionBlock",
    "RopeInputs",
    "TritonOps",
    "add_rms_norm",
    "apply_rope",
    "gemma_rms_norm",
    "param",
    "rms_norm",
]

LINEAR_WEIGHTS = ("qkv_weight", "o_weight", "gate_up_weight", "down_weight")


def param(*shape: int) -> nn.Parameter:
    """An uninitialized frozen parameter (the loader fills it)."""
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``F.rms_norm`` over the last dim (Llama's RMSNorm)."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm over the last dim, as transformers' ``Gemma3RMSNorm``: in float32,
    ``x * rsqrt(mean(x^2) + eps) * (1 + weight)``, rounded once to ``x``'s dtype."""
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (out * (1.0 + weight.float())).to(x.dtype)


@dataclass(frozen=True, slots=True)
class TritonOps:
    """The batch-invariant Triton kernels the decoder runs instead of cuBLAS and torch's
    RMSNorm (:meth:`worker.model.LlamaForCausalLM.use_triton_ops`): ``linear`` is
    :func:`kernels.triton_matmul.triton_linear`, ``rms_norm`` and ``fused_add_rms_norm``
    those of :mod:`kernels.triton_norm`."""

    linear: Callable[..., torch.Tensor]
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    fused_add_rms_norm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], None]

    @classmethod
    def load(cls) -> TritonOps:
        """Import the kernels (Triton is optional: imported only here)."""
        from sluiceway.kernels.triton_matmul import triton_linear
        from sluiceway.kernels.triton_norm import triton_fused_add_rms_norm, triton_rms_norm

        return cls(triton_linear, triton_rms_norm, triton_fused_add_rms_norm)


@dataclass(slots=True)
class RopeInputs:
    """The step's rotary inputs for one rope table: ``positions`` ``[T]`` int64 and the float32
    tables ``cos_table``/``sin_table`` ``[max_positions, D / 2]`` (what the fused op reads),
    and for the torch path ``cos``/``sin`` ``[T, 1, D / 2]`` gathered in the model dtype (None
    with fused ops)."""

    positions: torch.Tensor
    cos_table: torch.Tensor
    sin_table: torch.Tensor
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None


def add_rms_norm(
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    fused: bool,
    triton_ops: TritonOps | None = None,
    gemma: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(hidden + residual), hidden + residual)``; ``residual`` None: no addition.
    Fused (the C++ ops, or ``triton_ops``): in place (``hidden`` becomes the normed rows,
    ``residual`` the sum). ``gemma``: Gemma's norm (:func:`gemma_rms_norm`); then ``weight`` is
    ``1 + w`` in float32 on the fused path, ``w`` itself on the torch path."""
    if triton_ops is not None and not gemma:
        if residual is None:
            return triton_ops.rms_norm(hidden, weight, eps), hidden
        triton_ops.fused_add_rms_norm(hidden, residual, weight, eps)
        return hidden, residual
    norm = gemma_rms_norm if gemma else rms_norm
    if residual is None:
        normed = cpu_ops.rms_norm(hidden, weight, eps) if fused else norm(hidden, weight, eps)
        return normed, hidden
    if fused:
        cpu_ops.fused_add_rms_norm(hidden, residual, weight, eps)
        return hidden, residual
    residual = hidden + residual
    return norm(residual, weight, eps), residual


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary embedding of ``x`` ``[T, heads, D]`` (HF/NeoX convention)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class AttentionBlock(nn.Module):
    """The weights of a decoder block's four linear layers, their kernels, and its attention.

    Parameters (``H`` hidden, ``Hq``/``Hkv`` heads, ``D`` head dim, ``I`` intermediate, all
    heads and ``I`` the rank's share, e.g. ``Hq = num_heads / N``): ``qkv_weight``
    ``[(Hq + 2 Hkv) D, H]`` (the rank's q rows, then its k, then its v), ``qkv_bias``
    ``[(Hq + 2 Hkv) D]`` or None, ``o_weight`` ``[H, Hq D]`` (the input columns of the rank's
    heads), ``o_bias`` ``[H]`` or None (whole on every rank), ``gate_up_weight`` ``[2 I, H]``
    (the rank's gate rows, then its up rows), ``gate_up_bias`` ``[2 I]`` / ``down_bias``
    ``[H]`` or None, ``down_weight`` ``[H, I]``; with ``config.qk_norm`` ``q_norm``/``k_norm``
    ``[D]`` (per-head RMSNorm before RoPE; Gemma's ``1 + w`` when ``gemma_norms``).

    ``window`` is the layer's sliding window (None: full attention), ``scale`` its softmax
    scale, ``rope_key`` the rope table it reads (``"local"`` or ``"global"``).

    Raises:
        ValueError: ``tp.world_size`` does not divide the heads or the intermediate size.
    """

    gemma_norms = False

    def __init__(
        self, config: ModelConfig, layer: int = 0, tp: TensorParallelGroup | None = None
    ) -> None:
        super().__init__()
        c = config
        self.tp = tp = tp or TensorParallelGroup()
        self.num_kv_heads = tp.shard(c.num_kv_heads, "KV heads (num_key_value_heads)")
        self.num_heads = tp.shard(c.num_heads, "attention heads (num_attention_heads)")
        self.head_dim = c.head_dim
        self.eps = c.rms_norm_eps
        self.window = c.layer_window(layer)
        self.scale = c.attention_scale
        self.rope_key = "local" if c.layer_uses_local_rope(layer) else "global"
        self.intermediate = tp.shard(
            c.intermediate_size, "MLP intermediate size (intermediate_size)"
        )
        qkv_out = (self.num_heads + 2 * self.num_kv_heads) * c.head_dim
        self.qkv_weight = param(qkv_out, c.hidden_size)
        self.qkv_bias = param(qkv_out) if c.qkv_bias else None
        self.o_weight = param(c.hidden_size, self.num_heads * c.head_dim)
        self.o_bias = param(c.hidden_size) if c.o_bias else None
        self.q_norm = param(c.head_dim) if c.qk_norm else None
        self.k_norm = param(c.head_dim) if c.qk_norm else None
        self.gate_up_weight = param(2 * self.intermediate, c.hidden_size)
        self.gate_up_bias = param(2 * self.intermediate) if c.mlp_bias else None
        self.down_weight = param(c.hidden_size, self.intermediate)
        self.down_bias = param(c.hidden_size) if c.mlp_bias else None
        # packed copies of the four weights, by name, once pack_linear_weights ran: oneDNN's
        # blocked layout, or (bf16_pairs) the layout of kernels.cpu_ops.bf16_linear
        self.packed: dict[str, torch.Tensor] = {}
        self.packed_out_features: dict[str, int] = {}
        self.bf16_pairs = False
        # --quantization gguf: weight name -> its parts' GGUF blocks (worker.quantized)
        self.quantized: dict[str, list[QuantWeight]] = {}
        self.triton_ops: TritonOps | None = None  # see LlamaForCausalLM.use_triton_ops
        # float32 norm weights for the fused C++ ops, by parameter name (see norm_scale)
        self._norm_scales: dict[str, torch.Tensor] = {}

    def norm_scale(self, name: str) -> torch.Tensor:
        """The float32 weight the C++ norms take for the norm parameter ``name``: ``1 + w``
        (Gemma: transformers adds the 1 in float32) or ``w``; made once, on first use after
        the weights are loaded."""
        scale = self._norm_scales.get(name)
        if scale is None:
            w = getattr(self, name).float()
            scale = (1.0 + w) if self.gemma_norms else w.contiguous()
            self._norm_scales[name] = scale
        return scale

    def pack_linear_weights(self, bf16_pairs: bool = False) -> int:
        """Pack the four linear weights once and free the plain copies (the forward reads only
        the packed ones). CPU only. ``bf16_pairs`` (bfloat16 weights, a CPU with AVX512-BF16):
        for :func:`kernels.cpu_ops.bf16_linear`, whose rows do not depend on the batch; else
        reordered for oneDNN (:mod:`kernels.onednn_linear`).

        Returns:
            Bytes the plain weights held.
        """
        packed_bytes = 0
        self.bf16_pairs = bf16_pairs
        pack = cpu_ops.pack_bf16_pairs if bf16_pairs else onednn_linear.pack
        for name in LINEAR_WEIGHTS:
            if name in self.quantized:
                continue
            weight = getattr(self, name)
            self.packed[name] = pack(weight.data)
            self.packed_out_features[name] = weight.shape[0]
            packed_bytes += weight.numel() * weight.element_size()
            weight.data = torch.empty(0, dtype=weight.dtype)
        return packed_bytes

    def linear(self, x: torch.Tensor, name: str, bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ W.T + bias`` for the weight ``name`` on the kernel this layer was set up with."""
        if self.triton_ops is not None:
            return self.triton_ops.linear(x, getattr(self, name), bias)
        quantized = self.quantized.get(name)
        if quantized is not None:
            return quant_linear_parts(x, quantized, bias)
        packed = self.packed.get(name)
        if packed is None:
            return F.linear(x, getattr(self, name), bias)
        if self.bf16_pairs:
            return cpu_ops.bf16_linear(x, packed, self.packed_out_features[name], bias)
        return onednn_linear.linear(x, packed, bias)

    def row_parallel_linear(
        self, x: torch.Tensor, name: str, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """``x`` ``[T, K / N]`` (the rank's input columns) -> ``[T, M]``: the rank's partial
        product summed over the ranks, then the (replicated) bias added once."""
        if not self.tp.enabled:
            return self.linear(x, name, bias)
        out = self.tp.all_reduce(self.linear(x, name, None))
        return out if bias is None else out + bias

    def attention(
        self,
        x: torch.Tensor,
        rope: RopeInputs,
        kv_cache: torch.Tensor,
        metadata: Any,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """The attention half of the block: ``x`` ``[T, H]`` (normed) -> the o projection's
        output ``[T, H]`` (all-reduced over the ranks). Q/K/V, the per-head q/k norm when the
        model has one, RoPE with ``rope``, this step's K/V written into ``kv_cache``, paged
        attention over the layer's window with its scale. With ``backend.fused_layer_ops``
        the norm, RoPE and the KV write run in the C++ ops, in place in the qkv rows."""
        t = x.shape[0]
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.linear(x, "qkv_weight", self.qkv_bias)
        if backend.fused_layer_ops:
            if self.q_norm is not None:
                cpu_ops.qk_rms_norm(
                    qkv, self.norm_scale("q_norm"), self.norm_scale("k_norm"), hq, hkv, self.eps
                )
            cpu_ops.rotary_embedding_write_kv(
                qkv, rope.positions, rope.cos_table, rope.sin_table, kv_cache,
                metadata.slot_mapping, hq, hkv,
            )  # fmt: skip
            q = qkv[:, : hq * d].view(t, hq, d)
        else:
            assert rope.cos is not None and rope.sin is not None
            qk = qkv[:, : (hq + hkv) * d].view(t, hq + hkv, d)
            if self.q_norm is not None and self.k_norm is not None:
                norm = gemma_rms_norm if self.gemma_norms else rms_norm
                qk = torch.cat(
                    (
                        norm(qk[:, :hq], self.q_norm, self.eps),
                        norm(qk[:, hq:], self.k_norm, self.eps),
                    ),
                    dim=1,
                )
            qk = apply_rope(qk, rope.cos, rope.sin)
            v = qkv[:, (hq + hkv) * d :].view(t, hkv, d)
            backend.write_kv(qk[:, hq:], v, kv_cache, metadata)
            q = qk[:, :hq]
        if self.window is None:
            attn = backend.attention(q, kv_cache, metadata, self.scale)
        else:
            attn = backend.attention(q, kv_cache, metadata, self.scale, sliding_window=self.window)
        return self.row_parallel_linear(attn.reshape(t, hq * d), "o_weight", self.o_bias)
