"""`sluiceway bench serve`: a serving benchmark against a running server.

Modelled on `vllm bench serve` (same flag names): requests stream through the
public gRPC API, at most `--max-concurrency` at a time, and the figures are
the ones vLLM prints: throughput, TTFT, TPOT, ITL and E2E latency, plus the
server's KV memory utilization, prefix-cache hit rate and where its step time
went (:func:`sluiceway.bench.metrics.step_breakdown`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any

import grpc

from sluiceway.bench.metrics import (
    STEP_PHASES,
    RequestResult,
    server_figures,
    step_breakdown,
    summarize,
)
from sluiceway.bench.workload import load_requests, request_intervals, send_workload
from sluiceway.client import connection as client_connection
from sluiceway.grpc_server import channel_options
from sluiceway.sharegpt import SampledRequest
from sluiceway.targets import client_options
from sluiceway.v1 import inference_pb2, inference_pb2_grpc

# After the run, how long to wait for every KV block to be free before reporting the count.
FREE_BLOCKS_WAIT_S = 5.0


@dataclass(slots=True)
class BenchRun:
    """One workload's outcome: per-request timings and the figures derived from them."""

    results: list[RequestResult]
    figures: dict[str, float]
    errors: list[str]


async def _one(
    stub: inference_pb2_grpc.InferenceStub,
    request: SampledRequest,
    ignore_eos: bool,
    metadata: tuple[tuple[str, str], ...] = (),
    request_id: str = "",
) -> RequestResult:
    req = inference_pb2.GenerateRequest(
        request_id=request_id,
        sampling=inference_pb2.SamplingParams(
            temperature=0.0, max_tokens=request.output_len, ignore_eos=ignore_eos
        ),
    )
    if request.prompt_token_ids:
        req.prompt_token_ids.ids.extend(request.prompt_token_ids)
    else:
        req.prompt = request.prompt
    result = RequestResult(ok=False, prompt_len=request.prompt_len, request_id=request_id)
    t0 = last = time.perf_counter()
    try:
        async for response in stub.Generate(req, metadata=metadata):
            now = time.perf_counter()
            if not response.token_ids:
                continue
            if result.output_len == 0:
                result.ttft = now - t0
            else:
                result.itl.append(now - last)
            last = now
            result.output_len += len(response.token_ids)
        result.e2e = time.perf_counter() - t0
        result.ok = True
    except grpc.aio.AioRpcError as e:
        result.error = f"{e.code().name}: {e.details()}"
    return result


async def run_workload(
    target: str,
    requests: list[SampledRequest],
    intervals: list[float],
    max_concurrency: int | None,
    ignore_eos: bool,
    desc: str = "requests",
    *,
    connection: dict[str, Any] | None = None,
) -> BenchRun:
    """Sends `requests` to the server at `target`, request i after waiting `intervals[i]`
    seconds, at most `max_concurrency` in flight (None: no limit), greedy.

    The first request is sent once alone before the clock starts (vLLM's
    initial test run). After the run it reports the server's free KV blocks
    (`num_free_kv_blocks_after`, waiting up to FREE_BLOCKS_WAIT_S for them to
    come back: a leak shows as fewer than `num_kv_blocks`). Raises RuntimeError if that warm-up fails and
    grpc.aio.AioRpcError if `GetModelInfo` does; a failed `Generate` during
    the run is counted, not raised. Request i is sent as request_id ``bench-RUN-i`` (RUN: 8
    hex digits, one per call), saved with its figures. `connection`: `sluiceway.client.connection`'s keyword
    arguments (the API key, TLS), from `sluiceway.targets.client_options`.
    """
    metadata, credentials = client_connection(**(connection or {}))
    if credentials is not None:
        channel = grpc.aio.secure_channel(target, credentials, options=channel_options())
    else:
        channel = grpc.aio.insecure_channel(target, options=channel_options())
    info = inference_pb2.GetModelInfoRequest()
    async with channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        if requests:  # as vLLM's initial test run: first-call costs stay out of the figures
            warmup = await _one(stub, requests[0], ignore_eos, metadata)
            if not warmup.ok:
                raise RuntimeError(f"warm-up request failed: {warmup.error}")
        before = await stub.GetModelInfo(info, metadata=metadata)
        run = uuid.uuid4().hex[:8]
        results, duration = await send_workload(
            lambda i, r: _one(stub, r, ignore_eos, metadata, f"bench-{run}-{i}"),
            requests,
            intervals,
            max_concurrency,
            desc,
        )
        after = await stub.GetModelInfo(info, metadata=metadata)
        settled = after
        deadline = time.monotonic() + FREE_BLOCKS_WAIT_S
        while settled.num_free_kv_blocks < settled.num_kv_blocks and time.monotonic() < deadline:
            await asyncio.sleep(0.1)  # aborted requests free their blocks at the next step
            settled = await stub.GetModelInfo(info, metadata=metadata)
    figures = summarize(results, duration)
    figures.update(server_figures(before, after))
    figures["num_kv_blocks"] = settled.num_kv_blocks
    figures["num_free_kv_blocks_after"] = settled.num_free_kv_blocks
    figures.update(step_breakdown(before.step_times, after.step_times, duration))
    return BenchRun(results, figures, sorted({r.error for r in results if not r.ok}))


def print_figures(figures: dict[str, float], errors: list[str]) -> None:
    """vLLM's result block (counts, the figures held as ints, as integers; the others with
    two decimals), then the step-time breakdown (ms per step and share)."""
    print(f"{'=' * 16} Serving Benchmark Result {'=' * 16}")
    for key, value in figures.items():
        if not key.startswith("step_") and not key.startswith("detokenize"):
            text = str(value) if isinstance(value, int) else f"{value:.2f}"
            print(f"{key:<40}{text:>14}")
    if figures.get("num_steps"):
        total = figures["step_total_ms"]
        print(f"{'-' * 14} Step-time breakdown (per step) {'-' * 13}")
        for key, label in STEP_PHASES:
            share = 100 * figures[key] / total if total else 0.0
            print(f"{label:<34}{figures[key]:>10.2f} ms{share:>8.1f} %")
        print(f"{'step total':<34}{total:>10.2f} ms")
        loops = int(figures["num_step_loops"])
        label = (
            "step loop busy (% of duration)" if loops == 1 else f"{loops} step loops busy (mean)"
        )
        print(f"{label:<34}{figures['step_loop_busy_pct']:>10.1f} %")
        print(
            f"{'router detokenization':<34}{figures['detokenize_us_per_token']:>10.1f} us/token"
            f"{figures['detokenize_pct']:>6.1f} % of duration"
        )
    for e in errors:
        print(f"error: {e}")


def json_safe(value: object) -> object:
    """`value` with every infinite or NaN float as the string "inf", "-inf" or "nan": strict
    JSON has no such numbers (`--request-rate inf` is the default)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def per_request(results: list[RequestResult]) -> list[dict[str, object]]:
    """Each request's figures, in request order, for the saved JSON: ok, prompt and output
    tokens, TTFT and E2E latency (ms; 0 for a failed request), the request_id it was sent
    with and the error, if any."""
    return [
        {
            "ok": r.ok,
            "prompt_len": r.prompt_len,
            "output_len": r.output_len,
            "ttft_ms": r.ttft * 1e3,
            "e2e_ms": r.e2e * 1e3,
            **({"request_id": r.request_id} if r.request_id else {}),
            **({"error": r.error} if r.error else {}),
        }
        for r in results
    ]


def report(args: argparse.Namespace, label: str, run: BenchRun) -> int:
    """Prints the figures (and, with `--roofline`, the duration as a fraction of the run's
    limit: :func:`sluiceway.bench.roofline.roofline_of_results`); writes `--save-result` (the
    args, every figure, the errors, the per-request figures and the roofline's) and `--plot`
    (series `label`) when asked. Returns the exit code: 1 when a request failed, else 0."""
    print_figures(run.figures, run.errors)
    roofline = None
    if getattr(args, "roofline", False):
        from sluiceway.bench.roofline import roofline_of_results

        roofline = roofline_of_results(args, [(label, run.results, run.figures["duration_s"])])
    if args.save_result:
        result = {
            "args": vars(args),
            **run.figures,
            "errors": run.errors,
            "requests": per_request(run.results),
            **({"roofline": roofline[0]} if roofline else {}),
        }
        with open(args.save_result, "w") as f:
            json.dump(json_safe(result), f, indent=2, default=str)
    if args.plot:
        from sluiceway.bench.plot import PlotSeries, plot_runs

        plot_runs([PlotSeries.from_run(label, run)], args.plot)
        print(f"plot saved to {args.plot}")
    return 1 if run.figures["failed_requests"] else 0


def _serve_openai(
    args: argparse.Namespace, requests: list[SampledRequest], intervals: list[float]
) -> int:
    from sluiceway.bench.openai_client import run_openai_workload

    try:
        results, figures = asyncio.run(
            run_openai_workload(
                args.base_url, args.served_model_name, requests, intervals,
                args.max_concurrency, args.ignore_eos, connection=client_options(args),
                keep_alive=args.keep_alive,
            )
        )  # fmt: skip
    except (RuntimeError, OSError) as e:
        print(f"sluiceway bench serve: {args.base_url}: {e}", file=sys.stderr)
        return 1
    errors = sorted({r.error for r in results if not r.ok})
    return report(args, args.base_url, BenchRun(results, figures, errors))


def serve_command(args: argparse.Namespace) -> int:
    """`bench serve`: runs the workload, prints the figures, saves JSON / PNG when asked
    (either backend).

    Returns 1 (with the reason on stderr) when the server cannot be reached, 2 for a workload
    that cannot be loaded (a `--dataset-path` that cannot be read, a `--model` that is no
    model)."""
    try:
        requests = load_requests(args)
    except ValueError as e:
        print(f"sluiceway bench serve: {e}", file=sys.stderr)
        return 2
    intervals = request_intervals(len(requests), args.request_rate, args.burstiness, args.seed)
    if args.backend == "openai":
        return _serve_openai(args, requests, intervals)
    try:
        run = asyncio.run(
            run_workload(
                args.target, requests, intervals, args.max_concurrency, args.ignore_eos,
                connection=client_options(args),
            )
        )  # fmt: skip
    except (RuntimeError, grpc.aio.AioRpcError, OSError, ValueError) as e:
        detail = f"{e.code().name}: {e.details()}" if isinstance(e, grpc.aio.AioRpcError) else e
        print(f"sluiceway bench serve: {args.target}: {detail}", file=sys.stderr)
        return 1
    return report(args, args.target, run)
