"""Every invalid input of the public API: the exact status, a message naming the field, and
the server keeps serving a valid request right after."""

from __future__ import annotations

import grpc
import pytest

from sluiceway.client import Client
from sluiceway.v1 import inference_pb2
from tests.integration.conftest import Stack

INVALID = grpc.StatusCode.INVALID_ARGUMENT


def _request(**fields: object) -> inference_pb2.GenerateRequest:
    prompt = fields.pop("prompt", "Hello")
    return Client.request(prompt, **fields)  # type: ignore[arg-type]


def _no_input() -> inference_pb2.GenerateRequest:
    return inference_pb2.GenerateRequest(sampling=inference_pb2.SamplingParams(max_tokens=2))


CASES = [
    ("empty prompt", lambda: _request(prompt=""), "input"),
    ("no input", _no_input, "input"),
    ("negative temperature", lambda: _request(temperature=-0.5), "sampling.temperature"),
    ("NaN temperature", lambda: _request(temperature=float("nan")), "sampling.temperature"),
    ("top_p 0", lambda: _request(top_p=0.0), "sampling.top_p"),
    ("top_p over 1", lambda: _request(top_p=1.5), "sampling.top_p"),
    ("top_k below -1", lambda: _request(top_k=-2), "sampling.top_k"),
    ("repetition_penalty 0", lambda: _request(repetition_penalty=0.0),
     "sampling.repetition_penalty"),
    ("max_tokens 0", lambda: _request(max_tokens=0), "sampling.max_tokens"),
    ("token id out of vocab", lambda: Client.request(prompt_token_ids=[1, 2, 10**6]),
     "prompt_token_ids.ids[2]"),
    ("unknown chat role", lambda: Client.request(messages=[("user", "hi"), ("wizard", "x")]),
     "messages[1].role"),
    ("17 stop strings", lambda: _request(stop=[str(i) for i in range(17)]), "sampling.stop"),
    ("stop string over 256 bytes", lambda: _request(stop=["ok", "é" * 129]), "sampling.stop[1]"),
    ("empty stop string", lambda: _request(stop=[""]), "sampling.stop[0]"),
    ("stop token id out of vocab", lambda: _request(stop_token_ids=[10**6]),
     "sampling.stop_token_ids[0]"),
    ("min_p over 1", lambda: _request(min_p=1.5), "sampling.min_p"),
    ("presence_penalty over 2", lambda: _request(presence_penalty=2.5),
     "sampling.presence_penalty"),
    ("frequency_penalty below -2", lambda: _request(frequency_penalty=-2.5),
     "sampling.frequency_penalty"),
    ("logprobs over 20", lambda: _request(logprobs=21), "sampling.logprobs"),
    ("min_tokens over max_tokens", lambda: _request(min_tokens=5, max_tokens=4),
     "sampling.min_tokens"),
    ("request_id over 256 chars", lambda: Client.request("Hi", request_id="r" * 257),
     "request_id"),
    ("allowed_token_ids with a constraint", lambda: _request(
        allowed_token_ids=[5], structured_outputs=inference_pb2.StructuredOutputs(
            choice=inference_pb2.Choices(choices=["hello"]))), "sampling.allowed_token_ids"),
    ("1025 stop token ids", lambda: _request(stop_token_ids=list(range(1025))),
     "sampling.stop_token_ids"),
    ("priority under fcfs", lambda: _request(priority=-1), "priority"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "make", "field"), CASES, ids=[c[0] for c in CASES])
def test_invalid_input_names_the_field(stack: Stack, name: str, make, field: str) -> None:  # type: ignore[no-untyped-def]
    with stack.client() as client:
        with pytest.raises(grpc.RpcError) as err:
            client.generate(make(), timeout=60)
        assert err.value.code() == INVALID, name
        assert (err.value.details() or "").startswith(f"{field}:"), err.value.details()
        _, ids, last = client.generate(
            Client.request("Hello", temperature=0, max_tokens=2), timeout=60
        )
        assert len(ids) == 2 and last.finish_reason == inference_pb2.FINISH_REASON_LENGTH


def test_values_at_the_edge_of_their_range_are_served(stack: Stack) -> None:
    """A repetition penalty near 0 and a temperature near the greedy threshold push logits
    past float32's range: served with finite logprobs (such a row's NaN softmax once failed
    the whole step, every request in it)."""
    edge = [
        _request(temperature=0, max_tokens=4, repetition_penalty=1e-38, logprobs=2),
        _request(temperature=2e-5, max_tokens=4, repetition_penalty=1e-38, logprobs=2, seed=3),
    ]
    with stack.client() as client:
        for req in edge:
            responses = list(client.generate_stream(req, timeout=60))
            lps = [lp for r in responses for lp in r.logprobs]
            assert len(lps) == 4 and all(-1e30 < lp.logprob <= 0 for lp in lps), lps
            assert responses[-1].finish_reason == inference_pb2.FINISH_REASON_LENGTH


def test_prompt_at_max_model_len_is_invalid(stack: Stack) -> None:
    with stack.client() as client:
        limit = client.model_info().max_model_len
        with pytest.raises(grpc.RpcError) as err:
            client.generate(Client.request(prompt_token_ids=[42] * limit), timeout=60)
    assert err.value.code() == INVALID
    assert "max_model_len" in (err.value.details() or "")


def test_a_message_over_4_mib_is_resource_exhausted(stack: Stack) -> None:
    with grpc.insecure_channel(stack.target) as channel:  # no client-side size limit
        call = channel.unary_stream(
            "/sluiceway.v1.Inference/Generate",
            request_serializer=inference_pb2.GenerateRequest.SerializeToString,
            response_deserializer=inference_pb2.GenerateResponse.FromString,
        )
        with pytest.raises(grpc.RpcError) as err:
            list(call(_request(prompt="x" * (5 * 2**20)), timeout=60))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_control_characters_emoji_and_mixed_scripts_work(stack: Stack) -> None:
    with stack.client() as client:
        _, ids, last = client.generate(
            Client.request("\x00\x07\t🙂 Привет, 世界! مرحبا\u200d", temperature=0, max_tokens=3),
            timeout=60,
        )
    assert len(ids) == 3 and last.usage.prompt_tokens > 5


def test_max_message_size_is_a_flag() -> None:
    from tests.integration.conftest import start_stack, stop_stack

    stack = start_stack("--max-message-size", "1MiB")  # below the 4 MiB default
    try:
        with grpc.insecure_channel(stack.target) as channel:
            call = channel.unary_stream(
                "/sluiceway.v1.Inference/Generate",
                request_serializer=inference_pb2.GenerateRequest.SerializeToString,
                response_deserializer=inference_pb2.GenerateResponse.FromString,
            )
            with pytest.raises(grpc.RpcError) as err:  # over 1 MiB: refused
                list(call(_request(prompt="x" * (3 * 2**19)), timeout=60))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            with pytest.raises(grpc.RpcError) as err:  # under: through, then too many tokens
                list(call(_request(prompt="x " * 2**17), timeout=120))
        assert err.value.code() == INVALID
        assert "max_model_len" in (err.value.details() or "")
    finally:
        assert stop_stack(stack) == 0
