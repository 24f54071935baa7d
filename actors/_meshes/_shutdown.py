"""Monarch's ``shutdown_context``: stop everything this program started on its host, once it is done with actors.

It stops every proc mesh this process spawned and still holds (the
companion ``this_proc()`` included), then the controllers it spawned: an
actor's ``__cleanup__`` may still call one. The runtime itself stays
usable: a later spawn starts afresh. (At interpreter exit the same happens
without being asked.)
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from .._runtime._core import current_runtime
from .._runtime._future import Future
from .._shared._errors import CallTimeout
from ._controllers import CONTROLLERS, stop_controllers
from ._proc_mesh import SPAWNED_MESHES

__all__ = ["shutdown_context"]


def shutdown_context(host_timeout: float | None = None) -> Future[None]:
    """Stop this process's proc meshes and controllers; await the result or ``get()`` it."""
    rt = current_runtime()
    if rt is None:
        return Future.ready(None)
    spawned = rt.parts.get(SPAWNED_MESHES)
    controllers = {id(mesh) for mesh in rt.parts.get(CONTROLLERS).spawned.values()}  # (stopped after the rest)
    # each stop request leaves now; a mesh whose stop is under way (or was given up on) is waited for
    stops = [mesh.stop() for mesh in list(spawned) if id(mesh) not in controllers]

    def too_long(limit: float | None) -> CallTimeout:
        return CallTimeout(
            f"the proc meshes did not stop within host_timeout={limit:g}s; their stops go on (a process "
            "that does not answer is killed)"
        )

    async def run() -> None:
        try:
            await asyncio.wait_for(asyncio.gather(*(_awaited(stop) for stop in stops)), host_timeout)
        except asyncio.TimeoutError:
            raise too_long(host_timeout) from None
        finally:  # (past host_timeout the meshes' stops go on; the controllers stop all the same)
            await stop_controllers()

    def run_sync(timeout: float | None) -> None:
        limit = host_timeout if timeout is None else timeout
        deadline = None if limit is None else time.monotonic() + limit  # (one bound for them all, as awaited)
        try:
            for stop in stops:
                try:
                    stop.get(timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
                except CallTimeout:
                    raise too_long(limit) from None
        finally:  # (as on a loop: the controllers stop whatever became of the meshes' stops)
            with contextlib.suppress(RuntimeError):
                asyncio.run(stop_controllers())

    return Future(run, run_sync)


async def _awaited(stop: Future[None]) -> None:
    await stop
