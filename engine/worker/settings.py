"""Worker command-line flags and the settings they resolve to (shared by prefill, decode, colocated).

Every flag is also settable as `SPLITSERVE_<FLAG>` (splitserve/cli.py). Each default is written once,
in the dataclass (`WorkerSettings`, `EngineConfig`); the flags read it from there. This module stays
import-light (no torch, no zmq) because `splitserve --help` imports it.
"""

from __future__ import annotations

import argparse
import os
import socket
import tempfile
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

from engine.config import DTYPES, EngineConfig
from engine.model_dir import MODEL_HELP
from splitserve.argtypes import non_negative_float, positive
from splitserve.control_flags import WORKER_ID_PATTERN, add_control_security_arguments
from splitserve.placement import parse_cpu_set

ROLES = ("prefill", "decode", "colocated")
TRANSFER_BACKENDS = ("ucx", "tcp", "nixl")  # nixl: the `nixl` extra
PULL_BACKENDS = ("ucx", "nixl")  # the backends with one-sided reads (kvtransfer.pull)
KV_TRANSFER_MODES = ("auto", "push", "pull")
CPU_PRIORITIES = ("normal", "idle")  # idle: SCHED_IDLE (splitserve.placement.run_at_idle_priority)


@dataclass(slots=True)
class WorkerSettings:
    """Everything one worker process needs besides the loaded model. Created once, never mutated."""

    role: str
    model: str
    coordinator: str
    worker_id: str
    engine: EngineConfig = field(default_factory=EngineConfig)
    served_model_name: str = ""
    advertise_host: str = "127.0.0.1"
    control_port: int = 0
    transfer_port: int = 0
    transfer_backend: str = "ucx"
    metrics_port: int = 0
    drain_timeout_s: float = 30.0
    lease_ms: int = 10_000  # P's progress (D) or D's answer (P) must come within this
    queue_lease_ms: int = 120_000  # D: a reservation whose prefill P has not started is held this long
    register_timeout_s: float = 120.0
    kv_message_bytes: int = 64 << 20  # kvtransfer's largest message; P and D must agree
    kv_direct_bytes: int = 256 << 10  # shorter runs of blocks are packed (gather/scatter)
    ucx_progress_mode: str = "hybrid"  # kvtransfer.ucx.PROGRESS_MODES; docs/kvtransfer.md measures them
    ucx_idle_wait_ms: int = 100  # kvtransfer.ucx.UcxSettings.idle_wait_ms (a test keeps them equal)
    kv_transfer_mode: str = "auto"  # decode side: P pushes, or D reads (UCX gets, NIXL READs); `pulls`
    control_key: str = ""  # this worker's .key_secret file (CURVE client and server key)
    coordinator_public_key: str = ""  # the coordinator's .key file (the DEALER verifies the server)
    insecure_control_plane: bool = False  # plaintext, unauthenticated control plane (logs a warning)
    # core leases (engine/worker/core_lease.py): lend this worker's CPUs while it idles; run prompt
    # steps on `borrow_cores` too while their leases are free
    lend_cores: bool = False
    borrow_cores: tuple[int, ...] = ()
    core_lease_dir: str = ""  # the host's lease files; "": <temp dir>/splitserve-<uid>-cores
    # prefill lanes (coordinator/router.py, "Prompt lanes"): the longest sequence this prefill worker
    # takes (0: any), and its CPU priority (idle: it computes only while its CPUs have nothing else)
    max_prompt_tokens: int = 0
    cpu_priority: str = "normal"
    step_trace_dir: str = ""  # a JSON line per model step there (engine/worker/step_trace.py); "": none

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if WORKER_ID_PATTERN.fullmatch(self.worker_id) is None:
            raise ValueError(
                f"--worker-id {self.worker_id[:64]!r}: use 1-128 characters of A-Z a-z 0-9 . _ : - "
                "(starting with a letter or digit)"
            )
        if not self.insecure_control_plane and not (self.control_key and self.coordinator_public_key):
            raise ValueError(
                "the control plane is authenticated by default: give --control-key (this worker's "
                ".key_secret) and --coordinator-public-key, or --insecure-control-plane"
            )
        if self.transfer_backend not in TRANSFER_BACKENDS:
            raise ValueError(
                f"--transfer-backend must be one of {TRANSFER_BACKENDS}, got {self.transfer_backend!r}"
            )
        if self.kv_transfer_mode not in KV_TRANSFER_MODES:
            raise ValueError(
                f"--kv-transfer-mode must be one of {KV_TRANSFER_MODES}, got {self.kv_transfer_mode!r}"
            )
        if self.kv_transfer_mode == "pull" and self.transfer_backend not in PULL_BACKENDS:
            raise ValueError(
                "--kv-transfer-mode pull reads with UCX gets or NIXL READs: it needs --transfer-backend "
                "ucx or nixl"
            )
        if self.lease_ms < 1 or self.queue_lease_ms < 1:
            raise ValueError(
                f"--lease-ms and --queue-lease-ms must be positive, got {self.lease_ms}, {self.queue_lease_ms}"
            )
        self._check_lane()
        if not self.served_model_name:
            self.served_model_name = default_served_name(self.model)
        if not self.core_lease_dir:
            self.core_lease_dir = os.path.join(tempfile.gettempdir(), f"splitserve-{os.getuid()}-cores")

    def _check_lane(self) -> None:
        """ValueError for a lane setting that cannot work: either outside a prefill worker (a decode
        worker's prompts are the router's `--local-prefill-max-tokens`), a negative cap, or an idle
        worker that lends its cores (a lender at normal priority on the same cores would wait for its
        lease while the idle one cannot run: lanes on shared cores lend from the normal one)."""
        if self.cpu_priority not in CPU_PRIORITIES:
            raise ValueError(f"--cpu-priority must be one of {CPU_PRIORITIES}, got {self.cpu_priority!r}")
        if self.max_prompt_tokens < 0:
            raise ValueError(f"--max-prompt-tokens must be >= 0 (0: any), got {self.max_prompt_tokens}")
        lane = self.max_prompt_tokens > 0 or self.cpu_priority != "normal"
        if lane and self.role != "prefill":
            raise ValueError("--max-prompt-tokens and --cpu-priority set a prefill worker's lane")
        if self.idle_priority and self.lend_cores:
            raise ValueError(
                "--cpu-priority idle with --lend-cores: an idle-priority worker would hold its cores' "
                "leases while anything else on them runs first; lend from a normal-priority worker"
            )

    @property
    def idle_priority(self) -> bool:
        """Whether this worker runs at SCHED_IDLE (`--cpu-priority idle`)."""
        return self.cpu_priority == "idle"

    @property
    def pulls(self) -> bool:
        """Whether this decode worker reads the KV itself. `auto` pulls over UCX and NIXL: pushing
        keeps D's receives posted (and its event loop polling UCX) through P's whole prefill, which
        cost D's decode steps 1.6x their time in the serving benchmark (docs/kvtransfer.md,
        "One-sided pull"), and over NIXL a push pays an announcement and an answer a message
        (NIXL's READs of P's blocks: 1.7-2x faster, kvtransfer.nixl_rma); TCP pushes. Per peer,
        `auto` still pushes where UCX's lanes are all TCP (`TransferPlane.pulls_over`)."""
        if self.role != "decode":
            return False  # a prefill worker follows each Reserved.pull; a colocated one moves no KV
        return self.kv_transfer_mode == "pull" or (
            self.kv_transfer_mode == "auto" and self.transfer_backend in PULL_BACKENDS
        )

    @property
    def coordinator_address(self) -> str:
        return self.coordinator if "://" in self.coordinator else f"tcp://{self.coordinator}"


def default_served_name(model: str) -> str:
    """The coordinator's default: "tiny" for the built-in model, else the checkpoint directory's name."""
    if model == "tiny" or model.startswith("tiny:"):
        return "tiny"
    return Path(model).resolve().name


def field_defaults(cls: Any) -> dict[str, Any]:
    """The field defaults of a settings dataclass, for the flags that set those fields."""
    return {f.name: f.default for f in fields(cls) if f.default is not MISSING}


def add_worker_arguments(parser: argparse.ArgumentParser, *, with_mode: bool = False) -> None:
    """The flags of `splitserve prefill|decode`; `with_mode` adds `--mode decode|colocated`."""
    w, e = field_defaults(WorkerSettings), field_defaults(EngineConfig)
    a = parser.add_argument
    a("--model", required=True, help=MODEL_HELP)
    a("--served-model-name", default="", help="model name to register (default: as the coordinator)")
    a("--coordinator", required=True, help="the coordinator's control endpoint HOST:PORT")
    a("--worker-id", default="", help="unique worker id (default: ROLE-HOSTNAME-PID)")
    a("--advertise-host", default=w["advertise_host"], help="host peers use to reach this worker")
    a(
        "--control-port",
        type=int,
        default=w["control_port"],
        help="this worker's control ROUTER port (0: OS-chosen)",
    )
    a(
        "--transfer-port",
        type=int,
        default=w["transfer_port"],
        help="bulk KV transfer listener port (0: OS-chosen)",
    )
    a(
        "--transfer-backend",
        choices=TRANSFER_BACKENDS,
        default=w["transfer_backend"],
        help="bulk KV transport",
    )
    a(
        "--metrics-port",
        type=int,
        default=w["metrics_port"],
        help="/metrics, /livez, /readyz port (0: OS-chosen)",
    )
    a(
        "--step-trace-dir",
        default=w["step_trace_dir"],
        help="append a JSON line per model step to DIR/<worker id>-<pid>.jsonl "
        "(summary: python -m engine.worker.step_trace FILE)",
    )
    a("--block-size", type=int, default=e["block_size"], help="tokens per KV block")
    a(
        "--num-gpu-blocks",
        type=int,
        default=e["num_blocks"],
        help="KV pool size in blocks (else --kv-cache-memory)",
    )
    a(
        "--kv-cache-memory",
        type=int,
        default=e["kv_cache_memory_bytes"],
        help="KV pool bytes when --num-gpu-blocks is unset",
    )
    a(
        "--max-num-batched-tokens",
        type=int,
        default=e["max_num_batched_tokens"],
        help="token budget of one step",
    )
    a(
        "--prefill-tokens-while-decoding",
        type=int,
        default=e["prefill_tokens_while_decoding"],
        help="prompt tokens a step may carry beside running decodes (decode worker's local prefill: "
        "bounds their inter-token latency; 0: the step budget)",
    )
    a(
        "--prefill-ms-while-decoding",
        type=non_negative_float,
        default=e["prefill_ms_while_decoding"],
        help="the same cap in step time: as many prompt tokens as that many ms buy at this worker's "
        "measured cost of a prompt token beside decodes (0: off; with both caps, the lower wins)",
    )
    a(
        "--long-prefill-token-threshold",
        type=int,
        default=e["long_prefill_token_threshold"],
        help="tokens one prompt may take of a step (0: the step budget): prompts behind a long one "
        "start in the next step",
    )
    a(
        "--short-prompts-whole",
        action="store_true",
        help="the caps beside decodes bound long prompts' chunks only: a prompt of at most "
        "--long-prefill-token-threshold tokens runs whole in one step (one gap for the decodes beside "
        "it instead of several)",
    )
    a("--max-num-seqs", type=int, default=e["max_num_seqs"], help="sequences in one step at most")
    a("--max-model-len", type=int, default=e["max_model_len"], help="context limit (default: the model's)")
    a("--no-prefix-caching", action="store_true", help="disable the prefix cache")
    a("--dtype", choices=DTYPES, default=e["dtype"], help="weights and KV dtype")
    a("--device", default=e["device"], help="torch device, e.g. cpu or cuda:0")
    a(
        "--lease-ms",
        type=int,
        default=w["lease_ms"],
        help="lease of a held prefill result, and of a reservation once P started it (renewed by P's progress)",
    )
    a(
        "--queue-lease-ms",
        type=int,
        default=w["queue_lease_ms"],
        help="decode: longest wait for P to start a reserved request (P's queue); a lost P is recovered sooner",
    )
    a(
        "--drain-timeout",
        type=float,
        default=w["drain_timeout_s"],
        help="seconds to finish in-flight work on SIGTERM",
    )
    a(
        "--register-timeout",
        type=float,
        default=w["register_timeout_s"],
        help="seconds to wait for the coordinator's ack",
    )
    a("--debug-integrity", action="store_true", help="run check_integrity() after every step")
    a(
        "--kv-message-bytes",
        type=int,
        default=w["kv_message_bytes"],
        help="largest KV transfer message (same on P and D)",
    )
    a(
        "--kv-direct-bytes",
        type=int,
        default=w["kv_direct_bytes"],
        help="shortest block run sent without packing",
    )
    a(
        "--ucx-progress-mode",
        # kvtransfer.ucx.PROGRESS_MODES (importing it would pull torch in; a test keeps them equal)
        choices=("hybrid", "thread", "thread-polling", "polling", "blocking"),
        default=w["ucx_progress_mode"],
        help="hybrid: poll only while transfers are outstanding; thread: never spin (saves a core, slower)",
    )
    a(
        "--ucx-idle-wait-ms",
        type=positive,
        default=w["ucx_idle_wait_ms"],
        help="how often UCX's progress thread wakes with nothing to do (ms, >= 1; UCXX's own is 1, "
        "which costs an idle worker ~2.5%% of its core and a decode step beside it ~4%%)",
    )
    a(
        "--lend-cores",
        action="store_true",
        help="hold the leases of this worker's CPUs while it computes and lend them while it is idle "
        "(to a worker on this host with --borrow-cores)",
    )
    a(
        "--borrow-cores",
        type=_cpu_set,
        default=w["borrow_cores"],
        help="CPUs (0, 0+2, 0-3) of a worker with --lend-cores on this host: steps that compute prompt "
        "tokens also run there while it is idle",
    )
    a(
        "--core-lease-dir",
        default=w["core_lease_dir"],
        help="directory of this host's core lease files, shared by the lending and borrowing workers "
        "(mode 0700; default: <temp dir>/splitserve-UID-cores)",
    )
    if not with_mode:  # a prefill worker's lane
        a(
            "--max-prompt-tokens",
            type=int,
            default=w["max_prompt_tokens"],
            help="take only sequences of at most this many tokens (0: any): a short-prompt lane beside "
            "a prefill worker that takes the long ones",
        )
        a(
            "--cpu-priority",
            choices=CPU_PRIORITIES,
            default=w["cpu_priority"],
            help="idle: run at SCHED_IDLE, computing only while this worker's CPUs have nothing else "
            "to run (the long-prompt lane beside a --max-prompt-tokens one on the same cores)",
        )
    add_control_security_arguments(parser)
    a("--coordinator-public-key", default="", help="the coordinator's CurveZMQ public key file (NAME.key)")
    if with_mode:
        a("--mode", choices=("decode", "colocated"), default="decode", help="colocated: prefill here too")
        a(
            "--kv-transfer-mode",
            choices=KV_TRANSFER_MODES,
            default=w["kv_transfer_mode"],
            help="push: the prefill worker sends the KV; pull: this worker reads it (UCX gets or NIXL "
            "READs: the ucx or nixl backend); auto: pull over ucx and nixl, push over tcp",
        )


def _cpu_set(text: str) -> tuple[int, ...]:
    try:
        return parse_cpu_set(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{exc} (CPU sets look like 0, 0+2 or 0-3)") from None


def settings_from_args(args: argparse.Namespace, role: str) -> WorkerSettings:
    w = field_defaults(WorkerSettings)
    engine = EngineConfig(
        block_size=args.block_size,
        num_blocks=args.num_gpu_blocks,
        kv_cache_memory_bytes=args.kv_cache_memory,
        max_num_batched_tokens=args.max_num_batched_tokens,
        prefill_tokens_while_decoding=args.prefill_tokens_while_decoding,
        prefill_ms_while_decoding=args.prefill_ms_while_decoding,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        short_prompts_whole=args.short_prompts_whole,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching,
        dtype=args.dtype,
        device=args.device,
        debug_integrity=args.debug_integrity,
    )
    return WorkerSettings(
        role=role,
        model=args.model,
        coordinator=args.coordinator,
        worker_id=args.worker_id or f"{role}-{socket.gethostname()}-{os.getpid()}",
        engine=engine,
        served_model_name=args.served_model_name,
        advertise_host=args.advertise_host,
        control_port=args.control_port,
        transfer_port=args.transfer_port,
        transfer_backend=args.transfer_backend,
        metrics_port=args.metrics_port,
        step_trace_dir=args.step_trace_dir,
        drain_timeout_s=args.drain_timeout,
        lease_ms=args.lease_ms,
        queue_lease_ms=args.queue_lease_ms,
        register_timeout_s=args.register_timeout,
        kv_message_bytes=args.kv_message_bytes,
        kv_direct_bytes=args.kv_direct_bytes,
        ucx_progress_mode=args.ucx_progress_mode,
        ucx_idle_wait_ms=args.ucx_idle_wait_ms,
        kv_transfer_mode=getattr(args, "kv_transfer_mode", w["kv_transfer_mode"]),
        control_key=args.control_key,
        coordinator_public_key=args.coordinator_public_key,
        insecure_control_plane=bool(args.insecure_control_plane),
        lend_cores=args.lend_cores,
        borrow_cores=args.borrow_cores,
        core_lease_dir=args.core_lease_dir,
        max_prompt_tokens=getattr(args, "max_prompt_tokens", w["max_prompt_tokens"]),
        cpu_priority=getattr(args, "cpu_priority", w["cpu_priority"]),
    )
