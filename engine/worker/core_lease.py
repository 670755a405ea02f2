"""Cores lent between the workers of one host: a worker runs its prompt steps on another's idle cores.

Why: a prompt step is compute-bound and runs about 1.5x faster on two cores than on one, while a
prefill worker pinned beside the decode worker is idle much of the time below saturation. Splitting a
two-core host one core a role leaves that core unused where colocation would use it. Leases let the
decode worker use it without ever competing with its owner for it: a team thread that shares a core
with another busy thread stalls every parallel region of the step at its barrier.

Contract (one `CoreLeases` per worker process, owned by its `StepLoop`, called on the event loop except
`widen`/`narrow`, which run on the step thread around the forward):

- a lendable core has a lease: exclusive `flock`s on `<lease_dir>/cpu<N>.lock` and `.claim`. A lock
  belongs to the open file and dies with the process, so a worker killed with -9 leaves no core leased;
- a lender (`--lend-cores`) holds the leases of every CPU it is pinned to while it has work (`claim`)
  and lets them go when it has none (`lend`). It first takes the core's claim (`cpu<N>.claim`), which
  stops borrowers from starting another step there, then the core itself once the borrower's step
  ends: a claim waits for at most one borrowed step. Past `claim_timeout_s` (a borrower stopped
  mid-step) the lender computes anyway and claims again before its next step;
- a borrower (`--borrow-cores 0`) takes a core without waiting, only while no lender claims it, before
  a step that computes prompt tokens (`borrow`), runs that step with one more team thread bound to
  each core it got (`widen`, kernels `place_team`), and returns the team and the cores right after
  (`narrow`, `give_back`).

The lease directory is the trust boundary: it must belong to this user and be closed to everyone
else (0700), as any process that can open a lease file can hold a core.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import stat
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch

log = structlog.get_logger(__name__)

CLAIM_POLL_S = 0.001  # a lender waiting for a borrowed step to end looks this often


def lease_directory(path: str) -> Path:
    """`path` created 0700 if missing; ValueError unless it is a directory of this user's that no one
    else can write or read."""
    directory = Path(path)
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = directory.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise ValueError(
            f"--core-lease-dir {path}: must be a directory owned by this user with mode 0700 "
            "(any process that can open a lease file can hold a core)"
        )
    return directory


@dataclass(slots=True)
class _Lock:
    """One exclusive `flock` on a lease file, taken without waiting."""

    fd: int
    held: bool = False

    def try_take(self) -> bool:
        if not self.held:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            self.held = True
        return True

    def let_go(self) -> None:
        if self.held:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            self.held = False

    def is_free(self) -> bool:
        """Whether no one holds it (taken and let go at once; only for a lock this side never holds)."""
        if not self.try_take():
            return False
        self.let_go()
        return True


@dataclass(slots=True)
class _Lease:
    """A core's two locks: `core`, held by whoever computes on it, and `claim`, held by its lender from
    the moment it wants the core until it lends it again, so a borrower never takes the core in the gap
    between its own steps while the lender waits for it."""

    cpu: int
    core: _Lock
    claim: _Lock

    def close(self) -> None:
        self.core.let_go()
        self.claim.let_go()
        os.close(self.core.fd)
        os.close(self.claim.fd)


class CoreLeases:
    """This worker's side of the host's core leases: the CPUs it lends (its own, while idle) and the
    CPUs it borrows (others', for its prompt steps). `place_team` sets the step thread's OpenMP team
    (one CPU set per thread; kernels.cpu_ext's `place_team`), None where the CPU kernels are missing:
    then nothing is borrowed (logged once)."""

    def __init__(
        self,
        lease_dir: str,
        *,
        lend: bool,
        borrow: Iterable[int],
        place_team: Callable[[list[list[int]]], None] | None,
        claim_timeout_s: float = 2.0,
        home: Iterable[int] | None = None,
    ) -> None:
        """`home`: this worker's CPUs (default: the process's affinity), lent with `lend`."""
        directory = lease_directory(lease_dir)
        self.home = sorted(os.sched_getaffinity(0) if home is None else set(home))
        self.home_threads = torch.get_num_threads()
        borrow = sorted(set(borrow))
        if overlap := set(borrow) & set(self.home):
            raise ValueError(
                f"--borrow-cores {borrow}: CPUs {sorted(overlap)} are this worker's own (pinned to {self.home})"
            )
        if borrow and place_team is None:
            log.warning("no CPU kernels (place_team): --borrow-cores is ignored", borrow=borrow)
            borrow = []
        self.claim_timeout_s = claim_timeout_s
        self._place_team = place_team
        self._own = [self._open(directory, cpu) for cpu in self.home] if lend else []
        self._borrowable = [self._open(directory, cpu) for cpu in borrow]
        self._borrowed: list[_Lease] = []

    @staticmethod
    def _open(directory: Path, cpu: int) -> _Lease:
        def lock(name: str) -> _Lock:
            flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
            return _Lock(os.open(directory / name, flags, 0o600))

        return _Lease(cpu, lock(f"cpu{cpu}.lock"), lock(f"cpu{cpu}.claim"))

    @property
    def lends(self) -> bool:
        return bool(self._own)

    @property
    def borrows(self) -> bool:
        return bool(self._borrowable)

    @property
    def widened_share(self) -> float:
        """This worker's own share of a widened step's team (one thread per borrowable CPU beside its
        own), 0 when it borrows none: the router's prior for what a prompt token costs there against
        home (compute splits evenly) until such steps are measured."""
        if not self._borrowable:
            return 0.0
        return self.home_threads / (self.home_threads + len(self._borrowable))

    # --- lender -------------------------------------------------------------------------------------

    async def claim(self) -> float:
        """Hold every own lease before computing: waits while a borrower's step runs on one, at most
        `claim_timeout_s`. Returns the seconds waited (0 when already held)."""
        start = time.monotonic()
        pending = [lease for lease in self._own if not _claimed(lease)]
        while pending and time.monotonic() - start < self.claim_timeout_s:
            await asyncio.sleep(CLAIM_POLL_S)  # the borrower's flock gives no wake-up to wait on
            pending = [lease for lease in pending if not _claimed(lease)]
        if pending:
            log.warning(
                "core lease still held past the claim timeout: computing beside its borrower",
                cpus=[lease.cpu for lease in pending],
                timeout_s=self.claim_timeout_s,
            )
        return time.monotonic() - start if self._own else 0.0

    def lend(self) -> None:
        """Nothing to compute: every own core may be borrowed until the next `claim`."""
        for lease in self._own:
            lease.core.let_go()
            lease.claim.let_go()

    # --- borrower -----------------------------------------------------------------------------------

    def borrow(self) -> list[int]:
        """Take every borrowable lease that is free now, without waiting: the CPUs the next step may
        run on beside this worker's own. `give_back` after that step."""
        self._borrowed = [
            lease for lease in self._borrowable if lease.claim.is_free() and lease.core.try_take()
        ]
        return [lease.cpu for lease in self._borrowed]

    def give_back(self) -> None:
        for lease in self._borrowed:
            lease.core.let_go()
        self._borrowed = []

    def widen(self, cpus: list[int]) -> None:
        """On the step thread: its team becomes the home threads (each on the home CPUs) plus one
        thread bound to each CPU of `cpus`."""
        assert self._place_team is not None
        self._place_team([self.home] * self.home_threads + [[cpu] for cpu in cpus])

    def narrow(self) -> None:
        """On the step thread, after a widened step: back to the home team."""
        assert self._place_team is not None
        self._place_team([self.home] * self.home_threads)

    def close(self) -> None:
        self._borrowed = []
        for lease in self._own + self._borrowable:
            lease.close()
        self._own, self._borrowable = [], []


def _claimed(lease: _Lease) -> bool:
    """The lender's step toward holding `lease`: its claim first (no borrower starts a step on the core
    from then on), then the core once the borrower's current step gives it back."""
    return lease.claim.try_take() and lease.core.try_take()
