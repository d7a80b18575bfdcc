"""Gemma 3's decoder block (Gemma Team, "Gemma 3 Technical Report", 2025; transformers'
``Gemma3DecoderLayer``): per-head q/k RMSNorm before RoPE, RMSNorms before and after both
attention and the MLP (all Gemma's ``(1 + w)`` norm in float32), a GELU-tanh gated MLP, and
local layers (sliding window, their own rope base) interleaved with global ones, five to one.

The model around it (:class:`worker.model.LlamaForCausalLM`) scales the embeddings by
``sqrt(H)``, ends in Gemma's norm and ties the logits to the embedding.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from sluiceway.kernels import cpu_ops
from sluiceway.kernels.backend import AttentionBackend
from sluiceway.worker.layers import AttentionBlock, RopeInputs, add_rms_norm, gemma_rms_norm, param
from sluiceway.worker.model_config import ModelConfig
from sluiceway.worker.parallel import TensorParallelGroup

__all__ = ["Gemma3DecoderLayer"]


class Gemma3DecoderLayer(AttentionBlock):
    """One Gemma 3 block: the parameters of :class:`worker.layers.AttentionBlock` (with
    ``q_norm``/``k_norm``) and four norms ``[H]``: ``input_norm`` (HF ``input_layernorm``),
    ``post_attn_norm`` (``post_attention_layernorm``), ``pre_mlp_norm``
    (``pre_feedforward_layernorm``), ``post_mlp_norm`` (``post_feedforward_layernorm``), each
    holding HF's ``w`` (the norm multiplies by ``1 + w``).

    Raises:
        ValueError: ``tp.world_size`` does not divide the heads or the intermediate size.
    """

    gemma_norms = True

    def __init__(
        self, config: ModelConfig, layer: int = 0, tp: TensorParallelGroup | None = None
    ) -> None:
        super().__init__(config, layer, tp)
        h = config.hidden_size
        self.input_norm = param(h)
        self.post_attn_norm = param(h)
        self.pre_mlp_norm = param(h)
        self.post_mlp_norm = param(h)

    def _norm(self, x: torch.Tensor, name: str, fused: bool) -> torch.Tensor:
        """Gemma's norm of ``x`` ``[T, H]`` with the weight ``name``, no residual."""
        if fused:
            return cpu_ops.rms_norm(x, self.norm_scale(name), self.eps)
        return gemma_rms_norm(x, getattr(self, name), self.eps)

    def _add_norm(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, name: str, fused: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(hidden + residual), hidden + residual)`` with Gemma's norm ``name``."""
        weight = self.norm_scale(name) if fused else getattr(self, name)
        return add_rms_norm(hidden, residual, weight, self.eps, fused, gemma=True)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rope: RopeInputs,
        kv_cache: torch.Tensor,
        metadata: Any,
        backend: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer in :class:`worker.model.DecoderLayer`'s residual convention (``hidden``
        the previous block's output after its post-MLP norm, ``residual`` the stream before
        it): ``residual + post_attn_norm(attn(input_norm(.)))``, then the MLP likewise with
        ``pre_mlp_norm`` and ``post_mlp_norm``. Shapes, the KV write and the fused ops as
        there; ``rope`` is the table of this layer's kind (local or global)."""
        fused = backend.fused_layer_ops
        x, residual = self._add_norm(hidden, residual, "input_norm", fused)
        attn = self.attention(x, rope, kv_cache, metadata, backend)
        attn = self._norm(attn, "post_attn_norm", fused)
        x, residual = self._add_norm(attn, residual, "pre_mlp_norm", fused)
        gate_up = self.linear(x, "gate_up_weight", self.gate_up_bias)
        if fused:
            act = cpu_ops.gelu_tanh_and_mul(gate_up)
        else:
            gate, up = gate_up[:, : self.intermediate], gate_up[:, self.intermediate :]
            act = F.gelu(gate, approximate="tanh") * up
        out = self.row_parallel_linear(act, "down_weight", self.down_bias)
        return self._norm(out, "post_mlp_norm", fused), residual
