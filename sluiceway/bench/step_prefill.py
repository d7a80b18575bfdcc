"""`sluiceway bench step --prefill-tokens N`: times a step of prompt rows (issue 33, part 3).

The step a long queue of new requests makes: ``N`` prompt rows, as prompts of ``--context-len``
tokens (default 256, the W1 workload's) each computed from position 0 and sampling its first
token, the last prompt shorter when ``N`` is not a multiple. It prints the step time and, on a
CPU, where the time goes: torch's profiler over a few steps of the per-layer path (the layer
stack off, so each kernel is its own entry; the same kernels on the same tensors), split into
the linears (the GEMM kernels), attention and the rest, and the linears' time against P: the
dense bfloat16 GEMM's best time at these shapes and row counts measured now
(:func:`sluiceway.bench.machine_rates.measure_gemm`, as `bench roofline` does), so "linears at
90% of P" means the step's GEMMs ran at 90% of the rate that GEMM reaches alone (with
`--quantization gguf` or `gguf_a8` the step's GEMMs are other kernels, P the same dense one).
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sluiceway.bench.machine_rates import LinearShape
    from sluiceway.worker.model_runner import ModelRunner, ScheduledChunk

DEFAULT_PROMPT_LEN = 256  # the W1 workload's prompts (bench_vs_vllm.sh)
PROFILED_STEPS = 3
ATTENTION_OPS = frozenset({"sluiceway::paged_attention"})


def is_linear_op(name: str) -> bool:
    """Whether a profiler entry ``name`` is a linear layer's GEMM: the C++ kernels'
    (``sluiceway::bf16_gemm``, ``quant_gemm``, ``quant_gemm_a8``), oneDNN's prepacked linear or
    torch's matrix products."""
    if name.startswith("sluiceway::"):
        return "gemm" in name
    return name in {"mkldnn::_linear_pointwise", "aten::mm", "aten::addmm", "aten::bmm"}


def prompt_lengths(tokens: int, prompt_len: int) -> list[int]:
    """``tokens`` rows as prompts of ``prompt_len`` tokens, the last one shorter when it does
    not divide (e.g. 600, 256 -> [256, 256, 88]).

    Raises:
        ValueError: ``tokens`` or ``prompt_len`` below 1.
    """
    if tokens < 1 or prompt_len < 1:
        raise ValueError(f"prefill tokens and prompt length must be >= 1: {tokens}, {prompt_len}")
    full, rest = divmod(tokens, prompt_len)
    return [prompt_len] * full + ([rest] if rest else [])


def prompt_lengths_of(args: argparse.Namespace) -> list[int] | None:
    """`--prefill-tokens`' prompt lengths (of `--context-len` tokens, default
    :data:`DEFAULT_PROMPT_LEN`), or None for the decode batches.

    Raises:
        SystemExit: `--prefill-tokens` with `--batch-sizes`, or a length below 1.
    """
    if args.prefill_tokens is None:
        return None
    if args.batch_sizes:
        raise SystemExit("--batch-sizes sets decode batches: leave it out with --prefill-tokens")
    prompt_len = args.context_len or DEFAULT_PROMPT_LEN
    try:
        return prompt_lengths(args.prefill_tokens, prompt_len)
    except ValueError as e:
        raise SystemExit(f"--prefill-tokens / --context-len: {e}") from None


@dataclass(slots=True)
class StepSplit:
    """Self time per step (seconds) of a profiled step, by kind of operator."""

    linears: float
    attention: float
    other: float

    @property
    def total(self) -> float:
        return self.linears + self.attention + self.other


def split_self_times(entries: Iterable[tuple[str, float]], steps: int) -> StepSplit:
    """(operator name, self seconds) over ``steps`` steps -> seconds per step by kind."""
    linears = attention = other = 0.0
    for name, seconds in entries:
        if is_linear_op(name):
            linears += seconds
        elif name in ATTENTION_OPS:
            attention += seconds
        else:
            other += seconds
    return StepSplit(linears / steps, attention / steps, other / steps)


def profile_split(runner: ModelRunner, chunks: list[ScheduledChunk]) -> StepSplit:
    """:data:`PROFILED_STEPS` steps of ``chunks`` on the per-layer path under torch's profiler
    (CPU self times), split by :func:`split_self_times`."""
    from torch.profiler import ProfilerActivity, profile

    model = runner.model
    model.per_layer_calls = True
    try:
        runner.execute(chunks)  # the per-layer path's first step outside the profile
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(PROFILED_STEPS):
                runner.execute(chunks)
    finally:
        model.per_layer_calls = False
    entries = [(e.key, e.self_cpu_time_total / 1e6) for e in prof.key_averages()]
    return split_self_times(entries, PROFILED_STEPS)


def _step_linears(
    runner: ModelRunner, rows: int, sampled_rows: int
) -> list[tuple[LinearShape, int]]:
    """The step's linears and the rows each runs on: the layers' on every row, the LM head's
    on the rows that sample."""
    from sluiceway.bench.machine_rates import linear_shapes

    return [
        (shape, sampled_rows if shape.name == "lm_head" else rows)
        for shape in linear_shapes(runner.model.config)
    ]


def gemm_floor_seconds(runner: ModelRunner, rows: int, sampled_rows: int) -> tuple[str, float]:
    """The GEMM kernel's name and the seconds the step's linears (:func:`_step_linears`)
    take at P: each shape's best time at its rows (times its count), measured now by
    :func:`sluiceway.bench.machine_rates.measure_gemm`."""
    from sluiceway.bench.machine_rates import measure_gemm

    figures = measure_gemm(
        runner.model.config,
        runner.dtype,
        rows=sorted({rows, sampled_rows}),
        max_head_rows=sampled_rows,
    )
    seconds = sum(
        figures.seconds[at][shape.name] * shape.count
        for shape, at in _step_linears(runner, rows, sampled_rows)
    )
    return figures.kernel, seconds


def linear_flops(runner: ModelRunner, rows: int, sampled_rows: int) -> int:
    """FLOPs of the step's linears (:func:`_step_linears`): 2 x its rows x its weights each."""
    return sum(2 * at * shape.weights for shape, at in _step_linears(runner, rows, sampled_rows))


def prefill_step(
    runner: ModelRunner, chunks: list[ScheduledChunk], times: list[float]
) -> dict[str, Any]:
    """Prints the step of the prompt ``chunks`` (each a whole prompt) that took ``times``
    seconds and, on a CPU, its split and the linears against P; returns the figures (the
    JSON's ``prefill``)."""
    lens = [c.num_new_tokens for c in chunks]
    rows = sum(lens)
    step_s = statistics.median(times)
    result: dict[str, Any] = {
        "prefill_tokens": rows,
        "prompt_lens": lens,
        "median_ms_per_step": 1e3 * step_s,
        "min_ms_per_step": 1e3 * min(times),
        "tokens_per_s": rows / step_s,
    }
    last = f", the last of {lens[-1]}" if lens[-1] != lens[0] else ""
    plural = "s" if len(lens) > 1 else ""
    print(
        f"prefill {rows} rows ({len(lens)} prompt{plural} of {lens[0]} tokens{last}): "
        f"{1e3 * step_s:.1f} ms/step (median of {len(times)}, min {1e3 * min(times):.1f}), "
        f"{rows / step_s:.0f} prompt tokens/s"
    )
    if runner.device.type != "cpu" or runner.attention_backend.name != "cpu":
        print("(the split by kernel and P: on a CPU with the C++ kernels, --attention-backend cpu)")
        return result
    split = profile_split(runner, chunks)
    kernel, floor_s = gemm_floor_seconds(runner, rows, len(lens))
    flops = linear_flops(runner, rows, len(lens))
    result.update(
        linears_ms=1e3 * split.linears,
        attention_ms=1e3 * split.attention,
        other_ms=1e3 * split.other,
        linear_flops=flops,
        linears_gflops=flops / split.linears / 1e9,
        gemm_kernel=kernel,
        p_gflops=flops / floor_s / 1e9,
        linears_of_p=floor_s / split.linears,
    )
    print(
        f"profiled ({PROFILED_STEPS} steps, per-layer calls), per step: linears "
        f"{1e3 * split.linears:.1f} ms ({100 * split.linears / split.total:.0f}%), attention "
        f"{1e3 * split.attention:.1f} ms ({100 * split.attention / split.total:.0f}%), other "
        f"{1e3 * split.other:.1f} ms; linears {flops / 1e9:.1f} GFLOP at "
        f"{result['linears_gflops']:.0f} GFLOPS (quantization {runner.quantization}) = "
        f"{100 * result['linears_of_p']:.0f}% of P (bench roofline's: {kernel} alone at these "
        f"shapes now, {result['p_gflops']:.0f} GFLOPS)"
    )
    return result
