"""The benchmark's progress bar: on a terminal one line redrawn in place as requests finish; elsewhere
(CI, a pipe) one plain line when a batch of requests is done."""

from __future__ import annotations

import sys
import time
from typing import IO

WIDTH = 30


class ProgressBar:
    """`[#####-----] done/total  label  elapsed` for one batch of requests. Single-threaded: the
    benchmark's event loop calls `advance`."""

    def __init__(self, label: str, total: int, out: IO[str] | None = None) -> None:
        self.out = out if out is not None else sys.stderr
        self.live = self.out.isatty()
        self.label, self.total, self.done = label, total, 0
        self.start = time.monotonic()
        if self.live:
            self._draw()

    def advance(self) -> None:
        self.done += 1
        if self.live:
            self._draw()

    def close(self) -> None:
        """End the bar's line (terminal) or print the one summary line (elsewhere)."""
        if self.live:
            self.out.write("\n")
        else:
            self.out.write(
                f"  {self.label}: {self.done}/{self.total} in {time.monotonic() - self.start:.1f}s\n"
            )
        self.out.flush()

    def _draw(self) -> None:
        filled = WIDTH * self.done // max(1, self.total)
        bar = "#" * filled + "-" * (WIDTH - filled)
        elapsed = time.monotonic() - self.start
        self.out.write(f"\r\x1b[2K  [{bar}] {self.done}/{self.total}  {self.label}  {elapsed:.0f}s")
        self.out.flush()
