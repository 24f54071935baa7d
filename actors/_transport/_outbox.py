"""Outbound records: one batched link per peer, and never a wait on the event loop's thread.

A record is queued on its peer's :class:`~actors._transport._sockets.Link` and leaves
with the rest of the batch at the end of the current loop turn (at once
when it is urgent, when the batch is large, or when no loop drives this
process). A peer whose socket queue is full keeps the batch:

* on an event loop, the send is retried on a timer while the loop runs on;
* a caller without a loop (synchronous code) blocks, serving its inbox,
  until the batch leaves or :data:`SEND_TIMEOUT` passes; then its record is
  taken back out of the batch and it gets :class:`~actors.BufferFull`
  (nothing sent, so nothing arrives late).

A link holding more than :data:`LINK_RECORDS` records or
:data:`LINK_BYTES` bytes refuses more with :class:`~actors.BufferFull`:
nothing is queued without limit and nothing is dropped quietly. A batch
never outgrows the payload a receiver accepts (``MAX_PAYLOAD_BYTES``: one
past it is dropped whole there): a record that would make it do so waits for
the batch to leave, or is refused; one that could never fit is an
:class:`~actors.EncodeError`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import zmq

from .._shared._errors import ActorDied, BufferFull, CallTimeout, EncodeError
from .._wire._codec import MAX_PAYLOAD_BYTES
from .._wire._records import record_prefix
from ._sockets import FLUSH_BYTES, FLUSH_RECORDS, Link, frame_size

__all__ = ["LINK_BYTES", "LINK_RECORDS", "SEND_TIMEOUT", "Outbox", "check_fits"]

log = logging.getLogger("actors")

#: Records and bytes one link may hold before new ones are refused with BufferFull.
LINK_RECORDS = 1_000_000
LINK_BYTES = 1 << 30
#: The most a record's framing adds to its bytes in a batch (two msgpack uints).
PREFIX_MAX = 18
#: How long a caller without an event loop waits for a full peer queue.
SEND_TIMEOUT = 60.0
#: Retry delays (s) for a batch a full peer queue refused.
RETRY_FIRST, RETRY_MAX = 0.001, 0.02

#: ``block(condition, socket, timeout, what)``: wait, serving the inbox, until ``condition()``.
Blocker = Callable[[Callable[[], bool], "zmq.Socket[Any]", float, str], None]


def check_fits(size: int) -> None:
    """Refuse (:class:`~actors.EncodeError`) a record of ``size`` bytes that no batch could carry: a receiver drops
    a payload past ``MAX_PAYLOAD_BYTES`` whole."""
    if size + PREFIX_MAX > MAX_PAYLOAD_BYTES:
        raise EncodeError(
            f"a message of {size} bytes exceeds the {MAX_PAYLOAD_BYTES}-byte payload a receiver accepts: send "
            "large bytes as tensors (they travel as buffer frames) or in parts"
        )


class Outbox:
    """This process's links to its peers and the policy for flushing them."""

    def __init__(
        self,
        ctx: zmq.Context[Any],
        header: bytes,
        keys: tuple[bytes, bytes] | None,
        block: Blocker,
        dispatching: Callable[[], bool],
    ) -> None:
        self._ctx = ctx
        self._header = header
        self._keys = keys
        self._block = block
        #: Whether this process is handling received records now (never block then: the records a full queue
        #: refused stay in their batch, retried by the next wait's pump).
        self._dispatching = dispatching
        self.links: dict[str, Link] = {}
        self.loop: asyncio.AbstractEventLoop | None = None  # set while an event loop drives this process
        self._dirty: list[Link] = []
        self._flush_scheduled = False

    def link(self, address: str) -> Link:
        link = self.links.get(address)
        if link is None:
            link = self.links[address] = Link(self._ctx, address, self._keys)
        return link

    def check_room(self, link: Link, size: int = 0) -> None:
        """Raise :class:`BufferFull` if ``link`` takes no more records (its peer is not reading), or, ``size``
        given, if records of ``size`` bytes in all would not join its batch now (one past the payload a receiver
        accepts must leave first: it is handed to the socket here if it can be)."""
        if link.records >= LINK_RECORDS or link.nbytes >= LINK_BYTES:
            raise BufferFull(
                f"{link.records} records ({link.nbytes >> 20} MiB) wait for {link.address}, whose queue stays "
                "full: it is not reading"
            )
        if size and link.inline + size + PREFIX_MAX > MAX_PAYLOAD_BYTES:
            self._make_payload_room(link, size, False)

    def post(self, link: Link, data: bytes, frames: list[Any], urgent: bool, *, owed: bool = False) -> None:
        """Queue one encoded record on ``link``; it leaves now or at the end of this loop turn.

        ``owed``: an answer the peer asked for (a call's reply) is queued past the limits: the peer's own
        calls bound how many it is owed, and refusing it would leave that call unanswered for good.
        """
        if link.dead:  # dropped since the caller looked it up (its peer died while a wait served the inbox)
            raise ActorDied(f"the process at {link.address} has exited")
        if not owed:
            self.check_room(link)
        if link.inline + len(data) + PREFIX_MAX > MAX_PAYLOAD_BYTES:
            self._make_payload_room(link, len(data), owed)
        part, frame = len(link.parts), len(link.frames)  # where this record goes in the batch
        if frames:
            link.append(data, frames)
        else:  # Link.append, inlined for the common record without buffer frames
            encoded = record_prefix(0, len(data)) + data
            link.parts.append(encoded)
            link.inline += len(encoded)
            link.nbytes += len(data)
            link.records += 1
        loop = self.loop
        if loop is None or urgent or link.nbytes >= FLUSH_BYTES or link.records >= FLUSH_RECORDS:
            batch = link.parts
            try:
                self.flush(link)
            except CallTimeout:  # (no loop: the peer's queue stayed full past SEND_TIMEOUT)
                if link.parts is not batch:
                    # Its batch left during the wait (a record handled meanwhile found room), or was sealed to
                    # leave whole (an owed record started the next): it is on its way. What waits in the batch
                    # built now was queued after it, and is not the caller's to take back.
                    return
                link.take_back(part, frame, len(frames), len(data) + sum(frame_size(f) for f in frames))
                raise BufferFull(
                    f"{link.address} took nothing for {SEND_TIMEOUT:g}s (its queue stayed full): the record was not "
                    "sent"
                ) from None
        elif not link.scheduled and link.retry is None:
            link.scheduled = True
            self._dirty.append(link)
            if not self._flush_scheduled:
                self._flush_scheduled = True
                loop.call_soon(self._flush_dirty)

    def _make_payload_room(self, link: Link, size: int, owed: bool) -> None:
        """A record of ``size`` bytes would push ``link``'s batch past the payload a receiver accepts: the batch
        leaves first; if the peer's queue refuses it, the record is refused (:class:`BufferFull`), unless it is
        owed: the batch is sealed to leave whole and the record starts the next (refusing it would leave its call
        unanswered, and adding it would make the receiver drop the batch). One that could never fit is an
        :class:`EncodeError`."""
        check_fits(size)
        if (link.parts or link.sealed) and not link.try_send(self._header):
            if not owed:
                raise BufferFull(
                    f"{link.inline >> 20} MiB wait for {link.address} in one batch, whose queue stays full: it is "
                    "not reading"
                )
            link.seal()

    def _flush_dirty(self) -> None:
        self._flush_scheduled = False
        dirty, self._dirty = self._dirty, []
        for link in dirty:  # all unmarked first: one link's failure must not leave the others marked, never flushed
            link.scheduled = False
        for link in dirty:
            if not link.dead:
                try:
                    self.flush(link)
                except Exception:  # (a socket error of this link's: the others still go)
                    log.exception("could not deliver queued records to %s", link.address)

    def flush(self, link: Link) -> None:
        """Hand ``link``'s batch to its socket; if the peer's queue is full, retry without blocking a loop."""
        if link.retry is not None or link.try_send(self._header):
            return  # a retry is already arranged (keeps order), or it left
        loop = self.loop
        if loop is not None:
            link.retry = loop.call_later(RETRY_FIRST, self._retry, link, RETRY_FIRST)
        elif not self._dispatching():
            self._block(
                lambda: link.dead or link.try_send(self._header),
                link.sock,
                SEND_TIMEOUT,
                f"room in the queue of {link.address}",
            )

    def _retry(self, link: Link, delay: float) -> None:
        link.retry = None
        if link.dead or link.try_send(self._header):
            return
        loop = self.loop
        if loop is not None:
            delay = min(delay * 2, RETRY_MAX)
            link.retry = loop.call_later(delay, self._retry, link, delay)

    def retry_stuck(self) -> None:
        """Try again every batch a full queue refused (a synchronous caller's pump calls this)."""
        for link in list(self.links.values()):
            if (link.parts or link.sealed) and not link.dead and link.try_send(self._header) and link.retry is not None:
                link.retry.cancel()
                link.retry = None

    def flush_all(self) -> None:
        for link in list(self.links.values()):
            if not link.dead:
                try:
                    self.flush(link)
                except Exception:
                    log.exception("could not deliver queued records to %s", link.address)

    def bind(self, loop: asyncio.AbstractEventLoop | None) -> None:
        """Follow ``loop`` (None: no loop drives this process now); pending retries move with it."""
        self.loop = loop
        for link in self.links.values():
            if link.retry is not None:
                link.retry.cancel()
                link.retry = None
            # (a batch refused while no loop ran, or whose retry the last unbinding cancelled, is retried too)
            if loop is not None and (link.parts or link.sealed) and not link.dead:
                link.retry = loop.call_later(RETRY_FIRST, self._retry, link, RETRY_FIRST)
        dirty, self._dirty = self._dirty, []
        self._flush_scheduled = False
        for link in dirty:
            link.scheduled = False
            if not link.dead and link.retry is None and not link.try_send(self._header) and loop is not None:
                link.retry = loop.call_later(RETRY_FIRST, self._retry, link, RETRY_FIRST)

    def drop(self, address: str) -> None:
        """The peer is gone: its link and whatever waited in it are discarded."""
        link = self.links.pop(address, None)
        if link is not None:
            link.dead = True
            link.close(linger=0)

    def close(self, linger_ms: int) -> None:
        for link in self.links.values():
            if link.records:  # a peer whose queue stayed full to the end: what it never took is lost, and said so
                log.warning(
                    "%d record(s) for %s were never sent: its queue stayed full until this process closed",
                    link.records,
                    link.address,
                )
            link.dead = True
            link.close(linger=linger_ms)
        self.links.clear()
