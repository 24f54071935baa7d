"""Ports: typed, one-way channels into a process, with end of stream and flow control.

``Channel.open(T)`` returns ``(Port[T], PortReceiver[T])``. The port is a small
handle that can be copied into any process (as an argument, a return value or
inside a message); the receiver stays where it was opened. ``None`` marks the
end of a stream; ``port.exception(e)`` puts an error in a value's place.

``Port.send`` never waits on an event loop's thread: past the port's
flow-control window a record waits in the sender's backlog, and past the
backlog's bound ``send`` raises :class:`~actors.BufferFull`.
``await port.drain()`` paces a fast sender (asyncio's ``write()`` /
``drain()`` convention); see :mod:`actors._transport._flow`. Code without an event
loop blocks in ``send`` instead, serving its inbox, up to a deadline.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import threading
import time
import traceback
import types
import typing
import weakref
from collections.abc import Generator
from typing import Any, Generic, TypeVar, overload

from .._shared._errors import ActorDied, ActorsError, BufferFull, CallTimeout, DecodeError, HandOffTimeout, PortClosed
from .._shared._liveness import ProcRef
from .._shared._loops import done_within
from .._transport._flow import CREDIT_BYTES, CREDIT_MESSAGES, WINDOW, WINDOW_BYTES, Window
from .._transport._outbox import SEND_TIMEOUT
from .._transport._receivers import ReceiverState
from .._transport._sockets import frame_size
from .._wire import _refs
from .._wire._codec import register_handle
from .._wire._ext import handle_of_type
from .._wire._records import Attach, ErrorRecord, Undecodable, port_prefix
from . import _core as _runtime
from ._context import actor_context
from ._core import Runtime, current_runtime, runtime
from ._future import Future
from ._port_error import PortError

T = TypeVar("T")

__all__ = ["Channel", "Port", "PortReceiver", "send_error"]


def _type_ref(tp: Any) -> str | None:
    """The name a port checks values against, or None for an untyped port."""
    if tp is None or tp is Any or tp is object:
        return None
    origin = typing.get_origin(tp)
    if origin is not None:
        tp = origin
    if not isinstance(tp, type):
        return None  # unions and other typing constructs: unchecked
    _check_travels_as_itself(tp)
    return _refs.qualified_name(tp)


#: Types msgpack carries as themselves; their subclasses travel as them (a named tuple as a tuple, an enum member
#: as its value), unless the codec has a record of their own for them.
_PLAIN = (bool, int, float, str, bytes, tuple, list, dict)


def _check_travels_as_itself(tp: type) -> None:
    """Refuse a port type whose values would reach another process as another type (``TypeError``)."""
    plain = next((base for base in _PLAIN if issubclass(tp, base)), None)
    if plain is None or tp in _PLAIN or dataclasses.is_dataclass(tp) or handle_of_type(tp) is not None:
        return
    raise TypeError(
        f"a port of {tp.__module__}.{tp.__qualname__} would deliver a plain {plain.__name__} to another process (its "
        f"values travel as their base type): make it a dataclass, or open the port for {plain.__name__}"
    )


_matches: dict[tuple[type, str], bool] = {}  # memo of _is_instance: (class, type name) -> answer


def _is_instance(value: Any, ref: str) -> bool:
    """``isinstance`` by qualified name, so the sender need not import the type."""
    key = (type(value), ref)
    hit = _matches.get(key)
    if hit is None:
        hit = _matches[key] = any(_safe_name(cls) == ref for cls in type(value).__mro__)
    return hit


def _safe_name(cls: type) -> str | None:
    try:
        return _refs.qualified_name(cls)
    except TypeError:
        return None


#: What a receive raises for rather than returns: it ends a ``recv_ready`` batch.
_RAISES = (Undecodable, PortError)

_EXHAUSTED = iter(())  # an exhausted iterator stays exhausted: one serves every await


class _Ready:
    """An awaitable that is already done (``drain()`` with nothing held back)."""

    __slots__ = ()

    def __await__(self) -> Generator[Any, None, None]:
        return _EXHAUSTED  # type: ignore[return-value]


_READY = _Ready()


class _Route:
    """How this process reaches a port: its runtime, the receiver's process, the packed prefix, the window."""

    __slots__ = ("prefix", "ref", "rt", "window")

    def __init__(self, rt: Runtime, ref: ProcRef | None, prefix: bytes, window: Window | None) -> None:
        self.rt = rt
        self.ref = ref  # None: the receiver lives in this process
        self.prefix = prefix
        self.window = window


class Port(Generic[T]):
    """The sending end of a channel; copy it freely into other processes."""

    __slots__ = ("__weakref__", "_address", "_id", "_once", "_pid", "_route", "_type", "_used")

    def __init__(self, address: str, pid: int, port_id: int, type_ref: str | None, once: bool) -> None:
        self._address = address
        self._pid = pid
        self._id = port_id
        self._type = type_ref
        self._once = once
        self._used = False
        self._route: _Route | None = None  # cached per runtime

    def __repr__(self) -> str:
        kind = self._type or "untyped"
        return f"<Port {self._id} of pid {self._pid} ({kind}{', once' if self._once else ''})>"

    def send(self, value: T | None) -> None:
        """Deliver ``value`` (or the end-of-stream ``None``) to the receiver.

        Raises ``TypeError`` for a value of the wrong type, :class:`PortClosed`
        if the receiver's process is gone, and :class:`BufferFull` if the
        receiver has fallen so far behind that this sender's backlog is full.
        """
        ref = self._type
        if value is not None and ref is not None and not _is_instance(value, ref):
            cls = type(value)
            raise TypeError(f"this port carries {ref.replace(':', '.')}, not {cls.__module__}.{cls.__qualname__}")
        self._send_once_or_more(value)

    def exception(self, exc: BaseException) -> None:
        """Deliver an error in the place of a value: the receive that meets it raises :class:`ActorError`.

        Monarch's ``Port.exception``. The error names the actor and endpoint
        sending it, when an actor sends it. It raises what :meth:`send` does.
        """
        if not isinstance(exc, BaseException):
            raise TypeError(f"Port.exception takes an exception, not {type(exc).__name__}")
        ctx = actor_context.get()
        record = ErrorRecord.of(exc, "".join(traceback.format_exception(exc)) if exc.__traceback__ else "")
        if ctx is None:
            self._send_once_or_more(PortError(record))
        else:
            self._send_once_or_more(PortError(record, ctx.name, ctx.rank, ctx.method))

    def _send_once_or_more(self, value: Any) -> None:
        if self._once:
            if self._used:
                raise PortClosed("a once-port can be sent to only once")
            self._used = True
            try:
                self._deliver(value)
            except Exception as exc:
                # Refused before it left (closed, full, a value that cannot be encoded, its own pickling code
                # raising): the one message is still to come. Not a hand-off to the runtime's thread that timed
                # out: the send may have run there after all, and a second could arrive as a second answer.
                if not isinstance(exc, HandOffTimeout):
                    self._used = False
                raise
            route = self._route
            if route is not None and route.window is not None:  # its one message left: no credit will come back
                route.rt.driver.on_thread(lambda: route.rt.windows.forget(route.window))
        else:
            self._deliver(value)

    def _deliver(self, value: T | None) -> None:
        route = self._route
        if route is not None:
            window = route.window
            rt = route.rt
            if window is not None and not window.stale and rt is _runtime._process.runtime and rt.driver.loop_active():
                self._post(rt, route, window, value)  # the hot path: a remote port, on this runtime's loop
                return
        rt = runtime()
        if rt.driver.on_runtime_thread():
            self._send(rt, value)
            return
        # Another thread drives the runtime: send there; while the receiver has no room, wait here.
        while not rt.driver.on_thread(lambda: self._send(rt, value, from_thread=True)):
            route = self._route
            assert route is not None and route.window is not None
            self._wait_for_room(rt, route.window)

    def _resolve(self, rt: Runtime) -> _Route:
        route = self._route
        if route is None or route.rt is not rt or (route.window is not None and route.window.stale):
            if self._address == rt.address:
                if self._pid != rt.pid:  # an earlier process at this address (restarted): its receivers are gone
                    raise PortClosed(
                        f"the receiver of port {self._id} (pid {self._pid}) has exited; pid {rt.pid} replaced it"
                    )
                route = _Route(rt, None, b"", None)
            else:
                ref = rt.registry.proc(self._address, self._pid)
                if ref.dead and not rt.registry.alive(ref):
                    raise PortClosed(f"the receiver of port {self._id} (pid {self._pid}) has exited")
                if ref.pid is not None and ref.pid != self._pid:
                    raise PortClosed(
                        f"the receiver of port {self._id} (pid {self._pid}) has exited; pid {ref.pid} replaced it"
                    )
                try:
                    link = rt.link(ref)
                except ActorDied as exc:
                    raise PortClosed(f"the receiver of port {self._id} (pid {self._pid}) has exited") from exc
                route = _Route(rt, ref, port_prefix(self._id), rt.windows.window(link, self._id))
            self._route = route
        return route

    def _send(self, rt: Runtime, value: Any, *, from_thread: bool = False) -> bool:
        """Send on the runtime's thread; False (nothing sent) when ``from_thread`` and the window is full."""
        route = self._resolve(rt)
        window = route.window
        if window is None:
            state = rt.receivers.get(self._id)
            if state is None or (state.closed is not None and not state.once):
                raise PortClosed(f"port {self._id} has no receiver in this process")
            state.deliver(value, None, 0)
            return True
        if window.backlog or not window.has_room():
            if from_thread:
                return False  # the calling thread waits for room (its own wait, not the loop's)
            if not rt.driver.loop_active():
                self._wait_for_room(rt, window)
        self._post(rt, route, window, value)
        return True

    def _post(self, rt: Runtime, route: _Route, window: Window, value: Any) -> None:
        enc = rt.encoder_now()
        enc.reset()
        data = route.prefix + enc.encode(value)
        frames = enc.frames
        size = len(data)
        if frames:
            for frame in frames:
                size += frame_size(frame)
        if enc.handles:
            assert route.ref is not None
            rt.note_handles(enc.handles, route.ref)
        # SenderWindows.send, inlined: this runs once per message.
        if (
            not window.backlog
            and window.inflight < WINDOW
            and (window.inflight_bytes < WINDOW_BYTES or not window.inflight)
        ):
            rt.outbox.post(window.link, data, frames, False)  # (BufferFull: nothing left, nothing counted)
            window.inflight += 1
            window.inflight_bytes += size
        else:
            rt.windows.hold(window, data, frames, size)

    def _wait_for_room(self, rt: Runtime, window: Window) -> None:
        """A caller without an event loop blocks (serving its inbox) for window, up to a deadline."""
        try:
            rt.driver.wait(
                lambda: window.dead or (not window.backlog and window.has_room()),
                timeout=SEND_TIMEOUT,
                what=f"the receiver of port {self._id} at {self._address} to consume",
            )
        except CallTimeout:
            raise BufferFull(f"the receiver of port {self._id} consumed nothing for {SEND_TIMEOUT:g}s") from None
        if window.dead:
            raise PortClosed(f"the receiver of port {self._id} (pid {self._pid}) has exited")

    def drain(self) -> Any:
        """Awaitable: returns once nothing this process sent to the port waits in its backlog.

        ``port.send(x); await port.drain()`` is the loop-friendly way to
        send faster than the receiver may consume: the sender yields until
        the receiver has caught up to within the port's window.
        """
        route = self._route
        if route is None or route.window is None or not route.window.backlog:
            return _READY  # the common case: nothing held back
        rt = current_runtime()
        if rt is None or route.rt is not rt:
            return _READY
        return rt.windows.drain(self._address, self._id)

    def _shipped_to(self, rt: Runtime, dest: ProcRef) -> None:
        """Record that process ``dest`` now holds a copy of this port."""
        pid = dest.pid
        if pid is None and dest.dead:  # it died before its pid was known (it never started): a holder gone
            state = rt.receivers.get(self._id) if self._address == rt.address and self._pid == rt.pid else None
            if state is not None:
                state.attach(dest.address, alive=False)
            return
        if pid is None:
            state = rt.receivers.get(self._id) if self._address == rt.address and self._pid == rt.pid else None
            if state is None:
                rt.registry.when_pid_known(dest, lambda: self._shipped_to(rt, dest))
                return
            # A holder to come (a restarted process starting): until its pid is known, its sender counts, so a
            # receive does not end with "every sender has exited" between the old process's death and it.
            state.pending += 1

            def known(state: ReceiverState = state) -> None:
                state.pending -= 1
                self._shipped_to(rt, dest)

            rt.registry.when_pid_known(dest, known)
            return
        if pid == self._pid and dest.address == self._address:  # the port's own process (a pid alone is no process
            return  # of this host's: another host's may have the same)
        if self._address == rt.address:
            state = rt.receivers.get(self._id) if self._pid == rt.pid else None  # (else an earlier process's)
            if state is not None:
                rt.receivers.attach(state, dest)
            return
        owner = rt.registry.proc(self._address, self._pid)
        if not owner.dead:
            with contextlib.suppress(ActorDied):
                rt.send(owner, Attach(self._id, pid, dest.address), urgent=False)


def _receiver_dropped(rt: Runtime, state: ReceiverState) -> None:
    """Close the port whose receiver was garbage-collected unclosed: later, on the runtime's loop, never here (a
    collection runs wherever an allocation triggered it, the runtime's own encoding or flushing included, and a
    close sends its senders their credit back)."""
    if state.closed is not None or rt.closed:
        return

    def close() -> None:
        if state.closed is None and not rt.closed:
            rt.receivers.close(state, "its receiver was dropped")

    loop = rt.driver.loop
    if loop is not None:  # (none bound yet: the port stays open, as an unclosed receiver did before)
        with contextlib.suppress(RuntimeError):  # (its loop closed meanwhile: nothing runs on it any more)
            loop.call_soon_threadsafe(close)


def send_error(port: Port[Any], error: PortError) -> None:
    """Send ``error`` (built by the runtime, for a call that failed) in a value's place, as ``Port.exception``."""
    port._send_once_or_more(error)


def _port_state(port: Port[Any]) -> list[Any]:
    return [port._address, port._pid, port._id, port._type, port._once]


def _port_from_state(state: Any) -> Port[Any]:
    if (
        type(state) is not list
        or len(state) != 5
        or type(state[0]) is not str
        or type(state[1]) is not int
        or type(state[2]) is not int
        or not (state[3] is None or type(state[3]) is str)
    ):
        raise DecodeError("malformed port")
    port: Port[Any] = Port(state[0], state[1], state[2], state[3], bool(state[4]))
    rt = runtime()
    if state[0] != rt.address:
        rt.registry.proc(state[0], state[1])  # watch the receiver's process
    return port


register_handle("port", Port, _port_state, _port_from_state)


class PortReceiver(Generic[T]):
    """The receiving end of a channel; lives in the process that opened it."""

    def __init__(self, rt: Runtime, state: ReceiverState, type_ref: str | None) -> None:
        self._rt = rt
        self._state = state
        self._type = type_ref

    def recv(self) -> Future[T | None]:
        """The next message (``None`` at end of stream).

        Raises :class:`PortClosed` when nothing is queued and every other
        process that held a sender for this port has exited.
        """
        return _Recv(self)

    def _wait(self) -> Generator[Any, None, T | None]:
        if not self._state.queue:
            yield from self._until_queued()
        elif not self._rt.driver.loop_active():  # (the queue and its credit are the runtime thread's: this
            self._rt.driver.ensure_loop()  # loop takes the runtime over first, or says why it cannot)
        return self._take()  # type: ignore[no-any-return]

    @types.coroutine
    def _until_queued(self) -> Generator[Any, None, None]:
        """Wait (on the runtime's loop) until a message is queued; PortClosed if none can come."""
        state = self._state
        queue = state.queue
        if queue:
            return
        loop = self._rt.driver.ensure_loop()
        while not queue:
            self._check_open()
            waiter = loop.create_future()
            state.waiters.append(waiter)  # other tasks may wait on this receiver too
            try:
                yield from waiter.__await__()
            finally:
                with contextlib.suppress(ValueError):  # (a woken waiter has left the list already)
                    state.waiters.remove(waiter)

    def _recv_sync(self, timeout: float | None) -> T | None:
        driver = self._rt.driver
        loop = driver.loop
        if loop is not None and loop.is_running() and threading.get_ident() != driver.thread:
            return self._recv_from_thread(loop, timeout)
        state = self._state

        def ready() -> bool:
            if not state.queue:
                self._check_open()
                return False
            return True

        driver.wait(ready, timeout=timeout, what=f"a message on port {state.port_id}")
        return self._take()  # type: ignore[no-any-return]

    def _recv_from_thread(self, loop: asyncio.AbstractEventLoop, timeout: float | None) -> T | None:
        """``recv().get(timeout)`` while another thread's loop drives the runtime: taken only for a waiting caller.

        The message is taken on the loop's thread. A caller that gives up
        first marks the hand-over abandoned, so a message arriving just then
        stays queued for the next ``recv``; one taken just before the caller
        gave up is returned rather than dropped.
        """
        handover = _Handover()
        started = time.monotonic()
        waiting = asyncio.run_coroutine_threadsafe(self._take_for(handover), loop)
        try:
            self._await_handover(waiting, loop, timeout)
        except BaseException as exc:
            with handover.lock:
                handover.abandoned = True
                taken = handover.taken
            if taken:
                return handover.outcome()  # type: ignore[no-any-return]
            waiting.cancel()  # (done already when the receive failed on its own)
            if isinstance(exc, concurrent.futures.CancelledError):  # the loop ended or handed the runtime over
                self._rt.driver.next_loop(loop)
                left = None if timeout is None else max(0.0, timeout - (time.monotonic() - started))
                return self._recv_sync(left)  # (on whatever drives the runtime now)
            if not isinstance(exc, concurrent.futures.TimeoutError):
                raise  # the receive's own outcome (PortClosed), or the caller was interrupted
            raise CallTimeout(
                f"gave up after {timeout:.1f}s waiting for a message on port {self._state.port_id}"
            ) from None
        return handover.outcome()  # type: ignore[no-any-return]

    def _await_handover(
        self, waiting: concurrent.futures.Future[None], loop: asyncio.AbstractEventLoop, timeout: float | None
    ) -> None:
        """``waiting.result(timeout)``, and ``CancelledError`` as soon as ``loop`` no longer drives the runtime
        (it stopped with the receive on it: a task not cancelled, which would wait for good)."""
        served = self._rt.driver.wait_while_driven(loop, functools.partial(done_within, waiting), timeout)
        if served is None:
            raise concurrent.futures.CancelledError()
        if not served:
            raise concurrent.futures.TimeoutError()
        waiting.result()  # (its own outcome: PortClosed, or cancelled with its loop)

    async def _take_for(self, handover: _Handover) -> None:
        await self._until_queued()
        with handover.lock:
            if not handover.abandoned:
                try:
                    handover.value = self._take()
                except Exception as exc:  # an error in a value's place (Port.exception, an undecodable one), taken
                    handover.error = exc
                handover.taken = True

    def _check_open(self) -> None:
        state = self._state
        if state.closed is not None:
            raise PortClosed(state.closed)
        if state.senders_gone():
            raise PortClosed(
                f"every process holding a sender for port {state.port_id} has exited, and nothing is queued"
            )

    def _take(self) -> Any:
        state = self._state
        value, sender, size = state.queue.popleft()
        if sender is not None:  # count it toward the sender's credit (inline: once per message)
            counts = state.unacked.get(sender)
            if counts is None:
                counts = state.unacked[sender] = [0, 0]
            counts[0] += 1
            counts[1] += size
            if value is None:  # the sender's end of stream: the rest of its credit goes back now, and its count
                self._rt.receivers.credit(state, sender, counts)
                del state.unacked[sender]
            elif counts[0] >= CREDIT_MESSAGES or counts[1] >= CREDIT_BYTES:
                self._rt.receivers.credit(state, sender, counts)
        if state.once:
            self._rt.receivers.close(state, "a once-port delivers a single message")
        kind = type(value)
        if kind is Undecodable:
            raise DecodeError(f"port {state.port_id}: {value.reason}")
        if kind is PortError:
            raise value.to_error()
        return value

    def recv_ready(self) -> list[T | None]:
        """The messages already queued, taken without waiting (an empty list when none is).

        A message that could not be decoded here, or an error sent with
        ``Port.exception``, ends the list before it (the next receive raises
        ``DecodeError`` or ``ActorError`` for it), or raises if it is first.
        From any thread: the queue and its credit are the runtime thread's.
        """
        return self._rt.driver.on_thread(self._take_ready)  # type: ignore[no-any-return]

    def _take_ready(self) -> list[T | None]:
        queue = self._state.queue
        taken: list[T | None] = []
        while queue and (not taken or type(queue[0][0]) not in _RAISES):
            taken.append(self._take())
        return taken

    def qsize(self) -> int:
        """Messages waiting to be received."""
        return len(self._state.queue)

    @property
    def senders_alive(self) -> bool:
        """False once every other process that held a sender has exited."""
        return not self._state.senders_gone()

    def close(self) -> None:
        """Stop receiving, from any thread: what is queued is dropped (and credited back to its senders), and
        later messages to this port are refused with a log."""
        self._rt.driver.on_thread(lambda: self._rt.receivers.close(self._state, "the receiver was closed"))


class _Handover:
    """A synchronous receive's message, taken on the runtime's thread for a caller waiting on its own."""

    __slots__ = ("abandoned", "error", "lock", "taken", "value")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.taken = False
        self.abandoned = False
        self.value: Any = None
        #: What the record taken raised in a value's place: the caller gets it, even one that just gave up.
        self.error: Exception | None = None

    def outcome(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.value


class _Recv(Future["T | None"]):
    """``PortReceiver.recv()``: returns at once, without a coroutine, when a message is queued."""

    __slots__ = ("_receiver",)

    def __init__(self, receiver: PortReceiver[T]) -> None:
        self._receiver = receiver
        self._done = False
        self._value: Any = None
        self._error: BaseException | None = None
        self._any_thread = True  # get() from any thread waits there; the message is taken where the runtime runs

    @property
    def _make(self) -> Any:  # type: ignore[override]
        return self._coroutine

    @property
    def _wait_sync(self) -> Any:  # type: ignore[override]
        return self._receiver._recv_sync

    async def _coroutine(self) -> T | None:
        return await self

    def __await__(self) -> Generator[Any, None, T | None]:
        if self._done:
            return self._result()
        receiver = self._receiver
        try:
            if receiver._state.queue and receiver._rt.driver.thread == threading.get_ident():
                value = receiver._take()  # (the hot path: on the runtime's own thread)
            else:
                value = yield from receiver._wait()
        except ActorsError as exc:  # (closed; an error sent in the stream; a message that could not be decoded)
            self._done, self._error = True, exc
            raise
        self._done, self._value = True, value
        return value  # type: ignore[no-any-return]


class Channel(Generic[T]):
    """Opens ports: ``port, receiver = Channel.open(T)``."""

    @overload
    @staticmethod
    def open(message_type: type[T], *, once: bool = False) -> tuple[Port[T], PortReceiver[T]]: ...
    @overload
    @staticmethod
    def open(message_type: None = None, *, once: bool = False) -> tuple[Port[Any], PortReceiver[Any]]: ...
    @staticmethod
    def open(message_type: Any = None, *, once: bool = False) -> tuple[Port[Any], PortReceiver[Any]]:
        """A new ``(Port, PortReceiver)`` pair owned by this process.

        ``message_type`` makes the port typed: ``send`` refuses other values.
        ``once=True`` makes a one-shot port that delivers a single message.
        """
        if isinstance(message_type, bool):
            raise TypeError("Channel.open(message_type, *, once=False): pass once as a keyword")
        rt = runtime()
        ref = _type_ref(message_type)
        state = rt.receivers.open(once)
        receiver: PortReceiver[Any] = PortReceiver(rt, state, ref)
        # A receiver dropped unclosed is closed (as Monarch's is when dropped): what it queued is let go, and
        # sends to it are refused, not kept for no one.
        weakref.finalize(receiver, _receiver_dropped, rt, state).atexit = False
        return Port(rt.address, rt.pid, state.port_id, ref, once), receiver
