"""The engine step loop of a worker: the forward on a thread, every engine structure on the event loop.

    event loop:  schedule ──► (await thread) ──► finish_step ──► deferred releases ──► role.on_step
    step thread:              execute (forward + sampling)

Only the event loop thread changes the engine (scheduler, KV manager, block pool); the step thread runs
`LLMEngine.execute`, which reads the runner and the scheduled sequences only. So the control loop keeps
handling messages (an Abort, a Reserved, a reservation) while a step runs. The one rule that makes this
safe: a sequence the in-flight step computes is never freed mid-step; `release` defers it to the end
of the step.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import structlog

from engine.llm_engine import LLMEngine, StepOutput
from engine.scheduler import ScheduledSequence, SchedulerOutput
from engine.sequence import Sequence
from engine.worker.metrics import WorkerMetrics

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class StepReport:
    """What one step did: its schedule, the engine's outputs, and the forward's wall time."""

    out: SchedulerOutput
    outputs: list[StepOutput]
    seconds: float


class StepHandler(Protocol):
    """The role (prefill, decode) reacting to the engine; every method runs on the event loop."""

    async def on_preempted(self, seqs: list[Sequence]) -> None: ...

    async def on_scheduled(self, scheduled: list[ScheduledSequence]) -> None: ...

    async def on_step(self, report: StepReport) -> None: ...

    async def on_step_failed(self, seqs: list[Sequence], error: BaseException) -> None: ...


class StepLoop:
    """Runs `engine`'s steps until `stop()`. Created and driven by the worker; one per engine."""

    def __init__(self, engine: LLMEngine, metrics: WorkerMetrics) -> None:
        self.engine = engine
        self.metrics = metrics
        self.handler: StepHandler | None = None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="engine-step")
        self._wake = asyncio.Event()
        self._in_flight: set[Sequence] = set()
        self._deferred: list[Sequence] = []
        self._stopped = False

    def wake(self) -> None:
        """New work or freed blocks: let a waiting loop schedule again."""
        self._wake.set()

    @property
    def step_in_flight(self) -> bool:
        return bool(self._in_flight)

    def release(self, seq: Sequence) -> None:
        """Take `seq` out of the engine and drop its block references, exactly once: now, or right after
        the in-flight step when that step computes it. Safe on finished and never-queued sequences."""
        if seq in self._in_flight:
            self._deferred.append(seq)  # protects an invariant: the forward still writes its slots
            return
        self.engine.release(seq)
        self.wake()

    def stop(self) -> None:
        self._stopped = True
        self.wake()

    async def run(self) -> None:
        assert self.handler is not None, "set the handler before running the loop"
        loop = asyncio.get_running_loop()
        try:
            while not self._stopped:
                self._wake.clear()  # cleared before looking, so a wake during the awaits below is kept
                if not self.engine.has_unfinished():
                    await self._wake.wait()  # idle: nothing to compute until a message brings work
                    continue
                out = self.engine.schedule()
                if out.preempted:
                    await self._notify(self.handler.on_preempted(out.preempted))
                if not out.scheduled:
                    # protects the pool: nothing fits until a release (held results, reservations) wakes us
                    await self._wake.wait()
                    continue
                await self._step(loop, out)
        finally:
            self._executor.shutdown(wait=True)

    async def _step(self, loop: asyncio.AbstractEventLoop, out: SchedulerOutput) -> None:
        assert self.handler is not None
        self._in_flight = {item.seq for item in out.scheduled}
        await self._notify(self.handler.on_scheduled(out.scheduled))
        start = time.perf_counter()
        try:
            # protects an invariant: one forward at a time over the KV cache; the loop stays responsive
            result = await loop.run_in_executor(self._executor, self.engine.execute, out)
        except Exception as exc:
            log.exception("model step failed", sequences=len(out.scheduled))
            self._end_step()
            await self.handler.on_step_failed([item.seq for item in out.scheduled], exc)
            return
        seconds = time.perf_counter() - start
        outputs = self.engine.finish_step(out, result, seconds)
        self._end_step()
        self._account(out, seconds)
        await self._notify(self.handler.on_step(StepReport(out, outputs, seconds)))

    async def _notify(self, call: Awaitable[None]) -> None:
        """Run a handler callback; its bug is logged, not fatal: the engine's state is already whole."""
        try:
            await call
        except Exception:
            log.exception("step handler failed")

    def _end_step(self) -> None:
        self._in_flight = set()
        deferred, self._deferred = self._deferred, []
        for seq in deferred:
            self.release(seq)

    def _account(self, out: SchedulerOutput, seconds: float) -> None:
        decode_only = out.num_tokens == len(out.scheduled)
        self.metrics.step_seconds.labels("decode" if decode_only else "prefill").observe(seconds)
