"""Call deadlines: an actor that blocks its event loop makes its callers time out, nobody else."""

from __future__ import annotations

import time

import pytest
from support import Blocker, Pinger

from actors import CallTimeout, ProcMesh, endpoint, send, this_host

FREEZE = 3.0


async def test_calls_to_a_blocked_actor_time_out_and_other_actors_answer(spawn):
    blocked_procs: ProcMesh = spawn(procs=1)
    other_procs: ProcMesh = spawn(procs=1)
    blocker = blocked_procs.spawn("blocker", Blocker)
    pinger = other_procs.spawn("pinger", Pinger)
    assert await blocker.ping.call_one(1) == 1
    send(blocker.freeze, (FREEZE,))
    started = time.monotonic()
    with pytest.raises(CallTimeout, match=r"blocker\.ping\(\) got no answer from rank 0 .* within 0\.5s.*blocked"):
        await blocker.ping.with_timeout(0.5).call_one(2)
    waited = time.monotonic() - started
    assert 0.5 <= waited < FREEZE, f"timed out after {waited:.2f}s"
    assert await pinger.ping.with_timeout(1.0).call_one(3) == 3, "other actors are unaffected"
    with pytest.raises(CallTimeout, match=r"guarded_ping\(\).*within 0\.5s"):
        await blocker.guarded_ping.call_one()  # the endpoint's declared deadline
    assert time.monotonic() - started < FREEZE
    # once the loop is free again, the same actor answers, and late replies of expired calls are ignored
    assert await blocker.ping.with_timeout(FREEZE + 5).call_one(4) == 4
    assert await blocker.guarded_ping.call_one() == "pong"


def test_synchronous_get_honours_the_call_deadline(sockets_dir):
    procs = this_host().spawn_procs(per_host={"procs": 1})
    try:
        blocker = procs.spawn("blocker", Blocker)
        assert blocker.ping.call_one(1).get(timeout=30) == 1
        send(blocker.freeze, (FREEZE,))
        started = time.monotonic()
        future = blocker.ping.with_timeout(0.5).call_one(2)
        with pytest.raises(CallTimeout, match=r"within 0\.5s"):
            future.get(timeout=30)
        assert time.monotonic() - started < FREEZE
        with pytest.raises(CallTimeout, match=r"within 0\.5s"):
            future.get()  # the outcome is kept
        # a shorter get(timeout) is the caller's own limit: the call itself is not failed by it
        slow = blocker.ping.with_timeout(FREEZE + 5).call_one(3)
        with pytest.raises(CallTimeout, match=r"gave up after 0\.2s"):
            slow.get(timeout=0.2)
        assert slow.get(timeout=FREEZE + 5) == 3
    finally:
        procs.stop().get()


def test_timeouts_must_be_positive():
    with pytest.raises(ValueError, match="positive"):

        @endpoint(timeout=0)
        async def nothing(self) -> None: ...

    with pytest.raises(ValueError, match="positive"):
        from actors import MeshEndpoint

        MeshEndpoint(None, "ping").with_timeout(-1)  # type: ignore[arg-type]


async def test_waiting_for_progress_gives_way_to_a_real_cancellation():
    """``wait_until``'s own timer is not a cancellation: cancelling the waiting task ends it at once."""
    import asyncio

    from actors._runtime._core import runtime

    waiting = asyncio.ensure_future(runtime().driver.wait_until(lambda: False, 20))
    await asyncio.sleep(0)  # (a yield: it now waits)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(waiting, 5)


async def test_waiting_for_progress_ends_at_its_deadline_with_false():
    from actors._runtime._core import runtime

    started = time.monotonic()
    assert await runtime().driver.wait_until(lambda: False, 0.05) is False
    assert time.monotonic() - started < 5


async def test_a_call_its_caller_gave_up_on_leaves_the_call_table_at_its_deadline(spawn):
    """A caller that stops waiting first (``wait_for`` shorter than the call's deadline, a future never awaited, a
    thread's ``get(timeout)`` polls) left the call in the table for good, with a waiter or a callback per attempt:
    a service polling a wedged actor grew without bound. Each call now ends at its own deadline, waited for or not,
    and an abandoned wait leaves nothing behind."""
    import asyncio
    import contextlib

    from actors._runtime._core import runtime

    procs: ProcMesh = spawn(procs=1)
    blocker = procs.spawn("blocker", Blocker)
    assert await blocker.ping.call_one(1) == 1
    calls = runtime().calls
    before = len(calls)
    send(blocker.freeze, (FREEZE,))
    for n in range(20):
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(blocker.ping.with_timeout(0.3).call_one(n), 0.005)
    never = blocker.ping.with_timeout(0.3).call_one(99)  # noqa: F841  (never awaited)
    last = blocker.ping.with_timeout(0.6).call_one(100)
    pending = calls._pending[max(calls._pending)]
    for _ in range(20):
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(last, 0.005)

    def poll() -> None:
        for _ in range(10):
            with pytest.raises(CallTimeout, match="gave up after"):
                last.get(timeout=0.005)

    await asyncio.to_thread(poll)
    assert len(calls) == before + 22
    assert pending.waiters == [] and len(pending.callbacks) <= 2, "abandoned waits are let go"
    with pytest.raises(CallTimeout, match=r"within 0\.6s"):
        await last
    assert len(calls) == before, "every call ended at its deadline, awaited or not"
