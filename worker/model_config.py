"""The decoder's config: the subset of an HF ``config.json`` the model families we run need.

Families (``model_type``): ``llama``, ``mistral``, ``qwen2``, ``phi3`` (the Llama block), ``qwen3`` (the
Llama block with per-head q/k RMSNorm, no bias) and ``gemma3`` (Gemma 3's block: q/k norm,
norms before and after attention and MLP, GELU-tanh, interleaved sliding and global layers
with their own rope bases; :mod:`worker.gemma3`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from sluiceway.model_files import context_window
from sluiceway.worker.architectures import UnsupportedModelError, model_type_of

__all__ = ["ModelConfig", "UnsupportedModelError", "rope_inv_freq"]  # the error: re-exported

_ACTIVATIONS = {"gemma3": "gelu_pytorch_tanh"}  # the rest: silu


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The subset of an HF ``config.json`` the decoder needs (see :meth:`from_hf_dict`).

    ``layer_windows`` holds each layer's sliding window in tokens (None: full causal
    attention; empty: no layer has one): a query at position ``p`` sees keys ``p - W < k <= p``.
    ``local_rope_theta`` is the rope base of the sliding layers when it differs (Gemma 3:
    10,000 beside the global 1e6; its rope scaling applies to the global layers only).
    ``attention_scale`` is the softmax scale (None: ``1 / sqrt(head_dim)``).
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    rope_scaling: Mapping[str, Any] | None = None
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    hidden_act: str = "silu"
    qk_norm: bool = False
    layer_windows: tuple[int | None, ...] = ()
    local_rope_theta: float | None = None
    attention_scale: float | None = None
    final_logit_softcapping: float | None = None

    def layer_window(self, layer: int) -> int | None:
        """Layer ``layer``'s sliding window in tokens, None for full attention."""
        return self.layer_windows[layer] if self.layer_windows else None

    def layer_uses_local_rope(self, layer: int) -> bool:
        """Whether layer ``layer`` rotates with ``local_rope_theta`` (a sliding layer of a model
        that has one), not the global base and scaling."""
        return self.local_rope_theta is not None and self.layer_window(layer) is not None

    @classmethod
    def from_hf_dict(cls, cfg: Mapping[str, Any]) -> ModelConfig:
        """Read an HF ``config.json`` dict (transformers 4.x or 5.x layout).

        Raises:
            UnsupportedModelError: an architecture not in
                :data:`worker.architectures.ARCHITECTURES`, another activation than the
                family's, a rope scaling other than default/linear/llama3 (Phi-3's longrope
                among them), a partial rotary factor (rotary over part of each head), or a
                Gemma option not implemented (attention logit softcapping, bidirectional
                attention).
        """
        model_type = model_type_of(cfg)
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
        if act != _ACTIVATIONS.get(model_type, "silu"):
            raise UnsupportedModelError(
                f"unsupported activation {act!r} for {model_type} "
                f"(only {_ACTIVATIONS.get(model_type, 'silu')!r})"
            )
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        head_dim = cfg.get("head_dim") or hidden // heads
        global_rope, local_theta = _rope(cfg, model_type)
        rope_theta = float(global_rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        scaling = _rope_scaling(cfg.get("rope_scaling") or global_rope or None)
        partial = float(
            global_rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1))
        )
        if partial != 1:
            raise UnsupportedModelError(
                f"partial_rotary_factor {partial} is not implemented (rotary over whole heads only)"
            )
        attention_bias = bool(cfg.get("attention_bias", False))
        max_positions, sliding = context_window({**cfg, "model_type": model_type})
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        layers = int(cfg["num_hidden_layers"])
        gemma = model_type == "gemma3"
        if gemma:
            _check_gemma3(cfg)
        scalar = cfg.get("query_pre_attn_scalar", 256) if gemma else None
        return cls(
            model_type=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", gemma)),
            qkv_bias=model_type == "qwen2" or (model_type != "qwen2" and attention_bias),
            o_bias=model_type != "qwen2" and attention_bias,
            mlp_bias=model_type == "llama" and bool(cfg.get("mlp_bias", False)),
            rope_scaling=scaling,
            sliding_window=sliding,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            hidden_act=act,
            qk_norm=model_type in ("qwen3", "gemma3"),
            layer_windows=_layer_windows(cfg, model_type, layers, sliding),
            local_rope_theta=local_theta,
            attention_scale=None if scalar is None else float(scalar) ** -0.5,
            final_logit_softcapping=cfg.get("final_logit_softcapping") if gemma else None,
        )


def _rope(cfg: Mapping[str, Any], model_type: str) -> tuple[dict[str, Any], float | None]:
    """``(the global layers' rope parameters, the local layers' rope base or None)``: for
    Gemma 3 transformers 5's per-layer-type ``rope_parameters`` or 4.x's ``rope_theta`` /
    ``rope_scaling`` / ``rope_local_base_freq``; for the rest ``rope_parameters`` as is."""
    params = dict(cfg.get("rope_parameters") or {})
    if model_type != "gemma3":
        return params, None
    if "full_attention" in params:
        local = params.get("sliding_attention") or {}
        return dict(params["full_attention"]), float(local.get("rope_theta", 10000.0))
    return params, float(cfg.get("rope_local_base_freq", 10000.0))


def _rope_scaling(scaling: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The rope scaling the decoder applies (None for default), checked."""
    if scaling is None:
        return None
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in ("default", "linear", "llama3"):
        raise UnsupportedModelError(
            f"rope scaling {rope_type!r} is not implemented (supported: default, linear, llama3)"
        )
    return None if rope_type == "default" else {**scaling, "rope_type": rope_type}


def _check_gemma3(cfg: Mapping[str, Any]) -> None:
    """Refuse the Gemma 3 options this decoder does not implement."""
    if cfg.get("attn_logit_softcapping"):
        raise UnsupportedModelError(
            "gemma3 attn_logit_softcapping is not implemented "
            f"(the config sets {cfg['attn_logit_softcapping']})"
        )
    if cfg.get("use_bidirectional_attention"):
        raise UnsupportedModelError("gemma3 use_bidirectional_attention is not implemented")


def _layer_windows(
    cfg: Mapping[str, Any], model_type: str, layers: int, sliding: int | None
) -> tuple[int | None, ...]:
    """Each layer's sliding window as transformers 5 sets it: ``layer_types`` when the config
    has it; else Gemma 3's pattern (every ``sliding_window_pattern``-th layer full, default 6),
    Qwen2/3's layers from ``max_window_layers`` on (default 28), Mistral's every layer; ``()``
    without a window."""
    if not sliding:
        return ()
    types = cfg.get("layer_types")
    if types is None:
        if model_type == "gemma3":
            pattern = int(cfg.get("sliding_window_pattern", 6))
            types = ["full" if (i + 1) % pattern == 0 else "sliding" for i in range(layers)]
        elif model_type in ("qwen2", "qwen3"):
            first = int(cfg.get("max_window_layers", 28))
            types = ["sliding" if i >= first else "full" for i in range(layers)]
        else:
            types = ["sliding"] * layers
    windows = tuple(sliding if str(t).startswith("sliding") else None for t in types[:layers])
    return windows if any(w is not None for w in windows) else ()


def rope_inv_freq(config: ModelConfig, local: bool = False) -> torch.Tensor:
    """Rotary inverse frequencies ``[head_dim // 2]`` float32, with linear/llama3 scaling applied
    exactly as transformers' ``ROPE_INIT_FUNCTIONS`` do; ``local``: the sliding layers'
    (``local_rope_theta``, unscaled, as Gemma 3's ``sliding_attention`` rope)."""
    d = config.head_dim
    theta = config.local_rope_theta if local and config.local_rope_theta else config.rope_theta
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    scaling = None if local else config.rope_scaling
    if scaling is None:
        return inv_freq
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    low = float(scaling["low_freq_factor"])
    high = float(scaling["high_freq_factor"])
    old_ctx = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_ctx / low
    high_freq_wavelen = old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)
