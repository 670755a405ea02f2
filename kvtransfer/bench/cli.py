"""`kvbench`: benchmark the KV bulk data plane between two processes (not NIXL's KVBench).

    kvbench run --backend ucx,tcp                       # both agents on this host (loopback)
    kvbench run --backend ucx --model-shape llama-2l --tokens 128,1k,4k,32k
    kvbench run --backend ucx-get,ucx --model-shape smollm2-135m --raw-sizes 16MiB  # + raw rows, "vs raw"
    kvbench serve --backend ucx --host 0.0.0.0 --advertise 10.0.0.5 --control-port 5555
    kvbench run --backend ucx --peer tcp://10.0.0.5:5555  # the receiver is the remote `serve`
    kvbench run --backend ucx,nixl,nixl-raw --busy 2      # beside raw NIXL, 2 busy loops running
    kvbench run --backend ucx-get,nixl-raw --rounds 4     # 4 rounds: per-round "vs peer", median
    kvbench run --backend ucx,tcp,nixl-raw --netns --mtu 1500  # two "hosts": namespaces + a veth pair (root)

Prints a single-thread memcpy baseline first (with `--device cuda`: a device-to-device copy), then
one row per point with its ratio to it; with the `nixl-raw` peer row in the run, each row of ours
also gets `vs peer` (its GB/s over the peer's at the same point in the same round) and, with
`--rounds`, a summary of those ratios round by round. Exits 1 when any verification failed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shlex
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from kvtransfer.bench import agent, get_loops, model_sweep, netns, nixl_sweep, raw_sweep, report, runner
from kvtransfer.bench.bench_loops import default_ring_bytes, memcpy_gbps
from kvtransfer.bench.busy import BusyLoops
from kvtransfer.bench.report import parse_size, parse_tokens
from splitserve.argtypes import csv_of

DEFAULT_SIZES = "64KiB,1MiB,4MiB,16MiB,64MiB"
SIZES = csv_of(parse_size, "a size (64KiB, 4MiB, 1000)", lambda n: n > 0)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="kvbench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a benchmark and print a table")
    run.add_argument(
        "--backend",
        type=csv_of(str, "a backend name"),
        default=["ucx", "tcp"],
        help="ucx, ucx-stock (UCXX defaults), ucx-get (one-sided gets, raw mode), tcp, nixl (our NIXL "
        "backend; nixl-tensor, nixl-thread: its per-message registration and NIXL-progress-thread "
        "variants; nixl-get: its pull with NIXL READs, model rows only), nixl-raw (NIXL driven as "
        "nixlbench does, the peer row); the nixl ones need NIXL",
    )
    run.add_argument("--sizes", type=SIZES, default=SIZES(DEFAULT_SIZES))
    run.add_argument(
        "--depth",
        type=csv_of(int, "a depth >= 1", lambda d: d >= 1),
        default=[1],
        help="messages in flight (a sweep)",
    )
    run.add_argument(
        "--duration", type=float, default=2.0, help="seconds per measured run (after a warm-up run)"
    )
    run.add_argument("--repeats", type=int, default=3)
    run.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the backend list this many times, reversed every other round (A B, B A, ...); "
        "within a round the backends' raw runs alternate run by run, so a ratio between backends "
        "compares neighbouring measurements; prints each round's `vs peer` ratios and their median",
    )
    run.add_argument("--progress-mode", default=None, help="UCX progress mode (default: kvtransfer's)")
    run.add_argument("--ucx-opt", action="append", default=[], metavar="KEY=VALUE", help="extra UCX option")
    run.add_argument(
        "--peer", default=None, metavar="tcp://HOST:PORT", help="control endpoint of `kvbench serve`"
    )
    run.add_argument("--model-shape", default=None, help="a name from engine.shapes.SHAPES")
    run.add_argument(
        "--tokens",
        type=csv_of(parse_tokens, "a token count (128, 4k)", lambda n: n > 0),
        default=[128, 1024, 4096, 32768],
    )
    run.add_argument("--block-size", type=int, default=16)
    run.add_argument(
        "--chunk-tokens",
        type=parse_tokens,
        default=512,
        help="--model-shape, ucx-get: tokens per pulled chunk (one KVChunkReady: a prefill step's budget)",
    )
    run.add_argument(
        "--raw-sizes",
        type=SIZES,
        default=[],
        help="--model-shape: also measure raw rows of these sizes in the same run; model rows get `vs raw`",
    )
    run.add_argument("--json", type=Path, default=None, help="write rows as JSON lines")
    run.add_argument("--csv", type=Path, default=None)
    run.add_argument("--plot", type=Path, default=None, help="bandwidth vs size PNG (raw mode)")
    run.add_argument(
        "--pin-agents",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="pin the receiver and the sender agent to two distinct cores of ours",
    )
    run.add_argument(
        "--ring-bytes",
        type=parse_size,
        default=None,
        help="bytes each side rotates through (default: 4x the LLC; smaller rings measure the cache)",
    )
    run.add_argument(
        "--busy", type=int, default=0, help="busy-loop processes running beside the agents all run long"
    )
    run.add_argument(
        "--nixl-variants",
        type=csv_of(str, "a NIXL variant"),
        default=["read", "write", "read+thread", "write+thread"],
        help="NIXL variants the nixl row takes the best of (+thread: NIXL's progress thread on)",
    )
    run.add_argument(
        "--netns",
        action="store_true",
        help="run the agents in two network namespaces joined by a veth pair, with separate IPC/PID "
        "namespaces (no shared memory, no CMA: two hosts); needs root",
    )
    run.add_argument("--mtu", type=int, default=1500, help="the veth pair's MTU with --netns (9000: jumbo)")
    run.add_argument(
        "--device", default="cpu", help="where both agents' buffers live (cuda: cuda_ipc, d2d baseline)"
    )
    run.add_argument("--agent-log", type=Path, default=Path(tempfile.gettempdir()) / "kvbench-agents.log")
    serve = sub.add_parser("serve", help="run the receiver agent for a remote `kvbench run --peer`")
    serve.add_argument("--backend", choices=sorted(runner.BACKEND_ARGS), required=True)
    serve.add_argument("--host", default="0.0.0.0")
    serve.add_argument("--advertise", required=True, help="address the other host dials")
    serve.add_argument("--port", type=int, default=0)
    serve.add_argument("--control-port", type=int, default=5555)
    serve.add_argument("--num-blocks", type=int, default=8192, help="KV blocks (model-shape mode)")
    serve.add_argument("--model-shape", default=None, help="as given to the `run` side (default: raw mode)")
    serve.add_argument("--block-size", type=int, default=16)
    return p.parse_args(argv)


async def _run(args: argparse.Namespace, argv: list[str]) -> int:
    cfg = runner.BenchConfig(
        backends=args.backend,
        sizes=args.raw_sizes if args.model_shape else args.sizes,
        depths=args.depth,
        duration_s=args.duration,
        repeats=args.repeats,
        rounds=args.rounds,
        progress_mode=args.progress_mode,
        ucx_opts=args.ucx_opt,
        peer=args.peer,
        model_shape=args.model_shape,
        tokens=args.tokens if args.model_shape else [],
        block_size=args.block_size,
        chunk_tokens=args.chunk_tokens,
        command=shlex.join(["kvbench", *argv]),
        agent_log=args.agent_log.open("a"),
        pin_agents=args.pin_agents,
        ring_bytes=args.ring_bytes,
        busy=args.busy,
        nixl_variants=args.nixl_variants,
        device=args.device,
    )
    if cfg.busy < 0:
        raise SystemExit(f"--busy takes a count of busy loops >= 0, got {cfg.busy}")
    if cfg.rounds < 1:
        raise SystemExit(f"--rounds takes a count of rounds >= 1, got {cfg.rounds}")
    known = [*runner.BACKEND_ARGS, *runner.PEER_BACKENDS]
    unknown = [b for b in cfg.backends if b not in known]
    if unknown:
        raise SystemExit(f"unknown backend(s) {unknown}; choose from {sorted(known)}")
    if cfg.peer is not None and len(cfg.backends) > 1:
        raise SystemExit(f"--peer measures the one backend its `kvbench serve` runs; got {cfg.backends}")
    if get_loops.BACKEND in cfg.backends and (cfg.peer or cfg.device != "cpu"):
        print(f"{get_loops.BACKEND}: skipped (local, host memory only for now)", file=sys.stderr)
        cfg.backends = [b for b in cfg.backends if b != get_loops.BACKEND]
    missing = nixl_sweep.nixl_missing()
    for backend in [b for b in cfg.backends if b.startswith("nixl")]:
        why = missing
        if backend == "nixl-raw" and cfg.device != "cpu":
            why = why or "the nixl-raw row keeps its buffers in host memory (no --device)"
        if why:
            print(f"{backend}: skipped ({why})", file=sys.stderr)
            cfg.backends.remove(backend)
    if args.netns:
        why = netns.netns_missing() or ("--netns and --peer exclude each other" if cfg.peer else None)
        if why:
            raise SystemExit(f"--netns: {why}")
    with contextlib.ExitStack() as stack:
        if args.netns:
            cfg.netns = stack.enter_context(netns.NetnsPair(args.mtu))
            print(f"agents in namespaces {sorted(cfg.netns.names.values())}, {cfg.link}", file=sys.stderr)
        busy = stack.enter_context(BusyLoops(cfg.busy))
        if cfg.busy:
            print(f"busy loops running beside the agents: pids {busy.pids}", file=sys.stderr)
        return await _sweep(cfg, args)


async def _sweep(cfg: runner.BenchConfig, args: argparse.Namespace) -> int:
    memcpy: dict[int, float] = {}

    def memcpy_for(size: int) -> float:
        if size not in memcpy:
            memcpy[size] = memcpy_gbps(size, args.duration, args.ring_bytes, args.device)
        return memcpy[size]

    for size in cfg.sizes:
        memcpy_for(size)
    if memcpy:
        ring = report.format_size(args.ring_bytes or default_ring_bytes())
        kind = (
            f"device-to-device baseline (copy_ on {args.device}"
            if args.device != "cpu"
            else "memcpy baseline (1 thread"
        )
        print(f"{kind}, buffers rotated through {ring} per size):")
        print(report.table([{"size": report.format_size(s), "memcpy_gbps": g} for s, g in memcpy.items()]))
    shaped = list(cfg.backends) if cfg.model_shape else []
    raw_backends = [b for b in cfg.backends if b not in raw_sweep.NO_RAW_ROWS]
    progress = report.Progress(
        cfg.rounds * (len(raw_backends) * len(cfg.sizes) * len(cfg.depths) + len(shaped) * len(cfg.tokens))
    )
    rows: list[report.Row] = []
    for round_ in range(cfg.rounds):
        order = cfg.backends if round_ % 2 == 0 else cfg.backends[::-1]
        measured = await raw_sweep.raw_sweep(cfg, order, memcpy, progress) if cfg.sizes else []
        for backend in order if shaped else []:
            measured += await _model_rows(cfg, backend, memcpy_for, progress)
        rows += [{**row, "round": round_} for row in measured]
    model_sweep.add_raw_ratios(rows)
    report.add_peer_ratios(rows)
    raw_rows = [r for r in rows if r["mode"] == "raw"]
    if raw_rows:
        print(report.table(raw_rows, report.COLUMNS))
    if cfg.model_shape:
        print(report.table([r for r in rows if r["mode"] == "model"], report.MODEL_COLUMNS))
    if cfg.rounds > 1 and (summary := report.peer_summary(rows)):
        print(f"vs peer ({report.PEER}) round by round, {cfg.rounds} rounds, runs alternating within each:")
        print(summary)
    if args.json:
        report.write_json_lines(rows, args.json)
    if args.csv:
        report.write_csv(rows, args.csv)
    if args.plot and raw_rows:
        report.plot([r for r in raw_rows if r["round"] == 0], memcpy, args.plot)  # the first round
    if cfg.busy:
        print(f"{cfg.busy} busy loop(s) ran beside the agents (column `busy`)", file=sys.stderr)
    print(f"agent logs: {args.agent_log}", file=sys.stderr)
    failed = [r for r in rows if not r["verified"]]
    if failed:
        print(f"verification FAILED for {len(failed)} row(s)", file=sys.stderr)
    return 1 if failed else 0


async def _model_rows(
    cfg: runner.BenchConfig, backend: str, memcpy_for: Callable[[int], float], progress: report.Progress
) -> list[report.Row]:
    """One backend's model-shaped rows of one round."""
    if backend == report.PEER:
        return await nixl_sweep.nixl_model_sweep(cfg, memcpy_for, progress)
    return await model_sweep.model_sweep(cfg, backend, memcpy_for, progress)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.command == "serve":
        layout = (
            runner.RAW_LAYOUT
            if args.model_shape is None
            else runner.model_layout(args.model_shape, args.block_size)
        )
        agent_argv = [*runner.BACKEND_ARGS[args.backend], "--layout", json.dumps(layout.to_dict())]
        agent_argv += ["--num-blocks", str(args.num_blocks)]
        agent_argv += ["--host", args.host, "--advertise", args.advertise, "--port", str(args.port)]
        agent.main([*agent_argv, "--control-port", str(args.control_port)])
        return 0
    return asyncio.run(_run(args, argv))


if __name__ == "__main__":
    sys.exit(main())
