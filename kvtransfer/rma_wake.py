"""The native posting and completion path of `kvtransfer.ucx_rma` gets (kvtransfer/csrc/rma_wake.c), via ctypes.

UCXX's progress thread completes a get inside `ucp_worker_progress`; a Python callback there must
take the GIL, and waking the loop with `call_soon_threadsafe` costs a second handoff (together
~140 µs per get measured, docs/kvtransfer.md "Completion path"). The C callback instead counts the
batch down with atomics and, on its last get, queues the batch and writes an eventfd that the asyncio
loop watches with `add_reader`: the progressing thread never touches Python. Posting is one call
too (`rma_get`: every run's `ucp_get_nbx`, then the poster's own progress of a small batch), so a
batch costs Python one ctypes call, not several per get (docs/kvtransfer.md, "Posted in C").

The library is a plain shared object (no Python, torch or UCX headers) that setup.py builds next to
this module (`kvtransfer/_rma_wake<EXT_SUFFIX>`). A checkout that has not run `setup.py build_ext`
builds it on first use with the system C compiler, or fails saying what to run.
"""

from __future__ import annotations

import ctypes
import functools
import os
import shutil
import subprocess
import sysconfig
import tempfile
from pathlib import Path
from typing import Any

import structlog

from kvtransfer.errors import TransportError

log = structlog.get_logger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "rma_wake.c"
LIBRARY = Path(__file__).parent / f"_rma_wake{sysconfig.get_config_var('EXT_SUFFIX')}"
BUILD_HINT = "run `python setup.py build_ext --inplace` in the checkout (or reinstall the package)"


def address(function: Any) -> int:
    """The address of a ctypes function: what C calls through a function pointer."""
    return ctypes.cast(function, ctypes.c_void_p).value or 0


def bind(lib: ctypes.CDLL, name: str, restype: Any, *argtypes: Any) -> Any:
    """`lib`'s function `name` with its ctypes signature set."""
    fn = getattr(lib, name)
    fn.restype, fn.argtypes = restype, list(argtypes)
    return fn


class CWake(ctypes.Structure):
    """`struct rma_wake`: one per Rma; Python owns it and its eventfd."""

    _fields_ = [
        ("done", ctypes.c_void_p),
        ("request_free", ctypes.c_void_p),
        ("efd", ctypes.c_int32),
        ("inside", ctypes.c_int32),
    ]


class CBatch(ctypes.Structure):
    """`struct rma_batch`: one per `Rma.get` call; must stay alive until the batch finished (for a
    batch `rma_get` left pending: until the loop drained it)."""

    _fields_ = [
        ("next", ctypes.c_void_p),
        ("wake", ctypes.c_void_p),
        ("pending", ctypes.c_int64),
        ("status", ctypes.c_int32),
    ]


class CUcp(ctypes.Structure):
    """`struct rma_ucp`: the libucp functions `rma_get` calls and the worker; one per Rma."""

    _fields_ = [
        ("get_nbx", ctypes.c_void_p),
        ("progress", ctypes.c_void_p),
        ("signal", ctypes.c_void_p),
        ("worker", ctypes.c_void_p),
    ]


class CRun(ctypes.Structure):
    """`struct rma_run`: one get, `nbytes` from the peer's `remote` address into our `local` one."""

    _fields_ = [("local", ctypes.c_uint64), ("remote", ctypes.c_uint64), ("nbytes", ctypes.c_uint64)]


ABI = b"rma_wake ABI 2"  # `rma_wake_abi` of the rma_wake.c these mirrors match
PENDING, DONE_AT_POST, DONE_INLINE = 0, 1, 2  # what `rma_get` returns (negative: pending, unsignalled)


class NativeWake:
    """The library's functions; `complete` is the address UCP calls back (ucp_send_nbx_callback_t)."""

    def __init__(self, path: Path) -> None:
        lib = ctypes.CDLL(str(path))
        vp, i32, i64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64
        self.complete = address(lib.rma_wake_complete)
        self.release = bind(lib, "rma_batch_release", i32, vp, i64, i32)  # rma_get's, bound for tests
        self.get = bind(lib, "rma_get", i32, vp, vp, vp, vp, vp, vp, i64, i64, i32)
        self.drain = bind(lib, "rma_wake_drain", vp, vp)
        self.quiesce = bind(lib, "rma_wake_quiesce", None, vp)


def build(target: Path) -> None:
    """Compile rma_wake.c into `target` (atomically: concurrent builders each rename a whole file)."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise TransportError(f"{target.name} is missing and no C compiler is on PATH: {BUILD_HINT}")
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        cmd = [cc, "-O2", "-shared", "-fPIC", str(SOURCE), "-o", str(out)]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise TransportError(f"building {target.name} failed ({done.stderr.strip()}): {BUILD_HINT}")
        os.replace(out, target)


@functools.cache
def native() -> NativeWake:
    """The loaded library (once per process), built first if this checkout lacks it or holds one
    built from an older rma_wake.c."""
    if not LIBRARY.exists():
        log.warning("building the RMA library", library=str(LIBRARY), hint=BUILD_HINT)
        build(LIBRARY)
    elif ABI not in LIBRARY.read_bytes():  # checked unloaded: a loaded stale build would stay loaded
        log.warning("rebuilding the RMA library: built from an older rma_wake.c", library=str(LIBRARY))
        build(LIBRARY)
    return NativeWake(LIBRARY)
