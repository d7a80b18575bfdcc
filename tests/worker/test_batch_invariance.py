"""Batch invariance of the forward in bfloat16, the default dtype, on the default CPU path (the
C++ kernels, the bfloat16 GEMM or, with --quantization gguf, the quantized one, the bfloat16 ->
float32 logits GEMM), with SmolLM2's real weights: a prompt's logits at every position are
bitwise the same computed alone, beside decodes and other prefills in one step, in other chunkings, and over a prefix whose K/V another
sequence computed (a prefix-cache hit). No tolerance: equal bits. Each test runs with the KV
pool in bfloat16, in int8 and in fp8 (``--kv-cache-dtype int8|fp8_e4m3``), in float32 on
the quantized weights (``--quantization gguf --dtype float32``) and with int8 activations
(``--quantization gguf_a8``)."""

from __future__ import annotations

import random

import pytest
import torch

from sluiceway.kernels import cpu_ops
from sluiceway.model_files import resolve_model
from sluiceway.sampling_params import SamplingParams
from sluiceway.worker.model_runner import ModelRunner, ScheduledChunk, SequenceData
from tests.worker.runner_logits import step_logits

pytestmark = pytest.mark.skipif(
    not cpu_ops.bf16_gemm_supported(),
    reason="batch invariance needs the C++ kernels on a CPU with AVX512-BF16",
)

BLOCK = 16
GREEDY = SamplingParams(temperature=0.0)


class Blocks:
    """Shuffled block ids, so no block table is contiguous."""

    def __init__(self, n: int) -> None:
        self.free = list(range(n))
        random.Random(0).shuffle(self.free)

    def grow(self, seq: SequenceData, tokens: int) -> None:
        while len(seq.block_table) * BLOCK < tokens:
            seq.block_table.append(self.free.pop())


@pytest.fixture(
    scope="module",
    params=[
        ("gguf", "auto", "bfloat16"),
        ("none", "auto", "bfloat16"),
        ("gguf", "int8", "bfloat16"),
        ("gguf", "fp8_e4m3", "bfloat16"),
        ("gguf", "auto", "float32"),
        pytest.param(
            ("gguf_a8", "auto", "bfloat16"),
            marks=pytest.mark.skipif(
                not cpu_ops.quant_gemm_a8_supported(), reason="gguf_a8 needs AVX512-VNNI"
            ),
        ),
    ],
    ids=lambda p: "-".join(p),
)
def runner(request: pytest.FixtureRequest) -> ModelRunner:
    """The bfloat16 runner: the embedded GGUF's weights in their Q4_1/Q8_0 blocks
    (--quantization gguf, the default) or dequantized (none); its KV pool in bfloat16 (auto),
    int8 or fp8 (``--kv-cache-dtype``: a token's quantized K/V depend on its own values only,
    so the same invariance holds). And the float32 runner on the blocks (its GEMM sums in a
    fixed order too; oneDNN's float32 ``none`` does not)."""
    quantization, kv_cache_dtype, dtype = request.param
    r = ModelRunner(
        resolve_model(None),
        dtype=dtype,
        quantization=quantization,
        block_size=BLOCK,
        kv_cache_memory=96 << 20,
        kv_cache_dtype=kv_cache_dtype,
    )
    assert r.attention_backend.name == "cpu" and r.quantization == quantization
    assert r.batch_invariant
    kv = {"auto": getattr(torch, dtype), "int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}
    assert r.kv_pool.dtype == kv[kv_cache_dtype]
    return r


def _ids(seed: int, n: int) -> list[int]:
    return torch.randint(100, 40_000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _prefill(runner: ModelRunner, blocks: Blocks, seq_id: int, ids: list[int]) -> SequenceData:
    """A sequence whose prompt's K/V are in the pool (one chunk of its own)."""
    seq = runner.make_sequence(seq_id, ids, GREEDY)
    blocks.grow(seq, len(ids))
    step_logits(runner, [ScheduledChunk(seq, 0, len(ids))])
    return seq


def test_logits_are_bitwise_the_same_alone_batched_chunked_and_cached(
    runner: ModelRunner,
) -> None:
    blocks = Blocks(runner.num_kv_blocks)
    prompt = _ids(1, 45)

    alone_seq = runner.make_sequence(0, prompt, GREEDY)
    blocks.grow(alone_seq, len(prompt))
    alone = step_logits(runner, [ScheduledChunk(alone_seq, 0, len(prompt))])[0]

    # 1. beside 4 decodes (contexts 20..300) and 2 prefills (one of 600 rows) in one step
    decodes = [_prefill(runner, blocks, 10 + i, _ids(10 + i, n)) for i, n in
               enumerate((20, 77, 160, 300))]  # fmt: skip
    for d in decodes:
        d.token_ids.append(_ids(99, 1)[0])
        blocks.grow(d, len(d.token_ids))
    others = [runner.make_sequence(20 + i, _ids(20 + i, n), GREEDY) for i, n in
              enumerate((9, 600))]  # fmt: skip
    for o in others:
        blocks.grow(o, len(o.token_ids))
    seq = runner.make_sequence(1, prompt, GREEDY)
    blocks.grow(seq, len(prompt))
    step = [ScheduledChunk(d, len(d.token_ids) - 1, 1) for d in decodes]
    step += [ScheduledChunk(others[0], 0, 9), ScheduledChunk(seq, 0, 45)]
    step += [ScheduledChunk(others[1], 0, 600)]
    batched = step_logits(runner, step)[5]
    assert torch.equal(batched, alone)

    # 1b. its first decode: alone, then beside the 4 decodes and a 600-row prefill
    next_token = int(alone[-1].argmax())
    decoded = {}
    for s, company in ((alone_seq, []), (seq, [others[1]])):
        s.token_ids.append(next_token)
        blocks.grow(s, len(s.token_ids))
        rows = [ScheduledChunk(s, 45, 1)]
        if company:
            for d in decodes:
                d.token_ids.append(_ids(98, 1)[0])
                blocks.grow(d, len(d.token_ids))
            rows += [ScheduledChunk(d, len(d.token_ids) - 1, 1) for d in decodes]
            rows += [ScheduledChunk(others[1], 0, 600)]
        decoded[len(company)] = step_logits(runner, rows)[0]
    assert torch.equal(decoded[0], decoded[1])

    # 2. chunked 16 + 13 + 16 over three steps, each beside other rows
    seq = runner.make_sequence(2, prompt, GREEDY)
    blocks.grow(seq, len(prompt))
    parts = []
    for start, n in ((0, 16), (16, 13), (29, 16)):
        extra = runner.make_sequence(30 + start, _ids(30 + start, 7 + start), GREEDY)
        blocks.grow(extra, len(extra.token_ids))
        out = step_logits(
            runner, [ScheduledChunk(extra, 0, len(extra.token_ids)), ScheduledChunk(seq, start, n)]
        )
        parts.append(out[1])
    assert torch.equal(torch.cat(parts), alone)

    # 3. a prefix-cache hit: another sequence computed the first 32 tokens (2 full blocks);
    #    this one reuses those blocks and computes the other 13
    other = runner.make_sequence(3, prompt[:32] + _ids(3, 20), GREEDY)
    blocks.grow(other, len(other.token_ids))
    step_logits(runner, [ScheduledChunk(other, 0, len(other.token_ids))])
    cached = runner.make_sequence(4, prompt, GREEDY)
    cached.block_table.extend(other.block_table[:2])
    blocks.grow(cached, len(prompt))
    tail = step_logits(runner, [ScheduledChunk(cached, 32, 13)])[0]
    assert torch.equal(tail, alone[32:])


def test_sampled_tokens_do_not_depend_on_the_batch(runner: ModelRunner) -> None:
    """The step path (logits buffer, C++ greedy sampling, seeded generators): greedy and
    seeded sequences get the same tokens and logprobs alone and in one batch with others."""
    blocks = Blocks(runner.num_kv_blocks)
    options = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, seed=7, top_p=0.95),
        SamplingParams(temperature=0.8, seed=1234, top_k=50),
    ]
    prompts = [_ids(50 + i, n) for i, n in enumerate((12, 40, 90))]

    def run(batch_with_noise: bool) -> list[list[tuple[int, float]]]:
        seqs = [runner.make_sequence(60 + i, p, o) for i, (p, o) in
                enumerate(zip(prompts, options, strict=True))]  # fmt: skip
        noise = [runner.make_sequence(70 + i, _ids(70 + i, 5 + 30 * i), SamplingParams(
            temperature=0.9)) for i in range(5)] if batch_with_noise else []  # fmt: skip
        got: list[list[tuple[int, float]]] = [[] for _ in seqs]
        computed = {id(s): 0 for s in seqs + noise}
        for _ in range(6):
            if batch_with_noise:
                chunks = [ScheduledChunk(s, computed[id(s)], len(s.token_ids) - computed[id(s)])
                          for s in seqs + noise]  # fmt: skip
                steps = [chunks]
            else:  # each sequence in a step of its own
                steps = [[ScheduledChunk(s, computed[id(s)], len(s.token_ids) - computed[id(s)])]
                         for s in seqs]  # fmt: skip
            for chunks in steps:
                for c in chunks:
                    blocks.grow(c.seq, len(c.seq.token_ids))
                for c, token in zip(chunks, runner.execute(chunks), strict=True):
                    computed[id(c.seq)] = len(c.seq.token_ids)
                    c.seq.token_ids.append(token.token_id)
                    if c.seq in seqs:
                        got[seqs.index(c.seq)].append((token.token_id, token.logprob))
        for s in seqs + noise:
            blocks.free.extend(s.block_table)
        return got

    assert run(batch_with_noise=True) == run(batch_with_noise=False)


def test_a_rows_sample_and_logprob_do_not_depend_on_the_other_rows() -> None:
    """The sampler on its own: a seeded top-p row whose nucleus is wider than the candidate
    count draws the same tokens beside a row with top_k 1000 (the batch's candidate count
    used to decide its path), and a greedy row's chosen logprob is bitwise the same beside a
    row that asks for top logprobs (one formula for every row)."""
    from sluiceway.worker.sampler import sample

    vocab = 49_152
    g = torch.Generator().manual_seed(0)
    peaked = torch.randn(1, vocab, generator=g) - 10
    peaked[0, torch.randperm(vocab, generator=g)[:300]] += 10 + torch.rand(300, generator=g)
    other = torch.randn(1, vocab, generator=g) * 3
    probe = SamplingParams(temperature=1.0, top_p=0.95, seed=7)

    def draws(logits: torch.Tensor, options: list[SamplingParams]) -> list[tuple[int, float]]:
        gens: list[torch.Generator | None] = [None] * len(options)
        gens[0] = torch.Generator().manual_seed(7)
        out = []
        for _ in range(20):
            r = sample(logits.clone(), options, gens, [[1]] * len(options), cpu_kernels=True)
            out.append((int(r.token_ids[0]), float(r.logprobs[0])))
        return out

    alone = draws(peaked, [probe])
    assert draws(torch.cat([peaked, other]), [probe, SamplingParams(top_k=1000)]) == alone
    greedy = SamplingParams(temperature=0.0)
    asks = SamplingParams(temperature=0.0, logprobs=5)
    for options in ([greedy], [greedy, asks], [greedy, SamplingParams(temperature=0.9)]):
        rows = torch.cat([other, peaked][: len(options)])
        got = sample(rows.clone(), options, [None] * len(options), [[1]] * len(options),
                     cpu_kernels=True)  # fmt: skip
        first = sample(other.clone(), [greedy], [None], [[1]], cpu_kernels=True)
        assert torch.equal(got.token_ids[:1], first.token_ids)
        assert torch.equal(got.logprobs[:1], first.logprobs), options
