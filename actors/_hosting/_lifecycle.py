"""An actor's life in a worker: constructed, failed for good, stopped (with what it spawned), and the worker's end.

Stopping follows Monarch's order: the actor's running calls are cancelled,
then its ``__cleanup__(exc)`` runs, then what it spawned is stopped, newest
first. An actor fails for good when an endpoint raises a ``BaseException``
that is not an ``Exception``, when an explicit-port endpoint raises instead
of answering, when it aborts, or when a failure of what it spawned is left
unhandled: its supervisor is told, then it is stopped, and its calls raise
:class:`~actors.SupervisionError`.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import traceback
from collections.abc import Callable, Coroutine
from typing import Any

from .._runtime._actor_host import Stoppable
from .._runtime._context import actor_context
from .._runtime._core import Runtime
from .._shared._errors import SupervisionError, actor_failed
from .._shared._names import shown
from .._wire import _refs
from .._wire._records import SUPERVISION, ErrorRecord
from ._actor import Actor, check_actor_class, endpoints_of, is_sync_actor
from ._failure_reports import FailureReports
from ._invocation import Invocation
from ._slots import ActorSlot, SlotTable

__all__ = ["CLEANUP_TIMEOUT", "Lifecycle"]

log = logging.getLogger("actors")

#: Default bound on an actor's ``__cleanup__`` when stopping.
CLEANUP_TIMEOUT = 10.0
#: How long a proc mesh's own stop steps may take, beyond the cleanup bound, when an owner stops it.
CHILD_STOP_GRACE = 7.0
#: How long a ``__cleanup__`` cancelled at its bound has to end before the stop goes on without it.
CANCEL_GRACE = 1.0


class Lifecycle:
    """Constructs this worker's actors, fails and stops them, and ends the worker."""

    def __init__(
        self, rt: Runtime, slots: SlotTable, reports: FailureReports, retitle: Callable[[list[tuple[str, int]]], None]
    ) -> None:
        self._rt = rt
        self.loop = asyncio.get_running_loop()
        self._slots = slots
        self._reports = reports
        self._retitle_to = retitle
        #: Set once every actor has stopped and the worker may exit.
        self.finished = asyncio.Event()
        self.stopping = False
        #: Ending for SIGTERM or the owner's death (not a stop request): cancelled calls go unanswered.
        self.ending = False
        self._last: list[Stoppable] = []  # stopped after every actor (controllers this worker spawned)
        self._tasks: set[asyncio.Task[Any]] = set()
        #: The stops under way (an actor stopped alone, or failed): the worker's stop waits for them too.
        self._stops: set[asyncio.Task[None]] = set()
        #: The constructions under way (a synchronous actor's runs on its thread): the worker's stop waits for them.
        self._building: set[asyncio.Future[None]] = set()

    def background(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run ``coro`` as a task of the worker (kept referenced until it ends)."""
        task = self.loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def spawn(self, inv: Invocation, name: str, class_ref: str, extent: dict[str, int], ctor: bytes) -> ActorSlot:
        """Construct actor ``name`` and answer ``inv``; the slot (failed if construction raised).

        Refused once the worker is stopping (nothing would stop the actor); the worker's stop waits for a
        construction under way and then cleans the actor up.
        """
        if self.stopping:
            raise RuntimeError(f"cannot spawn {shown(name)!r}: this process is stopping")
        if name in self._slots.actors:
            raise ValueError(f"an actor named {shown(name)!r} already exists in this process")
        built: asyncio.Future[None] = self.loop.create_future()
        self._building.add(built)
        try:
            return await self._construct(inv, name, class_ref, extent, ctor)
        finally:
            self._building.discard(built)
            built.set_result(None)

    async def _construct(
        self, inv: Invocation, name: str, class_ref: str, extent: dict[str, int], ctor: bytes
    ) -> ActorSlot:
        self._slots.stopped.discard(name)
        slot = ActorSlot(name, inv.call.rank, dict(extent), class_ref)
        slot.supervisor = self._rt.registry.proc(inv.call.reply_to, inv.call.reply_pid)
        slot.backlog = self._slots.waiting.pop(name, [])
        self._slots.actors[name] = slot
        token = actor_context.set(slot.context)
        try:
            cls = _refs.resolve(class_ref, allow_import=True)
            if not (isinstance(cls, type) and issubclass(cls, Actor)):
                raise TypeError(f"{class_ref} is not an Actor subclass")
            check_actor_class(cls)
            args, kwargs = self._rt.inbox.decoder.decode(ctor, inv.frames)
            slot.endpoints = endpoints_of(cls)
            if is_sync_actor(cls):  # constructed where its endpoints will run: thread-locals stay valid
                slot.instance = await slot.run_sync(self.loop, functools.partial(cls, *args, **kwargs))
            else:
                slot.instance = cls(*args, **kwargs)
        except BaseException as exc:
            slot.error = ErrorRecord.of(exc, traceback.format_exc(), spawn_failed=True)
            log.error(
                "could not construct actor %s[%d]: %s: %s",
                shown(name),
                slot.rank,
                slot.error.type_name,
                slot.error.message,
            )
            inv.reply(self._rt, False, slot.error)
            self._reports.report(name, slot.rank, "__init__", slot.error)  # a supervision event, as in Monarch
            self._start_stop(slot, exc, CLEANUP_TIMEOUT)  # what it spawned before it raised stops (no cleanup runs)
        else:
            inv.reply(self._rt, True, None)
            if slot.stopping:  # stopped while its constructor ran (a sync actor's, on its thread): the stop may have
                # found no instance (it answered at once): cleaned up here, once that stop ends, unless it did
                self._track_stop(self.loop.create_task(self._cleanup_late(slot)))
        finally:
            actor_context.reset(token)
        self._retitle()
        return slot

    async def _cleanup_late(self, slot: ActorSlot) -> None:
        """An actor stopped mid-construction: once its stop has ended, its ``__cleanup__`` runs, unless that stop ran
        it (it reached the cleanup after the instance was there: once is all; before, both ran it)."""
        if slot.stop_task is not None:
            await asyncio.wait([slot.stop_task])
        try:
            await self._cleanup(slot, None, CLEANUP_TIMEOUT)
        finally:
            slot.close()

    def _retitle(self) -> None:
        self._retitle_to(self._slots.hosted())

    def kill(
        self,
        slot: ActorSlot,
        method: str,
        why: str,
        record: ErrorRecord,
        exc: BaseException,
        inv: Invocation | None = None,
    ) -> None:
        """The actor failed itself (as in Monarch): it is gone for good.

        Its supervisor is told first; then ``inv``, every call still running
        and every later one raise :class:`SupervisionError`; the actor is
        stopped (``__cleanup__``, what it spawned).
        """
        if slot.error is None:
            failed = actor_failed(slot.name, slot.rank, why, slot.class_ref)
            slot.error = ErrorRecord(SUPERVISION, failed, record.traceback)
            log.error("%s\n%s", failed, record.traceback.rstrip())
            told = ErrorRecord(
                record.type_name, actor_failed(slot.name, slot.rank, record.message, slot.class_ref), record.traceback
            )
            self._reports.report(slot.name, slot.rank, method, told)
            self.background(self.stop_slot(slot, exc, CLEANUP_TIMEOUT))
        if inv is not None:
            inv.answer_error(self._rt, slot.error, slot.rank)

    def abort(self, actor: str, reason: str) -> None:
        """``Instance.abort``: fail ``actor`` with ``reason``."""
        slot = self._slots.get(actor)
        if slot is None:
            return
        cls = type(slot.instance).__qualname__ if slot.instance is not None else slot.class_ref.partition(":")[2]
        why = f"{cls} {shown(actor)}[{slot.rank}] aborted: {reason}"  # (its class still being built: its name)
        self.kill(slot, "abort", why, ErrorRecord("ActorAborted", why), SupervisionError(why))

    async def stop_actor(self, name: str, timeout: float = CLEANUP_TIMEOUT) -> None:
        """Stop actor ``name`` (``ActorMesh.stop``); answered once its stop ended, a second stop's too.

        It takes no call from now on, but stays findable (as leaving) until
        its stop ends: what it spawned reports to it meanwhile.
        """
        slot = self._slots.actors.pop(name, None)
        self._slots.stopped.add(name)
        if slot is None:
            slot = self._slots.leaving.get(name)  # (a stop under way: this one waits for it too)
            if slot is None:
                return
        stop = self._start_stop(slot, None, timeout)
        if not stop.done() and self._slots.leaving.get(name) is not slot:
            self._slots.leaving[name] = slot
            stop.add_done_callback(functools.partial(self._left, slot))
        await asyncio.shield(stop)
        self._retitle()

    def _left(self, slot: ActorSlot, _stop: asyncio.Task[None]) -> None:
        if self._slots.leaving.get(slot.name) is slot:
            del self._slots.leaving[slot.name]

    async def stop_all(self, timeout: float = CLEANUP_TIMEOUT, exc: BaseException | None = None) -> None:
        """Stop every actor, then what the worker itself spawned to outlive them (its controllers)."""
        self.stopping = True
        slots = list(self._slots.actors.values())
        self._slots.actors.clear()
        self._slots.stopped.update(slot.name for slot in slots)  # (what they spawn from now on is stopped at once)
        for slot in slots:
            self._start_stop(slot, exc, timeout)
        # every stop under way, those begun meanwhile too (an actor constructed meanwhile is cleaned up by one its
        # construction starts before it ends): their cleanup ends before the worker. A construction is waited for
        # up to the cleanup bound (a constructor that never returns must not hold the worker's end).
        deadline = self.loop.time() + timeout
        while self._stops or self._building:
            left = None if self._stops else max(0.0, deadline - self.loop.time())
            done = await _finished(self._stops | self._building, left)
            if not done:
                log.error("a constructor still runs %gs into this worker's stop: the worker stops without it", timeout)
                break
            for stop in done:
                if not stop.cancelled() and stop.exception() is not None:
                    log.error("a stop failed", exc_info=stop.exception())
        while self._last:
            await self._stop_child(self._last.pop(), timeout, "this worker")

    async def stop_slot(self, slot: ActorSlot, exc: BaseException | None, timeout: float) -> None:
        """Stop ``slot`` once; a second stop (a failed actor stops itself) waits for the first."""
        await asyncio.shield(self._start_stop(slot, exc, timeout))

    def _start_stop(self, slot: ActorSlot, exc: BaseException | None, timeout: float) -> asyncio.Task[None]:
        if slot.stop_task is None:
            slot.stopping = True
            slot.stop_task = self.loop.create_task(self._run_stop(slot, exc, timeout))
            self._track_stop(slot.stop_task)
        return slot.stop_task

    def _track_stop(self, stop: asyncio.Task[None]) -> None:
        self._stops.add(stop)
        stop.add_done_callback(self._stops.discard)

    async def _run_stop(self, slot: ActorSlot, exc: BaseException | None, timeout: float) -> None:
        """Cancel its running calls, then ``__cleanup__(exc)``, then stop what it spawned (Monarch's order)."""
        for task in list(slot.tasks):
            task.cancel()
        if slot.tasks:
            await asyncio.wait(list(slot.tasks), timeout=1.0)
        try:
            await self._cleanup(slot, exc, timeout)
        finally:
            try:
                while slot.children:  # newest first (as Monarch does when an owner stops)
                    await self._stop_child(slot.children.pop(), timeout, f"{shown(slot.name)}[{slot.rank}]")
            finally:
                slot.close()

    async def _cleanup(self, slot: ActorSlot, exc: BaseException | None, timeout: float) -> None:
        """Run ``__cleanup__(exc)``, once; what it raises is logged (its own CancelledError too: ``task.cancel();
        await task`` is a common cleanup), and the stop goes on."""
        cleanup = getattr(slot.instance, "__cleanup__", None)
        if cleanup is None or slot.cleaned:
            return
        slot.cleaned = True
        token = actor_context.set(slot.context)
        try:
            if not inspect.iscoroutinefunction(cleanup):
                # on the actor's thread: a synchronous actor's, or one with no endpoint (whose ``def`` would block
                # the loop; an async actor's must be async)
                result = slot.run_sync(self.loop, functools.partial(cleanup, exc))
            else:
                result = cleanup(exc)
            if inspect.isawaitable(result):
                await self._bounded(result, timeout, slot)
        except asyncio.CancelledError:
            if _cancelled(asyncio.current_task()):
                raise  # the stop itself is cancelled (the loop is closing), not a failure of the cleanup
            log.exception("__cleanup__ of %s[%d] raised CancelledError", shown(slot.name), slot.rank)
        except BaseException:  # (SystemExit, KeyboardInterrupt too: the cleanup's failure, not the worker's end)
            log.exception("__cleanup__ of %s[%d] failed", shown(slot.name), slot.rank)
        finally:
            actor_context.reset(token)

    async def _bounded(self, cleanup: Any, timeout: float, slot: ActorSlot) -> None:
        """Await ``cleanup`` up to ``timeout`` s; then cancel it, and give it :data:`CANCEL_GRACE` s to end before
        abandoning it (``wait_for`` waits for a cancelled task to end: one that swallows the cancel held the stop,
        and the worker's exit, for good)."""
        task = asyncio.ensure_future(_contained(cleanup))
        try:
            if not (await asyncio.wait({task}, timeout=timeout))[0]:
                task.cancel()
                who = f"__cleanup__ of {shown(slot.name)}[{slot.rank}]"
                if not (await asyncio.wait({task}, timeout=CANCEL_GRACE))[0]:
                    log.error("%s did not end within %gs, nor when cancelled: abandoned", who, timeout)
                    return
                if task.cancelled():
                    log.error("%s did not end within %gs: cancelled", who, timeout)
                    return
        except asyncio.CancelledError:
            task.cancel()  # the stop itself was cancelled (the loop is closing)
            raise
        task.result()  # (what it raised: logged by the caller)

    async def _stop_child(self, child: Stoppable, timeout: float, spawner: str) -> None:
        try:
            await asyncio.wait_for(child.stop(), timeout + CHILD_STOP_GRACE)
        except Exception:
            log.exception("could not stop %r, spawned by %s", child, spawner)

    def adopt(self, actor: str, child: Stoppable) -> None:
        """Record that ``actor`` spawned ``child``: it stops with the actor (at once if the actor stopped already,
        as one stopped while its constructor ran, which spawns on)."""
        slot = self._slots.get(actor)
        if slot is not None and slot.stop_task is None:
            slot.children.append(child)
            return
        # its stop began (a failed actor stays in the table: past its children's, the list is read no more), or
        # it stopped; stopped at once, from the loop (this is the spawning code's thread: a sync actor's, say)
        if slot is None and actor not in self._slots.stopped:
            log.error("%r was spawned by %s, which this worker does not host: stopping it", child, shown(actor))
        self.loop.call_soon_threadsafe(self._stop_orphan, actor, child)

    def disown(self, actor: str, child: Stoppable) -> None:
        """``child`` stopped before ``actor`` did: forgotten, so that an actor spawning and stopping meshes for as
        long as it lives does not keep every one (their supervisors, failures, spawn arguments)."""
        slot = self._slots.get(actor)
        if slot is not None and slot.stop_task is None:
            slot.children[:] = [kept for kept in slot.children if kept is not child]

    def _stop_orphan(self, actor: str, child: Stoppable) -> None:
        log.info("stopping %r at once: %s, which spawned it, has stopped", child, shown(actor))
        self._track_stop(self.loop.create_task(self._stop_child(child, CLEANUP_TIMEOUT, shown(actor))))

    def stop_last(self, child: Stoppable) -> None:
        """Stop ``child`` when this worker stops, after every actor has stopped."""
        self._last.append(child)

    def shutdown(self, reason: str) -> None:
        """Stop every actor quickly and end the process (SIGTERM, owner death): an ordinary end, not logged loudly."""
        if self.stopping:
            return
        self.stopping = self.ending = True
        log.info("stopping: %s", reason)

        async def stop() -> None:
            try:
                await self.stop_all(timeout=0.5)
            finally:
                self.finished.set()

        self.background(stop())


async def _finished(tasks: set[asyncio.Future[None]], timeout: float | None = None) -> set[asyncio.Future[None]]:
    """The tasks of ``tasks`` that end first, none if ``timeout`` passes first (shielded: a cancel of the waiter
    leaves them running)."""
    done, _ = await asyncio.wait(list(tasks), timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    return done


async def _contained(awaitable: Any) -> Any:
    """Await ``awaitable``, turning a ``SystemExit`` or ``KeyboardInterrupt`` it raises into a ``RuntimeError``: a
    task re-raises those out of the event loop, which would end the worker in the middle of its stop."""
    try:
        return await awaitable
    except (asyncio.CancelledError, Exception):
        raise
    except BaseException as exc:
        raise RuntimeError(f"raised {type(exc).__name__}: {exc}") from exc


def _cancelled(task: asyncio.Task[Any] | None) -> bool:
    """Whether ``task`` itself was asked to cancel (a CancelledError that is not some awaited task's)."""
    cancelling = getattr(task, "cancelling", None)  # (Python 3.11+; before, every CancelledError counts as ours)
    return cancelling is None or bool(cancelling())
