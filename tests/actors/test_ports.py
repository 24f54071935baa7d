"""Ports: typing, end of stream, fan-in, once-ports, flow control, dead peers."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import enum
import os
import signal
import time
from typing import Any, NamedTuple

import pytest
import torch
from support import Echo, Item, Relay

from actors import ActorDied, ActorError, Channel, DecodeError, Port, PortClosed, ProcMesh, this_host
from actors._runtime._core import runtime
from actors._transport._flow import WINDOW as PORT_WINDOW


async def test_typed_port_refuses_wrong_type_at_sender():
    port, recv = Channel.open(Item)
    with pytest.raises(TypeError, match=r"carries support\.Item"):
        port.send("not an item")
    port.send(Item(1, torch.ones(2)))
    port.send(None)
    got = await recv.recv()
    assert isinstance(got, Item) and got.seq == 1
    assert await recv.recv() is None


class Pair(NamedTuple):
    x: int
    y: int


class Colour(enum.IntEnum):
    RED = 1


def test_a_port_whose_type_would_arrive_as_another_is_refused_at_open():
    """Values travel as msgpack has them: a named tuple as a tuple, an int enum as an int. A port typed for one let
    the sender's check pass and handed another process's receiver a plain tuple (``got.x`` an AttributeError)."""
    for kind, plain in ((Pair, "tuple"), (Colour, "int"), (collections.OrderedDict, "dict")):
        with pytest.raises(TypeError, match=rf"would deliver a plain {plain} to another process.*make it a dataclass"):
            Channel.open(kind)
    for kind in (int, bool, str, tuple, dict, Item, tuple[int, int]):  # themselves, or a record of their own
        _port, recv = Channel.open(kind)
        recv.close()


async def test_typed_port_checks_remote_senders(procs: ProcMesh):
    port, recv = Channel.open(int)
    echo = procs.spawn("echo", Echo).slice(procs=0)
    with pytest.raises(ActorError, match=r"TypeError: this port carries builtins\.int") as info:
        await echo.send_to.call_one(port, [1, "two"])
    assert info.value.exception_type == "TypeError"
    assert await recv.recv() == 1
    assert recv.qsize() == 0


async def test_fan_in_many_senders_with_sentinels(procs: ProcMesh):
    port, recv = Channel.open(Item)
    echo = procs.spawn("echo", Echo)
    done = echo.emit.call(port, 500)
    seen: dict[int, int] = {}
    sentinels = 0
    while sentinels < 2:
        item = await recv.recv()
        if item is None:
            sentinels += 1
            continue
        seen[item.seq] = seen.get(item.seq, 0) + 1
        assert torch.equal(item.payload, torch.full((4,), float(item.seq)))
    await done
    assert seen == {seq: 2 for seq in range(500)}


async def test_per_sender_order_is_preserved(procs: ProcMesh):
    port, recv = Channel.open(Item)
    echo = procs.spawn("echo", Echo).slice(procs=0)
    fut = echo.emit.call_one(port, 3 * PORT_WINDOW, 1)
    seqs = []
    while (item := await recv.recv()) is not None:
        seqs.append(item.seq)
    await fut
    assert seqs == list(range(3 * PORT_WINDOW))


async def test_once_port_delivers_a_single_message():
    port, recv = Channel.open(once=True)
    port.send(7)
    with pytest.raises(PortClosed, match="once"):
        port.send(8)
    assert await recv.recv() == 7
    with pytest.raises(PortClosed):
        await recv.recv()


@dataclasses.dataclass
class Fields:
    x: int


class Unreadable(Fields):
    """A dataclass whose field cannot be read: encoding it raises the field's own error, not an ``EncodeError``."""

    @property
    def x(self) -> int:
        raise RuntimeError("this field cannot be read")


async def test_a_once_port_whose_value_raises_as_it_is_encoded_still_takes_its_one_message(procs: ProcMesh):
    """Only a refusal the port knew (closed, full, ``EncodeError``) gave a once-port its message back: a value whose
    own code raised as it was encoded (a property, a pickled object's ``__reduce__``) used the port up though
    nothing left, so the answer that followed was refused and its receiver never heard."""
    from support import OnceInlets

    inlets = procs.spawn("inlets", OnceInlets).slice(procs=0)
    inlet: Port = await inlets.open_untyped.call_one()
    with pytest.raises(RuntimeError, match="this field cannot be read"):
        inlet.send(object.__new__(Unreadable))
    inlet.send(5)
    assert await asyncio.wait_for(inlets.total.call_one(), 10) == 5


def test_a_synchronous_waiters_interrupt_is_not_the_futures_outcome():
    """A Ctrl-C during ``get()`` (an interrupted notebook cell) was kept as the future's result: every later
    ``get()`` or ``await`` raised ``KeyboardInterrupt`` at once, though the answer came."""
    from actors._runtime._future import Future

    tries = iter([KeyboardInterrupt(), 5])

    def wait_sync(timeout: float | None) -> int:
        outcome = next(tries)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    async def body() -> int:
        raise AssertionError("waited for on this thread")

    future = Future(body, wait_sync, any_thread=True)
    with pytest.raises(KeyboardInterrupt):
        future.get()
    try:
        answer = future.get()
    except KeyboardInterrupt:  # (caught here: raised on, it would end the test session)
        pytest.fail("the waiter's interrupt was kept as the future's outcome")
    assert answer == 5


async def test_a_get_of_work_that_cancels_itself_on_a_loop_that_drives_ends_with_the_cancellation():
    """``get()`` from a helper thread of work run on the runtime's loop, which ends in ``CancelledError`` while that
    loop drives the runtime: the run was started again at once, for good, re-running the work each round. Once
    is a loop shutting down (the work then runs on the next); twice on the same loop, the cancellation is its
    outcome."""
    from actors._runtime._future import Future

    runs: list[int] = []

    async def cancels_itself() -> None:
        runs.append(1)
        raise asyncio.CancelledError

    runtime().driver.ensure_loop()
    future: Future[None] = Future(cancels_itself)

    def get_in_a_thread() -> str:
        try:
            future.get()
        except BaseException as exc:
            return type(exc).__name__
        return "returned"

    assert await asyncio.wait_for(asyncio.to_thread(get_in_a_thread), 10) == "CancelledError"
    assert len(runs) == 2


async def test_once_port_from_an_actor(procs: ProcMesh):
    port, recv = Channel.open(once=True)
    echo = procs.spawn("echo", Echo).slice(procs=1)
    await echo.send_to.call_one(port, ["done"])
    assert await recv.recv() == "done"


async def test_sender_waits_when_the_window_is_full(procs: ProcMesh):
    """A slow receiver throttles the sender: the in-flight count never exceeds the window."""
    relay = procs.spawn("relay", Relay).slice(procs=0)
    inlet: Port = await relay.inlet.call_one()
    out, out_recv = Channel.open(Item)
    run = relay.run.call_one(out, 0.0)
    rt = runtime()
    total = 3 * PORT_WINDOW
    peak = 0
    payload = torch.zeros(1)
    consumer_count = 0

    async def consume() -> None:
        nonlocal consumer_count
        while (item := await out_recv.recv()) is not None:
            assert item.seq == consumer_count
            consumer_count += 1

    consumer = asyncio.create_task(consume())
    for seq in range(total):
        inlet.send(Item(seq, payload))
        peak = max(peak, rt.windows.inflight(inlet._address, inlet._id))
        if seq % 1000 == 0:
            await asyncio.sleep(0)
    inlet.send(None)
    await asyncio.wait_for(consumer, 60)
    assert await run == total
    assert consumer_count == total
    assert peak <= PORT_WINDOW


async def test_a_sender_lets_a_ports_flow_state_go_once_everything_it_sent_was_consumed(procs: ProcMesh):
    """A window per port a process ever sent to stayed until that peer exited: a service streaming to a long-lived
    caller on a new port per request grew without bound. Once all it sent is credited back it goes, on both sides,
    and the same port used again makes a fresh one that still counts."""
    from actors._transport._flow import CREDIT_MESSAGES

    relay = procs.spawn("relay", Relay).slice(procs=0)
    inlet: Port = await relay.inlet.call_one()
    out, out_recv = Channel.open(Item)
    rt = runtime()

    async def stream(items: int) -> list[int]:
        run = relay.run.call_one(out, 0.0)
        for seq in range(items):
            inlet.send(Item(seq, torch.zeros(1)))
        inlet.send(None)
        got = []
        while (item := await asyncio.wait_for(out_recv.recv(), 60)) is not None:
            got.append(item.seq)
        assert await run == items
        return got

    async def until(condition: Any) -> bool:
        deadline = time.monotonic() + 30  # a guard against a hang only
        while not await condition() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return bool(await condition())

    async def ours_gone() -> bool:
        return (inlet._address, inlet._id) not in rt.windows._windows

    async def relays_gone() -> bool:
        return not await relay.counts_flow_to.call_one(out)

    items = 2 * CREDIT_MESSAGES - 1  # with its None: exactly two credits' worth, so all of it is credited back
    assert await stream(items) == list(range(items))
    assert await until(ours_gone) and await until(relays_gone)
    assert await stream(5) == list(range(5)), "the same ports, used again, still carry everything"
    # a stream shorter than a credit batch: its None credits the rest at once (before, its 6 records stayed
    # counted in flight on the sender's side, and their count on the receiver's, for good)
    assert await until(ours_gone) and await until(relays_gone)


async def test_a_receive_that_succeeded_gives_its_value_again_and_no_error():
    port, recv = Channel.open(int)
    port.send(1)
    received = recv.recv()
    assert await received == 1
    assert await received == 1 and received.exception() is None  # (before: AttributeError, no _error set)


async def test_a_port_carries_an_exception_that_its_receiver_raises_as_an_actor_error():
    """Monarch's ``Port.exception``: the error takes its place in the stream (a typed port takes it too); the
    receive that meets it raises ``ActorError`` (again if awaited again), and the stream goes on after it."""
    port, recv = Channel.open(int)
    port.send(1)
    port.exception(ValueError("bad value"))
    port.send(2)
    assert recv.recv_ready() == [1], "a batch ends before an error"
    failed = recv.recv()
    with pytest.raises(ActorError, match="bad value") as raised:
        await failed
    assert raised.value.exception_type == "ValueError"
    with pytest.raises(ActorError, match="bad value"):
        await failed
    assert await recv.recv() == 2
    once, answer = Channel.open(int, once=True)
    once.exception(KeyError("gone"))
    with pytest.raises(PortClosed, match="only once"):
        once.exception(KeyError("again"))
    with pytest.raises(ActorError, match="KeyError"):
        await answer.recv()
    with pytest.raises(TypeError, match="an exception"):
        port.exception("not an exception")  # type: ignore[arg-type]


async def test_an_actor_sends_an_exception_through_a_port(procs: ProcMesh):
    port, recv = Channel.open(int)
    echo = procs.spawn("echo", Echo).slice(procs=0)
    await echo.fail_to.call_one(port, "refused over there")
    with pytest.raises(ActorError, match="refused over there") as raised:
        await asyncio.wait_for(recv.recv(), 20)
    assert raised.value.actor == "echo" and raised.value.method == "fail_to"


async def test_a_port_of_an_earlier_process_at_this_address_reaches_no_receiver_here():
    """A restarted process has its predecessor's address, and port ids start at 1 again: a port of the old
    process (its pid) sent to here reached the new one's receiver of the same id. It is closed."""
    from actors import PortClosed

    port, recv = Channel.open(int)
    rt = runtime()
    stale: Port[int] = Port(rt.address, rt.pid + 12345, port._id, port._type, False)
    with pytest.raises(PortClosed, match="replaced"):
        stale.send(42)
    assert recv.recv_ready() == []


async def test_a_call_to_no_process_leaves_nothing_in_the_call_table(procs: ProcMesh):
    echo = procs.spawn("echo", Echo)
    await echo.whoami.call()
    rt = runtime()
    before = len(rt.calls._pending)
    for pid in procs.pids:
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ActorDied):
        await asyncio.wait_for(echo.sleep.call(60), 30)
    for _ in range(3):
        with contextlib.suppress(Exception):
            await asyncio.wait_for(echo.stop(), 30)  # every process is dead: a call with no target
    assert len(rt.calls._pending) <= before, "calls with no target stayed in the call table"


async def test_a_sender_sent_to_a_process_still_starting_counts_until_its_pid_is_known(sockets_dir):
    """A restarted process is sent the port (a log port's replay) before its pid is known: meanwhile its sender
    counts, so a receive does not end with "every sender has exited" between the old process's death and the new
    one's pid (before: a log collector's receive ended there for good, and the restarted process's lines waited)."""
    from actors._shared._session import inbox_address

    port, recv = Channel.open(int)
    rt = runtime()
    recv._state.attach(rt.pid + 12345, False)  # (a holder that could not be watched: counted gone)
    assert not recv.senders_alive
    starting = rt.registry.proc(inbox_address(rt.dir, "w-starting"), None)
    port._shipped_to(rt, starting)
    assert recv.senders_alive, "a sender on its way counts"
    rt.registry.set_pid(starting, rt.pid)  # (its pid is known: a holder like any other from now on)
    assert recv._state.pending == 0


async def test_a_sender_sent_to_a_process_that_never_starts_counts_no_more_once_it_is_dead(sockets_dir):
    """The process a port was sent to dies before its pid is known (its spawn failed, its host was lost): what
    waited for its pid ran only once a pid was known, never, so its sender counted for good and a receive whose
    other senders had gone waited forever. Its death ends the wait; a port sent to it after that counts it gone."""
    from actors._shared._session import inbox_address

    rt = runtime()
    never = rt.registry.proc(inbox_address(rt.dir, "w-never"), None)
    port, recv = Channel.open(int)
    rt.driver.on_thread(lambda: port._shipped_to(rt, never))
    assert recv.senders_alive and recv._state.pending == 1
    rt.driver.on_thread(lambda: rt.registry.mark_dead(never, "its spawn failed"))
    assert recv._state.pending == 0
    with pytest.raises(PortClosed, match="every process"):
        await asyncio.wait_for(recv.recv(), 5)
    later, later_recv = Channel.open(int)
    rt.driver.on_thread(lambda: later._shipped_to(rt, never))
    with pytest.raises(PortClosed, match="every process"):
        await asyncio.wait_for(later_recv.recv(), 5)


async def test_a_sender_held_on_another_host_counts_until_news_of_its_death(sockets_dir):
    """A process of another host holds a sender: its pid names no process here, so watching it by pid here said it
    was gone at once ("every sender has exited" while it was alive), or waited on an unrelated local process of
    the same pid. It is known by its address until news of its death comes."""
    port, recv = Channel.open(int)
    rt = runtime()
    far = rt.registry.placed("tcp://10.255.0.1:40000")
    rt.registry.set_pid(far, 4_000_000)  # (a pid no process of this machine has: Linux's are below 2**22)
    rt.driver.on_thread(lambda: port._shipped_to(rt, far))
    assert recv.senders_alive and recv._state.holders == {far.address}
    rt.driver.on_thread(lambda: rt.registry.mark_dead(far, "its host said so"))
    with pytest.raises(PortClosed, match="every process"):
        await asyncio.wait_for(recv.recv(), 5)
    assert 4_000_000 not in rt.registry.watcher.dead, "no pid of this machine was taken for it"
    twin = rt.registry.placed("tcp://10.255.0.2:40000")  # another host's process of this one's pid (one image)
    rt.registry.set_pid(twin, rt.pid)
    port, recv = Channel.open(int)
    rt.driver.on_thread(lambda: port._shipped_to(rt, twin))
    assert recv._state.holders == {twin.address}, "a holder (before: taken for the port's own process, not counted)"


async def test_recv_raises_when_every_sender_died(procs: ProcMesh):
    port, recv = Channel.open(str)
    echo = procs.spawn("echo", Echo).slice(procs=0)
    await echo.hold.call_one(port)
    assert recv.senders_alive
    pid = await echo.pid.call_one()
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(PortClosed, match="every process"):
        await asyncio.wait_for(recv.recv(), 5)
    assert not recv.senders_alive


async def test_messages_queued_before_sender_death_are_still_received(procs: ProcMesh):
    port, recv = Channel.open(str)
    echo = procs.spawn("echo", Echo).slice(procs=0)
    await echo.send_to.call_one(port, ["last words"])
    os.kill(await echo.pid.call_one(), signal.SIGKILL)
    with pytest.raises(ActorDied):
        await asyncio.wait_for(echo.pid.call_one(), 5)
    assert await recv.recv() == "last words"
    with pytest.raises(PortClosed):
        await asyncio.wait_for(recv.recv(), 5)


async def test_send_to_a_dead_receiver_raises(procs: ProcMesh):
    relay = procs.spawn("relay", Relay).slice(procs=1)
    inlet: Port = await relay.inlet.call_one()
    pid = procs.pids[1]
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(ActorDied):
        await asyncio.wait_for(relay.inlet.call_one(), 5)
    with pytest.raises(PortClosed, match="exited"):
        inlet.send(Item(0, torch.zeros(1)))


async def test_closed_receiver_refuses_local_sends():
    port, recv = Channel.open()
    recv.close()
    with pytest.raises(PortClosed):
        port.send(1)
    with pytest.raises(PortClosed):
        await recv.recv()


def test_taking_what_is_queued_and_closing_run_on_the_runtimes_thread(sockets_dir, monkeypatch):
    """A synchronous program's runtime is served by a background loop: ``recv_ready()`` and ``close()`` from the
    program's thread took messages, sent credit and woke waiters there, beside that loop (the encoder, the ZeroMQ
    sockets and the waiters' futures are its thread's alone)."""
    import threading

    from actors._runtime._port import PortReceiver

    procs = this_host().spawn_procs(per_host={"procs": 1})
    try:
        port, recv = Channel.open(int)
        echo = procs.spawn("echo", Echo)
        echo.send_to.call_one(port, [1, 2, 3]).get(timeout=30)
        assert recv.recv().get(timeout=10) == 1  # (the rest are queued behind it)
        threads: list[int] = []
        real_take = PortReceiver._take

        def take(self: PortReceiver) -> object:
            threads.append(threading.get_ident())
            return real_take(self)

        monkeypatch.setattr(PortReceiver, "_take", take)
        assert recv.recv_ready() == [2, 3]
        driver = runtime().driver
        assert driver.thread is not None and driver.thread != threading.get_ident()
        assert threads == [driver.thread, driver.thread]
        closed_on: list[int] = []
        receivers = runtime().receivers
        real_close = type(receivers).close

        def close(self: object, state: object, reason: str) -> None:
            closed_on.append(threading.get_ident())
            real_close(self, state, reason)  # type: ignore[arg-type]

        monkeypatch.setattr(type(receivers), "close", close)
        recv.close()
        assert closed_on == [driver.thread]
    finally:
        procs.stop().get()


def test_channel_open_once_must_be_keyword():
    with pytest.raises(TypeError, match="keyword"):
        Channel.open(True)


def test_sync_recv_without_an_event_loop(sockets_dir):
    procs = this_host().spawn_procs(per_host={"procs": 1})
    try:
        port, recv = Channel.open(int)
        echo = procs.spawn("echo", Echo)
        echo.send_to.call_one(port, [5, 6]).get(timeout=30)
        assert recv.recv().get(timeout=10) == 5
        assert recv.recv().get(timeout=10) == 6
        from actors import CallTimeout

        with pytest.raises(CallTimeout):
            recv.recv().get(timeout=0.2)
    finally:
        procs.stop().get()


async def test_messages_to_a_closed_receiver_do_not_exhaust_the_window(procs: ProcMesh):
    """Dropped messages are credited back: a sender to a closed port never stalls."""
    relay = procs.spawn("relay", Relay).slice(procs=0)
    inlet: Port = await relay.inlet.call_one()
    out, out_recv = Channel.open(Item)
    echo = procs.spawn("echo", Echo).slice(procs=1)
    port, recv = Channel.open(Item)
    recv.close()
    # The actor sends 3 windows' worth to a port whose receiver is closed; it must finish.
    await asyncio.wait_for(echo.emit.call_one(port, 3 * PORT_WINDOW, 1), 60)
    assert inlet is not None and out is not None and out_recv.qsize() == 0


async def test_closing_a_receiver_with_messages_queued_gives_their_credit_back(procs: ProcMesh):
    """The queued messages (a full window) and the consumed ones not yet credited are credited at close: the
    sender's backlog then drains to the closed port instead of waiting for credit that never comes."""
    echo = procs.spawn("echo", Echo).slice(procs=0)
    port, recv = Channel.open(int)
    call = asyncio.ensure_future(echo.emit_paced.call_one(port, 2 * PORT_WINDOW + 10))
    for _ in range(10):  # consumed, not yet credited (below the credit batch)
        await recv.recv()
    await _until(lambda: recv.qsize() == PORT_WINDOW - 10)  # (the window is full: the rest waits in the backlog)
    recv.close()
    assert await asyncio.wait_for(call, 30) == 2 * PORT_WINDOW + 10
    with pytest.raises(PortClosed, match="closed"):
        await recv.recv()


async def test_a_stopping_process_first_sends_what_it_held_back_for_credit(sockets_dir):
    """``emit`` returns with a window's worth held back (the receiver had not consumed yet); stopping the process
    then dropped it silently, and the stream ended without its last window or its ``None``."""
    procs = this_host().spawn_procs(per_host={"procs": 1})
    echo = procs.spawn("echo", Echo).slice(procs=0)
    port, recv = Channel.open(Item)
    await echo.emit.call_one(port, 2 * PORT_WINDOW, 1)
    stopping = asyncio.ensure_future(procs.stop())
    seqs = []
    while (item := await asyncio.wait_for(recv.recv(), 30)) is not None:
        seqs.append(item.seq)
    await asyncio.wait_for(stopping, 30)
    assert seqs == list(range(2 * PORT_WINDOW))


async def test_a_once_port_sent_to_leaves_no_flow_window_behind(procs: ProcMesh):
    """Its one message is never credited: its window stayed in the sender's table until the receiving process
    exited, one per once-port (a service answering each request on a once-port grew without bound)."""
    from support import OnceInlets

    inlets = procs.spawn("inlets", OnceInlets).slice(procs=0)
    windows = runtime().windows
    before = len(windows._windows)
    for value in range(50):
        port = await inlets.open.call_one()
        port.send(value)
    assert await inlets.total.call_one() == sum(range(50))
    assert len(windows._windows) <= before + 1, "(at most a window of another port of that process)"


async def test_two_tasks_receiving_on_one_port_each_get_a_message():
    """Concurrent ``recv()``s queue up: every waiting task is woken, none is forgotten."""
    port, recv = Channel.open(int)
    first = asyncio.ensure_future(recv.recv())
    second = asyncio.ensure_future(recv.recv())
    await asyncio.sleep(0)  # (a yield, not a wait: both tasks now wait on the empty queue)
    assert len(recv._state.waiters) == 2
    port.send(1)
    port.send(2)
    assert sorted(await asyncio.wait_for(asyncio.gather(first, second), 10)) == [1, 2]
    assert not recv._state.waiters


async def test_a_cancelled_receiver_task_does_not_strand_the_other_one():
    port, recv = Channel.open(int)
    first = asyncio.ensure_future(recv.recv())
    second = asyncio.ensure_future(recv.recv())
    await asyncio.sleep(0)
    second.cancel()
    with pytest.raises(asyncio.CancelledError):
        await second
    port.send(7)
    assert await asyncio.wait_for(first, 10) == 7
    assert not recv._state.waiters


def test_a_once_port_whose_send_failed_was_not_used_up():
    """A send that raised delivered nothing, so the once-port's one message is still to come."""
    port, recv = Channel.open(int, once=True)
    recv.close()
    for _ in range(2):
        with pytest.raises(PortClosed, match="no receiver"):
            port.send(1)


async def test_work_handed_to_a_busy_runtime_thread_times_out_as_the_runtimes_own_timeout(monkeypatch):
    """A thread hands work to the runtime's loop, whose thread is busy past the hand-off's timeout: that was a bare
    ``TimeoutError`` (on Python 3.10 not even the built-in one, so a once-port took it for a refusal and could
    send a second answer); it is a ``CallTimeout``, ``HandOffTimeout``, after which the work never runs. A
    once-port whose send timed out that way keeps it used; one refused another way gets its message back."""
    import threading

    from actors import CallTimeout
    from actors._shared._errors import HandOffTimeout

    rt = runtime()
    rt.driver.ensure_loop()
    ran: list[int] = []
    outcome: list[BaseException] = []

    def hand_off() -> None:
        try:
            rt.driver.on_thread(lambda: ran.append(1), timeout=0.2)
        except BaseException as exc:
            outcome.append(exc)

    helper = threading.Thread(target=hand_off)
    helper.start()
    helper.join(30)  # (this test holds the loop's thread meanwhile: the work cannot run in time)
    [error] = outcome
    assert isinstance(error, HandOffTimeout) and isinstance(error, CallTimeout), repr(error)
    await asyncio.sleep(0)
    assert ran == [], "given up on: it does not run later"

    for refusal, used in ((HandOffTimeout("the hand-off timed out"), True), (CallTimeout("no credit came"), False)):
        port, recv = Channel.open(int, once=True)
        monkeypatch.setattr(Port, "_deliver", lambda self, value, refusal=refusal: (_ for _ in ()).throw(refusal))
        with pytest.raises(CallTimeout):
            port.send(1)
        assert port._used is used, refusal
        recv.close()


async def test_a_call_that_cannot_be_queued_leaves_no_pending_call(procs: ProcMesh, monkeypatch):
    """``post`` raising BufferFull fails the call at its caller; the call table forgets it."""
    from actors import BufferFull

    echo = procs.spawn("echo", Echo)
    await echo.add.call(1)  # every link is open
    rt = runtime()
    before = len(rt.calls)

    def full(*args: object, **kwargs: object) -> None:
        raise BufferFull("the link's queue is full")

    monkeypatch.setattr(rt.outbox, "post", full)
    with pytest.raises(BufferFull, match="full"):
        echo.add.call(1)
    monkeypatch.undo()
    assert len(rt.calls) == before
    assert await echo.slice(procs=1).add.call_one(2) == 2  # the runtime goes on


async def echo_with_posts_recorded(procs: ProcMesh, monkeypatch: Any) -> tuple[Any, Any, list[str]]:
    """An echo actor on each of ``procs`` (every link open), the link to rank 1's process, and the addresses every
    record posted from now on goes to."""
    echo = procs.spawn("echo", Echo)
    await echo.add.call(1)
    rt = runtime()
    posted: list[str] = []
    post = rt.outbox.post

    def recording(link: Any, *args: Any, **kwargs: Any) -> None:
        post(link, *args, **kwargs)
        posted.append(link.address)

    monkeypatch.setattr(rt.outbox, "post", recording)
    return echo, rt.link(procs._procs[1]), posted


async def test_a_call_one_of_whose_links_is_full_reaches_no_rank(procs: ProcMesh, monkeypatch):
    """A call to every rank is all or nothing: a full link or a dead rank found after rank 0 was sent to would
    leave rank 0 running a call whose caller was told it failed."""
    from actors import BufferFull
    from actors._transport._outbox import LINK_RECORDS

    echo, last, posted = await echo_with_posts_recorded(procs, monkeypatch)
    held, last.records = last.records, LINK_RECORDS  # rank 1's peer "is not reading"
    try:
        with pytest.raises(BufferFull, match="not reading"):
            echo.add.call(1)
    finally:
        last.records = held
    assert posted == [], "nothing was sent to rank 0"
    assert [v for _, v in await echo.add.call(2)] == [2, 2]  # the runtime goes on
    procs.add_failure_handler(lambda failure: failure.exception_type == "ActorDied")  # (handled: contained)
    os.kill(await echo.slice(procs=1).pid.call_one(), signal.SIGKILL)
    with pytest.raises(ActorDied):
        await asyncio.wait_for(echo.slice(procs=1).sleep.call_one(60), 30)  # rank 1 is known dead
    posted.clear()
    with pytest.raises(ActorDied):
        await echo.add.call(1)
    assert posted == [], "nothing was sent to rank 0: its rank 1 is dead"
    monkeypatch.undo()
    assert await echo.slice(procs=0).add.call_one(3) == 3


async def test_a_call_one_of_whose_batches_must_leave_first_and_cannot_reaches_no_rank(procs: ProcMesh, monkeypatch):
    """The up-front check of a call to every rank counted each link's records and bytes, not whether the record
    would fit in its batch: rank 1's batch near the payload a receiver accepts, its peer's queue full, the post to
    rank 1 raised ``BufferFull`` after rank 0 had been sent the call its caller was told failed."""
    from actors import BufferFull
    from actors._transport import _outbox
    from actors._transport._sockets import Link

    echo, last, posted = await echo_with_posts_recorded(procs, monkeypatch)
    limit = 1 << 16
    monkeypatch.setattr(_outbox, "MAX_PAYLOAD_BYTES", limit)
    send = Link.try_send
    monkeypatch.setattr(Link, "try_send", lambda self, header: False if self is last else send(self, header))
    last.parts, last.inline = [b""], limit - 64  # rank 1's batch is nearly full, and its peer's queue refuses it
    try:
        with pytest.raises(BufferFull, match="in one batch"):
            echo.add.call(1)
    finally:
        last.parts, last.inline = [], 0
    assert posted == [], "nothing was sent to rank 0"
    monkeypatch.undo()
    assert [v for _, v in await echo.add.call(2)] == [2, 2]  # the runtime goes on


async def test_a_port_send_refused_by_a_full_link_takes_no_window_credit(procs: ProcMesh, monkeypatch):
    """``BufferFull`` from the link means nothing left: the port's flow window must not count it as in flight."""
    from actors import BufferFull

    relay = procs.spawn("relay", Relay).slice(procs=0)
    inlet: Port = await relay.inlet.call_one()
    inlet.send(Item(0, torch.ones(2)))  # the port's route and window exist from here
    window = inlet._route.window  # type: ignore[union-attr]
    before = (window.inflight, window.inflight_bytes)
    rt = runtime()

    def full(*args: object, **kwargs: object) -> None:
        raise BufferFull("the link's queue is full")

    monkeypatch.setattr(rt.outbox, "post", full)
    with pytest.raises(BufferFull, match="full"):
        inlet.send(Item(1, torch.ones(2)))
    monkeypatch.undo()
    assert (window.inflight, window.inflight_bytes) == before


async def _until(condition: Any, timeout: float = 30.0) -> None:
    """Poll ``condition`` (state another process changes) until it holds; ``timeout`` guards against a hang."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition never held"
        await asyncio.sleep(0.01)


def test_a_port_or_mesh_naming_an_address_outside_the_session_is_refused():
    """A handle's address is where sends go: one no process of this session could own is a DecodeError."""
    import msgpack

    from actors._wire._codec import EXT_HANDLE, EXT_TUPLE, Decoder

    rt = runtime()
    extent = [msgpack.ExtType(EXT_TUPLE, msgpack.packb(["procs", 1]))]
    for kind, state in (
        ("port", ["ipc:///etc/elsewhere.sock", 7, 1, None, False]),
        ("actor_mesh", ["a", "m:C", [], extent, [[0, "tcp://[::bad", None]]]),
        ("proc_mesh", ["p", extent, [[f"ipc://{rt.dir}/../x.sock", None]]]),
    ):
        record = msgpack.ExtType(EXT_HANDLE, msgpack.packb([kind, state]))
        with pytest.raises(DecodeError, match="not a peer"):
            Decoder().decode(msgpack.packb(record))


async def test_a_receiver_dropped_unclosed_closes_its_port(sockets_dir):
    """A service that opens a port per request and drops the receiver kept every one, and what was queued on it,
    for good; sends to it were kept for no one. Dropped, a receiver closes, as Monarch's does."""
    import gc

    rt = runtime()
    before = len(rt.receivers._states)
    ports = []
    for n in range(20):
        port, recv = Channel.open(int)
        port.send(n)
        ports.append(port)
        del recv
    gc.collect()  # (their closes are queued on the loop, never run inside a collection: a yield runs them)
    await asyncio.sleep(0)
    assert len(rt.receivers._states) == before
    with pytest.raises(PortClosed, match="no receiver in this process"):
        ports[0].send(1)
    kept, recv = Channel.open(int)
    kept.send(5)
    assert await recv.recv() == 5, "a receiver still held is left alone"


def test_an_error_taken_just_as_a_threads_receive_gives_up_is_raised_not_lost(sockets_dir, monkeypatch):
    """A synchronous receive gives up just as the loop takes an error sent in a value's place (Port.exception): the
    error had left the queue, the caller got CallTimeout, and the stream silently skipped it."""
    from actors._runtime import _port

    port, recv = Channel.open(int)
    real = _port.done_within

    def arrives_as_it_gives_up(future: Any, seconds: float) -> bool:
        port.exception(ValueError("sent instead of a value"))
        real(future, 30)  # the loop takes it meanwhile
        return False  # and the caller's wait runs out just then

    monkeypatch.setattr(_port, "done_within", arrives_as_it_gives_up)
    with pytest.raises(ActorError, match="sent instead of a value"):
        recv.recv().get(timeout=0.1)


def test_an_attach_watches_the_pid_it_names_not_an_older_one_at_that_address():
    """A process restarted at an address another's sender came from: the ATTACH names its new pid, which is the one
    watched (the registry may still hold the old one, whose exit would say every sender was gone)."""
    from actors._shared._liveness import ProcRef
    from actors._transport._receivers import Receivers
    from actors._wire._records import Attach

    watched: list[int] = []
    old = ProcRef("ipc:///restarted.sock", 111)
    receivers = Receivers(1, lambda pid: watched.append(pid) or True, lambda *credit: None, print, lambda a, p: old)
    state = receivers.open(False)
    receivers.on_attach(Attach(state.port_id, 222, old.address), [], None, 0)  # type: ignore[arg-type]
    assert watched == [222] and state.holders == {222}


def test_a_senders_exit_seen_just_before_the_program_left_its_loop_still_ends_a_receive(sockets_dir, monkeypatch):
    """A port sender's exit is settled a moment later, on a timer of the loop that saw it (its last messages may
    still be on their way); ``asyncio.run`` ending meanwhile took the timer with its loop, the holder was never
    removed, and a receive of that port, with nothing queued, waited for good. The settle is timed again on the
    loop the runtime moves to."""
    from actors._runtime import _core

    monkeypatch.setattr(_core, "HOLDER_SETTLE", 1.0)  # (the program surely leaves its loop before it is due)
    port, recv = Channel.open(str)

    async def hold_then_lose_the_sender() -> ProcMesh:
        procs = this_host().spawn_procs(per_host={"procs": 1})
        echo = procs.spawn("echo", Echo)
        await echo.hold.call_one(port)
        os.kill(await echo.pid.call_one(), signal.SIGKILL)
        with pytest.raises(ActorDied):  # its exit seen: the settle is timed on this loop, which ends now
            await asyncio.wait_for(echo.pid.call_one(), 10)
        return procs

    procs = asyncio.run(hold_then_lose_the_sender())
    try:
        with pytest.raises(PortClosed, match="every process"):
            recv.recv().get(timeout=10)
    finally:
        procs.stop().get(timeout=30)


async def test_credit_for_messages_of_a_process_restarted_since_goes_not_to_its_replacement(sockets_dir, monkeypatch):
    """A receiver counted consumption by sender address, and gave the credit to the process at that address now:
    after a restart there, the replacement got back window its predecessor's messages had taken, and could send up
    to a window past its bound (or have its live window dropped). Credit goes to the process that sent."""
    from actors._transport._flow import CREDIT_MESSAGES
    from actors._wire._records import Credit, Header, Kind

    rt = runtime()
    sent: list[tuple[int | None, object]] = []
    monkeypatch.setattr(rt, "send", lambda ref, record, **kw: sent.append((ref.pid, record)))
    address = "tcp://10.255.0.3:40000"
    far = rt.registry.placed(address)
    rt.registry.set_pid(far, 4_000_001)
    _port, recv = Channel.open(int)
    old, new = Header(address, 4_000_001), Header(address, 4_000_002)

    def queue() -> None:  # (as the inbox hands them over)
        for i in range(CREDIT_MESSAGES):
            rt.receivers.on_port_message([int(Kind.PORT), recv._state.port_id, i], [], old, 8)
        rt.receivers.on_port_message([int(Kind.PORT), recv._state.port_id, -1], [], new, 8)  # the replacement's first

    rt.driver.on_thread(queue)
    rt.driver.on_thread(lambda: rt.registry.mark_dead(far, "its host restarted it"))
    rt.driver.on_thread(lambda: rt.registry.revive(far, 4_000_002))
    assert recv.recv_ready() == [*range(CREDIT_MESSAGES), -1]
    assert sent == [], "the predecessor's consumed messages were credited to its replacement"
    rt.driver.on_thread(lambda: rt.receivers.on_port_message([int(Kind.PORT), recv._state.port_id, None], [], new, 1))
    assert recv.recv_ready() == [None]
    assert sent == [(4_000_002, Credit(recv._state.port_id, 2, 9))]
