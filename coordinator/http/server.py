"""The HTTP listener: uvicorn serving the OpenAI routes on the coordinator's own event loop.

Why uvicorn + Starlette: both are maintained, asyncio-native and small; `uvicorn.Server.serve()` runs
as one task on the running loop (no thread, no second process), so the HTTP handlers call admission and
the dispatcher directly, with the same event-loop-only rules as the gRPC servicers. uvicorn's own
signal handling is turned off: the coordinator owns SIGTERM/SIGINT (drain first, then stop).

TLS: `ssl_context` (None = plaintext) is the seam where the coordinator's TLS settings plug in; this
module builds no context itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from collections.abc import Iterator
from typing import Any

import structlog
import uvicorn
from starlette.types import ASGIApp

log = structlog.get_logger(__name__)

# seconds stop() lets open HTTP connections finish (drain has already ended every request)
_SHUTDOWN_GRACE_S = 1


class _LoopServer(uvicorn.Server):
    """uvicorn without its signal handlers, telling when its listener is up."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.listening = asyncio.Event()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # the coordinator's own handlers stay in place

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        self.listening.set()


class HttpServer:
    """Owned by the coordinator app: `start()` binds and serves, `stop()` closes (both on its loop)."""

    def __init__(self, app: ASGIApp, host: str, port: int, ssl_context: ssl.SSLContext | None = None) -> None:
        self.host, self.port = host, port
        self.ssl_context = ssl_context
        factory: Any = None if ssl_context is None else (lambda _config, _default: ssl_context)
        self.config = uvicorn.Config(
            app,
            lifespan="off",
            access_log=False,
            log_config=None,
            timeout_graceful_shutdown=_SHUTDOWN_GRACE_S,
            ssl_context_factory=factory,
        )
        self.address = ""
        self._server = _LoopServer(self.config)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> str:
        """Bind (port 0 = OS-chosen) and serve; returns `host:port`. Raises if the listener fails."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.create_server((self.host, self.port), family=family)
        self.address = f"{self.host}:{sock.getsockname()[1]}"
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]), name="http-server")
        listening = asyncio.create_task(self._server.listening.wait())
        await asyncio.wait({self._task, listening}, return_when=asyncio.FIRST_COMPLETED)
        if not listening.done():
            listening.cancel()
            self._task.result()  # raises the startup failure
            raise RuntimeError("the HTTP server stopped during start-up")
        scheme = "https" if self.ssl_context is not None else "http"
        log.info("http listening", url=f"{scheme}://{self.address}")
        return self.address

    async def stop(self) -> None:
        if self._task is None:
            return
        self._server.should_exit = True
        await self._task
