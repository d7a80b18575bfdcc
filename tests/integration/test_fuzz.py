"""Random GenerateRequests against the live stack: a clear status or a stream, never a crash."""

from __future__ import annotations

import grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sluiceway.v1 import inference_pb2
from tests.integration.conftest import Stack, wait_for_free_blocks

# odd unicode: control characters, emoji, mixed scripts, lone combining marks
TEXT = st.text(
    st.characters(blacklist_categories=("Cs",)),  # no surrogates: proto strings are UTF-8
    max_size=120,
)
FLOAT32 = st.floats(width=32, allow_nan=True, allow_infinity=True)


@st.composite
def generate_requests(draw: st.DrawFn) -> inference_pb2.GenerateRequest:
    req = inference_pb2.GenerateRequest(request_id=draw(st.text(max_size=300)))
    which = draw(st.sampled_from(["prompt", "messages", "prompt_token_ids", "none"]))
    if which == "prompt":
        req.prompt = draw(TEXT)
    elif which == "messages":
        for role, content in draw(
            st.lists(
                st.tuples(st.sampled_from(["user", "assistant", "system", "tool", "x", ""]), TEXT),
                max_size=3,
            )
        ):
            req.messages.messages.add(role=role, content=content)
    elif which == "prompt_token_ids":
        req.prompt_token_ids.ids.extend(
            draw(st.lists(st.integers(0, 2**32 - 1) | st.integers(0, 49151), max_size=40))
        )
    s = req.sampling
    for name, strategy in (
        ("temperature", FLOAT32), ("top_p", FLOAT32), ("repetition_penalty", FLOAT32),
        ("top_k", st.integers(-(2**31), 2**31 - 1)), ("max_tokens", st.integers(0, 6)),
        ("seed", st.integers(0, 2**64 - 1)), ("min_p", FLOAT32), ("presence_penalty", FLOAT32),
        ("frequency_penalty", FLOAT32), ("min_tokens", st.integers(0, 2**32 - 1)),
        ("logprobs", st.integers(0, 2**32 - 1)), ("skip_special_tokens", st.booleans()),
    ):  # fmt: skip
        if draw(st.booleans()):
            setattr(s, name, draw(strategy))
    s.stop.extend(draw(st.lists(TEXT, max_size=18)))
    s.stop_token_ids.extend(draw(st.lists(st.integers(0, 2**32 - 1), max_size=3)))
    s.ignore_eos = draw(st.booleans())
    s.include_stop_str_in_output = draw(st.booleans())
    if not s.HasField("max_tokens"):
        s.max_tokens = 4  # keep each example short
    return req


OK_CODES = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
}


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(request=generate_requests())
def test_random_requests_get_a_stream_or_a_clear_error(
    stack: Stack, request: inference_pb2.GenerateRequest
) -> None:
    with stack.client() as client:
        try:
            responses = list(client.stub.Generate(request, timeout=120))
            code = grpc.StatusCode.OK
        except grpc.RpcError as e:
            code, responses = e.code(), []
            assert e.details(), "an error without a message"
    assert code in OK_CODES, f"{code}: {request}"
    if code == grpc.StatusCode.OK:
        last = responses[-1]
        assert last.finish_reason != inference_pb2.FINISH_REASON_UNSPECIFIED
        assert last.usage.completion_tokens == sum(len(r.token_ids) for r in responses)


def test_no_block_is_held_after_the_random_requests(stack: Stack) -> None:
    with stack.client() as client:
        info = wait_for_free_blocks(client)
    assert info.num_free_kv_blocks == info.num_kv_blocks
