"""A worker's stdout and stderr: each line prefixed with its actors' names, written here or sent to the controller.

By default a worker writes its lines to its own descriptors (inherited from
the forkserver: for a process of the controller's machine, the controller's
terminal). After ``ProcMesh.logging_option(stream_to_client=True)`` it sends
each complete line to the controller's log port instead, where the
controller prints it with its own Python streams (aggregated over a window
when asked): output then reaches a notebook, a redirected ``sys.stdout``, or
a controller on another machine.
"""

from __future__ import annotations

import io
import threading
from typing import Any, TextIO

from .._shared._output_line import OutputLine

__all__ = ["ProcessOutput", "WorkerStream"]


class ProcessOutput:
    """Where this process's output lines go: its descriptors, or the controller's log port."""

    def __init__(self, name: str, rank: int) -> None:
        self._process = name
        #: What starts each line written here: the actors' names and ranks (the process's name before any).
        self.label = name
        #: What a forwarded line names: the actors' names (its rank travels beside it).
        self.name = name
        self.rank = rank
        self._port: Any = None  # the controller's Port[OutputLine] while forwarding
        self._sending = threading.local()

    def rename(self, actors: list[tuple[str, int]]) -> None:
        """The actors this process hosts now, as ``(name, rank)``."""
        self.label = ",".join(f"{name}[{rank}]" for name, rank in actors) or self._process
        self.name = ",".join(name for name, _ in actors) or self._process

    @property
    def forwarding(self) -> bool:
        return self._port is not None

    def forward_to(self, port: Any) -> None:
        """Send lines to ``port`` from now on (None: write them to this process's descriptors again)."""
        self._port = port

    def send(self, stream: str, text: str) -> bool:
        """Send one line to the controller; False when it must be written here instead."""
        port = self._port
        if port is None or getattr(self._sending, "active", False):
            return False  # not forwarding, or a line written while sending one (a warning): never recurse
        self._sending.active = True
        try:
            port.send(OutputLine(stream, self.name, self.rank, text))
            return True
        except Exception:  # the controller's port is gone or full: keep the line, write it here
            self._port = None
            return False
        finally:
            self._sending.active = False


class WorkerStream(io.TextIOBase):
    """``sys.stdout`` or ``sys.stderr`` of a worker: prefixes lines, or hands them to :class:`ProcessOutput`."""

    def __init__(self, stream: TextIO, name: str, output: ProcessOutput) -> None:
        self._stream = stream
        self._name = name  # "stdout" or "stderr"
        self._output = output
        self._at_line_start = True
        self._partial = ""  # a forwarded line not yet ended
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        if not text:
            return 0
        with self._lock:
            if self._output.forwarding:
                self._forward(text)
            else:
                self._write_here(text)
        return len(text)

    def _forward(self, text: str) -> None:
        lines = (self._partial + text).split("\n")
        self._partial = lines.pop()
        for line in lines:
            if not self._output.send(self._name, line):
                self._write_here(line + "\n")

    def _write_here(self, text: str) -> None:
        if self._partial:
            text, self._partial = self._partial + text, ""
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

    def flush(self) -> None:
        self._stream.flush()

    def fileno(self) -> int:
        return self._stream.fileno()

    def isatty(self) -> bool:
        return self._stream.isatty()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self._stream, "encoding", "utf-8")
