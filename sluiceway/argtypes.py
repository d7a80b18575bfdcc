"""argparse helpers: types that reject out-of-range numbers with a usage error (exit 2), not a
traceback, and the help formatter every `sluiceway` parser uses."""

from __future__ import annotations

import argparse
import pathlib
from collections.abc import Callable
from typing import NoReturn

# --quantization (worker/quantized.py), also a draft model's (sluiceway.speculative)
QUANTIZATION_CHOICES = ("auto", "gguf", "gguf_a8", "none")


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
    """An `argparse.ArgumentParser` whose help (and its subcommands') uses `HelpFormatter` and
    whose usage errors are one line on stderr, exit 2 (README: a configuration error is one
    line), e.g. ``sluiceway serve: error: argument --port: ... (see sluiceway serve --help)``.
    `add_subparsers` makes its subcommands' parsers of the same class."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def parse_args(self, args=None, namespace=None):  # type: ignore[no-untyped-def,override]
        """As argparse's, but unrecognized arguments are the error of the (sub)command that
        was given them (``sluiceway serve: error: ...``), not of the top-level parser."""
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            self._subcommand(parsed).error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed

    def _subcommand(self, parsed: argparse.Namespace) -> argparse.ArgumentParser:
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                sub = action.choices.get(getattr(parsed, action.dest, None) or "")
                if isinstance(sub, ArgumentParser):
                    return sub._subcommand(parsed)
        return self

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def bounded_int(
    low: int | None = None, high: int | None = None, *, kind: str = ""
) -> Callable[[str], int]:
    """An argparse type: an int in [low, high] (None: no bound there), else
    argparse.ArgumentTypeError ("must be >= 1, got 0", "must be <= 4294967295 (uint32), got
    5000000000" with ``kind="uint32"``: the type whose limit ``high`` is)."""
    suffix = f" ({kind})" if kind else ""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if low is not None and value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f"must be <= {high}{suffix}, got {value}")
        return value

    parse.__name__ = "int"
    return parse


def bounded_float(
    low: float | None = None,
    high: float | None = None,
    *,
    low_open: bool = False,
    high_open: bool = False,
) -> Callable[[str], float]:
    """An argparse type: a float between low and high (each bound included unless ``*_open``;
    None: no bound there; NaN refused), else argparse.ArgumentTypeError ("must be in [0, 1],
    got 2", "must be > 0, got 0")."""
    lo = "" if low is None else f"{'(' if low_open else '['}{low:g}"
    hi = "" if high is None else f"{high:g}{')' if high_open else ']'}"
    if low is None:
        want = f"must be {'<' if high_open else '<='} {high:g}"
    elif high is None:
        want = f"must be {'>' if low_open else '>='} {low:g}"
    else:
        want = f"must be in {lo}, {hi}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
        ok = value == value  # not NaN
        if low is not None:
            ok = ok and (value > low if low_open else value >= low)
        if high is not None:
            ok = ok and (value < high if high_open else value <= high)
        if not ok:
            raise argparse.ArgumentTypeError(f"{want}, got {text}")
        return value

    parse.__name__ = "float"
    return parse


positive_int = bounded_int(1)
non_negative_int = bounded_int(0)
positive_float = bounded_float(0, low_open=True)
non_negative_float = bounded_float(0)
fraction = bounded_float(0, 1)  # [0, 1]
_integer = bounded_int()


def port_number(text: str) -> int:
    """A TCP port, 0..65535 (0: one the OS picks). Raises argparse.ArgumentTypeError otherwise."""
    value = _integer(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number 0..65535, got {value}")
    return value


def metrics_port_number(text: str) -> int:
    """A TCP port for /metrics, or -1 for none. Raises argparse.ArgumentTypeError otherwise."""
    value = _integer(text)
    if not -1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number 0..65535 or -1 (off), got {value}")
    return value


def directory_path(text: str) -> pathlib.Path:
    """A directory to write in: one that exists, or a path where nothing is yet (made when
    used). Raises argparse.ArgumentTypeError for a file or other non-directory there."""
    path = pathlib.Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: exists and is not a directory")
    return path


_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def log_level(text: str) -> str:
    """A stdlib logging level name, any case (returned upper-case). Raises
    argparse.ArgumentTypeError otherwise."""
    if text.upper() not in _LOG_LEVELS:
        raise argparse.ArgumentTypeError(
            f"must be one of {', '.join(_LOG_LEVELS)} (any case), got {text!r}"
        )
    return text.upper()


def byte_size(zero_reason: str) -> Callable[[str], int]:
    """An argparse type: a byte size of at least 1 (:func:`sluiceway.sizes.parse_size`: bytes,
    or a number with KiB/MiB/GiB/TiB or KB/MB/GB/TB, e.g. 4GiB), else
    argparse.ArgumentTypeError; 0 is refused with ``zero_reason`` (what 0 would mean)."""

    def parse(text: str) -> int:
        from sluiceway.sizes import parse_size

        try:
            size = parse_size(text, allow_zero=True)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        if size == 0:
            raise argparse.ArgumentTypeError(f"must be at least 1 byte, got 0 ({zero_reason})")
        return size

    parse.__name__ = "size"
    return parse


def api_keys_text(text: str) -> str:
    """``--api-key``: one key or several, comma-separated (``k1,k2``), none empty; returned as
    given. Raises argparse.ArgumentTypeError otherwise (an empty key would let anyone in).
    The error never repeats the text: it is a secret."""
    if not text or any(not key.strip() for key in text.split(",")):
        raise argparse.ArgumentTypeError("must be one or more non-empty keys, comma-separated")
    return text


def cert_reqs(text: str) -> int:
    """``--ssl-cert-reqs``: Python's `ssl.VerifyMode` number, 0 (CERT_NONE: no client
    certificate asked for) or 2 (CERT_REQUIRED); 1 (CERT_OPTIONAL) is refused, because the
    gRPC port cannot ask for an optional one. Raises argparse.ArgumentTypeError otherwise."""
    value = _integer(text)
    if value not in (0, 2):
        raise argparse.ArgumentTypeError(
            f"must be 0 (no client certificate) or 2 (one required), got {value}"
            + (" (1, optional, is not supported by the gRPC port)" if value == 1 else "")
        )
    return value
