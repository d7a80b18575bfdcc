"""Prompt logprobs of the model runner (worker/prompt_logprobs.py) against transformers'
teacher-forced float32 log_softmax, with the prompt chunked and other sequences in the step."""

from __future__ import annotations

import pathlib
import random

import pytest
import torch

from sluiceway.sampling_params import SamplingParams
from sluiceway.worker import prompt_logprobs as plp
from sluiceway.worker.model_runner import ModelRunner, ScheduledChunk, SequenceData

BLOCK = 4


def _grow(seq: SequenceData, tokens: int, free: list[int]) -> None:
    while len(seq.block_table) * BLOCK < tokens:
        seq.block_table.append(free.pop())


@pytest.mark.parametrize("slice_rows", [64, 3])  # 3: several slices of logits per chunk
def test_prompt_logprobs_match_transformers_chunked_and_amid_traffic(
    tiny_models: dict[str, pathlib.Path], monkeypatch: pytest.MonkeyPatch, slice_rows: int
) -> None:
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(plp, "ROWS_PER_SLICE", slice_rows)
    model_dir = tiny_models["llama-untied"]
    runner = ModelRunner(model_dir, dtype="float32", block_size=BLOCK, kv_cache_memory=1 << 20)
    rng = random.Random(3)
    prompt = [rng.randrange(256) for _ in range(23)]
    other = [rng.randrange(256) for _ in range(9)]
    free = list(range(runner.num_kv_blocks))
    asking = runner.make_sequence(1, prompt, SamplingParams(temperature=0, prompt_logprobs=3))
    plain = runner.make_sequence(2, other, SamplingParams(temperature=0))
    got: list[plp.PromptLogprobs] = []

    def step(chunks: list[tuple[SequenceData, int, int]]) -> None:
        scheduled = []
        for seq, start, n in chunks:
            _grow(seq, start + n, free)
            scheduled.append(ScheduledChunk(seq, start, n))
        for token in runner.execute(scheduled):
            {1: asking, 2: plain}[token.seq_id].token_ids.append(token.token_id)
        got.extend(runner.last_prompt_logprobs)

    step([(plain, 0, 9), (asking, 0, 10)])  # the other prompt whole, the first chunk
    step([(plain, 9, 1), (asking, 10, 13)])  # a decode beside the rest of the prompt
    step([(plain, 10, 1), (asking, 23, 1)])  # decodes only: no prompt logprobs
    # positions 0..9 predict tokens 1..10; 10..21 predict 11..22 (22 predicts the output)
    spans = [(p.seq_id, p.first_token_index, len(p.token_ids)) for p in got]
    assert spans == [(1, 1, 10), (1, 11, 12)]

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), -1)[:-1]
    targets = torch.tensor(prompt[1:])
    ref_lp = ref.gather(1, targets[:, None])[:, 0]
    ref_rank = (ref > ref_lp[:, None]).sum(-1) + 1
    ref_top_lp, ref_top_ids = torch.topk(ref, 3, dim=-1)
    ids = [t for p in got for t in p.token_ids]
    assert ids == prompt[1:]
    lps = torch.tensor([v for p in got for v in p.logprobs])
    torch.testing.assert_close(lps, ref_lp, atol=1e-4, rtol=0)
    assert [r for p in got for r in p.ranks] == ref_rank.tolist()
    assert [i for p in got for i in p.top_ids] == ref_top_ids.tolist()
    tops = torch.tensor([v for p in got for v in p.top_logprobs])
    torch.testing.assert_close(tops, ref_top_lp, atol=1e-4, rtol=0)


def test_no_prompt_logprobs_unless_asked_and_none_for_a_one_token_prompt(
    tiny_models: dict[str, pathlib.Path],
) -> None:
    runner = ModelRunner(
        tiny_models["llama-tied"], dtype="float32", block_size=BLOCK, kv_cache_memory=1 << 20
    )
    free = list(range(runner.num_kv_blocks))
    plain = runner.make_sequence(1, [5, 6, 7, 8, 9], SamplingParams(temperature=0))
    one = runner.make_sequence(2, [5], SamplingParams(temperature=0, prompt_logprobs=0))
    zero_top = runner.make_sequence(3, [5, 6, 7], SamplingParams(temperature=0, prompt_logprobs=0))
    for seq in (plain, one, zero_top):
        _grow(seq, len(seq.token_ids), free)
    runner.execute([ScheduledChunk(s, 0, len(s.token_ids)) for s in (plain, one, zero_top)])
    [only] = runner.last_prompt_logprobs
    assert (only.seq_id, only.first_token_index, only.token_ids) == (3, 1, [6, 7])
    assert only.top_ids == [] and len(only.logprobs) == 2 and all(r >= 1 for r in only.ranks)
