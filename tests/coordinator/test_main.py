"""`splitserve coordinator` as a process: the READY line, its addresses, API keys, and a SIGTERM drain
that exits 0."""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from coordinator.auth import hash_entry
from splitserve.control_auth import KeySet
from splitserve.v1 import serving_pb2, serving_pb2_grpc

# what `splitserve coordinator ARGS` runs, without depending on the CLI's command table
LAUNCH = (
    "import argparse, sys; from coordinator import main; p = argparse.ArgumentParser(); "
    "main.add_arguments(p); sys.exit(main.run(p.parse_args(sys.argv[1:])))"
)


def read_ready_line(proc: subprocess.Popen[str], timeout_s: float) -> dict[str, str]:
    """The SPLITSERVE_READY payload, waited for at most `timeout_s` (a readiness probe, not a sleep)."""
    assert proc.stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        if sel.select(left):
            line = proc.stdout.readline()
            if not line:
                break
            if line.startswith("SPLITSERVE_READY "):
                return dict(json.loads(line.removeprefix("SPLITSERVE_READY ")))
    raise AssertionError(f"no READY line within {timeout_s} s (exit code {proc.poll()})")


def http_status(url: str, authorization: str | None = None) -> int:
    request = urllib.request.Request(url, headers={"Authorization": authorization} if authorization else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return int(response.status)
    except urllib.error.HTTPError as err:
        return err.code


@pytest.mark.slow
def test_process_prints_ready_and_drains_on_sigterm(
    tiny_model_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    args = ["--model", str(tiny_model_dir("llama-2l")), "--served-model-name", "tiny", "--port", "0"]
    args += ["--control-port", "0", "--metrics-port", "0", "--http-port", "0"]
    args += ["--api-key-env", "TEST_COORDINATOR_KEY"]
    args += KeySet.create(tmp_path / "keys").coordinator_args()
    args += ["--api-key", hash_entry("k3")]
    env = {**os.environ, "TEST_COORDINATOR_KEY": "k1,k2"}
    proc = subprocess.Popen(
        [sys.executable, "-c", LAUNCH, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        ready = read_ready_line(proc, timeout_s=120)
        assert ready["role"] == "coordinator" and ready["control_address"].startswith("tcp://127.0.0.1:")
        with grpc.insecure_channel(ready["grpc_address"]) as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING  # no workers yet
            models = serving_pb2_grpc.ModelServiceStub(channel)
            with pytest.raises(grpc.RpcError) as caught:
                models.ListModels(serving_pb2.ListModelsRequest(), timeout=10)
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
            listed = models.ListModels(
                serving_pb2.ListModelsRequest(), metadata=[("authorization", "Bearer k2")]
            )
            assert [m.name for m in listed.models] == ["tiny"] and listed.models[0].context_length == 2048
            hashed = models.ListModels(
                serving_pb2.ListModelsRequest(), metadata=[("authorization", "Bearer k3")]
            )
            assert [m.name for m in hashed.models] == ["tiny"]  # a key given as its sha256 entry
            services = ProtoReflectionDescriptorDatabase(channel).get_services()  # what grpcurl uses
            assert {"splitserve.v1.InferenceService", "grpc.health.v1.Health"} <= set(services)
        with urllib.request.urlopen(f"http://{ready['metrics_address']}/metrics", timeout=10) as response:
            assert b"splitserve_coordinator_queue_depth" in response.read()
        # the HTTP door: the same health and the same API keys as gRPC
        http = f"http://{ready['http_address']}"
        assert http_status(f"{http}/health") == 503  # no workers yet, like gRPC health
        assert http_status(f"{http}/v1/models") == 401
        assert http_status(f"{http}/v1/models", "Bearer k1") == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stderr = proc.stderr.read() if proc.stderr else ""
    assert '"event": "draining"' in stderr  # JSON logs: stderr is not a terminal


def test_process_without_control_keys_exits_2_naming_the_flags(tiny_model_dir: Callable[[str], Path]) -> None:
    args = ["--model", str(tiny_model_dir("llama-2l")), "--port", "0", "--control-port", "0"]
    args += ["--metrics-port", "0"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPLITSERVE_")}
    done = subprocess.run(
        [sys.executable, "-c", LAUNCH, *args], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 2
    assert (
        "--control-key" in done.stdout + done.stderr
        and "--insecure-control-plane" in done.stdout + done.stderr
    )
