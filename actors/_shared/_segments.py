"""Shared-memory segment names: ``/dev/shm/actors-<session>-w<pid>-...``, and removing a process's or a session's.

One module owns the naming so that the publisher (``tensors._slots``), the
supervisor that sees a publisher die and the forkserver that tears a session
down agree on it without importing the weight transports.
"""

from __future__ import annotations

import contextlib
import glob
import os

__all__ = ["SHM_DIR", "process_prefix", "remove_process_segments", "remove_session_segments"]

SHM_DIR = "/dev/shm"


def process_prefix(session: str, pid: int) -> str:
    """The name every segment that process ``pid`` of ``session`` publishes starts with."""
    return f"{session}-w{pid}-"


def remove_process_segments(session: str, pid: int) -> list[str]:
    """Unlink every segment published by process ``pid`` of ``session`` (it has exited); the names removed."""
    removed = []
    prefix = process_prefix(session, pid)
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(SHM_DIR):
            if name.startswith(prefix):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(SHM_DIR, name))
                    removed.append(name)
    return removed


def remove_session_segments(session: str) -> None:
    """Unlink every segment of ``session`` (its forkserver's teardown)."""
    for path in glob.glob(f"{SHM_DIR}/{session}-*"):
        with contextlib.suppress(OSError):
            os.unlink(path)
