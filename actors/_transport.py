"""ZeroMQ sockets: one PULL inbox per process, one cached PUSH link per peer.

Outbound messages to a peer accumulate in its :class:`Link` and leave as one
ZeroMQ message at the end of the current event-loop iteration (or at once when
the batch is large, or when no loop drives this process). A full socket never
drops a message: the sender waits for room while it keeps serving its inbox.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import socket
import tempfile
from typing import Any

import msgpack
import zmq

from ._protocol import PROTOCOL_VERSION

#: ZeroMQ messages (each possibly a batch) queued per peer before a send waits.
SNDHWM = 2000
RCVHWM = 2000
#: A batch is flushed at once when it holds this many bytes or messages.
FLUSH_BYTES = 256 * 1024
FLUSH_MESSAGES = 512
#: How long a closing socket may keep flushing queued messages.
LINGER_MS = 2000

_SHORT_PREFIX = [bytes([0, n]) for n in range(128)]


def message_prefix(frame_count: int, length: int) -> bytes:
    """The ``frame_count, length`` pair (two msgpack uints) that precedes each message of a batch."""
    if frame_count == 0 and length < 128:
        return _SHORT_PREFIX[length]
    return msgpack.packb(frame_count) + msgpack.packb(length)  # type: ignore[no-any-return]


def make_header(address: str, pid: int) -> bytes:
    return msgpack.packb([PROTOCOL_VERSION, address, pid])  # type: ignore[no-any-return]


_TCP_ADDRESS = re.compile(r"tcp://[A-Za-z0-9.\-]+:[0-9]{1,5}")


def valid_peer_address(address: str, runtime_dir: str) -> bool:
    """Only addresses this session could own: an ipc socket in its private directory, or tcp host:port.

    A header is attacker-controlled input; its address decides where replies
    and credits go, so it must never point anywhere else.
    """
    if address.startswith("ipc://"):
        path = address[len("ipc://") :]
        return os.path.dirname(path) == runtime_dir and path.endswith(".sock") and ".." not in path
    return _TCP_ADDRESS.fullmatch(address) is not None


def parse_header(data: bytes) -> tuple[str, int]:
    """Return ``(sender_address, sender_pid)``; raise ValueError if malformed."""
    if len(data) > 4096:
        raise ValueError("oversized header")
    header = msgpack.unpackb(data, raw=False)
    if (
        type(header) is not list
        or len(header) != 3
        or header[0] != PROTOCOL_VERSION
        or type(header[1]) is not str
        or type(header[2]) is not int
    ):
        raise ValueError(f"bad header {header!r:.80}")
    return header[1], header[2]


def frame_size(frame: Any) -> int:
    return frame.nbytes if isinstance(frame, memoryview) else len(frame)


#: Environment switch for the transport: ``ipc`` (default, one host) or ``tcp``.
TRANSPORT_ENV = "ACTORS_TRANSPORT"
#: Interface tcp inboxes bind to; loopback unless explicitly widened.
TCP_HOST_ENV = "ACTORS_TCP_HOST"


def transport_kind() -> str:
    kind = os.environ.get(TRANSPORT_ENV, "ipc").lower()
    if kind not in ("ipc", "tcp"):
        raise ValueError(f"{TRANSPORT_ENV} must be 'ipc' or 'tcp', not {kind!r}")
    return kind


def inbox_address(runtime_dir: str, name: str) -> str:
    """A fresh inbox address: a socket file in the private directory, or a loopback tcp port."""
    if transport_kind() == "ipc":
        return f"ipc://{runtime_dir}/{name}.sock"
    host = os.environ.get(TCP_HOST_ENV, "127.0.0.1")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        port = probe.getsockname()[1]
    return f"tcp://{host}:{port}"


def remove_socket_file(address: str) -> None:
    """Delete an ipc address's socket file (nothing to do for tcp)."""
    if address.startswith("ipc://"):
        with contextlib.suppress(OSError):
            os.unlink(address.removeprefix("ipc://"))


#: Session key pair for CURVE on tcp (z85); set by the first process, inherited by its workers.
CURVE_PUBLIC_ENV = "ACTORS_CURVE_PUBLIC"
CURVE_SECRET_ENV = "ACTORS_CURVE_SECRET"
#: ``ACTORS_CURVE=0`` turns tcp authentication off (not recommended beyond loopback).
CURVE_ENV = "ACTORS_CURVE"


def session_keys() -> tuple[bytes, bytes] | None:
    """The session's CURVE key pair for tcp, created on first use; None for ipc or when disabled.

    Every inbox is a CURVE server and every link a CURVE client with this one
    key: a peer that does not hold it cannot complete the handshake, so its
    messages are never delivered.
    """
    if transport_kind() != "tcp" or os.environ.get(CURVE_ENV, "1") == "0":
        return None
    if not zmq.has("curve"):
        raise RuntimeError("this libzmq has no CURVE support; set ACTORS_CURVE=0 to run tcp unauthenticated")
    public, secret = os.environ.get(CURVE_PUBLIC_ENV), os.environ.get(CURVE_SECRET_ENV)
    if not public or not secret:
        pub, sec = zmq.curve_keypair()
        public, secret = pub.decode(), sec.decode()
        os.environ[CURVE_PUBLIC_ENV], os.environ[CURVE_SECRET_ENV] = public, secret
    return public.encode(), secret.encode()


def make_runtime_dir() -> str:
    """A private (0700) directory for this session's socket files."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    if not base or not os.access(base, os.W_OK):
        base = tempfile.gettempdir()
    path = tempfile.mkdtemp(prefix="actors-", dir=base)
    os.chmod(path, 0o700)
    return path


def bind_inbox(ctx: zmq.Context[Any], address: str, keys: tuple[bytes, bytes] | None = None) -> zmq.Socket[Any]:
    sock: zmq.Socket[Any] = ctx.socket(zmq.PULL)
    if keys is not None:
        sock.curve_server = True
        sock.curve_publickey, sock.curve_secretkey = keys
    sock.setsockopt(zmq.RCVHWM, RCVHWM)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(address)
    return sock


class Link:
    """The outbound side of one peer: a PUSH socket plus the batch being built."""

    __slots__ = ("address", "dead", "frames", "inflight", "nbytes", "parts", "pid", "scheduled", "sock")

    def __init__(
        self, ctx: zmq.Context[Any], address: str, pid: int | None, keys: tuple[bytes, bytes] | None = None
    ) -> None:
        self.address = address
        self.pid = pid
        self.sock = ctx.socket(zmq.PUSH)
        if keys is not None:
            self.sock.curve_serverkey = keys[0]
            self.sock.curve_publickey, self.sock.curve_secretkey = keys
        self.sock.setsockopt(zmq.SNDHWM, SNDHWM)
        self.sock.setsockopt(zmq.LINGER, LINGER_MS)
        self.sock.connect(address)
        self.parts: list[bytes] = []
        self.frames: list[Any] = []
        self.nbytes = 0
        self.scheduled = False
        self.dead = False
        #: port_id -> [messages, bytes] sent to that port and not yet credited back.
        self.inflight: dict[int, list[int]] = {}

    def append(self, data: bytes, frames: list[Any]) -> None:
        self.parts.append(message_prefix(len(frames), len(data)))
        self.parts.append(data)
        self.nbytes += len(data)
        if frames:
            self.frames.extend(frames)
            for frame in frames:
                self.nbytes += frame_size(frame)

    def try_send(self, header: bytes) -> bool:
        """Send the pending batch without blocking; False if the peer's queue is full."""
        if not self.parts:
            return True
        try:
            self.sock.send(header, zmq.NOBLOCK | zmq.SNDMORE)
        except zmq.Again:
            return False
        payload = b"".join(self.parts)
        frames = self.frames
        self.parts, self.frames, self.nbytes = [], [], 0
        if not frames:
            self.sock.send(payload)
            return True
        self.sock.send(payload, zmq.SNDMORE)
        last = len(frames) - 1
        for i, frame in enumerate(frames):
            self.sock.send(frame, 0 if i == last else zmq.SNDMORE, copy=False)
        return True

    def close(self, linger: int | None = None) -> None:
        if linger is not None:
            self.sock.setsockopt(zmq.LINGER, linger)
        self.sock.close()
        self.parts, self.frames, self.nbytes = [], [], 0


def incarnation_path(session_dir: str, address: str) -> str:
    """The file where an owner records the pid of the process now serving ``address``.

    Written (atomically) when a proc mesh restarts a process at its old address,
    read by any process whose handle still names the dead one.
    """
    digest = hashlib.sha1(address.encode(), usedforsecurity=False).hexdigest()[:16]
    return os.path.join(session_dir, f"pid-{digest}")


def write_incarnation(session_dir: str, address: str, pid: int) -> None:
    path = incarnation_path(session_dir, address)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(str(pid))
    os.replace(tmp, path)
