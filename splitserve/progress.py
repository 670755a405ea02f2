"""Start-up progress: each process says what it is doing; the local launcher shows one line per process.

A child process (`splitserve coordinator|prefill|decode`) calls `announce(stage)` at each slow step of
its start (resolving the model, loading it, loading kernels, registering). When its launcher asked
for progress (`SPLITSERVE_PROGRESS=1` in its environment: `splitserve.cluster` sets it) that writes
one `SPLITSERVE_PROGRESS {"stage": ...}` line on stdout, the channel that already carries the
readiness line, so logs (stderr) stay untouched; run alone, stdout stays the readiness line only.
Under `splitserve serve|demo` the launcher turns the lines into a `ProgressBoard`: on a terminal one
live line per process, redrawn in place; elsewhere one plain line per change.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import IO

PROGRESS_PREFIX = "SPLITSERVE_PROGRESS "
ENV = "SPLITSERVE_PROGRESS"  # "1": the launcher reads progress lines


def announce(stage: str) -> None:
    """Report this process's current start-up stage to its launcher (stdout, flushed), if it asked."""
    if os.environ.get(ENV) != "1":
        return
    sys.stdout.write(PROGRESS_PREFIX + json.dumps({"stage": stage}) + "\n")
    sys.stdout.flush()


def parse(line: str) -> str | None:
    """The stage of a progress line, or None for any other line (also for a malformed one)."""
    if not line.startswith(PROGRESS_PREFIX):
        return None
    try:
        stage = json.loads(line[len(PROGRESS_PREFIX) :]).get("stage")
    except (ValueError, AttributeError):
        return None
    return stage if isinstance(stage, str) else None


class ProgressBoard:
    """One line per process: `name  stage (seconds from its launch to this stage)`. Thread-safe: the
    launcher's reader threads call `update` concurrently. On a TTY the block of lines is redrawn in
    place; otherwise each update prints one line."""

    def __init__(self, out: IO[str] | None = None) -> None:
        self.out = out if out is not None else sys.stderr
        self.live = self.out.isatty()
        self._rows: dict[str, tuple[str, float, float]] = {}  # name -> (stage, launch time, stage time)
        self._drawn = 0
        self._lock = threading.Lock()

    def update(self, name: str, stage: str) -> None:
        with self._lock:
            now = time.monotonic()
            self._rows[name] = (stage, self._rows.get(name, ("", now, now))[1], now)
            if self.live:
                self._redraw()
            else:
                self.out.write(self._row(name) + "\n")
            self.out.flush()

    def _row(self, name: str) -> str:
        stage, launched, reached = self._rows[name]
        width = max(len(n) for n in self._rows)
        return f"  {name:<{width}}  {stage} ({reached - launched:.1f}s)"

    def _redraw(self) -> None:
        if self._drawn:
            self.out.write(f"\x1b[{self._drawn}F")  # back to the first line of the block
        for name in self._rows:
            self.out.write("\x1b[2K" + self._row(name) + "\n")
        self._drawn = len(self._rows)
