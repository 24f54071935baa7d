"""``Accumulator``: fold the results of one endpoint called on every actor of a mesh."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

from .._runtime._future import Future
from ._actor_mesh import MeshEndpoint

__all__ = ["Accumulator"]

R = TypeVar("R")
A = TypeVar("A")


class Accumulator(Generic[R, A]):
    """``Accumulator(mesh.endpoint, identity, combine).accumulate(*args)``: ``combine`` over every result.

    The fold starts from ``identity`` and takes the results in rank order,
    so a non-commutative ``combine`` gives the same answer every time.
    """

    def __init__(self, endpoint: MeshEndpoint[Any, R], identity: A, combine: Callable[[A, R], A]) -> None:
        if not isinstance(endpoint, MeshEndpoint):
            raise TypeError(f"Accumulator takes a mesh endpoint such as mesh.method, not {type(endpoint).__name__}")
        if not callable(combine):
            raise TypeError(f"combine must be callable, not {type(combine).__name__}")
        self._endpoint = endpoint
        self._identity = identity
        self._combine = combine

    def accumulate(self, *args: Any, **kwargs: Any) -> Future[A]:
        """Call the endpoint on every actor now; the future holds the folded result."""
        identity, combine = self._identity, self._combine

        def fold(results: Any) -> A:
            value = identity
            for result in results.values():
                value = combine(value, result)
            return value

        return self._endpoint.call(*args, **kwargs).then(fold)
