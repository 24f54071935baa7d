"""Shared-memory segment names: ``/dev/shm/actors-<session>-w<pid>-...``, and removing a process's or a session's.

One module owns the naming so that the publisher (``tensors._slots``), the
supervisor that sees a publisher die and the forkserver that tears a session
down agree on it without importing the weight transports.

A process without a runtime publishes under a session of its own,
``actors-solo<pid>``, which no forkserver tears down: while it has a slot
pool it holds a shared ``flock`` on ``/dev/shm/actors-solo<pid>.u<uid>.live``
(:func:`hold_solo_marker`; the kernel drops it when the process dies, even
killed), and a later session's start removes the segments whose marker
nobody holds (:func:`sweep_solo_segments`). A pid alone could not say so:
another pid namespace sharing ``/dev/shm`` may run a live process of that pid.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import os
import re

__all__ = [
    "SHM_DIR",
    "drop_solo_marker",
    "hold_solo_marker",
    "process_prefix",
    "remove_process_segments",
    "remove_session_segments",
    "solo_session",
    "sweep_solo_segments",
]

SHM_DIR = "/dev/shm"
_SOLO_MARKER = re.compile(r"(actors-solo[1-9][0-9]{0,6})\.u([0-9]+)\.live")  # (a Linux pid: at most 7 digits)


def solo_session(pid: int) -> str:
    """The session name of process ``pid``'s segments when it has no runtime."""
    return f"actors-solo{pid}"


def _marker_path(session: str) -> str:
    """The marker of ``session``'s segments for this user (users sharing ``/dev/shm`` and a pid each have one)."""
    return os.path.join(SHM_DIR, f"{session}.u{os.getuid()}.live")


def hold_solo_marker(session: str) -> int | None:
    """Mark the segments of ``session`` (this process's, without a runtime) live while the returned descriptor
    stays open; a sweep that removed the marker as this process took it is noticed, and a fresh one taken. None
    where no marker can be made (``/dev/shm`` read-only, say): the segments are then left unmarked, as before."""
    path = _marker_path(session)
    while True:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CREAT, 0o600)
        except OSError:
            return None
        fcntl.flock(fd, fcntl.LOCK_SH)  # (a sweep holds it exclusively only while it unlinks a few names)
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)


def drop_solo_marker(session: str, fd: int) -> None:
    """Let go of a hold :func:`hold_solo_marker` gave; the marker is removed too unless another holds it (another
    slot pool of this process, or a live process of the same pid in another pid namespace)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        pass
    else:
        with contextlib.suppress(FileNotFoundError):
            if os.stat(_marker_path(session)).st_ino == os.fstat(fd).st_ino:
                os.unlink(_marker_path(session))
    finally:
        os.close(fd)


def sweep_solo_segments() -> list[str]:
    """Remove this user's segments of processes without a runtime that have exited (nobody holds their marker);
    the sessions removed."""
    removed = []
    with contextlib.suppress(OSError):
        for name in os.listdir(SHM_DIR):
            solo = _SOLO_MARKER.fullmatch(name)
            if solo is None or int(solo[2]) != os.getuid():
                continue
            path = os.path.join(SHM_DIR, name)
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:
                continue
            try:
                if os.fstat(fd).st_uid != os.getuid():
                    continue
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # its process lives (here or in another pid namespace)
                _remove_own_segments(solo[1])
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                removed.append(solo[1])
            finally:
                os.close(fd)
    return removed


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


def _remove_own_segments(session: str) -> None:
    """Unlink this user's segments of ``session`` (another user's process may have the same pid, in its own pid
    namespace, and its segments the same session name)."""
    uid = os.getuid()
    for path in glob.glob(f"{SHM_DIR}/{session}-*"):
        with contextlib.suppress(OSError):
            if os.lstat(path).st_uid == uid:
                os.unlink(path)


def remove_session_segments(session: str) -> None:
    """Unlink every segment of ``session`` (its forkserver's teardown)."""
    for path in glob.glob(f"{SHM_DIR}/{session}-*"):
        with contextlib.suppress(OSError):
            os.unlink(path)
