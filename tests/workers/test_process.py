"""A worker as a real process (`splitserve decode --mode colocated`): readiness line, health and metrics
endpoints, heartbeats, one request and its step trace, and SIGTERM -> drain -> Deregister -> exit 0; a
dying control loop -> Deregister -> exit 1."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sys
import urllib.request
from pathlib import Path

from engine.worker import step_trace
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
        *("--step-trace-dir", str(tmp_path / "steps")),
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
        share = re.search(r"^splitserve_worker_kv_cache_huge_page_share (\S+)$", text, re.M)
        assert share is not None and 0.0 <= float(share.group(1)) <= 1.0
        assert re.search(r"^splitserve_worker_kv_staging_idle_bytes 0\.0$", text, re.M)  # nothing pushed

        # the trace the process entry opened is the one the worker writes: one open file, not two
        trace = tmp_path / "steps" / f"colo-p-{proc.pid}.jsonl"
        fds = Path(f"/proc/{proc.pid}/fd")
        assert [os.readlink(fds / fd) for fd in os.listdir(fds)].count(str(trace)) == 1

        proc.send_signal(signal.SIGTERM)
        _, env = await coord.expect("deregister")
        assert env.deregister.worker_id == "colo-p"
        assert await asyncio.wait_for(proc.wait(), WAIT_S) == 0

        # a line per step: the 7-token prompt's step(s), then one decode step per token after the first
        records = step_trace.read_records(trace)
        decode = [r for r in records if r.decode_only]
        assert sum(r.tokens for r in records) == 7 + 4 and len(decode) == 4
        assert [r.context_tokens for r in decode] == [8, 9, 10, 11] and all(r.sequences == 1 for r in records)
        assert all(r.seconds > 0 and r.after_s >= 0 for r in records)
        assert records == sorted(records, key=lambda r: r.started_at)
        summary = step_trace.summarize(records)
        assert summary[0] == f"{len(records)} steps, 4 decode-only" and summary[-1].startswith(
            "batch   1:      4 steps"
        )
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await coord.close()


# Loaded by the worker process below through PYTHONPATH (sitecustomize runs at interpreter start): the
# heartbeat loop's pool gauge raises on its third tick, as a bug in a supervised loop would.
FAULT = """
import engine.worker.metrics as metrics

ticks = 0
original = metrics.WorkerMetrics.observe_pool


def observe_pool(self, pool):
    global ticks
    ticks += 1
    if ticks >= 3:
        raise RuntimeError("injected fault in the heartbeat loop")
    return original(self, pool)


metrics.WorkerMetrics.observe_pool = observe_pool
"""


async def test_a_worker_process_whose_loop_dies_deregisters_and_exits_1(
    model_dir: Path, tmp_path: Path
) -> None:
    """Supervision in a real process: a control loop that dies takes /readyz down, deregisters with the
    reason, and the process exits 1 (a pod restart), never heartbeating READY while it cannot serve."""
    coord = ScriptedCoordinator(KeySet.create(tmp_path / "keys"))
    coord.keys.add_worker("colo-f", "colocated")
    (tmp_path / "fault").mkdir()
    (tmp_path / "fault" / "sitecustomize.py").write_text(FAULT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "fault"), *sys.path])}
    argv = [
        *("decode", "--mode", "colocated", "--model", str(model_dir), "--coordinator", coord.address),
        *coord.keys.worker_args("colo-f"),
        *("--worker-id", "colo-f", "--advertise-host", "127.0.0.1", "--metrics-port", "0"),
        *("--block-size", "4", "--num-gpu-blocks", "32", "--transfer-backend", "tcp"),
    ]
    with open(tmp_path / "worker.log", "w") as logs:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "splitserve.cli",
            *argv,
            stdout=asyncio.subprocess.PIPE,
            stderr=logs,
            env=env,
        )
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 120)).decode()
        assert line.startswith(READY), line
        _, env_msg = await coord.expect("deregister")
        assert "heartbeat ended" in env_msg.deregister.reason and "injected" in env_msg.deregister.reason
        assert await asyncio.wait_for(proc.wait(), WAIT_S) == 1
        log_text = (tmp_path / "worker.log").read_text()
        assert "control task died" in log_text and "worker failed; exiting" in log_text
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await coord.close()
