"""Prompt lanes end to end (`ClusterSpec(short_prompt_lane=N)`): real coordinator, decode worker and two
prefill workers, a short lane taking sequences of at most N tokens and a long one at SCHED_IDLE. Each
prompt is prefilled by its lane, the output is transformers' greedy on both, and the pools are clean."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from splitserve.client import Client
from splitserve.cluster import SHORT_LANE_ID, ClusterSpec, LocalCluster
from splitserve.v1 import serving_pb2
from tests.e2e.conftest import KEYS_ENV, assert_pools_clean, client_for, running_cluster, wait_quiescent

pytestmark = pytest.mark.xdist_group("e2e-prompt-lanes")
CAP = 48
PREFILL = serving_pb2.WORKER_ROLE_PREFILL


@pytest.fixture(scope="module")
def lanes_cluster(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    spec = ClusterSpec(
        model=str(model_dir),
        transfer_backend="tcp",
        env=dict(KEYS_ENV),
        short_prompt_lane=CAP,
        coordinator_args=["--heartbeat-interval-ms", "100"],
    )
    yield from running_cluster(spec, tmp_path_factory.mktemp("lanes"))


async def test_each_prompt_is_prefilled_by_its_lane(
    lanes_cluster: LocalCluster, hf_greedy: Callable[[list[int], int], list[int]]
) -> None:
    policies = {p.name: os.sched_getscheduler(p.proc.pid) for p in lanes_cluster.workers("prefill")}
    assert policies == {"prefill-0": os.SCHED_IDLE, SHORT_LANE_ID: os.SCHED_OTHER}
    short = [(5 * j) % 300 + 3 for j in range(20)]
    long = [(7 * j) % 300 + 3 for j in range(CAP + 40)]
    async with client_for(lanes_cluster) as client:
        for prompt in (short, long):
            got = await client.complete(prompt, max_tokens=6, temperature=0.0)
            assert got.token_ids == hf_greedy(prompt, 6)
        state = await wait_quiescent(client)
        assert_pools_clean(state)
        # the tokens each prefill worker looked up in its prefix cache: the prompts it prefilled (its
        # heartbeats carry them, so a bounded wait for the one after the last request)
        want = {SHORT_LANE_ID: len(short), "prefill-0": len(long)}
        deadline = time.monotonic() + 30
        while (queried := await _queried(client)) != want and time.monotonic() < deadline:
            await asyncio.sleep(0.05)  # poll interval of a bounded wait
    assert queried == want


async def _queried(client: Client) -> dict[str, int]:
    state = await client.pool_state()
    return {w.worker_id: w.load.prefix_cache_query_tokens for w in state.workers if w.role == PREFILL}
