"""`make gpu-check`: every GPU check the project has, in one run of under 8 minutes, ending in one table.

    python -m splitserve.gpu_check [--out-dir DIR] [--steps kernels,bench,kvbench,e2e] [--model M]
    python -m splitserve.gpu_check --cpu-dry-run    # the same steps at toy sizes on the CPU

The steps (`splitserve.gpu_steps`), each a process of its own under its own time budget, killed with
everything it started when it runs over; a failing step does not stop the next (one after another
on the GPU, side by side in a dry run):

    kernels  tests/kernels on CUDA (Triton compiled for real)
    bench    python -m kernels.bench: each Triton kernel against its torch reference
    kvbench  kvbench ucx between two processes with CUDA buffers (cuda_ipc), ratio to a d2d copy
    e2e      a disaggregated cluster on the real model, workers on CUDA, greedy ids vs transformers

On a machine without the project's packages (the GPU machine: docs/gpu-check.md) it first unpacks
what `make gpu-stage` packed (`splitserve.gpu_stage`). Writes `table.md`, `results.json` and one log
per step into `--out-dir`. Exit status: 0 when every step passed, 1 when one did not, 2 when there is
no CUDA device (unless `--cpu-dry-run`), before anything runs. Standard library only until a step runs.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from splitserve import gpu_stage

REPO = Path(__file__).resolve().parent.parent
# seconds per step on the GPU machine (16 cores, H200); they sum to under 8 minutes
BUDGETS_S = {"kernels": 150.0, "bench": 60.0, "kvbench": 100.0, "e2e": 150.0}
DRY_RUN_BUDGET_S = 300.0  # per step: a 2-core CI machine under other test runs (seen: 150 s for the e2e)
TITLES = {
    "kernels": "kernel tests (tests/kernels)",
    "bench": "kernels.bench vs torch",
    "kvbench": "kvbench ucx, device buffers",
    "e2e": "e2e real model vs transformers",
}


@dataclass(frozen=True)
class Step:
    """One row of the table: `argv` is run with `--result FILE --work DIR` appended and must write a
    `gpu_steps.StepResult` to FILE within `budget_s` (DIR: its scratch files)."""

    name: str
    title: str
    argv: list[str]
    budget_s: float


@dataclass(frozen=True)
class Outcome:
    name: str
    title: str
    status: str
    key: str
    detail: str
    seconds: float
    budget_s: float


def cuda_device() -> str | None:
    """The name of CUDA device 0, or None where torch sees none (or is missing)."""
    try:
        import torch
    except ImportError:
        return None
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def run_step(step: Step, out_dir: Path, work_dir: Path, env: dict[str, str]) -> Outcome:
    """Run one step in a session of its own; past its budget the whole session is killed. Its log
    goes to `out_dir`, everything else it writes under `work_dir`."""
    result, log, work = work_dir / f"{step.name}.json", out_dir / f"{step.name}.log", work_dir / step.name
    work_dir.mkdir(parents=True, exist_ok=True)
    result.unlink(missing_ok=True)
    start = time.monotonic()
    with log.open("w") as log_file:
        proc = subprocess.Popen(
            [*step.argv, "--result", str(result), "--work", str(work)],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=REPO,
            start_new_session=True,
        )
        try:
            code = proc.wait(timeout=step.budget_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = None
    seconds = time.monotonic() - start
    if code is None:
        status, key, detail = "FAIL", f"over its {step.budget_s:.0f} s budget", f"killed; see {log.name}"
    elif not result.is_file():
        status, key, detail = "FAIL", f"exited {code} without a result", _tail(log)
    else:
        got = json.loads(result.read_text())
        status, key, detail = got["status"], got["key"], got["detail"]
    return Outcome(step.name, step.title, status, key, detail, seconds, step.budget_s)


def _tail(log: Path, lines: int = 4) -> str:
    return " | ".join(log.read_text(errors="replace").strip().splitlines()[-lines:])


def table(outcomes: list[Outcome]) -> str:
    """The one table: a markdown row per step."""
    rows = ["| step | status | key number | s (budget) | detail |", "|---|---|---|---|---|"]
    for o in outcomes:
        detail = o.detail.replace("|", "/")
        rows.append(f"| {o.title} | {o.status} | {o.key} | {o.seconds:.0f} ({o.budget_s:.0f}) | {detail} |")
    return "\n".join(rows)


def plan(names: list[str], dry_run: bool, model: str, no_model: str = "") -> tuple[list[Step], list[Outcome]]:
    """The steps to run, and the rows decided without running anything (e2e with no model here,
    `no_model` saying why)."""
    steps, decided = [], []
    for name in names:
        argv = [sys.executable, "-m", "splitserve.gpu_steps", name]
        argv += ["--dry-run"] if dry_run else []
        budget = DRY_RUN_BUDGET_S if dry_run else BUDGETS_S[name]
        if name == "e2e":
            if not model:
                decided.append(Outcome(name, TITLES[name], "SKIP", "no model", no_model, 0.0, budget))
                continue
            argv += ["--model", model]
        steps.append(Step(name, TITLES[name], argv, budget))
    return steps, decided


def _model(args: argparse.Namespace, prepared: gpu_stage.Prepared) -> str:
    """The e2e model: --model, else the staged GGUF, else the registered model if it is cached here."""
    if args.model or args.cpu_dry_run:
        return str(args.model or "tiny")
    if prepared.gguf is not None:
        return str(prepared.gguf)
    from engine.model_dir import cache_dir

    cached = cache_dir() / "models" / gpu_stage.MODEL
    return str(cached) if (cached / "config.json").is_file() else ""


def _env(site: Path | None, dry_run: bool) -> dict[str, str]:
    paths = [*([str(site)] if site else []), str(REPO), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p), "PYTHONUNBUFFERED": "1"}
    if dry_run:
        env["TRITON_INTERPRET"] = "1"
    else:  # the C++ CPU kernels are not built there; loading them would compile them (minutes)
        env.setdefault("SPLITSERVE_CPU_KERNELS", "0")
    return env


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="splitserve.gpu_check", description=__doc__.splitlines()[0])
    p.add_argument("--cpu-dry-run", action="store_true", help="the same steps at toy sizes on the CPU")
    p.add_argument(
        "--steps", default=",".join(TITLES), help="a comma-separated subset of " + ",".join(TITLES)
    )
    p.add_argument("--model", default="", help="e2e model (default: the staged or cached real model)")
    p.add_argument("--out-dir", type=Path, default=REPO / "out" / "gpu-check", help="table, results, logs")
    p.add_argument(
        "--work-dir", type=Path, default=None, help="the steps' scratch files (default: a temp dir)"
    )
    args = p.parse_args(argv)
    names = [n for n in args.steps.split(",") if n]
    unknown = sorted(set(names) - set(TITLES))
    if unknown:
        p.error(f"unknown steps {unknown}; choose from {','.join(TITLES)}")
    device = "cpu (dry run, toy sizes)" if args.cpu_dry_run else cuda_device()
    if device is None:
        print(
            "gpu-check: no CUDA device (torch is missing or sees none). Run it on a GPU machine (docs/gpu-check.md), "
            "or `python -m splitserve.gpu_check --cpu-dry-run` for the plumbing at toy sizes.",
            file=sys.stderr,
        )
        return 2
    prepared = gpu_stage.Prepared() if args.cpu_dry_run else gpu_stage.prepare(REPO)
    model = _model(args, prepared)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    print(f"gpu-check on {device}; e2e model: {model or 'none'}", flush=True)
    for note in prepared.notes:
        print(f"gpu-check: {note}", flush=True)
    no_model = "; ".join(prepared.notes) or "the real model is not here: make gpu-stage (docs/gpu-check.md)"
    steps, outcomes = plan(names, args.cpu_dry_run, model, no_model)
    env = _env(prepared.site, args.cpu_dry_run)
    work_dir = args.work_dir or Path(tempfile.mkdtemp(prefix="splitserve-gpu-check-"))

    def run(step: Step) -> Outcome:
        print(f"gpu-check: {step.name} (budget {step.budget_s:.0f} s) ...", flush=True)
        outcome = run_step(step, args.out_dir, work_dir, env)
        print(f"gpu-check: {step.name} {outcome.status} in {outcome.seconds:.0f} s", flush=True)
        return outcome

    # on a GPU one step at a time (each has the device to itself); a dry run has no device to share,
    # so its steps run side by side (a 2-core machine spends much of each step starting processes)
    with ThreadPoolExecutor(max_workers=len(steps) if args.cpu_dry_run and steps else 1) as pool:
        outcomes += pool.map(run, steps)
    outcomes.sort(key=lambda o: names.index(o.name))
    text = table(outcomes)
    (args.out_dir / "table.md").write_text(f"gpu-check on {device}\n\n{text}\n")
    (args.out_dir / "results.json").write_text(
        json.dumps({"device": device, "steps": [asdict(o) for o in outcomes]}, indent=1)
    )
    print(f"\n{text}\n\nlogs: {args.out_dir}/  scratch: {work_dir}/")
    return 0 if all(o.status == "PASS" for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
