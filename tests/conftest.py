"""Fixtures shared across test folders: the oracle is loaded once per session.

Without CUDA, Triton kernels run in Triton's interpreter; it must be switched on before any
``@triton.jit`` decorator runs, so before anything imports the kernels: here, at the top.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# helper modules whose asserts should show their values as a test file's do
pytest.register_assert_rewrite("tests.deploy_config", "tests.cli_helpers")


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    from sluiceway.model_files import embedded_model_path

    return embedded_model_path()


@pytest.fixture(scope="session")
def oracle(gguf_path: Path):  # type: ignore[no-untyped-def]
    """SmolLM2 as transformers' own GGUF loader reads it (float32; ~15-30 s, once)."""
    from tests.oracle import load_oracle

    return load_oracle(gguf_path)
