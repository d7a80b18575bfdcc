"""CUDA graphs of the decode forward at a set of batch sizes.

A decode step of a small model on a GPU is dominated by kernel launches (a few hundred per
forward), not by the kernels. Capturing the forward once per batch size in a CUDA graph and
replaying it turns those launches into one (vLLM's ``CUDAGraphRunner``; `--enforce-eager` turns
it off, as in vLLM). A decode batch of ``n`` sequences runs the graph of the smallest captured
size ``B >= n``: rows ``n .. B - 1`` are padding (context length 0, KV slot -1: the Triton
kernels write and read nothing for them). Larger batches and steps with prefill chunks run
eagerly.

Graphs read their inputs from fixed buffers (token ids, positions, and the Triton decode
metadata: context lengths, block tables, slot mapping), so a replay only copies this step's
values into them. Only the Triton backend is captured (the torch reference builds index tensors
whose shapes depend on the contexts).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence

import torch

from sluiceway.kernels.varlen_metadata import VarlenMetadata
from sluiceway.worker.model import LlamaForCausalLM

__all__ = ["CUDA_GRAPH_BATCH_SIZES", "DecodeCudaGraphs"]

log = logging.getLogger(__name__)

# Decode batch sizes captured, as vLLM's default capture list (1, 2, 4, then multiples of 8),
# thinned above 64.
CUDA_GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


class DecodeCudaGraphs:
    """The model's decode forward captured at each of `batch_sizes` (those <= `max_batch`).

    Args:
        model: the model, with the Triton attention backend, on a CUDA device.
        kv_caches: one ``[2, num_blocks, Hkv, block_size * D]`` cache per layer (the pool the
            graphs will read and write: captured by address).
        max_blocks_per_seq: block-table width, ``ceil(max_model_len / block_size)``.
        block_size: tokens per KV block.

    Raises:
        ValueError: no batch size to capture.
        RuntimeError: capture failed (CUDA errors propagate).
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: Sequence[torch.Tensor],
        *,
        max_blocks_per_seq: int,
        block_size: int,
        batch_sizes: Sequence[int] = CUDA_GRAPH_BATCH_SIZES,
        max_batch: int = 256,
    ) -> None:
        sizes = sorted({b for b in batch_sizes if 1 <= b <= max_batch})
        if not sizes:
            raise ValueError(f"no CUDA graph batch size <= {max_batch} in {list(batch_sizes)}")
        c = model.config
        device = model.embed_weight.device
        self.model = model
        self.kv_caches = list(kv_caches)
        self.batch_sizes = sizes
        self.max_batch = sizes[-1]
        self.device = device
        self.input_ids = torch.zeros(self.max_batch, dtype=torch.int64, device=device)
        self.positions = torch.zeros(self.max_batch, dtype=torch.int64, device=device)
        self.metadata = VarlenMetadata.decode_static(
            self.max_batch,
            max_blocks_per_seq,
            device,
            block_size=block_size,
            num_heads=model.num_heads,
            num_kv_heads=model.num_kv_heads,
            head_dim=c.head_dim,
            num_splits=1,  # one grid for every context length: no split-merge kernel
        )
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        t0 = time.perf_counter()
        free_before = torch.cuda.mem_get_info(device)[0]
        pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for b in reversed(sizes):  # largest first: the smaller ones reuse its memory
                self._graphs[b] = self._capture(b, pool)
        torch.cuda.synchronize(device)
        log.info(
            "captured %d CUDA graphs (decode batch sizes %s) in %.1f s, %d MiB",
            len(sizes),
            sizes,
            time.perf_counter() - t0,
            (free_before - torch.cuda.mem_get_info(device)[0]) // 2**20,
        )

    def _view(self, batch: int) -> VarlenMetadata:
        m = self.metadata
        return dataclasses.replace(
            m,
            query_start_loc=m.query_start_loc[: batch + 1],
            context_lens=m.context_lens[:batch],
            block_tables=m.block_tables[:batch],
            slot_mapping=m.slot_mapping[:batch],
        )

    def _capture(
        self, batch: int, pool: torch.cuda._POOL_HANDLE
    ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        metadata = self._view(batch)
        args = (self.input_ids[:batch], self.positions[:batch], metadata, self.kv_caches)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # compile the Triton kernels and settle the allocator
                self.model(*args)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            hidden = self.model(*args)
        return graph, hidden

    def batch_size_for(self, num_seqs: int) -> int | None:
        """The captured size that serves `num_seqs` decodes, or None (run eagerly)."""
        for b in self.batch_sizes:
            if b >= num_seqs:
                return b
        return None

    def run(
        self,
        input_ids: Sequence[int],
        positions: Sequence[int],
        block_tables: Sequence[Sequence[int]],
    ) -> torch.Tensor:
        """One decode step of ``n = len(input_ids)`` sequences through a graph.

        Args:
            input_ids: each sequence's last token, the one this step computes.
            positions: its position (the context length before this step).
            block_tables: each sequence's block ids (covering ``position + 1`` tokens).

        Returns:
            ``[n, H]`` final hidden states (a view of the graph's output buffer: use it before
            the next replay).

        Raises:
            ValueError: more sequences than the largest captured size, or a block table
                too short or a context wider than ``max_blocks_per_seq`` (from
                :meth:`VarlenMetadata.fill_decode`).
        """
        n = len(input_ids)
        batch = self.batch_size_for(n)
        if batch is None:
            raise ValueError(
                f"{n} decode sequences exceed the largest CUDA graph ({self.max_batch})"
            )
        pad = batch - n
        host = torch.tensor([*input_ids, *([0] * pad)], dtype=torch.int64)
        self.input_ids[:batch].copy_(host, non_blocking=True)
        host = torch.tensor([*positions, *([0] * pad)], dtype=torch.int64)
        self.positions[:batch].copy_(host, non_blocking=True)
        self.metadata.fill_decode([p + 1 for p in positions], block_tables)
        graph, hidden = self._graphs[batch]
        graph.replay()
        return hidden[:n]
