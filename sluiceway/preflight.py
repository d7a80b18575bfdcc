"""Configuration checks made before a process starts serving (by `serve` before it starts any
child), so that a bad flag is one line on stderr and exit 2, not a child's traceback."""

from __future__ import annotations

import json
import pathlib


class ConfigError(ValueError):
    """A flag, or a combination of flags, that cannot be served."""


def check_device(device: str) -> None:
    """Refuses ``cuda`` (or ``cuda:N``) without a usable GPU; imports torch only then.

    Raises:
        ConfigError: a CPU-only torch build, or no CUDA device visible.
    """
    if not device.startswith("cuda"):
        return
    import torch

    if torch.version.cuda is None:
        raise ConfigError(
            f"--device cuda: torch {torch.__version__} is a CPU-only build; install a CUDA "
            "build of torch (README: GPU install) or pass --device cpu"
        )
    if not torch.cuda.is_available():
        raise ConfigError("--device cuda: torch sees no CUDA device (torch.cuda.is_available())")


def check_max_model_len(model_dir: pathlib.Path, max_model_len: int | None) -> None:
    """Refuses a ``--max-model-len`` above the context of the model in ``model_dir`` (an HF
    folder with ``config.json``), as the worker would after importing torch.

    Raises:
        ConfigError: see :func:`sluiceway.model_files.resolve_max_model_len`.
    """
    from sluiceway.model_files import context_window, resolve_max_model_len  # numpy: not here

    if max_model_len is None:
        return
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    try:
        resolve_max_model_len(max_model_len, context_window(config)[0])
    except ValueError as e:
        raise ConfigError(str(e)) from None


def check_architecture(model_dir: pathlib.Path) -> None:
    """Refuses a model folder whose ``config.json`` names an architecture the worker does not
    implement, as the worker would after importing torch (the same line).

    Raises:
        ConfigError: see :func:`sluiceway.worker.architectures.model_type_of`.
    """
    from sluiceway.worker.architectures import UnsupportedModelError, model_type_of

    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    try:
        model_type_of(config)
    except UnsupportedModelError as e:
        raise ConfigError(str(e)) from None


def check_draft_vocabulary(model_dir: pathlib.Path, draft_dir: pathlib.Path) -> None:
    """Refuses a draft model (``--speculative-config``) whose ``config.json`` vocabulary
    differs from the model's, as the worker would once both are loaded (the same line).

    Raises:
        ConfigError: the two ``vocab_size`` values differ.
    """
    draft, model = (json.loads((d / "config.json").read_text(encoding="utf-8")).get("vocab_size")
                    for d in (draft_dir, model_dir))  # fmt: skip
    if draft != model:
        raise ConfigError(f"the draft's vocabulary has {draft} tokens, the model's {model}")
