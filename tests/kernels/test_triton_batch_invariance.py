"""The batch-invariant Triton kernels: the unified attention, the fixed-tile matmul and the
per-row RMSNorm, each against the torch reference (with a tolerance) and for bitwise
invariance (no tolerance): a row's result alone, in batches of 7 and 33 (and 70, across a
tile), a token's attention as a decode, inside prefill chunks, after a prefix-cache hit, with
and without the segment split.

On CUDA they run on the GPU (``scripts/gpu_check.sh``); without it in Triton's interpreter
(``TRITON_INTERPRET=1``, set by ``tests/conftest.py``) on small shapes. The interpreter rounds
float32 -> bfloat16 by truncation (a GPU rounds to nearest even), hence bfloat16 tolerances of
one bfloat16 ulp relative.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from sluiceway.kernels.paged_attention import (
    build_attention_metadata,
    kv_pool_shape,
    paged_attention,
)
from sluiceway.kernels.triton_backend import TritonAttentionBackend
from sluiceway.kernels.triton_matmul import triton_linear
from sluiceway.kernels.triton_norm import triton_fused_add_rms_norm, triton_rms_norm
from sluiceway.kernels.triton_unified_attention import triton_unified_attention
from sluiceway.kernels.varlen_metadata import build_varlen_metadata

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
BF16_REL = 2.0**-7  # one bfloat16 ulp, relative: truncation in the interpreter


def _randn(*shape: int, seed: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device=DEVICE, dtype=dtype)


# -- matmul -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("out_dtype", "bias"), [(None, False), (None, True), (torch.float32, False)], ids=str
)
def test_matmul_matches_reference(out_dtype: torch.dtype | None, bias: bool) -> None:
    x, w = _randn(70, 200, seed=0), _randn(130, 200, seed=1)
    b = _randn(130, seed=2) if bias else None
    out = triton_linear(x, w, b, out_dtype=out_dtype)
    ref = x.float() @ w.float().T + (b.float() if b is not None else 0.0)
    assert out.shape == (70, 130) and out.dtype == (out_dtype or torch.bfloat16)
    if out_dtype == torch.float32:  # float32 sums of exact products: only the order differs
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4)
    else:
        err = (out.float() - ref).abs()
        assert bool((err <= BF16_REL * ref.abs() + 1e-3).all()), float(err.max())


def test_matmul_float32_inputs_and_empty_shapes() -> None:
    x, w = _randn(5, 40, seed=3, dtype=torch.float32), _randn(24, 40, seed=4, dtype=torch.float32)
    torch.testing.assert_close(triton_linear(x, w), x @ w.T, rtol=1e-5, atol=1e-5)
    assert triton_linear(x[:0], w).shape == (0, 24)
    b = _randn(24, seed=5, dtype=torch.float32)
    assert torch.equal(triton_linear(x[:, :0], w[:, :0], b), b.expand(5, 24))


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (((3, 8), (4, 9), None), "do not match"),
        (((3, 8), (4, 8), (5,)), "bias"),
    ],
)
def test_matmul_errors(args: tuple, match: str) -> None:
    xs, ws, bs = args
    x, w = torch.zeros(xs, dtype=torch.bfloat16), torch.zeros(ws, dtype=torch.bfloat16)
    b = torch.zeros(bs, dtype=torch.bfloat16) if bs else None
    with pytest.raises(ValueError, match=match):
        triton_linear(x.to(DEVICE), w.to(DEVICE), None if b is None else b.to(DEVICE))
    with pytest.raises(ValueError, match="differ"):
        triton_linear(torch.zeros(2, 8, device=DEVICE), torch.zeros(3, 8, device=DEVICE).half())


@pytest.mark.parametrize("out_dtype", [None, torch.float32], ids=str)
def test_matmul_rows_do_not_depend_on_m(out_dtype: torch.dtype | None) -> None:
    """Row i of x @ w.T is bitwise the same computed in batches of 1, 7, 33 and 70 rows, at
    any offset in the batch, across the 64-row tile (K 300: five K blocks, one partial; N
    100: two column tiles)."""
    x, w, b = _randn(80, 300, seed=6), _randn(100, 300, seed=7), _randn(100, seed=8)
    full = triton_linear(x, w, b, out_dtype=out_dtype)
    for m in (1, 7, 33, 70):
        for start in (0, 3, 80 - m):
            part = triton_linear(x[start : start + m], w, b, out_dtype=out_dtype)
            assert torch.equal(part, full[start : start + m]), (m, start)


# -- RMSNorm ------------------------------------------------------------------------------


def test_rms_norm_matches_reference_and_rows_are_independent() -> None:
    x, w = _randn(33, 96, seed=9) * 3, _randn(96, seed=10)
    out = triton_rms_norm(x, w, 1e-5)
    ref = torch.nn.functional.rms_norm(x.float(), (96,), w.float(), 1e-5)
    err = (out.float() - ref).abs()
    assert bool((err <= BF16_REL * ref.abs() + 1e-3).all()), float(err.max())
    for m in (1, 7):
        assert torch.equal(triton_rms_norm(x[5 : 5 + m], w, 1e-5), out[5 : 5 + m])


def test_fused_add_rms_norm_in_place() -> None:
    hidden, residual, w = _randn(7, 96, seed=11), _randn(7, 96, seed=12), _randn(96, seed=13)
    want_sum = (hidden.float() + residual.float()).to(torch.bfloat16)
    want = torch.nn.functional.rms_norm(want_sum.float(), (96,), w.float(), 1e-6)
    h, r = hidden.clone(), residual.clone()
    triton_fused_add_rms_norm(h, r, w, 1e-6)
    # the residual stream: one rounding of the float32 sum (truncated in the interpreter)
    assert bool(((r.float() - want_sum.float()).abs() <= BF16_REL * want_sum.float().abs()).all())
    err = (h.float() - want).abs()
    assert bool((err <= 2 * BF16_REL * want.abs() + 1e-3).all()), float(err.max())
    h1, r1 = hidden[2:3].clone(), residual[2:3].clone()
    triton_fused_add_rms_norm(h1, r1, w, 1e-6)
    assert torch.equal(h1, h[2:3]) and torch.equal(r1, r[2:3])
    with pytest.raises(ValueError, match="differ"):
        triton_fused_add_rms_norm(h, r[:3], w, 1e-6)
    with pytest.raises(ValueError, match="contiguous rows"):
        triton_rms_norm(h.t(), w, 1e-6)


# -- attention ----------------------------------------------------------------------------

HQ, HKV, D, BLOCK = 4, 2, 16, 4


class Pool:
    """One layer's KV cache with shuffled blocks and one fixed K/V stream per sequence: token
    ``p`` of sequence ``s`` always gets the same K/V, whichever step writes it."""

    def __init__(self, num_blocks: int, dtype: torch.dtype, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.cache = torch.full(kv_pool_shape(1, num_blocks, BLOCK, HKV, D)[1:], float("nan"))
        self.cache = self.cache.to(device=DEVICE, dtype=dtype)
        self.free = torch.randperm(num_blocks, generator=g).tolist()
        self.dtype = dtype
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.queries: dict[int, torch.Tensor] = {}

    def stream(self, s: int, n: int) -> None:
        g = torch.Generator().manual_seed(1000 + s)
        for store in (self.keys, self.values, self.queries):
            heads = HQ if store is self.queries else HKV
            store[s] = torch.randn(n, heads, D, generator=g).to(device=DEVICE, dtype=self.dtype)

    def table(self, tokens: int) -> list[int]:
        return [self.free.pop() for _ in range(-(-tokens // BLOCK))]


def _step(
    pool: Pool,
    chunks: list[tuple[int, list[int], int, int]],
    *,
    split: bool = False,
    segment: int | None = None,
) -> list[torch.Tensor]:
    """Write the chunks' K/V (sequence id, block table, computed, new) and run the unified
    attention over them in one step; returns each chunk's ``[new, Hq, D]`` output."""
    query_lens = [n for *_, n in chunks]
    context_lens = [c + n for *_, c, n in chunks]
    md = build_varlen_metadata(
        query_lens, context_lens, [t for _, t, *_ in chunks], block_size=BLOCK,
        num_heads=HQ, num_kv_heads=HKV, head_dim=D, device=DEVICE,
    )  # fmt: skip
    key = torch.cat([pool.keys[s][c : c + n] for s, _, c, n in chunks])
    value = torch.cat([pool.values[s][c : c + n] for s, _, c, n in chunks])
    query = torch.cat([pool.queries[s][c : c + n] for s, _, c, n in chunks])
    TritonAttentionBackend(batch_invariant=True).write_kv(key, value, pool.cache, md)
    kw = {} if segment is None else {"segment": segment}
    out = triton_unified_attention(
        query, pool.cache, md.block_tables, md.query_start_loc, md.context_lens,
        block_size=BLOCK, max_context_len=md.max_context_len, split=split, **kw,
    )  # fmt: skip
    return list(out.split(query_lens))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("split", [False, True], ids=["loop", "split"])
def test_unified_attention_matches_reference(dtype: torch.dtype, split: bool) -> None:
    """A mixed step (decodes, a fresh prompt, a chunk over a cached prefix) against the torch
    reference, with segments of 8 keys so contexts span several of them."""
    pool = Pool(40, dtype)
    seqs = [(0, 9, 1), (1, 0, 13), (2, 20, 1), (3, 11, 6), (4, 1, 1)]  # (id, cached, new)
    tables = {s: pool.table(c + n) for s, c, n in seqs}
    for s, c, n in seqs:
        pool.stream(s, c + n)
    if any(c for _, c, _ in seqs):
        _step(pool, [(s, tables[s], 0, c) for s, c, _ in seqs if c])
    chunks = [(s, tables[s], c, n) for s, c, n in seqs]
    got = _step(pool, chunks, split=split, segment=8)
    md = build_attention_metadata(
        [n for *_, n in seqs], [c + n for _, c, n in seqs], [tables[s] for s, *_ in seqs],
        block_size=BLOCK, num_heads=HQ, num_kv_heads=HKV, head_dim=D, device=DEVICE,
    )  # fmt: skip
    query = torch.cat([pool.queries[s][c : c + n] for s, c, n in seqs])
    ref = paged_attention(query.float(), pool.cache.float(), md)
    err = float((torch.cat(got).float() - ref).abs().max())
    assert err <= (1e-3 if dtype == torch.float32 else 2e-2), err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_tokens_attention_is_bitwise_the_same_however_it_is_computed(
    dtype: torch.dtype,
) -> None:
    """Sequence 0 (22 tokens, segments of 8 keys) computed: as one prefill chunk alone; in
    chunks of 5 + 11 + 6 beside other sequences' prefills and decodes; as decode steps (all
    22, and the last 9 after a 13-token chunk with the segment split); and as a prefix-cache
    hit (its first 16 tokens' blocks written by another sequence, then a 6-token chunk).
    Every token's output: the same bits."""
    n, seg = 22, 8
    pool = Pool(200, dtype)
    for s in range(10):
        pool.stream(s, n)
    pool.stream(99, 80)
    # the shared prefix: sequences 0, 4, 5 and 6 have the same token stream
    for s in (4, 5, 6):
        pool.keys[s], pool.values[s], pool.queries[s] = (
            pool.keys[0],
            pool.values[0],
            pool.queries[0],
        )

    alone = torch.cat(_step(pool, [(0, pool.table(n), 0, n)], segment=seg))

    # chunked 5 + 11 + 14, each step beside a decode of another sequence and a prefill
    t4 = pool.table(n)
    other = pool.table(80)
    _step(pool, [(99, other, 0, 17)], segment=seg)
    parts = []
    done_other = 17
    for c, m in ((0, 5), (5, 11), (16, 6)):
        extra = (1 + c % 3, pool.table(m + 3), 0, m + 3)
        out = _step(pool, [(99, other, done_other, 1), extra, (4, t4, c, m)], segment=seg)
        done_other += 1
        parts.append(out[2])
    assert torch.equal(torch.cat(parts), alone)

    # one token at a time (decodes), beside another decode, loop and split
    for s, split, first in ((5, False, 0), (6, True, 13)):
        table = pool.table(n)
        rows = _step(pool, [(s, table, 0, first)], segment=seg) if first else []
        for p in range(first, n):
            step = [(s, table, p, 1)]
            if p % 2:
                step.insert(0, (99, other, done_other, 1))
                done_other += 1
            rows.append(_step(pool, step, split=split, segment=seg)[-1])
        assert torch.equal(torch.cat(rows), alone), split

    # a prefix-cache hit: sequence 7 (the same tokens) reuses the 4 full blocks (16 tokens)
    # sequence 4 wrote in the chunked steps, and computes the other 6 beside a prefill
    pool.keys[7], pool.values[7], pool.queries[7] = pool.keys[0], pool.values[0], pool.queries[0]
    hit = t4[:4] + pool.table(n - 16)
    tail = _step(pool, [(8, pool.table(9), 0, 9), (7, hit, 16, n - 16)], segment=seg)[1]
    assert torch.equal(tail, alone[16:])


def test_backend_switch_selects_the_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """SLUICEWAY_BATCH_INVARIANT picks the backend's default; the old decode/prefill kernels
    still match the reference behind it."""
    monkeypatch.setenv("SLUICEWAY_BATCH_INVARIANT", "0")
    assert not TritonAttentionBackend().batch_invariant
    monkeypatch.setenv("SLUICEWAY_BATCH_INVARIANT", "1")
    assert TritonAttentionBackend().batch_invariant
    monkeypatch.setenv("SLUICEWAY_BATCH_INVARIANT", "maybe")
    with pytest.raises(ValueError, match="SLUICEWAY_BATCH_INVARIANT"):
        TritonAttentionBackend()
    monkeypatch.delenv("SLUICEWAY_BATCH_INVARIANT")
    assert TritonAttentionBackend().batch_invariant

    pool = Pool(20, torch.float32)
    seqs = [(0, 6, 3), (1, 9, 1)]
    tables = {s: pool.table(c + n) for s, c, n in seqs}
    for s, c, n in seqs:
        pool.stream(s, c + n)
    _step(pool, [(s, tables[s], 0, c + n) for s, c, n in seqs])  # every token's K/V
    query_lens, context_lens = [n for *_, n in seqs], [c + n for _, c, n in seqs]
    geometry = {"block_size": BLOCK, "num_heads": HQ, "num_kv_heads": HKV, "head_dim": D}
    for step in ([0, 1], [1]):  # mixed, then a pure decode
        ql = [query_lens[i] for i in step]
        cl = [context_lens[i] for i in step]
        tb = [tables[i] for i in step]
        query = torch.cat([pool.queries[i][seqs[i][1] : context_lens[i]] for i in step])
        old = TritonAttentionBackend(batch_invariant=False)
        md = old.build_metadata(ql, cl, tb, device=DEVICE, **geometry)
        ref_md = build_attention_metadata(ql, cl, tb, device=DEVICE, **geometry)
        ref = paged_attention(query, pool.cache, ref_md)
        assert float((old.attention(query, pool.cache, md) - ref).abs().max()) <= 1e-3
        new = TritonAttentionBackend(batch_invariant=True).attention(query, pool.cache, md)
        assert float((new - ref).abs().max()) <= 1e-3
