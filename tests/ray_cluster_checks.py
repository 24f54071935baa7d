"""Checks of ``actors.ray`` on a Ray cluster of several nodes on this machine (run by test_ray.py).

Each node of ``ray.cluster_utils.Cluster`` counts as a separate host: its
workers are started by its own node host, bind tcp with CURVE, and the
controller learns of their deaths only through Ray. Prints one JSON line per
check: ``{"check": name, "ok": bool, "detail": ...}``.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
import traceback

import zmq

import actors
from actors import Actor, ActorDied, Channel, Port, SupervisionError, endpoint

RESULTS: list[dict[str, object]] = []


class Where(Actor):
    def __init__(self, tag: str = "") -> None:
        self.tag = tag

    @endpoint
    async def where(self) -> list[object]:
        return [os.getpid(), os.environ.get("ACTORS_TCP_HOST"), self.tag, actors.current_rank().rank]

    @endpoint
    async def host(self) -> str:
        return actors.host_id()

    @endpoint
    async def hang(self) -> None:
        await asyncio.Event().wait()  # answers only by its process dying

    @endpoint
    async def address(self) -> str:
        from actors._runtime import runtime

        return runtime().address

    @endpoint
    async def call_peer(self, peer: Where) -> list[object]:
        return await peer.where.call_one()

    @endpoint
    async def stream_to(self, port: Port[int], n: int) -> None:
        for i in range(n):
            port.send(i)
        port.send(None)


def check(name: str):  # type: ignore[no-untyped-def]
    def wrap(fn):  # type: ignore[no-untyped-def]
        async def run(*args):  # type: ignore[no-untyped-def]
            started = time.monotonic()
            try:
                detail = await fn(*args)
                RESULTS.append({"check": name, "ok": True, "detail": detail, "s": round(time.monotonic() - started, 3)})
            except BaseException as exc:
                RESULTS.append({"check": name, "ok": False, "detail": f"{type(exc).__name__}: {exc}", "tb": traceback.format_exc()})
            print(json.dumps(RESULTS[-1]), flush=True)

        return run

    return wrap


@check("call_across_nodes")
async def call_across_nodes(hosts):  # type: ignore[no-untyped-def]
    async with hosts.spawn_procs(per_host={"procs": 1}) as procs:
        assert procs.extent == {"hosts": 2, "procs": 1}, procs.extent
        mesh = procs.spawn("where", Where, "x")
        results = [v for _, v in await mesh.where.call()]
        pids = {r[0] for r in results}
        assert len(pids) == 2 and [r[3] for r in results] == [0, 1], results
        addresses = [v for _, v in await mesh.address.call()]
        assert all(a.startswith("tcp://") for a in addresses), addresses
        info = hosts.hosts
        assert len({h["node"] for h in info}) == 2, info
        # actor to actor, across the two nodes, over their own sockets
        other = await mesh.slice(hosts=0).call_peer.call_one(mesh.slice(hosts=1))
        assert other[0] == results[1][0], (other, results)
        return {"addresses": addresses}


@check("ports_across_nodes")
async def ports_across_nodes(hosts):  # type: ignore[no-untyped-def]
    async with hosts.spawn_procs(per_host={"procs": 1}) as procs:
        mesh = procs.spawn("streamer", Where)
        port, recv = Channel.open(int)
        await mesh.slice(hosts=1).stream_to.call_one(port, 1000)
        got = []
        while (item := await asyncio.wait_for(recv.recv(), 30)) is not None:
            got.append(item)
        assert got == list(range(1000)), got[:10]
        return {"items": len(got)}


@check("worker_killed_fails_calls")
async def worker_killed_fails_calls(hosts):  # type: ignore[no-untyped-def]
    async with hosts.spawn_procs(per_host={"procs": 1}) as procs:
        mesh = procs.spawn("victim", Where)
        pid = (await mesh.slice(hosts=1).where.call_one())[0]
        os.kill(pid, signal.SIGKILL)
        started = time.monotonic()
        try:
            await asyncio.wait_for(mesh.slice(hosts=1).where.call_one(), 10)
        except ActorDied as exc:
            took = time.monotonic() - started
            assert took < 2.0, took
            return {"seconds": round(took, 3), "error": str(exc)[:160]}
        raise AssertionError("a call to a killed worker answered")


@check("key_refused")
async def key_refused(hosts):  # type: ignore[no-untyped-def]
    """A client with CURVE but not the session's key, and one without CURVE, deliver nothing."""
    import msgpack

    from actors._wire import PROTOCOL_VERSION, Kind, record_prefix

    procs = hosts.spawn_procs(per_host={"procs": 1})
    ctx = zmq.Context()
    try:
        port, recv = Channel.open(str)
        from actors._runtime import runtime

        target = runtime().address
        body = msgpack.packb([int(Kind.PORT), port._id, "intruder"])
        header = msgpack.packb([PROTOCOL_VERSION, "tcp://127.0.0.1:9", 1])
        socks = []
        for curve in (False, True):
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            if curve:  # knows the server's public key, but holds its own key pair
                public, secret = zmq.curve_keypair()
                sock.curve_serverkey = os.environ["ACTORS_CURVE_PUBLIC"].encode()
                sock.curve_publickey, sock.curve_secretkey = public, secret
            sock.connect(target)
            sock.send_multipart([header, record_prefix(0, len(body)) + body])
            socks.append(sock)
        mesh = procs.spawn("friend", Where)
        await mesh.slice(hosts=0).where.call_one()  # the session's own traffic flows meanwhile
        await asyncio.sleep(1.0)  # give the intruders every chance
        assert recv.qsize() == 0, "an intruder delivered a message"
        for sock in socks:
            sock.close()
        return {"intruders_delivered": 0}
    finally:
        ctx.term()
        await procs.stop()


@check("spawn_beyond_ready_addresses_refused_on_a_loop")
async def spawn_beyond_ready_addresses_refused_on_a_loop(hosts):  # type: ignore[no-untyped-def]
    """Fetching more addresses would block this loop on Ray: refused, with the way out, and nothing started."""
    from actors.ray._host_mesh import ADDRESS_POOL

    try:
        hosts.spawn_procs(per_host={"procs": 3 * ADDRESS_POOL})
    except ValueError as exc:
        assert "would block this event loop" in str(exc), exc
        async with hosts.spawn_procs(per_host={"procs": 1}) as procs:  # the mesh still serves
            assert len(await procs.spawn("after", Where).where.call()) == 2
        return {"error": str(exc)[:120]}
    raise AssertionError("spawn_procs waited on Ray on the event loop's thread")


@check("node_host_lost_fails_calls")
async def node_host_lost_fails_calls(hosts):  # type: ignore[no-untyped-def]
    procs = hosts.spawn_procs(per_host={"procs": 1})
    mesh = procs.spawn("lost", Where)
    worker_pid = (await mesh.slice(hosts=1).where.call_one())[0]
    host_pid = hosts.hosts[1]["pid"]
    pending = asyncio.ensure_future(mesh.slice(hosts=1).hang.call_one())
    await asyncio.sleep(0.2)  # the call is on its way (a guard, not synchronisation: either order must fail it)
    os.kill(host_pid, signal.SIGKILL)  # the node host: its forkserver ends its workers
    started = time.monotonic()
    try:
        await asyncio.wait_for(pending, 10)
    except ActorDied as exc:
        took = time.monotonic() - started
        try:
            await asyncio.wait_for(mesh.slice(hosts=1).where.call_one(), 10)
            raise AssertionError("a later call to a lost host's worker answered")
        except SupervisionError:  # ActorDied, or the mesh's fault once the failure went unhandled
            pass
        assert hosts.hosts[1]["lost"], hosts.hosts
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.kill(worker_pid, 0)
            except ProcessLookupError:
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError(f"worker {worker_pid} outlived its node host") from None
        assert took < 2.0, took
        return {"seconds": round(took, 3), "error": str(exc)[:200]}
    finally:
        await procs.stop()
    raise AssertionError("a call to a lost host's worker answered")


@check("weights_across_nodes")
async def weights_across_nodes(hosts):  # type: ignore[no-untyped-def]
    """A publisher on one node, a consumer on the other: the bytes come over the tcp transport, whole."""
    from support import WeightSink, WeightSource

    async with hosts.spawn_procs(per_host={"procs": 1}) as procs:
        where = procs.spawn("where", Where)
        host_ids = [v for _, v in await where.host.call()]
        assert host_ids[0] != host_ids[1], host_ids
        source = procs.spawn("source", WeightSource, "tcp")
        sink = procs.spawn("sink", WeightSink)
        manifest = await source.slice(hosts=0).publish.call_one(3)
        assert manifest.transport == "tcp" and manifest.publisher_host == host_ids[0], manifest
        actors.send(sink.slice(hosts=1).update_weights, (manifest,))
        installs = await asyncio.wait_for(sink.slice(hosts=1).install_until.call_one(3), 60)
        return {"bytes": manifest.total_nbytes, "installs": installs, "served_from": manifest.handle.host}


@check("pipeline_across_nodes")
async def pipeline_across_nodes(address):  # type: ignore[no-untyped-def]
    """``--ray``: trainer on host 0, generators on both, weights over shm here and tcp there, 300 steps."""
    import tempfile

    from pipeline import Config, run_pipeline

    config = Config(task="bandit", steps=300, generators=2, ray=address, ray_hosts=2, target_score=None)
    config.run_dir = tempfile.mkdtemp(prefix="ray-pipeline-")
    result = await asyncio.wait_for(run_pipeline(config, quiet=True), 240)
    assert result.steps == 300, result
    routes = result.weight_routes
    assert len(routes) == 2 and routes[0].endswith(": shm") and routes[1].endswith(": tcp"), routes
    assert all(count > 0 for count in result.rollouts.values()), result.rollouts
    return {"routes": routes, "rollouts": result.rollouts, "score": result.score, "seconds": round(result.seconds, 2)}


@check("pipeline_placement_refused")
async def pipeline_placement_refused(address):  # type: ignore[no-untyped-def]
    """More hosts than live nodes, or generators that do not spread evenly: refused before anything starts."""
    import tempfile

    from pipeline import Config, run_pipeline

    errors = []
    for generators, hosts, expected in ((2, 4, "has 3 live nodes"), (3, 2, "must be a multiple of the 2 Ray hosts")):
        config = Config(task="bandit", steps=10, generators=generators, ray=address, ray_hosts=hosts)
        config.run_dir = tempfile.mkdtemp(prefix="ray-refused-")
        try:
            await asyncio.wait_for(run_pipeline(config, quiet=True), 60)
        except ValueError as exc:
            assert expected in str(exc), exc
            errors.append(str(exc))
        else:
            raise AssertionError(f"--generators {generators} --ray-hosts {hosts} ran")
    return {"errors": errors}


@check("raylet_killed_fails_calls")
async def raylet_killed_fails_calls(cluster):  # type: ignore[no-untyped-def]
    """A whole Ray node removed (raylet and its workers killed): its actors' calls fail within 2 s.

    Ray's own health check takes far longer; the node host's lifeline to
    the controller closes the moment its process dies.
    """
    from actors.ray import host_mesh_async

    hosts = await host_mesh_async(hosts=2)
    try:
        procs = hosts.spawn_procs(per_host={"procs": 1})
        mesh = procs.spawn("far", Where)
        await mesh.where.call()
        head = cluster.head_node.node_id
        index = next(i for i, h in enumerate(hosts.hosts) if h["node"] != head)
        victim = next(n for n in cluster.list_all_nodes() if n.node_id == hosts.hosts[index]["node"])
        pending = asyncio.ensure_future(mesh.slice(hosts=index).hang.call_one())
        await asyncio.sleep(0.2)  # the call is on its way (either order must fail it)
        started = time.monotonic()
        removing = asyncio.ensure_future(asyncio.to_thread(cluster.remove_node, victim, False))
        try:
            await asyncio.wait_for(pending, 30)
            raise AssertionError("a call to a removed node's actor answered")
        except ActorDied as exc:
            took = time.monotonic() - started
            error = str(exc)
        await removing
        assert hosts.hosts[index]["lost"], hosts.hosts
        assert took < 2.0, (took, error)
        await procs.stop()
        return {"seconds": round(took, 3), "lost": hosts.hosts[index]["lost"], "error": error[:200]}
    finally:
        await hosts.shutdown_async()


async def main() -> None:
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    for _ in range(2):
        cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        from actors.ray import host_mesh

        hosts = host_mesh(hosts=2, cpus_per_host=1)
        try:
            await call_across_nodes(hosts)
            await ports_across_nodes(hosts)
            await worker_killed_fails_calls(hosts)
            await key_refused(hosts)
            await spawn_beyond_ready_addresses_refused_on_a_loop(hosts)
            await weights_across_nodes(hosts)
            await node_host_lost_fails_calls(hosts)
        finally:
            hosts.shutdown()
        await pipeline_placement_refused(cluster.address)
        await pipeline_across_nodes(cluster.address)
        await raylet_killed_fails_calls(cluster)
    finally:
        ray.shutdown()
        cluster.shutdown()
    print(json.dumps({"done": True}), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
    sys.exit(0)
