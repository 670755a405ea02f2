"""The steps of `make gpu-check`, one per process: `python -m splitserve.gpu_steps STEP --result FILE`.

Each step runs the project's own entry point for its check (pytest, `kernels.bench`, `kvbench`, a
`LocalCluster`), reads that entry point's machine-readable output, and writes one `StepResult` as JSON
to `--result`: PASS/FAIL/SKIP, the key number, and a detail line. `splitserve.gpu_check` runs the steps
under their time budgets and prints the table. `--dry-run` runs each at toy sizes on the CPU (Triton
interpreted), which is what the test of `make gpu-check` does.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"
# kvbench on CUDA: sizes a KV transfer uses; rings of 256 MiB exceed 4x the H200's 60 MB L2
KV_SIZES = "1MiB,4MiB,16MiB,64MiB"
KV_RING = "256MiB"
# kvbench's model-shaped push (staging buffers on the device), by dry run or not
KV_PUSH_TOKENS = {False: "1k,4k", True: "64"}
E2E_TOKENS = 48


@dataclass(frozen=True)
class StepResult:
    status: str  # PASS, FAIL or SKIP
    key: str  # the number that matters, with its unit
    detail: str = ""


@dataclass(frozen=True)
class StepContext:
    dry_run: bool
    device: str  # "cuda" or, in a dry run, "cpu"
    work: Path  # this step's files (junit XML, JSON rows, cluster logs)
    model: str  # e2e: a checkpoint directory, a .gguf file, a registered name, or "" (none here)


def _python(argv: list[str]) -> tuple[int, str]:
    """Run `python ARGV`, its output streamed into ours (the step's log, readable even when the
    step is killed at its budget); returns the exit status and the last lines."""
    proc = subprocess.Popen(
        [sys.executable, *argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=os.environ
    )
    assert proc.stdout is not None
    tail: deque[str] = deque(maxlen=6)
    for line in proc.stdout:
        sys.stdout.write(line)
        sys.stdout.flush()
        if line.strip():
            tail.append(line.strip())
    return proc.wait(), " | ".join(tail)


def kernel_tests(ctx: StepContext) -> StepResult:
    """tests/kernels on the device (their DEVICE is CUDA wherever torch sees one; Triton compiles for
    real); the dry run runs two quick ones (`make test` runs the whole file, the third of which starts
    a process of its own)."""
    junit = ctx.work / "kernels.xml"
    argv = ["-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}"]
    if ctx.dry_run:
        argv += ["tests/kernels/test_dispatch.py", "-k", "not importing"]
    else:
        argv += ["tests/kernels", "-n", "8", "--dist", "loadgroup"]
    code, tail = _python(argv)
    if not junit.is_file():
        return StepResult(FAIL, f"pytest exited {code}", tail)
    root = ET.parse(junit).getroot()
    suite = root.find("testsuite") if root.tag == "testsuites" else root
    assert suite is not None
    counts = {k: int(suite.get(k, "0")) for k in ("tests", "failures", "errors", "skipped")}
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    key = f"{passed} passed, {counts['failures'] + counts['errors']} failed, {counts['skipped']} skipped"
    ok = code == 0 and passed > 0
    return StepResult(PASS if ok else FAIL, key, "" if ok else tail)


def kernel_bench(ctx: StepContext) -> StepResult:
    """`python -m kernels.bench`: every Triton kernel against its torch reference (bf16, full sizes)."""
    rows_path = ctx.work / "kernels-bench.json"
    argv = ["-m", "kernels.bench", "--json", str(rows_path), "--device", ctx.device]
    if ctx.dry_run:
        argv += ["--shape", "tiny", "--dtype", "float32"]
    code, tail = _python(argv)
    if not rows_path.is_file():
        return StepResult(FAIL, f"kernels.bench exited {code}", tail)
    rows = json.loads(rows_path.read_text())
    speedups = [r["torch_ms"] / r["triton_ms"] for r in rows]
    key = f"{len(rows)} kernels, speed-up {min(speedups):.2f}x..{max(speedups):.2f}x"
    detail = f"max rel diff {max(r['rel_diff'] for r in rows):.1e}; " + ", ".join(
        f"{r['name'].split()[0]} {s:.2f}x" for r, s in zip(rows, speedups, strict=True)
    )
    return StepResult(PASS if code == 0 else FAIL, key, detail if code == 0 else f"{tail}; {detail}")


def _kvbench_rows(ctx: StepContext, name: str, args: list[str]) -> tuple[int, str, list[dict[str, Any]]]:
    """One `kvbench run --backend ucx --device DEVICE ARGS`: exit status, last lines, JSON rows."""
    rows_path = ctx.work / f"{name}.jsonl"
    argv = ["-m", "kvtransfer.bench.cli", "run", "--backend", "ucx", "--device", ctx.device, *args]
    argv += ["--json", str(rows_path), "--agent-log", str(ctx.work / f"{name}-agents.log")]
    code, tail = _python(argv)
    rows = [json.loads(line) for line in rows_path.read_text().splitlines()] if rows_path.is_file() else []
    return code, tail, rows


def kvbench(ctx: StepContext) -> StepResult:
    """kvbench between two agent processes, buffers on the device, over UCX (cuda_ipc on a GPU),
    each size's ratio to a device-to-device copy of the same rotation; then a prompt's KV in the
    real model's block layout pushed between fragmented pools, so packed messages go through
    staging buffers (a gather, the transport's read, a scatter: stream order matters) and must land
    verified. Should the raw rows fail on a GPU, one size again with UCX progressed by the thread
    that holds the CUDA context (`--progress-mode polling`) says whether UCXX's progress thread,
    which has none, is the cause."""
    sizes, ring, duration, repeats = (
        ("64KiB", "1MiB", "0.05", "1") if ctx.dry_run else (KV_SIZES, KV_RING, "0.5", "2")
    )
    common = ["--ring-bytes", ring, "--duration", duration, "--repeats", repeats]
    code, tail, rows = _kvbench_rows(ctx, "kvbench", ["--sizes", sizes, *common])
    shape = ["--model-shape", "smollm2-135m", "--tokens", KV_PUSH_TOKENS[ctx.dry_run], "--repeats", repeats]
    push_code, push_tail, push_rows = _kvbench_rows(ctx, "kvbench-push", shape)
    pushed = push_code == 0 and bool(push_rows) and all(r["verified"] for r in push_rows)
    ok = code == 0 and bool(rows) and all(r["verified"] for r in rows) and pushed
    if rows:
        big = max(rows, key=lambda r: r["size_bytes"])
        baseline = "memcpy" if ctx.device == "cpu" else "d2d"
        key = f"{big['size']}: {big['gbps']:.1f} GB/s = {big['ratio']:.2f}x {baseline}"
        detail = "; ".join(f"{r['size']} {r['gbps']:.1f} GB/s ({r['ratio']:.2f}x)" for r in rows)
        detail += f"; lanes {big['transport']}; pushed model-shaped, staged: "
        detail += (
            ", ".join(f"{r['tokens']} tokens {r['gbps']:.1f} GB/s verified" for r in push_rows)
            if pushed
            else f"not verified (exit {push_code}: {push_tail})"
        )
        if ok and not ctx.dry_run and "cuda_ipc" not in big["transport"]:
            return StepResult(FAIL, key, "no cuda_ipc lane: UCX fell back; " + detail)
    else:
        key, detail = f"kvbench exited {code}", tail
    if ok:
        return StepResult(PASS, key, detail)
    if not ctx.dry_run:
        code2, _, rows2 = _kvbench_rows(
            ctx, "kvbench-polling", ["--sizes", "16MiB", *common, "--progress-mode", "polling"]
        )
        again = "verified" if code2 == 0 and rows2 and all(r["verified"] for r in rows2) else "failed too"
        detail += f"; 16MiB with --progress-mode polling: {again}"
    return StepResult(FAIL, key, "not verified; " + detail if rows else detail)


def end_to_end(ctx: StepContext) -> StepResult:
    """A disaggregated cluster (1 prefill + 1 decode worker, KV over UCX) with its workers on the
    device, serving the demo's chat prompt greedily; the token ids must be transformers' greedy
    continuation on the same device."""
    if not ctx.model:
        return StepResult(SKIP, "no model", "the real model is not on this machine (make gpu-stage)")
    from engine.model_dir import resolve_model_dir
    from splitserve.cluster import ClusterSpec, LocalCluster

    model_dir = resolve_model_dir(ctx.model, say=print)
    ids = _demo_prompt(model_dir)
    key_ = secrets.token_urlsafe(24)
    device = ["--device", ctx.device]
    if ctx.dry_run:  # the CPU default sizes the pool for long prompts: 256 MiB per worker to zero and map
        device += ["--num-gpu-blocks", "256"]
    spec = ClusterSpec(
        model=str(model_dir),
        transfer_backend="ucx",
        prefill_args=device,
        decode_args=device,
        env={"SPLITSERVE_API_KEY": key_},
        log_dir=ctx.work / "cluster-logs",
    )
    with LocalCluster(spec, ready_timeout=240) as cluster:
        served, timings = asyncio.run(_serve(cluster.grpc_address, key_, ids))
        codes = cluster.stop()
    want, eos = transformers_greedy(model_dir, ids, E2E_TOKENS, ctx.device)
    served, want = _without_eos(served, eos), _without_eos(want, eos)
    same = _common_prefix(served, want)
    key = f"{same}/{len(want)} tokens = transformers"
    detail = f"TTFT {timings['first_token']:.1f} ms (prefill {timings['prefill']:.1f}, "
    detail += f"kv_transfer {timings['kv_transfer']:.1f}), decode {timings['decode']:.1f} ms; "
    detail += f"{_lanes(ctx.work / 'cluster-logs')}; exit codes {sorted(set(codes.values()))}"
    ok = served == want and all(c == 0 for c in codes.values())
    return StepResult(PASS if ok else FAIL, key, detail)


def _demo_prompt(model_dir: Path) -> list[int]:
    from transformers import AutoTokenizer

    from splitserve.demo import QUESTION, SYSTEM

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False))


async def _serve(address: str, api_key: str, ids: list[int]) -> tuple[list[int], dict[str, float]]:
    from splitserve.client import Client

    async with Client(address, api_key=api_key) as client:
        done = await client.complete(ids, max_tokens=E2E_TOKENS, temperature=0.0, timeout=120)
    t = done.timings
    assert t is not None
    names = ("prefill", "kv_transfer", "first_token", "decode")
    return done.token_ids, {n: float(getattr(t, f"{n}_ms")) for n in names}


def transformers_greedy(
    model_dir: Path, ids: list[int], max_new_tokens: int, device: str
) -> tuple[list[int], set[int]]:
    """transformers' greedy continuation of `ids` on `device` (float32), and the EOS ids it stops at."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, device_map=device).eval()
    with torch.inference_mode():
        x = torch.tensor([ids], device=device)
        y = model.generate(
            x,
            attention_mask=torch.ones_like(x),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            pad_token_id=0,
        )
    eos = model.generation_config.eos_token_id
    return [int(t) for t in y[0, len(ids) :]], set(eos if isinstance(eos, list) else [eos])


def _without_eos(ids: list[int], eos: set[int]) -> list[int]:
    return ids[:-1] if ids and ids[-1] in eos else ids


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def _lanes(log_dir: Path) -> str:
    """The UCX lanes the workers logged for their KV peer ("kv peer connected")."""
    for log in sorted(log_dir.glob("*.log")):
        for line in log.read_text(errors="replace").splitlines():
            if "kv peer connected" in line and "transports" in line:
                try:
                    return f"lanes {json.loads(line)['transports']}"
                except (ValueError, KeyError):
                    return line[-200:]
    return "lanes not logged"


STEPS: dict[str, Callable[[StepContext], StepResult]] = {
    "kernels": kernel_tests,
    "bench": kernel_bench,
    "kvbench": kvbench,
    "e2e": end_to_end,
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="splitserve.gpu_steps", description=__doc__.splitlines()[0])
    p.add_argument("step", choices=sorted(STEPS))
    p.add_argument("--result", type=Path, required=True, help="where the StepResult JSON goes")
    p.add_argument("--work", type=Path, required=True, help="this step's scratch directory")
    p.add_argument("--dry-run", action="store_true", help="toy sizes on the CPU")
    p.add_argument("--model", default="", help="e2e: checkpoint dir, .gguf, registered name ('': none)")
    args = p.parse_args(argv)
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    ctx = StepContext(args.dry_run, "cpu" if args.dry_run else "cuda", work, args.model)
    try:
        result = STEPS[args.step](ctx)
    except Exception as exc:  # the table shows it; the traceback is in this step's log
        import traceback

        traceback.print_exc()
        result = StepResult(FAIL, type(exc).__name__, str(exc)[:300])
    if result.status == FAIL:  # what the processes it started said, into this step's log
        for log in sorted(work.rglob("*.log")):
            print(
                f"--- last lines of {log}:\n" + "\n".join(log.read_text(errors="replace").splitlines()[-40:])
            )
    args.result.write_text(json.dumps(asdict(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
