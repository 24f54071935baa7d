"""The inbox pump: read the process's PULL socket, check each sender, decode batches, dispatch records.

A message whose header is malformed or names an address outside this
session is dropped whole; a record that cannot be decoded is dropped
alone. Every drop is logged (at most :data:`DROP_LOG_BURST` lines per
:data:`DROP_LOG_WINDOW` seconds, then a count) and counted; the process
goes on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import zmq

from .._shared._errors import DecodeError
from .._shared._hooks import Hook
from .._shared._session import valid_peer_address
from .._wire._codec import Decoder, WholeBatch
from .._wire._records import RECORDS, Header, Kind, decode_record

__all__ = ["DropLog", "Inbox"]

log = logging.getLogger("actors")

#: Dropped-message logs: at most this many per window, then one summary line.
DROP_LOG_BURST = 10
DROP_LOG_WINDOW = 10.0

_EVENTS, _POLLIN = zmq.EVENTS, zmq.POLLIN

#: ``handler(record, its buffer frames, sender, size in bytes)``.
Handler = Callable[[Any, list[Any], Header, int], None]
#: Delivers the run of PORT records for one port starting at entry ``j`` of a batch; the entry after the run.
PortRun = Callable[[WholeBatch, int, Header], int]


class DropLog:
    """Counts dropped messages and logs them without letting a flood fill the log."""

    def __init__(self) -> None:
        self.count = 0
        self._window = 0.0
        self._logged = 0
        self._suppressed = 0

    def __call__(self, what: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self._window >= DROP_LOG_WINDOW:
            if self._suppressed:
                log.error("... and %d more dropped messages in the last %.0fs", self._suppressed, DROP_LOG_WINDOW)
            self._window, self._logged, self._suppressed = now, 0, 0
        self.count += 1
        if self._logged < DROP_LOG_BURST:
            self._logged += 1
            log.error("dropped " + what, *args)
        else:
            self._suppressed += 1


class Inbox:
    """The process's one inbox socket and the table that routes each record kind to its handler."""

    def __init__(
        self,
        sock: zmq.Socket[Any],
        session_dir: str,
        own_address: str,
        learn_sender: Callable[[Header], None],
        drops: DropLog,
        authenticated: bool = False,
    ) -> None:
        self.sock = sock
        #: A CURVE inbox: every sender holds the session key (see ``valid_peer_address``).
        self._authenticated = authenticated
        self.decoder = Decoder()
        self._session_dir = session_dir
        self._own_address = own_address
        self._learn_sender = learn_sender
        self._drops = drops
        self._routes: dict[Any, tuple[Callable[[Any], Any] | None, Handler]] = {}  # kind -> (decode, handler)
        self.dispatching = False
        self._pumping = False  # (a pump called from within one returns at once)
        #: After each message is handled (wakes code waiting for "some progress").
        self.handled: Hook[[]] = Hook("handled messages")
        self._senders: dict[bytes, Header] = {}  # raw header -> checked header
        self._port_run: PortRun | None = None

    def on(
        self,
        record_type: type,
        handler: Handler,
        *,
        raw: bool = False,
        run: PortRun | None = None,
    ) -> None:
        """Route every record of ``record_type`` (one of ``_wire.RECORDS``) to ``handler``.

        The handler gets ``record_type.from_wire(fields)``; with ``raw``, the
        undecoded fields list, which it checks itself. ``run`` (PORT records
        only) takes whole runs of them from a batch decoded in one pass.
        """
        kind = next(kind for kind, known in RECORDS.items() if known is record_type)
        self._routes[kind] = (None if raw else record_type.from_wire, handler)  # type: ignore[attr-defined]
        if run is not None:
            self._port_run = run

    def pump(self, limit: int | None = None) -> bool:
        """Handle waiting messages (at most ``limit``); True when the socket is empty.

        Called again while it handles a message (a handler's side effect, such
        as news of a sender's exit), it returns at once: the outer call reads
        the rest, in order.
        """
        if self._pumping:
            return False
        self._pumping = True
        try:
            return self._pump(limit)
        finally:
            self._pumping = False

    def _pump(self, limit: int | None) -> bool:
        count = 0
        sock = self.sock
        handled = self.handled
        while int(sock.getsockopt(_EVENTS)) & _POLLIN:  # (cheaper than meeting zmq.Again at the end)
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return True
            try:
                self._handle(frames)
            except Exception:  # one bad message must not stall the ones behind it
                log.exception("error while handling a message")
            count += 1
            if handled:
                handled()
            if limit is not None and count >= limit:
                return False
        return True

    def _sender(self, raw: bytes) -> Header:
        header = self._senders.get(raw)
        if header is None:
            header = Header.decode(raw)
            if not valid_peer_address(header.address, self._session_dir, self._authenticated):
                raise DecodeError(f"sender address {header.address!r:.80} is not a peer of this session")
            if len(self._senders) > 4096:
                self._senders.clear()
            self._senders[raw] = header
            if header.address != self._own_address:
                self._learn_sender(header)
        return header

    def _dispatch_all(self, batch: WholeBatch, sender: Header) -> None:
        """Dispatch a batch decoded in one pass.

        Runs of port messages go to the port handler's run delivery in one
        call (the hot path); every other record is dispatched alone.
        """
        routes = self._routes
        no_frames: list[Any] = []
        port_run = self._port_run
        frame_counts, sizes, records, _ = batch
        end = len(records)
        j = 0
        while j < end:
            fields = records[j]
            if (
                port_run is not None
                and type(fields) is list
                and len(fields) == 3
                and type(fields[0]) is int  # (a decoded tensor compares elementwise)
                and fields[0] == Kind.PORT
            ):
                after = port_run(batch, j, sender)
                if after > j:
                    j = after
                    continue
            size = sizes[j]
            try:
                count = frame_counts[j]
                if type(count) is not int or count or type(size) is not int:
                    raise DecodeError("malformed batch framing")
                route = routes.get(fields[0]) if type(fields) is list and fields and type(fields[0]) is int else None
                if route is None:
                    decode_record(fields)  # raises: what is wrong with it
                    raise DecodeError(f"no handler for {fields[0]} records in this process")
                decode, handler = route
                handler(fields if decode is None else decode(fields), no_frames, sender, size)
            except DecodeError as exc:
                self._drops("a malformed message from %s: %s", sender.address, exc)
            except Exception:
                log.exception("error while handling a message from %s", sender.address)
            j += 1

    def _handle(self, frames: list[Any]) -> None:
        if len(frames) < 2:
            self._drops("a malformed message: %d frame(s), need at least 2", len(frames))
            return
        try:
            sender = self._sender(frames[0].bytes)
        except DecodeError as exc:
            self._drops("a message with a malformed header: %s", exc)
            return
        routes = self._routes
        self.dispatching = True
        payload = frames[1].buffer
        if len(frames) == 2:  # no buffer frames: the whole batch in one pass, as far as it is clean
            batch = self.decoder.decode_whole(payload)
            if batch is not None:
                try:
                    self._dispatch_all(batch, sender)
                except BaseException:
                    self.dispatching = False
                    raise
                if batch.rest == payload.nbytes:
                    self.dispatching = False
                    return
                payload = payload[batch.rest :]  # the rest record by record, from the first that failed
        try:
            for fields, run, size in self.decoder.decode_batch(payload, frames[2:]):
                try:
                    route = (
                        routes.get(fields[0]) if type(fields) is list and fields and type(fields[0]) is int else None
                    )
                    if route is None:
                        if type(fields) is DecodeError:
                            raise fields
                        decode_record(fields)  # raises: what is wrong with it
                        raise DecodeError(f"no handler for {type(fields[0]).__name__} {fields[0]} records here")
                    decode, handler = route
                    handler(fields if decode is None else decode(fields), run, sender, size)
                except DecodeError as exc:
                    self._drops("a malformed message from %s: %s", sender.address, exc)
                except Exception:
                    log.exception("error while handling a message from %s", sender.address)
        except DecodeError as exc:
            self._drops("the rest of a malformed batch from %s: %s", sender.address, exc)
        finally:
            self.dispatching = False
