"""The wheel: one top-level package, `sluiceway`, with the process folders under it and
the .proto files next to their generated modules."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_wheel_installs_one_namespace_and_carries_its_protos(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path), str(REPO)],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("sluiceway-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        z.extractall(tmp_path / "site")
    assert {n.split("/")[0] for n in names} == {
        "sluiceway",
        wheel.name.split("-py3")[0] + ".dist-info",
    }
    packages = {n.split("/")[1] for n in names if n.count("/") >= 2}
    assert {"router", "scheduler", "worker", "kernels", "v1", "internal", "bench"} <= packages
    for proto in ("v1/inference.proto", "internal/v1/scheduler.proto", "internal/v1/worker.proto"):
        assert (tmp_path / "site/sluiceway" / proto).read_text() == (
            REPO / "protos/sluiceway" / proto
        ).read_text()
    assert "sluiceway/kernels/csrc/paged_attention.cpp" in names
    # The installed package imports from itself, not from the checkout.
    site = tmp_path / "site"
    code = (
        f"import sys; sys.path.insert(0, {str(site)!r}); "
        "import sluiceway.router.request_path as v, sluiceway.scheduler.block_manager as b; "
        "print(v.__file__); print(b.__file__)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, check=True, capture_output=True, text=True
    ).stdout.split()
    assert all(path.startswith(str(site)) for path in out), out


def test_the_code_imports_the_process_packages_only_under_sluiceway() -> None:
    """A module imported as top-level `worker.server` would be a second copy of
    `sluiceway.worker.server` (its globals patched or read apart from the real one)."""
    code = (
        "import pkgutil, importlib, sys, sluiceway\n"
        "for m in pkgutil.walk_packages(sluiceway.__path__, 'sluiceway.'):\n"
        "    if '.v1' not in m.name and 'triton' not in m.name and 'cuda' not in m.name:\n"
        "        importlib.import_module(m.name)\n"
        "tops = {n.split('.')[0] for n in sys.modules}\n"
        "print(sorted(tops & {'router', 'scheduler', 'worker', 'kernels'}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, check=True, capture_output=True, text=True
    ).stdout
    assert out.strip() == "[]"
