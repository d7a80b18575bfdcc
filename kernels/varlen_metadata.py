"""One step's flattened varlen batch as flat index tensors: what the Triton kernels (CUDA) and
the C++ CPU kernels (:mod:`kernels.cpu_ops`) take.

Built on the host from Python lists (no device op, no sync) and copied to the device with
``non_blocking=True``. For CUDA graphs of decode steps, :meth:`VarlenMetadata.decode_static`
allocates fixed buffers once and :meth:`VarlenMetadata.fill_decode` rewrites them in place
before each replay; rows past the live batch are padding (context length 0: zero output,
nothing read; slot -1: nothing written).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sluiceway.kernels.paged_attention import check_step

__all__ = ["VarlenMetadata", "VarlenMetadataBuilder", "build_varlen_metadata", "choose_num_splits"]

# FlashDecoding split choice: at most this many splits, each at least this many tokens long.
MAX_DECODE_SPLITS = 16
MIN_TOKENS_PER_SPLIT = 256


@functools.cache
def _num_sms(device: torch.device) -> int:
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def choose_num_splits(
    num_seqs: int, num_kv_heads: int, max_context_len: int, device: torch.device
) -> int:
    """Context splits per (sequence, KV head) for a decode step (FlashDecoding).

    Splits only on CUDA and only when the ``num_seqs * num_kv_heads`` programs would leave
    streaming multiprocessors idle: enough splits for about two programs per SM, at most
    :data:`MAX_DECODE_SPLITS`, each split at least :data:`MIN_TOKENS_PER_SPLIT` tokens of the
    longest context. 1 on CPU (the interpreter).
    """
    if device.type != "cuda":
        return 1
    programs = max(1, num_seqs * num_kv_heads)
    sms = _num_sms(device)
    if programs >= sms:
        return 1
    wanted = math.ceil(2 * sms / programs)
    by_length = math.ceil(max_context_len / MIN_TOKENS_PER_SPLIT)
    return max(1, min(wanted, by_length, MAX_DECODE_SPLITS))


@dataclass(slots=True)
class VarlenMetadata:
    """One step's batch description for the Triton and C++ kernels, shared by all layers.

    Attributes (``S`` sequences, ``T`` rows of the flattened batch; device tensors):
        query_start_loc: ``[S + 1]`` int32, row offsets of each sequence's chunk.
        context_lens: ``[S]`` int32, tokens of each sequence once this step's K/V are written
            (0 for a padding row of a static decode batch).
        block_tables: ``[S, max_blocks]`` int32, physical block ids; a row is padded with its
            first block (0 for padding rows), never read past the context.
        slot_mapping: ``[T]`` int64, ``block * block_size + offset`` where each new token's
            K/V go; -1: write nothing (padding rows).

    Host values (no device sync to read them):
        max_query_len: the longest chunk; 1 means a pure decode step (the decode kernel).
        max_context_len: the longest context (sizes the decode splits).
        num_splits: decode context splits (:func:`choose_num_splits`).
        block_size, num_heads, num_kv_heads, head_dim: the cache geometry.
    """

    query_start_loc: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    max_query_len: int
    max_context_len: int
    num_splits: int
    block_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def decode_static(
        cls,
        max_batch: int,
        max_blocks_per_seq: int,
        device: torch.device | str,
        *,
        block_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        num_splits: int | None = None,
    ) -> VarlenMetadata:
        """Fixed decode buffers for ``max_batch`` sequences (one query row each), for a CUDA
        graph: capture with them, then :meth:`fill_decode` before every replay.

        All rows start as padding (context length 0, slot -1, block 0). ``num_splits``
        defaults to :func:`choose_num_splits` for ``max_batch`` sequences of
        ``max_blocks_per_seq * block_size`` tokens; it is fixed for the buffers' lifetime
        (the captured grid).

        Raises:
            ValueError: ``max_batch`` or ``max_blocks_per_seq`` < 1, or bad head counts.
        """
        if max_batch < 1 or max_blocks_per_seq < 1:
            raise ValueError(f"bad static decode size {max_batch} x {max_blocks_per_seq} blocks")
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}"
            )
        device = torch.device(device)
        max_len = max_blocks_per_seq * block_size
        if num_splits is None:
            num_splits = choose_num_splits(max_batch, num_kv_heads, max_len, device)
        return cls(
            query_start_loc=torch.arange(max_batch + 1, dtype=torch.int32, device=device),
            context_lens=torch.zeros(max_batch, dtype=torch.int32, device=device),
            block_tables=torch.zeros(
                (max_batch, max_blocks_per_seq), dtype=torch.int32, device=device
            ),
            slot_mapping=torch.full((max_batch,), -1, dtype=torch.int64, device=device),
            max_query_len=1,
            max_context_len=max_len,
            num_splits=num_splits,
            block_size=block_size,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
        )

    def fill_decode(
        self, context_lens: Sequence[int], block_tables: Sequence[Sequence[int]]
    ) -> None:
        """Rewrite the buffers of a :meth:`decode_static` batch in place for ``n`` live decode
        sequences: rows ``0 .. n - 1`` get them (``context_lens`` counts this step's token, whose
        slot is at position ``context_len - 1``), rows ``n ..`` become padding (context length
        0, slot -1). Copies are ``non_blocking`` host-to-device: no sync, graph-replay safe.

        Raises:
            ValueError: more sequences than rows, a context of 0, or a block table too short
                for its context or longer than the buffers' ``max_blocks_per_seq``.
        """
        max_batch, max_blocks = self.block_tables.shape
        n = len(context_lens)
        if len(block_tables) != n:
            raise ValueError("context_lens and block_tables must have one entry per sequence")
        if n > max_batch:
            raise ValueError(f"{n} sequences exceed the static batch of {max_batch}")
        bs = self.block_size
        used = []
        slots = []
        for c, bt in zip(context_lens, block_tables, strict=True):
            if c < 1 or len(bt) * bs < c:
                raise ValueError(f"bad decode row: context_len={c}, {len(bt)} blocks of {bs}")
            if -(-c // bs) > max_blocks:
                raise ValueError(f"context of {c} tokens exceeds {max_blocks} blocks of {bs}")
            used.append(-(-c // bs))
            slots.append(bt[(c - 1) // bs] * bs + (c - 1) % bs)
        pad = max_batch - n
        ctx = torch.tensor([*context_lens, *([0] * pad)], dtype=torch.int32)
        self.context_lens.copy_(ctx, non_blocking=True)
        slot_t = torch.tensor([*slots, *([-1] * pad)], dtype=torch.int64)
        self.slot_mapping.copy_(slot_t, non_blocking=True)
        # Only the live rows' used blocks come from Python lists; the padding (each row's
        # first block past its context, block 0 for padding rows) is filled by tensor ops.
        tables = torch.zeros((max_batch, max_blocks), dtype=torch.int32)
        if n:
            width = max(used)
            rows = [
                list(bt[:u]) + [bt[0]] * (width - u)
                for bt, u in zip(block_tables, used, strict=True)
            ]
            live = torch.tensor(rows, dtype=torch.int32)
            tables[:n, :width] = live
            tables[:n, width:] = live[:, :1]
        self.block_tables.copy_(tables, non_blocking=True)


def build_varlen_metadata(
    query_lens: Sequence[int],
    context_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    *,
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    device: torch.device | str,
) -> VarlenMetadata:
    """:class:`VarlenMetadata` for one step; arguments and errors as
    :func:`kernels.paged_attention.build_attention_metadata`.

    Raises:
        ValueError: inconsistent lengths, no sequence, ``num_heads`` not a multiple of
            ``num_kv_heads``, a bad chunk (``query_len < 1`` or ``context_len < query_len``),
            or a block table too short for its context.
    """
    n = len(query_lens)
    used = check_step(
        query_lens,
        context_lens,
        block_tables,
        block_size=block_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
    )
    max_blocks = max(used)
    tables = [
        list(bt[:u]) + [bt[0]] * (max_blocks - u) for bt, u in zip(block_tables, used, strict=True)
    ]
    starts = [0]
    slots: list[int] = []
    for q, c, bt in zip(query_lens, context_lens, block_tables, strict=True):
        starts.append(starts[-1] + q)
        slots.extend(bt[p // block_size] * block_size + p % block_size for p in range(c - q, c))
    device = torch.device(device)
    max_context_len = max(context_lens)

    def to_device(values: list[int] | list[list[int]], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

    return VarlenMetadata(
        query_start_loc=to_device(starts, torch.int32),
        context_lens=to_device(list(context_lens), torch.int32),
        block_tables=to_device(tables, torch.int32),
        slot_mapping=to_device(slots, torch.int64),
        max_query_len=max(query_lens),
        max_context_len=max_context_len,
        num_splits=choose_num_splits(n, num_kv_heads, max_context_len, device),
        block_size=block_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
    )


class VarlenMetadataBuilder:
    """``build_metadata`` for the attention backends whose kernels take :class:`VarlenMetadata`
    (Triton, the C++ CPU kernels)."""

    build_metadata = staticmethod(build_varlen_metadata)
