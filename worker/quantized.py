"""``--quantization gguf``: a GGUF model's weights served in their own bits.

A folder converted from a GGUF keeps each quantized weight's blocks
(:mod:`sluiceway.gguf_blocks`). In ``gguf`` mode the decoder's linear weights, the token
embedding and the logits' weight are repacked from those blocks
(:func:`sluiceway.kernels.quant_pack.pack_gguf`, the file's bits and scales) and their plain
copies freed; the GEMM (:func:`sluiceway.kernels.cpu_ops.quant_linear`) dequantizes tile by
tile into bfloat16 and multiplies in :func:`~sluiceway.kernels.cpu_ops.bf16_linear`'s order,
so a ``gguf`` run gives bitwise the tokens of ``--quantization none`` in bfloat16 (the same
dequantized weights rounded to bfloat16), batch invariant as that path is, with about a third
of its weight bytes. In float32 (asked for by name: ``auto`` keeps float32, the quality
reference, on ``none``) it sums gguf's float32 values in a fixed order, batch invariant too.
``gguf_a8`` packs the same blocks for :func:`~sluiceway.kernels.cpu_ops.quant_linear`'s
int8-activation GEMM (layout ``"a8"``: each row of x quantized to int8 per 32 values, exact
integer dot products, a fixed float32 sequence per output): batch invariant, its own tokens
(not ``none``'s), far fewer instructions per weight at small batches.
``none`` serves the dequantized weights (the reference).
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib
from typing import TYPE_CHECKING

import torch

from sluiceway.gguf_blocks import GgufBlocks, has_blocks, read_blocks
from sluiceway.kernels import cpu_ops
from sluiceway.kernels.backend import AttentionBackend
from sluiceway.kernels.quant_pack import SUPPORTED, QuantWeight, merge_row_parts, pack_gguf
from sluiceway.worker.config import QUANTIZATION_CHOICES
from sluiceway.worker.parallel import TensorParallelGroup

if TYPE_CHECKING:
    from sluiceway.worker.layers import AttentionBlock
    from sluiceway.worker.model import LlamaForCausalLM

__all__ = [
    "QUANTIZATION_CHOICES",
    "QuantizationPlan",
    "plan_quantization",
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
    mode: str = "gguf",
) -> list[str]:
    """Why ``mode`` (``gguf`` or ``gguf_a8``) cannot serve this run (empty: it can): a folder
    without GGUF blocks, another device than the CPU, activations other than bfloat16 or
    float32, a CPU without AVX512-BF16 (the kernels' build needs it for both; ``gguf_a8``
    AVX512-VNNI too), the torch attention reference (gguf runs beside the C++ kernels),
    tensor parallelism (each rank would need its slice of the blocks: not built)."""
    out = []
    if not has_blocks(model_dir):
        out.append(f"{model_dir} was not converted from a GGUF file with quantized weights")
    if device.type != "cpu":
        out.append(f"it runs on the CPU only, not {device.type}")
    if dtype not in (torch.bfloat16, torch.float32):
        out.append(
            f"it runs bfloat16 or float32 activations, not {str(dtype).removeprefix('torch.')}"
        )
    if device.type == "cpu":  # (elsewhere asking would build the C++ CPU kernels, for nothing)
        if not cpu_ops.bf16_gemm_supported():
            out.append("its GEMM needs a CPU with AVX512-BF16")
        elif mode == "gguf_a8" and not cpu_ops.quant_gemm_a8_supported():
            out.append("its int8 GEMM needs a CPU with AVX512-VNNI")
    if not backend.fused_layer_ops:
        out.append(f"it runs beside the C++ CPU kernels, not the {backend.name} backend")
    if tp.world_size > 1:
        out.append("it does not shard the blocks for tensor parallelism yet")
    return out


def resolve_quantization(requested: str, obstacles: list[str]) -> str:
    """``auto`` -> ``gguf`` when nothing stands in its way (``obstacles``, see
    :func:`quantization_obstacles`), else ``none``; ``gguf``, ``gguf_a8`` and ``none`` as
    given.

    Raises:
        ValueError: ``gguf`` or ``gguf_a8`` asked for where it cannot run (naming why), or an
            unknown name.
    """
    if requested not in QUANTIZATION_CHOICES:
        raise ValueError(
            f"--quantization: one of {', '.join(QUANTIZATION_CHOICES)}, got {requested!r}"
        )
    if requested in ("gguf", "gguf_a8") and obstacles:
        raise ValueError(
            f"--quantization {requested} cannot serve this run: "
            + "; ".join(obstacles)
            + " (--quantization none serves the dequantized weights)"
        )
    if requested == "auto":
        return "none" if obstacles else "gguf"
    return requested


@dataclasses.dataclass(frozen=True)
class QuantizationPlan:
    """What ``--quantization`` resolved to for one run: ``mode`` (``"gguf"``, ``"gguf_a8"``
    or ``"none"``) and, for the first two, the weights served from blocks: ``served`` maps where each lands
    (``"layers.3.qkv_weight"``, ``"embed"``, ``"lm_head"``) to the blocks of its HF parts in
    row order (a fused weight only when every part is of a type the GEMM runs)."""

    mode: str
    served: dict[str, list[tuple[str, GgufBlocks]]] = dataclasses.field(default_factory=dict)

    def skipped_names(self) -> frozenset[str]:
        """HF names the loader need not read from ``model.safetensors`` (their parameters are
        replaced by blocks: never reading them keeps their pages untouched)."""
        return frozenset(name for parts in self.served.values() for name, _ in parts)

    def apply(self, model: LlamaForCausalLM) -> str:
        """Pack the served weights into ``model`` (each plain parameter emptied). Returns
        ``mode``. Call before :func:`worker.model_setup.select_linear_kernels` (which packs
        what is left)."""
        layers: list[AttentionBlock] = list(model.layers)  # type: ignore[arg-type]
        for key, parts in self.served.items():
            # one GEMM call per run of parts of one type (fewer calls a step: at batch 1
            # each costs its dispatch and a parallel region)
            layout = "a8" if self.mode == "gguf_a8" else "tile"
            weights = merge_row_parts([_pack(blocks, layout) for _, blocks in parts])
            if key.startswith("layers."):
                _, i, name = key.split(".")
                layers[int(i)].quantized[name] = weights
                getattr(layers[int(i)], name).data = torch.empty(0, dtype=model.dtype)
            else:
                setattr(model, f"quant_{key}", weights[0])
                getattr(model, f"{key}_weight").data = torch.empty(0, dtype=model.dtype)
        return self.mode


def plan_quantization(
    requested: str,
    model_dir: pathlib.Path,
    *,
    num_layers: int,
    device: torch.device,
    dtype: torch.dtype,
    backend: AttentionBackend,
    tp: TensorParallelGroup,
) -> QuantizationPlan:
    """Resolve ``requested`` (:data:`QUANTIZATION_CHOICES`) for a model of ``num_layers``
    layers in ``model_dir``, before it is loaded; for ``gguf``, which weights its blocks serve.
    ``auto`` falls back to ``none`` (a log line says why) where ``gguf`` cannot run, no
    weight is of a type the GEMM runs, or in float32 (the quality reference: ``gguf`` there
    is asked for by name); weights of other types stay dequantized (logged).

    Raises:
        ValueError: ``gguf`` asked for where it cannot run, naming why (see
            :func:`resolve_quantization`), or where no weight is of a type the GEMM runs.
    """
    obstacles = quantization_obstacles(
        model_dir, device=device, dtype=dtype, backend=backend, tp=tp, mode=requested
    )
    if requested == "auto" and dtype == torch.float32 and not obstacles:
        # float32 is the quality reference (bench quality): its weights stay as dequantized
        # unless the blocks are asked for
        obstacles.append("float32 serves the dequantized weights unless --quantization gguf")
    blocks = read_blocks(model_dir) if not obstacles else {}
    served = _served(blocks, num_layers)
    if blocks and not served:
        types = ", ".join(sorted({b.qtype for b in blocks.values()}))
        obstacles.append(
            f"none of its quantized weights ({types}) is of a type the GEMM runs "
            f"({', '.join(q.name for q in SUPPORTED)})"
        )
    mode = resolve_quantization(requested, obstacles)
    if requested == "auto" and has_blocks(model_dir) and mode == "none":
        log.info("serving the dequantized weights (--quantization none): %s", "; ".join(obstacles))
    if mode == "none":
        return QuantizationPlan("none")
    plan = QuantizationPlan(mode, served)
    plain = [name for name in blocks if name not in plan.skipped_names()]
    if plain:
        log.warning(
            "--quantization %s: %d quantized weights stay dequantized: those of type %s (the "
            "GEMM runs %s) and the parts fused with them (%s)",
            mode,
            len(plain),
            ", ".join(sorted({blocks[n].qtype for n in plain if not _supported(blocks[n])})),
            ", ".join(q.name for q in SUPPORTED),
            ", ".join(plain[:4]) + (", ..." if len(plain) > 4 else ""),
        )
    return plan


def _served(
    blocks: dict[str, GgufBlocks], num_layers: int
) -> dict[str, list[tuple[str, GgufBlocks]]]:
    """The weights ``blocks`` can serve: each layer's fused weights whose every part is of a
    supported type, the embedding and a separate logits weight when they are."""
    served: dict[str, list[tuple[str, GgufBlocks]]] = {}
    for i in range(num_layers):
        for name, parts in _LAYER_PARTS.items():
            names = [f"model.layers.{i}.{part}.weight" for part in parts]
            found = [blocks.get(n) for n in names]
            if all(b is not None and _supported(b) for b in found):
                served[f"layers.{i}.{name}"] = [
                    (n, b) for n, b in zip(names, found, strict=True) if b
                ]
    for hf_name, key in (("model.embed_tokens.weight", "embed"), ("lm_head.weight", "lm_head")):
        b = blocks.get(hf_name)
        if b is not None and _supported(b):
            served[key] = [(hf_name, b)]
    return served


def _pack(blocks: GgufBlocks, layout: str) -> QuantWeight:
    """``blocks`` repacked for the GEMM in ``layout`` (:data:`~sluiceway.kernels.quant_pack.LAYOUTS`),
    rows in HF order (llama.cpp's Q/K permutation undone)."""
    import gguf

    qtype = gguf.GGMLQuantizationType[blocks.qtype]
    n, k = blocks.shape
    rows = blocks.hf_rows() if blocks.permuted_heads else None
    return pack_gguf(blocks.raw, qtype, n, k, rows, layout)


def _supported(blocks: GgufBlocks) -> bool:
    """Whether the GEMM runs ``blocks``' type."""
    import gguf

    return gguf.GGMLQuantizationType[blocks.qtype] in SUPPORTED


def quant_linear_parts(
    x: torch.Tensor,
    parts: list[QuantWeight],
    bias: torch.Tensor | None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``x`` ``[T, K]`` bfloat16 or float32 @ the row-concatenation of ``parts`` (a fused
    weight's q, k, v or gate, up, each in its own GGUF type) ``+ bias`` ``[sum N]`` ->
    ``[T, sum N]`` in ``out_dtype`` (default ``x``'s): each part's GEMM writes its columns of
    one output (an output column's value does not depend on the other columns)."""
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if len(parts) == 1:
        return cpu_ops.quant_linear(x, parts[0], bias, out_dtype=out_dtype)
    out = torch.empty(x.shape[0], sum(p.n for p in parts), dtype=out_dtype)
    col = 0
    for part in parts:
        part_bias = None if bias is None else bias[col : col + part.n]
        cpu_ops.quant_linear(x, part, part_bias, out=out[:, col : col + part.n])
        col += part.n
    return out
