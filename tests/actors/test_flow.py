"""Lossless flow under a slow receiver: a million messages, complete, in order, bounded memory."""

from __future__ import annotations

import asyncio
import time

import pytest
from support import Counter, Forwarder

from actors import Channel
from actors._transport._flow import WINDOW as PORT_WINDOW

TOTAL = 1_000_000


async def test_a_million_messages_through_two_stages_to_a_slow_receiver(procs):
    source = procs.spawn("source", Counter).slice(procs=0)
    relay = procs.spawn("relay", Forwarder).slice(procs=1)
    inlet = await relay.inlet.call_one()
    out, received = Channel.open()
    rss_before = [await source.rss_mib.call_one(), await relay.rss_mib.call_one()]
    forwarding = relay.run.call_one(out)
    producing = source.count_to.call_one(inlet, TOTAL)
    expected = 0
    started = time.monotonic()
    while (item := await received.recv()) is not None:
        assert item == expected, f"message {expected} arrived as {item}"
        expected += 1
        if expected % 50_000 == 0:
            await asyncio.sleep(0.05)  # the slow receiver: it stalls now and then
            assert received.qsize() <= 2 * PORT_WINDOW, "the relay must be throttled by the window"
    assert expected == TOTAL
    assert await forwarding == TOTAL
    await producing
    rss_after = [await source.rss_mib.call_one(), await relay.rss_mib.call_one()]
    assert all(after - before < 64 for before, after in zip(rss_before, rss_after, strict=True)), (
        f"memory grew: {rss_before} -> {rss_after} MiB"
    )
    assert await relay.peak.call_one() <= 2 * PORT_WINDOW
    assert time.monotonic() - started < 100


class FullOnce:
    """An outbox whose link refuses the first record (its peer's queue full), then takes every one."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None) -> None:
        self.loop = loop
        self.posted: list[bytes] = []
        self.refusals = 1

    def post(self, link: object, data: bytes, frames: list[object], urgent: bool) -> None:
        from actors import BufferFull

        if self.refusals:
            self.refusals -= 1
            raise BufferFull("the link's queue is full")
        self.posted.append(data)


async def test_a_backlog_a_full_link_refused_with_nothing_in_flight_is_offered_again():
    """The credit that emptied the window found the link full: nothing was in flight, so no credit would come to
    release the backlog, and ``drain()`` waited forever. It is offered to the link again until it leaves."""
    import types

    from actors._transport._flow import SenderWindows

    outbox = FullOnce(asyncio.get_running_loop())
    windows = SenderWindows(outbox)  # type: ignore[arg-type]
    window = windows.window(types.SimpleNamespace(address="ipc://peer"), 7)  # type: ignore[arg-type]
    window.inflight = PORT_WINDOW  # full: the next record waits in the backlog
    windows.send(window, b"record", [], 6)
    assert len(window.backlog) == 1
    windows.on_credit("ipc://peer", 7, PORT_WINDOW, 0)  # room again, but the link refuses
    assert window.inflight == 0 and len(window.backlog) == 1
    await asyncio.wait_for(windows.drain("ipc://peer", 7), 5)
    assert outbox.posted == [b"record"] and window.inflight == 1


@pytest.mark.parametrize("refused_on", ["another loop", "no loop"])
async def test_a_backlog_refused_while_another_loop_or_none_drove_the_process_is_offered_again(refused_on):
    """The credit that emptied the window found the link full while another event loop drove the process (the
    background loop handing over to the program's), or none: the release was timed on that loop, or not at all,
    and with nothing in flight no credit came to try again: ``drain()`` waited for good. A drain, or the next
    send, offers the backlog again when its release is not due on the loop that drives the process now."""
    import types

    from actors._transport._flow import SenderWindows

    other = asyncio.new_event_loop()
    outbox = FullOnce(other if refused_on == "another loop" else None)
    windows = SenderWindows(outbox)  # type: ignore[arg-type]
    window = windows.window(types.SimpleNamespace(address="ipc://peer"), 7)  # type: ignore[arg-type]
    window.inflight = PORT_WINDOW
    windows.send(window, b"record", [], 6)
    windows.on_credit("ipc://peer", 7, PORT_WINDOW, 0)  # room again, but the link refuses (on the other loop)
    other.close()  # (its timer never fires)
    outbox.loop = asyncio.get_running_loop()  # the program's loop drives the process now
    await asyncio.wait_for(windows.drain("ipc://peer", 7), 5)
    assert outbox.posted == [b"record"] and window.inflight == 1


async def test_a_backlog_released_by_its_retry_timer_wakes_a_thread_blocked_for_room(sockets_dir):
    """A thread without an event loop that sends to a full port blocks, the background loop checking for room after
    each message handled; when the backlog left through the retry timer (the link had refused it), no message came
    with it, and the thread slept on to the next one or its 60 s deadline (a spurious ``BufferFull`` if another
    sender filled the window meanwhile). The release is announced, and the runtime's waits for progress look again."""
    import types

    from actors._runtime._core import runtime
    from actors._transport._flow import SenderWindows

    outbox = FullOnce(asyncio.get_running_loop())
    windows = SenderWindows(outbox)  # type: ignore[arg-type]
    released = asyncio.Event()
    windows.released.connect(released.set)
    window = windows.window(types.SimpleNamespace(address="ipc://peer"), 7)  # type: ignore[arg-type]
    window.inflight = PORT_WINDOW
    windows.send(window, b"record", [], 6)
    windows.on_credit("ipc://peer", 7, PORT_WINDOW, 0)  # room again, but the link refuses: the timer releases it
    assert not released.is_set()
    await asyncio.wait_for(released.wait(), 5)
    assert outbox.posted == [b"record"]

    rt = runtime()  # the runtime hears of its windows' releases: a wait for room looks again at once
    room = [False]
    waiting = asyncio.ensure_future(rt.driver.wait_until(lambda: room[0], 60))
    for _ in range(3):
        await asyncio.sleep(0)
    room[0] = True
    rt.windows.released()
    assert await asyncio.wait_for(waiting, 5)


async def test_a_message_too_large_for_any_batch_is_refused_when_held_back_too(monkeypatch):
    """A full window sends records to the backlog, which took one too large for any batch: its release raised
    ``EncodeError`` out of the credit's handling, it stayed first in the backlog with everything behind it held
    for good (``drain()`` never returned), and the next sends raised that error for messages they had queued."""
    import types

    from actors import EncodeError
    from actors._transport import _outbox
    from actors._transport._flow import SenderWindows

    monkeypatch.setattr(_outbox, "MAX_PAYLOAD_BYTES", 1024)
    outbox = _outbox.Outbox.__new__(_outbox.Outbox)  # (only post's checks run: its link takes every record)
    posted: list[bytes] = []
    outbox.loop = asyncio.get_running_loop()
    outbox.post = lambda link, data, frames, urgent: (_outbox.check_fits(len(data)), posted.append(data))  # type: ignore[method-assign]
    windows = SenderWindows(outbox)
    window = windows.window(types.SimpleNamespace(address="ipc://peer"), 7)  # type: ignore[arg-type]
    window.inflight = PORT_WINDOW  # full: what is sent now is held back
    windows.send(window, b"first", [], 5)
    with pytest.raises(EncodeError, match="exceeds the 1024-byte payload"):
        windows.send(window, b"x" * 2048, [], 2048)
    windows.send(window, b"last", [], 4)
    assert [data for data, _, _ in window.backlog] == [b"first", b"last"] and windows.backlogged == 2
    windows.on_credit("ipc://peer", 7, PORT_WINDOW, 0)
    await asyncio.wait_for(windows.drain("ipc://peer", 7), 5)
    assert posted == [b"first", b"last"] and windows.backlogged == 0


async def test_a_retry_timer_of_a_loop_the_process_left_releases_nothing():
    """The backlog's retry timer was left on the loop the process stopped running; run again later (on another
    thread, say) while another loop drove the process, it released the backlog from that thread, touching the
    window beside the loop that owns it. It now does nothing; the loop driving the process offers the backlog."""
    import types

    from actors._transport._flow import SenderWindows

    left = asyncio.new_event_loop()
    outbox = FullOnce(left)
    windows = SenderWindows(outbox)  # type: ignore[arg-type]
    window = windows.window(types.SimpleNamespace(address="ipc://peer"), 7)  # type: ignore[arg-type]
    window.inflight = PORT_WINDOW
    windows.send(window, b"record", [], 6)
    windows.on_credit("ipc://peer", 7, PORT_WINDOW, 0)  # the link refuses: a retry timed on the loop left
    outbox.loop = asyncio.get_running_loop()  # another loop drives the process now
    try:
        await asyncio.to_thread(left.run_until_complete, asyncio.sleep(0.1))  # it runs again: its timer fires
        assert outbox.posted == [] and len(window.backlog) == 1, "released from a loop that does not drive"
    finally:
        left.close()
    await asyncio.wait_for(windows.drain("ipc://peer", 7), 5)  # the driving loop offers it
    assert outbox.posted == [b"record"]


async def test_drain_waits_given_up_leave_no_waiter_behind():
    """A producer that polls ``await wait_for(port.drain(), 0.1)`` while its receiver is stalled: each wait given
    up left its future in the window's list, which only an emptied backlog cleared (never, with that receiver)."""
    import types

    from actors._transport._flow import SenderWindows

    outbox = types.SimpleNamespace(loop=asyncio.get_running_loop(), post=lambda *args, **kw: None)
    windows = SenderWindows(outbox)  # type: ignore[arg-type]
    window = windows.window(types.SimpleNamespace(address="ipc://peer"), 7)  # type: ignore[arg-type]
    window.inflight = PORT_WINDOW  # full: the next record waits in the backlog, and no credit comes
    windows.send(window, b"record", [], 6)
    for _ in range(20):
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(windows.drain("ipc://peer", 7), 0.001)
    assert window.waiters == []
    assert await windows.drain_all(0.001) == 1 and window.waiters == []


async def test_a_calls_answer_is_queued_past_the_links_limits_and_anything_else_is_refused(tmp_path):
    """A link to a caller that reads nothing refuses more records (BufferFull); a call's reply was refused too, and
    its error reply, on the same full link, raised out of the endpoint's task: the call was never answered. The
    answer is owed (the caller's own calls bound how many): it is queued."""
    import zmq

    from actors import BufferFull
    from actors._transport._outbox import LINK_RECORDS, Outbox

    ctx = zmq.Context()
    outbox = Outbox(ctx, b"header", None, lambda *args: None, lambda: False)
    outbox.bind(asyncio.get_running_loop())
    try:
        link = outbox.link(f"ipc://{tmp_path}/nobody-reads")
        link.records = LINK_RECORDS  # (as if a million records waited for it)
        with pytest.raises(BufferFull, match="it is not reading"):
            outbox.post(link, b"a port message", [], False)
        outbox.post(link, b"a reply", [], False, owed=True)
        assert not link.parts, "queued, and handed to the socket with the batch"
    finally:
        outbox.close(0)
        ctx.term()


async def test_a_batch_never_outgrows_the_payload_its_receiver_accepts(tmp_path, monkeypatch):
    """A peer that reads nothing: records pile up in one batch. The link's limit counts records and bytes before
    each one (and owed answers pass it), so the batch could outgrow the payload a receiver accepts, which drops it
    whole, every record in it lost. A record that would push it past waits for the batch to leave, or is refused;
    an owed one is queued; one that could never fit is an EncodeError."""
    import zmq

    from actors import BufferFull, EncodeError
    from actors._transport import _outbox
    from actors._transport._outbox import Outbox
    from actors._transport._sockets import Link
    from actors._wire._codec import Decoder

    limit = 4096
    monkeypatch.setattr(_outbox, "MAX_PAYLOAD_BYTES", limit)
    monkeypatch.setattr(Link, "try_send", lambda self, header: not (self.parts or self.sealed))  # (stays full)
    ctx = zmq.Context()
    outbox = Outbox(ctx, b"header", None, lambda *args: None, lambda: False)
    outbox.bind(asyncio.get_running_loop())
    try:
        link = outbox.link(f"ipc://{tmp_path}/nobody-reads")
        with pytest.raises(BufferFull, match="in one batch"):
            for _ in range(100):
                outbox.post(link, b"r" * 100, [], False)
        assert link.inline == sum(len(part) for part in link.parts) <= limit
        assert len(list(Decoder(max_payload=limit).decode_batch(b"".join(link.parts), []))) == link.records
        with pytest.raises(EncodeError, match="exceeds the 4096-byte payload"):
            outbox.post(link, b"x" * limit, [], False, owed=True)
        waiting = link.records
        outbox.post(link, b"a reply", [], False, owed=True)  # (owed: queued past the limit, in a batch of its own)
        ((sealed, _, _, records),) = link.sealed
        assert records == waiting and len(link.parts) == 1 and link.parts[0].endswith(b"a reply")
        for batch in (
            sealed,
            link.parts,
        ):  # (before, the reply joined the full batch, which its receiver dropped whole)
            assert sum(len(part) for part in batch) <= limit
            assert len(list(Decoder(max_payload=limit).decode_batch(b"".join(batch), []))) == len(batch)
        assert link.records == waiting + 1
    finally:
        outbox.close(0)
        ctx.term()


def test_a_sealed_batch_leaves_whole_before_the_one_built_after_it(tmp_path):
    import zmq

    from actors._transport._sockets import Link

    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.bind(f"ipc://{tmp_path}/peer")
    link = Link(ctx, f"ipc://{tmp_path}/peer")
    try:
        link.append(b"first", [])
        link.append(b"second", [b"frame"])
        link.seal()
        link.append(b"third", [])
        assert link.records == 3 and link.nbytes == len(b"firstsecondframethird")
        assert link.try_send(b"header")
        assert link.records == link.nbytes == link.inline == 0 and not link.sealed and link.batches == 2
        first = inbox.recv_multipart(copy=True)
        second = inbox.recv_multipart(copy=True)
        assert first[0] == b"header" and first[1].endswith(b"second") and first[2] == b"frame" and len(first) == 3
        assert second[0] == b"header" and second[1].endswith(b"third") and len(second) == 2
    finally:
        link.close(0)
        inbox.close(0)
        ctx.term()


def test_an_invocation_answers_as_an_owed_record():
    import types

    from actors._hosting._invocation import Invocation
    from actors._wire._records import Call

    sent: list[tuple[bool, bool]] = []
    peer = types.SimpleNamespace(dead=False, remote=False, pid=1)
    rt = types.SimpleNamespace(
        registry=types.SimpleNamespace(proc=lambda address, pid: peer),
        send=lambda ref, record, urgent, owed=False: sent.append((record.ok, owed)),
    )
    Invocation(Call(7, "a", "m", "ipc://caller", 1, 0, b"", None), []).reply(rt, True, 1)  # type: ignore[arg-type]
    assert sent == [(True, True)]


def test_a_credit_is_sent_as_an_owed_record():
    """A port's credit gives its sender its window back: the sender's own window bounds how many are due, as a
    call's replies. Sent as an ordinary record, a full link refused it (BufferFull): a received value was lost
    with the raise, a closing receiver's senders never got their window back and stalled for good."""
    import types

    from actors._runtime._core import Runtime
    from actors._wire._records import Credit, Header

    sent: list[tuple[object, bool]] = []
    peer = types.SimpleNamespace(dead=False, pid=7)
    rt = types.SimpleNamespace(
        registry=types.SimpleNamespace(procs={"ipc://sender": peer}),
        send=lambda ref, record, urgent, owed=False: sent.append((record, owed)),
    )
    Runtime._credit(rt, Header("ipc://sender", 7), 3, 1, 100)  # type: ignore[arg-type]
    assert sent == [(Credit(3, 1, 100), True)]


async def test_a_batch_whose_retry_a_loop_hand_over_cancelled_is_retried_on_the_next_loop(tmp_path, monkeypatch):
    """Unbinding the outbox (the runtime's loop ending or handing over) cancels the retries of batches a full
    queue refused; binding it to the next loop arranged them only for links that still had one: none."""
    import zmq

    from actors._transport._outbox import Outbox
    from actors._transport._sockets import Link

    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    address = f"ipc://{tmp_path}/peer.sock"
    pull.bind(address)
    refusing = [True]
    real = Link.try_send
    monkeypatch.setattr(Link, "try_send", lambda link, header: False if refusing[0] else real(link, header))
    outbox = Outbox(ctx, b"header", None, lambda *args: None, lambda: False)
    try:
        loop = asyncio.get_running_loop()
        outbox.bind(loop)
        link = outbox.link(address)
        outbox.post(link, b"record", [], True)  # the peer's queue is full: a retry is arranged
        assert link.retry is not None
        outbox.bind(None)
        outbox.bind(loop)
        refusing[0] = False
        assert await asyncio.to_thread(pull.poll, 5000), "the batch was retried on the new loop"
        header, payload = pull.recv_multipart()
        assert header == b"header" and payload.endswith(b"record")
    finally:
        for link in outbox.links.values():
            if link.retry is not None:
                link.retry.cancel()
            link.sock.close(linger=0)
        pull.close(linger=0)


def test_without_a_loop_a_full_queue_blocks_a_send_but_never_the_handling_of_received_records(tmp_path, monkeypatch):
    """Handling received records (a credit for a closed port, news of a death) must not wait up to a minute for a
    full peer: the batch stays for the next wait's pump to retry. The flag saying so was never set."""
    import zmq

    from actors._transport._outbox import Outbox
    from actors._transport._sockets import Link

    monkeypatch.setattr(Link, "try_send", lambda link, header: False)  # the peer's queue stays full
    dispatching = [True]
    blocked: list[str] = []
    ctx = zmq.Context()
    outbox = Outbox(ctx, b"header", None, lambda *args: blocked.append(args[3]), lambda: dispatching[0])
    try:
        link = outbox.link(f"ipc://{tmp_path}/peer.sock")
        outbox.post(link, b"credit", [], True)
        assert blocked == [] and link.records == 1, "kept for later, not waited for"
        dispatching[0] = False
        outbox.post(link, b"call", [], True)
        assert len(blocked) == 1 and "room in the queue" in blocked[0], "a sender's own post waits (its deadline)"
    finally:
        for each in outbox.links.values():
            each.sock.close(linger=0)


def test_without_a_loop_a_send_that_gives_up_is_taken_back_and_refused(tmp_path, monkeypatch):
    """A caller without a loop waits up to SEND_TIMEOUT for a full peer; then it got CallTimeout while its record
    stayed in the batch, to arrive later (a caller that retried sent it twice). The record is taken back out (what
    was queued before and after it stays) and the caller gets BufferFull: nothing was sent."""
    import zmq

    from actors import BufferFull, CallTimeout
    from actors._transport._outbox import Outbox
    from actors._transport._sockets import Link

    monkeypatch.setattr(Link, "try_send", lambda link, header: False)  # the peer's queue stays full
    dispatching = [True]
    ctx = zmq.Context()

    def block(condition, sock, timeout, what):
        dispatching[0] = True  # (records handled meanwhile queue after it, without waiting)
        outbox.post(link, b"a credit queued meanwhile", [], True)
        dispatching[0] = False
        raise CallTimeout(f"gave up after {timeout:.1f}s waiting for {what}")

    outbox = Outbox(ctx, b"header", None, block, lambda: dispatching[0])
    try:
        link = outbox.link(f"ipc://{tmp_path}/peer.sock")
        outbox.post(link, b"queued before", [memoryview(b"frame-0")], True)
        dispatching[0] = False
        with pytest.raises(BufferFull, match="the record was not sent"):
            outbox.post(link, b"given up", [memoryview(b"frame-1"), memoryview(b"frame-22")], True)
        assert [part[-len(b"queued before") :] for part in link.parts[:1]] == [b"queued before"]
        assert link.parts[1].endswith(b"a credit queued meanwhile") and len(link.parts) == 2
        assert [bytes(frame) for frame in link.frames] == [b"frame-0"]
        assert link.records == 2 and link.nbytes == len(b"queued before") + 7 + len(b"a credit queued meanwhile")
    finally:
        for each in outbox.links.values():
            each.sock.close(linger=0)
        ctx.term()


class _FakeSocket:
    """A PUSH socket whose peer's queue is full while ``full`` says so; what it takes goes to ``sent``."""

    def __init__(self) -> None:
        self.full = True
        self.sent: list[bytes] = []

    def send(self, data: object, flags: int = 0, copy: bool = True) -> None:
        import zmq

        if self.full and flags & zmq.NOBLOCK:
            raise zmq.Again()
        self.sent.append(bytes(data))  # type: ignore[call-overload]

    def close(self, linger: int | None = None) -> None:
        pass

    def setsockopt(self, *args: object) -> None:
        pass


def test_without_a_loop_a_record_that_left_while_its_post_waited_is_not_taken_back(tmp_path):
    """A caller blocked on a full peer serves its inbox; a record handled meanwhile (a credit) finds room and takes
    the batch with the caller's record in it, then the next one finds the queue full again and the caller's wait
    times out. The caller's record left: it must not be refused as unsent, nor the later record taken back in its
    place (before, BufferFull told the caller its sent record was not sent, and the later one lost its part but
    left its frame in the batch, to be paired with the next record's tensors)."""
    import zmq

    from actors import ActorDied, CallTimeout
    from actors._transport._outbox import Outbox

    dispatching = [False]
    ctx = zmq.Context()
    fake = _FakeSocket()

    def block(condition: object, sock: object, timeout: float, what: str) -> None:
        dispatching[0] = True  # the inbox is served meanwhile
        fake.full = False
        outbox.post(link, b"credit", [], True)  # room: the batch leaves, the caller's record with it
        fake.full = True
        outbox.post(link, b"nested", [memoryview(b"its-frame")], True)  # full again: kept for later
        dispatching[0] = False
        raise CallTimeout(f"gave up after {timeout:.1f}s waiting for {what}")

    outbox = Outbox(ctx, b"header", None, block, lambda: dispatching[0])
    try:
        link = outbox.link(f"ipc://{tmp_path}/peer.sock")
        link.sock.close(linger=0)
        link.sock = fake  # type: ignore[assignment]
        outbox.post(link, b"ours", [], True)  # returns: its record left
        [payload] = [data for data in fake.sent if b"ours" in data]  # (one batch: the header, then its payload)
        assert payload.endswith(b"credit") and b"nested" not in payload
        assert len(link.parts) == 1 and link.parts[0].endswith(b"nested")
        assert [bytes(frame) for frame in link.frames] == [b"its-frame"] and link.records == 1
        outbox.drop(link.address)
        with pytest.raises(ActorDied, match="has exited"):  # (before: lost without a word, or a raw ZMQError)
            outbox.post(link, b"to a dropped link", [], True)
    finally:
        for each in outbox.links.values():
            each.sock.close(linger=0)
        ctx.term()


def test_a_link_that_fails_to_flush_leaves_the_others_flushed_and_closing_says_what_was_never_sent(
    tmp_path, monkeypatch, caplog
):
    """End of a loop turn: one link's socket error must not leave the links behind it marked as scheduled, and so
    never flushed again by a turn's end (before, they waited for an urgent record); and a close that drops records a
    full peer never took says how many (before: nothing was logged)."""
    import logging

    import zmq

    from actors._transport._outbox import Outbox

    class Loop:
        def call_soon(self, callback: object) -> None:
            pass

    ctx = zmq.Context()
    outbox = Outbox(ctx, b"header", None, lambda *args: None, lambda: False)
    outbox.loop = Loop()  # type: ignore[assignment]
    broken, fine = _FakeSocket(), _FakeSocket()
    fine.full = False

    def fails(data: object, flags: int = 0, copy: bool = True) -> None:
        raise zmq.ZMQError(zmq.EHOSTUNREACH)

    broken.send = fails  # type: ignore[method-assign]
    try:
        first, second = outbox.link(f"ipc://{tmp_path}/a.sock"), outbox.link(f"ipc://{tmp_path}/b.sock")
        for link, sock in ((first, broken), (second, fine)):
            link.sock.close(linger=0)
            link.sock = sock  # type: ignore[assignment]
            outbox.post(link, b"record", [], False)
        with caplog.at_level(logging.ERROR, logger="actors"):
            outbox._flush_dirty()
        assert "could not deliver" in caplog.text
        assert any(b"record" in data for data in fine.sent) and not first.scheduled and not second.scheduled
        outbox.post(first, b"another", [], False)
        assert outbox._dirty == [first], "its next record schedules a flush again"
        broken.full = True
        with caplog.at_level(logging.WARNING, logger="actors"):
            outbox.close(0)
        assert f"2 record(s) for {first.address} were never sent" in caplog.text
    finally:
        ctx.term()
