"""Speculative decoding (n-gram) gives bitwise the tokens of plain decoding: SmolLM2's real
weights in bfloat16 (gguf, the default, and the dequantized weights) and in float32 (gguf: its
fixed-order float32 GEMM; float32 ``none`` is oneDNN's, not batch invariant), greedy and seeded,
alone and beside unrelated streams, with penalties, min_tokens, logprobs, an exact
max_tokens, under preemption and under structured outputs; and it saves forward steps on repetitive text."""

from __future__ import annotations

import json
from typing import Any

import pytest
from prometheus_client import REGISTRY
from transformers import AutoTokenizer

from sluiceway.kernels import cpu_ops
from sluiceway.model_files import resolve_model
from sluiceway.sampling_params import SamplingParams
from sluiceway.sharegpt import sample_requests
from sluiceway.v1 import inference_pb2
from sluiceway.worker.model_runner import ModelRunner
from tests.worker.spec_driver import generate

pytestmark = [
    pytest.mark.skipif(
        not cpu_ops.bf16_gemm_supported(),
        reason="speculative decoding needs the batch-invariant forward (AVX512-BF16)",
    ),
    pytest.mark.slow,
]

NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                    "prompt_lookup_min": 2})  # fmt: skip
PARAGRAPH = (
    "The river rises in the hills above the town, runs past the old mill and the stone "
    "bridge, and reaches the sea after a long bend through the marshes."
)
CODE = (
    "class Basket:\n    def __init__(self):\n        self.count = 0\n        self.items = []\n\n"
    "    def add(self, item):\n        self.items.append(item)\n        self.count += 1\n\n"
    "    def remove(self, item):\n        self.items.remove(item)\n        self.count -= 1\n\n"
    "    def size(self):\n        return self.count\n"
)
REPEAT = f"Repeat this paragraph 3 times.\n\n{PARAGRAPH}\n\n{PARAGRAPH}\n\n"  # plain text
EDIT = (  # a chat turn: the instruct model copies the code back
    "Rename the attribute `count` to `total` in this code and show the whole code:\n\n"
    f"```python\n{CODE}```"
)
GREEDY = SamplingParams(temperature=0.0, max_tokens=40)
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=1234, max_tokens=40)


BF16 = [("gguf", "bfloat16"), ("none", "bfloat16")]  # (--quantization, --dtype)
# The must-show equalities run in float32 too; the composed modes in bfloat16 only (CI time).
in_bf16 = pytest.mark.parametrize("runner", BF16, indirect=True, ids="-".join)
in_bf16_and_fp32 = pytest.mark.parametrize(
    "runner", [*BF16, ("gguf", "float32")], indirect=True, ids="-".join
)


@pytest.fixture(scope="module")
def runner(request: pytest.FixtureRequest) -> ModelRunner:
    quantization, dtype = request.param
    r = ModelRunner(
        resolve_model(None), dtype=dtype, quantization=quantization, kv_cache_memory=256 << 20
    )
    assert r.batch_invariant
    return r


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(resolve_model(None))


@pytest.fixture(scope="module")
def prompts(tokenizer: Any) -> list[list[int]]:
    """24 ShareGPT first turns (at most 200 tokens), then the two repetitive prompts."""
    sharegpt = sample_requests(tokenizer, 24, seed=3, max_prompt_len=200)
    edit = tokenizer.apply_chat_template(
        [{"role": "user", "content": EDIT}], add_generation_prompt=True, tokenize=False
    )
    return [tokenizer(t).input_ids for t in [r.prompt for r in sharegpt] + [REPEAT, edit]]


@in_bf16_and_fp32
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_tokens_equal_plain_decoding_for_sharegpt_and_repetitive_prompts(
    runner: ModelRunner, prompts: list[list[int]], params: SamplingParams
) -> None:
    every = [params] * len(prompts)
    plain = generate(runner, prompts, every)
    spec = generate(runner, prompts, every, speculative_config=NGRAM)
    assert spec.tokens == plain.tokens
    assert spec.finish == plain.finish
    counts = spec.scheduler.spec_decode
    assert counts.num_drafts > 0 and counts.num_accepted_tokens > 0


@in_bf16_and_fp32
def test_alone_and_beside_20_streams_the_tokens_are_the_same(
    runner: ModelRunner, prompts: list[list[int]]
) -> None:
    target = [prompts[-2], prompts[-1]]
    alone = generate(runner, target, [GREEDY, SEEDED], speculative_config=NGRAM)
    company = prompts[:20]
    crowd = generate(runner, target + company, [GREEDY, SEEDED] + [SEEDED] * 20,
                     speculative_config=NGRAM)  # fmt: skip
    plain = generate(runner, target, [GREEDY, SEEDED])
    assert alone.tokens == plain.tokens == crowd.tokens[:2]


@in_bf16
def test_repetitive_prompts_take_under_0_6_forward_steps_per_token(
    runner: ModelRunner, prompts: list[list[int]]
) -> None:
    def steps(phase: str) -> float:  # the worker's step counter (forward_seconds)
        labels = {"model_name": "", "phase": phase}
        return REGISTRY.get_sample_value("sluiceway:forward_seconds_count", labels) or 0.0

    for prompt in prompts[-2:]:
        params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
        plain = generate(runner, [prompt], [params])
        before = steps("prefill"), steps("decode")
        spec = generate(runner, [prompt], [params], speculative_config=NGRAM)
        assert spec.tokens == plain.tokens and len(spec.tokens[0]) == 64
        decode_steps = spec.num_steps - 1  # the prompt's step samples the first token
        assert decode_steps / 63 < 0.6, (decode_steps, spec.scheduler.spec_decode)
        assert (steps("prefill") - before[0], steps("decode") - before[1]) == (1, decode_steps)


@in_bf16
def test_penalties_min_tokens_logprobs_and_an_exact_max_tokens(
    runner: ModelRunner, prompts: list[list[int]]
) -> None:
    cases = [
        SamplingParams(temperature=0.0, max_tokens=7, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=30, repetition_penalty=1.3),
        SamplingParams(
            temperature=0.7, seed=5, max_tokens=30, frequency_penalty=0.5, presence_penalty=0.3
        ),
        SamplingParams(temperature=0.0, max_tokens=30, min_tokens=25),
    ]
    for params in cases:
        plain = generate(runner, prompts[-2:], [params] * 2)
        spec = generate(runner, prompts[-2:], [params] * 2, speculative_config=NGRAM)
        assert spec.tokens == plain.tokens, params
        assert spec.logprobs == plain.logprobs, params
        assert all(len(t) <= params.max_tokens for t in spec.tokens)
    assert [len(t) for t in generate(runner, prompts[-2:], [cases[0]] * 2,
                                     speculative_config=NGRAM).tokens] == [7, 7]  # fmt: skip


@in_bf16
def test_under_preemption_the_tokens_are_the_same(
    runner: ModelRunner, prompts: list[list[int]]
) -> None:
    """12 blocks for 4 sequences that need ~5 each: sequences are preempted, recomputed and
    resume speculating."""
    target = prompts[-2:] + prompts[:2]
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)] * 4
    plain = generate(runner, target, params)
    spec = generate(runner, target, params, speculative_config=NGRAM, num_blocks=16)
    assert spec.scheduler.num_preemptions > 0
    assert spec.tokens == plain.tokens


@in_bf16
def test_structured_outputs_mask_each_verified_position(
    runner: ModelRunner, prompts: list[list[int]], tokenizer: Any
) -> None:
    """A JSON schema and a regex: each proposed position is masked by the grammar after the
    proposals before it, and the matcher is rolled back for the rejected ones."""
    people = {"type": "array", "minItems": 3, "maxItems": 3, "items": {
        "type": "object", "required": ["name", "city"],
        "properties": {"name": {"type": "string"}, "city": {"type": "string"}}}}  # fmt: skip
    constraints = [
        inference_pb2.StructuredOutputs(json=json.dumps(people)),
        inference_pb2.StructuredOutputs(regex="(yes|no)(, (yes|no)){12}"),
    ]
    ask = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Three people and their cities, as JSON."}],
        add_generation_prompt=True,
        tokenize=False,
    )
    target = [tokenizer(ask).input_ids, prompts[-2]]
    for constraint in constraints:
        params = [SamplingParams(temperature=0.0, max_tokens=80, structured_outputs=constraint),
                  SamplingParams(temperature=0.8, seed=3, max_tokens=80,
                                 structured_outputs=constraint)]  # fmt: skip
        plain = generate(runner, target, params)
        spec = generate(runner, target, params, speculative_config=NGRAM)
        assert spec.tokens == plain.tokens
        assert spec.scheduler.spec_decode.num_accepted_tokens > 0


@in_bf16
def test_beside_chunked_prefills_and_as_parallel_samples_the_tokens_are_the_same(
    runner: ModelRunner, prompts: list[list[int]]
) -> None:
    """A 64-token step budget (long prompts prefilled in chunks beside speculating decodes,
    whose proposals share the budget), and n = 3 seeded samples per request (the prompt's
    blocks shared through the prefix cache)."""
    long_prompts = [p for p in prompts if len(p) > 100][:2]
    target = prompts[-2:] + long_prompts
    params = [SamplingParams(temperature=0.0, max_tokens=40)] * 2 + [SEEDED] * len(long_prompts)
    plain = generate(runner, target, params, max_num_batched_tokens=64, max_num_seqs=8)
    spec = generate(runner, target, params, speculative_config=NGRAM,
                    max_num_batched_tokens=64, max_num_seqs=8)  # fmt: skip
    assert len(long_prompts) == 2 and spec.tokens == plain.tokens
    assert spec.scheduler.spec_decode.num_accepted_tokens > 0

    samples = [SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=40)] * 2
    plain = generate(runner, prompts[-2:], samples, samples=3)
    spec = generate(runner, prompts[-2:], samples, speculative_config=NGRAM, samples=3)
    assert spec.tokens == plain.tokens
    assert spec.scheduler.block_manager.prefix_cache_hits > 0


@in_bf16
def test_a_stream_resumed_with_its_output_so_far_continues_as_plain_decoding(
    runner: ModelRunner, prompts: list[list[int]]
) -> None:
    """The replica that takes over a stream gets its prompt and the tokens already sent, and
    speculates from there: greedy and seeded (its generator skips the draws those used)."""
    target = prompts[-2:]
    params = [GREEDY, SEEDED]
    plain = generate(runner, target, params)
    sent = [tokens[:9] for tokens in plain.tokens]
    resumed = generate(runner, target, params, speculative_config=NGRAM, resumed=sent)
    assert resumed.tokens == plain.tokens
    assert resumed.scheduler.spec_decode.num_accepted_tokens > 0
