"""Session directories whose owner died without cleaning up, found by name and removed.

A session directory is named ``actors-<owner pid>-<random>``. Its owner
removes it on exit, or its forkserver does when the owner dies; an owner
killed before it started one (a controller that never spawned, SIGKILLed)
leaves it behind. While a session lives, its owner's runtime and its
forkserver each hold a shared ``flock`` on the directory
(:func:`hold_session`); the kernel drops it when they die. The next session
made in the same place removes a directory, and its shared-memory segments,
when its owner's pid is gone, nobody holds that lock and no socket in it
answers: a live session in another pid namespace sharing the folder still
holds its lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import socket
import stat

from ._liveness import pid_exists
from ._segments import remove_session_segments

__all__ = ["SESSION_PREFIX", "hold_session", "sweep_stale_sessions"]

#: The start of every session directory's name; the owner's pid follows, then ``-`` and mkdtemp's suffix.
SESSION_PREFIX = "actors-"
_OWNED = re.compile(r"actors-([1-9][0-9]{0,6})-[A-Za-z0-9_]{8}")  # (a Linux pid has at most 7 digits)


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
        if owned is None:
            continue
        path = os.path.join(base, name)
        try:  # one odd entry (another user's, a pid beyond the kernel's) never fails the new session
            info = os.lstat(path)
            if info.st_uid != uid or not stat.S_ISDIR(info.st_mode) or pid_exists(int(owned[1])):
                continue
            if not _abandoned(path):
                continue
        except (OSError, OverflowError):
            continue
        shutil.rmtree(path, ignore_errors=True)
        remove_session_segments(name)
        removed.append(name)
    return removed


def hold_session(folder: str) -> int:
    """Mark session ``folder`` live for as long as the returned descriptor stays open (or this process lives)."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_SH)
    return fd


def _abandoned(folder: str) -> bool:
    """Whether no process holds ``folder``'s session lock and no socket file in it accepts a connection."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # its runtime or forkserver lives (in another pid namespace, say)
    finally:
        os.close(fd)
    for entry in os.scandir(folder):
        if stat.S_ISSOCK(entry.stat(follow_symlinks=False).st_mode):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                probe.settimeout(0.2)
                with contextlib.suppress(OSError):
                    probe.connect(entry.path)
                    return False  # a live process serves it
    return True
