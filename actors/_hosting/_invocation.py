"""One endpoint call inside a worker: its arguments, running it, and where its answer goes.

The answer of a call that wants a reply is a :class:`~actors._wire._records.Reply`
to the caller; a fire-and-forget call with a port sends its result, or its
error, there; otherwise the result is dropped and a failure is reported to
the actor's supervisor (see ``FailureReports``).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .._runtime._port import send_error
from .._runtime._port_error import PortError
from .._shared._errors import ActorDied, DecodeError, PortClosed
from .._wire._records import Call, ErrorRecord, Reply

if TYPE_CHECKING:
    from .._runtime._core import Runtime

__all__ = ["Invocation"]

log = logging.getLogger("actors")


@dataclass
class Invocation:
    """A received :class:`Call` and its buffer frames."""

    call: Call
    frames: list[Any]

    @property
    def wants_reply(self) -> bool:
        return self.call.call_id != 0

    def arguments(self, rt: Runtime) -> tuple[list[Any], dict[str, Any]]:
        """Decode the call's ``[args, kwargs]``, refusing anything of another shape."""
        decoded = rt.inbox.decoder.decode(self.call.args, self.frames)
        if (
            type(decoded) is not list
            or len(decoded) != 2
            or type(decoded[0]) is not list
            or type(decoded[1]) is not dict
            or not all(type(key) is str for key in decoded[1])
        ):
            raise DecodeError("call arguments must be [list, dict with string keys]")
        return decoded[0], decoded[1]

    def reply(self, rt: Runtime, ok: bool, value: Any) -> None:
        """Answer the caller (a no-op for a fire-and-forget call or a caller that has gone)."""
        call = self.call
        if not call.call_id:
            return
        ref = rt.registry.proc(call.reply_to, call.reply_pid)
        if ref.dead or (not ref.remote and ref.pid is not None and ref.pid != call.reply_pid):
            # (the caller has gone; or it was restarted at its address meanwhile: call ids start again at 1 in
            # the new process, whose own call of this id and rank would take this answer for its own)
            return
        with contextlib.suppress(ActorDied):
            # (owed: queued past the link's limits, which the caller's own calls bound, never refused as BufferFull)
            try:
                rt.send(ref, Reply(call.call_id, call.rank, ok, value), urgent=True, owed=True)
            except Exception as exc:  # refused by the codec, or raised by the value's own pickling code
                message = f"the endpoint's return value could not be sent: {exc}"
                record = ErrorRecord.of(exc)._replace(message=message)
                rt.send(ref, Reply(call.call_id, call.rank, False, record), urgent=True, owed=True)

    def deliver_result(self, value: Any) -> None:
        """A fire-and-forget call with a port: the result goes to that port, or why it could not (a value of
        another type than the port's, one the codec refuses, a full port), so its receiver does not wait for good."""
        call = self.call
        port = call.port
        if port is None:
            return
        try:
            port.send(value)
        except PortClosed:  # (its receiver has gone: nobody waits)
            return
        except Exception as exc:
            record = ErrorRecord.of(exc)._replace(message=f"the endpoint's result could not be sent to its port: {exc}")
            try:
                send_error(port, PortError(record, call.actor, call.rank, call.method))
            except Exception:
                log.exception("could not send the result of %s.%s to its port", call.actor, call.method)

    def answer_error(self, rt: Runtime, record: ErrorRecord, rank: int) -> bool:
        """Tell whoever waits on this call that it failed: its caller, else the port it was sent with (as in
        Monarch, whose ``send(..., port=p)`` hands ``p`` the error). False if nobody waits (fire-and-forget)."""
        call = self.call
        if call.call_id:
            self.reply(rt, False, record)
            return True
        port = call.port
        if port is None:
            return False
        try:
            send_error(port, PortError(record, call.actor, rank, call.method))
        except Exception:
            log.exception("could not send the failure of %s.%s to its port", call.actor, call.method)
        return True
