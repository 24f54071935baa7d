"""Hostile input: a live worker takes 100,000+ random and mutated frames and keeps serving."""

from __future__ import annotations

import asyncio
import random

import msgpack
import zmq
from support import Pinger

from actors import Channel
from actors._wire._codec import EXT_DATACLASS, EXT_HANDLE, EXT_TENSOR, EXT_TUPLE, Encoder
from actors._wire._records import PROTOCOL_VERSION, Credit, Kind
from actors._wire._records import record_prefix as message_prefix

CALL, CREDIT, PORT, REPLY = int(Kind.CALL), int(Kind.CREDIT), int(Kind.PORT), int(Kind.REPLY)

FRAMES = int(__import__("os").environ.get("FUZZ_FRAMES", 100_000))


def _seeds(rng: random.Random, actor: str) -> list[tuple[bytes, list[bytes]]]:
    """Real messages the runtime would send, as (payload, buffer frames)."""
    enc = Encoder()
    out = []
    for message in (
        [PORT, 7, {"x": [1, 2.5, "three"]}],
        [PORT, 9, ("a", b"bytes", None, True)],
        [REPLY, 12345, 0, True, [1, 2, 3]],
        [CREDIT, 3, 10, 1000],
        [CALL, 0, actor, "ping", "ipc:///nowhere", 1, 0, enc.encode([[5], {}]), None, 0, None],
    ):
        enc.reset()
        data = enc.encode(message)
        out.append((message_prefix(len(enc.frames), len(data)) + data, [bytes(f) for f in enc.frames]))
    import torch

    enc.reset()
    data = enc.encode([PORT, 7, torch.arange(5000, dtype=torch.float32)])
    out.append((message_prefix(len(enc.frames), len(data)) + data, [bytes(f) for f in enc.frames]))
    return out


def _hostile(rng: random.Random) -> list[bytes]:
    """Payload bodies aimed at the decoder's limits."""
    ext = msgpack.ExtType
    bodies = [
        msgpack.packb([PORT, 7, ext(EXT_TENSOR, msgpack.packb(["float32", [1 << 30], 0]))]),  # huge, missing frame
        msgpack.packb([PORT, 7, ext(EXT_TENSOR, msgpack.packb(["float32", [10], b"\0" * 3]))]),  # truncated
        msgpack.packb([PORT, 7, ext(EXT_DATACLASS, msgpack.packb(["os:system", ["rm -rf /"]]))]),
        msgpack.packb([PORT, 7, ext(EXT_DATACLASS, msgpack.packb(["not_loaded:X", []]))]),
        msgpack.packb([PORT, 7, ext(EXT_HANDLE, msgpack.packb(["no-such-handle", None]))]),
        msgpack.packb([PORT, 7, ext(rng.randrange(6, 128), b"\x01\x02")]),  # wrong ext types
        msgpack.packb([PORT, 7, ext(EXT_TUPLE, b"\xdd\xff\xff\xff\xff")]),
        b"\xdd\xff\xff\xff\xff",  # declares 4 billion items
        b"\xdb\xff\xff\xff\xf0" + b"x" * 10,  # declares a 4 GiB string
        b"\x91" * rng.randrange(100, 3000) + b"\xc0",  # deep nesting
    ]
    return bodies


def _mutate(rng: random.Random, data: bytes) -> bytes:
    raw = bytearray(data)
    for _ in range(rng.randrange(1, 4)):
        choice = rng.random()
        if choice < 0.4 and raw:
            raw[rng.randrange(len(raw))] = rng.randrange(256)
        elif choice < 0.7 and raw:
            del raw[rng.randrange(len(raw)) :]
        else:
            raw[rng.randrange(len(raw) + 1) : 0] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 8)))
    return bytes(raw)


async def test_worker_survives_100k_hostile_frames(procs):
    target = procs.spawn("pinger", Pinger).slice(procs=0)
    assert await target.ping.call_one(1) == 1
    rng = random.Random(1234)
    seeds = _seeds(rng, target._name)
    hostile = _hostile(rng)
    # A plausible sender (inside the session's directory) that never reads: the worst peer.
    from actors._runtime._core import runtime

    header = msgpack.packb([PROTOCOL_VERSION, f"ipc://{runtime().dir}/fuzzer.sock", 1])
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    try:
        await _fuzz(sock, procs, target, rng, seeds, hostile, header)
    finally:
        sock.close(linger=0)
        ctx.term()


async def _fuzz(sock, procs, target, rng, seeds, hostile, header) -> None:  # type: ignore[no-untyped-def]
    from actors._runtime._core import runtime

    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.LINGER, 5000)
    sock.connect(procs._procs[0].address)
    sent = 0
    for i in range(FRAMES):
        kind = i % 5
        if kind == 0:  # random bytes, random frame counts
            frames = [
                bytes(rng.randrange(256) for _ in range(rng.randrange(0, 40))) for _ in range(rng.randrange(1, 4))
            ]
        elif kind == 1:  # valid header, corrupted payload
            payload, bufs = rng.choice(seeds)
            frames = [header, _mutate(rng, payload), *bufs]
        elif kind == 2:  # valid framing around a hostile body
            body = rng.choice(hostile)
            frames = [header, message_prefix(0, len(body)) + body]
        elif kind == 3:  # a valid message whose tensor frame is cut short or missing
            payload, bufs = seeds[-1]
            frames = [header, payload, *[b[: rng.randrange(len(b))] for b in bufs][: rng.randrange(2)]]
        else:  # a mutated header
            payload, bufs = rng.choice(seeds)
            frames = [_mutate(rng, header), payload, *bufs]
        sock.send_multipart(frames)
        sent += 1
    assert sent >= FRAMES
    # A last, valid call on the same socket: when it answers, every frame before it was handled.
    port, processed = Channel.open(str)
    enc = Encoder()
    blob = enc.encode([[port], {}])
    enc.reset()
    call = enc.encode([CALL, 0, target._name, "mark", f"ipc://{runtime().dir}/fuzzer.sock", 1, 0, blob, None, 0, None])
    sock.send_multipart([header, message_prefix(0, len(call)) + call])
    assert await asyncio.wait_for(processed.recv(), 120) == "processed"
    # The worker still serves, and it saw (and dropped) the garbage.
    assert await target.ping.call_one(41) == 41
    dropped = await target.dropped.call_one()
    assert dropped > FRAMES // 2


def test_a_message_whose_handling_fails_unexpectedly_does_not_stall_the_ones_behind_it(tmp_path):
    """pump() goes on past a message that raised something other than DecodeError."""
    from actors._transport._inbox_pump import DropLog, Inbox

    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    address = f"ipc://{tmp_path}/inbox.sock"
    learned: list[int] = []

    def learn(header) -> None:  # type: ignore[no-untyped-def]
        learned.append(header.pid)
        if header.pid == 666:
            raise RuntimeError("a broken sender lookup")

    try:
        pull.bind(address)
        push.connect(address)
        inbox = Inbox(pull, str(tmp_path), "ipc://own", learn, DropLog())
        seen: list[object] = []
        inbox.on(Credit, lambda record, frames, sender, size: seen.append(record))
        enc = Encoder()
        body = enc.encode([Kind.CREDIT, 3, 10, 1000])
        for pid in (666, 42):
            header = msgpack.packb([PROTOCOL_VERSION, f"ipc://{tmp_path}/peer{pid}.sock", pid])
            push.send_multipart([header, message_prefix(0, len(body)) + body])
        while len(seen) < 1:
            assert pull.poll(10_000), "the second message never arrived"
            inbox.pump()
        assert learned == [666, 42] and len(seen) == 1
    finally:
        push.close(linger=0)
        pull.close(linger=0)
        ctx.term()


async def test_a_call_whose_reply_address_is_not_its_senders_is_dropped(procs):
    """Replies go only to the process that sent the call: a CALL naming another address (outside the session, one
    zmq cannot even parse, or another peer's) or another pid is dropped, and a worker told to stop that way
    neither stops nor stops answering (before, the reply to such a stop raised ZMQError and the stop never ended)."""
    target = procs.spawn("pinger", Pinger).slice(procs=0)
    before = await target.dropped.call_one()
    from actors._runtime._core import runtime
    from actors._wire._records import PROCESS_ACTOR

    own = f"ipc://{runtime().dir}/forger.sock"
    header = msgpack.packb([PROTOCOL_VERSION, own, 1])
    enc = Encoder()
    no_args = enc.encode([[], {}])
    forged = [
        [CALL, 5, target._name, "ping", "ipc:///etc/elsewhere.sock", 1, 0, enc.encode([[1], {}]), None, 0, None],
        [CALL, 6, PROCESS_ACTOR, "stop", "tcp://[::bad", 1, 0, no_args, None, 0, None],
        [CALL, 7, PROCESS_ACTOR, "stop", f"ipc://{runtime().dir}/another.sock", 1, 0, no_args, None, 0, None],
        [CALL, 8, PROCESS_ACTOR, "stop", own, 2, 0, no_args, None, 0, None],
    ]
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    try:
        sock.setsockopt(zmq.LINGER, 5000)
        sock.connect(procs._procs[0].address)
        for record in forged:
            enc.reset()
            data = enc.encode(record)
            sock.send_multipart([header, message_prefix(0, len(data)) + data])
        port, processed = Channel.open(str)
        enc.reset()
        blob = enc.encode([[port], {}])
        enc.reset()
        call = enc.encode([CALL, 0, target._name, "mark", own, 1, 0, blob, None, 0, None])
        sock.send_multipart([header, message_prefix(0, len(call)) + call])
        assert await asyncio.wait_for(processed.recv(), 60) == "processed"
    finally:
        sock.close(linger=0)
        ctx.term()
    assert await target.ping.call_one(3) == 3
    assert await target.dropped.call_one() - before == len(forged)
