"""Core lending end to end (`ClusterSpec(share_idle_cores=True)`): real coordinator, prefill and decode
processes pinned to one CPU each; the decode worker runs its prompt steps on the idle prefill worker's
CPU too, learns what they cost there, and the router prices its next short prompts by that. The output
is transformers' greedy; the pools are clean after."""

from __future__ import annotations

import asyncio
import os
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from splitserve.client import Client
from splitserve.cluster import ClusterSpec, LocalCluster
from splitserve.v1 import serving_pb2
from tests.e2e.conftest import KEYS_ENV, assert_pools_clean, client_for, running_cluster, wait_quiescent

pytestmark = [
    pytest.mark.xdist_group("e2e-core-lending"),
    pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pins prefill and decode to a CPU each"),
]


@pytest.fixture(scope="module")
def lending_cluster(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """Every prompt prefills on the decode worker (`--disaggregation never`), whose prompt steps
    borrow the prefill worker's CPU while it idles."""
    first, second = sorted(os.sched_getaffinity(0))[:2]
    spec = ClusterSpec(
        model=str(model_dir),
        mode="conditional",
        transfer_backend="tcp",
        env=dict(KEYS_ENV),
        cpus={"prefill": (first,), "decode": (second,)},
        threads={"prefill": 1, "decode": 1},
        share_idle_cores=True,
        coordinator_args=["--disaggregation", "never", "--heartbeat-interval-ms", "100"],
    )
    yield from running_cluster(spec, tmp_path_factory.mktemp("lending"))


def _metric(cluster: LocalCluster, role: str, name: str) -> float:
    address = cluster.workers(role)[0].ready["metrics_address"]
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in {role}'s metrics")


async def _borrowed_shares(client: Client) -> dict[int, float]:
    return {w.role: w.load.prompt_on_borrowed_cores_share for w in (await client.pool_state()).workers}


async def test_the_decode_worker_prefills_on_the_idle_prefill_cpu_and_is_priced_by_it(
    lending_cluster: LocalCluster, hf_greedy: Callable[[list[int], int], list[int]]
) -> None:
    prompts = [[(7 * i + 3 * j) % 400 + 3 for j in range(20 + i)] for i in range(4)]
    async with client_for(lending_cluster) as client:
        # before any step there, D's prior: its one thread of the two a widened step runs
        deadline = time.monotonic() + 30
        while not (shares := await _borrowed_shares(client))[serving_pb2.WORKER_ROLE_DECODE]:
            assert time.monotonic() < deadline, "the decode worker never reported its share"
            await asyncio.sleep(0.05)  # poll interval of a bounded wait
        assert shares == {serving_pb2.WORKER_ROLE_PREFILL: 0.0, serving_pb2.WORKER_ROLE_DECODE: 0.5}
        done = []
        for prompt in prompts:  # one at a time: the prefill worker idles throughout
            done.append(await client.complete(prompt, max_tokens=5, temperature=0.0))
        for prompt, got in zip(prompts, done, strict=True):
            assert got.token_ids == hf_greedy(prompt, 5)
            assert got.timings is not None and got.timings.routing.path == serving_pb2.PREFILL_PATH_LOCAL
        assert _metric(lending_cluster, "decode", "splitserve_worker_borrowed_core_steps_total") >= len(
            prompts
        )
        # the fit of those steps reaches the router (a heartbeat), which prices the next prompt by it
        deadline = time.monotonic() + 30
        while not any(
            w.load.prompt_on_borrowed_cores_us_per_token > 0 for w in (await client.pool_state()).workers
        ):
            assert time.monotonic() < deadline, "the decode worker never reported its fit on borrowed cores"
            await asyncio.sleep(0.05)  # poll interval of a bounded wait
        last = await client.complete(prompts[0], max_tokens=5, temperature=0.0)
        assert last.token_ids == hf_greedy(prompts[0], 5)
        assert last.timings is not None and last.timings.routing.local_on_borrowed_cores
        assert_pools_clean(await wait_quiescent(client))
    assert _metric(lending_cluster, "prefill", "splitserve_worker_borrowed_core_steps_total") == 0
