"""The draft model of speculative decoding (`--speculative-config` with ``"method":
"draft_model"``): a second, cheaper model with the target's vocabulary that proposes its
greedy tokens (Leviathan et al., "Fast Inference from Transformers via Speculative Decoding",
ICML 2023). The target verifies them as it verifies n-gram proposals (:mod:`worker.verify`),
so what the draft proposes changes how many tokens a step emits, never which.

A draft that is the target's own weights in another quantization (the same model folder,
e.g. the embedded GGUF as ``gguf_a8`` drafting for its ``none`` bfloat16 copy) reads and
writes the target's KV pool, as QSpec does (Zhao et al., "QSpec: Speculative Decoding with
Complementary Quantization Schemes", EMNLP 2025, arXiv 2410.11305): the target's K/V of the
sequence so far stand in for the draft's own, so a proposal computes one position per
proposed token and nothing else. The draft writes its K/V at the positions it proposes
from, which the target's verifying forward of the same step writes again before any
attention reads them (each layer writes its step's K/V, then attends:
:mod:`kernels.backend`), so the target only ever reads its own K/V.

Any other draft keeps its K/V in a pool of its own with the target pool's number of blocks,
indexed by the target's block table: the scheduler's block manager hands out both at once (a
block id holds a position's K/V in each pool), and the KV budget is split in proportion to
their bytes per block. It computes lazily: each sequence's :class:`DraftState` says up to
which position its draft K/V hold the sequence's own tokens, and a proposal first computes
the positions from there to the last token (the whole prompt the first time, or after a
preemption, a prefix-cache hit, a disaggregated hand-off or a stream resume: none of those
carry draft K/V), then one position per further proposed token.
"""

from __future__ import annotations

import pathlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from sluiceway.kernels.backend import AttentionBackend
from sluiceway.model_files import resolve_model
from sluiceway.speculative import SpeculativeConfig
from sluiceway.worker.kv_sizing import allocate_kv_pool, kv_bytes_per_block
from sluiceway.worker.loader import load_config
from sluiceway.worker.model import LlamaForCausalLM, ModelConfig
from sluiceway.worker.model_setup import load_or_check_model, select_linear_kernels
from sluiceway.worker.parallel import TensorParallelGroup
from sluiceway.worker.quantized import plan_quantization
from sluiceway.worker.step_inputs import ScheduledChunk, SequenceData, prepare_step_inputs

__all__ = ["DraftModel", "DraftState"]


@dataclass(slots=True)
class DraftState:
    """A sequence's draft K/V: positions ``[0, computed)`` hold the draft's K/V of the
    sequence's tokens as they were at the last proposal, whose tokens ``proposed`` followed
    position ``base`` (the sequence's length then). The tokens accepted since are the
    prefix of ``proposed`` that the sequence now has at ``base``."""

    computed: int = 0
    base: int = 0
    proposed: list[int] = field(default_factory=list)

    def valid(self, token_ids: Sequence[int]) -> int:
        """Positions of ``token_ids`` whose draft K/V are right: up to ``base`` plus the
        accepted proposals the draft computed (all but the last proposed token's)."""
        accepted = 0
        limit = min(len(self.proposed) - 1, len(token_ids) - self.base)
        while accepted < limit and token_ids[self.base + accepted] == self.proposed[accepted]:
            accepted += 1
        return min(self.computed, self.base + accepted) if self.proposed else self.computed


class DraftModel:
    """A loaded draft (``config.model``, with ``config.quantization``) for a target of
    ``vocab_size`` tokens and ``max_model_len`` positions, on the target's device, dtype,
    attention backend and KV dtype. :meth:`attach_pool` once the block count is known.

    ``target_dir``: the target's model folder (None: weights not read from a folder; the
    same folder holds the same config.json). ``shares_kv`` (the attribute) is whether the draft uses the
    target's pool: a draft from the same folder does unless ``share_kv=False`` (a pool of its
    own, as any other draft has; beyond vLLM's config, for tests).

    Raises:
        ValueError: tensor parallelism (not built), a vocabulary other than the target's, a
            context shorter than ``max_model_len``, or what loading the model raises.
    """

    def __init__(
        self,
        config: SpeculativeConfig,
        *,
        vocab_size: int,
        max_model_len: int,
        device: torch.device,
        dtype: torch.dtype,
        kv_dtype: torch.dtype,
        backend: AttentionBackend,
        block_size: int,
        tp: TensorParallelGroup,
        target_dir: pathlib.Path | None,
        share_kv: bool = True,
    ) -> None:
        if tp.world_size > 1:
            raise ValueError("speculative_config: draft_model needs tensor_parallel_size 1")
        try:
            model_dir = resolve_model(config.model)
        except ValueError as e:  # (a path that is missing or not a model)
            raise ValueError(f"speculative_config.model: {e}") from None
        self.config: ModelConfig = load_config(model_dir)
        if self.config.vocab_size != vocab_size:
            raise ValueError(f"speculative_config.model: the draft's vocabulary has "
                             f"{self.config.vocab_size} tokens, the model's {vocab_size}")  # fmt: skip
        if self.config.max_position_embeddings < max_model_len:
            raise ValueError(
                f"speculative_config.model: the draft's context "
                f"({self.config.max_position_embeddings}) is shorter than max_model_len "
                f"{max_model_len}"
            )
        plan = plan_quantization(
            config.quantization, model_dir, num_layers=self.config.num_layers, device=device,
            dtype=dtype, backend=backend, tp=tp,
        )  # fmt: skip
        self.model: LlamaForCausalLM = load_or_check_model(
            model_dir, None, dtype=dtype, device=device, max_model_len=max_model_len, tp=tp,
            skip=plan.skipped_names(),
        )  # fmt: skip
        self.model.attention_backend = backend
        self.quantization = plan.apply(self.model)
        select_linear_kernels(self.model, backend, dtype)
        self.model_dir = pathlib.Path(model_dir)
        self._backend = backend
        self._device = device
        self._kv_dtype = kv_dtype
        self._block_size = block_size
        self._max_model_len = max_model_len
        same_weights = target_dir is not None and self.model_dir.resolve() == target_dir.resolve()
        self.shares_kv = share_kv and same_weights
        self.bytes_per_block = 0 if self.shares_kv else kv_bytes_per_block(
            self.config, self.model.num_kv_heads, block_size, kv_dtype
        )  # fmt: skip
        self._kv_caches: list[torch.Tensor] = []

    def attach_pool(self, num_blocks: int, target_caches: Sequence[torch.Tensor]) -> None:
        """The draft's K/V: the target's per-layer caches ``target_caches`` when it shares
        them, else a pool of its own of ``num_blocks`` blocks (the target pool's count)."""
        if self.shares_kv:
            self._kv_caches = list(target_caches)
            return
        pool = allocate_kv_pool(
            None,
            self.config,
            num_blocks=num_blocks,
            block_size=self._block_size,
            num_kv_heads=self.model.num_kv_heads,
            dtype=self._kv_dtype,
            device=self._device,
        )
        self._kv_caches = list(pool.unbind(0))

    def propose(self, chunks: Sequence[ScheduledChunk]) -> None:
        """Appends to each chunk's record its ``num_model_drafts`` greedy draft tokens (and
        counts them in the chunk's ``num_draft_tokens``, which the caller takes off the
        record after the step). One forward per proposed token, over every chunk still
        proposing; the first one also computes each record's positions the draft has not
        (:meth:`DraftState.valid`). Call it under ``torch.inference_mode()``.

        Raises:
            ValueError: a chunk whose proposal does not fit its block table or
                ``max_model_len`` (:func:`worker.step_inputs.check_chunks`).
        """
        todo = [c for c in chunks if c.num_model_drafts > 0]
        if not todo:
            return
        starts = [self._start(c.seq) for c in todo]
        first = [ScheduledChunk(c.seq, start, len(c.seq.token_ids) - start)
                 for c, start in zip(todo, starts, strict=True)]  # fmt: skip
        bases = [len(c.seq.token_ids) for c in todo]
        self._append(todo, self._greedy(first))
        for j in range(1, max(c.num_model_drafts for c in todo)):
            going = [c for c in todo if c.num_model_drafts > j]
            shares = [ScheduledChunk(c.seq, len(c.seq.token_ids) - 1, 1) for c in going]
            self._append(going, self._greedy(shares))
        if self.shares_kv:
            return  # (no DraftState: the target's K/V are the draft's)
        for c, base in zip(todo, bases, strict=True):
            state = c.seq.draft
            assert state is not None
            state.base, state.proposed = base, c.seq.token_ids[base:]
            state.computed = len(c.seq.token_ids) - 1  # the last proposal's K/V: not computed

    def _start(self, seq: SequenceData) -> int:
        """The first position the draft computes for ``seq``: its first position without
        the draft's K/V, at most the last token (whose logits propose). With the target's
        pool, the last token: the target holds the K/V of every token before it."""
        if self.shares_kv:
            return len(seq.token_ids) - 1
        seq.draft = seq.draft or DraftState()
        return min(seq.draft.valid(seq.token_ids), len(seq.token_ids) - 1)

    @staticmethod
    def _append(chunks: Sequence[ScheduledChunk], tokens: Sequence[int]) -> None:
        for c, token in zip(chunks, tokens, strict=True):
            c.seq.token_ids.append(token)  # (not SequenceData.append: no grammar moves)
            c.num_draft_tokens += 1

    def _greedy(self, shares: Sequence[ScheduledChunk]) -> list[int]:
        """The draft's forward over ``shares`` (their K/V written to the draft's pool) and
        its greedy token after each share's last position."""
        inputs = prepare_step_inputs(
            shares,
            self._backend,
            block_size=self._block_size,
            max_model_len=self._max_model_len,
            num_heads=self.model.num_heads,
            num_kv_heads=self.model.num_kv_heads,
            head_dim=self.config.head_dim,
            device=self._device,
        )
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.metadata, self._kv_caches)
        last = [inputs.row_start[i] + s.num_new_tokens - 1 for i, s in enumerate(shares)]
        rows = hidden.index_select(0, torch.tensor(last, dtype=torch.int64, device=self._device))
        logits = self.model.compute_logits(rows, float32=True)
        return logits.argmax(dim=-1).tolist()
