"""Lifelines: one tcp connection between the controller and each node host, so either sees the other go.

A placer's own health checks (Ray's, a scheduler's) take seconds to tens of
seconds to notice that a machine is gone. A lifeline is quicker: when either
process dies, its kernel closes the connection and the other side reads EOF
at once; when a machine vanishes without closing anything, the heartbeats
stop and the other side gives up after a silence bound (:data:`SILENCE` s
unless ``ACTORS_LIFELINE_SILENCE`` in the controller's environment says
otherwise: the controller hands its bound to each node host with the
lifeline's address and key, a :class:`LifelineTicket`). The node host
proves it belongs to this controller with an HMAC of the controller's nonce
under a key that reached it over an authenticated channel (a Ray
constructor argument, or a CURVE-encrypted call to an attached worker).
Used by ``actors.ray`` and by ``attach_to_workers``.

The controller's side is :class:`Lifelines` (one thread, every node); the
node host's is :func:`hold` (one thread).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import math
import os
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = [
    "HEARTBEAT",
    "LIFELINE_THREAD",
    "SILENCE",
    "SILENCE_ENV",
    "LifelineTicket",
    "Lifelines",
    "hold",
    "silence_bound",
]

log = logging.getLogger("actors")

#: The name of the node host's lifeline thread (a stop it causes must not wait for itself).
LIFELINE_THREAD = "actors-lifeline"
#: Seconds between heartbeats, both ways.
HEARTBEAT = 0.5
#: Pause after a connection the listener could not take (out of descriptors): bounds the retries of one still queued.
ACCEPT_RETRY = 0.05
#: Seconds without a byte after which the other side counts as gone (a machine lost without a word), by default.
SILENCE = 5.0
#: The controller's environment variable that sets the silence bound, in seconds.
SILENCE_ENV = "ACTORS_LIFELINE_SILENCE"
_NONCE = 16
_ANSWER = struct.Struct("<32sI")  # MAC of the nonce, node index
#: Connections held at once before they proved the key (a node host proves at once): past it the oldest goes.
UNPROVEN_LINES = 128


def silence_bound() -> float:
    """The silence bound this controller gives its lifelines: ``ACTORS_LIFELINE_SILENCE``, else :data:`SILENCE`.

    Shorter finds a vanished machine sooner; it must leave room for a few
    missed heartbeats of a busy host (at least ``4 x HEARTBEAT``, 2 s).
    """
    setting = os.environ.get(SILENCE_ENV)
    if setting is None:
        return SILENCE
    try:
        seconds = float(setting)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds < 4 * HEARTBEAT:
        raise ValueError(
            f"{SILENCE_ENV}={setting!r}: the lifeline's silence bound is a number of seconds, at least "
            f"{4 * HEARTBEAT:g} (four heartbeats)"
        )
    return seconds


@dataclass(frozen=True)
class LifelineTicket:
    """What a node host needs to hold its lifeline: the controller's address and key, its index, the silence bound."""

    host: str
    port: int
    key: bytes
    index: int
    silence: float

    @property
    def address(self) -> tuple[str, int]:
        return (self.host, self.port)


def _mac(key: bytes, nonce: bytes, index: int) -> bytes:
    return hmac.digest(key, b"lifeline" + nonce + struct.pack("<I", index), hashlib.sha256)


@dataclass(eq=False)
class _Line:
    sock: socket.socket
    nonce: bytes
    index: int | None = None
    heard: float = field(default_factory=time.monotonic)
    pending: bytes = b""


class Lifelines:
    """The controller's end: accepts each node host's lifeline and reports a node whose line ends.

    ``on_lost(index, why)`` runs on this class's thread; losses seen before
    it is set are kept and reported when it is. ``silence_s`` is the bound both
    ends use (default: :func:`silence_bound`).
    """

    def __init__(self, host: str, silence_s: float | None = None) -> None:
        self.silence = silence_bound() if silence_s is None else silence_s
        self.key = os.urandom(32)
        self._listener = socket.create_server((host, 0))
        self._listener.setblocking(False)
        self.address = (host, self._listener.getsockname()[1])
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._lock = threading.Lock()
        self._on_lost: Callable[[int, str], None] | None = None
        self._early: list[tuple[int, str]] = []
        self._cuts: set[int] = set()  # lines this side ends (their hosts were lost otherwise)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="actors-lifelines", daemon=True)
        self._thread.start()

    def ticket(self, index: int) -> LifelineTicket:
        """What node host ``index`` is handed to hold its lifeline to this controller."""
        return LifelineTicket(self.address[0], self.address[1], self.key, index, self.silence)

    def watch(self, on_lost: Callable[[int, str], None]) -> None:
        with self._lock:
            self._on_lost, early, self._early = on_lost, self._early, []
        for index, why in early:
            on_lost(index, why)

    def cut(self, index: int) -> None:
        """End node ``index``'s line from this side: its host was lost otherwise (a request to it failed), and its
        workers, restarted elsewhere, must not run on beside their replacements: the host ends them as its line
        ends (from any thread; nothing to do for a line already ended)."""
        with self._lock:
            if self._closed:
                return
            self._cuts.add(index)
        with contextlib.suppress(OSError):
            self._wake_w.send(b"!")

    def _lost(self, index: int, why: str) -> None:
        with self._lock:
            if self._closed:
                return
            report = self._on_lost
            if report is None:
                self._early.append((index, why))
                return
        report(index, why)

    def _run(self) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self._listener, selectors.EVENT_READ)
        selector.register(self._wake_r, selectors.EVENT_READ)
        lines: dict[socket.socket, _Line] = {}
        next_beat = time.monotonic()
        try:
            while not self._closed:
                for key, _ in selector.select(HEARTBEAT):
                    if key.fileobj is self._listener:
                        self._accept(selector, lines)
                    elif key.fileobj is self._wake_r:
                        with contextlib.suppress(BlockingIOError, OSError):
                            self._wake_r.recv(4096)
                    else:
                        line = lines[key.fileobj]  # type: ignore[index]
                        if not self._read(line):
                            self._drop(selector, lines, line, "its lifeline to the controller closed")
                with self._lock:
                    cuts, self._cuts = self._cuts, set()
                for line in [line for line in lines.values() if line.index in cuts]:
                    self._drop(selector, lines, line, "this controller ended its lifeline: it was lost")
                now = time.monotonic()
                for line in list(lines.values()):
                    if now - line.heard > self.silence:
                        self._drop(selector, lines, line, f"its lifeline was silent for {self.silence:g}s")
                    elif now >= next_beat and line.index is not None:
                        try:
                            line.sock.send(b".")
                        except BlockingIOError:
                            pass  # its buffer is full of beats: it is slow, not gone (silence decides)
                        except OSError:
                            self._drop(selector, lines, line, "its lifeline to the controller broke")
                if now >= next_beat:
                    next_beat = now + HEARTBEAT
        finally:
            for line in lines.values():
                line.sock.close()
            selector.close()

    def _accept(self, selector: selectors.BaseSelector, lines: dict[socket.socket, _Line]) -> None:
        try:
            sock, _ = self._listener.accept()
        except BlockingIOError:
            return
        except OSError as exc:  # out of descriptors, a connection reset while queued: the lines held stay held
            log.warning("lifelines: could not accept a node host's connection (%s); it is retried", exc)
            time.sleep(ACCEPT_RETRY)  # (this thread's own wait: a connection still queued is retried, not spun on)
            return
        sock.setblocking(False)
        line = _Line(sock, os.urandom(_NONCE))
        try:
            sock.send(line.nonce)  # 16 bytes into an empty buffer
        except OSError:
            sock.close()
            return
        unproven = [held for held in lines.values() if held.index is None]
        if len(unproven) >= UNPROVEN_LINES:  # (anyone on the network can connect: descriptors are not theirs)
            self._drop(selector, lines, min(unproven, key=lambda held: held.heard), "")
        lines[sock] = line
        selector.register(sock, selectors.EVENT_READ)

    def _read(self, line: _Line) -> bool:
        """False once the line has ended (EOF, error, or a failed proof)."""
        try:
            data = line.sock.recv(4096)
        except BlockingIOError:
            return True
        except OSError:
            return False
        if not data:
            return False
        if line.index is None:  # (its silence counts from its connection until it proves the key: a byte a while
            line.pending += data  # kept an unproven one open for good)
            if len(line.pending) < _ANSWER.size:
                return True
            mac, index = _ANSWER.unpack(line.pending[: _ANSWER.size])
            if not hmac.compare_digest(mac, _mac(self.key, line.nonce, index)):
                log.warning("a lifeline without this controller's key was refused")
                return False  # dropped: it was never a node of ours, so no node is lost
            line.index = index
        line.heard = time.monotonic()
        return True

    def _drop(self, selector: selectors.BaseSelector, lines: dict[socket.socket, _Line], line: _Line, why: str) -> None:
        lines.pop(line.sock, None)
        with contextlib.suppress(KeyError, ValueError):
            selector.unregister(line.sock)
        line.sock.close()
        if line.index is not None:
            self._lost(line.index, why)

    def close(self) -> None:
        with self._lock:
            self._closed = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"!")
        self._thread.join(5.0)
        for sock in (self._listener, self._wake_r, self._wake_w):
            sock.close()


def hold(ticket: LifelineTicket, on_lost: Callable[[str], None]) -> Callable[[], None]:
    """The node host's end: connect, prove the key, then beat until the line ends; returns a closer.

    ``on_lost(why)`` runs (on the lifeline's thread) when the controller's
    end closes or falls silent for the ticket's bound, never after the closer
    was called.
    """
    if type(ticket) is not LifelineTicket:
        raise TypeError(f"a lifeline is held by its LifelineTicket, not {ticket!r:.80}")
    bound = ticket.silence
    sock = socket.create_connection(ticket.address, timeout=bound)  # the handshake, too, gives up after the bound
    try:
        nonce = bytearray()
        while len(nonce) < _NONCE:
            piece = sock.recv(_NONCE - len(nonce))
            if not piece:
                raise ConnectionError("the controller closed the lifeline during its handshake")
            nonce += piece
        sock.sendall(_ANSWER.pack(_mac(ticket.key, bytes(nonce), ticket.index), ticket.index))
    except BaseException:
        sock.close()
        raise
    sock.settimeout(HEARTBEAT)
    closing = threading.Event()

    def beat() -> None:
        heard = time.monotonic()
        why = ""
        while not closing.is_set():
            try:
                data = sock.recv(4096)
                if not data:
                    why = "the controller's lifeline closed"
                    break
                heard = time.monotonic()
            except TimeoutError:
                pass
            except OSError as exc:
                why = f"the controller's lifeline broke ({exc})"
                break
            if time.monotonic() - heard > bound:
                why = f"the controller's lifeline was silent for {bound:g}s"
                break
            with contextlib.suppress(TimeoutError, OSError):
                sock.send(b".")
        if why and not closing.is_set():
            on_lost(why)
            sock.close()  # the line has ended: its closer, if ever called, finds it closed (a no-op)

    thread = threading.Thread(target=beat, name=LIFELINE_THREAD, daemon=True)
    thread.start()

    def close() -> None:
        closing.set()
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        thread.join(5.0)
        sock.close()

    return close
