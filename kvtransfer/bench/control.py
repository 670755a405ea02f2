"""Control channel of kvbench and the kvtransfer tests: JSON requests over ZeroMQ DEALER/ROUTER.

An agent process (`kvtransfer.bench.agent`) binds a ROUTER socket and answers requests
`{"id": n, "op": ..., ...}` with `{"id": n, "ok": true, ...}` or `{"id": n, "ok": false, "error": ...}`;
requests run concurrently, so a long `wait_recv` never delays an `abort`. Bulk bytes never travel
here. `spawn_agent` starts a local agent and returns once it printed its ready line (a pipe, no sleep).
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import itertools
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import IO, Any

import zmq
import zmq.asyncio

READY_PREFIX = "KVAGENT-READY "


class AgentError(RuntimeError):
    """The agent answered a request with an error."""


class AgentClient:
    """Async client of one agent. Owns its DEALER socket; `close()` it when done."""

    def __init__(self, endpoint: str, context: zmq.asyncio.Context | None = None) -> None:
        self._context = context or zmq.asyncio.Context.instance()
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(endpoint)
        self._ids = itertools.count()
        self._waiters: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._reader = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        while True:
            reply = json.loads(await self._socket.recv())
            waiter = self._waiters.pop(reply["id"], None)
            if waiter is not None and not waiter.done():
                waiter.set_result(reply)

    async def call(self, op: str, timeout: float = 120.0, **args: Any) -> dict[str, Any]:
        """Send one request and return its reply; raises AgentError on an error reply."""
        request_id = next(self._ids)
        waiter: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._waiters[request_id] = waiter
        await self._socket.send(json.dumps({"id": request_id, "op": op, **args}).encode())
        reply = await asyncio.wait_for(waiter, timeout)
        if not reply.get("ok"):
            raise AgentError(f"{op}: {reply.get('error')}")
        return reply

    def close(self) -> None:
        self._reader.cancel()
        self._socket.close()


def bind_router(router: zmq.Socket[Any], host: str, port: int, endpoint: str | None = None) -> str:
    """Bind an agent's control ROUTER on `host:port` (0: OS-chosen), or on `endpoint` when given (an
    ipc:// path: the netns mode); returns the endpoint peers dial."""
    if endpoint:
        router.bind(endpoint)
        return endpoint
    if port:
        router.bind(f"tcp://{host}:{port}")
    else:
        port = router.bind_to_random_port(f"tcp://{host}")
    return f"tcp://{host}:{port}"


def parse_request(frames: list[bytes]) -> tuple[bytes, dict[str, Any]] | None:
    """(routing id, request) from what an agent's ROUTER received, or None for anything that is not
    one identity frame and a JSON object with an int `id` and a str `op` (dropped, never fatal)."""
    if len(frames) != 2:
        return None
    try:
        request = json.loads(frames[1])
    except ValueError:  # not JSON (UnicodeDecodeError is a ValueError too)
        return None
    if not isinstance(request, dict) or not isinstance(request.get("id"), int):
        return None
    return (frames[0], request) if isinstance(request.get("op"), str) else None


def die_with_parent() -> None:
    """Linux: get SIGKILL when the process that spawned us dies, so no child outlives its bench."""
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def dying_with_parent(cpus: Collection[int] | None) -> Callable[[], None]:
    """A `preexec_fn` for a helper process of a bench (a busy loop, a timing child): SIGKILL when
    the bench dies (`die_with_parent`), then pinned to `cpus` when given."""
    pinned = set(cpus) if cpus else None

    def prepare() -> None:
        die_with_parent()
        if pinned:
            os.sched_setaffinity(0, pinned)

    return prepare


def _prepare_child(cpu: int | None, wrapped: bool) -> None:
    """In the forked child before exec: pin to `cpu`; a wrapper gets SIGKILL when we die."""
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    if wrapped:
        die_with_parent()


@dataclass
class SpawnedAgent:
    """A local agent process; `info` is its ready line (control endpoint, transport address and key)."""

    process: subprocess.Popen[str]
    info: dict[str, Any]

    @property
    def control(self) -> str:
        return str(self.info["control"])

    @property
    def address(self) -> str:
        return str(self.info["address"])

    @property
    def key(self) -> str:
        """Its transfer key, hex (what a peer passes to `connect`)."""
        return str(self.info["key"])

    def stop(self, grace_s: float = 0.0) -> None:
        """Reap the process, killing it if it has not exited within `grace_s`."""
        try:
            self.process.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def spawn_agent(
    args: Sequence[str],
    log: IO[str] | None = None,
    timeout: float = 60.0,
    cpu: int | None = None,
    module: str = "kvtransfer.bench.agent",
    wrap: Sequence[str] = (),
) -> SpawnedAgent:
    """Start `python -m MODULE ARGS` (an agent) and wait for its ready line on stdout.

    The agent's logs (stderr) go to `log`, or to our stderr. `cpu`: pin the agent (all its threads)
    to that core. `wrap`: a command prefix (`netns.NetnsPair.wrap`); it dies with us, and the agent
    with it."""
    process = subprocess.Popen(
        [*wrap, sys.executable, "-m", module, *args, "--die-with-parent"],
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        preexec_fn=functools.partial(_prepare_child, cpu, bool(wrap)) if cpu is not None or wrap else None,
    )
    assert process.stdout is not None
    # Wait (protects an invariant): nobody may talk to the agent before it listens. Libraries may
    # print before the ready line; EOF means the agent died.
    seen = []
    for line in process.stdout:
        if line.startswith(READY_PREFIX):
            return SpawnedAgent(process, json.loads(line[len(READY_PREFIX) :]))
        seen.append(line)
    process.wait(timeout)
    raise RuntimeError(f"agent failed to start (exit code {process.returncode}): {''.join(seen[-5:])!r}")
