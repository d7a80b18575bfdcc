"""The batching policy: what runs in the next step.

Each call to `schedule` builds one step, the way vLLM v1 does: running
sequences first, in admission order (one decode token each, or the next
chunk of a prompt being prefilled), then waiting sequences within what is
left of the token budget (`max_num_batched_tokens`), the sequence cap
(`max_num_seqs`) and the free blocks. A waiting sequence starts from the
longest cached prefix of its tokens (prefix caching) and computes only the
rest. Finished and aborted sequences give their blocks back at once, so the
waiting queue gets them in the very next step: iteration-level batching
(Yu et al., "Orca", OSDI '22).

Long prefills share the step (vLLM's `long_prefill_token_threshold`,
`max_num_partial_prefills`, `max_long_partial_prefills`, with their meaning):
a sequence with more uncomputed tokens than the threshold is a long prefill
and gets at most the threshold per step, so a short request that arrives
behind a long prompt is admitted in the next step with the rest of the
budget instead of after the whole prompt. A waiting request that would be
left partly prefilled by its chunk is a partial prefill: at most
`max_num_partial_prefills` run at once (`max_long_partial_prefills` of them
long); one that would exceed either is passed over for this step, and the
requests behind it are still considered (a request that completes its
prompt in the step is never held back by these caps). How a prompt is
chunked changes no token (README, Reproducibility).

When a running sequence needs a block and none is free, the most recently
admitted running sequence is preempted by recompute: its blocks are freed
and it goes back to the front of the waiting queue with its generated tokens
kept as part of its prompt (vLLM's RECOMPUTE preemption).

The `priority` policy is vLLM v1's: the waiting queue is kept in (priority,
arrival) order, lower first (a sorted insertion; the fcfs queue stays a plain
append), a preempted sequence goes back to its place in that order, and the
victim of a preemption is the running sequence with the largest (priority,
arrival), itself included; a victim already given a share of this step has
that share taken back. As in vLLM, a waiting request never preempts a running
one: a high-priority request that finds no free block waits for one like any
other (it is first in line), and preempts lower ones once it runs.

Parallel sampling: the n samples of one request are n sequences with one
`parent_request_id`, sharing the prompt's full blocks through the prefix
cache, as vLLM v1 does. The first one scheduled computes the prompt; the
others wait (no other sequence waits behind them) until it has computed the
prompt's full blocks, which are then cached, take those as a prefix-cache
hit and compute the rest of the prompt, at most a block, themselves (its
logits give each sample its own first token). No block is ever shared
partly filled, so none is copied. With prefix caching off they do not wait:
each computes its whole prompt.

The `static` policy is the baseline the benchmark compares against: batches
of `static_batch_size` requests in arrival order, no request joins a running
batch, and finished members keep their blocks until the whole batch ends, as
in a padded static batch (unless a live member needs their blocks: the
padding gives way before a member is preempted, so a batch never deadlocks).
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Mapping
from typing import TYPE_CHECKING

from sluiceway.scheduler.block_manager import BlockManager
from sluiceway.scheduler.config import SchedulerConfig
from sluiceway.scheduler.outputs import KvUsage, ScheduledSequence, SchedulerOutput, TokenUpdate
from sluiceway.scheduler.proposals import Proposal, step_proposals
from sluiceway.scheduler.sequence import Sequence, SequenceStatus
from sluiceway.spec_gate import SpeculationGate, StreamGuard
from sluiceway.speculative import (
    AdaptiveLength,
    NgramProposer,
    SpecDecodeCounts,
    SpeculativeConfig,
)
from sluiceway.v1 import inference_pb2

if TYPE_CHECKING:
    from sluiceway.v1.inference_pb2 import FinishReason

__all__ = ["KvUsage", "ScheduledSequence", "Scheduler", "SchedulerOutput", "TokenUpdate"]


class Scheduler:
    """Waiting and running queues over one `BlockManager`. Never touches a tensor."""

    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        max_model_len: int,
        speculative: SpeculativeConfig | None = None,
        draft_catches_up: bool = True,
    ):
        """`speculative`: propose tokens to decoding sequences (the workers' forward must be
        batch invariant: see `sluiceway.speculative`); None: plain decoding.
        `draft_catches_up`: a draft model's proposal first computes the draft's K/V for the
        tokens since the sequence's last one (False: the draft reads the model's K/V).

        `max_model_len` is the model's (or the user's) limit; `self.max_model_len` is
        that capped so that every sequence can always run again: at most the tokens the
        whole pool holds (a lone sequence never preempts itself forever) and, without
        chunked prefill, at most `max_num_batched_tokens` (a preempted sequence is
        recomputed in one step), as vLLM requires at start-up."""
        self.config = config
        self.block_manager = block_manager
        self.max_model_len = min(max_model_len, block_manager.num_blocks * block_manager.block_size)
        if not config.enable_chunked_prefill:
            self.max_model_len = min(self.max_model_len, config.max_num_batched_tokens)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._forgotten_seq_ids: list[int] = []  # to tell the workers in the next step
        self.num_preemptions = 0
        self.kv_usage = KvUsage()
        self._static = config.scheduling_policy == "static"
        self._priority = config.scheduling_policy == "priority"
        self._batch: set[int] = set()  # static: unfinished members of the current batch
        self._batch_parents: set[str] = set()  # static: parallel-sampling requests in it
        self._holding: list[Sequence] = []  # static: finished members keeping their blocks
        self._samples: dict[str, list[Sequence]] = {}  # parent request id -> its live samples
        self._slot_freed = False  # a sequence finished since the last step was built
        # tokens; 0: a prefill chunk is capped only by the step's budget
        self.long_prefill_token_threshold = config.resolved_long_prefill_token_threshold(
            max_model_len
        )
        self.speculative = speculative
        self.proposer = (  # (a draft_model's proposals: the workers')
            NgramProposer(speculative)
            if speculative is not None and speculative.method == "ngram"
            else None
        )
        self.pace = AdaptiveLength(speculative.num_speculative_tokens if speculative else 0)
        self.spec_decode = SpecDecodeCounts()
        # whether to speculate at all, per batch size: measured. A draft model that catches
        # up computes, in an explored step, every token its sequences made since their last
        # proposal (their prompts, for new ones): it is not tried again where plain won
        self.gate = SpeculationGate(
            draft_catches_up=draft_catches_up
            and speculative is not None
            and speculative.method == "draft_model"
        )
        self.guard = StreamGuard()  # and per step, whether each stream gains

    # -- queue changes ----------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Queues a new sequence, shorter than `max_model_len` (the engine's gate checks it)."""
        seq.status = SequenceStatus.WAITING
        if self._priority:
            self._queue_by_priority(seq)
        else:
            self.waiting.append(seq)
        self._join_parent(seq)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Ends `seq` (done or aborted) and frees its blocks at once. Idempotent.

        Under the static policy a member that finishes normally keeps its
        blocks until the last member of its batch finishes.
        """
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self._slot_freed = True
        self._forget(seq)
        self._leave_parent(seq)
        if not self._static:
            self.block_manager.free(seq)
            return
        self._batch.discard(seq.seq_id)
        if reason == inference_pb2.FINISH_REASON_ABORT:
            self.block_manager.free(seq)
        else:
            self._holding.append(seq)
        if not self._batch:
            self._release_holding()

    def detach(self, seq: Sequence) -> None:
        """Gives running `seq` up to another scheduler (disaggregated prefill: its prompt's
        K/V have been copied to a decode worker): frees its blocks here (full ones stay in the
        prefix cache) and has this worker forget it. Its tokens are kept; its status is for
        the scheduler that takes it over to set."""
        self.running.remove(seq)
        self._forget(seq)
        self._leave_parent(seq)
        self.block_manager.free(seq)

    def admit_prefilled(
        self, seq: Sequence, block_ids: list[int], num_computed_tokens: int
    ) -> None:
        """Takes over `seq`, whose first `num_computed_tokens` tokens' K/V were copied into
        `block_ids` of this pool (from `block_manager.allocate_for_transfer`): it runs from the next
        step, announced to this worker as new, computing from `num_computed_tokens` on."""
        seq.block_table = list(block_ids)
        seq.num_computed_tokens = num_computed_tokens
        seq.num_tokens_on_worker = 0
        seq.status = SequenceStatus.RUNNING
        self.block_manager.register_hashes(seq)
        self.running.append(seq)

    def carry_counters_from(self, previous: Scheduler) -> None:
        """Continues the cumulative counters (prefix cache, preemptions, KV utilization sums)
        of the scheduler this one replaces when a worker registers again."""
        self.num_preemptions = previous.num_preemptions
        self.kv_usage.tokens_stored_total = previous.kv_usage.tokens_stored_total
        self.kv_usage.slots_allocated_total = previous.kv_usage.slots_allocated_total
        self.block_manager.prefix_cache_queries = previous.block_manager.prefix_cache_queries
        self.block_manager.prefix_cache_hits = previous.block_manager.prefix_cache_hits
        self.spec_decode = previous.spec_decode

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._forgotten_seq_ids)

    # -- one step ---------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Picks the sequences and token counts of the next step and allocates their blocks."""
        out = SchedulerOutput()
        bm = self.block_manager
        preempted = self._schedule_running(out)
        budget = self.config.max_num_batched_tokens - out.num_batched_tokens
        cfg = self.config
        # partial prefills scheduled so far, and the long ones
        num_partial = sum(not s.samples for s in out.scheduled)
        num_long = sum(not s.samples and self._is_long(self._remaining(s)) for s in out.scheduled)

        if self._static and not self._batch and self.waiting:
            members = list(self.waiting)[: self.config.static_batch_size]
            self._batch = {s.seq_id for s in members}
            self._batch_parents = {s.parent_request_id for s in members if s.parent_request_id}
        if self._batch_parents:  # static: a request's samples run in one batch, however they came
            for s in self.waiting:
                if s.parent_request_id in self._batch_parents:
                    self._batch.add(s.seq_id)
        index = 0  # into waiting: samples that wait for a sibling's prompt are passed over
        while (
            index < len(self.waiting)
            and not preempted
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
            and (not self._static or self.waiting[index].seq_id in self._batch)
        ):
            seq = self.waiting[index]
            if self._waits_for_sibling(seq):
                index += 1
                continue
            cached = bm.find_cached_prefix(seq)
            remaining = seq.num_tokens - cached.num_tokens
            num_new = self._chunk(remaining, budget)
            partial = num_new < remaining
            if partial and not cfg.enable_chunked_prefill:
                break
            long = self._is_long(remaining)
            if partial and (
                num_partial >= cfg.max_num_partial_prefills
                or (long and num_long >= cfg.max_long_partial_prefills)
            ):
                index += 1  # passed over for this step; a shorter one behind it may fit
                continue
            new_blocks = bm.allocate_slots(seq, num_new, cached)
            if new_blocks is None:
                if not self._holding:
                    break
                self._release_holding()  # static: a member waits on its batch's padding
                continue
            del self.waiting[index]
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(self._schedule(seq, num_new, new_blocks))
            budget -= num_new
            if partial:
                num_partial += 1
                num_long += long

        out.finished_seq_ids = self._forgotten_seq_ids
        self._forgotten_seq_ids = []
        return out

    def apply_sampled(
        self, output: SchedulerOutput, sampled: Mapping[int, int | list[int]]
    ) -> list[TokenUpdate]:
        """Advances every scheduled sequence and appends its sampled tokens.

        `sampled` maps seq_id to the token the worker sampled for it, or, for a chunk with
        proposed tokens, the tokens it emitted in order (the accepted proposals, then the
        token it sampled after them). A sequence aborted while the step ran is skipped.
        Blocks filled by the step join the prefix cache. Sequences that hit a stop token,
        `max_tokens` or `max_model_len` finish here, at the first such token (the tokens
        after it are dropped, as plain decoding never computes them). Raises KeyError if a
        sequence that should have sampled has no token.
        """
        updates: list[TokenUpdate] = []
        advanced = output.advanced
        for s in output.scheduled:
            seq = s.seq
            if seq.status is not SequenceStatus.RUNNING:
                continue
            if not s.samples:
                if not advanced:
                    seq.num_computed_tokens += s.num_new_tokens
                self.block_manager.cache_full_blocks(seq, s.num_computed_tokens + s.num_new_tokens)
                continue  # a prompt chunk that did not reach the end
            got = sampled[seq.seq_id]
            tokens = [got] if isinstance(got, int) else list(got)
            drafts, num_drafts = s.draft_token_ids, s.num_drafts
            if not 1 <= len(tokens) <= num_drafts + 1 or (
                drafts and tokens[:-1] != drafts[: len(tokens) - 1]
            ):
                raise ValueError(f"sequence {seq.seq_id}: tokens {tokens} do not follow the "
                                 f"proposal {drafts or num_drafts}")  # fmt: skip
            if num_drafts:
                self.spec_decode.add(num_drafts, len(tokens) - 1)
                self.pace.record(seq.seq_id, num_drafts, len(tokens) - 1)
            if advanced:
                seq.num_pending_tokens -= 1
            reason = None
            applied = 0
            for token in tokens:
                seq.output_token_ids.append(token)
                updates.append(TokenUpdate(seq, token))
                applied += 1
                reason = self._finish_reason(seq, token)
                if reason is not None:
                    break
            # computed: the chunk's positions whose input was right (its own tokens, then the
            # accepted proposals; rejected positions' K/V are overwritten when recomputed)
            computed = s.num_new_tokens - num_drafts + applied - 1
            if not advanced:
                seq.num_computed_tokens += computed
            self.block_manager.cache_full_blocks(seq, s.num_computed_tokens + computed)
            if reason is not None:
                self.finish(seq, reason)
        self._sample_kv_usage()
        return updates

    def advance(self, output: SchedulerOutput) -> None:
        """Counts step `output` as computed before its tokens come (async scheduling: the
        next step is built while it runs): each share's positions join
        `num_computed_tokens`, and a share that samples leaves a pending token, which the
        next step decodes (`append_last_sampled`) and `apply_sampled` then resolves. Raises
        ValueError for a step with proposed tokens (how many are computed depends on the
        answer)."""
        for s in output.scheduled:
            if s.num_drafts:
                raise ValueError("a step with proposed tokens cannot be advanced")
            s.seq.num_computed_tokens += s.num_new_tokens
            s.seq.num_pending_tokens += s.samples
        output.advanced = True

    # -- helpers ----------------------------------------------------------------

    def _schedule_running(self, out: SchedulerOutput) -> bool:
        """Gives each running sequence, in admission order, its next token or prompt chunk
        within the step's token budget, preempting (`_victim`) while one needs a block and
        none is free. Appends their shares to `out`; returns whether any was preempted."""
        bm = self.block_manager
        budget = self.config.max_num_batched_tokens
        preempted = False
        i = 0
        spec = self.speculative
        on = spec is not None and spec.allows(len(self.running)) and not self._prefill_due()
        self._slot_freed = False
        if on:
            on = out.speculating = self.gate.choose(len(self.running))
        proposals: dict[int, Proposal] | None = {}
        if on:
            proposals = step_proposals(self.running, budget, self.pace, self.proposer,
                                       self.guard, self.max_model_len)  # fmt: skip
        if proposals is None:  # the guard's: a plain step, which the gate does not weigh
            out.speculating, out.guarded, proposals = False, True, {}
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.num_pending_tokens and self._ends_at_pending(seq):
                i += 1  # its pending token is its last: nothing to compute
                continue
            remaining = seq.num_tokens_with_pending - seq.num_computed_tokens
            num_new = self._chunk(remaining, budget)
            drafts, n = proposals.get(seq.seq_id, ([], 0))
            if n and (new_blocks := bm.allocate_slots(seq, 1 + n)) is not None:
                out.scheduled.append(self._schedule(seq, 1 + n, new_blocks, drafts, n))
                budget -= 1 + n
                i += 1
                continue  # (no block for the proposal: plain decoding, below)
            while (new_blocks := bm.allocate_slots(seq, num_new)) is None:
                if self._holding:  # static: padding gives way before a live member does
                    self._release_holding()
                    continue
                victim = self._victim()
                if self._priority and self.running.index(victim) < i:  # has its share
                    budget += self._unschedule(out, victim)
                    i -= 1
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                out.scheduled.append(self._schedule(seq, num_new, new_blocks))
                budget -= num_new
                i += 1
                continue
            break  # seq preempted itself: no other running sequence was a victim before it
        return preempted

    def _prefill_due(self) -> bool:
        """Whether the next step may compute a prompt chunk, or the one after it: a running
        sequence's prompt is not all computed (a chunked or recomputed one), a sequence waits
        and the batch has room, or a sequence finished since the last step (a freed slot is
        mostly filled at once: a client with more requests, an agent's next call, a
        benchmark at fixed concurrency; its prompt comes while this step runs and waits it
        out). Such a step does not speculate: its proposals' draft forwards and verifying
        rows would lengthen the step that holds or delays the new prompt (its TTFT) and the
        step of every other stream, in the steps the gate does not measure (at 4 streams
        with a draft model, ShareGPT replies under 10 tokens ended 1.6x later, their TTFT
        1.6x; with the waiting rule alone TTFT P50 was still 1.18x plain decoding's)."""
        if self._slot_freed or (self.waiting and len(self.running) < self.config.max_num_seqs):
            return True
        return any(s.num_tokens_with_pending - s.num_computed_tokens > 1 for s in self.running)

    def _victim(self) -> Sequence:
        """The running sequence to preempt: the most recently admitted, or under the priority
        policy the one with the largest (priority, arrival) (vLLM v1's choice)."""
        if not self._priority:
            return self.running[-1]
        return max(self.running, key=_priority_key)

    def _unschedule(self, out: SchedulerOutput, seq: Sequence) -> int:
        """Takes `seq`'s share of this step out of `out` (it is to be preempted): the worker
        keeps the record it had before the step. Returns the share's tokens."""
        index = next(j for j, s in enumerate(out.scheduled) if s.seq is seq)
        share = out.scheduled.pop(index)
        seq.num_tokens_on_worker -= len(share.appended_token_ids) + share.append_last_sampled
        return share.num_new_tokens

    def _queue_by_priority(self, seq: Sequence) -> None:
        """Inserts waiting `seq` at its place in (priority, arrival) order, after its equals."""
        bisect.insort_right(self.waiting, seq, key=_priority_key)

    @staticmethod
    def _remaining(s: ScheduledSequence) -> int:
        """Tokens `s.seq` had left to compute before this step."""
        return s.seq.num_tokens_with_pending - s.num_computed_tokens

    def _ends_at_pending(self, seq: Sequence) -> bool:
        """Whether `seq`'s pending tokens reach `max_tokens` or `max_model_len`: it
        finishes when they come, whatever they are."""
        num_output = len(seq.output_token_ids) + seq.num_pending_tokens
        return (
            num_output >= seq.sampling.max_tokens
            or seq.num_tokens_with_pending >= self.max_model_len
        )

    def _chunk(self, remaining: int, budget: int) -> int:
        """Tokens to compute this step for a sequence with `remaining` uncomputed tokens:
        at most `budget`, and at most the threshold for a long prefill."""
        if self._is_long(remaining):
            remaining = self.long_prefill_token_threshold
        return min(remaining, budget)

    def _is_long(self, remaining: int) -> bool:
        """Whether `remaining` uncomputed tokens make a long prefill (vLLM's rule: more than
        a nonzero `long_prefill_token_threshold`)."""
        return 0 < self.long_prefill_token_threshold < remaining

    def _schedule(
        self,
        seq: Sequence,
        num_new: int,
        new_blocks: list[int],
        drafts: list[int] | None = None,
        num_drafts: int = 0,
    ) -> ScheduledSequence:
        """`seq`'s share of the step, its blocks allocated (`new_blocks` the fresh ones);
        `num_drafts` proposed tokens: `drafts`, or when that is empty the draft model's."""
        is_new = seq.num_tokens_on_worker == 0
        appended = seq.token_ids[seq.num_tokens_on_worker :]
        seq.num_tokens_on_worker = seq.num_tokens_with_pending
        return ScheduledSequence(
            seq=seq,
            is_new=is_new,
            appended_token_ids=appended,
            num_computed_tokens=seq.num_computed_tokens,
            num_new_tokens=num_new,
            new_block_ids=list(seq.block_table) if is_new else new_blocks,
            draft_token_ids=drafts or [],
            append_last_sampled=seq.num_pending_tokens > 0,
            num_draft_model_tokens=0 if drafts else num_drafts,
        )

    def _waits_for_sibling(self, seq: Sequence) -> bool:
        """Whether waiting `seq`, a sample of a parallel-sampling request with no output yet,
        is to wait for a running sibling computing their prompt: until one has computed the
        prompt's tokens a prefix-cache hit can give, which the cache then gives `seq`. Never
        with prefix caching off, nor for a prompt without a full block to share."""
        parent = seq.parent_request_id
        if parent is None or seq.output_token_ids or seq.wants_prompt_logprobs:
            return False  # (a sample owing prompt logprobs computes its prompt anyway)
        num_shared = self.block_manager.max_cached_prefix_tokens(len(seq.prompt_token_ids))
        if num_shared == 0:
            return False
        computing = False
        for sibling in self._samples.get(parent, ()):
            if sibling is seq or sibling.status is not SequenceStatus.RUNNING:
                continue
            if sibling.prompt_token_ids != seq.prompt_token_ids:
                continue  # not a sample of the same request (a router would not do this)
            # its blocks hashed (cached) so far: with async scheduling `num_computed_tokens`
            # also counts a step still running
            if len(sibling.block_hashes) * self.block_manager.block_size >= num_shared:
                return False  # cached: take them now
            computing = True
        return computing

    def _join_parent(self, seq: Sequence) -> None:
        if seq.parent_request_id is not None:
            samples = self._samples.setdefault(seq.parent_request_id, [])
            if seq not in samples:
                samples.append(seq)

    def _leave_parent(self, seq: Sequence) -> None:
        parent = seq.parent_request_id
        if parent is None:
            return
        samples = self._samples.get(parent)
        if samples is not None and seq in samples:
            samples.remove(seq)
            if not samples:
                del self._samples[parent]

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        self._forget(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        if self._priority:
            self._queue_by_priority(seq)
        else:
            self.waiting.appendleft(seq)

    def _release_holding(self) -> None:
        for held in self._holding:
            self.block_manager.free(held)
        self._holding.clear()

    def _forget(self, seq: Sequence) -> None:
        """Resets `seq`'s progress and has the workers drop their record of it."""
        seq.num_computed_tokens = 0
        seq.num_pending_tokens = 0  # (a step in flight samples it: dropped when it comes)
        if self.proposer is not None:
            self.proposer.forget(seq.seq_id)
        self.pace.forget(seq.seq_id)
        self.guard.forget(seq.seq_id)
        if seq.wants_prompt_logprobs:
            seq.prompt_logprobs.clear()  # computed again with the prompt
        if seq.num_tokens_on_worker:
            self._forgotten_seq_ids.append(seq.seq_id)
            seq.num_tokens_on_worker = 0

    def _finish_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        sampling = seq.sampling
        if token in seq.stop_token_ids and len(seq.output_token_ids) >= sampling.min_tokens:
            return inference_pb2.FINISH_REASON_STOP
        if len(seq.output_token_ids) >= sampling.max_tokens or seq.num_tokens >= self.max_model_len:
            return inference_pb2.FINISH_REASON_LENGTH
        return None

    def _sample_kv_usage(self) -> None:
        bm = self.block_manager
        bs = bm.block_size
        full: set[int] = set()  # shared prefix blocks count once
        partial = 0
        for seq in self.running:
            n = seq.num_computed_tokens
            full.update(seq.block_table[: n // bs])
            partial += n % bs
        stored = len(full) * bs + partial
        slots = (bm.num_blocks - bm.num_free_blocks) * bs
        usage = self.kv_usage
        usage.utilization = stored / slots if slots else 0.0
        usage.tokens_stored_total += stored
        usage.slots_allocated_total += slots


def _priority_key(seq: Sequence) -> tuple[int, float, int]:
    """The priority policy's order: lower priority value first, then earlier arrival (then
    the lower seq_id, for two arrivals at one clock reading)."""
    return (seq.priority, seq.arrival_time, seq.seq_id)
