"""Container healthcheck: exit 0 iff the gRPC health service at ADDRESS answers SERVING.

    python /app/deploy/healthcheck.py 127.0.0.1:50051 [--service NAME] [--timeout 3]
        [--ssl-ca-certs CA.pem [--ssl-certfile CLIENT.pem --ssl-keyfile CLIENT.key]]

It asks the standard `grpc.health.v1.Health/Check` that router, scheduler and worker
all serve (the empty service name, the process as a whole, by default). Anything else
(NOT_SERVING, UNKNOWN, nothing listening, no answer within the timeout) exits 1, so
Docker marks the container unhealthy. No `grpc_health_probe` binary in the image.
The health service needs no API key (--api-key); a router serving TLS (--ssl-certfile) is
asked over TLS with --ssl-ca-certs (the CA of its certificate), and with a client
certificate when it requires one (docs/security.md).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def _channel(address: str, ca: str | None, cert: str | None, key: str | None) -> grpc.Channel:
    if ca is None:
        return grpc.insecure_channel(address)

    def read(path: str | None) -> bytes | None:
        if path is None:
            return None
        with open(path, "rb") as f:
            return f.read()

    credentials = grpc.ssl_channel_credentials(read(ca), read(key), read(cert))
    return grpc.secure_channel(address, credentials)


def is_serving(
    address: str,
    service: str = "",
    timeout_s: float = 3.0,
    ssl_ca_certs: str | None = None,
    ssl_certfile: str | None = None,
    ssl_keyfile: str | None = None,
) -> bool:
    """True iff `address` answers the health check for `service` with SERVING in time (over
    TLS, the server checked against `ssl_ca_certs`, when that is given; with the client
    certificate `ssl_certfile` and its key `ssl_keyfile` when given)."""
    try:
        with _channel(address, ssl_ca_certs, ssl_certfile, ssl_keyfile) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
    except grpc.RpcError:
        return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Exit 0 iff the gRPC health service at ADDRESS answers SERVING."
    )
    parser.add_argument("address", help="host:port of a gRPC server with the health service")
    parser.add_argument("--service", default="", help="health service name (default: '')")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds (default 3)")
    parser.add_argument("--ssl-ca-certs", default=None, help="TLS: the server's CA (PEM)")
    parser.add_argument("--ssl-certfile", default=None, help="TLS: a client certificate")
    parser.add_argument("--ssl-keyfile", default=None, help="TLS: its private key")
    args = parser.parse_args(argv)
    serving = is_serving(
        args.address, args.service, args.timeout,
        args.ssl_ca_certs, args.ssl_certfile, args.ssl_keyfile,
    )  # fmt: skip
    return 0 if serving else 1


if __name__ == "__main__":
    sys.exit(main())
