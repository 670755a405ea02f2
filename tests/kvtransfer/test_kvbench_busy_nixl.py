"""kvbench's contention and peer rows: `--busy N` loops beside the agents, and the `nixl-raw` row."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from kvtransfer.bench import cli
from kvtransfer.bench.busy import BusyLoops
from kvtransfer.bench.nixl_sweep import VARIANTS, nixl_missing

TEST_RING = "8MiB"
TOY = ["--duration", "0.05", "--repeats", "1", "--ring-bytes", TEST_RING]


def _printed_pids(stderr: str) -> list[int]:
    match = re.search(r"busy loops running beside the agents: pids \[([0-9, ]+)\]", stderr)
    assert match, f"no busy pids in {stderr!r}"
    return [int(p) for p in match.group(1).split(",")]


def _gone(pid: int) -> bool:
    """Reaped: not even a zombie is left (a child of ours cannot be reused before we reap it)."""
    return not Path(f"/proc/{pid}").exists()


def test_busy_run_records_busy_in_every_row_and_leaves_no_loop_behind(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "rows.jsonl"
    argv = ["run", "--backend", "tcp", "--sizes", "256KiB", "--busy", "1", *TOY, "--json", str(out)]
    assert cli.main([*argv, "--csv", str(tmp_path / "rows.csv"), "--agent-log", str(tmp_path / "a.log")]) == 0
    captured = capsys.readouterr()
    (pid,) = _printed_pids(captured.err)
    assert _gone(pid)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["busy"] for r in rows] == [1] and rows[0]["verified"] is True
    assert "busy" in (tmp_path / "rows.csv").read_text().splitlines()[0].split(",")
    assert captured.out.splitlines()[-3].split()[0] == "busy"  # the table's first column


def test_busy_loops_are_reaped_when_the_run_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["run", "--backend", "tcp", "--model-shape", "no-such-shape", "--busy", "2", *TOY]
    with pytest.raises(SystemExit, match="unknown model shape"):
        cli.main([*argv, "--agent-log", str(tmp_path / "a.log")])
    pids = _printed_pids(capsys.readouterr().err)
    assert len(pids) == 2 and all(_gone(p) for p in pids)


def test_busy_loops_are_reaped_on_ctrl_c() -> None:
    with pytest.raises(KeyboardInterrupt), BusyLoops(2) as busy:
        pids = busy.pids
        assert all(Path(f"/proc/{p}").exists() for p in pids)
        raise KeyboardInterrupt
    assert all(_gone(p) for p in pids)


def test_busy_loops_run_on_the_cpus_they_were_given() -> None:
    cpu = max(os.sched_getaffinity(0))
    with BusyLoops(1, [cpu]) as busy:
        (pid,) = busy.pids
        assert os.sched_getaffinity(pid) == {cpu}
    assert _gone(pid)


def test_a_negative_busy_count_is_refused() -> None:
    with pytest.raises(SystemExit, match="--busy takes a count"):
        cli.main(["run", "--backend", "tcp", "--busy", "-1", *TOY])


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--sizes", "1MiB,huge", "argument --sizes: 'huge' is not a size (64KiB, 4MiB, 1000)"),
        ("--depth", "1,0", "argument --depth: '0' is not a depth >= 1"),
    ],
)
def test_bad_list_flags_are_usage_errors_naming_the_entry(
    flag: str, value: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.parse_args(["run", flag, value])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_list_flags_skip_empty_entries() -> None:
    assert cli.parse_args(["run", "--tokens", "4k,,128,"]).tokens == [4096, 128]


@pytest.mark.skipif(nixl_missing() is not None, reason=f"NIXL not importable: {nixl_missing()}")
def test_nixl_row_is_verified_and_reports_a_ratio(tmp_path: Path) -> None:
    out = tmp_path / "rows.jsonl"
    argv = ["run", "--backend", "nixl-raw", "--sizes", "1MiB", *TOY, "--json", str(out)]
    assert cli.main([*argv, "--agent-log", str(tmp_path / "a.log")]) == 0
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["backend"] == "nixl-raw" and row["verified"] is True and row["gbps"] > 0
    assert row["ratio"] == pytest.approx(row["gbps"] / row["memcpy_gbps"])
    assert len(row["nixl_variants"]) == len(VARIANTS)
    assert row["transport"] in row["nixl_variants"] and row["transport"].startswith("nixl:UCX ")
    assert row["gbps"] == max(row["nixl_variants"].values())


@pytest.mark.skipif(nixl_missing() is not None, reason=f"NIXL not importable: {nixl_missing()}")
def test_nixl_model_rows_read_a_prompts_scattered_blocks_verified(tmp_path: Path) -> None:
    """`--model-shape` for the peer row: the receiver READs a prompt's blocks from the sender's
    churned pool into its own in one NIXL request, one descriptor per run consecutive on both sides."""
    out = tmp_path / "rows.jsonl"
    argv = [
        "run",
        "--backend",
        "nixl-raw",
        "--model-shape",
        "llama-2l",
        "--tokens",
        "100,1k",
        "--repeats",
        "1",
    ]
    assert cli.main([*argv, "--json", str(out), "--agent-log", str(tmp_path / "a.log")]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["mode"], r["backend"], r["tokens"], r["blocks"]) for r in rows] == [
        ("model", "nixl-raw", 100, 7),
        ("model", "nixl-raw", 1024, 64),
    ]
    assert all(
        r["verified"] and r["transfer_ms"] > 0 and r["transport"] == "nixl:UCX READ thread off" for r in rows
    )
    # clocked in the driver, as our rows are: the READ inside the agent is part of it
    assert all(0 < r["in_agent_ms"] < r["transfer_ms"] for r in rows)
    assert 1 < rows[1]["messages"] < rows[1]["blocks"]  # fragmented on both sides, runs coalesced
    assert all(0.0 <= r["huge_page_share"][side] <= 1.0 for r in rows for side in ("send", "recv"))


@pytest.mark.skipif(nixl_missing() is not None, reason=f"NIXL not importable: {nixl_missing()}")
def test_our_nixl_pull_rows_read_the_prompt_chunk_by_chunk_verified(tmp_path: Path) -> None:
    """`nixl-get`: our NIXL backend's pull sessions, D reading P's churned pool with NIXL READs,
    one per chunk (kvtransfer.nixl_rma); model rows only (raw sizes are skipped, saying so)."""
    out = tmp_path / "rows.jsonl"
    argv = ["run", "--backend", "nixl-get", "--model-shape", "llama-2l", "--tokens", "1k"]
    argv += ["--chunk-tokens", "256", "--raw-sizes", "1MiB", "--repeats", "1"]
    assert cli.main([*argv, "--json", str(out), "--agent-log", str(tmp_path / "a.log")]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["mode"], r["backend"], r["tokens"], r["chunk_tokens"]) for r in rows] == [
        ("model", "nixl-get", 1024, 256)
    ]
    assert rows[0]["verified"] and rows[0]["transport"] == "nixl: UCX READ (receiver-pulled)"
    assert 1 < rows[0]["messages"] < rows[0]["blocks"]  # runs coalesced, both pools fragmented


def test_a_peer_run_of_two_backends_is_refused_before_anything_starts() -> None:
    with pytest.raises(SystemExit, match="--peer measures the one backend its `kvbench serve` runs"):
        cli.main(["run", "--backend", "ucx,tcp", "--peer", "tcp://127.0.0.1:9", *TOY])


def test_a_round_count_below_one_is_refused() -> None:
    with pytest.raises(SystemExit, match="--rounds takes a count"):
        cli.main(["run", "--backend", "tcp", "--rounds", "0", *TOY])


@pytest.mark.skipif(nixl_missing() is not None, reason=f"NIXL not importable: {nixl_missing()}")
def test_rounds_alternate_the_order_runs_alternate_within_and_ratio_each_row_to_its_rounds_peer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "rows.jsonl"
    argv = [
        "run",
        "--backend",
        "tcp,nixl-raw",
        "--nixl-variants",
        "read",
        "--sizes",
        "256KiB",
        "--rounds",
        "2",
    ]
    argv += [*TOY, "--repeats", "3", "--json", str(out), "--agent-log", str(tmp_path / "a.log")]
    assert cli.main(argv) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["round"], r["backend"]) for r in rows] == [
        (0, "tcp"),
        (0, "nixl-raw"),
        (1, "nixl-raw"),
        (1, "tcp"),
    ]
    for first, second in (rows[0:2], rows[2:4]):  # each round: A B, B A, A B run by run
        a, b = first["repeat_started_at"], second["repeat_started_at"]
        assert len(a) == len(b) == 3 and a[0] < b[0] < b[1] < a[1] < a[2] < b[2], (a, b)
    assert rows[1]["repeat_started_at"][2] < rows[2]["repeat_started_at"][0]  # round 1 starts after round 0
    peer = {r["round"]: r["gbps"] for r in rows if r["backend"] == "nixl-raw"}
    ours = [r for r in rows if r["backend"] == "tcp"]
    assert all(r["verified"] for r in rows) and "peer_ratio" not in rows[1]
    assert [r["peer_ratio"] for r in ours] == [pytest.approx(r["gbps"] / peer[r["round"]]) for r in ours]
    printed = capsys.readouterr().out
    summary = printed[printed.index("vs peer (nixl-raw) round by round") :].splitlines()
    (line,) = [s for s in summary if s.split()[1:3] == ["tcp", "256KiB"]]
    expected = sorted(r["peer_ratio"] for r in ours)
    assert line.split()[3:] == [f"{ours[0]['peer_ratio']:.2f}", f"{ours[1]['peer_ratio']:.2f}",
                                f"{sum(expected) / 2:.2f}", f"{expected[0]:.2f}"]  # fmt: skip
