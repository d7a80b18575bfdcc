"""The benchmark's figures: vLLM's latency and throughput summary, the server's
KV-cache figures and the step-time breakdown, all from raw timings."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import numpy as np

from sluiceway.v1 import inference_pb2


@dataclass(slots=True)
class RequestResult:
    """Timings of one request, seconds since it was sent (since it arrived, for the
    `transformers` baseline, which queues requests itself)."""

    ok: bool
    prompt_len: int  # tokens
    output_len: int = 0  # tokens received
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)  # gaps between streamed chunks
    error: str = ""
    request_id: str = ""  # what the client sent (the server's logs name the request by it)


def percentile(values: list[float], q: float) -> float:
    """numpy's linear-interpolation percentile (as vLLM reports); 0.0 for no values."""
    return float(np.percentile(values, q)) if values else 0.0


def summarize(results: list[RequestResult], duration_s: float) -> dict[str, float]:
    """vLLM's benchmark figures: counts, throughputs (per second) and, for TTFT,
    TPOT ((E2E - TTFT) / (output tokens - 1)), ITL and E2E latency, the mean,
    median, P90 and P99 in milliseconds. Failed requests count only as failures."""
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_len for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    ttft = [r.ttft * 1e3 for r in ok]
    tpot = [(r.e2e - r.ttft) / (r.output_len - 1) * 1e3 for r in ok if r.output_len > 1]
    itl = [x * 1e3 for r in ok for x in r.itl]
    e2e = [r.e2e * 1e3 for r in ok]
    figures: dict[str, float] = {
        "successful_requests": len(ok),
        "failed_requests": len(results) - len(ok),
        "duration_s": duration_s,
        "request_throughput": len(ok) / duration_s,
        "output_throughput": out_tokens / duration_s,
        "total_token_throughput": (in_tokens + out_tokens) / duration_s,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
    }
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2el", e2e)):
        figures[f"mean_{name}_ms"] = statistics.fmean(values) if values else 0.0
        figures[f"median_{name}_ms"] = percentile(values, 50)
        figures[f"p90_{name}_ms"] = percentile(values, 90)
        figures[f"p99_{name}_ms"] = percentile(values, 99)
    return figures


def server_figures(
    before: inference_pb2.ModelInfo, after: inference_pb2.ModelInfo
) -> dict[str, float]:
    """The server's KV cache figures over the run, from two `GetModelInfo` snapshots:
    mean KV memory utilization (tokens stored / slots allocated, summed over steps),
    prefix-cache hit rate (tokens) and preemptions."""
    stored = after.kv_cache_tokens_stored_total - before.kv_cache_tokens_stored_total
    slots = after.kv_cache_slots_allocated_total - before.kv_cache_slots_allocated_total
    queries = after.prefix_cache_queries_total - before.prefix_cache_queries_total
    hits = after.prefix_cache_hits_total - before.prefix_cache_hits_total
    drafts = after.spec_decode_num_drafts_total - before.spec_decode_num_drafts_total
    proposed = after.spec_decode_num_draft_tokens_total - before.spec_decode_num_draft_tokens_total
    accepted = (
        after.spec_decode_num_accepted_tokens_total - before.spec_decode_num_accepted_tokens_total
    )
    return {
        "kv_cache_utilization_pct": 100 * stored / slots if slots else 0.0,
        "prefix_cache_hit_rate_pct": 100 * hits / queries if queries else 0.0,
        "num_preemptions": after.num_preemptions_total - before.num_preemptions_total,
        # speculative decoding (vLLM's report): accepted / proposed, and tokens per step of
        # a sequence with a proposal (its accepted ones plus the token sampled after them)
        "spec_decode_acceptance_rate_pct": 100 * accepted / proposed if proposed else 0.0,
        "spec_decode_mean_acceptance_length": 1 + accepted / drafts if drafts else 0.0,
    }


# (figure name, share of the step it measures), in the order a step runs.
STEP_PHASES = (
    ("step_schedule_ms", "scheduler: build the step"),
    ("step_rpc_ms", "RPC + (de)serialization"),
    ("step_worker_prepare_ms", "worker: input tensors"),
    ("step_worker_forward_ms", "worker: model forward"),
    ("step_worker_sample_ms", "worker: sampling"),
    ("step_worker_other_ms", "worker: sequence records"),
    ("step_apply_ms", "scheduler: apply tokens"),
)


def step_breakdown(
    before: inference_pb2.StepTimes, after: inference_pb2.StepTimes, duration_s: float
) -> dict[str, float]:
    """Where the server's time went over the run, from two `StepTimes` snapshots.

    Per step, in ms: the phases of :data:`STEP_PHASES` (RPC = the scheduler's
    wait for `ExecuteStep` minus the worker's own time; worker "other" = the
    worker's step minus prepare, forward and sample) and their sum
    `step_total_ms`. Over the run: `step_loop_busy_pct` (steps' time / (duration x
    the number of step loops, one per worker group of each replica: their mean))
    and the router's detokenization, `detokenize_us_per_token` and
    `detokenize_pct` (its share of the duration, on the router's event loop).
    """

    def delta(name: str) -> float:
        return float(getattr(after, name) - getattr(before, name))

    steps = delta("num_steps_total")
    schedule = delta("schedule_seconds_total")
    execute = delta("execute_seconds_total")
    worker = delta("worker_step_seconds_total")
    prepare = delta("worker_prepare_seconds_total")
    forward = delta("worker_forward_seconds_total")
    sample = delta("worker_sample_seconds_total")
    apply = delta("apply_seconds_total")
    detok = delta("detokenize_seconds_total")
    detok_tokens = delta("detokenized_tokens_total")
    seconds = {
        "step_schedule_ms": schedule,
        "step_rpc_ms": execute - worker,
        "step_worker_prepare_ms": prepare,
        "step_worker_forward_ms": forward,
        "step_worker_sample_ms": sample,
        "step_worker_other_ms": worker - prepare - forward - sample,
        "step_apply_ms": apply,
    }
    figures: dict[str, float] = {"num_steps": int(steps)}
    for name, total in seconds.items():
        figures[name] = 1e3 * total / steps if steps else 0.0
    busy = schedule + execute + apply
    figures["step_total_ms"] = 1e3 * busy / steps if steps else 0.0
    loops = max(1, after.num_step_loops)  # 0 from a server older than the field
    figures["num_step_loops"] = loops
    figures["step_loop_busy_pct"] = 100 * busy / (duration_s * loops) if duration_s else 0.0
    figures["detokenize_us_per_token"] = 1e6 * detok / detok_tokens if detok_tokens else 0.0
    figures["detokenize_pct"] = 100 * detok / duration_s if duration_s else 0.0
    return figures
