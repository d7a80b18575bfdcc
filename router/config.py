"""The router process's config. Each field is the flag of the same name (`sluiceway router
--help`; `sluiceway.options`). Imports no grpc: the CLI builds its parser from it."""

from __future__ import annotations

from dataclasses import dataclass

from sluiceway.argtypes import (
    api_keys_text,
    byte_size,
    cert_reqs,
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
from sluiceway.router.tool_parsers import PARSERS

# The environment variable of the API keys when neither --api-key nor --api-key-file is given
# (vLLM reads VLLM_API_KEY; the clients read the same variable).
API_KEY_ENV = "SLUICEWAY_API_KEY"

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
        "largest gRPC request or response of the public API and largest HTTP request body, "
        "bytes or e.g. 16MiB; larger ones get RESOURCE_EXHAUSTED / HTTP 413 (default 4MiB)",
        type=byte_size("every message would be refused"),
    )
    # Authentication and TLS of the public ports, vLLM's flags (docs/security.md).
    api_key: str | None = option(
        None,
        "require `Authorization: Bearer KEY` (HTTP) / `authorization: Bearer KEY` metadata "
        "(gRPC) with one of these keys, comma-separated, on every call but health, /version "
        f"and metrics; default: ${API_KEY_ENV} if set, else no key (note: a command line is "
        "visible to other users of the machine: prefer --api-key-file or the variable)",
        type=api_keys_text,
    )
    api_key_file: str | None = option(
        None,
        "a file of API keys, one per line (blank lines and # comments skipped), taken "
        "besides --api-key; default: none",
    )
    ssl_keyfile: str | None = option(
        None, "the private key (PEM) of --ssl-certfile; default: none (no TLS)"
    )
    ssl_certfile: str | None = option(
        None,
        "serve the gRPC and HTTP ports over TLS with this certificate chain (PEM; with "
        "--ssl-keyfile); default: none (plaintext)",
    )
    ssl_ca_certs: str | None = option(
        None,
        "CA certificates (PEM) that client certificates must chain to: clients must present "
        "one (mutual TLS, unless --ssl-cert-reqs 0); default: none",
    )
    ssl_cert_reqs: int | None = option(
        None,
        "client certificates: 0 (not asked for) or 2 (required; Python's ssl.CERT_REQUIRED); "
        "default: 2 with --ssl-ca-certs, else 0",
        type=cert_reqs,
    )
    internal_listen: str | None = option(
        None,
        "another address, unix:PATH, where this router serves the same gRPC services without "
        "TLS (API keys still checked): `serve`'s readiness probe; default: none",
    )
    enable_auto_tool_choice: bool = option(
        False,
        'tool_choice "auto" (the default when a chat request gives tools): the model decides '
        "and its output is parsed for calls by --tool-call-parser; without it such a request "
        "is refused (docs/tool-calling.md)",
    )
    tool_call_parser: str | None = option(
        None,
        "how tool calls are read from the output of an auto tool_choice (vLLM's names): "
        "hermes (<tool_call> JSON, the generic tools prompt's format), llama3_json, mistral "
        "(default: none)",
        choices=tuple(PARSERS),
    )
    chat_template: str | None = option(
        None,
        "the Jinja chat template of chat requests, vLLM's flag: a file's path, or the template "
        "itself when no such file exists (backslash escapes such as \\n decoded); for a "
        "model without one (a base model's GGUF) or to replace the model's (default: the "
        "model's own; docs/models.md)",
    )
    log_format: str = LOG_FORMAT.field()
    log_level: str = LOG_LEVEL.field()

    def __post_init__(self) -> None:
        self.check_options()
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
        if self.ssl_certfile is not None and self.ssl_keyfile is None:
            raise ValueError("--ssl-certfile needs --ssl-keyfile (TLS takes both)")
        if self.ssl_keyfile is not None and self.ssl_certfile is None:
            raise ValueError("--ssl-keyfile needs --ssl-certfile (TLS takes both)")
        if self.ssl_ca_certs is not None and self.ssl_certfile is None:
            raise ValueError("--ssl-ca-certs needs --ssl-certfile and --ssl-keyfile (TLS)")
        if self.ssl_cert_reqs == 2 and self.ssl_ca_certs is None:
            raise ValueError(
                "--ssl-cert-reqs 2 needs --ssl-ca-certs (the CA client certificates chain to)"
            )
        if self.internal_listen is not None and not self.internal_listen.startswith("unix:"):
            raise ValueError(f"--internal-listen must be unix:PATH, got {self.internal_listen!r}")

    @property
    def tls(self) -> bool:
        """Whether the public ports speak TLS."""
        return self.ssl_certfile is not None

    @property
    def client_cert_required(self) -> bool:
        """Whether a client must present a certificate signed by `ssl_ca_certs` (the default
        once `ssl_ca_certs` is given; `ssl_cert_reqs` 0 turns it off)."""
        if self.ssl_cert_reqs is None:
            return self.ssl_ca_certs is not None
        return self.ssl_cert_reqs == 2
