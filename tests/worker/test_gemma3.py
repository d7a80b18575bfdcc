"""Gemma 3 against transformers in float32: a tiny random checkpoint (window 8, one KV head,
interleaved sliding and full layers with their own rope bases) on the torch path and on the
fused C++ elementwise ops, and the packaged Gemma 3 270M GGUF (slow)."""

from __future__ import annotations

import json
import pathlib
import random

import pytest
import torch

from sluiceway.kernels.backend import TorchAttentionBackend
from sluiceway.sampling_params import SamplingParams
from sluiceway.worker.model import ModelConfig, UnsupportedModelError
from sluiceway.worker.model_runner import ModelRunner, ScheduledChunk, SequenceData
from tests.oracle import greedy
from tests.worker.runner_logits import step_logits
from tests.worker.tiny_models import make_tiny_gemma3

BLOCK = 4


class FusedOpsTorchAttention(TorchAttentionBackend):
    """The fused C++ elementwise ops (q/k norm, RoPE + KV write, the norms, GELU-tanh) around
    the torch reference attention, which has sliding windows (until the C++ kernel has them)."""

    name = "torch-fused-ops"
    fused_layer_ops = True


@pytest.fixture(scope="module")
def tiny_gemma(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return make_tiny_gemma3(tmp_path_factory.mktemp("gemma3") / "tiny")


def _runner(model_dir: pathlib.Path, ops: str) -> ModelRunner:
    runner = ModelRunner(
        model_dir, dtype="float32", block_size=BLOCK, kv_cache_memory=1 << 20,
        attention_backend="torch",
    )  # fmt: skip
    if ops == "fused":
        from sluiceway.kernels import cpu_ops

        cpu_ops.load()
        runner.attention_backend = runner.model.attention_backend = FusedOpsTorchAttention()
    return runner


def _grow(seq: SequenceData, tokens: int, free: list[int]) -> None:
    while len(seq.block_table) * BLOCK < tokens:
        seq.block_table.append(free.pop())


def test_config_of_the_tiny_model(tiny_gemma: pathlib.Path) -> None:
    cfg = json.loads((tiny_gemma / "config.json").read_text())
    c = ModelConfig.from_hf_dict(cfg)
    assert (c.model_type, c.hidden_act, c.qk_norm) == ("gemma3", "gelu_pytorch_tanh", True)
    assert c.layer_windows == (8, None, 8, None)
    assert (c.rope_theta, c.local_rope_theta) == (1e6, 10000.0)
    assert [c.layer_uses_local_rope(i) for i in range(4)] == [True, False, True, False]
    assert c.attention_scale == 48**-0.5
    assert (c.tie_word_embeddings, c.qkv_bias, c.final_logit_softcapping) == (True, False, None)
    with pytest.raises(UnsupportedModelError) as e:
        ModelConfig.from_hf_dict({**cfg, "attn_logit_softcapping": 50.0})
    assert str(e.value) == "gemma3 attn_logit_softcapping is not implemented (the config sets 50.0)"


@pytest.mark.parametrize("ops", ["torch", "fused"])
def test_chunked_mixed_batch_matches_transformers(tiny_gemma: pathlib.Path, ops: str) -> None:
    """Teacher-forced logits of prompts past the window, in chunks that start past it, beside
    decodes, equal transformers' float32 forward over the whole text."""
    from transformers import AutoModelForCausalLM

    runner = _runner(tiny_gemma, ops)
    rng = random.Random(1)
    full = {s: [rng.randrange(3, 256) for _ in range(n)] for s, n in ((0, 26), (1, 31), (2, 16))}
    seqs = {s: runner.make_sequence(s, full[s][:n], SamplingParams()) for s, n in ((0, 13), (1, 21), (2, 5))}  # fmt: skip
    free = list(range(runner.num_kv_blocks))
    random.Random(2).shuffle(free)
    got: dict[int, list[torch.Tensor]] = {s: [] for s in full}
    computed = dict.fromkeys(full, 0)

    def step(plan: list[tuple[int, int]]) -> None:
        chunks = []
        for s, n in plan:
            _grow(seqs[s], computed[s] + n, free)
            chunks.append(ScheduledChunk(seqs[s], computed[s], n))
        for (s, n), logits in zip(plan, step_logits(runner, chunks), strict=True):
            got[s].append(logits)
            computed[s] += n
        for s, _ in plan:
            seq = seqs[s]
            if computed[s] == len(seq.token_ids) and len(seq.token_ids) < len(full[s]):
                seq.token_ids.append(full[s][len(seq.token_ids)])

    step([(0, 13), (1, 10)])
    step([(1, 11), (0, 1)])  # a chunk whose first query is past the window
    step([(0, 1), (2, 5), (1, 1)])
    for _ in range(8):
        step([(2, 1), (1, 1), (0, 1)])
    model = AutoModelForCausalLM.from_pretrained(tiny_gemma, dtype=torch.float32).eval()
    for s in full:
        with torch.no_grad():
            ref = model(torch.tensor([seqs[s].token_ids[: computed[s]]])).logits[0]
        torch.testing.assert_close(torch.cat(got[s]), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("ops", ["torch", "fused"])
def test_greedy_matches_transformers(tiny_gemma: pathlib.Path, ops: str) -> None:
    from transformers import AutoModelForCausalLM

    runner = _runner(tiny_gemma, ops)
    rng = random.Random(5)
    prompts = [[2] + [rng.randrange(3, 256) for _ in range(n)] for n in (19, 6, 11)]
    seqs = [
        runner.make_sequence(i, p, SamplingParams(temperature=0.0)) for i, p in enumerate(prompts)
    ]
    free = list(range(runner.num_kv_blocks))
    computed = [0] * len(seqs)
    for _ in range(14):
        chunks = []
        for i, s in enumerate(seqs):
            _grow(s, len(s.token_ids), free)
            chunks.append(ScheduledChunk(s, computed[i], len(s.token_ids) - computed[i]))
            computed[i] = len(s.token_ids)
        for s, t in zip(seqs, runner.execute(chunks), strict=True):
            s.token_ids.append(t.token_id)
    model = AutoModelForCausalLM.from_pretrained(tiny_gemma, dtype=torch.float32).eval()
    for s, p in zip(seqs, prompts, strict=True):
        assert s.token_ids[len(p) :] == greedy(model, p, 14)


def test_final_logit_softcapping(tmp_path: pathlib.Path) -> None:
    from transformers import AutoModelForCausalLM

    model_dir = make_tiny_gemma3(tmp_path / "capped", seed=3, final_logit_softcapping=0.5)
    runner = _runner(model_dir, "torch")
    ids = [2, *range(40, 60)]
    seq = runner.make_sequence(0, ids, SamplingParams())
    _grow(seq, len(ids), list(range(runner.num_kv_blocks)))
    logits = step_logits(runner, [ScheduledChunk(seq, 0, len(ids))])[0]
    assert logits.abs().max() <= 0.5
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(logits, ref, atol=1e-5, rtol=1e-5)
