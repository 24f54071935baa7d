"""``ActorMesh`` (handles to the actors of one spawn), its endpoints, and ``send``.

Every way of invoking an endpoint puts the message on the wire when it is
called; the returned :class:`Future` only waits for the answer. An actor
mesh is a handle: it can be passed to other actors in any process, and it
works there.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, Generic, Literal, ParamSpec, TypeVar

from .._hosting._actor import Actor
from .._runtime._call_sender import Through, encode_arguments, pending_future, send_call
from .._runtime._core import runtime
from .._runtime._future import Future
from .._runtime._pending_calls import PendingCall
from .._runtime._port import Port
from .._runtime._value_mesh import Shaped, ValueMesh, extent_from_wire, flattened, select, split_extent
from .._shared._errors import ActorDied, DecodeError, SupervisionError, actor_stopped
from .._shared._liveness import ProcRef
from .._shared._names import MeshName, shown
from .._wire._codec import register_handle
from .._wire._records import PROCESS_ACTOR

if TYPE_CHECKING:
    from ._proc_mesh import ProcMesh

__all__ = ["ActorMesh", "MeshEndpoint", "Selection", "check_endpoint_names", "send"]

A = TypeVar("A", bound=Actor)
P = ParamSpec("P")
R = TypeVar("R")

#: Who a fire-and-forget ``send`` reaches: every actor, or one chosen to spread the load.
Selection = Literal["all", "choose"]


class MeshEndpoint(Generic[P, R]):
    """One endpoint of an actor mesh: ``call``, ``call_one``, ``choose``, ``broadcast``."""

    __slots__ = ("_mesh", "_name", "_timeout")

    def __init__(self, mesh: ActorMesh[Any], name: str, timeout: float | None = None) -> None:
        self._mesh = mesh
        self._name = name
        self._timeout = timeout

    def with_timeout(self, seconds: float | None) -> MeshEndpoint[P, R]:
        """This endpoint with a deadline on every call: waiting longer raises :class:`CallTimeout`.

        Overrides the endpoint's declared ``@endpoint(timeout=...)``; ``None`` removes it.
        """
        if seconds is not None and not seconds > 0:
            raise ValueError(f"a call's timeout must be positive, not {seconds!r}")
        return MeshEndpoint(self._mesh, self._name, seconds)

    def __repr__(self) -> str:
        return f"<endpoint {shown(self._mesh._name)}.{self._name}>"

    def _invoke(self, targets: list[tuple[int, ProcRef]], args: tuple[Any, ...], kwargs: dict[str, Any]) -> PendingCall:
        rt = runtime()

        def send() -> PendingCall | None:
            encoded = encode_arguments(rt, args, kwargs)
            mesh = self._mesh
            return send_call(
                rt,
                targets,
                mesh._name,
                self._name,
                encoded,
                want_reply=True,
                timeout=self._timeout,
                class_ref=mesh._class_ref,
                through=mesh._through(targets),
            )

        pending = rt.driver.on_thread(send)
        assert pending is not None
        return pending  # type: ignore[no-any-return]

    def call(self, *args: P.args, **kwargs: P.kwargs) -> Future[ValueMesh[R]]:
        """Invoke on every actor; the future holds a :class:`ValueMesh` of results."""
        mesh = self._mesh
        targets = mesh._targets()
        pending = self._invoke(targets, args, kwargs)
        extent = mesh._extent
        return pending_future(
            runtime(),
            pending,
            lambda results: ValueMesh(extent, [results[r] for r, _ in targets]),
            f"{shown(mesh._name)}.{self._name}.call()",
        )

    def call_one(self, *args: P.args, **kwargs: P.kwargs) -> Future[R]:
        """Invoke on the mesh's only actor (the mesh must hold exactly one)."""
        targets = self._mesh._targets()
        if len(targets) != 1:
            raise ValueError(
                f"call_one() needs a mesh of exactly one actor; {shown(self._mesh._name)!r} has {len(targets)} "
                "(use call(), choose(), or slice the mesh)"
            )
        return self._one(targets[0], args, kwargs, "call_one")

    def choose(self, *args: P.args, **kwargs: P.kwargs) -> Future[R]:
        """Invoke on one actor of the mesh, chosen to spread the load."""
        return self._one(self._mesh._choose(), args, kwargs, "choose")

    def _one(self, target: tuple[int, ProcRef], args: tuple[Any, ...], kwargs: dict[str, Any], how: str) -> Future[R]:
        pending = self._invoke([target], args, kwargs)
        rank = target[0]
        return pending_future(
            runtime(), pending, lambda results: results[rank], f"{shown(self._mesh._name)}.{self._name}.{how}()"
        )

    def stream(self, *args: P.args, **kwargs: P.kwargs) -> Iterator[Future[R]]:
        """Invoke on every actor now; yields one future per actor (in rank order) to await as wanted."""
        futures = [self._one(target, args, kwargs, "stream") for target in self._mesh._targets()]
        return iter(futures)

    def rref(self, *args: Any, **kwargs: Any) -> Any:
        """Monarch's tensor-engine remote reference: not offered (there is no tensor engine here)."""
        raise NotImplementedError(
            f"{self!r}.rref() needs Monarch's tensor engine, which actors does not have; "
            "use call()/call_one() and move tensors as results or through actors.weights"
        )

    def broadcast(self, *args: P.args, **kwargs: P.kwargs) -> None:
        """Invoke on every actor without waiting for (or receiving) results."""
        _send_now(self, self._mesh._targets(), args, kwargs, None)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(f"call endpoints through call(), call_one(), choose() or broadcast(): {self!r}")


def _send_now(
    ep: MeshEndpoint[Any, Any],
    targets: list[tuple[int, ProcRef]],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    port: Any,
) -> None:
    rt = runtime()

    def send() -> None:
        encoded = encode_arguments(rt, args, kwargs)
        mesh = ep._mesh
        send_call(
            rt,
            targets,
            mesh._name,
            ep._name,
            encoded,
            want_reply=False,
            port=port,
            class_ref=mesh._class_ref,
            through=mesh._through(targets),
        )

    rt.driver.on_thread(send)


def send(
    endpoint: MeshEndpoint[Any, Any],
    args: tuple[Any, ...] = (),
    kwargs: dict[str, Any] | None = None,
    port: Any = None,
    selection: Selection = "all",
) -> None:
    """Fire-and-forget: invoke ``endpoint`` on every actor (``"all"``) or one (``"choose"``).

    With ``port``, each result is sent to that port; otherwise results are
    dropped and failures are reported to the actor's owner.
    """
    if not isinstance(endpoint, MeshEndpoint):
        raise TypeError(f"send() takes a mesh endpoint such as mesh.method, not {type(endpoint).__name__}")
    if port is not None and not isinstance(port, Port):  # (the receiver would drop the whole call)
        raise TypeError(f"send(port=...) takes a Port (from Channel.open()), not {type(port).__name__}")
    mesh = endpoint._mesh
    if selection == "all":
        targets = mesh._targets()
    elif selection == "choose":
        targets = [mesh._choose()]
    else:
        raise ValueError(f"selection must be 'all' or 'choose', not {selection!r}")
    _send_now(endpoint, targets, tuple(args), dict(kwargs or {}), port)


class _Life:
    """What the views of one mesh handle share: the ranks stopped through it, and ``choose``'s turn over each set
    of ranks (a slice taken afresh each time still takes turns; two slices each take their own)."""

    __slots__ = ("stopped", "turns")

    def __init__(self) -> None:
        self.stopped: set[int] = set()
        self.turns: dict[tuple[int, ...], itertools.count[int]] = {}

    def turn(self, targets: list[tuple[int, ProcRef]]) -> itertools.count[int]:
        """The turn counter of the views over ``targets``' ranks."""
        ranks = tuple(rank for rank, _ in targets)
        counter = self.turns.get(ranks)
        if counter is None:
            if len(self.turns) >= _MAX_TURNS:  # (a program slicing a large mesh every which way)
                self.turns.clear()
            counter = self.turns[ranks] = itertools.count()
        return counter


#: The rank sets whose ``choose`` turns a mesh handle keeps.
_MAX_TURNS = 1024


class ActorMesh(Shaped, Generic[A]):
    """Handles to the actors of one ``spawn``; copy it freely into other actors."""

    __slots__ = (
        "__weakref__",
        "_class_ref",
        "_endpoints",
        "_extent",
        "_life",
        "_name",
        "_next",
        "_proc_mesh",
        "_spawn_call",
        "_targets_list",
    )

    def __init__(
        self,
        name: str,
        class_ref: str,
        endpoints: dict[str, float | None],
        extent: dict[str, int],
        targets: list[tuple[int, ProcRef]],
        proc_mesh: ProcMesh | None = None,
    ) -> None:
        self._name = MeshName(name)  # (``await mesh._name`` reads as in Monarch)
        self._proc_mesh = proc_mesh  # set where the mesh was spawned: its faults are checked here
        self._class_ref = class_ref
        self._endpoints = endpoints
        self._extent = extent
        self._targets_list = targets
        self._life = _Life()  # shared with every slice of this mesh
        self._next = self._life.turn(targets)
        self._spawn_call: PendingCall | None = None  # where this mesh was spawned: its constructors' answers

    def __getattr__(self, name: str) -> MeshEndpoint[Any, Any]:
        # (called only for a name that is no attribute: an endpoint's; a slot not set yet is none)
        if name.startswith("__") or name in ActorMesh.__slots__:
            raise AttributeError(name)
        endpoints = self._endpoints
        if name in endpoints:
            return MeshEndpoint(self, name, endpoints[name])
        raise AttributeError(f"actor mesh {shown(self._name)!r} has no endpoint {name!r}")

    def __repr__(self) -> str:
        return f"<ActorMesh {self._name} {self._class_ref} {self._extent}>"

    def __len__(self) -> int:
        return len(self._targets_list)

    @property
    def initialized(self) -> Future[None]:
        """Resolves once every actor is constructed (raises :class:`SpawnError` if one failed).

        On a mesh received from another process it resolves at once.
        """
        pending = self._spawn_call
        if pending is None:
            return Future.ready(None)
        return pending_future(runtime(), pending, lambda results: None, f"{shown(self._name)}.initialized")

    def _targets(self) -> list[tuple[int, ProcRef]]:
        """Every actor of this mesh; ``SupervisionError`` if one was stopped (or the mesh faulted)."""
        targets = self._reachable()
        stopped = self._life.stopped
        if stopped and any(rank in stopped for rank, _ in targets):
            raise SupervisionError(actor_stopped(self._name))
        return targets

    def _reachable(self) -> list[tuple[int, ProcRef]]:
        """Every actor of this mesh, unless its proc mesh faulted or stops."""
        proc_mesh = self._proc_mesh
        if proc_mesh is not None:
            fault = proc_mesh.fault
            if fault is not None:
                raise fault.with_traceback(None)  # (raised again and again: each raise would add its frames)
            if proc_mesh.stopping:  # (an ActorDied, which code waiting out a shutdown already expects)
                raise ActorDied(
                    f"actor mesh is stopped due to proc mesh shutdown: {shown(self._name)} was spawned on {proc_mesh!r}"
                )
        return self._targets_list

    def _through(self, targets: list[tuple[int, ProcRef]]) -> Through:
        """This mesh's shape and each of ``targets``' index in it: where a call through it finds its target
        (Monarch's ``message_rank``: on a slice, the actor's place in the slice, not in the mesh it was spawned as)."""
        listed = self._targets_list
        positions = list(range(len(listed))) if targets is listed else [listed.index(t) for t in targets]
        return self._extent, positions  # (a plain dict: the codec packs it as it is)

    def _choose(self) -> tuple[int, ProcRef]:
        """Round-robin over the actors not stopped whose process is alive (or was restarted)."""
        targets = self._reachable()
        stopped = self._life.stopped
        if stopped:
            targets = [target for target in targets if target[0] not in stopped]
            if not targets and self._targets_list:
                raise SupervisionError(actor_stopped(self._name))
        if not targets:
            raise ValueError(f"actor mesh {shown(self._name)!r} is empty: there is no actor to choose")
        driver = runtime().driver
        registry = runtime().registry
        for _ in range(len(targets)):
            target = targets[next(self._next) % len(targets)]
            # (a dead one may have been restarted: finding out updates the registry, on the runtime's thread)
            ref = target[1]
            if not ref.dead or driver.on_thread(functools.partial(registry.alive, ref)):
                return target
        return targets[next(self._next) % len(targets)]

    def slice(self, **coords: int | slice) -> ActorMesh[A]:
        """The sub-mesh at ``coords`` (an index drops a dimension, a slice keeps it)."""
        ranks, extent = select(self._extent, coords)
        return self._view(extent, [self._targets_list[r] for r in ranks])

    def flatten(self, dim: str) -> ActorMesh[A]:
        """The same actors along one dimension named ``dim``."""
        return self._view(flattened(self._extent, dim), list(self._targets_list))

    def split(self, **changes: object) -> ActorMesh[A]:
        """The same actors with dimensions split, as Monarch's (``split(host=("dp", "pp"), pp=2)``)."""
        return self._view(split_extent(self._extent, changes), list(self._targets_list))

    def rename(self, **names: str) -> ActorMesh[A]:
        """The same actors with dimensions renamed (``rename(host="dp", gpu="tp")``)."""
        return self.split(**{old: (new,) for old, new in names.items()})

    def _view(self, extent: dict[str, int], targets: list[tuple[int, ProcRef]]) -> ActorMesh[A]:
        view: ActorMesh[A] = ActorMesh(self._name, self._class_ref, self._endpoints, extent, targets, self._proc_mesh)
        view._life = self._life
        view._spawn_call = self._spawn_call
        view._next = self._life.turn(targets)  # choose() on a slice taken afresh each time still takes turns
        return view

    def stop(self, reason: str = "stopped by client") -> Future[None]:
        """Run ``__cleanup__`` on these actors and remove them (their processes stay); ``reason`` is Monarch's.

        Stopping a slice stops its actors only: the others answer on, and
        calls that would reach a stopped one raise ``SupervisionError``.
        """
        rt = runtime()
        ranks = [rank for rank, _ in self._targets_list]
        self._life.stopped.update(ranks)

        def stop() -> PendingCall | None:
            if self._proc_mesh is not None:  # (on the runtime's thread, as a restart's replay: one or the other first)
                self._proc_mesh._actors_stopped(self._name, ranks)
            # (those alive are picked on the runtime's thread, as the call is sent: a call is sent to all or none)
            alive = [t for t in self._targets_list if not t[1].dead]
            encoded = encode_arguments(rt, (self._name,), {})
            return send_call(rt, alive, PROCESS_ACTOR, "stop_actor", encoded, want_reply=True)

        pending = rt.driver.on_thread(stop)
        return pending_future(rt, pending, lambda results: None, f"stopping {shown(self._name)}")


def check_endpoint_names(cls: type, endpoints: Iterable[str]) -> None:
    """Refuse (``ValueError``, as Monarch does) an endpoint that an actor mesh's own attribute would hide."""
    hidden = sorted(name for name in endpoints if hasattr(ActorMesh, name))
    if hidden:
        raise ValueError(
            f"ActorMesh has an attribute that collides with an endpoint name: {', '.join(hidden)} "
            f"(of {cls.__qualname__}); rename the endpoint"
        )


def _mesh_state(mesh: ActorMesh[Any]) -> list[Any]:
    registry = runtime().registry
    procs = [[rank, ref.address, registry.resolve_pid(ref)] for rank, ref in mesh._targets_list]
    return [mesh._name, mesh._class_ref, list(mesh._endpoints.items()), list(mesh._extent.items()), procs]


def _mesh_from_state(state: Any) -> ActorMesh[Any]:
    if type(state) is not list or len(state) != 5:
        raise DecodeError("malformed actor mesh")
    name, class_ref, endpoints, extent, procs = state
    if type(name) is not str or type(class_ref) is not str or type(endpoints) is not list or type(procs) is not list:
        raise DecodeError("malformed actor mesh")
    timeouts: dict[str, float | None] = {}
    for entry in endpoints:
        if type(entry) is not tuple or len(entry) != 2 or type(entry[0]) is not str:
            raise DecodeError("malformed actor mesh endpoint")
        if entry[1] is not None and type(entry[1]) is not float:
            raise DecodeError("malformed actor mesh endpoint timeout")
        timeouts[entry[0]] = entry[1]
    registry = runtime().registry
    targets = []
    for proc in procs:
        if type(proc) is not list or len(proc) != 3:
            raise DecodeError("malformed actor mesh process")
        rank, address, pid = proc
        if type(rank) is not int or type(address) is not str or not (pid is None or type(pid) is int):
            raise DecodeError("malformed actor mesh process")
        targets.append((rank, registry.proc(address, pid)))
    return ActorMesh(name, class_ref, timeouts, extent_from_wire(extent, "actor mesh"), targets)


register_handle("actor_mesh", ActorMesh, _mesh_state, _mesh_from_state)
