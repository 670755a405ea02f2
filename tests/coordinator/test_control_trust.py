"""The coordinator's control ROUTER against untrusted peers: no key, a wrong key, a valid key of the
wrong role, a stolen model identity, a key speaking for another worker id, malformed frames; and a
control plane that dies takes health down."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitserve.control import ControlQueueFull
from splitserve.control_auth import KeySet, load_public_key
from splitserve.v1 import control_pb2, serving_pb2, serving_pb2_grpc
from tests.control_attacks import Attacker, named_cases
from tests.coordinator.conftest import Cluster

StartCluster = Callable[..., Awaitable[Cluster]]
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
NO_ANSWER_S = 1.5  # how long a refused peer waits for the RegisterAck it must never get


def dropped(cluster: Cluster, reason: str) -> float:
    return cluster.app.metrics.control_dropped.labels(reason)._value.get()


async def health(cluster: Cluster) -> int:
    stub = health_pb2_grpc.HealthStub(cluster.channel)
    return (await stub.Check(health_pb2.HealthCheckRequest())).status


async def test_no_key_or_a_wrong_key_cannot_register_even_with_the_stolen_model_identity(
    start_cluster: StartCluster, tmp_path: Path
) -> None:
    cluster = await start_cluster()
    models = serving_pb2_grpc.ModelServiceStub(cluster.channel)
    stolen = (await models.GetModel(serving_pb2.GetModelRequest(name="tiny"))).identity
    assert stolen == cluster.model.identity  # what any API client learns
    stranger = KeySet.create(tmp_path / "stranger", ["prefill-x"])
    server_key = load_public_key(cluster.keys.coordinator_public)
    attempts = [
        cluster.worker("prefill-x", "prefill", keys=None, server_key=None, identity=stolen),
        cluster.worker("prefill-y", "prefill", keys=stranger.worker_keys("prefill-x"), identity=stolen),
        cluster.worker(  # a worker that trusts the wrong coordinator key
            "prefill-z", "prefill", server_key=load_public_key(stranger.coordinator_public), identity=stolen
        ),
    ]
    assert server_key
    for w in attempts:
        with pytest.raises((TimeoutError, ControlQueueFull)):  # no link at all, or no answer
            await w.register(timeout=NO_ANSWER_S)
    assert list(cluster.app.registry) == []
    await cluster.ready_pair()  # real workers are unaffected
    assert await health(cluster) == SERVING


async def test_a_valid_key_of_the_wrong_role_is_refused(start_cluster: StartCluster) -> None:
    cluster = await start_cluster()
    cluster.keys.add_worker("w1", role="decode")
    ack = await cluster.worker("w1", "prefill").register()
    assert not ack.accepted and "WORKER_ROLE_DECODE" in ack.reason and "role" in ack.reason
    assert cluster.app.registry.get("w1") is None
    ack = await cluster.worker("w2", "colocated").register()  # keyed for colocated: accepted
    assert ack.accepted


async def until_unroutable(cluster: Cluster, worker_id: str, timeout: float = 10.0) -> None:
    """Wait (bounded) until the coordinator's ROUTER has dropped `worker_id`'s connection. Until then
    ZMQ refuses a new connection under the same routing id (no ROUTER_HANDOVER: a live worker's id
    cannot be taken over) and that peer's first frames are lost, which a loaded box made this test's
    wait for the thief's RegisterAck hit."""
    async with asyncio.timeout(timeout):
        while True:
            try:
                await cluster.app.socket.send(control_pb2.Envelope(), to=worker_id)
            except ControlQueueFull:
                return
            await asyncio.sleep(0.01)  # a probe's interval, not a synchronization


async def test_a_key_cannot_speak_for_another_worker_id(start_cluster: StartCluster) -> None:
    cluster = await start_cluster()
    p, _ = await cluster.ready_pair()
    p.close()  # p0 goes away; a peer holding another valid key takes its routing id
    await until_unroutable(cluster, "p0")
    cluster.keys.add_worker("thief", role="prefill")
    thief = cluster.worker("p0", "prefill", keys=cluster.keys.worker_keys("thief"))
    before = dropped(cluster, "unauthenticated")
    await thief.heartbeat()
    ack = await thief.register()
    assert not ack.accepted and "another control key" in ack.reason
    assert dropped(cluster, "unauthenticated") == before + 1
    info = cluster.app.registry.get("p0")
    assert info is not None and info.register.endpoint.control_public_key == p.public_key


async def test_malformed_frames_from_an_authenticated_peer_are_dropped_and_counted(
    start_cluster: StartCluster,
) -> None:
    cluster = await start_cluster()
    _, d = await cluster.ready_pair()
    cluster.keys.add_worker("prefill-evil")
    attacker = Attacker(
        cluster.app.control_address,
        keys=cluster.keys.worker_keys("prefill-evil"),
        server_key=load_public_key(cluster.keys.coordinator_public),
    )
    try:
        for case in named_cases():
            await attacker.send(case)
        total = sum(dropped(cluster, r) for r in ("decode", "kind", "frame_count", "routing_id"))
        async with asyncio.timeout(10):
            while total < 7:
                await asyncio.sleep(0.02)  # poll interval of a bounded wait
                total = sum(dropped(cluster, r) for r in ("decode", "kind", "frame_count", "routing_id"))
    finally:
        attacker.close()
    assert not cluster.app.plane_task.done()
    await d.heartbeat()  # the plane still serves its workers
    assert await health(cluster) == SERVING


async def test_a_dead_control_plane_turns_health_not_serving(
    start_cluster: StartCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    cluster = await start_cluster()
    await cluster.ready_pair()
    assert await health(cluster) == SERVING

    def broken(now: float) -> list[object]:
        raise RuntimeError("injected fault in the staleness sweep")

    monkeypatch.setattr(cluster.app.registry, "sweep", broken)  # the sweep task dies on its next tick
    async with asyncio.timeout(10):
        while not cluster.app.plane_task.done():
            await asyncio.sleep(0.01)  # poll interval of a bounded wait
        assert cluster.app.plane_task.exception() is not None
        while await health(cluster) != NOT_SERVING:
            await asyncio.sleep(0.01)
    await cluster.worker("d9", "decode").send(
        heartbeat=control_pb2.Heartbeat(worker_id="d9", health=serving_pb2.WORKER_HEALTH_READY)
    )
    assert await health(cluster) == NOT_SERVING  # never SERVING again
