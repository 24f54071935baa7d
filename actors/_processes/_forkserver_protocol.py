"""The forkserver's pipe protocol, shared by the controller's side, the forkserver and a Ray node host.

Requests (``["spawn", index, config]``) go down the forkserver's stdin and
reports (``["spawned", index, pid]``, ``["failed", index, why]``,
``["exited", index, pid, code]``) come back on its status pipe, each one
msgpack frame behind a 4-byte big-endian length.
"""

from __future__ import annotations

import struct
from typing import Any

import msgpack

__all__ = ["PR_SET_PDEATHSIG", "TERM_GRACE", "frame", "read_frames"]

#: Grace period between SIGTERM and SIGKILL when tearing workers down.
TERM_GRACE = 1.0
#: ``prctl`` option: the signal a process gets when its parent dies.
PR_SET_PDEATHSIG = 1


def frame(obj: Any) -> bytes:
    """``obj`` as one length-prefixed msgpack frame."""
    data: bytes = msgpack.packb(obj)
    return struct.pack(">I", len(data)) + data


def read_frames(buffer: bytearray) -> list[Any]:
    """Pop every complete frame from ``buffer`` (a partial one stays for the next read)."""
    out = []
    while len(buffer) >= 4:
        (size,) = struct.unpack(">I", buffer[:4])
        if len(buffer) < 4 + size:
            break
        out.append(msgpack.unpackb(bytes(buffer[4 : 4 + size]), raw=False))
        del buffer[: 4 + size]
    return out
