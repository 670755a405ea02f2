"""`splitserve coordinator`: the API process (gRPC + OpenAI HTTP + control plane + metrics) for one model.

Prints one `SPLITSERVE_READY {...}` line on stdout once gRPC, HTTP, control and metrics are bound; drains on
SIGTERM/SIGINT (stops admitting, lets in-flight requests finish within --drain-timeout) and exits 0.
Module-level imports stay light: the heavy ones happen in `run`.
"""

from __future__ import annotations

import argparse
import sys

from coordinator.config import CLI_HTTP_PORT, CoordinatorConfig, TemplateLimits
from engine.model_dir import MODEL_HELP
from engine.worker.settings import field_defaults
from splitserve.control_flags import add_control_security_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags; every default is read from CoordinatorConfig (and TemplateLimits, RoutingPolicy)."""
    c, t = field_defaults(CoordinatorConfig), field_defaults(TemplateLimits)
    parser.add_argument("--model", required=True, help=MODEL_HELP)
    parser.add_argument(
        "--served-model-name",
        default=c["served_model_name"],
        help="name clients use (default: dir name, 'tiny')",
    )
    parser.add_argument("--host", default=c["host"], help="gRPC, HTTP and metrics listen host")
    parser.add_argument("--port", type=int, default=c["port"], help="gRPC port (0 = any free)")
    parser.add_argument("--control-host", default=c["control_host"], help="ZeroMQ control listen host")
    parser.add_argument(
        "--control-port", type=int, default=c["control_port"], help="ZeroMQ control port (0 = any free)"
    )
    parser.add_argument(
        "--metrics-port", type=int, default=c["metrics_port"], help="Prometheus /metrics port (0 = any free)"
    )
    _add_key_flags(parser, "api", "accepted API key(s); none = every caller is one anonymous principal")
    _add_key_flags(parser, "admin", "AdminService key(s); none = AdminService disabled")
    parser.add_argument(
        "--admin-port",
        type=int,
        default=c["admin_port"],
        help="serve AdminService on its own listener (0 = any free) instead of the main gRPC port",
    )
    parser.add_argument("--admin-host", default=c["admin_host"], help="listen host of --admin-port")
    parser.add_argument(
        "--tls-cert", default=c["tls_cert"], help="PEM certificate chain: serve gRPC over TLS"
    )
    parser.add_argument("--tls-key", default=c["tls_key"], help="PEM private key of --tls-cert")
    parser.add_argument(
        "--tls-client-ca",
        default=c["tls_client_ca"],
        help="PEM CA bundle: require client certificates it signed (mTLS)",
    )
    parser.add_argument(
        "--insecure-grpc",
        action="store_true",
        help="allow plaintext gRPC on a non-loopback --host/--admin-host (unencrypted, spoofable)",
    )
    parser.add_argument(
        "--health-port",
        type=int,
        default=c["health_port"],
        help="also serve grpc.health.v1 alone, plaintext, on this port (kubelet gRPC probes; 0 = any)",
    )
    parser.add_argument("--health-host", default=c["health_host"], help="listen host of --health-port")
    parser.add_argument(
        "--allow-request-chat-template",
        action="store_true",
        help="let requests replace the model's chat template (template.kwargs.chat_template)",
    )
    parser.add_argument(
        "--chat-template-timeout-ms",
        type=float,
        default=t["render_timeout_s"] * 1e3,
        help="render time limit of one chat template (the call's deadline applies too)",
    )
    parser.add_argument(
        "--max-rendered-chars",
        type=int,
        default=t["max_rendered_chars"],
        help="largest rendered chat prompt, in characters",
    )
    parser.add_argument(
        "--chat-template-threads",
        type=int,
        default=t["render_threads"],
        help="threads rendering chat templates concurrently",
    )
    parser.add_argument(
        "--http-port", type=int, default=CLI_HTTP_PORT, help="OpenAI-compatible HTTP port (0 = any free)"
    )
    _add_routing_flags(parser)
    parser.add_argument("--max-queue", type=int, default=c["max_queue"], help="admission queue bound")
    parser.add_argument(
        "--max-request-bytes", type=int, default=c["max_request_bytes"], help="largest accepted request"
    )
    parser.add_argument(
        "--heartbeat-interval-ms",
        type=int,
        default=c["heartbeat_interval_ms"],
        help="worker heartbeat period",
    )
    parser.add_argument(
        "--heartbeat-timeout-ms",
        type=int,
        default=c["heartbeat_timeout_ms"],
        help="silence after which a worker is stale",
    )
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=c["drain_timeout"],
        help="seconds to finish in-flight work on SIGTERM",
    )
    add_control_security_arguments(parser)
    parser.add_argument(
        "--control-authorized-keys",
        default=c["control_authorized_keys"],
        help="dir of worker public keys (*.key) allowed on the control plane; each file name starts "
        "with the role the key may register as (prefill, decode, colocated)",
    )


def _add_routing_flags(parser: argparse.ArgumentParser) -> None:
    from coordinator.routing_policy import DISAGGREGATION, FIRST_TOKEN_FROM, TPOT_GUARDS, RoutingPolicy

    default = field_defaults(RoutingPolicy)
    parser.add_argument(
        "--disaggregation",
        choices=DISAGGREGATION,
        default=default["disaggregation"],
        help="always: prefill on a prefill worker and ship the KV; never: the decode worker prefills; "
        "conditional: per request, the path with the lower estimated TTFT (docs/architecture.md)",
    )
    parser.add_argument(
        "--local-prefill-max-tokens",
        type=int,
        default=default["local_prefill_max_tokens"],
        help="conditional: longest uncached prompt a decode worker prefills itself",
    )
    parser.add_argument(
        "--tpot-slo-ms",
        type=float,
        default=default["tpot_slo_ms"],
        help="conditional: prefill on a decode worker only while its running requests' projected TPOT "
        "stays within this (ms; 0 = off: TTFT alone decides)",
    )
    parser.add_argument(
        "--local-first-ttft-ms",
        type=float,
        default=default["local_first_ttft_ms"],
        help="conditional: prefill on a decode worker whenever its estimated TTFT is within this (ms), "
        "even where a prefill worker would be sooner, leaving the prefill workers to long prompts "
        "(0 = off: the lower estimate decides)",
    )
    parser.add_argument(
        "--ttft-slo-ms",
        type=float,
        default=default["ttft_slo_ms"],
        help="conditional: a prompt over a decode worker's --long-prefill-token-threshold prefills there "
        "only when a prefill worker's estimated TTFT is over this (ms): long prompts stall decode only "
        "to save the target (0 = off: the lower estimate decides)",
    )
    parser.add_argument(
        "--itl-stretch",
        type=float,
        default=default["itl_stretch"],
        help="conditional: prefill on a decode worker that is decoding only while the step carrying "
        "the prompt is estimated within this multiple of its decode step; else on a prefill worker "
        "(when its estimate is within --ttft-slo-ms, where set), sparing running requests' gaps "
        "(0 = off)",
    )
    parser.add_argument(
        "--tpot-guard",
        choices=TPOT_GUARDS,
        default=default["tpot_guard"],
        help="ceiling: local only while every running request's projected TPOT is within --tpot-slo-ms; "
        "increment: unless it pushes one that would meet the target over it",
    )
    parser.add_argument(
        "--first-token-from",
        choices=FIRST_TOKEN_FROM,
        default=default["first_token_from"],
        help="a shipped request's first token streams when its decode worker starts decoding it "
        "(decode: the KV transfer in TTFT, an even first gap) or when the prefill worker samples it "
        "(prefill: a lower TTFT, the transfer in the first gap)",
    )


def _add_key_flags(parser: argparse.ArgumentParser, kind: str, what: str) -> None:
    """--KIND-key, --KIND-key-env and --KIND-key-file; all three are read (see auth.read_key_entries)."""
    parser.add_argument(
        f"--{kind}-key",
        default="",
        help=f"{what}, comma-separated, each a key or sha256:<hex> of one (the command line is visible "
        "to local users: prefer sha256 entries, the environment variable or the key file)",
    )
    parser.add_argument(
        f"--{kind}-key-env",
        default=f"SPLITSERVE_{kind.upper()}_KEY",
        help=f"environment variable holding more {kind} key entries, comma-separated",
    )
    parser.add_argument(f"--{kind}-key-file", default=None, help=f"file of {kind} key entries, one a line")


def _keys(inline: str, env_var: str, path: str | None) -> tuple[str, ...]:
    from coordinator.auth import read_key_entries

    return read_key_entries(inline, env_var, [path] if path else [])


def run(args: argparse.Namespace) -> int:
    import asyncio

    import structlog

    from splitserve.logs import configure_logging

    configure_logging(role="coordinator")
    log = structlog.get_logger("coordinator")
    try:
        keys = _keys(args.api_key, args.api_key_env, args.api_key_file)
        admin_keys = _keys(args.admin_key, args.admin_key_env, args.admin_key_file)
        config = _config(args, keys, admin_keys)
    except (ValueError, OSError) as exc:  # a flag to fix: say which, exit 2 like argparse
        print(f"splitserve coordinator: error: {exc}", file=sys.stderr)
        return 2
    if not keys:
        log.warning("no API key configured: every caller is one anonymous principal and sees its requests")
    return asyncio.run(_serve(config))


def _config(
    args: argparse.Namespace, keys: tuple[str, ...], admin_keys: tuple[str, ...]
) -> CoordinatorConfig:
    from coordinator.routing_policy import RoutingPolicy

    templates = TemplateLimits(
        allow_request_template=args.allow_request_chat_template,
        render_timeout_s=args.chat_template_timeout_ms / 1e3,
        max_rendered_chars=args.max_rendered_chars,
        render_threads=args.chat_template_threads,
    )
    return CoordinatorConfig(
        model=args.model,
        served_model_name=args.served_model_name,
        host=args.host,
        port=args.port,
        control_host=args.control_host,
        control_port=args.control_port,
        metrics_port=args.metrics_port,
        http_port=args.http_port,
        api_keys=keys,
        admin_keys=admin_keys,
        admin_host=args.admin_host,
        admin_port=args.admin_port,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_client_ca=args.tls_client_ca,
        insecure_grpc=args.insecure_grpc,
        health_host=args.health_host,
        health_port=args.health_port,
        templates=templates,
        max_queue=args.max_queue,
        max_request_bytes=args.max_request_bytes,
        heartbeat_interval_ms=args.heartbeat_interval_ms,
        heartbeat_timeout_ms=args.heartbeat_timeout_ms,
        drain_timeout=args.drain_timeout,
        control_key=args.control_key,
        control_authorized_keys=args.control_authorized_keys,
        insecure_control_plane=bool(args.insecure_control_plane),
        routing=RoutingPolicy(
            args.disaggregation,
            args.local_prefill_max_tokens,
            args.tpot_slo_ms,
            args.tpot_guard,
            args.first_token_from,
            args.local_first_ttft_ms,
            args.ttft_slo_ms,
            args.itl_stretch,
        ),
    )


async def _serve(config: CoordinatorConfig) -> int:
    import asyncio
    import json
    import signal

    import structlog

    from coordinator.app import Coordinator
    from splitserve.control_auth import ControlKeyError
    from splitserve.heap import freeze_heap
    from splitserve.progress import announce

    log = structlog.get_logger("coordinator")
    announce("loading the tokenizer, binding ports")
    app = Coordinator(config)
    try:
        await app.start()
    except ControlKeyError as exc:
        log.error("bad control-plane key configuration", error=str(exc))
        return 2
    freeze_heap()  # before the readiness line: nothing is served while it runs
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
