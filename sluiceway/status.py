"""A request's failure as data: a gRPC status code, a message and the request field at fault.

It crosses processes as a gRPC status. The details are ``"field: message"`` (readable by any
client), and the standard rich status (a ``google.rpc.Status`` in the
``grpc-status-details-bin`` trailer, grpcio-status's format) carries a ``google.rpc.BadRequest``
whose field violation names the field and holds the message, so that whoever forwards or shows
the error (the scheduler for a worker's, the router for a scheduler's, the HTTP front's
``param``) reads the field as data and never parses the text.

A status a sluiceway server chose is also marked (``STATUS_SOURCE_METADATA``), so that a
forwarder tells details written for clients from gRPC's own transport text, which names
internal addresses and socket paths.
"""

from __future__ import annotations

from typing import NoReturn

import grpc
from google.rpc import error_details_pb2, status_pb2

__all__ = [
    "STATUS_SOURCE_METADATA",
    "FieldError",
    "RequestError",
    "abort",
    "error_from_rpc",
    "written_by_sluiceway",
]

# Trailing metadata on a status a sluiceway server chose (`abort`).
STATUS_SOURCE_METADATA = "x-sluiceway-status"
# grpcio-status's key of the serialized google.rpc.Status (grpc_status._common).
RICH_STATUS_METADATA = "grpc-status-details-bin"

# What a client is told for a call that failed with a status no sluiceway server wrote
# (gRPC's transport text names socket paths and addresses; it goes to the log only).
TRANSPORT_DETAILS = {
    grpc.StatusCode.UNAVAILABLE: "the model replica is unavailable; retry",
    grpc.StatusCode.DEADLINE_EXCEEDED: "deadline exceeded",
    grpc.StatusCode.CANCELLED: "the model replica cancelled the request",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "the model replica is out of resources",
}
INTERNAL_DETAILS = "internal error in the model replica"


class RequestError(Exception):
    """A request that ends with a status instead of (more) tokens.

    Attributes:
        code: the gRPC status code (the HTTP front maps it to an HTTP status).
        message: what went wrong and what is allowed, without the field name
            (e.g. "must be in (0, 1]; got 1.5").
        field: the request field at fault in the public proto's words, with an index where
            it is a list element or a map key ("sampling.top_p", "sampling.stop[2]",
            "messages[3].role", "prompt_token_ids.ids[7]", "input" for the prompt as a
            whole), or None when no field is at fault.
    """

    def __init__(self, code: grpc.StatusCode, message: str, field: str | None = None) -> None:
        super().__init__(code, message, field)
        self.code = code
        self.message = message
        self.field = field

    @property
    def details(self) -> str:
        """The status details: ``"field: message"``, or the message alone."""
        return f"{self.field}: {self.message}" if self.field else self.message

    def __str__(self) -> str:
        return self.details

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.code.name}, {self.message!r}, {self.field!r})"


class FieldError(RequestError, ValueError):
    """INVALID_ARGUMENT naming the request field at fault (what validation raises)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(grpc.StatusCode.INVALID_ARGUMENT, message, field)

    def __repr__(self) -> str:
        return f"FieldError({self.field!r}, {self.message!r})"


def status_metadata(error: RequestError) -> tuple[tuple[str, str | bytes], ...]:
    """The trailing metadata of `error`'s status: the sluiceway mark and, for an error that
    names a field, the rich status with its ``google.rpc.BadRequest``."""
    metadata: list[tuple[str, str | bytes]] = [(STATUS_SOURCE_METADATA, "1")]
    if error.field is not None:
        violation = error_details_pb2.BadRequest.FieldViolation(
            field=error.field, description=error.message
        )
        status = status_pb2.Status(code=error.code.value[0], message=error.details)
        status.details.add().Pack(error_details_pb2.BadRequest(field_violations=[violation]))
        metadata.append((RICH_STATUS_METADATA, status.SerializeToString()))
    return tuple(metadata)


async def abort(context: grpc.aio.ServicerContext, error: RequestError) -> NoReturn:
    """Ends the call with `error`'s status (details, the sluiceway mark and, when it names a
    field, the rich status). Raises what `context.abort` raises to end the handler."""
    await context.abort(error.code, error.details, trailing_metadata=status_metadata(error))
    raise AssertionError("context.abort returned")  # it raises; for the type checker


def written_by_sluiceway(error: grpc.RpcError) -> bool:
    """Whether the status of a failed call was set by a sluiceway server through `abort`
    (details meant for clients), not by gRPC (a transport failure, an uncaught exception)."""
    metadata = error.trailing_metadata() or ()  # type: ignore[attr-defined]
    return any(key == STATUS_SOURCE_METADATA for key, _ in metadata)


def error_from_rpc(error: grpc.RpcError) -> RequestError:
    """The `RequestError` of a failed call to another sluiceway process: its code, and its
    field and message from the rich status when it names a field. A status no sluiceway server
    wrote gets a fixed text per code instead of gRPC's transport text (`TRANSPORT_DETAILS`,
    `INTERNAL_DETAILS` for the other codes)."""
    code: grpc.StatusCode = error.code()  # type: ignore[attr-defined]
    if not written_by_sluiceway(error):
        return RequestError(code, TRANSPORT_DETAILS.get(code, INTERNAL_DETAILS))
    for key, value in error.trailing_metadata() or ():  # type: ignore[attr-defined]
        if key != RICH_STATUS_METADATA:
            continue
        status = status_pb2.Status.FromString(value)
        for detail in status.details:
            bad_request = error_details_pb2.BadRequest()
            if detail.Unpack(bad_request) and bad_request.field_violations:
                violation = bad_request.field_violations[0]
                return RequestError(code, violation.description, violation.field)
    return RequestError(code, error.details() or INTERNAL_DETAILS)  # type: ignore[attr-defined]
