"""The background loop: a thread that drives a synchronous program's runtime while none of its own loops does.

A plain script (no event loop) would otherwise handle its inbox only while
it blocks in ``Future.get()``: a fault hook, a supervision event or a port
message would wait until then. Instead, the first time such a program uses
the runtime, a daemon thread starts a uvloop event loop and the runtime is
bound to it; the program's calls hand their work to that loop and wait on
their own thread, as a synchronous actor's thread does in a worker.

The thread only ever runs the runtime's handlers and what they call: the
controller's ``unhandled_fault_hook`` and failure handlers (as in Monarch,
whose hook runs on its runtime's thread). When the program starts an event
loop of its own and uses the runtime there, the background loop hands the
runtime over and ends; it stops, too, when the runtime closes at exit.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

from .._shared._loops import close_loop

__all__ = ["HANDOVER_TIMEOUT", "BackgroundLoop"]

#: How long starting or handing over the background loop may take (seconds); it takes milliseconds.
HANDOVER_TIMEOUT = 10.0


class BackgroundLoop:
    """One daemon thread running an event loop bound to the runtime, until :meth:`stop`."""

    def __init__(self, bind: Callable[[], object], unbind: Callable[[], None]) -> None:
        self._bind = bind
        self._unbind = unbind
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        self._stop: asyncio.Event | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._main, name="actors-runtime", daemon=True)

    def start(self) -> asyncio.AbstractEventLoop:
        """Start the thread and return its loop once the runtime is bound to it."""
        self._thread.start()
        if not self._ready.wait(HANDOVER_TIMEOUT):
            raise RuntimeError(f"the actors runtime's background loop did not start within {HANDOVER_TIMEOUT:g}s")
        if self._failure is not None:
            raise RuntimeError("the actors runtime's background loop failed to start") from self._failure
        assert self.loop is not None
        return self.loop

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def thread_id(self) -> int | None:
        return self._thread.ident

    def stop(self) -> None:
        """Unbind the runtime on the loop's own thread, end the loop and wait for the thread (any other thread)."""
        if threading.get_ident() == self._thread.ident:
            raise RuntimeError("the actors runtime's background loop cannot stop itself")
        loop, stop = self.loop, self._stop
        if loop is not None and stop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(stop.set)
            except RuntimeError:
                pass  # the loop closed meanwhile
        self._thread.join(HANDOVER_TIMEOUT)
        if self._thread.is_alive():
            raise RuntimeError(
                f"the actors runtime's background loop did not hand over within {HANDOVER_TIMEOUT:g}s "
                "(a fault hook or failure handler running there has not returned)"
            )

    def _main(self) -> None:
        import uvloop

        loop = uvloop.new_event_loop()
        try:
            loop.run_until_complete(self._serve())
        except BaseException as exc:  # reported by start(); after that, the loop just ends
            self._failure = exc
            self._ready.set()
        finally:
            close_loop(loop)

    async def _serve(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        try:
            self._bind()
        except BaseException as exc:
            self._failure = exc
            self._ready.set()
            return
        self._ready.set()
        try:
            await self._stop.wait()
        finally:
            self._unbind()
