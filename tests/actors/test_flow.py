"""Lossless flow under a slow receiver: a million messages, complete, in order, bounded memory."""

from __future__ import annotations

import asyncio
import time

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
