"""`sluiceway bench serve`: a ShareGPT serving benchmark against a running server.

Modelled on `vllm bench serve` (same flag names): requests stream through the
public gRPC API, at most `--max-concurrency` at a time, and the figures are
the ones vLLM prints: throughput, TTFT, TPOT, ITL and E2E latency, plus the
server's KV memory utilization and prefix-cache hit rate over the run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from dataclasses import dataclass, field

import grpc
import numpy as np

from sluiceway.grpc_server import channel_options
from sluiceway.v1 import inference_pb2, inference_pb2_grpc


@dataclass(slots=True)
class RequestResult:
    """Timings of one request, seconds since its start."""

    ok: bool
    prompt_len: int
    output_len: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


async def _one(
    stub: inference_pb2_grpc.InferenceStub, prompt: str, prompt_len: int, max_tokens: int,
    ignore_eos: bool,
) -> RequestResult:  # fmt: skip
    req = inference_pb2.GenerateRequest(
        prompt=prompt,
        sampling=inference_pb2.SamplingParams(
            temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos
        ),
    )
    result = RequestResult(ok=False, prompt_len=prompt_len)
    t0 = last = time.perf_counter()
    try:
        async for response in stub.Generate(req):
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


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else 0.0


def summarize(results: list[RequestResult], duration_s: float) -> dict[str, float]:
    """vLLM's benchmark figures (ms for latencies, per second for throughputs)."""
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
        figures[f"median_{name}_ms"] = _pct(values, 50)
        figures[f"p90_{name}_ms"] = _pct(values, 90)
        figures[f"p99_{name}_ms"] = _pct(values, 99)
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
    return {
        "kv_cache_utilization_pct": 100 * stored / slots if slots else 0.0,
        "prefix_cache_hit_rate_pct": 100 * hits / queries if queries else 0.0,
        "num_preemptions": after.num_preemptions_total - before.num_preemptions_total,
    }


async def run(args: argparse.Namespace) -> dict[str, float]:
    from router.tokenizer import load_tokenizer
    from sluiceway.model_files import resolve_model
    from sluiceway.sharegpt import sample_requests

    tokenizer = load_tokenizer(resolve_model(args.model))
    requests = sample_requests(
        tokenizer,
        args.num_prompts,
        seed=args.seed,
        output_len=args.sharegpt_output_len,
        max_output_len=args.sharegpt_max_output_len,
    )
    sem = asyncio.Semaphore(args.max_concurrency or len(requests))
    async with grpc.aio.insecure_channel(args.target, options=channel_options()) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)

        async def limited(r) -> RequestResult:  # type: ignore[no-untyped-def]
            async with sem:
                return await _one(stub, r.prompt, r.prompt_len, r.output_len, args.ignore_eos)

        before = await stub.GetModelInfo(inference_pb2.GetModelInfoRequest())
        t0 = time.perf_counter()
        results = await asyncio.gather(*(limited(r) for r in requests))
        duration = time.perf_counter() - t0
        after = await stub.GetModelInfo(inference_pb2.GetModelInfoRequest())
    figures = summarize(list(results), duration)
    figures.update(server_figures(before, after))
    errors = sorted({r.error for r in results if not r.ok})
    print(f"{'=' * 16} Serving Benchmark Result {'=' * 16}")
    for key, value in figures.items():
        print(f"{key:<40}{value:>14.2f}")
    for e in errors:
        print(f"error: {e}")
    if args.save_result:
        with open(args.save_result, "w") as f:
            json.dump({"args": vars(args), **figures, "errors": errors}, f, indent=2, default=str)
    return figures


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    p = bench_sub.add_parser("serve", help="ShareGPT serving benchmark against a running server")
    p.add_argument("--target", default="127.0.0.1:50051")
    p.add_argument("--model", default=None, help="tokenizer source (default: the embedded model)")
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--sharegpt-output-len", type=int, default=None, help="fixed output length, tokens"
    )
    p.add_argument(
        "--sharegpt-max-output-len",
        type=int,
        default=None,
        help="cap on the dataset's output lengths, tokens (sluiceway's own flag)",
    )
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--save-result", default=None, metavar="PATH.json")


def bench_command(args: argparse.Namespace) -> int:
    asyncio.run(run(args))
    return 0
