"""API keys and TLS of the router's public gRPC port (docs/security.md): `ApiKeys` compares a
presented ``Bearer`` token with the keys in constant time (it also serves the HTTP front,
router/openai_api.py), `ApiKeyInterceptor` refuses a call to anything but the health and
reflection services without a valid key with UNAUTHENTICATED (the same words whether the key
is missing or wrong, nothing about the keys), and `server_credentials` is the TLS of
``--ssl-certfile`` / ``--ssl-keyfile`` / ``--ssl-ca-certs``."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc

from sluiceway.router.config import RouterConfig

# Answered to a missing, malformed or wrong key alike (HTTP 401 / gRPC UNAUTHENTICATED).
UNAUTHORIZED = "a valid API key is required: send it as `Authorization: Bearer KEY`"
# gRPC services open without a key: the load balancers' and orchestrators' health checks,
# and reflection (the API's schema, public in docs/api.md).
OPEN_GRPC_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


class ApiKeys:
    """The keys a client may present, kept as SHA-256 digests: each check hashes the token
    and compares it with every digest by `hmac.compare_digest` (digests are of one length, so
    the time does not depend on which key, or how much of one, matched; vLLM does the same)."""

    def __init__(self, keys: Sequence[str]) -> None:
        if not keys or not all(keys):
            raise ValueError("ApiKeys needs one or more non-empty keys")
        self._digests = [hashlib.sha256(k.encode()).digest() for k in keys]

    def allows(self, authorization: str | None) -> bool:
        """Whether `authorization` (an Authorization header's value, or None when there is
        none) is ``Bearer KEY`` (the scheme in any case) with one of the keys."""
        if not authorization:
            return False
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer":
            return False
        digest = hashlib.sha256(token.strip().encode()).digest()
        match = False
        for known in self._digests:  # no early exit
            match |= hmac.compare_digest(digest, known)
        return match


def metadata_value(metadata: Sequence[tuple[str, Any]] | None, key: str) -> str | None:
    """The first value of `key` (lower-case) in gRPC invocation metadata, as text; None if
    absent or binary."""
    for k, v in metadata or ():
        if k == key:
            return v if isinstance(v, str) else None
    return None


async def _refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHORIZED)


_REFUSALS: dict[str, Callable[..., grpc.RpcMethodHandler]] = {
    "unary_unary": grpc.unary_unary_rpc_method_handler,
    "unary_stream": grpc.unary_stream_rpc_method_handler,
    "stream_unary": grpc.stream_unary_rpc_method_handler,
    "stream_stream": grpc.stream_stream_rpc_method_handler,
}


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Ends every call but those of `OPEN_GRPC_PREFIXES` with UNAUTHENTICATED unless its
    ``authorization`` metadata is ``Bearer KEY`` with a key of `keys`. The refused call's
    request is not even decoded (no deserializer), and the servicer never sees it."""

    def __init__(self, keys: ApiKeys) -> None:
        self.keys = keys

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method: str = handler_call_details.method  # type: ignore[attr-defined]
        if handler is None or method.startswith(OPEN_GRPC_PREFIXES):
            return handler
        metadata = handler_call_details.invocation_metadata  # type: ignore[attr-defined]
        if self.keys.allows(metadata_value(metadata, "authorization")):
            return handler
        kind = next(k for k in _REFUSALS if getattr(handler, k) is not None)
        return _REFUSALS[kind](_refuse)


def server_credentials(config: RouterConfig) -> grpc.ServerCredentials | None:
    """The TLS of the public gRPC port (None: plaintext): `config.ssl_certfile` and
    `ssl_keyfile`, and, when client certificates are required
    (`RouterConfig.client_cert_required`), `ssl_ca_certs` as their roots.

    Raises:
        OSError: a file cannot be read (`sluiceway.security.check_files` says it earlier).
    """
    if config.ssl_certfile is None or config.ssl_keyfile is None:
        return None
    with open(config.ssl_keyfile, "rb") as f:
        key = f.read()
    with open(config.ssl_certfile, "rb") as f:
        chain = f.read()
    roots = None
    if config.ssl_ca_certs is not None and config.client_cert_required:
        with open(config.ssl_ca_certs, "rb") as f:
            roots = f.read()
    return grpc.ssl_server_credentials(
        [(key, chain)], root_certificates=roots, require_client_auth=roots is not None
    )
