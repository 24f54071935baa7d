"""A saved folder (an exported model, a LoRA adapter) replaced whole, so that a kill at any moment loses neither.

It is written to ``<folder>.tmp-<tag>``; then ``<folder>`` is set aside as
``<folder>.old-<tag>``, the staging renamed into place, and the old one
removed. While ``.old-<tag>`` exists the staging beside it is complete: a
start after a kill finishes the swap
(:func:`pipeline.learning.checkpoint.remove_stale_staging`).

The tag (:func:`process_tag`) names the writing process by its pid and its
start time: a pid alone is reused (a resumed run in a new container often
gets the very pids of the killed one), and a leftover whose pid now names
another process was taken for a live save and never finished or cleared.
"""

from __future__ import annotations

import os
import re
import shutil

__all__ = ["process_tag", "replace_folder", "staging_folder", "sync_path", "tag_alive"]

#: A staging name's tag: ``<pid>.<start time>``, or a bare ``<pid>`` (what earlier versions wrote).
_TAG = re.compile(r"(\d+)(?:\.(\d+))?")


def _started(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks since boot, ``/proc/<pid>/stat``), or None if it is gone or
    that cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return stat[stat.rindex(b")") + 2 :].split()[19].decode()  # (field 22; the name before may hold spaces)
    except (OSError, ValueError, IndexError):
        return None


def process_tag() -> str:
    """This process's tag for the files it stages: ``<pid>.<start time>`` (a bare pid where /proc is not)."""
    pid = os.getpid()
    started = _started(pid)
    return str(pid) if started is None else f"{pid}.{started}"


def tag_alive(tag: str) -> bool | None:
    """Whether the process a staging name's ``tag`` names still runs; None if ``tag`` is no such tag."""
    match = _TAG.fullmatch(tag)
    if match is None:
        return None
    pid = int(match.group(1))
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    started = match.group(2)
    if started is None:
        return True  # (an earlier version's bare pid: whoever has it now counts)
    now = _started(pid)
    return now is None or now == started  # (unreadable: taken as that process, as a bare pid is)


def staging_folder(folder: str) -> str:
    """A fresh, empty-to-be staging path for ``folder`` (whatever an earlier save of this process left is gone)."""
    staging = f"{folder}.tmp-{process_tag()}"
    shutil.rmtree(staging, ignore_errors=True)
    return staging


def sync_path(path: str) -> None:
    """Flush a file's bytes, or a folder's entries (a rename in it), to the disk."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if os.path.isdir(path) else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_folder(staging: str, folder: str) -> str:
    """Put the complete ``staging`` in ``folder``'s place, on the disk before the old one goes; returns ``folder``.

    A crash after the swap (XFS, NFS: a rename may reach the disk before a
    file's bytes) leaves whole files under the new name, not empty ones.
    """
    for root, _, files in os.walk(staging):
        for name in files:
            sync_path(os.path.join(root, name))
        sync_path(root)
    old = f"{folder}.old-{process_tag()}"
    shutil.rmtree(old, ignore_errors=True)  # (one an earlier save of this process could not remove whole)
    if os.path.exists(folder):
        os.replace(folder, old)
    os.replace(staging, folder)
    sync_path(os.path.dirname(os.path.abspath(folder)))
    shutil.rmtree(old, ignore_errors=True)
    return folder
