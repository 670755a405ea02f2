"""Colocated replicas on their own cores (`ClusterSpec(split_pins=True)`, the bench's
`--colocated-replicas`): two real colocated workers pinned to one CPU each with one torch thread, as
two pods on their own cores would be. Each process runs where its share says; concurrent requests
spread over both replicas, come back as transformers' greedy, and leave both pools clean."""

from __future__ import annotations

import asyncio
import os
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from splitserve.cluster import ClusterSpec, LocalCluster, RoleProcess
from tests.e2e.conftest import KEYS_ENV, assert_pools_clean, client_for, running_cluster, wait_quiescent

pytestmark = [
    pytest.mark.xdist_group("e2e-colocated-replicas"),
    pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pins a replica to each of two CPUs"),
]


@pytest.fixture(scope="module")
def replicas(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    first, second = sorted(os.sched_getaffinity(0))[:2]
    spec = ClusterSpec(
        model=str(model_dir),
        mode="colocated",
        decode_workers=2,
        env=dict(KEYS_ENV),
        cpus={"colocated": (first, second)},
        threads={"colocated": 1},
        split_pins=True,
    )
    yield from running_cluster(spec, tmp_path_factory.mktemp("replicas"))


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().partition("=")[::2] for item in raw if item)


def _requests_ended(worker: RoleProcess) -> float:
    """The worker's `splitserve_worker_requests_total`, summed over outcomes."""
    address = worker.ready["metrics_address"]
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    return sum(
        float(line.split()[1])
        for line in text.splitlines()
        if line.startswith("splitserve_worker_requests_total{")
    )


async def test_each_replica_runs_on_its_own_cpu_and_both_serve(
    replicas: LocalCluster, hf_greedy: Callable[[list[int], int], list[int]]
) -> None:
    first, second = sorted(os.sched_getaffinity(0))[:2]
    workers = sorted(replicas.workers("colocated"), key=lambda p: p.name)
    assert [p.name for p in workers] == ["colocated-0", "colocated-1"]
    assert [os.sched_getaffinity(p.proc.pid) for p in workers] == [{first}, {second}]
    assert [_environ(p.proc.pid).get("OMP_NUM_THREADS") for p in workers] == ["1", "1"]
    assert len(os.sched_getaffinity(replicas.coordinator.proc.pid)) >= 2  # the coordinator is not split

    prompts = [[(11 * i + 5 * j) % 400 + 3 for j in range(40 + i)] for i in range(6)]
    async with client_for(replicas) as client:
        done = await asyncio.gather(*(client.complete(p, max_tokens=6, temperature=0.0) for p in prompts))
        for prompt, got in zip(prompts, done, strict=True):
            assert got.token_ids == hf_greedy(prompt, 6)
        assert_pools_clean(await wait_quiescent(client))
    ended = {p.name: _requests_ended(p) for p in workers}
    assert sum(ended.values()) == len(prompts) and all(ended.values()), f"a replica served nothing: {ended}"
