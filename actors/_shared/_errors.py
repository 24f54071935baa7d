"""The exception tree of the ``actors`` runtime, in one place.

Every error the runtime raises on purpose derives from :class:`ActorsError`::

    ActorsError
    ├── ActorError          an endpoint (or a constructor) raised in the remote actor;
    │   │                   carries the original type name, message and remote traceback
    │   └── SpawnError      the actor could not be constructed (class not found, __init__ raised)
    ├── SupervisionError    an actor failed (also a ``RuntimeError``, as in Monarch): it raised
    │   │                   a ``BaseException`` that is not an ``Exception``, abandoned its
    │   │                   explicit response port, or failed and no supervisor handled it
    │   │                   (later calls to its mesh raise it; carries the ``Failure``); also
    │   │                   a call to a stopped actor
    │   └── ActorDied       the process hosting the actor is gone (killed, crashed, stopped)
    ├── CallTimeout         a call's deadline or a wait's timeout passed (also a
    │   │                   ``TimeoutError``); the actor is alive but busy or blocked
    │   └── HandOffTimeout  work handed to the runtime's thread from another did not
    │                       finish in time (it may have run: what it sent may have left)
    ├── PortClosed          a port cannot deliver: its receiver is gone, a once-port was
    │                       already used, or every sender of a receiver has died
    ├── BufferFull          a bounded send buffer is full (a port's backlog, a peer's queue):
    │                       the receiver is not keeping up; ``await port.drain()`` paces a sender
    ├── MainLoadingError    the runtime was used while an actor process loaded the launching
    │                       script's definitions (that top-level statement is skipped there;
    │                       also a ``RuntimeError``)
    ├── CodecError          a value could not cross the wire
    │   ├── EncodeError     the sender tried to send something the codec refuses
    │   │                   (also a ``TypeError``)
    │   └── DecodeError     a frame was malformed, over a limit, or named a type the
    │                       receiver refuses to build (also a ``ValueError``)
    └── WeightSyncError     a weight update could not be published, imported or installed
        ├── VersionError    a publisher was given a version not above its last one
        ├── LifecycleError  an update was used out of order: acknowledged before import,
        │                   imported after release or rejection, or unknown
        ├── ChecksumError   an imported tensor does not match its published checksum
        ├── StaleUpdateError the update's storage was reused for a newer version
        ├── ManifestError   a manifest is malformed (sizes, dtypes, offsets, handle) or
        │                   does not fit the model it is installed into; nothing is installed
        ├── PublisherDied   the process that published an update has exited; the consumer
        │                   keeps the weights it last installed
        └── TransportBlocked the transport cannot run here (e.g. no CUDA); says why

``Port.send`` with a value of the wrong type raises the built-in ``TypeError``
at the sender, as Python code expects.
"""

from __future__ import annotations

from ._names import shown

__all__ = [
    "ActorDied",
    "ActorError",
    "ActorsError",
    "BufferFull",
    "CallTimeout",
    "ChecksumError",
    "CodecError",
    "DecodeError",
    "EncodeError",
    "HandOffTimeout",
    "LifecycleError",
    "MainLoadingError",
    "ManifestError",
    "PortClosed",
    "PublisherDied",
    "SpawnError",
    "StaleUpdateError",
    "SupervisionError",
    "TransportBlocked",
    "VersionError",
    "WeightSyncError",
]


class ActorsError(Exception):
    """Base class of every error raised by the runtime."""


class ActorError(ActorsError):
    """An exception raised inside a remote actor, re-raised at the caller.

    ``exception_type`` is the qualified name of the original exception class,
    ``remote_traceback`` the formatted traceback from the actor's process.
    """

    def __init__(
        self,
        exception_type: str,
        message: str,
        remote_traceback: str = "",
        *,
        actor: str = "",
        rank: int | None = None,
        method: str = "",
    ) -> None:
        self.exception_type = exception_type
        self.message = message
        self.remote_traceback = remote_traceback
        self.actor = actor = shown(actor)
        self.rank = rank
        self.method = method
        where = f" in actor {actor!r}" if actor else ""
        if rank is not None:
            where += f" (rank {rank})"
        text = f"{exception_type}: {message}{where}"
        if actor and method:  # the call first, in the words Monarch's programs match on
            text = f"Actor call {actor}.{method} failed: {text}"
        if remote_traceback:
            text += "\n\nRemote traceback:\n" + remote_traceback.rstrip()
        super().__init__(text)

    def __reduce__(self) -> tuple[object, ...]:
        return (
            _rebuild_actor_error,
            (type(self), self.exception_type, self.message, self.remote_traceback, self.actor, self.rank, self.method),
        )


def _rebuild_actor_error(
    cls: type[ActorError], etype: str, message: str, tb: str, actor: str, rank: int | None, method: str = ""
) -> ActorError:
    return cls(etype, message, tb, actor=actor, rank=rank, method=method)


class SpawnError(ActorError):
    """The actor could not be constructed in its process."""


class SupervisionError(ActorsError, RuntimeError):
    """An actor failed: it is gone for good, and so are the calls it had not answered.

    ``failure`` is the :class:`~actors.Failure` record when the failure went
    unhandled (actor, rank, pid, cause and remote traceback); the mesh then
    stays faulted and later calls to it raise this error again.
    """

    def __init__(self, message: str, failure: object = None) -> None:
        self.failure = failure
        super().__init__(message)


def actor_label(actor: str, rank: int, class_ref: str = "") -> str:
    """How a failure names one actor: ``<module.Class name[rank]>``, or ``name[rank]`` where its class is not known.

    Monarch's texts name the class too (``<module.FaultActor fault{...}>``), and its programs match on it.
    """
    if not class_ref:
        return f"{shown(actor)}[{rank}]"
    return f"<{class_ref.replace(':', '.')} {shown(actor)}[{rank}]>"


def actor_failed(actor: str, rank: int, why: str, class_ref: str = "") -> str:
    """The message of an actor's failure, in the words Monarch's programs match on."""
    return f"The actor {actor_label(actor, rank, class_ref)} and all its descendants have failed: {why}"


def actor_stopped(actor: str) -> str:
    """The message of a call to a stopped actor, in the words Monarch's programs match on."""
    return f"Supervision event: actor {shown(actor)} has status: stopped; it takes no more messages"


class ActorDied(SupervisionError):
    """The process hosting an actor has exited; its calls can never complete."""

    def __init__(self, message: str, *, pid: int | None = None, actor: str = "") -> None:
        self.pid = pid
        self.actor = actor
        super().__init__(message)

    @classmethod
    def of(
        cls, actor: str, rank: int, pid: int | None, reason: str, method: str = "", class_ref: str = ""
    ) -> ActorDied:
        """The error for calls to ``actor`` (rank ``rank``, of class ``class_ref``) whose process ``pid`` ended."""
        actor = shown(actor)
        call = f"Endpoint call {actor}.{method}() failed, " if method else ""
        why = f"its process (pid {pid}) died: {reason}"
        return cls(call + actor_failed(actor, rank, why, class_ref), pid=pid, actor=actor)


class MainLoadingError(ActorsError, RuntimeError):
    """The runtime was used while an actor process loaded the launching script's definitions."""


class CallTimeout(ActorsError, TimeoutError):
    """A call or wait ran past its deadline."""


class HandOffTimeout(CallTimeout):
    """Work handed to the runtime's thread did not finish in time; it may have run (a send may have left)."""


class PortClosed(ActorsError):
    """A port can no longer deliver messages."""


class BufferFull(ActorsError):
    """A bounded send buffer is full; nothing was queued. Await ``Port.drain()`` to pace the sender."""


class CodecError(ActorsError):
    """A value could not be encoded or decoded."""


class EncodeError(CodecError, TypeError):
    """The value holds something the wire format refuses to carry."""


class DecodeError(CodecError, ValueError):
    """A frame is malformed, exceeds a limit, or names a refused type."""


class WeightSyncError(ActorsError):
    """A weight update could not be published, imported or installed."""


class VersionError(WeightSyncError):
    """Versions must strictly increase per publisher."""


class LifecycleError(WeightSyncError):
    """An update was used out of order (e.g. acknowledged before it was imported)."""


class ChecksumError(WeightSyncError):
    """Imported bytes differ from what the publisher wrote."""


class StaleUpdateError(WeightSyncError):
    """The update's storage now holds a newer version; take the newer manifest."""


class ManifestError(WeightSyncError):
    """A manifest cannot be used: malformed, or not matching the model it is installed into."""


class PublisherDied(WeightSyncError):
    """The publisher of an update has exited: its updates can no longer be imported."""

    def __init__(self, message: str, *, pid: int) -> None:
        self.pid = pid
        super().__init__(message)


class TransportBlocked(WeightSyncError):
    """The transport cannot run on this machine; ``reason`` says why."""

    def __init__(self, transport: str, reason: str) -> None:
        self.transport = transport
        self.reason = reason
        super().__init__(f"transport {transport!r} is blocked: {reason}")
