"""The router's Prometheus metrics: request outcomes, tokens and latencies, as vLLM names them."""

from __future__ import annotations

from typing import Literal, get_args

import grpc
from prometheus_client import Counter, Gauge, Histogram

from sluiceway.metrics import (
    PREFIX,
    REQUEST_LATENCY_BUCKETS,
    TOKEN_LATENCY_BUCKETS,
    TTFT_BUCKETS,
)
from sluiceway.v1 import inference_pb2

# The label values the router emits, each from one source; `init_series` creates every
# combination at 0, so a dashboard shows 0 rather than "No data" before the first event.
Protocol = Literal["grpc", "http"]  # the API a request came in by
PROTOCOLS: tuple[Protocol, ...] = get_args(Protocol)
# finish reason -> the `finished_reason` label and log field (vLLM's words: stop, length,
# abort), for every FinishReason but UNSPECIFIED (still running) and TOOL_CALLS
FINISHED_REASONS: dict[int, str] = {
    value: name.removeprefix("FINISH_REASON_").lower()
    for name, value in inference_pb2.FinishReason.items()
    # TOOL_CALLS is a STOP after tool calls, as the router presents it (router/tool_calls.py):
    # counted as stop, as vLLM counts it
    if value
    not in (inference_pb2.FINISH_REASON_UNSPECIFIED, inference_pb2.FINISH_REASON_TOOL_CALLS)
}
# the `code` label: a failure's gRPC status, any but OK (the router relays the scheduler's)
FAILURE_CODES = tuple(c.name for c in grpc.StatusCode if c is not grpc.StatusCode.OK)

REQUEST_SUCCESS = Counter(
    f"{PREFIX}request_success",
    "Requests that finished normally, by finish reason (stop, length, abort) and API (grpc, http).",
    ["model_name", "finished_reason", "protocol"],
)
REQUEST_FAILURE = Counter(
    f"{PREFIX}request_failure",
    "Requests that ended with an error, by gRPC status code (CANCELLED: the client left; the "
    "HTTP API's errors by the code it maps from) and API (grpc, http).",
    ["model_name", "code", "protocol"],
)
PROMPT_TOKENS = Counter(
    f"{PREFIX}prompt_tokens", "Prompt tokens of successful requests.", ["model_name"]
)
GENERATION_TOKENS = Counter(
    f"{PREFIX}generation_tokens", "Tokens generated for successful requests.", ["model_name"]
)
TIME_TO_FIRST_TOKEN = Histogram(
    f"{PREFIX}time_to_first_token_seconds",
    "From the request's arrival at the router to its first token, seconds.",
    ["model_name"],
    buckets=TTFT_BUCKETS,
)
TIME_PER_OUTPUT_TOKEN = Histogram(
    f"{PREFIX}time_per_output_token_seconds",
    "(E2E - TTFT) / (generated tokens - 1) of each request with 2+ tokens, seconds.",
    ["model_name"],
    buckets=TOKEN_LATENCY_BUCKETS,
)
INTER_TOKEN_LATENCY = Histogram(
    f"{PREFIX}inter_token_latency_seconds",
    "Gap between consecutive tokens of a request, seconds.",
    ["model_name"],
    buckets=TOKEN_LATENCY_BUCKETS,
)
E2E_REQUEST_LATENCY = Histogram(
    f"{PREFIX}e2e_request_latency_seconds",
    "From the request's arrival at the router to its last token, seconds.",
    ["model_name"],
    buckets=REQUEST_LATENCY_BUCKETS,
)
REQUEST_QUEUE_TIME = Histogram(
    f"{PREFIX}request_queue_time_seconds",
    "From the request's arrival at the scheduler to its first scheduled step, seconds.",
    ["model_name"],
    buckets=REQUEST_LATENCY_BUCKETS,
)
# Per scheduler (a router over several spreads requests over them; router/balancer.py sets
# them, under the model's name once a scheduler has told it).
OUTSTANDING_REQUESTS = Gauge(
    f"{PREFIX}router_outstanding_requests",
    "Generate streams this router forwarded to the scheduler and that have not ended yet.",
    ["model_name", "scheduler"],
)
KV_INDEX_BLOCKS = Gauge(
    f"{PREFIX}router_kv_index_blocks",
    "KV blocks this router's cache-aware index holds for the scheduler (from its KV events).",
    ["model_name", "scheduler"],
)
SCHEDULER_READY = Gauge(
    f"{PREFIX}router_scheduler_ready",
    "1 while this router sees the scheduler ready (it gets new requests), else 0.",
    ["model_name", "scheduler"],
)
SCHEDULER_GAUGES = (OUTSTANDING_REQUESTS, KV_INDEX_BLOCKS, SCHEDULER_READY)


def init_series(model_name: str) -> None:
    """Creates every request series of `model_name` at 0: each finish reason and failure
    code with each protocol, the token counters and the latency histograms (as vLLM does
    at start). Idempotent."""
    for protocol in PROTOCOLS:
        for reason in FINISHED_REASONS.values():
            REQUEST_SUCCESS.labels(model_name, reason, protocol)
        for code in FAILURE_CODES:
            REQUEST_FAILURE.labels(model_name, code, protocol)
    for metric in (
        PROMPT_TOKENS,
        GENERATION_TOKENS,
        TIME_TO_FIRST_TOKEN,
        TIME_PER_OUTPUT_TOKEN,
        INTER_TOKEN_LATENCY,
        E2E_REQUEST_LATENCY,
        REQUEST_QUEUE_TIME,
    ):
        metric.labels(model_name)


class RequestRecorder:
    """One request's latencies and outcome, recorded into the metrics above.

    Times are `time.monotonic()` seconds; `arrival` is when the router got
    the request. TTFT = first token - arrival; ITL = gap between token
    events; TPOT = (E2E - TTFT) / (tokens - 1), as vLLM defines them.
    """

    def __init__(self, model_name: str, arrival: float, protocol: Protocol = "grpc") -> None:
        self.model_name = model_name
        self.protocol = protocol
        self.arrival = arrival
        self.first_token: float | None = None
        self.last_token = arrival
        self.num_generated = 0

    @property
    def ttft(self) -> float:
        return (
            self.first_token if self.first_token is not None else self.last_token
        ) - self.arrival

    @property
    def e2e(self) -> float:
        return self.last_token - self.arrival

    def on_tokens(self, count: int, now: float) -> None:
        if self.first_token is None:
            self.first_token = now
            TIME_TO_FIRST_TOKEN.labels(self.model_name).observe(now - self.arrival)
        else:
            INTER_TOKEN_LATENCY.labels(self.model_name).observe(now - self.last_token)
        self.last_token = now
        self.num_generated += count

    def on_queue_time(self, seconds: float) -> None:
        REQUEST_QUEUE_TIME.labels(self.model_name).observe(seconds)

    def on_success(self, finished_reason: str, prompt_tokens: int) -> None:
        REQUEST_SUCCESS.labels(self.model_name, finished_reason, self.protocol).inc()
        PROMPT_TOKENS.labels(self.model_name).inc(prompt_tokens)
        GENERATION_TOKENS.labels(self.model_name).inc(self.num_generated)
        E2E_REQUEST_LATENCY.labels(self.model_name).observe(self.e2e)
        if self.num_generated > 1:
            TIME_PER_OUTPUT_TOKEN.labels(self.model_name).observe(
                (self.e2e - self.ttft) / (self.num_generated - 1)
            )

    def on_failure(self, code: str) -> None:
        REQUEST_FAILURE.labels(self.model_name, code, self.protocol).inc()
