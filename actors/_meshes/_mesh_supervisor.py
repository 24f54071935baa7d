"""What a proc mesh's spawner knows of its failures: handlers, failures so far, the fault, restarts.

Every proc mesh has one. For the mesh's owner (the process that spawned its
processes) it also hears each process's death and, when the restart policy
allows, starts a replacement with every actor constructed again; for a mesh
received from elsewhere, it hears only failures of the actors this process
spawned on it. It is what ``MeshRoutes`` routes to (a ``SupervisedMesh``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable

from .._runtime._core import runtime
from .._runtime._supervision import Failure, FailureHandler, escalate_to_controller, offer
from .._shared._errors import SupervisionError
from .._shared._liveness import ProcRef, new_incarnation
from .._shared._names import shown
from .._shared._restart import RestartBudget, RestartPolicy
from .._shared._session import incarnation_path, remove_socket_file

__all__ = ["MeshSupervisor", "Respawn", "SpawnReplay"]

#: How a placer starts a new process for rank ``rank`` (whose old one is ``ref``): its address, or None if unchanged.
Respawn = Callable[[int, ProcRef], str | None]
#: Constructs every actor of the mesh again in the restarted process of ``rank``.
SpawnReplay = Callable[[int, ProcRef], None]


class MeshSupervisor:
    """Offers a proc mesh's failures to its supervisors, faults it when none handles one, restarts dead processes."""

    def __init__(
        self,
        procs: list[ProcRef],
        owner_actor: str | None,
        restart: RestartPolicy | None = None,
        respawn: Respawn | None = None,
        replay: SpawnReplay | None = None,
        actor_names: Callable[[], list[str]] = list,
    ) -> None:
        self._procs = procs
        #: The actor that spawned the mesh (None in the controller): its ``__supervise__`` is asked.
        self.owner_actor = owner_actor
        self._budget = RestartBudget(restart or RestartPolicy())
        #: How the placer starts a replacement process (None: dead processes stay dead).
        self.respawn = respawn
        self._replay = replay
        self._actor_names = actor_names
        #: How many times each rank's process has been restarted.
        self.restarts = [0] * len(procs)
        self.handlers: list[FailureHandler] = []
        self.failures: list[Failure] = []
        #: Set once the mesh's stop has begun: deaths from then on are expected, not failures.
        self.stopping = False
        #: The unhandled failure that faulted the mesh, if any (later calls raise it).
        self.fault: SupervisionError | None = None
        #: The first failure no supervisor of the mesh handled (even if the fault hook let it pass): as in
        #: Monarch, a proc mesh with a failed actor takes no more spawns.
        self.unhandled: Failure | None = None

    def report(self, failure: Failure, handled: bool = False) -> None:
        """Offer ``failure`` to every supervisor; escalate it if none handled it."""
        self.failures.append(failure)
        rt = runtime()
        handled = offer(failure, [*self.handlers, *rt.mesh_routes.handlers]) or handled
        server, actor = rt.server, self.owner_actor
        if actor is not None and server is not None:
            handled = server.supervise(actor, failure, handled or self.stopping) or handled
        if handled or self.stopping:
            return
        if self.unhandled is None:
            self.unhandled = failure
        if actor is not None and server is not None:
            server.escalate(actor, failure)
        elif self.fault is None:
            self.fault = escalate_to_controller(failure)

    def on_death(self, ref: ProcRef) -> None:
        """One of the mesh's processes died: restart it if the policy allows, and report it."""
        if self.stopping:
            return
        rank = self._procs.index(ref)
        names = ",".join(shown(name) for name in self._actor_names()) or "(no actors)"
        pid = ref.pid or 0
        reason = ref.exit_reason or "process exited"
        restarting = self.respawn is not None and self._budget.take()
        if restarting:
            try:
                self._restart_rank(rank, ref)
            except Exception as exc:  # no process could be started: the rank stays dead
                restarting = False
                self._budget.give_back()
                reason += f"; could not restart it: {exc}"
            else:
                reason += f"; restarted (restart {self.restarts[rank]} of rank {rank})"
        else:
            reason += self._budget.refusal()
        failure = Failure(names, rank, pid, "", "ActorDied", reason, restarted=restarting)
        self.report(failure, handled=restarting)

    def _restart_rank(self, rank: int, ref: ProcRef) -> None:
        """A new process for the dead one, with every actor constructed again.

        The placer starts it at the same address, or at a new one on another
        host when the old host is lost: handles here follow it at once, and
        peers on other hosts hear of it (``PeerNews``). In-flight calls
        already failed with ActorDied; calls made from now on queue for the
        new process, which runs them once its actors exist.
        """
        assert self.respawn is not None
        rt = runtime()
        remove_socket_file(ref.address)
        with contextlib.suppress(FileNotFoundError):
            os.remove(incarnation_path(rt.dir, ref.address))  # the new pid is written when it forks
        address = self.respawn(rank, ref)  # raises when no process can be started; then nothing changed
        old = ref.address
        rt.registry.revive(ref, None)
        if address is not None and address != old:
            rt.relocate(ref, address, remote=ref.remote)
        self.restarts[rank] += 1
        ref.incarnation = new_incarnation(ref)
        rt.news.restarted(old, ref)
        if self._replay is not None:
            self._replay(rank, ref)  # a constructor failing reports itself (__init__)
