"""`run_queue_wait_s`, what an idle-priority worker's step costs leave out: the time its step thread was
runnable but another thread had its CPU. Measured in a child pinned to one CPU beside a busy loop."""

from __future__ import annotations

import os
import subprocess
import sys

CHILD = """
import os, subprocess, sys, time
cpu = min(os.sched_getaffinity(0))
os.sched_setaffinity(0, {cpu})
busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
from engine.worker.stepper import run_queue_wait_s
def spin(seconds):
    before, end = run_queue_wait_s(), time.monotonic() + seconds
    while time.monotonic() < end:
        pass
    return run_queue_wait_s() - before
os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
waited = spin(0.5)
busy.kill(); busy.wait()
os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
print(f"{waited:.3f} {spin(0.2):.3f}")
"""


def test_a_thread_that_yields_its_cpu_to_a_busy_loop_counts_the_wait() -> None:
    out = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, check=True, timeout=60
    )
    beside_busy, alone = map(float, out.stdout.split())
    assert beside_busy > 0.25, f"waited {beside_busy:.3f} s of 0.5 at SCHED_IDLE beside a busy loop"
    # at normal priority, without the loop (a test process beside it would take at most half)
    assert alone < 0.15, f"waited {alone:.3f} s of 0.2 at normal priority without the busy loop"
    assert os.path.exists("/proc/thread-self/schedstat")
