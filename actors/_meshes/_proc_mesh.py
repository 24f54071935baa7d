"""``ProcMesh``: a group of actor processes; spawn actors on it, restart them, stop them.

The process that spawned a proc mesh is its *owner*: it hears of each of its
processes' deaths and of each failure its actors report, through the mesh's
:class:`~._mesh_supervisor.MeshSupervisor` (failures, fault, restarts);
stopping follows :func:`~._proc_stop.stop_steps`. The mesh itself is the
handle: spawn, ask, stop.
"""

from __future__ import annotations

import itertools
import logging
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from .._hosting._actor import Actor, check_actor_class, endpoints_of
from .._hosting._server import CLEANUP_TIMEOUT
from .._runtime._call_sender import encode_arguments, pending_future, send_call
from .._runtime._context import actor_context
from .._runtime._core import Runtime, join_session, runtime
from .._runtime._future import Future
from .._runtime._parts import Part
from .._runtime._pending_calls import PendingCall
from .._runtime._supervision import Failure, FailureHandler, checked_handler
from .._runtime._value_mesh import Shaped, extent_from_wire, flattened, select, split_extent
from .._shared._errors import DecodeError, SupervisionError
from .._shared._liveness import ProcRef, new_incarnation
from .._shared._names import wire_name
from .._shared._restart import RestartPolicy
from .._wire import _refs
from .._wire._codec import register_handle
from .._wire._records import PROCESS_ACTOR
from ._actor_mesh import ActorMesh, check_endpoint_names
from ._log_collector import LogCollector
from ._mesh_supervisor import MeshSupervisor
from ._proc_stop import StopRun, StopStep, stop_steps

__all__ = ["SPAWNED_MESHES", "ProcMesh"]

A = TypeVar("A", bound=Actor)
R = TypeVar("R")


def _mesh_set() -> weakref.WeakSet[ProcMesh]:
    return weakref.WeakSet()


@dataclass
class SpawnRecord:
    """One spawn on a proc mesh (or a slice of it), as a restart replays it: the actor's name, class, arguments
    and mesh extent, and for each process it lives in (by its rank in the proc mesh spawned from, not sliced) the
    actor's rank in its own mesh. A rank whose actor was stopped is dropped: a restart does not build it again."""

    name: str
    class_ref: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    extent: dict[str, int]
    ranks: dict[int, int] = field(default_factory=dict)


class ProcMesh(Shaped):
    """A group of actor processes; ``spawn`` actors on it, ``stop`` it when done."""

    def __init__(
        self,
        name: str,
        extent: dict[str, int],
        procs: list[ProcRef],
        restart: RestartPolicy | None = None,
        respawn: Callable[[int, ProcRef], str | None] | None = None,
        *,
        owned: bool = True,
        kill: Callable[[ProcRef], None] | None = None,
        sliced_from: tuple[ProcMesh, list[int]] | None = None,
    ) -> None:
        """``sliced_from``: ``(root, ranks)`` for a slice of ``root``, whose processes at ``ranks`` these are: it
        shares the root's supervision, spawn records and actors (see :meth:`slice`)."""
        self._name = name
        #: Where the processes' output arrives once ``logging_option`` streams it here.
        self._logs: LogCollector | None = None
        self._logs_lock = threading.Lock()
        #: The last ``logging_option`` sent to the processes: ``(port or None, level)``.
        self._log_option: tuple[Any, int] | None = None
        #: How the placer ends a process on another host that ignored the stop (its pid means nothing here).
        self._kill_remote = kill
        self._extent = dict(extent)
        self._procs = procs
        self._stopped = False
        self._stop_run: StopRun | None = None
        root, root_ranks = sliced_from if sliced_from is not None else (self, list(range(len(procs))))
        #: The proc mesh this one was sliced from (itself, unsliced), and its processes' ranks there.
        self._root: ProcMesh = root
        self._root_ranks = root_ranks
        #: Every spawn on the root or a slice of it, replayed into a restarted process where its actor lives.
        self._spawned: list[SpawnRecord] = root._spawned if root is not self else []
        self._actors: dict[str, ActorMesh[Any]] = root._actors if root is not self else {}
        self.supervisor: MeshSupervisor
        self._owned: bool
        if root is not self:  # a view of some of the root's processes: one supervision, one set of records
            self.supervisor = root.supervisor
            self._owned = root._owned  # (spawns on it are the root's owner's, as spawns on the root are)
            return
        context = actor_context.get()
        self.supervisor = MeshSupervisor(
            procs,
            context.name if context is not None else None,
            restart,
            respawn,
            self._replay_spawns,
            lambda: list(self._actors),
        )
        self._owned = owned
        rt = runtime()
        if owned:  # a handle received from elsewhere (or this_proc()) supervises nothing
            for ref in procs:
                rt.mesh_routes.own(ref.address, self.supervisor)
                ref.incarnation = new_incarnation(ref)
            rt.parts.get(SPAWNED_MESHES).add(self)
            owner_actor = self.supervisor.owner_actor
            if owner_actor is not None and rt.server is not None:
                rt.server.adopt(owner_actor, self)  # stopped when that actor stops

    def __repr__(self) -> str:
        return f"<ProcMesh {self._name} {self._extent}>"

    def __len__(self) -> int:
        return len(self._procs)

    @property
    def pids(self) -> list[int | None]:
        """The processes' pids (``None`` for one not started yet)."""
        registry = runtime().registry
        return [registry.resolve_pid(ref) for ref in self._procs]

    def spawn(self, name: str, actor_class: type[A], *args: Any, **kwargs: Any) -> A:
        """Construct ``actor_class(*args, **kwargs)`` in every process; returns at once.

        The result is an :class:`ActorMesh`, typed as the actor class so that
        its endpoints carry their signatures (as in Monarch).
        """
        if self.supervisor.stopping:
            raise RuntimeError(f"`ProcMesh` has already been stopped: cannot spawn {name!r} on {self._name}")
        if self.supervisor.unhandled is not None:
            raise RuntimeError(
                f"error spawning actor mesh {name!r}: {self._name} has a failed actor and takes no more spawns "
                f"({self.supervisor.unhandled})"
            )
        if not (isinstance(actor_class, type) and issubclass(actor_class, Actor)):
            raise TypeError(f"spawn() needs an Actor subclass, not {actor_class!r}")
        check_actor_class(actor_class)
        class_ref = _refs.qualified_name(actor_class)
        if "<locals>" in class_ref:
            raise TypeError(f"{class_ref} is defined inside a function; define actor classes at module level")
        if not isinstance(name, str):
            raise TypeError(f"an actor's name must be a string, not {type(name).__name__}")
        if not name or name == PROCESS_ACTOR:
            raise ValueError(f"an actor's name must be non-empty and not {PROCESS_ACTOR!r}")
        name = wire_name(name)  # spawners choosing the same name on the same processes must not meet
        rt = runtime()
        targets = list(enumerate(self._procs))
        endpoint_timeouts = {ep_name: ep.timeout for ep_name, ep in endpoints_of(actor_class).items()}
        check_endpoint_names(actor_class, endpoint_timeouts)

        def send() -> PendingCall | None:
            pending = self._send_spawn(rt, targets, name, class_ref, args, kwargs, self._extent)
            # with its send, on the runtime's thread: a restart from now on constructs it too (recorded on the
            # caller's thread, a restart handled in between on the loop's missed it)
            ranks = {root_rank: rank for rank, root_rank in enumerate(self._root_ranks)}
            self._spawned.append(SpawnRecord(name, class_ref, args, kwargs, dict(self._extent), ranks))
            return pending

        pending = rt.driver.on_thread(send)
        mesh: ActorMesh[A] = ActorMesh(name, class_ref, endpoint_timeouts, self._extent, targets, self)
        mesh._spawn_call = pending
        self._actors[name] = mesh
        if not self._owned:  # this process spawned them: their failures come here, not to the procs' owner
            for ref in self._procs:
                rt.mesh_routes.supervise(ref.address, name, self.supervisor)
            spawner = actor_context.get()
            if spawner is not None and rt.server is not None:
                rt.server.adopt(spawner.name, mesh)  # stopped when the spawning actor stops
        return mesh  # type: ignore[return-value]

    def _send_spawn(
        self,
        rt: Runtime,
        targets: list[tuple[int, ProcRef]],
        name: str,
        class_ref: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        extent: dict[str, int],
    ) -> PendingCall | None:
        enc = rt.encoder_now()
        enc.reset()
        ctor = enc.encode([list(args), kwargs])
        frames, handles = enc.frames, enc.handles
        enc.reset()
        blob = enc.encode([[name, class_ref, extent, ctor], {}])
        return send_call(rt, targets, PROCESS_ACTOR, "spawn", (blob, frames, handles), want_reply=True)

    def _ask_processes(self, operation: str, args: tuple[Any, ...], build: Callable[[], R], what: str) -> Future[R]:
        """Send a process operation (``ping``, ``log_option``) to every process; ``build()`` once all answered."""
        rt = runtime()
        targets = list(enumerate(self._procs))
        pending = rt.driver.on_thread(
            lambda: send_call(rt, targets, PROCESS_ACTOR, operation, encode_arguments(rt, args, {}), want_reply=True)
        )
        return pending_future(rt, pending, lambda results: build(), f"{self._name}.{what}")

    @property
    def initialized(self) -> Future[bool]:
        """Resolves to True once every process is up and answering."""
        return self._ask_processes("ping", (), lambda: True, "initialized")

    def logging_option(
        self, stream_to_client: bool = True, aggregate_window_sec: float | None = 3, level: int = logging.INFO
    ) -> Future[None]:
        """Where this mesh's processes' output goes, and their ``logging`` level (Monarch's call).

        ``stream_to_client=True``: each line they write to stdout or stderr is
        sent here and printed on this process's ``sys.stdout`` / ``sys.stderr``
        (so a notebook or a redirection sees it), grouped over
        ``aggregate_window_sec`` seconds as ``[N similar log lines] [name]
        line`` (``None``: each line at once, as ``[name] [rank] line``).
        ``stream_to_client=False``, and before the first call: each process
        writes its lines to its own descriptors, prefixed with its actors'
        names (on this machine, the terminal this process started from).
        """
        if self._root is not self:
            raise ValueError(
                f"{self!r} is a slice of {self._root!r}: set the logging option on the mesh it was sliced from "
                "(one collector, and one option a restarted process gets, for all its processes)"
            )
        if not isinstance(stream_to_client, bool):
            raise TypeError(f"stream_to_client must be a bool, not {stream_to_client!r}")
        window = aggregate_window_sec
        if window is not None and (isinstance(window, bool) or not isinstance(window, (int, float)) or not window > 0):
            raise ValueError(f"aggregate_window_sec must be a positive number of seconds or None, not {window!r}")
        if isinstance(level, bool) or not isinstance(level, int):
            raise TypeError(f"level must be a logging level such as logging.INFO, not {level!r}")
        port = None
        if stream_to_client:
            with self._logs_lock:  # two threads asking at once still get one collector
                if self._logs is None:
                    self._logs = LogCollector(runtime(), window)
                else:
                    self._logs.ensure_receiving()
            port = self._logs.port
        if self._logs is not None:  # what is held is printed now when aggregation ends
            self._logs.set_window(window if stream_to_client else None)
        self._log_option = (port, level)  # a restarted process gets them too
        return self._ask_processes("log_option", (port, level), lambda: None, "logging_option")

    def activate(self) -> Any:
        """Monarch's tensor-engine activation: not offered (actors has no tensor engine)."""
        raise NotImplementedError(
            "ProcMesh.activate() selects Monarch's tensor-engine device mesh; actors has no tensor engine"
        )

    def add_failure_handler(self, handler: FailureHandler) -> None:
        """Offer ``handler(failure)`` each failure of this mesh's actors; a true return handles it."""
        self.supervisor.handlers.append(checked_handler(handler))

    @property
    def stopping(self) -> bool:
        """Whether :meth:`stop` has begun (deaths from then on are expected, not failures)."""
        return self.supervisor.stopping

    @property
    def fault(self) -> SupervisionError | None:
        """The unhandled failure that faulted this mesh, if any (later calls raise it)."""
        return self.supervisor.fault

    @property
    def failures(self) -> list[Failure]:
        """Every failure reported to this mesh so far."""
        return self.supervisor.failures

    @property
    def restarts(self) -> list[int]:
        """How many times each rank's process has been restarted."""
        restarts = self.supervisor.restarts
        return restarts if self._root is self else [restarts[rank] for rank in self._root_ranks]

    def slice(self, **coords: int | slice) -> ProcMesh:
        """The processes at ``coords`` (an index drops a dimension, a slice keeps it), as Monarch's meshes slice.

        Actors spawned on it live in those processes only, ranked within the
        slice; it shares this mesh's supervision (failures, restarts, which
        rebuild its actors too) and is stopped with it (:meth:`stop` stops
        the mesh it was sliced from, not a slice).
        """
        ranks, extent = select(self._extent, coords)
        return self._sliced(extent, ranks)

    def flatten(self, dim: str) -> ProcMesh:
        """The same processes along one dimension named ``dim``."""
        return self._sliced(flattened(self._extent, dim), list(range(len(self._procs))))

    def split(self, **changes: object) -> ProcMesh:
        """The same processes with dimensions split, as Monarch's (``split(host=("dp", "pp"), pp=2)``)."""
        return self._sliced(split_extent(self._extent, changes), list(range(len(self._procs))))

    def rename(self, **names: str) -> ProcMesh:
        """The same processes with dimensions renamed (``rename(procs="dp")``)."""
        return self.split(**{old: (new,) for old, new in names.items()})

    def _sliced(self, extent: dict[str, int], ranks: list[int]) -> ProcMesh:
        procs = [self._procs[rank] for rank in ranks]
        root = self._root
        return ProcMesh(self._name, extent, procs, sliced_from=(root, [self._root_ranks[rank] for rank in ranks]))

    def _replay_spawns(self, rank: int, ref: ProcRef) -> None:
        """Construct every actor of this mesh again in the restarted process of ``rank`` (its log options first)."""
        rt = runtime()
        if self._log_option is not None:
            options = encode_arguments(rt, self._log_option, {})
            send_call(rt, [(rank, ref)], PROCESS_ACTOR, "log_option", options, want_reply=False)
        for spawned in self._spawned:
            own = spawned.ranks.get(rank)
            if own is not None:
                target = [(own, ref)]
                self._send_spawn(
                    rt, target, spawned.name, spawned.class_ref, spawned.args, spawned.kwargs, spawned.extent
                )

    def _actors_stopped(self, name: str, ranks: Iterable[int]) -> None:
        """The actor mesh ``name`` was stopped at its ``ranks``: a restart of their processes does not build it
        again."""
        gone = set(ranks)
        for spawned in self._spawned:
            if spawned.name == name:
                spawned.ranks = {root: own for root, own in spawned.ranks.items() if own not in gone}

    def _expect_exit(self) -> None:
        """Its processes were told to end by other means (an attached worker loop's shutdown): their deaths
        from now on are expected, not failures."""
        self.supervisor.stopping = True

    def stop(self, reason: str = "stopped by client", *, timeout: float = CLEANUP_TIMEOUT) -> Future[None]:
        """Run every actor's ``__cleanup__`` and end the processes (a no-op if already stopped).

        ``reason`` is Monarch's (its worker logs say why); ``timeout`` bounds each actor's ``__cleanup__``.

        The stop runs to its end whoever waits for it: an awaiter that gives
        up leaves it going, and a later ``stop()`` (or ``shutdown_context``)
        waits for the same run (its ``timeout`` is the first stop's).
        """
        if not isinstance(reason, str):
            raise TypeError(f"stop(reason) takes Monarch's reason, a str, not {reason!r} (the bound is timeout=)")
        if self._root is not self:
            raise ValueError(
                f"{self!r} is a slice of {self._root!r}: stop the proc mesh it was sliced from (a slice's processes "
                "are that mesh's, stopped with it)"
            )
        run = self._stop_run
        if run is None:
            rt = runtime()
            plan = self._stop_plan(rt, timeout)
            first = next(plan, None)  # eager: the stop request leaves now
            steps = itertools.chain([first], plan) if first is not None else plan
            run = self._stop_run = StopRun(rt, steps)
        return Future(run.wait, run.wait_sync)

    def _stop_plan(self, rt: Runtime, timeout: float) -> Iterator[StopStep]:
        """The stop sequence as (condition, time limit) steps, for async and sync waiting alike."""
        if self._stopped:
            return
        self.supervisor.stopping = True
        yield from stop_steps(rt, self._procs, timeout, self._kill_remote)
        self._stopped = True
        if self._logs is not None:
            self._logs.close()
        owner_actor = self.supervisor.owner_actor
        if owner_actor is not None and self._owned and rt.server is not None:
            rt.server.disown(owner_actor, self)  # stopped: the actor that spawned it lets it go

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled (``multiprocessing`` hands it to a child so): another program of the session can spawn on it.

        The copy is a handle, as one passed to an actor: its program spawns
        actors on these processes and owns them (they stop when it exits);
        this mesh's owner keeps supervising and stopping the processes. A
        program that unpickles it before using actors joins this session.
        """
        return (_proc_mesh_unpickled, (runtime().dir, _proc_mesh_state(self)))

    async def __aenter__(self) -> ProcMesh:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


def _proc_mesh_state(mesh: ProcMesh) -> list[Any]:
    registry = runtime().registry
    procs = [[ref.address, registry.resolve_pid(ref)] for ref in mesh._procs]
    return [mesh._name, list(mesh._extent.items()), procs]


def _proc_mesh_from_state(state: Any) -> ProcMesh:
    """A proc mesh received as an argument: spawn on it and stop it; its owner keeps supervising it."""
    if type(state) is not list or len(state) != 3:
        raise DecodeError("malformed proc mesh")
    name, extent, procs = state
    if type(name) is not str or type(procs) is not list:
        raise DecodeError("malformed proc mesh")
    dims = extent_from_wire(extent, "proc mesh")
    registry = runtime().registry
    refs = []
    for proc in procs:
        if type(proc) is not list or len(proc) != 2 or type(proc[0]) is not str:
            raise DecodeError("malformed proc mesh process")
        if not (proc[1] is None or type(proc[1]) is int):
            raise DecodeError("malformed proc mesh process")
        refs.append(registry.proc(proc[0], proc[1]))
    return ProcMesh(name, dims, refs, owned=False)


def _proc_mesh_unpickled(session_dir: str, state: Any) -> ProcMesh:
    """A proc mesh unpickled in another program (``multiprocessing``): that program joins its session first."""
    join_session(session_dir, "a pickled proc mesh")
    return _proc_mesh_from_state(state)


#: Kept on the runtime (``rt.parts``): the proc meshes this process spawned and still holds.
SPAWNED_MESHES: Part[weakref.WeakSet[ProcMesh]] = Part("spawned proc meshes", _mesh_set)

register_handle("proc_mesh", ProcMesh, _proc_mesh_state, _proc_mesh_from_state)
