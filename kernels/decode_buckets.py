"""The torch reference's decode buckets: decode sequences (one query token each) grouped by
the blocks they read, with the ``embedding_bag`` indices that read those blocks in place
(layout and the bucket's attention in :mod:`kernels.paged_attention`). A sequence may read
from a block past its first (a sliding window: the block of its first visible key).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "DECODE_BUCKET_OVERHEAD_BLOCKS",
    "DecodeBucket",
    "decode_buckets",
    "split_decode_buckets",
]


@dataclass(slots=True)
class DecodeBucket:
    """Decode sequences (one query token each) attended to together, padded to the bucket's
    longest context: ``Sb`` sequences, ``Nb`` blocks, ``Lp = Nb * block_size``.

    Attributes:
        rows: their rows of the flattened batch, as a ``slice`` when contiguous, else an int64
            index tensor ``[Sb]``.
        k_bags: ``[Sb * Hq * Nb, D]`` int32, for each (sequence, query head, block) the ``D``
            row ids of its transposed K block in ``key_blocks(...).reshape(-1, block_size)``.
        v_bags: ``[Sb * Hq, Lp]`` int32, for each (sequence, query head) the row ids of its
            values in ``value_blocks(...).reshape(-1, D)``; padding re-reads position 0.
        invalid: ``[Sb, 1, 1, Lp]`` bool, True past a sequence's context.
        num_blocks: ``Nb``.
    """

    rows: slice | torch.Tensor
    k_bags: torch.Tensor
    v_bags: torch.Tensor
    invalid: torch.Tensor
    num_blocks: int


# What one more decode bucket costs, in padded (sequence x block) units: the fixed cost of its
# ~8 ops per layer against the per-block cost of the bag sums (0.3 ms vs 1.7 us per layer,
# measured with `sluiceway bench step` shapes on a 2-core CPU).
DECODE_BUCKET_OVERHEAD_BLOCKS = 128


def split_decode_buckets(
    num_blocks: Sequence[int], overhead_blocks: int = DECODE_BUCKET_OVERHEAD_BLOCKS
) -> list[list[int]]:
    """Groups decode sequences by context length so that padding each group to its longest
    costs least.

    Minimizes ``sum over buckets (sequences x longest block count) + overhead_blocks x
    buckets`` exactly, by dynamic programming over the sorted distinct block counts
    (O(m^2) for m distinct counts; buckets are contiguous ranges of the sorted counts).

    Args:
        num_blocks: blocks of each sequence's context (``>= 1``).
        overhead_blocks: the fixed cost of a bucket, in padded (sequence x block) units.

    Returns:
        Index lists into ``num_blocks``, by increasing block count; each list ascending.
    """
    values = sorted(set(num_blocks))
    counts = [0] * len(values)
    where = {v: i for i, v in enumerate(values)}
    for n in num_blocks:
        counts[where[n]] += 1
    cum = [0]
    for c in counts:
        cum.append(cum[-1] + c)
    m = len(values)
    best = [0.0] + [math.inf] * m
    cut = [0] * (m + 1)
    for j in range(1, m + 1):
        for i in range(j):
            cost = best[i] + (cum[j] - cum[i]) * values[j - 1] + overhead_blocks
            if cost < best[j]:
                best[j], cut[j] = cost, i
    bucket_of_value: dict[int, int] = {}
    j, k = m, 0
    while j:
        for v in values[cut[j] : j]:
            bucket_of_value[v] = k
        j, k = cut[j], k + 1
    buckets: list[list[int]] = [[] for _ in range(k)]
    for idx, n in enumerate(num_blocks):
        buckets[k - 1 - bucket_of_value[n]].append(idx)
    return buckets


def decode_buckets(
    query_lens: Sequence[int],
    qsl: torch.Tensor,
    tables: torch.Tensor,
    ctx: torch.Tensor,
    used: list[int],
    first_keys: list[int],
    *,
    block_size: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    device: torch.device | str,
) -> list[DecodeBucket]:
    """The decode sequences (one query token) in buckets of similar length read (from the
    block of ``first_keys[i]``, each sequence's first visible key, on;
    :func:`split_decode_buckets`), each with its bag indices on ``device``."""
    decode_idx = [i for i, q in enumerate(query_lens) if q == 1]
    first_blocks = [k // block_size for k in first_keys]
    return [
        _decode_bucket(
            [decode_idx[b] for b in bucket],
            qsl,
            tables,
            ctx,
            used,
            head_dim,
            device,
            first_blocks=first_blocks,
            first_keys=first_keys,
            block_size=block_size,
            num_kv_heads=num_kv_heads,
            group=group,
        )
        for bucket in split_decode_buckets([used[i] - first_blocks[i] for i in decode_idx])
    ]


def _decode_bucket(
    members: list[int],
    qsl: torch.Tensor,
    tables: torch.Tensor,
    ctx: torch.Tensor,
    used: list[int],
    head_dim: int,
    device: torch.device | str,
    *,
    first_blocks: list[int],
    first_keys: list[int],
    block_size: int,
    num_kv_heads: int,
    group: int,
) -> DecodeBucket:
    """The bag indices of the decode sequences `members` (indices into the step's sequences),
    each read from its block ``first_blocks[i]`` on, keys before ``first_keys[i]`` masked."""
    cpu = torch.device("cpu")
    starts = [int(qsl[i]) for i in members]
    rows: slice | torch.Tensor
    if starts == list(range(starts[0], starts[0] + len(starts))):
        rows = slice(starts[0], starts[0] + len(starts))
    else:
        rows = torch.tensor(starts, dtype=torch.int64, device=device)
    sel = torch.tensor(members, dtype=torch.int64, device=cpu)
    sd = len(members)
    nb = max(used[i] - first_blocks[i] for i in members)
    start = torch.tensor([first_blocks[i] for i in members], dtype=torch.int64, device=cpu)
    last = torch.tensor([used[i] - 1 for i in members], dtype=torch.int64, device=cpu)
    # each sequence's blocks from its first read on; past its last, its last again (masked)
    cols = torch.minimum(start[:, None] + torch.arange(nb, device=cpu)[None, :], last[:, None])
    blocks = tables[sel[:, None], cols]  # [Sd, Nb]
    heads = torch.arange(num_kv_heads, dtype=torch.int64, device=cpu)
    # (block, head) pair ids: [Sd, Hkv, Nb]
    pairs = blocks[:, None, :] * num_kv_heads + heads[None, :, None]
    dims = torch.arange(head_dim, dtype=torch.int64, device=cpu)
    k_bags = (
        (pairs[:, :, None, :, None] * head_dim + dims)  # [Sd, Hkv, 1, Nb, D]
        .expand(sd, num_kv_heads, group, nb, head_dim)
        .reshape(-1, head_dim)
        .to(device=device, dtype=torch.int32)
    )
    lp = nb * block_size
    positions = torch.arange(lp, dtype=torch.int64, device=cpu)
    absolute = start[:, None] * block_size + positions[None, :]
    first_key = torch.tensor([first_keys[i] for i in members], dtype=torch.int64, device=cpu)
    valid = (absolute < ctx[sel][:, None]) & (absolute >= first_key[:, None])  # [Sd, Lp]
    pos = torch.where(valid, positions[None, :], 0)  # padding re-reads the first read slot
    value_rows = (
        pairs.gather(2, (pos // block_size)[:, None, :].expand(-1, num_kv_heads, -1)) * block_size
        + (pos % block_size)[:, None, :]
    )  # [Sd, Hkv, Lp]
    v_bags = (
        value_rows[:, :, None, :]
        .expand(-1, -1, group, -1)
        .reshape(-1, lp)
        .to(device=device, dtype=torch.int32)
    )
    return DecodeBucket(rows, k_bags, v_bags, (~valid).view(sd, 1, 1, lp).to(device), nb)
