"""Prometheus metrics shared by the three processes: names, buckets and the HTTP endpoint.

Names follow vLLM's (`vllm:num_requests_running` -> `sluiceway:num_requests_running`),
every series carries a `model_name` label, and each process serves its own
`/metrics` on `--metrics-port` (a WSGI server of the standard library, in a thread).
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import structlog
from prometheus_client import REGISTRY, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

PREFIX = "sluiceway:"

# Seconds, wide enough for a 2-core CPU (seconds per step, minutes per request)
# and an H200 (milliseconds per token). From vLLM's buckets, extended at both ends.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                         0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
# E2E latency and queue time: vLLM's request buckets with 1-50 ms in front (a request
# waits less than a step when the server has room; a short one ends in milliseconds).
REQUEST_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0,
                           1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
STEP_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                0.5, 1.0, 2.5, 5.0, 10.0, 30.0)  # fmt: skip
# Sequences per step and tokens per step (powers of two up to the largest defaults x 4).
COUNT_BUCKETS = tuple(float(2**i) for i in range(0, 11))
TOKEN_COUNT_BUCKETS = tuple(float(2**i) for i in range(0, 14))


METRICS_PATH = "/metrics"
INDEX_TEXT = f"sluiceway metrics: GET {METRICS_PATH}\n".encode()
NOT_FOUND_TEXT = f"not found; sluiceway metrics are at {METRICS_PATH}\n".encode()

StartResponse = Callable[[str, list[tuple[str, str]]], Any]


def metrics_app() -> Callable[[dict[str, Any], StartResponse], Iterable[bytes]]:
    """The WSGI app of the endpoint: the default registry on GET /metrics (prometheus-client's
    app: text format, gzip and OpenMetrics when asked), a one-line pointer to it on /, 404
    Not Found on every other path."""
    prometheus = make_wsgi_app(REGISTRY)

    def app(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == METRICS_PATH:
            return prometheus(environ, start_response)  # type: ignore[no-any-return]
        if path == "/":
            start_response("200 OK", [("Content-Type", "text/plain; charset=utf-8")])
            return [INDEX_TEXT]
        start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
        return [NOT_FOUND_TEXT]

    return app


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Nothing: a scrape every few seconds would fill stderr."""


def serve_metrics(port: int, host: str = "127.0.0.1") -> int:
    """Serves `metrics_app` on http://host:port in a daemon thread and logs the metrics URL
    (`metrics_listening`); IPv6 hosts work as IPv4 ones do.

    Returns the bound port (a free one when `port` is 0). Raises
    MetricsPortError (an OSError) naming the address when it cannot be bound.
    """
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        server_class = type("MetricsServer", (ThreadingWSGIServer,), {"address_family": family})
        server: WSGIServer = make_server(
            str(sockaddr[0]), port, metrics_app(), server_class, handler_class=_QuietHandler
        )
    except OSError as e:
        raise MetricsPortError(
            f"cannot serve metrics on {host}:{port}: {e.strerror or e} (--metrics-port)"
        ) from e
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    bound = int(server.server_port)
    shown = f"[{host}]" if ":" in host else host
    structlog.get_logger("metrics").info(
        "metrics_listening", url=f"http://{shown}:{bound}{METRICS_PATH}"
    )
    return bound


class MetricsPortError(OSError):
    """The metrics endpoint's address cannot be bound (taken, or not ours)."""
