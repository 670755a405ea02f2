"""A worker's per-step trace (``--step-trace-dir``): one JSON line per model step, and its summary.

A client's inter-token latency is the decode worker's step time plus what its event loop does between
two steps; the metrics' ``splitserve_worker_step_seconds`` histogram has the first only, in buckets,
and not by batch size. The trace has both, step by step, so a tail can be traced to the batch it ran
(docs/performance.md reads it):

    splitserve decode ... --step-trace-dir /tmp/steps        # or SPLITSERVE_STEP_TRACE_DIR for a bench
    python -m engine.worker.step_trace /tmp/steps/decode-*.jsonl [--beside /tmp/steps/prefill-*.jsonl]

Each process appends to ``<dir>/<worker id>-<pid>.jsonl`` (a benchmark's clusters reuse worker ids).
The `StepLoop` writes; the worker process opens the trace before its loop starts and closes it after.
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import json
import os
import statistics
from dataclasses import dataclass, fields
from pathlib import Path
from typing import IO

from splitserve.stats import dist, percentiles

IDLE_GAP_S = 0.2  # a longer gap between two steps is the loop waiting for work, not overhead
MAX_STEP_S = 10.0  # no step is longer: how far back `overlapped` looks
WAITED_MS = 1.0  # a step whose thread waited longer for a CPU is counted in the summary
CPU_FIELDS = (("step thread", "step_cpu_s"), ("event loop", "loop_cpu_s"), ("other threads", "other_cpu_s"))


@dataclass(slots=True)
class StepRecord:
    """One step. ``started_at``: Unix seconds as the forward was posted; ``seconds``: the forward's
    wall time (as the step-time histogram sees it); ``run_queue_wait_s``: the step thread's wait for a
    CPU meanwhile (runnable, another thread or process on its CPU: its own event loop, a neighbour;
    not its OpenMP team's other threads; 0 where the kernel has no schedstat); ``after_s``: finishing
    the step and the role's reaction to it (token messages, releases) on the event loop. CPU seconds
    while the forward ran: ``step_cpu_s`` the step thread's (a forward slowed by a neighbour's use of
    the caches and memory takes more), ``loop_cpu_s`` the event loop's (messages, KV pulls: on a
    one-CPU worker, time taken from the step), ``other_cpu_s`` every other thread's (transport
    progress, sockets, the step's OpenMP team beyond its first thread); 0 in traces from before
    they were recorded."""

    started_at: float
    sequences: int
    tokens: int
    context_tokens: int  # keys the step's attention reads: every scheduled sequence's length
    seconds: float
    run_queue_wait_s: float
    after_s: float
    step_cpu_s: float = 0.0
    loop_cpu_s: float = 0.0
    other_cpu_s: float = 0.0

    @property
    def decode_only(self) -> bool:
        return self.tokens == self.sequences


_RECORD_FIELDS = tuple(f.name for f in fields(StepRecord))


class StepTrace:
    """Appends `StepRecord`s to ``directory/<worker_id>-<pid>.jsonl``, a line each, flushed per line."""

    def __init__(self, directory: str | Path, worker_id: str) -> None:
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        self.path = path / f"{worker_id}-{os.getpid()}.jsonl"
        self._file: IO[str] | None = self.path.open("a", buffering=1)

    def write(self, record: StepRecord) -> None:
        if self._file is not None:  # not dataclasses.asdict: it deep-copies, 108 us a step on a decode CPU
            self._file.write(json.dumps({name: getattr(record, name) for name in _RECORD_FIELDS}) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_records(path: str | Path) -> list[StepRecord]:
    with Path(path).open() as f:
        return [StepRecord(**json.loads(line)) for line in f if line.strip()]


def overlapped(record: StepRecord, beside: list[StepRecord]) -> bool:
    """Whether steps in `beside` (another worker's, sorted by start) ran for more than half of `record`."""
    end = record.started_at + record.seconds
    covered = 0.0
    for i in reversed(range(bisect.bisect_left(beside, end, key=lambda r: r.started_at))):
        other = beside[i]
        if other.started_at + MAX_STEP_S < record.started_at:
            break  # this step and every earlier one ended before `record` started
        covered += max(
            0.0, min(end, other.started_at + other.seconds) - max(record.started_at, other.started_at)
        )
    return covered > record.seconds / 2


def _percentiles(ms: list[float]) -> str:
    return " ".join(f"{name} {value:6.1f}" for name, value in dist(ms).items())


def summarize(records: list[StepRecord], beside: list[StepRecord] | None = None) -> list[str]:
    """Lines of a summary: decode-only steps' time by batch size (ms), the gap from a step's end to
    the next step's start while work was queued (the event loop's share of an ITL), the step
    thread's run-queue wait (its CPU taken by another thread or process mid-step), and the CPU time
    of the step thread, the event loop and the other threads during the steps. With `beside`
    (another worker's steps, e.g. the prefill worker's on the next core), each batch size's steps
    are also split by whether one of those overlapped more than half of them."""
    decode = [r for r in records if r.decode_only]
    lines = [f"{len(records)} steps, {len(decode)} decode-only"]
    gaps = [
        (b.started_at - a.started_at - a.seconds) * 1e3
        for a, b in itertools.pairwise(records)
        if 0 <= b.started_at - a.started_at - a.seconds < IDLE_GAP_S
    ]
    if gaps:
        p50, p99 = percentiles(gaps, (50, 99))
        lines.append(f"gap between steps ms: p50 {p50:.2f} p99 {p99:.2f} mean {statistics.fmean(gaps):.2f}")
    if decode:
        waits = [r.run_queue_wait_s * 1e3 for r in decode]
        over = sum(w > WAITED_MS for w in waits)
        lines.append(
            f"run-queue wait ms, decode-only: {_percentiles(waits)}; over {WAITED_MS:g} ms in {over}"
        )
        for label, field in CPU_FIELDS:
            lines.append(
                f"{label} CPU ms, decode-only: {_percentiles([getattr(r, field) * 1e3 for r in decode])}"
            )
    others = sorted(beside or [], key=lambda r: r.started_at)
    for size in sorted({r.sequences for r in decode}):
        steps = [r for r in decode if r.sequences == size]
        context = statistics.fmean(r.context_tokens for r in steps)
        line = f"batch {size:3d}: {len(steps):6d} steps, ms {_percentiles([r.seconds * 1e3 for r in steps])}"
        line += f", mean context {context:7.0f}"
        if beside is not None:
            split: dict[bool, list[float]] = {True: [], False: []}
            for r in steps:
                split[overlapped(r, others)].append(r.seconds * 1e3)
            for busy, label in ((True, "beside a step"), (False, "alone")):
                if split[busy]:
                    line += f"; {label} ({len(split[busy])}) {_percentiles(split[busy])}"
        lines.append(line)
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Summarize step traces (--step-trace-dir files)")
    parser.add_argument("traces", nargs="+", help="<worker id>-<pid>.jsonl files")
    parser.add_argument(
        "--beside",
        nargs="+",
        default=None,
        help="other workers' traces (e.g. the prefill workers on the next core): split each batch "
        "size's steps by whether one of theirs overlapped more than half of it",
    )
    args = parser.parse_args(argv)
    beside = [r for path in args.beside for r in read_records(path)] if args.beside else None
    for path in args.traces:
        print(path)
        for line in summarize(read_records(path), beside):
            print("  " + line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
