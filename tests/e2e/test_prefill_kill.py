"""kill -9 of a real prefill worker while it computes a long prompt and a second request waits in its
queue behind it (the decode worker has reserved blocks for both): docs/architecture.md, "Reservation
leases" and "Seeds and resumption".

The dead P is found by the coordinator (a send to it fails, or it goes stale after
`--heartbeat-timeout-ms`) or by D's transport (peer lost); either way its requests are resumed and D's
reservations aborted, so D's blocks come free within the heartbeat bound, not after `--lease-ms` or
`--queue-lease-ms` (set far above it here). A resumed request completes on another prefill worker
when one is registered, and ends UNAVAILABLE WORKER_LOST when none is left. The pools end clean."""

from __future__ import annotations

import asyncio
import random
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from splitserve.client import Client, Completion
from splitserve.cluster import ClusterSpec, LocalCluster
from splitserve.v1 import serving_pb2
from tests.e2e.conftest import (
    KEYS_ENV,
    assert_pools_clean,
    client_for,
    error_reason,
    start_cluster,
)

pytestmark = pytest.mark.xdist_group("e2e-prefill-kill")

BLOCK, BUDGET = 4, 2  # P computes BUDGET tokens a step: the long prompt holds it for 400 steps
LONG, SHORT, MAX_TOKENS = 800, 8, 4
HEARTBEAT_TIMEOUT_MS = 3000  # the coordinator's default, given explicitly: the bound below is tied to it
LEASE_MS = 60_000  # D's leases, far above the bound: they are not what frees D's blocks here
FREED_WITHIN_S = HEARTBEAT_TIMEOUT_MS / 1e3 + 12.0  # + slack for a loaded 2-core box
WAIT_S = 60.0  # bound of the other waits


@pytest.fixture(scope="module")
def kill_cluster(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """1 prefill + 1 decode worker, KV pulled over UCX (the default serving path); more prefill
    workers join during the test. Every process but the killed ones exits 0."""
    pools = ["--block-size", str(BLOCK), "--num-gpu-blocks", "256"]
    spec = ClusterSpec(
        model=str(model_dir),
        transfer_backend="ucx",
        env=dict(KEYS_ENV),
        coordinator_args=["--heartbeat-timeout-ms", str(HEARTBEAT_TIMEOUT_MS)],
        prefill_args=[*pools, "--max-num-batched-tokens", str(BUDGET)],
        decode_args=[*pools, "--lease-ms", str(LEASE_MS), "--queue-lease-ms", str(2 * LEASE_MS)],
    )
    c = start_cluster(spec, tmp_path_factory.mktemp("prefill-kill"))
    yield c
    codes = c.stop()
    killed = {p.name for p in c.processes if p.proc.returncode == -signal.SIGKILL}
    assert killed <= {p.name for p in c.workers("prefill")}, codes
    assert all(code == 0 for name, code in codes.items() if name not in killed), codes


def _held(state: serving_pb2.GetPoolStateResponse, worker_id: str) -> int:
    return next((w.pool.held_blocks for w in state.workers if w.worker_id == worker_id), 0)


def _live(state: serving_pb2.GetPoolStateResponse) -> serving_pb2.GetPoolStateResponse:
    """The state without the workers the coordinator holds stale (the killed ones: no pool to check)."""
    live = serving_pb2.GetPoolStateResponse()
    live.CopyFrom(state)
    del live.workers[:]
    live.workers.extend(w for w in state.workers if w.health == serving_pb2.WORKER_HEALTH_READY)
    return live


async def _until(
    client: Client, done: Callable[[serving_pb2.GetPoolStateResponse], bool], what: str, timeout: float
) -> serving_pb2.GetPoolStateResponse:
    """Bounded wait on the pool state, queried fresh from the workers."""
    deadline = time.monotonic() + timeout
    while True:
        state = await client.pool_state(fresh=True)
        if done(state):
            return state
        assert time.monotonic() < deadline, f"not within {timeout:.0f} s: {what}\n{state}"
        await asyncio.sleep(0.05)  # poll interval of a bounded wait


def _quiescent(state: serving_pb2.GetPoolStateResponse) -> bool:
    return not state.active_requests and not any(w.pool.held_blocks for w in _live(state).workers)


def _blocks(tokens: int) -> int:
    return -(-tokens // BLOCK)


async def test_sigkill_of_a_busy_prefill_worker_frees_ds_blocks_then_resumes_on_another(
    kill_cluster: LocalCluster, hf_greedy: Callable[[list[int], int], list[int]]
) -> None:
    rng = random.Random(12)
    long_prompt = [rng.randrange(3, 1000) for _ in range(LONG)]
    short_prompt = [rng.randrange(3, 1000) for _ in range(SHORT)]
    both = _blocks(LONG) + _blocks(SHORT)  # D reserves at least the prompts' blocks

    def submit(prompt: list[int]) -> asyncio.Task[Completion]:
        return asyncio.create_task(client.complete(prompt, max_tokens=MAX_TOKENS, temperature=0.0))

    async with client_for(kill_cluster) as client:
        # 1. The only P dies computing the long prompt, the short one queued behind it.
        long_task = submit(long_prompt)
        await _until(client, lambda s: _held(s, "decode-0") >= _blocks(LONG), "D reserves the long", WAIT_S)
        short_task = submit(short_prompt)
        await _until(client, lambda s: _held(s, "decode-0") >= both, "D reserves both", WAIT_S)
        killed_at = time.monotonic()
        kill_cluster.kill("prefill-0")
        for task in (long_task, short_task):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await asyncio.wait_for(task, killed_at + FREED_WITHIN_S - time.monotonic())
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE, caught.value.details()
            assert error_reason(caught.value) == "WORKER_LOST", caught.value.details()
        left = killed_at + FREED_WITHIN_S - time.monotonic()
        await _until(client, lambda s: _held(s, "decode-0") == 0, "D frees both", left)
        assert_pools_clean(_live(await _until(client, _quiescent, "the cluster to go quiet", WAIT_S)))

        # 2. Two prefill workers join. The one computing the long prompt is killed with the short
        # one placed too: the long one resumes on the other and both answers are transformers' greedy.
        await asyncio.to_thread(kill_cluster.add_workers, "prefill", 2)
        joined = ("prefill-1", "prefill-2")
        long_task = submit(long_prompt)
        busy = await _until(
            client, lambda s: max(_held(s, p) for p in joined) > _blocks(SHORT), "a P on the long", WAIT_S
        )
        victim = max(joined, key=lambda p: _held(busy, p))
        short_task = submit(short_prompt)
        await _until(
            client, lambda s: short_task.done() or _held(s, "decode-0") >= both, "D reserves both", WAIT_S
        )
        kill_cluster.kill(victim)
        results = [await asyncio.wait_for(task, WAIT_S) for task in (long_task, short_task)]
        assert results[0].usage is not None and results[0].usage.preemptions >= 1, "the long one resumed"
        for prompt, got in zip((long_prompt, short_prompt), results, strict=True):
            assert got.token_ids == hf_greedy(prompt, MAX_TOKENS)
        assert_pools_clean(_live(await _until(client, _quiescent, "the cluster to go quiet", WAIT_S)))
