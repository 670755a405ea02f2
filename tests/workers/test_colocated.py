"""The colocated worker: one process prefills and decodes, speaking the same control protocol."""

from __future__ import annotations

import asyncio
import random
import time

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from splitserve import wire
from splitserve.v1 import control_pb2, serving_pb2
from tests.workers.conftest import WAIT_S, Cluster, execution_request


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 1000) for _ in range(rng.randrange(3, 30))] for _ in range(n)]


async def test_colocated_streams_greedy_output_and_ends_clean(cluster: Cluster) -> None:
    worker = await cluster.start("colocated", "colo-0", max_num_batched_tokens=24)
    coord = cluster.coordinator
    batch = prompts(4, seed=1)
    for rid, prompt in enumerate(batch, start=1):
        req = execution_request(rid, prompt, 10, identity=worker.engine.loaded.identity)
        await coord.send("colo-0", decode={"request": req})
    got = await coord.collect(set(range(1, len(batch) + 1)))
    llm = LLM(worker.engine.loaded.model_dir, block_size=4, num_blocks=64)
    want = llm.generate(batch, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    for rid, expected in enumerate(want, start=1):
        assert got[rid] == (expected.token_ids, serving_pb2.FINISH_REASON_LENGTH)
    await coord.assert_pool_clean("colo-0")


async def test_requests_it_cannot_run_are_refused_with_the_reason(cluster: Cluster) -> None:
    worker = await cluster.start("colocated", "colo-0", num_blocks=8)
    coord, identity = cluster.coordinator, worker.engine.loaded.identity
    bad = {
        1: execution_request(1, [5, 6, 7], 4, identity="0" * 64),
        2: execution_request(2, [5, 6, 7], 40, identity=identity),  # 43 tokens > 8 blocks of 4
        3: execution_request(3, [5, 6, 7], 0, identity=identity),
    }
    bad[4] = execution_request(4, [5, 6, 7], 4, identity=identity)
    bad[4].deadline_unix_ns = 1
    for req in bad.values():
        await coord.send("colo-0", decode={"request": req})
    reasons = {}
    for _ in bad:
        _, env = await coord.expect("abort")
        reasons[env.abort.rid] = (env.abort.reason, env.abort.message)
    assert reasons[1][0] == control_pb2.ABORT_REASON_WORKER_ERROR and "model_identity" in reasons[1][1]
    assert "KV blocks" in reasons[2][1] and "max_tokens" in reasons[3][1] and "deadline" in reasons[4][1]
    await coord.assert_pool_clean("colo-0")


async def test_shutdown_with_drain_finishes_in_flight_work_then_deregisters(cluster: Cluster) -> None:
    worker = await cluster.start("colocated", "colo-0")
    coord, identity = cluster.coordinator, worker.engine.loaded.identity
    serving = asyncio.create_task(worker.serve())
    await coord.send(
        "colo-0", decode={"request": execution_request(1, [5, 6, 7, 8, 9], 12, identity=identity)}
    )
    _, env = await coord.expect("output")  # running now
    await coord.send("colo-0", shutdown=control_pb2.Shutdown(drain=True, grace_ms=20_000, reason="test"))
    _, env = await coord.expect("heartbeat")
    while env.heartbeat.health != serving_pb2.WORKER_HEALTH_DRAINING:
        _, env = await coord.expect("heartbeat")
    await coord.send("colo-0", decode={"request": execution_request(2, [5, 6], 4, identity=identity)})
    _, env = await coord.expect("reserve_failed")  # a draining worker takes nothing new
    assert env.reserve_failed.rid == 2
    tokens = 1
    while tokens < 12:
        _, env = await coord.expect("output")
        tokens += sum(len(item.token_ids) // 4 for item in env.token_batch.items)
    _, env = await coord.expect("deregister")
    assert env.deregister.worker_id == "colo-0"
    await asyncio.wait_for(serving, WAIT_S)
    assert not worker.role.records  # type: ignore[union-attr]


async def test_heartbeats_report_the_prefix_cache_changes(cluster: Cluster) -> None:
    worker = await cluster.start("colocated", "colo-0")
    coord = cluster.coordinator
    prompt = list(range(20, 33))  # 13 tokens: 3 full blocks of 4 get cached
    await coord.send(
        "colo-0", decode={"request": execution_request(1, prompt, 2, identity=worker.engine.loaded.identity)}
    )
    await coord.collect({1})
    stored: set[int] = set()
    while len(stored) < 3:
        _, env = await coord.expect("heartbeat")
        stored |= set(wire.unpack_hashes(env.heartbeat.prefix_cache.stored))
    want = {int.from_bytes(h[:8], "little") for h in worker.engine.pool.cached_hashes()}
    assert stored == want and len(want) >= 3


async def test_a_deadline_passing_mid_generation_aborts_and_releases(cluster: Cluster) -> None:
    worker = await cluster.start("colocated", "colo-0", num_blocks=400)
    req = execution_request(1, [5, 6, 7, 8], 1500, identity=worker.engine.loaded.identity)
    req.deadline_unix_ns = time.time_ns() + 300_000_000
    await cluster.coordinator.send("colo-0", decode={"request": req})
    _, env = await cluster.coordinator.expect("abort")
    assert (env.abort.rid, env.abort.reason) == (1, control_pb2.ABORT_REASON_DEADLINE_EXCEEDED)
    await cluster.coordinator.assert_pool_clean("colo-0")
