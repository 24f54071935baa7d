"""How a proc mesh stops: ask every live process to stop, wait, kill what ignored it, wait, clean up.

The sequence is a generator of ``(condition, time limit)`` steps so that
an async caller awaits each step and a synchronous caller blocks on it,
with the same logic; its first step (the stop request) runs eagerly. A
:class:`StopRun` runs it to its end whoever waits: an awaiter that gives up
(``wait_for``) leaves it running, and a later ``stop()`` waits for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import signal
import time
from collections.abc import Callable, Iterator

from .._runtime._call_sender import encode_arguments, send_call
from .._runtime._core import Runtime
from .._runtime._pending_calls import PendingCall
from .._shared._errors import ActorDied, CallTimeout
from .._shared._liveness import ProcRef
from .._shared._session import incarnation_path, remove_socket_file
from .._wire._records import PROCESS_ACTOR

__all__ = ["StopRun", "StopStep", "stop_steps"]

log = logging.getLogger("actors")

#: Wait until the condition holds or the limit (seconds) passes.
StopStep = tuple[Callable[[], bool], float]
#: Beyond the actors' cleanup bound: how long their processes may take to answer the stop request.
ANSWER_GRACE = 2.0
#: How long processes may take to exit after answering, and again after SIGKILL.
EXIT_WAIT = 3.0
KILL_WAIT = 2.0


def stop_steps(
    rt: Runtime, procs: list[ProcRef], timeout: float, kill_remote: Callable[[ProcRef], None] | None
) -> Iterator[StopStep]:
    """The stop sequence of ``procs``; ``kill_remote`` ends a process on another host (its pid means nothing here)."""

    def all_dead() -> bool:
        return all(ref.dead for ref in procs)

    alive: list[tuple[int, ProcRef]] = []

    def ask_to_stop() -> PendingCall | None:
        # (those alive are picked on the runtime's thread, as the call is sent: a call is sent to all or none)
        alive[:] = [(rank, ref) for rank, ref in enumerate(procs) if not ref.dead]
        if not alive:
            return None
        stop = encode_arguments(rt, (timeout,), {})
        # (past a full link's limits: a worker with a backlog still gets it, and one that reads nothing is killed)
        return send_call(rt, alive, PROCESS_ACTOR, "stop", stop, want_reply=True, past_limits=True)

    pending = None
    with contextlib.suppress(ActorDied):
        pending = rt.driver.on_thread(ask_to_stop)
    if pending is not None:
        answer_by = time.monotonic() + timeout + ANSWER_GRACE
        yield (lambda: pending.done or all_dead()), timeout + ANSWER_GRACE
        if pending.error is not None:
            # A process died, failing the call: later answers are not recorded, so every process still alive
            # keeps the rest of its cleanup's bound (the others may be well inside it), then the time to exit.
            yield all_dead, max(0.0, answer_by - time.monotonic()) + EXIT_WAIT
        else:
            # A process that never answered will not exit by itself (its loop is stuck): only those that
            # answered are given time to exit; the rest are killed at once.
            answered = [ref for rank, ref in alive if rank not in pending.remaining]
            yield (lambda: all(ref.dead for ref in answered)), EXIT_WAIT
    else:
        yield all_dead, EXIT_WAIT
    registry = rt.registry
    for ref in procs:  # (one that cannot be killed stops neither the others' kill nor the clean-up: a generator
        if ref.dead:  # that raised is over, and a later stop would find nothing left to do)
            continue
        try:
            if ref.remote:  # never os.kill another host's pid: it names some process of this one
                if kill_remote is not None:
                    kill_remote(ref)
                continue
            pid = registry.resolve_pid(ref)
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
            else:  # not started yet (its forkserver still importing): killed as it is reported, and its files go
                registry.when_pid_known(ref, functools.partial(_kill_late, rt, ref))
        except ProcessLookupError:
            pass
        except Exception:
            log.exception("could not kill the process at %s: the stop goes on without it", ref.address)
    yield all_dead, KILL_WAIT
    for ref in procs:
        _remove_files(rt, ref)


def _remove_files(rt: Runtime, ref: ProcRef) -> None:
    """Remove the socket and incarnation files of the process at ``ref``'s address (one that cannot be removed is
    logged: the others still go)."""
    try:
        remove_socket_file(ref.address)
        with contextlib.suppress(FileNotFoundError):
            os.remove(incarnation_path(rt.dir, ref.address))
    except OSError as exc:
        log.warning("could not remove the files of %s: %s", ref.address, exc)


def _kill_late(rt: Runtime, ref: ProcRef) -> None:
    """A process of a stopped mesh whose pid came to be known only after its stop's SIGKILL step: killed now."""
    if ref.pid is None or ref.dead:
        return  # (it died before it was ever reported: nothing runs)
    with contextlib.suppress(ProcessLookupError):
        os.kill(ref.pid, signal.SIGKILL)
    log.info("killed pid %d of %s: it started after its mesh stopped", ref.pid, ref.address)
    _remove_files(rt, ref)


class StopRun:
    """One run of a mesh's stop steps, to their end whoever waits for them, and however many wait.

    On an event loop the steps run as a task of the runtime's loop, which
    each awaiter waits for shielded: one that is cancelled (``wait_for``
    ran out) leaves the run going, to the SIGKILL of what ignored the stop.
    A run whose loop ended mid-way goes on, from the step after, on the
    next loop the runtime moves to (or with the next waiter). A synchronous
    waiter (no loop runs the runtime: interpreter exit) runs the steps on
    its own thread.
    """

    def __init__(self, rt: Runtime, steps: Iterator[StopStep]) -> None:
        self._rt = rt
        self._steps = steps
        self._task: asyncio.Task[None] | None = None
        #: Bumped when a run is taken over from a task whose loop no longer runs (stopped or closed with the
        #: task on it): should that loop run again, its task stops instead of stepping beside the new one.
        self._generation = 0
        self._following = False  # whether it listens for the runtime's moves to another loop
        self.done = False

    async def wait(self) -> None:
        task = self._task
        if task is None or (task.done() and not self.done) or self._stranded(task):
            task = self._start(asyncio.get_running_loop())
        await asyncio.shield(task)

    def _start(self, loop: asyncio.AbstractEventLoop) -> asyncio.Task[None]:
        self._generation += 1
        task = self._task = loop.create_task(self._run(self._generation))
        if not self._following:
            self._following = True
            self._rt.driver.moved.connect(self._resume)
        return task

    def _resume(self) -> None:
        """The runtime moved to another loop (announced there): a run cut short on the one it left (its tasks
        cancelled as it closed, or stranded on it) goes on here, so a stop given up on still kills what ignored
        it while the program goes on with actors elsewhere."""
        task, loop = self._task, self._rt.driver.loop
        if self.done or task is None or loop is None or not (task.done() or self._stranded(task)):
            return
        self._start(loop)

    def _finished(self) -> None:
        self.done = True
        if self._following:
            self._following = False
            self._rt.driver.moved.disconnect(self._resume)

    @staticmethod
    def _stranded(task: asyncio.Task[None]) -> bool:
        """Whether ``task`` waits on a loop that no longer runs (it will not go on unless that loop runs again)."""
        return not task.done() and not task.get_loop().is_running()

    async def _run(self, generation: int) -> None:
        for condition, limit in self._steps:
            await self._rt.driver.wait_until(condition, limit)
            if generation != self._generation:
                return  # (taken over meanwhile: its loop had stopped)
        self._finished()

    def wait_sync(self, timeout: float | None = None) -> None:
        """Wait without a loop (this thread runs the steps); ``timeout``: :class:`CallTimeout` once it passes, the
        run left where it is (the next waiter goes on from the step after)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        driver, task = self._rt.driver, self._task
        if task is not None and not task.done():  # under way on the loop of another thread, while that loop runs
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            driver.wait(lambda: task.done() or self._stranded(task), timeout=left, what="the stop under way")
        if self.done:
            return
        self._generation += 1
        self._task = None
        for condition, limit in self._steps:
            bound = limit if deadline is None else min(limit, max(0.0, deadline - time.monotonic()))
            try:
                driver.wait(condition, timeout=bound, what="processes to stop")
            except CallTimeout:
                if deadline is not None and time.monotonic() >= deadline:
                    raise CallTimeout(
                        f"the stop did not end within {timeout:g}s; a later stop goes on with it"
                    ) from None
        self._finished()
