"""A worker as a real process (`splitserve decode --mode colocated`): readiness line, health and metrics
endpoints, heartbeats, one request, and SIGTERM -> drain -> Deregister -> exit 0."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import urllib.request
from pathlib import Path

from splitserve.control_auth import KeySet
from tests.workers.conftest import WAIT_S, ScriptedCoordinator, execution_request

READY = "SPLITSERVE_READY "


def http_get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=WAIT_S) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


async def test_colocated_process_serves_reports_and_drains(model_dir: Path, tmp_path: Path) -> None:
    coord = ScriptedCoordinator(KeySet.create(tmp_path / "keys"))
    coord.keys.add_worker("colo-p", "colocated")
    argv = [
        *("decode", "--mode", "colocated", "--model", str(model_dir), "--coordinator", coord.address),
        *coord.keys.worker_args("colo-p"),
        *("--worker-id", "colo-p", "--advertise-host", "127.0.0.1", "--metrics-port", "0"),
        *("--block-size", "4", "--num-gpu-blocks", "32", "--transfer-backend", "tcp"),
    ]
    with open(tmp_path / "worker.log", "w") as logs:  # logs to a file: an unread pipe could fill up
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "splitserve.cli", *argv, stdout=asyncio.subprocess.PIPE, stderr=logs
        )
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 120)).decode()
        assert line.startswith(READY), line
        ready = json.loads(line[len(READY) :])
        assert ready["role"] == "colocated" and ready["worker_id"] == "colo-p"
        assert ready["control_address"].startswith("tcp://127.0.0.1:")
        register = coord.workers["colo-p"]
        assert register.model_identity and register.num_blocks == 32 and register.kv_layout.block_size == 4

        base = f"http://{ready['metrics_address']}"
        assert await asyncio.to_thread(http_get, base + "/livez") == (200, "ok\n")
        assert (await asyncio.to_thread(http_get, base + "/readyz"))[0] == 200

        _, env = await coord.expect("heartbeat")
        hb = env.heartbeat
        assert hb.worker_id == "colo-p" and hb.pool.total_blocks == 32 and hb.prefix_cache.cleared

        req = execution_request(7, [5, 6, 7, 8, 9, 10, 11], 5, identity=register.model_identity)
        await coord.send("colo-p", decode={"request": req})
        got = await coord.collect({7})
        assert len(got[7][0]) == 5

        status, text = await asyncio.to_thread(http_get, base + "/metrics")
        assert status == 200
        assert 'splitserve_worker_requests_total{outcome="finished"} 1.0' in text
        assert "splitserve_worker_step_seconds_count" in text

        proc.send_signal(signal.SIGTERM)
        _, env = await coord.expect("deregister")
        assert env.deregister.worker_id == "colo-p"
        assert await asyncio.wait_for(proc.wait(), WAIT_S) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await coord.close()
