"""kvbench end to end at toy sizes: two real agent processes per backend, every output written."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvtransfer.bench import cli, runner
from kvtransfer.bench.control import READY_PREFIX, spawn_agent
from kvtransfer.bench.report import parse_size, parse_tokens

# Rings of 4x the LLC (the benchmark's default) are 1.2 GiB per side on a 300 MiB-LLC host: tests
# check the plumbing, not the speed, so they rotate through a few MiB.
TEST_RING = "8MiB"
REQUIRED = {
    "backend",
    "size_bytes",
    "gbps",
    "memcpy_gbps",
    "ratio",
    "p50_us",
    "p99_us",
    "verified",
    "command",
}


def test_size_and_token_parsing() -> None:
    assert [parse_size(s) for s in ("64KiB", "4MiB", "1GiB", "1000")] == [65536, 4 << 20, 1 << 30, 1000]
    assert [parse_tokens(t) for t in ("128", "1k", "32k")] == [128, 1024, 32768]


def test_raw_sweep_writes_json_csv_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "rows.jsonl"
    argv = ["run", "--backend", "ucx,tcp", "--sizes", "256KiB,1MiB", "--duration", "0.05", "--repeats", "1"]
    argv += ["--ring-bytes", TEST_RING]
    argv += ["--json", str(out), "--csv", str(tmp_path / "rows.csv"), "--plot", str(tmp_path / "bw.png")]
    argv += ["--agent-log", str(tmp_path / "agents.log")]
    assert cli.main(argv) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["backend"], r["size_bytes"]) for r in rows] == [  # point by point, backends side by side
        ("ucx", 256 << 10),
        ("tcp", 256 << 10),
        ("ucx", 1 << 20),
        ("tcp", 1 << 20),
    ]
    for r in rows:
        assert r.keys() >= REQUIRED and r["verified"] is True and r["gbps"] > 0
        assert r["ratio"] == pytest.approx(r["gbps"] / r["memcpy_gbps"])
    assert rows[0]["transport"].startswith("ucx:") and rows[1]["transport"] == "tcp"
    assert len(list(csv.DictReader((tmp_path / "rows.csv").open()))) == 4
    assert (tmp_path / "bw.png").stat().st_size > 0
    printed = capsys.readouterr().out
    assert printed.index("memcpy baseline") < printed.index("GB/s")


def test_model_shape_mode_moves_a_prompts_kv_pushed_and_pulled(tmp_path: Path) -> None:
    """Push (tcp) and one-sided pull (ucx-get, two chunks per 1k prompt) through real sessions into
    fragmented blocks, verified; the raw row of the same run gives each model row its `vs raw`."""
    out = tmp_path / "rows.jsonl"
    argv = ["run", "--backend", "tcp,ucx-get", "--model-shape", "llama-2l", "--tokens", "100,1k"]
    argv += ["--repeats", "1", "--chunk-tokens", "512", "--raw-sizes", "256KiB", "--duration", "0.05"]
    argv += ["--ring-bytes", TEST_RING, "--json", str(out), "--agent-log", str(tmp_path / "agents.log")]
    assert cli.main(argv) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["mode"], r["backend"], r.get("tokens")) for r in rows] == [
        ("raw", "tcp", None),  # the raw rows side by side first, then each backend's model rows
        ("raw", "ucx-get", None),
        ("model", "tcp", 100),
        ("model", "tcp", 1024),
        ("model", "ucx-get", 100),
        ("model", "ucx-get", 1024),
    ]
    model = [r for r in rows if r["mode"] == "model"]
    assert [(r["tokens"], r["blocks"]) for r in model] == [(100, 7), (1024, 64)] * 2
    assert all(r["verified"] and r["transfer_ms"] > 0 and r["raw_size"] == "256KiB" for r in model)
    assert all(r["raw_ratio"] == pytest.approx(r["gbps"] / r["raw_gbps"]) for r in model)
    # each agent's cache backing, so a slow round can be laid against its pages
    assert all(0.0 <= r["huge_page_share"][side] <= 1.0 for r in model for side in ("send", "recv"))
    pulled = model[3]
    # fragmented on both sides: more than one get per chunk, fewer than one per block (coalesced)
    assert 2 < pulled["messages"] < pulled["blocks"] and pulled["chunk_tokens"] == 512


def test_pinned_agent_runs_on_the_core_it_was_given(tmp_path: Path) -> None:
    receiver_cpu, sender_cpu = runner.agent_cpus()
    if sender_cpu is None:
        pytest.skip("needs two cores")
    assert receiver_cpu != sender_cpu
    args = [*runner.BACKEND_ARGS["tcp"], "--layout", json.dumps(runner.RAW_LAYOUT.to_dict())]
    with (tmp_path / "agent.log").open("w") as log:
        agent = spawn_agent([*args, "--num-blocks", "1", "--fragment", "1"], log, cpu=sender_cpu)
    try:
        assert os.sched_getaffinity(agent.process.pid) == {sender_cpu}
    finally:
        agent.process.kill()
        agent.process.wait()


@pytest.mark.parametrize("backend", ["ucx", "tcp"])
def test_run_against_a_separate_serve_process(tmp_path: Path, backend: str) -> None:
    """`kvbench serve` in its own process (as on another host), `kvbench run --peer` against it."""
    serve_argv = ["serve", "--backend", backend, "--host", "127.0.0.1", "--advertise", "127.0.0.1"]
    serve = subprocess.Popen(
        [sys.executable, "-m", "kvtransfer.bench.cli", *serve_argv, "--control-port", "0"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert serve.stdout is not None
        # Wait (readiness): the served agent prints its control endpoint once it listens.
        ready = next(line for line in serve.stdout if line.startswith(READY_PREFIX))
        control = json.loads(ready[len(READY_PREFIX) :])["control"]
        out = tmp_path / "rows.jsonl"
        argv = ["run", "--backend", backend, "--peer", control, "--sizes", "1MiB", "--duration", "0.05"]
        argv += ["--repeats", "1", "--json", str(out), "--agent-log", str(tmp_path / "agents.log")]
        argv += ["--ring-bytes", TEST_RING]
        assert cli.main(argv) == 0
        (row,) = [json.loads(line) for line in out.read_text().splitlines()]
        assert row["backend"] == backend and row["verified"] is True and row["gbps"] > 0
    finally:
        serve.kill()
        serve.wait()


def test_a_seeded_ring_holds_what_it_is_asked_for_and_every_buffer_differs() -> None:
    from kvtransfer.bench.bench_loops import default_ring_bytes, new_ring, ring_count

    assert ring_count(1 << 20, 8 << 20) == 8 and ring_count(64 << 20, 8 << 20) == 2
    assert ring_count(1 << 20) * (1 << 20) >= default_ring_bytes()
    ring = new_ring(64 << 10, seed=7, ring_bytes=1 << 20)
    assert len(ring) == 16
    assert len({bytes(buf.numpy()) for buf in ring}) == 16, "two buffers of one ring are equal"
    again = new_ring(64 << 10, seed=7, ring_bytes=1 << 20)
    assert all(bool((a == b).all()) for a, b in zip(ring, again, strict=True)), "a seed must repeat"
    assert all(int(buf.sum()) == 0 for buf in new_ring(64 << 10, seed=None, ring_bytes=1 << 20))


def test_ring_buffers_smaller_than_a_huge_page_are_rows_of_one_huge_page_slab() -> None:
    """A KV pool's blocks lie on huge pages; a ring of 1 MiB buffers must too (one slab), or a copy
    between processes looks up 4 KiB pages and the bench measures the page walk."""
    from kernels.host_memory import HUGE_PAGE_BYTES
    from kvtransfer.bench.bench_loops import new_ring

    ring = new_ring(1 << 20, seed=3, ring_bytes=8 << 20)
    base = ring[0].data_ptr()
    assert base % HUGE_PAGE_BYTES == 0
    assert [buf.data_ptr() - base for buf in ring] == [j << 20 for j in range(8)]
    assert all(buf.is_contiguous() and buf.nbytes == 1 << 20 for buf in ring)


async def test_an_agent_drops_malformed_control_frames_and_keeps_serving(tmp_path: Path) -> None:
    """Raw bytes, a non-object, a missing id/op, an extra frame: each dropped; a valid request sent
    after them on the same connection (so handled after them) is answered."""
    import asyncio

    import zmq
    import zmq.asyncio

    args = [*runner.BACKEND_ARGS["tcp"], "--layout", json.dumps(runner.RAW_LAYOUT.to_dict())]
    with (tmp_path / "agent.log").open("w") as log:
        agent = spawn_agent([*args, "--num-blocks", "1"], log)
    ctx = zmq.asyncio.Context()
    stranger = ctx.socket(zmq.DEALER)
    stranger.setsockopt(zmq.LINGER, 0)
    stranger.connect(agent.control)
    try:
        for frames in (
            [b"\xff\x00garbage"],
            [b"[1, 2]"],
            [b'{"op": "info"}'],
            [b'{"id": 1}'],
            [b"{}", b"{}"],
        ):
            await stranger.send_multipart(frames)
        await stranger.send(json.dumps({"id": 7, "op": "info"}).encode())
        reply = json.loads(await asyncio.wait_for(stranger.recv(), 30))
        assert reply["id"] == 7 and reply["ok"] and reply["backend"] == "tcp"
        assert agent.process.poll() is None
    finally:
        stranger.close()
        ctx.term()
        agent.process.kill()
        agent.process.wait()
    assert (tmp_path / "agent.log").read_text().count("malformed control request dropped") == 5
