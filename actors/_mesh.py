"""Meshes: ``ProcMesh`` (processes), ``ActorMesh`` (actor handles), and ``send``.

Every way of invoking an endpoint puts the message on the wire when it is
called; the returned :class:`Future` only waits for the answer.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import itertools
import os
import signal
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from . import _protocol as P
from . import _refs
from ._actor import Actor, _context, endpoints_of
from ._calls import PendingCall
from ._codec import register_handle
from ._errors import ActorDied, CallTimeout, DecodeError, SupervisionError
from ._future import Future
from ._liveness import ProcRef
from ._runtime import Runtime, runtime
from ._supervision import Failure, FailureHandler, escalate_to_controller, offer
from ._transport import incarnation_path, remove_socket_file, write_incarnation
from ._value_mesh import ValueMesh, coordinates
from ._worker import CLEANUP_TIMEOUT, HOST, escalate, supervise
from .tensors.shm import remove_segments

A = TypeVar("A", bound=Actor)

RESTART_MODES = ("never", "on-failure")


@dataclass(frozen=True)
class RestartPolicy:
    """When a proc mesh restarts a dead process: ``on-failure``, at most ``max_restarts`` per ``period`` s."""

    restart: str = "never"
    max_restarts: int = 3
    period: float = 60.0

    def __post_init__(self) -> None:
        if self.restart not in RESTART_MODES:
            raise ValueError(f"restart must be one of {RESTART_MODES}, not {self.restart!r}")
        if type(self.max_restarts) is not int or self.max_restarts < 1:
            raise ValueError(f"max_restarts must be a positive int, not {self.max_restarts!r}")
        if not self.period > 0:
            raise ValueError(f"the restart period must be positive, not {self.period!r}")


R = TypeVar("R")

__all__ = ["ActorMesh", "MeshEndpoint", "ProcMesh", "send"]


def _pending_future(rt: Runtime, pending: PendingCall, build: Callable[[dict[int, Any]], R], what: str) -> Future[R]:
    async def wait() -> R:
        return build(await rt.wait_pending(pending))

    def wait_sync(timeout: float | None) -> R:
        limit = timeout
        if pending.deadline is not None:
            left = max(0.0, pending.deadline - time.monotonic())
            limit = left if timeout is None else min(timeout, left)
        try:
            rt.wait(lambda: pending.done, timeout=limit, what=what)
        except CallTimeout:
            if pending.deadline is None or time.monotonic() < pending.deadline:
                raise  # the caller's own get(timeout) ran out; the call itself may still finish
            rt.expire_call(pending)
        if pending.error is not None:
            raise pending.error
        return build(pending.results)

    return Future(wait, wait_sync)


class MeshEndpoint(Generic[R]):
    """One endpoint of an actor mesh: ``call``, ``call_one``, ``choose``, ``broadcast``."""

    __slots__ = ("_mesh", "_name", "_timeout")

    def __init__(self, mesh: ActorMesh[Any], name: str, timeout: float | None = None) -> None:
        self._mesh = mesh
        self._name = name
        self._timeout = timeout

    def with_timeout(self, seconds: float | None) -> MeshEndpoint[R]:
        """This endpoint with a deadline on every call: waiting longer raises :class:`CallTimeout`.

        Overrides the endpoint's declared ``@endpoint(timeout=...)``; ``None`` removes it.
        """
        if seconds is not None and not seconds > 0:
            raise ValueError(f"a call's timeout must be positive, not {seconds!r}")
        return MeshEndpoint(self._mesh, self._name, seconds)

    def __repr__(self) -> str:
        return f"<endpoint {self._mesh._name}.{self._name}>"

    def _invoke(self, targets: list[tuple[int, ProcRef]], args: tuple[Any, ...], kwargs: dict[str, Any]) -> PendingCall:
        rt = runtime()
        pending = rt.on_thread(
            lambda: rt.call(targets, self._mesh._name, self._name, args, kwargs, want_reply=True, timeout=self._timeout)
        )
        assert pending is not None
        return pending  # type: ignore[no-any-return]

    def call(self, *args: Any, **kwargs: Any) -> Future[ValueMesh[R]]:
        """Invoke on every actor; the future holds a :class:`ValueMesh` of results."""
        mesh = self._mesh
        targets = mesh._targets()
        pending = self._invoke(targets, args, kwargs)
        extent = mesh._extent
        return _pending_future(
            runtime(),
            pending,
            lambda results: ValueMesh(extent, [results[r] for r, _ in targets]),
            f"{mesh._name}.{self._name}.call()",
        )

    def call_one(self, *args: Any, **kwargs: Any) -> Future[R]:
        """Invoke on the mesh's only actor (the mesh must hold exactly one)."""
        targets = self._mesh._targets()
        if len(targets) != 1:
            raise ValueError(
                f"call_one() needs a mesh of exactly one actor; {self._mesh._name!r} has {len(targets)} "
                "(use call(), choose(), or slice the mesh)"
            )
        return self._one(targets[0], args, kwargs, "call_one")

    def choose(self, *args: Any, **kwargs: Any) -> Future[R]:
        """Invoke on one actor of the mesh, chosen to spread the load."""
        return self._one(self._mesh._choose(), args, kwargs, "choose")

    def _one(self, target: tuple[int, ProcRef], args: tuple[Any, ...], kwargs: dict[str, Any], how: str) -> Future[R]:
        pending = self._invoke([target], args, kwargs)
        rank = target[0]
        return _pending_future(
            runtime(), pending, lambda results: results[rank], f"{self._mesh._name}.{self._name}.{how}()"
        )

    def broadcast(self, *args: Any, **kwargs: Any) -> None:
        """Invoke on every actor without waiting for (or receiving) results."""
        _send_now(self, self._mesh._targets(), args, kwargs, None)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(f"call endpoints through call(), call_one(), choose() or broadcast(): {self!r}")


def _send_now(
    ep: MeshEndpoint[Any], targets: list[tuple[int, ProcRef]], args: tuple[Any, ...], kwargs: dict[str, Any], port: Any
) -> None:
    rt = runtime()
    rt.on_thread(lambda: rt.call(targets, ep._mesh._name, ep._name, args, kwargs, want_reply=False, port=port))


def send(
    endpoint: MeshEndpoint[Any],
    args: tuple[Any, ...] = (),
    kwargs: dict[str, Any] | None = None,
    port: Any = None,
    selection: str = "all",
) -> None:
    """Fire-and-forget: invoke ``endpoint`` on every actor (``"all"``) or one (``"choose"``).

    With ``port``, each result is sent to that port; otherwise results are
    dropped and failures are reported to the actor's owner.
    """
    if not isinstance(endpoint, MeshEndpoint):
        raise TypeError(f"send() takes a mesh endpoint such as mesh.method, not {type(endpoint).__name__}")
    mesh = endpoint._mesh
    if selection == "all":
        targets = mesh._targets()
    elif selection == "choose":
        targets = [mesh._choose()]
    else:
        raise ValueError(f"selection must be 'all' or 'choose', not {selection!r}")
    _send_now(endpoint, targets, tuple(args), dict(kwargs or {}), port)


class ActorMesh(Generic[A]):
    """Handles to the actors of one ``spawn``; copy it freely into other actors."""

    def __init__(
        self,
        name: str,
        class_ref: str,
        endpoints: dict[str, float | None],
        extent: dict[str, int],
        targets: list[tuple[int, ProcRef]],
        ready: PendingCall | None = None,
        proc_mesh: ProcMesh | None = None,
    ) -> None:
        self._name = name
        self._proc_mesh = proc_mesh  # set where the mesh was spawned: its faults are checked here
        self._class_ref = class_ref
        self._endpoints = endpoints
        self._extent = extent
        self._targets_list = targets
        self._ready = ready
        self._next = itertools.count()

    def __getattr__(self, name: str) -> MeshEndpoint[Any]:
        endpoints = self.__dict__.get("_endpoints", {})
        if not name.startswith("__") and name in endpoints:
            return MeshEndpoint(self, name, endpoints[name])
        raise AttributeError(f"actor mesh {self.__dict__.get('_name')!r} has no endpoint {name!r}")

    def __repr__(self) -> str:
        return f"<ActorMesh {self._name} {self._class_ref} {self._extent}>"

    def __len__(self) -> int:
        return len(self._targets_list)

    @property
    def extent(self) -> dict[str, int]:
        return dict(self._extent)

    def size(self) -> int:
        return len(self._targets_list)

    def _targets(self) -> list[tuple[int, ProcRef]]:
        if self._proc_mesh is not None and self._proc_mesh._fault is not None:
            raise self._proc_mesh._fault
        return self._targets_list

    def _choose(self) -> tuple[int, ProcRef]:
        """Round-robin over the actors whose process is alive (or was restarted)."""
        targets = self._targets()
        rt = runtime()
        for _ in range(len(targets)):
            target = targets[next(self._next) % len(targets)]
            if rt.alive(target[1]):
                return target
        return targets[next(self._next) % len(targets)]

    def slice(self, **coords: int | slice) -> ActorMesh[A]:
        """The sub-mesh at ``coords`` (an index drops a dimension, a slice keeps it)."""
        unknown = set(coords) - set(self._extent)
        if unknown:
            raise KeyError(f"unknown dimension(s) {sorted(unknown)}; mesh has {list(self._extent)}")
        keep: list[tuple[int, ProcRef]] = []
        extent: dict[str, int] = {}
        ranges = {}
        for dim, size in self._extent.items():
            sel = coords.get(dim, slice(None))
            if isinstance(sel, int):
                if not -size <= sel < size:
                    raise IndexError(f"{dim}={sel} is outside a dimension of size {size}")
                ranges[dim] = [sel % size]
            else:
                ranges[dim] = list(range(size))[sel]
                extent[dim] = len(ranges[dim])
        for index, target in enumerate(self._targets_list):
            point = coordinates(index, self._extent)
            if all(point[dim] in ranges[dim] for dim in self._extent):
                keep.append(target)
        return ActorMesh(
            self._name,
            self._class_ref,
            self._endpoints,
            extent or {"procs": len(keep)},
            keep,
            self._ready,
            self._proc_mesh,
        )

    def stop(self) -> Future[None]:
        """Run ``__cleanup__`` on these actors and remove them (their processes stay)."""
        rt = runtime()
        alive = [t for t in self._targets_list if not t[1].dead]
        pending = rt.on_thread(lambda: rt.call(alive, HOST, "stop_actor", (self._name,), want_reply=True))
        return _pending_future(rt, pending, lambda results: None, f"stopping {self._name}")


def _mesh_state(mesh: ActorMesh[Any]) -> list[Any]:
    rt = runtime()
    procs = [[rank, ref.address, rt.pid_of(ref)] for rank, ref in mesh._targets_list]
    return [mesh._name, mesh._class_ref, list(mesh._endpoints.items()), list(mesh._extent.items()), procs]


def _mesh_from_state(state: Any) -> ActorMesh[Any]:
    if type(state) is not list or len(state) != 5:
        raise DecodeError("malformed actor mesh")
    name, class_ref, endpoints, extent, procs = state
    if type(name) is not str or type(class_ref) is not str or type(endpoints) is not list:
        raise DecodeError("malformed actor mesh")
    timeouts: dict[str, float | None] = {}
    for entry in endpoints:
        if type(entry) is not tuple or len(entry) != 2 or type(entry[0]) is not str:
            raise DecodeError("malformed actor mesh endpoint")
        if entry[1] is not None and type(entry[1]) is not float:
            raise DecodeError("malformed actor mesh endpoint timeout")
        timeouts[entry[0]] = entry[1]
    rt = runtime()
    targets = []
    for rank, address, pid in procs:
        if type(rank) is not int or type(address) is not str or type(pid) is not int:
            raise DecodeError("malformed actor mesh process")
        targets.append((rank, rt.proc(address, pid)))
    dims = {str(dim): int(size) for dim, size in extent}
    return ActorMesh(name, class_ref, timeouts, dims, targets)


register_handle("actor_mesh", ActorMesh, _mesh_state, _mesh_from_state)


_meshes_by_address: weakref.WeakValueDictionary[str, ProcMesh] = weakref.WeakValueDictionary()


class ProcMesh:
    """A group of actor processes; ``spawn`` actors on it, ``stop`` it when done."""

    def __init__(
        self,
        name: str,
        extent: dict[str, int],
        procs: list[ProcRef],
        restart: RestartPolicy | None = None,
        respawn: Callable[[int, ProcRef], None] | None = None,
    ) -> None:
        self._name = name
        self._restart = restart or RestartPolicy()
        self._respawn = respawn
        self._restart_times: collections.deque[float] = collections.deque()
        #: ``(name, class_ref, args, kwargs)`` of every spawn, replayed into a restarted process.
        self._spawned: list[tuple[str, str, tuple[Any, ...], dict[str, Any]]] = []
        #: How many times each rank's process has been restarted.
        self.restarts = [0] * len(procs)
        self._extent = dict(extent)
        self._procs = procs
        self._actors: dict[str, ActorMesh[Any]] = {}
        self._stopping = False
        self._stopped = False
        self._handlers: list[FailureHandler] = []
        self.failures: list[Failure] = []
        #: The actor that spawned this mesh (None in the controller): its ``__supervise__`` is asked.
        context = _context.get()
        self._owner_actor = context.name if context is not None else None
        self._fault: SupervisionError | None = None
        rt = runtime()
        for ref in procs:
            _meshes_by_address[ref.address] = self
        _install_owner_handlers(rt)

    def __repr__(self) -> str:
        return f"<ProcMesh {self._name} {self._extent}>"

    @property
    def extent(self) -> dict[str, int]:
        return dict(self._extent)

    def size(self) -> int:
        return len(self._procs)

    def __len__(self) -> int:
        return len(self._procs)

    @property
    def pids(self) -> list[int | None]:
        """The processes' pids (``None`` for one the forkserver has not reported yet)."""
        return [ref.pid for ref in self._procs]

    def spawn(self, name: str, actor_class: type[A], *args: Any, **kwargs: Any) -> ActorMesh[A]:
        """Construct ``actor_class(*args, **kwargs)`` in every process; returns at once."""
        if self._stopping:
            raise RuntimeError(f"proc mesh {self._name!r} is stopped")
        if not (isinstance(actor_class, type) and issubclass(actor_class, Actor)):
            raise TypeError(f"spawn() needs an Actor subclass, not {actor_class!r}")
        class_ref = _refs.qualified_name(actor_class)
        if "<locals>" in class_ref:
            raise TypeError(f"{class_ref} is defined inside a function; define actor classes at module level")
        if name in self._actors or name == HOST:
            raise ValueError(f"an actor named {name!r} already lives on this proc mesh")
        rt = runtime()
        targets = list(enumerate(self._procs))
        endpoint_timeouts = {ep_name: ep.timeout for ep_name, ep in endpoints_of(actor_class).items()}
        pending = rt.on_thread(lambda: self._send_spawn(rt, targets, name, class_ref, args, kwargs))
        mesh: ActorMesh[A] = ActorMesh(name, class_ref, endpoint_timeouts, self._extent, targets, pending, self)
        self._actors[name] = mesh
        self._spawned.append((name, class_ref, args, kwargs))
        return mesh

    def _send_spawn(
        self,
        rt: Runtime,
        targets: list[tuple[int, ProcRef]],
        name: str,
        class_ref: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> PendingCall | None:
        enc = rt.encoder
        enc.reset()
        ctor = enc.encode([list(args), kwargs])
        blob = enc.encode([[name, class_ref, self._extent, ctor], {}])
        return rt.call(targets, HOST, "spawn", want_reply=True, encoded=(blob, enc.frames, enc.handles))

    def add_failure_handler(self, handler: FailureHandler) -> None:
        """Offer ``handler(failure)`` each failure of this mesh's actors; a true return handles it."""
        self._handlers.append(handler)

    @property
    def fault(self) -> SupervisionError | None:
        """The unhandled failure that faulted this mesh, if any (later calls raise it)."""
        return self._fault

    def _report(self, failure: Failure, handled: bool = False) -> None:
        """Offer ``failure`` to every supervisor; escalate it if none handled it."""
        self.failures.append(failure)
        handled = offer(failure, self._handlers) or handled
        if self._owner_actor is not None:
            handled = supervise(self._owner_actor, failure) or handled
        if handled or self._stopping:
            return
        if self._owner_actor is not None:
            escalate(self._owner_actor, failure)
        elif self._fault is None:
            self._fault = escalate_to_controller(failure)

    def _on_death(self, ref: ProcRef) -> None:
        if self._stopping:
            return
        rank = self._procs.index(ref)
        names = ",".join(self._actors) or "(no actors)"
        pid = ref.pid or 0
        reason = ref.exit_reason or "process exited"
        restarting = self._may_restart()
        if restarting:
            self._restart_rank(rank, ref)
            reason += f"; restarted (restart {self.restarts[rank]} of rank {rank})"
        elif self._restart.restart == "on-failure":
            policy = self._restart
            reason += f"; not restarted: {policy.max_restarts} restarts within {policy.period:g}s already"
        self._report(Failure(names, rank, pid, "", "ActorDied", reason, restarted=restarting), handled=restarting)

    def _may_restart(self) -> bool:
        """Whether the policy allows one more restart now (and count it if so)."""
        policy = self._restart
        if policy.restart != "on-failure" or self._respawn is None:
            return False
        now = time.monotonic()
        times = self._restart_times
        while times and now - times[0] > policy.period:
            times.popleft()
        if len(times) >= policy.max_restarts:
            return False
        times.append(now)
        return True

    def _restart_rank(self, rank: int, ref: ProcRef) -> None:
        """A new process at the dead one's address, with every actor constructed again.

        In-flight calls already failed with ActorDied; calls made from now on
        queue for the new process, which runs them once its actors exist.
        """
        assert self._respawn is not None
        rt = runtime()
        remove_socket_file(ref.address)
        rt.revive(ref, None)
        self.restarts[rank] += 1
        self._respawn(rank, ref)
        rt.when_pid_known(ref, lambda: write_incarnation(rt.dir, ref.address, rt.pid_of(ref)))
        for name, class_ref, args, kwargs in self._spawned:
            pending = self._send_spawn(rt, [(rank, ref)], name, class_ref, args, kwargs)
            if pending is not None:
                pending.callbacks.append(functools.partial(self._respawned, name=name, rank=rank, ref=ref))

    def _respawned(self, call: PendingCall, name: str, rank: int, ref: ProcRef) -> None:
        error = call.error
        if error is None or isinstance(error, ActorDied):
            return  # constructed (or the new process died too: that death is reported on its own)
        etype = getattr(error, "exception_type", type(error).__name__)
        message = getattr(error, "message", str(error))
        tb = getattr(error, "remote_traceback", "")
        self._report(Failure(name, rank, ref.pid or 0, "__init__", etype, f"after a restart: {message}", tb))

    def stop(self, timeout: float = CLEANUP_TIMEOUT) -> Future[None]:
        """Run every actor's ``__cleanup__`` and end the processes (a no-op if already stopped)."""
        rt = runtime()
        plan = self._stop_plan(rt, timeout)
        first = next(plan, None)  # eager: the stop request leaves now
        if first is not None:
            plan = itertools.chain([first], plan)

        async def run() -> None:
            for condition, limit in plan:
                await rt.wait_until(condition, limit)

        def run_sync(_timeout: float | None) -> None:
            for condition, limit in plan:
                try:
                    rt.wait(condition, timeout=limit, what="processes to stop")
                except CallTimeout:
                    pass

        return Future(run, run_sync)

    def _stop_plan(self, rt: Runtime, timeout: float) -> Iterator[tuple[Callable[[], bool], float]]:
        """The stop sequence as (condition, time limit) steps, for async and sync waiting alike."""
        if self._stopped:
            return
        self._stopping = True
        procs = self._procs

        def all_dead() -> bool:
            return all(ref.dead for ref in procs)

        alive = [(rank, ref) for rank, ref in enumerate(procs) if not ref.dead]
        pending = None
        if alive:
            try:
                pending = rt.on_thread(lambda: rt.call(alive, HOST, "stop", (timeout,), want_reply=True))
            except ActorDied:
                pending = None
        if pending is not None:
            yield (lambda: pending.done or all_dead()), timeout + 2.0
        yield all_dead, 3.0
        for ref in procs:
            if not ref.dead and ref.pid is not None:
                try:
                    os.kill(ref.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        yield all_dead, 2.0
        for ref in procs:
            remove_socket_file(ref.address)
            with contextlib.suppress(FileNotFoundError):
                os.remove(incarnation_path(rt.dir, ref.address))
        self._stopped = True

    async def __aenter__(self) -> ProcMesh:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


def _install_owner_handlers(rt: Runtime) -> None:
    """Receive failure reports and deaths of processes this process spawned (once per runtime)."""
    if P.OP_FAILURE in rt.control_handlers:
        return

    def on_failure(arg: Any, frames: list[Any], address: str, pid: int) -> None:
        if type(arg) is not list or len(arg) != 7:
            raise DecodeError("malformed failure report")
        actor, rank, fpid, method, etype, message, tb = arg
        failure = Failure(str(actor), int(rank), int(fpid), str(method), str(etype), str(message), str(tb))
        mesh = _meshes_by_address.get(address)
        if mesh is not None:
            mesh._report(failure)
        else:
            offer(failure, [])

    def on_death(ref: ProcRef) -> None:
        mesh = _meshes_by_address.get(ref.address)
        if mesh is not None:
            if ref.pid is not None:  # weights it published die with it
                remove_segments(rt.session, ref.pid)
            mesh._on_death(ref)

    rt.control_handlers[P.OP_FAILURE] = on_failure
    rt.death_callbacks.append(on_death)
