"""Speculative decoding with a draft model gives bitwise the tokens of plain decoding: SmolLM2
as the target (bfloat16 on its dequantized weights, `none`; float32 on its GGUF blocks) and
its own Q4_1 file as the draft (`gguf_a8`: int8 activations, a cheaper forward), greedy and
seeded, alone and beside unrelated streams, under preemption, chunked prefill, parallel
samples, structured outputs and a resumed stream; and its proposals save forward steps.

The draft, being the target's own weights, reads and writes the target's KV pool; with a
pool of its own (`draft_shares_kv=False`, as any other draft has) its K/V are recomputed from
its last valid position (worker.draft.DraftState): after a preemption, a prefix-cache hit or
a resume it computes the sequence's tokens again."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest
from transformers import AutoTokenizer

from sluiceway.kernels import cpu_ops
from sluiceway.model_files import embedded_model_path, resolve_model
from sluiceway.sampling_params import SamplingParams
from sluiceway.sharegpt import sample_requests
from sluiceway.spec_gate import SpeculationGate
from sluiceway.speculative import SpeculativeConfig
from sluiceway.v1 import inference_pb2
from sluiceway.worker.draft import DraftState
from sluiceway.worker.model_runner import ModelRunner
from tests.worker.spec_driver import generate
from tests.worker.test_speculative import EDIT, REPEAT

pytestmark = [
    pytest.mark.skipif(
        not cpu_ops.quant_gemm_a8_supported(),
        reason="the draft's gguf_a8 and the batch-invariant forward need AVX512-BF16/VNNI",
    ),
    pytest.mark.slow,
]

DRAFT = json.dumps({"method": "draft_model", "model": str(embedded_model_path()),
                    "num_speculative_tokens": 4, "quantization": "gguf_a8"})  # fmt: skip
GREEDY = SamplingParams(temperature=0.0, max_tokens=32)
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=1234, max_tokens=32)
KV_MEMORY = 256 << 20
# (--quantization, --dtype, the draft in the target's KV pool)
TARGETS = [("none", "bfloat16", True), ("gguf", "float32", True)]
OWN_POOL = ("none", "bfloat16", False)
in_bf16 = pytest.mark.parametrize(
    "runner", TARGETS[:1], indirect=True, ids=lambda t: "-".join(t[:2])
)
either_pool = pytest.mark.parametrize("runner", [TARGETS[0], OWN_POOL], indirect=True,
                                      ids=["shared-kv", "own-kv"])  # fmt: skip


@pytest.fixture(scope="module")
def runner(request: pytest.FixtureRequest) -> ModelRunner:
    quantization, dtype, shares_kv = request.param
    r = ModelRunner(
        resolve_model(None),
        dtype=dtype,
        quantization=quantization,
        kv_cache_memory=KV_MEMORY,
        speculative=SpeculativeConfig.parse(DRAFT),
        draft_shares_kv=shares_kv,
    )
    assert r.batch_invariant and r.draft is not None
    assert r.draft.quantization == "gguf_a8" and r.draft.shares_kv == shares_kv
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


def test_a_draft_path_that_is_not_a_model_is_refused_naming_the_key(tmp_path: Any) -> None:
    for path, words in [(tmp_path / "none.gguf", "does not exist"), (tmp_path, "config.json")]:
        config = SpeculativeConfig("draft_model", 2, model=str(path))
        with pytest.raises(ValueError, match=f"^speculative_config.model: .*{words}"):
            ModelRunner(resolve_model(None), kv_cache_memory=64 << 20, speculative=config)


@pytest.mark.parametrize("runner", TARGETS, indirect=True, ids=lambda t: "-".join(t[:2]))
def test_a_draft_of_the_models_own_weights_uses_the_models_kv_pool(runner: ModelRunner) -> None:
    """No second pool: the draft's caches are the model's, and the KV budget holds as many
    blocks as without a draft (a pool of its own halves them: the same bytes per block)."""
    assert runner.draft is not None
    assert runner.draft.bytes_per_block == 0
    assert all(d is t for d, t in zip(runner.draft._kv_caches, runner._kv_caches, strict=True))
    assert runner.num_kv_blocks == KV_MEMORY // runner.bytes_per_block


def test_the_draft_state_keeps_the_accepted_proposals_it_computed() -> None:
    """Proposed [5, 6, 7] after position 10: the draft computed positions up to 12 (the last
    proposal's K/V never); what the sequence now holds there decides what stays valid."""
    state = DraftState(computed=12, base=10, proposed=[5, 6, 7])
    base = list(range(10))
    assert state.valid([*base, 5, 6, 7, 8]) == 12  # all accepted: the 7's position is not
    assert state.valid([*base, 5, 9]) == 11  # one accepted
    assert state.valid([*base, 4]) == 10  # none
    assert DraftState().valid(base) == 0  # never computed


@pytest.mark.parametrize("runner", TARGETS, indirect=True, ids=lambda t: "-".join(t[:2]))
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_tokens_equal_plain_decoding_for_sharegpt_and_repetitive_prompts(
    runner: ModelRunner, prompts: list[list[int]], params: SamplingParams
) -> None:
    every = [params] * len(prompts)
    plain = generate(runner, prompts, every)
    spec = generate(runner, prompts, every, speculative_config=DRAFT)
    assert spec.tokens == plain.tokens
    assert spec.finish == plain.finish
    counts = spec.scheduler.spec_decode
    assert counts.num_drafts > 0 and counts.num_accepted_tokens > 0


@in_bf16
def test_repetitive_prompts_take_under_0_6_forward_steps_per_token(
    runner: ModelRunner, prompts: list[list[int]]
) -> None:
    for prompt in prompts[-2:]:
        params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
        plain = generate(runner, [prompt], [params])
        spec = generate(runner, [prompt], [params], speculative_config=DRAFT)
        assert spec.tokens == plain.tokens and len(spec.tokens[0]) == 64
        decode_steps = spec.num_steps - 1  # the prompt's step samples the first token
        assert decode_steps / 63 < 0.6, (decode_steps, spec.scheduler.spec_decode)


@either_pool
def test_beside_20_streams_under_preemption_chunked_prefill_and_parallel_samples(
    runner: ModelRunner, prompts: list[list[int]]
) -> None:
    """The same tokens alone and beside 20 seeded streams; in 16 blocks for 4 sequences
    (preempted, recomputed: the draft computes their tokens again); with a 64-token step
    budget (long prompts chunked beside drafting decodes); as n = 3 seeded samples (the
    prompt's blocks shared through the prefix cache, the draft's K/V recomputed in them)."""
    target = prompts[-2:]
    plain = generate(runner, target, [GREEDY, SEEDED])
    crowd = generate(runner, target + prompts[:20], [GREEDY, SEEDED] + [SEEDED] * 20,
                     speculative_config=DRAFT)  # fmt: skip
    assert crowd.tokens[:2] == plain.tokens

    four = prompts[-2:] + prompts[:2]
    params = [SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)] * 4
    tight = generate(runner, four, params, speculative_config=DRAFT, num_blocks=16)
    assert tight.scheduler.num_preemptions > 0
    assert tight.tokens == generate(runner, four, params).tokens

    long_prompts = [p for p in prompts if len(p) > 100][:2]
    mixed = target + long_prompts
    params = [GREEDY, GREEDY, SEEDED, SEEDED]
    small = {"max_num_batched_tokens": 64, "max_num_seqs": 8}
    chunked = generate(runner, mixed, params, speculative_config=DRAFT, **small)
    assert len(long_prompts) == 2 and chunked.tokens == generate(runner, mixed, params).tokens

    samples = [SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=32)] * 2
    spec = generate(runner, target, samples, speculative_config=DRAFT, samples=3)
    assert spec.tokens == generate(runner, target, samples, samples=3).tokens
    assert spec.scheduler.block_manager.prefix_cache_hits > 0
    assert spec.scheduler.spec_decode.num_accepted_tokens > 0


@either_pool
def test_structured_outputs_and_a_resumed_stream(
    runner: ModelRunner, prompts: list[list[int]]
) -> None:
    """A regex masks each verified position (the draft proposes unconstrained); a stream
    resumed with 9 tokens sent continues as plain decoding."""
    constraint = inference_pb2.StructuredOutputs(regex="(yes|no)(, (yes|no)){12}")
    params = [SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=constraint),
              SamplingParams(temperature=0.8, seed=3, max_tokens=60,
                             structured_outputs=constraint)]  # fmt: skip
    target = prompts[-2:]
    plain = generate(runner, target, params)
    spec = generate(runner, target, params, speculative_config=DRAFT)
    assert spec.tokens == plain.tokens
    assert spec.scheduler.spec_decode.num_accepted_tokens > 0

    plain = generate(runner, target, [GREEDY, SEEDED])
    sent = [tokens[:9] for tokens in plain.tokens]
    resumed = generate(runner, target, [GREEDY, SEEDED], speculative_config=DRAFT, resumed=sent)
    assert resumed.tokens == plain.tokens


@in_bf16
def test_the_gates_plain_steps_between_proposals_keep_the_plain_tokens(
    runner: ModelRunner, prompts: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The gate (sluiceway.spec_gate) runs plain steps between speculating ones, runs of them
    where speculation loses: the draft then catches up on every token since its last
    proposal. Steps in cycles of 8 (speculating, plain, speculating, 5 plain) at a batch of
    6 (4 ShareGPT prompts and the two repetitive ones): the plain tokens, and fewer forward
    steps than plain decoding."""
    pattern = itertools.cycle([True, False, True, False, False, False, False, False])
    monkeypatch.setattr(SpeculationGate, "choose", lambda self, batch: next(pattern))
    chosen = prompts[:4] + prompts[-2:]
    every = [SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)] * len(chosen)
    plain = generate(runner, chosen, every)
    spec = generate(runner, chosen, every, speculative_config=DRAFT)
    assert spec.tokens == plain.tokens
    assert spec.scheduler.spec_decode.num_accepted_tokens > 0
    assert spec.num_steps < plain.num_steps
