"""What the layers above need of the actor server a worker runs, as a protocol of the runtime layer.

The server (``_hosting._server.ActorServer``) registers itself with
``Runtime.host``; meshes and controllers then reach the hosted actors'
lifecycle and supervision through this interface only (mypy checks the
server against it).
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import asyncio

    from .._shared._liveness import ProcRef
    from ._supervision import Failure

__all__ = ["ActorHost", "Stoppable"]


class Stoppable(Protocol):
    """Something an actor or a worker spawned that stops with it (a proc mesh, an actor mesh, controllers)."""

    def stop(self) -> Awaitable[Any]: ...


class ActorHost(Protocol):
    """A worker's actor server, as this process's other layers use it."""

    @property
    def loop(self) -> asyncio.AbstractEventLoop: ...

    @property
    def owner(self) -> ProcRef: ...  # the process that spawned this one

    def abort(self, actor: str, reason: str) -> None: ...

    def shutdown(self, reason: str) -> None: ...  # stop every actor and end the process's serving

    def adopt(self, actor: str, child: Stoppable) -> None: ...  # stopped when ``actor`` stops

    def disown(self, actor: str, child: Stoppable) -> None: ...  # ``child`` stopped first: ``actor`` lets it go

    def stop_last(self, child: Stoppable) -> None: ...  # stopped when the worker stops, after its actors

    def supervise(self, actor: str, failure: Failure, handled: bool = False) -> bool: ...

    def escalate(self, actor: str, failure: Failure, raised: BaseException | None = None) -> None: ...
