"""The records that travel between processes: one named type per kind, its encoding beside it.

A ZeroMQ message is ``[header][payload][buffer 0..n]``. The header is a
:class:`Header`. The payload is a batch: for each record, its buffer-frame
count and byte length (two msgpack uints, :func:`record_prefix`), then the
record itself, a msgpack array whose first item is its :class:`Kind`. A
record's tensors refer to its own run of buffer frames, so a record that
cannot be decoded is dropped alone.

=========  ==================================================================
kind       record
=========  ==================================================================
CALL       :class:`Call`: invoke ``actor.method`` (reply wanted if call_id)
REPLY      :class:`Reply`: the result, or an :class:`ErrorRecord`
PORT       :class:`PortMessage`: one value for a port (the hot path)
CREDIT     :class:`Credit`: flow-control window given back to a port's sender
ATTACH     :class:`Attach`: a process now holds a sender of a port
FAILURE    :class:`FailureReport`: a worker tells its owner an actor failed
LOST       :class:`ProcessLost`: an owner tells peers one of its processes died
RESTARTED  :class:`ProcessRestarted`: an owner tells peers where a replacement serves
=========  ==================================================================

``Call.args`` is itself an encoded ``[args, kwargs]``: it is decoded only once
the target actor exists, so its dataclasses are loaded by then. Spawning and
stopping actors are calls to the reserved actor :data:`PROCESS_ACTOR`.
Every ``from_wire`` checks arity and field types and raises
:class:`~actors.DecodeError`; nothing here trusts its input.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any, NamedTuple

import msgpack

from .._shared._errors import ActorError, ActorsError, DecodeError, SpawnError, SupervisionError
from ._brief import brief
from ._ext import handle_of_kind

__all__ = [
    "PROCESS_ACTOR",
    "PROTOCOL_VERSION",
    "RECORDS",
    "Attach",
    "Call",
    "Credit",
    "ErrorRecord",
    "FailureReport",
    "Header",
    "Kind",
    "PortMessage",
    "ProcessLost",
    "ProcessRestarted",
    "Reply",
    "decode_record",
    "port_prefix",
    "record_prefix",
]

PROTOCOL_VERSION = 3
#: The largest pid Linux hands out (its pid_max ceiling): a header claiming more is forged.
PID_MAX = 1 << 22
#: The actor name that addresses a process itself (spawn, stop_actor, stop).
PROCESS_ACTOR = "__process__"


class Kind(IntEnum):
    CALL = 1
    REPLY = 2
    PORT = 3
    CREDIT = 4
    ATTACH = 5
    FAILURE = 6
    LOST = 7
    RESTARTED = 8


_new_tuple = tuple.__new__


def _check(fields: Any, kind: Kind, arity: int) -> list[Any]:
    if type(fields) is not list or len(fields) != arity or not isinstance(fields[0], int) or fields[0] != kind:
        raise DecodeError(f"malformed {kind.name} record: {brief(fields)}")
    return fields


class Header(NamedTuple):
    """Who sent a ZeroMQ message: every record in it came from this process."""

    address: str
    pid: int

    def encode(self) -> bytes:
        return msgpack.packb([PROTOCOL_VERSION, self.address, self.pid])  # type: ignore[no-any-return]

    @classmethod
    def decode(cls, data: bytes) -> Header:
        if len(data) > 4096:
            raise DecodeError("oversized header")
        try:
            header = msgpack.unpackb(data, raw=False)
        except (ValueError, msgpack.UnpackException) as exc:
            raise DecodeError(f"undecodable header: {exc}") from None
        if type(header) is list and header and type(header[0]) is int and header[0] != PROTOCOL_VERSION:
            raise DecodeError(
                f"a header of protocol version {header[0]}; this process speaks {PROTOCOL_VERSION} "
                "(is the sender running another version of the package?)"
            )
        if (
            type(header) is not list
            or len(header) != 3
            or header[0] != PROTOCOL_VERSION
            or type(header[1]) is not str
            or type(header[2]) is not int
            or not 0 < header[2] <= PID_MAX
        ):
            raise DecodeError(f"bad header {brief(header)}")
        return cls(header[1], header[2])


#: The ``type_name`` of an error reply the caller raises as :class:`SupervisionError` (a stopped
#: actor; an explicit-response-port endpoint that raised instead of answering).
SUPERVISION = "SupervisionError"


class ErrorRecord(NamedTuple):
    """An exception as it crosses the wire; becomes :class:`ActorError` (or :class:`SpawnError`)."""

    type_name: str
    message: str
    traceback: str = ""
    spawn_failed: bool = False

    @classmethod
    def of(cls, exc: BaseException, tb: str = "", spawn_failed: bool = False) -> ErrorRecord:
        if isinstance(exc, ActorError):
            return cls(exc.exception_type, exc.message, exc.remote_traceback or tb, spawn_failed)
        kind = type(exc)
        name = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
        try:
            message = str(exc)
        except Exception as failure:  # (its __str__ raised: the call is answered all the same)
            message = f"<unprintable {kind.__qualname__}: its str() raised {type(failure).__name__}>"
        return cls(name, message, tb, spawn_failed)

    def to_error(self, actor: str, rank: int | None, method: str = "") -> ActorsError:
        if self.type_name == SUPERVISION:
            return SupervisionError(self.message)
        if self.spawn_failed:
            return SpawnError(self.type_name, self.message, self.traceback, actor=actor, rank=rank)
        return ActorError(self.type_name, self.message, self.traceback, actor=actor, rank=rank, method=method)

    def to_wire(self) -> list[Any]:
        return list(self)

    @classmethod
    def from_wire(cls, value: Any) -> ErrorRecord:
        if (
            type(value) is not list
            or len(value) != 4
            or type(value[0]) is not str
            or type(value[1]) is not str
            or type(value[2]) is not str
            or type(value[3]) is not bool
        ):
            return cls("DecodeError", f"malformed error record {brief(value)}")
        return cls(*value)


class Call(NamedTuple):
    """Invoke ``actor.method`` with encoded ``args``; ``call_id`` 0 wants no reply.

    ``extent`` is the shape of the mesh the call was sent through (a slice of the actors' mesh, or a flattening)
    and ``position`` the target's index in it: Monarch's ``message_rank``. None: the actors' own mesh
    (``position`` is then ``rank``), as for calls to the :data:`PROCESS_ACTOR`.
    """

    call_id: int
    actor: str
    method: str
    reply_to: str  # the caller's inbox address
    reply_pid: int
    rank: int  # the target's rank in its mesh (the reply's)
    args: bytes  # encoded [args, kwargs]
    port: Any  # a Port that receives the result (fire-and-forget with a port), or None
    position: int = 0
    extent: dict[str, int] | None = None

    def to_wire(self) -> list[Any]:
        return [Kind.CALL, *self]

    @classmethod
    def from_wire(cls, fields: Any) -> Call:
        f = _check(fields, Kind.CALL, 11)
        if (
            type(f[1]) is not int
            or type(f[2]) is not str
            or type(f[3]) is not str
            or type(f[4]) is not str
            or type(f[5]) is not int
            or type(f[6]) is not int
            or type(f[7]) is not bytes
            or (f[8] is not None and not _is_port(f[8]))
            or type(f[9]) is not int
            or not _is_extent(f[10], f[9])
        ):
            raise DecodeError(f"malformed CALL record: {brief(fields)}")
        return cls(*f[1:])


def _is_port(value: Any) -> bool:
    """Whether ``value`` is a port as decoded (a handle of kind ``port``): anything else answering to ``send`` (an
    actor mesh with an endpoint of that name) is no place for a response."""
    handle = handle_of_kind("port")
    return handle is not None and type(value) is handle.cls


#: The most dimensions a call's mesh may name (Monarch's meshes have a handful).
_MAX_DIMENSIONS = 16


def _is_extent(extent: Any, position: int) -> bool:
    """Whether ``extent`` is None or a mesh shape (labels to sizes ≥ 1) that ``position`` lies in."""
    if extent is None:
        return position >= 0
    if type(extent) is not dict or len(extent) > _MAX_DIMENSIONS:
        return False
    size = 1
    for label, length in extent.items():
        if type(label) is not str or type(length) is not int or length < 1:
            return False
        size *= length
    return 0 <= position < size


class Reply(NamedTuple):
    """The answer of one rank to a call: its value, or (``ok`` false) an :class:`ErrorRecord`."""

    call_id: int
    rank: int
    ok: bool
    value: Any

    def to_wire(self) -> list[Any]:
        value = self.value.to_wire() if isinstance(self.value, ErrorRecord) else self.value
        return [Kind.REPLY, self.call_id, self.rank, self.ok, value]

    @classmethod
    def from_wire(cls, fields: Any) -> Reply:
        f = _check(fields, Kind.REPLY, 5)
        if type(f[1]) is not int or type(f[2]) is not int or type(f[3]) is not bool:
            raise DecodeError(f"malformed REPLY record: {brief(fields)}")
        return cls(f[1], f[2], f[3], f[4] if f[3] else ErrorRecord.from_wire(f[4]))


class PortMessage(NamedTuple):
    """One value (or the end-of-stream ``None``) for port ``port_id`` of the receiving process."""

    port_id: int
    value: Any

    @classmethod
    def from_wire(cls, fields: Any) -> PortMessage:
        return _new_tuple(cls, (cls.checked(fields)[1], fields[2]))  # type: ignore[no-any-return]

    @staticmethod
    def checked(fields: Any) -> list[Any]:
        """``fields`` if they form a PORT record (``[PORT, port_id, value]``), without building one.

        The hot path: one call per port message, so its receiver reads the
        two fields in place.
        """
        if (
            type(fields) is not list
            or len(fields) != 3
            or not isinstance(fields[0], int)  # (a decoded tensor compares elementwise)
            or fields[0] != Kind.PORT
            or type(fields[1]) is not int
        ):
            raise DecodeError(f"malformed PORT record: {brief(fields)}")
        return fields


class Undecodable(NamedTuple):
    """In a port's queue, in place of a value that arrived but could not be built here (its type unknown, its
    constructor raising): receiving it raises ``DecodeError`` with ``reason``, and its window credit flows as for
    any message."""

    reason: str


def port_prefix(port_id: int) -> bytes:
    """The packed start of a PORT record for ``port_id``; the value is packed right after it."""
    return b"\x93" + msgpack.packb(int(Kind.PORT)) + msgpack.packb(port_id)  # type: ignore[no-any-return]


class Credit(NamedTuple):
    """The receiver of ``port_id`` consumed ``messages`` (``nbytes``) of the sender's window."""

    port_id: int
    messages: int
    nbytes: int

    def to_wire(self) -> list[Any]:
        return [Kind.CREDIT, *self]

    @classmethod
    def from_wire(cls, fields: Any) -> Credit:
        f = _check(fields, Kind.CREDIT, 4)
        if type(f[1]) is not int or type(f[2]) is not int or type(f[3]) is not int or f[2] < 0 or f[3] < 0:
            raise DecodeError("malformed CREDIT record")
        return cls(f[1], f[2], f[3])


class Attach(NamedTuple):
    """Process ``pid`` at ``address`` now holds a sender of ``port_id`` (so the receiver watches it: by its pid on
    the receiver's host, by news of its death on another)."""

    port_id: int
    pid: int
    address: str

    def to_wire(self) -> list[Any]:
        return [Kind.ATTACH, *self]

    @classmethod
    def from_wire(cls, fields: Any) -> Attach:
        f = _check(fields, Kind.ATTACH, 4)
        if type(f[1]) is not int or type(f[2]) is not int or not 0 < f[2] <= PID_MAX:  # (a pid to watch: a real one)
            raise DecodeError("malformed ATTACH record")
        if type(f[3]) is not str:
            raise DecodeError("malformed ATTACH record")
        return cls(f[1], f[2], f[3])


class FailureReport(NamedTuple):
    """An actor of the sending process failed (a fire-and-forget call raised, a supervisor escalated)."""

    actor: str
    rank: int
    pid: int
    endpoint: str
    exception_type: str
    message: str
    traceback: str

    def to_wire(self) -> list[Any]:
        return [Kind.FAILURE, *self]

    @classmethod
    def from_wire(cls, fields: Any) -> FailureReport:
        f = _check(fields, Kind.FAILURE, 8)
        types = (str, int, int, str, str, str, str)
        if any(type(value) is not expected for value, expected in zip(f[1:], types, strict=True)):
            raise DecodeError("malformed FAILURE record")
        return cls(*f[1:])


class ProcessLost(NamedTuple):
    """The process at ``address`` died: its owner tells the peers that cannot watch its pid (another host's).

    ``incarnation`` stamps the process that died (its owner's clock, in ns,
    when it started it; 0 when the sender never learned it), so news of an
    old death that arrives after news of the restart (by another path), or
    after a new process took the address, is recognised as stale.
    """

    address: str
    reason: str
    incarnation: int

    def to_wire(self) -> list[Any]:
        return [Kind.LOST, *self]

    @classmethod
    def from_wire(cls, fields: Any) -> ProcessLost:
        f = _check(fields, Kind.LOST, 4)
        if type(f[1]) is not str or type(f[2]) is not str or type(f[3]) is not int or f[3] < 0:
            raise DecodeError("malformed LOST record")
        return cls(f[1], f[2], f[3])


class ProcessRestarted(NamedTuple):
    """The process once at ``address`` was replaced; the replacement serves ``new_address`` (maybe the same).

    ``incarnation`` is the replacement's stamp (later than the one it replaced).
    """

    address: str
    new_address: str
    incarnation: int

    def to_wire(self) -> list[Any]:
        return [Kind.RESTARTED, *self]

    @classmethod
    def from_wire(cls, fields: Any) -> ProcessRestarted:
        f = _check(fields, Kind.RESTARTED, 4)
        if type(f[1]) is not str or type(f[2]) is not str or type(f[3]) is not int or f[3] < 1:
            raise DecodeError("malformed RESTARTED record")
        return cls(f[1], f[2], f[3])


Record = Call | Reply | PortMessage | Credit | Attach | FailureReport | ProcessLost | ProcessRestarted

#: Each record type by its kind: ``RECORDS[fields[0]].from_wire(fields)`` decodes one.
RECORDS: dict[int, type[Record]] = {
    Kind.CALL: Call,
    Kind.REPLY: Reply,
    Kind.PORT: PortMessage,
    Kind.CREDIT: Credit,
    Kind.ATTACH: Attach,
    Kind.FAILURE: FailureReport,
    Kind.LOST: ProcessLost,
    Kind.RESTARTED: ProcessRestarted,
}


def decode_record(fields: Any) -> Record:
    """The record an undecoded msgpack array stands for; :class:`DecodeError` if none."""
    if type(fields) is not list or not fields:
        raise DecodeError(f"not a record: {brief(fields)}")
    record_type = RECORDS.get(fields[0]) if isinstance(fields[0], int) else None  # (a list is unhashable)
    if record_type is None:
        raise DecodeError(f"unknown record kind {brief(fields[0])}")
    return record_type.from_wire(fields)


_SHORT_PREFIX = [bytes([0, n]) for n in range(128)]


def record_prefix(frame_count: int, length: int) -> bytes:
    """The ``frame_count, length`` pair (two msgpack uints) that precedes each record of a batch."""
    if frame_count == 0 and length < 128:
        return _SHORT_PREFIX[length]
    return msgpack.packb(frame_count) + msgpack.packb(length)  # type: ignore[no-any-return]
