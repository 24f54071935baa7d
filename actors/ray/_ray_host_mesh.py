"""``host_mesh()``: the nodes of a Ray cluster as one :class:`~actors.HostMesh`.

Ray reserves one bundle per node (a ``STRICT_SPREAD`` placement group) and
starts a :class:`~actors.ray._node.NodeHost` in each: that node's forkserver.
``spawn_procs`` then asks each node host to fork its share of the workers and
returns a :class:`~actors.ProcMesh` whose first dimension is ``hosts``. Ray
places, starts and watches; actor messages go over the workers' own tcp
sockets, CURVE-authenticated with the session's keys.

Liveness: a worker's exit is reaped by its node's forkserver and reported
through the node host; a node host that dies (its Ray worker or the whole
node lost) fails every process it held. Either way the calls waiting on them
raise :class:`~actors.ActorDied`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .._meshes._host_mesh import HostMesh, check_spawn, main_module, worker_config
from .._meshes._proc_mesh import ProcMesh
from .._processes._devices import GPU_DIM, gpu_env
from .._runtime._core import Runtime, at_runtime_exit, current_runtime, runtime
from .._runtime._value_mesh import select
from .._shared._liveness import ProcRef
from .._shared._loops import loop_running
from .._shared._restart import RestartMode, RestartPolicy
from .._shared._session import TCP_HOST_ENV, TRANSPORT_ENV, session_keys, tcp_host
from ._lifeline import Lifelines
from ._node import NodeHost
from ._relay import Relay

__all__ = ["RayHostMesh", "host_mesh", "host_mesh_async"]

log = logging.getLogger("actors.ray")

#: Free tcp addresses asked of each node ahead of need, so ``spawn_procs`` rarely waits for Ray.
ADDRESS_POOL = 64
#: How long the setup calls (reserving nodes, starting node hosts) may take.
SETUP_TIMEOUT = 120.0
#: How long a node host may take to stop its workers when the host mesh shuts down.
STOP_TIMEOUT = 15.0


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ImportError("actors.ray needs Ray: pip install 'actors[ray]'") from None
    return ray


@dataclass
class _Node:
    """One node host, as the controller sees it."""

    index: int
    handle: Any
    ip: str
    pid: int
    node_id: str
    gpus: list[str]
    addresses: list[str] = field(default_factory=list)
    #: Workers started there and not yet reaped, by spawn index.
    procs: dict[int, ProcRef] = field(default_factory=dict)
    lost: str = ""

    def __str__(self) -> str:
        return f"host {self.index} ({self.ip}, Ray node {self.node_id[:8]})"


def exit_reason(code: int) -> str:
    """A reaped worker's exit code, in words."""
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
        return f"killed by signal {-code}"
    return f"exited with code {code}"


class RayHostMesh(HostMesh):
    """Hosts placed by Ray: ``spawn_procs(per_host)`` starts ``per_host`` processes on each."""

    def __init__(self, rt: Runtime, placement_group: Any, nodes: list[_Node], lifelines: Lifelines) -> None:
        self._rt = rt
        self._pg = placement_group
        self._nodes = nodes
        self._relay = Relay(rt)
        self._lifelines = lifelines
        self._root: RayHostMesh | None = None
        self.closed = False
        for node in nodes:
            self._watch(node)
        lifelines.watch(self._lifeline_lost)
        at_runtime_exit(self.shutdown)

    def _lifeline_lost(self, index: int, why: str) -> None:
        """A node host's lifeline ended (lifeline thread): mark its node lost on the runtime's thread."""
        if 0 <= index < len(self._nodes):
            self._relay.call_soon(lambda: self._lose(self._nodes[index], why))

    def __repr__(self) -> str:
        return f"<RayHostMesh {[node.ip for node in self._nodes]}>"

    @property
    def extent(self) -> dict[str, int]:
        return {"hosts": len(self._nodes)}

    def slice(self, hosts: int | slice) -> RayHostMesh:
        """Some of the hosts, as a host mesh of their own (``hosts=0``, ``hosts=slice(1, None)``).

        A slice shares its parent's node hosts and reservation: spawn on it
        to place processes on those hosts only; shut down the parent.
        """
        ranks, _ = select(
            self.extent, {"hosts": hosts if isinstance(hosts, slice) else slice(hosts, hosts + 1 or None)}
        )
        if not ranks:
            raise IndexError(f"hosts={hosts!r} selects none of {len(self._nodes)} hosts")
        view = object.__new__(RayHostMesh)
        view._rt, view._pg, view._relay = self._rt, self._pg, self._relay
        view._nodes = [self._nodes[r] for r in ranks]
        view._root = self._root or self
        view.closed = False
        return view

    @property
    def hosts(self) -> list[dict[str, Any]]:
        """Each host: its cluster address, Ray node id, node host pid, GPUs and whether it was lost."""
        return [
            {"ip": n.ip, "node": n.node_id, "pid": n.pid, "gpus": list(n.gpus), "lost": n.lost} for n in self._nodes
        ]

    def spawn_procs(
        self,
        per_host: dict[str, int] | None = None,
        bootstrap: Callable[[], None] | None = None,
        name: str | None = None,
        *,
        threads: int = 1,
        restart: RestartMode = "never",
        max_restarts: int = 3,
        restart_period: float = 60.0,
    ) -> ProcMesh:
        """Start ``per_host`` processes on every host; the mesh's extent is ``{"hosts": N, **per_host}``."""
        if self.closed or (self._root is not None and self._root.closed):
            raise RuntimeError("this Ray host mesh has been shut down")
        policy = RestartPolicy(restart, max_restarts, restart_period)
        per, boot = check_spawn(per_host, bootstrap)
        if "hosts" in per:
            raise ValueError("per_host counts processes on each host; 'hosts' is the host mesh's own dimension")
        lost = [str(node) for node in self._nodes if node.lost]
        if lost:
            raise RuntimeError(f"cannot spawn on a host mesh that lost {', '.join(lost)}")
        rt = self._rt
        count = math.prod(per.values())
        self._ensure_addresses(count)
        main = main_module()
        mesh_name = name or f"procs{rt.counter('mesh')}"
        procs: list[ProcRef] = []
        configs: list[dict[str, Any]] = []
        homes: list[_Node] = []

        def config_for(rank: int, node: _Node, address: str) -> dict[str, Any]:
            """Rank's worker on ``node``: the GPU of its place among its host's ``count`` processes."""
            env = gpu_env(per, rank % count, node.gpus)
            return worker_config(rt, f"{mesh_name}.{rank}", address, rank, main, boot, threads, env).to_wire()

        for node in self._nodes:
            for _ in range(count):
                rank, address = len(procs), node.addresses.pop()
                ref = rt.registry.placed(address)
                configs.append(config_for(rank, node, address))
                procs.append(ref)
                homes.append(node)
                self._start(node, ref, configs[-1])
        self._refill()

        def respawn(rank: int, ref: ProcRef) -> str:
            """Start rank's replacement: on its host if that lives, else at a new address on the least busy one."""
            home = homes[rank]
            if not home.lost:
                self._start(home, ref, configs[rank])
                return ref.address
            node = self._live_node()
            if not node.addresses:
                raise RuntimeError(f"{node} has no free address ready yet")
            address = node.addresses.pop()
            if GPU_DIM in per:
                log.warning("rank %d moves to %s, sharing GPU %d of its own rank there", rank, node, rank % count)
            configs[rank], homes[rank] = config_for(rank, node, address), node
            self._start(node, ref, configs[rank])
            self._refill()
            log.warning("rank %d of %s restarts on %s at %s: %s was lost", rank, mesh_name, node, address, home)
            return address

        return ProcMesh(mesh_name, {"hosts": len(self._nodes), **per}, procs, policy, respawn, kill=self._kill)

    def shutdown(self) -> None:
        """End every process on every host, the node hosts and the Ray reservation (blocks until done)."""
        if self._root is not None:
            raise RuntimeError("shut down the Ray host mesh this one was sliced from: they share their hosts")
        if self.closed:
            return
        self.closed = True
        self._relay.close()
        self._lifelines.close()
        with contextlib.suppress(Exception):
            ray = _ray()
            if ray.is_initialized():
                live = [n.handle.stop.remote() for n in self._nodes if not n.lost]
                with contextlib.suppress(Exception):
                    ray.get(live, timeout=STOP_TIMEOUT)
                for node in self._nodes:
                    with contextlib.suppress(Exception):
                        ray.kill(node.handle)
                with contextlib.suppress(Exception):
                    ray.util.remove_placement_group(self._pg)
        for node in self._nodes:
            for ref in list(node.procs.values()):
                self._rt.registry.mark_dead(ref, "its Ray host mesh was shut down")
            node.procs.clear()

    async def shutdown_async(self) -> None:
        """:meth:`shutdown` for code on an event loop: Ray is waited on by a worker thread."""
        await asyncio.to_thread(self.shutdown)

    def __enter__(self) -> RayHostMesh:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ Ray's answers, on the runtime thread

    def _start(self, node: _Node, ref: ProcRef, config: dict[str, Any]) -> None:
        index = self._rt.counter("worker")
        node.procs[index] = ref

        def spawned(pid: Any, error: BaseException | None) -> None:
            if error is not None:
                node.procs.pop(index, None)
                self._rt.registry.mark_dead(ref, f"could not start on {node}: {error}")
            elif ref.pid != pid:
                self._rt.registry.set_pid(ref, int(pid))

        self._relay.when_done(node.handle.spawn.remote(index, config), spawned)

    def _kill(self, ref: ProcRef) -> None:
        """Have its node host SIGKILL the worker serving ``ref`` (one that ignored a stop); its exit reports back."""
        serving = self._serving(ref)
        if serving is not None and not serving[1].lost:
            self._relay.when_done(serving[1].handle.kill.remote(serving[0]), lambda _value, _error: None)

    def _serving(self, ref: ProcRef) -> tuple[int, _Node] | None:
        """The spawn index and node of the latest worker started for ``ref`` and not yet reaped.

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

    def _watch(self, node: _Node) -> None:
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

        self._relay.when_done(node.handle.exits.remote(), exited)

    def _lose(self, node: _Node, why: str) -> None:
        if node.lost or self.closed:
            return
        node.lost = why
        log.error("lost %s: %s", node, node.lost)
        for index, ref in list(node.procs.items()):
            if not self._superseded(ref, index):
                self._rt.registry.mark_dead(ref, f"its {node} was lost ({node.lost})")
        node.procs.clear()

    def _live_node(self) -> _Node:
        """The live host of this mesh running the fewest workers (a lost host's replacements go there)."""
        live = [node for node in self._nodes if not node.lost]
        if not live:
            raise RuntimeError(f"every host of {self!r} is lost")
        return min(live, key=lambda node: (len(node.procs), node.index))

    def _ensure_addresses(self, count: int) -> None:
        """At least ``count`` ready addresses on every node; a round trip to Ray only off the event loop."""
        short = [node for node in self._nodes if len(node.addresses) < count]
        if not short:
            return
        if loop_running():
            raise ValueError(
                f"spawn_procs() needs {count} addresses per host but {short[0]} has {len(short[0].addresses)} ready, "
                "and fetching more would block this event loop: spawn fewer processes per call "
                f"(at most {ADDRESS_POOL} while the pool refills), or call it from a thread"
            )
        ray = _ray()
        fresh = ray.get([n.handle.addresses.remote(count + ADDRESS_POOL) for n in short], timeout=SETUP_TIMEOUT)
        for node, addresses in zip(short, fresh, strict=True):
            node.addresses.extend(addresses)

    def _refill(self) -> None:
        for node in self._nodes:
            if len(node.addresses) < ADDRESS_POOL // 2 and not node.lost:

                def got(addresses: Any, error: BaseException | None, node: _Node = node) -> None:
                    if error is None:
                        node.addresses.extend(addresses)

                self._relay.when_done(node.handle.addresses.remote(ADDRESS_POOL), got)


def _use_tcp(bind_host: str) -> None:
    """Make this process's inbox a tcp one on the cluster address (its runtime may not exist yet)."""
    existing = current_runtime()
    if existing is None:
        os.environ[TRANSPORT_ENV] = "tcp"
        os.environ.setdefault(TCP_HOST_ENV, bind_host)
        return
    host = tcp_host(existing.address)
    if host is None:
        raise RuntimeError(
            "actors.ray.host_mesh() needs this process's inbox on tcp, but the actors runtime already started "
            "on ipc: call host_mesh() before anything else that uses actors, or start the program with "
            f"{TRANSPORT_ENV}=tcp {TCP_HOST_ENV}=<this node's cluster address>"
        )


def host_mesh(
    address: str | None = None,
    hosts: int = 1,
    gpus_per_host: int = 0,
    cpus_per_host: int = 1,
    *,
    bind_host: str | None = None,
) -> RayHostMesh:
    """Reserve ``hosts`` Ray nodes (one bundle each) and start an actors host on each.

    ``address`` is a Ray cluster address (``"auto"`` for the one this machine
    joined, None to start or reuse a local Ray). Each bundle holds
    ``cpus_per_host`` CPUs and ``gpus_per_host`` GPUs; processes spawned
    with a ``gpus`` dimension get the GPUs Ray gave their host. Every
    address binds to the node's cluster IP (``bind_host`` overrides it, for
    this process and the hosts). Blocks until the hosts are up.
    """
    if type(hosts) is not int or hosts < 1:
        raise ValueError(f"hosts must be a positive int, not {hosts!r}")
    for what, value in (("gpus_per_host", gpus_per_host), ("cpus_per_host", cpus_per_host)):
        if not isinstance(value, (int, float)) or value < 0:
            raise ValueError(f"{what} must be a non-negative number, not {value!r}")
    ray = _ray()
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if not ray.is_initialized():
        ray.init(address=address, log_to_driver=True, include_dashboard=False)
    _use_tcp(bind_host or ray.util.get_node_ip_address())
    rt = runtime()
    keys = session_keys()
    if keys is None:
        raise RuntimeError("hosts on other machines need CURVE on tcp; unset ACTORS_CURVE=0")
    bundle: dict[str, float] = {"CPU": cpus_per_host}
    if gpus_per_host:
        bundle["GPU"] = gpus_per_host
    pg = placement_group([dict(bundle) for _ in range(hosts)], strategy="STRICT_SPREAD")
    ready, _ = ray.wait([pg.ready()], timeout=SETUP_TIMEOUT)
    if not ready:
        remove_placement_group(pg)
        raise RuntimeError(
            f"Ray could not reserve {hosts} separate nodes with {bundle} each within {SETUP_TIMEOUT:g}s "
            f"(the cluster has {len(ray.nodes())} nodes: {ray.cluster_resources()})"
        )
    lifelines = Lifelines(tcp_host(rt.address) or "127.0.0.1")
    remote = ray.remote(NodeHost)
    handles = [
        remote.options(
            num_cpus=cpus_per_host,
            num_gpus=gpus_per_host,
            max_concurrency=8,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i),
        ).remote(keys[0].decode(), keys[1].decode(), bind_host, [*lifelines.address, lifelines.key.hex(), i])
        for i in range(hosts)
    ]
    try:
        infos = ray.get([h.info.remote() for h in handles], timeout=SETUP_TIMEOUT)
        pools = ray.get([h.addresses.remote(ADDRESS_POOL) for h in handles], timeout=SETUP_TIMEOUT)
    except BaseException:
        for h in handles:
            with contextlib.suppress(Exception):
                ray.kill(h)
        remove_placement_group(pg)
        lifelines.close()
        raise
    nodes = [
        _Node(i, h, info["ip"], info["pid"], info["node"], list(info["gpus"]), pool)
        for i, (h, info, pool) in enumerate(zip(handles, infos, pools, strict=True))
    ]
    return RayHostMesh(rt, pg, nodes, lifelines)


async def host_mesh_async(
    address: str | None = None,
    hosts: int = 1,
    gpus_per_host: int = 0,
    cpus_per_host: int = 1,
    *,
    bind_host: str | None = None,
) -> RayHostMesh:
    """:func:`host_mesh` for code on an event loop: the reservation is waited for on a worker thread.

    Each Ray wait inside is bounded (``SETUP_TIMEOUT``); the loop keeps running meanwhile.
    """
    return await asyncio.to_thread(host_mesh, address, hosts, gpus_per_host, cpus_per_host, bind_host=bind_host)
