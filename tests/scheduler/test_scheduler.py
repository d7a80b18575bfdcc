"""The batching policy and block accounting, without processes or tensors."""

from __future__ import annotations

import pytest

from sluiceway.sampling_params import SamplingParams
from sluiceway.scheduler.block_manager import BlockManager
from sluiceway.scheduler.config import SchedulerConfig
from sluiceway.scheduler.scheduler import Scheduler, SchedulerOutput
from sluiceway.scheduler.sequence import Sequence, SequenceStatus
from sluiceway.v1 import inference_pb2

EOS = 2


def make_seq(seq_id: int, prompt_len: int, max_tokens: int = 8) -> Sequence:
    return Sequence(
        seq_id=seq_id,
        request_id=f"r{seq_id}",
        prompt_token_ids=[1000 * seq_id + i for i in range(prompt_len)],  # no shared prefix
        sampling=SamplingParams(temperature=0, max_tokens=max_tokens, stop_token_ids=(EOS,)),
    )


def make_scheduler(num_blocks: int = 64, max_model_len: int = 1024, **config: object) -> Scheduler:
    cfg = SchedulerConfig(**config)  # type: ignore[arg-type]
    bm = BlockManager(num_blocks, 16, enable_prefix_caching=cfg.enable_prefix_caching)
    return Scheduler(cfg, bm, max_model_len)


def run_step(sched: Scheduler, token: int = 7) -> SchedulerOutput:
    out = sched.schedule()
    sampled = {s.seq.seq_id: token for s in out.scheduled if s.samples}
    sched.apply_sampled(out, sampled)
    return out


def test_prompt_takes_ceil_blocks_and_a_new_block_every_16_tokens() -> None:
    sched = make_scheduler()
    seq = make_seq(1, prompt_len=16, max_tokens=40)
    sched.add(seq)
    out = run_step(sched)
    assert [s.num_new_tokens for s in out.scheduled] == [16]
    assert len(seq.block_table) == 1  # 16 tokens computed, token 17 sampled
    run_step(sched)  # computes token 17 -> second block
    assert len(seq.block_table) == 2
    for _ in range(15):
        run_step(sched)
    assert seq.num_computed_tokens == 32 and len(seq.block_table) == 2
    run_step(sched)
    assert len(seq.block_table) == 3
    assert sched.block_manager.num_free_blocks == 64 - 3


def test_waiting_requests_join_the_running_batch_at_the_next_step() -> None:
    sched = make_scheduler()
    a = make_seq(1, 20)
    sched.add(a)
    run_step(sched)
    b = make_seq(2, 5)
    sched.add(b)
    out = run_step(sched)
    assert [(s.seq.seq_id, s.num_new_tokens) for s in out.scheduled] == [(1, 1), (2, 5)]
    assert out.scheduled[1].is_new and out.scheduled[1].appended_token_ids == b.prompt_token_ids
    assert not out.scheduled[0].is_new and out.scheduled[0].appended_token_ids == [7]


def test_blocks_are_freed_when_a_sequence_finishes_and_reused_next_step() -> None:
    sched = make_scheduler(num_blocks=4)
    a = make_seq(1, 30, max_tokens=2)  # 2 blocks
    b = make_seq(2, 40)  # 3 blocks: must wait for a
    sched.add(a)
    sched.add(b)
    out = run_step(sched)
    assert [s.seq.seq_id for s in out.scheduled] == [1]
    run_step(sched)
    assert a.finish_reason == inference_pb2.FINISH_REASON_LENGTH
    assert a.block_table == [] and sched.block_manager.num_free_blocks == 4
    out = run_step(sched)
    assert [s.seq.seq_id for s in out.scheduled] == [2]
    assert out.finished_seq_ids == [1]


@pytest.mark.parametrize(
    ("token", "max_tokens", "max_model_len", "reason", "n_out"),
    [
        (EOS, 8, 1024, inference_pb2.FINISH_REASON_STOP, 1),
        (7, 3, 1024, inference_pb2.FINISH_REASON_LENGTH, 3),
        (7, 100, 12, inference_pb2.FINISH_REASON_LENGTH, 2),  # 10 prompt + 2 = max_model_len
    ],
)
def test_finish_reasons(
    token: int, max_tokens: int, max_model_len: int, reason: int, n_out: int
) -> None:
    sched = make_scheduler(max_model_len=max_model_len)
    seq = make_seq(1, 10, max_tokens=max_tokens)
    sched.add(seq)
    while not seq.is_finished:
        run_step(sched, token)
    assert seq.finish_reason == reason
    assert len(seq.output_token_ids) == n_out
    assert sched.block_manager.num_free_blocks == 64


def test_chunked_prefill_fills_the_token_budget_after_decodes() -> None:
    sched = make_scheduler(max_num_seqs=8, max_num_batched_tokens=32)
    a = make_seq(1, 10)
    sched.add(a)
    run_step(sched)
    b = make_seq(2, 100)
    sched.add(b)
    chunks = []
    while b.num_computed_tokens < 100 and not b.output_token_ids:
        out = run_step(sched)
        chunks.append([(s.seq.seq_id, s.num_new_tokens) for s in out.scheduled])
    assert chunks == [[(1, 1), (2, 31)], [(1, 1), (2, 31)], [(1, 1), (2, 31)], [(1, 1), (2, 7)]]


def test_without_chunked_prefill_a_prompt_runs_whole() -> None:
    sched = make_scheduler(max_num_seqs=8, max_num_batched_tokens=48, enable_chunked_prefill=False)
    a = make_seq(1, 10)
    sched.add(a)
    run_step(sched)
    b = make_seq(2, 31)
    sched.add(b)
    out = run_step(sched)  # 1 decode + 31 prompt <= 48: fits
    assert [(s.seq.seq_id, s.num_new_tokens) for s in out.scheduled] == [(1, 1), (2, 31)]
    c = make_seq(3, 47)
    sched.add(c)
    out = run_step(sched)  # 2 decodes + 47 prompt > 48: c waits, never split
    assert [(s.seq.seq_id, s.num_new_tokens) for s in out.scheduled] == [(1, 1), (2, 1)]


def test_max_model_len_is_capped_so_every_sequence_can_always_run_again() -> None:
    assert make_scheduler(num_blocks=8, max_model_len=1024).max_model_len == 8 * 16
    # unchunked, a preempted sequence is recomputed in one step: it must fit the budget
    sched = make_scheduler(
        max_model_len=1024, max_num_seqs=8, max_num_batched_tokens=32, enable_chunked_prefill=False
    )
    assert sched.max_model_len == 32  # a 32-token prompt is refused by the engine's gate


def test_a_preempted_sequence_resumes_without_chunked_prefill() -> None:
    # 3 blocks, steps of 32 tokens, no chunking: the regression of a preempted sequence
    # whose prompt + output outgrew the step budget and never ran again.
    sched = make_scheduler(
        num_blocks=3, max_num_seqs=8, max_num_batched_tokens=32, enable_chunked_prefill=False
    )
    seqs = [make_seq(i, 10, max_tokens=100) for i in (1, 2, 3)]
    for s in seqs:
        sched.add(s)
    for _ in range(200):
        if all(s.is_finished for s in seqs):
            break
        run_step(sched)
    assert all(s.finish_reason == inference_pb2.FINISH_REASON_LENGTH for s in seqs)
    assert [s.num_tokens for s in seqs] == [32, 32, 32]
    assert sched.num_preemptions > 0
    assert sched.block_manager.num_free_blocks == 3


def test_max_num_seqs_bounds_the_batch() -> None:
    sched = make_scheduler(max_num_seqs=2)
    for i in range(3):
        sched.add(make_seq(i + 1, 4))
    out = run_step(sched)
    assert [s.seq.seq_id for s in out.scheduled] == [1, 2]
    assert len(sched.waiting) == 1


def test_preemption_frees_the_latest_sequence_and_requeues_it_first() -> None:
    sched = make_scheduler(num_blocks=3, max_model_len=1024)
    a = make_seq(1, 16, max_tokens=100)
    b = make_seq(2, 16, max_tokens=100)
    sched.add(a)
    sched.add(b)
    run_step(sched)  # a: 1 block, b: 1 block
    out = run_step(sched)  # a takes block 3; b needs one more, none left: b is preempted
    assert [s.seq.seq_id for s in out.scheduled] == [1]
    assert out.finished_seq_ids == [2]  # the worker forgets b in the same step
    assert b.status is SequenceStatus.WAITING and sched.waiting[0] is b
    assert b.block_table == [] and b.num_preemptions == 1
    assert b.output_token_ids == [7]  # kept, recomputed as prompt later
    assert sched.num_preemptions == 1
    assert sched.block_manager.num_free_blocks == 1


def test_abort_frees_blocks_at_once_and_tells_the_worker() -> None:
    sched = make_scheduler()
    seq = make_seq(1, 40)
    sched.add(seq)
    run_step(sched)
    assert sched.block_manager.num_free_blocks == 61
    sched.finish(seq, inference_pb2.FINISH_REASON_ABORT)
    assert sched.block_manager.num_free_blocks == 64
    assert sched.schedule().finished_seq_ids == [1]


def test_a_sequence_aborted_while_its_step_runs_gets_no_token() -> None:
    sched = make_scheduler()
    seq = make_seq(1, 4)
    sched.add(seq)
    out = sched.schedule()
    sched.finish(seq, inference_pb2.FINISH_REASON_ABORT)
    assert sched.apply_sampled(out, {1: 7}) == []
    assert seq.output_token_ids == []


def test_the_longest_prompt_the_pool_holds_runs_to_its_end() -> None:
    sched = make_scheduler(num_blocks=2, max_model_len=100)
    assert sched.max_model_len == 32  # what 2 blocks hold (a longer prompt: the engine's gate)
    seq = make_seq(2, 31, max_tokens=8)
    sched.add(seq)
    while not seq.is_finished:
        run_step(sched)
    assert seq.output_token_ids == [7] and seq.finish_reason == inference_pb2.FINISH_REASON_LENGTH
    assert sched.block_manager.num_free_blocks == 2


def shared_prompt_seq(seq_id: int, prompt: list[int], max_tokens: int = 4) -> Sequence:
    seq = make_seq(seq_id, 1, max_tokens)
    seq.prompt_token_ids = list(prompt)
    return seq


def test_prefix_cache_reuses_full_blocks_and_counts_tokens() -> None:
    sched = make_scheduler(num_blocks=16)
    bm = sched.block_manager
    prompt = list(range(100, 140))  # 40 tokens: 2 full blocks + 8
    a = shared_prompt_seq(1, prompt, max_tokens=50)
    sched.add(a)
    run_step(sched)
    assert len(bm.cached_hashes) == 2
    b = shared_prompt_seq(2, [*prompt[:35], 7, 7])  # shares 2 full blocks, then differs
    sched.add(b)
    out = run_step(sched)
    new_b = next(s for s in out.scheduled if s.seq is b)
    assert new_b.is_new and new_b.num_computed_tokens == 32 and new_b.num_new_tokens == 5
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert new_b.new_block_ids == b.block_table  # the whole table, cached blocks included
    assert [bm.blocks[x].ref_count for x in a.block_table[:2]] == [2, 2]
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (40 + 37, 0 + 32)
    assert bm.num_free_blocks == 16 - 3 - 1  # a: 3 blocks, b: 1 of its own


def test_a_fully_cached_prompt_still_computes_its_last_block() -> None:
    sched = make_scheduler(num_blocks=16)
    prompt = list(range(100, 132))  # exactly 2 blocks
    a = shared_prompt_seq(1, prompt, max_tokens=1)
    sched.add(a)
    run_step(sched)
    assert a.is_finished and sched.block_manager.num_free_blocks == 16  # cached, evictable
    b = shared_prompt_seq(2, prompt)
    sched.add(b)
    out = run_step(sched)
    assert [(s.num_computed_tokens, s.num_new_tokens) for s in out.scheduled] == [(16, 16)]


def test_cached_blocks_are_evicted_only_when_fresh_blocks_run_out() -> None:
    sched = make_scheduler(num_blocks=4)
    bm = sched.block_manager
    a = shared_prompt_seq(1, list(range(100, 148)), max_tokens=1)  # 3 full blocks
    sched.add(a)
    run_step(sched)
    assert bm.num_free_blocks == 4 and len(bm.cached_hashes) == 3
    b = shared_prompt_seq(2, list(range(300, 310)), max_tokens=1)  # 1 fresh block
    sched.add(b)
    run_step(sched)
    assert len(bm.cached_hashes) == 3  # the never-hashed block was reused first
    c = shared_prompt_seq(3, list(range(500, 540)), max_tokens=1)  # 3 blocks: must evict
    sched.add(c)
    run_step(sched)
    assert c.finish_reason == inference_pb2.FINISH_REASON_LENGTH
    assert len(bm.cached_hashes) == 2 + 1  # c's 2 full blocks + whatever of a survived
    assert bm.num_free_blocks == 4


def test_prefix_caching_off_shares_nothing() -> None:
    sched = make_scheduler(num_blocks=16, enable_prefix_caching=False)
    prompt = list(range(100, 140))
    for i in (1, 2):
        sched.add(shared_prompt_seq(i, prompt))
    out = run_step(sched)
    assert [s.num_computed_tokens for s in out.scheduled] == [0, 0]
    assert sched.block_manager.prefix_cache_hits == 0


def test_static_batches_enter_together_and_hold_blocks_until_the_batch_ends() -> None:
    sched = make_scheduler(scheduling_policy="static", static_batch_size=2)
    a, b, c = make_seq(1, 10, max_tokens=1), make_seq(2, 10, max_tokens=3), make_seq(3, 10)
    for s in (a, b, c):
        sched.add(s)
    out = run_step(sched)
    assert [s.seq.seq_id for s in out.scheduled] == [1, 2]  # c waits for the next batch
    assert a.is_finished and a.block_table != []  # finished, still holding its block
    out = run_step(sched)
    assert [s.seq.seq_id for s in out.scheduled] == [2]  # nobody joins the running batch
    assert sched.block_manager.num_free_blocks == 64 - 2
    run_step(sched)
    assert b.is_finished and a.block_table == [] and b.block_table == []
    assert sched.block_manager.num_free_blocks == 64
    out = run_step(sched)
    assert [s.seq.seq_id for s in out.scheduled] == [3]


def test_kv_utilization_is_tokens_stored_over_slots_allocated() -> None:
    sched = make_scheduler(num_blocks=16)
    sched.add(make_seq(1, 20, max_tokens=10))  # 20 tokens in 2 blocks
    sched.add(make_seq(2, 4, max_tokens=10))  # 4 tokens in 1 block
    run_step(sched)
    assert sched.kv_usage.utilization == (20 + 4) / (3 * 16)
    run_step(sched)
    assert sched.kv_usage.tokens_stored_total == 24 + 26
    assert sched.kv_usage.slots_allocated_total == 48 + 48


def samples_of(parent: str, first_id: int, prompt: list[int], n: int, max_tokens: int = 8):
    """The n sequences of one parallel-sampling request (what the router sends)."""
    return [
        Sequence(
            seq_id=first_id + i,
            request_id=f"{parent}-{i}",
            prompt_token_ids=list(prompt),
            sampling=SamplingParams(
                temperature=1.0, seed=i, max_tokens=max_tokens, stop_token_ids=(EOS,)
            ),
            parent_request_id=parent,
        )
        for i in range(n)
    ]


def test_parallel_samples_take_the_prompts_full_blocks_from_the_prefix_cache() -> None:
    sched = make_scheduler(num_blocks=16)
    bm = sched.block_manager
    prompt = list(range(100, 137))  # 37 tokens: 2 full blocks + 5
    a, b, c = samples_of("p", 1, prompt, 3, max_tokens=20)
    for s in (a, b, c):
        sched.add(s)
    out = run_step(sched, token=7)
    # one sample computes the prompt; the others wait for it, holding nothing
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(a, 37)]
    assert b.block_table == c.block_table == [] and bm.num_free_blocks == 16 - 3
    out = run_step(sched, token=8)
    # b and c take a's 2 full blocks (32 tokens) from the prefix cache and compute the
    # partial block, 5 tokens, in a block of their own: nothing is copied
    by_seq = {s.seq: s for s in out.scheduled}
    assert [(s.num_computed_tokens, s.num_new_tokens) for s in (by_seq[b], by_seq[c])] == [
        (32, 5),
        (32, 5),
    ]
    assert a.block_table[:2] == b.block_table[:2] == c.block_table[:2]
    assert len({a.block_table[2], b.block_table[2], c.block_table[2]}) == 3
    assert [bm.blocks[x].ref_count for x in a.block_table] == [3, 3, 1]
    assert by_seq[b].is_new and by_seq[b].new_block_ids == b.block_table
    assert bm.num_free_blocks == 16 - 5  # 2 shared + 3 partial, one each
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (3 * 37, 2 * 32)
    assert [len(s.output_token_ids) for s in (a, b, c)] == [2, 1, 1]
    for s in (a, b, c):
        sched.finish(s, inference_pb2.FINISH_REASON_ABORT)
    assert bm.num_free_blocks == 16 and all(x.ref_count == 0 for x in bm.blocks)


def test_samples_wait_for_a_chunked_prompt_until_its_full_blocks_are_cached() -> None:
    sched = make_scheduler(num_blocks=16, max_num_batched_tokens=16, max_num_seqs=8)
    prompt = list(range(100, 137))  # 37 tokens: 3 chunks of at most 16
    a, b = samples_of("p", 1, prompt, 2)
    sched.add(a)
    sched.add(b)
    assert chunk_sizes(run_step(sched)) == [(1, 16)]
    assert chunk_sizes(run_step(sched)) == [(1, 16)]  # b waits: a's second block not cached
    out = run_step(sched)  # a's 2 full blocks are cached: b takes them, computes the rest
    assert chunk_sizes(out) == [(1, 5), (2, 5)]
    assert b.block_table[:2] == a.block_table[:2]


def test_a_sample_that_comes_late_takes_a_decoding_siblings_full_blocks() -> None:
    sched = make_scheduler(num_blocks=16)
    bm = sched.block_manager
    prompt = list(range(100, 120))  # 20 tokens: 1 full block + 4
    a, b = samples_of("p", 1, prompt, 2, max_tokens=20)
    sched.add(a)
    run_step(sched)
    run_step(sched)  # a holds 21 computed tokens, its second block partial
    sched.add(b)
    out = run_step(sched)
    assert [(s.num_computed_tokens, s.num_new_tokens) for s in out.scheduled if s.seq is b] == [
        (16, 4)
    ]
    assert b.block_table[0] == a.block_table[0] and b.block_table[1] != a.block_table[1]
    assert [bm.blocks[x].ref_count for x in a.block_table] == [2, 1]


def test_a_sample_whose_siblings_are_gone_computes_its_prompt() -> None:
    sched = make_scheduler(num_blocks=16)
    prompt = list(range(100, 120))
    a, b = samples_of("p", 1, prompt, 2, max_tokens=1)
    sched.add(a)
    sched.add(b)
    run_step(sched)
    assert a.is_finished  # max_tokens 1: done at its first step
    out = run_step(sched)
    # the prefix cache still has a's full block; b computes the rest itself
    assert [(s.num_computed_tokens, s.num_new_tokens) for s in out.scheduled] == [(16, 4)]


def test_a_waiting_sample_does_not_hold_back_other_requests() -> None:
    sched = make_scheduler(num_blocks=16)
    a, b = samples_of("p", 1, list(range(100, 140)), 2)
    other = make_seq(9, 10)
    for s in (a, b, other):
        sched.add(s)
    out = run_step(sched)
    assert [s.seq for s in out.scheduled] == [a, other]
    assert list(sched.waiting) == [b]


def test_samples_compute_their_prompts_at_once_with_prefix_caching_off() -> None:
    sched = make_scheduler(num_blocks=16, enable_prefix_caching=False)
    a, b = samples_of("p", 1, list(range(100, 140)), 2)
    sched.add(a)
    sched.add(b)
    out = run_step(sched)
    assert [(s.seq, s.num_computed_tokens, s.num_new_tokens) for s in out.scheduled] == [
        (a, 0, 40),
        (b, 0, 40),
    ]
    assert not set(a.block_table) & set(b.block_table)


def test_samples_of_a_prompt_within_one_block_do_not_wait() -> None:
    sched = make_scheduler(num_blocks=16)
    a, b = samples_of("p", 1, list(range(100, 116)), 2)  # 16 tokens: nothing cacheable
    sched.add(a)
    sched.add(b)
    assert chunk_sizes(run_step(sched)) == [(1, 16), (2, 16)]


def test_samples_wait_only_for_a_sibling_with_their_prompt() -> None:
    sched = make_scheduler(
        max_num_batched_tokens=64, long_prefill_token_threshold=24, max_num_seqs=8
    )
    (a,) = samples_of("p", 1, list(range(100, 140)), 1)  # 40 tokens: a chunk of 24 first
    (b,) = samples_of("p", 2, list(range(500, 520)), 1)  # another prompt, the same parent id
    sched.add(a)
    sched.add(b)
    out = run_step(sched)  # b does not wait for a's blocks: they are not its prompt's
    assert [(s.seq, s.num_computed_tokens, s.num_new_tokens) for s in out.scheduled] == [
        (a, 0, 24),
        (b, 0, 20),
    ]


def test_static_batches_take_every_sample_of_a_request_in() -> None:
    sched = make_scheduler(num_blocks=32, scheduling_policy="static", static_batch_size=2)
    a0, a1, a2 = samples_of("a", 1, list(range(100, 120)), 3, max_tokens=4)
    other = make_seq(9, 10, max_tokens=4)
    sched.add(a0)
    sched.add(other)
    run_step(sched)  # the batch is a0 and other
    sched.add(a1)  # a0's siblings come after the batch formed: they join it, hit a0's block
    sched.add(a2)
    out = run_step(sched)
    assert {s.seq for s in out.scheduled} == {a0, other, a1, a2}
    assert sched.block_manager.prefix_cache_hits == 2 * 16


def chunk_sizes(out: SchedulerOutput) -> list[tuple[int, int]]:
    return [(s.seq.seq_id, s.num_new_tokens) for s in out.scheduled]


def test_a_long_prefill_is_capped_at_the_threshold_so_a_short_request_starts_at_once() -> None:
    sched = make_scheduler(
        max_num_seqs=8, max_num_batched_tokens=64, long_prefill_token_threshold=16
    )
    long = make_seq(1, 100)
    sched.add(long)
    steps = [chunk_sizes(run_step(sched))]
    sched.add(make_seq(2, 10))
    while not long.output_token_ids:
        steps.append(chunk_sizes(run_step(sched)))
    assert steps == [
        [(1, 16)],
        [(1, 16), (2, 10)],  # the short prompt whole, beside the long one's capped chunk
        [(1, 16), (2, 1)],
        [(1, 16), (2, 1)],
        [(1, 16), (2, 1)],
        [(1, 16), (2, 1)],
        [(1, 4), (2, 1)],  # 4 tokens left: no longer long
    ]


def test_without_a_threshold_a_long_prompt_takes_the_whole_budget() -> None:
    sched = make_scheduler(max_num_seqs=8, max_num_batched_tokens=64)
    sched.add(make_seq(1, 200))
    run_step(sched)
    sched.add(make_seq(2, 10))
    assert chunk_sizes(run_step(sched)) == [(1, 64)]  # the short one waits (vLLM's default)


@pytest.mark.parametrize(
    ("num_partial", "num_long", "expected"),
    [
        (1, 1, [(1, 32), (4, 8)]),  # B and E would be a second partial prefill: passed over
        (2, 1, [(1, 32), (3, 16)]),  # B would be a second long one; E (not long) fits
        (2, 2, [(1, 32), (2, 16)]),
    ],
)
def test_partial_prefill_caps_pass_over_requests_that_would_exceed_them(
    num_partial: int, num_long: int, expected: list[tuple[int, int]]
) -> None:
    sched = make_scheduler(
        max_num_seqs=8,
        max_num_batched_tokens=48,
        long_prefill_token_threshold=32,
        max_num_partial_prefills=num_partial,
        max_long_partial_prefills=num_long,
    )
    for seq_id, prompt_len in [(1, 100), (2, 40), (3, 24), (4, 8)]:  # A, B long; E, C not
        sched.add(make_seq(seq_id, prompt_len))
    assert chunk_sizes(run_step(sched)) == expected


def test_partial_prefill_config_follows_vllm() -> None:
    assert SchedulerConfig().resolved_long_prefill_token_threshold(8192) == 0
    cfg = SchedulerConfig(max_num_partial_prefills=2)
    assert cfg.resolved_long_prefill_token_threshold(8192) == 327  # 4% of max_model_len
    cfg = SchedulerConfig(long_prefill_token_threshold=100, max_num_partial_prefills=2)
    assert cfg.resolved_long_prefill_token_threshold(8192) == 100
    with pytest.raises(ValueError, match="max_long_partial_prefills"):
        SchedulerConfig(max_num_partial_prefills=2, max_long_partial_prefills=3)
    with pytest.raises(ValueError, match="enable_chunked_prefill"):
        SchedulerConfig(long_prefill_token_threshold=64, enable_chunked_prefill=False)
    with pytest.raises(ValueError, match=">= 0"):
        SchedulerConfig(long_prefill_token_threshold=-1)
