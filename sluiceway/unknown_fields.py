"""Refusing protobuf fields this server does not know: a client built from a newer
`sluiceway.v1` proto may set a field that the parser here keeps aside as unknown, and a request
that asks for something the server would silently not do must fail instead (the gRPC API's
half of "nothing is silently dropped"; the HTTP API's is router/openai_fields.py)."""

from __future__ import annotations

from google.protobuf.message import Message
from google.protobuf.unknown_fields import UnknownFieldSet

from sluiceway.status import FieldError

__all__ = ["check_unknown_fields"]


def check_unknown_fields(message: Message, where: str = "") -> None:
    """Raises FieldError naming the first field of `message`, or of a message set in it at any
    depth, that this server's proto does not declare.

    Args:
        message: a parsed request.
        where: `message`'s place in the request ("sampling"), "" for the request itself.

    Raises:
        FieldError(where or "request"): the field's number, as the parser only knows that.
    """
    unknown = UnknownFieldSet(message)
    if len(unknown):
        number = unknown[0].field_number
        raise FieldError(
            where or "request",
            f"has field number {number}, which this server does not implement (a client "
            "built from a newer proto?); refused rather than ignored",
        )
    for field, value in message.ListFields():
        if field.message_type is None or field.message_type.GetOptions().map_entry:
            continue
        name = f"{where}.{field.name}" if where else field.name
        if field.is_repeated:
            for i, item in enumerate(value):
                check_unknown_fields(item, f"{name}[{i}]")
        else:
            check_unknown_fields(value, name)
