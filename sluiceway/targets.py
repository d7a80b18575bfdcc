"""The router's gRPC address as a client command takes it (`generate --target`, `bench serve
--target`): HOST:PORT, HOST alone (the port `serve` listens on by default), [IPV6]:PORT, or
one of gRPC's own target forms (unix:PATH, dns:///HOST:PORT, ...). An http:// or https://
URL is refused with the form to use: it is the HTTP API's way of writing an address, and
stripping the scheme would send gRPC to whatever port was written there (the HTTP API's 8000
answers a gRPC call with an opaque protocol error)."""

from __future__ import annotations

import argparse
import os
from typing import Any

from sluiceway.router.config import API_KEY_ENV, RouterConfig

_ROUTER = RouterConfig.options()
DEFAULT_PORT: int = _ROUTER["port"].default
DEFAULT_TARGET = f"{_ROUTER['host'].default}:{DEFAULT_PORT}"
TARGET_HELP = (
    f"the router's gRPC address: HOST:PORT, HOST alone (port {DEFAULT_PORT}, where serve "
    "listens) or unix:PATH"
)
_URL_SCHEMES = ("http://", "https://")
# gRPC's name-resolver schemes (a target written with one is passed on as it is)
_GRPC_SCHEMES = ("unix:", "unix-abstract:", "dns:", "ipv4:", "ipv6:", "vsock:")


def grpc_target(text: str) -> str:
    """An argparse type: `text` as a gRPC target, with serve's default port where it names a
    host alone (``127.0.0.1`` -> ``127.0.0.1:50051``, ``[::1]`` -> ``[::1]:50051``).

    Raises:
        argparse.ArgumentTypeError: an http(s):// URL (the message gives the target to use
            instead), or a port that is not a number in [1, 65535].
    """
    if text.startswith(_GRPC_SCHEMES):
        return text
    if text.lower().startswith(_URL_SCHEMES):
        address = text.split("://", 1)[1].split("/", 1)[0]
        raise argparse.ArgumentTypeError(
            f"a gRPC address is written without a scheme: use {_with_port(address)}, not {text}"
        )
    return _with_port(text)


def _with_port(address: str) -> str:
    """`address` with serve's default port when it has none."""
    if address.startswith("["):  # [IPV6] or [IPV6]:PORT
        host, _, port = address[1:].partition("]")
        host, port = f"[{host}]", port.removeprefix(":")
    elif address.count(":") > 1:  # a bare IPv6 address
        host, port = f"[{address}]", ""
    else:
        host, _, port = address.partition(":")
    if not port:
        return f"{host}:{DEFAULT_PORT}"
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"port must be a number in [1, 65535], got {port!r}")
    return f"{host}:{port}"


def add_connection_args(parser: argparse.ArgumentParser) -> None:
    """The flags of a client command that say how to reach a router started with --api-key or
    --ssl-certfile (docs/security.md): --api-key, --tls, --ssl-ca-certs, --ssl-certfile,
    --ssl-keyfile; `client_options` turns them into `sluiceway.client.Client`'s arguments."""
    group = parser.add_argument_group("authentication and TLS (docs/security.md)")
    group.add_argument(
        "--api-key",
        default=None,
        help=f"sent as `authorization: Bearer KEY` (default: ${API_KEY_ENV} if set, else none)",
    )
    group.add_argument(
        "--tls",
        action="store_true",
        help="connect over TLS, the server's certificate checked against the system's roots",
    )
    group.add_argument(
        "--ssl-ca-certs",
        default=None,
        metavar="PATH",
        help="connect over TLS, the server's certificate checked against these CA "
        "certificates (PEM; a self-signed server's own certificate) (default: none)",
    )
    group.add_argument(
        "--ssl-certfile",
        default=None,
        metavar="PATH",
        help="a client certificate (PEM), for a server that requires one; implies TLS "
        "(default: none)",
    )
    group.add_argument(
        "--ssl-keyfile",
        default=None,
        metavar="PATH",
        help="the private key of --ssl-certfile (default: none)",
    )


def client_options(args: argparse.Namespace) -> dict[str, Any]:
    """`Client`'s keyword arguments from the flags of `add_connection_args`."""
    return {
        "api_key": args.api_key or os.environ.get(API_KEY_ENV) or None,
        "tls": args.tls,
        "ssl_ca_certs": args.ssl_ca_certs,
        "ssl_certfile": args.ssl_certfile,
        "ssl_keyfile": args.ssl_keyfile,
    }
