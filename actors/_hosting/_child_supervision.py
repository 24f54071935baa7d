"""An actor as the supervisor of what it spawned: its ``__supervise__`` is offered their failures.

An ``async def __supervise__`` runs as a task on this loop, and a
synchronous actor's ``def __supervise__`` on that actor's own thread, in
turn with its endpoints; until it answers the failure counts as handled,
and a false answer escalates it then. A ``__supervise__`` that raises, or a failure left unhandled, fails
the supervising actor itself (as in Monarch).
"""

from __future__ import annotations

import functools
import inspect
import logging
from typing import TYPE_CHECKING

from .._runtime._context import actor_context
from .._shared._errors import SupervisionError, actor_failed
from .._shared._names import shown
from .._wire._records import SUPERVISION, ErrorRecord
from ._actor import is_sync_actor
from ._failure_reports import FailureReports
from ._lifecycle import Lifecycle
from ._slots import SlotTable

if TYPE_CHECKING:
    from .._runtime._supervision import Failure

__all__ = ["ChildSupervision"]

log = logging.getLogger("actors")


class ChildSupervision:
    """Offers failures of spawned meshes to the spawning actor's ``__supervise__``, and escalates what it leaves."""

    def __init__(self, slots: SlotTable, reports: FailureReports, lifecycle: Lifecycle) -> None:
        self._slots = slots
        self._reports = reports
        self._lifecycle = lifecycle

    def supervise(self, actor: str, failure: Failure, handled: bool = False) -> bool:
        """Offer ``failure`` to the ``__supervise__`` of ``actor`` (hosted here); True if handled (or pending).

        ``handled``: a restart or a handler handled it already (or its mesh is
        stopping): a false answer then escalates nothing, whenever it comes.
        """
        slot = self._slots.find(actor)
        if slot is None or slot.instance is None:
            return False
        if slot.stopping:  # its stop stops what it spawned: a failure there meanwhile is part of that stop
            log.info("%s of %s, which is stopping, taken as handled", failure, shown(actor))
            return True
        token = actor_context.set(slot.context)
        try:
            hook = slot.instance.__supervise__
            if is_sync_actor(type(slot.instance)) and not inspect.iscoroutinefunction(hook):
                # a synchronous actor's: on its own thread, after the calls queued there (never beside one)
                verdict = slot.run_sync(self._lifecycle.loop, functools.partial(hook, failure))
            else:
                verdict = hook(failure)
        except BaseException as exc:  # (SystemExit too: the hook's failure, never raised into the mesh supervisor)
            self.escalate(actor, failure, exc)
            return True
        finally:
            actor_context.reset(token)
        if not inspect.isawaitable(verdict):
            return bool(verdict)

        async def settle() -> None:
            try:
                verdict_handled = bool(await verdict)
            except BaseException as exc:  # a CancelledError it raised itself, too, unless the actor is stopping
                if not slot.stopping:
                    self.escalate(actor, failure, exc)
                return
            if not (verdict_handled or handled or slot.stopping):  # (stopping meanwhile: as above)
                self.escalate(actor, failure)

        token = actor_context.set(slot.context)
        try:
            task = self._lifecycle.loop.create_task(settle())
        finally:
            actor_context.reset(token)
        slot.track(task)
        return True

    def escalate(self, actor: str, failure: Failure, raised: BaseException | None = None) -> None:
        """A failure of what ``actor`` spawned went unhandled (or its ``__supervise__`` raised): ``actor`` fails."""
        if raised is not None:
            cause = f"__supervise__ raised {type(raised).__name__}: {raised} while handling {failure}"
        else:
            cause = f"__supervise__ left a failure of an actor it spawned unhandled: {failure}"
        record = ErrorRecord(SUPERVISION, cause, failure.traceback)
        slot = self._slots.get(actor)
        if slot is None:  # already gone: its owner still hears of it
            self._reports.report(actor, 0, "__supervise__", record)
            return
        exc = SupervisionError(actor_failed(actor, slot.rank, cause, slot.class_ref))
        self._lifecycle.kill(slot, "__supervise__", cause, record, exc)
