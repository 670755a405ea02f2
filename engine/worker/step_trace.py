"""A worker's per-step trace (``--step-trace-dir``): one JSON line per model step, and its summary.

A client's inter-token latency is the decode worker's step time plus what its event loop does between
two steps; the metrics' ``splitserve_worker_step_seconds`` histogram has the first only, in buckets,
and not by batch size. The trace has both, step by step, so a tail can be traced to the batch it ran
(docs/performance.md reads it):

    splitserve decode ... --step-trace-dir /tmp/steps        # or SPLITSERVE_STEP_TRACE_DIR for a bench
    python -m engine.worker.step_trace /tmp/steps/*.jsonl     # step time by batch size, gaps

Each process appends to ``<dir>/<worker id>-<pid>.jsonl`` (a benchmark's clusters reuse worker ids).
The `StepLoop` writes; the worker process opens the trace before its loop starts and closes it after.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO

IDLE_GAP_S = 0.2  # a longer gap between two steps is the loop waiting for work, not overhead


@dataclass(slots=True)
class StepRecord:
    """One step. ``started_at``: Unix seconds as the forward was posted; ``seconds``: the forward's
    wall time (as the step-time histogram sees it); ``run_queue_wait_s``: the step thread's wait for a
    CPU meanwhile (0 unless the worker measures it); ``after_s``: finishing the step and the role's
    reaction to it (token messages, releases) on the event loop."""

    started_at: float
    sequences: int
    tokens: int
    context_tokens: int  # keys the step's attention reads: every scheduled sequence's length
    seconds: float
    run_queue_wait_s: float
    after_s: float

    @property
    def decode_only(self) -> bool:
        return self.tokens == self.sequences


class StepTrace:
    """Appends `StepRecord`s to ``directory/<worker_id>-<pid>.jsonl``, a line each, flushed per line."""

    def __init__(self, directory: str | Path, worker_id: str) -> None:
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        self.path = path / f"{worker_id}-{os.getpid()}.jsonl"
        self._file: IO[str] | None = self.path.open("a", buffering=1)

    def write(self, record: StepRecord) -> None:
        if self._file is not None:
            self._file.write(json.dumps(asdict(record)) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_records(path: str | Path) -> list[StepRecord]:
    with Path(path).open() as f:
        return [StepRecord(**json.loads(line)) for line in f if line.strip()]


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(records: list[StepRecord]) -> list[str]:
    """Lines of a summary: decode-only steps' time by batch size (p50/p90/p99, ms), and the gap from
    a step's end to the next step's start while work was queued (the event loop's share of an ITL)."""
    decode = [r for r in records if r.decode_only]
    lines = [f"{len(records)} steps, {len(decode)} decode-only"]
    gaps = [
        (b.started_at - a.started_at - a.seconds) * 1e3
        for a, b in itertools.pairwise(records)
        if 0 <= b.started_at - a.started_at - a.seconds < IDLE_GAP_S
    ]
    if gaps:
        lines.append(
            f"gap between steps ms: p50 {_quantile(gaps, 0.5):.2f} p99 {_quantile(gaps, 0.99):.2f} "
            f"mean {statistics.fmean(gaps):.2f}"
        )
    for size in sorted({r.sequences for r in decode}):
        ms = [r.seconds * 1e3 for r in decode if r.sequences == size]
        context = statistics.fmean(r.context_tokens for r in decode if r.sequences == size)
        lines.append(
            f"batch {size:3d}: {len(ms):6d} steps, step ms p50 {_quantile(ms, 0.5):6.1f} "
            f"p90 {_quantile(ms, 0.9):6.1f} p99 {_quantile(ms, 0.99):6.1f}, mean context {context:7.0f}"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Summarize step traces (--step-trace-dir files)")
    parser.add_argument("traces", nargs="+", help="<worker id>-<pid>.jsonl files")
    args = parser.parse_args(argv)
    for path in args.traces:
        print(path)
        for line in summarize(read_records(path)):
            print("  " + line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
