"""Packed id lists round-trip from every input kind and refuse values that would wrap around."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from splitserve.v1 import control_pb2
from splitserve.wire import ids_array, pack_hashes, pack_ids, unpack_hashes, unpack_ids

INT32 = st.integers(-(2**31), 2**31 - 1)
UINT64 = st.integers(0, 2**64 - 1)


@given(st.lists(INT32, max_size=300))
def test_python_ints_round_trip(ids: list[int]) -> None:
    packed = pack_ids(ids)
    assert len(packed) == 4 * len(ids)
    assert unpack_ids(packed) == ids
    assert ids_array(packed).tolist() == ids


def _int32_compatible_arrays(dtype: Any) -> st.SearchStrategy[np.ndarray]:
    info = np.iinfo(dtype)
    elements = st.integers(max(info.min, -(2**31)), min(info.max, 2**31 - 1))
    return hnp.arrays(dtype, st.integers(0, 300), elements=elements)


@given(st.sampled_from([np.int64, np.int32, np.uint16, np.int8]).flatmap(_int32_compatible_arrays))
def test_numpy_arrays_round_trip(arr: np.ndarray) -> None:
    assert unpack_ids(pack_ids(arr)) == arr.tolist()


@given(st.lists(st.integers(-(2**31), 2**31 - 1), max_size=100), st.sampled_from([torch.int64, torch.int32]))
def test_torch_tensors_round_trip(ids: list[int], dtype: torch.dtype) -> None:
    assert unpack_ids(pack_ids(torch.tensor(ids, dtype=dtype))) == ids


@given(st.lists(UINT64, max_size=100))
def test_hashes_round_trip(hashes: list[int]) -> None:
    packed = pack_hashes(hashes)
    assert len(packed) == 8 * len(hashes)
    assert unpack_hashes(packed) == hashes


def test_bytes_are_little_endian_int32() -> None:
    assert pack_ids([1, -2]) == b"\x01\x00\x00\x00\xfe\xff\xff\xff"
    assert pack_hashes([1]) == b"\x01" + b"\x00" * 7


@pytest.mark.parametrize(
    "bad",
    [
        [2**31],
        [-(2**31) - 1],
        [2**70],
        [1.5],
        [[1, 2]],
        np.array([0.5]),
        np.zeros((2, 2), np.int32),
        torch.tensor([2**40]),
    ],
)
def test_pack_ids_refuses_what_would_wrap_or_truncate(bad: object) -> None:
    with pytest.raises(ValueError):
        pack_ids(bad)


@pytest.mark.parametrize("bad", [[-1], [2**64], np.array([-1])])
def test_pack_hashes_refuses_out_of_range(bad: object) -> None:
    with pytest.raises(ValueError):
        pack_hashes(bad)


def test_truncated_bytes_are_refused() -> None:
    with pytest.raises(ValueError, match="whole number"):
        unpack_ids(b"\x00" * 5)
    with pytest.raises(ValueError, match="whole number"):
        unpack_hashes(b"\x00" * 12)


def test_ids_array_is_a_read_only_view() -> None:
    packed = pack_ids(range(10))
    view = ids_array(packed)
    assert view.dtype == np.dtype("<i4")
    assert not view.flags.writeable
    assert view.base is packed


@given(st.lists(st.integers(0, 2**31 - 1), max_size=2000))
def test_ids_survive_a_control_message(block_ids: list[int]) -> None:
    sent = control_pb2.Envelope(
        reserved=control_pb2.Reserved(rid=7, generation=2, block_ids=pack_ids(block_ids))
    )
    received = control_pb2.Envelope.FromString(sent.SerializeToString())
    assert unpack_ids(received.reserved.block_ids) == block_ids
