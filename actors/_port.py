"""Ports: typed, one-way channels into a process, with end of stream and flow control.

``Channel.open(T)`` returns ``(Port[T], PortReceiver[T])``. The port is a small
handle that can be copied into any process (as an argument, a return value or
inside a message); the receiver stays where it was opened. ``None`` marks the
end of a stream. Each sending process may have a bounded window of messages in
flight to a port; a sender that fills it waits (serving its own inbox) until
the receiver consumes.
"""

from __future__ import annotations

import asyncio
import contextlib
import typing
from collections import deque
from collections.abc import Generator
from typing import Any, Generic, TypeVar

from . import _protocol as P
from . import _refs
from . import _runtime as _runtime_module
from ._codec import register_handle
from ._errors import ActorDied, DecodeError, PortClosed
from ._future import Future
from ._liveness import ProcRef
from ._runtime import SEND_TIMEOUT, Runtime, runtime
from ._transport import frame_size

T = TypeVar("T")

__all__ = ["Channel", "Port", "PortReceiver"]


def _type_ref(tp: Any) -> str | None:
    """The name a port checks values against, or None for an untyped port."""
    if tp is None or tp is Any or tp is object:
        return None
    origin = typing.get_origin(tp)
    if origin is not None:
        tp = origin
    if not isinstance(tp, type):
        return None  # unions and other typing constructs: unchecked
    return _refs.qualified_name(tp)


_matches: dict[tuple[type, str], bool] = {}


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


#: Messages and bytes one sending process may have in flight to one port before it waits.
PORT_WINDOW = 4096
PORT_WINDOW_BYTES = 64 * 1024 * 1024


def _send_remote(rt: Runtime, ref: ProcRef, port_id: int, value: Any, prefix: bytes) -> None:
    """Send ``value`` to a port owned by another process, within the port's window.

    ``prefix`` is the packed ``[PORT, port_id,`` start of the message. A full
    window makes the sender wait, still serving its own inbox, for credit.
    """
    link = rt.links.get(ref.address) or rt.link(ref)
    inflight = link.inflight.get(port_id)
    if inflight is None:
        inflight = link.inflight[port_id] = [0, 0]
    if inflight[0] >= PORT_WINDOW or (inflight[1] >= PORT_WINDOW_BYTES and inflight[0] > 0):
        rt.flush(link)
        rt.wait(
            lambda: inflight[0] < PORT_WINDOW and (inflight[1] < PORT_WINDOW_BYTES or inflight[0] == 0),
            timeout=SEND_TIMEOUT,
            link=link,
            what=f"the receiver of port {port_id} at {ref.address} to consume",
        )
    enc = rt.encoder
    enc.reset()
    data = prefix + enc.encode(value)
    frames = enc.frames
    if enc.handles:
        rt.note_handles(enc.handles, ref)
    size = len(data)
    for frame in frames:
        size += frame_size(frame)
    inflight[0] += 1
    inflight[1] += size
    rt.post(link, data, frames, urgent=False)


def _send_credit(rt: Runtime, address: str, port_id: int, messages: int, nbytes: int) -> None:
    """Return window credit to the process at ``address``.

    Urgent: a consumer that always finds messages queued never yields to the
    loop, and a credit held back until then would stall the sender.
    """
    ref = rt.procs.get(address)
    if ref is None or ref.dead:
        return
    with contextlib.suppress(ActorDied):
        rt.send_message(ref, [P.CREDIT, port_id, messages, nbytes], urgent=True)


class _ReceiverState:
    """What the owning process keeps for one open port."""

    __slots__ = ("attached", "closed", "holders", "once", "port_id", "queue", "unacked", "waiter")

    def __init__(self, port_id: int, once: bool) -> None:
        self.port_id = port_id
        self.queue: deque[tuple[Any, str | None, int]] = deque()
        self.waiter: asyncio.Future[None] | None = None
        self.holders: set[int] = set()
        self.attached = False
        self.closed: str | None = None
        self.once = once
        self.unacked: dict[str, list[int]] = {}

    def deliver(self, value: Any, address: str | None, size: int) -> None:
        if self.closed is not None and self.once:
            return
        self.queue.append((value, address, size))
        self._wake()

    def attach(self, rt: Runtime, pid: int) -> None:
        if pid == rt.pid:
            return
        self.attached = True
        if rt.watcher.watch(pid):
            self.holders.add(pid)
        else:
            self._wake()

    def holder_died(self, pid: int) -> None:
        if pid in self.holders:
            self.holders.discard(pid)
            if not self.holders:
                self._wake()

    def senders_gone(self) -> bool:
        return self.attached and not self.holders

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            with contextlib.suppress(RuntimeError):
                waiter.set_result(None)


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
        self._route: tuple[Runtime, Any, bytes] | None = None

    def __repr__(self) -> str:
        kind = self._type or "untyped"
        return f"<Port {self._id} of pid {self._pid} ({kind}{', once' if self._once else ''})>"

    def send(self, value: T | None) -> None:
        """Deliver ``value`` (or the end-of-stream ``None``) to the receiver.

        Raises ``TypeError`` for a value of the wrong type and
        :class:`PortClosed` if the receiver's process is gone.
        """
        ref = self._type
        if value is not None and ref is not None and not _is_instance(value, ref):
            cls = type(value)
            raise TypeError(f"this port carries {ref.replace(':', '.')}, not {cls.__module__}.{cls.__qualname__}")
        if self._once:
            if self._used:
                raise PortClosed("a once-port can be sent to only once")
            self._used = True
        route = self._route
        if route is not None and route[0] is _runtime_module._runtime and route[0].loop_active():
            self._send(route[0], value)  # fast path: same runtime, on its running loop
            return
        rt = runtime()
        if rt.on_runtime_thread():
            self._send(rt, value)
        else:
            rt.on_thread(lambda: self._send(rt, value))

    def _send(self, rt: Runtime, value: Any) -> None:
        route = self._route
        if route is None or route[0] is not rt:
            if self._address == rt.address:
                route = (rt, None, b"")
            else:
                route = (rt, rt.proc(self._address, self._pid), P.port_prefix(self._id))
            self._route = route
        ref = route[1]
        if ref is None:
            state = rt.receivers.get(self._id)
            if state is None or (state.closed is not None and not state.once):
                raise PortClosed(f"port {self._id} has no receiver in this process")
            state.deliver(value, None, 0)
            return
        if ref.dead and not rt.alive(ref):
            raise PortClosed(f"the receiver of port {self._id} (pid {self._pid}) has exited")
        if ref.pid is not None and ref.pid != self._pid:
            raise PortClosed(f"the receiver of port {self._id} (pid {self._pid}) has exited; pid {ref.pid} replaced it")
        try:
            _send_remote(rt, ref, self._id, value, route[2])
        except ActorDied as exc:
            raise PortClosed(f"the receiver of port {self._id} (pid {self._pid}) has exited") from exc

    def _shipped_to(self, rt: Runtime, dest: Any) -> None:
        """Record that process ``dest`` now holds a copy of this port."""
        pid = dest.pid
        if pid is None:
            rt.when_pid_known(dest, lambda: self._shipped_to(rt, dest))
            return
        if pid == self._pid:
            return
        if self._address == rt.address:
            state = rt.receivers.get(self._id)
            if state is not None:
                state.attach(rt, pid)
            return
        owner = rt.proc(self._address, self._pid)
        if not owner.dead:
            with contextlib.suppress(ActorDied):
                rt.send_message(owner, [P.ATTACH, self._id, pid], urgent=False)


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
        rt.proc(state[0], state[1])  # watch the receiver's process
    return port


register_handle("port", Port, _port_state, _port_from_state)


class PortReceiver(Generic[T]):
    """The receiving end of a channel; lives in the process that opened it."""

    def __init__(self, rt: Runtime, state: _ReceiverState, type_ref: str | None) -> None:
        self._rt = rt
        self._state = state
        self._type = type_ref

    def recv(self) -> Future[T]:
        """The next message (``None`` at end of stream).

        Raises :class:`PortClosed` when nothing is queued and every other
        process that held a sender for this port has exited.
        """
        return _Recv(self)

    def _wait(self) -> Generator[Any, None, T]:
        state = self._state
        queue = state.queue
        if not queue:
            loop = self._rt.ensure_loop()
            while not queue:
                self._check_open()
                waiter = loop.create_future()
                state.waiter = waiter
                try:
                    yield from waiter.__await__()
                finally:
                    state.waiter = None
        return self._take()  # type: ignore[no-any-return]

    def _recv_sync(self, timeout: float | None) -> T:
        state = self._state

        def ready() -> bool:
            if not state.queue:
                self._check_open()
                return False
            return True

        self._rt.wait(ready, timeout=timeout, what=f"a message on port {state.port_id}")
        return self._take()  # type: ignore[no-any-return]

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
        value, address, size = state.queue.popleft()
        if address is not None:
            unacked = state.unacked.get(address)
            if unacked is None:
                unacked = state.unacked[address] = [0, 0]
            unacked[0] += 1
            unacked[1] += size
            if unacked[0] >= PORT_WINDOW // 4 or unacked[1] >= PORT_WINDOW_BYTES // 4:
                _send_credit(self._rt, address, state.port_id, unacked[0], unacked[1])
                unacked[0] = unacked[1] = 0
        if state.once:
            state.closed = "a once-port delivers a single message"
            self._rt.receivers.pop(state.port_id, None)
        return value

    def qsize(self) -> int:
        """Messages waiting to be received."""
        return len(self._state.queue)

    @property
    def senders_alive(self) -> bool:
        """False once every other process that held a sender has exited."""
        return not self._state.senders_gone()

    def close(self) -> None:
        """Stop receiving: later messages to this port are refused with a log."""
        state = self._state
        state.closed = "the receiver was closed"
        self._rt.receivers.pop(state.port_id, None)
        state._wake()


class _Recv(Future[T]):
    """``PortReceiver.recv()``: returns at once, without a coroutine, when a message is queued."""

    __slots__ = ("_receiver",)

    def __init__(self, receiver: PortReceiver[T]) -> None:
        self._receiver = receiver
        self._make = self._coroutine
        self._wait_sync = receiver._recv_sync
        self._done = False
        self._value = None
        self._error = None

    async def _coroutine(self) -> T:
        return await self

    def __await__(self) -> Generator[Any, None, T]:
        if self._done:
            return self._result()
        receiver = self._receiver
        try:
            if receiver._state.queue:
                value = receiver._take()
            else:
                value = yield from receiver._wait()
        except PortClosed as exc:
            self._done, self._error = True, exc
            raise
        self._done, self._value = True, value
        return value  # type: ignore[no-any-return]


class Channel(Generic[T]):
    """Opens ports: ``port, receiver = Channel.open(T)``."""

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
        port_id = rt.new_port_id()
        state = _ReceiverState(port_id, once)
        rt.receivers[port_id] = state
        return Port(rt.address, rt.pid, port_id, ref, once), PortReceiver(rt, state, ref)
