"""API keys and TLS of the public ports, without a model: the key check, the flags and the
files `serve` refuses before any child starts, the gRPC interceptor on a real in-process
server (and mutual TLS with `server_credentials`), and the HTTP middleware on the real app."""

from __future__ import annotations

import asyncio
import contextlib
import io
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
from fastapi.testclient import TestClient
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from sluiceway import serve_check
from sluiceway.client import Client, channel_credentials
from sluiceway.router.auth import (
    UNAUTHORIZED,
    ApiKeyInterceptor,
    ApiKeys,
    server_credentials,
)
from sluiceway.router.config import RouterConfig
from sluiceway.router.openai_api import build_app
from sluiceway.security import api_keys, check_files
from sluiceway.v1 import inference_pb2
from tests.tls_certs import Certs, make_certs


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("tls"))


# ------------------------------------------------------------------------- the key check


def test_a_key_is_accepted_only_as_a_bearer_token_of_a_known_key() -> None:
    keys = ApiKeys(["k1", "second-key"])
    assert [keys.allows(h) for h in ("Bearer k1", "bearer second-key", "BEARER k1")] == [True] * 3
    refused = [None, "", "k1", "Bearer", "Bearer ", "Bearer k2", "Basic k1", "Bearer k1x",
               "Bearer second"]  # fmt: skip
    assert [keys.allows(h) for h in refused] == [False] * len(refused)
    with pytest.raises(ValueError):
        ApiKeys([])
    with pytest.raises(ValueError):
        ApiKeys([""])


def test_keys_come_from_the_flag_the_file_or_else_the_environment(tmp_path: Path) -> None:
    file = tmp_path / "keys"
    file.write_text("# the team's keys\n\n  alpha  \nbeta\nalpha\n")
    env = {"SLUICEWAY_API_KEY": "from-env,other"}
    assert api_keys(RouterConfig(api_key="a,b"), env) == ["a", "b"]
    assert api_keys(RouterConfig(api_key_file=str(file)), env) == ["alpha", "beta"]
    both = RouterConfig(api_key="a", api_key_file=str(file))
    assert api_keys(both, env) == ["a", "alpha", "beta"]
    assert api_keys(RouterConfig(), env) == ["from-env", "other"]  # as vLLM's VLLM_API_KEY
    assert api_keys(RouterConfig(), {"SLUICEWAY_API_KEY": ""}) == []
    assert api_keys(RouterConfig(), {}) == []


def _serve_check(*argv: str) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            code = serve_check.main(["--port", "0", "--metrics-port", "-1", *argv])
        except SystemExit as e:  # a usage error
            code = int(e.code or 0)
    return code, err.getvalue().strip()


def test_serve_refuses_a_bad_key_or_tls_flag_with_one_line_naming_it(
    tmp_path: Path, certs: Certs
) -> None:
    empty = tmp_path / "empty"
    empty.write_text("# no key\n\n")
    missing = str(tmp_path / "missing.pem")
    cert, key = str(certs.server_cert), str(certs.server_key)
    cases = [
        (["--api-key", ""], "sluiceway serve: error: argument --api-key: must be one or more "
         "non-empty keys, comma-separated (see sluiceway serve --help)"),
        (["--api-key", "a,,b"], "sluiceway serve: error: argument --api-key: must be one or "
         "more non-empty keys, comma-separated (see sluiceway serve --help)"),
        (["--ssl-cert-reqs", "1"], "sluiceway serve: error: argument --ssl-cert-reqs: must be "
         "0 (no client certificate) or 2 (one required), got 1 (1, optional, is not supported "
         "by the gRPC port) (see sluiceway serve --help)"),
        (["--api-key-file", str(tmp_path / "nope")], f"sluiceway: --api-key-file "
         f"{tmp_path / 'nope'}: cannot read it (No such file or directory)"),
        (["--api-key-file", str(empty)], f"sluiceway: --api-key-file {empty}: has no key "
         "(one per line)"),
        (["--ssl-certfile", cert], "sluiceway: --ssl-certfile needs --ssl-keyfile (TLS takes "
         "both)"),
        (["--ssl-keyfile", key], "sluiceway: --ssl-keyfile needs --ssl-certfile (TLS takes "
         "both)"),
        (["--ssl-ca-certs", str(certs.ca)], "sluiceway: --ssl-ca-certs needs --ssl-certfile "
         "and --ssl-keyfile (TLS)"),
        (["--ssl-certfile", cert, "--ssl-keyfile", key, "--ssl-cert-reqs", "2"],
         "sluiceway: --ssl-cert-reqs 2 needs --ssl-ca-certs (the CA client certificates "
         "chain to)"),
        (["--ssl-certfile", missing, "--ssl-keyfile", key],
         f"sluiceway: --ssl-certfile {missing}: cannot read it (No such file or directory)"),
        (["--ssl-certfile", cert, "--ssl-keyfile", cert, "--ssl-ca-certs", missing],
         f"sluiceway: --ssl-ca-certs {missing}: cannot read it (No such file or directory)"),
    ]  # fmt: skip
    for argv, line in cases:
        assert _serve_check(*argv) == (2, line), argv
    # a key that is not the certificate's
    code, line = _serve_check("--ssl-certfile", cert, "--ssl-keyfile", str(certs.client_key))
    assert code == 2
    assert line.startswith(f"sluiceway: --ssl-certfile {cert} and --ssl-keyfile "
                           f"{certs.client_key}: not a PEM certificate chain and its "
                           "unencrypted private key (")  # fmt: skip
    ok = ["--ssl-certfile", cert, "--ssl-keyfile", key, "--ssl-ca-certs", str(certs.ca)]
    assert _serve_check(*ok, "--api-key", "k") == (0, "")


def test_client_certificates_are_required_with_ca_certs_unless_cert_reqs_0(certs: Certs) -> None:
    tls = {"ssl_certfile": str(certs.server_cert), "ssl_keyfile": str(certs.server_key)}
    assert not RouterConfig(**tls).client_cert_required
    assert RouterConfig(**tls, ssl_ca_certs=str(certs.ca)).client_cert_required
    assert not RouterConfig(**tls, ssl_ca_certs=str(certs.ca), ssl_cert_reqs=0).client_cert_required
    check_files(RouterConfig(**tls, ssl_ca_certs=str(certs.ca)))


# ------------------------------------------------------------------ the gRPC interceptor

GENERATE = "/sluiceway.v1.Inference/Generate"
TOKENIZE = "/sluiceway.v1.Inference/Tokenize"


async def _tokenize(request: inference_pb2.TokenizeRequest, context: Any) -> Any:
    return inference_pb2.TokenizeResponse(token_ids=[len(request.prompt)])


async def _generate(request: Any, context: Any) -> AsyncIterator[Any]:
    yield inference_pb2.GenerateResponse(text="a")
    yield inference_pb2.GenerateResponse(text="b")


def _service() -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler(
        "sluiceway.v1.Inference",
        {
            "Tokenize": grpc.unary_unary_rpc_method_handler(
                _tokenize,
                request_deserializer=inference_pb2.TokenizeRequest.FromString,
                response_serializer=inference_pb2.TokenizeResponse.SerializeToString,
            ),
            "Generate": grpc.unary_stream_rpc_method_handler(
                _generate,
                request_deserializer=inference_pb2.GenerateRequest.FromString,
                response_serializer=inference_pb2.GenerateResponse.SerializeToString,
            ),
        },
    )


@contextlib.asynccontextmanager
async def _server(
    keys: ApiKeys | None, credentials: grpc.ServerCredentials | None = None
) -> AsyncIterator[str]:
    server = grpc.aio.server(interceptors=[ApiKeyInterceptor(keys)] if keys else None)
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    server.add_generic_rpc_handlers([_service()])
    if credentials is None:
        port = server.add_insecure_port("127.0.0.1:0")
    else:
        port = server.add_secure_port("127.0.0.1:0", credentials)
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


def _calls(target: str, **client: Any) -> list[Any]:
    """(Tokenize's answer or code, Generate's texts or code, health's status) from a Client."""
    out: list[Any] = []
    with Client(target, **client) as c:
        try:
            out.append(list(c.stub.Tokenize(inference_pb2.TokenizeRequest(prompt="abc")).token_ids))
        except grpc.RpcError as e:
            out.append((e.code(), e.details()))  # type: ignore[attr-defined]
        try:
            out.append([r.text for r in c.generate_stream(Client.request("x"))])
        except grpc.RpcError as e:
            out.append((e.code(), e.details()))  # type: ignore[attr-defined]
        reply = health_pb2_grpc.HealthStub(c.channel).Check(health_pb2.HealthCheckRequest())
        out.append(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
    return out


def test_the_interceptor_refuses_calls_without_a_valid_key_but_not_health(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("SLUICEWAY_API_KEY", raising=False)
    refused = (grpc.StatusCode.UNAUTHENTICATED, UNAUTHORIZED)

    async def main() -> list[list[Any]]:
        async with _server(ApiKeys(["k1", "k2"])) as target:
            return [
                await asyncio.to_thread(_calls, target),
                await asyncio.to_thread(_calls, target, api_key="wrong"),
                await asyncio.to_thread(_calls, target, api_key="k2"),
            ]

    none, wrong, right = asyncio.run(main())
    assert none == [refused, refused, "SERVING"]
    assert wrong == [refused, refused, "SERVING"]
    assert right == [[3], ["a", "b"], "SERVING"]
    # the environment variable, as the clients read it
    monkeypatch.setenv("SLUICEWAY_API_KEY", "k1")

    async def env() -> list[Any]:
        async with _server(ApiKeys(["k1"])) as target:
            return await asyncio.to_thread(_calls, target)

    assert asyncio.run(env()) == [[3], ["a", "b"], "SERVING"]


def test_mutual_tls_admits_a_client_certificate_of_the_ca_only(certs: Certs) -> None:
    config = RouterConfig(ssl_certfile=str(certs.server_cert), ssl_keyfile=str(certs.server_key),
                          ssl_ca_certs=str(certs.ca))  # fmt: skip
    credentials = server_credentials(config)
    assert credentials is not None
    ca = str(certs.ca)

    def codes(target: str, **client: Any) -> list[Any]:
        return [r if isinstance(r, list) else r[0] for r in _calls(target, **client)[:2]]

    async def main() -> list[Any]:
        async with _server(None, credentials) as target:
            with_cert = await asyncio.to_thread(
                codes, target, ssl_ca_certs=ca, ssl_certfile=str(certs.client_cert),
                ssl_keyfile=str(certs.client_key),
            )  # fmt: skip
            out: list[Any] = [with_cert]
            for client in ({"ssl_ca_certs": ca}, {}):  # no client certificate; plaintext
                with Client(target, **client) as c:
                    call = c.stub.Tokenize.future(inference_pb2.TokenizeRequest(), timeout=5)
                    out.append(await asyncio.to_thread(lambda call=call: call.code()))
            return out

    with_cert, without, plaintext = asyncio.run(main())
    assert with_cert == [[3], ["a", "b"]]
    assert (without, plaintext) == (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAVAILABLE)
    with pytest.raises(ValueError):
        channel_credentials(ca, ssl_certfile=str(certs.client_cert))


# --------------------------------------------------------------------- the HTTP middleware


@pytest.fixture(scope="module")
def http() -> TestClient:
    unready = SimpleNamespace(serving=False, limits=None)  # no scheduler: 503 past the key check
    return TestClient(build_app(unready, ApiKeys(["k"])), raise_server_exceptions=False)  # type: ignore[arg-type]


def test_http_needs_the_key_everywhere_but_health(http: TestClient) -> None:
    body = {"error": {"message": UNAUTHORIZED, "type": "AuthenticationError", "param": None,
                      "code": 401}}  # fmt: skip
    for method, path in [("GET", "/v1/models"), ("POST", "/v1/chat/completions"),
                         ("POST", "/v1/completions"), ("POST", "/tokenize"),
                         ("POST", "/detokenize"), ("GET", "/no/such/path")]:  # fmt: skip
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "k"}):
            r = http.request(method, path, json={}, headers=headers)
            assert (r.status_code, r.json(), r.headers["www-authenticate"]) == (
                401, body, "Bearer"), (method, path, headers)  # fmt: skip
    r = http.get("/v1/models", headers={"Authorization": "Bearer k"})
    assert (r.status_code, r.json()["error"]["message"]) == (503, "no scheduler is ready yet")
    r = http.get("/health")  # open: answers as the router's health (no scheduler: 503)
    assert (r.status_code, r.json()["error"]["message"]) == (503, "not ready")
