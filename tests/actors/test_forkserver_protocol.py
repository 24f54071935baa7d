"""The forkserver's pipe protocol: named messages round-trip; malformed or unexpected frames are dropped, logged."""

from __future__ import annotations

import asyncio
import logging
import os
import struct

import msgpack
import pytest

from actors._processes._forkserver_protocol import (
    Exited,
    Spawned,
    SpawnFailed,
    SpawnRequest,
    frame,
    read_reports,
    read_requests,
)


def raw(obj: object) -> bytes:
    data = msgpack.packb(obj)
    return struct.pack(">I", len(data)) + data


def test_every_message_round_trips_and_a_partial_frame_waits():
    request = SpawnRequest(3, {"name": "procs0.0"})
    reports = [Spawned(3, 4242), SpawnFailed(4, "fork: out of memory"), Exited(3, 4242, -9)]
    buffer = bytearray(frame(request))
    assert read_requests(buffer) == [request] and buffer == b""
    whole = b"".join(frame(report) for report in reports)
    buffer = bytearray(whole[:-2])
    assert read_reports(buffer) == reports[:2], "the cut last frame stays for the next read"
    buffer += whole[-2:]
    assert read_reports(buffer) == reports[2:] and buffer == b""
    assert isinstance(read_reports(bytearray(frame(reports[2])))[0], Exited)


@pytest.mark.parametrize(
    "obj",
    [
        ["spawned", 3],  # a field short
        ["spawned", 3, "4242"],  # a pid that is not an int
        ["exited", 3, 4242, -9, "extra"],
        ["respawn", 3, 4242],  # no such message
        "spawned",
        [],
        ["spawn", 3, {}],  # a request, where reports are expected
    ],
)
def test_a_malformed_or_unexpected_report_is_dropped_with_a_log_line(obj, caplog):
    buffer = bytearray(raw(obj) + frame(Spawned(5, 77)))
    with caplog.at_level(logging.ERROR, logger="actors"):
        assert read_reports(buffer) == [Spawned(5, 77)], "the good frame behind it still arrives"
    assert "malformed or unexpected frame" in caplog.text


def test_a_report_sent_where_requests_are_read_is_dropped(caplog):
    with caplog.at_level(logging.ERROR, logger="actors"):
        assert read_requests(bytearray(frame(Spawned(1, 2)) + raw(["spawn", "x", {}]))) == []
    assert caplog.text.count("malformed or unexpected frame") == 2


def test_an_undecodable_frame_is_dropped_and_the_next_one_still_arrives(caplog):
    """A frame whose bytes are no msgpack (0xc1 is never used) raised out of the reader and stayed in the buffer,
    so every later read raised again."""
    buffer = bytearray(struct.pack(">I", 1) + b"\xc1" + frame(Spawned(5, 77)))
    with caplog.at_level(logging.ERROR, logger="actors"):
        assert read_reports(buffer) == [Spawned(5, 77)] and buffer == b""
    assert "undecodable frame" in caplog.text


def test_a_frame_longer_than_any_message_ends_the_stream_instead_of_buffering_without_bound(caplog):
    """A length prefix past the limit means the stream is out of step: what it holds is dropped, not awaited."""
    buffer = bytearray(struct.pack(">I", 2**31) + b"x" * 100)
    with caplog.at_level(logging.ERROR, logger="actors"):
        assert read_requests(buffer) == [] and buffer == b""
    assert "longer than any message" in caplog.text


def test_a_spawn_request_whose_config_does_not_fit_is_refused_with_the_reason():
    """A field the worker's config does not have (another version of the package at one end) gives SpawnFailed with
    the reason, not a TypeError that ends the forkserver."""
    from actors._processes._forkserver_process import read_worker_config

    config, why = read_worker_config({"bogus": 1})
    assert config is None and "bogus" in why


def test_reports_read_with_the_forkservers_end_still_count():
    """A SpawnFailed and the pipe's end read in one go: the worker fails with the forkserver's reason, not with
    'exited before starting it' (the reports were dropped when the end was seen first)."""
    import os
    from types import SimpleNamespace

    from actors._processes._forkserver import Forkserver

    dead: list[tuple[object, str]] = []
    registry = SimpleNamespace(mark_dead=lambda ref, why: dead.append((ref, why)), set_pid=lambda ref, pid: None)
    read_end, write_end = os.pipe()
    os.set_blocking(read_end, False)
    server = Forkserver.__new__(Forkserver)  # (no process: only its status pipe, and a process already reaped)
    server.rt = SimpleNamespace(registry=registry, driver=SimpleNamespace(remove_reader=lambda fd: None))
    server.process = SimpleNamespace(requests=-1, wait=lambda timeout: True)
    server.status_fd, server._buffer, server._refs, server.closed, server._retry, server._open_fds = (
        read_end,
        bytearray(),
        {},
        False,
        None,
        {read_end},
    )
    server._unsent = bytearray()
    ref = object()
    server._refs[3] = ref
    os.write(write_end, frame(SpawnFailed(3, "fork: out of memory")))
    os.close(write_end)
    try:
        server._on_status()
    except BaseException:
        os.close(read_end)
        raise
    assert dead == [(ref, "could not start: fork: out of memory")] and server.closed
    with pytest.raises(OSError):
        os.fstat(read_end)  # the lost forkserver's status pipe is closed with its loss


async def test_a_full_request_pipe_has_one_retry_at_most_and_none_once_the_forkserver_is_lost(monkeypatch):
    """Spawn requests meet a full pipe (a forkserver still importing torch): each request's write set up a retry
    of its own and dropped the last one's handle, so every earlier chain ran on, every 5 ms, for good; once the
    forkserver was lost, those chains wrote to its closed descriptor (or one reused since, a new forkserver's)."""
    import os
    from types import SimpleNamespace

    from actors._processes import _forkserver
    from actors._processes._forkserver import Forkserver

    loop = asyncio.get_running_loop()
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    try:
        while True:
            os.write(write_end, b"x" * 65536)
    except BlockingIOError:
        pass
    server = Forkserver.__new__(Forkserver)
    server.rt = SimpleNamespace(
        registry=SimpleNamespace(mark_dead=lambda ref, why: None),
        driver=SimpleNamespace(loop=loop, remove_reader=lambda fd: None),
    )
    server.process = SimpleNamespace(requests=write_end, wait=lambda timeout: True)
    server.status_fd, server._buffer, server._unsent, server._refs, server.closed, server._retry = (
        read_end,
        bytearray(),
        bytearray(),
        {},
        False,
        None,
    )
    server._open_fds = {read_end, write_end}
    writes: list[int] = []
    real_write = os.write

    def counted(fd: int, data: bytes) -> int:
        writes.append(fd)
        return real_write(fd, data)

    monkeypatch.setattr(_forkserver.os, "write", counted)
    for _ in range(3):
        server._unsent += b"request"
        server._write()
    pending = [h for h in loop._scheduled if not h.cancelled() and "_write" in repr(h)]  # type: ignore[attr-defined]
    assert len(pending) == 1, "one retry waits for the pipe, whatever the number of requests"
    server._lost()
    writes.clear()
    await asyncio.sleep(0.05)
    assert writes == [], "nothing is written once the forkserver is lost"
    assert not server._unsent


def test_a_worker_whose_forkserver_died_before_its_death_signal_was_armed_ends_at_once():
    """The forkserver's pid is read before the fork: one that dies between the fork and the child's prctl leaves
    the child with another parent, which it sees and ends (before, it read its parent after the fork, so a
    reparented child compared the new parent with itself and ran on, orphaned)."""
    import signal as _signal

    from actors._processes._forkserver_process import _child

    status_r, status_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: told its forkserver was a process that is not its parent
        _signal.alarm(30)  # (a guard: a child that ran on would be killed, and the test fail on its status)
        _child(None, status_w, None, server=1)  # type: ignore[arg-type]
        os._exit(3)  # not reached: _child always exits
    os.close(status_w)
    os.close(status_r)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "ended at the parent check, before running any worker"
