"""`splitserve demo` on a terminal-free run: progress lines and the answer only; logs in files; a clean
shutdown logs no warning. Also the progress protocol's parsing and its plain (non-TTY) board."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from splitserve.progress import PROGRESS_PREFIX, ProgressBoard, parse

PROCESSES = ("coordinator", "prefill-0", "decode-0")
ROW = re.compile(r"^  (coordinator|prefill-0|decode-0) +\S.* \(\d+\.\ds\)$")


def test_demo_output_has_no_log_lines_and_logs_land_in_files(
    tiny_model_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    env = {**os.environ, "SPLITSERVE_CACHE": str(tmp_path)}  # the default log directory lives here
    argv = [sys.executable, "-m", "splitserve.cli", "demo", "--model", str(tiny_model_dir("llama-2l"))]
    done = subprocess.run(
        [*argv, "--max-tokens", "8"], capture_output=True, text=True, env=env, timeout=240, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "assistant:" in done.stdout and "timings (ms): queue" in done.stdout
    assert "cluster stopped cleanly: True" in done.stdout
    for line in done.stderr.splitlines():  # only progress rows and the launcher's own lines
        assert ROW.match(line) or line.startswith(("logs: ", "cluster up in ")), line
    for line in done.stdout.splitlines():
        assert not line.startswith("{") and "[info" not in line, line
    for name in PROCESSES:
        assert re.search(rf"^  {name} +ready ", done.stderr, re.M), f"{name} never showed ready"
    (log_dir,) = (tmp_path / "logs").iterdir()
    assert f"logs: {log_dir}/" in done.stderr
    for name in (*PROCESSES, "splitserve"):
        events = [json.loads(line) for line in (log_dir / f"{name}.log").read_text().splitlines()]
        assert events, f"{name}.log is empty"
        bad = [e for e in events if e["level"] in ("warning", "error", "critical")]
        assert not bad, f"{name}.log: a clean run logged {bad}"
    assert any(e["event"] == "stopped" for e in map(json.loads, (log_dir / "decode-0.log").open()))


def test_progress_lines_parse_and_reject_malformed() -> None:
    assert parse(PROGRESS_PREFIX + json.dumps({"stage": "loading"})) == "loading"
    for line in (
        "loading",
        PROGRESS_PREFIX + "{not json",
        PROGRESS_PREFIX + "[1]",
        PROGRESS_PREFIX + '{"stage": 3}',
    ):
        assert parse(line) is None


def test_plain_board_prints_one_line_per_change() -> None:
    out = io.StringIO()  # not a TTY
    board = ProgressBoard(out)
    board.update("prefill-0", "loading")
    board.update("decode-0", "ready")
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and "\x1b" not in out.getvalue()
    assert ROW.match(lines[0]) and "loading" in lines[0] and ROW.match(lines[1])
