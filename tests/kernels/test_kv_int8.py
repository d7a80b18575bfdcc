"""The quantized KV caches (``--kv-cache-dtype int8|fp8_e4m3``, kernels/kv_quant.py): the
quantization rules' exact values, the C++ fused write bitwise equal to the torch reference's,
the C++ attention against the torch reference, quantized attention against float attention,
batch invariance of the C++ kernel, the pool's block count and a block copy carrying the
scales."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from sluiceway.kernels import cpu_ops
from sluiceway.kernels.cpu_backend import CpuAttentionBackend
from sluiceway.kernels.kv_quant import (
    dequantize_rows,
    kv_cache_torch_dtype,
    quantize_rows,
    split_blocks,
)
from sluiceway.kernels.paged_attention import (
    build_attention_metadata,
    kv_pool_shape,
    paged_attention,
    write_kv,
)
from sluiceway.worker.kv_pool import allocate_shared_kv_pool, copy_blocks, open_kv_pool
from sluiceway.worker.kv_sizing import count_kv_blocks, kv_bytes_per_block
from sluiceway.worker.model import _apply_rope
from sluiceway.worker.parallel import TensorParallelGroup

cpu_ops.load()
BACKEND = CpuAttentionBackend()


def test_quantize_rule_exact_values_and_round_trip_through_the_pool() -> None:
    """scale = amax / 127, q = round-half-even(x / scale): with amax 127 the scale is 1 and
    2.5 / 3.5 / -2.5 are ties (to 2, 4, -2); a zero row is all 0 with scale 0; a row's bits
    read back from the pool (values and scales) are those the rule gives."""
    x = torch.tensor([[127.0, 2.5, 3.5, -2.5, 0.4, -127.0, 0.6, 1.5], [0.0] * 8])
    q, scale = quantize_rows(x)
    assert q.tolist() == [[127, 2, 4, -2, 0, -127, 1, 2], [0] * 8]
    assert scale.tolist() == [1.0, 0.0]
    assert torch.equal(dequantize_rows(q, scale), q.float() * scale[:, None])
    y = torch.tensor([[0.5, -1.0, 0.25, 0.1]])  # amax 1: scale 1/127 in float32
    qy, sy = quantize_rows(y)
    s = torch.tensor(1.0) / 127.0
    assert sy.item() == s.item()
    assert qy.tolist() == [[round(0.5 / s.item()), -127, round(0.25 / s.item()), 13]]

    hkv, d, bs = 2, 8, 4
    cache = torch.zeros(kv_pool_shape(1, 3, bs, hkv, d, torch.int8)[1:], dtype=torch.int8)
    k, v = torch.randn(5, hkv, d), torch.randn(5, hkv, d)
    slots = torch.tensor([1, 4, 6, 11, 0])
    write_kv(k, v, cache, slots)
    keys, values, key_scales, value_scales = split_blocks(cache, d)
    kq, ks = quantize_rows(k)
    vq, vs = quantize_rows(v)
    for i, slot in enumerate(slots.tolist()):
        b, o = divmod(slot, bs)
        assert torch.equal(keys[b, :, :, o], kq[i]) and torch.equal(values[b, :, o], vq[i])
        assert torch.equal(key_scales[b, :, o], ks[i]) and torch.equal(value_scales[b, :, o], vs[i])


def test_fp8_rule_exact_values() -> None:
    """fp8_e4m3: scale = amax / 448 (448 -> scale 1), then torch's cast, round to nearest
    even: 1.0625 (halfway between 1 and 1.125) -> 1, 1.1875 (between 1.125 and 1.25) -> 1.25,
    -3.25 exact; a zero row: scale 0, zeros."""
    x = torch.tensor([[448.0, 1.0625, 1.1875, -3.25], [0.0] * 4])
    q, scale = quantize_rows(x, torch.float8_e4m3fn)
    assert q.dtype == torch.float8_e4m3fn and scale.tolist() == [1.0, 0.0]
    assert q.float().tolist() == [[448.0, 1.0, 1.25, -3.25], [0.0] * 4]


@pytest.mark.parametrize("kv", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_rope_write_is_bitwise_the_reference_quantization(
    dtype: torch.dtype, kv: torch.dtype
) -> None:
    """The C++ RoPE + KV write into an int8 (fp8) cache writes the bits of the torch
    reference's :func:`write_kv` of the same (rotated, rounded) K and of V, scales included,
    and nothing for a ``-1`` slot; ties round to even."""
    torch.manual_seed(2)
    hq, hkv, d, bs, t = 9, 3, 64, 16, 11
    qkv = torch.randn(t, 1024)[:, : (hq + 2 * hkv) * d].to(dtype)
    positions = torch.tensor([0, 1, 5, 17, 300, 301, 302, 40, 41, 42, 99])
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.arange(512).float()[:, None] * inv[None]
    cos, sin = freqs.cos(), freqs.sin()
    slots = torch.tensor([3, 4, 20, 21, 22, 50, 51, 52, -1, 60, 79])
    cache = torch.zeros(kv_pool_shape(1, 5, bs, hkv, d, kv)[1:], dtype=kv)
    ref_cache = cache.clone()
    # position 0 rotates by the identity: ties at scale 1 (int8: 2.5 -> 2, 3.5 -> 4, -2.5 ->
    # -2; fp8: 1.0625 -> 1, 1.1875 -> 1.25) in its first K and V heads, a zero V head
    pattern = [127.0, 2.5, 3.5, -2.5] if kv == torch.int8 else [448.0, 1.0625, 1.1875, -3.25]
    ties = torch.tensor(pattern * (d // 4))
    qkv[0, hq * d : (hq + 1) * d] = ties.to(dtype)
    qkv[0, (hq + hkv) * d : (hq + hkv + 1) * d] = ties.to(dtype)
    qkv[0, (hq + hkv + 1) * d : (hq + hkv + 2) * d] = 0.0
    out = qkv.clone()
    cpu_ops.rotary_embedding_write_kv(out, positions, cos, sin, cache, slots, hq, hkv)
    ref_qk = _apply_rope(
        qkv[:, : (hq + hkv) * d].float().view(t, hq + hkv, d),
        cos[positions].unsqueeze(1),
        sin[positions].unsqueeze(1),
    ).to(dtype)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.02, "rtol": 0.02}
    torch.testing.assert_close(out[:, : (hq + hkv) * d].view(t, hq + hkv, d), ref_qk, **tol)
    keep = slots >= 0
    k = out[:, hq * d : (hq + hkv) * d].reshape(t, hkv, d)  # the kernel's rotated K
    v = out[:, (hq + hkv) * d :].reshape(t, hkv, d)
    write_kv(k[keep], v[keep], ref_cache, slots[keep])
    assert torch.equal(cache.view(torch.uint8), ref_cache.view(torch.uint8))
    keys, values, key_scales, value_scales = split_blocks(cache, d)
    expect = [127, 2, 4, -2] if kv == torch.int8 else [448.0, 1.0, 1.25, -3.25]
    assert keys[0, 0, :4, 3].float().tolist() == expect and key_scales[0, 0, 3].item() == 1.0
    assert values[0, 1, 3].float().count_nonzero() == 0 and value_scales[0, 1, 3].item() == 0.0


def _int8_pool(lengths, hkv, d, bs, dtype, seed, kv=torch.int8):  # type: ignore[no-untyped-def]
    """An int8 (``kv``) cache and a float one (``dtype``) holding the same random K/V of
    sequences of ``lengths`` in shuffled blocks; every unowned byte is 0xFF (NaN scales, -1
    int8 values or fp8 NaNs)."""
    gen = torch.Generator().manual_seed(seed)
    used = [-(-n // bs) for n in lengths]
    nb = sum(used) + 3
    perm = torch.randperm(nb, generator=gen).tolist()
    tables, at = [], 0
    for u in used:
        tables.append(perm[at : at + u])
        at += u
    shape = kv_pool_shape(1, nb, bs, hkv, d, kv)[1:]
    cache = torch.full(shape, -1, dtype=torch.int8).view(kv)
    fcache = torch.full(kv_pool_shape(1, nb, bs, hkv, d)[1:], float("nan"), dtype=dtype)
    for n, table in zip(lengths, tables, strict=True):
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(n)])
        k = (torch.randn(n, hkv, d, generator=gen) * 2).to(dtype)
        v = torch.randn(n, hkv, d, generator=gen).to(dtype)
        write_kv(k, v, cache, slots)
        write_kv(k, v, fcache, slots)
    return cache, fcache, tables


CASES = [
    ([1, 1, 1], [37, 90, 5]),  # decodes
    ([7], [7]),  # a whole prompt
    ([1, 9, 1, 33], [16, 40, 17, 64]),  # mixed, block boundaries, a chunk over a prefix
]


@pytest.mark.parametrize(("query_lens", "context_lens"), CASES)
@pytest.mark.parametrize(("hq", "hkv", "d", "bs"), [(9, 3, 64, 16), (4, 1, 256, 16),
                                                    (6, 2, 80, 4)])  # fmt: skip
@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("kv", [torch.int8, torch.float8_e4m3fn])
def test_cpp_int8_attention_matches_the_reference(
    query_lens: list[int], context_lens: list[int], hq: int, hkv: int, d: int, bs: int,
    window: int | None, kv: torch.dtype,
) -> None:  # fmt: skip
    """The C++ kernel (vectorized D = 64, 256; generic D = 80 with block 4) over an int8 cache
    against :func:`kernels.kv_quant.attention_quantized` (dequantize, SDPA): in float32 against
    SDPA in float64, to atol 4e-6, rtol 4e-5 (the kernel's exp is 2 ulp and it sums in its own
    order; measured up to 2.5e-6 on an Intel Xeon with AMX, where float32 SDPA itself is 4.5e-6
    off the float64 result, so a float32 oracle's error hangs on the CPU torch runs on); in
    bfloat16 against SDPA in float32 rounded to bfloat16, to one rounding."""
    for dtype, tol in ((torch.float32, 4e-6), (torch.bfloat16, 1e-2)):
        cache, _, tables = _int8_pool(context_lens, hkv, d, bs, dtype, seed=d + bs, kv=kv)
        q = torch.randn(sum(query_lens), hq, d, generator=torch.Generator().manual_seed(3))
        q = q.to(dtype)
        md = build_attention_metadata(query_lens, context_lens, tables, block_size=bs,
                                      num_heads=hq, num_kv_heads=hkv, head_dim=d)  # fmt: skip
        oracle_q = q.double() if dtype == torch.float32 else q
        ref = paged_attention(oracle_q, cache, md, sliding_window=window)
        vmd = BACKEND.build_metadata(query_lens, context_lens, tables, block_size=bs,
                                     num_heads=hq, num_kv_heads=hkv, head_dim=d,
                                     device="cpu")  # fmt: skip
        out = BACKEND.attention(q, cache, vmd, sliding_window=window)
        assert out.dtype == dtype and not out.isnan().any()
        torch.testing.assert_close(out.double(), ref.double(), atol=tol, rtol=10 * tol)


def test_int8_attention_is_close_to_float_attention() -> None:
    """int8 K/V (per-token scales) against the same K/V in float32 (K ~ N(0, 4), V ~ N(0, 1),
    9 heads on 3, contexts to 300; mean |out| 0.41, max 2.6): the largest difference of an
    output stays under 0.05 and the mean under 0.006 (measured 0.027 and 0.0036: about 1%
    of the mean output, the error of 8-bit values with a step of amax / 127)."""
    hq, hkv, d, bs = 9, 3, 64, 16
    lengths = [300, 37, 64, 1]
    cache, fcache, tables = _int8_pool(lengths, hkv, d, bs, torch.float32, seed=1)
    q = torch.randn(4, hq, d, generator=torch.Generator().manual_seed(2))
    md = BACKEND.build_metadata([1] * 4, lengths, tables, block_size=bs, num_heads=hq,
                                num_kv_heads=hkv, head_dim=d, device="cpu")  # fmt: skip
    diff = (BACKEND.attention(q, cache, md) - BACKEND.attention(q, fcache, md)).abs()
    assert diff.max().item() < 0.05 and diff.mean().item() < 0.006


def _attend(query, cache, query_lens, context_lens, tables, bs):  # type: ignore[no-untyped-def]
    md = BACKEND.build_metadata(query_lens, context_lens, tables, block_size=bs,
                                num_heads=query.shape[1], num_kv_heads=cache.shape[2],
                                head_dim=query.shape[2], device="cpu")  # fmt: skip
    return BACKEND.attention(query, cache, md)


@pytest.mark.parametrize("kv", [torch.int8, torch.float8_e4m3fn])
def test_a_row_is_bitwise_the_same_whatever_else_is_in_the_step(kv: torch.dtype) -> None:
    """Batch invariance of the C++ kernel over an int8 (fp8) cache in bfloat16: a decode row
    alone, in a batch, as the last row of its prefill and of a later chunk, bitwise."""
    hq, hkv, d, bs = 9, 3, 64, 16
    lengths = [200, 37, 64, 1]
    cache, _, tables = _int8_pool(lengths, hkv, d, bs, torch.bfloat16, seed=5, kv=kv)
    q = torch.randn(sum(lengths), hq, d, generator=torch.Generator().manual_seed(6))
    chunk = q[:200].to(torch.bfloat16)
    others = q[200:203].to(torch.bfloat16)
    alone = _attend(chunk[-1:], cache, [1], [200], tables[:1], bs)
    batch = torch.cat([others[:1], chunk[-1:], others[1:]])
    in_batch = _attend(batch, cache, [1] * 4, [37, 200, 64, 1],
                       [tables[1], tables[0], tables[2], tables[3]], bs)  # fmt: skip
    as_prefill = _attend(chunk, cache, [200], [200], tables[:1], bs)
    as_chunks = _attend(chunk[150:], cache, [50], [200], tables[:1], bs)
    assert torch.equal(in_batch[1], alone[0])
    assert torch.equal(as_prefill[-1], alone[0])
    assert torch.equal(as_chunks, as_prefill[150:])


def test_the_same_memory_holds_about_twice_the_blocks_of_bfloat16() -> None:
    """SmolLM2-135M's shapes (30 layers, 3 KV heads, D 64, block 16): a block is 368,640 bytes
    in bfloat16, 737,280 in float32 and 195,840 in int8 and fp8 (16 * 64 values + 16 * 4 scale
    bytes per layer, K|V and head); 96 MiB hold 273, 136 and 514 blocks (1.88x, 3.78x)."""
    config: Any = SimpleNamespace(num_layers=30, head_dim=64)  # what the sizing reads
    sizes = {
        name: kv_bytes_per_block(config, 3, 16, kv_cache_torch_dtype(name, model_dtype))
        for name, model_dtype in (
            ("auto", torch.bfloat16),
            ("int8", torch.bfloat16),
            ("fp8_e4m3", torch.bfloat16),
        )
    }
    sizes["float32"] = kv_bytes_per_block(config, 3, 16, torch.float32)
    assert sizes == {"auto": 368_640, "int8": 195_840, "fp8_e4m3": 195_840, "float32": 737_280}
    tp = TensorParallelGroup()
    blocks = {name: count_kv_blocks(96 << 20, size, tp) for name, size in sizes.items()}
    assert blocks == {"auto": 273, "int8": 514, "fp8_e4m3": 514, "float32": 136}
    shape = kv_pool_shape(30, 514, 16, 3, 64, torch.int8)
    assert math.prod(shape) == 514 * 195_840 and shape[-1] == 16 * 68
    with pytest.raises(ValueError, match="multiple of 4"):
        kv_bytes_per_block(SimpleNamespace(num_layers=1, head_dim=3), 1, 1, torch.int8)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="kv-cache-dtype"):
        kv_cache_torch_dtype("fp4", torch.bfloat16)


@pytest.mark.parametrize(("kv", "name"), [(torch.int8, "int8"),
                                           (torch.float8_e4m3fn, "float8_e4m3fn")])  # fmt: skip
def test_a_block_copy_between_shared_pools_carries_the_scales(kv: torch.dtype, name: str) -> None:
    """A KV hand-off (disaggregated prefill, stream resume): blocks copied out of a peer's
    shared int8 (fp8) pool (opened from its handle, which names the dtype) into another pool
    at other ids give bitwise the same attention as the source."""
    hq, hkv, d, bs = 9, 3, 64, 16
    lengths = [45, 20]
    cache, _, tables = _int8_pool(lengths, hkv, d, bs, torch.bfloat16, seed=9, kv=kv)
    shape = (1, *cache.shape)
    source = allocate_shared_kv_pool(shape, kv, "cpu")
    dest = allocate_shared_kv_pool(shape, kv, "cpu")
    try:
        assert source.handle.dtype == name
        source.tensor.view(torch.uint8).copy_(cache[None].view(torch.uint8))
        dest.tensor.view(torch.uint8).fill_(255)
        peer = open_kv_pool(source.handle, "cpu")
        assert peer.dtype == kv and tuple(peer.shape) == shape
        src_ids = tables[0] + tables[1]
        dst_ids = list(reversed(range(len(src_ids))))
        moved = copy_blocks(peer, dest.tensor, src_ids, dst_ids)
        assert moved == len(src_ids) * 2 * hkv * bs * (d + 4)
        new_tables = [dst_ids[: len(tables[0])], dst_ids[len(tables[0]) :]]
        q = torch.randn(2, hq, d, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
        before = _attend(q, cache, [1, 1], lengths, tables, bs)
        after = _attend(q, dest.tensor[0], [1, 1], lengths, new_tables, bs)
        assert torch.equal(before, after)
    finally:
        source.close()
        dest.close()
