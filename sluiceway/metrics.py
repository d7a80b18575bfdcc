"""Prometheus metrics shared by the three processes: names, buckets and the HTTP endpoint.

Names follow vLLM's (`vllm:num_requests_running` -> `sluiceway:num_requests_running`),
every series carries a `model_name` label, and each process serves its own
`/metrics` on `--metrics-port` (prometheus-client's HTTP server, in a thread).
"""

from __future__ import annotations

import structlog
from prometheus_client import start_http_server

PREFIX = "sluiceway:"

# Seconds, wide enough for a 2-core CPU (seconds per step, minutes per request)
# and an H200 (milliseconds per token). From vLLM's buckets, extended at both ends.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                         0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
                           30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0,
                           7680.0)  # fmt: skip
STEP_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                0.5, 1.0, 2.5, 5.0, 10.0, 30.0)  # fmt: skip
# Sequences per step and tokens per step (powers of two up to the largest defaults x 4).
COUNT_BUCKETS = tuple(float(2**i) for i in range(0, 11))
TOKEN_COUNT_BUCKETS = tuple(float(2**i) for i in range(0, 14))


def serve_metrics(port: int, host: str = "127.0.0.1") -> int:
    """Serves the default registry on http://host:port/metrics in a daemon thread and logs
    its URL (`metrics_listening`).

    Returns the bound port (a free one when `port` is 0). Raises
    MetricsPortError (an OSError) naming the address when it cannot be bound.
    """
    try:
        server, _thread = start_http_server(port, addr=host)
    except OSError as e:
        raise MetricsPortError(
            f"cannot serve metrics on {host}:{port}: {e.strerror or e} (--metrics-port)"
        ) from e
    bound = int(server.server_port)
    structlog.get_logger("metrics").info("metrics_listening", url=f"http://{host}:{bound}/metrics")
    return bound


class MetricsPortError(OSError):
    """The metrics endpoint's address cannot be bound (taken, or not ours)."""
