"""The actor server of a worker process: the parts that host its actors, put together, and its process calls.

Calls arrive as :class:`~actors._wire._records.Call` records. Those to the
reserved actor :data:`~actors._wire._records.PROCESS_ACTOR` spawn and stop
actors and are handled here; every other call goes to the
:class:`~._dispatch.CallDispatcher`. The server is the worker's
:class:`~actors._runtime._core.ActorHost`: the layers above reach its
actors' lifecycle and supervision through it::

    Call ──► ActorServer ──► CallDispatcher (runs calls on their actors)
                 │                 │
                 ├──► Lifecycle (spawn, fail, stop, the worker's end)
                 ├──► ChildSupervision (``__supervise__`` of what an actor spawned)
                 └──► FailureReports (error replies, reports to supervisors)
                       all over one SlotTable (the hosted actors)
"""

from __future__ import annotations

import asyncio
import logging
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .._runtime._actor_host import Stoppable
from .._runtime._core import Runtime
from .._shared._config import WorkerConfig
from .._shared._errors import DecodeError
from .._shared._liveness import ProcRef
from .._shared._names import shown
from .._wire._records import PROCESS_ACTOR, Call, ErrorRecord, Header
from ._child_supervision import ChildSupervision
from ._dispatch import CallDispatcher
from ._failure_reports import FailureReports
from ._invocation import Invocation
from ._lifecycle import CLEANUP_TIMEOUT, Lifecycle
from ._output import ProcessOutput
from ._slots import SlotTable

if TYPE_CHECKING:
    from .._runtime._supervision import Failure

__all__ = ["CLEANUP_TIMEOUT", "ActorServer"]

log = logging.getLogger("actors")


class ActorServer:
    """Serves the actors of this worker process."""

    def __init__(
        self, rt: Runtime, config: WorkerConfig, retitle: Callable[[list[tuple[str, int]]], None], output: ProcessOutput
    ) -> None:
        self.rt = rt
        self.config = config
        #: Where this process's stdout and stderr lines go (``log_option`` redirects them).
        self.output = output
        #: The process that spawned this one: the worker ends when it does.
        self.owner = rt.registry.proc(config.owner_address, config.owner_pid)
        self.slots = SlotTable()
        self.reports = FailureReports(rt, self.slots, self.owner)
        self.lifecycle = Lifecycle(rt, self.slots, self.reports, retitle)
        self.loop: asyncio.AbstractEventLoop = self.lifecycle.loop
        self.dispatcher = CallDispatcher(rt, self.slots, self.reports, self.lifecycle)
        self.children = ChildSupervision(self.slots, self.reports, self.lifecycle)
        rt.inbox.on(Call, self.on_call)
        rt.registry.deaths.connect(self._on_death)
        rt.host(self)

    @property
    def finished(self) -> asyncio.Event:
        """Set once every actor has stopped and the worker may exit."""
        return self.lifecycle.finished

    def on_call(self, call: Call, frames: list[Any], sender: Header, size: int) -> None:
        if call.reply_to != sender.address or call.reply_pid != sender.pid:
            # The runtime only ever sends calls answered at its own inbox: any other reply address is forged (and
            # may be one zmq cannot parse, or another peer's, which would hear of a stop it never asked for).
            raise DecodeError(
                f"a call whose reply address {call.reply_to!r:.80} (pid {call.reply_pid}) is not its sender's"
            )
        inv = Invocation(call, frames)
        if call.actor == PROCESS_ACTOR:
            self.lifecycle.background(self._process_call(inv))
        else:
            self.dispatcher.dispatch(inv)

    async def _process_call(self, inv: Invocation) -> None:
        method = inv.call.method
        lifecycle = self.lifecycle
        try:
            args, _kwargs = inv.arguments(self.rt)
            if method == "spawn":
                self.dispatcher.replay(await lifecycle.spawn(inv, *args))
                return  # the spawn answers for itself
            if method == "stop_actor":
                await lifecycle.stop_actor(*args)
            elif method == "stop":
                await lifecycle.stop_all(*args)
            elif method == "log_option":
                port, level = args
                logging.getLogger().setLevel(level)
                self.output.forward_to(port)
            elif method != "ping":
                raise AttributeError(f"unknown process operation {method!r}")
        except BaseException as exc:
            self.reports.fail(None, inv, ErrorRecord.of(exc, traceback.format_exc(), spawn_failed=method == "spawn"))
            if method == "stop":  # a stop that failed part-way still ends the worker (it ignores SIGTERM by now)
                self.rt.outbox.flush_all()
                lifecycle.finished.set()
            return
        inv.reply(self.rt, True, None)
        if method == "stop":
            self.rt.outbox.flush_all()
            lifecycle.finished.set()

    def _on_death(self, ref: ProcRef) -> None:
        if ref is self.owner:
            self.shutdown("the owning process exited")
            return
        # Actors another process spawned here (on a mesh it was handed) stop when that process is gone,
        # as they would have had it stopped in order; the process itself stays with its owner.
        for name, slot in list(self.slots.actors.items()):
            if slot.supervisor is ref and not slot.stopping:
                log.info("stopping actor %s[%d]: the process that spawned it exited", shown(name), slot.rank)
                self.lifecycle.background(self.lifecycle.stop_actor(name))

    # ---------------------------------------------------------- ActorHost: what the layers above use

    def shutdown(self, reason: str) -> None:
        """Stop every actor quickly and end the process (SIGTERM, owner death)."""
        self.lifecycle.shutdown(reason)

    def abort(self, actor: str, reason: str) -> None:
        """``Instance.abort``: fail ``actor`` with ``reason``."""
        self.lifecycle.abort(actor, reason)

    def adopt(self, actor: str, child: Stoppable) -> None:
        """``actor`` spawned ``child`` (a proc or actor mesh): it stops with the actor."""
        self.lifecycle.adopt(actor, child)

    def disown(self, actor: str, child: Stoppable) -> None:
        """``child``, which ``actor`` spawned, has stopped: the actor no longer holds it."""
        self.lifecycle.disown(actor, child)

    def stop_last(self, child: Stoppable) -> None:
        """``child`` (this worker's controllers) stops when the worker stops, after its actors."""
        self.lifecycle.stop_last(child)

    def supervise(self, actor: str, failure: Failure, handled: bool = False) -> bool:
        """Offer ``failure`` to ``actor``'s ``__supervise__``; True if handled (``handled``: already, elsewhere)."""
        return self.children.supervise(actor, failure, handled)

    def escalate(self, actor: str, failure: Failure, raised: BaseException | None = None) -> None:
        """A failure of what ``actor`` spawned went unhandled: ``actor`` fails."""
        self.children.escalate(actor, failure, raised)
