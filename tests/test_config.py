"""The process configs and their flags (sluiceway/options.py): each config survives its own
command line (`parse(to_argv(config)) == config`), a flag's range is the config's range (the
same words at parse time and from `__post_init__`), and serve's config composes the child
configs it forwards flags to."""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys

import pytest

from sluiceway.cli import build_parser
from sluiceway.options import ProcessConfig
from sluiceway.router.config import RouterConfig
from sluiceway.scheduler.config import SchedulerConfig
from sluiceway.serve_config import FLAGS, FORWARDED, PARTS, ServeConfig, forwarded_to
from sluiceway.worker.config import WorkerConfig

COMMANDS: dict[type[ProcessConfig], str] = {
    RouterConfig: "router",
    SchedulerConfig: "scheduler",
    WorkerConfig: "worker",
    ServeConfig: "serve",
}


def parse(config: ProcessConfig) -> ProcessConfig:
    """`config` through its command line: to_argv, the real parser, from_namespace."""
    args = build_parser().parse_args([COMMANDS[type(config)], *config.to_argv()])
    return type(config).from_namespace(args)


# Forwarded flags of the serve configs below, every one off its default.
SERVE_FORWARDED = dict(
    http_host="0.0.0.0", drain_timeout=2.5, cache_threshold=0.25, balance_abs_threshold=3,
    max_message_size=1 << 20, api_key="k1,k2", api_key_file="/keys", ssl_keyfile="/k.pem",
    ssl_certfile="/c.pem", ssl_ca_certs="/ca.pem", ssl_cert_reqs=0, model="/models/x", served_model_name="x", device="cpu",
    dtype="float32", block_size=32, kv_cache_memory=1 << 30, gpu_memory_utilization=0.5,
    num_threads=2, attention_backend="torch", kv_cache_dtype="int8", quantization="none",
    enforce_eager=True, max_num_seqs=4,
    max_num_batched_tokens=64, enable_prefix_caching=False, long_prefill_token_threshold=16,
    max_num_partial_prefills=3, max_long_partial_prefills=2, max_waiting_requests=5,
    tensor_parallel_size=2, num_prefill_workers=1, num_decode_workers=2, max_model_len=512,
    log_format="console", log_level="WARNING",
)  # fmt: skip


def serve_config(**own: object) -> ServeConfig:
    """A ServeConfig whose parts take SERVE_FORWARDED (and `own`'s forwarded names)."""
    forwarded = {**SERVE_FORWARDED, **{k: v for k, v in own.items() if k in FORWARDED}}
    parts = {
        part: PARTS[part](**{k: v for k, v in forwarded.items() if k in forwarded_to(part)})
        for part in PARTS
    }
    return ServeConfig(**{k: v for k, v in own.items() if k not in FORWARDED}, **parts)  # type: ignore[arg-type]


ROUND_TRIP: list[ProcessConfig] = [
    RouterConfig(
        host="0.0.0.0", port=6000, scheduler="a:1,unix:/tmp/b.sock", model="/models/x",
        served_model_name="x", metrics_port=-1, metrics_host="::", http_port=0,
        http_host="::1", drain_timeout=0.5, cache_threshold=1.0, balance_abs_threshold=0,
        max_message_size=4096, api_key="k", api_key_file="/etc/keys", ssl_keyfile="/k.pem",
        ssl_certfile="/c.pem", ssl_ca_certs="/ca.pem", ssl_cert_reqs=2,
        internal_listen="unix:/tmp/r.sock", enable_auto_tool_choice=True,
        tool_call_parser="mistral", chat_template="{{ messages[0]['content'] }}\\n",
        log_format="console", log_level="debug",
    ),
    SchedulerConfig(
        listen="unix:/tmp/s.sock", max_num_seqs=4, max_num_batched_tokens=64,
        enable_prefix_caching=False, long_prefill_token_threshold=16,
        max_num_partial_prefills=3, max_long_partial_prefills=2, max_waiting_requests=5,
        tensor_parallel_size=2, num_prefill_workers=1, num_decode_workers=2,
        max_model_len=512, metrics_port=0, metrics_host="0.0.0.0", log_format="console",
        log_level="ERROR", speculative_config='{"method": "ngram", "num_speculative_tokens": 3}',
    ),
    SchedulerConfig(enable_chunked_prefill=False, scheduling_policy="static", static_batch_size=3),
    SchedulerConfig(async_scheduling=True),
    WorkerConfig(
        listen="0.0.0.0:7000", advertise="w:7000", scheduler="s:50052", worker_group=1,
        share_kv_pool=True, rank=1, distributed_init_method="tcp://127.0.0.1:29500",
        tensor_parallel_size=2, model="/models/x", served_model_name="x", device="cpu",
        dtype="bfloat16", block_size=32, kv_cache_memory=3 << 20, gpu_memory_utilization=0.125,
        num_threads=1, attention_backend="cpu", kv_cache_dtype="int8", quantization="gguf",
        enforce_eager=True, max_model_len=2, speculative_config='{"method": "draft_model", '
        '"model": "/models/d.gguf", "num_speculative_tokens": 2, "quantization": "gguf_a8"}',
        metrics_port=9999, metrics_host="0.0.0.0", log_format="console", log_level="CRITICAL",
    ),
    serve_config(host="0.0.0.0", port=0, metrics_port=-1, http_port=9000, num_replicas=2,
                 num_routers=3, enable_auto_tool_choice=True, tool_call_parser="hermes",
                 chat_template="/templates/chat.jinja",
                 speculative_config='{"method": "ngram", "num_speculative_tokens": 2}'),
    serve_config(enable_chunked_prefill=False, long_prefill_token_threshold=0,
                 max_num_partial_prefills=1, max_long_partial_prefills=1, num_prefill_workers=0,
                 num_decode_workers=0, scheduling_policy="static", static_batch_size=3),
    serve_config(async_scheduling=True, tensor_parallel_size=1, num_prefill_workers=0,
                 num_decode_workers=0),
]  # fmt: skip


@pytest.mark.parametrize("config", ROUND_TRIP, ids=lambda c: type(c).__name__)
def test_a_config_survives_its_command_line(config: ProcessConfig) -> None:
    assert config.to_argv()
    assert parse(config) == config


@pytest.mark.parametrize("cls", list(COMMANDS))
def test_a_default_config_is_no_flags(cls: type[ProcessConfig]) -> None:
    assert cls().to_argv() == []
    assert parse(cls()) == cls()


def _off_default(config: ProcessConfig) -> set[str]:
    """The flags of `config` (serve: its own and the forwarded ones) not at their default."""
    if isinstance(config, ServeConfig):
        parts = [(config, ServeConfig.options())] + [
            (getattr(config, p), {n: PARTS[p].options()[n] for n in forwarded_to(p)}) for p in PARTS
        ]
    else:
        parts = [(config, config.options())]
    return {n for source, opts in parts for n, o in opts.items() if getattr(source, n) != o.default}


@pytest.mark.parametrize("cls", list(COMMANDS))
def test_the_round_trip_covers_every_flag(cls: type[ProcessConfig]) -> None:
    flags = set(cls.options()) | (set(FORWARDED) if cls is ServeConfig else set())
    covered = set().union(*(_off_default(c) for c in ROUND_TRIP if type(c) is cls))
    assert covered == flags


def test_serve_lists_its_flags_and_the_ones_it_forwards_as_they_are_defined() -> None:
    (sub,) = [a for a in build_parser()._actions if a.dest == "command"]
    serve = {a.dest: a for a in sub.choices["serve"]._actions}  # type: ignore[attr-defined]
    assert list(serve) == ["help", *(name for _, names in FLAGS for name in names)]
    for name in FORWARDED:
        takers = [p for p in PARTS if name in forwarded_to(p)]
        option = PARTS[takers[0]].options()[name]
        assert (serve[name].help, serve[name].default) == (option.help, option.default), name
        # a flag several children take is one definition (sluiceway/options.py)
        assert all(PARTS[p].options()[name] is option for p in takers), name


def usage_error(*argv: str) -> str:
    err = io.StringIO()
    with pytest.raises(SystemExit) as exit_, contextlib.redirect_stderr(err):
        build_parser().parse_args(list(argv))
    assert exit_.value.code == 2
    return err.getvalue().rstrip("\n")


@pytest.mark.parametrize(
    ("command", "cls", "name", "value", "words"),
    [
        ("scheduler", SchedulerConfig, "max_num_seqs", 0, "must be >= 1, got 0"),
        ("serve", SchedulerConfig, "max_num_batched_tokens", 0, "must be >= 1, got 0"),
        ("scheduler", SchedulerConfig, "num_prefill_workers", -1, "must be >= 0, got -1"),
        ("serve", SchedulerConfig, "num_decode_workers", -2, "must be >= 0, got -2"),
        ("scheduler", SchedulerConfig, "long_prefill_token_threshold", -1, "must be >= 0, got -1"),
        ("serve", SchedulerConfig, "max_num_partial_prefills", 0, "must be >= 1, got 0"),
        ("scheduler", SchedulerConfig, "max_long_partial_prefills", 0, "must be >= 1, got 0"),
        ("scheduler", SchedulerConfig, "static_batch_size", 0, "must be >= 1, got 0"),
        ("scheduler", SchedulerConfig, "max_model_len", 1, "must be >= 2, got 1"),
        ("worker", WorkerConfig, "block_size", 0, "must be >= 1, got 0"),
        ("worker", WorkerConfig, "gpu_memory_utilization", 0, "must be in (0, 1], got 0"),
        ("worker", WorkerConfig, "kv_cache_memory", 0,
         "must be at least 1 byte, got 0 (no room for a KV block)"),
        ("router", RouterConfig, "cache_threshold", 2, "must be in [0, 1], got 2"),
        ("router", RouterConfig, "port", 70000, "must be a port number 0..65535, got 70000"),
        ("router", RouterConfig, "metrics_port", -2,
         "must be a port number 0..65535 or -1 (off), got -2"),
        ("serve", ServeConfig, "num_routers", 0, "must be >= 1, got 0"),
    ],
)  # fmt: skip
def test_a_range_is_checked_at_parse_time_and_by_the_config_in_the_same_words(
    command: str, cls: type[ProcessConfig], name: str, value: int, words: str
) -> None:
    flag = "--" + name.replace("_", "-")
    assert usage_error(command, flag, str(value)) == (
        f"sluiceway {command}: error: argument {flag}: {words} (see sluiceway {command} --help)"
    )
    with pytest.raises(ValueError) as err:
        cls(**{name: value})
    assert str(err.value) == f"{name} {words}"


def test_max_num_seqs_0_is_one_line_and_exit_2_from_the_command_line() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "sluiceway.cli", "scheduler", "--max-num-seqs", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == (
        "sluiceway scheduler: error: argument --max-num-seqs: must be >= 1, got 0 "
        "(see sluiceway scheduler --help)\n"
    )


def test_choices_and_nones_are_checked_by_the_config() -> None:
    with pytest.raises(
        ValueError, match=r"^scheduling_policy must be one of fcfs, priority, static, got 'x'$"
    ):
        SchedulerConfig(scheduling_policy="x")
    with pytest.raises(ValueError, match=r"^log_level must be one of DEBUG, .* got 'loud'$"):
        WorkerConfig(log_level="loud")
    with pytest.raises(ValueError, match=r"^max_num_seqs must be given, got None$"):
        SchedulerConfig(max_num_seqs=None)  # type: ignore[arg-type]
    assert WorkerConfig(log_level="debug").log_level == "DEBUG"  # as the flag parses it
    assert RouterConfig(drain_timeout=1).drain_timeout == 1.0


def test_the_step_budget_below_max_num_seqs_is_refused_by_the_scheduler_config() -> None:
    with pytest.raises(ValueError) as err:
        SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=8)
    assert str(err.value) == (
        "max_num_batched_tokens (8) must be greater than or equal to max_num_seqs (16)"
    )
    assert SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=8).max_num_batched_tokens == 8
    args = build_parser().parse_args(["serve", "--max-num-batched-tokens", "64"])
    with pytest.raises(ValueError, match=r"^max_num_batched_tokens \(64\) must be greater"):
        ServeConfig.from_namespace(args)  # before serve starts any child


def test_serve_config_checks() -> None:
    with pytest.raises(ValueError) as err:
        ServeConfig(port=65535, num_routers=2)
    assert str(err.value) == "--num-routers 2 from --port 65535 runs past port 65535"
    assert ServeConfig(port=0, num_routers=2).num_routers == 2  # free ports
    with pytest.raises(ValueError) as err:
        ServeConfig(router=RouterConfig(model="a"), worker=WorkerConfig(model="b"))
    assert str(err.value) == "model differs between the router and worker configs"


@pytest.mark.parametrize(
    ("other", "refusal"),
    [
        (
            {"speculative_config": '{"method":"ngram","num_speculative_tokens":2}'},
            "cannot be combined with speculative_config",
        ),
        ({"tensor_parallel_size": 2}, "needs tensor_parallel_size 1 \\(only rank 0 samples"),
        (
            {"num_prefill_workers": 1, "num_decode_workers": 1},
            "cannot be combined with disaggregated prefill",
        ),
        ({"scheduling_policy": "static"}, "cannot be combined with the static policy"),
    ],
    ids=["speculative", "tensor-parallel", "disaggregated", "static"],
)
def test_async_scheduling_refuses_what_it_cannot_serve(
    other: dict[str, object], refusal: str
) -> None:
    SchedulerConfig(**other)  # type: ignore[arg-type]  # (each is fine alone)
    with pytest.raises(ValueError, match=f"^async_scheduling {refusal}"):
        SchedulerConfig(async_scheduling=True, **other)  # type: ignore[arg-type]
