"""The host's own jitter: identical work, timed again and again on the CPUs a study's decode runs on.

Issue 12 reads its decode target as ITL p99 over the unloaded decode, a median. On a shared VM the
CPU itself is not steady: on the study's host (session 40) a fixed L1-resident loop pinned to one
idle core had a p99 of 1.33x its median in one minute and 2.17x in the next, the slow steps coming
in runs of a second or two (the hypervisor's other tenants, not anything in the guest). No serving
system reads a lower ITL ratio than identical work does on that CPU at that time, so a study records
that ratio beside its own: `time_fixed_work` times a pure-Python loop (no imports, a few ms) in a
child process pinned to the CPUs, while the variant's cluster is up and idle (before its unloaded
probes), and `jitter_summary` reads its percentiles. The child is ours: it is waited for, and
killed with its parent (PR_SET_PDEATHSIG) if the bench dies first.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from kvtransfer.bench.control import dying_with_parent
from splitserve.stats import dist

FIXED_WORK_CODE = """
import json, os, sys, time
def work():
    total = 0
    for i in range(150_000):
        total += i
    return total
for _ in range(20):
    work()
times = []
for _ in range(int(sys.argv[1])):
    start = time.perf_counter()
    work()
    times.append((time.perf_counter() - start) * 1e3)
print(json.dumps({"cpus": sorted(os.sched_getaffinity(0)), "ms": times}))
"""


@dataclass(frozen=True, slots=True)
class FixedWorkRun:
    """The CPUs the child ran on (its own affinity, as it read it) and each run's milliseconds."""

    cpus: list[int]
    times_ms: list[float]


def time_fixed_work(samples: int, cpus: Collection[int] | None, timeout_s: float = 300.0) -> FixedWorkRun:
    """`samples` runs of the same loop, after 20 untimed ones, in a child pinned to `cpus` (None: where
    the OS puts it). RuntimeError (with its stderr) if the child fails."""
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    done = subprocess.run(
        [sys.executable, "-c", FIXED_WORK_CODE, str(samples)],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
        preexec_fn=dying_with_parent(cpus),
    )
    if done.returncode != 0:
        raise RuntimeError(f"the fixed-work child exited {done.returncode}: {done.stderr.strip()[-500:]}")
    out = json.loads(done.stdout)
    return FixedWorkRun(out["cpus"], out["ms"])


def jitter_summary(times_ms: list[float]) -> dict[str, Any]:
    """p50/p90/p99 of `times_ms`, how many, and `p99_x_p50`: the ITL ratio identical work reaches."""
    spread = dist(times_ms)
    return {**spread, "samples": len(times_ms), "p99_x_p50": spread["p99"] / spread["p50"]}
