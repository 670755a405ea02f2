"""The native posting and completion path of RMA gets (kvtransfer/csrc/rma_wake.c, kvtransfer.rma_wake).

The library alone, built from source into a temporary directory and driven by real threads (and,
for `rma_get`, by a scripted UCP: its function pointers are Python callbacks that say what each get
and each progress call does), and then many concurrent `Rma.get` batches over real UCX endpoints to
two agent processes, one of them made to fail: every batch completes once, with its own outcome,
and nothing is left behind.
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


def test_a_library_built_from_an_older_source_is_rebuilt_before_it_is_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    old_source = tmp_path / "rma_wake_old.c"
    old_source.write_text(rma_wake.SOURCE.read_text().replace(rma_wake.ABI.decode(), "rma_wake ABI 1"))
    target = tmp_path / rma_wake.LIBRARY.name
    monkeypatch.setattr(rma_wake, "SOURCE", old_source)
    rma_wake.build(target)
    mtime = target.stat().st_mtime_ns
    assert rma_wake.ABI not in target.read_bytes()
    monkeypatch.undo()  # this checkout's source again
    monkeypatch.setattr(rma_wake, "LIBRARY", target)
    loaded = rma_wake.native.__wrapped__()  # what `native()` does on first use, uncached
    assert rma_wake.ABI in target.read_bytes() and target.stat().st_mtime_ns != mtime
    assert loaded.get is not None and loaded.complete


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


GET_NBX = ctypes.CFUNCTYPE(
    ctypes.c_void_p,
    ctypes.c_void_p,
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_uint64,
    ctypes.c_void_p,
    ctypes.c_void_p,
)
PROGRESS = ctypes.CFUNCTYPE(ctypes.c_uint, ctypes.c_void_p)
SIGNAL = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_void_p)
FREE = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
REQUEST = 1 << 20  # what the scripted get_nbx returns for a get it leaves in flight (a "request")


class ScriptedUcp:
    """UCP as `rma_get` sees it. `outcomes[i]` is what the i-th get returns: 0 (done at post), a
    negative status (failed at post) or REQUEST (in flight; progress completes one per call, or
    none while `stalled`). Records the gets, the progress calls, the signals, the freed requests."""

    def __init__(self, lib: rma_wake.NativeWake, outcomes: list[int], stalled: bool = False) -> None:
        self.lib, self.outcomes, self.stalled = lib, outcomes, stalled
        self.gets: list[tuple[int, int, int]] = []
        self.in_flight: list[tuple[int, int]] = []  # (request, user_data)
        self.progress_calls = self.signals = 0
        self.freed: list[int] = []
        self._complete = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int32, ctypes.c_void_p)(
            lib.complete
        )
        self._fns = (GET_NBX(self._get), PROGRESS(self._progress), SIGNAL(self._signal))
        self.c = rma_wake.CUcp(*(ctypes.cast(f, ctypes.c_void_p).value for f in self._fns), None)
        self.free = FREE(self.freed.append)

    def _get(self, ep: int, local: int, nbytes: int, remote: int, rkey: int, param: int) -> int:
        outcome = self.outcomes[len(self.gets)]
        self.gets.append((local, remote, nbytes))
        if outcome != REQUEST:
            return outcome & ((1 << 64) - 1)  # a status as a pointer: 0 or an error in (-100, 0)
        request = REQUEST + len(self.gets)
        user_data = ctypes.c_void_p.from_address(param + 32).value  # ucp_request_param_t.user_data
        self.in_flight.append((request, user_data or 0))
        return request

    def complete_one(self, status: int = 0) -> None:
        request, user_data = self.in_flight.pop(0)
        self._complete(request, status, user_data)

    def _progress(self, worker: int) -> int:
        self.progress_calls += 1
        if self.stalled or not self.in_flight:
            return 0
        self.complete_one()
        return 1

    def _signal(self, worker: int) -> int:
        self.signals += 1
        return 0

    def get(self, batch: rma_wake.CBatch, n: int, inline_bytes: int, calls: int = 64) -> int:
        runs = (rma_wake.CRun * n)(*(rma_wake.CRun(4096 * (i + 1), 8192 * (i + 1), 100) for i in range(n)))
        return int(
            self.lib.get(ctypes.byref(batch), ctypes.byref(self.c), 1, 2, None, runs, n, inline_bytes, calls)
        )


def test_rma_get_posts_every_run_and_resolves_a_batch_it_finished_without_queueing_it(
    lib: rma_wake.NativeWake,
) -> None:
    efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
    try:
        # every get done at post, one of them failed: no progress, no signal, the first error kept
        ucp = ScriptedUcp(lib, [0, UCS_ERR_IO_ERROR, 0])
        wake = rma_wake.CWake(None, ctypes.cast(ucp.free, ctypes.c_void_p).value, efd, 0)
        batch = rma_wake.CBatch(None, ctypes.addressof(wake), 3 + 1, 0)
        assert ucp.get(batch, 3, inline_bytes=1 << 20) == rma_wake.DONE_AT_POST
        assert ucp.gets == [(4096, 8192, 100), (8192, 16384, 100), (12288, 24576, 100)]
        assert (batch.status, batch.pending, ucp.progress_calls, ucp.signals) == (UCS_ERR_IO_ERROR, 0, 0, 0)

        # two in flight, progressed here until both completed: resolved by the poster, the
        # eventfd never written (the completions found the poster's reference still held)
        ucp = ScriptedUcp(lib, [REQUEST, 0, REQUEST])
        wake.request_free = ctypes.cast(ucp.free, ctypes.c_void_p).value
        batch = rma_wake.CBatch(None, ctypes.addressof(wake), 3 + 1, 0)
        assert ucp.get(batch, 3, inline_bytes=300) == rma_wake.DONE_INLINE
        assert (batch.status, batch.pending, ucp.progress_calls, ucp.signals) == (0, 0, 2, 0)
        assert sorted(ucp.freed) == [REQUEST + 1, REQUEST + 3]
        assert not _readable(efd) and _drain(lib, wake) == []
    finally:
        os.close(efd)


@pytest.mark.parametrize("case", ["stalled", "too_large", "out_of_calls"])
def test_rma_get_hands_a_batch_it_did_not_finish_to_the_progress_thread(
    lib: rma_wake.NativeWake, case: str
) -> None:
    # stalled: the first progress call finds nothing to do (a network lane) and the poster stops
    # there, it never spins; too_large: a batch over inline_bytes is not progressed here at all;
    # out_of_calls: progress makes headway but the call budget ends first
    efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
    try:
        ucp = ScriptedUcp(lib, [REQUEST] * 4, stalled=case == "stalled")
        wake = rma_wake.CWake(None, ctypes.cast(ucp.free, ctypes.c_void_p).value, efd, 0)
        batch = rma_wake.CBatch(None, ctypes.addressof(wake), 4 + 1, 0)
        inline_bytes = 399 if case == "too_large" else 400
        calls = 2 if case == "out_of_calls" else 64
        assert ucp.get(batch, 4, inline_bytes, calls) == rma_wake.PENDING
        expected_calls = {"stalled": 1, "too_large": 0, "out_of_calls": 2}[case]
        assert (ucp.progress_calls, ucp.signals) == (expected_calls, 1)
        assert not _readable(efd), "queued while gets were still in flight"
        ucp.complete_one(UCS_ERR_IO_ERROR)
        while ucp.in_flight:
            ucp.complete_one()
        assert _readable(efd) and _drain(lib, wake) == [ctypes.addressof(batch)]
        assert (batch.status, batch.pending, len(ucp.freed)) == (UCS_ERR_IO_ERROR, 0, 4)
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
