"""Sending calls: the arguments encoded once, one :class:`~actors._wire._records.Call` per target, on the wire now.

Every way of invoking an endpoint (``call``, ``call_one``, ``choose``,
``broadcast``, ``send``) and every process operation (spawn, stop) goes
through :func:`send_call`; :func:`pending_future` turns the pending call
into the :class:`~actors.Future` the caller awaits.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

from .._shared._errors import ActorDied, CallTimeout
from .._shared._liveness import ProcRef
from .._transport._driver import Driver
from .._wire._records import Call
from ._core import Runtime
from ._future import Future
from ._pending_calls import PendingCall

__all__ = ["Through", "pending_future", "send_call"]

R = TypeVar("R")

#: ``(args_blob, frames, handles)`` of arguments already encoded.
Encoded = tuple[bytes, list[Any], list[Any]]
#: ``(extent, positions)``: the shape of the mesh a call goes through, and each target's index in it.
Through = tuple[dict[str, int], list[int]]


def encode_arguments(rt: Runtime, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Encoded:
    enc = rt.encoder_now()
    enc.reset()
    blob = enc.encode([list(args), kwargs])
    return blob, enc.frames, enc.handles


def send_call(
    rt: Runtime,
    targets: list[tuple[int, ProcRef]],
    actor: str,
    method: str,
    encoded: Encoded,
    *,
    want_reply: bool,
    port: Any = None,
    timeout: float | None = None,
    class_ref: str = "",
    past_limits: bool = False,
    through: Through | None = None,
) -> PendingCall | None:
    """Put one call per ``(rank, process)`` on the wire; the pending call if a reply is wanted.

    ``through``: the mesh the call goes through (a slice, a flattening) and each target's position in it, which
    the target reads as ``context().message_rank`` (default: its own rank in its own mesh).

    A dead target fails the call at once with :class:`ActorDied` (raised
    for a fire-and-forget call), and a target whose link is full with
    :class:`BufferFull`, both before any rank was sent the call.
    ``past_limits``: queued even on a full link (a process's stop, which
    must reach a worker with a backlog, and precede the kill of one that
    reads nothing).
    """
    blob, frames, handles = encoded
    actor = str(actor)  # a mesh's name is a str subclass (awaitable): a plain str keeps the encoder's fast path
    pending = rt.calls.open(actor, method, targets, timeout, class_ref) if want_reply else None
    call_id = pending.call_id if pending is not None else 0
    enc = rt.encoder_now()
    try:
        links = []
        for rank, ref in targets:  # all or nothing: no rank runs a call its caller was told failed
            if ref.dead and not rt.registry.alive(ref):
                error = ActorDied.of(actor, rank, ref.pid, ref.exit_reason, method, class_ref)
                if pending is None:
                    raise error
                pending.fail(error)
                return pending
            links.append(rt.link(ref))
            if not past_limits:
                rt.outbox.check_room(links[-1])
        extent, positions = through if through is not None else (None, [rank for rank, _ in targets])
        calls = []
        for (rank, _), position in zip(targets, positions, strict=True):
            enc.reset()
            call = Call(call_id, actor, method, rt.address, rt.pid, rank, blob, port, position, extent)
            calls.append((enc.encode(call.to_wire()), list(enc.handles)))
        if not past_limits:  # room in each batch too (one past a receiver's payload limit leaves first, or fails all)
            for link, (data, _) in zip(links, calls, strict=True):
                rt.outbox.check_room(link, len(data))
        for (_, ref), link, (data, shipped) in zip(targets, links, calls, strict=True):
            if handles or shipped:
                rt.note_handles([*handles, *shipped], ref)
            rt.outbox.post(link, data, frames, urgent=True, owed=past_limits)
    except BaseException as exc:  # (BufferFull from a link whose peer is not reading): the caller hears it
        if pending is not None:
            pending.fail(exc)  # and the call table forgets the call; a rank already sent to answers no one
        raise
    return pending


def pending_future(rt: Runtime, pending: PendingCall, build: Callable[[dict[int, Any]], R], what: str) -> Future[R]:
    """A :class:`Future` over ``pending``: awaitable, or ``get()`` from code without a loop."""

    async def wait() -> R:
        rt.driver.ensure_loop()  # replies reach this loop
        return build(await pending.wait())

    def wait_sync(timeout: float | None) -> R:
        limit = timeout
        if pending.deadline is not None:
            left = max(0.0, pending.deadline - time.monotonic())
            limit = left if timeout is None else min(timeout, left)
        driver = rt.driver
        try:
            if driver.on_runtime_thread():
                driver.wait(lambda: pending.done, timeout=limit, what=what)
            elif not _wait_served(driver, pending, limit, what):  # the loop of another thread serves the reply
                raise CallTimeout(f"gave up after {limit:.1f}s waiting for {what}")
        except CallTimeout:
            if pending.deadline is None or time.monotonic() < pending.deadline:
                raise  # the caller's own get(timeout) ran out; the call itself may still finish
            driver.on_thread(pending.expire)
        if pending.error is not None:
            raise pending.error
        return build(pending.results)

    return Future(wait, wait_sync, any_thread=True)


def _wait_served(driver: Driver, pending: PendingCall, limit: float | None, what: str) -> bool:
    """Wait on this thread while another thread's loop reads ``pending``'s reply; False at ``limit``.

    Should that loop stop driving the runtime meanwhile (it stopped, closed,
    or handed the runtime over), the wait follows the runtime to whatever
    drives it next: nothing would read the reply otherwise.
    """
    started = time.monotonic()
    served = driver.wait_while_driven(driver.loop, pending.arrival().wait, limit)
    if served is not None:
        return served or pending.done
    left = None if limit is None else max(0.0, limit - (time.monotonic() - started))
    try:
        driver.wait(lambda: pending.done, timeout=left, what=what)
    except CallTimeout:
        return pending.done
    return True
