"""The actor process: its event loop, and the host that runs its actors.

A worker is forked by the forkserver, names itself for ``ps``, prefixes its
output with its actors' names, loads the launching script's module (so
actor classes defined in ``__main__`` resolve), then serves its inbox on a
uvloop event loop until it is stopped, terminated, or its owner dies.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import gc
import inspect
import io
import logging
import os
import random
import runpy
import signal
import sys
import traceback
import types
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TextIO

from . import _protocol as P
from . import _refs
from ._actor import Actor, ActorContext, Endpoint, _context, endpoints_of
from ._calls import error_record
from ._errors import DecodeError
from ._runtime import Runtime, install_runtime, log

#: Reserved actor name for calls addressed to the process itself.
HOST = "__host__"
#: How long a call may wait for an actor that has not been spawned here yet.
SPAWN_WAIT = 30.0
#: Allocations between young-generation collections in worker processes.
GC_THRESHOLD = 20_000
#: True while a worker re-runs the launching script to find its classes.
LOADING_MAIN = [False]
#: Default bound on an actor's ``__cleanup__`` when stopping.
CLEANUP_TIMEOUT = 10.0


class _Prefixed(io.TextIOBase):
    """A text stream that starts every line with the process's label."""

    def __init__(self, stream: TextIO, label: list[str]) -> None:
        self._stream = stream
        self._label = label
        self._at_line_start = True

    def write(self, text: str) -> int:
        if not text:
            return 0
        prefix = f"[{self._label[0]}] "
        out = []
        for line in text.splitlines(keepends=True):
            if self._at_line_start:
                out.append(prefix)
            out.append(line)
            self._at_line_start = line.endswith("\n")
        self._stream.write("".join(out))
        if "\n" in text:
            self._stream.flush()
        return len(text)

    def flush(self) -> None:
        self._stream.flush()

    def fileno(self) -> int:
        return self._stream.fileno()

    def isatty(self) -> bool:
        return self._stream.isatty()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self._stream, "encoding", "utf-8")


def _load_main(main: list[str] | None) -> None:
    """Run the launching script's module as ``__mp_main__`` (like multiprocessing)."""
    if not main:
        return
    kind, target = main
    module = types.ModuleType("__mp_main__")
    sys.modules["__mp_main__"] = module
    LOADING_MAIN[0] = True
    try:
        with warnings.catch_warnings():
            # runpy warns when the main module's package already imported it; harmless here.
            warnings.filterwarnings("ignore", category=RuntimeWarning, module="runpy")
            if kind == "module":
                namespace = runpy.run_module(target, run_name="__mp_main__", alter_sys=True)
            else:
                namespace = runpy.run_path(target, run_name="__mp_main__")
    finally:
        LOADING_MAIN[0] = False
    module.__dict__.update(namespace)
    sys.modules["__main__"] = sys.modules["__mp_main__"] = module


def run(config: dict[str, Any]) -> int:
    """Entry point of a freshly forked worker; returns the exit code."""
    label = [config["name"]]
    os.environ.update(config.get("env") or {})  # before anything here touches CUDA
    _set_title(config, [])
    sys.path[:] = config["sys_path"]
    os.chdir(config["cwd"])
    random.seed()
    import torch

    torch.seed()
    torch.set_num_threads(int(config.get("threads") or 1))
    sys.stdout = _Prefixed(sys.__stdout__, label)  # type: ignore[arg-type]
    sys.stderr = _Prefixed(sys.__stderr__, label)  # type: ignore[arg-type]
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s", force=True)
    try:
        _load_main(config.get("main"))
    except BaseException:
        print(f"could not load the launching script's module:\n{traceback.format_exc()}", file=sys.stderr)
    bootstrap = config.get("bootstrap")
    if bootstrap:
        _refs.resolve(bootstrap, allow_import=True)()
    _tune_gc()
    import uvloop

    return uvloop.run(_serve(config, label))  # type: ignore[no-any-return]


def _tune_gc() -> None:
    """Keep the cyclic collector off the hot path of a message-heavy process.

    Everything loaded so far (torch, the script) is moved out of the
    collector's view, and young collections run less often: messages queued
    in ports otherwise make every collection walk a large, long-lived heap.
    """
    gc.freeze()  # the forkserver already collected and froze torch's heap before forking
    gc.set_threshold(GC_THRESHOLD, 20, 50)


def _set_title(config: dict[str, Any], actors: list[str]) -> None:
    try:
        import setproctitle
    except ImportError:  # pragma: no cover - optional at runtime
        return
    names = " ".join(actors)
    setproctitle.setproctitle(f"actors[{config['name']}] {names}".rstrip())


async def _serve(config: dict[str, Any], label: list[str]) -> int:
    rt = Runtime(address=config["address"])
    install_runtime(rt)
    loop = rt.ensure_loop()
    host = ActorHost(rt, config, label)
    loop.add_signal_handler(signal.SIGTERM, host.shutdown, "terminated")
    await host.finished.wait()
    rt.close()
    return 0


@dataclass
class _Invocation:
    call_id: int
    method: str
    reply_address: str
    reply_pid: int
    rank: int
    blob: Any
    frames: list[Any]
    port: Any


@dataclass
class _Slot:
    """One actor hosted in this process."""

    name: str
    rank: int
    extent: dict[str, int]
    instance: Any = None
    error: list[Any] | None = None
    endpoints: dict[str, Endpoint[Any]] = field(default_factory=dict)
    tasks: set[asyncio.Task[Any]] = field(default_factory=set)
    backlog: list[_Invocation] = field(default_factory=list)
    stopping: bool = False

    @property
    def context(self) -> ActorContext:
        return ActorContext(self.name, self.rank, self.extent)


class ActorHost:
    """Constructs actors and runs their endpoint invocations as tasks."""

    def __init__(self, rt: Runtime, config: dict[str, Any], label: list[str]) -> None:
        self.rt = rt
        self.loop = asyncio.get_running_loop()
        self.config = config
        self.label = label
        self.actors: dict[str, _Slot] = {}
        self.waiting: dict[str, list[_Invocation]] = {}
        self.finished = asyncio.Event()
        self.executor = ThreadPoolExecutor(thread_name_prefix="endpoint")
        self.owner = rt.proc(config["owner_address"], config["owner_pid"])
        self._stopping = False
        self._host_tasks: set[asyncio.Task[Any]] = set()
        self.stopped: set[str] = set()
        rt.on_call = self.on_call
        rt.death_callbacks.append(self._on_death)
        _host[:] = [self]

    # -------------------------------------------------------------- dispatch

    def on_call(self, message: list[Any], frames: list[Any], address: str, pid: int) -> None:
        _, call_id, actor, method, reply_address, reply_pid, rank, blob, port = message
        if type(actor) is not str or type(method) is not str or type(rank) is not int:
            raise DecodeError("malformed call")
        inv = _Invocation(call_id, method, reply_address, reply_pid, rank, blob, frames, port)
        if actor == HOST:
            self._spawn_task(self._host_call(inv))
            return
        slot = self.actors.get(actor)
        if slot is None and actor in self.stopped:
            self._refuse(actor, inv, ["LookupError", f"actor {actor!r} was stopped", "", False])
        elif slot is None:
            self.waiting.setdefault(actor, []).append(inv)
            self.loop.call_later(SPAWN_WAIT, self._expire, actor, inv)
        elif slot.instance is None and slot.error is None:
            slot.backlog.append(inv)
        else:
            self._start(slot, inv)

    def _expire(self, actor: str, inv: _Invocation) -> None:
        waiting = self.waiting.get(actor)
        if waiting and inv in waiting:
            waiting.remove(inv)
            self._refuse(actor, inv, ["LookupError", f"no actor named {actor!r} in this process", "", False])

    def _start(self, slot: _Slot, inv: _Invocation) -> None:
        if slot.error is not None:
            self._refuse(slot.name, inv, slot.error)
            return
        if slot.stopping:
            self._refuse(slot.name, inv, ["RuntimeError", f"actor {slot.name!r} is stopping", "", False])
            return
        ep = slot.endpoints.get(inv.method)
        if ep is None:
            cls = type(slot.instance).__qualname__
            self._refuse(slot.name, inv, ["AttributeError", f"{cls} has no endpoint {inv.method!r}", "", False])
            return
        try:
            args, kwargs = self._arguments(inv)
        except DecodeError as exc:
            self._refuse(slot.name, inv, error_record(exc, ""))
            return
        token = _context.set(slot.context)
        try:
            task = self.loop.create_task(self._invoke(slot, ep, args, kwargs, inv))
        finally:
            _context.reset(token)
        slot.tasks.add(task)
        task.add_done_callback(slot.tasks.discard)

    def _arguments(self, inv: _Invocation) -> tuple[list[Any], dict[str, Any]]:
        """Decode a call's ``[args, kwargs]``, refusing anything of another shape."""
        decoded = self.rt.decode_blob(inv.blob, inv.frames)
        if (
            type(decoded) is not list
            or len(decoded) != 2
            or type(decoded[0]) is not list
            or type(decoded[1]) is not dict
            or not all(type(key) is str for key in decoded[1])
        ):
            raise DecodeError("call arguments must be [list, dict with string keys]")
        return decoded[0], decoded[1]

    async def _invoke(
        self, slot: _Slot, ep: Endpoint[Any], args: list[Any], kwargs: dict[str, Any], inv: _Invocation
    ) -> None:
        try:
            if ep.is_async:
                result = await ep.fn(slot.instance, *args, **kwargs)
            else:
                call = functools.partial(ep.fn, slot.instance, *args, **kwargs)
                result = await self.loop.run_in_executor(self.executor, contextvars.copy_context().run, call)
        except asyncio.CancelledError:
            self._fail(
                slot,
                slot.name,
                inv,
                ["CancelledError", f"actor {slot.name!r} stopped before the call finished", "", False],
                report=False,
            )
        except BaseException as exc:
            self._fail(slot, slot.name, inv, error_record(exc, traceback.format_exc()))
        else:
            if inv.call_id:
                self.rt.reply(inv.reply_address, inv.reply_pid, inv.call_id, inv.rank, True, result)
            elif inv.port is not None:
                try:
                    inv.port.send(result)
                except Exception:
                    log.exception("could not send the result of %s.%s to its port", slot.name, inv.method)

    def _refuse(self, actor: str, inv: _Invocation, record: list[Any]) -> None:
        """A call that never ran (no such actor or endpoint, bad arguments): an error reply.

        Fire-and-forget, it is a bad message rather than an actor failure:
        dropped with a rate-limited log, never reported to the owner.
        """
        if inv.call_id:
            self.rt.reply(inv.reply_address, inv.reply_pid, inv.call_id, inv.rank, False, record)
        else:
            self.rt._dropped("a fire-and-forget call to %s.%s: %s: %s", actor, inv.method, record[0], record[1])

    def _fail(self, slot: _Slot | None, actor: str, inv: _Invocation, record: list[Any], report: bool = True) -> None:
        if inv.call_id:
            self.rt.reply(inv.reply_address, inv.reply_pid, inv.call_id, inv.rank, False, record)
            return
        if not report:
            return
        rank = slot.rank if slot is not None else inv.rank
        log.error(
            "fire-and-forget call %s[%d].%s failed: %s: %s\n%s",
            actor,
            rank,
            inv.method,
            record[0],
            record[1],
            str(record[2]).rstrip(),
        )
        self.report_failure(actor, rank, inv.method, record)

    def report_failure(self, actor: str, rank: int, method: str, record: list[Any]) -> None:
        """Send a failure of ``actor`` to the owner of this process (its supervisor)."""
        failure = [actor, rank, os.getpid(), method, record[0], record[1], record[2]]
        if not self.owner.dead:
            try:
                self.rt.control(self.owner, P.OP_FAILURE, failure)
            except Exception:
                log.exception("could not report a failure to the owner")

    def _spawn_task(self, coro: Any) -> None:
        task = self.loop.create_task(coro)
        self._host_tasks.add(task)
        task.add_done_callback(self._host_tasks.discard)

    # -------------------------------------------------------------- host operations

    async def _host_call(self, inv: _Invocation) -> None:
        try:
            args, _kwargs = self._arguments(inv)
            if inv.method == "spawn":
                result = self._spawn(inv, *args)
            elif inv.method == "stop_actor":
                await self._stop_actor(*args)
                result = None
            elif inv.method == "stop":
                await self._stop_all(*args)
                result = None
            else:
                raise AttributeError(f"unknown host operation {inv.method!r}")
        except BaseException as exc:
            self._fail(None, HOST, inv, error_record(exc, traceback.format_exc(), spawn_failed=inv.method == "spawn"))
            return
        if result is not _DEFERRED and inv.call_id:
            self.rt.reply(inv.reply_address, inv.reply_pid, inv.call_id, inv.rank, True, result)
        if inv.method == "stop":
            self.rt.flush_all()
            self.finished.set()

    def _spawn(self, inv: _Invocation, name: str, class_ref: str, extent: dict[str, int], ctor: bytes) -> Any:
        if name in self.actors:
            raise ValueError(f"an actor named {name!r} already exists in this process")
        self.stopped.discard(name)
        slot = _Slot(name, inv.rank, dict(extent))
        slot.backlog = self.waiting.pop(name, [])
        self.actors[name] = slot
        token = _context.set(slot.context)
        try:
            cls = _refs.resolve(class_ref, allow_import=True)
            if not (isinstance(cls, type) and issubclass(cls, Actor)):
                raise TypeError(f"{class_ref} is not an Actor subclass")
            args, kwargs = self.rt.decode_blob(ctor, inv.frames)
            slot.instance = cls(*args, **kwargs)
            slot.endpoints = endpoints_of(cls)
        except BaseException as exc:
            slot.error = error_record(exc, traceback.format_exc(), spawn_failed=True)
            log.error("could not construct actor %s[%d]: %s: %s", name, inv.rank, slot.error[0], slot.error[1])
            if inv.call_id:
                self.rt.reply(inv.reply_address, inv.reply_pid, inv.call_id, inv.rank, False, slot.error)
        else:
            if inv.call_id:
                self.rt.reply(inv.reply_address, inv.reply_pid, inv.call_id, inv.rank, True, None)
        finally:
            _context.reset(token)
        self._retitle()
        backlog, slot.backlog = slot.backlog, []
        for waiting in backlog:
            self._start(slot, waiting)
        return _DEFERRED

    def _retitle(self) -> None:
        names = [f"{name}[{slot.rank}]" for name, slot in self.actors.items()]
        self.label[0] = ",".join(names) or self.config["name"]
        _set_title(self.config, names)

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

    async def _stop_slot(self, slot: _Slot, exc: BaseException | None, timeout: float) -> None:
        slot.stopping = True
        cleanup = getattr(slot.instance, "__cleanup__", None)
        if cleanup is not None:
            token = _context.set(slot.context)
            try:
                result = cleanup(exc)
                if inspect.isawaitable(result):
                    await asyncio.wait_for(result, timeout)
            except Exception:
                log.exception("__cleanup__ of %s[%d] failed", slot.name, slot.rank)
            finally:
                _context.reset(token)
        for task in list(slot.tasks):
            task.cancel()
        if slot.tasks:
            await asyncio.wait(list(slot.tasks), timeout=1.0)

    def shutdown(self, reason: str) -> None:
        """Stop every actor quickly and end the process (SIGTERM, owner death)."""
        if self._stopping:
            return
        self._stopping = True
        log.warning("stopping: %s", reason)

        async def stop() -> None:
            try:
                await self._stop_all(timeout=0.5)
            finally:
                self.finished.set()

        self._spawn_task(stop())

    def _on_death(self, ref: Any) -> None:
        if ref is self.owner:
            self.shutdown("the owning process exited")


_DEFERRED = object()
_host: list[ActorHost] = []  # this worker's host, once serving


def supervise(actor: str, failure: Any) -> bool:
    """Offer ``failure`` to the ``__supervise__`` of ``actor`` (hosted here); True if handled."""
    slot = _host[0].actors.get(actor) if _host else None
    if slot is None or slot.instance is None:
        return False
    token = _context.set(slot.context)
    try:
        return bool(slot.instance.__supervise__(failure))
    except Exception:
        log.exception("__supervise__ of %s[%d] raised; the failure stays unhandled", slot.name, slot.rank)
        return False
    finally:
        _context.reset(token)


def escalate(actor: str, failure: Any) -> None:
    """Report an unhandled ``failure`` to this process's owner as a failure of ``actor``."""
    if not _host:
        return
    host = _host[0]
    slot = host.actors.get(actor)
    rank = slot.rank if slot is not None else 0
    record = ["SupervisionError", f"unhandled failure of an actor it spawned: {failure}", failure.traceback, False]
    host.report_failure(actor, rank, "__supervise__", record)
