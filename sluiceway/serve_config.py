"""`sluiceway serve`'s config: its own flags (where the routers listen, how many routers and
replicas) and, by composition, the router, scheduler and worker configs whose flags it
forwards to its children. The launcher (sluiceway/launcher.py) builds each child's config
from these with `dataclasses.replace` (its address, ports, rank ...) and starts the child
with `to_argv()` of it."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any, Self

from sluiceway.argtypes import positive_int
from sluiceway.options import ProcessConfig, add_option, option, option_argv
from sluiceway.router.config import RouterConfig, http_port_help
from sluiceway.scheduler.config import SchedulerConfig
from sluiceway.worker.config import WorkerConfig

PARTS: dict[str, type[ProcessConfig]] = {
    "router": RouterConfig,
    "scheduler": SchedulerConfig,
    "worker": WorkerConfig,
}

# serve's flags, in the order of its --help: its own (None) and the child config fields it
# forwards. A forwarded flag goes to every child config with a field of its name: --model to
# the routers and workers, the API key and TLS flags and --chat-template to the routers (the public ports), --tensor-parallel-size and --max-model-len to the schedulers and
# workers, --log-format and --log-level to all. The other child fields are the launcher's to
# set per child (addresses, ports, ranks).
FLAGS: tuple[tuple[str | None, tuple[str, ...]], ...] = (
    (None, ("host", "port", "metrics_port", "http_port")),
    (
        "router",
        ("http_host", "drain_timeout", "cache_threshold", "balance_abs_threshold",
         "max_message_size", "api_key", "api_key_file", "ssl_keyfile", "ssl_certfile",
         "ssl_ca_certs", "ssl_cert_reqs", "enable_auto_tool_choice", "tool_call_parser",
         "chat_template", "model"),
    ),
    (
        "worker",
        ("served_model_name", "device", "dtype", "quantization", "block_size", "kv_cache_dtype",
         "kv_cache_memory", "gpu_memory_utilization", "num_threads", "attention_backend",
         "enforce_eager"),
    ),
    (
        "scheduler",
        ("max_num_seqs", "max_num_batched_tokens", "enable_chunked_prefill",
         "enable_prefix_caching", "long_prefill_token_threshold", "max_num_partial_prefills",
         "max_long_partial_prefills", "scheduling_policy", "static_batch_size",
         "max_waiting_requests", "tensor_parallel_size", "num_prefill_workers",
         "num_decode_workers", "speculative_config", "async_scheduling"),
    ),
    (None, ("num_replicas", "num_routers")),
    ("scheduler", ("max_model_len", "log_format", "log_level")),
)  # fmt: skip
FORWARDED = tuple(name for part, names in FLAGS if part is not None for name in names)


def forwarded_to(part: str) -> list[str]:
    """The forwarded flags that child config `part` ("router", ...) takes."""
    return [name for name in FORWARDED if name in PARTS[part].options()]


_ROUTER = RouterConfig.options()


@dataclass(slots=True, kw_only=True)
class ServeConfig(ProcessConfig):
    """The stack `serve` starts: `num_routers` routers on `host`, ports from `port` (0: free
    ones), over `num_replicas` replicas (a scheduler and its workers each); metrics ports from
    `metrics_port` (routers, schedulers, workers; -1: off), HTTP ports from `http_port`.
    `router`, `scheduler`, `worker`: the flags serve forwards (`FLAGS`), each child's other
    fields at their defaults; a forwarded flag has the same value in every part.

    Raises ValueError: a field out of its flag's range, the routers' ports past 65535, parts
    that disagree on a forwarded flag, or what `SchedulerConfig` refuses (when it is built).
    """

    host: str = _ROUTER["host"].field(help="the routers' address")
    port: int = _ROUTER["port"].field(
        help="the first router's port (more routers: the next ones; 0 = free ports)"
    )
    metrics_port: int = _ROUTER["metrics_port"].field(
        help="Prometheus /metrics of the router; the scheduler gets the next port and the "
        "worker the one after (more routers, replicas or workers: the next ports, in that "
        "order; 0 = free ports, -1 = off)"
    )
    http_port: int = _ROUTER["http_port"].field(
        help=http_port_help("the first router (more routers: the next ports)")
    )
    num_replicas: int = option(
        1,
        "model replicas, each a scheduler with its own workers; the routers spread "
        "requests over them",
        type=positive_int,
    )
    num_routers: int = option(
        1,
        "router processes, on consecutive ports from --port, each over every replica",
        type=positive_int,
    )
    router: RouterConfig = field(default_factory=RouterConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    worker: WorkerConfig = field(default_factory=WorkerConfig)

    def __post_init__(self) -> None:
        self.check_options()
        if self.port and self.port + self.num_routers - 1 > 65535:
            raise ValueError(
                f"--num-routers {self.num_routers} from --port {self.port} runs past port 65535"
            )
        for name in FORWARDED:
            parts = [p for p in PARTS if name in forwarded_to(p)]
            if len({repr(getattr(getattr(self, p), name)) for p in parts}) > 1:
                raise ValueError(f"{name} differs between the {' and '.join(parts)} configs")

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """Adds serve's flags (`FLAGS`) to `parser`."""
        for part, names in FLAGS:
            options = cls.options() if part is None else PARTS[part].options()
            for name in names:
                add_option(parser, name, options[name])

    @classmethod
    def from_namespace(cls, args: argparse.Namespace) -> Self:
        """The config of serve's flags parsed into `args`.

        Raises:
            ValueError: what `ServeConfig` or a child config refuses (e.g. SchedulerConfig:
                max_num_batched_tokens below max_num_seqs).
        """
        parts: dict[str, Any] = {
            part: PARTS[part](**{name: getattr(args, name) for name in forwarded_to(part)})
            for part in PARTS
        }
        return cls(**{name: getattr(args, name) for name in cls.options()}, **parts)

    def to_argv(self) -> list[str]:
        """serve's flags that give this config (those not at their default)."""
        argv: list[str] = []
        for part, names in FLAGS:
            source: ProcessConfig = self if part is None else getattr(self, part)
            options = type(source).options()
            argv += option_argv(source, {name: options[name] for name in names})
        return argv
