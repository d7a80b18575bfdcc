"""A small synchronous client of the public API, used by `sluiceway generate`, tests and benchmarks."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sluiceway.grpc_server import channel_options
from sluiceway.v1 import inference_pb2, inference_pb2_grpc


def wait_until_serving(target: str, timeout_s: float, service: str = "") -> None:
    """Polls the gRPC health service of `target` until it answers SERVING.

    Raises TimeoutError after `timeout_s` seconds.
    """
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{target} not SERVING after {timeout_s:.0f} s")
            time.sleep(0.1)


class Client:
    """Blocking client of `sluiceway.v1.Inference` on `target` (host:port or unix:PATH)."""

    def __init__(self, target: str) -> None:
        self.channel = grpc.insecure_channel(target, options=channel_options())
        self.stub = inference_pb2_grpc.InferenceStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def request(
        prompt: str | None = None,
        *,
        messages: list[tuple[str, str]] | None = None,
        prompt_token_ids: list[int] | None = None,
        request_id: str = "",
        **sampling: Any,
    ) -> inference_pb2.GenerateRequest:
        """Builds a `GenerateRequest` from exactly one input and `SamplingParams` fields."""
        req = inference_pb2.GenerateRequest(
            request_id=request_id, sampling=inference_pb2.SamplingParams(**sampling)
        )
        if prompt is not None:
            req.prompt = prompt
        elif messages is not None:
            req.messages.messages.extend(
                inference_pb2.ChatMessage(role=r, content=c) for r, c in messages
            )
        elif prompt_token_ids is not None:
            req.prompt_token_ids.ids.extend(prompt_token_ids)
        return req

    def generate_stream(
        self, request: inference_pb2.GenerateRequest, timeout: float | None = None
    ) -> Iterator[inference_pb2.GenerateResponse]:
        """Streams the responses of one request. Raises grpc.RpcError on a failed call."""
        return self.stub.Generate(request, timeout=timeout)  # type: ignore[no-any-return]

    def generate(
        self, request: inference_pb2.GenerateRequest, timeout: float | None = None
    ) -> tuple[str, list[int], inference_pb2.GenerateResponse]:
        """Runs one request to the end: (text, token ids, last response). Raises ValueError
        for ``sampling.n`` > 1 (see `generate_samples`), grpc.RpcError on a failed call."""
        if request.sampling.n > 1:
            raise ValueError("sampling.n > 1: use generate_samples")
        ((text, ids, last),) = self.generate_samples(request, timeout)
        return text, ids, last

    def generate_samples(
        self, request: inference_pb2.GenerateRequest, timeout: float | None = None
    ) -> list[tuple[str, list[int], inference_pb2.GenerateResponse]]:
        """Runs a request of ``sampling.n`` samples to the end: (text, token ids, last
        response) of each, in `index` order. Raises grpc.RpcError on a failed call."""
        n = max(1, request.sampling.n)
        text: list[list[str]] = [[] for _ in range(n)]
        ids: list[list[int]] = [[] for _ in range(n)]
        last = [inference_pb2.GenerateResponse() for _ in range(n)]
        for response in self.generate_stream(request, timeout):
            i = response.index
            text[i].append(response.text)
            ids[i].extend(response.token_ids)
            last[i] = response
        return [("".join(text[i]), ids[i], last[i]) for i in range(n)]

    def model_info(self) -> inference_pb2.ModelInfo:
        return self.stub.GetModelInfo(inference_pb2.GetModelInfoRequest(), timeout=10)  # type: ignore[no-any-return]


def generate_command(args: argparse.Namespace) -> int:
    """`sluiceway generate`: streams the answer to stdout; exit 1 with the gRPC status on error."""
    sampling: dict[str, Any] = {}
    for name in ("max_tokens", "temperature", "top_p", "top_k", "seed"):
        value = getattr(args, name)
        if value is not None:
            sampling[name] = value
    if args.chat:
        req = Client.request(messages=[("user", args.prompt)], **sampling)
    else:
        req = Client.request(args.prompt, **sampling)
    with Client(args.target) as client:
        try:
            for response in client.generate_stream(req):
                sys.stdout.write(response.text)
                sys.stdout.flush()
        except grpc.RpcError as e:
            print(f"\nsluiceway generate: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    sys.stdout.write("\n")
    return 0
