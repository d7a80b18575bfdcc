"""`bench step --random-model`'s built-in configs: HF config.json fields, read by ModelConfig."""

from __future__ import annotations

from typing import Any

# Built-in configs for `--random-model` (HF config.json fields, read by ModelConfig).
RANDOM_MODELS: dict[str, dict[str, Any]] = {
    # Llama 2 7B (meta-llama/Llama-2-7b-hf): 6.74e9 parameters, 13.5 GB in bfloat16.
    "llama-2-7b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    # A few million parameters with the same structure (untied, GQA), to dry-run on a CPU.
    "tiny": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 1024,
        "hidden_size": 256,
        "intermediate_size": 688,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
}
# `tiny` with Gemma 3's 262,144-token vocabulary, tied: the logits and sampling of a large
# vocabulary dominate its step.
RANDOM_MODELS["tiny-262k"] = {
    **RANDOM_MODELS["tiny"],
    "vocab_size": 262_144,
    "tie_word_embeddings": True,
}
