"""Where failure reports and deaths of the processes this one spawned go: to their proc meshes.

A proc mesh registers here the processes it owns (:meth:`MeshRoutes.own`)
and, for a mesh received from elsewhere, the actors this process spawned on
it (:meth:`MeshRoutes.supervise`: those actors' failures come to the
spawner, as in Monarch). A report or death with no mesh to take it goes to
the process-wide failure handlers (``actors.add_failure_handler``). The
routes are weak: a mesh nobody holds any more hears nothing.

This module is the runtime layer's side of that contract; the meshes layer
implements :class:`SupervisedMesh`.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from .._shared._segments import remove_process_segments
from .._wire._records import FailureReport, Header
from ._supervision import Failure, FailureHandler, offer

if TYPE_CHECKING:
    from .._shared._liveness import ProcRef
    from .._transport._inbox_pump import Inbox
    from .._transport._registry import Registry

__all__ = ["MeshRoutes", "SupervisedMesh"]


class SupervisedMesh(Protocol):
    """What failure routing needs of a proc mesh this process spawned (``_meshes._proc_mesh.ProcMesh``)."""

    @property
    def stopping(self) -> bool: ...

    def report(self, failure: Failure, handled: bool = False) -> None: ...

    def on_death(self, ref: ProcRef) -> None: ...


class MeshRoutes:
    """This process's routes from spawned processes (and actors spawned on received meshes) to their meshes."""

    def __init__(self, inbox: Inbox, registry: Registry, session: str, tell_lost: Callable[[ProcRef], None]) -> None:
        self._inbox = inbox
        self._registry = registry
        self._session = session
        self._tell_lost = tell_lost  # peers on other hosts cannot see a spawned process die
        self._by_process: weakref.WeakValueDictionary[str, SupervisedMesh] = weakref.WeakValueDictionary()
        self._by_actor: weakref.WeakValueDictionary[tuple[str, str], SupervisedMesh] = weakref.WeakValueDictionary()
        #: Process-wide failure handlers (``actors.add_failure_handler``), after each mesh's own.
        self.handlers: list[FailureHandler] = []
        self._listening = False

    def own(self, address: str, mesh: SupervisedMesh) -> None:
        """The process at ``address`` was spawned by this one, into ``mesh``: its failures and death go there."""
        self._by_process[address] = mesh
        self._listen()

    def supervise(self, address: str, actor: str, mesh: SupervisedMesh) -> None:
        """This process spawned ``actor`` at ``address`` on a mesh it received: that actor's failures go to ``mesh``."""
        self._by_actor[(address, actor)] = mesh
        self._listen()

    def owns(self, address: str) -> bool:
        """Whether this process spawned the process at ``address`` (and a mesh of it is still held)."""
        return address in self._by_process

    def spawned(self) -> list[str]:
        """The addresses of the processes this process spawned whose meshes are still held."""
        return list(self._by_process.keys())

    def moved(self, old: str, address: str) -> None:
        """The process at ``old`` was replaced by one at ``address``: the routes follow it."""
        mesh = self._by_process.pop(old, None)
        if mesh is not None:
            self._by_process[address] = mesh
        for key in [key for key in self._by_actor.keys() if key[0] == old]:
            supervisor = self._by_actor.pop(key, None)
            if supervisor is not None:
                self._by_actor[(address, key[1])] = supervisor

    def _listen(self) -> None:
        """Start taking failure reports and deaths (on the first route: a process that spawns nothing never does)."""
        if self._listening:
            return
        self._listening = True
        self._inbox.on(FailureReport, self._on_failure)
        self._registry.deaths.connect(self._on_death)

    def _on_failure(self, report: FailureReport, frames: list[Any], sender: Header, size: int) -> None:
        failure = Failure.from_report(report)
        mesh = self._by_actor.get((sender.address, report.actor)) or self._by_process.get(sender.address)
        if mesh is not None:
            mesh.report(failure)
        else:
            offer(failure, self.handlers)

    def _on_death(self, ref: ProcRef) -> None:
        mesh = self._by_process.get(ref.address)
        if mesh is None:
            return
        if ref.pid is not None and not ref.remote:  # the weights it published die with it
            remove_process_segments(self._session, ref.pid)
        if not mesh.stopping:
            self._tell_lost(ref)
        mesh.on_death(ref)
