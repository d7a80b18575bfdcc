"""How the model runner gets its model: the device and dtype it resolves, the weights it loads
(or the pre-built model it checks), and the linear kernels it picks for the attention backend.

Everything here runs once, when a :class:`worker.model_runner.ModelRunner` starts.
"""

from __future__ import annotations

import pathlib

import torch

from sluiceway.kernels import cpu_ops, onednn_linear
from sluiceway.kernels.backend import AttentionBackend
from sluiceway.worker.loader import load_model
from sluiceway.worker.model import LlamaForCausalLM
from sluiceway.worker.parallel import TensorParallelGroup

__all__ = [
    "cpu_has_fast_bf16",
    "load_or_check_model",
    "packing_note",
    "resolve_device",
    "resolve_dtype",
    "select_linear_kernels",
]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cpu_has_fast_bf16() -> bool:
    """True when ``/proc/cpuinfo`` lists ``amx_bf16`` or ``avx512_bf16``: oneDNN runs bf16
    matmuls natively there (measured on an avx512_bf16 Xeon: SmolLM2 decode at batch 64 is
    1.5x faster in bf16 than in fp32)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return not {"amx_bf16", "avx512_bf16"}.isdisjoint(line.split())
    except OSError:
        pass
    return False


def resolve_device(device: str) -> torch.device:
    """``auto`` is ``cuda`` when torch sees a GPU, else ``cpu``; any other name as torch reads it."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """Map ``auto|float32|bfloat16|float16`` to a torch dtype.

    ``auto`` is bfloat16 on CUDA (float16 where bf16 is unsupported) and on CPUs with AMX-BF16 or AVX512-BF16,
    float32 elsewhere.

    Raises:
        ValueError: an unknown name.
    """
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def load_or_check_model(
    model_dir: pathlib.Path,
    model: LlamaForCausalLM | None,
    *,
    dtype: torch.dtype,
    device: torch.device,
    max_model_len: int,
    tp: TensorParallelGroup,
    skip: frozenset[str] = frozenset(),
) -> LlamaForCausalLM:
    """The runner's model: ``model`` itself when given (checked against the runner's
    settings), else the rank's shard loaded from ``model_dir`` in ``dtype`` on ``device``, its
    rotary table covering ``max_model_len`` positions, the checkpoint names ``skip`` unread
    (:func:`worker.loader.load_model`).

    Raises:
        worker.loader.ModelLoadError, worker.model.UnsupportedModelError: bad model folder.
        ValueError: a pre-built model in another dtype, on another device type, with fewer
            positions than ``max_model_len`` or for another tensor-parallel world size.
    """
    if model is None:
        return load_model(
            model_dir, dtype=dtype, device=device, max_positions=max_model_len, tp=tp, skip=skip
        )
    if (
        model.dtype != dtype
        or model.embed_weight.device.type != device.type
        or model.max_positions < max_model_len
        or model.tp.world_size != tp.world_size
    ):
        raise ValueError(
            f"the pre-built model ({model.dtype} on {model.embed_weight.device}, "
            f"{model.max_positions} positions, {model.tp.world_size} ranks) does not fit "
            f"the runner ({dtype} on {device}, max_model_len "
            f"{max_model_len}, {tp.world_size} ranks)"
        )
    return model


def select_linear_kernels(
    model: LlamaForCausalLM, backend: AttentionBackend, dtype: torch.dtype
) -> None:
    """Puts ``model``'s linear layers on the fastest kernels ``backend`` and ``dtype`` allow:
    weights packed for oneDNN or the bfloat16 GEMM beside the C++ CPU kernels, the
    batch-invariant Triton matmul and RMSNorm beside batch-invariant Triton attention in
    bfloat16; else leaves them on ``F.linear``. Call it before anything runs the model (the CUDA
    profiling forward, the graph capture)."""
    if (
        backend.fused_layer_ops
        and dtype in (torch.float32, torch.bfloat16)  # oneDNN's fp16 needs AVX512-FP16
        and (
            onednn_linear.available() or (dtype == torch.bfloat16 and cpu_ops.bf16_gemm_supported())
        )
    ):
        model.pack_linear_weights()
    elif backend.name == "triton" and backend.batch_invariant and dtype == torch.bfloat16:
        model.use_triton_ops()


def packing_note(model: LlamaForCausalLM) -> str:
    """The start line's word on the linear weights' packing."""
    if model.quantized_bytes():
        weight = model.quant_logits_weight
        gemm = "int8-activation" if weight is not None and weight.layout == "a8" else "quantized"
        return (
            f", weights kept in their GGUF blocks ({model.quantized_bytes() / 1e6:.0f} MB) on "
            f"the {gemm} GEMM"
        )
    if model.bf16_pairs:
        return ", linear weights packed for the bfloat16 GEMM"
    if model.triton_ops is not None:
        return ", linear layers and RMSNorm on the batch-invariant Triton kernels"
    if model.packed_lm_head is not None:
        return ", linear weights packed for oneDNN"
    return ""
