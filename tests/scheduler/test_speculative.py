"""Speculative decoding's scheduler half: `--speculative-config`, the n-gram proposer, the
slots reserved for a proposal, and what the emitted tokens do to a sequence."""

from __future__ import annotations

import random

import pytest

from sluiceway.sampling_params import SamplingParams
from sluiceway.scheduler.block_manager import BlockManager
from sluiceway.scheduler.config import SchedulerConfig
from sluiceway.scheduler.scheduler import Scheduler
from sluiceway.scheduler.sequence import Sequence
from sluiceway.speculative import AdaptiveLength, NgramProposer, SpeculativeConfig
from sluiceway.v1 import inference_pb2

EOS = 2


def test_the_config_takes_vllms_keys_and_refuses_the_rest() -> None:
    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 4}')
    assert (c.prompt_lookup_min, c.prompt_lookup_max, c.disable_by_batch_size) == (5, 5, 0)
    c = SpeculativeConfig.parse(
        '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'
    )
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (4, 4)
    assert SpeculativeConfig.parse(c.to_json()) == c
    legacy = SpeculativeConfig.parse('{"model": "[ngram]", "num_speculative_tokens": 3}')
    assert legacy.method == "ngram"
    refused = {
        '{"method": "ngram"}': "num_speculative_tokens is required",
        '{"method": "ngram", "num_speculative_tokens": 0}': r"must be in \[1, 15\], got 0",
        '{"method": "ngram", "num_speculative_tokens": 2, "foo": 1}': "unknown key.*foo",
        '{"method": "draft_model", "num_speculative_tokens": 2}': "model: the draft model's path",
        '{"method": "draft_model", "model": "d.gguf", "num_speculative_tokens": 2, '
        '"prompt_lookup_max": 3}': 'prompt_lookup_max: only with "method": "ngram"',
        '{"method": "draft_model", "model": "d.gguf", "num_speculative_tokens": 2, '
        '"quantization": "q2"}': "quantization: one of auto, gguf, gguf_a8, none, got 'q2'",
        '{"method": "ngram", "model": "d.gguf", "num_speculative_tokens": 2}': "model: only with",
        '{"method": "eagle", "num_speculative_tokens": 2}': "method: one of ngram, draft_model",
        '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, '
        '"prompt_lookup_max": 3}': "prompt_lookup_min .4. must be <= prompt_lookup_max .3.",
        "[1]": "a JSON object",
        "{": "not JSON",
    }
    for text, message in refused.items():
        with pytest.raises(ValueError, match=message):
            SpeculativeConfig.parse(text)
    with pytest.raises(ValueError, match="speculative_config"):
        SchedulerConfig(speculative_config='{"method": "ngram"}')
    draft = SpeculativeConfig.parse(
        '{"method": "draft_model", "model": "d.gguf", "num_speculative_tokens": 3}'
    )
    assert (draft.model, draft.quantization, draft.num_speculative_tokens) == ("d.gguf", "auto", 3)
    assert SpeculativeConfig.parse(draft.to_json()) == draft
    with pytest.raises(ValueError, match="draft_model needs tensor_parallel_size 1"):
        SchedulerConfig(speculative_config=draft.to_json(), tensor_parallel_size=2)


def _reference(tokens: list[int], lo: int, hi: int, k: int) -> list[int]:
    """The proposal by brute force: longest suffix n-gram first, its latest earlier start."""
    n = len(tokens)
    for size in range(min(hi, n - 1), lo - 1, -1):
        suffix = tokens[n - size :]
        for start in range(n - size - 1, -1, -1):
            if tokens[start : start + size] == suffix:
                return tokens[start + size : start + size + k]
    return []


def test_the_ngram_proposer_matches_a_brute_force_search() -> None:
    config = SpeculativeConfig("ngram", 3, 2, 4)
    proposer = NgramProposer(config)
    assert proposer.propose(1, [1, 2, 3, 9], [8, 1, 2, 3], 5) == [9, 8, 1]
    assert proposer.propose(1, [1, 2, 3, 9], [8, 1, 2, 3, 7], 5) == []  # (grown in place)
    assert proposer.propose(2, [5, 6, 5, 6], [], 5) == [5, 6]
    assert proposer.propose(2, [5, 6, 5, 6], [], 1) == [5]
    assert proposer.propose(3, [5, 6, 5, 6], [], 0) == []
    # ids whose bytes repeat across token boundaries: a match must start on a token
    vocab = [0, 1, 256, 257, 65536, 1 << 24]
    rng = random.Random(0)
    for _ in range(400):
        tokens = [rng.choice(vocab) for _t in range(rng.randint(1, 40))]
        proposer.forget(9)
        cut = rng.randint(1, len(tokens))  # the prompt; then the output grows a token a step
        for end in range(cut, len(tokens) + 1):
            got = proposer.propose(9, tokens[:cut], tokens[cut:end], 3)
            assert got == _reference(tokens[:end], 2, 4, 3), tokens[:end]


def _scheduler(num_blocks: int = 32, **spec: int) -> Scheduler:
    cfg = SchedulerConfig()
    spec_config = SpeculativeConfig("ngram", spec.get("k", 4), 1, 3, spec.get("off", 0))
    return Scheduler(cfg, BlockManager(num_blocks, 16), 1024, spec_config)


def _decoding(sched: Scheduler, seq_id: int, prompt: list[int], max_tokens: int) -> Sequence:
    """A sequence past its prompt step, its first token 7 sampled (7 for the others too)."""
    seq = Sequence(
        seq_id=seq_id,
        request_id=f"r{seq_id}",
        prompt_token_ids=prompt,
        sampling=SamplingParams(temperature=0, max_tokens=max_tokens, stop_token_ids=(EOS,)),
    )
    sched.add(seq)
    out = sched.schedule()
    sched.apply_sampled(out, {s.seq.seq_id: 7 for s in out.scheduled if s.samples})
    return seq


def test_a_proposal_gets_its_slots_and_the_accepted_tokens_advance_the_sequence() -> None:
    sched = _scheduler()
    seq = _decoding(sched, 1, [7, 8, 9, 10, 11, 12, 5, 6, 7, 8, 9] + [40] * 4, max_tokens=50)
    out = sched.schedule()
    (s,) = out.scheduled
    # no earlier [40, 40, 7] nor [40, 7]: what followed the latest earlier 7 (index 8)
    assert s.draft_token_ids == [8, 9, 40, 40]
    assert (s.num_computed_tokens, s.num_new_tokens) == (15, 5)
    assert len(seq.block_table) == 2  # positions 15..19
    updates = sched.apply_sampled(out, {1: [8, 9, 3]})  # two accepted, then 3 sampled
    assert [u.token_id for u in updates] == [8, 9, 3]
    assert seq.output_token_ids == [7, 8, 9, 3]
    assert seq.num_computed_tokens == 18 and seq.num_tokens == 19
    counts = sched.spec_decode
    assert (counts.num_drafts, counts.num_draft_tokens, counts.num_accepted_tokens) == (1, 4, 2)
    assert counts.accepted_per_pos == [1, 1, 0, 0]
    with pytest.raises(ValueError, match="do not follow the proposal"):
        out = sched.schedule()
        sched.apply_sampled(out, {1: [99, 98]})


def test_a_draft_models_proposal_is_a_count_and_its_answer_advances_the_sequence() -> None:
    cfg = SpeculativeConfig("draft_model", 3, model="d.gguf")
    sched = Scheduler(SchedulerConfig(), BlockManager(32, 16), 1024, cfg)
    assert sched.proposer is None
    seq = _decoding(sched, 1, list(range(100, 115)), max_tokens=50)
    out = sched.schedule()
    (s,) = out.scheduled
    assert (s.draft_token_ids, s.num_draft_model_tokens, s.num_drafts) == ([], 3, 3)
    assert (s.num_computed_tokens, s.num_new_tokens, s.samples) == (15, 4, True)
    assert out.is_decode_only and len(seq.block_table) == 2  # positions 15..18
    updates = sched.apply_sampled(out, {1: [21, 22, 23]})  # two accepted, then 23 sampled
    assert [u.token_id for u in updates] == [21, 22, 23]
    assert seq.num_computed_tokens == 18 and seq.num_tokens == 19
    counts = sched.spec_decode
    assert (counts.num_drafts, counts.num_draft_tokens, counts.num_accepted_tokens) == (1, 3, 2)
    with pytest.raises(ValueError, match="do not follow the proposal 3"):
        out = sched.schedule()
        sched.apply_sampled(out, {1: [1, 2, 3, 4, 5]})  # more than 3 proposals + 1


def test_proposals_stop_at_max_tokens_and_a_stop_token_among_them_ends_the_sequence() -> None:
    sched = _scheduler()
    seq = _decoding(sched, 1, [7, 8, 9, 10, 11, 12, 5], max_tokens=3)
    out = sched.schedule()
    assert out.scheduled[0].draft_token_ids == [8]  # 1 output + 1 proposed + 1 sampled = 3
    sched.apply_sampled(out, {1: [8, 9]})
    assert seq.output_token_ids == [7, 8, 9] and seq.is_finished
    assert seq.finish_reason == inference_pb2.FINISH_REASON_LENGTH

    seq = _decoding(sched, 2, [7, EOS, 4, 4, 4, 5], max_tokens=20)
    out = sched.schedule()
    assert out.scheduled[0].draft_token_ids == [EOS, 4, 4, 4]
    updates = sched.apply_sampled(out, {2: [EOS, 4, 4]})  # EOS accepted: the end
    assert [u.token_id for u in updates] == [EOS] and seq.output_token_ids == [7, EOS]
    assert seq.finish_reason == inference_pb2.FINISH_REASON_STOP
    assert sched.block_manager.num_free_blocks == 32


def test_no_proposal_above_disable_by_batch_size_or_for_a_first_token() -> None:
    sched = _scheduler(off=1)
    _decoding(sched, 1, [7, 8, 7], max_tokens=20)
    assert sched.schedule().scheduled[0].draft_token_ids == [7]  # [7, 8, 7] + 7: after index 2
    sched = _scheduler(off=1)
    _decoding(sched, 1, [7, 8, 7], max_tokens=20)
    _decoding(sched, 2, [7, 8, 7], max_tokens=20)
    assert [s.draft_token_ids for s in sched.schedule().scheduled] == [[], []]
    sched = _scheduler()
    seq = Sequence(seq_id=3, request_id="r3", prompt_token_ids=[7, 8, 7],
                   sampling=SamplingParams(temperature=0, max_tokens=9))  # fmt: skip
    sched.add(seq)
    assert sched.schedule().scheduled[0].draft_token_ids == []  # the prompt's step


def test_per_sequence_the_length_shrinks_to_what_was_accepted_and_misses_wait() -> None:
    pace = AdaptiveLength(4)
    assert pace.allowed(1) == 4
    pace.record(1, 4, 1)
    assert pace.allowed(1) == 2
    pace.record(1, 2, 0)
    assert [pace.allowed(1) for _ in range(3)] == [0, 1, 1]  # waited 1 step
    pace.record(1, 1, 0)
    assert [pace.allowed(1) for _ in range(3)] == [0, 0, 1]  # then 2
    pace.record(1, 1, 1)
    assert pace.allowed(1) == 2


def test_a_step_that_may_prefill_does_not_propose() -> None:
    """A waiting prompt (with room in the batch) or a running one not all computed keeps the
    step plain: proposals would lengthen the step that holds the new prompt."""
    cfg = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=2)
    spec = SpeculativeConfig("ngram", 4, 1, 3)
    sched = Scheduler(cfg, BlockManager(32, 16), 1024, spec)
    _decoding(sched, 1, [7, 8, 7], max_tokens=20)
    sched.add(Sequence(seq_id=2, request_id="r2", prompt_token_ids=list(range(100, 200)),
                       sampling=SamplingParams(temperature=0, max_tokens=5)))  # fmt: skip
    for done in ((3, 0), (4, 63)):  # the prompt's 100 tokens in chunks: 63 (the budget less
        out = sched.schedule()  # the decode's token), then 37
        assert [(s.seq.seq_id, s.num_computed_tokens, s.draft_token_ids) for s in out.scheduled] \
            == [(1, done[0], []), (2, done[1], [])]  # fmt: skip
        assert out.speculating is None  # (the gate is not asked)
        sched.apply_sampled(out, {s.seq.seq_id: 7 for s in out.scheduled if s.samples})
    out = sched.schedule()  # both decode: proposals come back ([7, 8, 7, 7, 7, 7]: after 2..4)
    assert [s.draft_token_ids for s in out.scheduled] == [[7], []]
    sched.apply_sampled(out, {1: [7, 7], 2: 9})
    sched.add(Sequence(seq_id=3, request_id="r3", prompt_token_ids=[5, 6],
                       sampling=SamplingParams(temperature=0, max_tokens=5)))  # fmt: skip
    out = sched.schedule()  # a third waits, but max_num_seqs 2 leaves it no room: propose
    assert [s.seq.seq_id for s in out.scheduled] == [1, 2] and out.scheduled[0].draft_token_ids


def test_a_step_in_which_a_stream_would_not_gain_runs_plain() -> None:
    """With steps measured at 20 ms plain and 1.25 ms more per proposed token (2 streams), a
    step where a new stream has no n-gram match (1 token in a 1.25x longer step, nothing
    gained before) runs plain (the gate is not told: `guarded`); where both propose 4 tokens,
    expected accepted (none recorded yet: all), it speculates."""
    for other_prompt, expected in (([100, 101, 102], False), ([1, 2, 3, 7, 1, 2, 3], True)):
        sched = _scheduler()
        for _ in range(10):
            sched.guard.observe([8, 9], [1, 1], 2, 0.020)
        for _ in range(10):
            sched.guard.observe([8, 9], [1, 1], 10, 0.030)
        # 7 sampled twice (the second in 2's prompt step): [3, 7, 7] -> [1, 2, 3, 7]
        _decoding(sched, 1, [1, 2, 3, 7, 7, 1, 2, 3], max_tokens=20)
        _decoding(sched, 2, other_prompt, max_tokens=20)
        out = sched.schedule()
        assert [s.draft_token_ids for s in out.scheduled] == (
            [[1, 2, 3, 7]] * 2 if expected else [[], []]
        )
        assert (out.speculating, out.guarded) == (expected, not expected)


def test_a_sequences_expected_acceptance_is_its_recent_mean_else_everyones() -> None:
    pace = AdaptiveLength(4)
    assert pace.expected_accepted(1, 3) == 3.0  # nothing recorded: no reason to doubt
    pace.record(1, 4, 2)
    pace.record(1, 4, 0)
    assert pace.expected_accepted(1, 4) == 1.0  # (2 + 0) / 2, decay 0.5
    assert pace.expected_accepted(2, 4) == pytest.approx(0.9 * 2.0)  # everyone's: 0.9 x 2 + 0
    assert pace.expected_accepted(1, 0) == 0.0


def test_the_step_after_a_sequence_finished_does_not_propose() -> None:
    """A freed slot is mostly filled at once (a client's next request): the step built right
    after a sequence finished runs plain, so that the new prompt waits out a plain step, not a
    speculating one; the step after that proposes again."""
    sched = _scheduler()
    _decoding(sched, 1, [7, 8, 7], max_tokens=20)
    short = _decoding(sched, 2, [100, 101], max_tokens=2)
    out = sched.schedule()  # 1 proposes [7]; 2 has room for none (its last token)
    assert [s.draft_token_ids for s in out.scheduled] == [[7], []]
    sched.apply_sampled(out, {1: [7, 8], 2: 9})
    assert short.is_finished
    out = sched.schedule()
    assert out.speculating is None and out.scheduled[0].draft_token_ids == []
    sched.apply_sampled(out, {1: 7})
    assert sched.schedule().scheduled[0].draft_token_ids != []
