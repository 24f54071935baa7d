"""``this_host()``: the local machine as a place to spawn actor processes."""

from __future__ import annotations

import math
import os
import sys
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

from .._processes._devices import GPU_DIM, gpu_env, visible_gpus
from .._processes._forkserver import forkserver, prefork
from .._runtime._core import Runtime, current_runtime, runtime
from .._runtime._future import Future
from .._runtime._parts import Part
from .._runtime._value_mesh import Extent
from .._shared._config import WorkerConfig
from .._shared._liveness import ProcRef
from .._shared._main_loader import loading_main
from .._shared._restart import RestartMode, RestartPolicy
from .._shared._session import inbox_address
from .._wire import _refs
from ._proc_mesh import ProcMesh

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["HostMesh", "this_host", "this_proc"]

#: How long a program's thread waits for the runtime's thread to start a spawn (it takes milliseconds).
SPAWN_HANDOFF_TIMEOUT = 60.0


def main_module() -> list[str] | None:
    """How a worker can load the launching script's ``__main__`` module."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and getattr(spec, "name", None) and spec.name != "__main__":
        return ["module", spec.name]
    path = getattr(main, "__file__", None)
    if path and path.endswith(".py") and os.path.exists(path):
        return ["path", os.path.abspath(path)]
    return None


def check_spawn(
    per_host: dict[str, int] | None, bootstrap: Callable[[], None] | None
) -> tuple[dict[str, int], str | None]:
    """``spawn_procs``' checks: the per-host extent, and the bootstrap function's name."""
    if loading_main.get():
        raise RuntimeError(
            "spawn_procs() ran while an actor process was importing the launching script; "
            'guard the script\'s entry point with `if __name__ == "__main__":`'
        )
    extent = dict(per_host or {"procs": 1})
    if not extent or any(type(n) is not int or n < 1 for n in extent.values()):
        raise ValueError(f"per_host must map dimension names to positive sizes, not {per_host!r}")
    boot = _refs.qualified_name(bootstrap) if bootstrap is not None else None
    if boot is not None and "<locals>" in boot:
        raise TypeError("bootstrap must be a module-level function")
    return extent, boot


def worker_config(
    rt: Runtime,
    name: str,
    address: str,
    rank: int,
    main: list[str] | None,
    boot: str | None,
    threads: int,
    env: dict[str, str],
) -> WorkerConfig:
    """What one worker process needs to start: its inbox, its owner (this process), the script's code."""
    return WorkerConfig(
        name=name,
        address=address,
        owner_address=rt.address,
        owner_pid=rt.pid,
        rank=rank,
        argv=list(sys.argv),
        sys_path=list(sys.path),
        cwd=os.getcwd(),
        main=main,
        bootstrap=boot,
        threads=threads,
        env=env,
    )


class HostMesh:
    """The local host. ``spawn_procs`` starts processes forked from a warm forkserver.

    As Monarch's, ``shutdown()`` (and ``stop()``, the same here: this machine serves on) stops the proc meshes
    spawned through it, and ``async with this_host() as host:`` shuts it down on leaving.
    """

    def __init__(self) -> None:
        #: The proc meshes spawned through this host mesh, which its shutdown stops (weakly held, as the runtime
        #: holds them: a mesh the program dropped is not kept alive by the host it came from).
        self._spawned: weakref.WeakSet[ProcMesh] = weakref.WeakSet()

    @property
    def extent(self) -> Extent:
        """One host: ``{"hosts": 1}``."""
        return Extent(["hosts"], [1])

    def shutdown(self) -> Future[None]:
        """Stop every proc mesh spawned through this host mesh (their actors' ``__cleanup__``, then the processes);
        ``await`` it, or ``get()`` it from synchronous code."""
        meshes = list(self._spawned)
        self._spawned.clear()

        async def stopped() -> None:
            failures = []
            for mesh in meshes:  # (each one: a stop that raises leaves none of the others running)
                try:
                    await mesh.stop()
                except Exception as exc:
                    failures.append(exc)
            if failures:
                raise failures[0]

        def stopped_here(timeout: float | None) -> None:
            deadline = None if timeout is None else time.monotonic() + timeout
            failures = []
            for mesh in meshes:
                try:
                    mesh.stop().get(None if deadline is None else max(0.0, deadline - time.monotonic()))
                except Exception as exc:
                    failures.append(exc)
            if failures:
                raise failures[0]

        return Future(stopped, stopped_here)

    def stop(self) -> Future[None]:
        """Monarch's stop (the host serves on for a later host mesh): here, :meth:`shutdown`."""
        return self.shutdown()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()

    @property
    def initialized(self) -> Future[Literal[True]]:
        """Monarch's readiness future: ``True``. This host and Ray's ``host_mesh`` are ready when returned;
        ``attach_to_workers``' mesh overrides this to wait for its workers."""
        return Future.ready(True)

    def spawn_procs(
        self,
        per_host: dict[str, int] | None = None,
        bootstrap: Callable[[], None] | None = None,
        name: str | None = None,
        *,
        threads: int = 1,
        restart: RestartMode = "never",
        max_restarts: int = 3,
        restart_period: float = 60.0,
    ) -> ProcMesh:
        """Start ``prod(per_host.values())`` processes; returns at once.

        ``per_host`` names the mesh's dimensions (``{"procs": 4}``,
        ``{"gpus": 8}``); a ``gpus`` dimension gives each process its own GPU
        as ``CUDA_VISIBLE_DEVICES`` (see :mod:`actors._processes._devices`).
        ``bootstrap`` is a module-level function run in each process before it
        serves. ``threads`` sets torch's intra-op threads per process (1 keeps
        many processes from fighting over few cores). ``restart="on-failure"``
        replaces a process that dies (at most ``max_restarts`` times within
        ``restart_period`` seconds) with a new one at the same address, its
        actors constructed again with their original arguments.
        """
        policy = RestartPolicy(restart, max_restarts, restart_period)
        extent, boot = check_spawn(per_host, bootstrap)
        return self._spawn(extent, boot, name, threads, policy)

    def _spawn(
        self, extent: dict[str, int], boot: str | None, name: str | None, threads: int, policy: RestartPolicy
    ) -> ProcMesh:
        """Start the processes of checked arguments: here, from the forkserver (a mesh of other hosts overrides it)."""
        if current_runtime() is None:
            prefork()  # while this process may still be single-threaded: a forked forkserver starts at once
        rt = runtime()
        # here, not on the runtime's thread: without CUDA_VISIBLE_DEVICES torch counts them (a first import of it
        # takes seconds, which would hold a background loop's replies, deaths and credit for every mesh)
        gpus = visible_gpus() if GPU_DIM in extent else []
        # On the runtime's thread: from a synchronous program that is its background loop's.
        mesh: ProcMesh = rt.driver.on_thread(
            lambda: _spawn_procs(rt, name, extent, boot, threads, policy, gpus), timeout=SPAWN_HANDOFF_TIMEOUT
        )
        self._spawned.add(mesh)
        return mesh


def _spawn_procs(
    rt: Runtime,
    name: str | None,
    extent: dict[str, int],
    boot: str | None,
    threads: int,
    policy: RestartPolicy,
    gpus: list[str],
) -> ProcMesh:
    """Ask the forkserver for the processes of a new proc mesh (the runtime's thread); ``gpus``: the GPUs this
    process may hand out (``visible_gpus``), for a mesh with a ``gpus`` dimension."""
    server = forkserver(rt, threads)
    # Even a forkserver forked from this program needs it: it holds only what the script had defined
    # by the first spawn_procs, and a script may define actor classes after that (Monarch's ping_pong).
    main = main_module()
    mesh_name = name or f"procs{rt.counter('mesh')}"
    procs: list[ProcRef] = []
    configs: list[WorkerConfig] = []
    for rank in range(math.prod(extent.values())):
        index = rt.counter("worker")
        address = inbox_address(rt.dir, f"w{rt.pid}-{index}")  # unique in the session, nested spawns too
        config = worker_config(
            rt, f"{mesh_name}.{rank}", address, rank, main, boot, threads, gpu_env(extent, rank, gpus)
        )
        ref = rt.registry.proc(address, None)
        server.spawn(index, config, ref)
        procs.append(ref)
        configs.append(config)

    def respawn(rank: int, ref: ProcRef) -> None:
        forkserver(rt, threads).spawn(rt.counter("worker"), configs[rank], ref)

    return ProcMesh(mesh_name, extent, procs, policy, respawn)


def this_host() -> HostMesh:
    """The host this program runs on."""
    return HostMesh()


def this_proc() -> ProcMesh:
    """The process this code runs in, as a proc mesh of one: ``this_proc().spawn(...)`` places actors here.

    Inside an actor it is the actor's own process. In the controller it is
    a companion process started on first use (and stopped with the
    controller): actors never run on the caller's own event loop, which
    they could block (Monarch places them in the client process itself).
    """
    rt = runtime()
    if rt.server is not None:
        return ProcMesh("this_proc", {"procs": 1}, [rt.registry.proc(rt.address, rt.pid)], owned=False)
    companion = rt.parts.get(THIS_PROC)

    def started() -> ProcMesh:  # (on the runtime's thread: two threads asking at once get one companion)
        local = companion.mesh
        if local is None or local.stopping:
            local = companion.mesh = this_host().spawn_procs({"procs": 1}, name="this_proc")
        return local

    return rt.driver.on_thread(started)  # type: ignore[no-any-return]


class Companion:
    """The controller's ``this_proc()``: a process of its own, started on first use."""

    __slots__ = ("mesh",)

    def __init__(self) -> None:
        self.mesh: ProcMesh | None = None


#: Kept on the runtime (``rt.parts``): the controller's companion process.
THIS_PROC: Part[Companion] = Part("this_proc", Companion)
