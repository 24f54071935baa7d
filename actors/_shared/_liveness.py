"""Process liveness through Linux pidfds: a death is noticed the moment it happens.

A pidfd becomes readable when its process exits, so dead peers are detected
by the event loop (or the synchronous pump) without polling or heartbeats.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from ._readiness import fd_ready


class Watcher:
    """Tracks pids and reports each one's death exactly once."""

    def __init__(self, on_death: Callable[[int], None]) -> None:
        self._on_death = on_death
        self._fds: dict[int, int] = {}  # pid -> pidfd
        self._pids: dict[int, int] = {}  # pidfd -> pid
        self.dead: set[int] = set()
        self._add_reader: Callable[..., object] | None = None
        self._remove_reader: Callable[[int], object] | None = None

    def bind(self, add_reader: Callable[..., object] | None, remove_reader: Callable[[int], object] | None) -> None:
        """Register every pidfd with an event loop (or unregister with ``None``)."""
        self._add_reader, self._remove_reader = add_reader, remove_reader
        if add_reader is not None:
            for fd in self._fds.values():
                add_reader(fd, self._readable, fd)

    def fds(self) -> list[int]:
        return list(self._pids)

    def watch(self, pid: int) -> bool:
        """Start watching ``pid``; returns False if it is already known dead."""
        if pid in self.dead:
            return False
        if pid in self._fds or pid == os.getpid():
            return True
        try:
            fd = os.pidfd_open(pid)
        except OSError:  # gone, or never a process this one can see: either way it cannot answer
            self._died(pid)
            return False
        self._fds[pid] = fd
        self._pids[fd] = pid
        if self._add_reader is not None:
            self._add_reader(fd, self._readable, fd)
        return True

    def check(self, fd: int) -> None:
        """Called when ``fd`` is readable: its process has exited."""
        self._readable(fd)

    def take_pending(self, pid: int) -> None:
        """Report ``pid``'s death now if it already happened (its pidfd readable) but is not yet handled.

        For news that must come after it: a restart heard before this
        process's own event loop got to the old process's exit.
        """
        fd = self._fds.get(pid)
        if fd is not None and fd_ready(fd):
            self._readable(fd)

    def _readable(self, fd: int) -> None:
        pid = self._pids.pop(fd, None)
        if pid is None:
            return
        del self._fds[pid]
        if self._remove_reader is not None:
            try:
                self._remove_reader(fd)
            except (RuntimeError, ValueError):
                pass
        os.close(fd)
        self._died(pid)

    def _died(self, pid: int) -> None:
        if pid in self.dead:
            return
        self.dead.add(pid)
        self._on_death(pid)

    def close(self) -> None:
        for fd in list(self._pids):
            if self._remove_reader is not None:
                try:
                    self._remove_reader(fd)
                except (RuntimeError, ValueError):
                    pass
            os.close(fd)
        self._fds.clear()
        self._pids.clear()


class ProcRef:
    """A process this one talks to: its inbox address and, once known, its pid.

    A ``remote`` process runs on another host: its pid means nothing here, so
    no pidfd watches it and its death is reported by whoever placed it.
    ``incarnation`` stamps the process now at the address (its owner's clock
    when it started it; 0 until known); ``heard`` orders the news of it
    applied here (:mod:`actors._transport._peer_news`).
    """

    __slots__ = ("address", "dead", "exit_reason", "heard", "incarnation", "pid", "remote")

    def __init__(self, address: str, pid: int | None, remote: bool = False) -> None:
        self.address = address
        self.pid = pid
        self.dead = False
        self.exit_reason = ""
        self.remote = remote
        self.incarnation = 0
        self.heard = -1

    def __repr__(self) -> str:
        return f"ProcRef({self.address!r}, pid={self.pid})"


def new_incarnation(ref: ProcRef) -> int:
    """A stamp for the process an owner starts at ``ref`` now: its clock in ns, always later than the last one."""
    return max(time.time_ns(), ref.incarnation + 1)


def pid_exists(pid: int) -> bool:
    """Whether a process ``pid`` exists now (another user's counts; a reused pid is not told apart)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
