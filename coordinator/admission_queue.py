"""The bounded admission queue: admitted requests waiting for a placement.

Order: lower `priority` first, then arrival (rids grow with arrival, so a resumed request goes back to
its original place, ahead of later arrivals). New arrivals beyond `max_size` are refused at once with
RESOURCE_EXHAUSTED QUEUE_FULL and a RetryInfo; a resumed request is always taken back (it was
admitted already, and refusing it would drop a stream mid-way).
"""

from __future__ import annotations

import heapq
import itertools

import grpc

from coordinator.errors import RpcError
from coordinator.request_table import RequestRecord


class AdmissionQueue:
    """Owned by the dispatcher; event-loop only. Removal is lazy (cancelled entries are skipped)."""

    def __init__(self, max_size: int, retry_after_s: float = 1.0) -> None:
        self.max_size = max_size
        self.retry_after_s = retry_after_s
        self._heap: list[tuple[int, int, int, RequestRecord]] = []
        self._live: set[int] = set()
        self._tiebreak = itertools.count()  # never compare records

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, record: RequestRecord) -> bool:
        return record.rid in self._live

    def push(self, record: RequestRecord, *, resumed: bool = False) -> None:
        if not resumed and len(self._live) >= self.max_size:
            raise RpcError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "QUEUE_FULL",
                f"the admission queue is full ({len(self._live)} requests waiting, limit {self.max_size}); "
                f"retry in {self.retry_after_s:g} s",
                metadata={"queue_depth": len(self._live), "max_queue": self.max_size},
                retry_after_s=self.retry_after_s,
            )
        if record.rid not in self._live:
            self._live.add(record.rid)
            heapq.heappush(self._heap, (record.admitted.priority, record.rid, next(self._tiebreak), record))

    def peek(self) -> RequestRecord | None:
        while self._heap and self._heap[0][1] not in self._live:
            heapq.heappop(self._heap)
        return self._heap[0][3] if self._heap else None

    def pop(self) -> RequestRecord:
        record = self.peek()
        assert record is not None, "pop from an empty admission queue"
        heapq.heappop(self._heap)
        self._live.discard(record.rid)
        return record

    def remove(self, record: RequestRecord) -> None:
        self._live.discard(record.rid)

    def ordered(self) -> list[RequestRecord]:
        """The waiting requests in queue order (a snapshot; `remove` takes one out of turn). Compacts
        the heap: entries of removed requests and repeats of a re-queued one are dropped."""
        entries, seen = [], set()
        for entry in sorted(self._heap):
            if entry[1] in self._live and entry[1] not in seen:
                seen.add(entry[1])
                entries.append(entry)
        self._heap = entries  # a sorted list is a valid heap
        return [entry[3] for entry in entries]

    def drain_all(self) -> list[RequestRecord]:
        """Take every waiting request out, in queue order."""
        out = []
        while self.peek() is not None:
            out.append(self.pop())
        return out
