"""The metrics port answers /metrics with the metrics, / with a pointer, anything else 404."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request

import pytest

from sluiceway.metrics import INDEX_TEXT, MetricsPortError, serve_metrics


def get(port: int, path: str) -> tuple[int, str, bytes]:
    """Status, content type and body of GET http://127.0.0.1:port/path."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.headers["Content-Type"], r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers["Content-Type"], e.read()


def test_only_metrics_path_serves_the_metrics() -> None:
    port = serve_metrics(0)
    status, content_type, body = get(port, "/metrics")
    assert (status, content_type) == (200, "text/plain; version=0.0.4; charset=utf-8")
    assert b"# TYPE python_info gauge" in body
    assert get(port, "/") == (200, "text/plain; charset=utf-8", INDEX_TEXT)
    for path in ("/foo", "/metrics/", "/metricsfoo", "/favicon.ico"):
        status, _, body = get(port, path)
        assert status == 404, path
        assert b"# TYPE" not in body


def test_a_taken_port_raises_naming_the_address() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(MetricsPortError, match=f"127.0.0.1:{port}"):
            serve_metrics(port)
