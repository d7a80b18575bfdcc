"""The Triton kernels and backend against the torch reference of :mod:`kernels.paged_attention`.

On a machine with CUDA they run on the GPU (fp32, and fp16/bf16 with a looser tolerance);
without CUDA they run on CPU tensors in Triton's interpreter (``TRITON_INTERPRET=1``, set by
``tests/conftest.py`` before the kernels are imported), in fp32 only (the interpreter's bf16 is
wrong) and on tiny shapes (it is slow).
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("triton")

from sluiceway.kernels.backend import get_attention_backend
from sluiceway.kernels.paged_attention import (
    build_attention_metadata,
    kv_pool_shape,
    paged_attention,
    write_kv,
)
from sluiceway.kernels.triton_backend import TritonAttentionBackend
from sluiceway.kernels.triton_decode_attention import triton_decode_attention
from sluiceway.kernels.triton_kv_write import triton_write_kv
from sluiceway.kernels.varlen_metadata import VarlenMetadata
from tests.kernels.runner_parity import worst_logit_difference

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
BLOCK = 4
# fp32 everywhere; fp16/bf16 only on CUDA (the interpreter's bf16 arithmetic is wrong)
DTYPES = [torch.float32] + ([torch.float16, torch.bfloat16] if CUDA else [])
TOL = {torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 2e-2}
MAX_ERR: dict[str, float] = {}  # worst error per dtype, printed at the end (pytest -s)


def _record(dtype: torch.dtype, err: float) -> None:
    key = str(dtype).removeprefix("torch.")
    MAX_ERR[key] = max(MAX_ERR.get(key, 0.0), err)


@pytest.fixture(scope="module", autouse=True)
def _report_max_errors():  # type: ignore[no-untyped-def]
    yield
    print(f"\nmax abs error vs the torch reference on {DEVICE}: {MAX_ERR}")


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A bitwise view (NaN == NaN) for exact comparisons of caches."""
    return t.contiguous().view(torch.uint8)


def _pool(
    num_blocks: int,
    hkv: int,
    d: int,
    dtype: torch.dtype,
    gen: torch.Generator,
    block_size: int = BLOCK,
) -> torch.Tensor:
    """One layer's cache full of garbage, NaN included: unwritten slots must never matter."""
    cache = torch.randn(kv_pool_shape(1, num_blocks, block_size, hkv, d)[1:], generator=gen)
    cache.view(-1)[::7] = float("nan")
    return cache.to(device=DEVICE, dtype=dtype)


def _poison_unused(cache: torch.Tensor, tables: list[list[int]]) -> torch.Tensor:
    """The pool's random contents serve as context here: finite in the blocks of ``tables``,
    NaN in every other block (never read)."""
    cache = torch.nan_to_num(cache)
    unused = sorted(set(range(cache.shape[1])) - {b for t in tables for b in t})
    cache[:, unused] = float("nan")
    return cache


def _run_case(
    seqs: list[tuple[int, int]],
    hq: int,
    hkv: int,
    d: int,
    dtype: torch.dtype,
    seed: int,
    block_size: int = BLOCK,
) -> tuple[torch.Tensor, torch.Tensor, VarlenMetadata]:
    """Triton vs torch for sequences given as (cached tokens, new tokens).

    The cached prefixes are written by the torch writer in an earlier "step"; the chunks' K/V
    by both writers (the caches must come out bit-identical), then both attentions run.
    Block ids are a random permutation, so tables are never contiguous.
    """
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-(c + q) // block_size) for c, q in seqs) + 3
    cache = _pool(num_blocks, hkv, d, dtype, gen, block_size)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[perm.pop() for _ in range(-(-(c + q) // block_size))] for c, q in seqs]

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=DEVICE, dtype=dtype)

    keys = [rand(c + q, hkv, d) for c, q in seqs]
    values = [rand(c + q, hkv, d) for c, q in seqs]
    query = rand(sum(q for _, q in seqs), hq, d)
    geometry = {"block_size": block_size, "num_heads": hq, "num_kv_heads": hkv, "head_dim": d}
    pre = [(i, c) for i, (c, _) in enumerate(seqs) if c > 0]
    if pre:
        md0 = build_attention_metadata(
            [c for _, c in pre], [c for _, c in pre], [tables[i] for i, _ in pre],
            device=DEVICE, **geometry,
        )  # fmt: skip
        write_kv(
            torch.cat([keys[i][:c] for i, c in pre]),
            torch.cat([values[i][:c] for i, c in pre]),
            cache,
            md0.slot_mapping,
        )
    query_lens = [q for _, q in seqs]
    context_lens = [c + q for c, q in seqs]
    ref_md = build_attention_metadata(query_lens, context_lens, tables, device=DEVICE, **geometry)
    md = TritonAttentionBackend().build_metadata(
        query_lens, context_lens, tables, device=DEVICE, **geometry
    )
    assert md.slot_mapping.tolist() == ref_md.slot_mapping.tolist()
    new_k = torch.cat([k[c:] for k, (c, _) in zip(keys, seqs, strict=True)])
    new_v = torch.cat([v[c:] for v, (c, _) in zip(values, seqs, strict=True)])
    mine = cache.clone()
    write_kv(new_k, new_v, cache, ref_md.slot_mapping)
    TritonAttentionBackend().write_kv(new_k, new_v, mine, md)
    assert torch.equal(_bits(mine), _bits(cache))
    out = TritonAttentionBackend().attention(query, cache, md)
    ref = paged_attention(query, cache, ref_md)
    return out, ref, md


CASES: dict[str, tuple[list[tuple[int, int]], int, int, int, int]] = {
    # name: (seqs as (cached, new), Hq, Hkv, D, block_size)
    "decode-partial-last-block": ([(5, 1), (12, 1), (2, 1)], 2, 2, 16, BLOCK),
    "decode-gqa-9-on-3-several-blocks": ([(13, 1), (3, 1), (21, 1)], 9, 3, 64, BLOCK),
    "prefill-from-0-several-blocks": ([(0, 11)], 4, 2, 16, BLOCK),
    "mixed-prefix-chunk-fresh-prompt-decodes": (
        [(9, 1), (0, 6), (4, 1), (7, 5), (1, 1)],
        9,
        3,
        64,
        BLOCK,
    ),
    "mixed-head-dim-80": ([(6, 3), (10, 1)], 4, 2, 80, BLOCK),
    "decode-head-dim-80": ([(6, 1), (9, 1)], 2, 1, 80, BLOCK),
    "mixed-block-size-16": ([(17, 4), (0, 9), (40, 1)], 4, 2, 16, 16),
    "decode-block-size-16": ([(17, 1), (40, 1)], 4, 2, 16, 16),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_attention_matches_reference(case: str, dtype: torch.dtype) -> None:
    seqs, hq, hkv, d, block_size = CASES[case]
    out, ref, md = _run_case(seqs, hq, hkv, d, dtype, seed=len(case), block_size=block_size)
    assert md.max_query_len == max(q for _, q in seqs)
    assert out.shape == ref.shape and out.dtype == dtype
    err = float((out.float() - ref.float()).abs().max())
    _record(dtype, err)
    assert err <= TOL[dtype], f"{case} {dtype}: max abs error {err}"


@pytest.mark.parametrize("num_splits", [2, 3])
def test_decode_splits_match_reference(num_splits: int) -> None:
    """FlashDecoding splits (a split with nothing to do included) merge to the same output."""
    gen = torch.Generator().manual_seed(num_splits)
    hq, hkv, d = 4, 2, 16
    cache = _pool(30, hkv, d, torch.float32, gen)
    context_lens = [70, 5, 33]  # 5 tiles of 16, 1 tile (empty splits), 3 tiles
    perm = torch.randperm(30, generator=gen).tolist()
    tables = [[perm.pop() for _ in range(-(-c // BLOCK))] for c in context_lens]
    geometry = {"block_size": BLOCK, "num_heads": hq, "num_kv_heads": hkv, "head_dim": d}
    cache = _poison_unused(cache, tables)
    ref_md = build_attention_metadata([1, 1, 1], context_lens, tables, device=DEVICE, **geometry)
    md = TritonAttentionBackend().build_metadata(
        [1, 1, 1], context_lens, tables, device=DEVICE, **geometry
    )
    query = torch.randn(3, hq, d, generator=gen).to(DEVICE)
    out = triton_decode_attention(
        query, cache, md.block_tables, md.context_lens, block_size=BLOCK,
        num_splits=num_splits, block_n=16,
    )  # fmt: skip
    err = float((out - paged_attention(query, cache, ref_md)).abs().max())
    _record(torch.float32, err)
    assert err <= 1e-3


def test_write_kv_skips_negative_slots_and_reads_strided_views() -> None:
    gen = torch.Generator().manual_seed(0)
    hkv, d = 3, 16
    cache = _pool(5, hkv, d, torch.float32, gen)
    fused = torch.randn(4, 2 * hkv + 1, d, generator=gen).to(DEVICE)  # like a QKV projection
    key, value = fused[:, :hkv], fused[:, hkv : 2 * hkv]
    slots = torch.tensor([-1, 2 * BLOCK + 3, -1, 0], device=DEVICE)
    mine, ref = cache.clone(), cache.clone()
    triton_write_kv(key, value, mine, slots)
    write_kv(key[[1, 3]], value[[1, 3]], ref, slots[[1, 3]])
    assert torch.equal(_bits(mine), _bits(ref))
    untouched = cache.clone()
    triton_write_kv(key, value, untouched, torch.full((4,), -1, device=DEVICE))
    assert torch.equal(_bits(untouched), _bits(cache))


def test_static_decode_buffers_pad_with_zero_rows() -> None:
    """The CUDA-graph buffers: n live rows, the rest padding (zeros out, nothing written)."""
    gen = torch.Generator().manual_seed(1)
    hq, hkv, d = 4, 2, 16
    cache = _pool(12, hkv, d, torch.float32, gen)
    md = VarlenMetadata.decode_static(
        4, 3, DEVICE, block_size=BLOCK, num_heads=hq, num_kv_heads=hkv, head_dim=d
    )
    assert md.context_lens.tolist() == [0] * 4 and md.slot_mapping.tolist() == [-1] * 4
    context_lens, tables = [6, 9], [[7, 2], [3, 0, 11]]
    md.fill_decode([1, 1, 1], [[5], [6], [8]])  # an earlier, longer batch: overwritten below
    md.fill_decode(context_lens, tables)
    assert md.context_lens.tolist() == [6, 9, 0, 0]
    assert md.slot_mapping.tolist() == [2 * BLOCK + 1, 11 * BLOCK + 0, -1, -1]
    assert md.block_tables.tolist() == [[7, 2, 7], [3, 0, 11], [0, 0, 0], [0, 0, 0]]
    with pytest.raises(ValueError, match="exceed"):
        md.fill_decode([1] * 5, [[0]] * 5)

    key = torch.randn(4, hkv, d, generator=gen).to(DEVICE)
    value = torch.randn(4, hkv, d, generator=gen).to(DEVICE)
    query = torch.randn(4, hq, d, generator=gen).to(DEVICE)
    ref_md = build_attention_metadata(
        [1, 1], context_lens, tables, block_size=BLOCK, num_heads=hq, num_kv_heads=hkv,
        head_dim=d, device=DEVICE,
    )  # fmt: skip
    cache = _poison_unused(cache, tables)
    ref_cache = cache.clone()
    write_kv(key[:2], value[:2], ref_cache, ref_md.slot_mapping)
    backend = TritonAttentionBackend()
    backend.write_kv(key, value, cache, md)
    assert torch.equal(_bits(cache), _bits(ref_cache))  # padding rows wrote nothing
    out = backend.attention(query, cache, md)
    assert torch.equal(out[2:], torch.zeros_like(out[2:]))
    err = float((out[:2] - paged_attention(query[:2], cache, ref_md)).abs().max())
    _record(torch.float32, err)
    assert err <= 1e-3


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (([1], [1, 2], [[0]]), "one entry per sequence"),
        (([], [], []), "at least one sequence"),
        (([0], [3], [[0]]), "bad chunk"),
        (([4], [3], [[0]]), "bad chunk"),
        (([1], [9], [[0, 1]]), "cannot hold"),
    ],
)
def test_metadata_errors_match_reference(args: tuple, match: str) -> None:
    kw = {"block_size": 4, "num_heads": 2, "num_kv_heads": 1, "head_dim": 8, "device": "cpu"}
    with pytest.raises(ValueError, match=match) as ref:
        build_attention_metadata(*args, **kw)
    with pytest.raises(ValueError, match=match) as mine:
        TritonAttentionBackend().build_metadata(*args, **kw)
    assert str(mine.value) == str(ref.value)
    with pytest.raises(ValueError, match="not a multiple"):
        TritonAttentionBackend().build_metadata(
            [1], [1], [[0]], **{**kw, "num_heads": 3, "num_kv_heads": 2}
        )


def test_get_attention_backend_triton() -> None:
    backend = get_attention_backend("triton", DEVICE)
    assert isinstance(backend, TritonAttentionBackend) and backend.name == "triton"
    if not CUDA:
        assert os.environ.get("TRITON_INTERPRET") == "1"
        assert get_attention_backend("auto", "cpu").name == "cpu"


def test_model_runner_triton_matches_torch(tmp_path: pathlib.Path) -> None:
    """A tiny random Llama: prefill chunks then decode steps, Triton vs torch backend."""
    worst = worst_logit_difference(tmp_path, "triton", DEVICE, BLOCK)
    _record(torch.float32, worst)
    assert worst <= 1e-3


def test_imports_and_torch_backend_without_triton() -> None:
    """With Triton absent (``sys.modules["triton"] = None``: ``import triton`` fails and
    ``find_spec`` finds nothing), the package imports and CPU steps keep the C++ kernels."""
    code = textwrap.dedent(
        """
        import sys

        # what an absent package looks like to both `import` and importlib.util.find_spec
        sys.modules["triton"] = None
        try:
            import triton  # noqa: F401
        except ImportError:
            pass
        else:
            raise SystemExit("triton still imports")
        import sluiceway.kernels.backend as backend
        import sluiceway.worker.model_runner  # noqa: F401

        assert not backend.triton_available()

        assert backend.get_attention_backend("auto", "cpu").name == "cpu"
        try:
            backend.get_attention_backend("triton", "cpu")
        except ValueError as e:
            assert "Triton" in str(e), e
        else:
            raise SystemExit("triton backend without triton did not raise")
        print("ok")
        """
    )
    root = pathlib.Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
