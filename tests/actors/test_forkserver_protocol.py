"""The forkserver's pipe protocol: named messages round-trip; malformed or unexpected frames are dropped, logged."""

from __future__ import annotations

import logging
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
