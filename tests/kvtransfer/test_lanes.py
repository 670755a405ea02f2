"""transport_label: the bounded metric label derived from Peer.transports; gets_over_tcp, which
keeps a decode worker in --kv-transfer-mode auto from pulling over TCP-only lanes."""

from __future__ import annotations

import pytest

from kvtransfer.lanes import gets_over_tcp, transport_label


@pytest.mark.parametrize(
    ("transports", "label"),
    [
        ("ucx: sysv/memory(am keepalive), posix/memory(-), cma/memory(rma_bw#0)", "ucx:cma"),
        ("ucx: tcp/veth0(rma_bw#0 am wireup)", "ucx:tcp"),
        ("ucx: tcp/lo(am keepalive), tcp/lo(rma_bw#0 wireup)", "ucx:tcp-lo"),
        ("ucx: sysv/memory(am keepalive), posix/memory(-)", "ucx:sysv"),
        ("ucx: rc_mlx5/mlx5_0:1(rma_bw#0), rc_mlx5/mlx5_1:1(rma_bw#1), ud(am)", "ucx:rc_mlx5"),
        ("ucx: cuda_ipc/cuda(rma_bw#0), tcp/eth0(am)", "ucx:cuda_ipc"),
        ("ucx: unknown", "ucx:unknown"),
        ("tcp", "tcp"),
        ('x"} 1\nevil{', "unknown"),
    ],
)
def test_label_names_the_bulk_lanes(transports: str, label: str) -> None:
    assert transport_label(transports) == label


def test_label_values_stay_few_whatever_the_string() -> None:
    many = ", ".join(f"t{i}/d(rma_bw#{i})" for i in range(10))
    assert transport_label(f"ucx: {many}") == "ucx:t0+t1+t2"


@pytest.mark.parametrize(
    ("transports", "over_tcp"),
    [
        ("ucx: tcp/veth0(rma_bw#0 am wireup)", True),  # two pods on two nodes, no RDMA
        ("ucx: tcp/lo(am keepalive), tcp/lo(rma_bw#0 wireup)", True),
        ("ucx: sysv/memory(am keepalive), posix/memory(-), cma/memory(rma_bw#0)", False),
        ("ucx: rc_mlx5/mlx5_0:1(rma_bw#0), ud(am)", False),
        ("ucx: cuda_ipc/cuda(rma_bw#0), tcp/eth0(am)", False),
        ("ucx: rc_mlx5/mlx5_0:1(rma_bw#0), tcp/eth0(rma_bw#1)", False),  # RDMA carries part of it
        ("ucx: unknown", False),
        ("tcp", False),  # not UCX: our TCP backend pushes anyway
    ],
)
def test_gets_over_tcp_only_when_every_bulk_lane_is_tcp(transports: str, over_tcp: bool) -> None:
    assert gets_over_tcp(transports) is over_tcp
