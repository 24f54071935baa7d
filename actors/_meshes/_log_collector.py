"""The controller's end of a proc mesh's forwarded output: it receives the lines, aggregates them, prints them.

``ProcMesh.logging_option(stream_to_client=True)`` hands the mesh's
processes this collector's port; from then on each line they write arrives
here and is printed on this process's own ``sys.stdout`` / ``sys.stderr``
(looked up at each print, so a redirection or a notebook's capture sees
it), at once or, with a window, as :class:`~._line_aggregator.LineAggregator`
groups. Receiving, the window's timer and option changes all run on the
runtime's loop (a caller on another thread hands its change over), so its
state needs no lock; printing happens there too, so a ``sys.stdout`` that blocks holds up this process's
messages while it does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time

from .._runtime._core import Runtime
from .._runtime._port import Channel, Port, PortReceiver
from .._shared._errors import PortClosed
from .._shared._output_line import OutputLine
from ._line_aggregator import LineAggregator, Printed

__all__ = ["LogCollector"]

log = logging.getLogger("actors")


class LogCollector:
    """Prints what a proc mesh's processes forward; opened on the first ``logging_option`` that streams."""

    def __init__(self, rt: Runtime, window: float | None) -> None:
        self._rt = rt
        self._lines = LineAggregator(window)
        self._timer: asyncio.TimerHandle | None = None
        self._armed_for: float | None = None  # the deadline the timer is set for
        self.port: Port[OutputLine]
        self._receiver: PortReceiver[OutputLine]
        self.port, self._receiver = Channel.open(OutputLine)
        self._task: asyncio.Task[None] | None = None
        self.ensure_receiving()
        rt.driver.moved.connect(self._start)  # (the receiving task and the timer die with a loop the program left)

    def ensure_receiving(self) -> None:
        """Receive on the runtime's current loop (again, when the program moved to another loop since)."""
        self._rt.driver.on_thread(self._start)

    def _start(self) -> None:
        loop = self._rt.driver.loop
        task = self._task
        if loop is None or (task is not None and not task.done() and task.get_loop() is loop):
            return
        if task is not None:
            task.cancel()  # bound to a loop the program left
        self._armed_for = None  # (so was the timer)
        self._task = loop.create_task(self._receive())
        self._arm()

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
        printed = [p for line in lines if line is not None for p in self._lines.add(line, now)]
        self._arm()
        _print(printed)

    def _arm(self) -> None:
        """Set the timer for the held lines' deadline."""
        deadline = self._lines.deadline
        if deadline == self._armed_for:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._armed_for = deadline
        loop = self._rt.driver.loop
        if deadline is not None and loop is not None:
            self._timer = loop.call_at(loop.time() + max(0.0, deadline - time.monotonic()), self._due)

    def _due(self) -> None:
        self._timer = None
        self._armed_for = None
        _print(self._lines.flush())

    def set_window(self, window: float | None) -> None:
        """Aggregate over ``window`` seconds from now on (None: print each line; what is held is printed now).

        Lines already received count under the old window.
        """
        self._rt.driver.on_thread(lambda: self._change(window))

    def _change(self, window: float | None) -> None:
        self._take(self._receiver.recv_ready())
        printed = self._lines.set_window(window)
        self._arm()
        _print(printed)

    def close(self) -> None:
        """Print what is held or already received, and stop receiving (the mesh stopped)."""
        with contextlib.suppress(Exception):
            self.set_window(None)

        def stop() -> None:
            with contextlib.suppress(ValueError):
                self._rt.driver.moved.disconnect(self._start)
            if self._timer is not None:
                self._timer.cancel()
            with contextlib.suppress(Exception):
                self._receiver.close()
            if self._task is not None:
                self._task.cancel()

        with contextlib.suppress(Exception):
            self._rt.driver.on_thread(stop)


def _print(printed: list[Printed]) -> None:
    for stream, text in printed:
        out = sys.stdout if stream == "stdout" else sys.stderr
        try:
            print(text, file=out, flush=True)
        except Exception:  # a closed or broken stream of the program's: the line is lost, the receiving goes on
            log.debug("could not print a worker's line on sys.%s", stream, exc_info=True)
