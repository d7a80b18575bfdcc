"""The HF architectures the worker implements, and the one-line refusal of the others.

Imports no torch: ``serve`` checks the model folder with it before starting any child
(:func:`sluiceway.preflight.check_model_config`), and the worker again when it loads the
model (:meth:`worker.model.ModelConfig.from_hf_dict`); both say the same line.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["ARCHITECTURES", "UnsupportedModelError", "model_type_of"]

# HF ``architectures[0]`` -> the model_type the decoder is built for
ARCHITECTURES = {
    "Gemma3ForCausalLM": "gemma3",
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Phi3ForCausalLM": "phi3",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
# config.json ``model_type`` values that name one of ours differently (no ``architectures``)
_MODEL_TYPES = {"gemma3_text": "gemma3"}


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture or one of its options is not implemented here."""


def model_type_of(cfg: Mapping[str, Any]) -> str:
    """The model_type the decoder implements for an HF ``config.json`` dict: that of its first
    architecture listed in :data:`ARCHITECTURES`, else (no ``architectures``) its own
    ``model_type`` when it is one of ours.

    Raises:
        UnsupportedModelError: neither; the message names the architecture (or model_type)
            and those implemented, in one line.
    """
    archs = cfg.get("architectures") or []
    for arch in archs:
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    model_type = cfg.get("model_type")
    ours = _MODEL_TYPES.get(str(model_type), model_type)
    if not archs and ours in ARCHITECTURES.values():
        return str(ours)
    supported = ", ".join(ARCHITECTURES)
    if not archs and model_type is None:
        raise UnsupportedModelError(
            f"config.json names no architecture (architectures, model_type); supported: {supported}"
        )
    name = ", ".join(map(str, archs)) if archs else f"model_type {model_type!r}"
    raise UnsupportedModelError(f"architecture {name} is not implemented; supported: {supported}")
