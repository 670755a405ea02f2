"""Per-role settings of a local cluster: CPU pinning, torch thread counts, prompt chunk caps.

`--pin prefill=0,decode=1` pins every process of a role to a CPU set (`0`, `0+2`, `0-3`); `--threads 2`
or `--threads prefill=1,decode=1` sets `OMP_NUM_THREADS` (torch's intra-op pool) per role;
`--long-prefill-token-threshold 128` or `prefill=256,decode=128` caps one prompt's tokens a step per
role. Roles are the process roles of `splitserve.cluster`: coordinator, prefill, decode, colocated.
The launcher applies them in the child: `os.sched_setaffinity` before exec, the thread count through
the environment the child starts with, the threshold as the worker's flag. A worker started with
`--cpu-priority idle` drops itself to SCHED_IDLE (`run_at_idle_priority`).
"""

from __future__ import annotations

import os
from collections.abc import Callable

ROLES = ("coordinator", "prefill", "decode", "colocated")


def parse_cpu_set(text: str) -> tuple[int, ...]:
    """`0`, `0+2` or `0-3` -> the CPUs, sorted; ValueError says what to fix."""
    cpus: set[int] = set()
    for part in text.split("+"):
        lo, _, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi or lo)
        except ValueError:
            raise ValueError(f"{part!r} is not a CPU or a CPU range (0, 0+2 or 0-3)") from None
        if first < 0 or last < first:
            raise ValueError(f"bad CPU range {part!r}")
        cpus.update(range(first, last + 1))
    return tuple(sorted(cpus))


def _role_map(text: str, what: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        role, sep, value = item.partition("=")
        if not sep or role not in ROLES or not value:
            raise ValueError(f"{what} wants ROLE=VALUE items with ROLE in {', '.join(ROLES)}; got {item!r}")
        out[role] = value
    return out


def parse_pins(text: str) -> dict[str, tuple[int, ...]]:
    """`prefill=0,decode=1+2` -> {"prefill": (0,), "decode": (1, 2)}; ValueError says what to fix."""
    try:
        return {role: parse_cpu_set(v) for role, v in _role_map(text, "--pin").items()}
    except ValueError as exc:
        raise ValueError(f"--pin {text!r}: {exc} (CPU sets look like 0, 0+2 or 0-3)") from None


def parse_role_counts(text: str, flag: str, minimum: int) -> dict[str, int]:
    """`2` (every worker role) or `prefill=1,decode=2` -> role -> an integer >= `minimum`, for `flag`
    (`--threads`, `--long-prefill-token-threshold`); ValueError says what to fix."""
    try:
        if "=" not in text:
            n = int(text)
            counts = {role: n for role in ROLES if role != "coordinator"}
        else:
            counts = {role: int(v) for role, v in _role_map(text, flag).items()}
    except ValueError as exc:
        raise ValueError(f"{flag} {text!r}: {exc} (a number, or ROLE=NUMBER items)") from None
    if any(n < minimum for n in counts.values()):
        raise ValueError(f"{flag} {text!r}: values must be >= {minimum}")
    return counts


def parse_threads(text: str) -> dict[str, int]:
    """`2` or `prefill=1,decode=2` -> role -> torch thread count (>= 1)."""
    return parse_role_counts(text, "--threads", 1)


def parse_long_prefill_thresholds(text: str) -> dict[str, int]:
    """`128` or `prefill=256,decode=128` -> role -> its workers' `--long-prefill-token-threshold`
    (>= 0; 0: off)."""
    return parse_role_counts(text, "--long-prefill-token-threshold", 0)


def thread_env(threads: int | None) -> dict[str, str]:
    """The environment that sets a child's torch (OpenMP) thread count; empty for None."""
    return {} if threads is None else {"OMP_NUM_THREADS": str(threads)}


def pin_hook(cpus: tuple[int, ...] | None) -> Callable[[], None] | None:
    """A `preexec_fn` pinning the child to `cpus` before it execs; None when not pinned."""
    if not cpus:
        return None
    return lambda: os.sched_setaffinity(0, set(cpus))


def run_at_idle_priority() -> None:
    """Move every thread of this process, and so every thread it starts later, to SCHED_IDLE: they run
    only while their CPUs have nothing else to run. Lowering a priority needs no privilege. Linux only
    (RuntimeError elsewhere: the lane it serves relies on it)."""
    if not hasattr(os, "SCHED_IDLE"):
        raise RuntimeError("--cpu-priority idle needs Linux's SCHED_IDLE")
    for tid in os.listdir("/proc/self/task"):
        os.sched_setscheduler(int(tid), os.SCHED_IDLE, os.sched_param(0))
