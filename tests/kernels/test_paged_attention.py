"""The torch paged attention against plain dense causal attention."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sluiceway.kernels.backend import AttentionBackend, TorchAttentionBackend
from sluiceway.kernels.paged_attention import (
    build_attention_metadata,
    key_blocks,
    kv_pool_shape,
    paged_attention,
    value_blocks,
    write_kv,
)
from tests.kernels.attention_oracle import dense_causal_attention

BLOCK = 4


def _run_case(
    seqs: list[tuple[int, int]],
    hq: int,
    hkv: int,
    d: int,
    seed: int,
    dtype: torch.dtype,
    backend: AttentionBackend | None = None,
    block_size: int = BLOCK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Paged (through `backend`, default the torch reference) vs dense for sequences given as
    (cached tokens, new tokens).

    The cached prefix is written in an earlier "step"; the chunk's K/V are written with the
    slot mapping the metadata builds, then attention runs over the pool.
    """
    backend = backend or TorchAttentionBackend()
    geometry = {"block_size": block_size, "num_heads": hq, "num_kv_heads": hkv, "head_dim": d}
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-(c + q) // block_size) for c, q in seqs) + 5
    # garbage around, NaN included: unwritten slots must never reach the output
    shape = kv_pool_shape(1, num_blocks, block_size, hkv, d)[1:]
    cache = torch.randn(shape, generator=gen).to(dtype)
    cache.view(-1)[::7] = float("nan")
    perm = torch.randperm(num_blocks, generator=gen).tolist()  # non-contiguous block ids
    tables, keys, values, queries = [], [], [], []
    for cached, new in seqs:
        total = cached + new
        nb = -(-total // block_size)
        tables.append([perm.pop() for _ in range(nb)])
        keys.append(torch.randn(total, hkv, d, generator=gen).to(dtype))
        values.append(torch.randn(total, hkv, d, generator=gen).to(dtype))
        queries.append(torch.randn(new, hq, d, generator=gen).to(dtype))
    # step 1: the cached prefixes
    pre = [(i, c) for i, (c, _) in enumerate(seqs) if c > 0]
    if pre:
        md0 = backend.build_metadata(
            [c for _, c in pre], [c for _, c in pre], [tables[i] for i, _ in pre],
            device="cpu", **geometry,
        )  # fmt: skip
        backend.write_kv(
            torch.cat([keys[i][:c] for i, c in pre]),
            torch.cat([values[i][:c] for i, c in pre]),
            cache,
            md0,
        )
    # step 2: the chunks
    md = backend.build_metadata(
        [q for _, q in seqs], [c + q for c, q in seqs], tables, device="cpu", **geometry
    )
    backend.write_kv(
        torch.cat([k[c:] for k, (c, _) in zip(keys, seqs, strict=True)]),
        torch.cat([v[c:] for v, (c, _) in zip(values, seqs, strict=True)]),
        cache,
        md,
    )
    out = backend.attention(torch.cat(queries), cache, md)
    ref = torch.cat(
        [dense_causal_attention(q, k, v) for q, k, v in zip(queries, keys, values, strict=True)]
    )
    return out, ref


@pytest.mark.parametrize(
    "seqs",
    [
        [(0, 7)],  # a whole prompt
        [(5, 1), (12, 1), (3, 1)],  # decode only
        [(9, 1), (0, 6), (4, 1), (8, 5), (1, 1)],  # mixed, decodes not contiguous
        [(0, 1)],  # a one-token prompt
        [(16, 4), (15, 1), (0, 16)],  # block boundaries
    ],
)
@pytest.mark.parametrize(("hq", "hkv"), [(4, 4), (6, 2), (8, 1)])
def test_matches_dense(seqs: list[tuple[int, int]], hq: int, hkv: int) -> None:
    out, ref = _run_case(
        seqs, hq, hkv, 16, seed=hash((tuple(seqs), hq)) % 1000, dtype=torch.float32
    )
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@settings(max_examples=40, deadline=None)
@given(
    seqs=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 12)), min_size=1, max_size=6),
    heads=st.sampled_from([(2, 1), (4, 2), (3, 3), (9, 3)]),
    seed=st.integers(0, 2**16),
)
def test_matches_dense_random(
    seqs: list[tuple[int, int]], heads: tuple[int, int], seed: int
) -> None:
    out, ref = _run_case(seqs, heads[0], heads[1], 8, seed=seed, dtype=torch.float32)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_bfloat16_close() -> None:
    out, ref = _run_case([(20, 1), (0, 9), (7, 3), (33, 1)], 6, 2, 32, seed=3, dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), ref, atol=3e-2, rtol=3e-2)


def test_slot_mapping_and_tables() -> None:
    md = build_attention_metadata(
        [2, 1], [5, 3], [[7, 2], [4]], block_size=4, num_heads=2, num_kv_heads=1, head_dim=8
    )
    # seq 0 positions 3, 4 -> block 7 offset 3, block 2 offset 0; seq 1 position 2 -> block 4
    assert md.slot_mapping.tolist() == [31, 8, 18]
    assert md.query_start_loc.tolist() == [0, 2, 3]
    assert md.context_lens.tolist() == [5, 3]
    assert md.block_tables.tolist() == [[7, 2], [4, 4]]
    assert [b.rows for b in md.decode_buckets] == [slice(2, 3)]
    assert md.decode_buckets[0].num_blocks == 1


def test_decode_buckets_minimize_padding_plus_overhead() -> None:
    from sluiceway.kernels.paged_attention import split_decode_buckets

    # Padding 1 with 70 to one bucket costs 2 * 70 + 128 = 268; two buckets 1 + 70 + 256 = 327.
    assert split_decode_buckets([70, 1]) == [[0, 1]]
    # Twenty short and twenty long: one bucket 40 * 70 + 128 = 2928; two 20 + 1400 + 256 = 1676.
    lens = [1, 70] * 20
    assert split_decode_buckets(lens) == [list(range(0, 40, 2)), list(range(1, 40, 2))]
    assert split_decode_buckets(lens, overhead_blocks=10_000) == [list(range(40))]
    assert split_decode_buckets([3, 3, 3]) == [[0, 1, 2]]
    assert split_decode_buckets([]) == []


def test_decode_buckets_rows_and_results() -> None:
    """Decode sequences split into two buckets, interleaved with a prefill chunk."""
    torch.manual_seed(0)
    bs, hq, hkv, d = 4, 4, 2, 8
    query_lens = [1, 3, 1, 1]  # rows 0, 1-3, 4, 5
    context_lens = [2, 3, 1200, 1198]  # decode: 1, 300 and 300 blocks
    tables = [[0], [1], list(range(2, 302)), list(range(302, 602))]
    md = build_attention_metadata(
        query_lens, context_lens, tables, block_size=bs, num_heads=hq, num_kv_heads=hkv,
        head_dim=d, device="cpu",
    )  # fmt: skip
    # one bucket: 3 * 300 + 128 = 1028 padded blocks; two: 1 + 128 + 2 * 300 + 128 = 857
    assert [b.num_blocks for b in md.decode_buckets] == [1, 300]
    assert md.decode_buckets[0].rows == slice(0, 1)
    assert md.decode_buckets[1].rows == slice(4, 6)
    cache = torch.randn(2, 602, hkv, bs * d, dtype=torch.float64)
    query = torch.randn(6, hq, d, dtype=torch.float64)
    out = paged_attention(query, cache, md)
    keys = key_blocks(cache, d).permute(0, 3, 1, 2).reshape(-1, hkv, d)  # [slot, Hkv, D]
    values = value_blocks(cache, d).transpose(1, 2).reshape(-1, hkv, d)
    row = 0
    for q_len, c, table in zip(query_lens, context_lens, tables, strict=True):
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(c)])
        ref = dense_causal_attention(query[row : row + q_len], keys[slots], values[slots])
        torch.testing.assert_close(out[row : row + q_len], ref)
        row += q_len


def test_bad_block_table_rejected() -> None:
    with pytest.raises(ValueError, match="cannot hold"):
        build_attention_metadata(
            [1], [9], [[0, 1]], block_size=4, num_heads=2, num_kv_heads=1, head_dim=8
        )


def test_layout_key_transposed_value_plain() -> None:
    """K sits transposed ([D, block_size]) and V as is ([block_size, D]) in each (block, head)."""
    cache = torch.zeros(kv_pool_shape(1, 3, 4, 2, 8)[1:])
    key = torch.arange(2 * 8, dtype=torch.float32).view(1, 2, 8)
    write_kv(key, key + 100, cache, torch.tensor([2 * 4 + 1]))  # block 2, offset 1
    k = cache[0, 2].view(2, 8, 4)  # [Hkv, D, block_size]
    v = cache[1, 2].view(2, 4, 8)  # [Hkv, block_size, D]
    assert torch.equal(k[:, :, 1], key[0])
    assert torch.equal(v[:, 1, :], key[0] + 100)
    assert torch.equal(key_blocks(cache, 8)[2, :, :, 1], key[0])
    assert cache.count_nonzero() == 2 * 2 * 8 - 1  # nothing else written (one element is 0)
