"""`make serve`'s first step, before the install: serve's flags parsed by serve's own parser,
every port of the stack checked (`sluiceway.ports.plan_ports`), the API key and TLS files
read (`sluiceway.security.check_files`) and the model paths looked at
(`sluiceway.model_paths`: `--model`'s and a draft model's), with the standard library
alone (``python3 -S -m sluiceway.serve_check [serve flags]`` from the repository's root), so
that a bad flag or a taken port is one line and exit 2 before a four-minute install, not
after it. `sluiceway serve` makes the same checks again, then those that need the installed
packages (the model, the device)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from sluiceway.argtypes import ArgumentParser
from sluiceway.model_paths import check_model_path, local_model_path
from sluiceway.ports import plan_ports
from sluiceway.security import check_files
from sluiceway.serve_config import ServeConfig


def main(argv: Sequence[str] | None = None) -> int:
    """Returns 0 when serve's flags `argv` parse and every port is free; else prints
    serve's line (a usage error, or ``sluiceway: --port 50051 is taken (...)``) and returns
    2. ``--help`` is left to `sluiceway serve`, which prints it after the install."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if {"-h", "--help"} & set(argv):
        return 0
    parser = ArgumentParser(prog="sluiceway serve")
    ServeConfig.add_arguments(parser)
    args = parser.parse_args(argv)  # a usage error exits 2 here, as serve's would
    try:
        config = ServeConfig.from_namespace(args)
        plan_ports(config)
        check_files(config.router)
        check_model_paths(config)
    except ValueError as e:
        print(f"sluiceway: {e}", file=sys.stderr)
        return 2
    return 0


def check_model_paths(config: ServeConfig) -> None:
    """Refuses a ``--model`` path, or a ``draft_model``'s ``model`` in
    ``--speculative-config``, that is not a model folder or a ``.gguf`` file (the embedded
    model and a packaged short name are looked up after the install, by serve).

    Raises:
        ValueError: serve's message for that path (a draft's prefixed
            ``speculative_config.model: ``).
    """
    spec = config.scheduler.speculative
    draft = spec.draft_model_path if spec is not None else None
    for prefix, given in (("", config.worker.model), ("speculative_config.model: ", draft)):
        path = local_model_path(given)
        if path is None:
            continue
        try:
            check_model_path(path, given)
        except ValueError as e:
            raise ValueError(f"{prefix}{e}") from None


if __name__ == "__main__":
    sys.exit(main())
