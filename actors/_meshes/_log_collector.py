"""The controller's end of a proc mesh's forwarded output: it receives the lines, aggregates them, prints them.

``ProcMesh.logging_option(stream_to_client=True)`` hands the mesh's
processes this collector's port; from then on each line they write arrives
here and is printed on this process's own ``sys.stdout`` / ``sys.stderr``
(looked up at each print, so a redirection or a notebook's capture sees
it), at once or, with a window, as :class:`~._line_aggregator.LineAggregator`
groups. Receiving and the window's timer run on the runtime's loop; a
caller changing the options does so from any thread, under a lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import threading
import time

from .._runtime._core import Runtime
from .._runtime._port import Channel, Port, PortReceiver
from .._shared._errors import PortClosed
from .._shared._output_line import OutputLine
from ._line_aggregator import LineAggregator, Printed

__all__ = ["LogCollector"]


class LogCollector:
    """Prints what a proc mesh's processes forward; opened on the first ``logging_option`` that streams."""

    def __init__(self, rt: Runtime, window: float | None) -> None:
        self._rt = rt
        self._lock = threading.Lock()
        self._lines = LineAggregator(window)
        self._timer: asyncio.TimerHandle | None = None
        self.port: Port[OutputLine]
        self._receiver: PortReceiver[OutputLine]
        self.port, self._receiver = Channel.open(OutputLine)
        self._task: asyncio.Task[None] = rt.driver.on_thread(self._start)

    def _start(self) -> asyncio.Task[None]:
        loop = self._rt.driver.loop
        assert loop is not None
        return loop.create_task(self._receive())

    async def _receive(self) -> None:
        while True:
            try:
                line = await self._receiver.recv()
            except PortClosed:  # every process of the mesh has exited
                return
            if line is None:
                return
            self._take([line])

    def _take(self, lines: list[OutputLine | None]) -> None:
        now = time.monotonic()
        with self._lock:
            printed = [p for line in lines if line is not None for p in self._lines.add(line, now)]
            self._arm()
        _print(printed)

    def _arm(self) -> None:
        """Set the timer for the held lines' deadline (under the lock, on the loop's thread)."""
        deadline = self._lines.deadline
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        loop = self._rt.driver.loop
        if deadline is not None and loop is not None:
            self._timer = loop.call_at(loop.time() + max(0.0, deadline - time.monotonic()), self._due)

    def _due(self) -> None:
        with self._lock:
            self._timer = None
            printed = self._lines.flush()
        _print(printed)

    def set_window(self, window: float | None) -> None:
        """Aggregate over ``window`` seconds from now on (None: print each line; what is held is printed now).

        Lines already received count under the old window.
        """
        self._rt.driver.on_thread(lambda: self._change(window))

    def _change(self, window: float | None) -> None:
        self._take(self._receiver.recv_ready())
        with self._lock:
            printed = self._lines.set_window(window)
            self._arm()
        _print(printed)

    def flush(self) -> None:
        """Print whatever is held or already received, now."""

        def flush_now() -> None:
            self._take(self._receiver.recv_ready())
            with self._lock:
                printed = self._lines.flush()
                self._arm()
            _print(printed)

        self._rt.driver.on_thread(flush_now)

    def close(self) -> None:
        """Print what is held and stop receiving (the mesh stopped)."""
        with contextlib.suppress(Exception):
            self.flush()

        def stop() -> None:
            if self._timer is not None:
                self._timer.cancel()
            self._task.cancel()
            with contextlib.suppress(Exception):
                self._receiver.close()

        with contextlib.suppress(Exception):
            self._rt.driver.on_thread(stop)


def _print(printed: list[Printed]) -> None:
    for stream, text in printed:
        out = sys.stdout if stream == "stdout" else sys.stderr
        print(text, file=out, flush=True)
