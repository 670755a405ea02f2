"""The step trace's summary (engine/worker/step_trace.py) on records written by its own writer: batch
sizes, the gap between steps, and the split by another worker's overlapping steps."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.worker import step_trace
from engine.worker.step_trace import StepRecord, StepTrace


def step(start: float, ms: float, sequences: int = 1, tokens: int | None = None) -> StepRecord:
    return StepRecord(
        start, sequences, sequences if tokens is None else tokens, 100 * sequences, ms / 1e3, 0.0, 0.0
    )


def test_summary_by_batch_gap_and_overlap(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # D: four batch-1 steps of 10 ms, 2 ms apart, then a batch-2 step after an idle second
    decode = [step(100.000, 10), step(100.012, 10), step(100.024, 10), step(100.036, 10), step(101.5, 20, 2)]
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
    assert lines[2].startswith("batch   1:      4 steps, ms p50   10.0")
    assert "; beside a step (2) p50   10.0" in lines[2] and "; alone (2) p50   10.0" in lines[2]
    assert lines[3].startswith("batch   2:      1 steps, ms p50   20.0") and "beside" not in lines[3]

    prefill_trace = StepTrace(tmp_path, "prefill-0")
    for record in prefill:
        prefill_trace.write(record)
    prefill_trace.close()
    assert step_trace.main([str(trace.path), "--beside", str(prefill_trace.path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == str(trace.path) and out[1:] == ["  " + line for line in lines]
