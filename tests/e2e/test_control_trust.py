"""The control plane of real processes under attack: every named malformed frame and a seeded fuzz
corpus sent to the coordinator's ROUTER and to a prefill and a decode worker's ROUTER (with stolen
keys, so the frames reach the parsers), a DEALER with no key or a wrong key, a valid key of the wrong
role. After each: every process alive, health SERVING, a canary equal to transformers' greedy."""

from __future__ import annotations

import asyncio
import contextlib
import random
import re
import urllib.request
from collections.abc import Callable

import pytest
import zmq.asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitserve.cluster import LocalCluster
from splitserve.control import ControlQueueFull, ControlSocket, envelope
from splitserve.control_auth import KeySet, load_public_key
from splitserve.v1 import control_pb2, serving_pb2
from tests.control_attacks import FUZZ_CASES, Attacker, fuzz_cases, named_cases
from tests.e2e.conftest import assert_pools_clean, client_for, wait_quiescent

pytestmark = pytest.mark.xdist_group("e2e-cluster")


def dropped_total(metrics_address: str) -> float:
    """Sum of the process's control-drop counters, scraped from its /metrics."""
    with urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return sum(
        float(v) for v in re.findall(r"^splitserve_\w+_control_dropped_total\{[^}]*\} (\S+)$", text, re.M)
    )


async def assert_unharmed(cluster: LocalCluster, hf_greedy: Callable[[list[int], int], list[int]]) -> None:
    for p in cluster.processes:
        assert p.proc.poll() is None, f"{p.name} exited with {p.proc.returncode}"
    rng = random.Random(len(cluster.processes))
    prompt = [rng.randrange(5, 1000) for _ in range(13)]
    async with client_for(cluster) as client:
        health = health_pb2_grpc.HealthStub(client.channel)
        reply = await health.Check(health_pb2.HealthCheckRequest(service=""))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        got = await client.complete(prompt, max_tokens=12, temperature=0.0)
        assert got.token_ids == hf_greedy(prompt, 12)
        assert_pools_clean(await wait_quiescent(client))


def targets(cluster: LocalCluster) -> list[tuple[str, str, str, bytes]]:
    """(name, ROUTER address, metrics address, server key) of the coordinator, prefill-0, decode-0."""
    keys = cluster.keys
    assert keys is not None
    out = []
    for name in ("coordinator", "prefill-0", "decode-0"):
        proc = next(p for p in cluster.processes if p.name == name)
        server_key = (
            load_public_key(keys.coordinator_public)
            if name == "coordinator"
            else keys.worker_keys(name).public
        )
        out.append((name, proc.ready["control_address"], proc.ready["metrics_address"], server_key))
    return out


@pytest.mark.fuzz
async def test_malformed_and_fuzzed_frames_at_every_router_leave_the_cluster_serving(
    cluster: LocalCluster, hf_greedy: Callable[[list[int], int], list[int]]
) -> None:
    keys = cluster.keys
    assert keys is not None
    keys.add_worker("prefill-evil")  # an allow-listed key: its frames reach the coordinator's parser
    # a worker admits the keys of its peers: a stolen decode key reaches P, a stolen prefill key D
    stolen = {"coordinator": "prefill-evil", "prefill-0": "decode-0", "decode-0": "prefill-0"}
    per_target = max(FUZZ_CASES // 3, 1)
    for i, (name, address, metrics, server_key) in enumerate(targets(cluster)):
        before = dropped_total(metrics)
        attacker = Attacker(address, keys=keys.worker_keys(stolen[name]), server_key=server_key)
        try:
            for case in [*named_cases(), *fuzz_cases(seed=1000 + i, count=per_target)]:
                await attacker.send(case)
            async with asyncio.timeout(60):  # bounded wait for the process to read the corpus
                while dropped_total(metrics) < before + 7:
                    await asyncio.sleep(0.05)  # poll interval of a bounded wait
        finally:
            attacker.close()
        await assert_unharmed(cluster, hf_greedy)


async def test_no_key_a_wrong_key_or_a_wrong_role_cannot_join(
    cluster: LocalCluster, hf_greedy: Callable[[list[int], int], list[int]], tmp_path: object
) -> None:
    keys = cluster.keys
    assert keys is not None
    coordinator = targets(cluster)[0]
    stranger = KeySet.create(tmp_path / "stranger", ["colocated-x"])  # type: ignore[operator]
    keys.add_worker("fake-colocated", role="decode")  # valid, but keyed for decode
    server_key = load_public_key(keys.coordinator_public)
    async with client_for(cluster) as client:
        identity = (await client.list_models())[0].identity  # what any API client learns
    register = envelope(
        register=control_pb2.Register(
            protocol_version=control_pb2.PROTOCOL_VERSION_1,
            role=serving_pb2.WORKER_ROLE_COLOCATED,
            endpoint=control_pb2.WorkerEndpoint(worker_id="fake-colocated"),
            incarnation=1,
            model="tiny",
            model_identity=identity,
            context_length=1 << 20,
            kv_layout=control_pb2.KvLayout(block_size=4, hash="x"),
            num_blocks=1 << 20,
        )
    )
    ctx = zmq.asyncio.Context()
    fakes = [
        ControlSocket.dealer(ctx, coordinator[1], "fake-colocated"),  # no CURVE
        ControlSocket.dealer(
            ctx,
            coordinator[1],
            "fake-colocated",
            keys=stranger.worker_keys("colocated-x"),
            server_key=server_key,
        ),
    ]
    wrong_role = ControlSocket.dealer(
        ctx, coordinator[1], "fake-colocated", keys=keys.worker_keys("fake-colocated"), server_key=server_key
    )
    try:
        for fake in fakes:
            with contextlib.suppress(ControlQueueFull):  # no link at all: the handshake failed
                await fake.send(register)
            fake.close()
        await wrong_role.send(register)
        ack = (await asyncio.wait_for(wrong_role.recv(), 30)).envelope.register_ack
        assert not ack.accepted and "WORKER_ROLE_DECODE" in ack.reason
    finally:
        wrong_role.close()
        ctx.term()
    async with client_for(cluster) as client:
        state = await client.pool_state(fresh=False)
        assert sorted(w.worker_id for w in state.workers) == ["decode-0", "decode-1", "prefill-0"]
    await assert_unharmed(cluster, hf_greedy)
