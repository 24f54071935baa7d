"""The receiving side of ports: each open port's queue, who holds its senders, and the credit it owes.

A :class:`ReceiverState` lives in the process that opened the port. It
queues delivered values, wakes the tasks waiting in ``recv``, knows
which other processes hold a sender (so "every sender is gone" is
observable), and counts consumption per sender for flow-control credit.
:class:`Receivers` is the process's table of them, and handles the
``PortMessage`` and ``Attach`` records addressed to them.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from collections.abc import Callable
from typing import Any

from .._shared._liveness import ProcRef
from .._shared._loops import wake_all
from .._wire._codec import WholeBatch
from .._wire._records import Attach, Header, Kind, PortMessage

__all__ = ["ReceiverState", "Receivers"]


class ReceiverState:
    """What the owning process keeps for one open port."""

    __slots__ = ("attached", "closed", "holders", "once", "pending", "port_id", "queue", "unacked", "waiters")

    def __init__(self, port_id: int, once: bool) -> None:
        self.port_id = port_id
        #: (value, who sent it (None: this process), its bytes), oldest first.
        self.queue: deque[tuple[Any, Header | None, int]] = deque()
        #: The ``recv()``s waiting for the queue to fill, oldest first (woken ones leave it; a cancelled one removes itself).
        self.waiters: list[asyncio.Future[None]] = []
        #: Who holds a sender: a process of this host by its pid, one of another host by its address.
        self.holders: set[int | str] = set()
        #: Processes sent a sender whose pid is not known yet (a restarted one starting): holders to come.
        self.pending = 0
        self.attached = False
        self.closed: str | None = None
        self.once = once
        #: Per sender (its address and pid: a process restarted at the address is another sender, whose window
        #: the old one's messages never took): [messages, bytes] consumed and not yet credited back.
        self.unacked: dict[Header, list[int]] = {}

    def deliver(self, value: Any, sender: Header | None, size: int) -> None:
        if self.closed is not None and self.once:
            return
        self.queue.append((value, sender, size))
        self.wake()

    def attach(self, holder: int | str, alive: bool) -> None:
        """Process ``holder`` (a pid, or another host's address) holds a sender now (``alive``: it is watched)."""
        self.attached = True
        if alive:
            self.holders.add(holder)
        else:
            self.wake()

    def holder_died(self, holder: int | str) -> None:
        if holder in self.holders:
            self.holders.discard(holder)
            if not self.holders:
                self.wake()

    def senders_gone(self) -> bool:
        return self.attached and not self.holders and not self.pending

    def wake(self) -> None:
        """Wake every waiting ``recv()``: each looks at the queue again, in the order they came."""
        wake_all(self.waiters)


class Receivers:
    """Every port receiver open in this process, by port id."""

    def __init__(
        self,
        own_pid: int,
        watch: Callable[[int], bool],
        credit: Callable[[Header, int, int, int], None],
        drops: Callable[..., None],
        proc: Callable[[str, int], ProcRef],
    ) -> None:
        self._own_pid = own_pid
        self._watch = watch
        self._proc = proc  # the process at an address (the registry's): who an Attach names
        self._credit = credit
        self._drops = drops
        self._states: dict[int, ReceiverState] = {}
        self._ids = itertools.count(1)

    def open(self, once: bool) -> ReceiverState:
        state = ReceiverState(next(self._ids), once)
        self._states[state.port_id] = state
        return state

    def get(self, port_id: int) -> ReceiverState | None:
        return self._states.get(port_id)

    def close(self, state: ReceiverState, reason: str) -> None:
        """Stop receiving: the messages still queued are dropped, and every sender gets back the credit its
        queued and consumed messages took (else a sender whose window they fill waits for it forever)."""
        state.closed = reason
        self._states.pop(state.port_id, None)
        owed = state.unacked
        state.unacked = {}
        for _value, sender, size in state.queue:
            if sender is not None:
                counts = owed.setdefault(sender, [0, 0])
                counts[0] += 1
                counts[1] += size
        state.queue.clear()
        if not state.once:  # (a once-port's one message was its sender's last: no window waits on it)
            for sender, (messages, nbytes) in owed.items():
                if messages:
                    self._credit(sender, state.port_id, messages, nbytes)
        state.wake()

    def credit(self, state: ReceiverState, sender: Header, counts: list[int]) -> None:
        """Give ``sender`` back the window its consumed messages took (``counts``: [messages, bytes])."""
        self._credit(sender, state.port_id, counts[0], counts[1])
        counts[0] = counts[1] = 0

    def attach(self, state: ReceiverState, holder: ProcRef, pid: int | None = None) -> None:
        """``holder`` holds a sender of ``state``'s port: watched by its pid on this host (``pid``, the one the
        news names, else the one known: a process restarted at the address has a new one); on another host, where
        its pid names no process of this one, by its address, until news of its death comes."""
        if holder.remote:
            state.attach(holder.address, not holder.dead)
            return
        pid = pid if pid is not None else holder.pid
        if pid is not None and pid != self._own_pid:
            state.attach(pid, self._watch(pid))

    def on_port_message(self, fields: list[Any], frames: list[Any], sender: Header, size: int) -> None:
        """An undecoded ``[PORT, port_id, value]`` record: the hot path, so checked here in place."""
        if len(fields) != 3 or type(fields[1]) is not int:
            PortMessage.checked(fields)  # raises DecodeError saying what is wrong
        port_id = fields[1]
        state = self._states.get(port_id)
        if state is None:
            self._drops("a message for port %r: no such receiver in this process", port_id)
            self._credit(sender, port_id, 1, size)  # its window credit still goes back
            return
        if state.closed is not None and state.once:
            return
        state.queue.append((fields[2], sender, size))
        if state.waiters:
            state.wake()

    def deliver_run(self, batch: WholeBatch, j: int, sender: Header) -> int:
        """Queue the run of well-formed PORT records to one open port starting at entry ``j`` of ``batch``.

        Returns the entry after the run (``j`` itself if the record there is
        not for an open port: the caller handles it alone). The receiver is
        woken once, at the end of the run.
        """
        frame_counts, sizes, records, _ = batch
        fields = records[j]
        state = self._states.get(fields[1]) if type(fields[1]) is int else None
        if state is None or state.closed is not None:
            return j
        port_id, queue, end = fields[1], state.queue, len(records)
        while j < end:
            fields, size = records[j], sizes[j]
            if (
                type(fields) is not list
                or len(fields) != 3
                or type(fields[0]) is not int  # (a decoded tensor compares elementwise)
                or fields[0] != Kind.PORT
                or type(fields[1]) is not int
                or fields[1] != port_id
                or type(frame_counts[j]) is not int  # (the framing is msgpack too: a tensor would compare elementwise)
                or frame_counts[j]
                or type(size) is not int
            ):
                break
            queue.append((fields[2], sender, size))
            j += 1
        if state.waiters:
            state.wake()
        return j

    def on_attach(self, record: Attach, frames: list[Any], sender: Header, size: int) -> None:
        state = self._states.get(record.port_id)
        if state is not None:
            self.attach(state, self._proc(record.address, record.pid), record.pid)

    def holder_died(self, holder: int | str) -> None:
        """Process ``holder`` (a pid of this host, an address of another) is gone."""
        for state in list(self._states.values()):
            state.holder_died(holder)
