"""Errors the router reports back to the client.

The gRPC layer maps `InvalidRequest` to `INVALID_ARGUMENT`, with `str(error)`
("field: message") as the status details, so a client learns which field of
its request to fix and what range it must lie in.
"""

from __future__ import annotations

__all__ = ["InvalidRequest"]


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
