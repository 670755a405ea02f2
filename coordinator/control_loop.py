"""The coordinator's side of the control plane: one ZeroMQ ROUTER, every worker's DEALER connected to it.

In: Register, Heartbeat, Deregister, PoolStateReply (membership and load, into the registry); PrefillDone
and TokenBatch (outputs, through the request table's gate); ReserveFailed, Preempted, Abort (to the
dispatcher). Out: everything the dispatcher and this loop post, through the `Outbox`, in post order.

Trust: `socket.recv` drops malformed frames (splitserve/control.py). With CURVE (`authorized` given) a
Register is accepted only from a key allow-listed for the role it claims, and binds the worker id to
that key: every later message under that id must come from the same key, else it is dropped (reason
"unauthenticated") — the sender is the routing id plus the authenticated key, never a field inside a
message. Under --insecure-control-plane (`authorized` None) every key is "".

Liveness: a worker silent for longer than the staleness bound is marked STALE by the sweep and its
requests are recovered; a new incarnation under a known worker id, a Deregister, or a send that fails
(its queue is full or it is gone) does the same. Every membership change re-sends `Peers` to the
workers and calls `on_membership` (the health service follows it).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable

import structlog

from coordinator.dispatch import Dispatcher
from coordinator.metrics import CoordinatorMetrics
from coordinator.request_table import Outcome, RequestTable
from coordinator.workers import STALE, WorkerInfo, WorkerRegistry
from splitserve.control import ControlQueueFull, ControlSocket, Received, envelope
from splitserve.control_auth import AuthorizedKeys
from splitserve.v1 import control_pb2, serving_pb2

log = structlog.get_logger(__name__)


class Outbox:
    """Ordered, non-blocking sends. `post` never waits; a failed send calls `on_failure(worker_id, why)`."""

    def __init__(self, socket: ControlSocket) -> None:
        self.socket = socket
        self.on_failure: Callable[[str, str], None] = lambda worker_id, why: None
        self._queue: asyncio.Queue[tuple[str, control_pb2.Envelope]] = asyncio.Queue()

    def post(self, to: str, env: control_pb2.Envelope) -> None:
        self._queue.put_nowait((to, env))

    async def run(self) -> None:
        while True:
            to, env = await self._queue.get()
            try:
                await self.socket.send(env, to=to)
            except ControlQueueFull as exc:
                log.warning("control send failed", worker=to, kind=env.WhichOneof("msg"), error=str(exc))
                self.on_failure(to, str(exc))
            finally:
                self._queue.task_done()

    async def flush(self) -> None:
        """Wait until everything posted so far has been handed to ZeroMQ."""
        await self._queue.join()


class CoordinatorControl:
    """The coordinator's end of the control plane (the worker's is `engine.worker.runtime.WorkerControl`).
    Owned by the coordinator app; runs three tasks (receive, send, staleness sweep) on its loop."""

    def __init__(
        self,
        socket: ControlSocket,
        outbox: Outbox,
        registry: WorkerRegistry,
        table: RequestTable,
        dispatcher: Dispatcher,
        metrics: CoordinatorMetrics,
        *,
        incarnation: int,
        heartbeat_interval_ms: int,
        heartbeat_timeout_ms: int,
        on_membership: Callable[[], None] = lambda: None,
        authorized: AuthorizedKeys | None = None,
    ) -> None:
        self.socket = socket
        self.outbox = outbox
        self.registry = registry
        self.table = table
        self.dispatcher = dispatcher
        self.metrics = metrics
        self.incarnation = incarnation
        self.heartbeat_interval_ms = heartbeat_interval_ms
        self.heartbeat_timeout_ms = heartbeat_timeout_ms
        self.on_membership = on_membership
        self.authorized = authorized
        self._query_ids = itertools.count(1)
        self._queries: dict[int, tuple[set[str], dict[str, control_pb2.PoolStateReply], asyncio.Event]] = {}
        outbox.on_failure = self.peer_failed

    async def run(self) -> None:
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(self.outbox.run())
            tasks.create_task(self._receive())
            tasks.create_task(self._sweep())

    async def _receive(self) -> None:
        while True:
            msg = await self.socket.recv()
            try:
                self.handle(msg)
            except Exception as exc:  # one bad message must not stop the control plane
                self.socket.drop(
                    "handler_error", sender=msg.sender, kind=msg.kind, error=repr(exc)[:200], exc_info=True
                )

    async def _sweep(self) -> None:
        # a timer, not a synchronization: staleness is defined by elapsed time
        period = max(self.heartbeat_interval_ms, 20) / 2e3
        while True:
            await asyncio.sleep(period)
            for info in self.registry.sweep(time.monotonic()):
                log.warning("worker stale", worker=info.worker_id, silent_ms=self.heartbeat_timeout_ms)
                self.dispatcher.worker_lost(info.worker_id, "stale")
                self.on_membership()

    def handle(self, msg: Received) -> None:
        """Apply one validated message from worker `msg.sender` (authenticated as `msg.user_id`)."""
        sender, env, kind = msg.sender, msg.envelope, msg.kind
        if kind == "register":
            self._register(msg, env.register)
            return
        info = self.registry.get(sender)
        if info is None or info.register.endpoint.control_public_key != msg.user_id:
            self.socket.drop("unregistered" if info is None else "unauthenticated", sender=sender, kind=kind)
            return
        if kind == "heartbeat":
            self._heartbeat(sender, env.heartbeat)
        elif kind == "prefill_done":
            self._prefill_done(sender, env.prefill_done)
        elif kind == "token_batch":
            for item in env.token_batch.items:
                self._output(sender, item, from_prefill=False)
        elif kind == "reserve_failed":
            self.dispatcher.on_reserve_failed(sender, env.reserve_failed)
        elif kind == "preempted":
            self.dispatcher.on_preempted(sender, env.preempted)
        elif kind == "abort":
            self.dispatcher.on_worker_abort(sender, env.abort)
        elif kind == "deregister":
            self._deregister(sender, env.deregister)
        elif kind == "pool_state_reply":
            self._pool_state_reply(sender, env.pool_state_reply)
        else:
            self.socket.drop("unexpected_kind", sender=sender, kind=kind)

    # -- membership ----------------------------------------------------------------------------------
    def _key_refusal(self, msg: Received, reg: control_pb2.Register) -> str | None:
        """Why the authenticated key may not register `reg` under `msg.sender`, or None."""
        if self.authorized is None:
            return None
        role = self.authorized.role(msg.user_id)
        if role is None:  # the ZAP handler admitted it, so the allow-list changed since: refuse
            return "the control key is not authorized"
        if role != reg.role:
            return (
                f"role {serving_pb2.WorkerRole.Name(reg.role)} is not the role this control key is "
                f"authorized for ({serving_pb2.WorkerRole.Name(role)})"
            )
        bound = self.registry.get(msg.sender)
        if (
            bound is not None
            and bound.health != STALE
            and bound.register.endpoint.control_public_key != msg.user_id
        ):
            return f"worker id {msg.sender!r} is registered under another control key"
        return None

    def _register(self, msg: Received, reg: control_pb2.Register) -> None:
        sender = msg.sender
        reason = self._key_refusal(msg, reg) or self.registry.refusal(sender, reg)
        if reason is not None:
            log.warning("registration refused", worker=sender, reason=reason)
            self.outbox.post(sender, envelope(register_ack=self._ack(accepted=False, reason=reason)))
            return
        reg.endpoint.control_public_key = msg.user_id  # peers connect to the key that authenticated
        info, replaced = self.registry.add(reg, time.monotonic())
        self.metrics.set_worker_pool(info.worker_id, info.role_name, info.pool)
        ack = self._ack(accepted=True, peers=self.registry.peers_for(info))
        self.outbox.post(sender, envelope(register_ack=ack))  # before any work is sent to it
        log.info("worker registered", worker=sender, role=info.role_name, blocks=reg.num_blocks)
        if replaced is not None:
            self.dispatcher.worker_lost(sender, "restarted (new incarnation)")
        self._membership_changed(exclude=sender)

    def _ack(
        self, accepted: bool, reason: str = "", peers: list[control_pb2.Peer] | None = None
    ) -> control_pb2.RegisterAck:
        return control_pb2.RegisterAck(
            accepted=accepted,
            reason=reason,
            coordinator_incarnation=self.incarnation,
            heartbeat_interval_ms=self.heartbeat_interval_ms,
            heartbeat_timeout_ms=self.heartbeat_timeout_ms,
            peers=peers or [],
        )

    def _membership_changed(self, exclude: str | None = None) -> None:
        for info in self.registry:
            if info.worker_id != exclude:
                self.outbox.post(
                    info.worker_id, envelope(peers=control_pb2.Peers(peers=self.registry.peers_for(info)))
                )
        self.on_membership()
        self.dispatcher.pump()

    def _heartbeat(self, sender: str, hb: control_pb2.Heartbeat) -> None:
        before = self.registry.get(sender)
        was = before.health if before is not None else None
        info = self.registry.heartbeat(sender, hb, time.monotonic())
        if info is None:
            log.debug("heartbeat from an unregistered worker ignored", worker=sender)
            return
        self.metrics.set_worker_pool(info.worker_id, info.role_name, info.pool)
        if info.health != was:
            self.on_membership()
        self.dispatcher.pump()  # its capacity may have changed

    def _deregister(self, sender: str, msg: control_pb2.Deregister) -> None:
        info = self.registry.get(sender)
        if info is None or info.register.incarnation != msg.incarnation:
            return
        self._remove(info, f"deregistered: {msg.reason}")

    def _remove(self, info: WorkerInfo, why: str) -> None:
        self.registry.remove(info.worker_id)
        self.metrics.forget_worker(info.worker_id, info.role_name)
        log.info("worker removed", worker=info.worker_id, why=why)
        self.dispatcher.worker_lost(info.worker_id, why)
        self._membership_changed()

    def peer_failed(self, worker_id: str, why: str) -> None:
        """A send to the worker failed: it gets no new work until it heartbeats again."""
        info = self.registry.get(worker_id)
        if info is not None and info.health != STALE:
            info.health = STALE
            self.dispatcher.worker_lost(worker_id, why)
            self.on_membership()

    # -- outputs -------------------------------------------------------------------------------------
    def _prefill_done(self, sender: str, msg: control_pb2.PrefillDone) -> None:
        record = self.table.get(msg.output.rid)
        outcome = self._output(sender, msg.output, from_prefill=True)
        if record is not None and outcome in (Outcome.ACCEPTED, Outcome.FINISHED):
            stats = record.stats
            stats.queue_ms += msg.queue_ms
            stats.prefill_ms += msg.prefill_ms
            if stats.cached_prompt_tokens is None:
                stats.cached_prompt_tokens = msg.cached_tokens

    def _output(self, sender: str, tokens: control_pb2.Tokens, *, from_prefill: bool) -> Outcome:
        outcome = self.table.accept(sender, tokens, from_prefill=from_prefill)
        if outcome is Outcome.GAP:
            record = self.table.get(tokens.rid)
            if record is not None:
                self.dispatcher.resume(record, "output_gap")
        return outcome

    # -- pool state ----------------------------------------------------------------------------------
    async def query_pools(self, timeout_s: float) -> dict[str, control_pb2.PoolStateReply]:
        """Ask every non-stale worker for its pool state with an integrity check; wait for the replies,
        at most `timeout_s` (a bounded wait: a worker that does not answer keeps its heartbeat values)."""
        query_id = next(self._query_ids)
        targets = {w.worker_id for w in self.registry if w.health != STALE}
        replies: dict[str, control_pb2.PoolStateReply] = {}
        done = asyncio.Event()
        if not targets:
            return replies
        self._queries[query_id] = (targets, replies, done)
        query = control_pb2.PoolStateQuery(query_id=query_id, check_integrity=True)
        for worker_id in targets:
            self.outbox.post(worker_id, envelope(pool_state_query=query))
        try:
            await asyncio.wait_for(done.wait(), timeout_s)
        except TimeoutError:
            log.warning("pool state query timed out", missing=sorted(targets - replies.keys()))
        finally:
            del self._queries[query_id]
        return replies

    def _pool_state_reply(self, sender: str, msg: control_pb2.PoolStateReply) -> None:
        info = self.registry.get(sender)
        if info is not None:  # the registry keeps the heartbeat's view; only the gauges take the fresh one
            self.metrics.set_worker_pool(info.worker_id, info.role_name, msg.pool)
        query = self._queries.get(msg.query_id)
        if query is not None and sender in query[0]:
            targets, replies, done = query
            replies[sender] = msg
            if targets <= replies.keys():
                done.set()
