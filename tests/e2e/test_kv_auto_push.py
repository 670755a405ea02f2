"""`--kv-transfer-mode auto` across TCP-only UCX lanes: the decode worker has P push instead of
reading with gets (a UCX get over TCP measured well below the push: docs/kvtransfer.md, "Across
hosts"). A real cluster whose UCX may use only TCP (`UCX_TLS=tcp`, as between two nodes without
RDMA); one host's shared memory and CMA are what the default cluster pulls over."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from splitserve.cluster import ClusterSpec, LocalCluster
from tests.e2e.conftest import KEYS_ENV, assert_pools_clean, client_for, running_cluster, wait_quiescent
from tests.e2e.test_kv_transport_label import transfer_bytes

pytestmark = pytest.mark.xdist_group("e2e-cluster")


@pytest.fixture(scope="module")
def tcp_cluster(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    spec = ClusterSpec(
        model=str(model_dir),
        transfer_backend="ucx",
        env={**KEYS_ENV, "UCX_TLS": "tcp"},
        decode_args=["--block-size", "4"],
        prefill_args=["--block-size", "4"],
    )
    yield from running_cluster(spec, tmp_path_factory.mktemp("tcp-cluster"))


async def test_auto_pushes_over_tcp_only_lanes(
    tcp_cluster: LocalCluster, hf_greedy: Callable[[list[int], int], list[int]]
) -> None:
    prompt = [random.Random(9).randrange(5, 500) for _ in range(40)]
    before = transfer_bytes(tcp_cluster)
    async with client_for(tcp_cluster) as client:
        out = await client.complete(prompt, max_tokens=6, temperature=0.0)
        assert_pools_clean(await wait_quiescent(client))
    assert out.token_ids == hf_greedy(prompt, 6)
    moved = transfer_bytes(tcp_cluster) - before
    (label,) = {t for _, t in moved}  # the lanes it judged by: TCP only (lo and the host's NIC)
    assert label.startswith("ucx:") and set(label[4:].split("+")) <= {"tcp", "tcp-lo"}, moved
    assert tcp_cluster.spec.log_dir is not None
    prefill_log = (tcp_cluster.spec.log_dir / "prefill-0.log").read_text()
    assert "kv sent" in prefill_log  # P pushed
    assert "kv pool mapped for one-sided reads" not in prefill_log  # nobody asked P for a pull
