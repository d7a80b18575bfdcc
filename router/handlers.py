"""The `sluiceway.v1.Inference` method handlers, with request decoding that never raises.

`inference_pb2_grpc.add_InferenceServicer_to_server` deserializes with
`Message.FromString`: bytes that are not a valid message (a corrupt wire format,
a string field with bad UTF-8) raise `DecodeError` inside gRPC, and the client
gets UNKNOWN "Unexpected <class 'DecodeError'>...". `add_inference_servicer`
registers the same methods (names, kinds, response serializers, generic and
registered handlers) with deserializers that return a `MalformedRequest`
instead of raising; the handler then ends the call with INVALID_ARGUMENT
"request is not a valid <message type>: <why>" without calling the servicer.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message

from sluiceway.v1 import inference_pb2

SERVICE_NAME = inference_pb2.DESCRIPTOR.services_by_name["Inference"].full_name


@dataclass(frozen=True)
class MalformedRequest:
    """What a request deserializer returns for bytes that are not a valid `type_name`."""

    type_name: str  # the message's full name, e.g. sluiceway.v1.GenerateRequest
    error: str  # why it is not, from the DecodeError

    @property
    def details(self) -> str:
        """The INVALID_ARGUMENT status details."""
        return f"request is not a valid {self.type_name}: {self.error}"


def lenient_deserializer(message_class: type[Message]) -> Callable[[bytes], Any]:
    """`message_class.FromString`, except that undecodable bytes give a `MalformedRequest`."""
    type_name = message_class.DESCRIPTOR.full_name
    # upb's DecodeError already names the type; the details say it once
    prefix = f"Error parsing message with type '{type_name}': "

    def deserialize(data: bytes) -> Message | MalformedRequest:
        try:
            return message_class.FromString(data)
        except DecodeError as e:
            error = str(e).removeprefix(prefix) or "cannot be parsed"
            return MalformedRequest(type_name, error)

    return deserialize


# Called with the method name ("Generate") and the malformed request, before the call
# ends with INVALID_ARGUMENT (logs, metrics).
OnMalformed = Callable[[str, MalformedRequest], None]


def _unary_stream(
    name: str, method: Callable[[Any, Any], AsyncGenerator[Any, None]], on_malformed: OnMalformed
) -> Callable[[Any, grpc.aio.ServicerContext], AsyncIterator[Any]]:
    # An async generator function: grpc.aio runs it on the event loop as it runs the
    # servicer's own (a plain function would be taken for a sync handler).
    async def handler(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        if isinstance(request, MalformedRequest):
            on_malformed(name, request)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.details)
        async with contextlib.aclosing(method(request, context)) as responses:
            async for response in responses:
                yield response

    return handler


def _unary_unary(
    name: str, method: Callable[[Any, Any], Awaitable[Any]], on_malformed: OnMalformed
) -> Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]:
    async def handler(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, MalformedRequest):
            on_malformed(name, request)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.details)
        return await method(request, context)

    return handler


def _ignore(name: str, request: MalformedRequest) -> None:
    pass


def add_inference_servicer(
    servicer: Any, server: grpc.aio.Server, on_malformed: OnMalformed = _ignore
) -> None:
    """`inference_pb2_grpc.add_InferenceServicer_to_server(servicer, server)`, except that a
    request that does not decode gets INVALID_ARGUMENT (after `on_malformed`)."""
    pb = inference_pb2
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            _unary_stream("Generate", servicer.Generate, on_malformed),
            request_deserializer=lenient_deserializer(pb.GenerateRequest),
            response_serializer=pb.GenerateResponse.SerializeToString,
        ),
        "Tokenize": grpc.unary_unary_rpc_method_handler(
            _unary_unary("Tokenize", servicer.Tokenize, on_malformed),
            request_deserializer=lenient_deserializer(pb.TokenizeRequest),
            response_serializer=pb.TokenizeResponse.SerializeToString,
        ),
        "GetModelInfo": grpc.unary_unary_rpc_method_handler(
            _unary_unary("GetModelInfo", servicer.GetModelInfo, on_malformed),
            request_deserializer=lenient_deserializer(pb.GetModelInfoRequest),
            response_serializer=pb.ModelInfo.SerializeToString,
        ),
    }
    methods = {m.name for m in inference_pb2.DESCRIPTOR.services_by_name["Inference"].methods}
    if methods != handlers.keys():  # the proto changed: every method needs its handler here
        raise RuntimeError(
            f"{SERVICE_NAME} has methods {sorted(methods)}, handled {sorted(handlers)}"
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)
