"""A local cluster on one host: a coordinator plus prefill and decode worker processes.

Used by `splitserve serve`, `make run` and the end-to-end tests. Every process binds OS-chosen ports
and announces itself with one `SPLITSERVE_READY {json}` line on stdout; the launcher waits for that
line (bounded), never sleeps. Processes are real `splitserve <role>` subprocesses.

Control-plane keys: unless `insecure_control_plane`, `start` writes an ephemeral CurveZMQ keypair per
process into a private temp dir (0700, see splitserve.control_auth.KeySet), gives each process its
own, and deletes the dir in `stop`.

Their `SPLITSERVE_PROGRESS` lines (`splitserve.progress`) and readiness go to an optional
`progress(name, stage)` callback; their logs (stderr) go to `<log_dir>/<name>.log`, or to the
launcher's stderr.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import structlog

from engine.config import EngineConfig
from engine.worker.settings import field_defaults
from splitserve.control_auth import KeySet
from splitserve.placement import pin_hook, thread_env
from splitserve.progress import ENV as PROGRESS_ENV
from splitserve.progress import parse as parse_progress

log = structlog.get_logger(__name__)

READY_PREFIX = "SPLITSERVE_READY "
# Deployment modes, in one place (`serve --mode`, `bench --modes`): a new mode is one entry here.
MODES = ("disaggregated", "colocated", "conditional")  # ClusterSpec.mode
SHORT_LANE_ID = "prefill-short"  # ClusterSpec.short_prompt_lane's worker


class ClusterError(RuntimeError):
    """A process of the cluster failed to start or died."""


@dataclass(slots=True)
class RoleProcess:
    """One child process; `ready` is the JSON of its readiness line."""

    role: str
    name: str
    proc: subprocess.Popen[str]
    ready: dict[str, Any] = field(default_factory=dict)

    def wait_ready(self, lines: queue.Queue[str | None], timeout: float) -> None:
        try:
            while True:
                line = lines.get(timeout=timeout)  # bounded wait for the child's readiness line
                if line is None:
                    raise ClusterError(f"{self.name} exited with {self.proc.wait()} before it was ready")
                if line.startswith(READY_PREFIX):
                    self.ready = json.loads(line[len(READY_PREFIX) :])
                    return
        except queue.Empty:
            raise ClusterError(f"{self.name} was not ready within {timeout:.0f}s") from None


ProgressCallback = Callable[[str, str], None]  # (process name, stage)


def _pump(
    stream: IO[str], lines: queue.Queue[str | None], name: str, progress: ProgressCallback | None
) -> None:
    """Forward a child's stdout line by line (keeps its pipe from filling up), reporting its
    progress lines and its readiness to `progress`."""
    for line in stream:
        lines.put(line.rstrip("\n"))
        if progress is not None:
            stage = "ready" if line.startswith(READY_PREFIX) else parse_progress(line)
            if stage is not None:
                progress(name, stage)
    lines.put(None)


@dataclass
class ClusterSpec:
    model: str = "tiny"
    prefill_workers: int = 1
    decode_workers: int = 1
    # "colocated": decode_workers colocated workers, no prefill pool; "conditional": the disaggregated
    # pools with `--disaggregation conditional` on the coordinator (short prompts prefill on D)
    mode: str = "disaggregated"
    host: str = "127.0.0.1"
    port: int = 0
    http_port: int = 0
    transfer_backend: str = "tcp"
    # every worker's weights and KV (engine.config.DTYPES): one dtype per cluster
    dtype: str = field_defaults(EngineConfig)["dtype"]
    # role -> its workers' cap on one prompt's tokens a step (EngineConfig's default for a role not named)
    long_prefill_token_threshold: dict[str, int] = field(default_factory=dict)
    coordinator_args: list[str] = field(default_factory=list)
    prefill_args: list[str] = field(default_factory=list)
    decode_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    log_dir: Path | None = None
    insecure_control_plane: bool = False  # plaintext control plane (else ephemeral CURVE keys)
    cpus: dict[str, tuple[int, ...]] = field(default_factory=dict)  # role -> CPU set (splitserve.placement)
    threads: dict[str, int] = field(default_factory=dict)  # role -> torch threads (OMP_NUM_THREADS)
    # the prefill workers lend their pinned CPUs while idle; the decode workers borrow them for prompt
    # steps (engine/worker/core_lease.py); needs cpus["prefill"], ignored by colocated clusters
    share_idle_cores: bool = False
    # > 0: one more prefill worker, `prefill-short`, takes sequences of at most this many tokens at
    # normal priority while the others run at idle priority on the same CPUs (coordinator/router.py,
    # "Prompt lanes"); only the short lane lends its CPUs
    short_prompt_lane: int = 0
    # each worker of a pinned role on its own equal share of the role's CPUs (`worker_cpus`): replicas
    # on their own cores, as separate pods would be, instead of all of them on the whole set
    split_pins: bool = False

    def __post_init__(self) -> None:
        if self.share_idle_cores and self.mode != "colocated" and not self.cpus.get("prefill"):
            raise ValueError(
                "sharing idle cores needs the prefill workers pinned (--pin prefill=CPUS): their CPUs are lent"
            )
        if self.short_prompt_lane < 0:
            raise ValueError(
                f"the short prompt lane must be >= 0 tokens (0: none), got {self.short_prompt_lane}"
            )
        if self.short_prompt_lane and self.mode == "colocated":
            raise ValueError("a short prompt lane is a prefill worker: colocated clusters have none")
        if self.split_pins:
            self._check_split_pins()

    def _check_split_pins(self) -> None:
        if self.short_prompt_lane:
            raise ValueError("split pins give each worker its own CPUs; a short prompt lane shares P's")
        counts: dict[str, int] = {}
        for role, _ in self.worker_ids():
            counts[role] = counts.get(role, 0) + 1
        for role, n in counts.items():
            cpus = self.cpus.get(role)
            if cpus is None:
                continue
            if len(cpus) % n:
                raise ValueError(
                    f"split pins: {n} {role} workers cannot share {len(cpus)} CPUs {list(cpus)} equally "
                    f"(pin the role to a multiple of {n} CPUs)"
                )
            share = len(cpus) // n
            if self.threads.get(role, 0) > share:
                raise ValueError(
                    f"split pins: each {role} worker has {share} CPU(s); --threads "
                    f"{role}={self.threads[role]} would oversubscribe them"
                )

    def worker_ids(self) -> list[tuple[str, str]]:
        """(role, worker id) of every worker, in start order; each id starts with its role."""
        if self.mode == "colocated":
            return [("colocated", f"colocated-{i}") for i in range(self.decode_workers)]
        lane = [("prefill", SHORT_LANE_ID)] if self.short_prompt_lane else []
        return [
            *(("prefill", f"prefill-{i}") for i in range(self.prefill_workers)),
            *lane,
            *(("decode", f"decode-{i}") for i in range(self.decode_workers)),
        ]

    def worker_cpus(self, role: str, worker_id: str) -> tuple[int, ...] | None:
        """The CPUs `worker_id` is pinned to: its role's set, or with `split_pins` its own share of it
        (the i-th of the role's workers takes the i-th slice). None: not pinned."""
        cpus = self.cpus.get(role)
        if not self.split_pins or cpus is None or role == "coordinator":
            return cpus
        ids = [wid for r, wid in self.worker_ids() if r == role]
        if worker_id not in ids:
            raise ValueError(
                f"split pins: {worker_id} is not one of the {role} workers the CPUs were split for"
            )
        share = len(cpus) // len(ids)
        i = ids.index(worker_id)
        return cpus[i * share : (i + 1) * share]

    def idle_lane(self, role: str, worker_id: str) -> bool:
        """Whether the worker is a long lane beside `prefill-short`: at idle priority, lending nothing."""
        return bool(self.short_prompt_lane) and role == "prefill" and worker_id != SHORT_LANE_ID

    def lane_args(self, role: str, worker_id: str) -> list[str]:
        """A worker's lane flags: the short lane's cap, idle priority for the other prefill workers."""
        if self.idle_lane(role, worker_id):
            return ["--cpu-priority", "idle"]
        if self.short_prompt_lane and worker_id == SHORT_LANE_ID:
            return ["--max-prompt-tokens", str(self.short_prompt_lane)]
        return []


class LocalCluster:
    """Starts, addresses and stops the processes of one `ClusterSpec`. Use as a context manager."""

    def __init__(
        self, spec: ClusterSpec, *, ready_timeout: float = 180.0, progress: ProgressCallback | None = None
    ) -> None:
        self.spec = spec
        self.ready_timeout = ready_timeout
        self.progress = progress
        self.processes: list[RoleProcess] = []
        self.keys: KeySet | None = None
        self._logs: list[IO[str]] = []
        self._worker_common: list[str] = []  # every worker's args (set by start)
        self._lease_dir: Path | None = None  # the core leases of share_idle_cores (set by start)

    @property
    def coordinator(self) -> RoleProcess:
        return self.processes[0]

    @property
    def grpc_address(self) -> str:
        return str(self.coordinator.ready["grpc_address"])

    @property
    def http_address(self) -> str:
        """The coordinator's OpenAI-compatible HTTP `host:port`."""
        return str(self.coordinator.ready["http_address"])

    def workers(self, role: str) -> list[RoleProcess]:
        return [p for p in self.processes if p.role == role]

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _security_args(self) -> tuple[list[str], dict[str, list[str]]]:
        """(coordinator args, worker id -> args) for the control plane's keys (or its insecure flag)."""
        s = self.spec
        if s.insecure_control_plane:
            flag = ["--insecure-control-plane"]
            return flag, {wid: flag for _, wid in s.worker_ids()}
        ids = [wid for _, wid in s.worker_ids()]
        self.keys = KeySet.create(Path(tempfile.mkdtemp(prefix="splitserve-keys-")), ids)
        return self.keys.coordinator_args(), {wid: self.keys.worker_args(wid) for wid in ids}

    def start(self) -> None:
        s = self.spec
        try:
            coordinator_security, worker_security = self._security_args()
            coord = self._spawn(
                "coordinator",
                "coordinator",
                [
                    "--model",
                    s.model,
                    "--host",
                    s.host,
                    "--port",
                    str(s.port),
                    "--control-host",
                    s.host,
                    "--control-port",
                    "0",
                    "--metrics-port",
                    "0",
                    *coordinator_security,
                    "--http-port",
                    str(s.http_port),
                    *(["--disaggregation", "conditional"] if s.mode == "conditional" else []),
                    *s.coordinator_args,
                ],
            )
            control = coord.ready["control_address"].removeprefix("tcp://")
            self._worker_common = [
                "--model",
                s.model,
                "--coordinator",
                control,
                "--advertise-host",
                s.host,
                "--control-port",
                "0",
                "--transfer-port",
                "0",
                "--metrics-port",
                "0",
                "--transfer-backend",
                s.transfer_backend,
                "--dtype",
                s.dtype,
            ]
            if s.share_idle_cores and s.mode != "colocated":
                self._lease_dir = Path(tempfile.mkdtemp(prefix="splitserve-cores-"))  # 0700
            # workers load their models in parallel
            pending = [self._launch_worker(role, wid, worker_security[wid]) for role, wid in s.worker_ids()]
            for proc, lines in pending:
                proc.wait_ready(lines, self.ready_timeout)
        except BaseException:
            self.stop()
            raise
        log.info("cluster ready", grpc=self.grpc_address, processes=len(self.processes))

    def add_workers(self, role: str, count: int = 1) -> list[RoleProcess]:
        """Start `count` more workers of `role` ("prefill", "decode" or "colocated") into the running
        cluster, with the spec's args for the role; ids continue the role's numbering, and each gets
        a fresh control key (the coordinator re-reads its allow-list) unless the control plane is
        insecure. Returns them once ready (registered with the coordinator)."""
        pending = []
        for _ in range(count):
            wid = f"{role}-{len(self.workers(role))}"
            if self.keys is None:
                security = ["--insecure-control-plane"]
            else:
                self.keys.add_worker(wid)
                security = self.keys.worker_args(wid)
            pending.append(self._launch_worker(role, wid, security))
        for proc, lines in pending:
            proc.wait_ready(lines, self.ready_timeout)
        return [proc for proc, _ in pending]

    def _launch_worker(
        self, role: str, wid: str, security: list[str]
    ) -> tuple[RoleProcess, queue.Queue[str | None]]:
        command = ["decode", "--mode", "colocated"] if role == "colocated" else [role]
        threshold = self.spec.long_prefill_token_threshold.get(role)
        if threshold is not None:
            command += ["--long-prefill-token-threshold", str(threshold)]
        extra = self.spec.prefill_args if role == "prefill" else self.spec.decode_args
        return self._launch(
            role,
            wid,
            [
                *command,
                *self._worker_common,
                "--worker-id",
                wid,
                *security,
                *self.spec.lane_args(role, wid),
                *self._core_args(role, wid),
                *extra,
            ],
        )

    def _core_args(self, role: str, wid: str) -> list[str]:
        """A worker's core-lease flags: prefill workers lend (not a long lane at idle priority: it
        yields its CPUs anyway), decode workers borrow the prefill CPUs."""
        if self._lease_dir is None or role not in ("prefill", "decode") or self.spec.idle_lane(role, wid):
            return []
        lease = ["--core-lease-dir", str(self._lease_dir)]
        if role == "prefill":
            return ["--lend-cores", *lease]
        return ["--borrow-cores", "+".join(map(str, self.spec.cpus["prefill"])), *lease]

    def _spawn(self, role: str, name: str, args: list[str]) -> RoleProcess:
        proc, lines = self._launch(role, name, [role, *args])
        proc.wait_ready(lines, self.ready_timeout)
        return proc

    def _launch(self, role: str, name: str, argv: list[str]) -> tuple[RoleProcess, queue.Queue[str | None]]:
        s = self.spec
        stderr: IO[str] | None = None
        if s.log_dir is not None:
            s.log_dir.mkdir(parents=True, exist_ok=True)
            stderr = open(s.log_dir / f"{name}.log", "w")  # noqa: SIM115 - closed in stop()
            self._logs.append(stderr)
        placed = thread_env(s.threads.get(role))
        env = {**os.environ, "PYTHONUNBUFFERED": "1", PROGRESS_ENV: "1", **s.env, **placed}
        popen = subprocess.Popen(
            [sys.executable, "-m", "splitserve.cli", *argv],
            stdout=subprocess.PIPE,
            stderr=stderr,
            stdin=subprocess.DEVNULL,
            text=True,
            env=env,
            preexec_fn=pin_hook(s.worker_cpus(role, name)),
        )
        assert popen.stdout is not None
        lines: queue.Queue[str | None] = queue.Queue()
        if self.progress is not None:
            self.progress(name, "starting")
        pump_args = (popen.stdout, lines, name, self.progress)
        threading.Thread(target=_pump, args=pump_args, daemon=True, name=name).start()
        proc = RoleProcess(role, name, popen)
        self.processes.append(proc)
        return proc, lines

    def kill(self, name: str) -> None:
        """SIGKILL one process (fault-injection in tests)."""
        for p in self.processes:
            if p.name == name:
                p.proc.kill()
                p.proc.wait()

    def stop(self, timeout: float = 60.0) -> dict[str, int]:
        """SIGTERM the coordinator first (it stops admitting and drains in-flight requests while the
        workers still serve them), then the workers; SIGKILL whatever outlives `timeout`."""
        codes: dict[str, int] = {}
        coordinators = [p for p in self.processes if p.role == "coordinator"]
        workers = [p for p in self.processes if p.role != "coordinator"]
        for group in (coordinators, workers):
            for p in group:
                if p.proc.poll() is None:
                    p.proc.send_signal(signal.SIGTERM)
            for p in group:
                try:
                    codes[p.name] = p.proc.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    p.proc.kill()
                    codes[p.name] = p.proc.wait()
        for f in self._logs:
            f.close()
        self._logs.clear()
        if self.keys is not None:
            shutil.rmtree(self.keys.root, ignore_errors=True)
        if self._lease_dir is not None:
            shutil.rmtree(self._lease_dir, ignore_errors=True)
        return codes
