"""`splitserve bench` end to end: two modes in one run on real local clusters of the tiny model, and
the per-role pinning and thread counts that the launcher applies to worker processes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from splitserve.cluster import ClusterSpec, LocalCluster

pytestmark = pytest.mark.xdist_group("bench-study")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TOLERANCE_MS = 5.0  # two clocks read at slightly different points of one request's life


def test_two_modes_in_one_run(tiny_model_dir: Callable[[str], Path], tmp_path: Path) -> None:
    cpu = min(os.sched_getaffinity(0))
    argv = [
        *(sys.executable, "-m", "splitserve.cli", "bench", "--model", str(tiny_model_dir("llama-2l"))),
        *("--modes", "colocated,disaggregated", "--mix", "0.25:96x4,0.75:16x8", "--num-requests", "4"),
        *("--rates", "4", "--slo-scale", "3", "--slo-scales", "1,4", "--unloaded-probes", "1"),
        *("--host-jitter-samples", "30", "--pin", f"decode={max(os.sched_getaffinity(0))}"),
        *("--tpot-slo-multiples", "0.001,1000"),  # no request meets the first; only TTFT decides the second
        *("--insecure-control-plane", "--log-dir", str(tmp_path / "logs")),
        *("--json", str(tmp_path / "study.json"), "--plots", str(tmp_path / "plots")),
        *("--busy", "1", "--busy-pin", str(cpu)),  # a busy loop beside the whole study, on one CPU
    ]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=280, check=False)
    assert done.returncode == 0, done.stderr
    busy = re.search(
        rf"1 busy loop\(s\) beside the study, on CPUs \[{cpu}\]: pids \[(\d+)\]", done.stdout + done.stderr
    )
    assert busy, done.stdout
    assert not Path(f"/proc/{busy.group(1)}").exists()  # killed and reaped when the study ended
    assert "goodput colocated:" in done.stdout and "goodput disaggregated:" in done.stdout
    study = json.loads((tmp_path / "study.json").read_text())
    assert (study["workload"]["busy"], study["workload"]["busy_pin"]) == (1, [cpu])
    host = study["workload"]["host"]  # what the numbers were measured on
    assert host["cpus"] == os.cpu_count() and isinstance(host["isa"], list) and "host: " in done.stdout

    assert [r["variant"] for r in study["rows"]] == ["colocated", "disaggregated"]
    for row in study["rows"]:
        assert row["completed"] == 4, row["errors"]
        assert 0.0 <= row["attainment"] <= 1.0
        assert set(row["attainment_by_scale"]) == {"1", "4"}
        assert all(0.0 <= a <= 1.0 for a in row["attainment_by_scale"].values())
        for req in row["requests"]:  # the breakdown agrees with TTFT
            b = req["breakdown_ms"]
            assert all(b[k] >= 0 for k in ("queue_ms", "prefill_ms", "kv_transfer_ms", "first_token_ms"))
            # the coordinator's default --first-token-from decode: a shipped request's KV lies in TTFT
            assert req["kv_transfer_in_ttft"] == (row["mode"] == "disaggregated")
            in_ttft = b["kv_transfer_ms"] if req["kv_transfer_in_ttft"] else 0.0
            assert b["queue_ms"] + b["prefill_ms"] + in_ttft <= b["first_token_ms"] + TOLERANCE_MS
            assert b.get("other_ms", 0.0) >= -TOLERANCE_MS
            assert b["first_token_ms"] <= req["ttft_ms"] + TOLERANCE_MS
            assert b["first_token_ms"] <= b["total_ms"]
            assert (b["kv_transfer_ms"] > 0) == (row["mode"] == "disaggregated")
            assert req["path"] == {"colocated": "colocated", "disaggregated": "remote"}[row["mode"]]
            routing = req["routing_ms"]  # the router's estimates behind the path
            assert routing["estimated_ttft_ms"] > 0 and routing["remote_ttft_ms"] >= 0
            assert routing["local_tpot_ms"] >= 0 and routing["tpot_target_ms"] == 0  # --slo-scale: guard off
            if row["mode"] == "disaggregated":
                assert routing["estimated_ttft_ms"] == pytest.approx(routing["remote_ttft_ms"])
            # 8 or 4 tokens each: a first gap, 0 when the coordinator delivered tokens 1 and 2 in one Delta
            assert req["first_gap_ms"] is not None and req["first_gap_ms"] >= 0
            times = req["token_ms"]  # every token's arrival, after the request was sent, in order
            assert len(times) == req["tokens"] and times[0] == pytest.approx(req["ttft_ms"], abs=0.01)
            assert times == sorted(times)
    assert {v["name"]: v["goodput"] in (0.0, 4.0) for v in study["variants"]} == {
        "colocated": True,
        "disaggregated": True,
    }

    slo = study["slo"]  # the scale resolved against the first mode's unloaded latencies
    assert slo["reference"] == "colocated" and slo["scale"] == 3
    base = study["unloaded"]["colocated"]
    assert set(base) == {"96x4", "16x8"} == set(study["unloaded"]["disaggregated"])
    for kind, latency in base.items():
        assert latency["ttft_ms"] > 0
        assert slo["by_kind"][kind]["ttft_ms"] == pytest.approx(3 * latency["ttft_ms"])
        assert slo["by_kind"][kind]["tpot_ms"] == pytest.approx(3 * latency["tpot_ms"])

    fastest = min(k["tpot_ms"] for base in study["unloaded"].values() for k in base.values())
    assert study["unloaded_decode_ms"] == fastest > 0
    for row in study["rows"]:
        assert row["itl_p99_x_unloaded"] == pytest.approx(row["itl_ms"]["p99"] / fastest)
    assert "unloaded decode:" in done.stdout
    jitter = study["host_jitter"]  # identical work on each cluster's decode CPUs, pooled
    assert jitter["samples"] == 60 and jitter["p99_x_p50"] >= 1.0
    assert set(jitter["by_variant"]) == {"colocated", "disaggregated"}
    assert all(v["samples"] == 30 for v in jitter["by_variant"].values())
    assert jitter["by_variant"]["disaggregated"]["cpus"] == [max(os.sched_getaffinity(0))]  # D's pin
    assert jitter["by_variant"]["colocated"]["cpus"] == sorted(os.sched_getaffinity(0))  # not pinned
    assert "host jitter: the same loop on the decode CPUs took p99" in done.stdout

    assert study["tpot_slo_multiples"] == {"0.001": fastest / 1000, "1000": fastest * 1000}
    for row in study["rows"]:
        ttft_only = [r["ttft_ms"] <= slo["by_kind"][r["kind"]]["ttft_ms"] for r in row["requests"]]
        assert row["attainment_by_tpot_x"] == {"0.001": 0.0, "1000": sum(ttft_only) / len(ttft_only)}
    for v in study["variants"]:
        assert v["goodput_by_tpot_x"]["0.001"] == 0.0 and v["goodput_by_tpot_x"]["1000"] in (0.0, 4.0)
    assert study["best_by_tpot_x"] == {}  # no colocated chunk budget was swept
    assert "goodput with TPOT SLO 1000x unloaded decode" in done.stdout

    plots = ("attainment-vs-rate.png", "attainment-vs-slo-scale.png")
    for name in (*plots, "attainment-vs-rate-tpot0.001x.png", "attainment-vs-rate-tpot1000x.png"):
        data = (tmp_path / "plots" / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 1000


def test_workers_run_pinned_with_their_thread_count(
    tiny_model_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    cpu = min(os.sched_getaffinity(0))
    spec = ClusterSpec(
        model=str(tiny_model_dir("llama-2l")),
        mode="colocated",
        insecure_control_plane=True,
        log_dir=tmp_path / "logs",
        cpus={"colocated": (cpu,)},
        threads={"colocated": 1},
    )
    with LocalCluster(spec, ready_timeout=240) as cluster:
        (worker,) = cluster.workers("colocated")
        assert os.sched_getaffinity(worker.proc.pid) == {cpu}
        environ = Path(f"/proc/{worker.proc.pid}/environ").read_bytes().split(b"\0")
        assert b"OMP_NUM_THREADS=1" in environ
        assert os.sched_getaffinity(cluster.coordinator.proc.pid) == os.sched_getaffinity(0)  # unpinned
