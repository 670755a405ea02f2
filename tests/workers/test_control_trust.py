"""A real prefill and decode worker against untrusted input on their control ROUTERs (the named
malformed frames and a seeded fuzz corpus, from a peer the coordinator introduced and from a key it
never did), and supervision: a control task that dies takes readiness down and fails `serve`."""

from __future__ import annotations

import asyncio
import random

import pytest

from engine.worker.process import Worker, WorkerFailed
from splitserve.v1 import control_pb2, serving_pb2
from tests.control_attacks import Attacker, Case, fuzz_cases, named_cases
from tests.workers.conftest import WAIT_S, Cluster, execution_request
from tests.workers.test_disaggregated import LENGTH, assert_quiescent, dispatch, wait_until

ABORT = control_pb2.Envelope(abort=control_pb2.Abort(rid=1, generation=1)).SerializeToString()


def dropped(worker: Worker) -> float:
    return sum(
        s.value
        for metric in worker.metrics.control_dropped.collect()
        for s in metric.samples
        if s.name.endswith("_total")
    )


async def introduce_fake_peer(cluster: Cluster, fake_id: str, *workers: Worker) -> None:
    """The coordinator lists a peer whose key the test holds (as if a real peer were compromised)."""
    coord = cluster.coordinator
    coord.keys.add_worker(fake_id, role="decode")
    fake = control_pb2.Peer(
        role=serving_pb2.WORKER_ROLE_DECODE,
        endpoint=control_pb2.WorkerEndpoint(
            worker_id=fake_id,
            control_address="tcp://127.0.0.1:1",
            control_public_key=coord.keys.worker_keys(fake_id).public.decode(),
        ),
        incarnation=1,
    )
    for w in workers:
        await coord.send(w.settings.worker_id, peers=control_pb2.Peers(peers=[*coord.peers(), fake]))
        await wait_until(lambda w=w: w.control.links.key_of(fake_id) is not None, "the fake peer listed")  # type: ignore[union-attr]


async def canary(cluster: Cluster, p: Worker, d: Worker, rid: int) -> tuple[list[int], int]:
    """One greedy request through P and D (test_disaggregated checks this path against the offline
    engine's greedy; here the output after an attack must equal the output before it)."""
    rng = random.Random(5)
    prompt = [rng.randrange(5, 1000) for _ in range(11)]
    req = execution_request(rid, prompt, 8, identity=p.engine.loaded.identity)
    await dispatch(cluster.coordinator, p, d, req)
    return (await cluster.coordinator.collect({rid}))[rid]


@pytest.mark.fuzz
async def test_malformed_and_fuzzed_frames_leave_both_workers_serving_the_same_tokens(
    cluster: Cluster,
) -> None:
    p = await cluster.start("prefill", "p0")
    d = await cluster.start("decode", "d0")
    before = await canary(cluster, p, d, rid=1)
    assert before[1] == LENGTH and len(before[0]) == 8
    await introduce_fake_peer(cluster, "decode-fuzz", p, d)
    keys = cluster.coordinator.keys
    attackers = [
        Attacker(
            w.control.control_address,  # type: ignore[union-attr]
            keys=keys.worker_keys("decode-fuzz"),
            server_key=w.control.keys.public,  # type: ignore[union-attr]
        )
        for w in (p, d)
    ]
    try:
        for i, attacker in enumerate(attackers):
            for case in [*named_cases(), *fuzz_cases(seed=100 + i)]:
                await attacker.send(case)
        for w in (p, d):  # the bounded wait sees the readers work through the corpus
            await wait_until(lambda w=w: dropped(w) >= 7, f"{w.settings.worker_id} to drop the bad frames")
    finally:
        for attacker in attackers:
            attacker.close()
    assert await canary(cluster, p, d, rid=2) == before
    await assert_quiescent(cluster, p, d)
    for w in (p, d):
        assert w.control.ready and not w.control.failure  # type: ignore[union-attr]


async def test_a_key_the_coordinator_never_introduced_cannot_reach_a_worker(cluster: Cluster) -> None:
    p = await cluster.start("prefill", "p0")
    assert p.control is not None and p.control.keys is not None
    keys = cluster.coordinator.keys
    keys.add_worker("decode-stranger")  # a valid cluster key, but no coordinator ever listed it
    stranger = Attacker(
        p.control.control_address, keys=keys.worker_keys("decode-stranger"), server_key=p.control.keys.public
    )
    plain = Attacker(p.control.control_address)  # no CURVE at all
    try:
        await stranger.send(Case("abort", [ABORT], identity=b"decode-stranger"))
        await plain.send(Case("abort", [ABORT], identity=b"d0"))
        assert await asyncio.wait_for(stranger.handshake(b"decode-stranger"), WAIT_S) == "auth"
        assert await asyncio.wait_for(plain.handshake(b"d0"), WAIT_S) == "protocol"
    finally:
        stranger.close()
        plain.close()
    assert dropped(p) == 0  # nothing reached the parser, let alone a handler
    assert p.control.ready


async def test_a_dead_control_task_takes_readiness_down_deregisters_and_fails_serve(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    w = await cluster.start("decode", "d0")
    assert w.control is not None and w.role is not None and w._ready()
    serving = asyncio.create_task(w.serve())

    def broken() -> dict[str, int]:
        raise RuntimeError("injected fault in the heartbeat loop")

    monkeypatch.setattr(w.role, "queue_depths", broken)  # the heartbeat task dies on its next tick
    sender, env = await cluster.coordinator.expect("deregister")
    assert sender == "d0" and "heartbeat ended" in env.deregister.reason
    assert not w._ready() and "injected" in w.control.failure
    with pytest.raises(WorkerFailed, match="heartbeat"):
        await asyncio.wait_for(serving, WAIT_S)
