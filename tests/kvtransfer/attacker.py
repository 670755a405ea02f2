"""An outsider on the transfer network: a process that can reach a worker's transfer port but was
never told its transfer key or any session secret. Used by test_outsider.py.

    python -m tests.kvtransfer.attacker SPEC_JSON

SPEC: {"backend", "layout", "target": "host:port", "claim": address to impersonate,
       "messages": [[tag, nbytes], ...] to send under chosen tags, "byte": payload fill value,
       "version", "nonce_bytes", "hello_max_bytes": the hello's (kvtransfer.hello's; passed in, so that
       the attacker imports no part of kvtransfer, whose package import alone costs seconds of CPU)}.

It sends the tagged messages (UCX: straight at the worker, whose tag matching spans endpoints; TCP,
and NIXL, whose control socket runs the same hello: as TCP RTS/DATA frames, once without any hello
and once after a refused one), runs a valid-looking hello
claiming `claim` with a forged proof, and prints one JSON line: what the target answered.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import socket
import struct
import sys
from typing import Any

_LEN = struct.Struct("<I")
_HEADER = struct.Struct("<BQQ")  # kvtransfer.tcp's frame header
_RTS, _DATA = 1, 3


def _hello(spec: dict[str, Any]) -> bytes:
    msg = {"version": spec["version"], "address": spec["claim"], "layout": spec["layout"]}
    return json.dumps({**msg, "nonce": secrets.token_hex(spec["nonce_bytes"])}).encode()


def _forged_proof() -> bytes:
    return json.dumps({"proof": secrets.token_hex(32)}).encode()


def _frames(spec: dict[str, Any]) -> bytes:
    out = b""
    for tag, nbytes in spec["messages"]:
        out += (
            _HEADER.pack(_RTS, tag, nbytes)
            + _HEADER.pack(_DATA, tag, nbytes)
            + bytes([spec["byte"]]) * nbytes
        )
    return out


def _tcp_recv(sock: socket.socket) -> bytes:
    (size,) = _LEN.unpack(_recv_exactly(sock, _LEN.size))
    return _recv_exactly(sock, size)


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise ConnectionError("closed by the target")
        out += chunk
    return out


def attack_tcp(spec: dict[str, Any]) -> dict[str, Any]:
    host, port = spec["target"].rsplit(":", 1)
    result: dict[str, Any] = {}
    # 1. Frames with no hello at all: the target must read them as a (malformed) hello and hang up.
    if spec["messages"]:
        with socket.create_connection((host, int(port)), timeout=30) as raw:
            with contextlib.suppress(OSError):
                raw.sendall(_frames(spec))
            with contextlib.suppress(OSError):
                result["raw_reply"] = raw.recv(1).hex()  # b"" once the target closed
    # 2. A valid-looking hello with a forged proof, then the frames anyway.
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(_LEN.pack(len(hello := _hello(spec))) + hello)
        result["challenge"] = json.loads(_tcp_recv(sock))
        proof = _forged_proof()
        sock.sendall(_LEN.pack(len(proof)) + proof)
        result["verdict"] = json.loads(_tcp_recv(sock))
        with contextlib.suppress(OSError):
            sock.sendall(_frames(spec))
            result["after_frames"] = sock.recv(1).hex()
    return result


async def attack_ucx(spec: dict[str, Any]) -> dict[str, Any]:
    import numpy as np
    import ucxx
    from ucxx._lib.arr import Array
    from ucxx.types import Tag

    host, port = spec["target"].rsplit(":", 1)
    endpoint = await ucxx.create_endpoint(host, int(port))
    # Tagged messages first: UCX keeps one endpoint's messages in order, so all of them reached the
    # target's tag matching before it read our hello (and long before it could close on us).
    buffers = [np.full(nbytes, spec["byte"], dtype=np.uint8) for _, nbytes in spec["messages"]]
    requests = [
        endpoint._ep.tag_send(Array(b), Tag(tag))
        for (tag, _), b in zip(spec["messages"], buffers, strict=True)
    ]
    # the hello on the endpoint's own tags: one frame of `<len:u32>` + message, padded to the size
    # the target receives (kvtransfer.ucx._UcxHello, spoken from the outside)
    frame_bytes = _LEN.size + spec["hello_max_bytes"]

    async def send(message: bytes) -> None:
        await endpoint.send(bytearray(_LEN.pack(len(message)) + message).ljust(frame_bytes, b"\0"))

    async def recv() -> bytes:
        frame = bytearray(frame_bytes)
        await endpoint.recv(frame)
        return bytes(frame[_LEN.size : _LEN.size + _LEN.unpack_from(frame)[0]])

    await send(_hello(spec))
    result: dict[str, Any] = {"challenge": json.loads(await recv())}
    await send(_forged_proof())
    result["verdict"] = json.loads(await recv())
    result["sends_completed"] = sum(bool(r.completed) for r in requests)
    with contextlib.suppress(Exception):
        await endpoint.close()
    return result


def main() -> None:
    spec = json.loads(sys.argv[1])
    result = attack_tcp(spec) if spec["backend"] in ("tcp", "nixl") else asyncio.run(attack_ucx(spec))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
