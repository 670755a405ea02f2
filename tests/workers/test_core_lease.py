"""Core leases (engine/worker/core_lease.py): a borrower takes a lender's core only while the lender
neither computes nor claims it, a claim waits for the borrowed step and no longer than its timeout, a
killed holder leaves nothing leased, the directory must be private, and `place_team` binds each team
thread where it is told. Real flock files in a temp dir, a real child process, real OpenMP threads."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from engine.worker.core_lease import CoreLeases, lease_directory
from kernels import cpu_ext


def leases(directory: Path, *, lend: bool = False, borrow: tuple[int, ...] = (), home: int = 0) -> CoreLeases:
    return CoreLeases(
        str(directory),
        lend=lend,
        borrow=borrow,
        place_team=lambda sets: None,
        claim_timeout_s=0.2,
        home=[home],
    )


@pytest.fixture
def lease_dir(tmp_path: Path) -> Path:
    return lease_directory(str(tmp_path / "cores"))


async def test_a_borrower_takes_a_core_only_while_its_lender_neither_computes_nor_claims_it(
    lease_dir: Path,
) -> None:
    lender, borrower = leases(lease_dir, lend=True, home=0), leases(lease_dir, borrow=(0,), home=1)
    assert borrower.borrow() == [0]  # a lender that never claimed: the core is free
    borrower.give_back()
    assert await lender.claim() < 0.2
    assert borrower.borrow() == []  # the lender computes
    lender.lend()
    assert borrower.borrow() == [0]
    borrower.give_back()
    lender.close()
    borrower.close()


async def test_a_claim_waits_for_the_borrowed_step_and_stops_borrowers_meanwhile(lease_dir: Path) -> None:
    lender, borrower = leases(lease_dir, lend=True, home=0), leases(lease_dir, borrow=(0,), home=1)
    other = leases(lease_dir, borrow=(0,), home=1)
    assert borrower.borrow() == [0]  # a step on the borrowed core begins
    claim = asyncio.ensure_future(lender.claim())
    await asyncio.sleep(0)  # the claim takes the core's claim lock and starts waiting for the core
    assert not claim.done()
    assert other.borrow() == []  # claimed: no borrower starts another step on it
    borrower.give_back()  # the step ends
    waited = await asyncio.wait_for(claim, 5)
    assert waited < 0.2  # it had the core before its timeout
    assert borrower.borrow() == []
    for side in (lender, borrower, other):
        side.close()


async def test_a_claim_past_its_timeout_computes_anyway_and_claims_again_next_step(lease_dir: Path) -> None:
    """A borrower stopped mid-step (SIGSTOP) cannot stall the lender past `claim_timeout_s`."""
    lender, borrower = leases(lease_dir, lend=True, home=0), leases(lease_dir, borrow=(0,), home=1)
    assert borrower.borrow() == [0]
    assert await lender.claim() >= 0.2  # timed out: computes beside the stopped borrower
    borrower.give_back()
    assert await lender.claim() < 0.2  # the next step has its core
    assert borrower.borrow() == []
    lender.close()
    borrower.close()


def test_a_worker_killed_holding_a_core_leaves_it_free(lease_dir: Path) -> None:
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600); "
            "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); sys.stdin.read()",
            str(lease_dir / "cpu0.lock"),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        borrower = leases(lease_dir, borrow=(0,), home=1)
        assert borrower.borrow() == []
        holder.kill()
        holder.wait(timeout=10)
        assert borrower.borrow() == [0]
        borrower.close()
    finally:
        holder.kill()
        holder.wait(timeout=10)


def test_the_lease_directory_must_be_private(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    with pytest.raises(ValueError, match="mode 0700"):
        lease_directory(str(shared))
    link = tmp_path / "link"
    link.symlink_to(lease_directory(str(tmp_path / "private")))
    with pytest.raises(ValueError, match="mode 0700"):
        lease_directory(str(link))
    assert oct(lease_directory(str(tmp_path / "new" / "cores")).stat().st_mode & 0o777) == "0o700"


def test_a_worker_cannot_borrow_its_own_cpus(lease_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"CPUs \[1\] are this worker's own"):
        leases(lease_dir, borrow=(0, 1), home=1)


def test_without_cpu_kernels_nothing_is_borrowed(lease_dir: Path) -> None:
    borrower = CoreLeases(str(lease_dir), lend=False, borrow=(0,), place_team=None, home=[1])
    assert not borrower.borrows and borrower.borrow() == [] and borrower.widened_share == 0.0
    borrower.close()


def test_the_share_of_a_widened_team_counts_one_thread_a_borrowable_cpu(lease_dir: Path) -> None:
    borrower, lender = leases(lease_dir, borrow=(0, 2), home=1), leases(lease_dir, lend=True, home=0)
    threads = borrower.home_threads
    assert borrower.widened_share == pytest.approx(threads / (threads + 2)) and lender.widened_share == 0.0
    borrower.close()
    lender.close()


def _thread_cpus() -> list[str]:
    allowed = []
    for task in Path("/proc/self/task").iterdir():
        for line in (task / "status").read_text().splitlines():
            if line.startswith("Cpus_allowed_list:"):
                allowed.append(line.split()[1])
    return allowed


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="binds a team thread to a second CPU")
def test_place_team_binds_each_team_thread_to_its_cpus() -> None:
    kernels = cpu_ext.load()
    if kernels is None:
        pytest.skip("no CPU kernels")
    first, second = sorted(os.sched_getaffinity(0))[:2]
    seen: dict[str, list[str]] = {}

    def step_thread() -> None:
        kernels.place_team([[first], [second]])
        seen["widened"] = _thread_cpus()
        seen["caller"] = [str(c) for c in sorted(os.sched_getaffinity(0))]
        kernels.place_team([[first]])
        seen["narrowed"] = [str(c) for c in sorted(os.sched_getaffinity(0))]

    thread = threading.Thread(target=step_thread)
    thread.start()
    thread.join(timeout=30)
    assert seen["caller"] == [str(first)] == seen["narrowed"]
    assert str(second) in seen["widened"]  # the team's second thread, bound to the second CPU
    with pytest.raises(RuntimeError, match="empty CPU set"):
        kernels.place_team([[first], []])
