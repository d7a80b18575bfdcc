"""Paged attention and the KV scatter in plain torch: the reference (oracle) and the CPU path.

KV pool layout
--------------
The worker allocates one tensor for the whole pool, ``[num_layers, 2, num_blocks,
num_kv_heads, block_size * head_dim]`` (see :func:`kv_pool_shape`), and hands layer ``i`` the
contiguous view ``kv_cache = pool[i]``: ``kv_cache[0]`` holds keys, ``kv_cache[1]`` values.
Within one (block, KV head):

- **K is stored transposed**, ``[head_dim, block_size]``: element ``(t, d)`` of the block is at
  ``d * block_size + t`` (:func:`key_blocks` gives the ``[num_blocks, Hkv, D, block_size]`` view);
- **V is stored as is**, ``[block_size, head_dim]`` (:func:`value_blocks`:
  ``[num_blocks, Hkv, block_size, D]``).

(vLLM's first paged attention kernel used a transposed V for the same reason: the layout the
dot products want.) A token's *slot* is ``block_id * block_size + offset``. One block of one
layer is one contiguous run of K (and one of V), which is what a block copy between workers
moves. Blocks hold stale or uninitialized data past a sequence's length; attention never lets
it reach the output (scores there are masked, not added to).

Flattened varlen batch
----------------------
A step runs the new tokens of several sequences back to back: ``query`` is ``[T, Hq, D]``;
sequence ``i`` owns rows ``query_start_loc[i]:query_start_loc[i + 1]`` (its *chunk*), at
positions ``context_lens[i] - query_len_i ... context_lens[i] - 1``. Each row attends to every
cached token of its sequence before its chunk and causally within its chunk, so row ``j`` of
the chunk sees keys ``0 .. context_lens[i] - query_len_i + j``. All of them are read through the
pool (write the chunk's K/V with :func:`write_kv` first). Query head ``h`` reads KV head
``h // (Hq // Hkv)`` (grouped-query attention).

Decode sequences (one query token) are served in a few buckets of similar context length
(:func:`split_decode_buckets`), with no gathered copy of K or V: per bucket, the scores of
every (sequence, query head, block) come from one ``embedding_bag`` that sums the ``D`` rows of
the transposed K block weighted by the query, then one masked softmax over the contexts padded
to the bucket's longest, then one ``embedding_bag`` that sums V rows weighted by the
probabilities. Prefill chunks (several query tokens) gather their blocks and run one
``scaled_dot_product_attention`` each. :func:`build_attention_metadata` precomputes every index
once per step; all layers share it.

Sliding window
--------------
A layer with a window ``W`` (``sliding_window``) lets a query at position ``p`` see keys
``p - W < k <= p`` only (transformers' ``sliding_window_overlay``). Its sequences read from the
block holding their first visible key on: blocks wholly before it are not read. The windowed
buckets and chunks are built from the step's indices on first use per window and kept in the
metadata (:meth:`AttentionMetadata.for_window`), so the layers of one window share them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from sluiceway.kernels.decode_buckets import DecodeBucket, decode_buckets, split_decode_buckets
from sluiceway.kernels.kv_quant import (
    attention_quantized,
    is_quantized,
    kv_row_width,
    write_kv_quantized,
)

__all__ = [
    "AttentionMetadata",
    "DecodeBucket",
    "PrefillChunk",
    "build_attention_metadata",
    "check_step",
    "key_blocks",
    "kv_pool_shape",
    "paged_attention",
    "split_decode_buckets",
    "value_blocks",
    "write_kv",
]


def kv_pool_shape(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype | None = None,
) -> tuple[int, int, int, int, int]:
    """Shape of the whole KV pool: ``(num_layers, 2, num_blocks, num_kv_heads, width)``,
    ``width`` = ``block_size * head_dim``, or ``block_size * (head_dim + 4)`` for an int8
    pool (``dtype`` ``torch.int8``: values then float32 scales, :mod:`kernels.kv_quant`)."""
    width = kv_row_width(block_size, head_dim, dtype or torch.float32)
    return (num_layers, 2, num_blocks, num_kv_heads, width)


def key_blocks(kv_cache: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Keys of one layer's cache as ``[num_blocks, Hkv, head_dim, block_size]`` (a view)."""
    _, nb, hkv, width = kv_cache.shape
    return kv_cache[0].view(nb, hkv, head_dim, width // head_dim)


def value_blocks(kv_cache: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Values of one layer's cache as ``[num_blocks, Hkv, block_size, head_dim]`` (a view)."""
    _, nb, hkv, width = kv_cache.shape
    return kv_cache[1].view(nb, hkv, width // head_dim, head_dim)


@dataclass(slots=True)
class PrefillChunk:
    """One sequence of the step with more than one query token (a prefill chunk).

    Attributes:
        start, end: its rows ``[start, end)`` in the flattened batch.
        context_len: keys it reads: the cached prefix + this chunk, from its first block on
            (with a window, the block holding the first query's first visible key).
        blocks: ``[ceil(context_len / block_size)]`` int64, its block ids from that block on.
        mask: ``[1, 1, q_len, context_len]`` bool (True = may attend), or ``None`` when the chunk
            is the whole context so far and no window cuts it (plain causal attention).
    """

    start: int
    end: int
    context_len: int
    blocks: torch.Tensor
    mask: torch.Tensor | None


@dataclass(slots=True)
class AttentionMetadata:
    """Everything attention needs for one step, built once and shared by all layers.

    The generic description (what a kernel would take):
        query_start_loc: ``[S + 1]`` int64, row offsets of each sequence's chunk.
        context_lens: ``[S]`` int64, tokens of each sequence in the pool once this step's K/V
            are written (cached + new).
        block_tables: ``[S, max_blocks]`` int64, physical block ids (padded rows repeat the
            first block; only the first ``ceil(context_len / block_size)`` entries matter).
        slot_mapping: ``[T]`` int64, the slot each new token's K/V is written to.
        block_size: tokens per block.

    Precomputed for the torch path (derived from the above; ``Sd`` decode sequences, ``Nb``
    blocks in the longest decode context, ``Lp = Nb * block_size``):
        decode_rows: rows of the flattened batch that are decode sequences (one query token),
            as a ``slice`` when they are contiguous, else an int64 index tensor ``[Sd]``;
            ``None`` when there are none.
        decode_k_bags: ``[Sd * Hq * Nb, D]`` int32, for each (sequence, query head, block) the
            ``D`` row ids of its transposed K block in ``key_blocks(...).reshape(-1, block_size)``.
        decode_v_bags: ``[Sd * Hq, Lp]`` int32, for each (sequence, query head) the row ids of
            its values in ``value_blocks(...).reshape(-1, D)``; padding re-reads position 0.
        decode_invalid: ``[Sd, 1, 1, Lp]`` bool, True past a sequence's context.
        decode_num_blocks: ``Nb``.
        prefills: the prefill chunks, in batch order.
    """

    query_start_loc: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    block_size: int
    num_kv_heads: int
    num_heads: int
    decode_buckets: list[DecodeBucket]
    prefills: list[PrefillChunk]
    step: _StepIndices | None = None
    windows: dict[int, tuple[list[DecodeBucket], list[PrefillChunk]]] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        """Rows of the flattened batch (``T``)."""
        return int(self.slot_mapping.shape[0])

    def for_window(
        self, sliding_window: int | None
    ) -> tuple[list[DecodeBucket], list[PrefillChunk]]:
        """The decode buckets and prefill chunks of a layer with ``sliding_window`` (None: the
        full ones): each sequence's blocks from the one holding its first visible key on,
        masks that hide keys outside the window. Built on first use per window, then kept.

        Raises:
            ValueError: a window < 1.
        """
        if sliding_window is None:
            return self.decode_buckets, self.prefills
        if sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        cached = self.windows.get(sliding_window)
        if cached is None:
            assert self.step is not None, "metadata built without its step indices"
            cached = self.step.build(sliding_window)
            self.windows[sliding_window] = cached
        return cached


@dataclass(slots=True)
class _StepIndices:
    """A step's host index tensors, kept to build windowed buckets and chunks on demand."""

    query_lens: list[int]
    context_lens: list[int]
    qsl: torch.Tensor
    tables: torch.Tensor
    used: list[int]
    block_size: int
    num_kv_heads: int
    group: int
    head_dim: int
    device: torch.device | str

    def build(self, window: int | None) -> tuple[list[DecodeBucket], list[PrefillChunk]]:
        """The decode buckets and prefill chunks for ``window`` (None: full attention)."""
        # each sequence's first visible key: that of its chunk's first query
        first_keys = [
            0 if window is None else max(0, c - q - window + 1)
            for q, c in zip(self.query_lens, self.context_lens, strict=True)
        ]
        buckets = decode_buckets(
            self.query_lens,
            self.qsl,
            self.tables,
            torch.tensor(self.context_lens, dtype=torch.int64),
            self.used,
            first_keys,
            block_size=self.block_size,
            num_kv_heads=self.num_kv_heads,
            group=self.group,
            head_dim=self.head_dim,
            device=self.device,
        )
        prefills = _prefill_chunks(
            self.query_lens,
            self.context_lens,
            self.qsl,
            self.tables,
            self.used,
            self.device,
            window,
            self.block_size,
        )
        return buckets, prefills


def check_step(
    query_lens: Sequence[int],
    context_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    *,
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
) -> list[int]:
    """Validates one step's flattened varlen batch (shared by every backend's metadata
    builder) and returns the blocks each sequence's context uses, ``ceil(context_len /
    block_size)``.

    Raises:
        ValueError: inconsistent lengths, no sequence, ``num_heads`` not a multiple of
            ``num_kv_heads``, a bad chunk (``query_len < 1`` or ``context_len < query_len``),
            or a block table too short for its context.
    """
    n = len(query_lens)
    if len(context_lens) != n or len(block_tables) != n:
        raise ValueError(
            "query_lens, context_lens and block_tables must have one entry per sequence"
        )
    if n == 0:
        raise ValueError("a step needs at least one sequence")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    used = []
    for q, c, bt in zip(query_lens, context_lens, block_tables, strict=True):
        if q < 1 or c < q:
            raise ValueError(f"bad chunk: query_len={q}, context_len={c}")
        if len(bt) * block_size < c:
            raise ValueError(
                f"block table of {len(bt)} blocks cannot hold {c} tokens (block_size={block_size})"
            )
        used.append(-(-c // block_size))
    return used


def build_attention_metadata(
    query_lens: Sequence[int],
    context_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    *,
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """Describe one step's flattened varlen batch for :func:`paged_attention` and :func:`write_kv`.

    Args:
        query_lens: new tokens per sequence (``>= 1``), in flattened-batch order.
        context_lens: tokens per sequence once this step's K/V are in the pool
            (``>= query_len``).
        block_tables: physical block ids per sequence, in order; must cover ``context_len``
            tokens (``len(table) * block_size >= context_len``).
        block_size: tokens per block.
        num_heads: query heads ``Hq`` (a multiple of ``num_kv_heads``).
        num_kv_heads: KV heads ``Hkv``.
        head_dim: ``D``.
        device: where the index tensors live (the model's device).

    Returns:
        The metadata; index tensors on ``device`` (int64, the decode bags int32: half the
        index traffic; a pool has fewer than 2**31 rows).

    Raises:
        ValueError: on inconsistent lengths or a block table too short for its context.
    """
    used = check_step(
        query_lens,
        context_lens,
        block_tables,
        block_size=block_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
    )
    tables, ctx, qsl, slot_mapping = _step_indices(
        query_lens, context_lens, block_tables, used, block_size
    )
    step = _StepIndices(
        list(query_lens),
        list(context_lens),
        qsl,
        tables,
        used,
        block_size,
        num_kv_heads,
        num_heads // num_kv_heads,
        head_dim,
        device,
    )
    decode_buckets, prefills = step.build(None)
    return AttentionMetadata(
        query_start_loc=qsl.to(device),
        context_lens=ctx.to(device),
        block_tables=tables.to(device),
        slot_mapping=slot_mapping.to(device),
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        num_heads=num_heads,
        decode_buckets=decode_buckets,
        prefills=prefills,
        step=step,
    )


def _step_indices(
    query_lens: Sequence[int],
    context_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    used: list[int],
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The step's generic index tensors, int64 on the CPU (``S`` sequences, ``T`` rows):
    block tables ``[S, max(used)]`` (each sequence's ``used`` blocks, padded with its first),
    context lengths ``[S]``, ``query_start_loc`` ``[S + 1]`` and the slot mapping ``[T]``."""
    n = len(query_lens)
    max_blocks = max(used)
    cpu = torch.device("cpu")
    tables = torch.tensor(
        [
            list(bt[:u]) + [bt[0]] * (max_blocks - u)
            for bt, u in zip(block_tables, used, strict=True)
        ],
        dtype=torch.int64,
        device=cpu,
    )
    ctx = torch.tensor(list(context_lens), dtype=torch.int64, device=cpu)
    qlens = torch.tensor(list(query_lens), dtype=torch.int64, device=cpu)
    qsl = torch.zeros(n + 1, dtype=torch.int64, device=cpu)
    torch.cumsum(qlens, 0, out=qsl[1:])

    # slot mapping of the new tokens: positions [ctx - q, ctx) of each sequence
    seq_of_row = torch.repeat_interleave(torch.arange(n, device=cpu), qlens)
    pos_of_row = (
        torch.arange(int(qsl[-1]), device=cpu) - qsl[:-1][seq_of_row] + (ctx - qlens)[seq_of_row]
    )
    slot_mapping = (
        tables[seq_of_row, pos_of_row // block_size] * block_size + pos_of_row % block_size
    )
    return tables, ctx, qsl, slot_mapping


def _prefill_chunks(
    query_lens: Sequence[int],
    context_lens: Sequence[int],
    qsl: torch.Tensor,
    tables: torch.Tensor,
    used: list[int],
    device: torch.device | str,
    window: int | None = None,
    block_size: int = 1,
) -> list[PrefillChunk]:
    """The sequences with more than one query token, in batch order, their block ids and
    masks on ``device`` (no mask where the chunk is the whole context and no window cuts it:
    plain causal). With ``window``, each reads from the block of its first query's first
    visible key on."""
    cpu = torch.device("cpu")
    prefills: list[PrefillChunk] = []
    for i, q in enumerate(query_lens):
        if q == 1:
            continue
        c = context_lens[i]
        # the window cuts the chunk when its last query (position c - 1) misses key 0
        cut = window if window is not None and c - 1 >= window else None
        first = 0 if cut is None else max(0, c - q - cut + 1) // block_size * block_size
        chunk_mask = None
        if c != q or cut is not None:
            kpos = torch.arange(first, c, device=cpu)
            qpos = torch.arange(c - q, c, device=cpu)
            visible = kpos[None, :] <= qpos[:, None]
            if cut is not None:
                visible &= kpos[None, :] > qpos[:, None] - cut
            chunk_mask = visible.view(1, 1, q, c - first).to(device)
        blocks = tables[i, first // block_size : used[i]].to(device)
        prefills.append(PrefillChunk(int(qsl[i]), int(qsl[i + 1]), c - first, blocks, chunk_mask))
    return prefills


def write_kv(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter new K/V into their slots of one layer's cache, in place.

    Args:
        key: ``[T, Hkv, D]``, the cache's dtype (may be a strided view).
        value: ``[T, Hkv, D]``, the cache's dtype.
        kv_cache: ``[2, num_blocks, Hkv, block_size * D]``, contiguous (layout in the module
            docstring); or an int8 cache (:mod:`kernels.kv_quant`), which quantizes each row.
        slot_mapping: ``[T]`` int64, ``block_id * block_size + offset`` per token; distinct.
    """
    if is_quantized(kv_cache):
        write_kv_quantized(key, value, kv_cache, slot_mapping)
        return
    d = key.shape[-1]
    block_size = kv_cache.shape[-1] // d
    blocks = torch.div(slot_mapping, block_size, rounding_mode="floor")
    offsets = slot_mapping - blocks * block_size
    key_blocks(kv_cache, d)[blocks, :, :, offsets] = key
    value_blocks(kv_cache, d)[blocks, :, offsets] = value


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Attention of a flattened varlen batch over the paged KV pool (see the module docstring).

    Args:
        query: ``[T, Hq, D]``, float32/bfloat16/float16 (the cache's dtype).
        kv_cache: ``[2, num_blocks, Hkv, block_size * D]``, already holding this step's K/V;
            or an int8 cache (:func:`kernels.kv_quant.attention_quantized`, per sequence).
        metadata: from :func:`build_attention_metadata` for this batch.
        scale: softmax scale; ``1 / sqrt(D)`` when ``None``.
        sliding_window: the layer's window ``W`` (a query at ``p`` sees keys ``p - W < k <=
            p``; blocks wholly before that are not read); None: full causal attention.

    Returns:
        ``[T, Hq, D]`` in ``query``'s dtype. Softmax runs in float32.
    """
    if is_quantized(kv_cache):
        return attention_quantized(query, kv_cache, metadata, scale, sliding_window)
    _, hq, d = query.shape
    hkv = kv_cache.shape[2]
    block_size = metadata.block_size
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    out = torch.empty_like(query)
    keys = key_blocks(kv_cache, d)
    values = value_blocks(kv_cache, d)
    buckets, prefills = metadata.for_window(sliding_window)

    for bucket in buckets:
        q = query[bucket.rows]  # [Sb, Hq, D]
        sd = q.shape[0]
        nb = bucket.num_blocks
        weights = q[:, :, None, :].expand(sd, hq, nb, d).reshape(-1, d)
        scores = F.embedding_bag(
            bucket.k_bags, keys.reshape(-1, block_size), mode="sum", per_sample_weights=weights
        )  # [Sb * Hq * Nb, block_size]
        scores = scores.view(sd, hkv, hq // hkv, nb * block_size).float().mul_(scale)
        scores.masked_fill_(bucket.invalid, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(query.dtype).view(sd * hq, -1)
        o = F.embedding_bag(
            bucket.v_bags, values.reshape(-1, d), mode="sum", per_sample_weights=probs
        )
        out[bucket.rows] = o.view(sd, hq, d)

    for chunk in prefills:
        c = chunk.context_len
        q = query[chunk.start : chunk.end].transpose(0, 1).unsqueeze(0)  # [1, Hq, q, D]
        k = keys.index_select(0, chunk.blocks).permute(1, 0, 3, 2).reshape(hkv, -1, d)[:, :c]
        v = values.index_select(0, chunk.blocks).transpose(0, 1).reshape(hkv, -1, d)[:, :c]
        o = F.scaled_dot_product_attention(
            q,
            k.unsqueeze(0),
            v.unsqueeze(0),
            attn_mask=chunk.mask,
            is_causal=chunk.mask is None,
            scale=scale,
            enable_gqa=hq != hkv,
        )
        out[chunk.start : chunk.end] = o[0].transpose(0, 1)
    return out
