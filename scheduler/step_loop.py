"""One worker group's step loop: schedule, send one `ExecuteStep` to every rank, apply the tokens.

One asyncio task per worker group (scheduler/worker_group.py) in the scheduler process. Each
iteration builds a step (`Scheduler.schedule`), sends it with a watchdog bound, appends the
sampled tokens (`Scheduler.apply_sampled`) and puts each on its request's queue. A failed step
costs what its kind costs (scheduler/faults.py).

With `--async-scheduling` (vLLM v1's async scheduling) the loop builds and sends step N+1
while the worker runs step N (`Scheduler.advance` counts N as done, its sampled tokens
pending), so that the worker finds its next step waiting instead of waiting on the RPC, the
token updates and the scheduler; N+1 names N as the step to run first.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

import grpc
import structlog

from sluiceway.internal.v1 import scheduler_pb2, worker_pb2
from sluiceway.scheduler import metrics
from sluiceway.scheduler.faults import (
    IDLE_PROBE_INTERVAL_S,
    STEP_TIMEOUT_FLOOR_S,
    GroupFaults,
    is_step_fault,
)
from sluiceway.scheduler.requests import RequestTable
from sluiceway.scheduler.scheduler import Scheduler, SchedulerOutput
from sluiceway.scheduler.worker_group import WorkerGroup
from sluiceway.status import error_from_rpc
from sluiceway.v1 import inference_pb2

__all__ = ["StepLoop", "StepTimeTotals", "build_step_request", "step_timeout_s"]

log = structlog.get_logger("scheduler")

# The step watchdog: a step not answered within step_timeout_s(step) seconds means a hung
# worker (SIGSTOPped, deadlocked, swapping to a halt). The bound grows with the step's size:
# STEP_TIMEOUT_FLOOR_S + STEP_TIMEOUT_PER_TOKEN_S * batched tokens + STEP_TIMEOUT_PER_SEQ_S
# * sequences + STEP_TIMEOUT_PER_ATTENDED_S * attended (query, key) pairs, so that only a
# worker that stopped answering trips it, never a slow one. Measured on 2 CPU cores
# (SmolLM2): a decode step of 200 sequences 100 ms (0.5 ms a sequence), prefill 0.5-1.6 ms a
# token (README; 2026-12-03, a host at half its usual speed: a 2,048-token prompt 3.3-3.9 s);
# the constants allow 6-30x that, and 10 s for any step. Attention's work grows with the
# context: an 8,191-token prompt's four chunks took 33-37 s there (the last ~16 s), 18-24 s
# more than four chunks from position 0, ~0.8 us per added pair; 5 us allows ~6x. Before the
# pairs' term such a prompt's last chunk (30.5 s allowed) timed out on a starved machine. A
# 2,048-token step from position 0 now gets 10 + 20.5 + 21 = 51.5 s, the last chunk of
# 8,191 tokens 114.4 s, a decode step of 200 sequences at context 320 14.3 s.
STEP_TIMEOUT_PER_TOKEN_S = 0.01
STEP_TIMEOUT_PER_SEQ_S = 0.01
STEP_TIMEOUT_PER_ATTENDED_S = 5e-6


def emitted_per_sequence(out: SchedulerOutput, response: worker_pb2.StepResponse) -> list[int]:
    """The tokens each scheduled sequence of `out` emitted in its answer, in `out.scheduled`'s
    order (0 for a prompt chunk that does not sample; 1 + accepted drafts when speculating)."""
    per_seq = Counter(t.seq_id for t in response.sampled)
    return [per_seq[s.seq.seq_id] for s in out.scheduled]


def log_step(step: SentStep, response: worker_pb2.StepResponse, execute_s: float) -> None:
    """One debug `step` event for a step that computed: its worker time (`ms`, sent to
    answered), its rows (`rows`, of which `prompt_rows` are prompt chunks: a prefill share),
    and per sequence (`seq_ids`, the scheduler's) the tokens it emitted (`emitted`);
    `speculating` and `guarded` as the gate and the guard chose (None without a speculative
    config). scripts/step_attribution.py reads these to split a request's latency into
    the steps it waited on."""
    out = step.out
    log.debug(
        "step",
        step_id=step.step_id,
        ms=round(1e3 * execute_s, 2),
        rows=out.num_batched_tokens,
        prompt_rows=sum(s.num_new_tokens for s in out.scheduled if s.is_prompt_chunk),
        seq_ids=[s.seq.seq_id for s in out.scheduled],
        emitted=emitted_per_sequence(out, response),
        speculating=out.speculating,
        guarded=out.guarded,
    )


def step_timeout_s(out: SchedulerOutput) -> float:
    """The watchdog's bound on one step, seconds (see STEP_TIMEOUT_PER_ATTENDED_S). A
    sequence's chunk of n tokens after c computed ones attends to n * (c + n) pairs at most
    (a sliding window attends to fewer: the bound stays an upper one)."""
    attended = sum(s.num_new_tokens * (s.num_computed_tokens + s.num_new_tokens)
                   for s in out.scheduled)  # fmt: skip
    return (
        STEP_TIMEOUT_FLOOR_S
        + STEP_TIMEOUT_PER_TOKEN_S * out.num_batched_tokens
        + STEP_TIMEOUT_PER_SEQ_S * len(out.scheduled)
        + STEP_TIMEOUT_PER_ATTENDED_S * attended
    )


@dataclass(slots=True)
class SentStep:
    """A step sent to the workers: its scheduler, what it holds, the task awaiting the
    answer; `t0` when its building began, `sent` when it was sent, `t1` when the workers
    could start it: `sent`, or when the step before it was answered if that was later (the
    step-time figures: build = sent - t0, execute = answer - t1)."""

    sched: Scheduler
    out: SchedulerOutput
    step_id: int
    timeout_s: float
    task: asyncio.Task[worker_pb2.StepResponse | None]
    t0: float
    sent: float
    t1: float


@dataclass(slots=True)
class StepTimeTotals:
    """Seconds the step loops spent in each phase, summed over `num_steps` steps.

    Sent as `sluiceway.v1.StepTimes`; the worker's share comes from its `StepResponse`, so
    execute - worker_step is RPC and (de)serialization.
    """

    num_steps: int = 0
    schedule_s: float = 0.0
    execute_s: float = 0.0
    worker_step_s: float = 0.0
    worker_prepare_s: float = 0.0
    worker_forward_s: float = 0.0
    worker_sample_s: float = 0.0
    apply_s: float = 0.0

    def add_worker(self, response: worker_pb2.StepResponse) -> None:
        self.worker_step_s += response.step_seconds
        self.worker_prepare_s += response.prepare_seconds
        self.worker_forward_s += response.forward_seconds
        self.worker_sample_s += response.sample_seconds

    def to_proto(self) -> inference_pb2.StepTimes:
        return inference_pb2.StepTimes(
            num_steps_total=self.num_steps,
            schedule_seconds_total=self.schedule_s,
            execute_seconds_total=self.execute_s,
            worker_step_seconds_total=self.worker_step_s,
            worker_prepare_seconds_total=self.worker_prepare_s,
            worker_forward_seconds_total=self.worker_forward_s,
            worker_sample_seconds_total=self.worker_sample_s,
            apply_seconds_total=self.apply_s,
        )


def token_logprobs(sampled: worker_pb2.SampledToken) -> inference_pb2.TokenLogprobs:
    """The public form of a sampled token's log-probabilities."""
    return inference_pb2.TokenLogprobs(
        token_id=sampled.token_id,
        logprob=sampled.logprob,
        top_logprobs=[
            inference_pb2.TopLogprob(token_id=t, logprob=lp)
            for t, lp in zip(sampled.top_token_ids, sampled.top_logprobs, strict=True)
        ],
    )


def add_prompt_logprobs(out: SchedulerOutput, chunks: Iterable[worker_pb2.PromptLogprobs]) -> None:
    """Appends each chunk's prompt logprobs to its sequence (chunks of one prompt come in
    prompt order, one step after another); a chunk that does not continue what the sequence
    holds (it was preempted while the step ran, say) is dropped."""
    seqs = {s.seq.seq_id: s.seq for s in out.scheduled}
    for chunk in chunks:
        seq = seqs.get(chunk.seq_id)
        if seq is None or not seq.wants_prompt_logprobs:
            continue
        if chunk.first_token_index == len(seq.prompt_logprobs) + 1:
            seq.prompt_logprobs.extend(chunk.logprobs)


def build_step_request(
    step_id: int, out: SchedulerOutput, previous_step_id: int = 0
) -> worker_pb2.StepRequest:
    """Translates a `SchedulerOutput` into the wire message of one step (`previous_step_id`:
    the step sent before it still running, async scheduling)."""
    req = worker_pb2.StepRequest(
        step_id=step_id, finished_seq_ids=out.finished_seq_ids, previous_step_id=previous_step_id
    )
    for s in out.scheduled:
        if s.is_new:
            sampling = s.seq.sampling.to_proto()
            if not s.seq.wants_prompt_logprobs:  # none, or sent before a preemption
                sampling.ClearField("prompt_logprobs")
            req.new_sequences.append(
                worker_pb2.NewSequence(
                    seq_id=s.seq.seq_id,
                    prompt_token_ids=s.appended_token_ids,
                    sampling=sampling,
                    request_id=s.seq.request_id,
                    num_prompt_tokens=len(s.seq.prompt_token_ids),
                )
            )
        scheduled = worker_pb2.ScheduledSequence(
            seq_id=s.seq.seq_id,
            appended_token_ids=[] if s.is_new else s.appended_token_ids,
            num_computed_tokens=s.num_computed_tokens,
            num_new_tokens=s.num_new_tokens,
            new_block_ids=s.new_block_ids,
            draft_token_ids=s.draft_token_ids,
            append_last_sampled=s.append_last_sampled,
            num_draft_model_tokens=s.num_draft_model_tokens,
        )
        req.scheduled.append(scheduled)
    return req


class StepLoop:
    """The loop of one worker group. `after_step` runs after every applied step (a prefill
    group's hand-off to the decode groups); `model_id` names the model in the metrics."""

    def __init__(
        self,
        group: WorkerGroup,
        requests: RequestTable,
        faults: GroupFaults,
        step_ids: itertools.count[int],
        times: StepTimeTotals,
        model_id: Callable[[], str],
        after_step: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.group = group
        self.requests = requests
        self.faults = faults
        self.step_ids = step_ids
        self.times = times
        self.model_id = model_id
        self.after_step = after_step

    async def run(self) -> None:
        """Runs until cancelled: steps while there is work, probes the workers while idle."""
        group = self.group
        await group.ready.wait()
        ahead: SentStep | None = None  # built and sent while the step before it ran
        try:
            while True:
                sched = group.scheduler
                assert sched is not None
                if ahead is not None and ahead.sched is sched:
                    step, ahead = ahead, None
                else:  # (one a replaced scheduler sent answers None: dropped)
                    ahead = None
                    if not sched.has_work:
                        group.wakeup.clear()
                        try:
                            await asyncio.wait_for(group.wakeup.wait(), IDLE_PROBE_INTERVAL_S)
                        except TimeoutError:
                            await self.faults.probe_idle(group)
                        continue
                    t0 = time.perf_counter()
                    out = self._schedule(sched)
                    if out.is_empty:
                        # Nothing fits right now (e.g. every block held by a step in flight);
                        # wait for an abort or a new request to change that.
                        group.wakeup.clear()
                        await group.wakeup.wait()
                        continue
                    step = self._send(sched, out, t0)
                if sched.config.async_scheduling:  # (the config refuses what it cannot serve)
                    ahead = self._send_next(sched, step)
                await self._finish(sched, step, ahead)
        finally:
            if ahead is not None:
                ahead.task.cancel()

    def _send_next(self, sched: Scheduler, running: SentStep) -> SentStep | None:
        """Counts `running` as done, then builds and sends the step after it, named to run
        after it; None when there is nothing to send."""
        sched.advance(running.out)
        t0 = time.perf_counter()
        out = self._schedule(sched)
        if out.is_empty:
            return None
        return self._send(sched, out, t0, previous=running)

    def _send(
        self, sched: Scheduler, out: SchedulerOutput, t0: float, previous: SentStep | None = None
    ) -> SentStep:
        """Sends `out` to the workers (after `previous`, which they run first: its own
        watchdog bound is added to this one's; not its whole wait, which covers the step
        before it, answered by now: the bounds would add up over every step)."""
        t1 = time.perf_counter()  # (building the request counts as the RPC's, as before)
        step_id = next(self.step_ids)
        timeout_s = step_timeout_s(out) + (step_timeout_s(previous.out) if previous else 0.0)
        request = build_step_request(step_id, out, previous.step_id if previous else 0)
        task = asyncio.create_task(self._execute(sched, out, request, timeout_s))
        return SentStep(sched, out, step_id, timeout_s, task, t0, t1, t1)

    async def _finish(self, sched: Scheduler, step: SentStep, ahead: SentStep | None) -> None:
        """Awaits `step`'s answer and applies it (the step after it, `ahead`, is running)."""
        response = await step.task
        if response is None:
            return
        t2 = time.perf_counter()
        if ahead is not None:
            ahead.t1 = max(ahead.t1, t2)
        decode_only = step.out.is_decode_only  # (before the step's tokens are applied)
        self._apply(sched, step.out, response)
        if decode_only and not step.out.advanced and step.out.speculating is not None:
            # the tokens each sequence emitted, and the step's time: the speculation gate's measure
            emitted = emitted_per_sequence(step.out, response)
            seconds = t2 - step.t1
            seq_ids = [s.seq.seq_id for s in step.out.scheduled]
            sched.guard.observe(seq_ids, emitted, step.out.num_batched_tokens, seconds)
            # (a guarded step: the gate chose to speculate, so a plain one is not its measure)
            if not step.out.guarded and sched.gate.observe(step.out.speculating, emitted, seconds):
                log.info(
                    "speculation_switched",
                    group=self.group.name,
                    batch=len(emitted),
                    speculating=step.out.speculating,
                )
        self._record(step, response, t2)
        if self.after_step is not None:
            await self.after_step()

    def _schedule(self, sched: Scheduler) -> SchedulerOutput:
        preemptions = sched.num_preemptions
        out = sched.schedule()
        if sched.num_preemptions > preemptions:
            log.info(
                "preempted",
                group=self.group.name,
                num_preemptions=sched.num_preemptions - preemptions,
                num_free_kv_blocks=sched.block_manager.num_free_blocks,
                num_waiting=len(sched.waiting),
            )
        now = time.monotonic()
        for s in out.scheduled:
            if s.seq.first_scheduled_time is None:
                s.seq.first_scheduled_time = now
        return out

    async def _execute(
        self,
        sched: Scheduler,
        out: SchedulerOutput,
        request: worker_pb2.StepRequest,
        timeout_s: float,
    ) -> worker_pb2.StepResponse | None:
        """Runs the step on every rank; None when it failed (the fault handled by its kind)
        or when a rank registered again while it ran (the group has failed those sequences)."""
        group = self.group
        try:
            response = await asyncio.wait_for(group.execute(request), timeout_s)
        except TimeoutError:
            if sched is group.scheduler:
                log.error("step_timed_out", group=group.name, timeout_s=round(timeout_s, 3),
                          num_seqs=len(out.scheduled))  # fmt: skip
                await self.faults.stall(
                    group, f"the worker did not answer a step within {timeout_s:.1f} s"
                )
            return None
        except grpc.aio.AioRpcError as e:
            if sched is not group.scheduler:
                return None  # a rank re-registered while the step ran: it has failed those
            # the details (gRPC's transport text, the worker's address) only in the log:
            # the reason reaches clients
            log.error("step_failed", group=group.name, error=f"{e.code().name}: {e.details()}")
            if is_step_fault(e):
                self.faults.fail_step(group, out, error_from_rpc(e))
            else:
                await self.faults.lose(group, f"the worker failed a step ({e.code().name})")
            return None
        return response if sched is group.scheduler else None

    def _apply(
        self, sched: Scheduler, out: SchedulerOutput, response: worker_pb2.StepResponse
    ) -> None:
        """Appends the step's sampled tokens and sends each to its request's stream."""
        by_seq: dict[int, list[worker_pb2.SampledToken]] = {}
        for s in response.sampled:  # a sequence with proposed tokens: each emitted, in order
            by_seq.setdefault(s.seq_id, []).append(s)
        sampled = {seq_id: [s.token_id for s in tokens] for seq_id, tokens in by_seq.items()}
        if response.prompt_logprobs:
            add_prompt_logprobs(out, response.prompt_logprobs)
        updates = sched.apply_sampled(out, sampled)
        applied = Counter(u.seq.seq_id for u in updates)
        index: dict[int, int] = {}  # the update's place among its sequence's tokens
        for update in updates:
            seq = update.seq
            i = index[seq.seq_id] = index.get(seq.seq_id, -1) + 1
            if not self.requests.is_live(seq):
                continue
            last = i == applied[seq.seq_id] - 1  # the finish reason goes with the last one
            event = scheduler_pb2.TokenEvent(
                token_ids=[update.token_id],
                finish_reason=seq.finish_reason
                if last
                else inference_pb2.FINISH_REASON_UNSPECIFIED,
            )
            if seq.sampling.logprobs is not None:
                event.logprobs.append(token_logprobs(by_seq[seq.seq_id][i]))
            if len(seq.output_token_ids) == 1 and seq.prompt_logprobs:
                event.prompt_logprobs.extend(seq.prompt_logprobs)
                seq.prompt_logprobs = []
            if len(seq.output_token_ids) == 1 and seq.first_scheduled_time is not None:
                event.queue_seconds = seq.first_scheduled_time - seq.arrival_time
            self.requests.send(seq, event)

    def _record(self, step: SentStep, response: worker_pb2.StepResponse, t2: float) -> None:
        """Adds one step (answered at t2) to the totals and, when it computed anything (not
        only told the workers to forget finished sequences), to the histograms."""
        out, build_s, execute_s = step.out, step.sent - step.t0, t2 - step.t1
        times = self.times
        times.num_steps += 1
        times.schedule_s += build_s
        times.execute_s += execute_s
        times.apply_s += time.perf_counter() - t2
        times.add_worker(response)
        if not out.scheduled:
            return
        if log.is_enabled_for(logging.DEBUG):  # (not built otherwise: every step passes here)
            log_step(step, response, execute_s)
        model = self.model_id()
        metrics.SCHEDULER_STEP_SECONDS.labels(model).observe(build_s)
        metrics.MODEL_STEP_SECONDS.labels(model).observe(execute_s)
        metrics.BATCH_SIZE.labels(model).observe(len(out.scheduled))
        metrics.BATCHED_TOKENS.labels(model).observe(out.num_batched_tokens)
