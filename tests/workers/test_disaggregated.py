"""A real prefill worker and a real decode worker (engines, sockets, KV transfer) against a scripted
coordinator: output parity with the offline engine, release on every path, both pools clean after."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable

from engine.worker.process import Worker
from splitserve import wire
from splitserve.v1 import control_pb2, serving_pb2
from tests.workers.conftest import WAIT_S, Cluster, ScriptedCoordinator, endpoint, execution_request

LENGTH = serving_pb2.FINISH_REASON_LENGTH


def random_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(5, 1000) for _ in range(n)]


async def dispatch(
    coord: ScriptedCoordinator,
    p: Worker,
    d: Worker,
    req: control_pb2.ExecutionRequest,
    *,
    decode_first: bool = False,
) -> None:
    """What the coordinator does for one request: Prefill to P and Decode to D at once."""
    for send in (send_decode, send_prefill) if decode_first else (send_prefill, send_decode):
        await send(coord, p, d, req)


async def dispatch_reserved_first(
    coord: ScriptedCoordinator, p: Worker, d: Worker, reqs: list[control_pb2.ExecutionRequest]
) -> None:
    """Decode to D for every request, then (once P holds all of D's Reserved) Prefill to P: every
    shipper exists before P's first step ends, so the KV can stream while the prefill computes."""
    for req in reqs:
        await send_decode(coord, p, d, req)
    assert p.role is not None
    await wait_until(
        lambda: p.role.queue_depths()["early_reserved"] == len(reqs),  # type: ignore[union-attr]
        "P to hold D's Reserved",
    )
    for req in reqs:
        await send_prefill(coord, p, d, req)


async def send_prefill(
    coord: ScriptedCoordinator, p: Worker, d: Worker, req: control_pb2.ExecutionRequest
) -> None:
    await coord.send(p.settings.worker_id, prefill={"request": req, "decode": endpoint(d)})


async def send_decode(
    coord: ScriptedCoordinator, p: Worker, d: Worker, req: control_pb2.ExecutionRequest
) -> None:
    await coord.send(d.settings.worker_id, decode={"request": req, "prefill": endpoint(p)})


async def wait_until(cond: Callable[[], bool], what: str) -> None:
    """Bounded wait for in-process worker state to reach `cond` (workers run in this event loop)."""
    deadline = time.monotonic() + WAIT_S
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)  # poll interval of a bounded wait


async def assert_quiescent(cluster: Cluster, *workers: Worker) -> None:
    for w in workers:
        assert w.role is not None
        await wait_until(lambda w=w: not w.role.records, f"{w.settings.worker_id} to finish")  # type: ignore[union-attr]
        await cluster.coordinator.assert_pool_clean(w.settings.worker_id)


async def start_chunked_pair(cluster: Cluster, kv_blocks_per_message: int) -> tuple[Worker, Worker]:
    """Prefill worker p0 computing 16 tokens a step and decode worker d0, both shipping KV in
    messages of `kv_blocks_per_message` blocks."""
    p = await cluster.start(
        "prefill", "p0", max_num_batched_tokens=16, kv_blocks_per_message=kv_blocks_per_message
    )
    d = await cluster.start("decode", "d0", kv_blocks_per_message=kv_blocks_per_message)
    return p, d


async def test_prefill_then_decode_equals_greedy_and_frees_both_pools(
    cluster: Cluster, greedy: Callable[[list[int], int], list[int]]
) -> None:
    # chunked prefill (16 tokens a step) and 2-block KV messages: the 37-token prompt ships in >= 2
    # chunks, the first while its later prefill chunks compute. D's Reserved messages reach P before the
    # Prefills, so every shipper starts before the first step ends (else a late Reserved would find the
    # prefill finished and ship it whole, which is correct but not what this test is about)
    p, d = await start_chunked_pair(cluster, kv_blocks_per_message=2)
    coord, rng = cluster.coordinator, random.Random(3)
    identity = p.engine.loaded.identity
    prompts = {1: random_prompt(rng, 37), 2: random_prompt(rng, 5), 3: random_prompt(rng, 16)}
    requests = [execution_request(rid, prompt, 8, identity=identity) for rid, prompt in prompts.items()]
    await dispatch_reserved_first(coord, p, d, requests)
    got = await coord.collect(set(prompts))
    for rid, prompt in prompts.items():
        assert got[rid] == (greedy(prompt, 8), LENGTH)
    chunks = d.metrics.registry.get_sample_value(
        "splitserve_worker_kv_transfer_chunks_total", {"direction": "recv", "transport": "tcp"}
    )
    assert chunks is not None and chunks >= 4, "no request streamed its KV in more than one chunk"
    await assert_quiescent(cluster, p, d)

    # the same prompt again: D's prefix cache already holds its full blocks, so P ships only the rest
    assert d.role is not None
    await dispatch(coord, p, d, execution_request(4, prompts[1], 6, identity=identity))
    got = await coord.collect({4})
    assert got[4] == (greedy(prompts[1], 6), LENGTH)
    assert d.role.prefix_hit_tokens == 36
    await assert_quiescent(cluster, p, d)


async def test_a_first_token_that_ends_the_request_ships_no_kv_and_decodes_nothing(
    cluster: Cluster, greedy: Callable[[list[int], int], list[int]]
) -> None:
    p = await cluster.start("prefill", "p0")
    d = await cluster.start("decode", "d0")
    prompt = random_prompt(random.Random(9), 14)
    await dispatch(
        cluster.coordinator, p, d, execution_request(2, prompt, 1, identity=p.engine.loaded.identity)
    )
    _, env = await cluster.coordinator.expect("output")
    out = env.prefill_done.output
    assert (wire.unpack_ids(out.token_ids), out.offset, out.finish_reason) == (greedy(prompt, 1), 0, LENGTH)
    await assert_quiescent(cluster, p, d)
    assert cluster.coordinator.inbox["output"].empty(), "the decode worker generated after the end"


async def test_reserved_before_prefill_and_reassign_to_another_decode_worker(
    cluster: Cluster, greedy: Callable[[list[int], int], list[int]]
) -> None:
    p = await cluster.start("prefill", "p0")
    d1 = await cluster.start("decode", "d1")
    d2 = await cluster.start("decode", "d2")
    coord = cluster.coordinator
    prompt = random_prompt(random.Random(4), 21)
    req = execution_request(9, prompt, 5, identity=p.engine.loaded.identity)
    # P is told d1, but d2 reserves (as after d1's ReserveFailed); d2's Reserved may beat the Reassign
    await coord.send("d2", decode={"request": req, "prefill": endpoint(p)})
    await wait_until(lambda: 9 in p.role._early, "P to keep the early Reserved")  # type: ignore[union-attr]
    await coord.send("p0", prefill={"request": req, "decode": endpoint(d1)})
    await coord.send("p0", reassign=control_pb2.Reassign(rid=9, generation=1, decode=endpoint(d2)))
    got = await coord.collect({9})
    assert got[9] == (greedy(prompt, 5), LENGTH)
    await assert_quiescent(cluster, p, d1, d2)


async def test_abort_mid_decode_releases_everything(cluster: Cluster) -> None:
    p = await cluster.start("prefill", "p0")
    d = await cluster.start("decode", "d0")
    coord = cluster.coordinator
    req = execution_request(5, random_prompt(random.Random(5), 12), 200, identity=p.engine.loaded.identity)
    await dispatch(coord, p, d, req)
    while True:  # wait until D streams decode tokens for it (past its announce of token 1)
        _, env = await coord.expect("output")
        if any(item.offset > 0 for item in env.token_batch.items):
            break
    abort = control_pb2.Abort(rid=5, generation=1, reason=control_pb2.ABORT_REASON_CLIENT_CANCELLED)
    await coord.send("d0", abort=abort)
    await coord.send("p0", abort=abort)
    await assert_quiescent(cluster, p, d)
    assert d.role is not None and not d.engine.has_unfinished()


async def test_reserve_failed_when_the_decode_pool_is_short(cluster: Cluster) -> None:
    p = await cluster.start("prefill", "p0")
    d = await cluster.start("decode", "d0", num_blocks=16)
    coord, rng = cluster.coordinator, random.Random(6)
    identity = p.engine.loaded.identity
    # A reserves 10 of D's 16 blocks and waits for its KV (P never gets its Prefill)
    await coord.send(
        "d0",
        decode={
            "request": execution_request(1, random_prompt(rng, 40), 4, identity=identity),
            "prefill": endpoint(p),
        },
    )
    await coord.send(
        "d0",
        decode={
            "request": execution_request(2, random_prompt(rng, 40), 4, identity=identity),
            "prefill": endpoint(p),
        },
    )
    _, env = await coord.expect("reserve_failed")
    failed = env.reserve_failed
    assert (failed.rid, failed.decode_worker_id, failed.needed_blocks, failed.available_blocks) == (
        2,
        "d0",
        10,
        6,
    )
    await coord.send("d0", abort=control_pb2.Abort(rid=1, generation=1))
    await assert_quiescent(cluster, p, d)


async def test_held_prefill_result_expires_its_lease(cluster: Cluster) -> None:
    p = await cluster.start("prefill", "p0", lease_ms=200)
    d = await cluster.start("decode", "d0")
    coord = cluster.coordinator
    req = execution_request(3, random_prompt(random.Random(7), 9), 4, identity=p.engine.loaded.identity)
    await coord.send("p0", prefill={"request": req, "decode": endpoint(d)})  # D never reserves
    _, env = await coord.expect("output")
    assert env.prefill_done.output.rid == 3 and len(wire.unpack_ids(env.prefill_done.output.token_ids)) == 1
    _, env = await coord.expect("abort")
    assert (env.abort.rid, env.abort.reason) == (3, control_pb2.ABORT_REASON_LEASE_EXPIRED)
    await assert_quiescent(cluster, p)


async def test_preempted_request_resumes_through_prefill_with_identical_output(
    cluster: Cluster, greedy: Callable[[list[int], int], list[int]]
) -> None:
    # the refused request waits in P until the other finishes: a long lease keeps load from expiring it
    p = await cluster.start("prefill", "p0", lease_ms=120_000)
    d = await cluster.start("decode", "d0", num_blocks=12)  # 48 token slots for two 12 + 30 token requests
    coord, rng = cluster.coordinator, random.Random(8)
    identity = p.engine.loaded.identity
    prompts = {1: random_prompt(rng, 12), 2: random_prompt(rng, 12)}
    reqs = {rid: execution_request(rid, prompt, 30, identity=identity) for rid, prompt in prompts.items()}
    for req in reqs.values():
        await dispatch(coord, p, d, req)
    tokens: dict[int, list[int]] = {1: [], 2: []}
    done: set[int] = set()
    refused: set[int] = set()
    preempted = 0
    while done != {1, 2}:
        _, env = await coord.expect_first("output", "reserve_failed")
        if env.HasField("reserve_failed"):  # D is full now: place it again once the other finishes
            refused.add(env.reserve_failed.rid)
        elif env.HasField("preempted"):
            pre = env.preempted
            preempted += 1
            assert pre.num_output_tokens == len(tokens[pre.rid])
            reqs[pre.rid] = execution_request(  # resume: prompt + everything streamed, next generation
                pre.rid,
                prompts[pre.rid],
                30,
                generation=reqs[pre.rid].generation + 1,
                output=tokens[pre.rid],
                identity=identity,
            )
            await dispatch(coord, p, d, reqs[pre.rid])
        else:
            items = [env.prefill_done.output] if env.HasField("prefill_done") else env.token_batch.items
            for item in items:
                if item.offset < len(tokens[item.rid]):
                    continue  # D's announce of token 1 at its first step: a repeat by design
                assert item.offset == len(tokens[item.rid]) and item.generation == reqs[item.rid].generation
                tokens[item.rid] += wire.unpack_ids(item.token_ids)
                if item.finish_reason:
                    done.add(item.rid)
            for rid in refused - done if done else ():
                await send_decode(coord, p, d, reqs[rid])
                refused.discard(rid)
    assert preempted > 0, "the pool never ran short"
    for rid, prompt in prompts.items():
        assert tokens[rid] == greedy(prompt, 30)
    await assert_quiescent(cluster, p, d)


async def test_a_dead_prefill_worker_ends_the_reservation_waiting_for_its_kv(cluster: Cluster) -> None:
    p = await cluster.start("prefill", "p0")
    d = await cluster.start("decode", "d0")
    coord = cluster.coordinator
    req = execution_request(4, random_prompt(random.Random(10), 20), 4, identity=p.engine.loaded.identity)
    await coord.send("d0", decode={"request": req, "prefill": endpoint(p)})  # P never gets the Prefill
    await wait_until(lambda: 4 in p.role._early, "D's Reserved to reach P")  # type: ignore[union-attr]
    assert d.engine.pool.num_held_blocks > 0
    await p.close()  # the KV connection breaks: D's session ends, D gives the request up
    _, env = await coord.expect("abort")
    assert (env.abort.rid, env.abort.reason) == (4, control_pb2.ABORT_REASON_PEER_FAILED)
    await assert_quiescent(cluster, d)


async def test_kv_streams_chunk_by_chunk_while_the_prefill_computes(
    cluster: Cluster, greedy: Callable[[list[int], int], list[int]]
) -> None:
    # 96 prompt tokens at 16 a step: 6 prefill steps; 1-block KV messages. With Reserved known before
    # the first step, the blocks each step finishes ship while the next step computes, so the KV
    # arrives in several chunks (shipping only at the last chunk could make at most 2).
    p, d = await start_chunked_pair(cluster, kv_blocks_per_message=1)
    coord, rng = cluster.coordinator, random.Random(11)
    prompt = random_prompt(rng, 96)
    req = execution_request(1, prompt, 4, identity=p.engine.loaded.identity)
    await dispatch_reserved_first(coord, p, d, [req])
    got = await coord.collect({1})
    assert got[1] == (greedy(prompt, 4), LENGTH)
    chunks = d.metrics.registry.get_sample_value(
        "splitserve_worker_kv_transfer_chunks_total", {"direction": "recv", "transport": "tcp"}
    )
    assert chunks is not None and chunks >= 3, f"the KV came in {chunks} chunk(s), not streamed"
    await assert_quiescent(cluster, p, d)


async def test_a_short_lane_refuses_a_longer_sequence_and_serves_one_within_it(
    cluster: Cluster, greedy: Callable[[list[int], int], list[int]]
) -> None:
    """The router never sends a `--max-prompt-tokens` lane more; if it did, the worker says why."""
    p = await cluster.start("prefill", "p-short", max_prompt_tokens=8)
    d = await cluster.start("decode", "d0")
    coord = cluster.coordinator
    await send_prefill(coord, p, d, execution_request(1, list(range(5, 14)), 4))  # 9 tokens
    _, env = await coord.expect("abort")
    assert (env.abort.rid, env.abort.reason) == (1, control_pb2.ABORT_REASON_WORKER_ERROR)
    assert "at most 8 (--max-prompt-tokens)" in env.abort.message
    prompt = list(range(5, 13))  # 8 tokens: the lane's
    await dispatch(coord, p, d, execution_request(2, prompt, 4))
    assert (await coord.collect({2}))[2] == (greedy(prompt, 4), LENGTH)
    await coord.assert_pool_clean("p-short")
    await coord.assert_pool_clean("d0")
