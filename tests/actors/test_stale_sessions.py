"""Session directories left by an owner killed before it cleaned up are removed by the next session made there."""

from __future__ import annotations

import os
import socket
import subprocess

from actors._shared._segments import SHM_DIR
from actors._shared._session import make_runtime_dir
from actors._shared._stale_sessions import sweep_stale_sessions


def _dead_pid() -> int:
    gone = subprocess.Popen(["true"])
    gone.wait()
    return gone.pid


def test_a_dead_owners_session_and_its_segments_are_removed_and_live_or_foreign_ones_kept(tmp_path, monkeypatch):
    dead = _dead_pid()
    stale = tmp_path / f"actors-{dead}-abcd_123"
    stale.mkdir()
    (stale / "pid-0123456789abcdef").write_text("42")
    segment = os.path.join(SHM_DIR, f"{stale.name}-w{dead}-0")
    with open(segment, "wb") as f:
        f.write(b"\0" * 16)
    live = tmp_path / f"actors-{os.getpid()}-live0000"
    live.mkdir()
    unnamed = tmp_path / "actors-k2j4h5g6"  # the old naming: its owner is unknown, so it stays
    unnamed.mkdir()
    other = tmp_path / f"actors-{dead}-notmine"  # not mkdtemp's eight characters: not a session directory
    other.mkdir()
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    made = make_runtime_dir()
    try:
        assert os.path.basename(made).startswith(f"actors-{os.getpid()}-")
        assert not stale.exists() and not os.path.exists(segment)
        assert live.exists() and unnamed.exists() and other.exists()
    finally:
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
