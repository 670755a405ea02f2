"""`splitserve serve`: a coordinator and its worker pools as local processes, until Ctrl-C/SIGTERM."""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from engine.config import DTYPES
from engine.model_dir import MODEL_HELP
from engine.worker.settings import TRANSFER_BACKENDS, field_defaults
from splitserve.argtypes import checked, non_negative
from splitserve.cluster import MODES, ClusterSpec
from splitserve.launch import choose_log_dir, say, started
from splitserve.placement import parse_long_prefill_thresholds, parse_pins, parse_threads


def add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags shared by `serve` and `demo` (their defaults are `ClusterSpec`'s)."""
    spec = field_defaults(ClusterSpec)
    parser.add_argument("--model", default="smollm2-135m-instruct", help=MODEL_HELP)
    parser.add_argument("--prefill-workers", type=int, default=spec["prefill_workers"])
    parser.add_argument("--decode-workers", type=int, default=spec["decode_workers"])
    parser.add_argument("--mode", choices=MODES, default=spec["mode"])
    parser.add_argument("--transfer-backend", choices=TRANSFER_BACKENDS, default=spec["transfer_backend"])
    parser.add_argument(
        "--dtype", choices=DTYPES, default=spec["dtype"], help="every worker's weights and KV dtype"
    )
    parser.add_argument(
        "--long-prefill-token-threshold",
        type=checked(parse_long_prefill_thresholds),
        default={},
        help="the workers' cap on the tokens one prompt takes of a step, so prompts behind a long "
        "one start next step: N for every role, or e.g. prefill=256,decode=128 (0: off; default: "
        "the engine's, off)",
    )
    parser.add_argument("--host", default=spec["host"])
    parser.add_argument(
        "--log-dir",
        default=None,
        help="one log file per process in this directory, or '-' for stderr "
        "(default: files under $SPLITSERVE_CACHE/logs/ on a terminal and for demo, else stderr)",
    )
    parser.add_argument(
        "--insecure-control-plane",
        action="store_true",
        help="plaintext, unauthenticated control plane (default: ephemeral CurveZMQ keys per process)",
    )
    parser.add_argument(
        "--pin",
        type=checked(parse_pins),
        default={},
        help="pin each role's processes to CPUs, e.g. prefill=0,decode=1 (sets: 0+2, 0-3)",
    )
    parser.add_argument(
        "--split-pins",
        action="store_true",
        help="each worker of a pinned role on its own equal share of the role's CPUs, e.g. "
        "--mode colocated --decode-workers 2 --pin colocated=0-1 --threads colocated=1: two replicas, "
        "a core each (default: every worker of a role on the whole set)",
    )
    parser.add_argument(
        "--threads",
        type=checked(parse_threads),
        default={},
        help="torch threads per worker: N for every role, or e.g. prefill=1,decode=1",
    )
    parser.add_argument(
        "--share-idle-cores",
        action="store_true",
        help="the decode workers also run their prompt steps on the prefill workers' CPUs while those "
        "are idle (needs --pin prefill=CPUS; not for --mode colocated)",
    )
    parser.add_argument(
        "--short-prompt-lane",
        type=non_negative,
        default=field_defaults(ClusterSpec)["short_prompt_lane"],
        metavar="TOKENS",
        help="one more prefill worker on the prefill CPUs takes sequences of at most TOKENS at normal "
        "priority while the others run at idle priority, so a short prompt never waits out a long one "
        "(0: none; not for --mode colocated)",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_cluster_arguments(parser)
    parser.add_argument("--port", type=int, default=50051, help="gRPC port (0: any free port)")
    parser.add_argument(
        "--http-port", type=int, default=8000, help="OpenAI-compatible HTTP port (0: any free port)"
    )


def cluster_spec(args: argparse.Namespace, log_files_by_default: bool = False) -> ClusterSpec:
    """The spec the flags describe, with its model fetched/converted/built once (before the workers
    race for it). Flags that contradict each other are a usage error (exit 2) before anything loads."""
    from engine.model_dir import resolve_model_dir
    from splitserve.logs import configure_logging

    try:
        spec = ClusterSpec(
            model=args.model,
            prefill_workers=args.prefill_workers,
            decode_workers=args.decode_workers,
            mode=args.mode,
            host=args.host,
            port=getattr(args, "port", 0),
            http_port=getattr(args, "http_port", 0),
            transfer_backend=args.transfer_backend,
            dtype=args.dtype,
            long_prefill_token_threshold=dict(args.long_prefill_token_threshold),
            insecure_control_plane=bool(args.insecure_control_plane),
            cpus=dict(args.pin),
            threads=dict(args.threads),
            share_idle_cores=args.share_idle_cores,
            short_prompt_lane=args.short_prompt_lane,
            split_pins=args.split_pins,
        )
    except ValueError as exc:
        sys.stderr.write(f"splitserve: error: {exc}\n")
        raise SystemExit(2) from None
    configure_logging(level="warning")  # the launcher's own logs until `started` opens its log file
    spec.model = str(resolve_model_dir(args.model, say=say))
    spec.log_dir = choose_log_dir(args.log_dir, log_files_by_default)
    return spec


def run(args: argparse.Namespace) -> int:
    spec = cluster_spec(args)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with started(spec) as cluster:
        workers = ", ".join(p.name for p in cluster.processes[1:])
        print(
            f"splitserve: serving {spec.model} on {cluster.grpc_address} (gRPC) and "
            f"http://{cluster.http_address}/v1 (OpenAI) ({workers}); Ctrl-C drains and stops",
            flush=True,
        )
        stop.wait()  # protects nothing but the process's life: the servers run in the children
        codes = cluster.stop()
    print(f"splitserve: stopped ({', '.join(f'{k}={v}' for k, v in codes.items())})", flush=True)
    return 0 if all(code == 0 for code in codes.values()) else 1
