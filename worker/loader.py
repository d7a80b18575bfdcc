"""Load an HF model folder (``config.json`` + ``*.safetensors``) into :class:`worker.model.LlamaForCausalLM`.

Sharded checkpoints (``model.safetensors.index.json``) and single files both work. Q/K/V and
gate/up are copied into the fused parameters as they are read, converted to the target dtype.
A tensor-parallel rank reads only its shard of each tensor (see :func:`load_model`).
"""

from __future__ import annotations

import json
import pathlib
import re
from dataclasses import dataclass
from typing import Any

import torch
from safetensors import safe_open

from sluiceway.worker.model import DecoderLayer, LlamaForCausalLM, ModelConfig
from sluiceway.worker.parallel import TensorParallelGroup

__all__ = [
    "ModelLoadError",
    "load_config",
    "load_model",
    "random_model",
    "read_json",
    "safetensors_files",
]


class ModelLoadError(ValueError):
    """The folder is not a loadable model (missing files, missing or unexpected tensors)."""


def read_json(path: pathlib.Path) -> dict:
    """Parse one JSON file; ``{}`` when it does not exist."""
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as f:
        return json.load(f)


def load_config(model_dir: pathlib.Path) -> ModelConfig:
    """Read ``config.json`` (and ``generation_config.json`` for EOS ids) of an HF folder.

    Raises:
        ModelLoadError: no ``config.json`` in ``model_dir``.
        worker.model.UnsupportedModelError: an architecture or option we do not implement.
    """
    cfg_path = model_dir / "config.json"
    if not cfg_path.is_file():
        raise ModelLoadError(f"{model_dir} is not a model folder: it has no config.json")
    cfg = read_json(cfg_path)
    gen = read_json(model_dir / "generation_config.json")
    if gen.get("eos_token_id") is not None:
        cfg = {**cfg, "eos_token_id": _merge_ids(gen["eos_token_id"], cfg.get("eos_token_id"))}
    return ModelConfig.from_hf_dict(cfg)


def _merge_ids(*values: int | list[int] | None) -> list[int]:
    out: list[int] = []
    for v in values:
        for i in v if isinstance(v, list) else ([] if v is None else [v]):
            if int(i) not in out:
                out.append(int(i))
    return out


def safetensors_files(model_dir: pathlib.Path) -> list[pathlib.Path]:
    """The checkpoint's safetensors files (from the shard index when there is one).

    Raises:
        ModelLoadError: none found.
    """
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(read_json(index)["weight_map"].values()))
        files = [model_dir / n for n in names]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"shards named in {index} are missing: {missing}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{model_dir} has no *.safetensors weights")
    return files


_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_IGNORED = re.compile(r"rotary_emb\.inv_freq$")


# an HF norm -> (our parameter in the Llama block, in the Gemma 3 block)
_NORMS = {
    "input_layernorm": ("input_norm", "input_norm"),
    "post_attention_layernorm": ("post_norm", "post_attn_norm"),
    "pre_feedforward_layernorm": ("", "pre_mlp_norm"),
    "post_feedforward_layernorm": ("", "post_mlp_norm"),
    "self_attn.q_norm": ("q_norm", "q_norm"),
    "self_attn.k_norm": ("k_norm", "k_norm"),
}


@dataclass(frozen=True, slots=True)
class _Target:
    """Where one checkpoint tensor lands.

    ``param[rows]`` (all of ``param`` when ``rows`` is None) receives the checkpoint tensor, or
    with tensor parallelism its slice ``[start, start + n)`` along ``dim`` (``n`` the
    destination's size along ``dim``; the whole tensor when ``dim`` is None). ``full`` is the
    checkpoint's size along ``dim``, for the shape check.
    """

    param: torch.Tensor
    rows: slice | None = None
    dim: int | None = None
    start: int = 0
    full: int = 0

    @property
    def dest(self) -> torch.Tensor:
        """The view of the parameter that receives the tensor."""
        return self.param if self.rows is None else self.param[self.rows]

    def expected_shape(self) -> tuple[int, ...]:
        """The whole checkpoint tensor's shape."""
        shape = list(self.dest.shape)
        if self.dim is not None:
            shape[self.dim] = self.full
        return tuple(shape)


def _targets(model: LlamaForCausalLM, name: str) -> _Target | None:
    """Where an HF tensor name lands in the (rank's shard of the) model; None when not ours.

    Shards (Megatron-LM, see :mod:`worker.parallel`): q/k/v and gate/up rows of the rank's
    heads / intermediate columns go to the rank's fused parameters (q, k, v / gate, up blocks
    in that order), o/down take the matching input columns (dim 1), embedding and LM head the
    rank's vocabulary rows; norms and the o/down biases are whole on every rank.
    """
    c, tp = model.config, model.tp
    sharded = tp.enabled
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        param = model.embed_weight if name.startswith("model.") else model.lm_head_weight
        if param is None:
            return None
        if not sharded:
            return _Target(param)
        v0, v1 = tp.vocab_range(c.vocab_size)
        return _Target(param, slice(0, v1 - v0), dim=0, start=v0, full=c.vocab_size)
    if name == "model.norm.weight":
        return _Target(model.norm_weight)
    m = _LAYER.match(name)
    if m is None or int(m.group(1)) >= c.num_layers:
        return None
    layer = model.layers[int(m.group(1))]
    d = c.head_dim
    q_rows, kv_rows = model.num_heads * d, model.num_kv_heads * d  # the rank's
    inter = c.intermediate_size // tp.world_size
    part, kind = m.group(2).rsplit(".", 1)
    # part -> (fused prefix, destination rows, rows of the whole checkpoint tensor)
    fused = {
        "self_attn.q_proj": ("qkv", slice(0, q_rows), c.num_heads * d),
        "self_attn.k_proj": ("qkv", slice(q_rows, q_rows + kv_rows), c.num_kv_heads * d),
        "self_attn.v_proj": (
            "qkv",
            slice(q_rows + kv_rows, q_rows + 2 * kv_rows),
            c.num_kv_heads * d,
        ),
        "mlp.gate_proj": ("gate_up", slice(0, inter), c.intermediate_size),
        "mlp.up_proj": ("gate_up", slice(inter, 2 * inter), c.intermediate_size),
    }
    # part -> (attribute prefix, checkpoint columns split by rank: row-parallel)
    plain = {
        "self_attn.o_proj": ("o", c.num_heads * d),
        "mlp.down_proj": ("down", c.intermediate_size),
    }
    if part in _NORMS and kind == "weight":  # whole on every rank
        target = getattr(layer, _NORMS[part][c.model_type == "gemma3"], None)
        return None if target is None else _Target(target)
    if part in fused:
        prefix, rows, full = fused[part]
        target = getattr(layer, f"{prefix}_{kind}", None)
        if target is None:
            return None
        if not sharded:
            return _Target(target, rows)
        n = rows.stop - rows.start
        return _Target(target, rows, dim=0, start=tp.rank * n, full=full)
    if part in plain:
        prefix, cols = plain[part]
        target = getattr(layer, f"{prefix}_{kind}", None)
        if target is None:
            return None
        if not sharded or kind != "weight":  # o/down biases: whole
            return _Target(target)
        n = cols // tp.world_size
        return _Target(target, dim=1, start=tp.rank * n, full=cols)
    return None


def _packed_targets(model: LlamaForCausalLM, name: str) -> list[_Target] | None:
    """Where a tensor that already packs several of ours lands (Phi-3's
    ``self_attn.qkv_proj.weight`` ``[(Hq + 2 Hkv) D, H]``, q rows then k then v, and
    ``mlp.gate_up_proj.weight`` ``[2 I, H]``, gate rows then up: the layout of our fused
    parameters); None for any other name. One target, the whole parameter, without tensor
    parallelism; else one per part (q, k, v / gate, up), each the rank's rows of that part.
    """
    m = _LAYER.match(name)
    if m is None or int(m.group(1)) >= model.config.num_layers:
        return None
    c, tp = model.config, model.tp
    d = c.head_dim
    layer: DecoderLayer = model.layers[int(m.group(1))]  # type: ignore[assignment]
    param: torch.Tensor
    if m.group(2) == "self_attn.qkv_proj.weight":
        param = layer.qkv_weight
        # (rows of the part in the checkpoint, the rank's rows of it)
        parts = [(c.num_heads * d, model.num_heads * d)] + [
            (c.num_kv_heads * d, model.num_kv_heads * d)
        ] * 2
    elif m.group(2) == "mlp.gate_up_proj.weight":
        param = layer.gate_up_weight
        parts = [(c.intermediate_size, c.intermediate_size // tp.world_size)] * 2
    else:
        return None
    if not tp.enabled:
        return [_Target(param)]
    full = sum(whole for whole, _ in parts)
    targets, src, dst = [], 0, 0
    for whole, mine in parts:
        rows = slice(dst, dst + mine)
        targets.append(_Target(param, rows, dim=0, start=src + tp.rank * mine, full=full))
        src, dst = src + whole, dst + mine
    return targets


def _read(sf: Any, name: str, target: _Target) -> torch.Tensor:
    """The checkpoint tensor ``name`` (or, sharded, only the rank's slice of it, read from the
    file without the rest) on the CPU in its stored dtype.

    Raises:
        ModelLoadError: its shape is not the one the model expects.
    """
    expected = target.expected_shape()
    if target.dim is None:
        tensor = sf.get_tensor(name)
        shape = tuple(tensor.shape)
    else:
        part = sf.get_slice(name)
        shape = tuple(part.get_shape())
    if shape != expected:
        raise ModelLoadError(f"{name}: checkpoint shape {shape} != expected {expected}")
    if target.dim is None:
        return tensor
    stop = target.start + target.dest.shape[target.dim]
    return part[target.start : stop] if target.dim == 0 else part[:, target.start : stop]


@torch.inference_mode()
def load_model(
    model_dir: pathlib.Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    max_positions: int | None = None,
    tp: TensorParallelGroup | None = None,
    skip: frozenset[str] = frozenset(),
) -> LlamaForCausalLM:
    """Build the decoder for ``model_dir`` and fill it from its safetensors, in ``dtype`` on ``device``.

    With ``tp`` of more than one rank the model holds only the rank's shard (see
    :mod:`worker.parallel`): each checkpoint tensor is sliced as it is read (only the rank's
    rows or columns come off the file), then converted and copied to ``device``; vocabulary
    padding rows are zeros. A GGUF converted by :func:`sluiceway.model_files.convert_gguf` is
    such a folder and loads the same way.

    Args:
        model_dir: an HF folder (``config.json`` + safetensors).
        dtype: parameter dtype (the rotary tables stay float32).
        device: where the parameters live.
        max_positions: length of the rotary table (default: the config's
            ``max_position_embeddings``).
        tp: this process's tensor-parallel rank and world size (default: the whole model).
        skip: checkpoint names not read: their parameters count as filled but are left
            uninitialized (``--quantization gguf`` replaces them with GGUF blocks; their
            pages are never touched).

    Raises:
        ModelLoadError: missing files, a tensor of the wrong shape, tensors the model needs but
            the checkpoint lacks, or tensors it has that the model does not know.
        ValueError: the world size does not divide the heads or the intermediate size.
        worker.model.UnsupportedModelError: see :func:`load_config`.
    """
    config = load_config(model_dir)
    files = safetensors_files(model_dir)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, max_positions=max_positions, tp=tp)
    model.to(dtype)
    model.to_empty(device=device)
    model.init_rope()  # the rotary tables were built on meta

    # every (param, row range) must be written exactly once
    pending: dict[tuple[int, int, int], str] = {}
    for pname, p in model.named_parameters(remove_duplicate=True):
        pending[(id(p), 0, p.shape[0])] = pname
    filled: set[tuple[int, int, int]] = set()
    v0, v1 = model.tp.vocab_range(config.vocab_size)
    for vocab_param in (model.embed_weight, model.lm_head_weight):
        if vocab_param is not None and v1 - v0 < vocab_param.shape[0]:  # padding rows
            vocab_param[v1 - v0 :].zero_()
            filled.add((id(vocab_param), v1 - v0, vocab_param.shape[0]))
    unexpected: list[str] = []
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                if _IGNORED.search(name):
                    continue
                if name == "lm_head.weight" and config.tie_word_embeddings:
                    continue
                targets = _packed_targets(model, name)
                if targets is None:
                    target = _targets(model, name)
                    targets = [] if target is None else [target]
                if not targets:
                    unexpected.append(name)
                    continue
                for target in targets:
                    if name not in skip:
                        target.dest.copy_(_read(sf, name, target))
                    rows = target.rows
                    start = 0 if rows is None else rows.start
                    stop = target.param.shape[0] if rows is None else rows.stop
                    filled.add((id(target.param), start, stop))
    if unexpected:
        raise ModelLoadError(
            f"{model_dir}: tensors this model does not use: {sorted(unexpected)[:8]}"
            f"{' ...' if len(unexpected) > 8 else ''}"
        )
    missing = _missing(pending, filled)
    if missing:
        raise ModelLoadError(f"{model_dir}: tensors missing from the checkpoint for {missing[:8]}")
    return model.eval()


def _missing(
    pending: dict[tuple[int, int, int], str], filled: set[tuple[int, int, int]]
) -> list[str]:
    """Parameters not covered by the written row ranges."""
    covered: dict[int, list[tuple[int, int]]] = {}
    for pid, a, b in filled:
        covered.setdefault(pid, []).append((a, b))
    out = []
    for (pid, _, rows), pname in pending.items():
        end = 0
        for a, b in sorted(covered.get(pid, [])):
            if a > end:
                break
            end = max(end, b)
        if end < rows:
            out.append(pname)
    return out


@torch.inference_mode()
def random_model(
    config: ModelConfig,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    max_positions: int | None = None,
    seed: int = 0,
    std: float = 0.02,
) -> LlamaForCausalLM:
    """A decoder of ``config`` with random weights, made directly on ``device`` in ``dtype``
    (no checkpoint; for benchmarks such as ``sluiceway bench step --random-model``).

    Built on the meta device and then allocated on ``device`` as :func:`load_model` does, so a
    7B model in bfloat16 on a GPU never passes through host memory in float32. Matrices and
    embeddings are drawn from ``N(0, std)`` (seeded), norm weights are 1, biases 0. One rank:
    no tensor parallelism.
    """
    with torch.device("meta"):
        model = LlamaForCausalLM(config, max_positions=max_positions)
    model.to(dtype)
    model.to_empty(device=device)
    model.init_rope()  # the rotary tables were built on meta
    gen = torch.Generator(device=torch.device(device))
    gen.manual_seed(seed)
    for name, p in model.named_parameters():
        if p.dim() == 1:
            p.fill_(0.0 if name.endswith("bias") else 1.0)
        else:
            p.normal_(0.0, std, generator=gen)
    return model.eval()
