"""CurveZMQ key material and the ZAP handler of the control plane.

Key files are pyzmq certificates: `NAME.key` holds a public key, `NAME.key_secret` the public and the
secret key (`splitserve keygen` writes both; the secret file is 0600). A process's own identity is
its `.key_secret` file (`--control-key`); the coordinator also reads the public keys it admits from
`--control-authorized-keys DIR`, where each `*.key` file's name starts with the role that key may
register as (`prefill`, `decode` or `colocated`, e.g. `decode.key`, `prefill-pool-b.key`).

Ownership: `ZapHandler(ctx, ...).start()` runs one ZAP handler per context (a task on the running
loop); its owner calls `stop()` before terminating the context. `KeySet` writes a whole cluster's keys into
a private directory (0700) for the local launcher and tests.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import structlog
import zmq.asyncio
from zmq.auth import create_certificates, load_certificate
from zmq.utils import z85

from splitserve.control import CurveKeys
from splitserve.v1 import serving_pb2

log = structlog.get_logger(__name__)

ROLE_OF_NAME = {
    "prefill": serving_pb2.WORKER_ROLE_PREFILL,
    "decode": serving_pb2.WORKER_ROLE_DECODE,
    "colocated": serving_pb2.WORKER_ROLE_COLOCATED,
}
_RELOAD_MAX_S = 30.0
_ZAP_WAIT_S = 2.0
_ZAP_MAX_PENDING = 64
INSECURE_WARNING = (
    "--insecure-control-plane: the ZeroMQ control plane is plaintext and unauthenticated; anyone who "
    "can reach its ports can join as a worker, read prompts and forge outputs"
)


class ControlKeyError(ValueError):
    """A key file is missing or malformed; the message names the file and the fix."""


def load_keys(path: str | Path) -> CurveKeys:
    """This process's keypair from a `.key_secret` file."""
    try:
        public, secret = load_certificate(str(path))
    except (OSError, ValueError) as exc:
        raise ControlKeyError(
            f"cannot read control key {path}: {exc} (create one with `splitserve keygen`)"
        ) from exc
    if secret is None:
        raise ControlKeyError(f"{path} holds no secret key: --control-key takes the NAME.key_secret file")
    return CurveKeys(public=public, secret=secret)


def load_public_key(path: str | Path) -> bytes:
    """A peer's z85 public key from its `.key` (or `.key_secret`) file."""
    try:
        public, _ = load_certificate(str(path))
    except (OSError, ValueError) as exc:
        raise ControlKeyError(f"cannot read public key {path}: {exc}") from exc
    return public


def role_of_key_file(name: str) -> serving_pb2.WorkerRole.ValueType:
    for prefix, role in ROLE_OF_NAME.items():
        if name.startswith(prefix):
            return role
    raise ControlKeyError(
        f"authorized key {name}: the file name must start with prefill, decode or colocated"
    )


def load_authorized(directory: str | Path) -> dict[str, serving_pb2.WorkerRole.ValueType]:
    """z85 public key (str) -> the role it may register as, from every `*.key` in `directory`."""
    root = Path(directory)
    if not root.is_dir():
        raise ControlKeyError(f"--control-authorized-keys {directory} is not a directory")
    allowed: dict[str, serving_pb2.WorkerRole.ValueType] = {}
    for path in sorted(root.glob("*.key")):
        key = load_public_key(path).decode("ascii")
        role = role_of_key_file(path.name)
        if allowed.get(key, role) != role:
            raise ControlKeyError(f"{path}: the same public key is listed for two roles")
        allowed[key] = role
    return allowed


class AuthorizedKeys:
    """The coordinator's allow-list: public key -> role, from `--control-authorized-keys DIR`.

    Re-read when a key is not found and the dir changed (its mtime; one stat, so a flood of unknown
    keys costs no reads), and when the last read is older than `_RELOAD_MAX_S`: keys added to the dir
    (a rotated Secret) are admitted without a restart, and removed keys stop working on the next read.
    A dir that fails to read keeps the last good list (logged)."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self._keys = load_authorized(self.directory)
        self._loaded = time.monotonic()
        self._mtime = self._dir_mtime()

    def _dir_mtime(self) -> int:
        try:
            return self.directory.stat().st_mtime_ns
        except OSError:
            return -1

    def role(self, key: str) -> serving_pb2.WorkerRole.ValueType | None:
        now = time.monotonic()
        if now - self._loaded > _RELOAD_MAX_S or (key not in self._keys and self._dir_mtime() != self._mtime):
            self._loaded, self._mtime = now, self._dir_mtime()
            try:
                self._keys = load_authorized(self.directory)
            except ControlKeyError as exc:
                log.error("authorized keys not reloaded; keeping the last list", error=str(exc))
        return self._keys.get(key)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self.role(key) is not None


def create_keypair(directory: str | Path, name: str) -> tuple[Path, Path]:
    """Write `NAME.key` (public) and `NAME.key_secret` (0600) into `directory`; returns both paths."""
    public, secret = create_certificates(str(directory), name)
    os.chmod(secret, 0o600)
    return Path(public), Path(secret)


class ZapHandler:
    """The ZAP handler (RFC 27) of one context: decides which CURVE client keys its server sockets
    admit. A client key passes when `allowed(z85 key)`; otherwise, when `wait_for` is given, the
    decision waits up to `_ZAP_WAIT_S` for `wait_for(key)` to say yes (a peer the coordinator is
    about to introduce), at most `_ZAP_MAX_PENDING` at a time. An admitted connection's messages carry
    the key as ZMQ "User-Id". Started by `start()` on the running loop; `stop()` before `ctx.term()`.

    Replies never wait on each other (a ROUTER, not pyzmq's REP-based Authenticator), so a slow
    decision for one key does not delay another's, and a flood of unknown keys is refused at once
    beyond the pending bound."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        allowed: Callable[[str], bool],
        wait_for: Callable[[str], Awaitable[bool]] | None = None,
    ) -> None:
        self.allowed = allowed
        self.wait_for = wait_for
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind("inproc://zeromq.zap.01")
        self._pending: set[asyncio.Task[None]] = set()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> ZapHandler:
        self._task = asyncio.create_task(self._serve(), name="zap")
        return self

    async def _serve(self) -> None:
        while True:
            frames = await self.sock.recv_multipart()
            try:
                split = frames.index(b"")
            except ValueError:
                continue  # not a REQ envelope: nobody to answer
            route, req = frames[: split + 1], frames[split + 1 :]
            if len(req) < 6:
                continue
            request_id, mechanism, creds = req[1], req[5], req[6:]
            if mechanism != b"CURVE" or len(creds) != 1 or len(creds[0]) != 32:
                await self._reply(route, request_id, None)
                continue
            key = z85.encode(creds[0]).decode("ascii")
            if self.allowed(key):
                await self._reply(route, request_id, key)
            elif self.wait_for is not None and len(self._pending) < _ZAP_MAX_PENDING:
                task = asyncio.create_task(self._deferred(route, request_id, key, self.wait_for))
                self._pending.add(task)
                task.add_done_callback(self._pending.discard)
            else:
                await self._reply(route, request_id, None)

    async def _deferred(
        self, route: list[bytes], request_id: bytes, key: str, wait_for: Callable[[str], Awaitable[bool]]
    ) -> None:
        try:  # bounded wait: the coordinator's Peers list may trail the peer's first connection
            ok = await asyncio.wait_for(wait_for(key), _ZAP_WAIT_S)
        except TimeoutError:
            ok = False
        await self._reply(route, request_id, key if ok else None)

    async def _reply(self, route: list[bytes], request_id: bytes, user_id: str | None) -> None:
        if user_id is None:
            log.warning("control connection refused: unknown key")
            status = [b"400", b"unknown key", b"", b""]
        else:
            status = [b"200", b"OK", user_id.encode("ascii"), b""]
        await self.sock.send_multipart([*route, b"1.0", request_id, *status])

    def stop(self) -> None:
        for task in (self._task, *self._pending):
            if task is not None:
                task.cancel()
        self.sock.close(linger=0)


@dataclass(slots=True)
class KeySet:
    """A whole cluster's keys in `root` (0700): `coordinator.key[_secret]`, and under `workers/` (the
    coordinator's authorized-keys dir) one keypair per worker, its file named `<role>...`. For the
    local launcher and tests; workers may be added after the coordinator started (it re-reads)."""

    root: Path
    workers: dict[str, Path] = field(default_factory=dict)  # worker id -> its .key_secret

    @classmethod
    def create(cls, root: Path, worker_ids: Iterable[str] = ()) -> KeySet:
        root.mkdir(parents=True, exist_ok=True)
        os.chmod(root, 0o700)
        (root / "workers").mkdir(exist_ok=True)
        create_keypair(root, "coordinator")
        ks = cls(root)
        for wid in worker_ids:
            ks.add_worker(wid)
        return ks

    def add_worker(self, worker_id: str, role: str | None = None) -> Path:
        """A new keypair for `worker_id`, allow-listed for `role` (default: the role its id starts
        with); returns its .key_secret path."""
        stem = worker_id if role is None or worker_id.startswith(role) else f"{role}.{worker_id}"
        role_of_key_file(stem)
        self.workers[worker_id] = create_keypair(self.root / "workers", stem)[1]
        return self.workers[worker_id]

    @property
    def coordinator_secret(self) -> Path:
        return self.root / "coordinator.key_secret"

    @property
    def coordinator_public(self) -> Path:
        return self.root / "coordinator.key"

    @property
    def authorized_dir(self) -> Path:
        return self.root / "workers"

    def worker_keys(self, worker_id: str) -> CurveKeys:
        return load_keys(self.workers[worker_id])

    def coordinator_args(self) -> list[str]:
        return [
            "--control-key",
            str(self.coordinator_secret),
            "--control-authorized-keys",
            str(self.authorized_dir),
        ]

    def worker_args(self, worker_id: str) -> list[str]:
        return [
            "--control-key",
            str(self.workers[worker_id]),
            "--coordinator-public-key",
            str(self.coordinator_public),
        ]
