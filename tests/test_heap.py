"""freeze_heap: the live heap leaves the collector's generations (what a full collection walks)."""

from __future__ import annotations

import subprocess
import sys

# In a child, so the test process's own collector state is left alone: build a large live heap
# (what imports and a model are), freeze, and count what the collector still tracks.
CHILD = """
import gc
from splitserve.heap import freeze_heap
live = [[i] for i in range(200_000)]  # tracked containers, all alive
before = len(gc.get_objects())
frozen = freeze_heap()
after = len(gc.get_objects())
garbage = []
garbage.append(garbage)  # a cycle made after the freeze is still collected
del garbage
print(before, frozen, after, gc.collect())
"""


def test_freeze_moves_the_live_heap_out_of_every_generation() -> None:
    out = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, check=True, timeout=60
    )
    before, frozen, after, collected = map(int, out.stdout.splitlines()[-1].split())
    assert before > 200_000 and frozen >= 200_000
    assert after < 1_000  # a full collection now walks only what was allocated since
    assert collected >= 1
