"""Async scheduling (`--async-scheduling`): step N+1 built and sent while step N runs, the
worker putting in the token N sampled. The tokens, logprobs and finish reasons are those of
the synchronous loop, bitwise, with the real model: greedy and seeded, EOS and max_tokens
finishes, preemption, chunked prefill, parallel samples, penalties, structured outputs and a
resumed stream; every block comes back."""

from __future__ import annotations

import json
from typing import Any

import pytest
from transformers import AutoTokenizer

from sluiceway.kernels import cpu_ops
from sluiceway.model_files import resolve_model
from sluiceway.sampling_params import SamplingParams
from sluiceway.sharegpt import sample_requests
from sluiceway.v1 import inference_pb2
from sluiceway.worker.model_runner import ModelRunner
from tests.worker.spec_driver import Generation, generate

pytestmark = [
    pytest.mark.skipif(
        not cpu_ops.bf16_gemm_supported(),
        reason="the comparison with other batches needs the batch-invariant forward",
    ),
    pytest.mark.slow,
]

GREEDY = SamplingParams(temperature=0.0, max_tokens=32)
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=1234, max_tokens=32, logprobs=2)


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    return ModelRunner(resolve_model(None), dtype="bfloat16", kv_cache_memory=256 << 20)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(resolve_model(None))


@pytest.fixture(scope="module")
def prompts(tokenizer: Any) -> list[list[int]]:
    """16 ShareGPT first turns of at most 160 tokens (several end at EOS within 32 tokens)."""
    requests = sample_requests(tokenizer, 16, seed=5, max_prompt_len=160)
    return [tokenizer(r.prompt).input_ids for r in requests]


def both(runner: ModelRunner, prompts: list[list[int]], params: list[SamplingParams],
         **config: Any) -> tuple[Generation, Generation]:  # fmt: skip
    """The same requests through the synchronous loop and through async scheduling."""
    return (
        generate(runner, prompts, params, **config),
        generate(runner, prompts, params, async_scheduling=True, **config),
    )


def assert_same(sync: Generation, overlapped: Generation) -> None:
    assert overlapped.tokens == sync.tokens
    assert overlapped.logprobs == sync.logprobs
    assert overlapped.finish == sync.finish


def test_greedy_and_seeded_tokens_equal_the_synchronous_loop(
    runner: ModelRunner, prompts: list[list[int]]
) -> None:
    params = [GREEDY, SEEDED] * (len(prompts) // 2)
    sync, overlapped = both(runner, prompts, params)
    assert_same(sync, overlapped)
    stop = inference_pb2.FINISH_REASON_STOP
    num_stopped = sum(f == stop for f in sync.finish)
    assert num_stopped > 0  # EOS before max_tokens: the case with a token computed for nothing
    assert sync.num_sampled == sum(map(len, sync.tokens))
    # each sequence that stopped was in the step built before its stop was known, at most once
    wasted = overlapped.num_sampled - sum(map(len, overlapped.tokens))
    assert 0 < wasted <= num_stopped


def test_under_preemption_and_chunked_prefill_the_tokens_are_the_same(
    runner: ModelRunner, prompts: list[list[int]]
) -> None:
    """20 blocks for 6 sequences of ~80-190 tokens, a 48-token budget: prompts prefilled in
    chunks beside decodes, sequences preempted while a step that decodes them is in flight."""
    target = prompts[:6]
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), SEEDED] * 3
    sync, overlapped = both(runner, target, params, num_blocks=20,
                            max_num_batched_tokens=48, max_num_seqs=8)  # fmt: skip
    assert overlapped.scheduler.num_preemptions > 0
    assert_same(sync, overlapped)


def test_penalties_min_tokens_exact_max_tokens_and_parallel_samples(
    runner: ModelRunner, prompts: list[list[int]]
) -> None:
    cases = [
        SamplingParams(temperature=0.0, max_tokens=1),
        SamplingParams(temperature=0.0, max_tokens=7, logprobs=3),
        SamplingParams(temperature=0.0, max_tokens=20, repetition_penalty=1.3, min_tokens=15),
        SamplingParams(
            temperature=0.7, seed=5, max_tokens=20, frequency_penalty=0.5, presence_penalty=0.3
        ),
    ]
    for params in cases:
        sync, overlapped = both(runner, prompts[:3], [params] * 3)
        assert_same(sync, overlapped)
        assert [len(t) for t in overlapped.tokens] == [len(t) for t in sync.tokens]
    samples = [SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=20)] * 2
    sync, overlapped = both(runner, prompts[:2], samples, samples=3)
    assert_same(sync, overlapped)
    assert overlapped.scheduler.block_manager.prefix_cache_hits > 0


def test_structured_outputs_and_a_resumed_stream(
    runner: ModelRunner, prompts: list[list[int]], tokenizer: Any
) -> None:
    """The worker's grammar state advances over the token it puts in itself; a resumed
    stream (its output so far as the engine takes it) continues as it would have."""
    people = {"type": "array", "minItems": 2, "maxItems": 2, "items": {
        "type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}}  # fmt: skip
    constraint = inference_pb2.StructuredOutputs(json=json.dumps(people))
    ask = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Two people, as JSON."}],
        add_generation_prompt=True,
        tokenize=False,
    )
    params = [SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=constraint),
              SamplingParams(temperature=0.8, seed=3, max_tokens=60,
                             structured_outputs=constraint)]  # fmt: skip
    sync, overlapped = both(runner, [tokenizer(ask).input_ids] * 2, params)
    assert_same(sync, overlapped)
    assert all(json.loads(tokenizer.decode(t, skip_special_tokens=True)) for t in sync.tokens)

    plain = generate(runner, prompts[:2], [GREEDY, SEEDED])
    sent = [tokens[:5] for tokens in plain.tokens]
    resumed = generate(runner, prompts[:2], [GREEDY, SEEDED], async_scheduling=True,
                       resumed=sent)  # fmt: skip
    assert resumed.tokens == plain.tokens
