"""Monarch's ``enable_transport`` and ``ChannelTransport``: which transport this process's runtime uses.

Here the choice is ``ACTORS_TRANSPORT`` (``ipc``, the default, or
CURVE-authenticated ``tcp``), read when the runtime starts and inherited by
the processes it spawns. ``enable_transport`` sets it before the runtime
exists; after, it accepts only the transport already in use.
"""

from __future__ import annotations

import enum
import os

from .._shared._session import TCP_HOST_ENV, TRANSPORT_ENV, tcp_host
from ._core import current_runtime

__all__ = ["ChannelTransport", "enable_transport"]


class ChannelTransport(enum.Enum):
    """Monarch's transports; ``Unix`` and the tcp ones are offered here (tcp always with the session's CURVE key)."""

    Unix = "ipc"
    TcpWithHostname = "tcp"
    TcpWithLocalhost = "tcp-localhost"
    MetaTlsWithHostname = "metatls-hostname"
    MetaTlsWithIpV6 = "metatls"
    Tls = "tls"
    Local = "local"


_SHORT = {"ipc": ChannelTransport.Unix, "tcp": ChannelTransport.TcpWithHostname, "tls": ChannelTransport.Tls}
_SHORT.update({"metatls": ChannelTransport.MetaTlsWithIpV6, "metatls-hostname": ChannelTransport.MetaTlsWithHostname})


def enable_transport(transport: ChannelTransport | str) -> None:
    """Use ``transport`` for this process and those it spawns: call it before anything else that uses actors.

    ``"ipc"`` / ``ChannelTransport.Unix``, ``"tcp"`` / ``TcpWithHostname``
    (this host's ``ACTORS_TCP_HOST``, else loopback), ``TcpWithLocalhost``,
    or ``"tcp://<host>:<port>"`` (binds tcp on that host; the port is chosen
    per process). TLS transports are Monarch's own: ``NotImplementedError``.
    """
    kind, host = _resolve(transport)
    running = current_runtime()
    if running is not None:
        now = "tcp" if tcp_host(running.address) is not None else "ipc"
        if now != kind:
            raise RuntimeError(
                f"the actors runtime of this process already started on {now}; enable_transport({transport!r}) "
                "must come before anything else that uses actors"
            )
        return
    os.environ[TRANSPORT_ENV] = kind
    if host is not None:
        os.environ[TCP_HOST_ENV] = host


def _resolve(transport: ChannelTransport | str) -> tuple[str, str | None]:
    """``(ipc or tcp, the tcp host to bind or None)`` for a transport named as Monarch names them."""
    if isinstance(transport, str) and transport.startswith("tcp://"):
        host = tcp_host(transport if transport.count(":") >= 2 else f"{transport}:0")
        if not host:
            raise ValueError(f"not a tcp address: {transport!r}")
        return "tcp", host
    choice = _SHORT.get(transport) if isinstance(transport, str) else transport
    if not isinstance(choice, ChannelTransport):
        raise ValueError(
            f"unknown transport {transport!r}: use 'ipc', 'tcp', 'tcp://<host>:<port>' or a ChannelTransport"
        )
    if choice is ChannelTransport.Unix:
        return "ipc", None
    if choice is ChannelTransport.TcpWithHostname:
        return "tcp", None
    if choice is ChannelTransport.TcpWithLocalhost:
        return "tcp", "127.0.0.1"
    raise NotImplementedError(
        f"{choice.name} is one of Monarch's own transports; actors offers ipc and tcp with the session's CURVE key"
    )
