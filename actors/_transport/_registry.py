"""The process registry: every peer of this process by inbox address, its pid, and whether it lives.

A :class:`ProcRef` is interned per address. Its pid may be unknown for a
moment (a process just forked); it is learned from the forkserver, from
the first message the peer sends, or from the session directory, where
each process's pid is recorded under its address (``incarnation_path``):
the forkserver writes it when it forks, and an owner rewrites it when it
restarts a process at the same address. Nothing here ever waits.

Deaths come from :class:`~actors._shared._liveness.Watcher` (pidfds) or from
:meth:`Registry.mark_dead`; each is announced once on the ``deaths`` hook,
and one seen through a pidfd also on ``seen_deaths`` (news to pass on).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from .._shared._errors import DecodeError
from .._shared._hooks import Hook
from .._shared._liveness import ProcRef, Watcher
from .._shared._session import local_hosts, read_incarnation, tcp_host, valid_peer_address

__all__ = ["Registry"]

log = logging.getLogger("actors")


class Registry:
    """Peers by address; liveness through pidfds; deaths announced on its hooks."""

    def __init__(self, session_dir: str, own_pid: int, *, authenticated: bool = False) -> None:
        self.session_dir = session_dir
        self.own_pid = own_pid
        #: The session's links are CURVE-keyed: an ipc peer may serve anywhere (see ``valid_peer_address``).
        self.authenticated = authenticated
        self.procs: dict[str, ProcRef] = {}
        self._by_pid: dict[int, ProcRef] = {}
        self.watcher = Watcher(self._pid_died)
        #: Each ProcRef that dies, once (calls fail, links close, meshes hear of it).
        self.deaths: Hook[[ProcRef]] = Hook("process deaths")
        #: Every pid that exits, known ref or not (port holders are pids).
        self.pid_exits: Hook[[int]] = Hook("pid exits")
        #: Each peer whose death this process saw for itself (its pidfd), after ``deaths``.
        self.seen_deaths: Hook[[ProcRef]] = Hook("deaths seen here")
        #: The pid whose exit the hooks are announcing (``deaths``, ``seen_deaths``, then ``pid_exits``), while
        #: they are: a listener may leave what must follow what is waiting in the inbox to ``pid_exits``.
        self.exiting: int | None = None
        self._pid_waiters: dict[str, list[Callable[[], None]]] = {}
        #: Peers whose pid nobody has recorded yet: ``retry_unresolved`` looks again.
        self.unresolved: set[ProcRef] = set()
        #: A peer joined ``unresolved`` (whoever drives the runtime arranges the retries).
        self.pid_missing: Hook[[]] = Hook("pids to look up")
        self._local_hosts = local_hosts()
        #: Addresses whose process was restarted elsewhere, to the address it serves now.
        self.moved: dict[str, str] = {}

    def is_local(self, address: str) -> bool:
        """Whether ``address`` is served on this machine (ipc always is; tcp by its host)."""
        host = tcp_host(address)
        return host is None or host in self._local_hosts

    def proc(self, address: str, pid: int | None) -> ProcRef:
        """The interned :class:`ProcRef` for ``address`` (learning or updating its pid).

        Raises :class:`~actors.DecodeError` for an address no process of this session could own.
        """
        ref = self.procs.get(address)
        if ref is None and address in self.moved:  # a handle from before its process moved: the replacement
            moved = self.find(address)
            if moved is not None:
                return moved
        if ref is None:
            if not valid_peer_address(address, self.session_dir, self.authenticated):
                # Addresses arrive in records (reply addresses, ports, meshes): nothing may ever be sent to one no
                # process of this session could own, nor reach zmq unparsed.
                raise DecodeError(f"address {address!r:.80} is not a peer of this session")
            ref = self.procs[address] = ProcRef(address, None, remote=not self.is_local(address))
            if pid is not None:
                self.set_pid(ref, pid)
            else:
                self.resolve_pid(ref)
        elif ref.pid is None and pid is not None:
            self.set_pid(ref, pid)
        elif ref.dead and pid is not None and pid != ref.pid and pid not in self.watcher.dead:
            self.revive(ref, pid)  # a restarted process at the same address
        return ref

    def find(self, address: str) -> ProcRef | None:
        """The ref serving ``address`` now, following restarts elsewhere; None for a stranger."""
        for _ in range(len(self.moved) + 1):
            ref = self.procs.get(address)
            if ref is not None or address not in self.moved:
                return ref
            address = self.moved[address]
        return None

    def relocate(self, ref: ProcRef, address: str, remote: bool | None = None) -> str:
        """``ref``'s process was replaced by one serving ``address``: every handle here follows; the old address.

        ``remote`` says whether the new address is on another host (by its tcp
        host when not given); a placer keeps reporting its own processes.
        """
        old = ref.address
        if address == old:
            return old
        if self.procs.get(old) is ref:
            del self.procs[old]
        self.moved[old] = address
        self.moved.pop(address, None)
        ref.address = address
        self.procs[address] = ref  # (a ref made for the new address before the news is dropped)
        ref.remote = not self.is_local(address) if remote is None else remote
        waiting = self._pid_waiters.pop(old, None)
        if waiting:
            self._pid_waiters.setdefault(address, []).extend(waiting)
        return old

    def placed(self, address: str) -> ProcRef:
        """The ref for a process started elsewhere (by Ray) whose placer reports its pid and its death."""
        self.moved.pop(address, None)  # a fresh process there, not a moved one
        ref = self.procs.get(address)
        if ref is None:
            ref = self.procs[address] = ProcRef(address, None, remote=True)
        ref.remote = True
        self.unresolved.discard(ref)
        return ref

    def set_pid(self, ref: ProcRef, pid: int) -> None:
        self.unresolved.discard(ref)
        ref.pid = pid
        if not ref.remote:  # another host's pid is no process of this one's
            self._by_pid[pid] = ref
            if pid != self.own_pid and not ref.dead:
                self.watcher.watch(pid)  # a pid already gone is reported dead right here
        self._run_pid_waiters(ref)

    def _run_pid_waiters(self, ref: ProcRef) -> None:
        """Run what waited for ``ref``'s pid: it is known now, or, the process dead first, never will be."""
        for callback in self._pid_waiters.pop(ref.address, []):
            try:
                callback()
            except Exception:
                log.exception("a pid callback failed")

    def resolve_pid(self, ref: ProcRef) -> int | None:
        """``ref``'s pid, from the session directory if not yet known (None if nobody wrote it yet).

        A peer still unresolved is looked up again until its pid appears: until
        then no pidfd watches it, and a death would go unseen.
        """
        if ref.pid is None and not ref.remote:  # another host's pid comes from whoever placed it
            pid = read_incarnation(self.session_dir, ref.address)
            if pid is not None and pid not in self.watcher.dead:
                self.unresolved.discard(ref)
                self.set_pid(ref, pid)
            elif not ref.dead and ref not in self.unresolved:
                self.unresolved.add(ref)
                self.pid_missing()
        return ref.pid

    def retry_unresolved(self) -> bool:
        """Look up every unresolved peer again; True while some remain."""
        for ref in list(self.unresolved):
            if ref.pid is not None or ref.dead:
                self.unresolved.discard(ref)
            else:
                self.resolve_pid(ref)
        return bool(self.unresolved)

    def when_pid_known(self, ref: ProcRef, callback: Callable[[], None]) -> None:
        """Run ``callback`` once ``ref``'s pid is known (now, if it already is), or once ``ref`` dies without it
        (its process never started: the callback finds it dead, its pid unknown)."""
        if self.resolve_pid(ref) is not None:
            callback()
        else:
            self._pid_waiters.setdefault(ref.address, []).append(callback)

    def revive(self, ref: ProcRef, pid: int | None) -> None:
        """``ref``'s address is served again, by a restarted process (pid known now or later)."""
        ref.dead = False
        ref.exit_reason = ""
        if ref.pid is not None and self._by_pid.get(ref.pid) is ref:
            del self._by_pid[ref.pid]
        ref.pid = None
        if pid is not None:
            self.set_pid(ref, pid)

    def alive(self, ref: ProcRef) -> bool:
        """True unless ``ref`` is dead and no restarted process has replaced it.

        An owner that restarts a process records the new pid in the session
        directory; any process holding a handle to the old one finds it there.
        """
        if not ref.dead:
            return True
        if ref.remote:
            return False
        pid = read_incarnation(self.session_dir, ref.address)
        if pid is None or pid == ref.pid or pid in self.watcher.dead:
            return False
        self.revive(ref, pid)
        return not ref.dead

    def mark_dead(self, ref: ProcRef, reason: str) -> None:
        """Treat ``ref`` as gone and tell every listener, once."""
        if ref.dead:
            return
        ref.dead = True
        ref.exit_reason = reason
        self.deaths(ref)
        if ref.pid is None:  # (a process that never started: what waited for its pid waits no more)
            self._run_pid_waiters(ref)

    def _pid_died(self, pid: int) -> None:
        ref = self._by_pid.get(pid)
        # (a listener may learn of another death meanwhile, handled inside this one: this one is exiting after it)
        outer, self.exiting = self.exiting, pid
        try:
            if ref is not None and ref.pid == pid and not ref.dead:
                self.mark_dead(ref, "process exited")
                self.seen_deaths(ref)
        finally:  # (a Ctrl-C in a death's listener: the calls it left to pid_exits still fail there)
            try:
                self.pid_exits(pid)
            finally:
                self.exiting = outer

    def close(self) -> None:
        self.watcher.close()
