"""Sizing and allocating the model runner's KV pool: bytes per block, the CUDA profiling forward
that finds the memory left for the pool, the block count every tensor-parallel rank agrees on.

The pool is one ``[num_layers, 2, num_blocks, Hkv, block_size * D]`` tensor in the model's
dtype (layout in :mod:`kernels.paged_attention`; ``Hkv`` the rank's KV heads), or with
``--kv-cache-dtype int8`` an int8 ``[num_layers, 2, num_blocks, Hkv, block_size * (D + 4)]``
one (values and per-token float32 scales, :mod:`kernels.kv_quant`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from sluiceway.kernels.backend import AttentionBackend
from sluiceway.kernels.kv_quant import kv_row_width
from sluiceway.kernels.paged_attention import kv_pool_shape
from sluiceway.sampling_params import SamplingParams
from sluiceway.worker.model import LlamaForCausalLM, ModelConfig
from sluiceway.worker.parallel import TensorParallelGroup
from sluiceway.worker.sampler import sample

__all__ = [
    "DEFAULT_CPU_KV_CACHE_MEMORY",
    "KvPoolFactory",
    "allocate_kv_pool",
    "count_kv_blocks",
    "kv_bytes_per_block",
    "profile_cuda_kv_budget",
]

log = logging.getLogger(__name__)

DEFAULT_CPU_KV_CACHE_MEMORY = 4 * 1024**3

KvPoolFactory = Callable[[tuple[int, ...], torch.dtype, torch.device], torch.Tensor]


def kv_bytes_per_block(
    config: ModelConfig, num_kv_heads: int, block_size: int, dtype: torch.dtype
) -> int:
    """Bytes of one block across all layers, K and V: ``num_layers * 2 * num_kv_heads *
    width * dtype.itemsize`` (``num_kv_heads``: the rank's; ``width`` ``block_size * head_dim``
    elements of the pool's ``dtype``, or for int8 ``block_size * (head_dim + 4)`` bytes: the
    values and their float32 scales).

    Raises:
        ValueError: int8 with ``block_size * head_dim`` not a multiple of 4.
    """
    width = kv_row_width(block_size, config.head_dim, dtype)
    return config.num_layers * 2 * num_kv_heads * width * dtype.itemsize


def count_kv_blocks(kv_cache_memory: int, bytes_per_block: int, tp: TensorParallelGroup) -> int:
    """Blocks ``kv_cache_memory`` bytes hold, the smallest over the tensor-parallel ranks (every
    rank must hold the blocks the scheduler hands out; a collective when ``tp`` has several).

    Raises:
        ValueError: not one block.
    """
    num_blocks = tp.min_int(int(kv_cache_memory) // bytes_per_block)
    if num_blocks < 1:
        raise ValueError(
            f"KV cache memory of {kv_cache_memory} bytes holds no block of {bytes_per_block} bytes"
        )
    return num_blocks


def allocate_kv_pool(
    factory: KvPoolFactory | None,
    config: ModelConfig,
    *,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """The ``[num_layers, 2, num_blocks, num_kv_heads, width]`` pool in ``dtype`` on
    ``device`` (``width`` of :func:`kernels.paged_attention.kv_pool_shape`), from ``factory``
    (e.g. shared memory) or uninitialized ``torch.empty`` when None."""
    shape = kv_pool_shape(
        config.num_layers, num_blocks, block_size, num_kv_heads, config.head_dim, dtype
    )
    if factory is None:
        return torch.empty(shape, dtype=dtype, device=device)
    return factory(shape, dtype, device)


def profile_cuda_kv_budget(
    model: LlamaForCausalLM,
    backend: AttentionBackend,
    *,
    dtype: torch.dtype,
    device: torch.device,
    block_size: int,
    max_model_len: int,
    max_num_batched_tokens: int,
    utilization: float,
) -> int:
    """Bytes left for the KV pool after a profiling forward (and sampling) of
    ``min(max_num_batched_tokens, max_model_len)`` tokens of one sequence on ``device``:
    ``utilization * total - (peak torch memory + memory used outside torch)``, at least 0.

    The profiling pool (the blocks of that one sequence, zeros in ``dtype``: the pool's, the
    model's or int8) is left out of the peak: the real pool replaces it.
    """
    c = model.config
    tokens = max(1, min(max_num_batched_tokens, max_model_len))
    blocks = -(-tokens // block_size)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    hq, hkv = model.num_heads, model.num_kv_heads
    shape = kv_pool_shape(c.num_layers, blocks, block_size, hkv, c.head_dim, dtype)
    pool = torch.zeros(shape, dtype=dtype, device=device)
    pool_bytes = pool.numel() * pool.element_size()
    with torch.inference_mode():
        metadata = backend.build_metadata(
            [tokens],
            [tokens],
            [list(range(blocks))],
            block_size=block_size,
            num_heads=hq,
            num_kv_heads=hkv,
            head_dim=c.head_dim,
            device=device,
        )
        ids = torch.zeros(tokens, dtype=torch.int64, device=device)
        pos = torch.arange(tokens, dtype=torch.int64, device=device)
        hidden = model(ids, pos, metadata, list(pool.unbind(0)))
        rows = min(tokens, 256)
        logits = model.compute_logits(hidden[:rows])
        sample(logits, [SamplingParams(top_p=0.9)] * rows, [None] * rows, [[0]] * rows)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - pool_bytes
    del pool, hidden, logits
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    outside_torch = total - free - torch.cuda.memory_reserved(device)
    budget = int(utilization * total - peak - max(outside_torch, 0))
    log.info(
        "CUDA profile: total %d, peak torch %d, outside torch %d -> KV budget %d bytes",
        total,
        peak,
        outside_torch,
        budget,
    )
    return max(budget, 0)
