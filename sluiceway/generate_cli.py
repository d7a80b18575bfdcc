"""`sluiceway generate`: one request to a running server, every `SamplingParams` field a flag."""

from __future__ import annotations

import argparse
import pathlib
import sys
from typing import TYPE_CHECKING, Any

from sluiceway.argtypes import INT32, UINT32, UINT64, bounded_int, token_id_list

if TYPE_CHECKING:
    from sluiceway.v1 import inference_pb2

DEFAULT_TARGET = "127.0.0.1:50051"
# Integer flags bounded by their SamplingParams field's type (the protobuf constructor raises
# ValueError past it); the server checks the tighter limits (n <= 16, logprobs <= 20, ...).
_COUNT = bounded_int(1, UINT32[1], kind="uint32")
_UINT32 = bounded_int(*UINT32, kind="uint32")
_FINISH = {1: "stop", 2: "length", 3: "abort"}
# flag dest -> SamplingParams field, sent only when given (the server's defaults otherwise)
_SAMPLING_FIELDS = (
    "max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
    "repetition_penalty", "presence_penalty", "frequency_penalty", "stop", "stop_token_ids",
    "skip_special_tokens", "logprobs", "n",
)  # fmt: skip


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Adds the `generate` subcommand to `sub` (flags named as vLLM's `SamplingParams`)."""
    gen = sub.add_parser(
        "generate",
        help="stream one completion from a running server",
        description="Stream one completion from a running server to stdout. Sampling flags "
        "left out take the server's defaults (vLLM's); usage, logprobs and hints go to stderr.",
    )
    gen.add_argument("prompt", help="the prompt; - reads it from stdin (trailing newlines dropped)")
    gen.add_argument(
        "--target", default=DEFAULT_TARGET, help="the router's gRPC address, host:port or unix:PATH"
    )
    gen.add_argument(
        "--chat",
        action="store_true",
        help="send PROMPT as one user message through the model's chat template",
    )
    gen.add_argument(
        "--system-prompt",
        "--system",
        default=None,
        help="a system message before PROMPT; implies --chat (default: none)",
    )
    gen.add_argument(
        "--max-tokens", type=_COUNT, default=None, help="tokens to generate (default: 16)"
    )
    gen.add_argument(
        "--min-tokens",
        type=_UINT32,
        default=None,
        help="no EOS, stop token id or stop string ends the output before this many tokens "
        "(default: 0)",
    )
    gen.add_argument("--temperature", type=float, default=None, help="0 = greedy (default: 1.0)")
    gen.add_argument(
        "--top-p", type=float, default=None, help="nucleus sampling, in (0, 1] (default: 1.0, off)"
    )
    gen.add_argument(
        "--top-k",
        type=bounded_int(*INT32, kind="int32"),
        default=None,
        help="the K most likely tokens only (default: 0, off)",
    )
    gen.add_argument(
        "--min-p",
        type=float,
        default=None,
        help="drop tokens less likely than this times the most likely one (default: 0, off)",
    )
    gen.add_argument(
        "--seed",
        type=bounded_int(*UINT64, kind="uint64"),
        default=None,
        help="sampling seed, for repeatable samples (default: none)",
    )
    gen.add_argument(
        "--repetition-penalty",
        type=float,
        default=None,
        help="> 1 discourages tokens of the prompt and output (CTRL's; default: 1.0, off)",
    )
    gen.add_argument(
        "--presence-penalty",
        type=float,
        default=None,
        help="in [-2, 2], subtracted from tokens already generated (default: 0, off)",
    )
    gen.add_argument(
        "--frequency-penalty",
        type=float,
        default=None,
        help="in [-2, 2], times each token's count in the output (default: 0, off)",
    )
    gen.add_argument(
        "--stop",
        action="append",
        default=None,
        metavar="STRING",
        help="a stop string, left out of the output; repeat for several (default: none)",
    )
    gen.add_argument(
        "--stop-token-ids",
        type=token_id_list,
        default=None,
        metavar="ID[,ID...]",
        help="token ids that end the output, comma-separated (default: none)",
    )
    gen.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")
    gen.add_argument(
        "--include-stop-str-in-output",
        action="store_true",
        help="keep the matched stop string at the end of the output",
    )
    gen.add_argument(
        "--skip-special-tokens",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="leave special tokens out of the text (default: on)",
    )
    gen.add_argument(
        "--logprobs",
        type=_UINT32,
        default=None,
        metavar="N",
        help="print each generated token's log-probability and the top N alternatives "
        "(N <= 20) to stderr after the text (default: none)",
    )
    gen.add_argument(
        "-n",
        "--n",
        type=_COUNT,
        default=None,
        help="samples of the prompt (1..16), printed one after the other under a "
        "'--- sample I ---' line (default: 1)",
    )
    constraint = gen.add_argument_group(
        "structured outputs (at most one; README, Structured outputs)"
    ).add_mutually_exclusive_group()
    constraint.add_argument(
        "--json-schema",
        metavar="SCHEMA",
        default=None,
        help="the output is JSON valid against this schema: JSON text, or @FILE (default: none)",
    )
    constraint.add_argument(
        "--json-object", action="store_true", help="the output is a JSON object"
    )
    constraint.add_argument(
        "--regex", default=None, help="the whole output matches this regex (default: none)"
    )
    constraint.add_argument(
        "--choice",
        action="append",
        default=None,
        help="the output is one of these strings; repeat it for each (default: none)",
    )
    constraint.add_argument(
        "--grammar",
        default=None,
        help="the output follows this EBNF grammar (a root rule): text, or @FILE (default: none)",
    )
    gen.add_argument(
        "--show-usage",
        action="store_true",
        help="print the finish reason and the prompt and completion token counts to stderr",
    )


def build_request(args: argparse.Namespace, prompt: str) -> inference_pb2.GenerateRequest:
    """The `GenerateRequest` of parsed `generate` flags and ``prompt``: the flags given set their
    `SamplingParams` field, the others stay unset (the server's defaults); ``--chat`` or
    ``--system-prompt`` send ``prompt`` as a user message."""
    from sluiceway.client import Client

    sampling: dict[str, Any] = {
        name: getattr(args, name) for name in _SAMPLING_FIELDS if getattr(args, name) is not None
    }
    for flag in ("ignore_eos", "include_stop_str_in_output"):
        if getattr(args, flag):
            sampling[flag] = True
    structured = _structured_outputs(args)
    if structured is not None:
        sampling["structured_outputs"] = structured
    if args.chat or args.system_prompt is not None:
        messages = [("user", prompt)]
        if args.system_prompt is not None:
            messages.insert(0, ("system", args.system_prompt))
        return Client.request(messages=messages, **sampling)
    return Client.request(prompt, **sampling)


def _structured_outputs(args: argparse.Namespace) -> inference_pb2.StructuredOutputs | None:
    """The constraint of ``--json-schema``, ``--json-object``, ``--regex``, ``--choice`` or
    ``--grammar`` (``@FILE`` reads a schema or grammar from FILE), None for none.

    Raises:
        OSError: an @FILE that cannot be read.
    """
    from sluiceway.v1 import inference_pb2

    def text(value: str) -> str:
        return pathlib.Path(value[1:]).read_text() if value.startswith("@") else value

    if args.json_schema is not None:
        return inference_pb2.StructuredOutputs(json=text(args.json_schema))
    if args.json_object:
        return inference_pb2.StructuredOutputs(json_object=True)
    if args.regex is not None:
        return inference_pb2.StructuredOutputs(regex=args.regex)
    if args.choice is not None:
        return inference_pb2.StructuredOutputs(choice=inference_pb2.Choices(choices=args.choice))
    if args.grammar is not None:
        return inference_pb2.StructuredOutputs(grammar=text(args.grammar))
    return None


def generate_command(args: argparse.Namespace) -> int:
    """Runs `sluiceway generate`: the text to stdout (streamed when n is 1), the rest to stderr.

    Returns 0, 1 with "sluiceway generate: CODE: details" on a failed call, or 2 when an
    @FILE cannot be read. Raises
    KeyboardInterrupt on Ctrl-C (the caller prints one line and exits 130).
    """
    import grpc

    from sluiceway.client import Client

    prompt = sys.stdin.read().rstrip("\n") if args.prompt == "-" else args.prompt
    try:
        req = build_request(args, prompt)
    except OSError as e:  # an @FILE of --json-schema or --grammar
        print(f"sluiceway generate: {e.filename}: {e.strerror}", file=sys.stderr)
        return 2
    n = args.n or 1
    texts = [""] * n
    ids: list[list[int]] = [[] for _ in range(n)]
    last: list[Any] = [None] * n
    logprobs: list[list[Any]] = [[] for _ in range(n)]
    with Client(args.target) as client:
        try:
            for response in client.generate_stream(req):
                i = response.index
                texts[i] += response.text
                ids[i].extend(response.token_ids)
                logprobs[i].extend(response.logprobs)
                last[i] = response
                if n == 1:
                    sys.stdout.write(response.text)
                    sys.stdout.flush()
            eos_ids = set(client.model_info().eos_token_ids) if "" in texts else set()
        except grpc.RpcError as e:
            _end_line(n, texts)
            print(f"sluiceway generate: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            _end_line(n, texts)
            raise
    for i in range(n):
        label = f"sample {i}: " if n > 1 else ""
        if n > 1:
            print(f"--- sample {i} ---")
            sys.stdout.write(texts[i])
        if texts[i] or n > 1:
            sys.stdout.write("\n")
            sys.stdout.flush()
        reason = _FINISH.get(last[i].finish_reason, "unknown") if last[i] else "none"
        if not texts[i]:
            print(f"sluiceway generate: {label}{_empty_hint(reason, ids[i], eos_ids)}",
                  file=sys.stderr)  # fmt: skip
        if args.logprobs is not None:
            for k, lp in enumerate(logprobs[i]):
                top = ", ".join(f"{t.token_id} {t.logprob:.4f}" for t in lp.top_logprobs)
                print(f"logprobs: {label}{k} token {lp.token_id} {lp.logprob:.4f}"
                      + (f"  top: {top}" if top else ""), file=sys.stderr)  # fmt: skip
        if args.show_usage and last[i] is not None:
            u = last[i].usage
            print(f"usage: {label}finish reason {reason}, prompt tokens {u.prompt_tokens}, "
                  f"completion tokens {u.completion_tokens}", file=sys.stderr)  # fmt: skip
    return 0


def _end_line(n: int, texts: list[str]) -> None:
    """Ends the line of a streamed text cut short, so that a message after it stands alone."""
    if n == 1 and texts[0]:
        sys.stdout.write("\n")
        sys.stdout.flush()


def _empty_hint(reason: str, ids: list[int], eos_ids: set[int]) -> str:
    """Why a sample has no text, and what to try."""
    if reason == "stop" and (not ids or ids[0] in eos_ids):
        return (
            "no tokens generated (finish reason: stop, the model emitted EOS first); "
            "try --ignore-eos or --min-tokens"
        )
    return f"no text generated (finish reason: {reason}, {len(ids)} token(s))"
