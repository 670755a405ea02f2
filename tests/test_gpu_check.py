"""`make gpu-check`: its plumbing and its one table, proven on the CPU (a dry run at toy sizes), and
the staging that carries the real model to a GPU machine in two parts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

from splitserve import gpu_check, gpu_stage

STEPS = ["kernels", "bench", "kvbench", "e2e"]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "splitserve.gpu_check", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=1250, check=False, env=os.environ)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA refusal")
def test_without_cuda_it_stops_at_once_saying_so(tmp_path: Path) -> None:
    done = _run("--out-dir", str(tmp_path))
    assert done.returncode == 2
    assert "no CUDA device" in done.stderr and "--cpu-dry-run" in done.stderr
    assert not list(tmp_path.iterdir())  # nothing ran


@pytest.mark.slow
@pytest.mark.timeout(1300)
def test_the_cpu_dry_run_runs_every_step_and_ends_in_one_table(tmp_path: Path) -> None:
    done = _run("--cpu-dry-run", "--out-dir", str(tmp_path), "--work-dir", str(tmp_path / "work"))
    assert done.returncode == 0, done.stdout + done.stderr
    results = json.loads((tmp_path / "results.json").read_text())
    assert [s["name"] for s in results["steps"]] == STEPS
    assert all(s["status"] == "PASS" for s in results["steps"]), results
    by_name = {s["name"]: s for s in results["steps"]}
    assert by_name["kernels"]["key"].startswith("2 passed, 0 failed")
    assert by_name["bench"]["key"].startswith("5 kernels")
    assert "GB/s" in by_name["kvbench"]["key"] and "ucx:" in by_name["kvbench"]["detail"]
    assert "staged: 64 tokens" in by_name["kvbench"]["detail"]  # the push through staging buffers
    assert by_name["e2e"]["key"].endswith("tokens = transformers")
    table = done.stdout[done.stdout.index("| step |") :].split("\n\n")[0].splitlines()
    assert len(table) == 2 + len(STEPS) and (tmp_path / "table.md").read_text().count("| PASS |") == 4
    assert {p.name for p in tmp_path.iterdir()} == {"table.md", "results.json", "work"} | {
        f"{s}.log" for s in STEPS
    }  # what a GPU machine's $OUT returns: at most 8 files


def test_a_failing_or_overrunning_step_fails_its_row_and_the_exit_code_only(tmp_path: Path) -> None:
    ok = "import json, sys; a = sys.argv; open(a[a.index('--result') + 1], 'w').write(json.dumps("
    ok += "{'status': 'PASS', 'key': '1 x', 'detail': ''}))"
    steps = [
        gpu_check.Step("a", "writes a result", [sys.executable, "-c", ok], 30),
        gpu_check.Step("b", "dies", [sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"], 30),
        gpu_check.Step("c", "hangs", [sys.executable, "-c", "import time; time.sleep(600)"], 1),
        gpu_check.Step("d", "after them", [sys.executable, "-c", ok], 30),
    ]
    outcomes = [gpu_check.run_step(s, tmp_path, tmp_path / "work", dict(os.environ)) for s in steps]
    assert [o.status for o in outcomes] == ["PASS", "FAIL", "FAIL", "PASS"]
    assert outcomes[1].key == "exited 3 without a result" and "boom" in outcomes[1].detail
    assert outcomes[2].key == "over its 1 s budget" and outcomes[2].seconds < 30
    assert gpu_check.table(outcomes).count("\n") == 1 + len(steps)


def test_e2e_without_a_model_is_a_skipped_row_saying_why() -> None:
    steps, decided = gpu_check.plan(STEPS, dry_run=False, model="", no_model="part 0 is missing")
    assert [s.name for s in steps] == STEPS[:3]
    assert [(o.name, o.status, o.detail) for o in decided] == [("e2e", "SKIP", "part 0 is missing")]
    assert sum(gpu_check.BUDGETS_S.values()) < 8 * 60


def test_model_parts_join_only_to_the_manifests_digest(tmp_path: Path) -> None:
    src = tmp_path / "model.gguf"
    src.write_bytes(os.urandom(3000))
    a, b = tmp_path / "part0", tmp_path / "part1"
    gpu_stage.split_file(src, a, b, 1000)
    assert (a.stat().st_size, b.stat().st_size) == (1000, 2000)
    joined = gpu_stage.join_parts([a, b], tmp_path / "joined.gguf", gpu_stage.sha256(src))
    assert joined.read_bytes() == src.read_bytes()
    with pytest.raises(gpu_stage.StageError, match="SHA-256"):
        gpu_stage.join_parts([b, a], tmp_path / "swapped.gguf", gpu_stage.sha256(src))
    assert not (tmp_path / "swapped.gguf").exists()


def test_the_packed_site_stores_identical_libraries_once_and_drops_static_ones(tmp_path: Path) -> None:
    import zipfile

    wheel = tmp_path / "libdemo-1.0-py3-none-any.whl"
    lib = os.urandom(4096)
    with zipfile.ZipFile(wheel, "w") as zf:
        for name in ("libdemo/lib/libx.so", "libdemo/lib/libx.so.0", "libdemo/lib/libx.so.0.0.0"):
            zf.writestr(name, lib)
        zf.writestr("libdemo/lib/libx.a", b"static")
        zf.writestr("libdemo/include/x.h", b"header")
        zf.writestr("libdemo/__init__.py", b"")
    archive = tmp_path / "site.tar.xz"
    gpu_stage.pack_site([wheel], archive)
    with tarfile.open(archive) as tar:
        members = {m.name: m for m in tar.getmembers()}
        tar.extractall(tmp_path / "site", filter="tar")
    assert set(members) == {f"libdemo/lib/libx.so{s}" for s in ("", ".0", ".0.0.0")} | {"libdemo/__init__.py"}
    assert [m.name for m in members.values() if m.isfile() and m.name.endswith(".so.0.0.0")]
    assert sum(m.issym() for m in members.values()) == 2
    assert (tmp_path / "site/libdemo/lib/libx.so").read_bytes() == lib


def test_the_two_calls_stage_the_model_and_a_cold_second_call_says_what_is_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    repo, model = tmp_path / "repo", tmp_path / "m.gguf"
    model.write_bytes(os.urandom(5000))
    (repo / ".gpu/call1").mkdir(parents=True)
    (repo / ".gpu/call2").mkdir()
    gpu_stage.split_file(model, repo / ".gpu/call1/model.part0", repo / ".gpu/call2/model.part1", 3000)
    manifest = json.dumps({"gguf": "m.gguf", "sha256": gpu_stage.sha256(model), "bytes": 5000})
    for call in ("call1", "call2"):
        (repo / ".gpu" / call / "manifest.json").write_text(manifest)
    monkeypatch.setenv("SPLITSERVE_GPU_STAGE", str(tmp_path / "cold"))
    monkeypatch.chdir(repo)
    saved = (repo / ".gpu/call1/model.part0").read_bytes()
    (repo / ".gpu/call1/model.part0").unlink()  # call 1 ran on a machine that went back
    cold = gpu_stage.prepare(repo)
    assert cold.gguf is None and "part 0 is not on this machine" in cold.notes[0]
    (repo / ".gpu/call1/model.part0").write_bytes(saved)
    monkeypatch.setenv("SPLITSERVE_GPU_STAGE", str(tmp_path / "warm"))
    assert gpu_stage.main(["receive"]) == 0  # call 1: part 0 leaves the tree the tool replaces
    assert not (repo / ".gpu/call1/model.part0").exists()
    warm = gpu_stage.prepare(repo)  # call 2
    assert warm.gguf == tmp_path / "warm" / "m.gguf" and warm.gguf.read_bytes() == model.read_bytes()
    assert warm.site is None and not warm.notes
