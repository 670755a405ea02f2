"""The native completion path of RMA gets (kvtransfer/csrc/rma_wake.c, kvtransfer.rma_wake).

The library alone, built from source into a temporary directory and driven by real threads, and
then many concurrent `Rma.get` batches over real UCX endpoints to two agent processes, one of them
made to fail: every batch completes once, with its own outcome, and nothing is left behind.
"""

from __future__ import annotations

import ctypes
import json
import os
import select
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtransfer import rma_wake
from kvtransfer.bench.control import AgentClient, SpawnedAgent, spawn_agent
from tests.kvtransfer.conftest import LAYOUT, agent_args

UCS_ERR_IO_ERROR = -3


@pytest.fixture(scope="module")
def lib(tmp_path_factory: pytest.TempPathFactory) -> rma_wake.NativeWake:
    """The library as a checkout without a prebuilt one gets it: compiled from source on demand."""
    target = tmp_path_factory.mktemp("rma_wake") / rma_wake.LIBRARY.name
    rma_wake.build(target)
    return rma_wake.NativeWake(target)


def _readable(fd: int) -> bool:
    return bool(select.select([fd], [], [], 0)[0])


def _drain(lib: rma_wake.NativeWake, wake: rma_wake.CWake) -> list[int]:
    """Addresses of the batches queued since the last drain."""
    head, out = lib.drain(ctypes.byref(wake)), []
    while head:
        out.append(head)
        head = rma_wake.CBatch.from_address(head).next
    return out


def test_concurrent_completions_queue_each_batch_once_with_its_first_error(lib: rma_wake.NativeWake) -> None:
    efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
    try:
        wake = rma_wake.CWake(None, None, efd, 0)
        counts = [1 + i % 5 for i in range(300)]
        batches = [rma_wake.CBatch(None, ctypes.addressof(wake), n + 1, 0) for n in counts]
        failing = {i for i in range(len(batches)) if i % 7 == 3}
        # Each thread completes one get of every batch that still has one left for it.
        complete = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int32, ctypes.c_void_p)(lib.complete)

        def progress(k: int) -> None:
            for i, batch in enumerate(batches):
                if k < counts[i]:
                    complete(
                        None,
                        UCS_ERR_IO_ERROR if i in failing and k == counts[i] - 1 else 0,
                        ctypes.addressof(batch),
                    )

        threads = [threading.Thread(target=progress, args=(k,)) for k in range(5)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not _readable(efd), "a batch was queued while its poster still held it"
        for batch in batches:  # the poster lets go: nothing completed inline
            assert lib.release(ctypes.byref(batch), 1, 0) == 1
        assert _drain(lib, wake) == [] and not _readable(efd)

        # Now the poster lets go first and the completions come after: all are queued, once each.
        for i, batch in enumerate(batches):
            batch.pending, batch.status, batch.next = counts[i] + 1, 0, None
            assert lib.release(ctypes.byref(batch), 1, 0) == 0
        threads = [threading.Thread(target=progress, args=(k,)) for k in range(5)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert _readable(efd)
        queued = _drain(lib, wake)
        assert sorted(queued) == sorted(ctypes.addressof(b) for b in batches)
        assert not _readable(efd) and _drain(lib, wake) == []
        statuses = {i: batch.status for i, batch in enumerate(batches)}
        assert statuses == {i: UCS_ERR_IO_ERROR if i in failing else 0 for i in statuses}
        lib.quiesce(ctypes.byref(wake))  # returns: no callback is running
    finally:
        os.close(efd)


def test_an_inline_error_is_the_batchs_and_an_inline_batch_is_never_queued(lib: rma_wake.NativeWake) -> None:
    efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
    try:
        wake = rma_wake.CWake(None, None, efd, 0)
        batch = rma_wake.CBatch(None, ctypes.addressof(wake), 3 + 1, 0)
        assert lib.release(ctypes.byref(batch), 4, UCS_ERR_IO_ERROR) == 1
        assert batch.status == UCS_ERR_IO_ERROR and batch.pending == 0
        assert not _readable(efd) and _drain(lib, wake) == []
    finally:
        os.close(efd)


@pytest.fixture
def two_agents() -> Iterator[list[SpawnedAgent]]:
    agents = [spawn_agent(agent_args("ucx", fragment=2))]
    try:
        agents.append(spawn_agent(agent_args("ucx", fragment=2)))
        yield agents
    finally:
        for agent in agents:
            agent.stop()


NBYTES = 256 << 10  # large enough that UCP returns a request for every get (CMA, this UCX)


@pytest.mark.parametrize("inline", [False, True], ids=["progress_thread", "inline"])
async def test_many_concurrent_batches_get_their_own_outcome_and_nothing_leaks(
    two_agents: list[SpawnedAgent], inline: bool
) -> None:
    # progress_thread: no batch is progressed by its poster, so all of them complete on UCXX's
    # progress thread together; inline: the poster progresses each (4 x 64 KiB) while UCP makes
    # headway, and over CMA that finishes some before the next is posted
    peers, rings = [], []
    for seed, agent in enumerate(two_agents):
        client = AgentClient(agent.control)
        try:
            info = await client.call("info")
            await client.call("ring", size=NBYTES, seed=seed + 1, ring_bytes=4 * NBYTES)
            sources = (await client.call("get_expose"))["sources"]
            rings.append((await client.call("get_sender_state", verify=True))["checksums"])
        finally:
            client.close()
        peers.append({"address": info["address"], "key": info["key"], "sources": sources})
    spec = {
        "layout": LAYOUT.to_dict(),
        "peers": peers,
        "bad_peer": 1,
        "nbytes": NBYTES,
        "batches": 24,
        "runs": 4,
    }
    env = {**os.environ, "SPLITSERVE_RMA_INLINE_BYTES": str(NBYTES if inline else 0)}
    reader = subprocess.run(
        [sys.executable, "-m", "tests.kvtransfer.rma_batches", json.dumps(spec)],
        capture_output=True, text=True, timeout=120, check=False, cwd=Path(__file__).parents[2], env=env,
    )  # fmt: skip
    assert reader.returncode == 0, reader.stderr[-4000:]
    out = json.loads(reader.stdout.strip().splitlines()[-1])
    if inline:
        assert out["completed_inline"] > 0, "no batch finished on its poster"
    else:
        assert out["completed_inline"] == 0
        assert out["in_flight_after_posting"] > 1, "the batches were not in flight together"
    for i, outcome in enumerate(out["outcomes"]):
        if i % 2 == 0:  # the good peer: bit-exact
            assert outcome == "ok", (i, outcome)
            assert out["crcs"][i] == rings[0][i // 2 % len(rings[0])], i
        else:  # the failed endpoint: an RmaError for every batch on it, none lost
            assert outcome.startswith("RmaError: ucp_get_nbx: "), (i, outcome)
    assert out["pending_after_close"] == 0
    assert out["eventfds_left"] == 0
