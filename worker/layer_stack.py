"""A Llama-family decoder's layers in one C++ operator call (kernels/csrc/decoder_layers.cpp).

On the C++ CPU kernels each layer is about ten operator calls; at batch 1 the Python and
dispatcher work between them was about a quarter of the embedded model's decode step. When
every layer runs only kernels that :func:`kernels.cpu_ops.decoder_layers` knows (the Llama
block, one rank, the C++ attention, each linear weight either GGUF blocks in one part or
bfloat16 pairs), :func:`build_layer_stack` gathers their arguments once and the forward makes
one call for all layers: the same kernels on the same tensors in the same order, bitwise the
hidden states of the per-layer path (tests/worker/test_layer_stack.py).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

from sluiceway.kernels import cpu_ops
from sluiceway.kernels.backend import AttentionBackend
from sluiceway.kernels.cpu_backend import CpuAttentionBackend
from sluiceway.kernels.varlen_metadata import VarlenMetadata
from sluiceway.worker.layers import LINEAR_WEIGHTS, AttentionBlock, RopeInputs

__all__ = ["LayerStack", "build_layer_stack"]


@dataclasses.dataclass
class LayerStack:
    """:func:`kernels.cpu_ops.decoder_layers`' per-layer arguments, flattened: per layer its
    four linears (``qkv``, ``o``, ``gate_up``, ``down``: packed weight, kind
    (:data:`kernels.cpu_ops.LINEAR_KINDS`), ggml type or 0, output features, float32 bias or
    None), its two norm weights (as the per-layer path passes them), its q/k norm scales
    (None, None without), its window (0: none); ``scale`` the softmax scale of every layer."""

    weights: list[torch.Tensor]
    kinds: list[int]
    qtypes: list[int]
    out_features: list[int]
    biases: list[torch.Tensor | None]
    norms: list[torch.Tensor]
    qk_norms: list[torch.Tensor | None]
    windows: list[int]
    scale: float
    num_heads: int
    num_kv_heads: int
    eps: float

    def run(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rope: RopeInputs,
        kv_caches: Sequence[torch.Tensor],
        metadata: VarlenMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer on ``hidden`` ``[T, H]`` (``residual`` as the first layer takes it):
        returns the last layer's output and the residual stream, as the per-layer loop of
        :meth:`worker.model.LlamaForCausalLM.forward` does (``hidden`` and ``residual`` are
        overwritten in place as there)."""
        out = cpu_ops.decoder_layers(
            hidden, residual, self, rope.positions, rope.cos_table, rope.sin_table,
            kv_caches, metadata,
        )  # fmt: skip
        return out, hidden if residual is None else residual


def _linear_args(layer: AttentionBlock, name: str) -> tuple[torch.Tensor, int, int, int] | None:
    """(packed weight, kind, ggml type, output features) of ``layer``'s weight ``name``, or
    None when decoder_layers does not run its kernel."""
    quantized = layer.quantized.get(name)
    if quantized is not None:
        if len(quantized) != 1:  # parts of several types: one GEMM call each
            return None
        w = quantized[0]
        return w.packed, cpu_ops.LINEAR_KINDS[w.layout], int(w.qtype), w.n
    packed = layer.packed.get(name)
    if packed is None or not layer.bf16_pairs:
        return None
    return packed, cpu_ops.LINEAR_KINDS["bf16_pairs"], 0, layer.packed_out_features[name]


def build_layer_stack(
    layers: Sequence[AttentionBlock], backend: AttentionBackend, llama_block: type[AttentionBlock]
) -> LayerStack | None:
    """The stack of ``layers`` for :func:`kernels.cpu_ops.decoder_layers`, or None where a
    layer needs the per-layer path: another block than ``llama_block``
    (:class:`worker.model.DecoderLayer`, whose forward the C++ loop repeats), tensor
    parallelism, another backend than the C++ one, Triton ops, a local rope table, a linear
    weight that is neither GGUF blocks in one part nor bfloat16 pairs, or layers with
    different softmax scales. Call after the weights are packed."""
    if not layers or not isinstance(backend, CpuAttentionBackend):
        return None
    if any(
        type(layer) is not llama_block
        or layer.tp.enabled
        or layer.triton_ops is not None
        or layer.rope_key != "global"
        or layer.scale != layers[0].scale
        for layer in layers
    ):
        return None
    first = layers[0]
    # the scale backend.attention takes for None (CpuAttentionBackend.attention)
    scale = 1.0 / math.sqrt(first.head_dim) if first.scale is None else first.scale
    stack = LayerStack([], [], [], [], [], [], [], [], scale, first.num_heads,
                       first.num_kv_heads, first.eps)  # fmt: skip
    for layer in layers:
        for name, bias in zip(LINEAR_WEIGHTS, _biases(layer), strict=True):
            args = _linear_args(layer, name)
            if args is None:
                return None
            weight, kind, qtype, n = args
            stack.weights.append(weight)
            stack.kinds.append(kind)
            stack.qtypes.append(qtype)
            stack.out_features.append(n)
            stack.biases.append(None if bias is None else bias.float().contiguous())
        stack.norms.extend((layer.input_norm, layer.post_norm))  # type: ignore[arg-type]
        if layer.q_norm is None:
            stack.qk_norms.extend((None, None))
        else:
            stack.qk_norms.extend((layer.norm_scale("q_norm"), layer.norm_scale("k_norm")))
        stack.windows.append(layer.window or 0)
    return stack


def _biases(layer: AttentionBlock) -> tuple[torch.Tensor | None, ...]:
    """The layer's biases in :data:`worker.layers.LINEAR_WEIGHTS` order."""
    return (layer.qkv_bias, layer.o_bias, layer.gate_up_bias, layer.down_bias)
