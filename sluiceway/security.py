"""The router's API keys and TLS files, read and checked with the standard library alone:
`serve` (and ``make serve``'s first step, `sluiceway.serve_check`) refuses a missing or
unreadable key file, certificate or private key with one line naming the flag, exit 2, before
any child starts; the router reads its keys with the same function. docs/security.md is the
guide. What checks the keys on each call is router/auth.py (gRPC) and router/openai_api.py
(HTTP)."""

from __future__ import annotations

import os
import ssl
from collections.abc import Mapping

from sluiceway.router.config import API_KEY_ENV, RouterConfig


def read_key_file(path: str) -> list[str]:
    """The keys of an --api-key-file: one per line, surrounding whitespace stripped, blank
    lines and lines starting with # skipped.

    Raises:
        ValueError: ``--api-key-file PATH: cannot read it (No such file or directory)``, or
            ``... has no key`` (a file of no key would let anyone in).
    """
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--api-key-file {path}: cannot read it ({_why(e)})") from None
    keys = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    if not keys:
        raise ValueError(f"--api-key-file {path}: has no key (one per line)")
    return keys


def api_keys(config: RouterConfig, environ: Mapping[str, str] | None = None) -> list[str]:
    """The keys a client may present: --api-key's (comma-separated) and --api-key-file's;
    when neither flag is given, those of $SLUICEWAY_API_KEY (comma-separated; unset or empty:
    none), as vLLM reads VLLM_API_KEY. An empty list: no key is required.

    Raises:
        ValueError: an unreadable or empty --api-key-file (`read_key_file`).
    """
    keys = [k.strip() for k in config.api_key.split(",")] if config.api_key else []
    if config.api_key_file is not None:
        keys += read_key_file(config.api_key_file)
    if config.api_key is None and config.api_key_file is None:
        value = (os.environ if environ is None else environ).get(API_KEY_ENV, "")
        keys = [k.strip() for k in value.split(",") if k.strip()]
    return list(dict.fromkeys(keys))


def check_files(config: RouterConfig) -> None:
    """Reads what the router will read at start: the key file, the certificate chain and its
    private key (which must match), the CA certificates.

    Raises:
        ValueError: one line naming the flag, e.g. ``--ssl-keyfile /x/key.pem: cannot read
            it (No such file or directory)``, or ``--ssl-certfile ... and --ssl-keyfile ...:
            not a PEM certificate chain and its private key ([SSL] PEM lib)``.
    """
    api_keys(config)
    files = [("--ssl-certfile", config.ssl_certfile), ("--ssl-keyfile", config.ssl_keyfile),
             ("--ssl-ca-certs", config.ssl_ca_certs)]  # fmt: skip
    for flag, path in files:
        if path is not None:
            try:
                with open(path, "rb"):
                    pass
            except OSError as e:
                raise ValueError(f"{flag} {path}: cannot read it ({_why(e)})") from None
    if config.ssl_certfile is None or config.ssl_keyfile is None:
        return
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:  # no password: an encrypted key fails here rather than prompting on a terminal
        context.load_cert_chain(config.ssl_certfile, config.ssl_keyfile, password=_no_password)
    except (ssl.SSLError, ValueError) as e:
        raise ValueError(
            f"--ssl-certfile {config.ssl_certfile} and --ssl-keyfile {config.ssl_keyfile}: not "
            f"a PEM certificate chain and its unencrypted private key ({_why(e)})"
        ) from None
    if config.ssl_ca_certs is not None:
        try:
            context.load_verify_locations(config.ssl_ca_certs)
        except (ssl.SSLError, ValueError) as e:
            raise ValueError(
                f"--ssl-ca-certs {config.ssl_ca_certs}: not PEM CA certificates ({_why(e)})"
            ) from None


def _no_password() -> bytes:
    raise ValueError("the private key is encrypted")


def _why(error: Exception) -> str:
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    return str(error) or type(error).__name__
