"""Tiny random checkpoints written by transformers, for the worker tests: the Llama family
(``VARIANTS``) and Gemma 3 (:func:`make_tiny_gemma3`)."""

from __future__ import annotations

import pathlib
from typing import Any

import torch

VARIANTS: dict[str, dict[str, Any]] = {
    "llama-tied": {"model_type": "llama", "tie_word_embeddings": True},
    "llama-untied": {"model_type": "llama", "tie_word_embeddings": False},
    "llama3-rope-bias": {
        "model_type": "llama",
        "tie_word_embeddings": False,
        "attention_bias": True,
        "mlp_bias": True,
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    },
    "qwen2": {"model_type": "qwen2", "tie_word_embeddings": True},
    "mistral": {"model_type": "mistral", "tie_word_embeddings": False, "sliding_window": None},
    # q/k RMSNorm per head, no bias, head_dim from the config (128, not hidden / heads = 16)
    "qwen3": {"model_type": "qwen3", "tie_word_embeddings": False, "head_dim": 128},
    # last: the others keep their seeds; fused qkv_proj and gate_up_proj in the checkpoint
    "phi3": {"model_type": "phi3", "tie_word_embeddings": False, "pad_token_id": None},
}


def make_tiny_model(
    path: pathlib.Path, variant: str, seed: int = 0, max_shard_size: str | None = None
) -> pathlib.Path:
    """Write a random 2-layer model (hidden 64, 4 heads, 2 KV heads, vocab 256) to ``path``
    (in several safetensors shards when ``max_shard_size`` is set)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(VARIANTS[variant])
    model_type = spec.pop("model_type")
    config = AutoConfig.for_model(
        model_type,
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
        **spec,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # norms start at 1: make them matter
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0, 0.2)
    if max_shard_size:
        model.save_pretrained(path, max_shard_size=max_shard_size)
    else:
        model.save_pretrained(path)
    return path


def make_tiny_gemma3(path: pathlib.Path, seed: int = 0, **overrides: Any) -> pathlib.Path:
    """Write a random 4-layer Gemma 3 to ``path``: hidden 64, 4 query heads on 1 KV head of
    head_dim 32, vocab 256, layers sliding (window 8) / full / sliding / full, the local rope
    base 10,000 beside the global 1e6, ``query_pre_attn_scalar`` 48 (not the head dim), and
    norms drawn around 0 (Gemma's norm multiplies by ``1 + w``); ``overrides`` are config
    fields (e.g. ``final_logit_softcapping``)."""
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    fields: dict[str, Any] = {
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "max_position_embeddings": 256,
        "sliding_window": 8,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        "query_pre_attn_scalar": 48,
        "rms_norm_eps": 1e-6,
        "initializer_range": 0.2,
        "bos_token_id": 2,
        "eos_token_id": 1,
        "pad_token_id": 0,
        "tie_word_embeddings": True,
    }
    config = Gemma3TextConfig(**{**fields, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(-0.5, 0.5)
    model.save_pretrained(path)
    return path
