"""``get_or_spawn_controller``: one actor per name in the whole session, found from any process.

The first process to ask for a name claims it (an exclusive create in the
session directory), spawns the actor in a process of its own and publishes
the actor's handle there; every other process, and every later request,
gets that same actor. The controller lives as long as the process that
claimed it (in Monarch, as long as the client). The claim names the
claimer's pid: a claim whose process exited before publishing fails its
waiters at once, and a claimer whose spawn fails withdraws its claim (a
process waiting for it then claims the name itself).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import urllib.parse
from typing import Any, TypeVar

from .._hosting._actor import Actor
from .._runtime._core import Runtime, runtime
from .._runtime._future import Future
from .._runtime._parts import Part
from .._shared._errors import ActorDied, CallTimeout
from .._shared._liveness import pid_exists
from .._shared._loops import loop_running
from ._host_mesh import this_host
from ._proc_mesh import ProcMesh

__all__ = ["CONTROLLERS", "Controllers", "get_or_spawn_controller", "stop_controllers"]

A = TypeVar("A", bound=Actor)

#: How long a process waits for another one that claimed a name to publish its controller.
PUBLISH_WAIT = 30.0
#: How often it looks while waiting.
POLL = 0.005


class Controllers:
    """The controllers this process knows: those it looked up, and those it spawned (which end with it)."""

    __slots__ = ("found", "spawned", "unwinding")

    def __init__(self) -> None:
        #: Every controller this process has looked up or spawned, by name.
        self.found: dict[str, Any] = {}
        #: The proc meshes of the controllers this process spawned, by name.
        self.spawned: dict[str, ProcMesh] = {}
        #: The stops of proc meshes whose controller failed to spawn (kept until each ends).
        self.unwinding: set[asyncio.Task[None]] = set()

    async def stop(self) -> None:
        """Stop the controllers this process spawned and withdraw their names (a worker's actors stopped)."""
        await stop_controllers()


#: Kept on the runtime (``rt.parts``): this process's controllers.
CONTROLLERS: Part[Controllers] = Part("controllers", Controllers)


def _paths(rt: Runtime, name: str) -> tuple[str, str]:
    folder = os.path.join(rt.dir, "controllers")
    os.makedirs(folder, exist_ok=True)
    base = os.path.join(folder, urllib.parse.quote(name, safe=""))
    return base + ".claim", base + ".mesh"


def _publish(rt: Runtime, path: str, mesh: Any) -> None:
    """Write the controller's handle for other processes (encoded on the runtime's thread: the encoder's state
    is shared with every message this process sends; a synchronous endpoint calls from its actor's thread)."""

    def encode() -> bytes:
        enc = rt.encoder_now()
        enc.reset()
        return bytes(enc.encode(mesh))

    blob = rt.driver.on_thread(encode)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(blob)
    os.replace(tmp, path)  # readers see the whole handle or none


def _read(rt: Runtime, path: str) -> Any:
    try:
        with open(path, "rb") as f:
            blob = f.read()
    except FileNotFoundError:
        return None
    return rt.driver.on_thread(lambda: rt.inbox.decoder.decode(blob, []))  # (the inbox's decoder: its thread)


def _claim(rt: Runtime, name: str, cls: type[Actor], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """This process's controller ``name``, spawning it if this process is first; None if another one is."""
    claim, published = _paths(rt, name)
    try:
        fd = os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except FileExistsError:
        return _read(rt, published)
    try:
        os.write(fd, str(os.getpid()).encode())
    finally:
        os.close(fd)
    controllers = rt.parts.get(CONTROLLERS)
    procs = None
    try:
        procs = this_host().spawn_procs({"procs": 1}, name=f"controller-{name}")
        if not controllers.spawned and rt.server is not None:
            rt.server.stop_last(controllers)  # a worker's controllers end with its actors
        controllers.spawned[name] = procs
        mesh = procs.spawn(name, cls, *args, **kwargs)
        _publish(rt, published, mesh)
    except BaseException:  # (arguments that cannot be sent, no room for processes): the name is free again
        with contextlib.suppress(FileNotFoundError):
            os.remove(claim)
        if procs is not None:
            controllers.spawned.pop(name, None)
            _unwind(controllers, procs)
        raise
    return mesh


def _unwind(controllers: Controllers, procs: ProcMesh) -> None:
    """Stop the proc mesh of a controller that failed to spawn: now, or on the running loop."""
    stopping = procs.stop()  # the stop request leaves at once
    if not loop_running():
        stopping.get()
        return
    task = asyncio.ensure_future(stopping)  # (on this thread's running loop)
    controllers.unwinding.add(task)
    task.add_done_callback(controllers.unwinding.discard)


def _claimer(path: str) -> int | None:
    """The pid recorded in a claim (None while it is being written, or for a claim without one)."""
    try:
        with open(path, "rb") as f:
            text = f.read(32)
    except FileNotFoundError:
        return None
    return int(text) if text.isdigit() else None


async def stop_controllers() -> None:
    """Stop the controllers this process spawned and withdraw their names (for tests and orderly exits).

    Also waits for the background stops of controllers whose spawn failed, so no process of theirs outlives it.
    """
    rt = runtime()
    controllers = rt.parts.get(CONTROLLERS)
    while controllers.spawned:
        name, procs = controllers.spawned.popitem()
        controllers.found.pop(name, None)
        for path in _paths(rt, name):
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
        await procs.stop()
    loop = asyncio.get_running_loop()  # the stops of controllers that failed to spawn end before this returns
    unwinding = [task for task in controllers.unwinding if task.get_loop() is loop]
    if unwinding:
        await asyncio.gather(*unwinding, return_exceptions=True)
    controllers.found.clear()
    with contextlib.suppress(OSError):
        os.rmdir(os.path.join(rt.dir, "controllers"))


def get_or_spawn_controller(name: str, cls: type[A], *args: Any, **kwargs: Any) -> Future[A]:
    """The session's one actor called ``name``: spawned as ``cls(*args, **kwargs)`` by the first caller.

    Any process (the controller or an actor) gets the same actor for the
    same name; later callers' ``cls`` and arguments are not used.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"a controller's name must be a non-empty string, not {name!r}")
    if not (isinstance(cls, type) and issubclass(cls, Actor)):
        raise TypeError(f"get_or_spawn_controller() needs an Actor subclass, not {cls!r}")
    rt = runtime()
    known = rt.parts.get(CONTROLLERS).found
    found = known.get(name)
    if found is None:
        found = _claim(rt, name, cls, args, kwargs)
        if found is not None:
            known[name] = found
    if found is not None:
        return Future.ready(found)
    claim, published = _paths(rt, name)

    def lookup() -> Any:
        mesh = _read(rt, published)
        if mesh is None and not os.path.exists(claim):  # its claimer failed to spawn it and withdrew: ours now
            mesh = _claim(rt, name, cls, args, kwargs)
        if mesh is not None:
            known[name] = mesh
        return mesh

    def too_late() -> CallTimeout:
        return CallTimeout(f"controller {name!r} was claimed by another process that has not published it")

    def check_claimer() -> None:
        pid = _claimer(claim)
        if pid is not None and not pid_exists(pid) and lookup() is None:
            raise ActorDied(
                f"controller {name!r} was claimed by pid {pid}, which exited before publishing it; the claim "
                "stays until this session ends (use another name)",
                pid=pid,
                actor=name,
            )

    async def wait() -> A:
        deadline = time.monotonic() + PUBLISH_WAIT
        while (mesh := lookup()) is None:
            check_claimer()
            if time.monotonic() > deadline:
                raise too_late()
            await asyncio.sleep(POLL)
        return mesh  # type: ignore[no-any-return]

    def wait_sync(timeout: float | None) -> A:
        limit = PUBLISH_WAIT if timeout is None else min(timeout, PUBLISH_WAIT)
        deadline = time.monotonic() + limit
        while (mesh := lookup()) is None:
            check_claimer()
            if time.monotonic() > deadline:
                raise too_late()
            with contextlib.suppress(CallTimeout):
                rt.driver.wait(lambda: False, timeout=POLL, what="a controller")
        return mesh  # type: ignore[no-any-return]

    return Future(wait, wait_sync)
