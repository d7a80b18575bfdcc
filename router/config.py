"""The router process's config. Each field is the flag of the same name (`sluiceway router
--help`; `sluiceway.options`). Imports no grpc: the CLI builds its parser from it."""

from __future__ import annotations

from dataclasses import dataclass

from sluiceway.argtypes import (
    byte_size,
    fraction,
    metrics_port_number,
    non_negative_float,
    non_negative_int,
    port_number,
)
from sluiceway.options import (
    DEFAULT_MAX_MESSAGE_BYTES,
    DEFAULT_SCHEDULER,
    LOG_FORMAT,
    LOG_LEVEL,
    METRICS_HOST,
    MODEL,
    SERVED_MODEL_NAME,
    ProcessConfig,
    metrics_port,
    option,
)

# A cached prefix routes the request when it covers more than this share of the prompt's
# full blocks (`--cache-threshold`).
DEFAULT_CACHE_THRESHOLD = 0.5
# A replica with more outstanding requests than the least loaded one plus this gets no
# cache hits (`--balance-abs-threshold`).
DEFAULT_BALANCE_ABS_THRESHOLD = 8


def http_port_help(which: str) -> str:
    """--http-port's help, for the router(s) `which` names."""
    return (
        f"the OpenAI-compatible HTTP API of {which} (/v1/chat/completions, "
        "/v1/completions, /v1/models, ...; 0 = a free port, -1 = off)"
    )


@dataclass(slots=True, kw_only=True)
class RouterConfig(ProcessConfig):
    """One router: the public gRPC API on `host:port`, the OpenAI-compatible HTTP API on
    `http_host:http_port` (`http_host` None: `host`; port -1: off), over the schedulers in
    `scheduler` (comma-separated addresses), with the tokenizer of `model`.
    `served_model_name` is taken but unused: the name clients see comes from the workers'
    registration.

    Raises ValueError (naming the field) for a value out of its flag's range.
    """

    host: str = option("127.0.0.1", "address of the gRPC API")
    port: int = option(50051, "port of the gRPC API (0 = free)", type=port_number)
    scheduler: str = option(
        DEFAULT_SCHEDULER,
        "scheduler address (host:port or unix:PATH), or several comma-separated (one per "
        "model replica): each request goes where most of its prompt is cached, unless that one "
        "is loaded past the others, else to the one with the fewest requests in flight",
    )
    model: str | None = MODEL.field()
    served_model_name: str | None = SERVED_MODEL_NAME.field()
    metrics_port: int = metrics_port(9400)
    metrics_host: str = METRICS_HOST.field()
    http_port: int = option(8000, http_port_help("this router"), type=metrics_port_number)  # vLLM's
    http_host: str | None = option(None, "the HTTP API's address (default: --host)")
    drain_timeout: float = option(
        30.0,
        "on SIGTERM or Ctrl-C, seconds the router lets streams in flight finish (new ones get "
        "UNAVAILABLE); then, or at a second signal, those left end with UNAVAILABLE "
        '"server shutting down"',
        type=non_negative_float,
    )
    cache_threshold: float = option(
        DEFAULT_CACHE_THRESHOLD,
        "cache-aware routing: a replica's cached prefix of a prompt routes the request "
        "there when it covers more than this share of the prompt's full KV blocks",
        type=fraction,
    )
    balance_abs_threshold: int = option(
        DEFAULT_BALANCE_ABS_THRESHOLD,
        "cache-aware routing: a replica with more requests in flight than the least "
        "loaded one plus this gets no cache hits (they go by load)",
        type=non_negative_int,
    )
    max_message_size: int = option(
        DEFAULT_MAX_MESSAGE_BYTES,
        "largest gRPC request or response of the public API, bytes or e.g. 16MiB; larger "
        "ones get RESOURCE_EXHAUSTED (default 4MiB)",
        type=byte_size("every message would be refused"),
    )
    log_format: str = LOG_FORMAT.field()
    log_level: str = LOG_LEVEL.field()

    def __post_init__(self) -> None:
        self.check_options()
