"""Request bytes that are not a valid protobuf message: INVALID_ARGUMENT naming the message
type (not UNKNOWN "Exception deserializing request"), and the router keeps serving.

The router is the real `RequestPath` behind `start_router`, over one in-process fake
scheduler; the bad bytes are sent with raw calls whose serializer passes bytes through.
"""

from __future__ import annotations

import asyncio
import pathlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2
from prometheus_client import REGISTRY

from sluiceway.grpc_server import bind, new_server
from sluiceway.internal.v1 import scheduler_pb2, scheduler_pb2_grpc
from sluiceway.router.grpc_api import Router, start_router
from sluiceway.router.handlers import MalformedRequest, lenient_deserializer
from sluiceway.router.request_path import RequestPath
from sluiceway.router.tokenizer import encode_prompt
from sluiceway.v1 import inference_pb2, inference_pb2_grpc

INVALID = grpc.StatusCode.INVALID_ARGUMENT
MODEL = "fake-malformed"  # this file's model_name label
GARBAGE = b"\xff\xff\xff"  # an unterminated varint tag: corrupt for every message type
BAD_UTF8_PROMPT = b"\x12\x02\xff\xfe"  # GenerateRequest.prompt (field 2) = invalid UTF-8
PATH = "/sluiceway.v1.Inference/"


class FakeScheduler(scheduler_pb2_grpc.SchedulerServicer):
    """Streams `max_tokens` events (token 100 + i), the ones after the first `delay_s` apart;
    always ready."""

    delay_s = 0.0

    async def AddRequest(  # type: ignore[override]
        self, request: scheduler_pb2.AddRequestRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[scheduler_pb2.TokenEvent]:
        for i in range(request.sampling.max_tokens):
            if i:
                await asyncio.sleep(self.delay_s)
            last = i == request.sampling.max_tokens - 1
            yield scheduler_pb2.TokenEvent(
                token_ids=[100 + i],
                finish_reason=inference_pb2.FINISH_REASON_LENGTH if last else 0,  # type: ignore[arg-type]
            )

    async def GetSchedulerInfo(  # type: ignore[override]
        self, request: scheduler_pb2.GetSchedulerInfoRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.SchedulerInfo:
        return scheduler_pb2.SchedulerInfo(
            ready=True, model_id=MODEL, max_model_len=4096, block_size=16, vocab_size=49152,
            num_kv_blocks=100, num_free_kv_blocks=90,
        )  # fmt: skip


Scenario = Callable[[grpc.aio.Channel], Awaitable[None]]


async def _with_router(
    tokenizer: Any,
    model_dir: pathlib.Path,
    scenario: Scenario,
    fake: FakeScheduler | None = None,
    routers: list[Router] | None = None,
) -> None:
    scheduler, _ = new_server()
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(fake or FakeScheduler(), scheduler)
    scheduler_address = bind(scheduler, "127.0.0.1:0")
    await scheduler.start()
    router = await start_router(
        RequestPath(tokenizer, model_dir, scheduler_address), "127.0.0.1:0", poll_s=0.1
    )
    if routers is not None:
        routers.append(router)
    channel = grpc.aio.insecure_channel(router.address)
    try:
        health = health_pb2_grpc.HealthStub(channel)
        deadline = time.monotonic() + 5
        while (
            await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
        ).status != health_pb2.HealthCheckResponse.SERVING:
            assert time.monotonic() < deadline, "the router never became SERVING"
            await asyncio.sleep(0.02)
        await scenario(channel)
    finally:
        await channel.close()
        await router.stop(None)
        await scheduler.stop(None)


def _run(tokenizer: Any, model_dir: pathlib.Path, scenario: Scenario, **kwargs: Any) -> None:
    asyncio.run(asyncio.wait_for(_with_router(tokenizer, model_dir, scenario, **kwargs), 60))


async def _raw(
    channel: grpc.aio.Channel, method: str, payload: bytes, *, registered: bool = False
) -> tuple[grpc.StatusCode, str]:
    """Sends `payload` as the request bytes of `method`; the status the call ended with."""
    kwargs: dict[str, Any] = {
        "request_serializer": lambda b: b,
        "response_deserializer": lambda b: b,
    }
    if registered:  # the registered-method table, as generated stubs call
        kwargs["_registered_method"] = True
    try:
        if method == "Generate":
            async for _ in channel.unary_stream(PATH + method, **kwargs)(payload, timeout=10):
                pass
        else:
            await channel.unary_unary(PATH + method, **kwargs)(payload, timeout=10)
    except grpc.aio.AioRpcError as e:
        return e.code(), e.details() or ""
    return grpc.StatusCode.OK, ""


async def _generate_ok(channel: grpc.aio.Channel) -> None:
    stub = inference_pb2_grpc.InferenceStub(channel)
    request = inference_pb2.GenerateRequest(
        prompt="Hello", sampling=inference_pb2.SamplingParams(max_tokens=3, ignore_eos=True)
    )
    responses = [r async for r in stub.Generate(request, timeout=10)]
    assert [t for r in responses for t in r.token_ids] == [100, 101, 102]
    assert responses[-1].finish_reason == inference_pb2.FINISH_REASON_LENGTH


def _failures(code: str = "INVALID_ARGUMENT") -> float:
    labels = {"model_name": MODEL, "code": code, "protocol": "grpc"}
    return REGISTRY.get_sample_value("sluiceway:request_failure_total", labels) or 0.0


def test_lenient_deserializer() -> None:
    decode = lenient_deserializer(inference_pb2.GenerateRequest)
    request = inference_pb2.GenerateRequest(prompt="hi", request_id="r")
    assert decode(request.SerializeToString()) == request
    assert decode(b"") == inference_pb2.GenerateRequest()
    bad = decode(GARBAGE)
    assert isinstance(bad, MalformedRequest)
    assert bad.type_name == "sluiceway.v1.GenerateRequest"
    assert bad.details.startswith("request is not a valid sluiceway.v1.GenerateRequest: ")
    assert bad.error and "Error parsing message" not in bad.error  # the type named once


def test_garbage_generate_is_invalid_argument_and_the_router_keeps_serving(
    tokenizer: Any, tokenizer_dir: pathlib.Path
) -> None:
    async def scenario(channel: grpc.aio.Channel) -> None:
        before = _failures()
        for payload in (GARBAGE, BAD_UTF8_PROMPT):
            for registered in (False, True):
                code, details = await _raw(channel, "Generate", payload, registered=registered)
                assert code == INVALID, (payload, registered, code, details)
                assert details.startswith(
                    "request is not a valid sluiceway.v1.GenerateRequest: "
                ), details
                await _generate_ok(channel)  # the same router, right after
        assert _failures() == before + 4  # counted as the other invalid requests are
        # empty bytes are a valid (empty) GenerateRequest: the router's own validation
        code, details = await _raw(channel, "Generate", b"")
        assert (code, details) == (INVALID, "input: set one of prompt, messages, prompt_token_ids")
        assert _failures() == before + 5
        await _generate_ok(channel)

    _run(tokenizer, tokenizer_dir, scenario)


def test_garbage_tokenize_and_model_info_are_invalid_argument(
    tokenizer: Any, tokenizer_dir: pathlib.Path
) -> None:
    async def scenario(channel: grpc.aio.Channel) -> None:
        stub = inference_pb2_grpc.InferenceStub(channel)
        for registered in (False, True):
            code, details = await _raw(channel, "Tokenize", GARBAGE, registered=registered)
            assert code == INVALID, details
            assert details.startswith("request is not a valid sluiceway.v1.TokenizeRequest: ")
            reply = await stub.Tokenize(inference_pb2.TokenizeRequest(prompt="Hello"), timeout=10)
            assert list(reply.token_ids) == encode_prompt(tokenizer, "Hello")

            code, details = await _raw(channel, "GetModelInfo", GARBAGE, registered=registered)
            assert code == INVALID, details
            assert details.startswith(
                "request is not a valid sluiceway.v1.GetModelInfoRequest: "
            ), details
            info = await stub.GetModelInfo(inference_pb2.GetModelInfoRequest(), timeout=10)
            assert info.model_id == MODEL
        # empty bytes: an empty TokenizeRequest, which the router rejects as it always has
        assert await _raw(channel, "Tokenize", b"") == (
            INVALID,
            "input: set one of prompt, messages",
        )
        assert await _raw(channel, "GetModelInfo", b"") == (grpc.StatusCode.OK, "")
        await _generate_ok(channel)

    _run(tokenizer, tokenizer_dir, scenario)


async def _reflect(
    channel: grpc.aio.Channel, version: str, request: reflection_pb2.ServerReflectionRequest
) -> reflection_pb2.ServerReflectionResponse:
    """One request to grpc.reflection.`version`.ServerReflection (v1 or v1alpha: the same
    messages on the wire, so v1alpha's classes serve both)."""
    call = channel.stream_stream(
        f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
        request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
        response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
    )
    replies = [r async for r in call(iter([request]), timeout=10)]
    assert len(replies) == 1
    return replies[0]


def test_reflection_v1_and_v1alpha_list_the_same_services(
    tokenizer: Any, tokenizer_dir: pathlib.Path
) -> None:
    async def scenario(channel: grpc.aio.Channel) -> None:
        listed = {}
        for version in ("v1", "v1alpha"):
            reply = await _reflect(
                channel, version, reflection_pb2.ServerReflectionRequest(list_services="")
            )
            listed[version] = sorted(s.name for s in reply.list_services_response.service)
        assert (
            listed["v1"]
            == listed["v1alpha"]
            == [
                "grpc.health.v1.Health",
                "grpc.reflection.v1.ServerReflection",
                "grpc.reflection.v1alpha.ServerReflection",
                "sluiceway.v1.Inference",
            ]
        )
        # each version describes its own service, and v1 the public API as v1alpha does
        for version in ("v1", "v1alpha"):
            symbol = f"grpc.reflection.{version}.ServerReflection"
            reply = await _reflect(
                channel,
                version,
                reflection_pb2.ServerReflectionRequest(file_containing_symbol=symbol),
            )
            (raw,) = reply.file_descriptor_response.file_descriptor_proto
            file = descriptor_pb2.FileDescriptorProto.FromString(raw)
            assert file.package == f"grpc.reflection.{version}"
            method = file.service[0].method[0]
            assert (method.name, method.input_type) == (
                "ServerReflectionInfo", f".grpc.reflection.{version}.ServerReflectionRequest"
            )  # fmt: skip
        described = []
        for version in ("v1", "v1alpha"):
            request = reflection_pb2.ServerReflectionRequest(
                file_containing_symbol="sluiceway.v1.Inference"
            )
            reply = await _reflect(channel, version, request)
            described.append(list(reply.file_descriptor_response.file_descriptor_proto))
        assert described[0] == described[1] and len(described[0]) >= 1

    _run(tokenizer, tokenizer_dir, scenario)


def test_a_cancelled_stream_still_ends_as_before(
    tokenizer: Any, tokenizer_dir: pathlib.Path
) -> None:
    """The handler wraps the servicer's stream: a client leaving mid-stream still reaches
    `Generate`'s cleanup (CANCELLED counted, nothing left in flight or outstanding)."""
    fake = FakeScheduler()
    fake.delay_s = 0.05
    routers: list[Router] = []

    async def scenario(channel: grpc.aio.Channel) -> None:
        (router,) = routers
        before = _failures("CANCELLED")
        stub = inference_pb2_grpc.InferenceStub(channel)
        request = inference_pb2.GenerateRequest(
            prompt="Hello", sampling=inference_pb2.SamplingParams(max_tokens=200, ignore_eos=True)
        )
        call = stub.Generate(request, timeout=10)
        assert list((await call.read()).token_ids) == [100]
        assert router.path.num_in_flight == 1
        call.cancel()
        deadline = time.monotonic() + 5
        while router.path.num_in_flight or _failures("CANCELLED") != before + 1:
            assert time.monotonic() < deadline, "the cancelled stream never ended"
            await asyncio.sleep(0.02)
        assert [r.outstanding for r in router.path.pool.replicas] == [0]
        await _generate_ok(channel)

    _run(tokenizer, tokenizer_dir, scenario, fake=fake, routers=routers)
