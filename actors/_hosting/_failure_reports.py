"""How a worker answers calls that failed and tells supervisors of failures.

A call that never ran (no such actor or endpoint, bad arguments) gets an
error reply, or, fire-and-forget, is dropped with a rate-limited log. A call
that ran and raised gets an error reply, or, fire-and-forget, is reported as
a failure of its actor to that actor's supervisor: whoever spawned it, else
this process's owner (as in Monarch). A fire-and-forget call sent with a port
is answered there with its error either way, and its actor lives on.
"""

from __future__ import annotations

import logging
import os

from .._runtime._core import Runtime
from .._shared._errors import ActorDied
from .._shared._liveness import ProcRef
from .._shared._names import shown
from .._wire._records import ErrorRecord, FailureReport
from ._invocation import Invocation
from ._slots import ActorSlot, SlotTable

__all__ = ["FailureReports"]

log = logging.getLogger("actors")


class FailureReports:
    """Error replies for failed calls, and failure reports to each actor's supervisor."""

    def __init__(self, rt: Runtime, slots: SlotTable, owner: ProcRef) -> None:
        self._rt = rt
        self._slots = slots
        self._owner = owner

    def refuse(self, inv: Invocation, record: ErrorRecord) -> None:
        """A call that never ran: an error reply (or to its port); fire-and-forget, a bad message, never an actor
        failure."""
        if not inv.answer_error(self._rt, record, inv.call.rank):
            call = inv.call
            self._rt.drops(
                "a fire-and-forget call to %s.%s: %s: %s",
                shown(call.actor),
                call.method,
                record.type_name,
                record.message,
            )

    def fail(self, slot: ActorSlot | None, inv: Invocation, record: ErrorRecord, report: bool = True) -> None:
        """A call that raised: an error reply (or to the port it was sent with: its actor lives on, as in
        Monarch); fire-and-forget, a failure of its actor (unless ``report`` is false)."""
        call = inv.call
        rank = slot.rank if slot is not None else call.rank
        if inv.answer_error(self._rt, record, rank) or not report:
            return
        log.error(
            "fire-and-forget call %s[%d].%s failed: %s: %s\n%s",
            shown(call.actor),
            rank,
            call.method,
            record.type_name,
            record.message,
            record.traceback.rstrip(),
        )
        self.report(call.actor, rank, call.method, record)

    def report(self, actor: str, rank: int, method: str, record: ErrorRecord) -> None:
        """Send a failure of ``actor`` to its supervisor: whoever spawned it, else this process's owner."""
        failure = FailureReport(
            actor=actor,
            rank=rank,
            pid=os.getpid(),
            endpoint=method,
            exception_type=record.type_name,
            message=record.message,
            traceback=record.traceback,
        )
        slot = self._slots.find(actor)
        supervisor = slot.supervisor if slot is not None and slot.supervisor is not None else self._owner
        if supervisor.dead:
            supervisor = self._owner
        if not supervisor.dead:
            try:
                self._rt.send(supervisor, failure, urgent=True)
            except ActorDied:
                pass
            except Exception:
                log.exception("could not report a failure to the owner")
