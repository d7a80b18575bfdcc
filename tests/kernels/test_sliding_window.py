"""Sliding-window paged attention against dense windowed attention in float64, with the blocks
wholly outside each sequence's window poisoned (NaN) to show they are never read."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sluiceway.kernels.backend import AttentionBackend, TorchAttentionBackend
from sluiceway.kernels.paged_attention import (
    build_attention_metadata,
    key_blocks,
    kv_pool_shape,
    value_blocks,
)

BLOCK = 4


def dense_window_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, window: int, scale: float
) -> torch.Tensor:
    """``query`` ``[Lq, Hq, D]`` (the last ``Lq`` positions), ``key``/``value`` ``[L, Hkv, D]``
    -> ``[Lq, Hq, D]`` float64: a query at ``p`` sees keys ``p - window < k <= p``."""
    lq, hq, _ = query.shape
    length, hkv, _ = key.shape
    g = hq // hkv
    k = key.double().repeat_interleave(g, dim=1).transpose(0, 1)
    v = value.double().repeat_interleave(g, dim=1).transpose(0, 1)
    scores = query.double().transpose(0, 1) @ k.transpose(-1, -2) * scale
    qpos = torch.arange(length - lq, length)[:, None]
    kpos = torch.arange(length)[None, :]
    scores = scores.masked_fill((kpos > qpos) | (kpos <= qpos - window), float("-inf"))
    return (torch.softmax(scores, -1) @ v).transpose(0, 1)


def run_window_case(
    seqs: list[tuple[int, int]],
    window: int,
    hq: int,
    hkv: int,
    d: int,
    seed: int,
    backend: AttentionBackend | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Paged attention with ``window`` through ``backend`` (default the torch reference) and
    the dense oracle, for sequences of (cached tokens, new tokens). Every block that ends
    before a sequence's first visible key (its first query's ``p - window + 1``) is filled
    with NaN after its K/V were written: reading it would poison the output."""
    backend = backend or TorchAttentionBackend()
    geometry = {"block_size": BLOCK, "num_heads": hq, "num_kv_heads": hkv, "head_dim": d}
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-(c + q) // BLOCK) for c, q in seqs) + 3
    cache = torch.randn(kv_pool_shape(1, num_blocks, BLOCK, hkv, d)[1:], generator=gen).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, keys, values, queries = [], [], [], []
    for cached, new in seqs:
        tables.append([perm.pop() for _ in range(-(-(cached + new) // BLOCK))])
        keys.append(torch.randn(cached + new, hkv, d, generator=gen).to(dtype))
        values.append(torch.randn(cached + new, hkv, d, generator=gen).to(dtype))
        queries.append(torch.randn(new, hq, d, generator=gen).to(dtype))
    md = backend.build_metadata(
        [q for _, q in seqs], [c + q for c, q in seqs], tables, device="cpu", **geometry
    )
    kb, vb = key_blocks(cache, d), value_blocks(cache, d)
    for (cached, new), table, k, v in zip(seqs, tables, keys, values, strict=True):
        for pos in range(cached + new):  # the whole sequence, as earlier steps would have
            block, off = table[pos // BLOCK], pos % BLOCK
            kb[block, :, :, off] = k[pos]
            vb[block, :, off] = v[pos]
        first_visible = max(0, cached - window + 1)
        for i in range(first_visible // BLOCK):  # wholly outside every row's window
            kb[table[i]] = float("nan")
            vb[table[i]] = float("nan")
    scale = 1.0 / math.sqrt(d)
    out = backend.attention(torch.cat(queries), cache, md, scale, sliding_window=window)
    ref = torch.cat(
        [
            dense_window_attention(q, k, v, window, scale)
            for q, k, v in zip(queries, keys, values, strict=True)
        ]
    )
    return out, ref


@pytest.mark.parametrize(
    "seqs",
    [
        [(0, 20)],  # a prompt longer than the window
        [(17, 1), (30, 1), (3, 1), (8, 1)],  # decodes, some past the window
        [(9, 1), (0, 14), (21, 6), (12, 1), (40, 9)],  # mixed: chunks that start past it
        [(16, 4), (15, 1), (0, 16), (7, 1)],  # block boundaries
    ],
)
@pytest.mark.parametrize("window", [1, 5, 8])
def test_window_matches_dense_and_skips_outside_blocks(
    seqs: list[tuple[int, int]], window: int
) -> None:
    out, ref = run_window_case(seqs, window, 4, 1, 16, seed=len(seqs) * 10 + window)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@settings(max_examples=30, deadline=None)
@given(
    seqs=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 12)), min_size=1, max_size=5),
    window=st.integers(1, 24),
    heads=st.sampled_from([(2, 1), (4, 2), (3, 3)]),
    seed=st.integers(0, 2**16),
)
def test_window_matches_dense_random(
    seqs: list[tuple[int, int]], window: int, heads: tuple[int, int], seed: int
) -> None:
    out, ref = run_window_case(seqs, window, heads[0], heads[1], 8, seed=seed)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_windowed_indices_are_built_once_per_window() -> None:
    md = build_attention_metadata(
        [1, 6], [30, 6], [list(range(8)), [8, 9]], block_size=4, num_heads=2, num_kv_heads=1,
        head_dim=8,
    )  # fmt: skip
    buckets, prefills = md.for_window(5)
    assert md.for_window(5)[0] is buckets
    # the decode at position 29 sees 25..29: blocks 6 and 7 only (24..31), not the six before
    assert [b.num_blocks for b in buckets] == [2]
    assert md.decode_buckets[0].num_blocks == 8  # the full layers' read all of them
    # the 6-token prompt: its last query (5) misses key 0, so it gets a mask, from block 0 on
    assert prefills[0].context_len == 6 and prefills[0].mask is not None
    assert md.for_window(None) == (md.decode_buckets, md.prefills)
    with pytest.raises(ValueError, match="sliding_window must be >= 1"):
        md.for_window(0)
