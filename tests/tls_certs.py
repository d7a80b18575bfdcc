"""Test certificates made with the `openssl` command: a CA, a server certificate for
127.0.0.1 and localhost (subjectAltName) and a client certificate, both signed by the CA."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

_EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


@dataclass(frozen=True)
class Certs:
    """PEM files: the CA's certificate, the server's and the client's certificate and key."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _run(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _signed(folder: Path, name: str, ext: str) -> None:
    _run("req", *_EC, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}",
         cwd=folder)  # fmt: skip
    (folder / f"{name}.ext").write_text(ext + "\n")
    _run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
         "-CAcreateserial", "-days", "2", "-out", f"{name}.pem", "-extfile", f"{name}.ext",
         cwd=folder)  # fmt: skip


def make_certs(folder: Path) -> Certs:
    """Writes a CA and the certificates it signs into `folder` (skips the test without the
    openssl command)."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is not installed")
    folder.mkdir(parents=True, exist_ok=True)
    _run("req", "-x509", *_EC, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
         "-subj", "/CN=sluiceway test CA", "-addext", "basicConstraints=critical,CA:TRUE",
         "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=folder)  # fmt: skip
    _signed(folder, "server",
            "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth")  # fmt: skip
    _signed(folder, "client", "extendedKeyUsage=clientAuth")
    return Certs(
        folder / "ca.pem",
        folder / "server.pem",
        folder / "server.key",
        folder / "client.pem",
        folder / "client.key",
    )
