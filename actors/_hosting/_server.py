"""The actor server of a worker process: constructs its actors, runs their calls, stops them.

Calls arrive as :class:`~actors._wire._records.Call` records. A call to an actor that
is not constructed yet waits (up to :data:`SPAWN_WAIT`) for it; every
invocation of an async endpoint runs as its own task on the process's event
loop, so endpoints of one actor interleave; the ``def`` endpoints of a
synchronous actor run one at a time on that actor's own thread (as in
Monarch), so they never freeze the message pump. Calls to the
reserved actor :data:`~actors._wire._records.PROCESS_ACTOR` spawn and stop actors.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import logging
import os
import traceback
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from .._runtime._context import ActorContext, _context
from .._runtime._core import Runtime
from .._shared._config import WorkerConfig
from .._shared._errors import ActorDied, DecodeError, SupervisionError, actor_failed, actor_stopped
from .._shared._liveness import ProcRef
from .._shared._names import shown
from .._wire import _refs
from .._wire._records import PROCESS_ACTOR, SUPERVISION, Call, ErrorRecord, FailureReport, Header
from ._actor import Actor, Endpoint, check_actor_class, endpoints_of, is_sync_actor
from ._invocation import Invocation
from ._response_port import ResponsePort

__all__ = ["CLEANUP_TIMEOUT", "ActorServer"]

log = logging.getLogger("actors")

#: How long a call may wait for an actor that has not been spawned here yet.
SPAWN_WAIT = 30.0
#: Default bound on an actor's ``__cleanup__`` when stopping.
CLEANUP_TIMEOUT = 10.0


@dataclass
class ActorSlot:
    """One actor hosted in this process."""

    name: str
    rank: int
    extent: dict[str, int]
    class_ref: str = ""
    instance: Any = None
    error: ErrorRecord | None = None
    endpoints: dict[str, Endpoint[Any, Any]] = field(default_factory=dict)
    tasks: set[asyncio.Task[Any]] = field(default_factory=set)
    backlog: list[Invocation] = field(default_factory=list)
    stopping: bool = False
    #: The one run of its stop (``__cleanup__``, its calls, its children), once begun.
    stop_task: asyncio.Task[None] | None = None
    #: Who spawned it: its failures are reported there (as in Monarch; None: this process's owner).
    supervisor: ProcRef | None = None
    #: What it spawned (proc meshes, actor meshes on proc meshes it was given): stopped when it stops.
    children: list[Any] = field(default_factory=list)
    #: A synchronous actor's own thread: its ``def`` endpoints run there, one message at a time.
    thread: ThreadPoolExecutor | None = None

    @property
    def context(self) -> ActorContext:
        return ActorContext(self.name, self.rank, self.extent, self.class_ref)

    def context_for(self, message_rank: int) -> ActorContext:
        return ActorContext(self.name, self.rank, self.extent, self.class_ref, message_rank)

    def run_sync(self, loop: asyncio.AbstractEventLoop, call: Callable[[], Any]) -> asyncio.Future[Any]:
        """Run ``call`` on this actor's own thread, after the calls queued before it."""
        if self.thread is None:
            self.thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"actor-{shown(self.name)}")
        return loop.run_in_executor(self.thread, contextvars.copy_context().run, call)

    def close(self) -> None:
        if self.thread is not None:
            self.thread.shutdown(wait=False, cancel_futures=True)


class ActorServer:
    """Serves the actors of this worker process."""

    def __init__(self, rt: Runtime, config: WorkerConfig, retitle: Callable[[list[str]], None]) -> None:
        self.rt = rt
        self.loop = asyncio.get_running_loop()
        self.config = config
        self._retitle_to = retitle
        self.actors: dict[str, ActorSlot] = {}
        self.waiting: dict[str, list[Invocation]] = {}
        self.stopped: set[str] = set()
        self.finished = asyncio.Event()
        self.owner = rt.registry.proc(config.owner_address, config.owner_pid)
        self._stopping = False
        #: Shutting down for SIGTERM or the owner's death (not a stop request): cancelled calls go unanswered.
        self._ending = False
        self._tasks: set[asyncio.Task[Any]] = set()
        rt.inbox.on(Call, self.on_call)
        rt.registry.death_listeners.append(self._on_death)
        rt.server = self

    # -------------------------------------------------------------- routing calls

    def on_call(self, call: Call, frames: list[Any], sender: Header, size: int) -> None:
        inv = Invocation(call, frames)
        actor = call.actor
        if actor == PROCESS_ACTOR:
            self._spawn_task(self._process_call(inv))
            return
        slot = self.actors.get(actor)
        if slot is None and actor in self.stopped:
            self._refuse(inv, ErrorRecord(SUPERVISION, actor_stopped(actor)))
        elif slot is None:
            self.waiting.setdefault(actor, []).append(inv)
            self.loop.call_later(SPAWN_WAIT, self._expire, actor, inv)
        elif slot.instance is None and slot.error is None:
            slot.backlog.append(inv)
        else:
            self._start(slot, inv)

    def _expire(self, actor: str, inv: Invocation) -> None:
        waiting = self.waiting.get(actor)
        if waiting and inv in waiting:
            waiting.remove(inv)
            self._refuse(inv, ErrorRecord("LookupError", f"no actor named {shown(actor)!r} in this process"))

    def _start(self, slot: ActorSlot, inv: Invocation) -> None:
        if slot.error is not None:
            self._refuse(inv, slot.error)
            return
        if slot.stopping:
            self._refuse(inv, ErrorRecord("RuntimeError", f"actor {shown(slot.name)!r} is stopping"))
            return
        ep = slot.endpoints.get(inv.call.method)
        if ep is None:
            cls = type(slot.instance).__qualname__
            self._refuse(inv, ErrorRecord("AttributeError", f"{cls} has no endpoint {inv.call.method!r}"))
            return
        try:
            args, kwargs = inv.arguments(self.rt)
        except DecodeError as exc:
            self._refuse(inv, ErrorRecord.of(exc))
            return
        token = _context.set(slot.context_for(inv.call.rank))
        try:
            task = self.loop.create_task(self._invoke(slot, ep, args, kwargs, inv))
        finally:
            _context.reset(token)
        slot.tasks.add(task)
        task.add_done_callback(slot.tasks.discard)

    async def _invoke(
        self, slot: ActorSlot, ep: Endpoint[Any, Any], args: list[Any], kwargs: dict[str, Any], inv: Invocation
    ) -> None:
        port = ResponsePort[Any](self.rt, inv) if ep.explicit_response_port else None
        if port is not None:
            args = [port, *args]
        try:
            if ep.is_async:
                result = await ep.fn(slot.instance, *args, **kwargs)
            else:
                result = await slot.run_sync(self.loop, functools.partial(ep.fn, slot.instance, *args, **kwargs))
        except asyncio.CancelledError:
            if self._ending and slot.error is None:
                return  # the process is ending (SIGTERM, owner gone): its callers hear ActorDied when it exits
            record = slot.error or ErrorRecord("CancelledError", f"actor {shown(slot.name)!r} stopped first")
            self._fail(slot, inv, record, report=False)
        except BaseException as exc:
            record = ErrorRecord.of(exc, traceback.format_exc())
            if port is not None:
                if port.take_over():
                    why = f"{inv.call.method} raised instead of answering its response port: "
                    self._kill(slot, inv.call.method, why + f"{record.type_name}: {record.message}", record, exc, inv)
            elif isinstance(exc, Exception):
                self._fail(slot, inv, record)
            else:
                why = f"{inv.call.method} raised {record.type_name}: {record.message}"
                self._kill(slot, inv.call.method, why, record, exc, inv)
        else:
            if port is not None:
                return  # it answers through its port, now or later (unanswered, the port answers when dropped)
            if inv.wants_reply:
                inv.reply(self.rt, True, result)
            else:
                inv.deliver_result(result)

    def _kill(
        self,
        slot: ActorSlot,
        method: str,
        why: str,
        record: ErrorRecord,
        exc: BaseException,
        inv: Invocation | None = None,
    ) -> None:
        """The actor failed itself (as in Monarch): it is gone for good.

        That is an endpoint raising a ``BaseException`` that is not an
        ``Exception`` (``SystemExit``, a fatal error of the user's), an
        explicit-port endpoint raising instead of answering, or a failure of
        an actor it spawned that its ``__supervise__`` left unhandled. Its
        supervisor is told first; then ``inv``, every call still running and
        every later one raise :class:`SupervisionError`; the actor is stopped
        (``__cleanup__``, what it spawned).
        """
        if slot.error is None:
            failed = actor_failed(slot.name, slot.rank, why)
            slot.error = ErrorRecord(SUPERVISION, failed, record.traceback)
            log.error("%s\n%s", failed, record.traceback.rstrip())
            told = ErrorRecord(record.type_name, actor_failed(slot.name, slot.rank, record.message), record.traceback)
            self.report_failure(slot.name, slot.rank, method, told)
            self._spawn_task(self._stop_slot(slot, exc, CLEANUP_TIMEOUT))
        if inv is not None and inv.wants_reply:
            inv.reply(self.rt, False, slot.error)

    def abort(self, actor: str, reason: str) -> None:
        """``Instance.abort``: fail ``actor`` with ``reason``."""
        slot = self.actors.get(actor)
        if slot is None:
            return
        why = f"{type(slot.instance).__qualname__} {shown(actor)}[{slot.rank}] aborted: {reason}"
        self._kill(slot, "abort", why, ErrorRecord("ActorAborted", why), SupervisionError(why))

    def _refuse(self, inv: Invocation, record: ErrorRecord) -> None:
        """A call that never ran (no such actor or endpoint, bad arguments): an error reply.

        Fire-and-forget, it is a bad message rather than an actor failure:
        dropped with a rate-limited log, never reported to the owner.
        """
        if inv.wants_reply:
            inv.reply(self.rt, False, record)
        else:
            call = inv.call
            self.rt.drops("a fire-and-forget call to %s.%s: %s: %s", shown(call.actor), call.method, *record[:2])

    def _fail(self, slot: ActorSlot | None, inv: Invocation, record: ErrorRecord, report: bool = True) -> None:
        if inv.wants_reply:
            inv.reply(self.rt, False, record)
            return
        if not report:
            return
        call = inv.call
        rank = slot.rank if slot is not None else call.rank
        log.error(
            "fire-and-forget call %s[%d].%s failed: %s: %s\n%s",
            shown(call.actor),
            rank,
            call.method,
            record.type_name,
            record.message,
            record.traceback.rstrip(),
        )
        self.report_failure(call.actor, rank, call.method, record)

    def report_failure(self, actor: str, rank: int, method: str, record: ErrorRecord) -> None:
        """Send a failure of ``actor`` to its supervisor: whoever spawned it, else this process's owner."""
        failure = FailureReport(actor, rank, os.getpid(), method, record.type_name, record.message, record.traceback)
        slot = self.actors.get(actor)
        supervisor = slot.supervisor if slot is not None and slot.supervisor is not None else self.owner
        if supervisor.dead:
            supervisor = self.owner
        if not supervisor.dead:
            try:
                self.rt.send(supervisor, failure, urgent=True)
            except ActorDied:
                pass
            except Exception:
                log.exception("could not report a failure to the owner")

    def _spawn_task(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = self.loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -------------------------------------------------------------- spawning and stopping

    async def _process_call(self, inv: Invocation) -> None:
        method = inv.call.method
        try:
            args, _kwargs = inv.arguments(self.rt)
            if method == "spawn":
                await self._spawn(inv, *args)
                return  # the spawn answers for itself
            if method == "stop_actor":
                await self._stop_actor(*args)
            elif method == "stop":
                await self._stop_all(*args)
            elif method == "log_level":
                logging.getLogger().setLevel(*args)
            elif method != "ping":
                raise AttributeError(f"unknown process operation {method!r}")
        except BaseException as exc:
            self._fail(None, inv, ErrorRecord.of(exc, traceback.format_exc(), spawn_failed=method == "spawn"))
            return
        inv.reply(self.rt, True, None)
        if method == "stop":
            self.rt.outbox.flush_all()
            self.finished.set()

    async def _spawn(self, inv: Invocation, name: str, class_ref: str, extent: dict[str, int], ctor: bytes) -> None:
        if name in self.actors:
            raise ValueError(f"an actor named {shown(name)!r} already exists in this process")
        self.stopped.discard(name)
        slot = ActorSlot(name, inv.call.rank, dict(extent), class_ref)
        slot.supervisor = self.rt.registry.proc(inv.call.reply_to, inv.call.reply_pid)
        slot.backlog = self.waiting.pop(name, [])
        self.actors[name] = slot
        token = _context.set(slot.context)
        try:
            cls = _refs.resolve(class_ref, allow_import=True)
            if not (isinstance(cls, type) and issubclass(cls, Actor)):
                raise TypeError(f"{class_ref} is not an Actor subclass")
            check_actor_class(cls)
            args, kwargs = self.rt.inbox.decoder.decode(ctor, inv.frames)
            slot.endpoints = endpoints_of(cls)
            if is_sync_actor(cls):  # constructed where its endpoints will run: thread-locals stay valid
                slot.instance = await slot.run_sync(self.loop, functools.partial(cls, *args, **kwargs))
            else:
                slot.instance = cls(*args, **kwargs)
        except BaseException as exc:
            slot.error = ErrorRecord.of(exc, traceback.format_exc(), spawn_failed=True)
            log.error("could not construct actor %s[%d]: %s: %s", shown(name), slot.rank, *slot.error[:2])
            inv.reply(self.rt, False, slot.error)
            self.report_failure(name, slot.rank, "__init__", slot.error)  # a supervision event, as in Monarch
        else:
            inv.reply(self.rt, True, None)
        finally:
            _context.reset(token)
        self._retitle()
        backlog, slot.backlog = slot.backlog, []
        for waiting in backlog:
            self._start(slot, waiting)

    def _retitle(self) -> None:
        self._retitle_to([f"{shown(name)}[{slot.rank}]" for name, slot in self.actors.items()])

    async def _stop_actor(self, name: str, timeout: float = CLEANUP_TIMEOUT) -> None:
        slot = self.actors.pop(name, None)
        self.stopped.add(name)
        if slot is not None:
            await self._stop_slot(slot, None, timeout)
            self._retitle()

    async def _stop_all(self, timeout: float = CLEANUP_TIMEOUT, exc: BaseException | None = None) -> None:
        self._stopping = True
        slots = list(self.actors.values())
        self.actors.clear()
        await asyncio.gather(*(self._stop_slot(slot, exc, timeout) for slot in slots))
        if self.rt.controller_procs:  # controllers this process spawned end with it, their names withdrawn
            from .._meshes._controllers import stop_controllers

            await stop_controllers()

    async def _stop_slot(self, slot: ActorSlot, exc: BaseException | None, timeout: float) -> None:
        """Stop ``slot`` once; a second stop (a failed actor stops itself) waits for the first."""
        if slot.stop_task is None:
            slot.stopping = True
            slot.stop_task = self.loop.create_task(self._run_stop(slot, exc, timeout))
        await asyncio.shield(slot.stop_task)

    async def _run_stop(self, slot: ActorSlot, exc: BaseException | None, timeout: float) -> None:
        """Cancel its running calls, then ``__cleanup__(exc)``, then stop what it spawned (Monarch's order)."""
        for task in list(slot.tasks):
            task.cancel()
        if slot.tasks:
            await asyncio.wait(list(slot.tasks), timeout=1.0)
        cleanup = getattr(slot.instance, "__cleanup__", None)
        if cleanup is not None:
            token = _context.set(slot.context)
            try:
                if slot.thread is not None and not inspect.iscoroutinefunction(cleanup):
                    result = slot.run_sync(self.loop, functools.partial(cleanup, exc))  # on the actor's thread
                else:
                    result = cleanup(exc)
                if inspect.isawaitable(result):
                    await asyncio.wait_for(result, timeout)
            except Exception:
                log.exception("__cleanup__ of %s[%d] failed", shown(slot.name), slot.rank)
            finally:
                _context.reset(token)
        await self._stop_children(slot, timeout)
        slot.close()

    async def _stop_children(self, slot: ActorSlot, timeout: float) -> None:
        """Stop what the actor spawned, newest first (as Monarch does when an owner stops)."""
        while slot.children:
            child = slot.children.pop()
            try:
                await asyncio.wait_for(child.stop(), timeout + 7.0)  # a proc mesh's own stop steps take 7 s at most
            except Exception:
                log.exception("could not stop %r, spawned by %s[%d]", child, shown(slot.name), slot.rank)

    def adopt(self, actor: str, child: Any) -> None:
        """Record that ``actor`` spawned ``child`` (something with ``stop()``): it stops with the actor."""
        slot = self.actors.get(actor)
        if slot is not None:
            slot.children.append(child)

    def shutdown(self, reason: str) -> None:
        """Stop every actor quickly and end the process (SIGTERM, owner death): an ordinary end, not logged loudly."""
        if self._stopping:
            return
        self._stopping = self._ending = True
        log.info("stopping: %s", reason)

        async def stop() -> None:
            try:
                await self._stop_all(timeout=0.5)
            finally:
                self.finished.set()

        self._spawn_task(stop())

    def _on_death(self, ref: ProcRef) -> None:
        if ref is self.owner:
            self.shutdown("the owning process exited")

    # -------------------------------------------------------------- supervision of child meshes

    def supervise(self, actor: str, failure: Any) -> bool:
        """Offer ``failure`` to the ``__supervise__`` of ``actor`` (hosted here); True if handled.

        An ``async def __supervise__`` runs as a task on this loop; until it
        answers the failure counts as handled, and a false answer escalates it
        then. A ``__supervise__`` that raises fails its actor (as in Monarch).
        """
        slot = self.actors.get(actor)
        if slot is None or slot.instance is None:
            return False
        token = _context.set(slot.context)
        try:
            verdict = slot.instance.__supervise__(failure)
        except Exception as exc:
            self.escalate(actor, failure, exc)
            return True
        finally:
            _context.reset(token)
        if not inspect.isawaitable(verdict):
            return bool(verdict)

        async def settle() -> None:
            try:
                handled = bool(await verdict)
            except BaseException as exc:  # a CancelledError it raised itself, too, unless the actor is stopping
                if slot.stopping:
                    return
                self.escalate(actor, failure, exc)
                return
            if not handled:
                self.escalate(actor, failure)

        token = _context.set(slot.context)
        try:
            task = self.loop.create_task(settle())
        finally:
            _context.reset(token)
        slot.tasks.add(task)
        task.add_done_callback(slot.tasks.discard)
        return True

    def escalate(self, actor: str, failure: Any, raised: BaseException | None = None) -> None:
        """A failure of what ``actor`` spawned went unhandled (or its ``__supervise__`` raised): ``actor`` fails."""
        if raised is not None:
            cause = f"__supervise__ raised {type(raised).__name__}: {raised} while handling {failure}"
        else:
            cause = f"__supervise__ left a failure of an actor it spawned unhandled: {failure}"
        record = ErrorRecord(SUPERVISION, cause, failure.traceback)
        slot = self.actors.get(actor)
        if slot is None:  # already gone: its owner still hears of it
            self.report_failure(actor, 0, "__supervise__", record)
            return
        self._kill(slot, "__supervise__", cause, record, SupervisionError(actor_failed(actor, slot.rank, cause)))
