"""The decoder in plain torch over the paged KV pool: Llama 2/3, Mistral, Qwen2/3, Phi-3, SmolLM (the
Llama block, :class:`DecoderLayer`) and Gemma 3 (:class:`worker.gemma3.Gemma3DecoderLayer`).

One forward runs a flattened varlen batch (prefill chunks and decode tokens back to back, no
padding in the linear layers). Q/K/V are one fused matmul, gate/up another. Parameter names are
our own (``qkv_weight``, ``gate_up_weight`` ...); :mod:`worker.loader` maps HF checkpoints onto them.
The block's shared half (linear kernels, q/k norm, RoPE, paged attention with the layer's
window) is :class:`worker.layers.AttentionBlock`; the config is :mod:`worker.model_config`.

With tensor parallelism (:mod:`worker.parallel`, Megatron-LM sharding, Shoeybi et al. 2019) a
model holds only its rank's shard of ``N``: ``Hq / N`` query and ``Hkv / N`` KV heads, ``I / N``
intermediate columns and ``ceil(V / N)`` vocabulary rows; the o and down projections and the
embedding end in an all-reduce, the logits in a gather. Shapes below are per rank; with
``N == 1`` they are the whole model and no collective runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, overload

import torch
import torch.nn.functional as F
from torch import nn

from sluiceway.kernels import cpu_ops, onednn_linear
from sluiceway.kernels.backend import AttentionBackend, TorchAttentionBackend
from sluiceway.kernels.quant_pack import QuantWeight
from sluiceway.worker.layer_stack import LayerStack, build_layer_stack
from sluiceway.worker.layers import (
    LINEAR_WEIGHTS,
    AttentionBlock,
    RopeInputs,
    TritonOps,
    add_rms_norm,
    param,
)
from sluiceway.worker.layers import apply_rope as _apply_rope
from sluiceway.worker.layers import rms_norm as _rms_norm
from sluiceway.worker.model_config import ModelConfig, UnsupportedModelError, rope_inv_freq
from sluiceway.worker.parallel import TensorParallelGroup

__all__ = [
    "LINEAR_WEIGHTS",
    "DecoderLayer",
    "LlamaForCausalLM",
    "ModelConfig",
    "RopeInputs",
    "UnsupportedModelError",
    "rope_inv_freq",
]
_ = (_apply_rope, _rms_norm)  # re-exported for the kernel tests


class DecoderLayer(AttentionBlock):
    """Pre-norm attention + SwiGLU MLP block (Llama, Mistral, Qwen2/3): the parameters of
    :class:`worker.layers.AttentionBlock` and ``input_norm``/``post_norm`` ``[H]``.

    Raises:
        ValueError: ``tp.world_size`` does not divide the heads or the intermediate size.
    """

    def __init__(
        self, config: ModelConfig, tp: TensorParallelGroup | None = None, layer: int = 0
    ) -> None:
        super().__init__(config, layer, tp)
        self.input_norm = param(config.hidden_size)
        self.post_norm = param(config.hidden_size)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rope: RopeInputs,
        kv_cache: torch.Tensor,
        metadata: Any,
        backend: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer, vLLM's residual convention: ``hidden`` ``[T, H]`` is the previous
        layer's MLP output (the embeddings, with ``residual`` None, for the first layer) and
        ``residual`` ``[T, H]`` the residual stream before it; returns this layer's MLP
        output and the residual stream before it. Writes this step's K/V into ``kv_cache``.

        ``kv_cache`` is this layer's ``[2, num_blocks, Hkv, block_size * D]``, ``metadata``
        what ``backend.build_metadata`` returned for the step. With ``backend.fused_layer_ops``
        the elementwise work runs through the fused C++ ops (:mod:`kernels.cpu_ops`), which
        may overwrite ``hidden`` and ``residual`` in place. With ``N > 1`` all ranks must
        call it together (two all-reduces).
        """
        fused = backend.fused_layer_ops
        ops = self.triton_ops
        x, residual = add_rms_norm(hidden, residual, self.input_norm, self.eps, fused, ops)
        hidden = self.attention(x, rope, kv_cache, metadata, backend)
        x, residual = add_rms_norm(hidden, residual, self.post_norm, self.eps, fused, ops)
        gate_up = self.linear(x, "gate_up_weight", self.gate_up_bias)
        if fused:
            act = cpu_ops.silu_and_mul(gate_up)
        else:
            act = F.silu(gate_up[:, : self.intermediate]) * gate_up[:, self.intermediate :]
        return self.row_parallel_linear(act, "down_weight", self.down_bias), residual


def _make_layer(config: ModelConfig, layer: int, tp: TensorParallelGroup) -> AttentionBlock:
    """The block of ``config``'s family for layer ``layer``."""
    if config.model_type == "gemma3":
        from sluiceway.worker.gemma3 import Gemma3DecoderLayer

        return Gemma3DecoderLayer(config, layer, tp)
    return DecoderLayer(config, tp, layer)


class LlamaForCausalLM(nn.Module):
    """The decoder. Create with :func:`worker.loader.load_model`, which fills the weights.

    Parameters: ``embed_weight`` ``[Vs, H]``, ``layers`` (:class:`DecoderLayer`),
    ``norm_weight`` ``[H]``, ``lm_head_weight`` ``[Vs, H]`` (None when tied: the logits use
    ``embed_weight``), where ``Vs = ceil(V / N)`` rows hold token ids
    ``tp.vocab_range(V)`` and zeros past ``V`` (``Vs = V`` without tensor parallelism).
    Rotary tables ``rope_cos``/``rope_sin`` (and, for a model whose sliding layers have their
    own base, ``rope_tables["local"]``) are plain float32 attributes (not buffers), so
    ``.to(dtype)`` leaves them alone; see :meth:`init_rope`. Gemma 3 scales the embeddings by
    ``sqrt(H)`` rounded to the model dtype (as transformers), and a config's
    ``final_logit_softcapping`` caps the logits (``cap * tanh(logits / cap)``, float32). ``num_heads``/``num_kv_heads``
    are the rank's head counts (the KV pool's ``Hkv``), ``tp`` its
    :class:`worker.parallel.TensorParallelGroup`.
    """

    def __init__(
        self,
        config: ModelConfig,
        max_positions: int | None = None,
        tp: TensorParallelGroup | None = None,
    ) -> None:
        """Build with uninitialized float32 CPU parameters, at the shard sizes of ``tp``
        (default: one rank, the whole model).

        ``max_positions`` bounds the rotary table (default ``config.max_position_embeddings``).

        Raises:
            ValueError: ``tp.world_size`` does not divide the heads or the intermediate size
                (see :func:`worker.parallel.check_tensor_parallel`).
        """
        super().__init__()
        self.config = config
        self.tp = tp = tp or TensorParallelGroup()
        self.num_kv_heads = tp.shard(config.num_kv_heads, "KV heads (num_key_value_heads)")
        self.num_heads = tp.shard(config.num_heads, "attention heads (num_attention_heads)")
        vocab_rows = tp.vocab_shard_size(config.vocab_size)
        self.embed_weight = param(vocab_rows, config.hidden_size)
        self.layers = nn.ModuleList(_make_layer(config, i, tp) for i in range(config.num_layers))
        self.norm_weight = param(config.hidden_size)
        self.lm_head_weight = (
            None if config.tie_word_embeddings else param(vocab_rows, config.hidden_size)
        )
        self.gemma = config.model_type == "gemma3"
        self.max_positions = max_positions or config.max_position_embeddings
        self.rope_cos = torch.empty(0)
        self.rope_sin = torch.empty(0)
        # rope key ("global", "local") -> (cos, sin) tables; "global" is rope_cos/rope_sin
        self.rope_tables: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._final_norm_scale: torch.Tensor | None = None  # Gemma's 1 + w, float32
        self.init_rope()
        # Paged attention and the KV scatter; the worker sets the one it chose at start.
        self.attention_backend: AttentionBackend = TorchAttentionBackend()
        # --quantization gguf (worker.quantized): the embedding's / logits' GGUF blocks
        self.quant_embed: QuantWeight | None = None
        self.quant_lm_head: QuantWeight | None = None
        self.packed_lm_head: torch.Tensor | None = None  # see pack_linear_weights
        self.packed_lm_head_bytes = 0
        # bfloat16 with AVX512-BF16: the packed weights are pack_bf16_pairs' (else oneDNN's)
        self.bf16_pairs = False
        self._logits_buffer = torch.empty(0)  # compute_logits(reuse_buffer=True) writes here
        self.packed_weight_bytes = 0  # bytes of the plain weights freed by pack_linear_weights
        self.triton_ops: TritonOps | None = None  # see use_triton_ops
        # the layers as one C++ call on the backend it was built for (see _layer_stack)
        self._stack: LayerStack | None = None
        self._stack_backend: AttentionBackend | None = None
        # True: the per-layer path even where the stack applies (bench step --prefill-tokens
        # profiles it: one profiler entry per kernel; the same hidden states bitwise)
        self.per_layer_calls = False

    def use_triton_ops(self) -> None:
        """Run every linear layer and the logits on :func:`kernels.triton_matmul.triton_linear`
        and every RMSNorm on :mod:`kernels.triton_norm` (one tile config whatever the batch,
        one reduction order per row: with the batch-invariant Triton attention the forward
        is batch invariant; float32 logits straight from the float32 accumulator). For CUDA
        (or CPU tensors in Triton's interpreter, tests); the weights stay as they are.
        Not for Gemma 3: its (1 + w) norms have no Triton kernel yet, so it stays on torch's
        ops (and the runner does not call itself batch invariant)."""
        if self.gemma:
            return
        ops = TritonOps.load()
        self.triton_ops = ops
        self._stack_backend = None
        layers: list[AttentionBlock] = list(self.layers)  # type: ignore[arg-type]
        for layer in layers:
            layer.triton_ops = ops

    def pack_linear_weights(self) -> None:
        """Pack every linear weight once (CPU, float32/bfloat16 only): the layers' four (their
        plain copies freed, counted in ``packed_weight_bytes``) and a copy of the logits'
        weight (the embedding stays for the lookups; ``packed_lm_head_bytes``) whose GEMM
        gives float32 logits, not bfloat16 roundings of them, where exact ties between the
        top two logits are common.

        In bfloat16 on a CPU with AVX512-BF16 all of them go to
        :func:`kernels.cpu_ops.bf16_linear` (float32 sums in a fixed order per row: the
        forward is batch invariant; ``bf16_pairs``); else oneDNN's reordered layout
        (:mod:`kernels.onednn_linear`), the logits from a float32 copy of the weight."""
        layers: list[AttentionBlock] = list(self.layers)  # type: ignore[arg-type]
        self._stack_backend = None  # (the stack holds the packed weights)
        weight = self.embed_weight if self.lm_head_weight is None else self.lm_head_weight
        self.bf16_pairs = weight.dtype == torch.bfloat16 and cpu_ops.bf16_gemm_supported()
        self.packed_weight_bytes = sum(
            layer.pack_linear_weights(bf16_pairs=self.bf16_pairs) for layer in layers
        )
        if self.quant_logits_weight is not None:
            return
        if self.bf16_pairs:
            self.packed_lm_head = cpu_ops.pack_bf16_pairs(weight.data)
            self.packed_lm_head_bytes = self.packed_lm_head.numel() * 2
        else:
            self.packed_lm_head = onednn_linear.pack(weight.data.float())
            self.packed_lm_head_bytes = weight.numel() * 4

    @property
    def quant_logits_weight(self) -> QuantWeight | None:
        """The logits' weight in GGUF blocks (the embedding's when tied), or None."""
        return self.quant_embed if self.lm_head_weight is None else self.quant_lm_head

    def all_linears_quantized(self) -> bool:
        """Whether every layer's linear weights and the logits' are served from GGUF blocks
        (:func:`kernels.cpu_ops.quant_linear`: a fixed summation order per row, float32 too)."""
        layers: list[AttentionBlock] = list(self.layers)  # type: ignore[arg-type]
        return self.quant_logits_weight is not None and all(
            set(LINEAR_WEIGHTS) <= layer.quantized.keys() for layer in layers
        )

    def quantized_bytes(self) -> int:
        """Bytes of the weights held in GGUF blocks (``--quantization gguf``; else 0)."""
        layers: list[AttentionBlock] = list(self.layers)  # type: ignore[arg-type]
        weights = [w for layer in layers for ws in layer.quantized.values() for w in ws]
        weights += [w for w in (self.quant_embed, self.quant_lm_head) if w is not None]
        return sum(w.nbytes for w in weights)

    def init_rope(self) -> None:
        """(Re)build the rotary tables ``rope_cos``/``rope_sin`` ``[max_positions, D / 2]`` float32
        on the embedding's device (call after moving the model), and ``rope_tables`` with the
        sliding layers' own when the model has a local rope base."""
        device = self.embed_weight.device
        pos = torch.arange(self.max_positions, dtype=torch.float32, device=device)
        self.rope_tables = {}
        layers: list[AttentionBlock] = list(self.layers)  # type: ignore[arg-type]
        for key in sorted({layer.rope_key for layer in layers} | {"global"}):
            inv_freq = rope_inv_freq(self.config, local=key == "local").to(device)
            freqs = pos[:, None] * inv_freq[None]
            self.rope_tables[key] = (freqs.cos(), freqs.sin())
        self.rope_cos, self.rope_sin = self.rope_tables["global"]

    @property
    def dtype(self) -> torch.dtype:
        """The weights' dtype."""
        return self.embed_weight.dtype

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: Any,
        kv_caches: Sequence[torch.Tensor],
    ) -> torch.Tensor:
        """Run the flattened batch through every layer.

        Args:
            input_ids: ``[T]`` int64 token ids.
            positions: ``[T]`` int64 positions (``< max_positions``).
            metadata: the step's attention metadata from ``attention_backend.build_metadata``.
            kv_caches: one ``[2, num_blocks, Hkv, block_size * D]`` cache per layer, model dtype.

        Returns:
            ``[T, H]`` final hidden states (after the last norm), model dtype, the same on
            every rank.
        """
        backend = self.attention_backend
        ropes = {}
        for key, (cos, sin) in self.rope_tables.items():
            rope = ropes[key] = RopeInputs(positions, cos, sin)
            if not backend.fused_layer_ops:
                rope.cos = cos[positions].to(self.dtype).unsqueeze(1)
                rope.sin = sin[positions].to(self.dtype).unsqueeze(1)
        hidden = self._embed(input_ids)
        if self.gemma:  # transformers: the float32 sqrt(H) rounded to the dtype, then multiplied
            hidden = hidden * torch.tensor(self.config.hidden_size**0.5).to(hidden.dtype)
        residual: torch.Tensor | None = None
        stack = self._layer_stack(backend)
        if stack is not None:
            hidden, residual = stack.run(hidden, None, ropes["global"], kv_caches, metadata)
        else:
            for layer, cache in zip(self.layers, kv_caches, strict=True):
                rope = ropes[layer.rope_key]  # type: ignore[index]
                hidden, residual = layer(hidden, residual, rope, cache, metadata, backend)
        fused = backend.fused_layer_ops
        weight: torch.Tensor = self.norm_weight
        if self.gemma and fused:
            if self._final_norm_scale is None:
                self._final_norm_scale = 1.0 + self.norm_weight.float()
            weight = self._final_norm_scale
        normed, _ = add_rms_norm(
            hidden, residual, weight, self.config.rms_norm_eps, fused, self.triton_ops, self.gemma
        )
        return normed

    def _layer_stack(self, backend: AttentionBackend) -> LayerStack | None:
        """The layers as one C++ call (:mod:`worker.layer_stack`) on ``backend``, or None
        (the per-layer path, also while ``per_layer_calls``); built on the first forward after
        the weights are packed."""
        if self.per_layer_calls:
            return None
        if self._stack_backend is not backend:
            layers: list[AttentionBlock] = list(self.layers)  # type: ignore[arg-type]
            self._stack = build_layer_stack(layers, backend, DecoderLayer)
            self._stack_backend = backend
        return self._stack

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[T]`` ids -> ``[T, H]``. Vocab-parallel: each rank looks up the ids of its shard,
        zeroes the rows of the others, and the all-reduce sums the one nonzero row per id."""
        if self.quant_embed is not None:  # gguf's float32 rows, rounded as the plain table
            return cpu_ops.quant_embedding(self.quant_embed, input_ids).to(self.dtype)
        if not self.tp.enabled:
            return F.embedding(input_ids, self.embed_weight)
        start, stop = self.tp.vocab_range(self.config.vocab_size)
        outside = (input_ids < start) | (input_ids >= stop)
        local = (input_ids - start).masked_fill_(outside, 0)
        hidden = F.embedding(local, self.embed_weight).masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(hidden)

    def _cpu_logits(self, hidden: torch.Tensor, vocab_rows: int, reuse: bool) -> torch.Tensor:
        """Float32 logits ``[S, vocab_rows]`` from the GGUF blocks (``hidden`` bfloat16 or
        float32) or the bfloat16 GEMM's packed copy, into the kept buffer when ``reuse``."""
        rows = hidden.shape[0]
        out = None
        if reuse:
            if self._logits_buffer.shape[0] < rows:
                self._logits_buffer = torch.empty(rows, vocab_rows, dtype=torch.float32)
            out = self._logits_buffer[:rows]
        quantized = self.quant_logits_weight
        if quantized is not None:
            return cpu_ops.quant_linear(hidden, quantized, out=out, out_dtype=torch.float32)
        assert self.packed_lm_head is not None
        return cpu_ops.bf16_linear(
            hidden, self.packed_lm_head, vocab_rows, out=out, out_dtype=torch.float32
        )

    @overload
    def compute_logits(
        self,
        hidden: torch.Tensor,
        dst: None = None,
        *,
        float32: bool = True,
        reuse_buffer: bool = False,
    ) -> torch.Tensor: ...

    @overload
    def compute_logits(
        self, hidden: torch.Tensor, dst: int, *, float32: bool = True, reuse_buffer: bool = False
    ) -> torch.Tensor | None: ...

    def compute_logits(
        self,
        hidden: torch.Tensor,
        dst: int | None = None,
        *,
        float32: bool = True,
        reuse_buffer: bool = False,
    ) -> torch.Tensor | None:
        """``hidden`` ``[S, H]`` (only rows that sample) -> logits ``[S, V]``, float32 (or, with
        ``float32=False``, the GEMM's own output dtype, the model's: the caller converts).
        With :meth:`use_triton_ops` the Triton matmul writes float32 straight from its float32
        sums (never rounded to the model dtype), with a reduction order that does not depend
        on ``S``.

        ``reuse_buffer``: write the float32 logits of the bfloat16 kernel into a buffer this
        model keeps (grown as needed) instead of a new tensor: the next call overwrites them.
        The step loop's logits are read before the next step; a fresh ``[S, V]`` float32
        tensor costs its page faults every step (about 10 ms of a 150 ms step at ``S`` 200).

        With ``N > 1`` each rank computes its ``[S, Vs]`` vocabulary slice; the slices are
        all-gathered (``dst`` None: every rank gets the logits) or gathered to rank ``dst``
        (the others get None), and the padding columns past ``V`` dropped. All ranks must call
        it together with the same ``S`` and ``dst``. With ``N == 1`` ``dst`` is ignored.
        """
        weight = self.embed_weight if self.lm_head_weight is None else self.lm_head_weight
        if self.triton_ops is not None:
            local = self.triton_ops.linear(hidden, weight, out_dtype=torch.float32)
        elif self.bf16_pairs or self.quant_logits_weight is not None:
            vocab_rows = (
                weight.shape[0] if self.quant_logits_weight is None else self.quant_logits_weight.n
            )
            local = self._cpu_logits(hidden, vocab_rows, reuse_buffer)
        elif self.packed_lm_head is not None:  # float32 logits from float32 weights
            local = onednn_linear.linear(hidden.float(), self.packed_lm_head, None)
        else:
            local = F.linear(hidden, weight)
        if not self.tp.enabled:
            return self._softcap(local.float() if float32 else local)
        if dst is None:
            full: torch.Tensor | None = self.tp.all_gather_last_dim(local)
        else:
            full = self.tp.gather_last_dim(local, dst)
        if full is None:
            return None
        full = full[:, : self.config.vocab_size]
        return self._softcap(full.float() if float32 else full)

    def _softcap(self, logits: torch.Tensor) -> torch.Tensor:
        """``cap * tanh(logits / cap)`` in place when the config sets
        ``final_logit_softcapping`` (Gemma 2's; Gemma 3's configs leave it None)."""
        cap = self.config.final_logit_softcapping
        if cap:
            logits.div_(cap).tanh_().mul_(cap)
        return logits
