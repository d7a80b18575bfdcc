"""The decoder's layers in one C++ call (worker/layer_stack.py) give bitwise the logits of the
per-layer path, in every mode it runs: GGUF blocks (tile and a8 layouts, bfloat16 and float32
activations), bfloat16 pairs, an int8 KV cache, biases, q/k norms and a sliding window; and
where it cannot run, the per-layer path serves."""

from __future__ import annotations

import pathlib

import pytest
import torch

from sluiceway.kernels import cpu_ops
from sluiceway.model_files import resolve_model
from sluiceway.sampling_params import SamplingParams
from sluiceway.worker.model_runner import ModelRunner, ScheduledChunk, SequenceData
from tests.worker.runner_logits import step_logits

pytestmark = pytest.mark.skipif(
    not cpu_ops.quant_gemm_a8_supported(), reason="the stack's kernels need AVX512-BF16/VNNI"
)
BLOCK = 16


def _runner(
    model_dir: pathlib.Path, per_layer: bool, window: int | None = None, **kwargs: str
) -> ModelRunner:
    runner = ModelRunner(
        model_dir, block_size=BLOCK, kv_cache_memory=16 << 20, max_model_len=256, **kwargs
    )
    if window is not None:  # every layer slides (before the stack is built)
        for layer in runner.model.layers:
            layer.window = window  # type: ignore[assignment]
    runner.model.per_layer_calls = per_layer  # bench step --prefill-tokens' profiled path
    return runner


def _steps_logits(runner: ModelRunner) -> list[torch.Tensor]:
    """Logits of every position of: a 30-token chunk of sequence 0; its last 21 tokens beside
    the whole 27-token prompt of sequence 1; then 6 decode steps of both (greedy tokens)."""
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(5, 250, (n,), generator=gen).tolist() for n in (51, 27)]
    seqs = [
        runner.make_sequence(i, p, SamplingParams(temperature=0.0)) for i, p in enumerate(prompts)
    ]
    free = list(range(runner.num_kv_blocks))

    def grow(seq: SequenceData) -> None:
        while len(seq.block_table) * BLOCK < len(seq.token_ids):
            seq.block_table.append(free.pop())

    out: list[torch.Tensor] = []
    plans = [
        [ScheduledChunk(seqs[0], 0, 30)],
        [ScheduledChunk(seqs[0], 30, 21), ScheduledChunk(seqs[1], 0, 27)],
    ]
    for plan in plans:
        for c in plan:
            grow(c.seq)
        out += step_logits(runner, plan)
    for _ in range(6):
        for seq, logits in zip(seqs, out[-2:], strict=True):
            seq.token_ids.append(int(logits[-1].argmax()))
            grow(seq)
        out += step_logits(runner, [ScheduledChunk(s, len(s.token_ids) - 1, 1) for s in seqs])
    return out


def _assert_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b) == 2 + 1 + 12
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


@pytest.mark.parametrize(
    ("quantization", "dtype", "kv_cache_dtype"),
    [
        ("gguf_a8", "bfloat16", "auto"),
        ("gguf_a8", "bfloat16", "int8"),
        ("gguf", "bfloat16", "auto"),
        ("gguf", "float32", "auto"),
        ("none", "bfloat16", "int8"),
    ],
)
def test_the_embedded_model_gives_the_per_layer_logits(
    quantization: str, dtype: str, kv_cache_dtype: str
) -> None:
    kw = {"quantization": quantization, "dtype": dtype, "kv_cache_dtype": kv_cache_dtype}
    stacked = _runner(resolve_model(None), False, **kw)
    assert stacked.model._layer_stack(stacked.model.attention_backend) is not None
    _assert_equal(_steps_logits(stacked), _steps_logits(_runner(resolve_model(None), True, **kw)))


@pytest.mark.parametrize("variant", ["llama3-rope-bias", "qwen2", "qwen3", "llama-tied"])
def test_biases_qk_norms_and_windows_give_the_per_layer_logits(
    tiny_models: dict[str, pathlib.Path], variant: str
) -> None:
    window = 20 if variant == "llama-tied" else None  # past the window: blocks skipped
    stacked = _runner(tiny_models[variant], False, window, dtype="bfloat16")
    logits = _steps_logits(stacked)
    stack = stacked.model._layer_stack(stacked.model.attention_backend)
    assert stack is not None and stack.windows == [window or 0] * 2
    per_layer = _runner(tiny_models[variant], True, window, dtype="bfloat16")
    _assert_equal(logits, _steps_logits(per_layer))


def test_what_the_stack_cannot_run_takes_the_per_layer_path(
    tiny_models: dict[str, pathlib.Path],
) -> None:
    # float32 without blocks: oneDNN's packed weights, which decoder_layers does not run
    runner = _runner(tiny_models["llama-tied"], False, dtype="float32")
    assert runner.model._layer_stack(runner.model.attention_backend) is None
    # the torch attention reference
    runner = _runner(tiny_models["llama-tied"], False, dtype="bfloat16", attention_backend="torch")
    assert runner.model._layer_stack(runner.model.attention_backend) is None
