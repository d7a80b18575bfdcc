"""The Triton kernels over an int8 KV cache (kernels/kv_quant.py): the KV write's bits against
the torch reference's, the unified attention against the reference's int8 attention, and a
row's bits alone and in a batch. Without CUDA they run in Triton's interpreter
(``TRITON_INTERPRET=1``, set by tests/conftest.py), float32 only and on small shapes."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from sluiceway.kernels.paged_attention import (
    build_attention_metadata,
    kv_pool_shape,
    paged_attention,
    write_kv,
)
from sluiceway.kernels.triton_kv_write import triton_write_kv
from sluiceway.kernels.triton_unified_attention import triton_unified_attention

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
HQ, HKV, D, BS = 4, 2, 16, 4


def _cache(num_blocks: int) -> torch.Tensor:
    """One layer's int8 cache full of 0xFF: NaN scales wherever nothing was written."""
    shape = kv_pool_shape(1, num_blocks, BS, HKV, D, torch.int8)[1:]
    return torch.full(shape, -1, dtype=torch.int8, device=DEVICE)


def test_triton_write_is_bitwise_the_reference_quantization() -> None:
    """Values and scales of every written token equal :func:`write_kv`'s (the torch rule:
    round half to even, ties included); a ``-1`` slot writes nothing."""
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(7, HKV, D, generator=gen)
    k[0, 0] = torch.tensor([127.0, 2.5, 3.5, -2.5] + [0.5] * 12)  # ties at scale 1
    k[1, 1] = 0.0  # a zero row: scale 0, values 0
    v = torch.randn(7, HKV, D, generator=gen)
    slots = torch.tensor([0, 5, 6, -1, 11, 12, 3])
    ref = _cache(4)
    keep = slots >= 0
    write_kv(k[keep].to(DEVICE), v[keep].to(DEVICE), ref, slots[keep].to(DEVICE))
    out = _cache(4)
    triton_write_kv(k.to(DEVICE), v.to(DEVICE), out, slots.to(DEVICE))
    assert torch.equal(out, ref)


def _step(
    lengths: list[int], query_lens: list[int], seed: int
) -> tuple[torch.Tensor, list[list[int]], torch.Tensor]:
    """An int8 cache holding sequences of ``lengths`` in shuffled blocks, their tables and
    queries for the last ``query_lens`` positions of each."""
    gen = torch.Generator().manual_seed(seed)
    used = [-(-n // BS) for n in lengths]
    perm = torch.randperm(sum(used) + 2, generator=gen).tolist()
    tables, at = [], 0
    for u in used:
        tables.append(perm[at : at + u])
        at += u
    cache = _cache(sum(used) + 2)
    for n, table in zip(lengths, tables, strict=True):
        slots = torch.tensor([table[p // BS] * BS + p % BS for p in range(n)], device=DEVICE)
        k = (torch.randn(n, HKV, D, generator=gen) * 2).to(DEVICE)
        write_kv(k, torch.randn(n, HKV, D, generator=gen).to(DEVICE), cache, slots)
    q = torch.randn(sum(query_lens), HQ, D, generator=gen).to(DEVICE)
    return cache, tables, q


def _unified(q, cache, query_lens, lengths, tables, **kw):  # type: ignore[no-untyped-def]
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [t[0]] * (width - len(t)) for t in tables], dtype=torch.int32)
    return triton_unified_attention(
        q, cache, bt.to(DEVICE), qsl.to(DEVICE),
        torch.tensor(lengths, dtype=torch.int32, device=DEVICE),
        block_size=BS, max_context_len=max(lengths), **kw,
    )  # fmt: skip


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("window", [None, 7])
def test_unified_attention_over_int8_matches_the_reference(split: bool, window: int | None) -> None:
    """Decodes and a chunk over a cached prefix, against the reference (dequantize, float32
    SDPA) to 1e-3 (the float32 tolerance of the other Triton tests), split over segments of 8
    keys or not, with and without a window."""
    lengths, query_lens = [9, 21, 13], [1, 6, 1]
    cache, tables, q = _step(lengths, query_lens, seed=1)
    md = build_attention_metadata(query_lens, lengths, tables, block_size=BS, num_heads=HQ,
                                  num_kv_heads=HKV, head_dim=D, device=DEVICE)  # fmt: skip
    ref = paged_attention(q, cache, md, sliding_window=window)
    split_kw = {"split": True, "segment": 8} if split and max(query_lens) == 1 else {}
    out = _unified(q, cache, query_lens, lengths, tables, sliding_window=window, **split_kw)
    torch.testing.assert_close(out, ref, atol=1e-3, rtol=1e-3)
    if split:  # a pure decode step split over segments: the same bits as unsplit
        dq = q[[0, 7]]
        dl, dt = [lengths[0], lengths[2]], [tables[0], tables[2]]
        whole = _unified(dq, cache, [1, 1], dl, dt, sliding_window=window, segment=8)
        parts = _unified(dq, cache, [1, 1], dl, dt, sliding_window=window, segment=8, split=True)
        assert torch.equal(whole, parts)


def test_a_row_over_int8_is_bitwise_the_same_alone_and_in_a_batch() -> None:
    """The unified kernel over int8: a decode row alone, beside other decodes, and as the last
    row of its own prefill chunk, bitwise."""
    lengths = [21, 9, 13]
    cache, tables, q = _step(lengths, [21, 1, 1], seed=2)
    alone = _unified(q[20:21], cache, [1], [21], tables[:1])
    batch = _unified(q[20:23], cache, [1, 1, 1], lengths, tables)
    chunk = _unified(q[:21], cache, [21], [21], tables[:1])
    assert torch.equal(batch[0], alone[0]) and torch.equal(chunk[-1], alone[0])
