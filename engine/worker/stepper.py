"""The engine step loop of a worker: the forward on a thread, every engine structure on the event loop.

    event loop:  schedule ──► (await thread) ──► finish_step ──► deferred releases ──► role.on_step
    step thread:              execute (forward + sampling)

Only the event loop thread changes the engine (scheduler, KV manager, block pool); the step thread runs
`LLMEngine.execute`, which reads the runner and the scheduled sequences only. So the control loop keeps
handling messages (an Abort, a Reserved, a reservation) while a step runs. The one rule that makes this
safe: a sequence the in-flight step computes is never freed mid-step; `release` defers it to the end
of the step.

With core leases (engine/worker/core_lease.py) the loop also lends and borrows cores: a lender claims
its own cores before computing and lends them whenever it waits for work; a borrower, while a short
prompt is pending, takes the free borrowed cores before scheduling (the time cap then prices that
step's prompt tokens at their cost there), runs the step on them too, and gives them back as the
step ends (at once when the step has no prompt work).

A worker at idle CPU priority (`--cpu-priority idle`) is preempted mid-step by design, whenever
anything else on its CPUs has work: its step costs (the router's price of its prompt tokens) are fitted
to each forward's wall time less the time the step thread waited on a run queue meanwhile
(`run_queue_wait_s`), or a long lane beside a busy short one priced its documents at 1.1-2.7 ms a token
instead of about 0.7 and the router sent them to the decode worker (session 35). What the preemptions cost
its first tokens is the calibration's (coordinator/ttft_calibration.py). Only the step thread's wait
is subtracted: a team of several threads also waits at its barrier for a preempted member.
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
from engine.runner import StepResult
from engine.scheduler import ScheduledSequence, SchedulerOutput
from engine.sequence import Sequence
from engine.worker.core_lease import CoreLeases
from engine.worker.metrics import WorkerMetrics
from engine.worker.step_trace import StepRecord, StepTrace

log = structlog.get_logger(__name__)


SCHEDSTAT = "/proc/thread-self/schedstat"  # Linux: ns on a CPU, ns waiting on a run queue, timeslices


def run_queue_wait_s() -> float:
    """Seconds the calling thread has spent runnable but waiting for a CPU since it started; 0 where
    the kernel does not say (no schedstat)."""
    try:
        with open(SCHEDSTAT) as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


@dataclass(slots=True)
class ForwardTimes:
    """The step thread's own view of one forward (0 where not measured): how long it waited for a
    CPU while runnable, and the CPU time it ran (its OpenMP team's other threads not included)."""

    waited_s: float = 0.0
    cpu_s: float = 0.0


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
    """Runs `engine`'s steps until `stop()`. Created and driven by the worker; one per engine.
    `net_of_waits`: fit the step costs to each forward's time less its run-queue wait (module doc).
    `trace`: a line per step there, the step thread's run-queue wait included (the worker opens and
    closes it)."""

    def __init__(
        self,
        engine: LLMEngine,
        metrics: WorkerMetrics,
        leases: CoreLeases | None = None,
        net_of_waits: bool = False,
        trace: StepTrace | None = None,
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        self.leases = leases
        self.net_of_waits = net_of_waits
        self.trace = trace
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
                    await self._idle()  # nothing to compute until a message brings work
                    continue
                if self.leases is not None and self.leases.lends:
                    self.metrics.core_claim_seconds.observe(await self.leases.claim())
                borrowed = self._borrow()
                out = self.engine.schedule(widened=bool(borrowed))
                if borrowed and not any(item.is_prompt_chunk for item in out.scheduled):
                    borrowed = self._give_back()  # no prompt work after all: the step stays home
                if out.preempted:
                    await self._notify(self.handler.on_preempted(out.preempted))
                if not out.scheduled:
                    # protects the pool: nothing fits until a release (held results, reservations) wakes us
                    await self._idle()
                    continue
                await self._step(loop, out, borrowed)
        finally:
            self._executor.shutdown(wait=True)
            if self.leases is not None:
                self.leases.close()

    async def _idle(self) -> None:
        """Wait for a wake; a lender's cores may be borrowed meanwhile."""
        if self.leases is not None:
            self.leases.lend()
        await self._wake.wait()

    async def _step(self, loop: asyncio.AbstractEventLoop, out: SchedulerOutput, borrowed: list[int]) -> None:
        """Run `out` on the step thread, widened onto `borrowed` (this step's, given back as it ends)."""
        assert self.handler is not None
        self._in_flight = {item.seq for item in out.scheduled}
        await self._notify(self.handler.on_scheduled(out.scheduled))
        if borrowed:
            self.metrics.borrowed_core_steps.inc()
        # traced: the keys the step's attention reads, counted before finish_step advances the sequences
        context = (
            sum(i.seq.num_computed_tokens + i.num_new_tokens for i in out.scheduled)
            if self.trace is not None
            else 0
        )
        started_at = time.time()
        loop_cpu, process_cpu = (
            (time.thread_time(), time.process_time()) if self.trace is not None else (0, 0)
        )
        start = time.perf_counter()
        try:
            # protects an invariant: one forward at a time over the KV cache; the loop stays responsive
            result, forward = await loop.run_in_executor(self._executor, self._execute, out, borrowed)
        except Exception as exc:
            log.exception("model step failed", sequences=len(out.scheduled))
            self._end_step()
            await self.handler.on_step_failed([item.seq for item in out.scheduled], exc)
            return
        finally:
            self._give_back()
        seconds = time.perf_counter() - start
        if self.trace is not None:  # this (the loop's) thread's CPU and every thread's, while the forward ran
            loop_cpu, process_cpu = time.thread_time() - loop_cpu, time.process_time() - process_cpu
        cost_seconds = seconds - forward.waited_s if self.net_of_waits else seconds
        outputs = self.engine.finish_step(out, result, cost_seconds, widened=bool(borrowed))
        self._end_step()
        self._account(out, seconds)
        await self._notify(self.handler.on_step(StepReport(out, outputs, seconds)))
        if self.trace is not None:
            self.trace.write(
                StepRecord(
                    started_at=started_at,
                    sequences=len(out.scheduled),
                    tokens=out.num_tokens,
                    context_tokens=context,
                    seconds=seconds,
                    run_queue_wait_s=forward.waited_s,
                    after_s=time.perf_counter() - start - seconds,
                    step_cpu_s=forward.cpu_s,
                    loop_cpu_s=loop_cpu,
                    other_cpu_s=max(0.0, process_cpu - loop_cpu - forward.cpu_s),
                )
            )

    def _borrow(self) -> list[int]:
        """The borrowed CPUs the next step may run on beside this worker's own: the free, unclaimed
        ones, taken before scheduling while a short prompt (by `long_prefill_token_threshold`) waits
        or is mid-prefill, so the scheduler's time cap prices its tokens at their cost there. Decode
        steps stay on the home team, and so do long prompts' chunks alone: those would hold the
        lender's cores for seconds, and the short prompts arriving meanwhile would find both workers
        busy."""
        if self.leases is None or not self.leases.borrows or not self.engine.short_prompt_pending():
            return []
        return self.leases.borrow()

    def _give_back(self) -> list[int]:
        """Return any borrowed CPUs (the team is already home); the empty list of what is left."""
        if self.leases is not None:
            self.leases.give_back()
        return []

    def _execute(self, out: SchedulerOutput, borrowed: list[int]) -> tuple[StepResult, ForwardTimes]:
        """On the step thread: the forward, on a team widened onto `borrowed` for this step only, and
        this thread's wait for a CPU and CPU time during it (measured for `net_of_waits` and the
        trace)."""
        measured = self.net_of_waits or self.trace is not None
        waited, cpu = (run_queue_wait_s(), time.thread_time()) if measured else (0.0, 0.0)
        if not borrowed:
            result = self.engine.execute(out)
        else:
            assert self.leases is not None
            self.leases.widen(borrowed)
            try:
                result = self.engine.execute(out)
            finally:
                self.leases.narrow()
        if not measured:
            return result, ForwardTimes()
        return result, ForwardTimes(run_queue_wait_s() - waited, time.thread_time() - cpu)

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
