"""A Llama-family decoder (Llama 2/3, Mistral, Qwen2, Phi-3, SmolLM) in plain torch over the paged KV pool.

One forward runs a flattened varlen batch (prefill chunks and decode tokens back to back, no
padding in the linear layers). Q/K/V are one fused matmul, gate/up another. Parameter names are
our own (``qkv_weight``, ``gate_up_weight`` ...); :mod:`worker.loader` maps HF checkpoints onto them.

With tensor parallelism (:mod:`worker.parallel`, Megatron-LM sharding, Shoeybi et al. 2019) a
model holds only its rank's shard of ``N``: ``Hq / N`` query and ``Hkv / N`` KV heads, ``I / N``
intermediate columns and ``ceil(V / N)`` vocabulary rows; the o and down projections and the
embedding end in an all-reduce, the logits in a gather. Shapes below are per rank; with
``N == 1`` they are the whole model and no collective runs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, overload

import torch
import torch.nn.functional as F
from torch import nn

from sluiceway.kernels import cpu_ops, onednn_linear
from sluiceway.kernels.backend import AttentionBackend, TorchAttentionBackend
from sluiceway.model_files import context_window
from sluiceway.worker.architectures import UnsupportedModelError, model_type_of
from sluiceway.worker.parallel import TensorParallelGroup

__all__ = ["DecoderLayer", "LlamaForCausalLM", "ModelConfig", "UnsupportedModelError"]

LINEAR_WEIGHTS = ("qkv_weight", "o_weight", "gate_up_weight", "down_weight")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The subset of an HF ``config.json`` the decoder needs (see :meth:`from_hf_dict`)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    rope_scaling: Mapping[str, Any] | None = None
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    @classmethod
    def from_hf_dict(cls, cfg: Mapping[str, Any]) -> ModelConfig:
        """Read an HF ``config.json`` dict (transformers 4.x or 5.x layout).

        Raises:
            UnsupportedModelError: an architecture not in
                :data:`worker.architectures.ARCHITECTURES`, a non-SiLU activation, a rope
                scaling other than default/linear/llama3 (Phi-3's longrope among them), or a
                partial rotary factor (rotary over part of each head).
        """
        model_type = model_type_of(cfg)
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"unsupported hidden_act {act!r} (only 'silu')")
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        head_dim = cfg.get("head_dim") or hidden // heads
        rope_params = dict(cfg.get("rope_parameters") or {})
        rope_theta = float(rope_params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        scaling = cfg.get("rope_scaling") or rope_params or None
        if scaling is not None:
            rope_type = scaling.get("rope_type", scaling.get("type", "default"))
            if rope_type not in ("default", "linear", "llama3"):
                raise UnsupportedModelError(
                    f"rope scaling {rope_type!r} is not implemented (supported: default, "
                    "linear, llama3)"
                )
            scaling = None if rope_type == "default" else {**scaling, "rope_type": rope_type}
        partial = float(
            rope_params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1))
        )
        if partial != 1:
            raise UnsupportedModelError(
                f"partial_rotary_factor {partial} is not implemented (rotary over whole heads only)"
            )
        attention_bias = bool(cfg.get("attention_bias", False))
        max_positions, sliding = context_window({**cfg, "model_type": model_type})
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            model_type=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or (model_type == "llama" and attention_bias),
            o_bias=model_type == "llama" and attention_bias,
            mlp_bias=model_type == "llama" and bool(cfg.get("mlp_bias", False)),
            rope_scaling=scaling,
            sliding_window=sliding,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Rotary inverse frequencies ``[head_dim // 2]`` float32, with linear/llama3 scaling applied
    exactly as transformers' ``ROPE_INIT_FUNCTIONS`` do."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    low = float(scaling["low_freq_factor"])
    high = float(scaling["high_freq_factor"])
    old_ctx = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_ctx / low
    high_freq_wavelen = old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


@dataclass(frozen=True, slots=True)
class TritonOps:
    """The batch-invariant Triton kernels the decoder runs instead of cuBLAS and torch's
    RMSNorm (:meth:`LlamaForCausalLM.use_triton_ops`): ``linear`` is
    :func:`kernels.triton_matmul.triton_linear`, ``rms_norm`` and ``fused_add_rms_norm``
    those of :mod:`kernels.triton_norm`."""

    linear: Callable[..., torch.Tensor]
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    fused_add_rms_norm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], None]

    @classmethod
    def load(cls) -> TritonOps:
        """Import the kernels (Triton is optional: imported only here)."""
        from sluiceway.kernels.triton_matmul import triton_linear
        from sluiceway.kernels.triton_norm import triton_fused_add_rms_norm, triton_rms_norm

        return cls(triton_linear, triton_rms_norm, triton_fused_add_rms_norm)


class DecoderLayer(nn.Module):
    """Pre-norm attention + SwiGLU MLP block.

    Parameters (``H`` hidden, ``Hq``/``Hkv`` heads, ``D`` head dim, ``I`` intermediate, all
    heads and ``I`` the rank's share, e.g. ``Hq = num_heads / N``): ``input_norm`` ``[H]``,
    ``qkv_weight`` ``[(Hq + 2 Hkv) D, H]`` (the rank's q rows, then its k, then its v),
    ``qkv_bias`` ``[(Hq + 2 Hkv) D]`` or None, ``o_weight`` ``[H, Hq D]`` (the input columns
    of the rank's heads), ``o_bias`` ``[H]`` or None (whole on every rank), ``post_norm``
    ``[H]``, ``gate_up_weight`` ``[2 I, H]`` (the rank's gate rows, then its up rows),
    ``gate_up_bias`` ``[2 I]`` / ``down_bias`` ``[H]`` or None, ``down_weight`` ``[H, I]``.

    Raises:
        ValueError: ``tp.world_size`` does not divide the heads or the intermediate size.
    """

    def __init__(self, config: ModelConfig, tp: TensorParallelGroup | None = None) -> None:
        super().__init__()
        c = config
        self.tp = tp = tp or TensorParallelGroup()
        self.num_kv_heads = tp.shard(c.num_kv_heads, "KV heads (num_key_value_heads)")
        self.num_heads = tp.shard(c.num_heads, "attention heads (num_attention_heads)")
        self.head_dim = c.head_dim
        self.eps = c.rms_norm_eps
        self.intermediate = tp.shard(
            c.intermediate_size, "MLP intermediate size (intermediate_size)"
        )
        qkv_out = (self.num_heads + 2 * self.num_kv_heads) * c.head_dim
        self.input_norm = _param(c.hidden_size)
        self.qkv_weight = _param(qkv_out, c.hidden_size)
        self.qkv_bias = _param(qkv_out) if c.qkv_bias else None
        self.o_weight = _param(c.hidden_size, self.num_heads * c.head_dim)
        self.o_bias = _param(c.hidden_size) if c.o_bias else None
        self.post_norm = _param(c.hidden_size)
        self.gate_up_weight = _param(2 * self.intermediate, c.hidden_size)
        self.gate_up_bias = _param(2 * self.intermediate) if c.mlp_bias else None
        self.down_weight = _param(c.hidden_size, self.intermediate)
        self.down_bias = _param(c.hidden_size) if c.mlp_bias else None
        # packed copies of the four weights, by name, once pack_linear_weights ran: oneDNN's
        # blocked layout, or (bf16_pairs) the layout of kernels.cpu_ops.bf16_linear
        self.packed: dict[str, torch.Tensor] = {}
        self.packed_out_features: dict[str, int] = {}
        self.bf16_pairs = False
        self.triton_ops: TritonOps | None = None  # see LlamaForCausalLM.use_triton_ops

    def pack_linear_weights(self, bf16_pairs: bool = False) -> int:
        """Pack the four linear weights once and free the plain copies (the forward reads only
        the packed ones). CPU only. ``bf16_pairs`` (bfloat16 weights, a CPU with AVX512-BF16):
        for :func:`kernels.cpu_ops.bf16_linear`, whose rows do not depend on the batch; else
        reordered for oneDNN (:mod:`kernels.onednn_linear`).

        Returns:
            Bytes the plain weights held.
        """
        packed_bytes = 0
        self.bf16_pairs = bf16_pairs
        pack = cpu_ops.pack_bf16_pairs if bf16_pairs else onednn_linear.pack
        for name in LINEAR_WEIGHTS:
            weight = getattr(self, name)
            self.packed[name] = pack(weight.data)
            self.packed_out_features[name] = weight.shape[0]
            packed_bytes += weight.numel() * weight.element_size()
            weight.data = torch.empty(0, dtype=weight.dtype)
        return packed_bytes

    def _linear(self, x: torch.Tensor, name: str, bias: torch.Tensor | None) -> torch.Tensor:
        if self.triton_ops is not None:
            return self.triton_ops.linear(x, getattr(self, name), bias)
        packed = self.packed.get(name)
        if packed is None:
            return F.linear(x, getattr(self, name), bias)
        if self.bf16_pairs:
            return cpu_ops.bf16_linear(x, packed, self.packed_out_features[name], bias)
        return onednn_linear.linear(x, packed, bias)

    def _row_parallel_linear(
        self, x: torch.Tensor, name: str, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """``x`` ``[T, K / N]`` (the rank's input columns) -> ``[T, M]``: the rank's partial
        product summed over the ranks, then the (replicated) bias added once."""
        if not self.tp.enabled:
            return self._linear(x, name, bias)
        out = self.tp.all_reduce(self._linear(x, name, None))
        return out if bias is None else out + bias

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
        t = hidden.shape[0]
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        fused = backend.fused_layer_ops
        ops = self.triton_ops
        x, residual = _add_rms_norm(hidden, residual, self.input_norm, self.eps, fused, ops)
        qkv = self._linear(x, "qkv_weight", self.qkv_bias)
        if fused:
            cpu_ops.rotary_embedding_write_kv(
                qkv, rope.positions, rope.cos_table, rope.sin_table, kv_cache,
                metadata.slot_mapping, hq, hkv,
            )  # fmt: skip
            q = qkv[:, : hq * d].view(t, hq, d)
        else:
            assert rope.cos is not None and rope.sin is not None
            qk = _apply_rope(qkv[:, : (hq + hkv) * d].view(t, hq + hkv, d), rope.cos, rope.sin)
            v = qkv[:, (hq + hkv) * d :].view(t, hkv, d)
            backend.write_kv(qk[:, hq:], v, kv_cache, metadata)
            q = qk[:, :hq]
        attn = backend.attention(q, kv_cache, metadata)
        hidden = self._row_parallel_linear(attn.view(t, hq * d), "o_weight", self.o_bias)
        x, residual = _add_rms_norm(hidden, residual, self.post_norm, self.eps, fused, ops)
        gate_up = self._linear(x, "gate_up_weight", self.gate_up_bias)
        if fused:
            act = cpu_ops.silu_and_mul(gate_up)
        else:
            act = F.silu(gate_up[:, : self.intermediate]) * gate_up[:, self.intermediate :]
        return self._row_parallel_linear(act, "down_weight", self.down_bias), residual


@dataclass(slots=True)
class RopeInputs:
    """The step's rotary inputs: ``positions`` ``[T]`` int64 and the model's float32 tables
    ``cos_table``/``sin_table`` ``[max_positions, D / 2]`` (what the fused op reads), and for
    the torch path ``cos``/``sin`` ``[T, 1, D / 2]`` gathered in the model dtype (None with
    fused ops)."""

    positions: torch.Tensor
    cos_table: torch.Tensor
    sin_table: torch.Tensor
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None


def _add_rms_norm(
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    fused: bool,
    triton_ops: TritonOps | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(hidden + residual), hidden + residual)``; ``residual`` None: no addition.
    Fused (the C++ ops, or ``triton_ops``): in place (``hidden`` becomes the normed rows,
    ``residual`` the sum)."""
    if triton_ops is not None:
        if residual is None:
            return triton_ops.rms_norm(hidden, weight, eps), hidden
        triton_ops.fused_add_rms_norm(hidden, residual, weight, eps)
        return hidden, residual
    if residual is None:
        normed = cpu_ops.rms_norm(hidden, weight, eps) if fused else _rms_norm(hidden, weight, eps)
        return normed, hidden
    if fused:
        cpu_ops.fused_add_rms_norm(hidden, residual, weight, eps)
        return hidden, residual
    residual = hidden + residual
    return _rms_norm(residual, weight, eps), residual


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary embedding of ``x`` ``[T, heads, D]`` (HF/NeoX convention)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class LlamaForCausalLM(nn.Module):
    """The decoder. Create with :func:`worker.loader.load_model`, which fills the weights.

    Parameters: ``embed_weight`` ``[Vs, H]``, ``layers`` (:class:`DecoderLayer`),
    ``norm_weight`` ``[H]``, ``lm_head_weight`` ``[Vs, H]`` (None when tied: the logits use
    ``embed_weight``), where ``Vs = ceil(V / N)`` rows hold token ids
    ``tp.vocab_range(V)`` and zeros past ``V`` (``Vs = V`` without tensor parallelism).
    Rotary tables ``rope_cos``/``rope_sin`` are plain float32 attributes (not buffers), so
    ``.to(dtype)`` leaves them alone; see :meth:`init_rope`. ``num_heads``/``num_kv_heads``
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
        self.embed_weight = _param(vocab_rows, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, tp) for _ in range(config.num_layers))
        self.norm_weight = _param(config.hidden_size)
        self.lm_head_weight = (
            None if config.tie_word_embeddings else _param(vocab_rows, config.hidden_size)
        )
        self.max_positions = max_positions or config.max_position_embeddings
        self.rope_cos = torch.empty(0)
        self.rope_sin = torch.empty(0)
        self.init_rope()
        # Paged attention and the KV scatter; the worker sets the one it chose at start.
        self.attention_backend: AttentionBackend = TorchAttentionBackend()
        self.packed_lm_head: torch.Tensor | None = None  # see pack_linear_weights
        self.packed_lm_head_bytes = 0
        # bfloat16 with AVX512-BF16: the packed weights are pack_bf16_pairs' (else oneDNN's)
        self.bf16_pairs = False
        self._logits_buffer = torch.empty(0)  # compute_logits(reuse_buffer=True) writes here
        self.packed_weight_bytes = 0  # bytes of the plain weights freed by pack_linear_weights
        self.triton_ops: TritonOps | None = None  # see use_triton_ops

    def use_triton_ops(self) -> None:
        """Run every linear layer and the logits on :func:`kernels.triton_matmul.triton_linear`
        and every RMSNorm on :mod:`kernels.triton_norm` (one tile config whatever the batch,
        one reduction order per row: with the batch-invariant Triton attention the forward
        is batch invariant; float32 logits straight from the float32 accumulator). For CUDA
        (or CPU tensors in Triton's interpreter, tests); the weights stay as they are."""
        ops = TritonOps.load()
        self.triton_ops = ops
        layers: list[DecoderLayer] = list(self.layers)  # type: ignore[arg-type]
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
        layers: list[DecoderLayer] = list(self.layers)  # type: ignore[arg-type]
        weight = self.embed_weight if self.lm_head_weight is None else self.lm_head_weight
        self.bf16_pairs = weight.dtype == torch.bfloat16 and cpu_ops.bf16_gemm_supported()
        self.packed_weight_bytes = sum(
            layer.pack_linear_weights(bf16_pairs=self.bf16_pairs) for layer in layers
        )
        if self.bf16_pairs:
            self.packed_lm_head = cpu_ops.pack_bf16_pairs(weight.data)
            self.packed_lm_head_bytes = self.packed_lm_head.numel() * 2
        else:
            self.packed_lm_head = onednn_linear.pack(weight.data.float())
            self.packed_lm_head_bytes = weight.numel() * 4

    def init_rope(self) -> None:
        """(Re)build the rotary tables ``rope_cos``/``rope_sin`` ``[max_positions, D / 2]`` float32
        on the embedding's device (call after moving the model)."""
        device = self.embed_weight.device
        inv_freq = rope_inv_freq(self.config).to(device)
        pos = torch.arange(self.max_positions, dtype=torch.float32, device=device)
        freqs = pos[:, None] * inv_freq[None]
        self.rope_cos = freqs.cos()
        self.rope_sin = freqs.sin()

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
        rope = RopeInputs(positions, self.rope_cos, self.rope_sin)
        if not backend.fused_layer_ops:
            rope.cos = self.rope_cos[positions].to(self.dtype).unsqueeze(1)
            rope.sin = self.rope_sin[positions].to(self.dtype).unsqueeze(1)
        hidden = self._embed(input_ids)
        residual: torch.Tensor | None = None
        for layer, cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(hidden, residual, rope, cache, metadata, backend)
        normed, _ = _add_rms_norm(
            hidden,
            residual,
            self.norm_weight,
            self.config.rms_norm_eps,
            backend.fused_layer_ops,
            self.triton_ops,
        )
        return normed

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[T]`` ids -> ``[T, H]``. Vocab-parallel: each rank looks up the ids of its shard,
        zeroes the rows of the others, and the all-reduce sums the one nonzero row per id."""
        if not self.tp.enabled:
            return F.embedding(input_ids, self.embed_weight)
        start, stop = self.tp.vocab_range(self.config.vocab_size)
        outside = (input_ids < start) | (input_ids >= stop)
        local = (input_ids - start).masked_fill_(outside, 0)
        hidden = F.embedding(local, self.embed_weight).masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(hidden)

    def _bf16_logits(self, hidden: torch.Tensor, vocab_rows: int, reuse: bool) -> torch.Tensor:
        assert self.packed_lm_head is not None
        rows = hidden.shape[0]
        out = None
        if reuse:
            if self._logits_buffer.shape[0] < rows:
                self._logits_buffer = torch.empty(rows, vocab_rows, dtype=torch.float32)
            out = self._logits_buffer[:rows]
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
        elif self.bf16_pairs:
            local = self._bf16_logits(hidden, weight.shape[0], reuse_buffer)
        elif self.packed_lm_head is not None:  # float32 logits from float32 weights
            local = onednn_linear.linear(hidden.float(), self.packed_lm_head, None)
        else:
            local = F.linear(hidden, weight)
        if not self.tp.enabled:
            return local.float() if float32 else local
        if dst is None:
            full: torch.Tensor | None = self.tp.all_gather_last_dim(local)
        else:
            full = self.tp.gather_last_dim(local, dst)
        if full is None:
            return None
        full = full[:, : self.config.vocab_size]
        return full.float() if float32 else full
