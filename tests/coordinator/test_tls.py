"""gRPC TLS and mTLS on the real coordinator, with `splitserve.client.Client` and the `splitserve`
CLI as a process; plaintext only on loopback unless --insecure-grpc; probes on a health-only port."""

from __future__ import annotations

import asyncio
import os
import shutil
import ssl
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
import httpx2
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coordinator.app import CoordinatorConfig
from coordinator.tls import ClientTls
from splitserve.client import Client
from splitserve.v1 import serving_pb2, serving_pb2_grpc
from tests.certs import Pki, make_pki
from tests.coordinator.conftest import Cluster

StartCluster = Callable[..., Awaitable[Cluster]]
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def other_pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"), "other")


def tls_settings(pki: Pki, mutual: bool = False) -> dict[str, object]:
    settings: dict[str, object] = {"tls_cert": str(pki.server_cert), "tls_key": str(pki.server_key)}
    return settings | ({"tls_client_ca": str(pki.ca)} if mutual else {})


async def models_via(address: str, tls: ClientTls | None) -> list[str]:
    async with Client(address, tls=tls) as client:
        return [m.name for m in await client.list_models()]


async def fails_unavailable(call: Awaitable[object]) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await asyncio.wait_for(call, 30)
    assert caught.value.code() == UNAVAILABLE, caught.value.details()


async def test_tls_serves_the_right_ca_and_refuses_a_wrong_ca_or_plaintext(
    start_cluster: StartCluster, pki: Pki, other_pki: Pki, tmp_path: Path
) -> None:
    served = tmp_path / "secret"  # as a mounted Secret: rotated in place
    served.mkdir()
    for src, name in ((pki.server_cert, "tls.crt"), (pki.server_key, "tls.key")):
        shutil.copy(src, served / name)
    cluster = await start_cluster(
        tls_cert=str(served / "tls.crt"), tls_key=str(served / "tls.key"), health_port=0
    )
    address = cluster.app.grpc_address
    assert await models_via(address, ClientTls(ca=pki.ca)) == ["tiny"]
    await fails_unavailable(models_via(address, ClientTls(ca=other_pki.ca)))
    await fails_unavailable(models_via(address, None))  # plaintext to a TLS port

    # probes: health alone, plaintext, on its own port
    async with grpc.aio.insecure_channel(cluster.app.health_address) as channel:
        check = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert check.status == health_pb2.HealthCheckResponse.NOT_SERVING  # no workers yet
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await serving_pb2_grpc.ModelServiceStub(channel).ListModels(serving_pb2.ListModelsRequest())
        assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED

    # cert-manager rotates the Secret: new handshakes present the new certificate
    for src, name in ((other_pki.server_cert, "tls.crt"), (other_pki.server_key, "tls.key")):
        shutil.copy(src, served / name)
    assert await models_via(address, ClientTls(ca=other_pki.ca)) == ["tiny"]


async def test_mtls_requires_a_client_certificate_from_the_client_ca(
    start_cluster: StartCluster, pki: Pki, other_pki: Pki
) -> None:
    cluster = await start_cluster(**tls_settings(pki, mutual=True))
    address = cluster.app.grpc_address
    good = ClientTls(ca=pki.ca, cert=pki.client_cert, key=pki.client_key)
    assert await models_via(address, good) == ["tiny"]
    await fails_unavailable(models_via(address, ClientTls(ca=pki.ca)))  # no client certificate
    foreign = ClientTls(ca=pki.ca, cert=other_pki.client_cert, key=other_pki.client_key)
    await fails_unavailable(models_via(address, foreign))


async def http_models(cluster: Cluster, key: str, pki: Pki, client_cert: bool = True) -> int:
    """GET /v1/models over HTTPS trusting `pki.ca`, with or without the client certificate."""
    context = ssl.create_default_context(cafile=str(pki.ca))
    if client_cert:
        context.load_cert_chain(pki.client_cert, pki.client_key)
    url = f"https://{cluster.app.http_address}/v1/models"
    async with httpx2.AsyncClient(timeout=10, verify=context) as client:
        return (await client.get(url, headers={"Authorization": f"Bearer {key}"})).status_code


async def test_both_doors_take_the_same_tls_files_client_rule_and_api_keys(
    start_cluster: StartCluster, pki: Pki
) -> None:
    cluster = await start_cluster(api_keys=("door-key",), **tls_settings(pki, mutual=True))
    good = ClientTls(ca=pki.ca, cert=pki.client_cert, key=pki.client_key)
    async with Client(cluster.app.grpc_address, tls=good, api_key="door-key") as client:
        assert [m.name for m in await client.list_models()] == ["tiny"]
    assert await http_models(cluster, "door-key", pki) == 200
    assert await http_models(cluster, "other", pki) == 401
    with pytest.raises(httpx2.HTTPError):  # mTLS: no client certificate, no handshake
        await http_models(cluster, "door-key", pki, client_cert=False)
    with pytest.raises(httpx2.HTTPError):  # plaintext to the TLS listener
        async with httpx2.AsyncClient(timeout=10) as plain:
            await plain.get(f"http://{cluster.app.http_address}/v1/models")


async def run_cli(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """`splitserve ARGS` as a process (bounded): exit code, stdout, stderr."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "splitserve.cli", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env={**os.environ, **(env or {})},
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_the_cli_generates_over_mtls_and_fails_without_its_certificate(
    start_cluster: StartCluster, pki: Pki
) -> None:
    cluster = await start_cluster(**tls_settings(pki, mutual=True))
    p, d = await cluster.ready_pair()
    target = ["--target", cluster.app.grpc_address, "--tls-ca", str(pki.ca), "--max-tokens", "2"]
    cli = asyncio.create_task(
        run_cli(
            "generate", "hello", *target, "--tls-cert", str(pki.client_cert), "--tls-key", str(pki.client_key)
        )
    )
    req = (await p.expect("prefill", timeout=120)).prefill.request
    ids = cluster.model.tokenizer.encode(" tls works", add_special_tokens=False)[:2]
    await p.tokens(req.rid, req.generation, 0, ids[:1], prefill_done=True)
    await d.tokens(req.rid, req.generation, 1, ids[1:], finish=serving_pb2.FINISH_REASON_LENGTH)
    code, out, err = await cli
    assert code == 0, err
    assert out.strip() == cluster.model.tokenizer.decode(ids).strip() and "FINISH_REASON_LENGTH" in err

    code, _, err = await run_cli("chat", "hello", *target)  # no client certificate
    assert code == 1 and "UNAVAILABLE" in err
    code, _, err = await run_cli("generate", "hello", "--target", "192.0.2.1:50051")
    assert code == 2 and "--insecure" in err and "--tls-ca" in err  # no plaintext off loopback


def test_plaintext_off_loopback_needs_the_explicit_flag(pki: Pki) -> None:
    with pytest.raises(ValueError, match="--insecure-grpc"):
        CoordinatorConfig(model="tiny", host="0.0.0.0")
    with pytest.raises(ValueError, match="--insecure-grpc"):
        CoordinatorConfig(model="tiny", admin_host="10.0.0.1", admin_port=0)
    CoordinatorConfig(model="tiny", host="0.0.0.0", insecure_grpc=True)
    CoordinatorConfig(
        model="tiny", host="0.0.0.0", tls_cert=str(pki.server_cert), tls_key=str(pki.server_key)
    )
    CoordinatorConfig(model="tiny", host="::1")
    with pytest.raises(ValueError, match="--tls-cert"):
        CoordinatorConfig(model="tiny", tls_client_ca=str(pki.ca))


def test_the_ssl_context_for_an_http_listener_uses_the_same_files_and_client_rule(pki: Pki) -> None:
    import ssl

    from coordinator.tls import server_tls

    mutual = server_tls(str(pki.server_cert), str(pki.server_key), str(pki.ca))
    assert mutual is not None and mutual.mutual
    context = mutual.ssl_context()
    assert context.verify_mode == ssl.CERT_REQUIRED and context.minimum_version >= ssl.TLSVersion.TLSv1_2
    plain = server_tls(str(pki.server_cert), str(pki.server_key), None)
    assert plain is not None and plain.ssl_context().verify_mode == ssl.CERT_NONE
    with pytest.raises(ValueError, match="both"):
        server_tls(str(pki.server_cert), None, None)
    assert server_tls(None, None, None) is None
