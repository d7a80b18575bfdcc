"""Sliding-window attention in the Triton kernels: the unified (batch-invariant) kernel, looped
and split over segments, the prefill kernel and the decode kernel, against a dense masked
float32 oracle for windows 1, 16, 17, 40 and more than the context, with the blocks wholly
before every window of a sequence full of NaN (never read); head dim 256 on one KV head; and a
windowed row bitwise the same alone, in a prefill chunk and split.

On CUDA (``scripts/gpu_check.sh``'s kernels step) they run on the GPU; without it in Triton's
interpreter (``TRITON_INTERPRET=1``, set by ``tests/conftest.py``), float32, small shapes.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from sluiceway.kernels.triton_backend import TritonAttentionBackend
from sluiceway.kernels.triton_decode_attention import triton_decode_attention
from sluiceway.kernels.triton_unified_attention import triton_unified_attention
from tests.kernels.window_cases import MIXED_STEP, WINDOWS, WindowCase, make_case

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DECODES = [(40, 1), (70, 1), (3, 1), (16, 1)]
TOL = 1e-4 if DEVICE.type == "cpu" else 2e-3  # the GPU's float32 exp2 is approximate


def _run(case: WindowCase, kernel: str, window: int | None, cache: torch.Tensor) -> torch.Tensor:
    md = case.metadata(TritonAttentionBackend(), device=DEVICE)
    if kernel == "unified-split":
        return triton_unified_attention(
            case.query, cache, md.block_tables, md.query_start_loc, md.context_lens,
            block_size=case.block_size, max_context_len=md.max_context_len, split=True,
            segment=32, sliding_window=window,
        )  # fmt: skip
    if kernel == "decode-split":
        return triton_decode_attention(
            case.query, cache, md.block_tables, md.context_lens, block_size=case.block_size,
            num_splits=3, sliding_window=window,
        )  # fmt: skip
    backend = TritonAttentionBackend(batch_invariant=kernel == "unified")
    return backend.attention(case.query, cache, md, sliding_window=window)


def _check(case: WindowCase, kernel: str, window: int | None) -> None:
    out = _run(case, kernel, window, case.cache)
    torch.testing.assert_close(out.cpu(), case.oracle(window), atol=TOL, rtol=TOL)
    if window is not None:
        poisoned = _run(case, kernel, window, case.poisoned(window))
        assert torch.isfinite(poisoned).all()
        assert torch.equal(poisoned, out)


@pytest.mark.parametrize("window", [*WINDOWS, None])
@pytest.mark.parametrize("kernel", ["unified", "prefill"])
def test_mixed_step_with_a_window_matches_dense(kernel: str, window: int | None) -> None:
    """Prefill chunks over cached prefixes, a fresh prompt and decodes in one step."""
    case = make_case(MIXED_STEP, 4, 2, 32, 16, torch.float32, seed=3, device=DEVICE)
    if window is not None and window < 40:
        assert len(case.outside_windows(window)) >= 3
    _check(case, kernel, window)


@pytest.mark.parametrize("window", [1, 17, 40, 1000])
@pytest.mark.parametrize("kernel", ["unified-split", "decode", "decode-split"])
def test_decode_step_with_a_window_matches_dense(kernel: str, window: int) -> None:
    case = make_case(DECODES, 4, 2, 32, 16, torch.float32, seed=5, device=DEVICE)
    _check(case, kernel, window)


@pytest.mark.parametrize("kernel", ["unified", "prefill", "decode"])
def test_head_dim_256_on_one_kv_head(kernel: str) -> None:
    """Gemma 3 270M's heads: 4 query heads on 1 KV head of dim 256, block 16."""
    seqs = DECODES[:2] if kernel == "decode" else [(20, 13), (40, 1)]
    case = make_case(seqs, 4, 1, 256, 16, torch.float32, seed=9, device=DEVICE)
    _check(case, kernel, 17)


def test_a_windowed_row_is_bitwise_the_same_alone_in_a_chunk_and_split() -> None:
    """The unified kernel, window 17, segments of 32 keys: each token of a 70-token sequence
    computed in one prefill, in a 30-row chunk, and as a decode (looped and split) agree."""
    case = make_case([(0, 70)], 4, 2, 32, 16, torch.float32, seed=13, device=DEVICE)
    md = case.metadata(TritonAttentionBackend(), device=DEVICE)

    def attend(rows: slice, context: int, split: bool = False) -> torch.Tensor:
        q = case.query[rows]
        n = q.shape[0]
        qsl = torch.tensor([0, n], dtype=torch.int32, device=DEVICE)
        ctx = torch.tensor([context], dtype=torch.int32, device=DEVICE)
        return triton_unified_attention(
            q, case.cache, md.block_tables, qsl, ctx, block_size=16, max_context_len=context,
            split=split, segment=32, sliding_window=17,
        )  # fmt: skip

    whole = attend(slice(0, 70), 70)
    assert torch.equal(attend(slice(40, 70), 70), whole[40:])
    for pos in (0, 16, 17, 33, 50, 69):
        for split in (False, True):
            assert torch.equal(attend(slice(pos, pos + 1), pos + 1, split)[0], whole[pos])
