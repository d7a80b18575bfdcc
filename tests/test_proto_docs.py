"""docs/api.md is scripts/proto_docs.py's rendering of the public .proto, and every public
element of that .proto has a comment to render."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "proto_docs.py"


def load_generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("proto_docs", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def test_api_docs_are_up_to_date() -> None:
    text, _ = load_generator().render()
    assert (ROOT / "docs" / "api.md").read_text() == text, "run `make docs`"


def test_every_public_element_has_a_comment() -> None:
    text, missing = load_generator().render()
    assert missing == [], f"add a comment in protos/sluiceway/v1/inference.proto: {missing}"
    # every service, rpc, message, field and enum value of the descriptor is on the page
    from sluiceway.v1 import inference_pb2

    file = inference_pb2.DESCRIPTOR
    for message in file.message_types_by_name.values():
        assert f"### {message.name}\n" in text
        for field in message.fields:
            assert f"| `{field.name}` | {field.number} |" in text, (message.name, field.name)
    for enum in file.enum_types_by_name.values():
        assert f"### {enum.name}\n" in text
        for value in enum.values:
            assert f"| `{value.name}` | {value.number} |" in text
    for service in file.services_by_name.values():
        assert f"### {service.name}\n" in text
        for method in service.methods:
            assert f"| `{method.name}` |" in text


def test_check_mode_reports_a_stale_file(tmp_path: Path) -> None:
    stale = tmp_path / "api.md"
    stale.write_text((ROOT / "docs" / "api.md").read_text() + "an edit by hand\n")
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--check", str(stale)], capture_output=True, text=True
    )
    assert result.returncode == 1
    assert "make docs" in result.stderr
    ok = subprocess.run([sys.executable, str(SCRIPT), "--check", str(ROOT / "docs" / "api.md")])
    assert ok.returncode == 0
