"""`sluiceway serve --api-key-file F --ssl-certfile C --ssl-keyfile K` (docs/security.md): one
stack with both, a certificate made here (tests/tls_certs.py). No key or a wrong key is 401 /
UNAUTHENTICATED on both ports; the right one works from the openai SDK, raw HTTP (httpx and
curl), the gRPC client and `sluiceway generate`, with the same greedy text everywhere; health
stays open; a plaintext client, or one that does not trust the CA, is refused."""

from __future__ import annotations

import json
import os
import shutil
import ssl
import subprocess
import sys
from collections.abc import Iterator

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sluiceway.client import Client, channel_credentials
from sluiceway.router.auth import UNAUTHORIZED
from tests.integration.conftest import Stack, http_base_url, log_line, start_stack, stop_stack
from tests.tls_certs import Certs, make_certs

pytestmark = pytest.mark.slow

KEY = "sk-test-0123456789"
PROMPT = "The capital of France is"
UNAUTHORIZED_BODY = {"error": {"message": UNAUTHORIZED, "type": "AuthenticationError",
                               "param": None, "code": 401}}  # fmt: skip


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("tls"))


def trusting(certs: Certs) -> ssl.SSLContext:
    """httpx's `verify`: the test CA."""
    return ssl.create_default_context(cafile=str(certs.ca))


@pytest.fixture(scope="module")
def secured(certs: Certs, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    keys = tmp_path_factory.mktemp("keys") / "api_keys"
    keys.write_text(f"# one key per line\nanother-key\n{KEY}\n")
    s = start_stack("--api-key-file", str(keys), "--ssl-certfile", str(certs.server_cert),
                    "--ssl-keyfile", str(certs.server_key))  # fmt: skip
    yield s
    assert stop_stack(s) == 0, "".join(s.log[-30:])


@pytest.fixture(scope="module")
def base_url(secured: Stack) -> str:
    return http_base_url(secured)


@pytest.fixture(scope="module")
def grpc_text(secured: Stack, certs: Certs) -> str:
    with Client(secured.target, api_key=KEY, ssl_ca_certs=str(certs.ca)) as client:
        text, ids, _ = client.generate(Client.request(PROMPT, temperature=0, max_tokens=6))
    assert len(ids) == 6
    return text


def test_serve_says_https_and_what_protects_the_ports(secured: Stack, base_url: str) -> None:
    assert base_url.startswith("https://127.0.0.1:") and base_url.endswith("/v1")
    line = log_line(secured, "public ports")
    assert sum("public ports" in line for line in secured.log) == 1
    assert line.strip() == (
        "sluiceway: public ports (gRPC, HTTP): TLS, API key required (health, /version and "
        "/metrics open); schedulers and workers: Unix sockets of this machine, no TLS"
    )


def test_http_without_the_right_key_is_401_and_health_is_open(base_url: str, certs: Certs) -> None:
    root = base_url.removesuffix("/v1")
    with httpx.Client(verify=trusting(certs), timeout=30) as http:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = http.post(f"{base_url}/completions", json={"prompt": PROMPT}, headers=headers)
            assert (r.status_code, r.json()) == (401, UNAUTHORIZED_BODY)
        assert http.get(f"{root}/health").status_code == 200
        r = http.get(f"{base_url}/models", headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 200 and r.json()["object"] == "list"
    wrong = openai.OpenAI(base_url=base_url, api_key="wrong", http_client=httpx.Client(
        verify=trusting(certs)), max_retries=0)  # fmt: skip
    with pytest.raises(openai.AuthenticationError) as e:
        wrong.completions.create(model="x", prompt=PROMPT, max_tokens=2)
    assert (e.value.status_code, e.value.body) == (401, UNAUTHORIZED_BODY["error"])


def test_the_right_key_works_from_the_sdk_raw_http_and_curl(
    base_url: str, certs: Certs, grpc_text: str
) -> None:
    sdk = openai.OpenAI(base_url=base_url, api_key=KEY,
                        http_client=httpx.Client(verify=trusting(certs)))  # fmt: skip
    model = sdk.models.list().data[0].id
    done = sdk.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0)
    assert done.choices[0].text == grpc_text
    body = {"model": model, "prompt": PROMPT, "max_tokens": 6, "temperature": 0}
    headers = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(f"{base_url}/completions", json=body, headers=headers, verify=trusting(certs))
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == grpc_text
    if shutil.which("curl") is None:
        return
    curl = subprocess.run(
        ["curl", "-sS", "--cacert", str(certs.ca), "-H", f"Authorization: Bearer {KEY}",
         "-H", "Content-Type: application/json", "-d", json.dumps(body),
         f"{base_url}/completions"],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert json.loads(curl.stdout)["choices"][0]["text"] == grpc_text


def test_grpc_without_the_right_key_is_unauthenticated_and_health_is_open(
    secured: Stack, certs: Certs, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SLUICEWAY_API_KEY", raising=False)
    for key in (None, "wrong"):
        with Client(secured.target, api_key=key, ssl_ca_certs=str(certs.ca)) as client:
            with pytest.raises(grpc.RpcError) as e:
                client.generate(Client.request(PROMPT, max_tokens=2))
            assert (e.value.code(), e.value.details()) == (  # type: ignore[attr-defined]
                grpc.StatusCode.UNAUTHENTICATED,
                UNAUTHORIZED,
            )
            with pytest.raises(grpc.RpcError) as e:
                client.model_info()
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]
            reply = health_pb2_grpc.HealthStub(client.channel).Check(
                health_pb2.HealthCheckRequest(), timeout=10
            )
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_sluiceway_generate_takes_the_key_and_the_ca(
    secured: Stack, certs: Certs, grpc_text: str
) -> None:
    argv = [sys.executable, "-m", "sluiceway.cli", "generate", PROMPT, "--target",
            secured.target, "--ssl-ca-certs", str(certs.ca), "--temperature", "0",
            "--max-tokens", "6"]  # fmt: skip
    env = {**os.environ, "SLUICEWAY_API_KEY": KEY}  # the variable, as the server reads it
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
    assert (done.returncode, done.stdout) == (0, grpc_text + "\n"), done.stderr
    env.pop("SLUICEWAY_API_KEY")
    done = subprocess.run([*argv, "--api-key", "wrong"], capture_output=True, text=True,
                          timeout=120, env=env)  # fmt: skip
    assert (done.returncode, done.stderr.strip()) == (
        1, f"sluiceway generate: UNAUTHENTICATED: {UNAUTHORIZED}")  # fmt: skip


def test_plaintext_and_untrusting_clients_are_refused(
    secured: Stack, base_url: str, certs: Certs
) -> None:
    for client in (Client(secured.target, api_key=KEY), Client(secured.target, api_key=KEY,
                                                                tls=True)):  # fmt: skip
        with client, pytest.raises(grpc.RpcError) as e:
            client.model_info()
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
    plain = base_url.replace("https://", "http://")
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{plain}/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
    with pytest.raises(httpx.ConnectError):  # the system's roots do not know the test CA
        httpx.get(f"{base_url}/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
    # a secure channel that trusts the CA, as any gRPC client would make it
    with grpc.secure_channel(secured.target, channel_credentials(str(certs.ca))) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                          timeout=10)  # fmt: skip
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
