"""The transport each KV transfer used, as the workers export it: a real cluster (UCX, one host), its
workers' /metrics scraped after a request. On one host the bulk bytes must take a same-host lane,
never a silent fallback to TCP loopback (`ucx:tcp-lo`)."""

from __future__ import annotations

import random
import re
import urllib.request
from collections import Counter

import pytest

from splitserve.cluster import LocalCluster
from tests.e2e.conftest import client_for, wait_quiescent

pytestmark = pytest.mark.xdist_group("e2e-cluster")
SAMPLE = re.compile(
    r'^splitserve_worker_kv_transfer_bytes_total\{direction="(\w+)",transport="([^"]+)"\} (\S+)$'
)


def transfer_bytes(cluster: LocalCluster) -> Counter[tuple[str, str]]:
    """KV bytes by (direction, transport), summed over the cluster's workers' /metrics."""
    total: Counter[tuple[str, str]] = Counter()
    for proc in cluster.processes:
        if proc.name == "coordinator":
            continue
        with urllib.request.urlopen(f"http://{proc.ready['metrics_address']}/metrics", timeout=10) as resp:
            for line in resp.read().decode().splitlines():
                m = SAMPLE.match(line)
                if m:
                    total[(m.group(1), m.group(2))] += float(m.group(3))
    return total


async def test_kv_transfer_metrics_name_the_same_host_transport(cluster: LocalCluster) -> None:
    before = transfer_bytes(cluster)
    prompt = [random.Random(5).randrange(5, 500) for _ in range(40)]
    async with client_for(cluster) as client:
        await client.complete(prompt, max_tokens=2, temperature=0.0)
        await wait_quiescent(client)
    moved = transfer_bytes(cluster) - before
    (transport,) = {t for _, t in moved}  # one pair of workers, one connection, one label
    assert transport.startswith("ucx:") and "tcp" not in transport, moved
    assert moved[("send", transport)] == moved[("recv", transport)] > 0, moved
