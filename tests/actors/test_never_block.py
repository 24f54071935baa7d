"""No runtime call waits on the event loop's thread: a 1 ms heartbeat keeps beating through floods and spawns.

Backpressure is awaitable (``Port.drain``), a send past its bound raises
``BufferFull`` at once, and a producer whose receiver stopped reading still
serves its endpoints (the cause of the GRPO example's occasional hang: a
sender frozen inside ``send`` could never run the ``drain`` call that would
have ended the run).
"""

from __future__ import annotations

import asyncio
import gc
import time

import pytest
import torch
from support import Echo, Flooder, Heartbeat, Item, Relay

from actors import BufferFull, CallTimeout, Channel, this_host
from actors._runtime import _port
from actors._runtime._core import runtime
from actors._transport import _flow

MAX_GAP = 0.1
PAYLOAD = torch.zeros(1)


async def test_a_flooded_stalled_port_and_new_processes_never_stall_the_loop(procs, monkeypatch):
    monkeypatch.setattr(_flow, "BACKLOG", 20_000)
    relay = procs.spawn("relay", Relay).slice(procs=0)
    inlet = await relay.inlet.call_one()  # nobody reads this port until the end
    sent = 0
    async with Heartbeat() as beat:
        more = this_host().spawn_procs(per_host={"procs": 2})  # processes start while the port floods
        echoes = more.spawn("echo", Echo)
        with pytest.raises(BufferFull, match=r"await port\.drain"):
            while True:
                inlet.send(Item(sent, PAYLOAD))
                sent += 1
                if sent % 500 == 0:
                    await asyncio.sleep(0)
        assert sorted((await echoes.add.call(1)).values()) == [1, 1]
        await more.stop()
    assert beat.worst_stall < MAX_GAP, f"the loop stalled: {beat}"
    assert sent >= _flow.WINDOW + 20_000, "the window filled, then the backlog, then send refused"
    # what is held back is bytes and ints: the collector stops tracking it, so a full backlog costs a full
    # collection nothing (its empty frame lists alone made the collections 14-29 ms, bench_flood.py)
    backlog = [entry for window in runtime().windows._windows.values() for entry in window.backlog]
    gc.collect()
    assert len(backlog) == 20_000 and not any(gc.is_tracked(entry) for entry in backlog)
    del backlog
    # Nothing was lost: once the receiver reads, it gets every message that send accepted, in order.
    out, received = Channel.open()
    forwarding = relay.run.call_one(out)
    count = asyncio.ensure_future(_count_in_order(received))
    await asyncio.wait_for(inlet.drain(), 30)  # the backlog leaves as the receiver consumes
    inlet.send(None)
    assert await asyncio.wait_for(count, 30) == sent and await forwarding == sent


async def _count_in_order(received) -> int:  # type: ignore[no-untyped-def]
    expected = 0
    while (item := await received.recv()) is not None:
        assert item.seq == expected
        expected += 1
    return expected


async def test_drain_awaits_the_receiver_while_the_loop_beats(procs):
    relay = procs.spawn("relay", Relay).slice(procs=0)
    inlet = await relay.inlet.call_one()
    for seq in range(_flow.WINDOW + 100):
        inlet.send(Item(seq, PAYLOAD))
    draining = asyncio.ensure_future(inlet.drain())
    await asyncio.sleep(0.05)
    assert not draining.done(), "100 messages wait in the backlog until the receiver consumes"
    out, received = Channel.open()
    async with Heartbeat() as beat:
        forwarding = relay.run.call_one(out)
        await asyncio.wait_for(draining, 30)
    assert beat.worst_stall < MAX_GAP, f"the loop stalled: {beat}"
    inlet.send(None)
    count = 0
    while await received.recv() is not None:
        count += 1
    assert count == _flow.WINDOW + 100 and await forwarding == count


async def test_a_producer_whose_receiver_stopped_still_serves_its_endpoints(procs):
    flooder = procs.spawn("flooder", Flooder).slice(procs=0)
    relay = procs.spawn("relay", Relay).slice(procs=1)
    inlet = await relay.inlet.call_one()  # never read
    await flooder.start.call_one(inlet)
    deadline = time.monotonic() + 30
    while (await flooder.status.call_one())[0] <= _flow.WINDOW:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)
    # Its window is full and its backlog grows: it answers calls all the same, and can be stopped.
    sent, error = await flooder.status.with_timeout(5).call_one()
    assert sent > _flow.WINDOW and error is None
    assert await flooder.stop_flood.with_timeout(5).call_one() >= sent


def test_a_caller_without_a_loop_blocks_with_a_deadline(monkeypatch):
    monkeypatch.setattr(_port, "SEND_TIMEOUT", 0.5)
    procs = this_host().spawn_procs(per_host={"procs": 1})
    try:
        relay = procs.spawn("relay", Relay)
        inlet = relay.inlet.call_one().get(timeout=30)
        started = time.monotonic()
        with pytest.raises(BufferFull, match="consumed nothing"):
            for seq in range(_flow.WINDOW + 1):
                inlet.send(Item(seq, PAYLOAD))
        assert 0.4 < time.monotonic() - started < 10
        with pytest.raises(CallTimeout):
            Channel.open()[1].recv().get(timeout=0.2)
    finally:
        procs.stop().get()


def test_a_gpus_mesh_counts_its_gpus_on_the_callers_thread_not_the_runtimes(sockets_dir, monkeypatch):
    """Without ``CUDA_VISIBLE_DEVICES`` the GPUs are counted through torch (a first import takes seconds): that ran
    on the runtime's thread, a synchronous program's background loop, holding every mesh's replies, deaths and
    credit meanwhile. It runs on the thread that spawns."""
    import threading

    from actors._meshes import _host_mesh

    counted: list[int] = []
    monkeypatch.setattr(_host_mesh, "visible_gpus", lambda: counted.append(threading.get_ident()) or ["0", "1"])
    procs = this_host().spawn_procs(per_host={"gpus": 2})
    try:
        assert counted == [threading.get_ident()]
    finally:
        procs.stop().get(timeout=30)


def test_an_extra_descriptor_is_watched_and_unwatched_on_the_runtimes_thread(sockets_dir):
    """A relay (Ray's and attached hosts' answers reach the runtime's thread through its pipe) is made and closed
    on the caller's thread: its pipe's watcher was added to and removed from the background loop from there,
    beside the loop (uvloop's libuv handles are not thread-safe). The loop's watchers change on its own thread."""
    import sys
    import threading

    from actors._runtime._relay import Relay

    rt = runtime()
    rt.driver.follow_running_loop()  # (the background loop serves this synchronous test)
    assert rt.driver.thread != threading.get_ident()
    touched: list[str] = []

    def profile(frame, event, arg):  # type: ignore[no-untyped-def]
        if event == "c_call":
            owner, name = getattr(arg, "__self__", None), getattr(arg, "__name__", "")
        elif event == "call":
            owner, name = frame.f_locals.get("self"), frame.f_code.co_name
        else:
            return
        if name in ("add_reader", "remove_reader") and isinstance(owner, asyncio.AbstractEventLoop):
            touched.append(name)

    ran: list[int] = []
    sys.setprofile(profile)
    try:
        relay = Relay(rt)
        relay.call_soon(lambda: ran.append(threading.get_ident()))
        deadline = time.monotonic() + 10
        while not ran and time.monotonic() < deadline:
            time.sleep(0.01)  # (another thread's work, watched with a deadline)
        relay.close()
    finally:
        sys.setprofile(None)
    assert touched == [], "a loop's watchers were changed from this thread"
    assert ran == [rt.driver.thread]
