"""`sluiceway generate` without a running server: the request its flags make (every sampling
param, structured outputs, tools), the sampling contract's numbers as one-line usage errors
(exit 2), its --target addresses (and `bench serve`'s), and the one-line errors when no server
answers or TLS fails."""

from __future__ import annotations

import json

import grpc
import pytest

from sluiceway.cli import build_parser
from sluiceway.generate_cli import build_request
from sluiceway.v1 import inference_pb2
from tests.cli_helpers import run_cli, usage_error


def test_generate_has_a_flag_for_every_sampling_param() -> None:
    args = build_parser().parse_args(
        ["generate", "Hi", "--system", "Be brief.", "--max-tokens", "9", "--min-tokens", "2",
         "--temperature", "0.5", "--top-p", "0.9", "--top-k", "40", "--min-p", "0.1",
         "--seed", "3", "--repetition-penalty", "1.2", "--presence-penalty", "0.5",
         "--frequency-penalty", "-0.5", "--stop", "a", "--stop", "b c", "--stop-token-ids",
         "2,7", "--ignore-eos", "--include-stop-str-in-output", "--no-skip-special-tokens",
         "--logprobs", "5", "-n", "2", "--logit-bias", "28=100,29=-5.5", "--allowed-token-ids",
         "4,5", "--prompt-logprobs", "0", "--choice", "yes", "--choice", "no"]
    )  # fmt: skip
    req = build_request(args, "Hi")
    s = req.sampling
    for field in inference_pb2.SamplingParams.DESCRIPTOR.fields:
        value = getattr(s, field.name)
        assert value or (field.has_presence and s.HasField(field.name)), field.name
    assert (s.max_tokens, s.min_tokens, s.top_k, s.seed, s.logprobs, s.n) == (9, 2, 40, 3, 5, 2)
    assert (s.temperature, s.top_p, s.min_p) == pytest.approx((0.5, 0.9, 0.1))
    assert (s.repetition_penalty, s.presence_penalty, s.frequency_penalty) == pytest.approx(
        (1.2, 0.5, -0.5)
    )
    assert (list(s.stop), list(s.stop_token_ids)) == (["a", "b c"], [2, 7])
    assert (s.ignore_eos, s.include_stop_str_in_output, s.skip_special_tokens) == (
        True,
        True,
        False,
    )
    assert dict(s.logit_bias) == {28: 100.0, 29: -5.5}
    assert list(s.allowed_token_ids) == [4, 5]
    assert list(s.structured_outputs.choice.choices) == ["yes", "no"]
    assert [(m.role, m.content) for m in req.messages.messages] == [
        ("system", "Be brief."),
        ("user", "Hi"),
    ]


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--json-schema", '{"type": "object"}'], inference_pb2.StructuredOutputs(json='{"type": "object"}')),
        (["--json-object"], inference_pb2.StructuredOutputs(json_object=True)),
        (["--regex", "[0-9]+"], inference_pb2.StructuredOutputs(regex="[0-9]+")),
        (["--grammar", 'root ::= "a"'], inference_pb2.StructuredOutputs(grammar='root ::= "a"')),
    ],
)  # fmt: skip
def test_generate_structured_outputs_flags(flags: list[str], expected: object) -> None:
    req = build_request(build_parser().parse_args(["generate", "Hi", *flags]), "Hi")
    assert req.sampling.structured_outputs == expected


def test_generate_tool_flags_make_a_chat_request_with_tools(tmp_path) -> None:  # type: ignore[no-untyped-def]
    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    openai_tool = tmp_path / "t.json"
    openai_tool.write_text(json.dumps({"type": "function", "function": {
        "name": "get_weather", "description": "Weather", "parameters": schema}}))  # fmt: skip
    args = build_parser().parse_args(
        ["generate", "Hi", "--tool", f"@{openai_tool}", "--tool", '{"name": "get_time"}',
         "--tool-choice", "get_weather"]
    )  # fmt: skip
    messages = build_request(args, "Hi").messages
    assert [(m.role, m.content) for m in messages.messages] == [("user", "Hi")]
    assert list(messages.tools) == [
        inference_pb2.Tool(name="get_weather", description="Weather",
                           parameters=json.dumps(schema)),
        inference_pb2.Tool(name="get_time"),
    ]  # fmt: skip
    assert messages.tool_choice.function_name == "get_weather"
    args = build_parser().parse_args(["generate", "Hi", "--tool-choice", "required"])
    choice = build_request(args, "Hi").messages.tool_choice
    assert choice.mode == inference_pb2.TOOL_CHOICE_MODE_REQUIRED
    with pytest.raises(ValueError, match="--tool: not a function with a name"):
        build_request(build_parser().parse_args(["generate", "Hi", "--tool", "[1]"]), "Hi")
    with pytest.raises(ValueError, match=r"^--tool: not JSON text .*: notjson$"):
        build_request(build_parser().parse_args(["generate", "Hi", "--tool", "notjson"]), "Hi")


def test_generate_reads_a_schema_from_a_file_and_takes_one_constraint(tmp_path) -> None:  # type: ignore[no-untyped-def]
    schema = tmp_path / "s.json"
    schema.write_text('{"type": "integer"}')
    args = build_parser().parse_args(["generate", "Hi", "--json-schema", f"@{schema}"])
    assert build_request(args, "Hi").sampling.structured_outputs.json == '{"type": "integer"}'
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["generate", "Hi", "--regex", "a", "--json-object"])
    assert info.value.code == 2


def test_generate_without_flags_leaves_every_sampling_param_to_the_server() -> None:
    req = build_request(build_parser().parse_args(["generate", "Hi"]), "Hi")
    assert req.prompt == "Hi"
    assert req.sampling == inference_pb2.SamplingParams()


@pytest.mark.parametrize(
    ("flag", "error"),
    [
        ("--stop-token-ids=2,x", "argument --stop-token-ids: must be an integer, got 'x'"),
        ("--stop-token-ids=-1", "argument --stop-token-ids: must be >= 0, got -1"),
        ("--max-tokens=0", "argument --max-tokens: must be >= 1, got 0"),
    ],
)
def test_generate_bad_flag_is_a_usage_error(flag: str, error: str) -> None:
    result = run_cli("generate", "Hi", flag)
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == (
        f"sluiceway generate: error: {error} (see sluiceway generate --help)\n"
    )  # one line, no usage block


U32, U64, I32 = 2**32 - 1, 2**64 - 1, 2**31 - 1


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["--seed", "-1"], "argument --seed: must be >= 0, got -1"),
        (  # the contract's own range and words: finite, with its note
            ["--temperature", "inf"],
            "argument --temperature: must be a finite number >= 0 (0 = greedy), got inf",
        ),
        (["--top-p", "0"], "argument --top-p: must be in (0, 1], got 0"),
        (
            ["--seed", "18446744073709551616"],
            f"argument --seed: must be <= {U64} (uint64), got 18446744073709551616",
        ),
        (["--seed", "x"], "argument --seed: must be an integer, got 'x'"),
        (
            ["--max-tokens", "5000000000"],
            f"argument --max-tokens: must be <= {U32} (uint32), got 5000000000",
        ),
        (
            ["--min-tokens", "5000000000"],
            f"argument --min-tokens: must be <= {U32} (uint32), got 5000000000",
        ),
        (["--min-tokens", "-1"], "argument --min-tokens: must be >= 0, got -1"),
        (["--logprobs", "5000000000"], "argument --logprobs: must be <= 20, got 5000000000"),
        (["--logprobs", "21"], "argument --logprobs: must be <= 20, got 21"),
        (["-n", "5000000000"], "argument -n/--n: must be <= 16, got 5000000000"),
        (["-n", "0"], "argument -n/--n: must be >= 1, got 0"),
        (
            ["--stop-token-ids", "2,5000000000"],
            f"argument --stop-token-ids: must be <= {U32} (uint32), got 5000000000",
        ),
        (["--stop-token-ids", "2,x"], "argument --stop-token-ids: must be an integer, got 'x'"),
        (
            ["--top-k", "3000000000"],
            f"argument --top-k: must be <= {I32} (int32), got 3000000000",
        ),
        (["--top-k", "-2"], "argument --top-k: must be >= -1, got -2"),
        (["--top-p", "0"], "argument --top-p: must be in (0, 1], got 0"),
        (["--logit-bias", "28=101"], "argument --logit-bias: must be in [-100, 100], got 101"),
        (["--logit-bias", "28"], "argument --logit-bias: must be ID=BIAS pairs like 28=100, got '28'"),
    ],
)  # fmt: skip
def test_generate_numbers_outside_the_sampling_contract_are_usage_errors(
    argv: list[str], error: str
) -> None:
    assert usage_error("generate", *argv, "hi") == (
        f"sluiceway generate: error: {error} (see sluiceway generate --help)"
    )


def test_generate_numbers_at_the_bounds_of_the_sampling_contract_make_a_request() -> None:
    args = build_parser().parse_args(
        ["generate", "hi", "--seed", str(U64), "--max-tokens", str(U32), "--min-tokens",
         str(U32), "--logprobs", "20", "-n", "16", "--stop-token-ids", f"0,{U32}",
         "--top-k", str(I32), "--logit-bias", f"{U32}=-100"]
    )  # fmt: skip
    s = build_request(args, "hi").sampling
    assert (s.seed, s.max_tokens, s.min_tokens, s.logprobs, s.n) == (U64, U32, U32, 20, 16)
    assert (list(s.stop_token_ids), s.top_k) == ([0, U32], I32)
    assert dict(s.logit_bias) == {U32: -100.0}
    assert build_request(build_parser().parse_args(["generate", "hi", "--top-k", "-1"]), "hi")


def test_generate_with_an_unreadable_schema_file_is_one_line_and_exit_2(capsys) -> None:  # type: ignore[no-untyped-def]
    from sluiceway.cli import main

    assert main(["generate", "--grammar", "@/nonexistent/g.ebnf", "x"]) == 2
    assert capsys.readouterr().err == (
        "sluiceway generate: /nonexistent/g.ebnf: No such file or directory\n"
    )


@pytest.mark.parametrize(
    ("target", "dialled"),
    [
        ("127.0.0.1", "127.0.0.1:50051"),  # serve's default port, not gRPC's 443
        ("localhost:50061", "localhost:50061"),
        ("[::1]", "[::1]:50051"),
        ("::1", "[::1]:50051"),
        ("unix:/tmp/router.sock", "unix:/tmp/router.sock"),
        ("dns:///localhost:50051", "dns:///localhost:50051"),
    ],
)
def test_generate_and_bench_serve_targets(target: str, dialled: str) -> None:
    assert build_parser().parse_args(["generate", "--target", target, "x"]).target == dialled
    assert build_parser().parse_args(["bench", "serve", "--target", target]).target == dialled


def test_a_url_target_is_a_usage_error_giving_the_address_to_use() -> None:
    assert usage_error("generate", "--target", "http://127.0.0.1:50051", "x") == (
        "sluiceway generate: error: argument --target: a gRPC address is written without a "
        "scheme: use 127.0.0.1:50051, not http://127.0.0.1:50051 (see sluiceway generate --help)"
    )
    assert usage_error("bench", "serve", "--target", "https://example.com/v1") == (
        "sluiceway bench serve: error: argument --target: a gRPC address is written without a "
        "scheme: use example.com:50051, not https://example.com/v1 (see sluiceway bench serve "
        "--help)"
    )
    assert usage_error("generate", "--target", "127.0.0.1:http", "x") == (
        "sluiceway generate: error: argument --target: port must be a number in [1, 65535], "
        "got 'http' (see sluiceway generate --help)"
    )


def test_generate_with_nothing_listening_says_where_and_what_to_check() -> None:
    from sluiceway.ports import free_port

    port = free_port()
    result = run_cli("generate", "--target", f"127.0.0.1:{port}", "Hi")
    assert (result.returncode, result.stdout) == (1, "")
    assert result.stderr == (
        f"sluiceway generate: cannot reach a sluiceway server at 127.0.0.1:{port} (connection "
        "refused); is `sluiceway serve` running there? (--target)\n"
    )


class _TransportError(grpc.RpcError):
    """A failed call as gRPC reports a transport failure (no sluiceway status metadata)."""

    def __init__(self, details: str) -> None:
        self._details = details

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple[()]:
        return ()


def test_generate_says_what_to_do_when_tls_fails() -> None:
    from sluiceway.generate_cli import _failure

    untrusted = _TransportError(
        "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:52061: Ssl "
        "handshake failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: error:1000007d:SSL routines:"
        "OPENSSL_internal:CERTIFICATE_VERIFY_FAILED: self signed certificate: OK"
    )
    assert _failure(untrusted, "127.0.0.1:52061", started=False) == (
        "the TLS handshake with 127.0.0.1:52061 certificate verify failed: a self-signed server "
        "certificate needs --ssl-ca-certs CA.pem; a plaintext server, no --tls"
    )
    plaintext = _TransportError(
        "failed to connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:52061: "
        "Socket closed"
    )
    assert _failure(plaintext, "127.0.0.1:52061", started=False) == (
        "cannot reach a sluiceway server at 127.0.0.1:52061 (socket closed); is `sluiceway "
        "serve` running there? (--target) or does it serve TLS (--tls, --ssl-ca-certs)?"
    )
