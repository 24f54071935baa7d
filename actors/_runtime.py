"""The per-process messaging core: inbox pump, outbound links, pending calls.

Every process (the controller and each worker) has exactly one
:class:`Runtime`. It owns the ZeroMQ context, the inbox, the links to peers,
the table of calls awaiting replies, the port receivers living here, and the
liveness watch on every peer it depends on. All of its state is touched from
one thread: the thread of the event loop it is bound to, or, while no loop
drives it, the thread that calls it synchronously.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import itertools
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import zmq

from . import _protocol as P
from ._calls import PendingCall, error_record
from ._codec import Decoder, Encoder
from ._errors import ActorDied, CallTimeout, DecodeError, EncodeError
from ._liveness import ProcRef, Watcher
from ._transport import (
    FLUSH_BYTES,
    FLUSH_MESSAGES,
    Link,
    bind_inbox,
    inbox_address,
    incarnation_path,
    make_header,
    make_runtime_dir,
    message_prefix,
    parse_header,
    remove_socket_file,
    session_keys,
    valid_peer_address,
)

log = logging.getLogger("actors")

#: Dropped-message logs: at most this many per window, then one summary line.
DROP_LOG_BURST = 10
DROP_LOG_WINDOW = 10.0
#: How long closing a process's links may keep trying to deliver what is queued.
CLOSE_LINGER_MS = 200
#: How long a sender waits for room (socket or port window) before giving up.
SEND_TIMEOUT = 300.0

SESSION_ENV = "ACTORS_SESSION_DIR"
_ARITY = P.ARITY
assert P.PORT == 3
FLUSH_PARTS = 2 * FLUSH_MESSAGES


class Runtime:
    """Messaging state of this process. Obtain it with :func:`runtime`."""

    def __init__(self, address: str | None = None) -> None:
        self.pid = os.getpid()
        self.owns_dir = False
        session = os.environ.get(SESSION_ENV)
        if session and os.path.isdir(session):
            self.dir = session
        else:
            self.dir = make_runtime_dir()
            self.owns_dir = True
        self.session = os.path.basename(self.dir)
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.address = address or inbox_address(self.dir, f"c{self.pid}")
        self.keys = session_keys()
        self.inbox = bind_inbox(self.ctx, self.address, self.keys)
        self.header = make_header(self.address, self.pid)
        self.encoder = Encoder()
        self.decoder = Decoder()
        self.links: dict[str, Link] = {}
        self.procs: dict[str, ProcRef] = {}
        self.pending: dict[int, PendingCall] = {}
        self.receivers: dict[int, Any] = {}
        self.watcher = Watcher(self._on_death)
        self.death_callbacks: list[Callable[[ProcRef], None]] = []
        self.control_handlers: dict[str, Callable[[Any, list[Any], str, int], None]] = {}
        self.on_call: Callable[[list[Any], list[Any], str, int], None] | None = None
        self.extra_readers: dict[int, Callable[[], None]] = {}
        self.pid_resolvers: list[Callable[[ProcRef], None]] = []
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread: int | None = None
        self.closed = False
        self._dirty: list[Link] = []
        self._flush_scheduled = False
        self._call_ids = itertools.count(1)
        self._port_ids = itertools.count(1)
        self._dispatching = False
        self._pid_waiters: dict[str, list[Callable[[], None]]] = {}
        #: Messages dropped as malformed or undeliverable since start (logged, rate-limited).
        self.dropped_messages = 0
        self._drop_window = 0.0
        self._drop_logged = 0
        self._drop_suppressed = 0
        self._progress: list[asyncio.Future[None]] = []

    # ------------------------------------------------------------------ loop binding

    def ensure_loop(self) -> asyncio.AbstractEventLoop:
        """Bind to the running event loop (rebinding if an earlier loop ended)."""
        loop = asyncio.get_running_loop()
        if loop is self.loop:
            return loop
        old = self.loop
        if old is not None and not old.is_closed():
            if old.is_running():
                raise RuntimeError("the actors runtime is already driven by an event loop in another thread")
            self._unbind(old)
        self.loop = loop
        self.thread = threading.get_ident()
        loop.add_reader(self.inbox.FD, self._on_readable)
        self.watcher.bind(loop.add_reader, loop.remove_reader)
        for fd, callback in self.extra_readers.items():
            loop.add_reader(fd, callback)
        loop.call_soon(self._on_readable)  # messages may have arrived before binding
        return loop

    def _unbind(self, loop: asyncio.AbstractEventLoop) -> None:
        with contextlib.suppress(Exception):
            loop.remove_reader(self.inbox.FD)
            for fd in self.extra_readers:
                loop.remove_reader(fd)
            for fd in self.watcher.fds():
                loop.remove_reader(fd)
        self.watcher.bind(None, None)
        self.loop = None
        self.thread = None

    def loop_active(self) -> bool:
        """True when called on the thread of a running loop this runtime is bound to."""
        loop = self.loop
        return loop is not None and threading.get_ident() == self.thread and loop.is_running()

    def on_runtime_thread(self) -> bool:
        return self.thread is None or threading.get_ident() == self.thread or not self._loop_running()

    def _loop_running(self) -> bool:
        return self.loop is not None and self.loop.is_running()

    def add_reader(self, fd: int, callback: Callable[[], None]) -> None:
        """Watch an extra file descriptor in both loop and synchronous modes."""
        self.extra_readers[fd] = callback
        if self.loop is not None and not self.loop.is_closed():
            self.loop.add_reader(fd, callback)

    def remove_reader(self, fd: int) -> None:
        self.extra_readers.pop(fd, None)
        if self.loop is not None and not self.loop.is_closed():
            with contextlib.suppress(Exception):
                self.loop.remove_reader(fd)

    # ------------------------------------------------------------------ peers

    def proc(self, address: str, pid: int | None) -> ProcRef:
        """The interned :class:`ProcRef` for ``address``."""
        ref = self.procs.get(address)
        if ref is None:
            ref = self.procs[address] = ProcRef(address, pid)
            if pid is not None:
                self.watch(ref)
        elif ref.pid is None and pid is not None:
            self.set_pid(ref, pid)
        elif ref.dead and pid is not None and pid != ref.pid and pid not in self.watcher.dead:
            self.revive(ref, pid)  # a restarted process at the same address
        return ref

    def revive(self, ref: ProcRef, pid: int | None) -> None:
        """``ref``'s address is served again, by a restarted process (pid known now or later)."""
        ref.dead = False
        ref.exit_reason = ""
        ref.pid = None
        if pid is not None:
            self.set_pid(ref, pid)

    def alive(self, ref: ProcRef) -> bool:
        """True unless ``ref`` is dead and no restarted process has replaced it.

        An owner that restarts a process records the new pid in the session
        directory (:func:`incarnation_path`); any process holding a handle to
        the old one finds it there on its next call.
        """
        if not ref.dead:
            return True
        try:
            with open(incarnation_path(self.dir, ref.address)) as f:
                pid = int(f.read())
        except (OSError, ValueError):
            return False
        if pid == ref.pid or pid in self.watcher.dead:
            return False
        self.revive(ref, pid)
        return not ref.dead

    def set_pid(self, ref: ProcRef, pid: int) -> None:
        ref.pid = pid
        link = self.links.get(ref.address)
        if link is not None:
            link.pid = pid
        self.watch(ref)
        for callback in self._pid_waiters.pop(ref.address, []):
            try:
                callback()
            except Exception:
                log.exception("pid callback failed")

    def when_pid_known(self, ref: ProcRef, callback: Callable[[], None]) -> None:
        """Run ``callback`` once ``ref``'s pid is known (now, if it already is)."""
        if ref.pid is not None:
            callback()
        else:
            self._pid_waiters.setdefault(ref.address, []).append(callback)

    def pid_of(self, ref: ProcRef) -> int:
        """``ref``'s pid, waiting for the forkserver to report it if needed."""
        if ref.pid is None:
            for resolve in self.pid_resolvers:
                resolve(ref)
                if ref.pid is not None:
                    break
        if ref.pid is None:
            raise ActorDied(f"process {ref.address} never started: {ref.exit_reason or 'unknown'}")
        return ref.pid

    def watch(self, ref: ProcRef) -> None:
        if ref.pid is not None and not ref.dead and ref.pid != self.pid:
            self.watcher.watch(ref.pid)

    def mark_dead(self, ref: ProcRef, reason: str) -> None:
        """Treat ``ref`` as gone: fail everything that waits on it."""
        if ref.dead:
            return
        ref.dead = True
        ref.exit_reason = reason
        link = self.links.pop(ref.address, None)
        if link is not None:
            link.dead = True
            link.close(linger=0)
        for call in list(self.pending.values()):
            for rank, proc in call.procs.items():
                if proc is ref and rank in call.remaining:
                    call.fail(
                        ActorDied(
                            f"actor {call.actor!r} (rank {rank}, pid {ref.pid}) died: {reason}",
                            pid=ref.pid,
                            actor=call.actor,
                        )
                    )
                    self.pending.pop(call.call_id, None)
                    break
        if ref.pid is not None:
            for receiver in list(self.receivers.values()):
                receiver.holder_died(ref.pid)
        for callback in list(self.death_callbacks):
            try:
                callback(ref)
            except Exception:
                log.exception("death callback failed")
        self._notify_progress()

    def _notify_progress(self) -> None:
        waiters, self._progress = self._progress, []
        for waiter in waiters:
            if not waiter.done():
                with contextlib.suppress(RuntimeError):
                    waiter.set_result(None)

    async def wait_until(self, condition: Callable[[], bool], timeout: float) -> bool:
        """Wait (async) until ``condition()`` holds after some message or death; False on timeout."""
        loop = self.ensure_loop()
        deadline = loop.time() + timeout
        while not condition():
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            waiter = loop.create_future()
            self._progress.append(waiter)
            handle = loop.call_later(remaining, waiter.cancel)
            try:
                await waiter
            except asyncio.CancelledError:
                if not waiter.cancelled():
                    raise
            finally:
                handle.cancel()
        return True

    def _on_death(self, pid: int) -> None:
        for ref in list(self.procs.values()):
            if ref.pid == pid:
                self.mark_dead(ref, "process exited")
                return
        for receiver in list(self.receivers.values()):
            receiver.holder_died(pid)

    def link(self, ref: ProcRef) -> Link:
        if ref.dead and not self.alive(ref):
            raise ActorDied(f"process {ref.address} (pid {ref.pid}) is dead: {ref.exit_reason}", pid=ref.pid)
        link = self.links.get(ref.address)
        if link is None:
            link = self.links[ref.address] = Link(self.ctx, ref.address, ref.pid, self.keys)
            self.watch(ref)
        return link

    # ------------------------------------------------------------------ sending

    def post(self, link: Link, data: bytes, frames: list[Any], urgent: bool) -> None:
        """Queue one encoded message on ``link``; flush now or at the end of this loop turn."""
        if frames:
            link.append(data, frames)
        else:
            link.parts.append(message_prefix(0, len(data)))
            link.parts.append(data)
            link.nbytes += len(data)
        if urgent or link.nbytes >= FLUSH_BYTES or len(link.parts) >= FLUSH_PARTS or not self.loop_active():
            self.flush(link)
        elif not link.scheduled:
            link.scheduled = True
            self._dirty.append(link)
            if not self._flush_scheduled:
                self._flush_scheduled = True
                assert self.loop is not None
                self.loop.call_soon(self._flush_dirty)

    def _flush_dirty(self) -> None:
        self._flush_scheduled = False
        dirty, self._dirty = self._dirty, []
        for link in dirty:
            link.scheduled = False
            if link.dead:
                continue
            try:
                self.flush(link)
            except Exception:
                log.exception("could not deliver queued messages to %s", link.address)

    def flush(self, link: Link) -> None:
        if link.try_send(self.header):
            return
        if self._dispatching and self.loop_active():
            # Handling incoming messages must never block on a peer that does not
            # read (it may not exist at all): keep the batch and retry shortly.
            assert self.loop is not None
            self.loop.call_later(0.05, self._retry_flush, link)
            return
        self.wait(
            lambda: link.try_send(self.header),
            timeout=SEND_TIMEOUT,
            link=link,
            writable=link.sock,
            what=f"room in the queue of {link.address}",
        )

    def _retry_flush(self, link: Link) -> None:
        if link.dead or self.closed or not link.parts:
            return
        if not link.try_send(self.header):
            assert self.loop is not None
            self.loop.call_later(0.05, self._retry_flush, link)

    def flush_all(self) -> None:
        for link in list(self.links.values()):
            if not link.dead:
                with contextlib.suppress(Exception):
                    self.flush(link)

    def encode(self, message: Any) -> tuple[bytes, list[Any], list[Any]]:
        """Encode one message: ``(bytes, frames, handles)``."""
        enc = self.encoder
        enc.reset()
        data = enc.encode(message)
        return data, enc.frames, enc.handles

    def send_message(self, ref: ProcRef, message: Any, *, urgent: bool) -> None:
        data, frames, handles = self.encode(message)
        link = self.link(ref)
        if handles:
            self.note_handles(handles, ref)
        self.post(link, data, frames, urgent)

    def note_handles(self, handles: Iterable[Any], dest: ProcRef) -> None:
        """Tell the owners of ports being shipped to ``dest`` who now holds a sender."""
        for handle in handles:
            note = getattr(handle, "_shipped_to", None)
            if note is not None:
                note(self, dest)

    def reply(self, address: str, pid: int, call_id: int, rank: int, ok: bool, value: Any) -> None:
        ref = self.proc(address, pid)
        if ref.dead:
            return
        try:
            self.send_message(ref, [P.REPLY, call_id, rank, ok, value], urgent=True)
        except EncodeError as exc:
            record = error_record(exc, "")
            record[1] = f"the endpoint's return value could not be sent: {exc}"
            self.send_message(ref, [P.REPLY, call_id, rank, False, record], urgent=True)

    def call(
        self,
        targets: list[tuple[int, ProcRef]],
        actor: str,
        method: str,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        *,
        want_reply: bool,
        port: Any = None,
        encoded: tuple[bytes, list[Any], list[Any]] | None = None,
        timeout: float | None = None,
    ) -> PendingCall | None:
        """Send one endpoint invocation to each ``(rank, process)``; eager.

        ``encoded`` is an already encoded ``(args_blob, frames, handles)``;
        ``timeout`` is the call's deadline in seconds from now.
        """
        enc = self.encoder
        if encoded is None:
            enc.reset()
            blob = enc.encode([list(args), kwargs or {}])
            frames, handles = enc.frames, enc.handles
        else:
            blob, frames, handles = encoded
        call_id = next(self._call_ids) if want_reply else 0
        pending: PendingCall | None = None
        if want_reply:
            pending = PendingCall(call_id, actor, dict(targets), method, timeout)
            self.pending[call_id] = pending
        for rank, ref in targets:
            if ref.dead and not self.alive(ref):
                error = ActorDied(
                    f"actor {actor!r} (rank {rank}, pid {ref.pid}) is dead: {ref.exit_reason}", pid=ref.pid, actor=actor
                )
                if pending is None:
                    raise error
                pending.fail(error)
                self.pending.pop(call_id, None)
                return pending
            enc.reset()
            data = enc.encode([P.CALL, call_id, actor, method, self.address, self.pid, rank, blob, port])
            link = self.link(ref)
            if handles or enc.handles:
                self.note_handles([*handles, *enc.handles], ref)
            self.post(link, data, frames, urgent=True)
        return pending

    def control(self, ref: ProcRef, op: str, arg: Any, *, urgent: bool = True) -> None:
        self.send_message(ref, [P.CONTROL, op, arg], urgent=urgent)

    def new_port_id(self) -> int:
        return next(self._port_ids)

    def on_thread(self, fn: Callable[[], Any], timeout: float = SEND_TIMEOUT) -> Any:
        """Run ``fn`` on the runtime's thread (directly if already there) and return its result."""
        if self.on_runtime_thread():
            return fn()
        import concurrent.futures

        done: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def run() -> None:
            try:
                done.set_result(fn())
            except BaseException as exc:
                done.set_exception(exc)

        assert self.loop is not None
        self.loop.call_soon_threadsafe(run)
        return done.result(timeout)

    # ------------------------------------------------------------------ waiting

    async def wait_pending(self, pending: PendingCall) -> dict[int, Any]:
        loop = self.ensure_loop()
        while not pending.done:
            waiter = loop.create_future()
            pending.waiters.append(waiter)
            if pending.deadline is None:
                await waiter
                continue
            timer = loop.call_at(loop.time() + pending.deadline - time.monotonic(), self.expire_call, pending)
            try:
                await waiter
            finally:
                timer.cancel()
        if pending.error is not None:
            raise pending.error
        return pending.results

    def expire_call(self, pending: PendingCall) -> None:
        """Fail ``pending`` with CallTimeout: its deadline passed before every reply came.

        A late reply is then dropped. The actor is alive (a dead one fails the
        call at once), so it is busy or its event loop is blocked.
        """
        if pending.done:
            return
        late = ", ".join(f"rank {rank} (pid {pending.procs[rank].pid})" for rank in sorted(pending.remaining))
        pending.fail(
            CallTimeout(
                f"{pending.actor}.{pending.method}() got no answer from {late} within {pending.timeout:g}s; "
                "the actor is alive but busy, or its event loop is blocked by synchronous code"
            )
        )
        self.pending.pop(pending.call_id, None)

    def wait(
        self,
        condition: Callable[[], bool],
        *,
        timeout: float | None,
        link: Link | None = None,
        writable: zmq.Socket[Any] | None = None,
        what: str = "a reply",
    ) -> None:
        """Block this thread, still serving the inbox, until ``condition()`` holds.

        Used where a synchronous caller must wait: a full peer queue, an
        exhausted port window, or ``Future.get()`` with no loop running.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while not condition():
            if link is not None and link.dead:
                raise ActorDied(f"process {link.address} (pid {link.pid}) died while waiting for {what}", pid=link.pid)
            remaining = 0.1 if deadline is None else min(0.1, deadline - time.monotonic())
            if remaining <= 0:
                raise CallTimeout(f"gave up after {timeout:.1f}s waiting for {what}")
            poller = zmq.Poller()
            if not self._dispatching:
                poller.register(self.inbox, zmq.POLLIN)
            if writable is not None:
                poller.register(writable, zmq.POLLOUT)
            pidfds = self.watcher.fds()
            for fd in pidfds:
                poller.register(fd, zmq.POLLIN)
            for fd in self.extra_readers:
                poller.register(fd, zmq.POLLIN)
            events = dict(poller.poll(int(remaining * 1000) + 1))
            if self.inbox in events:
                self.drain_inbox()
            for fd in pidfds:
                if fd in events:
                    self.watcher.check(fd)
            for fd, callback in list(self.extra_readers.items()):
                if fd in events:
                    callback()

    # ------------------------------------------------------------------ receiving

    def _on_readable(self) -> None:
        if self.closed:
            return
        if not self.drain_inbox(limit=256):
            assert self.loop is not None
            self.loop.call_soon(self._on_readable)

    def drain_inbox(self, limit: int | None = None) -> bool:
        """Handle waiting ZeroMQ messages; True when the inbox is empty."""
        count = 0
        inbox = self.inbox
        while True:
            try:
                frames = inbox.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return True
            except zmq.ZMQError:
                if self.closed:
                    return True
                raise
            self._handle(frames)
            count += 1
            if self._progress:
                self._notify_progress()
            if limit is not None and count >= limit:
                return False

    def _handle(self, frames: list[Any]) -> None:
        if len(frames) < 2:
            self._dropped("a malformed message: %d frame(s), need at least 2", len(frames))
            return
        try:
            address, pid = parse_header(frames[0].bytes)
            if not valid_peer_address(address, self.dir) or pid <= 0:
                raise ValueError(f"sender address {address!r:.80} (pid {pid}) is not a peer of this session")
        except Exception as exc:
            self._dropped("a message with a malformed header: %s", exc)
            return
        known = self.procs.get(address)
        if (known is None and address != self.address) or (known is not None and known.pid != pid):
            self.proc(address, pid)  # know every sender (credits and replies go back to it), and restarts
        self._dispatching = True
        try:
            for message, run, size in self.decoder.decode_batch(frames[1].buffer, frames[2:]):
                try:
                    if type(message) is DecodeError:
                        raise message
                    self._dispatch(message, run, address, pid, size)
                except DecodeError as exc:
                    self._dropped("a malformed message from %s: %s", address, exc)
                except Exception:
                    log.exception("error while handling a message from %s", address)
        except DecodeError as exc:
            self._dropped("the rest of a malformed batch from %s: %s", address, exc)
        finally:
            self._dispatching = False

    def _dropped(self, what: str, *args: Any) -> None:
        """Log a dropped message; at most DROP_LOG_BURST per DROP_LOG_WINDOW, then a count."""
        now = time.monotonic()
        if now - self._drop_window >= DROP_LOG_WINDOW:
            if self._drop_suppressed:
                log.error("... and %d more dropped messages in the last %.0fs", self._drop_suppressed, DROP_LOG_WINDOW)
            self._drop_window, self._drop_logged, self._drop_suppressed = now, 0, 0
        self.dropped_messages += 1
        if self._drop_logged < DROP_LOG_BURST:
            self._drop_logged += 1
            log.error("dropped " + what, *args)
        else:
            self._drop_suppressed += 1

    def _dispatch(self, message: Any, frames: list[Any], address: str, pid: int, size: int) -> None:
        if type(message) is not list or not message or _ARITY.get(message[0]) != len(message):
            raise DecodeError(f"not a valid message: {message!r:.80}")
        kind = message[0]
        if kind == 3:  # PORT, the hot path
            receiver = self.receivers.get(message[1])
            if receiver is None:
                self._dropped("a message for port %r: no such receiver in this process", message[1])
                self._credit_dropped(address, message[1], size)
                return
            receiver.deliver(message[2], address, size)
        elif kind == P.REPLY:
            pending = self.pending.get(message[1])
            if pending is None:
                return  # the call already failed or timed out
            pending.deliver(message[2], bool(message[3]), message[4])
            if pending.done:
                self.pending.pop(message[1], None)
        elif kind == P.CALL:
            if self.on_call is None:
                self.reply(
                    address,
                    pid,
                    message[1],
                    message[6],
                    False,
                    ["LookupError", "this process hosts no actors", "", False],
                )
            else:
                self.on_call(message, frames, address, pid)
        elif kind == P.CREDIT:
            link = self.links.get(address)
            if link is not None:
                inflight = link.inflight.get(message[1])
                if inflight is not None:
                    inflight[0] -= message[2]
                    inflight[1] -= message[3]
        elif kind == P.ATTACH:
            receiver = self.receivers.get(message[1])
            if receiver is not None and type(message[2]) is int:
                receiver.attach(self, message[2])
        elif kind == P.CONTROL:
            handler = self.control_handlers.get(message[1])
            if handler is None:
                self._dropped("unknown control message %r from %s", message[1], address)
                return
            handler(message[2], frames, address, pid)

    def _credit_dropped(self, address: str, port_id: Any, size: int) -> None:
        """A message to a port that is gone still returns its window credit to the sender."""
        ref = self.procs.get(address)
        if ref is not None and not ref.dead and type(port_id) is int:
            with contextlib.suppress(ActorDied):
                self.send_message(ref, [P.CREDIT, port_id, 1, size], urgent=False)

    def decode_blob(self, blob: Any, frames: list[Any]) -> Any:
        if type(blob) is not bytes:
            raise DecodeError("expected an encoded argument blob")
        return self.decoder.decode(blob, frames)

    # ------------------------------------------------------------------ shutdown

    def close(self) -> None:
        """Flush what can be flushed, close every socket, remove owned files."""
        if self.closed or self.pid != os.getpid():
            return
        with contextlib.suppress(Exception):
            self.flush_all()
        self.closed = True
        if self.loop is not None and not self.loop.is_closed():
            self._unbind(self.loop)
        self.watcher.close()
        for link in self.links.values():
            # Queued messages to a live peer leave in milliseconds over ipc; a peer
            # that just exited would otherwise hold the exit for the full linger.
            link.close(linger=CLOSE_LINGER_MS)
        self.links.clear()
        self.inbox.close(linger=0)
        self.ctx.term()
        remove_socket_file(self.address)
        if self.owns_dir:
            shutil.rmtree(self.dir, ignore_errors=True)


_runtime: Runtime | None = None
_lock = threading.Lock()


def runtime() -> Runtime:
    """This process's runtime, created on first use (again after a fork).

    It follows the caller's event loop: called from a different running loop
    than before (a new ``asyncio.run``), it rebinds to that loop.
    """
    global _runtime
    rt = _runtime
    if rt is None or rt.pid != _pid[0] or rt.closed:
        with _lock:
            rt = _runtime
            if rt is None or rt.pid != os.getpid() or rt.closed:
                rt = _runtime = Runtime()
                atexit.register(_close_at_exit)
    loop = rt.loop
    running = asyncio._get_running_loop()
    if running is not loop and (running is not None or (loop is not None and loop.is_closed())):
        if loop is not None and loop.is_closed():
            rt._unbind(loop)
        if running is not None:
            rt.ensure_loop()
    return rt


_pid = [os.getpid()]
os.register_at_fork(after_in_child=lambda: _pid.__setitem__(0, os.getpid()))


def install_runtime(rt: Runtime) -> None:
    """Make ``rt`` this process's runtime (used by worker processes)."""
    global _runtime
    _runtime = rt


def current_runtime() -> Runtime | None:
    rt = _runtime
    return rt if rt is not None and rt.pid == _pid[0] and not rt.closed else None


def _close_at_exit() -> None:
    rt = current_runtime()
    if rt is None:
        return
    for callback in list(_exit_hooks):
        with contextlib.suppress(Exception):
            callback()
    rt.close()


_exit_hooks: list[Callable[[], None]] = []


def at_runtime_exit(callback: Callable[[], None]) -> None:
    """Run ``callback`` before this process's runtime closes at interpreter exit."""
    _exit_hooks.append(callback)
