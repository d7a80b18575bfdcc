"""`transformers` as the oracle: the same weights, loaded by transformers' own GGUF loader."""

from __future__ import annotations

from pathlib import Path

import torch


def load_oracle(gguf_path: Path):  # type: ignore[no-untyped-def]
    """A GGUF as `transformers` loads it itself (float32, eval mode; SmolLM2 ~30 s)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    )
    return model.eval()


@torch.inference_mode()
def greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:  # type: ignore[no-untyped-def]
    """Greedy tokens of `model`, never stopping at EOS (as `ignore_eos`); the logits of the
    last position only (a 262k vocabulary makes the others costly)."""
    out = model(torch.tensor([prompt_ids]), use_cache=True, logits_to_keep=1)
    tokens: list[int] = []
    for _ in range(max_new_tokens):
        tok = int(out.logits[0, -1].argmax())
        tokens.append(tok)
        if len(tokens) == max_new_tokens:
            break
        out = model(torch.tensor([[tok]]), cache=out.cache, use_cache=True, logits_to_keep=1)
    return tokens
