"""Sliding-window attention cases for the kernel tests: a dense masked oracle and a paged pool
whose blocks outside every window can be poisoned (the kernels must not read them)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from sluiceway.kernels.paged_attention import kv_pool_shape, write_kv
from sluiceway.kernels.varlen_metadata import VarlenMetadata

# (cached tokens, new tokens) per sequence: prefill chunks over a cached prefix, fresh prompts
# and decodes mixed, chunks spanning several 16-row tiles and several blocks
MIXED_STEP = [(40, 1), (0, 37), (20, 13), (70, 1), (3, 1), (33, 33)]
# 1: the token alone; 16/17: one block (of 16) and one more; 40; more than any context
WINDOWS = [1, 16, 17, 40, 1000]


def dense_window_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    sliding_window: int | None,
    scale: float | None = None,
) -> torch.Tensor:
    """Plain attention of one sequence in float32: the query at position ``p`` attends to keys
    ``p - W < k <= p`` (``W = sliding_window``; ``None``: ``k <= p``), as transformers'
    ``sliding_window_overlay``.

    Args:
        query: ``[Lq, Hq, D]``, the last ``Lq`` positions of the sequence.
        key, value: ``[L, Hkv, D]`` for all ``L >= Lq`` positions.
        sliding_window: the window ``W`` in tokens, or ``None``.
        scale: softmax scale; ``1 / sqrt(D)`` when ``None``.

    Returns:
        ``[Lq, Hq, D]`` float32.
    """
    lq, hq, d = query.shape
    length, hkv, _ = key.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    g = hq // hkv
    k = key.float().repeat_interleave(g, dim=1).transpose(0, 1)  # [Hq, L, D]
    v = value.float().repeat_interleave(g, dim=1).transpose(0, 1)
    q = query.float().transpose(0, 1)  # [Hq, Lq, D]
    scores = q @ k.transpose(-1, -2) * scale
    qpos = torch.arange(length - lq, length)[:, None]
    kpos = torch.arange(length)[None, :]
    hidden = kpos > qpos
    if sliding_window is not None:
        hidden |= kpos <= qpos - sliding_window
    scores = scores.masked_fill(hidden, float("-inf"))
    return (torch.softmax(scores, -1) @ v).transpose(0, 1)


@dataclass
class WindowCase:
    """One step over a paged pool: ``cache`` holds every sequence's K/V (the unused blocks
    NaN), ``query`` the step's rows, ``tables`` the block ids, ``keys``/``values`` the dense
    per-sequence K/V for the oracle."""

    seqs: list[tuple[int, int]]
    block_size: int
    cache: torch.Tensor
    query: torch.Tensor
    tables: list[list[int]]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    def metadata(self, backend: object, device: torch.device | str = "cpu") -> VarlenMetadata:
        """The step's metadata from ``backend.build_metadata``."""
        hq, d = self.query.shape[1:]
        return backend.build_metadata(  # type: ignore[attr-defined,no-any-return]
            [q for _, q in self.seqs], [c + q for c, q in self.seqs], self.tables,
            block_size=self.block_size, num_heads=hq, num_kv_heads=self.cache.shape[2],
            head_dim=d, device=device,
        )  # fmt: skip

    def oracle(self, sliding_window: int | None) -> torch.Tensor:
        """The dense float32 result of the step's rows, ``[T, Hq, D]``, on the CPU (where
        ``keys``/``values`` are, whatever device the query was moved to)."""
        starts = [0]
        for _, q in self.seqs:
            starts.append(starts[-1] + q)
        return torch.cat(
            [
                dense_window_attention(self.query[a:b].cpu(), k, v, sliding_window)
                for a, b, k, v in zip(starts, starts[1:], self.keys, self.values, strict=False)
            ]
        )

    def outside_windows(self, sliding_window: int) -> list[int]:
        """Block ids wholly before the window of every row of its sequence's chunk."""
        out = []
        for (cached, _), table in zip(self.seqs, self.tables, strict=True):
            first_needed = max(0, cached - sliding_window + 1) // self.block_size
            out.extend(table[:first_needed])
        return out

    def poisoned(self, sliding_window: int) -> torch.Tensor:
        """A copy of ``cache`` with NaN in every block of :meth:`outside_windows`."""
        cache = self.cache.clone()
        cache[:, self.outside_windows(sliding_window)] = float("nan")
        return cache


def make_case(
    seqs: list[tuple[int, int]],
    hq: int,
    hkv: int,
    d: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int,
    device: torch.device | str = "cpu",
) -> WindowCase:
    """Random K/V written through the slot mapping (non-contiguous block ids), NaN in the
    blocks no sequence owns, random queries."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-(c + q) // block_size) for c, q in seqs) + 3
    cache = torch.full(kv_pool_shape(1, num_blocks, block_size, hkv, d)[1:], float("nan"))
    cache = cache.to(device=device, dtype=dtype)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[perm.pop() for _ in range(-(-(c + q) // block_size))] for c, q in seqs]
    keys = [torch.randn(c + q, hkv, d, generator=gen).to(dtype) for c, q in seqs]
    values = [torch.randn(c + q, hkv, d, generator=gen).to(dtype) for c, q in seqs]
    query = torch.randn(sum(q for _, q in seqs), hq, d, generator=gen).to(dtype)
    slots = torch.tensor(
        [t[i // block_size] * block_size + i % block_size
         for (c, q), t in zip(seqs, tables, strict=True) for i in range(c + q)],
        dtype=torch.int64, device=device,
    )  # fmt: skip
    write_kv(torch.cat(keys).to(device), torch.cat(values).to(device), cache, slots)
    return WindowCase(seqs, block_size, cache, query.to(device), tables, keys, values)
