"""One line of a worker's output on its way to the controller (``ProcMesh.logging_option``)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["OutputLine"]


@dataclass(frozen=True)
class OutputLine:
    """A complete line a worker wrote to ``stream`` (``"stdout"`` or ``"stderr"``), without its newline."""

    stream: str
    name: str  # the writing process's label: its actors' names
    rank: int  # its rank in its proc mesh
    text: str
