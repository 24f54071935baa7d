"""The forkserver's pipe protocol, shared by the controller's side, the forkserver and a Ray node host.

A :class:`SpawnRequest` goes down the forkserver's stdin; reports come back
on its status pipe: :class:`Spawned`, :class:`SpawnFailed`, :class:`Exited`.
Each is one msgpack frame behind a 4-byte big-endian length, holding the
message's tag and then its fields. A frame that is not a well-formed
message of the kind expected is dropped with a log line (both ends are this
package, so that is a bug, never input to act on).
"""

from __future__ import annotations

import logging
import struct
from typing import Any, NamedTuple

import msgpack

__all__ = [
    "PR_SET_PDEATHSIG",
    "TERM_GRACE",
    "Exited",
    "Report",
    "SpawnFailed",
    "SpawnRequest",
    "Spawned",
    "frame",
    "read_reports",
    "read_requests",
]

log = logging.getLogger("actors")

#: Grace period between SIGTERM and SIGKILL when tearing workers down.
TERM_GRACE = 1.0
#: ``prctl`` option: the signal a process gets when its parent dies.
PR_SET_PDEATHSIG = 1
#: The longest frame either side accepts (a worker's config is a few kB): a longer prefix means the stream is
#: out of step, and waiting for that many bytes would buffer without bound.
MAX_FRAME = 16 * 2**20


class SpawnRequest(NamedTuple):
    """Fork worker number ``worker`` from ``config`` (a ``WorkerConfig`` on the wire)."""

    worker: int
    config: dict[str, Any]


class Spawned(NamedTuple):
    """Worker ``worker`` was forked as ``pid``."""

    worker: int
    pid: int


class SpawnFailed(NamedTuple):
    """Worker ``worker`` could not be forked, and why."""

    worker: int
    why: str


class Exited(NamedTuple):
    """Worker ``worker`` (``pid``) was reaped with exit ``code`` (negative: the signal that ended it)."""

    worker: int
    pid: int
    code: int


Report = Spawned | SpawnFailed | Exited

_TAGS: dict[type, str] = {SpawnRequest: "spawn", Spawned: "spawned", SpawnFailed: "failed", Exited: "exited"}
_FIELDS: dict[str, tuple[type, tuple[type, ...]]] = {
    "spawn": (SpawnRequest, (int, dict)),
    "spawned": (Spawned, (int, int)),
    "failed": (SpawnFailed, (int, str)),
    "exited": (Exited, (int, int, int)),
}


def frame(message: SpawnRequest | Report) -> bytes:
    """``message`` as one length-prefixed msgpack frame."""
    data: bytes = msgpack.packb([_TAGS[type(message)], *message])
    return struct.pack(">I", len(data)) + data


def _frames(buffer: bytearray) -> list[Any]:
    """Pop every complete frame from ``buffer`` (a partial one stays for the next read).

    An undecodable frame is dropped (logged); a length past :data:`MAX_FRAME`
    drops all the buffer holds, since nothing after it can be framed.
    """
    out = []
    while len(buffer) >= 4:
        (size,) = struct.unpack(">I", buffer[:4])
        if size > MAX_FRAME:
            log.error(
                "forkserver pipe: a frame of %d bytes is longer than any message; dropped the stream's %d "
                "buffered bytes",
                size,
                len(buffer),
            )
            buffer.clear()
            break
        if len(buffer) < 4 + size:
            break
        data = bytes(buffer[4 : 4 + size])
        del buffer[: 4 + size]
        try:
            out.append(msgpack.unpackb(data, raw=False))
        except (ValueError, msgpack.UnpackException) as exc:
            log.error("forkserver pipe: dropped an undecodable frame (%s: %s)", type(exc).__name__, exc)
    return out


def _message(obj: Any, kinds: tuple[type, ...]) -> Any:
    """The message ``obj`` encodes if it is one of ``kinds`` and well formed, else None (logged)."""
    spec = _FIELDS.get(obj[0]) if type(obj) is list and obj and type(obj[0]) is str else None
    if spec is not None and spec[0] in kinds:
        kind, types = spec
        fields = obj[1:]
        if len(fields) == len(types) and all(type(f) is t for f, t in zip(fields, types, strict=True)):
            return kind(*fields)
    log.error("forkserver pipe: dropped a malformed or unexpected frame %r", obj)
    return None


def read_requests(buffer: bytearray) -> list[SpawnRequest]:
    """Pop every complete request from ``buffer`` (the forkserver's side)."""
    return [m for m in (_message(obj, (SpawnRequest,)) for obj in _frames(buffer)) if m is not None]


def read_reports(buffer: bytearray) -> list[Report]:
    """Pop every complete report from ``buffer`` (the side that asked for workers)."""
    return [m for m in (_message(obj, (Spawned, SpawnFailed, Exited)) for obj in _frames(buffer)) if m is not None]
