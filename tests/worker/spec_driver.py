"""A scheduler and a worker in one process, without gRPC: the step loop's own translation
(`build_step_request`) to the worker's `StepExecutor` and back, for tests that compare the
tokens of whole generations (speculative decoding, async scheduling, against plain decoding
in the synchronous loop)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sluiceway.internal.v1 import worker_pb2
from sluiceway.sampling_params import SamplingParams
from sluiceway.scheduler.block_manager import BlockManager
from sluiceway.scheduler.config import SchedulerConfig
from sluiceway.scheduler.scheduler import Scheduler, SchedulerOutput
from sluiceway.scheduler.sequence import Sequence as SchedSeq
from sluiceway.scheduler.sequence import SequenceStatus
from sluiceway.scheduler.step_loop import build_step_request
from sluiceway.worker.model_runner import ModelRunner
from sluiceway.worker.server import StepExecutor


@dataclass
class Generation:
    """Per request (in order): its output tokens, the chosen tokens' logprobs and finish
    reason; the steps that computed anything and the scheduler (its counters)."""

    tokens: list[list[int]]
    logprobs: list[list[float]]
    finish: list[int]
    num_steps: int
    scheduler: Scheduler
    num_sampled: int = 0  # tokens the worker sampled, those dropped after a finish included


def generate(
    runner: ModelRunner,
    prompts: Sequence[list[int]],
    params: Sequence[SamplingParams],
    *,
    speculative_config: str = "",
    num_blocks: int | None = None,
    samples: int = 1,
    resumed: Sequence[list[int]] | None = None,
    **config: object,
) -> Generation:
    """Runs every prompt to its end, all admitted at once (a scheduler of `config`'s flags over
    `num_blocks` blocks, default the runner's pool); `samples` > 1: each prompt is that many
    parallel samples of one request (their prompt shared through the prefix cache), the
    results in prompt order, samples together. `resumed`: per prompt, output tokens a stream
    resumed from a failed replica brings (the scheduler's `output_token_ids` at admission,
    as the engine takes them); the results hold them too. With `async_scheduling=True` in
    `config` each step is built while the one before it is still to run, in the order the
    step loop keeps (`StepLoop._send_next`): advance N, build and send N+1, run N, apply N."""
    cfg = SchedulerConfig(speculative_config=speculative_config, **config)  # type: ignore[arg-type]
    bm = BlockManager(num_blocks or runner.num_kv_blocks, runner.block_size)
    sched = Scheduler(cfg, bm, runner.max_model_len, cfg.speculative)
    executor = StepExecutor(runner)
    seqs = []
    requests = [(i, prompt, p) for i, (prompt, p) in enumerate(zip(prompts, params, strict=True))
                for _ in range(samples)]  # fmt: skip
    for i, (request, prompt, p) in enumerate(requests):
        resolved = p.resolve(
            prompt_len=len(prompt),
            max_model_len=sched.max_model_len,
            vocab_size=runner.vocab_size,
            eos_token_ids=runner.eos_token_ids,
        )
        seq = SchedSeq(
            seq_id=i,
            request_id=f"r{i}",
            prompt_token_ids=list(prompt),
            sampling=resolved,
            parent_request_id=f"p{request}" if samples > 1 else None,
            output_token_ids=list(resumed[request]) if resumed else [],
        )
        sched.add(seq)
        seqs.append(seq)
    logprobs: list[list[float]] = [[] for _ in seqs]
    steps = num_sampled = step_id = 0
    ahead: tuple[SchedulerOutput, worker_pb2.StepRequest] | None = None
    while ahead is not None or sched.has_work:
        if ahead is None:
            out = sched.schedule()
            step_id += 1
            request = build_step_request(step_id, out)
        else:
            (out, request), ahead = ahead, None
        if cfg.async_scheduling and out.scheduled:
            sched.advance(out)
            following = sched.schedule()
            if not following.is_empty:
                step_id += 1
                ahead = following, build_step_request(step_id, following, request.step_id)
        response = executor.execute(request)
        steps += bool(out.scheduled)
        num_sampled += len(response.sampled)
        sampled: dict[int, list[int]] = {}
        # (async: a sequence finished or preempted since the step was built drops its token)
        running = {s.seq.seq_id for s in out.scheduled if s.seq.status is SequenceStatus.RUNNING}
        for s in response.sampled:
            sampled.setdefault(s.seq_id, []).append(s.token_id)
            if s.seq_id in running:
                logprobs[s.seq_id].append(s.logprob)  # (past a finish: cut below)
        sched.apply_sampled(out, sampled)
    assert bm.num_free_blocks == bm.num_blocks, "a block was not given back"
    return Generation(
        [s.output_token_ids for s in seqs],
        [lp[: len(s.output_token_ids)] for lp, s in zip(logprobs, seqs, strict=True)],
        [s.finish_reason for s in seqs],
        steps,
        sched,
        num_sampled,
    )
