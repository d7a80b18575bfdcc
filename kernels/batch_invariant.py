"""The switch for the batch-invariant Triton path (CUDA), named after vLLM's ``VLLM_BATCH_INVARIANT``.

On CUDA with the Triton attention backend and bfloat16 weights the forward is batch invariant
by default (README, Reproducibility): the unified attention kernel
(:mod:`kernels.triton_unified_attention`), the fixed-tile matmul
(:mod:`kernels.triton_matmul`) for every linear layer and the logits, and the per-row RMSNorm
(:mod:`kernels.triton_norm`). ``SLUICEWAY_BATCH_INVARIANT=0`` in the worker's environment
turns it off: the two older attention kernels (decode with a split count that follows the
batch, prefill with a tile that follows the chunk length), cuBLAS linears (``F.linear``) and
torch's RMSNorm. Whether that is faster on a GPU has not been measured yet
(``scripts/gpu_check.sh`` times the matmul against cuBLAS); on CPU the switch changes nothing
(the C++ kernels are invariant and the fast path).
"""

from __future__ import annotations

import os

__all__ = ["ENV_VAR", "enabled"]

ENV_VAR = "SLUICEWAY_BATCH_INVARIANT"
_OFF = ("0", "false", "no", "off")


def enabled() -> bool:
    """True unless ``SLUICEWAY_BATCH_INVARIANT`` is ``0``/``false``/``no``/``off`` (read at each
    call: the worker reads it once, when it picks its attention backend).

    Raises:
        ValueError: any other value than those and ``1``/``true``/``yes``/``on``/empty.
    """
    value = os.environ.get(ENV_VAR, "").strip().lower()
    if value in ("", "1", "true", "yes", "on"):
        return True
    if value in _OFF:
        return False
    raise ValueError(f"{ENV_VAR}={value!r}: use 1 (the default) or 0")
