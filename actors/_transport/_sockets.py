"""ZeroMQ sockets: one PULL inbox per process, one PUSH link per peer.

A :class:`Link` is the outbound side of one peer: its socket and the batch
of records being built for it (behind batches sealed whole, rarely: see
:meth:`Link.seal`). Sockets are never waited on here: a full peer queue
makes :meth:`Link.try_send` return False and the batches stay.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import zmq

from .._wire._records import record_prefix

__all__ = ["FLUSH_BYTES", "FLUSH_RECORDS", "Link", "bind_inbox", "frame_size", "session_authenticator"]

#: ZeroMQ messages (each a batch) queued per peer before the socket refuses more.
SNDHWM = 2000
RCVHWM = 2000
#: A batch is flushed at once when it holds this many bytes or records.
FLUSH_BYTES = 256 * 1024
FLUSH_RECORDS = 512
#: How long a closing socket may keep flushing queued messages.
LINGER_MS = 2000


def frame_size(frame: Any) -> int:
    return frame.nbytes if isinstance(frame, memoryview) else len(frame)


class _SessionKeyOnly:
    """ZAP credentials check: a CURVE client is admitted only if it holds the session's own key."""

    def __init__(self, public_key: bytes) -> None:
        self._key = public_key  # z85, as pyzmq hands the client's key to the callback

    def callback(self, domain: str, client_key: bytes) -> bool:
        return bool(client_key == self._key)


def session_authenticator(ctx: zmq.Context[Any], public_key: bytes) -> Any:
    """Start the ZAP handler that refuses every tcp peer without the session key (call before binding).

    CURVE alone admits any client that knows the server's public key; this
    handler also checks the client's key, which only the session's processes hold.
    """
    from zmq.auth.thread import ThreadAuthenticator

    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve_callback(domain="*", credentials_provider=_SessionKeyOnly(public_key))
    return auth


def bind_inbox(
    ctx: zmq.Context[Any], address: str, keys: tuple[bytes, bytes] | None = None, fd: int | None = None
) -> zmq.Socket[Any]:
    """The process's PULL inbox bound at ``address`` (a CURVE server with ``keys``).

    ``fd``: a listening tcp socket the process inherited (a scheduler bound
    it), served instead of a new one; ``address`` is then its own.
    """
    sock: zmq.Socket[Any] = ctx.socket(zmq.PULL)
    if keys is not None:
        sock.curve_server = True
        sock.curve_publickey, sock.curve_secretkey = keys
    sock.setsockopt(zmq.RCVHWM, RCVHWM)
    sock.setsockopt(zmq.LINGER, 0)
    if fd is not None:
        sock.setsockopt(zmq.USE_FD, fd)
    sock.bind(address)
    return sock


class Link:
    """The outbound side of one peer: a PUSH socket plus the records not yet handed to it."""

    __slots__ = (
        "address",
        "batches",
        "dead",
        "frames",
        "inline",
        "nbytes",
        "parts",
        "records",
        "retry",
        "scheduled",
        "sealed",
        "sock",
    )

    def __init__(self, ctx: zmq.Context[Any], address: str, keys: tuple[bytes, bytes] | None = None) -> None:
        self.address = address
        self.sock = ctx.socket(zmq.PUSH)
        if keys is not None:
            self.sock.curve_serverkey = keys[0]
            self.sock.curve_publickey, self.sock.curve_secretkey = keys
        self.sock.setsockopt(zmq.SNDHWM, SNDHWM)
        self.sock.setsockopt(zmq.LINGER, LINGER_MS)
        self.sock.connect(address)
        self.parts: list[bytes] = []
        self.frames: list[Any] = []
        #: Whole batches that leave before the one being built: (parts, frames, bytes, records) each.
        self.sealed: deque[tuple[list[bytes], list[Any], int, int]] = deque()
        #: Bytes and records waiting, in the sealed batches and the one being built.
        self.nbytes = 0
        #: The batch's payload so far (the records and their framing, not their buffer frames): what a receiver
        #: bounds at ``MAX_PAYLOAD_BYTES``.
        self.inline = 0
        self.records = 0
        self.scheduled = False  # a flush at the end of this loop turn is arranged
        self.retry: Any = None  # the timer retrying a send the peer's queue refused
        self.dead = False
        #: Batches handed to the socket so far: a record's post that waited can tell whether its batch left.
        self.batches = 0

    def append(self, data: bytes, frames: list[Any]) -> None:
        """Add one encoded record (and its buffer frames) to the batch."""
        part = record_prefix(len(frames), len(data)) + data
        self.parts.append(part)
        self.inline += len(part)
        self.nbytes += len(data)
        self.records += 1
        if frames:
            self.frames.extend(frames)
            for frame in frames:
                self.nbytes += frame_size(frame)

    def take_back(self, part: int, frame: int, frames: int, nbytes: int) -> None:
        """Drop one record whose send gave up: its part at index ``part``, its ``frames`` buffer frames from index
        ``frame``, ``nbytes`` bytes in all (records appended after it stay, in order)."""
        self.inline -= len(self.parts[part])
        del self.parts[part]
        del self.frames[frame : frame + frames]
        self.nbytes -= nbytes
        self.records -= 1

    def seal(self) -> None:
        """Close the batch being built: it leaves whole, before whatever is added from now on (a record owed to the
        peer that would push it past the payload a receiver accepts, which drops such a batch whole, starts the
        next one)."""
        if not self.parts:
            return
        nbytes = self.nbytes - sum(batch[2] for batch in self.sealed)
        records = self.records - sum(batch[3] for batch in self.sealed)
        self.sealed.append((self.parts, self.frames, nbytes, records))
        self.parts, self.frames, self.inline = [], [], 0

    def try_send(self, header: bytes) -> bool:
        """Hand the batches to the socket without waiting; False if the peer's queue is full."""
        while self.sealed:
            parts, frames, nbytes, records = self.sealed[0]
            if not self._send(header, parts, frames):
                return False
            self.sealed.popleft()
            self.nbytes -= nbytes
            self.records -= records
        if not self.parts:
            return True
        if not self._send(header, self.parts, self.frames):
            return False
        self.parts, self.frames, self.nbytes, self.records, self.inline = [], [], 0, 0, 0
        return True

    def _send(self, header: bytes, parts: list[bytes], frames: list[Any]) -> bool:
        try:
            self.sock.send(header, zmq.NOBLOCK | zmq.SNDMORE)
        except zmq.Again:
            return False
        self.batches += 1
        payload = b"".join(parts)
        if not frames:
            self.sock.send(payload)
            return True
        self.sock.send(payload, zmq.SNDMORE)
        last = len(frames) - 1
        for i, frame in enumerate(frames):
            self.sock.send(frame, 0 if i == last else zmq.SNDMORE, copy=False)
        return True

    def close(self, linger: int | None = None) -> None:
        if self.retry is not None:
            self.retry.cancel()
            self.retry = None
        if linger is not None:
            self.sock.setsockopt(zmq.LINGER, linger)
        self.sock.close()
        self.parts, self.frames, self.nbytes, self.records, self.inline = [], [], 0, 0, 0
        self.sealed.clear()
