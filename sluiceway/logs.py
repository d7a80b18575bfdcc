"""structlog set-up shared by the three processes: console lines for a person at a terminal,
JSON lines for a log collector (`--log-format auto`, the default, picks by stderr)."""

from __future__ import annotations

import logging
import sys
from typing import TextIO

import structlog


def resolve_log_format(log_format: str, stream: TextIO | None = None) -> str:
    """The format to log in, json or console: `log_format` itself, or for auto console when
    `stream` (default: stderr) is a terminal, else json. Raises ValueError for another one."""
    if log_format not in ("auto", "json", "console"):
        raise ValueError(f"log_format must be auto, json or console, got {log_format!r}")
    if log_format != "auto":
        return log_format
    stream = sys.stderr if stream is None else stream
    return "console" if stream.isatty() else "json"


def configure_logging(process: str, log_format: str = "auto", level: str = "INFO") -> None:
    """Routes structlog and stdlib logging (torch, grpc, our own `logging` users) to stderr
    through the same renderer, each line tagged with `process`, a level and an ISO timestamp.

    log_format: "json" (one JSON object per line), "console", or "auto" (`resolve_log_format`).
    Raises ValueError for another format.
    """
    log_format = resolve_log_format(log_format)
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer()
        if log_format == "json"
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )

    def add_process(
        _logger: object, _method: str, event: structlog.typing.EventDict
    ) -> structlog.typing.EventDict:
        event.setdefault("process", process)  # every thread, unlike a contextvar
        return event

    shared: list[structlog.typing.Processor] = [
        add_process,
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name],
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
        )
    )
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(level)
    structlog.configure(
        processors=[*shared, structlog.processors.EventRenamer("event"), renderer],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level)),
        # one write() per line: processes sharing a pipe never splice their lines
        logger_factory=structlog.WriteLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )
