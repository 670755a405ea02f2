"""`splitserve coordinator`: the API process (gRPC + control plane + metrics) for one served model.

Prints one `SPLITSERVE_READY {...}` line on stdout once gRPC, control and metrics are bound; drains on
SIGTERM/SIGINT (stops admitting, lets in-flight requests finish within --drain-timeout) and exits 0.
Module-level imports stay light: the heavy ones happen in `run`.
"""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

from engine.model_dir import MODEL_HELP

if TYPE_CHECKING:
    from coordinator.app import CoordinatorConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help=MODEL_HELP)
    parser.add_argument(
        "--served-model-name", default=None, help="name clients use (default: dir name, 'tiny')"
    )
    parser.add_argument("--host", default="127.0.0.1", help="gRPC and metrics listen host")
    parser.add_argument("--port", type=int, default=50051, help="gRPC port (0 = any free)")
    parser.add_argument("--control-host", default="127.0.0.1", help="ZeroMQ control listen host")
    parser.add_argument("--control-port", type=int, default=5555, help="ZeroMQ control port (0 = any free)")
    parser.add_argument(
        "--metrics-port", type=int, default=9100, help="Prometheus /metrics port (0 = any free)"
    )
    parser.add_argument(
        "--api-key-env",
        default="SPLITSERVE_API_KEY",
        help="environment variable holding the accepted API key(s), comma-separated; unset = no auth",
    )
    parser.add_argument("--max-queue", type=int, default=256, help="admission queue bound")
    parser.add_argument("--max-request-bytes", type=int, default=1 << 20, help="largest accepted request")
    parser.add_argument("--heartbeat-interval-ms", type=int, default=500, help="worker heartbeat period")
    parser.add_argument(
        "--heartbeat-timeout-ms", type=int, default=3000, help="silence after which a worker is stale"
    )
    parser.add_argument(
        "--drain-timeout", type=float, default=30.0, help="seconds to finish in-flight work on SIGTERM"
    )


def run(args: argparse.Namespace) -> int:
    import asyncio

    from coordinator.app import CoordinatorConfig
    from splitserve.logs import configure_logging

    configure_logging(role="coordinator")
    keys = tuple(k.strip() for k in os.environ.get(args.api_key_env, "").split(",") if k.strip())
    config = CoordinatorConfig(
        model=args.model,
        served_model_name=args.served_model_name,
        host=args.host,
        port=args.port,
        control_host=args.control_host,
        control_port=args.control_port,
        metrics_port=args.metrics_port,
        api_keys=keys,
        max_queue=args.max_queue,
        max_request_bytes=args.max_request_bytes,
        heartbeat_interval_ms=args.heartbeat_interval_ms,
        heartbeat_timeout_ms=args.heartbeat_timeout_ms,
        drain_timeout=args.drain_timeout,
    )
    return asyncio.run(_serve(config))


async def _serve(config: CoordinatorConfig) -> int:
    import asyncio
    import json
    import signal

    import structlog

    from coordinator.app import Coordinator
    from splitserve.progress import announce

    log = structlog.get_logger("coordinator")
    announce("loading the tokenizer, binding ports")
    app = Coordinator(config)
    await app.start()
    print("SPLITSERVE_READY " + json.dumps(app.ready_info()), flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    stopper = asyncio.create_task(stop.wait())
    await asyncio.wait({stopper, app.plane_task}, return_when=asyncio.FIRST_COMPLETED)
    if app.plane_task.done():  # the control plane died: nothing can be served
        log.error("control plane stopped", error=repr(app.plane_task.exception()))
        await app.stop()
        return 1
    log.info("draining", timeout_s=config.drain_timeout)
    await app.drain(config.drain_timeout)
    await app.stop()
    log.info("stopped")
    return 0
