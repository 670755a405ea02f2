"""Worker flags: each default is the settings dataclass's, and parsing them stays torch-free."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.worker.settings import WorkerSettings, add_worker_arguments, settings_from_args

REQUIRED = ["--model", "tiny", "--coordinator", "127.0.0.1:1", "--worker-id", "w", "--insecure-control-plane"]


def test_flag_defaults_are_the_settings_defaults() -> None:
    parser = argparse.ArgumentParser()
    add_worker_arguments(parser, with_mode=True)
    required = ["--model", "tiny", "--coordinator", "127.0.0.1:1", "--worker-id", "w"]
    args = parser.parse_args([*required, "--insecure-control-plane"])
    want = WorkerSettings(
        role="decode", model="tiny", coordinator="127.0.0.1:1", worker_id="w", insecure_control_plane=True
    )
    assert settings_from_args(args, "decode") == want
    assert want.transfer_backend == "ucx"


def test_worker_flags_import_without_torch() -> None:
    code = "import sys, engine.worker.settings; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "False"


def test_ucx_progress_mode_choices_are_the_transports() -> None:
    """The flag lists the modes itself (importing kvtransfer would pull torch into `--help`)."""
    from kvtransfer.ucx import PROGRESS_MODES

    parser = argparse.ArgumentParser()
    add_worker_arguments(parser, with_mode=True)
    (action,) = [a for a in parser._actions if a.dest == "ucx_progress_mode"]
    assert tuple(action.choices or ()) == PROGRESS_MODES


def test_ucx_idle_wait_default_is_the_transports() -> None:
    from kvtransfer.ucx import UcxSettings

    parser = argparse.ArgumentParser()
    add_worker_arguments(parser, with_mode=True)
    assert (
        settings_from_args(parser.parse_args(REQUIRED), "decode").ucx_idle_wait_ms
        == UcxSettings().idle_wait_ms
    )
    assert (
        settings_from_args(
            parser.parse_args([*REQUIRED, "--ucx-idle-wait-ms", "5"]), "decode"
        ).ucx_idle_wait_ms
        == 5
    )


def test_core_lease_flags() -> None:
    parser = argparse.ArgumentParser()
    add_worker_arguments(parser, with_mode=True)
    args = parser.parse_args([*REQUIRED, "--borrow-cores", "0+2-3", "--core-lease-dir", "/run/cores"])
    settings = settings_from_args(args, "decode")
    assert settings.borrow_cores == (0, 2, 3) and not settings.lend_cores
    assert settings.core_lease_dir == "/run/cores"
    default = settings_from_args(parser.parse_args([*REQUIRED, "--lend-cores"]), "prefill")
    assert default.lend_cores and default.core_lease_dir.endswith("-cores")
    with pytest.raises(SystemExit):
        parser.parse_args([*REQUIRED, "--borrow-cores", "1-0"])


def test_sharing_idle_cores_needs_the_prefill_workers_pinned() -> None:
    from splitserve.cluster import ClusterSpec

    with pytest.raises(ValueError, match="--pin prefill="):
        ClusterSpec(share_idle_cores=True)
    assert ClusterSpec(share_idle_cores=True, cpus={"prefill": (0,)}).share_idle_cores
    assert ClusterSpec(share_idle_cores=True, mode="colocated").share_idle_cores  # ignored there


def test_a_bad_core_lease_setting_fails_before_the_model_loads(tmp_path: Path) -> None:
    own = min(os.sched_getaffinity(0))
    args = ["--model", str(tmp_path / "no-model"), "--coordinator", "127.0.0.1:1", "--insecure-control-plane"]
    out = subprocess.run(
        [sys.executable, "-m", "splitserve.cli", "decode", *args, "--borrow-cores", str(own)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert "bad core lease settings" in out.stderr and "are this worker's own" in out.stderr
    assert "no-model" not in out.stderr  # it never got as far as the model


def test_an_unwritable_step_trace_directory_fails_before_the_model_loads(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")
    args = ["--model", str(tmp_path / "no-model"), "--coordinator", "127.0.0.1:1", "--insecure-control-plane"]
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "splitserve.cli",
            "decode",
            *args,
            "--step-trace-dir",
            str(tmp_path / "a-file" / "steps"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert "cannot write the step trace" in out.stderr and "a-file" in out.stderr
    assert "no-model" not in out.stderr and "Traceback" not in out.stderr


def test_short_prompts_whole_needs_a_threshold(tmp_path: Path) -> None:
    """`--short-prompts-whole` says what a short prompt is only with `--long-prefill-token-threshold`:
    alone it is refused before anything starts, naming the flag to add; with it, it reaches the engine."""
    args = ["--model", str(tmp_path / "no-model"), "--coordinator", "127.0.0.1:1", "--insecure-control-plane"]
    out = subprocess.run(
        [sys.executable, "-m", "splitserve.cli", "decode", *args, "--short-prompts-whole"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "needs long_prefill_token_threshold > 0" in out.stderr
    assert "Traceback" not in out.stderr
    parser = argparse.ArgumentParser()
    add_worker_arguments(parser, with_mode=True)
    flags = [*args, "--worker-id", "w", "--short-prompts-whole", "--long-prefill-token-threshold", "128"]
    assert settings_from_args(parser.parse_args(flags), "decode").engine.short_prompts_whole


def test_prompt_lane_flags_are_a_prefill_workers() -> None:
    prefill = argparse.ArgumentParser()
    add_worker_arguments(prefill)
    args = prefill.parse_args([*REQUIRED, "--max-prompt-tokens", "256", "--cpu-priority", "idle"])
    settings = settings_from_args(args, "prefill")
    assert (settings.max_prompt_tokens, settings.cpu_priority) == (256, "idle")
    decode = argparse.ArgumentParser()
    add_worker_arguments(decode, with_mode=True)
    with pytest.raises(SystemExit):
        decode.parse_args([*REQUIRED, "--max-prompt-tokens", "256"])


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"role": "prefill", "cpu_priority": "idle", "lend_cores": True}, "lend from a normal-priority"),
        ({"role": "prefill", "max_prompt_tokens": -1}, "--max-prompt-tokens must be >= 0"),
        ({"role": "prefill", "cpu_priority": "low"}, "--cpu-priority must be one of"),
        ({"role": "decode", "max_prompt_tokens": 64}, "set a prefill worker's lane"),
    ],
)
def test_a_lane_that_cannot_work_is_refused(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        WorkerSettings(model="tiny", coordinator="c:1", worker_id="w", insecure_control_plane=True, **fields)  # type: ignore[arg-type]


def test_idle_priority_reaches_every_thread_and_the_threads_started_after() -> None:
    code = (
        "import os, threading\n"
        "threading.Thread(target=threading.Event().wait, daemon=True).start()\n"
        "from splitserve.placement import run_at_idle_priority\n"
        "run_at_idle_priority()\n"
        "t = threading.Thread(target=threading.Event().wait, daemon=True); t.start()\n"
        "print(sorted({os.sched_getscheduler(int(tid)) for tid in os.listdir('/proc/self/task')}), len(os.listdir('/proc/self/task')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.split() == [f"[{os.SCHED_IDLE}]", "3"]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--mode", "colocated", "--short-prompt-lane", "64"], "colocated clusters have none"),
        (["--share-idle-cores"], "--pin prefill=CPUS"),
    ],
)
def test_contradicting_cluster_flags_are_a_usage_error_before_the_model(
    flags: list[str], message: str, tmp_path: Path
) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "splitserve.cli", "serve", "--model", str(tmp_path / "no-model"), *flags],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert message in out.stderr and "Traceback" not in out.stderr
    assert "no-model" not in out.stderr  # it never got as far as the model
