"""The sampler at Gemma 3's 262,144-token vocabulary: every row's token, logprob and top
logprobs bitwise equal to a straightforward per-row reference (fresh tensors, the row alone:
so also independent of the batch), the kept buffers reused across steps of other sizes, the
in-place kernels equal to torch's, and top-k/top-p kept sets equal to transformers'."""

from __future__ import annotations

import pathlib

import pytest
import torch
from transformers.generation.logits_process import (
    RepetitionPenaltyLogitsProcessor,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from sluiceway.kernels import cpu_ops
from sluiceway.sampling_params import FLOAT32_MAX, SamplingParams
from sluiceway.worker import sampler
from sluiceway.worker.loader import random_model
from sluiceway.worker.model import ModelConfig
from sluiceway.worker.model_runner import ModelRunner, ScheduledChunk
from sluiceway.worker.sampler import (
    SamplerBuffers,
    min_p_mask,
    sample,
    top_k_top_p_mask,
    truncated_candidates,
)
from sluiceway.worker.structured_output import allow_all_bitmask, apply_token_bitmask

V = 262_144

OPTIONS = [
    SamplingParams(temperature=0),
    SamplingParams(temperature=0, logprobs=5),
    SamplingParams(temperature=1.0, seed=1),
    SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=2),
    SamplingParams(temperature=1.0, top_p=0.9, seed=3),  # wider than the candidates: a full sort
    SamplingParams(temperature=0.6, top_p=0.9, seed=4, logprobs=2),  # peaky row: candidates
    SamplingParams(temperature=1.3, min_p=0.01, seed=5),
    SamplingParams(temperature=0, repetition_penalty=1.5, presence_penalty=0.5, logprobs=3),
    SamplingParams(temperature=0.9, frequency_penalty=0.7, logit_bias={5: 20.0}, seed=6),
    SamplingParams(temperature=1.0, top_k=7, seed=7),
]


def _logits(rows: int, seed: int) -> torch.Tensor:
    x = torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 4
    x[5::10] *= 3  # peaky rows: their top-p nucleus lies within the candidates
    return x


def _seen(rows: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [[*torch.randint(0, V, (40,), generator=g).tolist(), 9, 9, 9] for _ in range(rows)]


def _processed(
    row: torch.Tensor, o: SamplingParams, seen: list[int], prompt_len: int
) -> torch.Tensor:
    """``[1, V]``: the row after its bias and penalties (transformers' repetition penalty, a
    dense count table for the others)."""
    x = row.clone()[None]
    for t, b in o.logit_bias.items():
        x[0, t] += b
    if o.repetition_penalty != 1.0:
        x = RepetitionPenaltyLogitsProcessor(o.repetition_penalty)(torch.tensor([seen]), x)
    counts = torch.bincount(torch.tensor(seen[prompt_len:]), minlength=V).float()[None]
    x -= o.frequency_penalty * counts + o.presence_penalty * (counts > 0).float()
    return x


def _reference_row(
    row: torch.Tensor, o: SamplingParams, seen: list[int], prompt_len: int
) -> tuple[int, float, list[int], list[float]]:
    """One row alone with fresh tensors: (token, logprob, top ids, top logprobs)."""
    x = _processed(row, o, seen, prompt_len)
    log_probs = torch.log_softmax(x, -1)
    if o.temperature == 0:
        token = int(x.argmax())
    else:
        u = torch.rand(1, generator=torch.Generator().manual_seed(o.seed))
        scaled = (x / o.temperature).clamp(max=FLOAT32_MAX)
        if o.min_p:
            scaled = min_p_mask(scaled, torch.tensor([o.min_p]))
        top_k, top_p = torch.tensor([o.top_k]), torch.tensor([o.top_p])
        ids = torch.arange(V)[None]
        if o.top_k or o.top_p < 1:
            ids, probs, exact = truncated_candidates(scaled, top_k, top_p)
            if not exact[0]:
                ids = torch.arange(V)[None]
                probs = torch.softmax(top_k_top_p_mask(scaled, top_k, top_p), -1)
        else:
            probs = torch.softmax(scaled, -1)
        cdf = probs.cumsum(-1)
        total = cdf[:, -1]
        at = torch.minimum(u * total, torch.nextafter(total, torch.zeros(1)))
        token = int(ids[0, torch.searchsorted(cdf, at[:, None], right=True)[0, 0]])
    lp, top = torch.topk(log_probs[0], o.logprobs or 0)
    return token, float(log_probs[0, token]), top.tolist(), lp.tolist()


def _check_batch(rows: int, seed: int, buffers: SamplerBuffers) -> None:
    logits = _logits(rows, seed)
    options = [OPTIONS[(seed + i) % len(OPTIONS)] for i in range(rows)]
    seen = _seen(rows, seed)
    prompt_lens = [30] * rows
    gens = [torch.Generator().manual_seed(o.seed) if o.seed else None for o in options]
    got = sample(logits.clone(), options, gens, seen, prompt_lens, buffers=buffers)
    top_n = max(o.logprobs or 0 for o in options)
    for i, o in enumerate(options):
        token, lp, top_ids, top_lps = _reference_row(logits[i], o, seen[i], prompt_lens[i])
        assert int(got.token_ids[i]) == token, (i, o)
        assert float(got.logprobs[i]) == lp, (i, o)  # bitwise: same float32
        if o.logprobs:
            assert got.top_ids is not None and got.top_logprobs is not None
            assert got.top_ids[i, : o.logprobs].tolist() == top_ids
            assert got.top_logprobs[i, : o.logprobs].tolist() == top_lps
        elif top_n == 0:
            assert got.top_ids is None


def test_each_row_equals_its_reference_alone_across_batch_sizes() -> None:
    buffers = SamplerBuffers()
    # one buffer set for all: a step of 3 rows after one of 13 reads stale memory past it
    for rows, seed in ((13, 0), (3, 1), (10, 2), (1, 4)):
        _check_batch(rows, seed, buffers)


def test_cpu_kernels_give_the_same_tokens_and_top_logprobs() -> None:
    if not cpu_ops.available():
        pytest.skip("C++ kernels not built here")
    logits = _logits(10, 3)
    seen = _seen(10, 3)
    gens_a = [torch.Generator().manual_seed(o.seed) if o.seed else None for o in OPTIONS]
    gens_b = [torch.Generator().manual_seed(o.seed) if o.seed else None for o in OPTIONS]
    plain = sample(logits.clone(), OPTIONS, gens_a, seen, [30] * 10)
    fused = sample(logits.clone(), OPTIONS, gens_b, seen, [30] * 10, cpu_kernels=True)
    assert fused.token_ids.tolist() == plain.token_ids.tolist()
    assert fused.top_ids is not None and plain.top_ids is not None
    assert fused.top_ids.tolist() == plain.top_ids.tolist()
    assert fused.top_logprobs is not None and plain.top_logprobs is not None
    torch.testing.assert_close(fused.top_logprobs, plain.top_logprobs)  # log_softmax's
    # the chosen and the top logprobs: the kernel's (logit - max) - log(sum(exp(row - max))),
    # row alone; a chosen token among the top shows the same value there
    for i, o in enumerate(OPTIONS):
        x = _processed(logits[i], o, seen[i], 30)
        _, row_max, shifted = cpu_ops.argmax_log_normalizer(x)
        t = int(fused.token_ids[i])
        assert float(fused.logprobs[i]) == float((x[0, t] - row_max[0]) - shifted[0])
        top = fused.top_ids[i].tolist()
        assert fused.top_logprobs[i].tolist() == ((x[0, top] - row_max[0]) - shifted[0]).tolist()
        if t in top:
            assert float(fused.top_logprobs[i, top.index(t)]) == float(fused.logprobs[i])


def test_in_place_kernels_equal_torch_bitwise() -> None:
    x = _logits(4, 9)
    x[1, ::3] = float("-inf")  # a masked row (a grammar's)
    x[2, 7] = float("inf")
    x[3] = float("-inf")
    finite = x[:2]
    assert torch.equal(sampler._softmax_(finite.clone()), torch.softmax(finite, -1))
    assert torch.equal(sampler.log_softmax_(finite.clone()), torch.log_softmax(finite, -1))
    got, want = sampler.log_softmax_(x.clone()), torch.log_softmax(x, -1)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)  # NaN: the inf rows
    probs = torch.softmax(finite, -1)
    assert torch.equal(probs.clone().cumsum_(-1), probs.cumsum(-1))


def test_top_k_top_p_kept_sets_equal_transformers() -> None:
    logits = _logits(20, 5) / 0.7
    top_k = torch.tensor([50, 0, 20, 0] * 5)
    top_p = torch.tensor([0.9, 0.9, 0.5, 0.95] * 5)
    ids, probs, exact = truncated_candidates(logits, top_k, top_p)
    for r in range(20):
        warped = logits[r : r + 1].clone()
        if top_k[r] > 0:
            warped = TopKLogitsWarper(int(top_k[r]))(None, warped)
        warped = TopPLogitsWarper(float(top_p[r]))(None, warped)
        kept = set(torch.isfinite(warped[0]).nonzero().squeeze(1).tolist())
        mine = top_k_top_p_mask(logits[r : r + 1], top_k[r : r + 1], top_p[r : r + 1])
        assert set(torch.isfinite(mine[0]).nonzero().squeeze(1).tolist()) == kept
        if exact[r]:
            assert set(ids[r][probs[r] > 0].tolist()) == kept
        else:  # a nucleus wider than the candidates (flat rows)
            assert len(kept) > ids.shape[1] or float(probs[r].sum()) < float(top_p[r])
    assert bool(exact[5::10].all()) and not bool(exact.all())  # both paths taken


def test_bitmask_rows_are_applied_exactly() -> None:
    logits = _logits(5, 6)
    bitmask = allow_all_bitmask(5, V)
    g = torch.Generator().manual_seed(6)
    words = torch.randint(-(2**31), 2**31 - 1, (5, V // 32), generator=g, dtype=torch.int32)
    bitmask.copy_(words)
    out = logits.clone()
    apply_token_bitmask(out, bitmask, [0, 2, 3])
    bits = (words[:, :, None] >> torch.arange(32, dtype=torch.int32)) & 1  # [5, V/32, 32]
    allowed = bits.reshape(5, V).bool()
    for r in range(5):
        if r in (0, 2, 3):
            assert torch.equal(out[r][allowed[r]], logits[r][allowed[r]])
            assert bool(torch.isneginf(out[r][~allowed[r]]).all())
        else:  # not constrained: untouched whatever its bitmask row holds
            assert torch.equal(out[r], logits[r])
    # greedy over the masked logits: the argmax among the allowed tokens
    best = torch.where(allowed, logits, float("-inf")).argmax(-1)
    got = sample(out, [SamplingParams(temperature=0)] * 5, [None] * 5, [[]] * 5)
    assert got.token_ids[[0, 2, 3]].tolist() == best[[0, 2, 3]].tolist()


class _FixedMask:
    """A stand-in for a grammar's matcher: allows a fixed random half of the vocabulary (one
    of two masks, alternating with each token accepted)."""

    def __init__(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.words = torch.randint(
            -(2**31), 2**31 - 1, (2, V // 32), generator=g, dtype=torch.int32
        )
        self.step = 0

    def accept(self, token_ids: list[int]) -> None:
        self.step += len(token_ids)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = self.words[self.step % 2]

    def fill_along(self, bitmask: torch.Tensor, row: int, drafts: list[int]) -> None:
        # ConstraintMatcher.fill_along's contract: row + i allows what follows drafts[:i]
        for i in range(len(drafts) + 1):
            bitmask[row + i] = self.words[(self.step + i) % 2]

    def allowed(self, token: int, step: int) -> bool:
        return bool((int(self.words[step % 2, token // 32]) >> (token % 32)) & 1)


@pytest.mark.skipif(
    not cpu_ops.bf16_gemm_supported(),
    reason="batch invariance needs the C++ kernels on a CPU with AVX512-BF16",
)
def test_the_step_path_at_262k_gives_each_sequence_what_it_gets_alone() -> None:
    """A tiny random Llama with Gemma 3's vocabulary through ``ModelRunner.execute`` (the
    kept logits buffer, sampler scratch and bitmask): six sequences with greedy, logprobs,
    prompt logprobs, top-k/top-p, a full-sort top-p, a penalty and a bitmask get bitwise the
    same tokens, logprobs and prompt logprobs in one batch as alone (or beside the
    constrained one): the kept scratch and bitmask rows left by other steps are not read."""
    config = ModelConfig.from_hf_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": V,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 256,
            "tie_word_embeddings": True,
            "bos_token_id": 1,
            "eos_token_id": 2,
        }
    )
    model = random_model(config, dtype=torch.bfloat16, max_positions=256, std=0.3)
    runner = ModelRunner(
        pathlib.Path("random-262k"), dtype="bfloat16", kv_cache_memory=1 << 20, model=model
    )
    assert runner.batch_invariant
    options = [
        SamplingParams(temperature=0, logprobs=5, prompt_logprobs=2),
        SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=2),
        SamplingParams(temperature=1.0, top_p=0.9, seed=3),
        SamplingParams(temperature=0, repetition_penalty=1.3),
        SamplingParams(temperature=0),  # constrained
        SamplingParams(temperature=0, logprobs=1),
    ]
    prompts = [
        list(range(1000 * i + 5, 1000 * i + 5 + n)) for i, n in enumerate((9, 3, 17, 5, 30, 2))
    ]

    def run(groups: list[list[int]]) -> dict[int, list[object]]:
        out: dict[int, list[object]] = {}
        next_block = 0
        for group in groups:
            seqs = []
            for i in group:
                s = runner.make_sequence(i, prompts[i], options[i])
                s.constraint = _FixedMask(4) if i == 4 else None  # type: ignore[assignment]
                s.block_table.extend(range(next_block, next_block + 3))
                next_block += 3
                seqs.append(s)
                out[i] = []
            done = {s.seq_id: 0 for s in seqs}
            for _ in range(4):
                chunks = [
                    ScheduledChunk(s, done[s.seq_id], len(s.token_ids) - done[s.seq_id])
                    for s in seqs
                ]
                tokens = runner.execute(chunks)
                for p in runner.last_prompt_logprobs:
                    out[p.seq_id].append((p.logprobs, p.ranks, p.top_ids, p.top_logprobs))
                for s, t in zip(seqs, tokens, strict=True):
                    if s.constraint is not None:
                        assert s.constraint.allowed(t.token_id, s.constraint.step)  # type: ignore[attr-defined]
                    done[s.seq_id] = len(s.token_ids)
                    s.append([t.token_id])
                    out[s.seq_id].append((t.token_id, t.logprob, t.top_ids, t.top_logprobs))
        return out

    batched = run([[0, 1, 2, 3, 4, 5]])
    # [0, 4]: row 0's bitmask row holds the mask seq 4 wrote alone, and must not be read
    alone = run([[4], [0, 4], [1], [2], [3], [5]])
    assert alone == batched
    assert len(batched[0]) == 5  # 4 tokens and one prompt logprobs share
