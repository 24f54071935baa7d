"""News of peers on other hosts: the deaths and restarts their owner saw, passed on to those who cannot see them.

A process watches the peers on its own host through pidfds (and finds a
restarted one's pid in the session directory). A peer on another host is
watched only by its owner, which hears from whoever placed it (a Ray node
host, a lifeline). So an owner tells every process it knows of each death
(:class:`~actors._wire._records.ProcessLost`) and each restart
(:class:`~actors._wire._records.ProcessRestarted`, with the replacement's address
when it moved to another host): a worker's call to a peer on a lost node
then fails at once with ``ActorDied`` instead of waiting for its timeout,
and its handles follow the replacement. A session on ipc (one host, every
death seen through pidfds) sends nothing.

The owner does not know every process that may hold a handle (those its
workers spawned, or a cousin given the handle by a third process). So
whoever hears news passes it on to its neighbours in the spawning tree (the
processes it spawned and its own owner), never back to the one it came
from; a process that sees a peer on its own host die (its pidfd) starts the
same passing. Peers on ipc are left out of news about their own host: they
watch those pids themselves and have no neighbours elsewhere.

The same news reaches a process by several paths, in any order relative to
the restart that followed. Each record carries the incarnation stamp of the
process it speaks of (its owner's clock when it started it), and each ref
keeps the order of the latest news applied (``ProcRef.heard``: ``2t`` for
the death of incarnation ``t``, ``2t' - 1`` for the restart that made
``t'``; by address for a process with no handle here). Older or repeated
news changes nothing and goes no further, so the passing ends; news of a
new process that took a dead one's address is later, so it is not lost.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Protocol

from .._shared._errors import ActorDied
from .._shared._liveness import ProcRef
from .._shared._session import tcp_host
from .._wire._records import Header, ProcessLost, ProcessRestarted
from ._registry import Registry

__all__ = ["Newsroom", "PeerNews"]

log = logging.getLogger("actors")


def _order(record: ProcessLost | ProcessRestarted) -> int:
    """Where ``record`` stands in its process's history: each restart after the death before it."""
    return 2 * record.incarnation - (1 if isinstance(record, ProcessRestarted) else 0)


class Newsroom(Protocol):
    """All that news uses of its process (the runtime): who it is, its peers, who it spawned and who spawned it."""

    @property
    def address(self) -> str: ...

    @property
    def closed(self) -> bool: ...

    @property
    def registry(self) -> Registry: ...

    def send(self, ref: ProcRef, record: Any, *, urgent: bool) -> None: ...

    def relocate(self, ref: ProcRef, address: str, remote: bool | None = None) -> None: ...

    def owns(self, address: str) -> bool: ...  # whether this process spawned the one at ``address``

    def spawned(self) -> list[str]: ...  # the addresses of the processes it spawned

    def owner(self) -> ProcRef | None: ...  # the process that spawned it (None in the controller)


class PeerNews:
    """Tells peers on other hosts of deaths and restarts this process saw or heard, and takes such news from them.

    The runtime routes ``ProcessLost`` records to :meth:`on_lost`,
    ``ProcessRestarted`` to :meth:`on_restarted`, and the registry's
    ``seen_deaths`` hook to :meth:`seen_dying`.
    """

    def __init__(self, rt: Newsroom) -> None:
        self._rt = rt
        #: News of processes this one holds no handle to: the latest order passed on, by address.
        self._heard: dict[str, int] = {}

    def lost(self, ref: ProcRef) -> None:
        """``ref``, a process this one owns, died: tell the peers that cannot watch it themselves."""
        record = ProcessLost(ref.address, ref.exit_reason or "process exited", ref.incarnation)
        ref.heard = max(ref.heard, _order(record))  # the same news coming back by another path is old
        self._tell(self._audience(ref.address, ref.remote, self._known()), record)

    def restarted(self, old_address: str, ref: ProcRef) -> None:
        """``ref``'s process, once at ``old_address``, was replaced by one at ``ref.address`` (``ref.incarnation``)."""
        record = ProcessRestarted(old_address, ref.address, ref.incarnation)
        ref.heard = max(ref.heard, _order(record))
        self._tell(self._audience(ref.address, ref.remote, self._known()), record)

    def seen_dying(self, ref: ProcRef) -> None:
        """This process saw ``ref``, a peer on its host, die (its pidfd): pass it on along the spawning tree.

        Its owner tells only the processes it knows; those that spawned this
        one, or that it spawned, may be elsewhere and hold a handle.
        """
        if self._rt.owns(ref.address):
            return  # one of ours: ``lost`` told everyone
        record = ProcessLost(ref.address, ref.exit_reason or "process exited", ref.incarnation)
        if not self._stale(record, ref):
            self._tell(self._audience(ref.address, ref.remote, self._tree()), record)

    def _tell(self, audience: list[ProcRef], record: Any) -> None:
        rt = self._rt
        if rt.closed:
            return
        for peer in audience:
            with contextlib.suppress(ActorDied):  # one that just died needs no news
                rt.send(peer, record, urgent=True)

    def _known(self) -> list[ProcRef]:
        return list(self._rt.registry.procs.values())

    def _tree(self) -> list[ProcRef]:
        """This process's neighbours in the spawning tree: the processes it spawned, and its owner."""
        rt = self._rt
        procs = rt.registry.procs
        near = [ref for ref in (procs.get(address) for address in rt.spawned()) if ref is not None]
        owner = rt.owner()
        return [*near, owner] if owner is not None else near

    def _audience(self, about: str, about_remote: bool, peers: list[ProcRef], sender: str = "") -> list[ProcRef]:
        """The live ``peers`` that may be on another host than the process at ``about``, or lead to one that is.

        A peer on this host sees a death here by itself. One that speaks
        tcp may still have neighbours elsewhere, so it is told; one on ipc
        cannot, and is not: in an ipc session nothing is sent. Neither the
        process spoken of nor whoever told us is told.
        """
        own = self._rt.address
        return [
            peer
            for peer in peers
            if peer.address not in (about, own, sender)
            and not peer.dead
            and (about_remote or peer.remote or tcp_host(peer.address) is not None)
        ]

    def _stale(self, record: ProcessLost | ProcessRestarted, ref: ProcRef | None) -> bool:
        """Whether ``record`` was heard already (or something later was); if not, it now counts as heard."""
        order = _order(record)
        if ref is None:  # no handle here: the news is remembered by address, to pass each on once
            if order <= self._heard.get(record.address, -1):
                return True
            self._heard[record.address] = order
            return False
        if order <= ref.heard:
            return True
        ref.heard = order
        ref.incarnation = max(ref.incarnation, record.incarnation)
        return False

    def _pass_on(self, record: ProcessLost | ProcessRestarted, sender: Header, *addresses: str) -> None:
        """Give ``record`` to this process's neighbours in the spawning tree, but not back to ``sender``."""
        registry = self._rt.registry
        remote = any(not registry.is_local(address) for address in addresses)
        self._tell(self._audience(record.address, remote, self._tree(), sender.address), record)

    def on_lost(self, record: ProcessLost, frames: list[Any], sender: Header, size: int) -> None:
        rt = self._rt
        if record.address == rt.address:
            return  # news of our own death (an owner that lost sight of us): ours to hear, not to spread
        if rt.owns(record.address):
            return  # one of ours: its placer or pidfd tells us, and ``lost`` tells the others
        ref = rt.registry.find(record.address)
        if self._stale(record, ref):
            return
        if ref is not None and not ref.dead and ref.remote:  # one on this host is watched here, by its pidfd
            rt.registry.mark_dead(ref, f"{record.reason} (reported by {sender.address})")
        self._pass_on(record, sender, record.address)

    def on_restarted(self, record: ProcessRestarted, frames: list[Any], sender: Header, size: int) -> None:
        rt = self._rt
        if record.new_address == rt.address:
            return  # the news is of us
        registry = rt.registry
        ref = registry.find(record.address)
        if ref is not None and not ref.remote and ref.pid is not None:
            registry.watcher.take_pending(ref.pid)  # the old process's exit, if not yet handled here, comes first
        death_heard = ref is not None and ref.heard >= 0 and ref.heard % 2 == 0  # the latest news here: a death
        if self._stale(record, ref):
            return
        if ref is not None:  # (one holding no handle needs nothing: later handles carry the new address)
            moved = record.new_address != ref.address
            # Alive after its death was heard: the replacement spoke first and revived it, unless the
            # replacement is elsewhere (then this is still the old process, which must let go of the ref).
            if not ref.dead and (not death_heard or moved):
                registry.mark_dead(ref, f"replaced by a restarted process (reported by {sender.address})")
            rt.relocate(ref, record.new_address)
            if ref.dead:
                registry.revive(ref, None)  # the old pid no longer names it
                registry.resolve_pid(ref)  # on this host, its pid is in the session directory
            log.info("peer %s restarted at %s (reported by %s)", record.address, record.new_address, sender.address)
        self._pass_on(record, sender, record.address, record.new_address)
