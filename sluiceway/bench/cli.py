"""The `sluiceway bench serve|compare|step|grammar|quality|roofline` flags (vLLM's names where vLLM has the flag)."""

from __future__ import annotations

import argparse
import sys

from sluiceway.argtypes import directory_path, positive_int
from sluiceway.bench.grammar import add_grammar_args
from sluiceway.bench.quality import add_quality_args
from sluiceway.bench.roofline import ROOFLINE_HELP, add_roofline_args
from sluiceway.bench.step import add_step_args
from sluiceway.bench.workload import add_workload_args
from sluiceway.speculative import speculative_config_arg
from sluiceway.targets import DEFAULT_TARGET, TARGET_HELP, add_connection_args, grpc_target


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    serve = bench_sub.add_parser("serve", help="serving benchmark against a running server")
    serve.add_argument(
        "--target",
        type=grpc_target,
        default=DEFAULT_TARGET,
        help=f"{TARGET_HELP} (--backend sluiceway)",
    )
    serve.add_argument(
        "--backend",
        choices=("sluiceway", "openai"),
        default="sluiceway",
        help="sluiceway: the gRPC API at --target; openai: streamed /v1/completions at "
        "--base-url (vLLM's --backend openai: any OpenAI-compatible server)",
    )
    serve.add_argument(
        "--base-url", default="http://127.0.0.1:8000", help="the HTTP API (--backend openai)"
    )
    serve.add_argument(
        "--served-model-name",
        default=None,
        help="the request's model (--backend openai; default: the server's first)",
    )
    serve.add_argument(
        "--no-keep-alive",
        dest="keep_alive",
        action="store_false",
        help="a new connection per request (--backend openai; for servers that close the "
        "connection after a streamed response, e.g. llama.cpp's llama-server)",
    )
    add_connection_args(serve)  # both backends: --api-key, --tls, --ssl-ca-certs, ...
    add_workload_args(serve)

    compare = bench_sub.add_parser(
        "compare",
        help="start a server per configuration (and/or the transformers baseline), run the "
        "same workload on each, print one comparison table",
    )
    add_compare_args(compare)
    add_workload_args(compare)
    step = bench_sub.add_parser(
        "step", help="time the worker's model step on a synthetic decode batch (the hot path)"
    )
    add_step_args(step)
    grammar = bench_sub.add_parser(
        "grammar",
        help="structured outputs: compile time per constraint kind and the token mask's "
        "cost per step at --num-seqs constrained sequences",
    )
    add_grammar_args(grammar)
    quality = bench_sub.add_parser(
        "quality",
        help="perplexity and greedy top-1 agreement of serving modes (worker flags, e.g. "
        "dtype=bfloat16) against a float32 reference, over ShareGPT turns",
    )
    add_quality_args(quality)
    add_roofline_args(bench_sub.add_parser("roofline", help=ROOFLINE_HELP))


def add_compare_args(p: argparse.ArgumentParser) -> None:
    """`bench compare`'s own flags (the workload's are `add_workload_args`')."""
    p.add_argument(
        "--backend",
        "--backends",
        default="sluiceway",
        help="comma list of sluiceway, transformers (batched generate, static batches)",
    )
    p.add_argument(
        "--policies", default="static,continuous", help="comma list of scheduling policies"
    )
    p.add_argument(
        "--max-num-seqs", default="256", help="comma list: one continuous configuration each"
    )
    p.add_argument(
        "--static-batch-size",
        type=positive_int,
        default=32,
        help="batch of the static policy and of the transformers baseline",
    )
    p.add_argument(
        "--reference",
        default=None,
        help="the column the ratios compare against: a label or its start, e.g. static "
        "(default: continuous)",
    )
    p.add_argument(
        "--speculative-config",
        type=speculative_config_arg,
        default="",
        help="speculative decoding (`sluiceway serve`'s flag, vLLM's JSON): each continuous "
        'configuration runs a second time with it, in a column "... + spec" ("": none)',
    )
    p.add_argument(
        "--serve-args",
        default="",
        help="extra `sluiceway serve` flags for every sluiceway configuration, one string",
    )
    p.add_argument(
        "--server-log-dir",
        type=directory_path,
        default=None,
        metavar="DIR",
        help="keep each sluiceway server's log as DIR/LABEL.log, the label's spaces and "
        "signs as '-', e.g. continuous-spec.log (default: a temporary file, "
        "its tail printed if the server fails to start); with --serve-args '--log-level "
        "debug --log-format json' scripts/step_attribution.py reads them",
    )
    p.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        default="auto",
        help="dtype of the transformers baseline (auto: as the worker resolves it)",
    )


def bench_command(args: argparse.Namespace) -> int:
    if args.bench_command == "step":
        from sluiceway.bench.step import step_command

        return step_command(args)
    if args.bench_command == "quality":
        from sluiceway.bench.quality import quality_command

        return quality_command(args)
    if args.bench_command == "roofline":
        from sluiceway.bench.roofline import roofline_command

        return roofline_command(args)
    if args.bench_command == "grammar":
        from sluiceway.bench.grammar import grammar_command

        return grammar_command(args)
    from sluiceway.bench.extras import missing_bench_extra

    missing = missing_bench_extra(args)
    if missing:
        print(f"sluiceway bench {args.bench_command}: {missing}", file=sys.stderr)
        return 2
    if args.bench_command == "compare":
        from sluiceway.bench.compare import compare_command

        return compare_command(args)
    from sluiceway.bench.serve import serve_command

    return serve_command(args)
