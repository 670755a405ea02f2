"""D's reservation lease measures P's progress, not P's queue: it starts when P runs the request's
first step (PrefillProgress) and every KVChunkReady renews it, so a request that waits in P's queue
longer than the lease still completes; a reservation P never starts is released after
--queue-lease-ms all the same (the invariant: no P, dead or silent, pins D's blocks forever)."""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from engine.worker.process import Worker
from splitserve import wire
from splitserve.v1 import control_pb2
from tests.workers.conftest import Cluster, endpoint, execution_request
from tests.workers.test_disaggregated import assert_quiescent, dispatch, random_prompt, wait_until

LEASE_MS = 1000  # D hears P's progress every 250 ms of it: only a second-long stall would expire it
QUEUE_S = 1.5 * LEASE_MS / 1e3  # how long P's step thread is held with both requests queued
LONG, SHORT = 1600, 8


@contextmanager
def step_thread_held(worker: Worker) -> Iterator[None]:
    """Occupy `worker`'s step thread (its one-thread executor, where every forward runs) for the
    block: the worker's loop keeps receiving and scheduling, but no step computes, as while a long
    step of other requests runs. Its queue is then as long as the test decides, on any host, where a
    queue made of real steps was 0.75-1x the lease on a fast one. Let go on any exit: the worker's
    stop waits for its step thread."""
    gate = threading.Event()
    worker.stepper._executor.submit(gate.wait)
    try:
        yield
    finally:
        gate.set()


async def test_a_request_queued_on_p_longer_than_the_lease_completes_without_expiring(
    cluster: Cluster,
) -> None:
    p = await cluster.start("prefill", "p0", lease_ms=LEASE_MS, max_num_batched_tokens=8)
    d = await cluster.start("decode", "d0", lease_ms=LEASE_MS)
    coord, rng = cluster.coordinator, random.Random(3)
    identity = p.engine.loaded.identity
    reqs = [
        execution_request(1, random_prompt(rng, 64), 2, identity=identity),
        execution_request(2, random_prompt(rng, SHORT), 4, identity=identity),
    ]
    with step_thread_held(p):
        for req in reqs:
            await dispatch(coord, p, d, req)
        assert d.role is not None
        await wait_until(lambda: {1, 2} <= set(d.role.records), "D to reserve for both")  # type: ignore[union-attr]
        with pytest.raises(TimeoutError):  # the premise: both wait in P's queue past the lease, unexpired
            await coord.expect("abort", timeout=QUEUE_S)
    queue_ms: dict[int, float] = {}
    tokens: dict[int, int] = {1: 0, 2: 0}
    finished: set[int] = set()
    while finished != {1, 2}:
        _, env = await coord.expect("output")
        if env.HasField("prefill_done"):
            queue_ms[env.prefill_done.output.rid] = env.prefill_done.queue_ms
        items = [env.prefill_done.output] if env.HasField("prefill_done") else list(env.token_batch.items)
        for item in items:  # by offset: D's announce of token 1 repeats it
            tokens[item.rid] = max(tokens[item.rid], item.offset + len(wire.unpack_ids(item.token_ids)))
            if item.finish_reason:
                finished.add(item.rid)
    assert queue_ms[2] > LEASE_MS, "the premise: request 2 waited in P's queue past the lease"
    assert tokens == {1: 2, 2: 4}
    assert coord.inbox["abort"].empty(), coord.inbox["abort"].get_nowait()
    assert d.metrics.requests.labels("lease_expired")._value.get() == 0
    await assert_quiescent(cluster, p, d)


async def test_a_reservation_p_never_starts_is_released_after_the_queue_lease(cluster: Cluster) -> None:
    p = await cluster.start("prefill", "p0")
    d = await cluster.start("decode", "d0", lease_ms=LEASE_MS, queue_lease_ms=300)
    coord = cluster.coordinator
    req = execution_request(7, random_prompt(random.Random(4), 12), 4, identity=p.engine.loaded.identity)
    # P never gets the Prefill (it died with it, or lost it): only D's reservation exists
    await coord.send("d0", decode={"request": req, "prefill": endpoint(p)})
    sender, env = await coord.expect("abort")
    assert sender == "d0"
    assert (env.abort.rid, env.abort.reason) == (7, control_pb2.ABORT_REASON_LEASE_EXPIRED)
    assert "--queue-lease-ms" in env.abort.message
    await assert_quiescent(cluster, p, d)


async def test_p_lost_mid_queue_frees_ds_blocks_without_waiting_for_the_queue_lease(
    cluster: Cluster,
) -> None:
    """P's transport dies (as with a killed process) while request 2 waits in its queue: D's
    reservations end at once (the session's peer loss, or P's Abort), not after --queue-lease-ms."""
    p = await cluster.start("prefill", "p0", max_num_batched_tokens=8, num_blocks=600)
    d = await cluster.start("decode", "d0", queue_lease_ms=120_000, num_blocks=600)
    coord, rng = cluster.coordinator, random.Random(5)
    identity = p.engine.loaded.identity
    for rid, n in ((1, LONG), (2, SHORT)):
        await dispatch(coord, p, d, execution_request(rid, random_prompt(rng, n), 2, identity=identity))
    assert d.role is not None and p.transfer is not None
    await wait_until(lambda: 2 in d.role.records, "D to reserve for request 2")  # type: ignore[union-attr]
    await p.transfer.transport.close()
    aborted: set[int] = set()
    while aborted != {1, 2}:  # from D (the session's peer loss) or P (its sends failed), first wins
        _, env = await coord.expect("abort")
        assert env.abort.reason == control_pb2.ABORT_REASON_PEER_FAILED
        aborted.add(env.abort.rid)
    await wait_until(lambda: not d.role.records, "D to release both")  # type: ignore[union-attr]
    await coord.assert_pool_clean("d0")
