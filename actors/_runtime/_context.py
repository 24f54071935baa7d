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

    __slots__ = ("class_ref", "extent", "message_extent", "message_rank", "method", "name", "rank")

    def __init__(
        self,
        name: str,
        rank: int,
        extent: dict[str, int],
        class_ref: str = "",
        message_rank: int | None = None,
        method: str = "",
        message_extent: dict[str, int] | None = None,
    ) -> None:
        self.name = name
        self.method = method  # the endpoint whose call runs ("" outside one: construction, cleanup)
        self.rank = rank  # in the mesh it was spawned as, of shape ``extent``
        self.extent = extent
        self.class_ref = class_ref
        # Where the running message found it: its place in the mesh the call went through (a slice of its own)
        self.message_rank = rank if message_rank is None else message_rank
        self.message_extent = extent if message_extent is None else message_extent


actor_context: contextvars.ContextVar[ActorContext | None] = contextvars.ContextVar("actors_context", default=None)


def current_rank() -> Point:
    """Where the running message found its actor: its place in the mesh (or slice) the call went through, as in
    Monarch (rank 0 in the controller)."""
    ctx = actor_context.get()
    if ctx is None:
        return Point(0, {"procs": 1})
    return Point(ctx.message_rank, ctx.message_extent)


def current_size() -> dict[str, int]:
    """The extent of the mesh (or slice) the running message went through (``{}`` in the controller)."""
    ctx = actor_context.get()
    return dict(ctx.message_extent) if ctx is not None else {}
