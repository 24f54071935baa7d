"""The addresses a worker loop serves at and a controller attaches to, in the forms Monarch's bootstrap takes.

A worker loop serves ``tcp://host:port``, ``ipc:///absolute/path`` (a unix
socket wherever the scheduler put it), or ``tcp://host:fdN`` (a tcp socket
it inherited already bound, as Monarch's fd bootstrap passes one); Monarch's
``ProcAddr`` form ``<proc-id>@<url>`` names the same url. Every form is
CURVE-authenticated with the session's key, ipc as much as tcp.
"""

from __future__ import annotations

import errno
import os
import socket
import stat
from dataclasses import dataclass

from .._shared._session import tcp_host, valid_ipc_path

__all__ = ["ServingAddress", "attach_address", "serving_address"]

_FORMS = "'tcp://<host>:<port>', 'tcp://<host>:fd<N>' or 'ipc://<absolute path>'"


@dataclass(frozen=True)
class ServingAddress:
    """Where a worker loop is reached (``address``), and the inherited listening socket it serves, if any."""

    address: str
    fd: int | None = None

    @property
    def host(self) -> str:
        """The interface its workers bind: the tcp host, or loopback for a unix socket (ipc is one machine)."""
        return tcp_host(self.address) or "127.0.0.1"


def serving_address(address: object) -> ServingAddress:
    """``address`` as given to ``run_worker_loop_forever``, checked; ValueError saying which forms there are."""
    url = _without_proc_id(address)
    if url.startswith("ipc://"):
        return ServingAddress(_unserved(_ipc(url)))
    host = tcp_host(url)
    if not host:  # (None: not tcp at all)
        raise ValueError(f"a worker loop serves {_FORMS}, not {address!r}")
    if host in ("*", "0.0.0.0", "[::]", "::"):
        raise ValueError(f"give the address controllers reach this host at, not a wildcard: {address!r}")
    port = url.rpartition(":")[2]
    if port.startswith("fd"):
        return ServingAddress(f"tcp://{host}:{_listening_port(port[2:], address)}", int(port[2:]))
    _check_port(port, address)
    return ServingAddress(url)


def attach_address(address: object) -> str:
    """A worker's address as given to ``attach_to_workers``: the url a controller connects to."""
    url = _without_proc_id(address)
    if url.startswith("ipc://"):
        return _ipc(url)
    host = tcp_host(url)
    if not host:  # (None: not tcp at all)
        raise ValueError(
            f"a worker's address must be 'tcp://<host>:<port>' or 'ipc://<absolute path>', not {address!r}"
        )
    port = url.rpartition(":")[2]
    if port.startswith("fd"):
        raise ValueError(
            f"attach to the tcp port that the worker's socket is bound to, not its descriptor: {address!r}"
        )
    _check_port(port, address)
    return url


def _without_proc_id(address: object) -> str:
    """Monarch's ``<proc-id>@<url>`` names ``url``; advertising one url while binding another is not offered."""
    if not isinstance(address, str):
        raise TypeError(f"a worker loop's address is a string ({_FORMS}), not {type(address).__name__}")
    if address.startswith("ipc://"):
        return address  # a socket path may hold '@'
    left, at, right = address.partition("@")
    if not at:
        return address
    if "://" in left:
        raise ValueError(
            f"a worker loop binds the address controllers reach it at; '<advertised>@<bind>' is not offered: {address!r}"
        )
    if "://" not in right:
        raise ValueError(f"expected '<proc-id>@<url>' with a url of the form {_FORMS}, not {address!r}")
    return right


def _ipc(url: str) -> str:
    path = url[len("ipc://") :]
    if not valid_ipc_path(path):
        raise ValueError(
            f"an ipc worker address is 'ipc://<absolute path>' of at most 107 bytes, normalised, not {url!r}"
        )
    return url


def _unserved(url: str) -> str:
    """``url`` if no process serves its socket now: binding would silently take the path over (ZeroMQ removes
    the file it finds), and the first server would later remove the second's. A stale file is fine."""
    path = url[len("ipc://") :]
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return url
    if not stat.S_ISSOCK(mode):
        raise ValueError(
            f"{path} exists and is not a socket: a worker loop's ipc path must be free (it would be removed)"
        )
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(path)
        except OSError:
            return url  # nobody listens there (a file left by a loop that was killed)
    raise OSError(errno.EADDRINUSE, f"another process already serves {url}: give each worker loop a path of its own")


def _check_port(port: str, address: object) -> None:
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"a worker loop's tcp port must be 1-65535, not {port!r} (in {address!r})")


def _listening_port(fd_text: str, address: object) -> int:
    """The port of the inherited tcp socket ``fd``, made to listen (a scheduler may only have bound it).

    The descriptor becomes the worker loop's inbox: ZeroMQ closes it when the loop ends, so the code that
    passed it must not close it itself afterwards (a launcher closes its own copy before the loop starts, as
    ``subprocess``'s ``pass_fds`` does).
    """
    if not fd_text.isdigit():
        raise ValueError(f"expected 'tcp://<host>:fd<N>' with a descriptor number, not {address!r}")
    fd = int(fd_text)
    try:
        sock = socket.socket(fileno=fd)
    except OSError as exc:
        raise ValueError(f"descriptor {fd} of {address!r} is not an open socket of this process: {exc}") from None
    try:
        if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
            raise ValueError(f"descriptor {fd} of {address!r} is not a tcp socket")
        port = int(sock.getsockname()[1])
        if port == 0:
            raise ValueError(f"descriptor {fd} of {address!r} is not bound to a port")
        sock.listen(socket.SOMAXCONN)
        return port
    finally:
        sock.detach()  # the descriptor stays open: the inbox serves it
