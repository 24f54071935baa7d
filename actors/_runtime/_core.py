"""The per-process runtime: the parts that move records in and out, wired together.

Every process (the controller and each worker) has one :class:`Runtime`::

    peers ──► Inbox ──► Reply ─────────► CallTable (pending calls, deadlines)
                    ├─► PortMessage, Attach ► Receivers (port queues, holders)
                    ├─► Credit ────────► SenderWindows ──► Outbox (one Link per peer) ──► peers
                    ├─► ProcessLost, ProcessRestarted ► PeerNews ► Registry (peers on other hosts)
                    └─► Call, FailureReport ► the worker's ActorServer / the owner's meshes
              Registry: peers by address, pids, deaths ──► listeners above
              Driver: the event loop it is bound to, or a synchronous caller's pump

All of its state is touched from one thread: the thread of the event loop
it is bound to, or, while no loop drives it, the thread that calls it
synchronously. Only synchronous callers (no loop) ever block, in
``Driver.wait``: full queues with a deadline, ``Future.get`` with the
caller's or the call's (or, with neither, until the answer or the actor's
death).
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import zmq

from .._shared._errors import ActorDied, MainLoadingError
from .._shared._liveness import ProcRef
from .._shared._main_loader import loading_main
from .._shared._session import SESSION_ENV, inbox_address, make_runtime_dir, remove_socket_file, session_keys
from .._shared._stale_sessions import hold_session
from .._transport._driver import Driver
from .._transport._flow import SenderWindows
from .._transport._inbox_pump import DropLog, Inbox
from .._transport._outbox import Outbox
from .._transport._peer_news import PeerNews
from .._transport._receivers import Receivers
from .._transport._registry import Registry
from .._transport._sockets import Link, bind_inbox, session_authenticator
from .._wire._codec import Encoder
from .._wire._records import Attach, Credit, Header, PortMessage, ProcessLost, ProcessRestarted, Reply
from ._actor_host import ActorHost
from ._mesh_routes import MeshRoutes
from ._parts import Parts
from ._pending_calls import CallTable, Doomed, fail_waiting

__all__ = [
    "Runtime",
    "at_runtime_exit",
    "current_runtime",
    "install_runtime",
    "join_session",
    "runtime",
]

log = logging.getLogger("actors")

#: How long closing a process's links may keep trying to deliver what is queued.
CLOSE_LINGER_MS = 200
#: How long after a port sender's process exits its receivers wait for what it sent last (seconds).
HOLDER_SETTLE = 0.02


class Runtime:
    """Messaging state of this process. Obtain it with :func:`runtime`."""

    def __init__(
        self,
        address: str | None = None,
        *,
        serve_in_background: bool = False,
        fd: int | None = None,
    ) -> None:
        """``address`` is where peers reach this process; its inbox binds there, or serves the inherited
        listening socket ``fd`` bound there (a worker loop's fd bootstrap)."""
        self.pid = os.getpid()
        self.dir, self.owns_dir = prepare_session()
        #: While open, the session's directory is live (the next session made beside it leaves it alone).
        self._session_lock = hold_session(self.dir) if self.owns_dir else None
        _process.session = None
        self.session = os.path.basename(self.dir)
        self.address = address or inbox_address(self.dir, f"c{self.pid}")
        self.keys = session_keys()
        self.ctx: zmq.Context[Any] = zmq.Context()
        #: On tcp, the ZAP handler that admits only peers holding the session key.
        self.auth = session_authenticator(self.ctx, self.keys[0]) if self.keys is not None else None
        self.header = Header(self.address, self.pid).encode()
        self.encoder = Encoder()
        self.drops = DropLog()
        self.registry = Registry(self.dir, self.pid, authenticated=self.keys is not None)
        self.outbox = Outbox(
            self.ctx,
            self.header,
            self.keys,
            lambda *args: self.driver.block(*args),
            lambda: self.inbox.dispatching,  # (the inbox is made below: asked only once records arrive)
        )
        self.windows = SenderWindows(self.outbox)
        self.calls = CallTable()
        #: Calls waiting on a process whose exit the registry is announcing, by pid: they fail at its
        #: ``pid_exits``, once the inbox has been read (a reply sent just before the exit wins).
        self._doomed: dict[int, list[Doomed]] = {}
        self.receivers = Receivers(self.pid, self.registry.watcher.watch, self._credit, self.drops, self.registry.proc)
        sock = bind_inbox(self.ctx, self.address, self.keys, fd)
        self.inbox = Inbox(sock, self.dir, self.address, self._learn_sender, self.drops, self.keys is not None)
        self.driver = Driver(self.inbox, self.registry, self.outbox, serve_in_background=serve_in_background)
        #: Port-sender holders whose exit is settling (pid, or another host's address -> when it is due): timed
        #: again on each loop the runtime moves to (a timer of the loop it left never fires).
        self._settling: dict[int | str, float] = {}
        self.driver.moved.connect(self._moved)
        self.windows.released.connect(self.driver.notify_progress)  # (a sender blocked for room looks again)
        #: Deaths and restarts of processes on other hosts, told to and heard from peers.
        self.news = PeerNews(self)
        #: Where failures and deaths of the processes this one spawned go (their proc meshes).
        self.mesh_routes = MeshRoutes(self.inbox, self.registry, self.session, self.news.lost)
        #: What serves actors here (a worker's ActorServer, registered with :meth:`host`), once there is one.
        self.server: ActorHost | None = None
        #: The per-process state of the layers above (forkservers, controllers, ``this_proc``), by their keys.
        self.parts = Parts()
        self.closed = False
        self._counters: dict[str, itertools.count[int]] = {}
        self._wire_handlers()

    def host(self, server: ActorHost) -> None:
        """Make ``server`` the actor server of this process (a worker has exactly one)."""
        if self.server is not None:
            raise RuntimeError("this process already has an actor server")
        self.server = server

    def spawned(self) -> list[str]:
        """The addresses of the processes this one spawned (whose proc meshes are still held)."""
        return self.mesh_routes.spawned()

    def owns(self, address: str) -> bool:
        """Whether this process spawned the process at ``address``."""
        return self.mesh_routes.owns(address)

    def owner(self) -> ProcRef | None:
        """The process that spawned this one (None in the controller)."""
        return self.server.owner if self.server is not None else None

    def _wire_handlers(self) -> None:
        registry, inbox, receivers = self.registry, self.inbox, self.receivers
        registry.deaths.connect(self._peer_died)
        registry.deaths.connect(self._fail_calls_of)
        registry.pid_exits.connect(self._holder_exited)
        registry.deaths.connect(self._remote_holder_died)
        inbox.on(Reply, lambda record, frames, sender, size: self.calls.on_reply(record))
        inbox.on(Credit, lambda record, frames, sender, size: self.windows.on_credit(sender.address, *record))
        inbox.on(PortMessage, receivers.on_port_message, raw=True, run=receivers.deliver_run)  # the hot path
        inbox.on(Attach, receivers.on_attach)
        news = self.news
        inbox.on(ProcessLost, news.on_lost)
        inbox.on(ProcessRestarted, news.on_restarted)
        registry.seen_deaths.connect(news.seen_dying)

    def _fail_calls_of(self, ref: ProcRef) -> None:
        """Fail the calls still waiting on ``ref``, a process that died.

        One whose exit this process saw (its pidfd) may have answered just
        before it exited, the reply still unread (the pidfd read first, or
        the reply queued behind a turn's records): its calls fail at its
        ``pid_exits``, once what waits in the inbox has been read (the news
        of its death has gone out by then, so a restart read there is later).
        """
        doomed = self.calls.waiting_on(ref)
        if not doomed:
            return
        if ref.pid is not None and ref.pid == self.registry.exiting:
            self._doomed.setdefault(ref.pid, []).append(Doomed(doomed, ref, ref.exit_reason))
        else:
            fail_waiting(doomed, ref, ref.pid, ref.exit_reason)

    def _remote_holder_died(self, ref: ProcRef) -> None:
        """A process of another host died (news of it): its port senders, known by its address, are gone."""
        if ref.remote:
            self._holder_exited(ref.address)

    def _holder_exited(self, pid: int | str) -> None:
        """Process ``pid`` (another host's: its address) exited: once what it sent has been taken in, its port
        senders are gone.

        Messages it sent just before exiting can still be in ZeroMQ's I/O
        thread when its pidfd fires, so the inbox is pumped now and, on a
        running loop, again :data:`HOLDER_SETTLE` s later, before receivers
        may report "every sender gone" (a port's last messages are never
        mistaken for lost).
        """
        try:
            if not self.closed:
                self.inbox.pump()
        finally:  # (whatever the pump raised: a Ctrl-C, a closed socket)
            if isinstance(pid, int):
                for doomed in self._doomed.pop(pid, ()):  # its calls the inbox did not answer
                    fail_waiting(doomed.calls, doomed.ref, pid, doomed.reason)
        loop = self.driver.loop
        if loop is None or not loop.is_running():
            self.receivers.holder_died(pid)
            return
        self._settling[pid] = time.monotonic() + HOLDER_SETTLE
        loop.call_later(HOLDER_SETTLE, self._holder_settled, pid)

    def _holder_settled(self, pid: int | str) -> None:
        if self._settling.pop(pid, None) is None:
            return  # (settled already: timed on two loops)
        if not self.closed:
            self.inbox.pump()
        self.receivers.holder_died(pid)

    def _moved(self) -> None:
        """The runtime moved to another loop (``asyncio.run`` ended, say): what was timed on the one it left is timed
        there: each call's deadline (:meth:`CallTable.rearm`), and each port sender's exit still settling (or a
        receive would wait for that sender for good)."""
        loop = self.driver.loop
        if loop is None:
            return
        self.calls.rearm(loop)
        now = time.monotonic()
        for pid, due in self._settling.items():
            loop.call_later(max(0.0, due - now), self._holder_settled, pid)

    def _learn_sender(self, header: Header) -> None:
        self.registry.proc(header.address, header.pid)

    def _drop_route(self, address: str) -> None:
        """Forget the link to ``address`` and the port windows toward it (its process died or moved)."""
        self.outbox.drop(address)
        self.windows.drop(address)

    def _peer_died(self, ref: ProcRef) -> None:
        self._drop_route(ref.address)
        self.driver.notify_progress()

    def relocate(self, ref: ProcRef, address: str, remote: bool | None = None) -> None:
        """``ref``'s process was replaced by one at ``address`` (another host): route everything there now."""
        old = self.registry.relocate(ref, address, remote)
        if old == address:
            return
        self._drop_route(old)
        self.mesh_routes.moved(old, address)

    def _credit(self, sender: Header, port_id: int, messages: int, nbytes: int) -> None:
        """Give a port's sender its window back (urgent: a busy consumer may never yield; owed: the sender's own
        window bounds how many are due, and one refused on a full link would stall that sender for good).

        Only to that process: one restarted at its address since has a window of its own, which the old one's
        messages never took (credited, it would let the new one past its bound, or drop its live window).
        """
        ref = self.registry.procs.get(sender.address)
        if ref is not None and not ref.dead and (ref.pid is None or ref.pid == sender.pid):
            with contextlib.suppress(ActorDied):
                self.send(ref, Credit(port_id, messages, nbytes), urgent=True, owed=True)

    def encoder_now(self) -> Encoder:
        """The process's encoder, or a new one while it encodes: a message sent by code that a value runs as it is
        encoded (a pid callback shipping a port, as an actor mesh's state looks up pids) is encoded apart."""
        encoder = self.encoder
        return encoder if not encoder.busy else Encoder()

    def send(self, ref: ProcRef, record: Any, *, urgent: bool, owed: bool = False) -> None:
        """Encode ``record`` and queue it for ``ref``; raises ActorDied if ``ref`` is gone.

        ``owed``: an answer ``ref`` asked for (a call's reply), queued even past the link's limits (see
        :meth:`~actors._transport._outbox.Outbox.post`).
        """
        enc = self.encoder_now()
        enc.reset()
        data = enc.encode(record.to_wire())
        frames, handles = enc.frames, enc.handles
        link = self.link(ref)
        if handles:
            self.note_handles(handles, ref)
        self.outbox.post(link, data, frames, urgent, owed=owed)

    def link(self, ref: ProcRef) -> Link:
        if ref.dead and not self.registry.alive(ref):
            raise ActorDied(f"process {ref.address} (pid {ref.pid}) is dead: {ref.exit_reason}", pid=ref.pid)
        return self.outbox.link(ref.address)

    def note_handles(self, handles: Iterable[Any], dest: ProcRef) -> None:
        """Tell the owners of ports being shipped to ``dest`` who now holds a sender."""
        for handle in handles:
            note = getattr(handle, "_shipped_to", None)
            if note is not None:
                note(self, dest)

    def counter(self, name: str) -> int:
        """The next number of this process's sequence ``name`` (mesh names, worker indices)."""
        sequence = self._counters.get(name)
        if sequence is None:
            sequence = self._counters[name] = itertools.count()
        return next(sequence)

    def close(self) -> None:
        """Flush what can be flushed, close every socket, remove owned files."""
        if self.closed or self.pid != os.getpid():
            return
        for link in list(self.outbox.links.values()):
            with contextlib.suppress(Exception):
                link.try_send(self.header)
        self.closed = True
        self.driver.closed = True
        self.driver.release()
        self.registry.close()
        # Queued records to a live peer leave in milliseconds over ipc; a peer
        # that just exited would otherwise hold the exit for the full linger.
        self.outbox.close(CLOSE_LINGER_MS)
        self.inbox.sock.close(linger=0)
        if self.auth is not None:
            self.auth.stop()
        self.ctx.term()
        remove_socket_file(self.address)
        if self._session_lock is not None:
            os.close(self._session_lock)
        if self.owns_dir:
            shutil.rmtree(self.dir, ignore_errors=True)


class _Process:
    """This process's one runtime and its exit hooks: the only process-wide state of ``actors``.

    Like asyncio's running loop, a process has one messaging runtime; it is
    created on first use (again after a fork) and closed at interpreter exit.
    Before it exists, its session directory and forkserver may already be
    prepared (``_forkserver.prefork``).
    """

    def __init__(self) -> None:
        self.runtime: Runtime | None = None
        self.exit_hooks: list[Callable[[], None]] = []
        self.atexit_registered = False
        self.lock = threading.Lock()
        #: (session directory, whether this process owns it), prepared before the runtime.
        self.session: tuple[str, bool] | None = None
        #: State of the layers above kept before the runtime exists (a forkserver it will adopt).
        self.parts = Parts()


_process = _Process()


def process_state() -> _Process:
    return _process


def prepare_session() -> tuple[str, bool]:
    """This process's session directory and whether it owns it (inherited from a spawner, or made now)."""
    if _process.session is None:
        inherited = os.environ.get(SESSION_ENV)
        if inherited and os.path.isdir(inherited):
            _process.session = (inherited, False)
        else:
            _process.session = (make_runtime_dir(), True)
    return _process.session


def join_session(session_dir: str, what: str) -> None:
    """Make this process a peer of the session in ``session_dir``: before its runtime starts, or already in it.

    ``what`` (the handle that brought the session, say) names the cause in
    the error when this process already belongs to another session.
    """
    rt = current_runtime()
    current = rt.dir if rt is not None else _process.session[0] if _process.session is not None else None
    if current is None:
        if not os.path.isdir(session_dir):
            raise RuntimeError(f"{what} belongs to a session that has ended ({session_dir} is gone)")
        _process.session = (session_dir, False)
    elif current != session_dir:
        raise RuntimeError(
            f"{what} belongs to the session in {session_dir}, but this process already runs in {current}: "
            "hand it over before this process uses actors, or spawn from the process that owns it"
        )


def forget_in_child() -> None:
    """In a process forked from this one: none of the parent's runtime state applies."""
    _process.__init__()  # type: ignore[misc]


def runtime() -> Runtime:
    """This process's runtime, created on first use, following the caller's event loop."""
    if loading_main.get():
        raise MainLoadingError(
            "the actors runtime was used while an actor process loaded the launching script's definitions; "
            'this top-level statement is skipped there (guard it with `if __name__ == "__main__":` to be explicit)'
        )
    rt = _process.runtime
    if rt is None or rt.pid != os.getpid() or rt.closed:
        with _process.lock:
            rt = _process.runtime
            if rt is None or rt.pid != os.getpid() or rt.closed:
                _freeze_startup_heap()
                rt = _process.runtime = Runtime(serve_in_background=True)
                _register_exit()
    rt.driver.follow_running_loop()
    return rt


#: ``ACTORS_GC_FREEZE=0`` keeps the program's heap in the cyclic collector's view when the runtime starts.
GC_FREEZE_ENV = "ACTORS_GC_FREEZE"


def _freeze_startup_heap() -> None:
    """Move what the program has loaded (torch's modules: ~170 k objects) out of the cyclic collector's view.

    Every full collection walks every tracked object: with torch imported
    that is 85-140 ms on the loop's thread (measured), landing wherever the
    collector's count runs out — inside a stop, between two heartbeats. A
    freeze costs nothing (no collection); what it gives up is collecting
    reference cycles that exist now and later become garbage (memory freed
    by reference counts is freed as ever). Worker processes do the same.
    """
    if os.environ.get(GC_FREEZE_ENV, "1") != "0":
        gc.freeze()


def install_runtime(rt: Runtime) -> None:
    """Make ``rt`` this process's runtime (worker processes build their own)."""
    _process.runtime = rt
    _register_exit()


def current_runtime() -> Runtime | None:
    """This process's runtime if it has one (never creates it)."""
    rt = _process.runtime
    return rt if rt is not None and rt.pid == os.getpid() and not rt.closed else None


def at_runtime_exit(callback: Callable[[], None]) -> None:
    """Run ``callback`` before this process's runtime closes at interpreter exit."""
    _process.exit_hooks.append(callback)


def _register_exit() -> None:
    if not _process.atexit_registered:
        import atexit

        _process.atexit_registered = True
        atexit.register(_close_at_exit)


def _close_at_exit() -> None:
    rt = current_runtime()
    if rt is None:
        return
    if not rt.driver.loop_active():
        rt.driver.release()  # this thread drives the last steps itself
    for callback in list(_process.exit_hooks):
        with contextlib.suppress(Exception):
            callback()
    rt.close()
