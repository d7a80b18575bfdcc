"""A tiny random Llama through two attention backends, step by step: the shared check of
every backend against the torch reference (tests/kernels/test_*_kernels.py)."""

from __future__ import annotations

import pathlib
import random

import torch

from sluiceway.sampling_params import SamplingParams


def worst_logit_difference(
    tmp_path: pathlib.Path, backend: str, device: torch.device, block_size: int
) -> float:
    """Largest |logit difference| between ``backend`` and the torch reference over five steps
    of two sequences in float32: seq 0 in two prefill chunks (the second over a cached
    prefix) beside seq 1's whole prompt, then decodes of both together (teacher forcing: the
    reference's argmax is appended to both)."""
    from sluiceway.worker.model_runner import ModelRunner, ScheduledChunk
    from tests.worker.runner_logits import step_logits
    from tests.worker.tiny_models import make_tiny_model

    model_dir = make_tiny_model(tmp_path / "llama", "llama-untied", seed=3)
    runners = {
        name: ModelRunner(
            model_dir, device=str(device), dtype="float32", block_size=block_size,
            kv_cache_memory=1 << 18, attention_backend=name,
        )
        for name in ("torch", backend)
    }  # fmt: skip
    assert runners[backend].attention_backend.name == backend
    rng = random.Random(0)
    prompts = {0: [rng.randrange(256) for _ in range(9)], 1: [rng.randrange(256) for _ in range(5)]}
    free = list(range(runners["torch"].num_kv_blocks))
    rng.shuffle(free)
    per_seq = -(-20 // block_size)  # room for 20 tokens
    tables = {s: [free.pop() for _ in range(per_seq)] for s in prompts}
    seqs = {
        name: {s: r.make_sequence(s, list(p), SamplingParams()) for s, p in prompts.items()}
        for name, r in runners.items()
    }
    for by_id in seqs.values():
        for s, seq in by_id.items():
            seq.block_table.extend(tables[s])
    # (seq, computed, new) per step
    plan = [[(0, 0, 6), (1, 0, 5)], [(0, 6, 3), (1, 5, 1)], [(1, 6, 1), (0, 9, 1)]]
    plan += [[(0, 10, 1), (1, 7, 1)], [(1, 8, 1), (0, 11, 1)]]
    worst = 0.0
    for step in plan:
        logits = {}
        for name, runner in runners.items():
            chunks = [ScheduledChunk(seqs[name][s], done, new) for s, done, new in step]
            logits[name] = step_logits(runner, chunks)
        for s, done, new in step:
            nxt = int(logits["torch"][[x for x, *_ in step].index(s)][-1].argmax())
            if done + new == len(seqs["torch"][s].token_ids):
                for name in runners:
                    seqs[name][s].token_ids.append(nxt)
        for mine, ref in zip(logits[backend], logits["torch"], strict=True):
            worst = max(worst, float((mine - ref).abs().max()))
    return worst
