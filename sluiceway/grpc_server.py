"""What every sluiceway gRPC server shares: message-size limits, health service, signals."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from sluiceway.options import DEFAULT_MAX_MESSAGE_BYTES

# The keepalive policy every server applies to its clients' HTTP/2 pings. C-core's default
# (pings at least 5 minutes apart while the server sends nothing, none without a call in
# flight, GOAWAY "too_many_pings" after 2 strikes) drops a client that pings every 10-30 s,
# as gRPC clients and load balancers commonly do, while its request waits in the queue or
# prefills. Accepted instead: pings MIN_CLIENT_PING_INTERVAL_MS apart or more (half the
# common 10 s, a margin for timer jitter), with or without calls; a client pinging faster
# still gets GOAWAY after MAX_PING_STRIKES pings too soon.
MIN_CLIENT_PING_INTERVAL_MS = 5000
MAX_PING_STRIKES = 2


def keepalive_policy_options() -> list[tuple[str, int]]:
    """gRPC server options of the keepalive policy above (C-core channel arguments).

    `grpc.http2.min_ping_interval_without_data_ms` is C-core's spelling of
    GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS (the `min_recv_...` form is not an
    argument gRPC knows, and is ignored)."""
    return [
        ("grpc.http2.min_ping_interval_without_data_ms", MIN_CLIENT_PING_INTERVAL_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_ping_strikes", MAX_PING_STRIKES),
    ]


SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def channel_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    """gRPC channel/server options bounding one message to `max_message_bytes` bytes."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]


class RegistrationRefused(Exception):
    """The scheduler refused a worker's registration (a worker group, rank or model its
    configuration does not have): a configuration error, not worth restarting for."""


class SchedulerUnreachable(Exception):
    """A worker's scheduler did not answer its first registration in time: a wrong
    `--scheduler` address, or a scheduler not started (yet); a restart may help."""


# gRPC metadata key carrying the public request_id from the router to the scheduler. A
# binary ("-bin") key: the id is any string the client chose, and plain metadata values
# must be printable ASCII. The value is the id's UTF-8 bytes.
REQUEST_ID_METADATA = "x-request-id-bin"


def new_server(
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
) -> tuple[grpc.aio.Server, health.aio.HealthServicer]:
    """An asyncio gRPC server with the standard `grpc.health.v1` service added (NOT_SERVING),
    messages bounded to `max_message_bytes` bytes, the keepalive policy above, and
    `interceptors` (the router's API keys: router/auth.py)."""
    # No SO_REUSEPORT (gRPC's default on Linux): a second server on a taken port must fail,
    # not share the port and split the clients between two unrelated servers.
    server = grpc.aio.server(
        options=[
            *channel_options(max_message_bytes),
            *keepalive_policy_options(),
            ("grpc.so_reuseport", 0),
        ],
        interceptors=list(interceptors) or None,
    )
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    return server, health_servicer


async def set_health(
    health_servicer: health.aio.HealthServicer, services: list[str], serving: bool
) -> None:
    """Sets every name in `services` ("" = the whole server) to SERVING or NOT_SERVING."""
    for name in services:
        await health_servicer.set(name, SERVING if serving else NOT_SERVING)


class BindError(RuntimeError):
    """A gRPC server cannot listen on its address (taken, or not ours)."""


def bind(
    server: grpc.aio.Server, address: str, credentials: grpc.ServerCredentials | None = None
) -> str:
    """Binds `address` (host:port, port 0 = any free port, or unix:PATH), over TLS when
    `credentials` are given; returns the bound address.

    Raises BindError when the address cannot be bound.
    """
    try:
        if credentials is not None:
            port = server.add_secure_port(address, credentials)
        else:
            port = server.add_insecure_port(address)
    except RuntimeError as e:
        raise BindError(f"cannot listen on {address}: {e}") from e
    if port == 0 and not address.startswith("unix:"):
        raise BindError(f"cannot listen on {address}: the address is taken or not available")
    if address.startswith("unix:"):
        return address
    host = address.rsplit(":", 1)[0]
    return f"{host}:{port}"


def on_shutdown_signal(callback: Callable[[], None]) -> None:
    """Calls `callback` (in the running event loop) on SIGINT or SIGTERM."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, callback)


class ShutdownSignals:
    """SIGINT and SIGTERM, counted, in the running event loop: the first sets `first` (drain),
    the next one `second` (stop now: what uvicorn and vLLM do with a second Ctrl-C)."""

    def __init__(self) -> None:
        self.first = asyncio.Event()
        self.second = asyncio.Event()
        on_shutdown_signal(self._on_signal)

    def _on_signal(self) -> None:
        (self.second if self.first.is_set() else self.first).set()
