"""structlog set-up for every splitserve process: JSON lines on stderr when it is not a terminal, else console."""

from __future__ import annotations

import logging
import os
import sys
from typing import TextIO

import structlog


def configure_logging(level: str | None = None, stream: TextIO | None = None, **bound: str) -> None:
    """Route every structlog logger to `stream` (default stderr; stdout carries only the readiness and
    progress lines) at `level` (else $SPLITSERVE_LOG_LEVEL, else info) and bind `bound` (role,
    worker_id) to every event of the process. Request ids are bound per event."""
    level = level or os.environ.get("SPLITSERVE_LOG_LEVEL", "info")
    stream = stream if stream is not None else sys.stderr
    renderer: structlog.types.Processor = (
        structlog.dev.ConsoleRenderer() if stream.isatty() else structlog.processors.JSONRenderer()
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(**bound)
