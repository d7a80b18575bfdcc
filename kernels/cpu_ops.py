"""The C++ CPU kernels (``kernels/csrc``): paged attention, the fused elementwise ops, the
bfloat16 GEMM of the linear layers and the logits, and greedy sampling's reductions.

They are compiled once per machine with the system C++ compiler through
:func:`torch.utils.cpp_extension.load` (``-O3 -march=native``: the vector width of this CPU) and
cached under ``$TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``), keyed by the
sources, the flags, torch's version and installation folder and this CPU's instruction-set
flags; ``make install`` builds them, so a first ``serve`` only loads the library (well under
a second). Why C++ and not ``torch.compile``: Inductor
compiles the model again at every start (vLLM's CPU build takes 51-90 s to start on this
model on 2 cores, most of it there), and a fixed per-row reduction order is ours to write.

After :func:`load` the operators are ``torch.ops.sluiceway.*`` (they write into the tensors
they are given and return nothing):

- ``paged_attention(out, query, kv_cache, block_tables, context_lens, query_start_loc, scale,
  sliding_window)`` (``sliding_window`` 0: none)
- ``rms_norm(out, x, weight, eps)``, ``fused_add_rms_norm(x, residual, weight, eps)``
- ``silu_and_mul(out, x)``, ``gelu_tanh_and_mul(out, x)``, ``qk_rms_norm(qkv, q_w, k_w, Hq, Hkv, eps)``
- ``rotary_embedding_write_kv(qkv, positions, cos, sin, kv_cache, slot_mapping, Hq, Hkv)``
- ``argmax_logsumexp(argmax, shifted_logsumexp, logits)`` (log-sum-exp minus the max)
- ``bf16_gemm(out, x, packed, bias)``, ``bf16_gemm_supported()``
- ``quant_gemm(out, x, packed, qtype, bias)``, ``quant_rows(out, packed, ids, qtype, n)``
  (GGUF-quantized weights, packed by :mod:`sluiceway.kernels.quant_pack`); their int8-activation
  twins for the ``a8`` layout ``quant_gemm_a8``, ``quant_rows_a8``, ``quant_gemm_a8_supported()``
- ``decoder_layers(hidden, residual, ...)``: a Llama-family decoder's layers in one call
  (the ops above in the per-layer path's order; it returns the last layer's output)

The Python wrappers below give their shapes and dtypes.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import pathlib
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from sluiceway.kernels.quant_pack import QuantWeight
    from sluiceway.kernels.varlen_metadata import VarlenMetadata

__all__ = [
    "LINEAR_KINDS",
    "CpuKernelsUnavailable",
    "LayerStackArgs",
    "argmax_log_normalizer",
    "bf16_gemm_supported",
    "bf16_linear",
    "decoder_layers",
    "fused_add_rms_norm",
    "gelu_tanh_and_mul",
    "load",
    "pack_bf16_pairs",
    "paged_attention",
    "qk_rms_norm",
    "quant_embedding",
    "quant_gemm_a8_supported",
    "quant_linear",
    "rms_norm",
    "rotary_embedding_write_kv",
    "silu_and_mul",
]

log = logging.getLogger(__name__)

SOURCES = (
    "paged_attention.cpp",
    "elementwise.cpp",
    "sampling.cpp",
    "bf16_gemm.cpp",
    "quant_gemm.cpp",
    "quant_gemm_f32.cpp",
    "quant_gemm_a8.cpp",
    "decoder_layers.cpp",
    "bindings.cpp",
)
HEADERS = ("cpu_math.h", "bf16_tile.h", "quant_layout.h", "ops.h")
CSRC = pathlib.Path(__file__).with_name("csrc")
CFLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fopenmp"]


class CpuKernelsUnavailable(RuntimeError):
    """The C++ kernels could not be built or loaded (no C++ compiler, or a build error)."""


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return ""


def _extension_name() -> str:
    """``sluiceway_cpu_<hash>``: a new build for other sources, flags, torch version, torch
    installation or CPU. The installation (torch's folder, resolved) keeps two virtualenvs on
    one machine (a dev venv, a CI clone's) from rebuilding the same build folder in turn: its
    build.ninja names one torch's include paths."""
    h = hashlib.sha256()
    for name in (*SOURCES, *HEADERS):
        h.update((CSRC / name).read_bytes())
    h.update(" ".join(CFLAGS).encode())
    h.update(torch.__version__.encode())
    h.update(str(pathlib.Path(torch.__file__).resolve().parent).encode())
    h.update(_cpu_flags().encode())
    return f"sluiceway_cpu_{h.hexdigest()[:12]}"


_load_error: CpuKernelsUnavailable | None = None
_loaded = False


def load() -> None:
    """Build (first time on this machine) and load the kernels; idempotent, and a failure is
    remembered (no second build attempt in the same process).

    Raises:
        CpuKernelsUnavailable: no compiler or a failed build (the message says which).
    """
    global _load_error, _loaded
    if _loaded:
        return
    if _load_error is not None:
        raise _load_error
    from torch.utils import cpp_extension

    name = _extension_name()
    build_dir = pathlib.Path(cpp_extension._get_build_directory(name, verbose=False))
    built = build_dir / f"{name}.so"
    if not built.exists():
        log.info("compiling the C++ CPU kernels %s (once per machine, about 10 s)", name)
    try:
        with _build_lock(build_dir):
            cpp_extension.load(
                name=name,
                sources=[str(CSRC / s) for s in SOURCES],
                extra_cflags=CFLAGS,
                is_python_module=False,
                verbose=os.environ.get("SLUICEWAY_VERBOSE_BUILD") == "1",
            )
    except (OSError, RuntimeError, ImportError) as e:  # compiler missing, build or link error
        _load_error = CpuKernelsUnavailable(f"the C++ CPU kernels could not be built: {e}")
        raise _load_error from e
    _loaded = True


@contextlib.contextmanager
def _build_lock(build_dir: pathlib.Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``build_dir/sluiceway.flock`` (the OS releases it when
    its holder dies) while torch builds or loads, and remove torch's own build lock first:
    every builder holds this one, so a torch lock found then was left by a build that was
    killed midway, and torch would wait on it forever (each later start would hang)."""
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "sluiceway.flock", "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process that builds the C++ CPU kernels")
            fcntl.flock(f, fcntl.LOCK_EX)
        stale = build_dir / "lock"
        if stale.exists():
            log.warning("removing %s, left by a build of the C++ CPU kernels that died", stale)
            stale.unlink(missing_ok=True)
        yield


def available() -> bool:
    """Whether :func:`load` succeeds (logging why not)."""
    try:
        load()
    except CpuKernelsUnavailable as e:
        log.warning("%s; using the torch reference kernels", e)
        return False
    return True


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Attention of a flattened varlen batch over the paged pool (layout and batch rules of
    :mod:`kernels.paged_attention`): prefill chunks and decode tokens alike, each row causal
    over its sequence's cached tokens and its own chunk; with ``sliding_window`` ``W`` a row
    at position ``p`` attends to keys ``p - W < k <= p`` only, and blocks wholly before a
    row's window are not read (their table entries are not even checked).

    Args:
        query: ``[T, Hq, D]`` float32/bfloat16/float16, heads contiguous (a row-strided view of
            the fused qkv is fine).
        kv_cache: ``[2, num_blocks, Hkv, block_size * D]`` contiguous, ``query``'s dtype; or
            int8 ``[2, num_blocks, Hkv, block_size * (D + 4)]`` (:mod:`kernels.kv_quant`: each
            score the float32 dot product with the int8 key times its scale, each value row
            weighted by probability times its scale).
        block_tables: ``[S, max_blocks]`` int32 contiguous.
        context_lens: ``[S]`` int32, tokens in the pool per sequence (cached + this chunk).
        query_start_loc: ``[S + 1]`` int32, row offsets of each sequence's chunk.
        scale: softmax scale.
        sliding_window: ``W >= 1`` tokens, or ``None`` for full causal attention.

    Returns:
        A new ``[T, Hq, D]`` contiguous tensor. Scores, softmax and sums in float32, one
        rounding at the end.

    Raises:
        ValueError: ``sliding_window < 1``.
    """
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be at least 1, got {sliding_window}")
    out = torch.empty(query.shape, dtype=query.dtype)
    torch.ops.sluiceway.paged_attention(
        out, query, kv_cache, block_tables, context_lens, query_start_loc, scale,
        sliding_window or 0,
    )  # fmt: skip
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x`` ``[T, H]`` (rows contiguous) -> ``weight * x * rsqrt(mean(x^2) + eps)``, a new
    ``[T, H]`` tensor: float32 arithmetic, one rounding to the dtype (as ``F.rms_norm``);
    ``weight`` in ``x``'s dtype or float32 (Gemma's ``1 + w``)."""
    out = torch.empty(x.shape, dtype=x.dtype)
    torch.ops.sluiceway.rms_norm(out, x, weight, eps)
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> None:
    """In place, both ``[T, H]`` contiguous: ``residual += x`` (rounded to the dtype), then
    ``x = rms_norm(residual)`` (vLLM's ``fused_add_rms_norm``)."""
    torch.ops.sluiceway.fused_add_rms_norm(x, residual, weight, eps)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[T, 2 I]`` contiguous (gate columns, then up) -> ``silu(gate) * up`` ``[T, I]``,
    computed in float32 and rounded once."""
    out = torch.empty((x.shape[0], x.shape[1] // 2), dtype=x.dtype)
    torch.ops.sluiceway.silu_and_mul(out, x)
    return out


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[T, 2 I]`` contiguous (gate columns, then up) -> ``gelu_tanh(gate) * up``
    ``[T, I]`` (transformers' ``gelu_pytorch_tanh``; Gemma's MLP), float32, rounded once."""
    out = torch.empty((x.shape[0], x.shape[1] // 2), dtype=x.dtype)
    torch.ops.sluiceway.gelu_tanh_and_mul(out, x)
    return out


def qk_rms_norm(
    qkv: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    eps: float,
) -> None:
    """In place, each q head of ``qkv`` ``[T, (Hq + 2 Hkv) D]`` (rows contiguous) normalized
    with ``q_weight`` and each k head with ``k_weight`` (float32 ``[D]``; Gemma's ``1 + w``),
    as :func:`rms_norm` per head (Qwen3/Gemma 3's q/k norm, before RoPE); v untouched."""
    torch.ops.sluiceway.qk_rms_norm(qkv, q_weight, k_weight, num_heads, num_kv_heads, eps)


def rotary_embedding_write_kv(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
) -> None:
    """Rotate-half RoPE of the q and k heads of ``qkv`` in place, then the step's K (rotated)
    and V written to their slots of ``kv_cache``.

    Args:
        qkv: ``[T, (Hq + 2 Hkv) D]``, rows contiguous: q heads, k heads, v heads.
        positions: ``[T]`` int64.
        cos, sin: ``[max_positions, D / 2]`` float32 rotary tables.
        kv_cache: this layer's ``[2, num_blocks, Hkv, block_size * D]``, ``qkv``'s dtype; or
            int8 (:mod:`kernels.kv_quant`): each K (rotated, rounded to ``qkv``'s dtype) and V
            row quantized by :func:`kernels.kv_quant.quantize_rows`'s rule, bitwise.
        slot_mapping: ``[T]`` int64 slots (``-1``: write nothing for that row).
    """
    torch.ops.sluiceway.rotary_embedding_write_kv(
        qkv, positions, cos, sin, kv_cache, slot_mapping, num_heads, num_kv_heads
    )


def argmax_log_normalizer(
    logits: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``logits`` ``[R, V]`` float32 or bfloat16 (rows contiguous) -> ``(argmax [R] int64,
    max [R] float32, shifted [R] float32)`` in one pass per row, in float32: the first index of
    each row's largest logit (as ``torch.argmax``), that logit, and
    ``log(sum(exp(row - max)))``; a token's logprob is ``(logit - max) - shifted`` (0 - shifted
    for the argmax, exact to float32). A row of ``-inf`` or holding ``inf`` has shifted 0. A
    NaN is never the argmax (torch's would be): NaN logits are a broken model, and its row's
    shifted value is NaN.
    """
    rows = logits.shape[0]
    argmax = torch.empty(rows, dtype=torch.int64)
    shifted = torch.empty(rows, dtype=torch.float32)
    torch.ops.sluiceway.argmax_logsumexp(argmax, shifted, logits)
    row_max = logits.gather(1, argmax[:, None]).squeeze(1).float()
    return argmax, row_max, shifted


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """In place: ``logits[r, t] = -inf`` for each ``r`` in ``rows`` (int64 ``[N]``) and every
    token ``t`` whose bit is clear in ``bitmask[r]`` (int32 ``[R, ceil(V / 32)]``, bit
    ``t % 32`` of word ``t // 32``); ``logits`` float32 ``[R, V]``, rows contiguous.

    Raises:
        RuntimeError: other dtypes or shapes, or a row out of range.
    """
    torch.ops.sluiceway.apply_token_bitmask(logits, bitmask, rows)


def bf16_gemm_supported() -> bool:
    """Whether :func:`bf16_linear` runs here: the kernels load and were built for a CPU with
    AVX512-BF16 (``-march=native``)."""
    return available() and bool(torch.ops.sluiceway.bf16_gemm_supported())


def quant_gemm_a8_supported() -> bool:
    """Whether :func:`quant_linear` runs weights of the ``a8`` layout here: the kernels load and
    were built for a CPU with AVX512-VNNI and AVX512-BF16 (``-march=native``)."""
    return available() and bool(torch.ops.sluiceway.quant_gemm_a8_supported())


def pack_bf16_pairs(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[N, K]`` -> the layout :func:`bf16_linear` reads: bfloat16
    ``[ceil(N / 16), ceil(K / 2), 16, 2]`` (per 16 columns, per K pair, the 16 columns' pair),
    zero-padded (``4 * ceil(N / 16) * 16 * ceil(K / 2)`` bytes)."""
    n, k = weight.shape
    n_pad, k_pad = -n % 16, -k % 2
    w = torch.nn.functional.pad(weight.to(torch.bfloat16), (0, k_pad, 0, n_pad))
    return w.view((n + n_pad) // 16, 16, (k + k_pad) // 2, 2).permute(0, 2, 1, 3).contiguous()


def bf16_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    n: int,
    bias: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """``x`` ``[M, K]`` bfloat16 (rows contiguous) @ the ``[N, K]`` weight ``packed`` by
    :func:`pack_bf16_pairs` (+ ``bias`` ``[N]``) -> ``[M, N]`` in ``out_dtype`` (bfloat16,
    rounded once, or float32) or into ``out``: each output the float32 sum of exact bfloat16
    products in K order (AVX512-BF16 ``vdpbf16ps``), so a row's result does not depend on
    the other rows (batch invariance).

    Raises:
        RuntimeError: shapes or dtypes that do not match, or a CPU without AVX512-BF16.
    """
    if out is None:
        out = torch.empty(x.shape[0], n, dtype=out_dtype)
    torch.ops.sluiceway.bf16_gemm(out, x, packed, None if bias is None else bias.float())
    return out


def quant_linear(
    x: torch.Tensor,
    weight: QuantWeight,
    bias: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``x`` ``[M, K]`` bfloat16 or float32 (rows contiguous) @ the GGUF-quantized ``[N, K]``
    ``weight`` (:func:`sluiceway.kernels.quant_pack.pack_gguf`) (+ ``bias`` ``[N]``, added in
    float32) -> ``[M, N]`` in ``out_dtype`` (default ``x``'s) or into ``out`` (rows may be
    strided: e.g. a column slice of a fused qkv), whatever ``M`` bitwise the same rows (batch
    invariance):

    - bfloat16 ``x``: out bfloat16 (rounded once) or float32. The weights are dequantized tile
      by tile to gguf's float32 values rounded to bfloat16 (to nearest even) and summed as
      :func:`bf16_linear` sums (kernels/csrc/quant_gemm.cpp): bitwise ``bf16_linear(x,
      pack_bf16_pairs(w.bfloat16()), ...)`` with ``w`` the dequantized weight.
    - float32 ``x``: out float32. Each output summed over ``k`` in order, a rounded product
      then a rounded sum (no fused multiply-add), the bias last
      (kernels/csrc/quant_gemm_f32.cpp): bitwise ``acc = acc + x[:, k, None] * w[:, k]`` for
      ``k`` in ``range(K)`` in float32 from zeros, then ``acc + bias``.
    - ``weight.layout == "a8"`` (``--quantization gguf_a8``), ``x`` either dtype: each row of
      ``x`` quantized to int8 per 32 K values (scale max ``|x|`` / 127), exact int32 dot
      products with the quants (AVX512-VNNI), then per 32 K values a fixed sequence of float32
      steps (kernels/csrc/quant_gemm_a8.cpp, whose header gives them; their torch reference is
      in tests/kernels/test_quant_gemm_a8.py); out ``x``'s dtype by default.

    Raises:
        RuntimeError: shapes or dtypes that do not match, or a CPU without AVX512-BF16.
    """
    if out is None:
        out = torch.empty(x.shape[0], weight.n, dtype=x.dtype if out_dtype is None else out_dtype)
    b = None if bias is None else bias.float().contiguous()
    gemm = (
        torch.ops.sluiceway.quant_gemm_a8
        if weight.layout == "a8"
        else torch.ops.sluiceway.quant_gemm
    )
    gemm(out, x, weight.packed, int(weight.qtype), b)
    return out


def quant_embedding(weight: QuantWeight, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` (int ``[R]``, each in ``[0, N)``) of the GGUF-quantized ``[N, K]``
    ``weight`` -> float32 ``[R, K]``: ``gguf.quants.dequantize``'s values bitwise (a token
    embedding that shares the tied LM head's packed weight).

    Raises:
        RuntimeError: an id out of range.
    """
    ids = ids.to(torch.int64).contiguous()
    out = torch.empty(ids.shape[0], weight.k, dtype=torch.float32)
    rows = (
        torch.ops.sluiceway.quant_rows_a8
        if weight.layout == "a8"
        else torch.ops.sluiceway.quant_rows
    )
    rows(out, weight.packed, ids, int(weight.qtype), weight.n)
    return out


# The linear kernels decoder_layers runs, by QuantWeight.layout (and "bf16_pairs": the packed
# weights of bf16_linear); the values are kernels/csrc/decoder_layers.cpp's LinearKind.
LINEAR_KINDS = {"bf16_pairs": 0, "tile": 1, "a8": 2}


class LayerStackArgs(Protocol):
    """What :func:`decoder_layers` reads of a layer stack (:class:`worker.layer_stack.LayerStack`
    gives the meanings)."""

    weights: list[torch.Tensor]
    kinds: list[int]
    qtypes: list[int]
    out_features: list[int]
    biases: list[torch.Tensor | None]
    norms: list[torch.Tensor]
    qk_norms: list[torch.Tensor | None]
    windows: list[int]
    scale: float
    num_heads: int
    num_kv_heads: int
    eps: float


def decoder_layers(
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    stack: LayerStackArgs,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_caches: Sequence[torch.Tensor],
    metadata: VarlenMetadata,
) -> torch.Tensor:
    """A Llama-family decoder's layers in one call (kernels/csrc/decoder_layers.cpp, whose
    header gives the steps): ``hidden`` ``[T, H]`` contiguous (the embeddings with
    ``residual`` None, else the previous layer's output and ``residual`` the stream before
    it; both overwritten in place, the stream ends in ``residual``, or in ``hidden`` when it
    was None) -> the last layer's output ``[T, H]``, a new tensor. ``stack`` holds the layers'
    weights (:class:`worker.layer_stack.LayerStack`), ``positions`` ``[T]`` int64, ``cos`` /
    ``sin`` the float32 rotary tables, ``kv_caches`` a cache per layer, ``metadata`` the
    step's :class:`kernels.varlen_metadata.VarlenMetadata`.

    Raises:
        RuntimeError: lists of the wrong lengths, or what a kernel it calls raises.
    """
    return torch.ops.sluiceway.decoder_layers(
        hidden, residual, stack.weights, stack.kinds, stack.qtypes, stack.out_features,
        stack.biases, stack.norms, stack.qk_norms, positions, cos, sin, list(kv_caches),
        metadata.slot_mapping, metadata.block_tables, metadata.context_lens,
        metadata.query_start_loc, stack.scale, stack.windows, stack.num_heads,
        stack.num_kv_heads, stack.eps,
    )  # fmt: skip


if __name__ == "__main__":  # `python -m sluiceway.kernels.cpu_ops`: build now (make install does)
    load()
    print(f"C++ CPU kernels ready: {_extension_name()}")
