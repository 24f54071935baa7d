"""Calls in flight: the replies a caller still expects, and remote error records.

A call to N actors is one :class:`PendingCall` keyed by its call id; it is
done at the last reply, at the first error, or when a target process dies.
An error crosses the wire as ``[type_name, message, traceback, spawn_failed]``
and becomes an :class:`ActorError` (or :class:`SpawnError`) at the caller.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

from ._errors import ActorError, SpawnError
from ._liveness import ProcRef


class PendingCall:
    """Replies expected for one call, by rank; done at the last reply or first error."""

    __slots__ = (
        "actor",
        "call_id",
        "callbacks",
        "deadline",
        "done",
        "error",
        "method",
        "procs",
        "remaining",
        "results",
        "timeout",
        "waiters",
    )

    def __init__(
        self, call_id: int, actor: str, procs: dict[int, ProcRef], method: str = "", timeout: float | None = None
    ) -> None:
        self.call_id = call_id
        self.actor = actor
        self.method = method
        self.timeout = timeout
        #: ``time.monotonic()`` after which a waiting caller gets CallTimeout (None: no deadline).
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.procs = procs
        self.remaining = set(procs)
        self.results: dict[int, Any] = {}
        self.error: BaseException | None = None
        self.done = not procs
        self.waiters: list[asyncio.Future[None]] = []
        #: Run once when the call is done (e.g. a restart's re-spawn reporting a failed constructor).
        self.callbacks: list[Callable[[PendingCall], None]] = []

    def deliver(self, rank: int, ok: bool, value: Any) -> None:
        if self.done or rank not in self.remaining:
            return
        if ok:
            self.results[rank] = value
            self.remaining.discard(rank)
            if not self.remaining:
                self.finish()
        else:
            self.fail(error_from_record(value, self.actor, rank))

    def fail(self, error: BaseException) -> None:
        if not self.done:
            self.error = error
            self.finish()

    def finish(self) -> None:
        self.done = True
        for waiter in self.waiters:
            if not waiter.done():
                with contextlib.suppress(RuntimeError):  # its loop may be closed
                    waiter.set_result(None)
        self.waiters.clear()
        callbacks, self.callbacks = self.callbacks, []
        for callback in callbacks:
            callback(self)


def error_record(exc: BaseException, tb: str, spawn_failed: bool = False) -> list[Any]:
    if isinstance(exc, ActorError):
        return [exc.exception_type, exc.message, exc.remote_traceback or tb, spawn_failed]
    cls = type(exc)
    name = cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"
    return [name, str(exc), tb, spawn_failed]


def error_from_record(record: Any, actor: str, rank: int | None) -> ActorError:
    if type(record) is not list or len(record) != 4:
        return ActorError("DecodeError", f"malformed error record {record!r:.80}", actor=actor, rank=rank)
    etype, message, tb, spawn_failed = record
    cls = SpawnError if spawn_failed else ActorError
    return cls(str(etype), str(message), str(tb), actor=actor, rank=rank)
