"""The quiet start of `splitserve serve|demo`: where logs go, a progress line per process, timings.

Log placement (`--log-dir`): a directory → one `<name>.log` per process there (JSON lines) plus the
launcher's own `splitserve.log`; `-` → every process logs to this terminal's stderr; unset → files
under `<cache>/logs/<UTC time>-<pid>/` when `files_by_default` (demo) or stderr is a terminal (serve),
else stderr (production and CI keep their JSON stream). The processes' `SPLITSERVE_PROGRESS` lines
become a `ProgressBoard` on stderr.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import TextIO

from splitserve.cluster import ClusterError, ClusterSpec, LocalCluster
from splitserve.progress import ProgressBoard

STDERR = "-"


def choose_log_dir(arg: str | None, files_by_default: bool) -> Path | None:
    """The directory for per-process log files, or None for stderr (see the module docstring)."""
    if arg == STDERR:
        return None
    if arg:
        return Path(arg)
    if not (files_by_default or sys.stderr.isatty()):
        return None
    from engine.model_dir import cache_dir

    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    return cache_dir() / "logs" / f"{stamp}-{os.getpid()}"


def say(line: str) -> None:
    """A line for the person at the terminal (stderr, so stdout stays the answer)."""
    print(line, file=sys.stderr, flush=True)


@contextmanager
def started(spec: ClusterSpec) -> Iterator[LocalCluster]:
    """Start `spec`'s processes showing their progress, yield the ready cluster, stop it on exit.

    Prints where the logs are and how long the start took; a failed start names the log directory.
    """
    from splitserve.logs import configure_logging

    own_log: TextIO | None = None
    if spec.log_dir is not None:
        spec.log_dir.mkdir(parents=True, exist_ok=True)
        own_log = open(spec.log_dir / "splitserve.log", "w")  # noqa: SIM115 - closed below
        say(f"logs: {spec.log_dir}/")
    configure_logging(stream=own_log, role="launcher")
    board = ProgressBoard()
    cluster = LocalCluster(spec, progress=board.update)
    start = time.monotonic()
    try:
        try:
            cluster.start()
        except ClusterError as exc:
            where = f"; see {spec.log_dir}/" if spec.log_dir is not None else ""
            raise ClusterError(f"{exc}{where}") from exc
        say(f"cluster up in {time.monotonic() - start:.1f}s: coordinator {cluster.grpc_address}")
        yield cluster
    finally:
        cluster.stop()
        if own_log is not None:
            own_log.close()
