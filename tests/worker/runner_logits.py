"""The logits of every computed position of a step, for tests that compare them."""

from __future__ import annotations

import torch

from sluiceway.worker.model_runner import ModelRunner, ScheduledChunk


def step_logits(runner: ModelRunner, chunks: list[ScheduledChunk]) -> list[torch.Tensor]:
    """Like ``runner.execute(chunks)`` (same metadata, same KV writes: it goes through the
    runner's own ``_prepare`` and ``_forward``) but returns the logits of every computed
    position instead of sampling: one ``[num_new_tokens, V]`` float32 tensor per chunk, in
    chunk order (on every tensor-parallel rank)."""
    with torch.inference_mode():
        inputs = runner._prepare(chunks)
        logits = runner.model.compute_logits(runner._forward(inputs))
        return [
            logits[s : s + c.num_new_tokens].clone()
            for s, c in zip(inputs.row_start, chunks, strict=True)
        ]
