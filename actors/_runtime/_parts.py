"""Per-process state that a layer above the runtime owns, kept on the runtime under that layer's typed key.

The runtime does not know what spawns processes or looks up controllers;
those layers keep their per-process state here, each under a :class:`Part`
defined in the owning module (``FORKSERVERS`` in ``_processes._forkserver``,
``CONTROLLERS`` in ``_meshes._controllers``, ``THIS_PROC`` in
``_meshes._host_mesh``). ``parts.get(KEY)`` returns that layer's object,
typed as the key says, made on first use; a reader finds every user of a
part by the key's name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

__all__ = ["Part", "Parts"]

T = TypeVar("T")


class Part(Generic[T]):
    """The key of one layer's per-process state: its name and how to make it."""

    __slots__ = ("make", "name")

    def __init__(self, name: str, make: Callable[[], T]) -> None:
        self.name = name
        self.make = make

    def __repr__(self) -> str:
        return f"<Part {self.name}>"


class Parts:
    """The per-process state of the layers above, by their :class:`Part` keys."""

    __slots__ = ("_values",)

    def __init__(self) -> None:
        self._values: dict[Part[Any], Any] = {}

    def get(self, part: Part[T]) -> T:
        """``part``'s state in this process, made now if it has none yet."""
        value = self._values.get(part)
        if value is None:
            value = self._values[part] = part.make()
        return value  # type: ignore[no-any-return]

    def find(self, part: Part[T]) -> T | None:
        """``part``'s state in this process if it was ever made (never makes it)."""
        return self._values.get(part)
