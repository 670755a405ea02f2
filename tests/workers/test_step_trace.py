"""The step trace's summary (engine/worker/step_trace.py) on records written by its own writer: batch
sizes, the gap between steps, and the split by another worker's overlapping steps."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledSequence
from engine.sequence import Sequence
from engine.worker import step_trace, stepper
from engine.worker.metrics import WorkerMetrics
from engine.worker.step_trace import StepRecord, StepTrace
from engine.worker.stepper import StepLoop, StepReport


def step(
    start: float, ms: float, sequences: int = 1, tokens: int | None = None, waited_ms: float = 0.0
) -> StepRecord:
    return StepRecord(
        start,
        sequences,
        sequences if tokens is None else tokens,
        100 * sequences,
        ms / 1e3,
        waited_ms / 1e3,
        0.0,
    )


def test_summary_by_batch_gap_and_overlap(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # D: four batch-1 steps of 10 ms, 2 ms apart, then a batch-2 step after an idle second
    # (the second waited 2.5 ms of its 10 for a CPU)
    decode = [
        step(100.000, 10),
        step(100.012, 10, waited_ms=2.5),
        step(100.024, 10),
        step(100.036, 10),
        step(101.5, 20, 2),
    ]
    # P: one prompt step over 9 ms of the second D step and 7 of the third, and one long before them all
    prefill = [step(90.0, 5_000, tokens=64), step(100.013, 18, tokens=64)]
    assert [step_trace.overlapped(r, prefill) for r in decode] == [False, True, True, False, False]

    trace = StepTrace(tmp_path, "decode-0")
    for record in decode:
        trace.write(record)
    trace.close()
    trace.close()  # idempotent
    assert step_trace.read_records(trace.path) == decode

    lines = step_trace.summarize(decode, prefill)
    assert lines[0] == "5 steps, 5 decode-only"
    assert lines[1].startswith("gap between steps ms: p50 2.00 p99 2.00")  # the idle second is no gap
    assert lines[2] == "run-queue wait ms, decode-only: p50    0.0 p90    2.5 p99    2.5; over 1 ms in 1"
    assert lines[3] == "step thread CPU ms, decode-only: p50    0.0 p90    0.0 p99    0.0"  # not recorded
    assert [line.split(" CPU")[0] for line in lines[3:6]] == ["step thread", "event loop", "other threads"]
    assert lines[6].startswith("batch   1:      4 steps, ms p50   10.0")
    assert "; beside a step (2) p50   10.0" in lines[6] and "; alone (2) p50   10.0" in lines[6]
    assert lines[7].startswith("batch   2:      1 steps, ms p50   20.0") and "beside" not in lines[7]

    prefill_trace = StepTrace(tmp_path, "prefill-0")
    for record in prefill:
        prefill_trace.write(record)
    prefill_trace.close()
    assert step_trace.main([str(trace.path), "--beside", str(prefill_trace.path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == str(trace.path) and out[1:] == ["  " + line for line in lines]


class _Finish:
    """A role that only waits for its requests to finish (the loop's StepHandler)."""

    def __init__(self) -> None:
        self.done = asyncio.Event()

    async def on_preempted(self, seqs: list[Sequence]) -> None:
        raise AssertionError("nothing should be preempted")

    async def on_scheduled(self, scheduled: list[ScheduledSequence]) -> None:
        pass

    async def on_step(self, report: StepReport) -> None:
        if all(o.finished for o in report.outputs):
            self.done.set()

    async def on_step_failed(self, seqs: list[Sequence], error: BaseException) -> None:
        raise AssertionError(f"step failed: {error!r}")


async def test_the_loop_records_each_steps_run_queue_wait(
    tiny_model_dir: Callable[[str], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the trace on, every step's record has its step thread's run-queue wait, also where the
    step costs do not net waits out (a decode worker's): the schedstat counter here advances 4 ms a
    read. And the CPU the step thread, the loop and the rest of the process spent meanwhile."""
    reads = itertools.count()
    monkeypatch.setattr(stepper, "run_queue_wait_s", lambda: 0.004 * next(reads))
    engine = LLMEngine.from_model_dir(tiny_model_dir("llama-2l"), EngineConfig(num_blocks=16))
    trace = StepTrace(tmp_path, "colo-0")
    loop = StepLoop(engine, WorkerMetrics("colocated", "colo-0"), trace=trace)
    role = _Finish()
    loop.handler = role
    engine.add_request("r", [5, 6, 7, 8], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    running = asyncio.create_task(loop.run())
    await asyncio.wait_for(role.done.wait(), 30)
    loop.stop()
    await asyncio.wait_for(running, 30)
    trace.close()
    records = step_trace.read_records(trace.path)
    assert [r.tokens for r in records] == [4, 1, 1]
    assert [r.run_queue_wait_s for r in records] == pytest.approx([0.004] * 3)
    # the forward's own CPU time: above 0, within the step's wall
    assert all(0 < r.step_cpu_s <= r.seconds + 0.001 for r in records)
    assert all(r.loop_cpu_s >= 0 and r.other_cpu_s >= 0 for r in records)
