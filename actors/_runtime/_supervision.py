"""Failure records, who handles them, and what happens when nobody does.

When a fire-and-forget endpoint raises, or a process an owner spawned dies,
the owner is told with a :class:`Failure`. It is offered, in order, to the
proc mesh's handlers (``ProcMesh.add_failure_handler``), the process-wide
handlers (:func:`add_failure_handler`) and, when the mesh was spawned by an
actor, that actor's ``__supervise__``. Any of them returning a true value
handles it; a restart policy that restarts the process handles it too.

An unhandled failure escalates, never silently: an owning actor reports it
to *its* owner as a failure of its own; in the controller it reaches
``actors.unhandled_fault_hook``, which by default faults the mesh so that
every later call to it raises :class:`~actors.SupervisionError`. As in
Monarch, the hook is replaced by assigning the package attribute
(``actors.unhandled_fault_hook = my_hook``), so it is looked up there each
time.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass

from .._shared._errors import SupervisionError
from .._shared._names import shown
from .._wire._records import FailureReport

log = logging.getLogger("actors.supervision")

__all__ = [
    "Failure",
    "MeshFailure",
    "add_failure_handler",
    "checked_handler",
    "remove_failure_handler",
    "unhandled_fault_hook",
]


@dataclass(frozen=True)
class Failure:
    """What went wrong, where: actor name, rank, pid, cause and remote traceback.

    Monarch calls it ``MeshFailure`` (``actors.MeshFailure`` is this class):
    ``mesh_name`` and ``report()`` are there too.
    """

    actor: str
    rank: int
    pid: int
    endpoint: str
    exception_type: str
    message: str
    traceback: str = ""
    #: The process died and its proc mesh's restart policy started a new one.
    restarted: bool = False
    #: The failed mesh's name on the wire, unique per spawn (empty when a process died).
    mesh: str = ""

    def __str__(self) -> str:
        """``MeshFailure <actor>[<rank>].<endpoint> failed: ...``, with Monarch's ``crashed_ranks=[<rank>]``."""
        where = f"{self.actor}[{self.rank}] (pid {self.pid}, crashed_ranks=[{self.rank}])"
        what = f".{self.endpoint}" if self.endpoint else ""
        return f"MeshFailure {where}{what} failed: {self.exception_type}: {self.message}"

    @property
    def mesh_name(self) -> str:
        """The failed actor mesh's name on the wire, unique per spawn (``mesh._name``, as in Monarch)."""
        return self.mesh or self.actor

    def report(self) -> str:
        """The failure with its remote traceback, for logs."""
        tb = self.traceback.rstrip()
        return f"{self}\n{tb}" if tb else str(self)

    @classmethod
    def from_report(cls, report: FailureReport) -> Failure:
        return cls(
            actor=shown(report.actor),
            rank=report.rank,
            pid=report.pid,
            endpoint=report.endpoint,
            exception_type=report.exception_type,
            message=report.message,
            traceback=report.traceback,
            mesh=report.actor,
        )


#: Monarch's name for a failure record.
MeshFailure = Failure

#: A handler returns True (or any true value) when it has dealt with the failure.
FailureHandler = Callable[[Failure], object]


def add_failure_handler(handler: FailureHandler) -> None:
    """Offer every failure reported to this process to ``handler`` (true return: handled)."""
    from ._core import runtime

    runtime().mesh_routes.handlers.append(checked_handler(handler))


def checked_handler(handler: FailureHandler) -> FailureHandler:
    """``handler``, if it answers at once: a failure is handled or not as it is reported (a coroutine function's
    coroutine, always true, would count as handled without its body ever running)."""
    if not callable(handler):
        raise TypeError(f"a failure handler is a function of the failure, not {type(handler).__name__}")
    call = type(handler).__call__ if not inspect.isroutine(handler) else None  # (an object with an async __call__)
    if inspect.iscoroutinefunction(handler) or (call is not None and inspect.iscoroutinefunction(call)):
        raise TypeError(
            f"failure handler {handler!r} is a coroutine function: a handler answers at once, with a true value if "
            "it handled the failure (start a task from it for work that awaits)"
        )
    return handler


def remove_failure_handler(handler: FailureHandler) -> None:
    from ._core import runtime

    runtime().mesh_routes.handlers.remove(handler)


def offer(failure: Failure, handlers: list[FailureHandler]) -> bool:
    """Log ``failure`` and give it to ``handlers``; True if one of them handled it."""
    log.error("%s", failure.report())
    handled = False
    for handler in handlers:
        try:
            answer = handler(failure)
        except Exception:
            log.exception("failure handler %r raised", handler)
            continue
        if inspect.isawaitable(answer):  # (a lambda around a coroutine function): not an answer, never run
            close = getattr(answer, "close", None)
            if close is not None:
                close()
            log.error(
                "failure handler %r returned an awaitable, not an answer: the failure is not handled by it", handler
            )
            continue
        handled = bool(answer) or handled
    return handled


def unhandled_fault_hook(failure: Failure) -> None:
    """Called in the controller with each failure nobody handled.

    The default raises :class:`SupervisionError`, which faults the failed
    actor's proc mesh: later calls to its actors raise that error. Replace it
    (``actors.unhandled_fault_hook = my_hook``) to exit, alert or ignore; a
    hook that returns normally drops the failure.
    """
    raise SupervisionError(f"unhandled actor failure: {failure}", failure)


def escalate_to_controller(failure: Failure) -> SupervisionError | None:
    """Run the (possibly user-replaced) ``actors.unhandled_fault_hook``; the error to fault with, if any."""
    hook = getattr(importlib.import_module("actors"), "unhandled_fault_hook", unhandled_fault_hook)
    try:
        hook(failure)
    except SupervisionError as exc:
        return exc
    except Exception as exc:
        return _hook_raised(failure, exc)
    except BaseException as exc:  # SystemExit, KeyboardInterrupt: the hook ends the program
        if threading.current_thread() is threading.main_thread():
            raise  # out of the program's own loop, as from any of its callbacks
        # On the runtime's background thread: as in Monarch, the program's main thread gets a
        # KeyboardInterrupt (only it can end the interpreter and run its atexit hooks).
        log.error("the unhandled fault hook raised %r: interrupting the program's main thread", exc)
        # A real SIGINT to the main thread, so that a blocking wait there is interrupted too.
        signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)
        return _hook_raised(failure, exc)
    return None


def _hook_raised(failure: Failure, exc: BaseException) -> SupervisionError:
    """The error that faults the mesh when the fault hook itself raised ``exc``."""
    error = SupervisionError(f"unhandled actor failure: {failure} (the fault hook raised {exc!r})", failure)
    error.__cause__ = exc
    return error
