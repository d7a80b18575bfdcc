"""Container healthcheck: exit 0 iff the gRPC health service at ADDRESS answers SERVING.

    python /app/deploy/healthcheck.py 127.0.0.1:50051 [--service NAME] [--timeout 3]

It asks the standard `grpc.health.v1.Health/Check` that router, scheduler and worker
all serve (the empty service name, the process as a whole, by default). Anything else
(NOT_SERVING, UNKNOWN, nothing listening, no answer within the timeout) exits 1, so
Docker marks the container unhealthy. No `grpc_health_probe` binary in the image.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def is_serving(address: str, service: str = "", timeout_s: float = 3.0) -> bool:
    """True iff `address` answers the health check for `service` with SERVING in time."""
    try:
        with grpc.insecure_channel(address) as channel:
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
    args = parser.parse_args(argv)
    return 0 if is_serving(args.address, args.service, args.timeout) else 1


if __name__ == "__main__":
    sys.exit(main())
