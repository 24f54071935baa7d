"""``Actor`` and ``@endpoint``: the user's side of an actor class.

An actor is a plain class deriving from :class:`Actor`; its ``@endpoint``
methods can be invoked from any process through an actor mesh. Async
endpoints run as tasks on the actor's event loop (so several run
concurrently); plain ``def`` endpoints run on a worker thread so they never
freeze the process's message pump.

Typing follows Monarch: ``proc_mesh.spawn(name, Cls)`` is typed as ``Cls``,
and an endpoint read from it is a ``MeshEndpoint[P, R]`` carrying the
method's parameters and result, so ``await mesh.add.call_one(1, 2)`` is
checked against ``add``'s signature. (At run time the mesh is an
:class:`~actors.ActorMesh`; inside the actor, ``self.add`` is the plain
bound method.)
"""

from __future__ import annotations

import contextvars
import inspect
import types
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Generic, Literal, ParamSpec, Protocol, TypeVar, overload

from ._value_mesh import Point

if TYPE_CHECKING:
    from typing import Concatenate

    from typing_extensions import Self

    from ._actor_mesh import MeshEndpoint
    from ._future import Future
    from ._supervision import Failure

__all__ = ["Actor", "Endpoint", "current_rank", "current_size", "endpoint"]

P = ParamSpec("P")
R = TypeVar("R")
R_co = TypeVar("R_co", covariant=True)


class Actor:
    """Base class of actors. Override ``__cleanup__`` to release what the actor owns."""

    async def __cleanup__(self, exc: BaseException | None) -> None:
        """Called once when the actor stops (``exc`` is None for a normal stop)."""

    def __supervise__(self, failure: Failure) -> bool:
        """Called when an actor this one spawned fails; return True once handled.

        The default handles nothing: the failure escalates to this actor's
        own owner, reported as a failure of this actor.
        """
        return False

    if TYPE_CHECKING:  # what a spawned mesh, typed as its actor class, offers (see ActorMesh)

        def slice(self, **coords: int | slice) -> Self: ...
        def stop(self) -> Future[None]: ...
        def size(self) -> int: ...
        def __len__(self) -> int: ...
        @property
        def extent(self) -> dict[str, int]: ...


class Endpoint(Generic[P, R]):
    """A method marked with ``@endpoint``: callable remotely through a mesh."""

    def __init__(self, fn: Callable[..., Any], timeout: float | None = None) -> None:
        if not callable(fn):
            raise TypeError("@endpoint decorates a method")
        if timeout is not None and not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ValueError(f"an endpoint's timeout must be a positive number of seconds, not {timeout!r}")
        self.fn = fn
        #: Default deadline (seconds) of calls to this endpoint; None waits as long as the actor lives.
        self.timeout = None if timeout is None else float(timeout)
        self.name = fn.__name__
        self.is_async = inspect.iscoroutinefunction(fn)
        self.__doc__ = fn.__doc__
        self.__wrapped__ = fn

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, owner: type) -> Endpoint[P, R]: ...
    @overload
    def __get__(self, obj: object, owner: type) -> MeshEndpoint[P, R]: ...
    def __get__(self, obj: object | None, owner: type) -> Any:
        if obj is None:
            return self
        return types.MethodType(self.fn, obj)  # inside the actor: the plain method


class _EndpointDecorator(Protocol):
    """``@endpoint(...)`` with options: takes the method, gives the endpoint."""

    @overload
    def __call__(self, fn: Callable[Concatenate[Any, P], Awaitable[R_co]]) -> Endpoint[P, R_co]: ...
    @overload
    def __call__(self, fn: Callable[Concatenate[Any, P], R_co]) -> Endpoint[P, R_co]: ...


@overload
def endpoint(fn: Callable[Concatenate[Any, P], Awaitable[R]]) -> Endpoint[P, R]: ...
@overload
def endpoint(fn: Callable[Concatenate[Any, P], R]) -> Endpoint[P, R]: ...
@overload
def endpoint(
    fn: None = None,
    *,
    timeout: float | None = None,
    propagate: Any = None,
    explicit_response_port: Literal[False] = False,
) -> _EndpointDecorator: ...
def endpoint(fn: Any = None, **options: Any) -> Any:
    """Mark an actor method as an endpoint (``@endpoint`` or ``@endpoint(...)``).

    ``@endpoint(timeout=seconds)`` gives every call to it a deadline: a caller
    waiting longer gets :class:`CallTimeout` (see ``MeshEndpoint.with_timeout``).
    """
    unknown = set(options) - {"propagate", "explicit_response_port", "timeout"}
    if unknown:
        raise TypeError(f"unknown endpoint option(s): {', '.join(sorted(unknown))}")
    if options.get("explicit_response_port"):
        raise NotImplementedError("explicit_response_port endpoints are not supported")
    timeout = options.get("timeout")
    if fn is None:
        return lambda f: Endpoint(f, timeout)
    return Endpoint(fn, timeout)


def endpoints_of(cls: type) -> dict[str, Endpoint[Any, Any]]:
    """Every endpoint an actor class defines or inherits, by name."""
    found: dict[str, Endpoint[Any, Any]] = {}
    for klass in reversed(cls.__mro__):
        for name, value in vars(klass).items():
            if isinstance(value, Endpoint):
                found[name] = value
            elif name in found:
                del found[name]
    return found


class ActorContext:
    """Where the running code is: which actor, which rank, in which mesh shape."""

    __slots__ = ("extent", "name", "rank")

    def __init__(self, name: str, rank: int, extent: dict[str, int]) -> None:
        self.name = name
        self.rank = rank
        self.extent = extent


_context: contextvars.ContextVar[ActorContext | None] = contextvars.ContextVar("actors_context", default=None)


def current_rank() -> Point:
    """The rank of the actor whose code is running (rank 0 in the controller)."""
    ctx = _context.get()
    if ctx is None:
        return Point(0, {"procs": 1})
    return Point(ctx.rank, ctx.extent)


def current_size() -> dict[str, int]:
    """The extent of the mesh of the running actor (``{}`` in the controller)."""
    ctx = _context.get()
    return dict(ctx.extent) if ctx is not None else {}
