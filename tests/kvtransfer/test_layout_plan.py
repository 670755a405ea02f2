"""Layout descriptor and message plan: pure functions, no processes."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import pytest
import torch

from kvtransfer import KVLayout, LayoutMismatch
from kvtransfer.plan import (
    check_session_secret,
    consecutive_start,
    message_tag,
    new_session_secret,
    plan_messages,
)
from tests.kvtransfer.conftest import LAYOUT


def test_layout_block_bytes_and_cache() -> None:
    assert LAYOUT.block_shape == (2, 2, 4, 2, 8)
    assert LAYOUT.block_bytes == 2 * 2 * 4 * 2 * 8 * 2
    cache = LAYOUT.new_cache(3)
    LAYOUT.check_cache(cache)
    assert cache[1].numel() * cache.element_size() == LAYOUT.block_bytes
    with pytest.raises(ValueError):
        LAYOUT.check_cache(cache.to(torch.float32))


def test_layout_digest_is_stable_and_covers_every_field() -> None:
    assert LAYOUT.digest() == KVLayout.from_dict(LAYOUT.to_dict()).digest()
    changed: dict[str, Any] = {"dtype": "bfloat16", "num_layers": 3, "block_size": 8, "num_kv_heads": 1}
    for name, value in {**changed, "head_dim": 16, "model_identity": "other"}.items():
        other = dataclasses.replace(LAYOUT, **{name: value})
        assert other.digest() != LAYOUT.digest()
        with pytest.raises(LayoutMismatch) as e:
            LAYOUT.check_compatible(other)
        assert e.value.field == name and name in str(e.value)


def test_layout_rejects_unknown_order_and_dtype() -> None:
    with pytest.raises(ValueError, match="order"):
        dataclasses.replace(LAYOUT, order="layer-major")
    with pytest.raises(ValueError, match="dtype"):
        dataclasses.replace(LAYOUT, dtype="float7")


def test_plan_direct_runs_and_packed_fragments() -> None:
    dst = [40, 41, 42, 43, 7, 19, 3, 60, 61, 62]
    plan = plan_messages(dst, block_bytes=100, max_message_bytes=10_000, min_direct_bytes=300)
    assert [(m.start, m.stop, m.direct) for m in plan] == [(0, 4, True), (4, 7, False), (7, 10, True)]
    assert [m.index for m in plan] == [0, 1, 2]


def test_plan_tiles_the_sequence_within_the_size_cap() -> None:
    dst = [*list(range(100, 120)), 5, 9, 11, 13, *list(range(30, 33))]
    plan = plan_messages(dst, block_bytes=100, max_message_bytes=500, min_direct_bytes=200)
    assert plan[0].start == 0 and plan[-1].stop == len(dst)
    assert all(a.stop == b.start for a, b in itertools.pairwise(plan))
    assert all(m.num_blocks <= 5 for m in plan)
    for m in plan:
        assert m.direct == (consecutive_start(dst[m.start : m.stop]) is not None and m.num_blocks >= 2)


def test_session_tags_derive_from_the_secret_alone() -> None:
    a, b = new_session_secret(), new_session_secret()
    assert a != b and len(a) == 16
    tags = {message_tag(secret, i) for secret in (a, b) for i in range(1000)}
    assert len(tags) == 2000  # no two messages of two sessions share a tag
    assert message_tag(a, 3) == message_tag(bytes(a), 3)  # stable: both sides compute the same
    assert all(0 <= t < 1 << 64 for t in tags)
    with pytest.raises(ValueError, match="at least 16 bytes"):
        check_session_secret(b"short")
