"""P and B of the machine it runs on, for `sluiceway bench roofline` (issue 33): the worker's
own CPU GEMM at a model's linear shapes (:func:`measure_gemm`) and a streaming read over a
buffer far larger than the L3 (:func:`measure_bandwidth`).
"""

from __future__ import annotations

import math
import os
import pathlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from sluiceway.worker.model_config import ModelConfig

ROWS = (1, 200, 2048)  # the GEMM's row counts (issue 33)
HEAD_MAX_ROWS = 200  # the LM head runs on the rows that sample: one per sequence
DEFAULT_L3_BYTES = 32 * 2**20  # where the cache size cannot be read


@dataclass(frozen=True, slots=True)
class LinearShape:
    """One linear layer of the model: ``[rows, in_features] @ [out_features, in_features].T``,
    ``count`` times per token (once per layer; the LM head once)."""

    name: str
    out_features: int
    in_features: int
    count: int

    @property
    def weights(self) -> int:
        """Weights a token goes through in all ``count`` of them."""
        return self.out_features * self.in_features * self.count


def linear_shapes(config: ModelConfig) -> list[LinearShape]:
    """The model's linear layers as the worker fuses them (qkv, o, gate_up, down per layer;
    the LM head, the tied embedding's or its own: the same shape)."""
    h, d, layers = config.hidden_size, config.head_dim, config.num_layers
    return [
        LinearShape("qkv", (config.num_heads + 2 * config.num_kv_heads) * d, h, layers),
        LinearShape("o", h, config.num_heads * d, layers),
        LinearShape("gate_up", 2 * config.intermediate_size, h, layers),
        LinearShape("down", h, config.intermediate_size, layers),
        LinearShape("lm_head", config.vocab_size, h, 1),
    ]


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo's; else the platform's processor string)."""
    import platform

    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _parse_size(text: str) -> int:
    """sysfs' cache size ("32768K") -> bytes."""
    text = text.strip()
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    unit = units.get(text[-1:].upper())
    return int(text[:-1]) * unit if unit else int(text)


def l3_cache_bytes() -> int:
    """This machine's L3 in bytes, each distinct L3 (sysfs ``shared_cpu_list``) counted once;
    glibc's figure where sysfs has none, else :data:`DEFAULT_L3_BYTES`."""
    caches: dict[str, int] = {}
    for index in pathlib.Path("/sys/devices/system/cpu").glob("cpu[0-9]*/cache/index[0-9]*"):
        try:
            if (index / "level").read_text().strip() == "3":
                shared = (index / "shared_cpu_list").read_text().strip()
                caches[shared] = _parse_size((index / "size").read_text())
        except (OSError, ValueError):
            continue
    if caches:
        return sum(caches.values())
    try:
        size = os.sysconf("SC_LEVEL3_CACHE_SIZE")
    except (ValueError, OSError):
        size = 0
    return size if size > 0 else DEFAULT_L3_BYTES


def measure_bandwidth(buffer_bytes: int, reps: int = 5) -> float:
    """B, bytes/s: the best of ``reps`` streaming reads (torch's float32 sum, on torch's
    threads) over a buffer of ``buffer_bytes`` (make it 8x the L3 or more: the read must come
    from memory), after one untimed read."""
    import torch

    buf = torch.ones(max(1, buffer_bytes // 4), dtype=torch.float32)
    buf.sum()
    best = math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t0)
    return buf.numel() * 4 / best


# (pack a [N, K] weight, run [rows, K] x packed -> [rows, N])
_Gemm = tuple[Callable[["torch.Tensor"], "torch.Tensor"], Callable[..., "torch.Tensor"]]


def gemm_kernels(dtype: torch.dtype) -> tuple[str, _Gemm, _Gemm]:
    """The CPU GEMMs the worker runs in ``dtype`` (``LlamaForCausalLM.pack_linear_weights``):
    its name, the layers' (pack, run) and the LM head's (float32 logits, written into a buffer
    the model keeps, as the step loop does)."""
    import torch
    import torch.nn.functional as F

    from sluiceway.kernels import cpu_ops, onednn_linear

    if dtype == torch.bfloat16 and cpu_ops.bf16_gemm_supported():

        def layer_run(x: torch.Tensor, w: torch.Tensor, n: int, out: Any) -> torch.Tensor:
            return cpu_ops.bf16_linear(x, w, n)

        def head_run(x: torch.Tensor, w: torch.Tensor, n: int, out: Any) -> torch.Tensor:
            return cpu_ops.bf16_linear(x, w, n, out=out, out_dtype=torch.float32)

        pack = cpu_ops.pack_bf16_pairs
        return "cpu_ops.bf16_linear (AVX512-BF16)", (pack, layer_run), (pack, head_run)
    if onednn_linear.available():

        def dnn_run(x: torch.Tensor, w: torch.Tensor, n: int, out: Any) -> torch.Tensor:
            return onednn_linear.linear(x, w, None)

        def dnn_head(x: torch.Tensor, w: torch.Tensor, n: int, out: Any) -> torch.Tensor:
            return onednn_linear.linear(x.float(), w, None)

        def head_pack(w: torch.Tensor) -> torch.Tensor:
            return onednn_linear.pack(w.float())

        return "oneDNN (prepacked)", (onednn_linear.pack, dnn_run), (head_pack, dnn_head)

    def plain(x: torch.Tensor, w: torch.Tensor, n: int, out: Any) -> torch.Tensor:
        return F.linear(x, w)

    return "F.linear", (lambda w: w, plain), (lambda w: w, plain)


@dataclass(slots=True)
class GemmFigures:
    """:func:`measure_gemm`'s result: ``seconds[rows][shape]``, the best time of one call."""

    kernel: str
    seconds: dict[int, dict[str, float]]
    copies: int  # copies of the layers' weights cycled through
    copies_bytes: int

    def flops_per_s(self, rows: int, shape: LinearShape) -> float:
        """FLOP/s of one call of ``shape`` at ``rows`` rows."""
        return 2 * rows * shape.out_features * shape.in_features / self.seconds[rows][shape.name]

    def seconds_per_token(self, rows: int, shapes: Sequence[LinearShape]) -> float:
        """Seconds a token costs through ``shapes`` (each ``count`` times) at ``rows`` rows."""
        return sum(self.seconds[rows][s.name] * s.count / rows for s in shapes)


def measure_gemm(
    config: ModelConfig,
    dtype: torch.dtype,
    rows: Sequence[int] = ROWS,
    *,
    reps: int = 3,
    cache_bytes: int | None = None,
    max_head_rows: int = HEAD_MAX_ROWS,
) -> GemmFigures:
    """Times the worker's GEMM (:func:`gemm_kernels`) at each linear shape of ``config`` and
    each row count: the best of ``reps`` passes after an untimed one.

    A pass walks copies of one layer's four weights in a forward's order (qkv, o, gate_up,
    down), as many copies (at most the model's layers) as make more than twice ``cache_bytes``
    (default: :func:`l3_cache_bytes`), so that a weight comes from memory as it does when a
    forward comes back to a layer; then the LM head (one copy), only at rows up to
    ``max_head_rows`` (it runs on the rows that sample: one per sequence).
    """
    import torch

    kernel, (pack, run), (head_pack, head_run) = gemm_kernels(dtype)
    shapes = linear_shapes(config)
    layer = [s for s in shapes if s.name != "lm_head"]
    head = next(s for s in shapes if s.name == "lm_head")
    elem = torch.tensor([], dtype=dtype).element_size()
    layer_bytes = sum(s.out_features * s.in_features for s in layer) * elem
    cache = cache_bytes or l3_cache_bytes()
    copies = max(1, min(config.num_layers, -(-2 * cache // layer_bytes) + 1))
    gen = torch.Generator().manual_seed(0)

    def weight(s: LinearShape) -> torch.Tensor:
        w = torch.randn(s.out_features, s.in_features, generator=gen) * 0.02
        return w.to(dtype)

    layers = [{s.name: pack(weight(s)) for s in layer} for _ in range(copies)]
    head_w = head_pack(weight(head))
    seconds: dict[int, dict[str, float]] = {}
    for m in rows:
        x = {k: torch.randn(m, k, generator=gen).to(dtype) for k in {s.in_features for s in shapes}}
        with_head = m <= max_head_rows
        out = torch.empty(m if with_head else 0, head.out_features)  # float32 logits
        best: dict[str, float] = {}
        for rep in range(reps + 1):  # the first pass is the warm-up
            total = dict.fromkeys([s.name for s in layer], 0.0)
            for weights in layers:
                for s in layer:
                    t0 = time.perf_counter()
                    run(x[s.in_features], weights[s.name], s.out_features, None)
                    total[s.name] += time.perf_counter() - t0
            passes = {k: v / copies for k, v in total.items()}
            if with_head:
                t0 = time.perf_counter()
                head_run(x[head.in_features], head_w, head.out_features, out)
                passes[head.name] = time.perf_counter() - t0
            if rep:
                best = {k: min(best.get(k, math.inf), v) for k, v in passes.items()}
        seconds[m] = best
    return GemmFigures(kernel, seconds, copies, copies * layer_bytes)


@dataclass(slots=True)
class Machine:
    """P and B as measured here (:func:`measure_machine`)."""

    cpu: str
    threads: int
    dtype: str
    l3_bytes: int
    buffer_bytes: int  # of the streaming read
    bandwidth: float  # B, bytes/s
    gemm: GemmFigures
    reps: int


def measure_machine(config: ModelConfig, dtype: torch.dtype, reps: int = 3) -> Machine:
    """P at :data:`ROWS` rows (:func:`measure_gemm`) and B over 8x the L3
    (:func:`measure_bandwidth`), on torch's threads: a few seconds for SmolLM2-135M."""
    import torch

    l3 = l3_cache_bytes()
    gemm = measure_gemm(config, dtype, reps=reps, cache_bytes=l3)
    bandwidth = measure_bandwidth(8 * l3, reps=max(5, reps))
    dtype_name = str(dtype).removeprefix("torch.")
    return Machine(
        cpu_model(), torch.get_num_threads(), dtype_name, l3, 8 * l3, bandwidth, gemm, reps
    )
