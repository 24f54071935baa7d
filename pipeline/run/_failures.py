"""Which role failed first: the launcher's watch over the roles' running tasks.

A role that dies takes its peers' ports with it, so several roles fail at
once; :func:`first_failure` names the one whose failure was the cause, not
the knock-on ones, and reports the user's own errors (a reward function
that raised) in one line, without the remote traceback.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

from actors import ActorError, PortClosed, PublisherDied

from ..models import VLLMUnavailable
from ..roles import first_death
from ..tasks import RewardError

__all__ = ["KNOCK_ON_GRACE", "USER_ERRORS", "PeerDied", "PipelineError", "first_failure"]


class PipelineError(RuntimeError):
    """A role failed; the message names it."""


class PeerDied(RuntimeError):
    """The launcher's work on a role's behalf (a restarted generator's rejoin) failed because another role's process
    died in a call to it: a knock-on failure, the dead role's to name."""


#: How long a role that failed because a peer's port closed waits for that peer's own failure to be named.
KNOCK_ON_GRACE = 1.0


async def first_failure(tasks: dict[str, asyncio.Task[Any]], until: asyncio.Task[Any]) -> None:
    """Wait for ``until``; raise PipelineError naming the first role that fails before it.

    ``tasks`` may change while this waits (a restarted generator's new task
    replaces the one that failed with its old process); a replaced task's
    outcome is ignored. A role that failed only because a peer's port closed
    (the peer died) waits up to ``KNOCK_ON_GRACE`` s for the peer's own
    failure, which is then the one named. If ``until`` itself fails (the
    trainer's report stream ended because the trainer died), give the roles a
    moment to report which of them failed; a ``PipelineError`` of its own
    (the run's metrics could not be written) is raised as it is.
    """
    finished: set[asyncio.Task[Any]] = set()
    while not until.done():
        watched = [until, *(task for task in tasks.values() if task not in finished)]
        done, _ = await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)
        for task in _causes_first(done):  # (a failure of its own first: a knock-on names its cause)
            if task is until:
                continue
            finished.add(task)
            if task in tasks.values():
                if _knock_on(task):  # its peer died: name the peer, whose failure is a moment behind
                    cause = await _dead_role(tasks)
                    if cause is not None:
                        _raise_if_failed(tasks, cause)
                _raise_if_failed(tasks, task)
            elif not task.cancelled():
                task.exception()  # replaced: its failure was the restart's cause, already handled
    if isinstance(until.exception(), PipelineError):  # it failed on its own (the run's metrics could not be written)
        raise until.exception()  # type: ignore[misc]
    if until.exception() is not None:
        await asyncio.wait(list(tasks.values()), timeout=2.0, return_when=asyncio.FIRST_EXCEPTION)
        for task in _causes_first(tasks.values()):
            if task.done():
                _raise_if_failed(tasks, task)
        raise PipelineError(f"the trainer stopped reporting: {until.exception()}") from until.exception()
    for task in _causes_first(tasks.values()):  # a role that failed just as the run ended
        if task.done():
            _raise_if_failed(tasks, task)


async def _dead_role(tasks: dict[str, asyncio.Task[Any]]) -> asyncio.Task[Any] | None:
    """The task of a role whose process died (``ActorDied``), waiting up to ``KNOCK_ON_GRACE`` s for one."""
    dead = await first_death(list(tasks.values()), KNOCK_ON_GRACE)
    return next((task for task in tasks.values() if task is dead), None)


#: Failures that only follow a peer's death: its port closed, (a generator's) its weight publisher exited, or
#: (a rejoin's) the peer it called died.
KNOCK_ON = (PortClosed, PublisherDied, PeerDied)


def _causes_first(tasks: Iterable[asyncio.Task[Any]]) -> list[asyncio.Task[Any]]:
    """``tasks``, those that failed only because a peer died last (their cause is named before them)."""
    return sorted(tasks, key=lambda task: task.done() and _knock_on(task))


def _knock_on(task: asyncio.Task[Any]) -> bool:
    """Whether ``task`` failed only because a peer died (its port closed, its weights' publisher exited)."""
    exc = None if task.cancelled() else task.exception()
    names = {f"{kind.__module__}.{kind.__qualname__}" for kind in KNOCK_ON}  # as a remote error names them
    return isinstance(exc, KNOCK_ON) or (isinstance(exc, ActorError) and exc.exception_type in names)


#: Failures of the user's own code whose message says everything: reported without the remote traceback.
USER_ERRORS = tuple(f"{kind.__module__}.{kind.__qualname__}" for kind in (RewardError, VLLMUnavailable))


def _raise_if_failed(tasks: dict[str, asyncio.Task[Any]], task: asyncio.Task[Any]) -> None:
    exc = task.exception()
    if exc is not None:
        role = next(name for name, t in tasks.items() if t is task)
        if isinstance(exc, ActorError) and exc.exception_type in USER_ERRORS:
            raise PipelineError(f"the {role} failed: {exc.message}") from exc
        raise PipelineError(f"the {role} failed: {exc}") from exc
