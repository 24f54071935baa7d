"""A session: the private directory, addresses and keys that one controller and its workers share.

The controller makes a 0700 runtime directory; its workers find it through
``ACTORS_SESSION_DIR``. Inbox addresses are socket files in it (``ipc``) or
loopback tcp ports (``ACTORS_TRANSPORT=tcp``), CURVE-authenticated with one
session key pair. The directory also records which pid serves each address
(an *incarnation* file), so any process can resolve a peer's pid without
asking anyone.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import socket
import tempfile

import zmq

from ._segments import sweep_solo_segments
from ._stale_sessions import SESSION_PREFIX, sweep_stale_sessions

__all__ = [
    "SESSION_ENV",
    "bind_host",
    "host_id",
    "inbox_address",
    "incarnation_path",
    "local_hosts",
    "make_runtime_dir",
    "read_incarnation",
    "remove_socket_file",
    "session_keys",
    "tcp_host",
    "transport_kind",
    "valid_ipc_path",
    "valid_peer_address",
    "write_incarnation",
]

#: Where workers find their session's directory.
SESSION_ENV = "ACTORS_SESSION_DIR"
#: Environment switch for the transport: ``ipc`` (default, one host) or ``tcp``.
TRANSPORT_ENV = "ACTORS_TRANSPORT"
#: Interface tcp inboxes bind to; loopback unless explicitly widened.
TCP_HOST_ENV = "ACTORS_TCP_HOST"
#: Session key pair for CURVE on tcp (z85); set by the first process, inherited by its workers.
CURVE_PUBLIC_ENV = "ACTORS_CURVE_PUBLIC"
CURVE_SECRET_ENV = "ACTORS_CURVE_SECRET"
#: This host's identity, when something other than the kernel's decides it (a Ray node host sets its node id).
HOST_ID_ENV = "ACTORS_HOST_ID"
#: ``ACTORS_CURVE=0`` turns tcp authentication off (not recommended beyond loopback).
CURVE_ENV = "ACTORS_CURVE"


def transport_kind() -> str:
    kind = os.environ.get(TRANSPORT_ENV, "ipc").lower()
    if kind not in ("ipc", "tcp"):
        raise ValueError(f"{TRANSPORT_ENV} must be 'ipc' or 'tcp', not {kind!r}")
    return kind


def host_id() -> str:
    """Which host this process is on: processes with the same id share memory, pids and GPUs.

    ``ACTORS_HOST_ID`` when set (Ray node hosts set their node's id, so
    nodes of one test cluster count as separate hosts); otherwise the
    kernel's boot id and this process's pid namespace.
    """
    given = os.environ.get(HOST_ID_ENV)
    if given:
        return given
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = socket.gethostname()
    try:
        space = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        space = 0
    return f"{boot}/{space}"


def make_runtime_dir() -> str:
    """A private (0700) directory for this session's socket files, named after its owner's pid.

    Directories that owners killed before cleaning up left in the same
    place are removed first (:mod:`._stale_sessions`).
    """
    base = os.environ.get("XDG_RUNTIME_DIR")
    if not base or not os.access(base, os.W_OK):
        base = tempfile.gettempdir()
    sweep_stale_sessions(base)
    sweep_solo_segments()  # (those of processes without a runtime that have exited)
    path = tempfile.mkdtemp(prefix=f"{SESSION_PREFIX}{os.getpid()}-", dir=base)
    os.chmod(path, 0o700)
    return path


def inbox_address(runtime_dir: str, name: str) -> str:
    """A fresh inbox address: a socket file in the private directory, or a loopback tcp port."""
    if transport_kind() == "ipc":
        return f"ipc://{runtime_dir}/{name}.sock"
    host = bind_host()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        port = probe.getsockname()[1]
    return f"tcp://{host}:{port}"


_TCP_ADDRESS = re.compile(r"tcp://[A-Za-z0-9.\-]+:[0-9]{1,5}")


def valid_peer_address(address: str, runtime_dir: str, authenticated: bool = False) -> bool:
    """Only addresses this session could own: an ipc socket in its private directory, or tcp host:port.

    A header is attacker-controlled input; its address decides where replies
    and credits go, so it must never point anywhere else. On an
    ``authenticated`` (CURVE) inbox every sender holds the session key, and
    an ipc worker loop's socket lies wherever its scheduler put it: any
    absolute socket path is then a peer's own.
    """
    if address.startswith("ipc://"):
        path = address[len("ipc://") :]
        if authenticated:
            return valid_ipc_path(path)
        return os.path.dirname(path) == runtime_dir and path.endswith(".sock") and ".." not in path
    return _TCP_ADDRESS.fullmatch(address) is not None


#: The longest path a unix socket address holds (``sun_path``, less its terminating NUL).
MAX_IPC_PATH = 107


def valid_ipc_path(path: str) -> bool:
    """An absolute, normalised unix socket path that fits ``sun_path``."""
    return (
        os.path.isabs(path)
        and os.path.normpath(path) == path
        and "\0" not in path
        and 0 < len(path.encode()) <= MAX_IPC_PATH
    )


def bind_host() -> str:
    """The interface this process binds tcp sockets to: ``ACTORS_TCP_HOST``, else loopback."""
    return os.environ.get(TCP_HOST_ENV) or "127.0.0.1"


def local_hosts() -> frozenset[str]:
    """The tcp hosts that mean this machine (a peer's pid there is a process here): loopback and our own.

    No name lookup: it may run on the event loop's thread, and a process binds
    the one cluster address it was given (``ACTORS_TCP_HOST``), as its peers on
    this machine do.
    """
    return frozenset({"127.0.0.1", "localhost", "::1", bind_host()})


def tcp_host(address: str) -> str | None:
    """The host part of a ``tcp://host:port`` address (None for ipc)."""
    if not address.startswith("tcp://"):
        return None
    return address[len("tcp://") :].rpartition(":")[0]


def remove_socket_file(address: str) -> None:
    """Delete an ipc address's socket file (nothing to do for tcp)."""
    if address.startswith("ipc://"):
        with contextlib.suppress(OSError):
            os.unlink(address.removeprefix("ipc://"))


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


def new_session_keys() -> dict[str, str]:
    """A fresh CURVE key pair as the environment variables that carry it, for a controller and its workers.

    Put both into the environment of every process of the session that
    starts on its own (``run_worker_loop_forever`` workers, the controller
    that attaches them): only processes holding the pair can talk.
    """
    if not zmq.has("curve"):
        raise RuntimeError("this libzmq has no CURVE support")
    public, secret = zmq.curve_keypair()
    return {CURVE_PUBLIC_ENV: public.decode(), CURVE_SECRET_ENV: secret.decode()}


def incarnation_path(session_dir: str, address: str) -> str:
    """The file that records the pid of the process serving ``address``."""
    digest = hashlib.sha1(address.encode(), usedforsecurity=False).hexdigest()[:16]
    return os.path.join(session_dir, f"pid-{digest}")


def write_incarnation(session_dir: str, address: str, pid: int) -> None:
    """Record (atomically) that ``pid`` now serves ``address``."""
    path = incarnation_path(session_dir, address)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(str(pid))
    os.replace(tmp, path)


def forget_incarnation(session_dir: str, address: str, pid: int) -> None:
    """Remove the record of ``address`` if it still names ``pid``, a process that has exited.

    A peer looking up a restarted process's pid must never find the old one.
    """
    if read_incarnation(session_dir, address) == pid:
        with contextlib.suppress(FileNotFoundError):
            os.remove(incarnation_path(session_dir, address))


def read_incarnation(session_dir: str, address: str) -> int | None:
    """The pid recorded for ``address``, or None if none is (yet)."""
    try:
        with open(incarnation_path(session_dir, address)) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None
