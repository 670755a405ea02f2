"""`kvbench run --busy N` (and `splitserve bench --busy N`): N busy-loop processes beside the
benchmark, as a serving host's CPU is busy.

`BusyLoops` owns its processes: it starts them on enter and kills and reaps every one on exit, on
every path (an exception, Ctrl-C); each also gets SIGKILL if the benchmark itself dies
(PR_SET_PDEATHSIG), so none outlives the run. `cpus`, when given, pins every loop to that CPU set.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Collection
from types import TracebackType

import structlog

from kvtransfer.bench.control import dying_with_parent

log = structlog.get_logger(__name__)

BUSY_CODE = "while True: pass"


class BusyLoops:
    """A context manager running `count` processes of `python -c 'while True: pass'` (on `cpus`, if
    given; else wherever the OS schedules them)."""

    def __init__(self, count: int, cpus: Collection[int] | None = None) -> None:
        if count < 0:
            raise ValueError(f"--busy must be >= 0, got {count}")
        self.count = count
        self.cpus = set(cpus) if cpus else None
        self.processes: list[subprocess.Popen[bytes]] = []

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    def __enter__(self) -> BusyLoops:
        try:
            for _ in range(self.count):
                self.processes.append(
                    subprocess.Popen(
                        [sys.executable, "-c", BUSY_CODE], preexec_fn=dying_with_parent(self.cpus)
                    )
                )
        except BaseException:
            self.stop()
            raise
        if self.processes:
            log.info("busy loops started", pids=self.pids, cpus=sorted(self.cpus) if self.cpus else "any")
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
