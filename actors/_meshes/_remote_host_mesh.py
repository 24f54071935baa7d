"""Hosts on other machines, each with a forkserver of its own that this controller drives: the shared logic.

Two placers start such hosts: Ray (``actors.ray.host_mesh``, a ``NodeHost``
actor per node) and a scheduler or a person (``run_worker_loop_forever`` on
each machine, joined with ``attach_to_workers``). Either way the controller
asks each host to fork its share of the workers, hears which exited, has one
killed when it ignored a stop, and takes a fresh batch of free tcp addresses
now and then; a subclass says how those requests travel (:meth:`_request`).
``spawn_procs`` returns a :class:`~actors.ProcMesh` whose first dimension is
``hosts``. Actor messages never go through the host: they use the workers'
own tcp sockets, CURVE-authenticated with the session's keys.

Liveness: a worker's exit is reaped by its host's forkserver and reported
here; a host that is lost (its lifeline ends, or its requests fail) fails
every process it held. Either way the calls waiting on them raise
:class:`~actors.ActorDied`.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import math
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from typing_extensions import Self

from .._processes._devices import GPU_DIM, gpu_env
from .._processes._lifeline import Lifelines
from .._runtime._core import Runtime, current_runtime
from .._runtime._future import Future
from .._runtime._relay import Relay
from .._runtime._value_mesh import Extent, select
from .._shared._liveness import ProcRef
from .._shared._loops import loop_running
from .._shared._restart import RestartPolicy
from .._shared._session import TCP_HOST_ENV, TRANSPORT_ENV, tcp_host
from ._host_mesh import HostMesh, main_module, worker_config
from ._proc_mesh import ProcMesh

__all__ = ["ADDRESS_POOL", "RemoteHostMesh", "RemoteNode", "Requested", "exit_reason", "use_tcp"]

log = logging.getLogger("actors")

#: Free tcp addresses asked of each host ahead of need, so ``spawn_procs`` rarely waits for one.
ADDRESS_POOL = 64
#: Rounds of fetching addresses and placing a spawn, while other spawns on the same hosts take them first.
PLACE_ATTEMPTS = 3

#: ``done(value, None)`` or ``done(None, error)`` on the runtime's thread when a request to a host completes.
Requested = Callable[[Any, BaseException | None], None]


@dataclass(eq=False)
class RemoteNode:
    """One host, as the controller sees it."""

    index: int
    #: How requests reach it (a Ray actor handle, or an attached worker's agent).
    handle: Any
    ip: str
    pid: int
    #: The placer's name for the host (a Ray node id; an attached worker's address).
    node: str
    #: What the host is called in messages (``Ray node 1a2b3c4d``, ``worker tcp://10.0.0.7:4444``).
    label: str
    gpus: list[str]
    addresses: list[str] = field(default_factory=list)
    #: Workers started there and not yet reaped, by spawn index.
    procs: dict[int, ProcRef] = field(default_factory=dict)
    lost: str = ""
    #: A request for more addresses is on its way (one at a time: each respawn below the mark asked again).
    refilling: bool = False

    def __str__(self) -> str:
        return f"host {self.index} ({self.ip}, {self.label})"

    def pool(self, addresses: list[str]) -> None:
        """Keep fresh free ``addresses`` for later workers, leaving out any this host's pool already holds or a
        worker of it was given.

        A batch is distinct in itself, but a port the pool still holds unbound
        is free to the host's next batch too, and so is one a worker was sent
        to start on and has not bound yet (the pool is refilled at once):
        kept again, it would be handed to two ranks.
        """
        held = set(self.addresses) | {ref.address for ref in self.procs.values()}
        self.addresses.extend(address for address in addresses if address not in held)


def use_tcp(caller: str, bind_host: str, reachable_at: str) -> None:
    """Make this process's inbox a tcp one on ``bind_host`` (its runtime may not exist yet), or say why it cannot.

    Hosts on other machines reach the controller over tcp only; a runtime
    that already started on ipc cannot move, so ``caller`` (the API that
    needs it) is named with the way out.
    """
    existing = current_runtime()
    if existing is None:
        os.environ[TRANSPORT_ENV] = "tcp"
        os.environ.setdefault(TCP_HOST_ENV, bind_host)
    elif tcp_host(existing.address) is None:
        raise RuntimeError(
            f"{caller} needs this process's inbox on tcp, but the actors runtime already started on ipc: call it "
            f"before anything else that uses actors, or start the program with {TRANSPORT_ENV}=tcp "
            f"{TCP_HOST_ENV}=<{reachable_at}>"
        )


def exit_reason(code: int) -> str:
    """A reaped worker's exit code, in words."""
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
        return f"killed by signal {-code}"
    return f"exited with code {code}"


class RemoteHostMesh(HostMesh):
    """Hosts with forkservers of their own: ``spawn_procs(per_host)`` starts ``per_host`` processes on each."""

    def __init__(self, rt: Runtime, nodes: list[RemoteNode], lifelines: Lifelines) -> None:
        self._rt = rt
        self._nodes = nodes
        self._relay = Relay(rt)
        self._lifelines = lifelines
        self._root: RemoteHostMesh | None = None
        self.closed = False
        self._shutting_down: asyncio.Future[None] | None = None  # a shutdown started on an event loop
        for node in nodes:
            self._watch(node)
        lifelines.watch(self._lifeline_lost)

    # ------------------------------------------------------------------ what a placer provides

    def _request(self, node: RemoteNode, op: str, args: tuple[Any, ...], done: Requested) -> None:
        """Send request ``op`` (``spawn``, ``kill``, ``exits``, ``addresses``) to ``node``; ``done`` gets its answer."""
        raise NotImplementedError

    def _fetch_addresses(self, nodes: list[RemoteNode], count: int) -> list[list[str]]:
        """``count`` free addresses on each of ``nodes``, waited for (never called on an event loop)."""
        raise NotImplementedError

    def shutdown(self) -> Future[None]:
        """End every process this mesh started on every host, and release the hosts.

        From synchronous code it blocks until done and returns a completed
        :class:`Future`, so Monarch's ``hosts.shutdown().get()`` reads as
        there. On an event loop (Monarch's ``await hosts.shutdown()``) the
        shutdown starts at once on a worker thread, whose waits never touch
        the loop's, and the returned Future is awaited for its end.
        """
        return self._released(end_hosts=True)

    def stop(self) -> Future[None]:
        """End every process this mesh started and release the hosts, leaving what serves a host for a later
        host mesh (Monarch's ``stop``: an attached worker loop serves the next ``attach_to_workers``)."""
        return self._released(end_hosts=False)

    def _released(self, end_hosts: bool) -> Future[None]:
        """:meth:`_release` as :meth:`shutdown` runs it: blocking in synchronous code, on a thread from a loop."""
        if self._root is not None:
            raise RuntimeError("shut down the host mesh this one was sliced from: they share their hosts")
        if not loop_running():
            self._release(end_hosts)
            return Future.ready(None)
        # (kept referenced here: a task only the caller's Future held could be collected mid-way)
        task = self._shutting_down = asyncio.ensure_future(asyncio.to_thread(self._release, end_hosts))

        async def ended() -> None:
            await asyncio.shield(task)

        return Future(ended)

    def _release(self, end_hosts: bool) -> None:
        """What :meth:`shutdown` does (once); ``end_hosts=False`` at the program's exit keeps what serves a host
        that outlives this controller (an attached worker loop) serving."""
        raise NotImplementedError

    async def shutdown_async(self) -> None:
        """:meth:`shutdown` for code on an event loop (``await hosts.shutdown()`` does the same)."""
        await self.shutdown()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ the mesh

    @property
    def extent(self) -> Extent:
        return Extent(["hosts"], [len(self._nodes)])

    @property
    def hosts(self) -> list[dict[str, Any]]:
        """Each host: its address, the placer's name for it, its host process's pid, GPUs, and whether it was lost."""
        return [{"ip": n.ip, "node": n.node, "pid": n.pid, "gpus": list(n.gpus), "lost": n.lost} for n in self._nodes]

    def slice(self, hosts: int | slice) -> RemoteHostMesh:
        """Some of the hosts, as a host mesh of their own (``hosts=0``, ``hosts=slice(1, None)``).

        A slice shares its parent's hosts: spawn on it to place processes on
        those hosts only; shut down the parent.
        """
        ranks, _ = select(
            self.extent, {"hosts": hosts if isinstance(hosts, slice) else slice(hosts, hosts + 1 or None)}
        )
        if not ranks:
            raise IndexError(f"hosts={hosts!r} selects none of {len(self._nodes)} hosts")
        view = copy.copy(self)
        view._nodes = [self._nodes[r] for r in ranks]
        view._root = self._root or self
        return view

    def _spawn(
        self, per: dict[str, int], boot: str | None, name: str | None, threads: int, policy: RestartPolicy
    ) -> ProcMesh:
        """Start ``per`` processes on every host; the mesh's extent is ``{"hosts": N, **per}``.

        The addresses are fetched on the caller's thread (a round trip that may wait); the hosts' worker tables
        change on the runtime's thread only, where their answers are handled.
        """
        if "hosts" in per:
            raise ValueError("per_host counts processes on each host; 'hosts' is the host mesh's own dimension")
        self._check_spawnable()
        count = math.prod(per.values())
        for _ in range(PLACE_ATTEMPTS):
            self._ensure_addresses(count)
            mesh = self._rt.driver.on_thread(lambda: self._place(per, count, boot, name, threads, policy))
            if mesh is not None:
                return mesh  # type: ignore[no-any-return]
        raise RuntimeError(
            f"spawn_procs() could not keep {count} free addresses per host ready: other spawns on these hosts took "
            f"them {PLACE_ATTEMPTS} times over; spawn again"
        )

    def _check_spawnable(self) -> None:
        if self.closed or (self._root is not None and self._root.closed):
            raise RuntimeError(f"{self!r} has been shut down")
        lost = [str(node) for node in self._nodes if node.lost]
        if lost:
            raise RuntimeError(f"cannot spawn on a host mesh that lost {', '.join(lost)}")

    def _free_addresses(self, node: RemoteNode, count: int, chosen: set[str]) -> list[str] | None:
        """``count`` of ``node``'s pooled addresses that no process this one knows ever served and this placement
        has not chosen, taken from its pool; None (the pool as it was) if it has too few.

        Another host with the same IP (two worker loops on one machine) pools
        ports of the same address space: a port it still holds unbound is
        free to this host's batch too, and may be a live worker's by now. One
        a dead worker served is left too: its ref, interned by address, is
        dead and still another mesh's rank.
        """
        taken: list[str] = []
        while len(taken) < count and node.addresses:
            address = node.addresses.pop()
            if address not in chosen and address not in self._rt.registry.procs:
                taken.append(address)
        if len(taken) < count:
            node.addresses.extend(reversed(taken))
            return None
        chosen.update(taken)
        return taken

    def _place(
        self, per: dict[str, int], count: int, boot: str | None, name: str | None, threads: int, policy: RestartPolicy
    ) -> ProcMesh | None:
        """:meth:`_spawn`'s processes started on the hosts (the runtime's thread); None, nothing started, if a
        host has too few free addresses (another spawn took them since they were fetched)."""
        self._check_spawnable()  # (again: a host may have been lost while the addresses came)
        chosen: set[str] = set()
        placements: list[tuple[RemoteNode, list[str]]] = []
        for node in self._nodes:
            addresses = self._free_addresses(node, count, chosen)
            if addresses is None:
                for earlier, taken in placements:
                    earlier.addresses.extend(reversed(taken))
                self._refill()  # (a pool that held addresses served since may be short now: the next spawn finds it full)
                return None
            placements.append((node, addresses))
        rt = self._rt
        main = main_module()
        mesh_name = name or f"procs{rt.counter('mesh')}"
        procs: list[ProcRef] = []
        configs: list[dict[str, Any]] = []
        homes: list[RemoteNode] = []

        def config_for(rank: int, node: RemoteNode, address: str) -> dict[str, Any]:
            """Rank's worker on ``node``: the GPU of its place among its host's ``count`` processes."""
            env = gpu_env(per, rank % count, node.gpus)
            return worker_config(rt, f"{mesh_name}.{rank}", address, rank, main, boot, threads, env).to_wire()

        for node, addresses in placements:
            for address in addresses:
                rank = len(procs)
                ref = rt.registry.placed(address)
                configs.append(config_for(rank, node, address))
                procs.append(ref)
                homes.append(node)
                self._start(node, ref, configs[-1])
        self._refill()

        def respawn(rank: int, ref: ProcRef) -> str:
            """Start rank's replacement: on its host if that lives, else at a new address on the least busy one.
            Refused once the hosts are shut down (their node hosts are gone: a replacement asked of one never
            answers, and its revived ref would wait for good)."""
            if self.closed or (self._root is not None and self._root.closed):
                raise RuntimeError(f"{self!r} has been shut down: rank {rank} is not restarted")
            home = homes[rank]
            if not home.lost:
                self._start(home, ref, configs[rank])
                return ref.address
            node, address = self._new_home()
            if GPU_DIM in per:
                log.warning("rank %d moves to %s, sharing GPU %d of its own rank there", rank, node, rank % count)
            configs[rank], homes[rank] = config_for(rank, node, address), node
            self._start(node, ref, configs[rank])
            self._refill()
            log.warning("rank %d of %s restarts on %s at %s: %s was lost", rank, mesh_name, node, address, home)
            return address

        return ProcMesh(mesh_name, {"hosts": len(self._nodes), **per}, procs, policy, respawn, kill=self._kill)

    def _forget_workers(self, why: str) -> None:
        """The mesh is shut down: every worker it started counts as gone (on the runtime's thread, where the
        registry's death hooks run; a shutdown runs on a worker thread, or a synchronous program's own)."""

        def forget() -> None:
            for node in self._nodes:
                for ref in list(node.procs.values()):
                    self._rt.registry.mark_dead(ref, why)
                node.procs.clear()

        self._rt.driver.on_thread(forget)

    # ------------------------------------------------------------------ the hosts' answers, on the runtime thread

    def _lifeline_lost(self, index: int, why: str) -> None:
        """A host's lifeline ended (lifeline thread): mark its host lost on the runtime's thread."""
        if 0 <= index < len(self._nodes):
            self._relay.call_soon(lambda: self._lose(self._nodes[index], why))

    def _start(self, node: RemoteNode, ref: ProcRef, config: dict[str, Any]) -> None:
        index = self._rt.counter("worker")
        node.procs[index] = ref

        def spawned(pid: Any, error: BaseException | None) -> None:
            # (news of a spawn another replaced since, on a host lost meanwhile, is not the replacement's)
            if error is not None:
                tracked = node.procs.pop(index, None)
                if tracked is not None and not self._superseded(ref, index):
                    self._rt.registry.mark_dead(ref, f"could not start on {node}: {error}")
            elif index in node.procs and not self._superseded(ref, index) and ref.pid != pid:
                self._rt.registry.set_pid(ref, int(pid))

        self._request(node, "spawn", (index, config), spawned)

    def _kill(self, ref: ProcRef) -> None:
        """Have its host SIGKILL the worker serving ``ref`` (one that ignored a stop); its exit reports back."""
        serving = self._serving(ref)
        if serving is not None and not serving[1].lost:
            self._request(serving[1], "kill", (serving[0],), lambda _value, _error: None)

    def _serving(self, ref: ProcRef) -> tuple[int, RemoteNode] | None:
        """The spawn index and host of the latest worker started for ``ref`` and not yet reaped.

        A tcp address, and so its ref, passes to a new worker once the old
        one stopped and its port was handed out again: news of the old one
        (its exit, reported late) must not fail the new one.
        """
        started = [(index, node) for node in self._nodes for index, placed in node.procs.items() if placed is ref]
        return max(started, key=lambda pair: pair[0], default=None)

    def _superseded(self, ref: ProcRef, index: int) -> bool:
        """Whether a worker started after spawn ``index`` serves ``ref`` now."""
        serving = self._serving(ref)
        return serving is not None and serving[0] > index

    def _watch(self, node: RemoteNode) -> None:
        def exited(reports: Any, error: BaseException | None) -> None:
            if self.closed:
                return
            if error is not None:
                first = str(error).splitlines()[0] if str(error) else ""
                self._lose(node, f"{type(error).__name__}: {first}")
                return
            for index, pid, code in reports:
                ref = node.procs.pop(index, None)
                if ref is not None and not self._superseded(ref, index):
                    self._rt.registry.mark_dead(ref, f"process {pid} on {node.ip} {exit_reason(code)}")
            self._watch(node)

        self._request(node, "exits", (), exited)

    def _lose(self, node: RemoteNode, why: str) -> None:
        if node.lost or self.closed:
            return
        node.lost = why
        log.error("lost %s: %s", node, node.lost)
        for index, ref in list(node.procs.items()):
            if not self._superseded(ref, index):
                self._rt.registry.mark_dead(ref, f"its {node} was lost ({node.lost})")
        node.procs.clear()
        # lost otherwise than by its lifeline (a request failed: a host briefly unreachable may live on), its
        # workers would run beside their replacements: its line is ended, and it ends them
        self._lifelines.cut(node.index)

    def _new_home(self) -> tuple[RemoteNode, str]:
        """Where a lost host's rank restarts: the live host running the fewest workers that has a free address
        ready, and that address (one whose pool ran dry, refilling, passes it on to the next)."""
        live = sorted((node for node in self._nodes if not node.lost), key=lambda node: (len(node.procs), node.index))
        if not live:
            raise RuntimeError(f"every host of {self!r} is lost")
        for node in live:
            free = self._free_addresses(node, 1, set())
            if free is not None:
                return node, free[0]
        self._refill()
        raise RuntimeError(f"no live host of {self!r} has a free address ready yet (their pools are refilling)")

    def _ensure_addresses(self, count: int) -> None:
        """At least ``count`` ready addresses on every host; a round trip to them only off the event loop."""
        short = [node for node in self._nodes if len(node.addresses) < count]
        if not short:
            return
        if loop_running():
            raise ValueError(
                f"spawn_procs() needs {count} addresses per host but {short[0]} has {len(short[0].addresses)} ready, "
                "and fetching more would block this event loop: spawn fewer processes per call "
                f"(at most {ADDRESS_POOL} while the pool refills), or call it from a thread"
            )
        for node, addresses in zip(short, self._fetch_addresses(short, count + ADDRESS_POOL), strict=True):
            node.pool(addresses)

    def _refill(self) -> None:
        for node in self._nodes:
            if len(node.addresses) < ADDRESS_POOL // 2 and not node.lost and not node.refilling:

                def got(addresses: Any, error: BaseException | None, node: RemoteNode = node) -> None:
                    node.refilling = False
                    if error is None:
                        node.pool(addresses)

                node.refilling = True
                try:
                    self._request(node, "addresses", (ADDRESS_POOL,), got)
                except BaseException:
                    node.refilling = False
                    raise
