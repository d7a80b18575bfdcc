"""structlog set-up shared by the three processes: JSON lines by default, console for humans."""

from __future__ import annotations

import logging
import sys

import structlog


def configure_logging(process: str, log_format: str = "json", level: str = "INFO") -> None:
    """Routes structlog (and stdlib logging) to stderr, each line tagged with `process`.

    log_format: "json" (one JSON object per line) or "console".
    Raises ValueError for another format.
    """
    if log_format not in ("json", "console"):
        raise ValueError(f"log_format must be json or console, got {log_format!r}")
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer()
        if log_format == "json"
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    logging.basicConfig(level=level, stream=sys.stderr, format="%(message)s")
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.EventRenamer("event"),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level)),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.bind_contextvars(process=process)
