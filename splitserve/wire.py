"""Packed id lists for control.proto's `bytes` fields.

Token ids, block ids and stop token ids travel as little-endian int32 (4 bytes each, no per-element
framing); prefix-cache block hashes as little-endian uint64. Packing validates the range instead of
wrapping around, because a silently wrapped block id would corrupt a block table.

Inputs may be Python int sequences, 1-D numpy integer arrays, or CPU torch tensors (anything
`numpy.asarray` accepts); move a CUDA tensor to the host first.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
import numpy.typing as npt

_INT32 = np.dtype("<i4")
_UINT64 = np.dtype("<u8")


def _pack(values: Any, dtype: np.dtype[Any], code: str) -> bytes:
    if not hasattr(values, "__array__"):  # Python ints (the per-step token messages: one or a few)
        ints = values if isinstance(values, list | tuple | range) else list(values)
        try:  # struct refuses floats and out-of-range ints instead of truncating them
            return struct.pack(f"<{len(ints)}{code}", *ints)
        except struct.error as exc:
            raise ValueError(f"values must be integers that fit {dtype.name}: {exc}") from None
    arr = np.asarray(values)  # numpy arrays, torch tensors
    if arr.size == 0:
        return b""
    if arr.ndim != 1:
        raise ValueError(f"expected a 1-D sequence, got shape {arr.shape}")
    info = np.iinfo(dtype)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"expected integers in [{info.min}, {info.max}], got dtype {arr.dtype}")
    if arr.dtype != dtype:
        low, high = int(arr.min()), int(arr.max())
        if low < info.min or high > info.max:
            raise ValueError(f"values {low}..{high} do not fit {dtype.name} [{info.min}, {info.max}]")
        arr = arr.astype(dtype)
    return arr.tobytes()


def _view(data: bytes, dtype: np.dtype[Any]) -> npt.NDArray[Any]:
    if len(data) % dtype.itemsize:
        raise ValueError(f"{len(data)} bytes is not a whole number of {dtype.itemsize}-byte values")
    return np.frombuffer(data, dtype=dtype)


def pack_ids(ids: Any) -> bytes:
    """Packs token or block ids as little-endian int32; ValueError if any is outside int32."""
    return _pack(ids, _INT32, "i")


def ids_array(data: bytes) -> npt.NDArray[np.int32]:
    """Zero-copy, read-only int32 view of packed ids (copy it before writing or `torch.from_numpy`)."""
    return _view(data, _INT32)


def unpack_ids(data: bytes) -> list[int]:
    """The ids packed by `pack_ids`, as Python ints."""
    return ids_array(data).tolist()


def pack_hashes(hashes: Any) -> bytes:
    """Packs 64-bit prefix-cache block hashes as little-endian uint64; ValueError outside [0, 2**64)."""
    return _pack(hashes, _UINT64, "Q")


def unpack_hashes(data: bytes) -> list[int]:
    """The hashes packed by `pack_hashes`, as Python ints."""
    return _view(data, _UINT64).tolist()
