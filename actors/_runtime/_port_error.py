"""An error in a port's stream: what ``Port.exception(exc)`` sends, and what a receive of it raises.

It travels as a handle of its own kind (``port-error``), in the place of a
value, so it keeps its place in the sender's order and takes window credit
like any message; a receive that meets it raises :class:`~actors.ActorError`
naming the actor and endpoint that sent it (when an actor did).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from .._shared._errors import ActorsError, DecodeError
from .._wire._codec import register_handle
from .._wire._records import ErrorRecord

__all__ = ["PortError"]


class PortError(NamedTuple):
    """``record`` raised by ``method`` of actor ``actor`` (rank ``rank``), or outside any actor (empty names)."""

    record: ErrorRecord
    actor: str = ""
    rank: int | None = None
    method: str = ""

    def to_error(self) -> ActorsError:
        return self.record.to_error(self.actor, self.rank, self.method)


def _state(error: PortError) -> list[Any]:
    return [error.record.to_wire(), error.actor, error.rank, error.method]


def _from_state(state: Any) -> PortError:
    if (
        type(state) is not list
        or len(state) != 4
        or type(state[1]) is not str
        or not (state[2] is None or type(state[2]) is int)
        or type(state[3]) is not str
    ):
        raise DecodeError("malformed port error")
    return PortError(ErrorRecord.from_wire(state[0]), state[1], state[2], state[3])


register_handle("port-error", PortError, _state, _from_state)
