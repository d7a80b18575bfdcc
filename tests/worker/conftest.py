"""Fixtures of the worker tests."""

from __future__ import annotations

import pathlib

import pytest

from tests.worker.tiny_models import VARIANTS, make_tiny_model


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    """All variants, written once per session."""
    root = tmp_path_factory.mktemp("tiny")
    return {v: make_tiny_model(root / v, v, seed=i) for i, v in enumerate(VARIANTS)}
