"""Two "hosts" on one machine: network namespaces joined by a veth pair (`kvbench run --netns`).

`NetnsPair` owns two named network namespaces `ssn<pid>x<run>a` / `...b`, a veth pair between them
with the addresses of a private /30 (`ADDRESSES`) and the given MTU (1500 as a pod network's,
9000 jumbo). `wrap(side)` is the command prefix that runs a process in one of them with its own
IPC, PID, UTS and mount namespaces too (a fresh tmpfs on /dev/shm, its own hostname), so no shared
memory and no CMA (`process_vm_readv` needs the peer's pid) can reach the other side: two pods on
two nodes, talking only over the veth link. The root namespace reaches the processes' control
sockets through the filesystem (ZeroMQ `ipc://` paths in `control_dir`, mode 0700).

Ownership: `__enter__` builds, `__exit__` (every path: an exception, Ctrl-C) deletes both
namespaces, which destroys the veth pair with them. Processes started through `wrap` get SIGKILL
when their spawner dies (`unshare --kill-child` under the spawner's PR_SET_PDEATHSIG). Namespaces
left by a killed run are named by its pid and reaped by the next `NetnsPair` (`reap_stale`).
Needs CAP_NET_ADMIN / CAP_SYS_ADMIN (root), `ip` (iproute2) and `unshare` (util-linux):
`netns_missing()` says why not.
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from types import TracebackType

import structlog

log = structlog.get_logger(__name__)

NETNS_DIR = Path("/run/netns")
PREFIX = "ssn"  # + pid + "x" + run number + side
ADDRESSES = {"a": "10.213.0.1", "b": "10.213.0.2"}  # a private /30; each pair is isolated
PREFIX_LEN = 30
MTUS = (1500, 9000)
_NAME = re.compile(rf"^{PREFIX}(\d+)x(\d+)[ab]$")
_runs = itertools.count()
# Run inside the new namespaces: own /dev/shm (POSIX shm lives there, not in the IPC namespace),
# own hostname (UCX keys its same-host transports by hostname), then the command.
_INNER = 'mount -t tmpfs -o size=64m kvbench-shm /dev/shm && hostname "$0" && exec "$@"'


def netns_missing() -> str | None:
    """Why two namespaces cannot be built here, or None when they can."""
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"netns mode needs `{tool}` on PATH"
    if os.geteuid() != 0:
        return "netns mode needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN to build namespaces)"
    probe = subprocess.run(["unshare", "--net", "--ipc", "--pid", "--fork", "true"], capture_output=True)
    if probe.returncode != 0:
        return f"cannot create namespaces here (unshare: {probe.stderr.decode().strip()})"
    return None


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip()}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def reap_stale() -> list[str]:
    """Delete the namespaces of runs whose process is gone (killed before its teardown)."""
    reaped = []
    for path in sorted(NETNS_DIR.glob(f"{PREFIX}*")) if NETNS_DIR.is_dir() else []:
        m = _NAME.match(path.name)
        if m and not _alive(int(m.group(1))):
            _ip("netns", "delete", path.name)
            reaped.append(path.name)
    if reaped:
        log.info("stale namespaces reaped", namespaces=reaped)
    return reaped


class NetnsPair:
    """Two namespaces `a` (the receiver's) and `b` (the sender's) joined by a veth pair."""

    def __init__(self, mtu: int = 1500) -> None:
        if not 576 <= mtu <= 65535:
            raise ValueError(f"MTU must be in 576..65535, got {mtu}")
        self.mtu = mtu
        base = f"{PREFIX}{os.getpid()}x{next(_runs)}"
        self.names = {side: base + side for side in ADDRESSES}
        self.control_dir = Path()
        self._built: list[str] = []
        self._sockets = itertools.count()

    @property
    def link(self) -> str:
        """What kvbench rows record as their link."""
        return f"veth mtu {self.mtu}"

    def address(self, side: str) -> str:
        return ADDRESSES[side]

    def control_endpoint(self, side: str) -> str:
        """A fresh ZeroMQ ipc:// endpoint for the control socket of a process on `side`."""
        return f"ipc://{self.control_dir / f'{side}{next(self._sockets)}.sock'}"

    def agent_args(self, side: str) -> list[str]:
        """Agent arguments placing its transport on `side`'s address and its control on an ipc path."""
        return ["--host", ADDRESSES[side], "--control-endpoint", self.control_endpoint(side)]

    def wrap(self, side: str) -> list[str]:
        """Command prefix: run the rest in `side`'s namespaces (net via `ip netns exec`; IPC, PID,
        UTS and mount fresh). The command is its namespaces' pid 1 and dies with the prefix's process."""
        ns = self.names[side]
        unshare = ["unshare", "--ipc", "--pid", "--uts", "--fork", "--kill-child", "--mount-proc"]
        return ["ip", "netns", "exec", ns, *unshare, "sh", "-c", _INNER, f"kvbench-{side}"]

    def __enter__(self) -> NetnsPair:
        reap_stale()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        log.info("namespaces built", namespaces=list(self.names.values()), mtu=self.mtu)
        return self

    def _build(self) -> None:
        self.control_dir = Path(tempfile.mkdtemp(prefix="kvbench-netns-"))
        for ns in self.names.values():
            _ip("netns", "add", ns)
            self._built.append(ns)
        a, b = self.names["a"], self.names["b"]
        # Created straight inside the namespaces: the root namespace never holds these names.
        _ip("link", "add", "veth0", "netns", a, "type", "veth", "peer", "name", "veth0", "netns", b)
        for side, ns in self.names.items():
            _ip("-n", ns, "addr", "add", f"{ADDRESSES[side]}/{PREFIX_LEN}", "dev", "veth0")
            _ip("-n", ns, "link", "set", "veth0", "mtu", str(self.mtu), "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        """Delete both namespaces (and with them the veth pair) and the control directory; idempotent."""
        while self._built:
            ns = self._built.pop()
            try:
                _ip("netns", "delete", ns)
            except RuntimeError as e:  # keep deleting the rest; the next run reaps it
                log.warning("namespace not deleted", namespace=ns, error=str(e))
        if self.control_dir != Path():
            shutil.rmtree(self.control_dir, ignore_errors=True)
