"""Batch invariance of the whole forward on the Triton path in bfloat16: a tiny random Llama
through ModelRunner with the Triton backend (the unified attention, the Triton matmul for
every linear and the logits, the Triton RMSNorm). A prompt's logits at every position are
bitwise the same alone, beside decodes and other prefills, in other chunkings and over a
prefix-cache hit; seeded and greedy tokens the same alone and in a batch. Each test runs with
the KV pool in bfloat16 and in int8 (``--kv-cache-dtype int8``).

Without CUDA the kernels run in Triton's interpreter (what CI checks: the kernels' structure;
``scripts/gpu_check.sh`` runs this file on a GPU, where the tensor cores are checked too).
"""

from __future__ import annotations

import pathlib
import random

import pytest
import torch

pytest.importorskip("triton")

from sluiceway.sampling_params import SamplingParams
from sluiceway.worker.model_runner import ModelRunner, ScheduledChunk, SequenceData
from tests.worker.runner_logits import step_logits

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK = 16
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module", params=["auto", "int8"])
def runner(tiny_models: dict[str, pathlib.Path], request: pytest.FixtureRequest) -> ModelRunner:
    """The runner with its KV pool in bfloat16 (auto) or int8 (``--kv-cache-dtype int8``)."""
    r = ModelRunner(
        tiny_models["llama3-rope-bias"], device=DEVICE, dtype="bfloat16", block_size=BLOCK,
        kv_cache_memory=1 << 20, attention_backend="triton", kv_cache_dtype=request.param,
    )  # fmt: skip
    assert r.attention_backend.name == "triton" and r.attention_backend.batch_invariant
    assert (r.kv_pool.dtype == torch.int8) == (request.param == "int8")
    assert r.model.triton_ops is not None and r.batch_invariant
    return r


class Blocks:
    """Shuffled block ids, so no block table is contiguous."""

    def __init__(self, n: int) -> None:
        self.free = list(range(n))
        random.Random(0).shuffle(self.free)

    def grow(self, seq: SequenceData, tokens: int) -> None:
        while len(seq.block_table) * BLOCK < tokens:
            seq.block_table.append(self.free.pop())


def _ids(seed: int, n: int) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _new(runner: ModelRunner, blocks: Blocks, seq_id: int, ids: list[int]) -> SequenceData:
    seq = runner.make_sequence(seq_id, ids, GREEDY)
    blocks.grow(seq, len(ids))
    return seq


def test_logits_are_bitwise_the_same_alone_batched_chunked_and_cached(
    runner: ModelRunner,
) -> None:
    blocks = Blocks(runner.num_kv_blocks)
    prompt = _ids(1, 37)
    alone = step_logits(runner, [ScheduledChunk(_new(runner, blocks, 0, prompt), 0, 37)])
    alone_logits = alone[0]
    assert alone_logits.dtype == torch.float32

    # beside 2 decodes and 2 other prefills (one of 70 rows: two 64-row matmul tiles)
    decodes = []
    for i, n in enumerate((5, 40)):
        d = _new(runner, blocks, 10 + i, _ids(10 + i, n))
        step_logits(runner, [ScheduledChunk(d, 0, n)])
        d.token_ids.append(7)
        blocks.grow(d, n + 1)
        decodes.append(d)
    others = [_new(runner, blocks, 20 + i, _ids(20 + i, n)) for i, n in enumerate((3, 70))]
    seq = _new(runner, blocks, 1, prompt)
    step = [ScheduledChunk(d, len(d.token_ids) - 1, 1) for d in decodes]
    step += [ScheduledChunk(others[0], 0, 3), ScheduledChunk(seq, 0, 37)]
    step += [ScheduledChunk(others[1], 0, 70)]
    assert torch.equal(step_logits(runner, step)[3], alone_logits)

    # chunked 16 + 5 + 16 over three steps, each beside another prefill
    seq = _new(runner, blocks, 2, prompt)
    parts = []
    for start, n in ((0, 16), (16, 5), (21, 16)):
        extra = _new(runner, blocks, 30 + start, _ids(30 + start, 4 + start))
        out = step_logits(
            runner, [ScheduledChunk(extra, 0, len(extra.token_ids)), ScheduledChunk(seq, start, n)]
        )
        parts.append(out[1])
    assert torch.equal(torch.cat(parts), alone_logits)

    # a prefix-cache hit: another sequence computed the first 32 tokens (2 full blocks)
    other = _new(runner, blocks, 3, prompt[:32] + _ids(3, 9))
    step_logits(runner, [ScheduledChunk(other, 0, len(other.token_ids))])
    cached = runner.make_sequence(4, prompt, GREEDY)
    cached.block_table.extend(other.block_table[:2])
    blocks.grow(cached, len(prompt))
    tail = step_logits(runner, [ScheduledChunk(cached, 32, 5)])[0]
    assert torch.equal(tail, alone_logits[32:])

    # its next token as a decode, alone and beside a 70-row prefill
    nxt = int(alone_logits[-1].argmax())
    got = []
    for s, company in ((seq, []), (cached, [_new(runner, blocks, 40, _ids(40, 70))])):
        s.token_ids.append(nxt)
        blocks.grow(s, 38)
        rows = [ScheduledChunk(s, 37, 1)] + [ScheduledChunk(c, 0, 70) for c in company]
        got.append(step_logits(runner, rows)[0])
    assert torch.equal(got[0], got[1])


def test_sampled_tokens_do_not_depend_on_the_batch(runner: ModelRunner) -> None:
    """The step path (one forward for every row, seeded generators): greedy and seeded
    sequences get the same tokens and logprobs alone and in one batch with others."""
    blocks = Blocks(runner.num_kv_blocks)
    options = [GREEDY, SamplingParams(temperature=1.0, seed=7, top_p=0.9)]
    prompts = [_ids(50, 12), _ids(51, 30)]

    def run(noise: bool) -> list[list[tuple[int, float]]]:
        seqs = [runner.make_sequence(60 + i, p, o) for i, (p, o) in
                enumerate(zip(prompts, options, strict=True))]  # fmt: skip
        extra = [runner.make_sequence(70 + i, _ids(70 + i, 9 + 20 * i), SamplingParams(
            temperature=0.9)) for i in range(2)] if noise else []  # fmt: skip
        got: list[list[tuple[int, float]]] = [[] for _ in seqs]
        done = {id(s): 0 for s in seqs + extra}
        for _ in range(3):
            groups = [seqs + extra] if noise else [[s] for s in seqs]
            for group in groups:
                chunks = [ScheduledChunk(s, done[id(s)], len(s.token_ids) - done[id(s)])
                          for s in group]  # fmt: skip
                for c in chunks:
                    blocks.grow(c.seq, len(c.seq.token_ids))
                for c, token in zip(chunks, runner.execute(chunks), strict=True):
                    done[id(c.seq)] = len(c.seq.token_ids)
                    c.seq.token_ids.append(token.token_id)
                    if c.seq in seqs:
                        got[seqs.index(c.seq)].append((token.token_id, token.logprob))
        for s in seqs + extra:
            blocks.free.extend(s.block_table)
        return got

    alone = run(noise=False)
    assert run(noise=True) == alone
