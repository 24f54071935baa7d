"""Flow control for ports: a window per (sender, port), credits from the receiver, a bounded backlog.

Each sending process may have :data:`WINDOW` records (or :data:`WINDOW_BYTES`)
in flight to one port; the receiver gives window back with a
:class:`~actors._wire._records.Credit` as its code consumes. A send that finds the
window full does not wait: the record joins the sender's backlog for that
port and leaves, in order, as credit returns. The backlog is bounded
(:data:`BACKLOG`, :data:`BACKLOG_BYTES`); past it ``send`` raises
:class:`~actors.BufferFull`.

Pacing is awaitable, never a wait on the loop's thread: ``await
port.drain()`` returns once that port's backlog has left. A producer that
may outrun its receiver, and a forwarding actor whose downstream may stall,
call it after ``send`` (asyncio's ``write()`` / ``drain()`` convention) and
keep memory bounded end to end. Receiving is never paused on a process's
behalf: a process that both feeds and drains a peer (a cycle) would then
wait on itself.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from typing import Any

from .._shared._errors import BufferFull, PortClosed
from .._shared._hooks import Hook
from .._shared._loops import wake_all
from ._outbox import Outbox, check_fits
from ._sockets import Link

__all__ = [
    "BACKLOG",
    "BACKLOG_BYTES",
    "CREDIT_BYTES",
    "CREDIT_MESSAGES",
    "WINDOW",
    "WINDOW_BYTES",
    "SenderWindows",
    "Window",
]

#: Records and bytes one sending process may have in flight to one port.
WINDOW = 4096
WINDOW_BYTES = 64 * 1024 * 1024
#: A receiver gives credit back each time it has consumed this many records or bytes from one sender.
CREDIT_MESSAGES = WINDOW // 4
CREDIT_BYTES = WINDOW_BYTES // 4
#: Records and bytes a sender may hold back for one port once its window is full.
BACKLOG = 262_144
BACKLOG_BYTES = 256 * 1024 * 1024
#: How soon a backlog a full link refused is offered to it again (s).
RELEASE_RETRY = 0.02


class Window:
    """One (peer, port) pair's flow state. Ports cache it until it is ``stale``: its peer died (``dead``), or
    everything sent through it was credited back and :class:`SenderWindows` let it go (a port that sends again
    then makes a fresh one)."""

    __slots__ = (
        "backlog",
        "backlog_bytes",
        "dead",
        "inflight",
        "inflight_bytes",
        "link",
        "port_id",
        "release",
        "release_loop",
        "stale",
        "waiters",
    )

    def __init__(self, link: Link, port_id: int) -> None:
        self.link = link
        self.port_id = port_id
        self.dead = False
        self.stale = False
        self.inflight = 0
        self.inflight_bytes = 0
        # (record, its buffer frames or None, bytes): without frames an entry is bytes and ints, which the
        # garbage collector stops tracking, so a full backlog adds nothing to a full collection's walk
        self.backlog: deque[tuple[bytes, list[Any] | None, int]] = deque()
        self.backlog_bytes = 0
        self.waiters: list[asyncio.Future[None]] = []
        #: The timer releasing the backlog again after a full link refused it (None when none is due).
        self.release: asyncio.TimerHandle | None = None
        #: The loop that timer is due on (another may drive the process by then, and it never fires).
        self.release_loop: asyncio.AbstractEventLoop | None = None

    def has_room(self) -> bool:
        return self.inflight < WINDOW and (self.inflight_bytes < WINDOW_BYTES or self.inflight == 0)


class SenderWindows:
    """The sending side of every port this process sends to."""

    def __init__(self, outbox: Outbox) -> None:
        self._outbox = outbox
        self._windows: dict[tuple[str, int], Window] = {}
        #: Records held back, across every port.
        self.backlogged = 0
        #: Records left a backlog: a thread blocked for room (no loop of its own) looks again. A release by
        #: credit comes with a handled message, which wakes it anyway; one by the retry timer comes with nothing.
        self.released: Hook[[]] = Hook("port messages released from a backlog")

    def inflight(self, address: str, port_id: int) -> int:
        """Records sent to the port and not yet credited back."""
        window = self._windows.get((address, port_id))
        return 0 if window is None else window.inflight

    def window(self, link: Link, port_id: int) -> Window:
        """The flow state of ``port_id`` at ``link``'s peer (created on first use)."""
        key = (link.address, port_id)
        window = self._windows.get(key)
        if window is None or window.stale:
            window = self._windows[key] = Window(link, port_id)
        return window

    def send(self, window: Window, data: bytes, frames: list[Any], size: int) -> None:
        """Put one PORT record on the wire if the window has room, else in the backlog."""
        if not window.backlog and window.has_room():
            self._outbox.post(window.link, data, frames, False)  # (BufferFull: nothing left, nothing counted)
            window.inflight += 1
            window.inflight_bytes += size
            return
        self.hold(window, data, frames, size)

    def hold(self, window: Window, data: bytes, frames: list[Any], size: int) -> None:
        """Keep a record back until credit returns (BufferFull past the backlog's bound; EncodeError for one no
        batch could carry, refused now: at its release it would block the backlog behind it for good)."""
        check_fits(len(data))
        port_id, link = window.port_id, window.link
        if len(window.backlog) >= BACKLOG or window.backlog_bytes >= BACKLOG_BYTES:
            raise BufferFull(
                f"port {port_id} at {link.address}: {len(window.backlog)} messages "
                f"({window.backlog_bytes >> 20} MiB) already wait for its receiver to consume; "
                "await port.drain() between sends to pace this sender"
            )
        window.backlog.append((data, frames or None, size))
        window.backlog_bytes += size
        self.backlogged += 1
        self._offer_again(window)

    def _offer_again(self, window: Window) -> None:
        """Release the backlog now if no release is due on the loop driving this process: the link refused it
        while another loop drove it (that timer never fires) or none did (no timer was set), and with nothing
        in flight no credit would come to try again."""
        if not window.backlog or not window.has_room():
            return
        if window.release is None or window.release_loop is not self._outbox.loop:
            self._release(window)

    def on_credit(self, address: str, port_id: int, messages: int, nbytes: int) -> None:
        """The receiver consumed ``messages``: release backlog into the freed window."""
        key = (address, port_id)
        window = self._windows.get(key)
        if window is None:
            return
        window.inflight = max(0, window.inflight - messages)
        window.inflight_bytes = max(0, window.inflight_bytes - nbytes)
        self._release(window)
        if not window.inflight and not window.backlog and window.release is None:
            # Everything sent was consumed: nothing to count any more. Kept, a window per port a process ever sent
            # to would stay until that peer exits (a service streaming to a long-lived caller on a new port per
            # request grew without bound); a port that sends again makes a fresh one.
            del self._windows[key]
            window.stale = True

    def _release(self, window: Window) -> None:
        """Send the backlog's head while the window has room; a full link is tried again shortly (with nothing
        in flight, no credit would come to do it)."""
        if window.release is not None:
            window.release.cancel()  # (this release makes the one due)
            window.release = None
        if window.dead:
            return
        backlog = window.backlog
        post = self._outbox.post
        released = 0
        while backlog and window.has_room():
            data, frames, size = backlog[0]
            try:
                post(window.link, data, frames or [], False)
            except BufferFull:  # the link's own queue is full (its peer reads slowly): the rest waits in order
                loop = self._outbox.loop
                if loop is not None:
                    window.release = loop.call_later(RELEASE_RETRY, self._retry_release, window, loop)
                    window.release_loop = loop
                break
            backlog.popleft()
            window.backlog_bytes -= size
            window.inflight += 1
            window.inflight_bytes += size
            released += 1
        self.backlogged -= released
        if not backlog:
            wake_all(window.waiters)
        if released and self.released:
            self.released()

    def _retry_release(self, window: Window, loop: asyncio.AbstractEventLoop) -> None:
        """The retry timer: a release, unless another loop drives this process now (the program ran the loop it
        left again, on another thread maybe): that loop's next drain or send offers the backlog again."""
        if self._outbox.loop is loop:  # (else nothing here is this thread's to touch)
            self._release(window)

    async def drain(self, address: str, port_id: int) -> None:
        """Return once nothing is held back for this port (at once if nothing is)."""
        window = self._windows.get((address, port_id))
        if window is None or not window.backlog:
            return
        self._offer_again(window)
        if not window.backlog:
            return
        waiter = asyncio.get_running_loop().create_future()
        window.waiters.append(waiter)
        try:
            await waiter
        finally:  # (a wait given up, by a timeout say, leaves no waiter behind: a stalled receiver's grew unbounded)
            with contextlib.suppress(ValueError):
                window.waiters.remove(waiter)

    async def drain_all(self, timeout: float) -> int:
        """Wait up to ``timeout`` s for every backlog to leave (a stopping process's last messages); the records
        still held back then (a receiver that consumes nothing, or too slowly), which are lost with it."""
        held = [key for key, window in self._windows.items() if window.backlog and not window.dead]
        if held:
            waits = [asyncio.ensure_future(self.drain(*key)) for key in held]
            _, late = await asyncio.wait(waits, timeout=timeout)
            for wait in late:
                wait.cancel()
            if late:  # (each ends at once, leaving no waiter behind)
                await asyncio.wait(late)
            for wait in waits:  # (a receiver that exited: its backlog is gone, and said so to its senders)
                if wait.done() and not wait.cancelled():
                    wait.exception()
        return self.backlogged

    def forget(self, window: Window | None) -> None:
        """A once-port's window after its one message left: nothing more goes there, and it is never credited
        (kept, one per once-port a process ever sent to, until that peer exited)."""
        if (
            window is not None
            and not window.backlog
            and self._windows.get((window.link.address, window.port_id)) is window
        ):
            del self._windows[(window.link.address, window.port_id)]

    def drop(self, address: str) -> None:
        """The peer at ``address`` is gone: its windows and backlogs go, their waiters hear why."""
        for key in [key for key in self._windows if key[0] == address]:
            window = self._windows.pop(key)
            window.dead = window.stale = True
            if window.release is not None:
                window.release.cancel()
                window.release = None
            dropped = len(window.backlog)
            window.backlog.clear()
            wake_all(window.waiters, PortClosed(f"the receiver of port {key[1]} at {address} has exited"))
            self.backlogged -= dropped
