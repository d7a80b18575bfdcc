"""Sliding-window attention and head dim 256 in the C++ CPU kernel (kernels/csrc).

Against a dense masked float32 oracle on a mixed step (prefill chunks over a cached prefix,
fresh prompts, decodes) for windows 1, 16, 17, 40 and more than the context; the blocks wholly
before every window of a sequence hold NaN and must not be read; bitwise batch invariance in
bfloat16 at Gemma 3 270M's shapes (4 query heads on 1 KV head, head dim 256), a row alone (its
query heads then split over threads), in a batch, in a prefill chunk and in chunks.
"""

from __future__ import annotations

import pytest
import torch

from sluiceway.kernels import cpu_ops
from sluiceway.kernels.cpu_backend import CpuAttentionBackend
from tests.kernels.window_cases import MIXED_STEP, WINDOWS, make_case

cpu_ops.load()
BACKEND = CpuAttentionBackend()
GEMMA = (4, 1, 256, 16)  # Hq, Hkv, D, block size of Gemma 3 270M


@pytest.mark.parametrize("window", [*WINDOWS, None])
@pytest.mark.parametrize(
    ("hq", "hkv", "d", "block_size"),
    [
        GEMMA,  # the vectorized path at D 256, one KV head
        (9, 3, 64, 16),  # SmolLM2's heads
        (6, 2, 80, 16),  # head dim 80: the generic path
        (4, 2, 32, 4),  # block size 4: the generic path
    ],
)
def test_window_matches_dense_float32_and_skips_blocks_outside(
    window: int | None, hq: int, hkv: int, d: int, block_size: int
) -> None:
    case = make_case(MIXED_STEP, hq, hkv, d, block_size, torch.float32, seed=d + (window or 0))
    md = case.metadata(BACKEND)
    out = BACKEND.attention(case.query, case.cache, md, sliding_window=window)
    torch.testing.assert_close(out, case.oracle(window), atol=2e-5, rtol=2e-5)
    if window is None:
        return
    skipped = case.outside_windows(window)
    if window < 40:  # the case has blocks outside the windows: check they are not read
        assert len(skipped) >= 3
    poisoned = BACKEND.attention(case.query, case.poisoned(window), md, sliding_window=window)
    assert torch.isfinite(poisoned).all()
    assert torch.equal(poisoned, out)


def test_head_dim_256_bfloat16_close() -> None:
    case = make_case(MIXED_STEP, *GEMMA, torch.bfloat16, seed=4)
    md = case.metadata(BACKEND)
    for window in (None, 40):
        out = BACKEND.attention(case.query, case.cache, md, sliding_window=window)
        torch.testing.assert_close(out.float(), case.oracle(window), atol=2e-2, rtol=2e-2)


def _attend(
    case_cache: torch.Tensor,
    query: torch.Tensor,
    seqs: list[tuple[int, list[int]]],
    query_lens: list[int],
    window: int,
) -> torch.Tensor:
    """``seqs``: (context length, block table) per sequence of the step."""
    md = BACKEND.build_metadata(
        query_lens, [c for c, _ in seqs], [t for _, t in seqs], block_size=16,
        num_heads=query.shape[1], num_kv_heads=case_cache.shape[2], head_dim=query.shape[2],
        device="cpu",
    )  # fmt: skip
    return BACKEND.attention(query, case_cache, md, sliding_window=window)


@pytest.mark.parametrize("window", [17, 40, 512])
def test_a_windowed_row_is_bitwise_the_same_whatever_else_is_in_the_step(window: int) -> None:
    """bfloat16, Gemma 3's heads: the last token of a 200-token sequence alone (one item,
    its 4 query heads split over 4 threads), in a batch of 40 decodes, as the last row of
    its prefill and of a 50-row chunk; and rows 0/15/16/17/99/160 of the prefill as decodes."""
    lengths = [200, 37, 64, 1] + [90] * 36
    case = make_case([(n - 1, 1) for n in lengths], *GEMMA, torch.bfloat16, seed=window)
    cache, tables = case.cache, case.tables
    gen = torch.Generator().manual_seed(7)
    chunk = torch.randn(200, 4, 256, generator=gen).to(torch.bfloat16)  # sequence 0's queries
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(4)
        alone = _attend(cache, chunk[-1:], [(200, tables[0])], [1], window)
        in_batch = _attend(
            cache, torch.cat([case.query[1:3], chunk[-1:], case.query[3:]]),
            [(n, t) for n, t in zip(lengths[1:3], tables[1:3], strict=True)]
            + [(200, tables[0])]
            + [(n, t) for n, t in zip(lengths[3:], tables[3:], strict=True)],
            [1] * len(lengths), window,
        )  # fmt: skip
        as_prefill = _attend(cache, chunk, [(200, tables[0])], [200], window)
        as_chunk = _attend(cache, chunk[150:], [(200, tables[0])], [50], window)
        decodes = {
            pos: _attend(cache, chunk[pos : pos + 1], [(pos + 1, tables[0])], [1], window)
            for pos in (0, 15, 16, 17, 99, 160)
        }
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(in_batch[2], alone[0])
    assert torch.equal(as_prefill[-1], alone[0])
    assert torch.equal(as_chunk, as_prefill[150:])
    for pos, decode in decodes.items():
        assert torch.equal(decode[0], as_prefill[pos]), pos


def test_a_one_kv_head_decode_splits_its_heads_over_threads_with_the_same_bits() -> None:
    """One decode on Gemma 3's heads with 1, 2, 3 and 4 threads (1, 2, 3 and 4 groups of query
    heads): the same bits, windowed or not."""
    case = make_case([(300, 1)], *GEMMA, torch.bfloat16, seed=11)
    md = case.metadata(BACKEND)
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2, 3, 4):
            torch.set_num_threads(n)
            outs.append([BACKEND.attention(case.query, case.cache, md, sliding_window=w)
                         for w in (None, 40)])  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    for other in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(outs[0], other, strict=True))


def test_a_bad_window_is_refused() -> None:
    case = make_case([(3, 1)], 2, 1, 32, 16, torch.float32, seed=1)
    md = case.metadata(BACKEND)
    with pytest.raises(ValueError, match="sliding_window must be at least 1, got 0"):
        BACKEND.attention(case.query, case.cache, md, sliding_window=0)
