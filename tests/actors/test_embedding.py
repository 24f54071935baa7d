"""The runtime joins whatever event loop the host program runs: asyncio, uvloop, anyio."""

from __future__ import annotations

import asyncio

import anyio
import uvloop
from harness import run_python
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


def test_tcp_transport_binds_loopback(tmp_path):
    """ACTORS_TRANSPORT=tcp switches every inbox to tcp on 127.0.0.1."""
    import os
    import sys

    script = tmp_path / "tcp_controller.py"
    script.write_text(
        "import asyncio\n"
        "from actors import Channel, this_host\n"
        "from actors._runtime._core import runtime\n"
        "from support import Echo\n"
        "async def main():\n"
        "    procs = this_host().spawn_procs(per_host={'procs': 2})\n"
        "    echo = procs.spawn('echo', Echo, 1)\n"
        "    port, recv = Channel.open(int)\n"
        "    await echo.send_to.call(port, [7])\n"
        "    got = [await recv.recv(), await recv.recv()]\n"
        "    print('ADDR', runtime().address, *[r.address for r in procs._procs])\n"
        "    print('RESULT', list((await echo.add.call(1)).values()), got)\n"
        "    await procs.stop()\n"
        "if __name__ == '__main__':\n"
        "    asyncio.run(main())\n"
    )
    env = dict(os.environ, ACTORS_TRANSPORT="tcp", PYTHONPATH=os.pathsep.join([os.path.dirname(__file__), *sys.path]))
    out = run_python(str(script), timeout=60, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    addresses = next(line for line in out.stdout.splitlines() if line.startswith("ADDR")).split()[1:]
    assert len(addresses) == 3 and all(a.startswith("tcp://127.0.0.1:") for a in addresses)
    assert "RESULT [2, 2] [7, 7]" in out.stdout


def test_runtime_dir_is_private(sockets_dir):
    import os
    import stat

    assert stat.S_IMODE(os.stat(sockets_dir).st_mode) == 0o700


async def test_async_with_stops_the_mesh(sockets_dir):
    from harness import actor_pids, wait_for

    async with this_host().spawn_procs(per_host={"procs": 1}) as procs:
        echo = procs.spawn("echo", Echo)
        pid = await echo.pid.call_one()
        assert pid in actor_pids()
    assert wait_for(lambda: pid not in actor_pids(), timeout=5)


CURVE_SCRIPT = """
import asyncio, os, sys
import msgpack, zmq
from actors import Channel, this_host
from actors._wire._records import PROTOCOL_VERSION, Kind
from actors._runtime._core import runtime
from actors._wire._records import record_prefix as message_prefix
from support import Echo

def push(address, text, keys):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    if keys == "own":  # knows the server's public key, holds a key pair of its own
        public, secret = zmq.curve_keypair()
        sock.curve_serverkey = os.environ["ACTORS_CURVE_PUBLIC"].encode()
        sock.curve_publickey, sock.curve_secretkey = public, secret
    elif keys:
        public, secret = os.environ["ACTORS_CURVE_PUBLIC"].encode(), os.environ["ACTORS_CURVE_SECRET"].encode()
        sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = public, public, secret
    sock.connect(address)
    body = msgpack.packb([int(Kind.PORT), PORT_ID, text])
    sock.send_multipart([msgpack.packb([PROTOCOL_VERSION, "tcp://127.0.0.1:9", 1]), message_prefix(0, len(body)) + body])
    return ctx, sock

async def main():
    global PORT_ID
    rt = runtime()
    port, recv = Channel.open(str)
    PORT_ID = port._id
    procs = this_host().spawn_procs(per_host={"procs": 1})
    echo = procs.spawn("echo", Echo)
    await echo.send_to.call_one(port, ["from a worker"])  # workers hold the session key
    print("WORKER", await recv.recv())
    keep = [push(rt.address, "intruder", keys=False), push(rt.address, "impostor", keys="own")]
    await asyncio.sleep(1.0)  # give the intruder every chance to get through
    print("INTRUDER_QUEUED", recv.qsize())
    keep.append(push(rt.address, "friend", keys=True))
    print("FRIEND", await asyncio.wait_for(recv.recv(), 10))
    await procs.stop()

if __name__ == "__main__":
    asyncio.run(main())
"""


def test_tcp_inboxes_refuse_peers_without_the_session_key(tmp_path):
    import os
    import sys

    script = tmp_path / "curve.py"
    script.write_text(CURVE_SCRIPT)
    env = dict(os.environ, ACTORS_TRANSPORT="tcp", PYTHONPATH=os.pathsep.join([os.path.dirname(__file__), *sys.path]))
    env.pop("ACTORS_CURVE_PUBLIC", None)
    env.pop("ACTORS_CURVE_SECRET", None)
    out = run_python(str(script), timeout=60, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "WORKER from a worker" in out.stdout
    assert "INTRUDER_QUEUED 0" in out.stdout, "a peer without the key must not deliver"
    assert "FRIEND friend" in out.stdout
