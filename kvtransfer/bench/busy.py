"""`kvbench run --busy N`: N busy-loop processes beside the agents, as a serving host's CPU is busy.

`BusyLoops` owns its processes: it starts them on enter and kills and reaps every one on exit, on
every path (an exception, Ctrl-C); each also gets SIGKILL if kvbench itself dies (PR_SET_PDEATHSIG),
so none outlives the run.
"""

from __future__ import annotations

import subprocess
import sys
from types import TracebackType

import structlog

from kvtransfer.bench.control import die_with_parent

log = structlog.get_logger(__name__)

BUSY_CODE = "while True: pass"


class BusyLoops:
    """A context manager running `count` processes of `python -c 'while True: pass'`."""

    def __init__(self, count: int) -> None:
        if count < 0:
            raise ValueError(f"--busy must be >= 0, got {count}")
        self.count = count
        self.processes: list[subprocess.Popen[bytes]] = []

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    def __enter__(self) -> BusyLoops:
        try:
            for _ in range(self.count):
                self.processes.append(
                    subprocess.Popen([sys.executable, "-c", BUSY_CODE], preexec_fn=die_with_parent)
                )
        except BaseException:
            self.stop()
            raise
        if self.processes:
            log.info("busy loops started", pids=self.pids)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def stop(self) -> None:
        """Kill and reap every loop (idempotent)."""
        for process in self.processes:
            if process.poll() is None:
                process.kill()
            process.wait()
        self.processes.clear()
