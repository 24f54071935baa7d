"""Session directories left by an owner killed before it cleaned up are removed by the next session made there."""

from __future__ import annotations

import os
import socket
import subprocess

from actors._shared._segments import SHM_DIR
from actors._shared._session import make_runtime_dir
from actors._shared._stale_sessions import hold_session, sweep_stale_sessions


def _dead_pid() -> int:
    gone = subprocess.Popen(["true"])
    gone.wait()
    return gone.pid


def _dead_socket(path: str) -> None:
    """A socket file nothing serves any more (its process was killed)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(path)


def test_a_dead_owners_session_and_its_segments_are_removed_and_live_or_unknowable_ones_kept(tmp_path, monkeypatch):
    dead = _dead_pid()
    stale = tmp_path / f"actors-{dead}-abcd_123"
    stale.mkdir()
    _dead_socket(str(stale / "c1.sock"))
    (stale / "pid-0123456789abcdef").write_text("42")
    segment = os.path.join(SHM_DIR, f"{stale.name}-w{dead}-0")
    with open(segment, "wb") as f:
        f.write(b"\0" * 16)
    live = tmp_path / f"actors-{os.getpid()}-live0000"
    live.mkdir()
    _dead_socket(str(live / "c2.sock"))
    kept = [
        live,
        tmp_path / f"actors-{dead}-locked00",  # its lock is held: a live owner in another pid namespace, say
        tmp_path / "actors-k2j4h5g6",  # the old naming: its owner is unknown
        tmp_path / f"actors-{dead}-notmine",  # not mkdtemp's eight characters: not a session directory
        tmp_path / "actors-4000000000-abcdefgh",  # no pid is that large (os.kill would overflow)
    ]
    for folder in kept[1:]:
        folder.mkdir()
    lock = hold_session(str(kept[1]))
    tcp = tmp_path / f"actors-{dead}-tcp00000"  # a tcp session's: incarnation files, no socket, no lock held
    tcp.mkdir()
    (tcp / "pid-fedcba9876543210").write_text("43")
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    made = make_runtime_dir()
    try:
        assert os.path.basename(made).startswith(f"actors-{os.getpid()}-")
        assert not stale.exists() and not os.path.exists(segment) and not tcp.exists()
        assert all(folder.exists() for folder in kept)
    finally:
        os.close(lock)
        os.rmdir(made)
        if os.path.exists(segment):
            os.unlink(segment)


def test_a_session_whose_socket_still_answers_is_kept(tmp_path):
    """An owner in another pid namespace looks dead from here; its serving socket says otherwise."""
    serving = tmp_path / f"actors-{_dead_pid()}-serving0"
    serving.mkdir()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(str(serving / "c1.sock"))
        listener.listen()
        assert sweep_stale_sessions(str(tmp_path)) == []
        assert serving.exists()
    assert sweep_stale_sessions(str(tmp_path)) == [serving.name]  # closed: nothing answers any more
    assert not serving.exists()


def test_a_running_session_holds_its_directory_and_the_sweep_leaves_it(tmp_path, sockets_dir):
    """This process's own session (its runtime holds the lock), seen from a sweep that thinks its owner dead."""
    from actors._shared._stale_sessions import _abandoned

    assert not _abandoned(sockets_dir)
