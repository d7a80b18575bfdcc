"""Errors the router reports back to the client.

The gRPC layer maps `InvalidRequest` to `INVALID_ARGUMENT`, with `str(error)`
("field: message") as the status details, so a client learns which field of
its request to fix and what range it must lie in.
"""

from __future__ import annotations

import grpc

from sluiceway.grpc_server import written_by_sluiceway

__all__ = ["InvalidRequest", "client_details"]

# What a client is told for a scheduler call that failed with a status no sluiceway server
# wrote (gRPC's transport text names socket paths and addresses; it goes to the log).
TRANSPORT_DETAILS = {
    grpc.StatusCode.UNAVAILABLE: "the model replica is unavailable; retry",
    grpc.StatusCode.DEADLINE_EXCEEDED: "deadline exceeded",
    grpc.StatusCode.CANCELLED: "the model replica cancelled the request",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "the model replica is out of resources",
}
INTERNAL_DETAILS = "internal error in the model replica"


def client_details(error: grpc.aio.AioRpcError) -> str:
    """The status details to send a client for `error`, a failed call to a scheduler: its own
    details when a sluiceway server wrote them (`sluiceway.grpc_server.abort`), else a fixed
    text per code (`TRANSPORT_DETAILS`, `INTERNAL_DETAILS` for the other codes)."""
    if written_by_sluiceway(error):
        return error.details() or INTERNAL_DETAILS
    return TRANSPORT_DETAILS.get(error.code(), INTERNAL_DETAILS)


class InvalidRequest(Exception):
    """A request the router refuses before it reaches a scheduler.

    Attributes:
        field: the offending request field, in the public proto's words, with
            an index where it is a list element, e.g. "sampling.top_p",
            "messages[3].role", "prompt_token_ids.ids[7]", or "input" for the
            prompt as a whole.
        message: what is wrong and what is allowed, e.g.
            "must be in (0, 1], got 1.5".
    """

    __slots__ = ("field", "message")

    def __init__(self, field: str, message: str) -> None:
        super().__init__(field, message)
        self.field = field
        self.message = message

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"

    def __repr__(self) -> str:
        return f"InvalidRequest({self.field!r}, {self.message!r})"
