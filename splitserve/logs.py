"""structlog set-up for every splitserve process: JSON lines on stderr when it is not a terminal, else console."""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any, TextIO

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


class RateLimitedLog:
    """Warnings about untrusted input that cannot flood the log: the first `event` of a reason is
    logged at once, later ones at most every `period_s`, with the count suppressed meanwhile (so a
    flood costs one line per reason and period). `bound` fields go on every line."""

    def __init__(self, event: str, period_s: float = 10.0, **bound: Any) -> None:
        self.event, self.period_s, self.bound = event, period_s, bound
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def __call__(self, reason: str, **detail: Any) -> None:
        now = time.monotonic()
        last = self._last.get(reason)
        if last is not None and now - last < self.period_s:
            self._suppressed[reason] = self._suppressed.get(reason, 0) + 1
            return
        self._last[reason] = now
        suppressed = self._suppressed.pop(reason, 0)
        structlog.get_logger(__name__).warning(
            self.event, reason=reason, suppressed=suppressed, **self.bound, **detail
        )
