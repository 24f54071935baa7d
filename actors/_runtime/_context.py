"""Which actor's code runs now: the server sets an :class:`ActorContext` per call (per task).

Its public face (``context()``, ``Instance``) is ``_meshes._instance``; the
runtime layer only keeps the record and the running code's rank and extent.
"""

from __future__ import annotations

import contextvars

from ._value_mesh import Point

__all__ = ["ActorContext", "actor_context", "current_rank", "current_size"]


class ActorContext:
    """What the server knows of the actor whose code runs now (set per call, per task)."""

    __slots__ = ("class_ref", "extent", "message_rank", "method", "name", "rank")

    def __init__(
        self,
        name: str,
        rank: int,
        extent: dict[str, int],
        class_ref: str = "",
        message_rank: int | None = None,
        method: str = "",
    ) -> None:
        self.name = name
        self.method = method  # the endpoint whose call runs ("" outside one: construction, cleanup)
        self.rank = rank
        self.extent = extent
        self.class_ref = class_ref
        self.message_rank = rank if message_rank is None else message_rank


actor_context: contextvars.ContextVar[ActorContext | None] = contextvars.ContextVar("actors_context", default=None)


def current_rank() -> Point:
    """The rank of the actor whose code is running (rank 0 in the controller)."""
    ctx = actor_context.get()
    if ctx is None:
        return Point(0, {"procs": 1})
    return Point(ctx.message_rank, ctx.extent)


def current_size() -> dict[str, int]:
    """The extent of the mesh of the running actor (``{}`` in the controller)."""
    ctx = actor_context.get()
    return dict(ctx.extent) if ctx is not None else {}
