"""A long-running process's live heap, moved out of the cyclic garbage collector's reach.

A coordinator or worker imports torch, transformers, grpc and protobuf and loads a model: ~320,000
objects the collector tracks, none of them garbage. CPython's full (generation 2) collection walks
every one: 190 ms on the study's host (a decode worker, measured), a stall of every stream in the
coordinator and of a whole decode step in a worker, i.e. an inter-token gap of that length for
every running request. `freeze_heap`, called when the process is about to serve (the coordinator,
each worker) or to measure (`splitserve bench`, before each rate: its client times every token),
collects once and then moves every live object into the permanent generation (`gc.freeze`), so a
later full collection walks only what was allocated since. vLLM (`freeze_gc_heap`) and SGLang
freeze theirs the same way. The cost: a cycle among the frozen objects that becomes garbage later
is never collected (start-up objects live as long as the process, so none does here).
"""

from __future__ import annotations

import gc

import structlog

log = structlog.get_logger(__name__)


def freeze_heap() -> int:
    """Collect, then freeze everything alive; returns how many objects were frozen (logged)."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.debug("heap frozen", objects=frozen)
    return frozen
