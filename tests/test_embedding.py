"""The runtime joins whatever event loop the host program runs: asyncio, uvloop, anyio."""

from __future__ import annotations

import asyncio

import anyio
import uvloop
from support import Echo

from actors import Channel, this_host


async def _exercise() -> list[object]:
    procs = this_host().spawn_procs(per_host={"procs": 1})
    try:
        echo = procs.spawn("echo", Echo, 1)
        port, recv = Channel.open(int)
        await echo.send_to.call_one(port, [3])
        return [await echo.add.call_one(1), await recv.recv()]
    finally:
        await procs.stop()


def test_plain_asyncio_run(sockets_dir):
    assert asyncio.run(_exercise()) == [2, 3]


def test_uvloop_run(sockets_dir):
    assert uvloop.run(_exercise()) == [2, 3]


def test_anyio_run(sockets_dir):
    assert anyio.run(_exercise) == [2, 3]


def test_successive_loops_reuse_the_runtime(sockets_dir):
    assert asyncio.run(_exercise()) == [2, 3]
    assert asyncio.run(_exercise()) == [2, 3]


def test_synchronous_program_uses_get(sockets_dir):
    procs = this_host().spawn_procs(per_host={"procs": 2})
    try:
        echo = procs.spawn("echo", Echo, 10)
        assert list(echo.add.call(1).get(timeout=30).values()) == [11, 11]
        assert echo.slice(procs=0).add.call_one(2).result(timeout=30) == 12
        assert echo.slice(procs=0).fail.call_one("x").exception(timeout=30) is not None
    finally:
        procs.stop().get()
