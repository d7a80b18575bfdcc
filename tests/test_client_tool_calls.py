"""sluiceway.client's tool-calling helpers: `Client.request` builds the tools fields, and
`generate` / `generate_samples` return each sample's calls joined from the pieces of all its
responses (a fake stub replays a recorded stream of pieces)."""

from __future__ import annotations

from collections.abc import Iterator

from sluiceway.client import Client
from sluiceway.v1 import inference_pb2 as pb


def test_request_builds_the_tools_fields() -> None:
    tool = pb.Tool(name="w", parameters='{"type": "object"}')
    req = Client.request(messages=[("user", "hi")], tools=[tool], tool_choice="required",
                         parallel_tool_calls=False)  # fmt: skip
    assert list(req.messages.tools) == [tool]
    assert req.messages.tool_choice.mode == pb.TOOL_CHOICE_MODE_REQUIRED
    assert req.messages.HasField("parallel_tool_calls") and not req.messages.parallel_tool_calls
    unset = Client.request(messages=[("user", "hi")], tools=[tool])
    assert not unset.messages.HasField("parallel_tool_calls")  # the server's default


class _Stub:
    def __init__(self, responses: list[pb.GenerateResponse]) -> None:
        self.responses = responses

    def Generate(self, request: pb.GenerateRequest, timeout: float | None) -> Iterator[
        pb.GenerateResponse
    ]:  # fmt: skip
        return iter(self.responses)


def test_generate_returns_the_calls_joined_on_the_last_response() -> None:
    pieces = [  # sample 0: a named call streamed in pieces; sample 1: two whole calls
        pb.GenerateResponse(index=0, tool_calls=[pb.ToolCall(index=0, id="call_a", name="w",
                                                             arguments='{"city": ')]),
        pb.GenerateResponse(index=1, text="ok ", tool_calls=[
            pb.ToolCall(index=0, id="call_b", name="w", arguments='{"city": "Rome"}')]),
        pb.GenerateResponse(index=0, tool_calls=[pb.ToolCall(index=0, arguments='"Paris"}')]),
        pb.GenerateResponse(index=1, tool_calls=[
            pb.ToolCall(index=1, id="call_c", name="w", arguments='{"city": "Oslo"}')],
            finish_reason=pb.FINISH_REASON_TOOL_CALLS),
        pb.GenerateResponse(index=0, finish_reason=pb.FINISH_REASON_TOOL_CALLS),
    ]  # fmt: skip
    with Client("127.0.0.1:1") as client:
        client.stub = _Stub(pieces)  # type: ignore[assignment]
        request = Client.request(messages=[("user", "hi")], n=2)
        (text0, _, last0), (text1, _, last1) = client.generate_samples(request)
        assert (text0, list(last0.tool_calls)) == (
            "",
            [pb.ToolCall(index=0, id="call_a", name="w", arguments='{"city": "Paris"}')],
        )
        assert (text1, list(last1.tool_calls)) == (
            "ok ",
            [
                pb.ToolCall(index=0, id="call_b", name="w", arguments='{"city": "Rome"}'),
                pb.ToolCall(index=1, id="call_c", name="w", arguments='{"city": "Oslo"}'),
            ],
        )
        assert last0.finish_reason == pb.FINISH_REASON_TOOL_CALLS
        client.stub = _Stub([r for r in pieces if r.index == 0])  # type: ignore[assignment]
        _, _, last = client.generate(Client.request(messages=[("user", "hi")]))
        assert [c.arguments for c in last.tool_calls] == ['{"city": "Paris"}']
