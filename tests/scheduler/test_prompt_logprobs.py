"""Prompt logprobs in the scheduler: a request that asks reads no prefix cache (vLLM v1) but
fills it, its chunks' logprobs are put together in prompt order and sent with the first
token, and a sequence preempted after that does not ask the workers again."""

from __future__ import annotations

import dataclasses

from sluiceway.internal.v1 import worker_pb2
from sluiceway.scheduler.scheduler import ScheduledSequence
from sluiceway.scheduler.step_loop import add_prompt_logprobs, build_step_request
from sluiceway.v1 import inference_pb2
from tests.scheduler.test_scheduler import make_scheduler, run_step, shared_prompt_seq

PROMPT = list(range(100, 140))  # 40 tokens: 2 full blocks + 8


def _asking(seq_id: int, prompt: list[int]):  # type: ignore[no-untyped-def]
    seq = shared_prompt_seq(seq_id, prompt)
    seq.sampling = dataclasses.replace(seq.sampling, prompt_logprobs=1)
    return seq


def test_a_request_asking_for_prompt_logprobs_reads_no_cache_but_fills_it() -> None:
    sched = make_scheduler(num_blocks=16)
    bm = sched.block_manager
    plain = shared_prompt_seq(1, PROMPT, max_tokens=1)
    sched.add(plain)
    run_step(sched)
    assert len(bm.cached_hashes) == 2
    asking = _asking(2, PROMPT)
    assert asking.wants_prompt_logprobs
    sched.add(asking)
    out = run_step(sched)
    assert [(s.num_computed_tokens, s.num_new_tokens) for s in out.scheduled] == [(0, 40)]
    assert not asking.wants_prompt_logprobs  # it has its first token: they went with it
    again = shared_prompt_seq(3, PROMPT)
    sched.add(again)
    out = run_step(sched)
    assert [(s.seq.seq_id, s.num_computed_tokens) for s in out.scheduled] == [(2, 40), (3, 32)]


def test_chunks_are_put_together_in_prompt_order() -> None:
    sched = make_scheduler(max_num_batched_tokens=16, max_num_seqs=4)
    seq = _asking(1, PROMPT)
    sched.add(seq)
    for step in range(3):  # positions 0-15, 16-31, 32-39: tokens 1-16, 17-32, 33-39
        out = sched.schedule()
        (s,) = out.scheduled
        first = s.num_computed_tokens + 1
        count = min(s.num_computed_tokens + s.num_new_tokens, 39) - s.num_computed_tokens
        chunk = worker_pb2.PromptLogprobs(
            seq_id=1,
            first_token_index=first,
            logprobs=[inference_pb2.TokenLogprobs(token_id=PROMPT[first + i], logprob=-1.0)
                      for i in range(count)],
        )  # fmt: skip
        add_prompt_logprobs(out, [chunk, chunk] if step == 1 else [chunk])  # a repeat is dropped
        sched.apply_sampled(out, {1: 7} if s.samples else {})
    assert [e.token_id for e in seq.prompt_logprobs] == PROMPT[1:]


def test_a_sequence_preempted_after_its_first_token_does_not_ask_again() -> None:
    sched = make_scheduler()
    seq = _asking(1, PROMPT)
    sched.add(seq)
    out = sched.schedule()
    assert build_step_request(1, out).new_sequences[0].sampling.prompt_logprobs == 1
    seq.prompt_logprobs.append(inference_pb2.TokenLogprobs(token_id=PROMPT[1]))
    sched._forget(seq)  # preempted before its first token: computed again, from scratch
    assert seq.prompt_logprobs == []
    seq.output_token_ids.append(7)  # after it: they were sent
    again = ScheduledSequence(seq, True, seq.token_ids, 0, 41, [1, 2, 3])
    new = build_step_request(2, dataclasses.replace(out, scheduled=[again])).new_sequences[0]
    assert not new.sampling.HasField("prompt_logprobs")
