"""The generated protobuf/gRPC modules in the tree match the .proto files."""

from __future__ import annotations

import filecmp
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTOS = sorted(p.relative_to(ROOT / "protos") for p in (ROOT / "protos").rglob("*.proto"))


def test_generated_code_is_up_to_date(tmp_path: Path) -> None:
    assert len(PROTOS) == 3
    subprocess.run(
        [
            sys.executable, "-m", "grpc_tools.protoc", "-I", str(ROOT / "protos"),
            f"--python_out={tmp_path}", f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}",
            *map(str, PROTOS),
        ],
        check=True,
    )  # fmt: skip
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.py*"))
    assert len(generated) == 9
    stale = [str(p) for p in generated if not filecmp.cmp(tmp_path / p, ROOT / p, shallow=False)]
    assert stale == [], f"run `make protos`: {stale}"
