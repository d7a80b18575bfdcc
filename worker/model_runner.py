"""The worker's step executor: one flattened forward over the scheduled chunks, then sampling.

The runner owns the model and the KV pool. Sequences are :class:`SequenceData` records the
caller (the worker's gRPC server) keeps between steps: it appends sampled tokens and new block
ids to them; the runner never mutates ``token_ids`` or ``block_table``. Everything runs under
``torch.inference_mode()``. Thread counts (``torch.set_num_threads``) are the process's choice,
not the runner's. The runner's parts live beside it: :mod:`worker.model_setup` (device, dtype,
weights, linear kernels), :mod:`worker.kv_sizing` (the KV pool's size and allocation) and
:mod:`worker.step_inputs` (a step's chunks flattened into the forward's inputs).
"""

from __future__ import annotations

import logging
import pathlib
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sluiceway.kernels.backend import get_attention_backend
from sluiceway.kernels.kv_quant import check_kv_cache_backend, kv_cache_torch_dtype
from sluiceway.model_files import resolve_max_model_len, served_model_name
from sluiceway.sampling_params import SamplingParams
from sluiceway.speculative import SpeculativeConfig
from sluiceway.worker.draft import DraftModel
from sluiceway.worker.kv_sizing import (
    DEFAULT_CPU_KV_CACHE_MEMORY,
    KvPoolFactory,
    allocate_kv_pool,
    count_kv_blocks,
    kv_bytes_per_block,
    profile_cuda_kv_budget,
)
from sluiceway.worker.loader import load_config
from sluiceway.worker.model import LlamaForCausalLM, ModelConfig
from sluiceway.worker.model_setup import (
    load_or_check_model,
    packing_note,
    resolve_device,
    resolve_dtype,
    select_linear_kernels,
)
from sluiceway.worker.parallel import check_tensor_parallel, joined_group
from sluiceway.worker.prompt_logprobs import (
    PromptLogprobs,
    compute_prompt_logprobs,
    plan_prompt_logprobs,
)
from sluiceway.worker.quantized import plan_quantization
from sluiceway.worker.sampler import SamplerBuffers, sample
from sluiceway.worker.step_inputs import (
    ScheduledChunk,
    SequenceData,
    StepInputs,
    prepare_step_inputs,
)
from sluiceway.worker.structured_output import allow_all_bitmask, apply_token_bitmask
from sluiceway.worker.verify import SampledToken, SamplingRows, sampled_tokens, sampling_rows

if TYPE_CHECKING:
    from sluiceway.worker.cuda_graphs import DecodeCudaGraphs

__all__ = [
    "ModelRunner",
    "SampledToken",
    "ScheduledChunk",
    "SequenceData",
]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class StepTimings:
    """Where the last `ModelRunner.execute` spent its time, seconds.

    On CUDA kernels launch asynchronously, so `forward_s` holds launches and
    `sample_s` the wait for them; their sum is exact.
    """

    prepare_s: float = 0.0  # input tensors: ids, positions, slot mapping, block tables
    forward_s: float = 0.0  # model forward and logits of the sampling rows
    sample_s: float = 0.0  # sampling and copying tokens to the host


class ModelRunner:
    """Loads a model folder, owns the KV pool and executes steps.

    Args:
        model_dir: an HF folder (see :func:`sluiceway.model_files.resolve_model`).
        device: ``cpu``, ``cuda``, ``cuda:N`` or ``auto`` (CUDA when available).
        dtype: ``auto|float32|bfloat16|float16`` (see :func:`worker.model_setup.resolve_dtype`).
        block_size: tokens per KV block.
        kv_cache_memory: bytes for the KV pool. On CPU the default is 4 GiB; on CUDA, when None,
            the pool takes ``gpu_memory_utilization * total - used`` after a profiling forward.
        gpu_memory_utilization: fraction of the GPU this worker may use (CUDA only).
        max_model_len: cap on positions; None: the config's ``max_position_embeddings`` (more
            than that is refused; a sliding window is attention's, not a cap).
        max_num_batched_tokens: tokens of the CUDA profiling forward (beyond the base API).
        kv_pool_factory: ``(shape, dtype, device) -> tensor`` allocating the pool, e.g. in
            shared memory (beyond the base API); ``torch.empty`` when None.
        attention_backend: ``auto|torch|cpu|triton`` (:func:`kernels.backend.get_attention_backend`).
        tensor_parallel_rank, tensor_parallel_size: this runner's rank ``r`` of ``N`` (beyond
            the base API). With ``N > 1`` the caller first joins the group with
            :func:`worker.parallel.init_tensor_parallel`; the runner then loads only its shard
            (``Hkv / N`` KV heads in its pool), every rank must execute the same steps in the
            same order, and only rank 0 samples (see :meth:`execute`).
        kv_cache_dtype: ``auto`` (the pool in the model's dtype) or ``int8`` (values and
            per-token scales, :mod:`kernels.kv_quant`: about twice bfloat16's blocks in the
            same memory); with the Triton backend only its batch-invariant unified kernel
            reads int8 (refused with ``SLUICEWAY_BATCH_INVARIANT=0``); or ``fp8_e4m3`` (the same
            layout in float8 e4m3; torch and cpu backends only).
        speculative: a ``draft_model`` config loads its draft (:class:`worker.draft.DraftModel`,
            ``draft``: its KV pool has this pool's block count, the budget split by their
            bytes per block; a draft of this ``model_dir``'s own weights reads and writes
            this pool instead); any other config or None: no draft.
        draft_shares_kv: False keeps even a draft of the model's own weights in a pool of
            its own (beyond the base API; for tests of that path).
        enforce_eager: never run decode steps through CUDA graphs (vLLM's flag). Graphs are
            captured on CUDA with the Triton backend and one rank
            (:mod:`worker.cuda_graphs`); everywhere else steps run eagerly anyway.
        model: a decoder already built on ``device`` in the resolved ``dtype`` (beyond the base
            API; e.g. :func:`worker.loader.random_model` for ``sluiceway bench step
            --random-model``). The runner then reads no weights or config from ``model_dir``
            (only an optional ``sluiceway.json`` for the model id; the name of a folder that
            does not exist is fine): the config is ``model.config``, the model's rotary table
            must cover ``max_model_len`` and its tensor-parallel world must be the runner's.

    Attributes beyond the base API: ``model`` (:class:`worker.model.LlamaForCausalLM`),
    ``config`` (:class:`worker.model.ModelConfig`), ``kv_pool`` (the
    ``[num_layers, 2, num_blocks, Hkv, block_size * D]`` tensor, layout in
    :mod:`kernels.paged_attention`, ``Hkv`` the rank's KV heads), ``kv_dtype`` (the pool's
    dtype: the model's, or ``torch.int8``), ``bytes_per_block``,
    ``last_timings`` (:class:`StepTimings` of the last :meth:`execute`),
    ``last_prompt_logprobs`` (the :class:`worker.prompt_logprobs.PromptLogprobs` the last
    :meth:`execute` computed, on rank 0, for sequences that ask for them), ``tp``
    (:class:`worker.parallel.TensorParallelGroup`).

    Raises:
        worker.loader.ModelLoadError, worker.model.UnsupportedModelError: bad model folder.
        ValueError: a bad dtype or kv_cache_dtype, ``kv_cache_dtype='int8'`` with the Triton
            backend's non-batch-invariant kernels, a memory budget too small for one block, a ``max_model_len``
            above the model's (:func:`sluiceway.model_files.resolve_max_model_len`), or a model
            ``tensor_parallel_size`` cannot split (:func:`worker.parallel.check_tensor_parallel`).
        RuntimeError: ``tensor_parallel_size > 1`` without an initialised process group.
    """

    def __init__(
        self,
        model_dir: pathlib.Path,
        *,
        device: str = "cpu",
        dtype: str = "auto",
        quantization: str = "auto",
        block_size: int = 16,
        kv_cache_memory: int | None = None,
        gpu_memory_utilization: float = 0.9,
        max_model_len: int | None = None,
        max_num_batched_tokens: int = 2048,
        kv_pool_factory: KvPoolFactory | None = None,
        attention_backend: str = "auto",
        tensor_parallel_rank: int = 0,
        tensor_parallel_size: int = 1,
        enforce_eager: bool = False,
        model: LlamaForCausalLM | None = None,
        kv_cache_dtype: str = "auto",
        speculative: SpeculativeConfig | None = None,
        draft_shares_kv: bool = True,
    ) -> None:
        model_dir = pathlib.Path(model_dir)
        self.model_dir = model_dir
        self._device = resolve_device(device)
        self.last_timings = StepTimings()
        self.last_prompt_logprobs: list[PromptLogprobs] = []
        # kept between steps: a [B, V] scratch and bitmask are not made again every step
        self._sampler_buffers = SamplerBuffers()
        self._bitmask = torch.empty(0, 0, dtype=torch.int32)
        self.config: ModelConfig = load_config(model_dir) if model is None else model.config
        check_tensor_parallel(self.config, tensor_parallel_size)
        self.tp = joined_group(tensor_parallel_rank, tensor_parallel_size)
        self._dtype = resolve_dtype(dtype, self._device)
        self.kv_dtype = kv_cache_torch_dtype(kv_cache_dtype, self._dtype)
        self._block_size = block_size
        self._max_model_len = resolve_max_model_len(
            max_model_len, self.config.max_position_embeddings
        )
        self._model_id = served_model_name(model_dir)
        self.attention_backend = get_attention_backend(attention_backend, self._device)
        check_kv_cache_backend(self.kv_dtype, self.attention_backend)
        plan = plan_quantization(
            quantization, model_dir, num_layers=self.config.num_layers, device=self._device,
            dtype=self._dtype, backend=self.attention_backend, tp=self.tp,
        )  # fmt: skip
        self.model: LlamaForCausalLM = load_or_check_model(
            model_dir,
            model,
            dtype=self._dtype,
            device=self._device,
            max_model_len=self._max_model_len,
            tp=self.tp,
            skip=plan.skipped_names(),
        )
        self.model.attention_backend = self.attention_backend
        self.quantization = plan.apply(self.model)
        # before the CUDA profiling forward and the graph capture, which run the model
        select_linear_kernels(self.model, self.attention_backend, self._dtype)
        # (its weights before CUDA's profile)
        self.draft = self._load_draft(speculative, None if model else model_dir, draft_shares_kv)
        hkv = self.model.num_kv_heads  # the rank's
        self.bytes_per_block = kv_bytes_per_block(self.config, hkv, block_size, self.kv_dtype)
        draft_bytes = self.draft.bytes_per_block if self.draft is not None else 0
        if kv_cache_memory is None:
            if self._device.type == "cuda":
                kv_cache_memory = profile_cuda_kv_budget(
                    self.model,
                    self.attention_backend,
                    dtype=self.kv_dtype,
                    device=self._device,
                    block_size=block_size,
                    max_model_len=self._max_model_len,
                    max_num_batched_tokens=max_num_batched_tokens,
                    utilization=gpu_memory_utilization,
                )
            else:
                kv_cache_memory = DEFAULT_CPU_KV_CACHE_MEMORY
        self._num_blocks = count_kv_blocks(
            kv_cache_memory, self.bytes_per_block + draft_bytes, self.tp
        )
        self.kv_pool = allocate_kv_pool(
            kv_pool_factory,
            self.config,
            num_blocks=self._num_blocks,
            block_size=block_size,
            num_kv_heads=hkv,
            dtype=self.kv_dtype,
            device=self._device,
        )
        self._kv_caches = list(self.kv_pool.unbind(0))
        if self.draft is not None:
            self.draft.attach_pool(self._num_blocks, self._kv_caches)
        self.cuda_graphs = None if enforce_eager else self._capture_cuda_graphs()
        self._log_start()

    def _load_draft(
        self, speculative: SpeculativeConfig | None, weights: pathlib.Path | None, share_kv: bool
    ) -> DraftModel | None:
        """The draft model of a ``draft_model`` config, on this runner's device, dtype,
        backend and KV dtype (the model's own KV pool when it is the model's ``weights``
        folder and ``share_kv``); None for any other config."""
        if speculative is None or speculative.method != "draft_model":
            return None
        draft = DraftModel(
            speculative, vocab_size=self.config.vocab_size, max_model_len=self._max_model_len,
            device=self._device, dtype=self._dtype, kv_dtype=self.kv_dtype,
            backend=self.attention_backend, block_size=self._block_size, tp=self.tp,
            target_dir=weights, share_kv=share_kv,
        )  # fmt: skip
        if draft.shares_kv:
            log.info("draft model %s (%s): the model's own weights, it reads the model's K/V",
                     draft.model_dir, draft.quantization)  # fmt: skip
        else:
            log.info("draft model %s (%s): %d KV bytes a block beside the model's",
                     draft.model_dir, draft.quantization, draft.bytes_per_block)  # fmt: skip
        return draft

    def _capture_cuda_graphs(self) -> DecodeCudaGraphs | None:
        """The decode forward's CUDA graphs, on CUDA with the Triton backend and one rank;
        None elsewhere (steps run eagerly)."""
        if not (
            self._device.type == "cuda"
            and self.attention_backend.name == "triton"
            and self.tp.world_size == 1
        ):
            return None
        from sluiceway.worker.cuda_graphs import DecodeCudaGraphs

        return DecodeCudaGraphs(
            self.model,
            self._kv_caches,
            max_blocks_per_seq=-(-self._max_model_len // self._block_size),
            block_size=self._block_size,
        )

    def _log_start(self) -> None:
        """The start line: model, dtype, device, KV pool, kernels."""
        log.info(
            "model %s: %s on %s, %d KV blocks of %d tokens (%s, %d bytes each), max_model_len "
            "%d, attention backend %s%s, %s",
            self._model_id,
            self._dtype,
            self._device,
            self._num_blocks,
            self._block_size,
            self.kv_dtype,
            self.bytes_per_block,
            self._max_model_len,
            self.attention_backend.name,
            packing_note(self.model),
            "batch invariant" if self.batch_invariant else "not batch invariant",
        )

    # -- properties -----------------------------------------------------------------------

    @property
    def batch_invariant(self) -> bool:
        """Whether every reduction of this runner's forward has an order fixed per row: the C++
        CPU attention and fused ops with every linear and the logits on
        :func:`kernels.cpu_ops.bf16_linear` (bfloat16 on a CPU with AVX512-BF16) or on
        :func:`kernels.cpu_ops.quant_linear` (``--quantization gguf``, float32 too); or, in
        bfloat16 with the Triton backend (CUDA; the interpreter in tests), the unified
        attention kernel with the Triton matmul and RMSNorm (:meth:`LlamaForCausalLM.use_triton_ops`),
        on one rank (NCCL's all-reduce orders its sums by the tensor's size). Not oneDNN's
        GEMMs (their reduction follows the shape), not the torch reference, not cuBLAS linears
        (``SLUICEWAY_BATCH_INVARIANT=0``; README, Reproducibility)."""
        if not self.attention_backend.batch_invariant:
            return False
        if self.model.bf16_pairs or self.model.all_linears_quantized():
            return True
        triton_ok = self._device.type != "cuda" or self.tp.world_size == 1
        return self.model.triton_ops is not None and triton_ok

    @property
    def model_id(self) -> str:
        """The model's name (:func:`sluiceway.model_files.served_model_name`)."""
        return self._model_id

    @property
    def num_kv_blocks(self) -> int:
        """Blocks in the KV pool: ``kv_cache_memory // bytes_per_block``."""
        return self._num_blocks

    @property
    def block_size(self) -> int:
        """Tokens per KV block."""
        return self._block_size

    @property
    def max_model_len(self) -> int:
        """The longest sequence (prompt + output) this runner accepts, in tokens."""
        return self._max_model_len

    @property
    def vocab_size(self) -> int:
        """Width of the logits."""
        return self.config.vocab_size

    @property
    def eos_token_ids(self) -> list[int]:
        """End-of-sequence ids from ``generation_config.json`` and ``config.json``."""
        return list(self.config.eos_token_ids)

    @property
    def dtype(self) -> torch.dtype:
        """The weights' dtype (the KV pool's too unless ``kv_dtype`` is ``torch.int8``)."""
        return self._dtype

    @property
    def device(self) -> torch.device:
        """Where the model runs."""
        return self._device

    @property
    def parameter_bytes(self) -> int:
        """Bytes of this rank's parameters (its shard with tensor parallelism; a tied
        embedding counted once; GGUF blocks as held)."""
        plain = sum(p.numel() * p.element_size() for p in self.model.parameters())
        return plain + self.model.packed_weight_bytes + self.model.quantized_bytes()

    def weight_bytes(self) -> int:
        """Bytes of weights this rank holds (the ``model_weight_bytes`` gauge): the parameters,
        the packed copies of the linear weights, the logits' packed copy beside the embedding
        and the GGUF blocks (``--quantization gguf``)."""
        weights = sum(t.numel() * t.element_size() for t in self.model.state_dict().values())
        weights += self.model.packed_weight_bytes + self.model.quantized_bytes()
        return weights + self.model.packed_lm_head_bytes

    def device_memory_used_bytes(self) -> int:
        """Bytes this worker holds on its device: torch's allocated bytes on CUDA; on CPU the
        weights and the KV pool (activations come and go within a step)."""
        if self._device.type == "cuda":
            return int(torch.cuda.memory_allocated(self._device))
        return int(self.weight_bytes() + self.kv_pool.numel() * self.kv_pool.element_size())

    # -- sequences and steps ----------------------------------------------------------------

    def make_sequence(
        self,
        seq_id: int,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        num_prompt_tokens: int | None = None,
    ) -> SequenceData:
        """A new record with an empty block table (and a seeded generator when ``sampling.seed``
        is set).

        ``num_prompt_tokens`` (default: all of them) is the original prompt's length when
        ``prompt_token_ids`` also holds generated tokens: a preempted sequence recomputed. A
        seeded generator then skips the draws those tokens used, so the sequence samples as if
        it had never been preempted.

        Raises:
            ValueError: an empty prompt, a prompt longer than ``max_model_len`` or token ids out
                of the vocabulary.
        """
        if not prompt_token_ids:
            raise ValueError(f"sequence {seq_id}: empty prompt")
        if len(prompt_token_ids) > self._max_model_len:
            raise ValueError(
                f"sequence {seq_id}: prompt of {len(prompt_token_ids)} tokens exceeds "
                f"max_model_len {self._max_model_len}"
            )
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= self.vocab_size:
            raise ValueError(f"sequence {seq_id}: token id outside [0, {self.vocab_size})")
        n_prompt = len(prompt_token_ids) if num_prompt_tokens is None else num_prompt_tokens
        if not 0 < n_prompt <= len(prompt_token_ids):
            raise ValueError(
                f"sequence {seq_id}: num_prompt_tokens {n_prompt} outside "
                f"[1, {len(prompt_token_ids)}]"
            )
        generator = None
        if sampling.seed is not None:
            generator = torch.Generator(device=self._device)
            generator.manual_seed(sampling.seed)
            if sampling.temperature > 0:  # one uniform per sampled token (see worker.sampler)
                for _ in range(len(prompt_token_ids) - n_prompt):
                    torch.rand(1, generator=generator, device=self._device)
        return SequenceData(seq_id, list(prompt_token_ids), [], sampling, generator, n_prompt)

    def execute(self, chunks: list[ScheduledChunk]) -> list[SampledToken]:
        """Run one step: a single flattened forward over all chunks, logits for the chunks that
        reach the end of their sequence, sampling on the device.

        Where the forward is batch invariant (:attr:`batch_invariant`: a row's logits do not
        depend on the other rows of the step, on how its prompt was chunked or on whether its
        prefix's K/V came from the prefix cache) every sequence shares the one forward.
        Elsewhere a seeded sequence that samples (temperature > 0) runs in a forward of its
        own, so that its tokens at least do not depend on the batch.

        With tensor parallelism every rank must call it with the same chunks (same
        sequences, positions, block tables and sampling options), in the same order of steps:
        the forward runs collectives.

        A chunk with proposed tokens (``num_draft_tokens``, speculative decoding) samples each
        of its positions and emits those :mod:`worker.verify` accepts: the tokens plain
        decoding gives (it needs a batch-invariant forward; the worker's server checks).

        Returns:
            One :class:`SampledToken` per sampling chunk (a chunk with proposals: one per
            token it emits, in order), in chunk order, on rank 0; an empty list on the other
            ranks. The caller appends the tokens to the sequences (on every rank).

        Raises:
            ValueError: an inconsistent chunk (see :meth:`_prepare`).
        """
        timings = self.last_timings = StepTimings()
        self.last_prompt_logprobs = []
        if self.draft is not None:  # its proposals join the records (worker.draft)
            t0 = time.perf_counter()
            with torch.inference_mode():
                self.draft.propose(chunks)
            timings.forward_s += time.perf_counter() - t0
        if self.batch_invariant:
            return self._execute_batch(chunks, timings)
        isolated: list[ScheduledChunk] = []
        shared: list[ScheduledChunk] = []
        for c in chunks:
            seeded = c.seq.sampling.seed is not None and c.seq.sampling.temperature > 0
            (isolated if seeded else shared).append(c)
        if not isolated or (not shared and len(isolated) == 1):
            return self._execute_batch(chunks, timings)
        by_seq = {t.seq_id: t for t in self._execute_batch(shared, timings)}
        for chunk in isolated:
            by_seq.update((t.seq_id, t) for t in self._execute_batch([chunk], timings))
        return [by_seq[c.seq.seq_id] for c in chunks if c.seq.seq_id in by_seq]

    def _execute_batch(
        self, chunks: list[ScheduledChunk], timings: StepTimings
    ) -> list[SampledToken]:
        """One flattened forward over `chunks` and its sampling; adds to `timings`."""
        if not chunks:
            return []
        with torch.inference_mode():
            t0 = time.perf_counter()
            graph = self.cuda_graphs
            if graph is not None and self._is_graph_decode(chunks, graph):
                sampling = list(range(len(chunks)))
                rows = sampling_rows(chunks, sampling, sampling)
                t1 = time.perf_counter()
                selected = graph.run(
                    [c.seq.token_ids[c.num_computed_tokens] for c in chunks],
                    [c.num_computed_tokens for c in chunks],
                    [c.seq.block_table for c in chunks],
                )
            else:
                inputs = self._prepare(chunks)
                sampling = inputs.sampling
                t1 = time.perf_counter()
                hidden = self._forward(inputs)
                plan = plan_prompt_logprobs(chunks, inputs.row_start)
                if plan is not None:  # a prompt's own logits, before the sampling rows'
                    prompt = compute_prompt_logprobs(
                        self.model, hidden, plan, self._sampler_buffers
                    )
                    self.last_prompt_logprobs.extend(prompt)
                if not sampling:
                    timings.prepare_s += t1 - t0
                    timings.forward_s += time.perf_counter() - t1
                    return []
                rows = sampling_rows(chunks, sampling, inputs.row_start)
                rows_t = torch.tensor(rows.hidden_rows, dtype=torch.int64, device=self._device)
                selected = hidden.index_select(0, rows_t)
            timings.prepare_s += t1 - t0
            fused = self.attention_backend.fused_layer_ops  # the sampler converts if needed
            logits = self.model.compute_logits(
                selected, dst=0, float32=not fused, reuse_buffer=True
            )
            t2 = time.perf_counter()
            timings.forward_s += t2 - t1
            if logits is None:  # a tensor-parallel rank other than 0: rank 0 samples
                return []
            seqs = rows.seqs
            if any(s.constraint is not None for s in seqs):
                logits = self._mask_logits(logits, rows)
            result = sample(
                logits,
                [s.sampling for s in seqs],
                [s.generator for s in seqs],
                rows.seen,
                [s.num_prompt_tokens for s in seqs],
                cpu_kernels=fused,
                buffers=self._sampler_buffers,
            )
            out = sampled_tokens(chunks, sampling, rows, result)
            timings.sample_s += time.perf_counter() - t2
        return out

    def _mask_logits(self, logits: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
        """``logits`` (``[R, V]``) as float32 with every token the grammar of a row's
        sequence does not allow next set to ``-inf`` (a chunk with proposals: each row after
        the proposals before it, :meth:`ConstraintMatcher.fill_along`). The bitmask is kept
        between steps: a matcher writes its whole rows, the other rows are not read."""
        logits = logits.float()
        num_rows, vocab = logits.shape
        if self._bitmask.shape[0] < num_rows or self._bitmask.shape[1] != (vocab + 31) // 32:
            self._bitmask = allow_all_bitmask(num_rows, vocab)
        constrained: list[int] = []
        for first, drafts in rows.chunk_rows:
            matcher = rows.seqs[first].constraint
            if matcher is None:
                continue
            matcher.fill_along(self._bitmask, first, drafts)
            constrained += range(first, first + len(drafts) + 1)
        apply_token_bitmask(logits, self._bitmask[:num_rows], constrained)
        return logits

    def _is_graph_decode(self, chunks: list[ScheduledChunk], graph: DecodeCudaGraphs) -> bool:
        """Whether the step is decodes only (one new token each, the last of its sequence,
        within the sequence's blocks) and fits a captured graph."""
        bs = self._block_size
        return len(chunks) <= graph.max_batch and all(
            c.num_new_tokens == 1
            and c.num_computed_tokens + 1 == len(c.seq.token_ids) <= self._max_model_len
            and len(c.seq.block_table) * bs > c.num_computed_tokens
            for c in chunks
        )

    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        return self.model(inputs.input_ids, inputs.positions, inputs.metadata, self._kv_caches)

    def _prepare(self, chunks: Sequence[ScheduledChunk]) -> StepInputs:
        """The chunks flattened into the forward's inputs (:func:`worker.step_inputs.prepare_step_inputs`).

        Raises:
            ValueError: a bad chunk (:func:`worker.step_inputs.check_chunks`).
        """
        return prepare_step_inputs(
            chunks,
            self.attention_backend,
            block_size=self._block_size,
            max_model_len=self._max_model_len,
            num_heads=self.model.num_heads,
            num_kv_heads=self.model.num_kv_heads,
            head_dim=self.config.head_dim,
            device=self._device,
        )
