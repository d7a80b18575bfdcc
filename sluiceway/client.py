"""A small synchronous client of the public API, used by `sluiceway generate`, tests and benchmarks.

docs/client.md is its guide (every example there is run by a test); docs/api.md the
reference of the messages it sends and receives.
"""

from __future__ import annotations

import collections
import os
import pathlib
import time
from collections.abc import Iterator
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sluiceway.grpc_server import channel_options
from sluiceway.router.config import API_KEY_ENV
from sluiceway.v1 import inference_pb2, inference_pb2_grpc


def wait_until_serving(target: str, timeout_s: float, service: str = "") -> None:
    """Polls the gRPC health service of `target` until it answers SERVING.

    Args:
        target: host:port or unix:PATH of a router (or of any sluiceway server).
        timeout_s: seconds to wait at most.
        service: the health service name to check: "" (the default) is the whole server;
            a router also answers for "sluiceway.v1.Inference".

    Each check has a 1 s deadline; a failed or NOT_SERVING check is retried every 0.1 s.

    Raises:
        TimeoutError: not SERVING after `timeout_s` seconds.
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


def channel_credentials(
    ssl_ca_certs: str | None = None,
    ssl_certfile: str | None = None,
    ssl_keyfile: str | None = None,
) -> grpc.ChannelCredentials:
    """TLS of a channel to a router serving with --ssl-certfile: the server's certificate
    verified against `ssl_ca_certs` (PEM; None: the system's roots, as gRPC finds them), and a
    client certificate `ssl_certfile` with its key `ssl_keyfile` for a router that requires
    one (--ssl-ca-certs on its side).

    Raises:
        OSError: a file cannot be read.
        ValueError: one of `ssl_certfile` and `ssl_keyfile` without the other.
    """
    if (ssl_certfile is None) != (ssl_keyfile is None):
        raise ValueError("ssl_certfile and ssl_keyfile go together (a client certificate)")

    def read(path: str | None) -> bytes | None:
        return None if path is None else pathlib.Path(path).read_bytes()

    return grpc.ssl_channel_credentials(read(ssl_ca_certs), read(ssl_keyfile), read(ssl_certfile))


def api_key_metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    """The call metadata that carries `api_key` (``authorization: Bearer KEY``, what the
    HTTP API takes as a header); empty for None."""
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()


def connection(
    api_key: str | None = None,
    *,
    tls: bool = False,
    ssl_ca_certs: str | None = None,
    ssl_certfile: str | None = None,
    ssl_keyfile: str | None = None,
) -> tuple[tuple[tuple[str, str], ...], grpc.ChannelCredentials | None]:
    """How to reach a router (see `Client`): the metadata of every call (`api_key`, or
    $SLUICEWAY_API_KEY when None) and the channel's TLS credentials (None: plaintext; TLS when
    `tls` or any ssl_* file is given).

    Raises:
        OSError, ValueError: as `channel_credentials`.
    """
    metadata = api_key_metadata(api_key or os.environ.get(API_KEY_ENV) or None)
    if not (tls or ssl_ca_certs or ssl_certfile or ssl_keyfile):
        return metadata, None
    return metadata, channel_credentials(ssl_ca_certs, ssl_certfile, ssl_keyfile)


class _CallDetails(
    collections.namedtuple(
        "_CallDetails",
        ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression"),
    ),
    grpc.ClientCallDetails,
):
    """A call's details with other metadata (grpc.ClientCallDetails has no constructor)."""


class _AddMetadata(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Adds `metadata` to every call of a channel, the stub's own calls included."""

    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self.metadata = metadata

    def _details(self, details: grpc.ClientCallDetails) -> _CallDetails:
        d: Any = details
        metadata = (*(d.metadata or ()), *self.metadata)
        return _CallDetails(d.method, d.timeout, metadata, d.credentials, d.wait_for_ready,
                            d.compression)  # fmt: skip

    def intercept_unary_unary(self, continuation, client_call_details, request):  # type: ignore[no-untyped-def]
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):  # type: ignore[no-untyped-def]
        return continuation(self._details(client_call_details), request)


class Client:
    """Blocking client of `sluiceway.v1.Inference` on `target` (host:port or unix:PATH).

    `api_key`: sent with every call as ``authorization: Bearer KEY`` metadata, for a router
    started with --api-key (None: $SLUICEWAY_API_KEY when set, else no key); a missing or
    wrong key fails each call with UNAUTHENTICATED. TLS, for a router started with
    --ssl-certfile: `tls=True`, or any of `ssl_ca_certs` (the CA that signed the server's
    certificate, e.g. a self-signed one; default: the system's roots), `ssl_certfile` and
    `ssl_keyfile` (a client certificate, for a router that requires one) (`channel_credentials`).

    The channel connects on the first call (constructing never fails for an
    unreachable target: calls then raise UNAVAILABLE) and reconnects by itself. Messages
    are bounded to 4 MiB each way, as the server's default --max-message-size: a larger
    request fails with RESOURCE_EXHAUSTED before it is sent. One client may be shared by
    threads and carry concurrent calls.

    Attributes:
        channel: the `grpc.Channel`.
        stub: the generated `InferenceStub`, for calls with no helper here (`Tokenize`).
    """

    def __init__(
        self,
        target: str,
        *,
        api_key: str | None = None,
        tls: bool = False,
        ssl_ca_certs: str | None = None,
        ssl_certfile: str | None = None,
        ssl_keyfile: str | None = None,
    ) -> None:
        metadata, credentials = connection(
            api_key, tls=tls, ssl_ca_certs=ssl_ca_certs, ssl_certfile=ssl_certfile,
            ssl_keyfile=ssl_keyfile,
        )  # fmt: skip
        if credentials is not None:
            self.channel = grpc.secure_channel(target, credentials, options=channel_options())
        else:
            self.channel = grpc.insecure_channel(target, options=channel_options())
        calls = grpc.intercept_channel(self.channel, _AddMetadata(metadata)) if metadata else None
        self.stub = inference_pb2_grpc.InferenceStub(calls or self.channel)

    def close(self) -> None:
        """Closes the channel; calls still in flight on it end with CANCELLED (the server
        aborts their requests)."""
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def request(
        prompt: str | None = None,
        *,
        messages: list[tuple[str, str] | inference_pb2.ChatMessage] | None = None,
        prompt_token_ids: list[int] | None = None,
        request_id: str = "",
        priority: int = 0,
        tools: list[inference_pb2.Tool] | None = None,
        tool_choice: str | None = None,
        parallel_tool_calls: bool | None = None,
        **sampling: Any,
    ) -> inference_pb2.GenerateRequest:
        """Builds a `GenerateRequest` from exactly one input and `SamplingParams` fields.

        Sends nothing; the server validates the request when it is sent.

        Args:
            prompt: plain text, tokenized as the model's tokenizer does by default.
            messages: chat turns as (role, content) pairs, role "system", "user",
                "assistant" or "tool", or as `ChatMessage`s (with tool_calls or a
                tool_call_id); the model's chat template is applied.
            prompt_token_ids: token ids, sent as they are.
            request_id: echoed in every response and in the server's logs (at most 256
                characters); empty: the router assigns one.
            priority: lower is served first by a server run with `--scheduling-policy
                priority` (any int32); a server under fcfs refuses anything but 0.
            tools: functions the model may call (with `messages`; docs/tool-calling.md).
            tool_choice: "none", "auto" or "required", or the name of one of `tools` to
                call; None: the server's default (auto with tools).
            parallel_tool_calls: False: a required choice makes exactly one call; None: the
                server's default (true).
            **sampling: `SamplingParams` fields by name (temperature, top_p, top_k, min_p,
                repetition_penalty, presence_penalty, frequency_penalty, max_tokens,
                min_tokens, stop, stop_token_ids, include_stop_str_in_output, ignore_eos,
                skip_special_tokens, seed, logprobs, n, logit_bias, allowed_token_ids,
                structured_outputs); `stop` may be one string;
                unset ones take vLLM's defaults
                (docs/api.md has each default and range).

        Give one input: with several, the first of prompt, messages, prompt_token_ids is
        used; with none, the server answers INVALID_ARGUMENT ("input").

        Raises:
            ValueError: a `sampling` name that is not a field, or a value out of the
                field's type (max_tokens=-1).
            TypeError: a value of the wrong type (temperature="0").
        """
        if isinstance(sampling.get("stop"), str):  # one stop string, as OpenAI's "stop"
            sampling["stop"] = [sampling["stop"]]
        req = inference_pb2.GenerateRequest(
            request_id=request_id,
            sampling=inference_pb2.SamplingParams(**sampling),
            priority=priority,
        )
        if prompt is not None:
            req.prompt = prompt
        elif messages is not None:
            req.messages.messages.extend(
                m if isinstance(m, inference_pb2.ChatMessage)
                else inference_pb2.ChatMessage(role=m[0], content=m[1])
                for m in messages
            )  # fmt: skip
            req.messages.tools.extend(tools or [])
            modes = {"none": inference_pb2.TOOL_CHOICE_MODE_NONE,
                     "auto": inference_pb2.TOOL_CHOICE_MODE_AUTO,
                     "required": inference_pb2.TOOL_CHOICE_MODE_REQUIRED}  # fmt: skip
            if tool_choice in modes:
                req.messages.tool_choice.mode = modes[tool_choice]
            elif tool_choice is not None:
                req.messages.tool_choice.function_name = tool_choice
            if parallel_tool_calls is not None:
                req.messages.parallel_tool_calls = parallel_tool_calls
        elif prompt_token_ids is not None:
            req.prompt_token_ids.ids.extend(prompt_token_ids)
        return req

    def generate_stream(
        self, request: inference_pb2.GenerateRequest, timeout: float | None = None
    ) -> Iterator[inference_pb2.GenerateResponse]:
        """Streams the responses of one request: one per decoded step, each with the new text
        and token ids of one sample (`index`), its last one with finish_reason and usage.

        `timeout` is the call's deadline in seconds (None: none), for the whole stream.
        The returned iterator is also a `grpc.Call`: `cancel()` ends the call (the server
        aborts the request and frees its KV blocks), `code()` and `details()` tell how it
        ended.

        Raises (while iterating, not when called):
            grpc.RpcError: a failed call; `code()` is INVALID_ARGUMENT (details "field:
                what is allowed"), RESOURCE_EXHAUSTED (the waiting queue is full, or a
                message over 4 MiB), UNAVAILABLE (no model replica ready, the router
                draining, or unreachable), DEADLINE_EXCEEDED (`timeout` passed) or
                CANCELLED (cancelled by this client); UNAUTHENTICATED (no valid API key).
        """
        return self.stub.Generate(request, timeout=timeout)  # type: ignore[no-any-return]

    def generate(
        self, request: inference_pb2.GenerateRequest, timeout: float | None = None
    ) -> tuple[str, list[int], inference_pb2.GenerateResponse]:
        """Runs one request to the end: (the whole text, every generated token id, the last
        response, which carries finish_reason and usage, and in `tool_calls` every tool call
        of the answer whole, as `generate_samples` joins them). `timeout`: the call's deadline in
        seconds (None: none).

        Raises:
            ValueError: ``sampling.n`` > 1 (see `generate_samples`).
            grpc.RpcError: a failed call, with the codes of `generate_stream`.
        """
        if request.sampling.n > 1:
            raise ValueError("sampling.n > 1: use generate_samples")
        ((text, ids, last),) = self.generate_samples(request, timeout)
        return text, ids, last

    def generate_samples(
        self, request: inference_pb2.GenerateRequest, timeout: float | None = None
    ) -> list[tuple[str, list[int], inference_pb2.GenerateResponse]]:
        """Runs a request of ``sampling.n`` samples to the end: (text, token ids, last
        response) of each, in `index` order (one entry when n is unset or 1). The last
        response's `tool_calls` is replaced by all of that sample's calls, joined: one
        `ToolCall` per call index with its id, name and whole arguments (the pieces came in
        earlier responses). `timeout`: the call's deadline in seconds (None: none).

        Raises:
            grpc.RpcError: a failed call, with the codes of `generate_stream` (a failure of
                one sample ends them all).
        """
        n = max(1, request.sampling.n)
        text: list[list[str]] = [[] for _ in range(n)]
        ids: list[list[int]] = [[] for _ in range(n)]
        last = [inference_pb2.GenerateResponse() for _ in range(n)]
        calls: list[dict[int, inference_pb2.ToolCall]] = [{} for _ in range(n)]
        for response in self.generate_stream(request, timeout):
            i = response.index
            text[i].append(response.text)
            ids[i].extend(response.token_ids)
            last[i] = response
            for piece in response.tool_calls:
                whole = calls[i].setdefault(piece.index, inference_pb2.ToolCall(index=piece.index))
                whole.id = whole.id or piece.id
                whole.name = whole.name or piece.name
                whole.arguments += piece.arguments
        for i in range(n):
            final, last[i] = last[i], inference_pb2.GenerateResponse()
            last[i].CopyFrom(final)
            del last[i].tool_calls[:]
            last[i].tool_calls.extend(calls[i][k] for k in sorted(calls[i]))
        return [("".join(text[i]), ids[i], last[i]) for i in range(n)]

    def model_info(self) -> inference_pb2.ModelInfo:
        """The served model and its KV cache (`GetModelInfo`), with a 10 s deadline.

        Raises:
            grpc.RpcError: UNAVAILABLE while no model replica is ready (or the router is
                unreachable), DEADLINE_EXCEEDED after 10 s.
        """
        return self.stub.GetModelInfo(inference_pb2.GetModelInfoRequest(), timeout=10)  # type: ignore[no-any-return]
