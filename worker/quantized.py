"""``--quantization gguf``: a GGUF model's weights served in their own bits.

A folder converted from a GGUF keeps each quantized weight's blocks
(:mod:`sluiceway.gguf_blocks`). In ``gguf`` mode the decoder's linear weights, the token
embedding and the logits' weight are repacked from those blocks
(:func:`sluiceway.kernels.quant_pack.pack_gguf`, the file's bits and scales) and their plain
copies freed; the GEMM (:func:`sluiceway.kernels.cpu_ops.quant_linear`) dequantizes tile by
tile into bfloat16 and multiplies in :func:`~sluiceway.kernels.cpu_ops.bf16_linear`'s order,
so a ``gguf`` run gives bitwise the tokens of ``--quantization none`` in bfloat16 (the same
dequantized weights rounded to bfloat16), batch invariant as that path is, with about a third
of its weight bytes. ``none`` serves the dequantized weights (the reference).
"""

from __future__ import annotations

import logging
import pathlib
from typing import TYPE_CHECKING

import torch

from sluiceway.gguf_blocks import GgufBlocks, has_blocks, read_blocks
from sluiceway.kernels import cpu_ops
from sluiceway.kernels.backend import AttentionBackend
from sluiceway.kernels.quant_pack import SUPPORTED, QuantWeight, pack_gguf
from sluiceway.worker.config import QUANTIZATION_CHOICES
from sluiceway.worker.parallel import TensorParallelGroup

if TYPE_CHECKING:
    from sluiceway.worker.layers import AttentionBlock
    from sluiceway.worker.model import LlamaForCausalLM

__all__ = [
    "QUANTIZATION_CHOICES",
    "apply_quantization",
    "quant_linear_parts",
    "quantization_obstacles",
    "resolve_quantization",
]

log = logging.getLogger(__name__)


# our fused weight -> the HF weights it is made of, in row order (worker.loader's fusion)
_LAYER_PARTS = {
    "qkv_weight": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o_weight": ("self_attn.o_proj",),
    "gate_up_weight": ("mlp.gate_proj", "mlp.up_proj"),
    "down_weight": ("mlp.down_proj",),
}


def quantization_obstacles(
    model_dir: pathlib.Path,
    *,
    device: torch.device,
    dtype: torch.dtype,
    backend: AttentionBackend,
    tp: TensorParallelGroup,
) -> list[str]:
    """Why ``gguf`` cannot serve this run (empty: it can): a folder without GGUF blocks,
    another device than the CPU, activations other than bfloat16, a CPU without AVX512-BF16,
    the torch attention reference (gguf runs beside the C++ kernels), tensor parallelism (each
    rank would need its slice of the blocks: not built)."""
    out = []
    if not has_blocks(model_dir):
        out.append(f"{model_dir} was not converted from a GGUF file with quantized weights")
    if device.type != "cpu":
        out.append(f"it runs on the CPU only, not {device.type}")
    if dtype != torch.bfloat16:
        out.append(f"it runs bfloat16 activations, not {str(dtype).removeprefix('torch.')}")
    if not cpu_ops.bf16_gemm_supported():
        out.append("its GEMM needs a CPU with AVX512-BF16")
    if not backend.fused_layer_ops:
        out.append(f"it runs beside the C++ CPU kernels, not the {backend.name} backend")
    if tp.world_size > 1:
        out.append("it does not shard the blocks for tensor parallelism yet")
    return out


def resolve_quantization(requested: str, obstacles: list[str]) -> str:
    """``auto`` -> ``gguf`` when nothing stands in its way (``obstacles``, see
    :func:`quantization_obstacles`), else ``none``; ``gguf`` and ``none`` as given.

    Raises:
        ValueError: ``gguf`` asked for where it cannot run (naming why), or an unknown name.
    """
    if requested not in QUANTIZATION_CHOICES:
        raise ValueError(
            f"--quantization: one of {', '.join(QUANTIZATION_CHOICES)}, got {requested!r}"
        )
    if requested == "gguf" and obstacles:
        raise ValueError(
            "--quantization gguf cannot serve this run: "
            + "; ".join(obstacles)
            + " (--quantization none serves the dequantized weights)"
        )
    if requested == "auto":
        return "none" if obstacles else "gguf"
    return requested


def apply_quantization(
    requested: str,
    model: LlamaForCausalLM,
    model_dir: pathlib.Path,
    *,
    dtype: torch.dtype,
    backend: AttentionBackend,
) -> str:
    """Resolve ``requested`` (:data:`QUANTIZATION_CHOICES`) for ``model`` (a
    :class:`worker.model.LlamaForCausalLM` just loaded from ``model_dir``) and, for ``gguf``,
    put its weights on the GGUF blocks (:func:`_quantize`). Returns ``"gguf"`` or ``"none"``.
    Call before :func:`worker.model_setup.select_linear_kernels` (which packs what is left).

    Raises:
        ValueError: see :func:`resolve_quantization`.
    """
    device = model.embed_weight.device
    obstacles = quantization_obstacles(
        model_dir, device=device, dtype=dtype, backend=backend, tp=model.tp
    )
    mode = resolve_quantization(requested, obstacles)
    if requested == "auto" and has_blocks(model_dir) and mode == "none":
        log.info("serving the dequantized weights (--quantization none): %s", "; ".join(obstacles))
    if mode == "gguf":
        _quantize(model, read_blocks(model_dir))
    return mode


def _pack(blocks: GgufBlocks) -> QuantWeight:
    import gguf

    qtype = gguf.GGMLQuantizationType[blocks.qtype]
    n, k = blocks.shape
    rows = blocks.hf_rows() if blocks.permuted_heads else None
    return pack_gguf(blocks.raw, qtype, n, k, rows)


def _supported(blocks: GgufBlocks | None) -> bool:
    import gguf

    return blocks is not None and gguf.GGMLQuantizationType[blocks.qtype] in SUPPORTED


def _quantize(model: LlamaForCausalLM, blocks: dict[str, GgufBlocks]) -> None:
    """Each linear weight (every part of a fused one), the embedding and a separate logits
    weight whose blocks are of a type the GEMM runs: packed from the blocks, the plain
    parameter emptied. A weight with a part in another type (F16, or a type without a
    kernel) stays plain (the bfloat16 GEMM)."""
    layers: list[AttentionBlock] = list(model.layers)  # type: ignore[arg-type]
    for i, layer in enumerate(layers):
        for name, parts in _LAYER_PARTS.items():
            found = [blocks.get(f"model.layers.{i}.{part}.weight") for part in parts]
            if all(_supported(b) for b in found):
                layer.quantized[name] = [_pack(b) for b in found if b is not None]
                getattr(layer, name).data = torch.empty(0, dtype=model.dtype)
    for hf_name, attr in (("model.embed_tokens.weight", "embed"), ("lm_head.weight", "lm_head")):
        param = getattr(model, f"{attr}_weight")
        block = blocks.get(hf_name)
        if param is not None and block is not None and _supported(block):
            setattr(model, f"quant_{attr}", _pack(block))
            param.data = torch.empty(0, dtype=model.dtype)


def quant_linear_parts(
    x: torch.Tensor,
    parts: list[QuantWeight],
    bias: torch.Tensor | None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """``x`` ``[T, K]`` bfloat16 @ the row-concatenation of ``parts`` (a fused weight's q, k,
    v or gate, up, each in its own GGUF type) ``+ bias`` ``[sum N]`` -> ``[T, sum N]`` in
    ``out_dtype``: each part's GEMM writes its columns of one output (an output column's
    value does not depend on the other columns)."""
    if len(parts) == 1:
        return cpu_ops.quant_linear(x, parts[0], bias, out_dtype=out_dtype)
    out = torch.empty(x.shape[0], sum(p.n for p in parts), dtype=out_dtype)
    col = 0
    for part in parts:
        part_bias = None if bias is None else bias[col : col + part.n]
        cpu_ops.quant_linear(x, part, part_bias, out=out[:, col : col + part.n])
        col += part.n
    return out
