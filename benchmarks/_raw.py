"""Raw pyzmq baselines, measured in the same run as the runtime's figures.

Each baseline runs its peer in a separate process over ``ipc://``, like the
runtime does, so the ratio isolates the runtime's own overhead.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import tempfile
import time

import msgpack
import zmq


def _echo_router(address: str, count: int, ready: mp.synchronize.Event) -> None:  # type: ignore[name-defined]
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(address)
    ready.set()
    for _ in range(count):
        sock.send_multipart(sock.recv_multipart())
    sock.close(linger=1000)
    ctx.term()


def dealer_router_rtt(rounds: int = 5000, warmup: int = 500) -> list[float]:
    """Blocking DEALER/ROUTER ipc round trips (seconds each) to a peer process."""
    address = f"ipc://{tempfile.mkdtemp(prefix='bench-')}/rtt.sock"
    ready = mp.Event()
    peer = mp.get_context("fork").Process(target=_echo_router, args=(address, rounds + warmup, ready))
    peer.start()
    ready.wait(10)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(address)
    payload = msgpack.packb([1, "ping", [1], {}])
    samples = []
    for i in range(rounds + warmup):
        start = time.perf_counter()
        sock.send(payload)
        sock.recv()
        if i >= warmup:
            samples.append(time.perf_counter() - start)
    sock.close(linger=0)
    ctx.term()
    peer.join(10)
    os.unlink(address.removeprefix("ipc://"))
    return samples


def _pull(address: str, count: int, queue: mp.Queue) -> None:  # type: ignore[type-arg]
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.bind(address)
    queue.put("ready")
    for _ in range(count):
        sock.recv()
    queue.put(time.perf_counter())
    sock.close(linger=0)
    ctx.term()


def push_pull_rate(message: bytes, count: int = 200_000) -> float:
    """Blocking PUSH/PULL ipc messages per second, first send to last receive."""
    address = f"ipc://{tempfile.mkdtemp(prefix='bench-')}/pp.sock"
    queue: mp.Queue = mp.Queue()  # type: ignore[type-arg]
    peer = mp.get_context("fork").Process(target=_pull, args=(address, count, queue))
    peer.start()
    assert queue.get(timeout=10) == "ready"
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.connect(address)
    first = time.perf_counter()
    for _ in range(count):
        sock.send(message)
    last = queue.get(timeout=60)
    sock.close(linger=0)
    ctx.term()
    peer.join(10)
    os.unlink(address.removeprefix("ipc://"))
    return count / (last - first)


def median(values: list[float]) -> float:
    return statistics.median(values)
