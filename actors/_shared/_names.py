"""Actor names: the one a user gives, and the unique one the actor has on the wire.

Two spawners may choose the same name for actors on the same processes (four
supervisors each spawning ``"worker"``, as Monarch allows). Each spawn therefore
gets a wire name of its own, ``<name>#<token>``, that addresses it; messages
and ``current_actor_name()`` show the name the user gave.
"""

from __future__ import annotations

import secrets
from collections.abc import Generator
from typing import Any

__all__ = ["MeshName", "shown", "wire_name"]

_SEPARATOR = "#"
_TOKEN_BYTES = 6


class MeshName(str):
    """An actor mesh's wire name: a string, that Monarch's programs may also ``await`` (its ``_name`` is a future)."""

    __slots__ = ()

    def __await__(self) -> Generator[Any, None, str]:
        return _ready(str(self)).__await__()


async def _ready(value: str) -> str:
    return value


def wire_name(name: str) -> str:
    """A name for one spawn of ``name``, unique in the session."""
    return f"{name}{_SEPARATOR}{secrets.token_hex(_TOKEN_BYTES)}"


def shown(name: str) -> str:
    """The name the user gave, for a wire name (other names are returned as they are)."""
    given, sep, token = name.rpartition(_SEPARATOR)
    return given if sep and len(token) == 2 * _TOKEN_BYTES else name
