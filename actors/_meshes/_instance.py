"""Where the running code is, as the user sees it: ``context()``, its actor instance, the message's rank.

Inside an endpoint, ``context().actor_instance`` describes the actor that is
running (its name, class, rank, process) and ``context().message_rank`` the
position of the message's target in the mesh it was sent to. In the
controller (no actor running) the instance is the root client, printed
``<root>`` as in Monarch.
"""

from __future__ import annotations

import os

from .._runtime._context import ActorContext, actor_context
from .._runtime._core import runtime
from .._runtime._value_mesh import Point
from .._shared._names import shown
from ._host_mesh import this_proc
from ._proc_mesh import ProcMesh

__all__ = ["Context", "Instance", "context", "current_actor_name"]


class Instance:
    """The actor running this code (or the root client): name, class, rank and process."""

    __slots__ = ("_ctx",)

    def __init__(self, ctx: ActorContext | None) -> None:
        self._ctx = ctx

    @property
    def name(self) -> str:
        """The actor's mesh name (``"root"`` in the controller)."""
        return shown(self._ctx.name) if self._ctx is not None else "root"

    @property
    def class_name(self) -> str:
        """The actor's class, qualified by its module (empty for the root client)."""
        return self._ctx.class_ref.replace(":", ".") if self._ctx is not None else ""

    @property
    def rank(self) -> Point:
        """The actor's own position in its mesh."""
        ctx = self._ctx
        return Point(ctx.rank, ctx.extent) if ctx is not None else Point(0, {})

    @property
    def pid(self) -> int:
        return os.getpid()

    @property
    def actor_id(self) -> str:
        """A name unique in the session: ``<mesh>[<rank>]@<pid>`` (``root@<pid>`` for the client)."""
        ctx = self._ctx
        return f"{ctx.name}[{ctx.rank}]@{os.getpid()}" if ctx is not None else f"root@{os.getpid()}"

    @property
    def proc(self) -> ProcMesh:
        """The process this code runs in, as a proc mesh of one (see :func:`actors.this_proc`)."""
        return this_proc()

    def abort(self, reason: str | None = None) -> None:
        """Fail this actor now, as an endpoint raising a fatal error would (Monarch's ``abort``).

        Its supervisor is told (the failure names the class and ``reason``);
        its running and later calls raise :class:`~actors.SupervisionError`;
        it is stopped. Safe from any task or thread of the actor.
        """
        ctx = self._ctx
        server = runtime().server if ctx is not None else None
        if ctx is None or server is None:  # checked first: the client starts no runtime just to refuse
            raise RuntimeError("abort() fails an actor; the client is not one")
        server.loop.call_soon_threadsafe(server.abort, ctx.name, reason or "no reason provided")

    def __str__(self) -> str:
        ctx = self._ctx
        if ctx is None:
            return "<root>"
        return f"<{self.class_name} {shown(ctx.name)}{Point(ctx.rank, ctx.extent)}>"

    __repr__ = __str__


class Context:
    """What ``context()`` returns: the running actor and the rank its current message was sent to."""

    __slots__ = ("_ctx",)

    def __init__(self, ctx: ActorContext | None) -> None:
        self._ctx = ctx

    @property
    def actor_instance(self) -> Instance:
        return Instance(self._ctx)

    @property
    def message_rank(self) -> Point:
        """The target's position in the mesh the current message was sent to."""
        ctx = self._ctx
        return Point(ctx.message_rank, ctx.message_extent) if ctx is not None else Point(0, {})

    def __repr__(self) -> str:
        return f"<Context {self.actor_instance}>"


def context() -> Context:
    """The running actor and message (the root client outside any actor)."""
    return Context(actor_context.get())


def current_actor_name() -> str:
    """A name for the running actor, unique in the session (see :attr:`Instance.actor_id`)."""
    return Instance(actor_context.get()).actor_id
