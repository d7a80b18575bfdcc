"""``--quantization gguf`` (worker/quantized.py) on the embedded SmolLM2 GGUF (Q4_1 layers, a
Q8_0 embedding tied to the logits): the converted folder's blocks are the file's, the runner's
logits and greedy tokens are bitwise those of ``--quantization none`` in bfloat16, its weights
take at most 0.4x the bytes, in float32 it keeps the float32 reference's greedy tokens, and
where ``gguf`` cannot run it is refused naming why."""

from __future__ import annotations

import pathlib

import gguf
import numpy as np
import pytest
import torch
from safetensors import safe_open

from sluiceway.gguf_blocks import has_blocks, read_blocks
from sluiceway.kernels import cpu_ops
from sluiceway.kernels.backend import TorchAttentionBackend
from sluiceway.model_files import export_hf_folder, resolve_model
from sluiceway.sampling_params import SamplingParams
from sluiceway.worker.config import WorkerConfig
from sluiceway.worker.model_runner import ModelRunner, ScheduledChunk, SequenceData
from sluiceway.worker.model_setup import packing_note
from sluiceway.worker.parallel import TensorParallelGroup
from sluiceway.worker.quantized import quantization_obstacles
from tests.worker.runner_logits import step_logits

needs_bf16 = pytest.mark.skipif(
    not cpu_ops.bf16_gemm_supported(), reason="--quantization gguf needs AVX512-BF16"
)
BLOCK = 16
GREEDY = SamplingParams(temperature=0.0)


def _runner(quantization: str, dtype: str = "bfloat16") -> ModelRunner:
    return ModelRunner(
        resolve_model(None),
        dtype=dtype,
        quantization=quantization,
        block_size=BLOCK,
        kv_cache_memory=320 << 20,  # 20 prompts of 288 tokens in float32
        max_model_len=2048,
    )


@pytest.fixture(scope="module")
def runners() -> dict[str, ModelRunner]:
    return {q: _runner(q) for q in ("gguf", "none")}


def test_the_folder_keeps_the_files_blocks_which_dequantize_to_its_weights() -> None:
    folder = resolve_model(None)
    blocks = read_blocks(folder)
    assert len(blocks) == 30 * 7 + 1  # q, k, v, o, gate, up, down per layer + the embedding
    assert {b.qtype for b in blocks.values()} == {"Q4_1", "Q8_0"}
    assert blocks["model.embed_tokens.weight"].qtype == "Q8_0"
    assert blocks["model.layers.0.self_attn.q_proj.weight"].permuted_heads == 9
    assert blocks["model.layers.0.self_attn.k_proj.weight"].permuted_heads == 3
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        for name in [n for n in blocks if n.startswith("model.layers.7.")] + [
            "model.embed_tokens.weight"
        ]:
            b = blocks[name]
            w = gguf.quants.dequantize(b.raw, gguf.GGMLQuantizationType[b.qtype])
            w = np.ascontiguousarray(w.reshape(b.shape)[b.hf_rows()])
            assert torch.equal(torch.from_numpy(w), f.get_tensor(name)), name


def _grow(seq: SequenceData, free: list[int], tokens: int) -> None:
    while len(seq.block_table) * BLOCK < tokens:
        seq.block_table.append(free.pop())


def greedy(runner: ModelRunner, prompts: list[list[int]], steps: int) -> list[list[int]]:
    """Every prompt prefilled (one chunk each, one step per prompt), then ``steps`` decode
    steps of all of them together: the generated ids."""
    free = list(range(runner.num_kv_blocks))
    seqs = [runner.make_sequence(i, p, GREEDY) for i, p in enumerate(prompts)]
    for seq in seqs:
        _grow(seq, free, len(seq.token_ids))
        (tok,) = runner.execute([ScheduledChunk(seq, 0, len(seq.token_ids))])
        seq.token_ids.append(tok.token_id)
    for _ in range(steps - 1):
        chunks = []
        for seq in seqs:
            _grow(seq, free, len(seq.token_ids))
            chunks.append(ScheduledChunk(seq, len(seq.token_ids) - 1, 1))
        for seq, tok in zip(seqs, runner.execute(chunks), strict=True):
            seq.token_ids.append(tok.token_id)
    return [s.token_ids[len(p) :] for s, p in zip(seqs, prompts, strict=True)]


def held_prompts(n: int, max_tokens: int) -> list[list[int]]:
    """The first ``n`` ShareGPT first turns of 100 characters or more, as token ids, cut at
    ``max_tokens``."""
    from transformers import AutoTokenizer

    from sluiceway.sharegpt import default_dataset_path, iter_records

    tok = AutoTokenizer.from_pretrained(str(resolve_model(None)))
    out = []
    for record in iter_records(default_dataset_path()):
        turns = record.get("conversations") or []
        if turns and len(turns[0]["value"]) >= 100:
            out.append(tok(turns[0]["value"])["input_ids"][:max_tokens])
            if len(out) == n:
                return out
    raise AssertionError("too few ShareGPT records")


@needs_bf16
def test_gguf_gives_the_logits_and_tokens_of_none_in_bfloat16_bitwise(
    runners: dict[str, ModelRunner],
) -> None:
    gguf_runner, none_runner = runners["gguf"], runners["none"]
    assert gguf_runner.quantization == "gguf" and none_runner.quantization == "none"
    assert gguf_runner.batch_invariant
    prompts = held_prompts(4, 400)
    logits = {}
    for name, runner in runners.items():
        free = list(range(runner.num_kv_blocks))
        out = []
        for i, p in enumerate(prompts):
            seq = runner.make_sequence(i, p, GREEDY)
            _grow(seq, free, len(p))
            out.append(step_logits(runner, [ScheduledChunk(seq, 0, len(p))])[0])
        logits[name] = out
    for a, b in zip(logits["gguf"], logits["none"], strict=True):
        assert torch.equal(a, b)
    assert greedy(gguf_runner, prompts, 24) == greedy(none_runner, prompts, 24)


@needs_bf16
@pytest.mark.slow
def test_gguf_in_float32_keeps_the_float32_references_greedy_tokens() -> None:
    # Issue 31's bar: the reference's greedy tokens for at least 18 of 20 held prompts. In
    # bfloat16 (either --quantization) it is 15 of 20 at 32 tokens (docs/models.md): the
    # activations' rounding, not the 4-bit weights, which float32 keeps the reference's.
    # gguf_a8's int8 activations cost more: 11 of 20 (docs/models.md).
    prompts = held_prompts(20, 256)
    got = {}
    for quantization, dtype in (("gguf", "float32"), ("gguf_a8", "bfloat16")):
        runner = _runner(quantization, dtype=dtype)
        assert runner.quantization == quantization and runner.batch_invariant
        got[quantization] = greedy(runner, prompts, 32)
        del runner
    want = greedy(_runner("none", dtype="float32"), prompts, 32)
    assert sum(a == b for a, b in zip(got["gguf"], want, strict=True)) >= 18
    assert sum(a == b for a, b in zip(got["gguf_a8"], want, strict=True)) >= A8_SAME_OF_20


needs_a8 = pytest.mark.skipif(
    not cpu_ops.quant_gemm_a8_supported(), reason="--quantization gguf_a8 needs AVX512-VNNI"
)
A8_SAME_OF_20 = 11  # measured 11 (15 over 16 tokens, 4 over 128): docs/models.md


@needs_a8
def test_gguf_a8_serves_the_same_blocks_with_int8_activations(
    runners: dict[str, ModelRunner],
) -> None:
    """Every weight in the a8 layout, the same bytes as gguf's, the same embedding rows; the
    prefill's top-1 tokens those of none at 397 of 410 positions (int8 activations are not
    bfloat16's: the count is exact because the forward is deterministic)."""
    a8 = _runner("gguf_a8")
    assert a8.quantization == "gguf_a8" and a8.batch_invariant
    assert a8.weight_bytes() == runners["gguf"].weight_bytes() == 96_506_496
    model = a8.model
    assert model.quant_embed is not None and model.quant_embed.layout == "a8"
    layouts = {w.layout for layer in model.layers for ws in layer.quantized.values() for w in ws}
    assert layouts == {"a8"}
    assert (
        packing_note(model)
        == ", weights kept in their GGUF blocks (96 MB) on the int8-activation GEMM"
    )
    assert packing_note(runners["gguf"].model).endswith("on the quantized GEMM")
    ids = torch.tensor([0, 1, 17, 49_151])
    tile_embed = runners["gguf"].model.quant_embed
    assert tile_embed is not None
    assert torch.equal(
        cpu_ops.quant_embedding(model.quant_embed, ids), cpu_ops.quant_embedding(tile_embed, ids)
    )
    prompts = held_prompts(4, 200)
    same = total = 0
    for i, p in enumerate(prompts):
        top1 = []
        for runner in (a8, runners["none"]):
            seq = runner.make_sequence(i, p, GREEDY)
            seq.block_table.extend(range(-(-len(p) // BLOCK)))
            top1.append(step_logits(runner, [ScheduledChunk(seq, 0, len(p))])[0].argmax(-1))
        same += int((top1[0] == top1[1]).sum())
        total += len(p)
    # measured: 397 of 410 (0.968; bench quality's 200 texts against float32: 0.9685)
    assert (same, total) == (397, 410)


@needs_bf16
def test_gguf_weights_take_at_most_0_4x_the_bfloat16_bytes(
    runners: dict[str, ModelRunner],
) -> None:
    gguf_bytes, none_bytes = runners["gguf"].weight_bytes(), runners["none"].weight_bytes()
    model = runners["gguf"].model
    quantized = model.quantized_bytes()
    norms = (30 * 2 + 1) * 576 * 2  # the bfloat16 norm weights stay plain
    assert gguf_bytes == quantized + norms == 96_506_496  # 0.296x none's, 0.359x its weights
    assert none_bytes == 134_515_008 * 2 + 49_152 * 576 * 2  # + the logits' packed copy
    assert gguf_bytes <= 0.4 * none_bytes, (gguf_bytes, none_bytes)


def test_gguf_is_refused_where_it_cannot_run(
    tiny_models: dict[str, pathlib.Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(
        ValueError, match=r"--quantization gguf cannot serve this run: .*not float16"
    ):
        _runner("gguf", dtype="float16")
    if cpu_ops.bf16_gemm_supported():
        monkeypatch.setattr(cpu_ops, "quant_gemm_a8_supported", lambda: False)
        with pytest.raises(
            ValueError,
            match=r"--quantization gguf_a8 cannot serve this run: its int8 GEMM needs a CPU "
            r"with AVX512-VNNI \(--quantization none",
        ):
            _runner("gguf_a8")
        monkeypatch.undo()
    # float32 is the quality reference: auto keeps its weights dequantized
    assert _runner("auto", dtype="float32").quantization == "none"
    with pytest.raises(ValueError, match="was not converted from a GGUF file"):
        ModelRunner(next(iter(tiny_models.values())), dtype="float32", quantization="gguf")
    auto = ModelRunner(next(iter(tiny_models.values())), dtype="float32", kv_cache_memory=8 << 20)
    assert auto.quantization == "none"
    with pytest.raises(ValueError, match="quantization"):
        WorkerConfig(quantization="q4")


def test_an_exported_folder_keeps_the_blocks(tmp_path: pathlib.Path) -> None:
    """`sluiceway convert --output DIR` copies the blocks' folder too: DIR serves gguf."""
    out = export_hf_folder(None, tmp_path / "smollm2")
    assert has_blocks(out) and not (out / "sluiceway.json").exists()
    assert read_blocks(out).keys() == read_blocks(resolve_model(None)).keys()


@needs_bf16
def test_weights_of_other_types_stay_dequantized_or_gguf_is_refused(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A file of Q8_0 matrices but one Q5_1 (no GEMM for it): the fused gate/up holding it
    stays dequantized (logged), the rest is served from blocks, logits bitwise none's; a file
    all in Q5_1: gguf refused, auto serves none."""
    from sluiceway.model_files import convert_gguf
    from tests.worker.test_gguf_types import write_tiny_gguf

    Q = gguf.GGMLQuantizationType
    mixed = convert_gguf(
        write_tiny_gguf(tmp_path / "mixed.gguf", lambda n: Q.Q5_1 if "ffn_up" in n else Q.Q8_0),
        tmp_path / "cache",
    )
    runners = {
        q: ModelRunner(mixed, dtype="bfloat16", quantization=q, kv_cache_memory=1 << 20)
        for q in ("gguf", "none")
    }
    layer = runners["gguf"].model.layers[0]
    assert sorted(layer.quantized) == ["down_weight", "o_weight", "qkv_weight"]
    assert runners["gguf"].model.quant_embed is not None
    assert "2 quantized weights stay dequantized: those of type Q5_1 (" in caplog.text
    ids = list(range(3, 40))
    logits = {}
    for q, runner in runners.items():
        seq = runner.make_sequence(0, ids, GREEDY)
        seq.block_table.extend(range(3))
        logits[q] = step_logits(runner, [ScheduledChunk(seq, 0, len(ids))])[0]
    assert torch.equal(logits["gguf"], logits["none"])

    q51 = convert_gguf(write_tiny_gguf(tmp_path / "q51.gguf", lambda n: Q.Q5_1), tmp_path / "c")
    with pytest.raises(ValueError, match=r"none of its quantized weights \(Q5_1\) is of a type"):
        ModelRunner(q51, dtype="bfloat16", quantization="gguf", kv_cache_memory=1 << 20)
    assert ModelRunner(q51, dtype="bfloat16", kv_cache_memory=1 << 20).quantization == "none"


def test_an_unreadable_blocks_file_is_one_clear_error(tmp_path: pathlib.Path) -> None:
    (tmp_path / "gguf").mkdir()
    (tmp_path / "gguf" / "blocks.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{")
    with pytest.raises(ValueError, match=r"blocks.safetensors is not a readable GGUF blocks file"):
        read_blocks(tmp_path)


def test_a_cuda_worker_never_builds_the_cpu_kernels_to_plan_its_weights(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On the first GPU run (2026-12-04) every CUDA worker spent minutes building the C++ CPU
    kernels because the plan asked whether the CPU GEMM runs: a CUDA device is an obstacle
    by itself, and the CPU kernels are not asked about."""

    def build() -> bool:
        raise AssertionError("a CUDA worker asked the C++ CPU kernels")

    monkeypatch.setattr(cpu_ops, "bf16_gemm_supported", build)
    monkeypatch.setattr(cpu_ops, "quant_gemm_a8_supported", build)
    obstacles = quantization_obstacles(
        resolve_model(None), device=torch.device("cuda"), dtype=torch.bfloat16,
        backend=TorchAttentionBackend(), tp=TensorParallelGroup(), mode="gguf_a8",
    )  # fmt: skip
    assert obstacles == [
        "it runs on the CPU only, not cuda",
        "it runs beside the C++ CPU kernels, not the torch backend",
    ]
