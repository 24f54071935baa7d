"""News of peers on other hosts: the deaths and restarts their owner saw, passed on to those who cannot see them.

A process watches the peers on its own host through pidfds (and finds a
restarted one's pid in the session directory). A peer on another host is
watched only by its owner, which hears from whoever placed it (a Ray node
host, a lifeline). So an owner tells every process it knows of each death
(:class:`~actors._wire.ProcessLost`) and each restart
(:class:`~actors._wire.ProcessRestarted`, with the replacement's address
when it moved to another host): a worker's call to a peer on a lost node
then fails at once with ``ActorDied`` instead of waiting for its timeout,
and its handles follow the replacement. Within one host nothing is sent.
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Any

from ._errors import ActorDied
from ._liveness import ProcRef
from ._wire import Header, ProcessLost, ProcessRestarted

if TYPE_CHECKING:
    from ._runtime import Runtime

__all__ = ["PeerNews"]

log = logging.getLogger("actors")


class PeerNews:
    """Tells peers on other hosts of deaths and restarts this process saw, and takes such news from them."""

    def __init__(self, rt: Runtime) -> None:
        self._rt = rt
        rt.inbox.on(ProcessLost, self._on_lost)
        rt.inbox.on(ProcessRestarted, self._on_restarted)

    def lost(self, ref: ProcRef) -> None:
        """``ref`` died: tell the peers that cannot watch it themselves."""
        self._tell(ref, ProcessLost(ref.address, ref.exit_reason or "process exited"))

    def restarted(self, old_address: str, ref: ProcRef) -> None:
        """``ref``'s process, once at ``old_address``, was replaced by one at ``ref.address``."""
        self._tell(ref, ProcessRestarted(old_address, ref.address))

    def _tell(self, about: ProcRef, record: Any) -> None:
        rt = self._rt
        if rt.closed:
            return
        for peer in self._audience(about):
            with contextlib.suppress(ActorDied):  # one that just died needs no news
                rt.send(peer, record, urgent=True)

    def _audience(self, about: ProcRef) -> list[ProcRef]:
        """Every live peer this process knows, but only those that may be on another host than ``about``.

        A peer on this host sees a death on this host by itself; when every
        process is here (``about`` and the peers all local), nobody is told.
        """
        own = self._rt.address
        return [
            peer
            for peer in list(self._rt.registry.procs.values())
            if peer is not about and not peer.dead and peer.address != own and (about.remote or peer.remote)
        ]

    def _on_lost(self, record: ProcessLost, frames: list[Any], sender: Header, size: int) -> None:
        registry = self._rt.registry
        ref = registry.find(record.address)
        if ref is None or ref.dead or not ref.remote:  # one on this host is watched here, by its pidfd
            return
        registry.mark_dead(ref, f"{record.reason} (reported by its owner, {sender.address})")

    def _on_restarted(self, record: ProcessRestarted, frames: list[Any], sender: Header, size: int) -> None:
        rt = self._rt
        registry = rt.registry
        ref = registry.find(record.address)
        if ref is None or record.new_address == rt.address:
            return  # never held a handle to it (later handles carry the new address), or the news is of us
        if not ref.dead:  # the old process is gone, whether or not this process saw it go
            registry.mark_dead(ref, f"replaced by a restarted process (reported by its owner, {sender.address})")
        rt.relocate(ref, record.new_address)
        registry.revive(ref, None)
        registry.resolve_pid(ref)  # on this host, its pid is in the session directory
        log.info("peer %s restarted at %s (reported by %s)", record.address, record.new_address, sender.address)
