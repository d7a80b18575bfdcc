"""Writes requirements/cpu.txt (every runtime dependency of sluiceway on a CPU machine,
pinned, triton left out) and requirements/cpu-bench.txt (what the bench extra adds).

    python3 scripts/lock_cpu.py        # about 3 minutes: a scratch venv, two pip installs

Why a lock: xgrammar requires triton on Linux x86_64 (1 GB installed) for its GPU kernel
only, and pip cannot leave out one dependency of a dependency; `make install` installs this
file with --no-deps instead. The file is derived, never edited: pyproject.toml stays the one
list of what sluiceway needs (tests/test_install.py checks the file against it).
"""

from __future__ import annotations

import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
LOCKS = ROOT / "requirements"
TORCH = "torch==2.13.0"  # the CPU wheel (README); a bare `torch` pulls the CUDA build
LEFT_OUT = {"triton": "xgrammar's GPU kernel only; the CPU path never imports it"}

HEADER = """\
# {what}, pinned: `make {target}` installs them with --no-deps.
# Written by scripts/lock_cpu.py from pyproject.toml; do not edit.
# Left out: {left_out}.
"""


def freeze(pip: list[str]) -> dict[str, str]:
    """The venv's packages by lowercase name -> their pin ("name==version"); torch as
    TORCH, sluiceway, pip (the installer) and LEFT_OUT dropped."""
    frozen = subprocess.run(
        [*pip, "freeze", "--all", "--exclude", "pip"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    pins = {}
    for line in frozen.splitlines():
        name = line.split("==")[0].split(" @ ")[0].strip().lower()
        if name not in ("sluiceway", *LEFT_OUT):
            pins[name] = TORCH if name == "torch" else line.strip()
    return pins


def write(name: str, pins: list[str], what: str, target: str) -> None:
    """Writes requirements/`name` with its header, pins sorted by name."""
    left_out = ", ".join(f"{k} ({v})" for k, v in LEFT_OUT.items())
    header = HEADER.format(what=what, target=target, left_out=left_out)
    path = LOCKS / name
    path.write_text(header + "\n".join(sorted(pins, key=str.lower)) + "\n", encoding="utf-8")
    print(f"wrote {path.relative_to(ROOT)}: {len(pins)} packages")


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        venv = pathlib.Path(tmp) / "venv"
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        pip = [str(venv / "bin" / "python"), "-m", "pip"]
        subprocess.run([*pip, "install", "--quiet", TORCH, str(ROOT)], check=True)
        runtime = freeze(pip)
        subprocess.run([*pip, "install", "--quiet", TORCH, f"{ROOT}[bench]"], check=True)
        with_bench = freeze(pip)
    changed = [k for k, v in runtime.items() if with_bench.get(k) != v]
    if changed:  # the extra would move a runtime pin: the two files could not be stacked
        raise SystemExit(f"the bench extra changes runtime pins: {changed}")
    LOCKS.mkdir(exist_ok=True)
    write(
        "cpu.txt", list(runtime.values()), "The runtime dependencies of sluiceway on CPU", "install"
    )
    bench = [v for k, v in with_bench.items() if k not in runtime]
    write("cpu-bench.txt", bench, "What the bench extra adds to requirements/cpu.txt", "bench")
    return 0


if __name__ == "__main__":
    sys.exit(main())
