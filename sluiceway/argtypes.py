"""argparse helpers: types that reject out-of-range numbers with a usage error (exit 2), not a
traceback, and the help formatter every `sluiceway` parser uses."""

from __future__ import annotations

import argparse


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" to a flag's help, unless the help names its default already or
    the default is None (then the help must say what happens without the flag)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (
            "default" in text.lower()
            or action.default in (None, argparse.SUPPRESS)
            or not action.option_strings
        ):
            return text
        return text + " (default: %(default)s)"


class ArgumentParser(argparse.ArgumentParser):
    """An `argparse.ArgumentParser` whose help (and its subcommands') uses `HelpFormatter`."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)


def positive_int(text: str) -> int:
    """An int >= 1. Raises argparse.ArgumentTypeError otherwise."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def positive_float(text: str) -> float:
    """A float > 0 (``inf`` allowed, NaN not). Raises argparse.ArgumentTypeError otherwise."""
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def non_negative_int(text: str) -> int:
    """An int >= 0. Raises argparse.ArgumentTypeError otherwise."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def port_number(text: str) -> int:
    """A TCP port, 0..65535 (0: one the OS picks). Raises argparse.ArgumentTypeError otherwise."""
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number 0..65535, got {value}")
    return value


def metrics_port_number(text: str) -> int:
    """A TCP port for /metrics, or -1 for none. Raises argparse.ArgumentTypeError otherwise."""
    value = int(text)
    if not -1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number 0..65535 or -1 (off), got {value}")
    return value


def token_id_list(text: str) -> list[int]:
    """Comma-separated token ids, each >= 0 (``2,7``). Raises argparse.ArgumentTypeError
    otherwise."""
    try:
        ids = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be token ids like 2,7, got {text!r}") from None
    if any(i < 0 for i in ids):
        raise argparse.ArgumentTypeError(f"token ids must be >= 0, got {text!r}")
    return ids
