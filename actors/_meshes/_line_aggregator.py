"""Similar output lines of a proc mesh's processes, gathered over a window and printed once with a count.

Two lines are *similar* when they go to the same stream and read the same
once every run of digits is set aside (ranks, pids, step counts, losses):
``[8 similar log lines] [trainer] step 12 loss 0.31`` stands for eight
lines like it, the first of which is shown. Without a window every line is
passed on at once, prefixed with its process's name and rank.
"""

from __future__ import annotations

import re

from .._shared._output_line import OutputLine

__all__ = ["LineAggregator", "Printed"]

#: ``(stream, text)``: what to print, and on which of the controller's streams.
Printed = tuple[str, str]

_DIGITS = re.compile(r"\d+")


class _Group:
    """Similar lines held: the first, and how many."""

    __slots__ = ("count", "first")

    def __init__(self, first: OutputLine) -> None:
        self.first = first
        self.count = 1


class LineAggregator:
    """Holds lines for ``window`` seconds from the first one held; then gives them back, one per group."""

    def __init__(self, window: float | None = None) -> None:
        self.window = window
        self._groups: dict[tuple[str, str], _Group] = {}
        self._since: float | None = None  # when the first held line arrived

    @property
    def deadline(self) -> float | None:
        """When the held lines are due (None: none held, or no window)."""
        if self._since is None or self.window is None:
            return None
        return self._since + self.window

    def add(self, line: OutputLine, now: float) -> list[Printed]:
        """Take one line; what to print now (the line itself when there is no window)."""
        if self.window is None:
            return [(line.stream, f"[{line.name}] [{line.rank}] {line.text}")]
        key = (line.stream, _DIGITS.sub("#", line.text))
        group = self._groups.get(key)
        if group is None:
            self._groups[key] = _Group(line)
        else:
            group.count += 1
        if self._since is None:
            self._since = now
        return []

    def set_window(self, window: float | None) -> list[Printed]:
        """A new window (the held lines' deadline moves with it); no window gives back what is held."""
        self.window = window
        return self.flush() if window is None else []

    def flush(self) -> list[Printed]:
        """Everything held, one line per group, in the order the groups began."""
        out: list[Printed] = []
        for group in self._groups.values():
            first = group.first
            out.append((first.stream, f"[{group.count} similar log lines] [{first.name}] {first.text}"))
        self._groups.clear()
        self._since = None
        return out
