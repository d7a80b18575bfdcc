"""Load an HF model folder (``config.json`` + ``*.safetensors``) into :class:`worker.model.LlamaForCausalLM`.

Sharded checkpoints (``model.safetensors.index.json``) and single files both work. Q/K/V and
gate/up are copied into the fused parameters as they are read, converted to the target dtype.
"""

from __future__ import annotations

import json
import pathlib
import re
from collections.abc import Iterator

import torch
from safetensors import safe_open

from worker.model import LlamaForCausalLM, ModelConfig

__all__ = ["ModelLoadError", "load_config", "load_model", "read_json", "safetensors_files"]


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


def _targets(model: LlamaForCausalLM, name: str) -> tuple[torch.Tensor, slice | None] | None:
    """The parameter (and row slice of it) an HF tensor name lands in; None when not ours."""
    c = model.config
    if name == "model.embed_tokens.weight":
        return model.embed_weight, None
    if name == "model.norm.weight":
        return model.norm_weight, None
    if name == "lm_head.weight":
        return None if model.lm_head_weight is None else (model.lm_head_weight, None)
    m = _LAYER.match(name)
    if m is None or int(m.group(1)) >= c.num_layers:
        return None
    layer = model.layers[int(m.group(1))]
    q_rows, kv_rows = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    inter = c.intermediate_size
    part, kind = m.group(2).rsplit(".", 1)
    fused = {
        "self_attn.q_proj": ("qkv", slice(0, q_rows)),
        "self_attn.k_proj": ("qkv", slice(q_rows, q_rows + kv_rows)),
        "self_attn.v_proj": ("qkv", slice(q_rows + kv_rows, q_rows + 2 * kv_rows)),
        "mlp.gate_proj": ("gate_up", slice(0, inter)),
        "mlp.up_proj": ("gate_up", slice(inter, 2 * inter)),
    }
    plain = {
        "self_attn.o_proj": "o",
        "mlp.down_proj": "down",
        "input_layernorm": "input_norm",
        "post_attention_layernorm": "post_norm",
    }
    if part in fused:
        prefix, rows = fused[part]
        target = getattr(layer, f"{prefix}_{kind}", None)
        return None if target is None else (target, rows)
    if part in plain:
        attr = plain[part] if part.endswith("layernorm") else f"{plain[part]}_{kind}"
        if part.endswith("layernorm") and kind != "weight":
            return None
        target = getattr(layer, attr, None)
        return None if target is None else (target, None)
    return None


def _iter_tensors(files: list[pathlib.Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                yield name, sf.get_tensor(name)


@torch.inference_mode()
def load_model(
    model_dir: pathlib.Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    max_positions: int | None = None,
) -> LlamaForCausalLM:
    """Build the decoder for ``model_dir`` and fill it from its safetensors, in ``dtype`` on ``device``.

    Args:
        model_dir: an HF folder (``config.json`` + safetensors).
        dtype: parameter dtype (the rotary tables stay float32).
        device: where the parameters live.
        max_positions: length of the rotary table (default: the config's
            ``max_position_embeddings``).

    Raises:
        ModelLoadError: missing files, a tensor of the wrong shape, tensors the model needs but
            the checkpoint lacks, or tensors it has that the model does not know.
        worker.model.UnsupportedModelError: see :func:`load_config`.
    """
    config = load_config(model_dir)
    files = safetensors_files(model_dir)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, max_positions=max_positions)
    model.to(dtype)
    model.to_empty(device=device)
    model.init_rope()  # the rotary tables were built on meta

    # every (param, row range) must be written exactly once
    pending: dict[tuple[int, int, int], str] = {}
    for pname, p in model.named_parameters(remove_duplicate=True):
        pending[(id(p), 0, p.shape[0])] = pname
    filled: set[tuple[int, int, int]] = set()
    unexpected: list[str] = []
    for name, tensor in _iter_tensors(files):
        if _IGNORED.search(name):
            continue
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        target = _targets(model, name)
        if target is None:
            unexpected.append(name)
            continue
        param, rows = target
        dest = param if rows is None else param[rows]
        if tuple(dest.shape) != tuple(tensor.shape):
            raise ModelLoadError(
                f"{name}: checkpoint shape {tuple(tensor.shape)} != expected {tuple(dest.shape)}"
            )
        dest.copy_(tensor)
        start = 0 if rows is None else rows.start
        stop = param.shape[0] if rows is None else rows.stop
        filled.add((id(param), start, stop))
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
