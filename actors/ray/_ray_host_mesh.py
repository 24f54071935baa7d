"""``host_mesh()``: the nodes of a Ray cluster as one :class:`~actors.HostMesh`.

Ray reserves one bundle per node (a ``STRICT_SPREAD`` placement group) and
starts a :class:`~actors.ray._node.NodeHost` in each: that node's forkserver.
``spawn_procs`` then asks each node host to fork its share of the workers and
returns a :class:`~actors.ProcMesh` whose first dimension is ``hosts``. Ray
places, starts and watches; what a host mesh of remote forkservers does is
:class:`~actors._meshes._remote_host_mesh.RemoteHostMesh`, shared with
``attach_to_workers``; the requests to the node hosts travel as Ray calls.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
from typing import Any

from .._meshes._remote_host_mesh import ADDRESS_POOL, RemoteHostMesh, RemoteNode, Requested, use_tcp
from .._processes._lifeline import Lifelines, silence_bound
from .._runtime._core import Runtime, at_runtime_exit, runtime
from .._shared._loops import loop_running
from .._shared._session import session_keys, tcp_host
from ._node import NodeHost

__all__ = ["RayHostMesh", "host_mesh", "host_mesh_async"]

log = logging.getLogger("actors.ray")

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


class RayHostMesh(RemoteHostMesh):
    """Hosts placed by Ray: ``spawn_procs(per_host)`` starts ``per_host`` processes on each."""

    def __init__(self, rt: Runtime, placement_group: Any, nodes: list[RemoteNode], lifelines: Lifelines) -> None:
        super().__init__(rt, nodes, lifelines)
        self._pg = placement_group
        at_runtime_exit(lambda: self._release(end_hosts=True))

    def __repr__(self) -> str:
        return f"<RayHostMesh {[node.ip for node in self._nodes]}>"

    def _request(self, node: RemoteNode, op: str, args: tuple[Any, ...], done: Requested) -> None:
        self._relay.when_done(getattr(node.handle, op).remote(*args).future(), done)

    def _fetch_addresses(self, nodes: list[RemoteNode], count: int) -> list[list[str]]:
        fresh: list[list[str]] = _ray().get([n.handle.addresses.remote(count) for n in nodes], timeout=SETUP_TIMEOUT)
        return fresh

    def _release(self, end_hosts: bool) -> None:
        """End every process on every host, the node hosts and the Ray reservation (at exit too)."""
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
        self._forget_workers("its Ray host mesh was shut down")


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
    this process and the hosts). Blocks until the hosts are up, so on an event loop's thread it refuses
    (``RuntimeError``): use :func:`host_mesh_async` there.
    """
    if loop_running():
        raise RuntimeError(
            "host_mesh() blocks until Ray has reserved and started the hosts (up to "
            f"{SETUP_TIMEOUT:g}s per wait) and will not block a running event loop: use "
            "`await actors.ray.host_mesh_async(...)`"
        )
    if type(hosts) is not int or hosts < 1:
        raise ValueError(f"hosts must be a positive int, not {hosts!r}")
    for what, value in (("gpus_per_host", gpus_per_host), ("cpus_per_host", cpus_per_host)):
        if not isinstance(value, (int, float)) or value < 0:
            raise ValueError(f"{what} must be a non-negative number, not {value!r}")
    lost_after = silence_bound()  # a bad setting refused before anything is reserved
    ray = _ray()
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if not ray.is_initialized():
        ray.init(address=address, log_to_driver=True, include_dashboard=False)
    use_tcp("actors.ray.host_mesh()", bind_host or ray.util.get_node_ip_address(), "this node's cluster address")
    rt = runtime()
    keys = session_keys()
    if keys is None:
        raise RuntimeError("hosts on other machines need CURVE on tcp; unset ACTORS_CURVE=0")
    bundle: dict[str, float] = {"CPU": cpus_per_host}
    if gpus_per_host:
        bundle["GPU"] = gpus_per_host
    pg = placement_group([dict(bundle) for _ in range(hosts)], strategy="STRICT_SPREAD")
    lifelines: Lifelines | None = None
    handles: list[Any] = []
    try:  # (whatever stops it, a Ctrl-C in a wait among them, gives back what it reserved and started)
        ready, _ = ray.wait([pg.ready()], timeout=SETUP_TIMEOUT)
        if not ready:
            raise RuntimeError(
                f"Ray could not reserve {hosts} separate nodes with {bundle} each within {SETUP_TIMEOUT:g}s "
                f"(the cluster has {len(ray.nodes())} nodes: {ray.cluster_resources()})"
            )
        lifelines = Lifelines(tcp_host(rt.address) or "127.0.0.1", lost_after)
        remote = ray.remote(NodeHost)
        for i in range(hosts):
            handles.append(
                remote.options(
                    num_cpus=cpus_per_host,
                    num_gpus=gpus_per_host,
                    max_concurrency=8,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i),
                ).remote(keys[0].decode(), keys[1].decode(), bind_host, lifelines.ticket(i))
            )
        infos = ray.get([h.info.remote() for h in handles], timeout=SETUP_TIMEOUT)
        pools = ray.get([h.addresses.remote(ADDRESS_POOL) for h in handles], timeout=SETUP_TIMEOUT)
    except BaseException:
        for h in handles:
            with contextlib.suppress(Exception):
                ray.kill(h)
        with contextlib.suppress(Exception):
            remove_placement_group(pg)
        if lifelines is not None:
            lifelines.close()
        raise
    nodes = [
        RemoteNode(
            i, h, info["ip"], info["pid"], info["node"], f"Ray node {info['node'][:8]}", list(info["gpus"]), pool
        )
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

    Each Ray wait inside is bounded (``SETUP_TIMEOUT``); the loop keeps running meanwhile. Cancelled (a
    ``wait_for`` that gave up, or the loop's end cancelling what is left on it), the reservation goes on on its
    thread, and the mesh it makes is shut down.
    """
    made: concurrent.futures.Future[RayHostMesh] = concurrent.futures.Future()

    def make() -> None:  # (a thread of its own, not a loop's executor: the loop may end first)
        try:
            mesh = host_mesh(address, hosts, gpus_per_host, cpus_per_host, bind_host=bind_host)
        except BaseException as exc:
            made.set_exception(exc)
        else:
            made.set_result(mesh)

    threading.Thread(target=make, name="actors-ray-host-mesh").start()
    try:
        return await asyncio.shield(asyncio.wrap_future(made))
    except asyncio.CancelledError:
        made.add_done_callback(_shut_down_unwanted)
        raise


def _shut_down_unwanted(made: concurrent.futures.Future[RayHostMesh]) -> None:
    """A host mesh whose caller gave up on it while it was made: its nodes and reservation are given back (on a
    thread of its own: this may be the loop's, where the mesh was made already)."""
    if made.exception() is None:
        threading.Thread(target=made.result().shutdown, name="actors-ray-unwanted-mesh").start()
