"""The actors a worker hosts: one :class:`ActorSlot` each, in the server's :class:`SlotTable`."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from .._runtime._actor_host import Stoppable
from .._runtime._context import ActorContext
from .._shared._liveness import ProcRef
from .._shared._names import shown
from .._wire._records import Call, ErrorRecord
from ._actor import Endpoint
from ._invocation import Invocation

__all__ = ["ActorSlot", "SlotTable"]


@dataclass
class ActorSlot:
    """One actor hosted in this process."""

    name: str
    rank: int
    extent: dict[str, int]
    class_ref: str = ""
    instance: Any = None
    error: ErrorRecord | None = None
    endpoints: dict[str, Endpoint[Any, Any]] = field(default_factory=dict)
    tasks: set[asyncio.Task[Any]] = field(default_factory=set)
    backlog: list[Invocation] = field(default_factory=list)
    stopping: bool = False
    #: The one run of its stop (``__cleanup__``, its calls, its children), once begun.
    stop_task: asyncio.Task[None] | None = None
    #: Who spawned it: its failures are reported there (as in Monarch; None: this process's owner).
    supervisor: ProcRef | None = None
    #: What it spawned (proc meshes, actor meshes on proc meshes it was given): stopped when it stops.
    children: list[Stoppable] = field(default_factory=list)
    #: A synchronous actor's own thread: its ``def`` endpoints run there, one message at a time.
    thread: ThreadPoolExecutor | None = None
    #: Whether its ``__cleanup__`` was started: it runs once, whichever of its stop and the end of its
    #: construction (a stop that came while a synchronous actor's constructor ran) reaches it first.
    cleaned: bool = False

    @property
    def context(self) -> ActorContext:
        return ActorContext(self.name, self.rank, self.extent, self.class_ref)

    def context_for(self, call: Call) -> ActorContext:
        """The context ``call`` runs in: its place in the mesh it came through (Monarch's ``message_rank``)."""
        if call.extent is None:  # (through the actors' own mesh)
            return ActorContext(self.name, self.rank, self.extent, self.class_ref, method=call.method)
        return ActorContext(self.name, self.rank, self.extent, self.class_ref, call.position, call.method, call.extent)

    def run_sync(self, loop: asyncio.AbstractEventLoop, call: Callable[[], Any]) -> Coroutine[Any, Any, Any]:
        """Run ``call`` on this actor's own thread, after the calls queued before it (queued now; await it)."""
        if self.thread is None:
            self.thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"actor-{shown(self.name)}")
        return _as_raised(loop.run_in_executor(self.thread, contextvars.copy_context().run, _carried, call))

    def track(self, task: asyncio.Task[Any]) -> None:
        """``task`` runs for this actor: it is cancelled when the actor stops."""
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def close(self) -> None:
        """Shut its thread down (a later :meth:`run_sync`, a late cleanup's, starts another)."""
        thread, self.thread = self.thread, None
        if thread is not None:
            thread.shutdown(wait=False, cancel_futures=True)


class SlotTable:
    """The actors of this process by name, those whose stop is under way, the calls waiting for actors not spawned
    yet, and the names stopped."""

    __slots__ = ("actors", "leaving", "stopped", "waiting")

    def __init__(self) -> None:
        self.actors: dict[str, ActorSlot] = {}
        #: Calls that arrived before their actor's spawn, by actor name.
        self.waiting: dict[str, list[Invocation]] = {}
        #: Actors stopped here: later calls to them are refused, not kept waiting.
        self.stopped: set[str] = set()
        #: Actors stopped by name whose stop is under way: they take no call, but what they spawned still
        #: reports to them until their stop ends (a later stop of the name waits for it).
        self.leaving: dict[str, ActorSlot] = {}

    def get(self, name: str) -> ActorSlot | None:
        return self.actors.get(name)

    def find(self, name: str) -> ActorSlot | None:
        """The actor ``name`` hosted here, else the one of that name whose stop is under way."""
        slot = self.actors.get(name)
        return slot if slot is not None else self.leaving.get(name)

    def hosted(self) -> list[tuple[str, int]]:
        """Each hosted actor's name (as shown) and rank, for the process title and its output's prefix."""
        return [(shown(name), slot.rank) for name, slot in self.actors.items()]


class _Carried(Exception):
    """What a call on the actor's thread raised that asyncio cannot carry back as it is."""

    def __init__(self, exc: BaseException) -> None:
        super().__init__()
        self.exc = exc


def _carried(call: Callable[[], Any]) -> Any:
    """``call()``; ``StopIteration`` (which an asyncio future refuses: the call would never end) and
    ``concurrent.futures.CancelledError`` (which asyncio turns into its own cancel) are carried as they are."""
    try:
        return call()
    except (StopIteration, concurrent.futures.CancelledError) as exc:
        raise _Carried(exc) from None


async def _as_raised(future: asyncio.Future[Any]) -> Any:
    """The result of a :func:`_carried` call, raising what it raised (``StopIteration`` as a coroutine does: a
    ``RuntimeError`` caused by it, the same as from an ``async`` endpoint)."""
    try:
        return await future
    except _Carried as carried:
        raise carried.exc from None
