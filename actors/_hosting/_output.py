"""A worker's stdout and stderr: each line prefixed with its actors' names, written here or sent to the controller.

By default a worker writes its lines to its own descriptors (inherited from
the forkserver: for a process of the controller's machine, the controller's
terminal). After ``ProcMesh.logging_option(stream_to_client=True)`` it sends
each complete line to the controller's log port instead, where the
controller prints it with its own Python streams (aggregated over a window
when asked): output then reaches a notebook, a redirected ``sys.stdout``, or
a controller on another machine.

Writing never waits: on the runtime loop's thread a write sends its
complete lines at once (a port send never blocks there); any other thread
only queues them and the loop sends them (one wake-up per batch), so a
thread that prints while the loop is busy, or a line written while another
is being sent (a warning the send logs), can neither block nor deadlock.
Only Python-level writes to ``sys.stdout``/``sys.stderr`` are forwarded; a C
library or a subprocess writing to the descriptors goes straight to them.
"""

from __future__ import annotations

import asyncio
import collections
import io
import threading
from typing import TYPE_CHECKING, TextIO

from .._shared._output_line import OutputLine

if TYPE_CHECKING:
    from .._runtime._port import Port

__all__ = ["MAX_PARTIAL", "ProcessOutput", "WorkerStream"]

#: A line not ended after this many characters (a progress bar redrawn with ``\r``) is sent as it stands.
MAX_PARTIAL = 64 * 1024


class ProcessOutput:
    """Where this process's output lines go: its descriptors, or the controller's log port, in order."""

    def __init__(self, name: str, rank: int, raw: dict[str, TextIO]) -> None:
        self._process = name
        #: What starts each line written here: the actors' names and ranks (the process's name before any).
        self.label = name
        #: What a forwarded line names: the actors' names (its rank travels beside it).
        self.name = name
        self.rank = rank
        self._raw = raw  # "stdout"/"stderr" -> this process's own streams
        self._port: Port[OutputLine] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queue: collections.deque[tuple[str, str]] = collections.deque()
        self._lock = threading.Lock()
        self._scheduled = False
        self._draining = False  # a drain is sending (on the loop's thread)
        self._loop_thread: int | None = None

    def rename(self, actors: list[tuple[str, int]]) -> None:
        """The actors this process hosts now, as ``(name, rank)``."""
        self.label = ",".join(f"{name}[{rank}]" for name, rank in actors) or self._process
        self.name = ",".join(name for name, _ in actors) or self._process

    @property
    def forwarding(self) -> bool:
        return self._port is not None

    def forward_to(self, port: Port[OutputLine] | None) -> None:
        """Send lines to ``port`` from now on (None: write them here); called on the runtime's loop."""
        self._drain()  # what was queued goes where it was meant to
        self._loop = asyncio.get_running_loop() if port is not None else None
        self._loop_thread = threading.get_ident() if port is not None else None
        self._port = port

    def finish(self) -> None:
        """The process is ending (on its loop, before its runtime closes): send what is queued, then write here."""
        self._drain()
        self._port = None
        self._loop = None
        self._loop_thread = None

    def queue(self, stream: str, lines: list[str]) -> None:
        """Queue complete lines for the controller; from any thread, never waiting.

        On the loop's thread they leave at once (so lines an endpoint printed
        reach the controller before its answer does), unless a line is being
        sent right now (a write from inside a send: it goes next, never nested).
        """
        with self._lock:
            self._queue.extend((stream, line) for line in lines)
            if threading.get_ident() == self._loop_thread and not self._draining:
                now = True
            elif self._scheduled:
                return
            else:
                now = False
                self._scheduled = True
            loop = self._loop
        if now:
            self._drain()
            return
        if loop is not None:
            try:
                loop.call_soon_threadsafe(self._drain)
                return
            except RuntimeError:  # the loop closed (the process is ending)
                pass
        self._drain(send=False)  # no loop to send them: write them here

    def _drain(self, *, send: bool = True) -> None:
        with self._lock:
            self._scheduled = False
            lines = list(self._queue)
            self._queue.clear()
            self._draining = True
        try:
            self._send(lines, self._port if send else None)
        finally:
            self._draining = False

    def _send(self, lines: list[tuple[str, str]], target: Port[OutputLine] | None) -> None:
        for stream, text in lines:
            if target is not None:
                try:
                    target.send(OutputLine(stream, self.name, self.rank, text))
                    continue
                except Exception as exc:  # the controller's port is gone or full: keep the lines, write them here
                    if self._port is target:
                        self._port = None
                    target = None
                    self.write_here("stderr", f"(output no longer streamed to the controller: {exc})\n")
            self.write_here(stream, text + "\n")

    def write_here(self, stream: str, text: str) -> None:
        """Complete lines to this process's own ``stream``, each prefixed."""
        prefix = f"[{self.label}] "
        raw = self._raw[stream]
        raw.write("".join(prefix + line for line in text.splitlines(keepends=True)))
        raw.flush()


class WorkerStream(io.TextIOBase):
    """``sys.stdout`` or ``sys.stderr`` of a worker: prefixes lines, or queues them in :class:`ProcessOutput`."""

    def __init__(self, stream: TextIO, name: str, output: ProcessOutput) -> None:
        self._stream = stream
        self._name = name  # "stdout" or "stderr"
        self._output = output
        self._at_line_start = True
        self._partial = ""  # a forwarded line not yet ended
        self._lock = threading.RLock()  # reentrant: a signal handler may print in the middle of a write

    def write(self, text: str) -> int:
        if not text:
            return 0
        with self._lock:
            if self._output.forwarding:
                lines = (self._partial + text).split("\n")
                self._partial = lines.pop()
                if len(self._partial) > MAX_PARTIAL:
                    lines.append(self._partial)
                    self._partial = ""
                if lines:
                    self._output.queue(self._name, lines)
            else:
                self._write_here(text)
        return len(text)

    def _write_here(self, text: str) -> None:
        if self._partial:  # a line begun while forwarding ends here
            text, self._partial = self._partial + text, ""
            self._at_line_start = True
        prefix = f"[{self._output.label}] "
        out = []
        for line in text.splitlines(keepends=True):
            if self._at_line_start:
                out.append(prefix)
            out.append(line)
            self._at_line_start = line.endswith("\n")
        self._stream.write("".join(out))
        if "\n" in text:
            self._stream.flush()

    def end(self) -> None:
        """The process is ending: write a line still unfinished here."""
        with self._lock:
            if self._partial:
                self._write_here("")

    def flush(self) -> None:
        self._stream.flush()

    def fileno(self) -> int:
        return self._stream.fileno()

    def isatty(self) -> bool:
        return self._stream.isatty()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self._stream, "encoding", "utf-8")
