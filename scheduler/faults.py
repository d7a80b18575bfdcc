"""Worker faults by kind, and what each costs.

- **A step the worker refused** with a status it chose (a sluiceway server's `abort`, or a
  code no transport produces: INVALID_ARGUMENT, FAILED_PRECONDITION, OUT_OF_RANGE,
  RESOURCE_EXHAUSTED): the step's requests end with that status (its field included) and the
  group serves on; the workers forget those sequences at the next step.
- **A worker gone** (UNAVAILABLE: connection refused or reset, or a worker's own "tensor-parallel
  group broken"; or a failure no sluiceway server chose: UNKNOWN, an unmarked INTERNAL): every
  request the group holds ends with UNAVAILABLE and the group waits for the rank to register
  again (`lose`).
- **A worker that does not answer** (a step past the watchdog's bound, an idle probe past its
  deadline): every request the group holds ends with UNAVAILABLE, and the group serves again
  once every rank answers (`stall`), or as a lost one if a rank is found gone meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import structlog

from sluiceway.scheduler.requests import RequestTable
from sluiceway.scheduler.scheduler import SchedulerOutput
from sluiceway.scheduler.worker_group import WorkerGroup
from sluiceway.status import RequestError, written_by_sluiceway
from sluiceway.v1 import inference_pb2

__all__ = [
    "IDLE_PROBE_INTERVAL_S",
    "IDLE_PROBE_TIMEOUT_S",
    "STEP_TIMEOUT_FLOOR_S",
    "GroupFaults",
    "is_step_fault",
]

log = structlog.get_logger("scheduler")

# The step watchdog's floor (scheduler/step_loop.py), seconds: also how long an idle probe
# waits for an answer.
STEP_TIMEOUT_FLOOR_S = 10.0
# While idle, the step loop checks the worker still answers this often, seconds; one that is
# gone (UNAVAILABLE) is lost, one that does not answer within the floor is hung.
IDLE_PROBE_INTERVAL_S = 1.0
IDLE_PROBE_TIMEOUT_S = STEP_TIMEOUT_FLOOR_S

# Codes an application chooses and no gRPC transport produces.
_CHOSEN_CODES = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.RESOURCE_EXHAUSTED,  # also a step over the message size limit
    }
)
_UNAVAILABLE = grpc.StatusCode.UNAVAILABLE


def is_step_fault(error: grpc.aio.AioRpcError) -> bool:
    """Whether a failed `ExecuteStep` is the step's fault (its requests fail, the group serves
    on) rather than the worker's (the group is lost): see the module docstring."""
    code = error.code()
    if code in (_UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
        return False
    return code in _CHOSEN_CODES or written_by_sluiceway(error)


class GroupFaults:
    """Ends the requests a fault costs (through `requests`) and brings the group back."""

    def __init__(self, requests: RequestTable) -> None:
        self.requests = requests

    def fail_step(self, group: WorkerGroup, out: SchedulerOutput, error: RequestError) -> None:
        """Ends every request scheduled in `out` with `error` (their blocks come back); the
        group keeps serving the others."""
        sched = group.scheduler
        assert sched is not None
        for s in out.scheduled:
            if not s.seq.is_finished:
                sched.finish(s.seq, inference_pb2.FINISH_REASON_ABORT)
                self.requests.send(s.seq, error)
        group.wakeup.set()

    def fail_group(self, group: WorkerGroup, error: RequestError) -> None:
        """Ends every request `group` holds with `error` and frees its blocks."""
        sched = group.scheduler
        if sched is None:
            return
        for seq in [*sched.running, *sched.waiting]:
            sched.finish(seq, inference_pb2.FINISH_REASON_ABORT)
            self.requests.send(seq, error)

    async def lose(self, group: WorkerGroup, reason: str) -> None:
        """A worker of `group` is gone: NOT_SERVING, every request the group holds ends with
        UNAVAILABLE(`reason`), new requests are refused; returns once the group is complete
        again."""
        group.lost_reason = f"{reason}; waiting for a worker"
        group.ready.clear()
        self.fail_group(group, RequestError(_UNAVAILABLE, reason))
        await group.ready.wait()

    async def stall(self, group: WorkerGroup, reason: str) -> None:
        """A worker of `group` does not answer (hung, SIGSTOPped): NOT_SERVING, every request
        the group holds ends with UNAVAILABLE(`reason`) (the router retries one that sent
        nothing elsewhere), new requests are refused. Unlike `lose`, the group comes back by
        itself: once every rank answers a health check again (SIGCONT), it serves again with
        the same pool (the sequences it held are finished, so the next step tells the workers
        to forget them); a worker found gone meanwhile, or one registering again, goes the way
        of a registration. Returns once the group is ready again."""
        sched = group.scheduler
        group.lost_reason = f"{reason}; waiting for it to answer"
        group.ready.clear()
        self.fail_group(group, RequestError(_UNAVAILABLE, reason))
        while not group.ready.is_set():
            try:
                await group.probe(IDLE_PROBE_TIMEOUT_S)
            except grpc.aio.AioRpcError as e:
                if e.code() == _UNAVAILABLE:  # it died: wait for a registration
                    group.lost_reason = f"{reason}, then became unreachable; waiting for a worker"
                    await group.ready.wait()
                    return
                with contextlib.suppress(TimeoutError):  # or it registered again meanwhile
                    await asyncio.wait_for(group.ready.wait(), IDLE_PROBE_INTERVAL_S)
                continue
            if group.scheduler is sched and not group.ready.is_set():
                log.info("worker_answers_again", group=group.name)
                group.lost_reason = ""
                group.ready.set()
                group.wakeup.set()

    async def probe_idle(self, group: WorkerGroup) -> None:
        """While no step runs, asks the group's ranks whether they are still there: a worker
        that died idle (UNAVAILABLE) is lost until it registers again; one that does not
        answer within IDLE_PROBE_TIMEOUT_S (hung, paused) is out until it answers (`stall`).
        Either is noticed within seconds, not at the next request's step."""
        if not group.ready.is_set():
            return
        sched = group.scheduler
        try:
            await group.probe(IDLE_PROBE_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            if sched is not group.scheduler:
                return
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                log.error("worker_not_answering", group=group.name, timeout_s=IDLE_PROBE_TIMEOUT_S)
                await self.stall(
                    group, f"the worker did not answer within {IDLE_PROBE_TIMEOUT_S:.0f} s"
                )
            elif e.code() == _UNAVAILABLE:  # gone: connection refused or reset
                log.error("worker_unreachable", group=group.name, code=e.code().name)
                await self.lose(group, f"the worker is unreachable ({e.code().name})")
