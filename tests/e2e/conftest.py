"""End-to-end fixtures: real coordinator, prefill and decode processes on 127.0.0.1 (ports from the OS)."""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import openai
import pytest
from grpc_status import rpc_status

from coordinator.tls import ClientTls
from splitserve.client import Client
from splitserve.cluster import ClusterSpec, LocalCluster
from splitserve.v1 import serving_pb2
from tests.certs import make_pki
from tests.hf_reference import HFGreedy

API_KEY = "e2e-secret"
ADMIN_KEY = "e2e-admin"
KEYS_ENV = {"SPLITSERVE_API_KEY": API_KEY, "SPLITSERVE_ADMIN_KEY": ADMIN_KEY}


def start_cluster(spec: ClusterSpec, tmp: Path) -> LocalCluster:
    spec.log_dir = tmp / "logs"
    cluster = LocalCluster(spec, ready_timeout=240)
    cluster.start()
    return cluster


def running_cluster(spec: ClusterSpec, tmp: Path) -> Iterator[LocalCluster]:
    """A cluster fixture's body (`yield from` it): `start_cluster`, the cluster, then stop it and
    assert that every process exited 0."""
    cluster = start_cluster(spec, tmp)
    yield cluster
    codes = cluster.stop()
    assert all(code == 0 for code in codes.values()), f"unclean shutdown: {codes}"


@pytest.fixture(scope="session")
def model_dir(tiny_model_dir: Callable[[str], Path]) -> Path:
    return tiny_model_dir("llama-2l")


@pytest.fixture(scope="session")
def cluster(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """1 prefill + 2 decode workers over UCX, API key required, gRPC over mutual TLS."""
    pki = make_pki(tmp_path_factory.mktemp("pki"))
    tls = [
        "--tls-cert",
        str(pki.server_cert),
        "--tls-key",
        str(pki.server_key),
        "--tls-client-ca",
        str(pki.ca),
    ]
    spec = ClusterSpec(
        model=str(model_dir),
        prefill_workers=1,
        decode_workers=2,
        transfer_backend="ucx",
        env=dict(KEYS_ENV),
        coordinator_args=tls,
        prefill_args=["--max-num-batched-tokens", "96", "--block-size", "4"],
        decode_args=["--block-size", "4"],
    )
    yield from running_cluster(spec, tmp_path_factory.mktemp("cluster"))


def client_tls(cluster: LocalCluster) -> ClientTls | None:
    """The CA and client certificate of a cluster started with --tls-client-ca (tests.certs layout)."""
    args = cluster.spec.coordinator_args
    if "--tls-client-ca" not in args:
        return None
    ca = Path(args[args.index("--tls-client-ca") + 1])
    return ClientTls(ca=ca, cert=ca.parent / "client.crt", key=ca.parent / "client.key")


def client_for(cluster: LocalCluster, api_key: str | None = API_KEY, model: str = "") -> Client:
    return Client(
        cluster.grpc_address, api_key=api_key, admin_key=ADMIN_KEY, model=model, tls=client_tls(cluster)
    )


def openai_client(cluster: LocalCluster, api_key: str = API_KEY) -> openai.AsyncOpenAI:
    """The official SDK against the cluster's HTTP door, with the same TLS client rule as `client_for`."""
    tls = client_tls(cluster)
    if tls is None:
        return openai.AsyncOpenAI(
            base_url=f"http://{cluster.http_address}/v1", api_key=api_key, max_retries=0
        )
    context = ssl.create_default_context(cafile=str(tls.ca))
    if tls.cert is not None:
        context.load_cert_chain(tls.cert, tls.key)
    return openai.AsyncOpenAI(
        base_url=f"https://{cluster.http_address}/v1",
        api_key=api_key,
        max_retries=0,
        http_client=openai.DefaultAsyncHttpx2Client(verify=context),
    )


async def wait_quiescent(client: Client, timeout: float = 30.0) -> serving_pb2.GetPoolStateResponse:
    """Bounded wait until no request is active and every pool holds no block; returns that state.

    Releases happen asynchronously after a stream ends (Abort fan-out, KV acks), so the test polls the
    admin RPC under a deadline instead of sleeping a fixed time.
    """
    deadline = time.monotonic() + timeout
    while True:
        state = await client.pool_state(fresh=True)
        busy = state.active_requests or any(w.pool.held_blocks for w in state.workers)
        if not busy or time.monotonic() > deadline:
            return state
        await asyncio.sleep(0.05)  # poll interval of a bounded wait, not a synchronization sleep


def error_reason(err: grpc.aio.AioRpcError) -> str:
    """The google.rpc.ErrorInfo reason of a failed call (e.g. "WORKER_LOST")."""
    from google.rpc import error_details_pb2

    status = rpc_status.from_call(err)  # type: ignore[arg-type]
    assert status is not None, f"no rich status details: {err.details()}"
    info = error_details_pb2.ErrorInfo()
    assert status.details[0].Unpack(info)
    return str(info.reason)


def assert_pools_clean(state: serving_pb2.GetPoolStateResponse) -> None:
    assert state.active_requests == 0
    assert state.workers, "no workers reported"
    for w in state.workers:
        assert w.pool.integrity_ok, f"{w.worker_id}: {w.pool.integrity_error}"
        assert w.pool.held_blocks == 0, f"{w.worker_id} still holds {w.pool.held_blocks} blocks"
        assert w.pool.free_blocks + w.pool.cached_blocks == w.pool.total_blocks


@pytest.fixture(scope="session")
def hf_greedy(model_dir: Path) -> Callable[[list[int], int], list[int]]:
    """transformers' greedy continuation of one prompt (no padding), stopping at EOS like the server."""
    return HFGreedy(model_dir)
