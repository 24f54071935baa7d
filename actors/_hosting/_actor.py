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

import inspect
import logging
import types
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Generic, Literal, ParamSpec, Protocol, TypeVar, overload

if TYPE_CHECKING:
    from typing import Concatenate

    from typing_extensions import Self

    from .._meshes._actor_mesh import MeshEndpoint
    from .._runtime._future import Future
    from .._runtime._port import Port
    from .._runtime._supervision import Failure

__all__ = ["Actor", "Endpoint", "check_actor_class", "concurrent_endpoint", "endpoint", "is_sync_actor"]

P = ParamSpec("P")
R = TypeVar("R")
R_co = TypeVar("R_co", covariant=True)


class Actor:
    """Base class of actors. Override ``__cleanup__`` to release what the actor owns."""

    @property
    def logger(self) -> logging.Logger:
        """A logger named after the actor's class (Monarch's ``self.logger``)."""
        return logging.getLogger(f"{type(self).__module__}.{type(self).__qualname__}")

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

    def __init__(
        self,
        fn: Callable[..., Any],
        timeout: float | None = None,
        *,
        explicit_response_port: bool = False,
        concurrent: bool = False,
    ) -> None:
        if not callable(fn):
            raise TypeError("@endpoint decorates a method")
        if timeout is not None and not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ValueError(f"an endpoint's timeout must be a positive number of seconds, not {timeout!r}")
        self.fn = fn
        #: Default deadline (seconds) of calls to this endpoint; None waits as long as the actor lives.
        self.timeout = None if timeout is None else float(timeout)
        self.name = fn.__name__
        self.is_async = inspect.iscoroutinefunction(fn)
        #: The method takes the caller's reply port as its first argument and answers through it.
        self.explicit_response_port = bool(explicit_response_port)
        #: Declared with ``@concurrent_endpoint`` (every async endpoint runs concurrently here).
        self.concurrent = concurrent
        if concurrent and not self.is_async:
            raise ValueError(
                f"@concurrent_endpoint can only wrap async endpoints (an async method); {self.name} is a plain def"
            )
        self.__doc__ = fn.__doc__
        self.__wrapped__ = fn

    @property
    def _explicit_response_port(self) -> bool:
        """Monarch's attribute name for :attr:`explicit_response_port`."""
        return self.explicit_response_port

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


class _PortEndpointDecorator(Protocol):
    """``@endpoint(explicit_response_port=True)``: the method's first argument is the reply port."""

    def __call__(self, fn: Callable[Concatenate[Any, Port[R_co], P], object]) -> Endpoint[P, R_co]: ...


_OPTIONS = frozenset({"propagate", "explicit_response_port", "timeout", "instrument"})


def _make(fn: Any, options: dict[str, Any], concurrent: bool) -> Any:
    unknown = set(options) - _OPTIONS
    if unknown:
        raise TypeError(f"unknown endpoint option(s): {', '.join(sorted(unknown))}")
    timeout = options.get("timeout")
    port = bool(options.get("explicit_response_port"))

    def make(f: Any) -> Endpoint[Any, Any]:
        if isinstance(f, Endpoint):
            raise ValueError(
                "concurrent_endpoint does not wrap @endpoint; pass endpoint options to @concurrent_endpoint"
                if concurrent
                else f"{f.name} is already an endpoint"
            )
        return Endpoint(f, timeout, explicit_response_port=port, concurrent=concurrent)

    return make if fn is None else make(fn)


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
    instrument: bool = True,
    explicit_response_port: Literal[False] = False,
) -> _EndpointDecorator: ...
@overload
def endpoint(
    fn: None = None,
    *,
    timeout: float | None = None,
    propagate: Any = None,
    instrument: bool = True,
    explicit_response_port: Literal[True],
) -> _PortEndpointDecorator: ...
def endpoint(fn: Any = None, **options: Any) -> Any:
    """Mark an actor method as an endpoint (``@endpoint`` or ``@endpoint(...)``).

    ``@endpoint(timeout=seconds)`` gives every call to it a deadline: a caller
    waiting longer gets :class:`CallTimeout` (see ``MeshEndpoint.with_timeout``).
    ``@endpoint(explicit_response_port=True)`` passes the caller's reply port
    as the first argument: the method answers with ``port.send(value)`` or
    ``port.exception(exc)``, now or later (see :class:`~actors.ResponsePort`).
    ``propagate`` and ``instrument`` are accepted for Monarch compatibility
    and have no effect.
    """
    return _make(fn, options, concurrent=False)


@overload
def concurrent_endpoint(fn: Callable[Concatenate[Any, P], Awaitable[R]]) -> Endpoint[P, R]: ...
@overload
def concurrent_endpoint(
    fn: None = None,
    *,
    timeout: float | None = None,
    propagate: Any = None,
    instrument: bool = True,
    explicit_response_port: Literal[False] = False,
) -> _EndpointDecorator: ...
@overload
def concurrent_endpoint(
    fn: None = None,
    *,
    timeout: float | None = None,
    propagate: Any = None,
    instrument: bool = True,
    explicit_response_port: Literal[True],
) -> _PortEndpointDecorator: ...
def concurrent_endpoint(fn: Any = None, **options: Any) -> Any:
    """An async endpoint whose calls run as concurrent tasks (Monarch's opt-in; here every async endpoint does).

    Takes ``@endpoint``'s options; refuses to wrap an ``@endpoint`` and a
    plain ``def`` with ``ValueError``, as Monarch does.
    """
    return _make(fn, options, concurrent=True)


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


def _overridden(cls: type, name: str) -> Callable[..., Any] | None:
    """``cls``'s ``name`` hook if a subclass defines it (None when only :class:`Actor`'s default is there)."""
    hook = getattr(cls, name, None)
    return None if hook is None or hook is getattr(Actor, name, None) else hook


def is_sync_actor(cls: type) -> bool:
    """A synchronous actor: at least one endpoint, every one a plain ``def`` (Monarch's rule)."""
    eps = endpoints_of(cls)
    return bool(eps) and not any(ep.is_async for ep in eps.values())


def check_actor_class(cls: type) -> None:
    """Refuse (``ValueError``) a class whose endpoints and hooks mix sync and async code, as Monarch does.

    An actor with only plain ``def`` endpoints is *synchronous*: its calls
    run one at a time on the actor's own thread, so an ``async`` endpoint,
    ``__cleanup__`` or ``__supervise__`` beside them would have no loop to
    run on. An async actor's ``__cleanup__`` must be async too.
    """
    eps = endpoints_of(cls)
    sync = sorted(name for name, ep in eps.items() if not ep.is_async)
    asynchronous = sorted(name for name, ep in eps.items() if ep.is_async)
    if sync and asynchronous:
        raise ValueError(
            f"{cls.__qualname__} mixes both async and sync endpoints (sync: {sync}, async: {asynchronous}); "
            "make them all `def` (run one at a time on the actor's thread) or all `async def`"
        )
    cleanup = _overridden(cls, "__cleanup__")
    supervise = _overridden(cls, "__supervise__")
    if sync and cleanup is not None and inspect.iscoroutinefunction(cleanup):
        raise ValueError(f"{cls.__qualname__} has sync endpoints but an async __cleanup__; make it a plain def")
    if asynchronous and cleanup is not None and not inspect.iscoroutinefunction(cleanup):
        raise ValueError(f"{cls.__qualname__} has async endpoints but a synchronous __cleanup__; make it async")
    if sync and supervise is not None and inspect.iscoroutinefunction(supervise):
        raise ValueError(f"{cls.__qualname__} has sync endpoints but an async __supervise__; make it a plain def")
