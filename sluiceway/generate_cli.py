"""`sluiceway generate`: one request to a running server, every `SamplingParams` field a flag."""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from sluiceway.argtypes import bounded_float, bounded_int
from sluiceway.sampling_params import FIELDS, Rule, python_type, wire_range
from sluiceway.targets import (
    DEFAULT_TARGET,
    TARGET_HELP,
    add_connection_args,
    client_options,
    grpc_target,
)
from sluiceway.v1 import inference_pb2

if TYPE_CHECKING:
    import grpc

_FINISH = {1: "stop", 2: "length", 3: "abort", 4: "tool_calls"}

# How `generate` presents some sampling flags (metavar, a word on its output, a short name);
# every flag's name, type, bounds, default and help come from the sampling contract.
_PRESENTATION: dict[str, dict[str, str]] = {
    "stop": {"metavar": "STRING", "more": "; repeat for several"},
    "stop_token_ids": {"metavar": "ID[,ID...]", "more": ", comma-separated"},
    "logit_bias": {"metavar": "ID=BIAS[,ID=BIAS...]", "more": ", comma-separated"},
    "allowed_token_ids": {"metavar": "ID[,ID...]", "more": ", comma-separated"},
    "logprobs": {"metavar": "N", "more": "; printed to stderr after the text"},
    "prompt_logprobs": {"metavar": "N", "more": "; printed to stderr after the text"},
    "n": {"short": "-n", "more": "; printed one after the other under a '--- sample I ---' line"},
}


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Adds the `generate` subcommand to `sub`: a flag for every `SamplingParams` field
    (named as vLLM's, derived from sluiceway/sampling_params.py), the constraint flags and
    how to send the prompt."""
    gen = sub.add_parser(
        "generate",
        help="stream one completion from a running server",
        description="Stream one completion from a running server to stdout. Sampling flags "
        "left out take the server's defaults (vLLM's); usage, logprobs and hints go to stderr.",
    )
    gen.add_argument("prompt", help="the prompt; - reads it from stdin (trailing newlines dropped)")
    gen.add_argument("--target", type=grpc_target, default=DEFAULT_TARGET, help=TARGET_HELP)
    add_connection_args(gen)
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
        "--priority",
        type=int,
        default=0,
        help="lower is served first by a server run with --scheduling-policy priority "
        "(default 0; a server under fcfs refuses anything else)",
    )
    for name in FIELDS:
        if python_type(name) is not None:  # a message: structured_outputs, below
            _add_sampling_flag(gen, name)
    _add_constraint_flags(gen)
    tools = gen.add_argument_group("tool calling (imply --chat; docs/tool-calling.md)")
    tools.add_argument(
        "--tool",
        action="append",
        default=None,
        metavar="JSON",
        help='a function the model may call: {"name", "description", "parameters": SCHEMA}, '
        "or OpenAI's tools entry, as JSON text or @FILE; repeat it for each (default: none)",
    )
    tools.add_argument(
        "--tool-choice",
        default=None,
        metavar="none|auto|required|NAME",
        help="whether and which tool to call; the calls are printed after the text as "
        "'tool call NAME ARGUMENTS' lines (default: the server's, auto with tools)",
    )
    gen.add_argument(
        "--show-usage",
        action="store_true",
        help="print the finish reason and the prompt and completion token counts to stderr",
    )


def _add_sampling_flag(gen: argparse.ArgumentParser, name: str) -> None:
    """The flag of sampling field `name`; unset, the field is left to the server."""
    default, rule = FIELDS[name]
    extra = _PRESENTATION.get(name, {})
    names = [f"--{name.replace('_', '-')}"]
    if "short" in extra:
        names.insert(0, extra["short"])
    shown = "none" if default is None or default in ((), {}) else default
    text = rule.help + extra.get("more", "")
    if rule.low is not None or rule.high is not None:
        text += f"; {rule.allowed()}"
    kwargs: dict[str, Any] = {"default": None, "help": f"{text} (default: {shown})"}
    if "metavar" in extra:
        kwargs["metavar"] = extra["metavar"]
    kind = python_type(name)
    if kind is bool:
        kwargs["action"] = argparse.BooleanOptionalAction if default else "store_true"
        if not default:
            kwargs["default"] = False
    elif kind is float:
        kwargs["type"] = _float_type(rule)
    elif kind is int:
        kwargs["type"] = _integer_type(name)
    elif kind == list[str]:
        kwargs["action"] = "append"
    elif kind == list[int]:
        kwargs["type"] = _id_list
    else:
        kwargs["type"] = _bias_map
    gen.add_argument(*names, **kwargs)


def _float_type(rule: Rule) -> Callable[[str], float]:
    """An argparse type for a float sampling field: the contract's own range and words
    (`Rule.admits`, `Rule.allowed`: "must be a finite number >= 0 (0 = greedy), got inf")."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
        if not rule.admits(value):
            raise argparse.ArgumentTypeError(f"must be {rule.allowed()}, got {text}")
        return value

    return parse


def _integer_type(name: str) -> Callable[[str], int]:
    """An argparse type for integer sampling field `name`: its range, within its proto type."""
    _, rule = FIELDS[name]
    wire = wire_range(inference_pb2.SamplingParams.DESCRIPTOR.fields_by_name[name])
    assert wire is not None
    kind, lo, hi = wire
    low = lo if rule.low is None else max(lo, int(rule.low))
    if rule.high is None:
        return bounded_int(low, hi, kind=kind)
    return bounded_int(low, min(hi, int(rule.high)))


_TOKEN_ID = bounded_int(0, 2**32 - 1, kind="uint32")  # TokenIds.ids and the id maps' keys


def _id_list(text: str) -> list[int]:
    """Comma-separated token ids (``2,7``), each a uint32."""
    return [_TOKEN_ID(part) for part in text.split(",")]


def _bias_map(text: str) -> dict[int, float]:
    """``ID=BIAS,...`` (``28=100,29=-5``): token ids and the bias of each, in [-100, 100]."""
    _, rule = FIELDS["logit_bias"]
    bias = bounded_float(rule.low, rule.high)
    out: dict[int, float] = {}
    for part in text.split(","):
        token, sep, value = part.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"must be ID=BIAS pairs like 28=100, got {text!r}")
        out[_TOKEN_ID(token)] = bias(value)
    return out


def _add_constraint_flags(gen: argparse.ArgumentParser) -> None:
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


def build_request(args: argparse.Namespace, prompt: str) -> inference_pb2.GenerateRequest:
    """The `GenerateRequest` of parsed `generate` flags and ``prompt``: the flags given set their
    `SamplingParams` field, the others stay unset (the server's defaults); ``--chat`` or
    ``--system-prompt`` send ``prompt`` as a user message."""
    from sluiceway.client import Client

    sampling: dict[str, Any] = {}
    for name, (default, _) in FIELDS.items():
        value = getattr(args, name, None)
        # unset: None, or False for a store_true flag (a field whose default is false)
        if value is not None and (value is not False or default):
            sampling[name] = value
    structured = _structured_outputs(args)
    if structured is not None:
        sampling["structured_outputs"] = structured
    tools = [_tool(t) for t in args.tool or []]
    if args.chat or args.system_prompt is not None or tools or args.tool_choice is not None:
        messages: list[Any] = [("user", prompt)]
        if args.system_prompt is not None:
            messages.insert(0, ("system", args.system_prompt))
        return Client.request(
            messages=messages,
            priority=args.priority,
            tools=tools,
            tool_choice=args.tool_choice,
            **sampling,
        )
    return Client.request(prompt, priority=args.priority, **sampling)


def _tool(value: str) -> inference_pb2.Tool:
    """The `Tool` of a ``--tool`` value: JSON text or @FILE of a function, or of OpenAI's
    ``{"type": "function", "function": {...}}``.

    Raises:
        OSError: an @FILE that cannot be read.
        ValueError: not JSON of an object with a string ``name``.
    """
    text = pathlib.Path(value[1:]).read_text() if value.startswith("@") else value
    try:
        spec = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise ValueError(f"--tool: not JSON text ({e}): {value}") from None
    if isinstance(spec, dict) and isinstance(spec.get("function"), dict):
        spec = spec["function"]
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise ValueError(f"--tool: not a function with a name: {value}")
    parameters = spec.get("parameters")
    return inference_pb2.Tool(
        name=spec["name"],
        description=str(spec.get("description") or ""),
        parameters=json.dumps(parameters) if parameters is not None else "",
    )


def _structured_outputs(args: argparse.Namespace) -> inference_pb2.StructuredOutputs | None:
    """The constraint of ``--json-schema``, ``--json-object``, ``--regex``, ``--choice`` or
    ``--grammar`` (``@FILE`` reads a schema or grammar from FILE), None for none.

    Raises:
        OSError: an @FILE that cannot be read.
    """

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
    @FILE or a TLS file cannot be read. Raises
    KeyboardInterrupt on Ctrl-C (the caller prints one line and exits 130).
    """
    import grpc

    from sluiceway.client import Client

    prompt = sys.stdin.read().rstrip("\n") if args.prompt == "-" else args.prompt
    try:
        req = build_request(args, prompt)
    except OSError as e:  # an @FILE of --json-schema, --grammar or --tool
        print(f"sluiceway generate: {e.filename}: {e.strerror}", file=sys.stderr)
        return 2
    except ValueError as e:  # a --tool that is not a function's JSON
        print(f"sluiceway generate: {e}", file=sys.stderr)
        return 2
    n = args.n or 1
    texts = [""] * n
    ids: list[list[int]] = [[] for _ in range(n)]
    last: list[Any] = [None] * n
    logprobs: list[list[Any]] = [[] for _ in range(n)]
    calls: list[dict[int, list[str]]] = [{} for _ in range(n)]  # index -> [name, arguments]
    prompt_logprobs: list[list[Any]] = [[] for _ in range(n)]
    started = False
    try:
        client = Client(args.target, **client_options(args))
    except (OSError, ValueError) as e:  # a certificate or key file, or only one of the pair
        print(f"sluiceway generate: {e}", file=sys.stderr)
        return 2
    with client:
        try:
            for response in client.generate_stream(req):
                started = True
                i = response.index
                texts[i] += response.text
                ids[i].extend(response.token_ids)
                logprobs[i].extend(response.logprobs)
                for call in response.tool_calls:
                    calls[i].setdefault(call.index, [call.name, ""])[1] += call.arguments
                prompt_logprobs[i].extend(response.prompt_logprobs)
                last[i] = response
                if n == 1:
                    sys.stdout.write(response.text)
                    sys.stdout.flush()
            eos_ids = set(client.model_info().eos_token_ids) if "" in texts else set()
        except grpc.RpcError as e:
            _end_line(n, texts)
            print(f"sluiceway generate: {_failure(e, args.target, started)}", file=sys.stderr)
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
        for name, arguments in calls[i].values():
            sys.stdout.write(f"tool call {name} {arguments}\n")
        sys.stdout.flush()
        reason = _FINISH.get(last[i].finish_reason, "unknown") if last[i] else "none"
        if not texts[i] and not calls[i]:
            print(f"sluiceway generate: {label}{_empty_hint(reason, ids[i], eos_ids)}",
                  file=sys.stderr)  # fmt: skip
        if args.prompt_logprobs is not None:
            _print_logprobs(label + "prompt ", prompt_logprobs[i], prompt=True)
        if args.logprobs is not None:
            _print_logprobs(label, logprobs[i])
        if args.show_usage and last[i] is not None:
            u = last[i].usage
            print(f"usage: {label}finish reason {reason}, prompt tokens {u.prompt_tokens}, "
                  f"completion tokens {u.completion_tokens}", file=sys.stderr)  # fmt: skip
    return 0


def _failure(error: grpc.RpcError, target: str, started: bool) -> str:
    """The line of a failed call: its code and details; or, when gRPC itself failed to reach
    `target` before any response (UNAVAILABLE, not a status a sluiceway server wrote), what
    went wrong in gRPC's last words and what to check."""
    import grpc

    from sluiceway.status import written_by_sluiceway

    code, details = error.code(), error.details() or ""  # type: ignore[attr-defined]
    if code != grpc.StatusCode.UNAVAILABLE or started or written_by_sluiceway(error):
        return f"{code.name}: {details}"
    lowered = details.lower()
    if "handshake" in lowered or "certificate" in lowered or "ssl" in lowered:
        why = "CERTIFICATE_VERIFY_FAILED" if "certificate_verify_failed" in lowered else "failed"
        return (
            f"the TLS handshake with {target} {why.lower().replace('_', ' ')}: a self-signed "
            "server certificate needs --ssl-ca-certs CA.pem; a plaintext server, no --tls"
        )
    reason = details.rstrip("]").rsplit(": ", 1)[-1]  # "...: Connection refused"
    reason = reason[:1].lower() + reason[1:]
    hint = " or does it serve TLS (--tls, --ssl-ca-certs)?" if "socket closed" in lowered else ""
    return (
        f"cannot reach a sluiceway server at {target} ({reason}); is `sluiceway serve` "
        f"running there? (--target){hint}"
    )


def _print_logprobs(
    label: str, logprobs: list[inference_pb2.TokenLogprobs], prompt: bool = False
) -> None:
    """One stderr line per token: its position, text (JSON-quoted: whitespace shows), id and
    log-probability, then the top ones the same way. ``prompt``: the prompt's entries (the
    first has no log-probability: "none")."""

    def token(text: str, token_id: int, logprob: float | None) -> str:
        value = "none" if logprob is None else f"{logprob:.4f}"
        return f"{json.dumps(text, ensure_ascii=False)} ({token_id}) {value}"

    for k, lp in enumerate(logprobs):
        top = ", ".join(token(t.token, t.token_id, t.logprob) for t in lp.top_logprobs)
        value = None if prompt and k == 0 else lp.logprob
        print(f"logprobs: {label}{k} token {token(lp.token, lp.token_id, value)}"
              + (f"  top: {top}" if top else ""), file=sys.stderr)  # fmt: skip


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
