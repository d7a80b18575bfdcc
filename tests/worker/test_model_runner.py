"""ModelRunner on tiny random checkpoints against transformers' own forward."""

from __future__ import annotations

import json
import pathlib
import random

import pytest
import torch

from sluiceway.sampling_params import SamplingParams
from sluiceway.worker.loader import ModelLoadError
from sluiceway.worker.model import UnsupportedModelError
from sluiceway.worker.model_runner import (
    ModelRunner,
    ScheduledChunk,
    SequenceData,
)
from tests.worker.runner_logits import step_logits
from tests.worker.tiny_models import VARIANTS, make_tiny_model

BLOCK = 4


class _Blocks:
    """Hands out shuffled block ids so block tables are never contiguous."""

    def __init__(self, n: int, seed: int = 0) -> None:
        self.free = list(range(n))
        random.Random(seed).shuffle(self.free)

    def grow(self, seq: SequenceData, tokens: int) -> None:
        while len(seq.block_table) * BLOCK < tokens:
            seq.block_table.append(self.free.pop())


def _hf_logits(model_dir: pathlib.Path, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_chunked_mixed_batch_matches_transformers(
    tiny_models: dict[str, pathlib.Path], variant: str
) -> None:
    model_dir = tiny_models[variant]
    runner = ModelRunner(model_dir, dtype="float32", block_size=BLOCK, kv_cache_memory=1 << 20)
    rng = random.Random(1)
    full = {s: [rng.randrange(256) for _ in range(n)] for s, n in ((0, 22), (1, 28), (2, 10))}
    prompt_len = {0: 13, 1: 21, 2: 5}
    seqs = {s: runner.make_sequence(s, full[s][: prompt_len[s]], SamplingParams()) for s in full}
    blocks = _Blocks(runner.num_kv_blocks)
    got: dict[int, list[torch.Tensor]] = {s: [] for s in full}
    computed = dict.fromkeys(full, 0)

    def step(plan: list[tuple[int, int]]) -> None:
        chunks = []
        for s, n in plan:
            seq = seqs[s]
            blocks.grow(seq, computed[s] + n)
            chunks.append(ScheduledChunk(seq, computed[s], n))
        for (s, n), logits in zip(plan, step_logits(runner, chunks), strict=True):
            assert logits.shape == (n, 256)
            got[s].append(logits)
            computed[s] += n
        for s, _ in plan:  # teacher forcing: append the next token of the reference text
            seq = seqs[s]
            if computed[s] == len(seq.token_ids) and len(seq.token_ids) < len(full[s]):
                seq.token_ids.append(full[s][len(seq.token_ids)])

    step([(0, 13), (1, 10)])  # seq 0 whole prompt, seq 1 first chunk
    step([(1, 11), (0, 1)])  # seq 1 second chunk, seq 0 decodes
    step([(0, 1), (2, 5), (1, 1)])  # a new prompt between two decodes
    for _ in range(3):
        step([(2, 1), (1, 1), (0, 1)])
    step([(1, 1), (0, 1)])

    for s in full:
        mine = torch.cat(got[s])
        ref = _hf_logits(model_dir, seqs[s].token_ids[: computed[s]])
        torch.testing.assert_close(mine, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_matches_transformers(tiny_models: dict[str, pathlib.Path], variant: str) -> None:
    """Greedy ids of two prompts decoded together equal transformers' float32 greedy."""
    from transformers import AutoModelForCausalLM

    from tests.oracle import greedy

    model_dir = tiny_models[variant]
    runner = ModelRunner(model_dir, dtype="float32", block_size=BLOCK, kv_cache_memory=1 << 20)
    rng = random.Random(7)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (11, 4)]
    seqs = [runner.make_sequence(i, p, SamplingParams(temperature=0.0)) for i, p in enumerate(prompts)]  # fmt: skip
    blocks = _Blocks(runner.num_kv_blocks)
    computed = [0, 0]
    for _ in range(10):
        chunks = []
        for i, seq in enumerate(seqs):
            blocks.grow(seq, len(seq.token_ids))
            chunks.append(ScheduledChunk(seq, computed[i], len(seq.token_ids) - computed[i]))
            computed[i] = len(seq.token_ids)
        for seq, t in zip(seqs, runner.execute(chunks), strict=True):
            seq.token_ids.append(t.token_id)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for seq, p in zip(seqs, prompts, strict=True):
        assert seq.token_ids[len(p) :] == greedy(model, p, 10)


def test_execute_greedy_and_order(tiny_models: dict[str, pathlib.Path]) -> None:
    model_dir = tiny_models["llama-untied"]
    runner = ModelRunner(model_dir, dtype="float32", block_size=BLOCK, kv_cache_memory=1 << 20)
    blocks = _Blocks(runner.num_kv_blocks)
    prompts = {7: [5, 9, 11, 200, 3], 3: [8, 8, 8]}
    seqs = {
        s: runner.make_sequence(s, p, SamplingParams(temperature=0.0)) for s, p in prompts.items()
    }
    for seq in seqs.values():
        blocks.grow(seq, 16)
    # seq 7 only partly prefilled: no token for it
    out = runner.execute([ScheduledChunk(seqs[7], 0, 3), ScheduledChunk(seqs[3], 0, 3)])
    assert [t.seq_id for t in out] == [3]
    out = runner.execute([ScheduledChunk(seqs[7], 3, 2)])
    assert [t.seq_id for t in out] == [7]
    ref = _hf_logits(model_dir, prompts[7])[-1]
    assert out[0].token_id == int(ref.argmax())
    assert out[0].logprob == pytest.approx(float(torch.log_softmax(ref, -1).max()), abs=1e-4)


def test_kv_sizing(tiny_models: dict[str, pathlib.Path]) -> None:
    model_dir = tiny_models["llama-tied"]
    memory = 10_000_000
    runner = ModelRunner(model_dir, dtype="float32", block_size=16, kv_cache_memory=memory)
    per_block = 2 * 2 * 16 * 2 * 16 * 4  # layers * K/V * block * kv heads * head_dim * fp32
    assert runner.bytes_per_block == per_block
    assert runner.num_kv_blocks == memory // per_block
    assert runner.kv_pool.shape == (2, 2, memory // per_block, 2, 16 * 16)
    bf16 = ModelRunner(model_dir, dtype="bfloat16", block_size=16, kv_cache_memory=memory)
    assert bf16.num_kv_blocks == memory // (per_block // 2)
    assert bf16.dtype == torch.bfloat16


def test_properties(tiny_models: dict[str, pathlib.Path]) -> None:
    runner = ModelRunner(
        tiny_models["qwen2"], dtype="float32", kv_cache_memory=1 << 20, max_model_len=100
    )
    assert runner.model_id == "qwen2"
    assert runner.max_model_len == 100
    assert runner.vocab_size == 256
    assert runner.eos_token_ids == [2]
    assert runner.block_size == 16
    seq = runner.make_sequence(1, [1, 2], SamplingParams(seed=5))
    assert seq.generator is not None and seq.block_table == []
    with pytest.raises(ValueError, match="max_model_len"):
        runner.make_sequence(2, [1] * 101, SamplingParams())


def test_a_recomputed_seeded_sequence_resumes_its_random_stream(
    tiny_models: dict[str, pathlib.Path],
) -> None:
    """After preemption the prompt holds 2 generated tokens: their 2 draws are skipped."""
    runner = ModelRunner(tiny_models["qwen2"], dtype="float32", kv_cache_memory=1 << 20)
    sampled = SamplingParams(temperature=0.8, seed=5)
    fresh = runner.make_sequence(1, [1, 2, 3], sampled)
    assert fresh.generator is not None
    draws = [float(torch.rand(1, generator=fresh.generator)) for _ in range(3)]
    resumed = runner.make_sequence(2, [1, 2, 3, 7, 8], sampled, num_prompt_tokens=3)
    assert resumed.num_prompt_tokens == 3 and resumed.generator is not None
    assert float(torch.rand(1, generator=resumed.generator)) == draws[2]
    greedy = runner.make_sequence(3, [1, 2, 3, 7], SamplingParams(temperature=0, seed=5), 3)
    assert greedy.generator is not None  # greedy rows draw nothing: nothing to skip
    assert float(torch.rand(1, generator=greedy.generator)) == draws[0]
    with pytest.raises(ValueError, match="num_prompt_tokens"):
        runner.make_sequence(4, [1, 2], sampled, num_prompt_tokens=3)


def test_bad_chunks_rejected(tiny_models: dict[str, pathlib.Path]) -> None:
    runner = ModelRunner(tiny_models["llama-tied"], dtype="float32", kv_cache_memory=1 << 20)
    seq = runner.make_sequence(1, [1, 2, 3], SamplingParams())
    with pytest.raises(ValueError, match="blocks cannot hold"):
        runner.execute([ScheduledChunk(seq, 0, 3)])
    seq.block_table.append(0)
    with pytest.raises(ValueError, match="outside"):
        runner.execute([ScheduledChunk(seq, 0, 4)])
    with pytest.raises(ValueError, match="twice"):
        runner.execute([ScheduledChunk(seq, 0, 1), ScheduledChunk(seq, 1, 2)])


def test_bad_folders(tmp_path: pathlib.Path, tiny_models: dict[str, pathlib.Path]) -> None:
    with pytest.raises(ModelLoadError, match=r"no config\.json"):
        ModelRunner(tmp_path, dtype="float32")
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        ModelRunner(tmp_path, dtype="float32")
    cfg = json.loads((tiny_models["llama-tied"] / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="safetensors"):
        ModelRunner(tmp_path, dtype="float32")
    with pytest.raises(ValueError, match="unknown dtype"):
        ModelRunner(tiny_models["llama-tied"], dtype="float8")


def test_sharded_checkpoint(tmp_path: pathlib.Path) -> None:
    from sluiceway.worker.loader import load_model

    whole = make_tiny_model(tmp_path / "whole", "llama-untied", seed=3)
    sharded = make_tiny_model(tmp_path / "sharded", "llama-untied", seed=3, max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 2
    a = load_model(whole).state_dict()
    b = load_model(sharded).state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("change", ["drop", "extra", "shape"])
def test_checkpoint_mismatch(
    tmp_path: pathlib.Path, tiny_models: dict[str, pathlib.Path], change: str
) -> None:
    import shutil

    from safetensors.torch import load_file, save_file

    src = tiny_models["llama-untied"]
    shutil.copy(src / "config.json", tmp_path / "config.json")
    tensors = load_file(src / "model.safetensors")
    if change == "drop":
        del tensors["model.layers.1.self_attn.k_proj.weight"]
        match = "missing"
    elif change == "extra":
        tensors["model.layers.0.mlp.experts.weight"] = torch.zeros(2)
        match = "does not use"
    else:
        tensors["model.norm.weight"] = torch.zeros(3)
        match = "shape"
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ModelLoadError, match=match):
        ModelRunner(tmp_path, dtype="float32", kv_cache_memory=1 << 20)


def test_a_runner_around_a_prebuilt_model_computes_what_the_loaded_one_does(
    tiny_models: dict[str, pathlib.Path],
) -> None:
    from sluiceway.worker.loader import load_model, random_model

    model_dir = tiny_models["llama-untied"]
    loaded = ModelRunner(model_dir, dtype="float32", block_size=BLOCK, kv_cache_memory=1 << 20)
    model = random_model(loaded.config, max_positions=loaded.max_model_len, seed=3)
    again = random_model(loaded.config, max_positions=loaded.max_model_len, seed=3)
    assert all(
        torch.equal(a, b)
        for a, b in zip(model.state_dict().values(), again.state_dict().values(), strict=True)
    )  # seeded
    # the runner's own model holds its linear weights packed for oneDNN: read the files again
    weights = load_model(
        model_dir, dtype=torch.float32, device=torch.device("cpu"),
        max_positions=loaded.max_model_len,
    ).state_dict()  # fmt: skip
    with torch.inference_mode():  # random_model's weights are inference tensors
        model.load_state_dict(weights)
    prebuilt = ModelRunner(
        model_dir, dtype="float32", block_size=BLOCK, kv_cache_memory=1 << 20, model=model
    )
    outputs = []
    for runner in (loaded, prebuilt):
        seq = runner.make_sequence(1, [5, 9, 11, 200, 3], SamplingParams(temperature=0.0))
        _Blocks(runner.num_kv_blocks).grow(seq, 16)
        outputs.append(step_logits(runner, [ScheduledChunk(seq, 0, 5)])[0])
    assert torch.equal(outputs[0], outputs[1])
    with pytest.raises(ValueError, match="does not fit the runner"):
        ModelRunner(model_dir, dtype="bfloat16", kv_cache_memory=1 << 20, model=model)


def test_an_int8_kv_cache_sizes_its_pool_and_serves_on_every_backend(
    tiny_models: dict[str, pathlib.Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``kv_cache_dtype='int8'``: 2 layers * K/V * 2 KV heads * 16 tokens * (16 values + 4
    scale bytes) = 2,560 bytes a block (float32's 8,192: 3.2x the blocks at head dim 16); the
    torch reference and the C++ kernels give the same greedy tokens over a prefill and 6
    decodes, logits within 1e-4 of each other (float32; the C++ exp is 2 ulp), within 0.2 of
    the float32 pool's (measured 0.12, logits' std 1.7) with its greedy tokens; the Triton
    backend's non-batch-invariant kernels are refused."""
    model_dir = tiny_models["llama-tied"]
    memory = 10_000_000
    runs = {}
    for backend, kv in (("torch", "int8"), ("cpu", "int8"), ("cpu", "auto")):
        runner = ModelRunner(model_dir, dtype="float32", block_size=16, kv_cache_memory=memory,
                             attention_backend=backend, kv_cache_dtype=kv)  # fmt: skip
        if kv == "int8":
            assert runner.bytes_per_block == 2_560 and runner.num_kv_blocks == memory // 2_560
            assert runner.kv_pool.dtype == torch.int8
            assert runner.kv_pool.shape == (2, 2, memory // 2_560, 2, 16 * 20)
        seq = runner.make_sequence(1, [5, 9, 11, 200, 3, 17, 42], SamplingParams(temperature=0.0))
        seq.block_table.extend([3, 1])
        logits = step_logits(runner, [ScheduledChunk(seq, 0, 7)])[0]
        tokens = []
        for _ in range(6):
            tokens.append(
                runner.execute(
                    [ScheduledChunk(seq, len(seq.token_ids) - 1, 1)]
                    if tokens
                    else [ScheduledChunk(seq, 0, 7)]
                )[0].token_id
            )
            seq.token_ids.append(tokens[-1])  # fmt: skip
        runs[(backend, kv)] = (logits, tokens)
    assert runs[("torch", "int8")][1] == runs[("cpu", "int8")][1]
    torch.testing.assert_close(runs[("torch", "int8")][0], runs[("cpu", "int8")][0],
                               atol=1e-4, rtol=1e-4)  # fmt: skip
    int8, full = runs[("cpu", "int8")][0], runs[("cpu", "auto")][0]
    assert (int8 - full).abs().max().item() < 0.2  # measured 0.12; the logits' std is 1.7
    assert runs[("cpu", "int8")][1] == runs[("cpu", "auto")][1]
    monkeypatch.setenv("SLUICEWAY_BATCH_INVARIANT", "0")
    with pytest.raises(ValueError, match="--kv-cache-dtype int8 with --attention-backend triton"):
        ModelRunner(model_dir, dtype="float32", kv_cache_memory=memory,
                    attention_backend="triton", kv_cache_dtype="int8")  # fmt: skip
    with pytest.raises(ValueError, match="--kv-cache-dtype fp8_e4m3 is not implemented in the"):
        ModelRunner(model_dir, dtype="float32", kv_cache_memory=memory,
                    attention_backend="triton", kv_cache_dtype="fp8_e4m3")  # fmt: skip
    with pytest.raises(ValueError, match="--kv-cache-dtype"):
        ModelRunner(model_dir, dtype="float32", kv_cache_memory=memory, kv_cache_dtype="fp4")
