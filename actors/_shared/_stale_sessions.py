"""Session directories whose owner died without cleaning up, found by name and removed.

A session directory is named ``actors-<owner pid>-<random>``. Its owner
removes it on exit, or its forkserver does when the owner dies; an owner
killed before it started one (a controller that never spawned, SIGKILLed)
leaves it behind. The next session made in the same place removes such
directories, and their shared-memory segments, when the owner is gone and
no socket in the directory still answers (another pid namespace sharing
the folder is never taken for dead).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import stat

from ._liveness import pid_exists
from ._segments import remove_session_segments

__all__ = ["SESSION_PREFIX", "sweep_stale_sessions"]

#: The start of every session directory's name; the owner's pid follows, then ``-`` and mkdtemp's suffix.
SESSION_PREFIX = "actors-"
_OWNED = re.compile(r"actors-([0-9]{1,10})-[A-Za-z0-9_]{8}")


def sweep_stale_sessions(base: str) -> list[str]:
    """Remove this user's session directories in ``base`` whose owner has exited; the names removed."""
    try:
        names = os.listdir(base)
    except OSError:
        return []
    uid = os.getuid()
    removed = []
    for name in names:
        owned = _OWNED.fullmatch(name)
        if owned is None or pid_exists(int(owned[1])):
            continue
        path = os.path.join(base, name)
        try:
            info = os.lstat(path)
        except OSError:
            continue
        if info.st_uid != uid or not stat.S_ISDIR(info.st_mode) or _serving(path):
            continue
        shutil.rmtree(path, ignore_errors=True)
        remove_session_segments(name)
        removed.append(name)
    return removed


def _serving(folder: str) -> bool:
    """Whether a socket file in ``folder`` accepts a connection (a live process in another pid namespace)."""
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return False
    for entry in entries:
        with contextlib.suppress(OSError):
            if not stat.S_ISSOCK(entry.stat(follow_symlinks=False).st_mode):
                continue
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                probe.settimeout(0.2)
                try:
                    probe.connect(entry.path)
                except OSError:
                    continue
                return True
    return False
