"""The quantized blocks of a converted GGUF, kept for ``--quantization gguf``.

:func:`sluiceway.model_files.convert_gguf` dequantizes every tensor into the folder's
``model.safetensors`` (the reference path, ``--quantization none``) and, beside it, writes the
file's own block bytes of each quantized 2-D weight into ``gguf/blocks.safetensors`` (a
sub-folder, so that the loader's ``*.safetensors`` glob does not take it for a checkpoint
shard): one uint8 tensor per HF weight name, and in the file's metadata the GGUF type, the
``[N, K]`` shape and, for Llama's Q/K, the head count whose rotary row permutation
(llama.cpp's) the rows still carry. Reading it back is a memory map, no GGUF parsing (which
takes 9-13 s for these files' tokenizer metadata).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import struct
from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = [
    "BLOCKS_FILE",
    "GgufBlocks",
    "has_blocks",
    "is_block_weight",
    "permuted_heads",
    "read_blocks",
    "reverse_permute",
    "write_blocks",
]

BLOCKS_FILE = pathlib.Path("gguf") / "blocks.safetensors"
_METADATA_KEY = "sluiceway.gguf_blocks"
# float types are plain weights (model.safetensors holds them exactly): not blocks
_FLOAT_TYPES = ("F32", "F16", "BF16", "F64")


@dataclasses.dataclass(frozen=True)
class GgufBlocks:
    """One weight's GGUF blocks: ``raw`` uint8 (``N * K / block`` blocks of the type, rows in
    order), ``qtype`` the ``gguf.GGMLQuantizationType`` name (``"Q4_1"``), ``shape`` ``(N,
    K)`` in HF order, ``permuted_heads`` the head count of llama.cpp's rotary permutation of
    the rows (Llama's Q/K; 0: rows in HF order)."""

    raw: np.ndarray
    qtype: str
    shape: tuple[int, int]
    permuted_heads: int = 0

    def hf_rows(self) -> np.ndarray:
        """int64 ``[N]``: HF row ``i`` is the file's row ``hf_rows()[i]`` (the inverse of the
        rotary permutation: :func:`reverse_permute` of the row indices)."""
        rows = np.arange(self.shape[0], dtype=np.int64)
        return reverse_permute(rows, self.permuted_heads) if self.permuted_heads else rows


def reverse_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (``convert_hf_to_gguf`` ``permute``), exactly as
    transformers' ``LlamaTensorProcessor._reverse_permute_weights``: rows ``[n_head * 2 *
    (D / 2), ...]`` go from interleaved rotary pairs back to the rotate-half order.

    ``n_head`` is ``num_attention_heads`` for Q and ``num_key_value_heads`` for K.
    """
    dim = weights.shape[0] // n_head // 2
    w = weights.reshape(n_head, dim, 2, *weights.shape[1:])
    return w.swapaxes(2, 1).reshape(weights.shape)


def is_block_weight(qtype_name: str, ndim: int, hf_name: str) -> bool:
    """Whether a GGUF tensor is kept as blocks: a quantized (not float) 2-D ``.weight``."""
    return ndim == 2 and hf_name.endswith(".weight") and qtype_name not in _FLOAT_TYPES


def permuted_heads(hf_name: str, config: Mapping[str, Any]) -> int:
    """The head count of llama.cpp's rotary row permutation of a Llama/Mistral Q or K weight
    (``config``: the HF config's dict), else 0."""
    if hf_name.endswith("q_proj.weight"):
        return int(config["num_attention_heads"])
    return int(config["num_key_value_heads"]) if hf_name.endswith("k_proj.weight") else 0


def write_blocks(folder: pathlib.Path, blocks: Mapping[str, GgufBlocks]) -> None:
    """Write ``blocks`` (HF name -> :class:`GgufBlocks`) into ``folder / BLOCKS_FILE``
    (nothing when empty)."""
    if not blocks:
        return
    import torch
    from safetensors.torch import save_file

    meta = {
        name: {"type": b.qtype, "shape": list(b.shape), "permuted_heads": b.permuted_heads}
        for name, b in blocks.items()
    }
    tensors = {
        name: torch.from_numpy(np.ascontiguousarray(b.raw, dtype=np.uint8).reshape(-1).copy())
        for name, b in blocks.items()
    }
    path = folder / BLOCKS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata={_METADATA_KEY: json.dumps(meta)})


def has_blocks(folder: pathlib.Path) -> bool:
    """Whether ``folder`` (a model folder) was converted from a GGUF with quantized weights."""
    return (folder / BLOCKS_FILE).is_file()


def read_blocks(folder: pathlib.Path) -> dict[str, GgufBlocks]:
    """The blocks :func:`write_blocks` wrote into ``folder`` (empty when there are none),
    memory-mapped read-only (the file is safetensors: an 8-byte little-endian header length,
    a JSON header of ``dtype``/``shape``/``data_offsets`` per tensor and ``__metadata__``,
    then the data; read here without copying it into process memory).

    Raises:
        ValueError: a file that is not such safetensors, or lacks the metadata that says what
            its tensors are (the message names the file; deleting the converted folder makes
            the next start convert again).
    """
    path = folder / BLOCKS_FILE
    if not path.is_file():
        return {}
    try:
        with path.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        meta: dict[str, Any] = json.loads(header["__metadata__"][_METADATA_KEY])
        data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + length)
        out = {}
        for name, m in meta.items():
            begin, end = header[name]["data_offsets"]
            n, k = (int(v) for v in m["shape"])
            out[name] = GgufBlocks(data[begin:end], m["type"], (n, k), int(m["permuted_heads"]))
    except (OSError, ValueError, KeyError, TypeError, struct.error) as e:
        raise ValueError(
            f"{path} is not a readable GGUF blocks file ({type(e).__name__}: {e}); delete "
            f"{folder} to convert the GGUF again"
        ) from None
    return out
