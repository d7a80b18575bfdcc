"""GGUF tensor types through the converter (sluiceway/model_files.py): tiny llama GGUFs written
here with gguf.GGUFWriter, every matrix of one type; the converted float32 weights equal gguf's
own dequantization of the same bytes, and a type gguf cannot dequantize is refused, naming the
tensor and the type, before any tensor is converted."""

from __future__ import annotations

import importlib.metadata
import pathlib
from collections.abc import Callable

import numpy as np
import pytest
import torch

from sluiceway.model_files import ModelFilesError, convert_gguf, hf_tensor_name, reverse_permute
from sluiceway.router.token_bytes import bytes_to_unicode

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

H, FF, VOCAB, HEADS, KV_HEADS = 256, 256, 256, 2, 1  # rows of 256: one K-quant block each
D = H // HEADS
MATRICES = {
    "token_embd.weight": (VOCAB, H),
    "blk.0.attn_q.weight": (H, H),
    "blk.0.attn_k.weight": (KV_HEADS * D, H),
    "blk.0.attn_v.weight": (KV_HEADS * D, H),
    "blk.0.attn_output.weight": (H, H),
    "blk.0.ffn_gate.weight": (FF, H),
    "blk.0.ffn_up.weight": (FF, H),
    "blk.0.ffn_down.weight": (H, FF),
    "output.weight": (VOCAB, H),
}
NORMS = ("blk.0.attn_norm.weight", "blk.0.ffn_norm.weight", "output_norm.weight")

# types gguf can quantize: quantized from random weights
QUANTIZED = (Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0)
# types it only dequantizes: random blocks whose float16 scales (byte offsets in the block,
# ggml's block layouts) are set to sane values
RAW_SCALES = {
    Q.Q2_K: (80, 82),  # scales[16] qs[64] d dmin
    Q.Q3_K: (108,),  # hmask[32] qs[64] scales[12] d
    Q.Q4_K: (0, 2),  # d dmin scales[12] qs[128]
    Q.Q5_K: (0, 2),  # d dmin scales[12] qh[32] qs[128]
    Q.Q6_K: (208,),  # ql[128] qh[64] scales[16] d
    Q.IQ4_NL: (0,),  # d qs[16]
    Q.IQ4_XS: (0,),  # d scales_h scales_l[4] qs[128]
}


def _tensor_bytes(shape: tuple[int, int], qtype: object, rng: np.random.Generator) -> np.ndarray:
    """A tensor of ``shape`` in ``qtype`` as GGUFWriter takes it."""
    if qtype in QUANTIZED:
        return gguf.quants.quantize(rng.standard_normal(shape).astype(np.float32) * 0.1, qtype)
    block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (shape[0] * shape[1] // block, block_bytes), dtype=np.uint8)
    if qtype == Q.Q8_K:  # d is a float32
        blocks[:, :4] = np.full((len(blocks), 1), 0.01, np.float32).view(np.uint8)
    for offset in RAW_SCALES.get(qtype, ()):
        scale = rng.uniform(1e-3, 1e-2, (len(blocks), 1)).astype(np.float16)
        blocks[:, offset : offset + 2] = scale.view(np.uint8)
    return blocks.reshape(shape[0], -1)


def write_tiny_gguf(
    path: pathlib.Path,
    type_of: Callable[[str], object],
    arch: str = "llama",
    token_scores: bool = True,
) -> pathlib.Path:
    """A one-layer llama GGUF (hidden 256, 2 heads, 1 KV head, a 256-token byte vocabulary)
    whose matrix ``name`` is of type ``type_of(name)``; norms are F32. ``arch``: the
    architecture it says it is; ``token_scores`` False: a tokenizer without
    ``tokenizer.ggml.scores`` (transformers cannot read it)."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny")
    w.add_block_count(1)
    w.add_context_length(128)
    w.add_embedding_length(H)
    w.add_feed_forward_length(FF)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(D)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(VOCAB)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    table = bytes_to_unicode()
    w.add_token_list([table[b] for b in range(256)])
    w.add_token_types([1] * 256)
    if token_scores:
        w.add_token_scores([0.0] * 256)
    w.add_token_merges([])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    rng = np.random.default_rng(0)
    for name in NORMS:
        w.add_tensor(name, rng.uniform(0.5, 1.5, H).astype(np.float32))
    for name, shape in MATRICES.items():
        qtype = type_of(name)
        w.add_tensor(name, _tensor_bytes(shape, qtype, rng), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("qtype", [*QUANTIZED, *RAW_SCALES], ids=lambda q: q.name)
def test_converted_weights_are_ggufs_own_dequantization(
    tmp_path: pathlib.Path, qtype: object
) -> None:
    from safetensors.torch import load_file

    from sluiceway.worker.loader import load_model

    path = write_tiny_gguf(tmp_path / "tiny.gguf", lambda _: qtype)
    folder = convert_gguf(path, cache=tmp_path / "cache")
    converted = load_file(folder / "model.safetensors")
    reader = gguf.GGUFReader(str(path))
    assert {t.name: t.tensor_type for t in reader.tensors if t.name in MATRICES} == dict.fromkeys(
        MATRICES, qtype
    )
    for t in reader.tensors:
        expected = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        if t.name.endswith("attn_q.weight"):
            expected = reverse_permute(expected, HEADS)
        elif t.name.endswith("attn_k.weight"):
            expected = reverse_permute(expected, KV_HEADS)
        got = converted[hf_tensor_name(t.name)]
        assert np.isfinite(expected).all() and expected.any(), t.name
        assert torch.equal(got, torch.from_numpy(np.ascontiguousarray(expected))), t.name
    model = load_model(folder)  # and the worker loads it
    assert model.layers[0].qkv_weight.shape == ((HEADS + 2 * KV_HEADS) * D, H)


def test_a_type_gguf_cannot_dequantize_is_refused_before_any_conversion(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_tiny_gguf(
        tmp_path / "tiny.gguf", lambda name: Q.Q8_K if name == "blk.0.ffn_up.weight" else Q.Q8_0
    )
    shapes: list[tuple[int, ...]] = []  # of the arrays dequantized
    dequantize = gguf.quants.dequantize

    def recorded(data: np.ndarray, qtype: object) -> np.ndarray:
        shapes.append(data.shape)
        return dequantize(data, qtype)

    monkeypatch.setattr(gguf.quants, "dequantize", recorded)
    with pytest.raises(ModelFilesError) as e:
        convert_gguf(path, cache=tmp_path / "cache")
    version = importlib.metadata.version("gguf")
    message = str(e.value)
    assert message.startswith(
        f"GGUF tensor 'blk.0.ffn_up.weight' is of type Q8_K, which gguf {version} cannot "
        "dequantize (supported: F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, "
        "Q6_K, "
    ), message
    assert "\n" not in message and "Q8_K" not in message.split("supported")[1]
    assert all(len(shape) == 1 for shape in shapes)  # at most one-block probes: no tensor
    assert not (tmp_path / "cache").exists()  # nothing written: no folder, no lock file


def test_an_architecture_the_converter_does_not_map_is_refused_naming_those_it_does(
    tmp_path: pathlib.Path,
) -> None:
    from sluiceway.model_files import _SUPPORTED

    path = write_tiny_gguf(tmp_path / "phi2.gguf", lambda _: Q.Q8_0, arch="phi2")
    with pytest.raises(ModelFilesError) as e:
        convert_gguf(path, cache=tmp_path / "cache")
    assert str(e.value) == (
        f"GGUF architecture 'phi2' is not supported (supported: {', '.join(_SUPPORTED)})"
    )


def test_a_tokenizer_transformers_cannot_read_is_refused_in_one_line(
    tmp_path: pathlib.Path,
) -> None:
    path = write_tiny_gguf(tmp_path / "noscores.gguf", lambda _: Q.Q8_0, token_scores=False)
    with pytest.raises(ModelFilesError) as e:
        convert_gguf(path, cache=tmp_path / "cache")
    assert str(e.value) == (
        f"the tokenizer of {path} cannot be read by transformers (KeyError: 'scores')"
    )
    assert [p.name for p in (tmp_path / "cache" / "gguf").iterdir() if p.is_dir()] == []
