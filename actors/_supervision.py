"""Failure records and the hooks that receive them.

When a fire-and-forget endpoint raises, or a process an owner spawned dies,
the owner is told with a :class:`Failure`. Handlers registered on a
``ProcMesh`` (or globally) receive it; with none registered it is logged
as an error, never dropped silently.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("actors.supervision")

__all__ = ["Failure"]


@dataclass(frozen=True)
class Failure:
    """What went wrong, where: actor name, rank, pid, cause and remote traceback."""

    actor: str
    rank: int
    pid: int
    endpoint: str
    exception_type: str
    message: str
    traceback: str = ""

    def __str__(self) -> str:
        where = f"{self.actor}[{self.rank}] (pid {self.pid})"
        what = f".{self.endpoint}" if self.endpoint else ""
        return f"{where}{what} failed: {self.exception_type}: {self.message}"


FailureHandler = Callable[[Failure], None]

_global_handlers: list[FailureHandler] = []


def add_failure_handler(handler: FailureHandler) -> None:
    """Receive every failure reported to this process."""
    _global_handlers.append(handler)


def remove_failure_handler(handler: FailureHandler) -> None:
    _global_handlers.remove(handler)


def report(failure: Failure, handlers: list[FailureHandler]) -> None:
    """Deliver ``failure`` to ``handlers`` and the global ones; log if nobody listens."""
    log.error("%s\n%s", failure, failure.traceback.rstrip())
    for handler in [*handlers, *_global_handlers]:
        try:
            handler(failure)
        except Exception:
            log.exception("failure handler %r raised", handler)
