"""Checks of ``actors.ray`` on a Ray cluster of several nodes on this machine (run by test_ray.py).

Each node of ``ray.cluster_utils.Cluster`` counts as a separate host: its
workers are started by its own node host, bind tcp with CURVE, and the
controller learns of their deaths only through Ray. Prints one JSON line per
check: ``{"check": name, "ok": bool, "detail": ...}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
import traceback
from typing import Any

import zmq
from check_records import scratch

import actors
from actors import Actor, ActorDied, Channel, Port, SupervisionError, endpoint

RESULTS: list[dict[str, object]] = []


class Where(Actor):
    def __init__(self, tag: str = "") -> None:
        self.tag = tag
        self.hung = asyncio.Event()

    @endpoint
    async def where(self) -> list[object]:
        return [os.getpid(), os.environ.get("ACTORS_TCP_HOST"), self.tag, actors.current_rank().rank]

    @endpoint
    async def host(self) -> str:
        return actors.host_id()

    @endpoint
    async def hang(self) -> None:
        self.hung.set()
        await asyncio.Event().wait()  # answers only by its process dying

    @endpoint
    async def hanging(self) -> None:
        """Answer once a ``hang`` call is running here (endpoints run concurrently)."""
        await self.hung.wait()

    @endpoint
    async def address(self) -> str:
        from actors._runtime._core import runtime

        return runtime().address

    @endpoint
    async def call_peer(self, peer: Where) -> list[object]:
        return await peer.where.call_one()

    @endpoint
    async def remember(self, peer: Where) -> None:
        self.peer = peer

    @endpoint
    async def ask_remembered(self) -> list[object]:
        return await self.peer.where.call_one()

    @endpoint
    async def wait_on_remembered(self) -> str:
        return await wait_for_death(self.peer)

    @endpoint
    async def start_child(self) -> list[object]:
        """Spawn a process of this worker's own, on its node (the controller never hears of it)."""
        self.child_procs = actors.this_host().spawn_procs(per_host={"procs": 1}, name="child")
        self.child = self.child_procs.spawn("child", Where, "grandchild")
        return await self.child.where.call_one()

    @endpoint
    async def start_child_elsewhere(self, address: str) -> list[object]:
        """Spawn a process of this worker's own on another Ray node, through a host mesh of its own."""
        from actors.ray import host_mesh_async

        self.far_hosts = await host_mesh_async(address, hosts=3)  # every node: at least two are not this one
        here = os.environ.get("ACTORS_TCP_HOST")
        index = next(i for i, host in enumerate(self.far_hosts.hosts) if host["ip"] != here)
        self.child_procs = self.far_hosts.slice(index).spawn_procs(per_host={"procs": 1}, name="child")
        self.child = self.child_procs.spawn("child", Where, "grandchild")
        return await self.child.where.call_one()

    @endpoint
    async def child_handle(self) -> Where:
        return self.child  # type: ignore[no-any-return]

    @endpoint
    async def child_remember(self, peer: Where) -> None:
        await self.child.remember.call_one(peer)

    @endpoint
    async def child_asks_remembered(self) -> list[object]:
        return await self.child.ask_remembered.call_one()

    @endpoint
    async def child_waits_on_remembered(self) -> str:
        return await self.child.wait_on_remembered.call_one()

    async def __cleanup__(self, exc: BaseException | None) -> None:
        procs = getattr(self, "child_procs", None)
        if procs is not None:
            await procs.stop()
        far_hosts = getattr(self, "far_hosts", None)
        if far_hosts is not None:
            await far_hosts.shutdown_async()

    @endpoint
    async def freeze(self, fifo: str, seconds: float) -> None:
        """Say so through ``fifo``, then block this worker's event loop: it can no longer obey a stop."""
        with open(fifo, "w") as f:
            f.write("frozen")
        time.sleep(seconds)

    @endpoint
    async def stream_to(self, port: Port[int], n: int) -> None:
        for i in range(n):
            port.send(i)
        port.send(None)


async def wait_for_death(peer: Where) -> str:
    """Call ``peer.hang`` and say how it ended: only the peer's death can end it."""
    started = time.monotonic()
    try:
        await peer.hang.call_one()
    except ActorDied as exc:
        return f"ActorDied after {time.monotonic() - started:.3f}s: {exc}"
    return "answered"


def check(name: str):  # type: ignore[no-untyped-def]
    def wrap(fn):  # type: ignore[no-untyped-def]
        async def run(*args):  # type: ignore[no-untyped-def]
            started = time.monotonic()
            try:
                detail = await fn(*args)
                RESULTS.append({"check": name, "ok": True, "detail": detail, "s": round(time.monotonic() - started, 3)})
            except BaseException as exc:
                RESULTS.append(
                    {"check": name, "ok": False, "detail": f"{type(exc).__name__}: {exc}", "tb": traceback.format_exc()}
                )
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

    from actors._wire._records import PROTOCOL_VERSION, Kind, record_prefix

    procs = hosts.spawn_procs(per_host={"procs": 1})
    ctx = zmq.Context()
    try:
        port, recv = Channel.open(str)
        from actors._runtime._core import runtime

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
    from actors.ray._ray_host_mesh import ADDRESS_POOL

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
        assert await pid_exited(worker_pid, 10), f"worker {worker_pid} outlived its node host"
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
    """``--ray``: trainer on this node, generators on both, weights over shm here and tcp there, 120 steps.

    The trainer is two sharded ranks (FSDP2 over gloo), rank 1 on the other node: every step's update, publish,
    evaluation and checkpoint crosses the hosts.
    """

    from pipeline import Config, run_pipeline

    config = Config(
        task="bandit", steps=120, generators=2, ray=address, ray_hosts=2, target_score=None, trainer_ranks=2
    )
    config.run_dir = scratch("ray-pipeline-")
    result = await asyncio.wait_for(run_pipeline(config, quiet=True), 240)
    assert result.steps == 120, result
    routes = result.weight_routes
    assert len(routes) == 2, routes
    here = [route for route in routes if route.endswith(": shm")]  # the trainer is on this node: shm there
    assert len(here) == 1 and "the trainer's host" in here[0], routes
    assert sum(route.endswith(": tcp") for route in routes) == 1, routes
    assert all(count > 0 for count in result.rollouts.values()), result.rollouts
    assert len(result.trainer_hosts) == 2 and len(set(result.trainer_hosts)) == 2, result.trainer_hosts
    return {
        "routes": routes,
        "rollouts": result.rollouts,
        "score": result.score,
        "seconds": round(result.seconds, 2),
        "trainer_hosts": result.trainer_hosts,
    }


@check("pipeline_placement_refused")
async def pipeline_placement_refused(address):  # type: ignore[no-untyped-def]
    """More hosts than live nodes, generators or trainer ranks that do not spread evenly: refused before anything starts."""

    from pipeline import Config, run_pipeline

    errors = []
    for generators, hosts, ranks, expected in (
        (2, 4, 1, "has 3 live nodes"),
        (3, 2, 1, "must be a multiple of the 2 Ray hosts"),
        (3, 3, 2, "--trainer-ranks 2: ranks 1..1 spread over the 2 Ray hosts beside the trainer's"),
    ):
        config = Config(
            task="bandit", steps=10, generators=generators, ray=address, ray_hosts=hosts, trainer_ranks=ranks
        )
        config.run_dir = scratch("ray-refused-")
        try:
            await asyncio.wait_for(run_pipeline(config, quiet=True), 60)
        except ValueError as exc:
            assert expected in str(exc), exc
            errors.append(str(exc))
        else:
            raise AssertionError(f"--generators {generators} --ray-hosts {hosts} --trainer-ranks {ranks} ran")
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


@check("stop_kills_a_wedged_worker_on_another_node")
async def stop_kills_a_wedged_worker_on_another_node(hosts):  # type: ignore[no-untyped-def]
    """A worker whose loop is blocked ignores the stop: its node host kills it (its pid means nothing here)."""

    procs = hosts.spawn_procs(per_host={"procs": 1})
    mesh = procs.spawn("wedged", Where)
    far = mesh.slice(hosts=1)
    pid = (await far.where.call_one())[0]
    fifo = os.path.join(scratch("ray-wedged-"), "frozen")
    os.mkfifo(fifo)
    frozen = asyncio.ensure_future(far.freeze.call_one(fifo, 120))
    said = await asyncio.wait_for(asyncio.to_thread(lambda: open(fifo).read()), 30)
    assert said == "frozen", said
    watch = os.pidfd_open(pid)
    started = time.monotonic()
    await asyncio.wait_for(procs.stop(timeout=0.5), 30)
    took = time.monotonic() - started
    assert wait_exited({watch: pid}, 5.0) == {pid}, f"worker {pid} outlived stop()"
    try:
        await asyncio.wait_for(frozen, 10)
        raise AssertionError("the frozen call answered")
    except SupervisionError:  # ActorDied, or the mesh's stop
        pass
    return {"stopped_s": round(took, 3)}


@check("worker_hears_of_a_death_on_another_node")
async def worker_hears_of_a_death_on_another_node(hosts):  # type: ignore[no-untyped-def]
    """A worker waiting on a peer on another node: the peer killed, the worker's call fails within 2 s.

    The worker cannot watch a pid on another host; the controller, told by
    the peer's node host, passes the death on.
    """
    async with hosts.spawn_procs(per_host={"procs": 1}) as procs:
        mesh = procs.spawn("waiter", Where)
        far = mesh.slice(hosts=1)
        pid = (await far.where.call_one())[0]
        waiter = mesh.slice(hosts=0)
        await waiter.remember.call_one(far)  # it holds the handle: whether its call leaves first or not, it fails
        return await kill_while_waiting(pid, waiter.wait_on_remembered.call_one())


@check("grandchild_hears_of_a_death_on_another_node")
async def grandchild_hears_of_a_death_on_another_node(hosts):  # type: ignore[no-untyped-def]
    """A process spawned by a worker, waiting on a peer on another node: the peer killed, its call fails within 2 s.

    The controller never heard of that process: it tells the worker, which
    passes the news down to the processes it spawned.
    """
    async with hosts.spawn_procs(per_host={"procs": 1}) as procs:
        mesh = procs.spawn("parent", Where)
        far, parent = mesh.slice(hosts=1), mesh.slice(hosts=0)
        pid = (await far.where.call_one())[0]
        child = await parent.start_child.call_one()
        assert child[1] == (await parent.where.call_one())[1] and child[2] == "grandchild", child
        await parent.child_remember.call_one(far)  # the grandchild holds its handle: any order of what follows fails
        return await kill_while_waiting(pid, parent.child_waits_on_remembered.call_one())


@check("cousin_hears_of_a_death_on_another_node")
async def cousin_hears_of_a_death_on_another_node(hosts):  # type: ignore[no-untyped-def]
    """Each of two workers spawns a child: one on the controller's node, one on another; the first child killed.

    The second child got the first one's handle through the controller.
    The first child's owner, its parent, tells the controller (on the same
    node, but on tcp), which passes the news down to the other worker, and
    that one to its child: the wait fails within 2 s.
    """
    here = os.environ["ACTORS_TCP_HOST"]
    far_index = next(i for i, host in enumerate(hosts.hosts) if host["ip"] != here)
    near_procs = actors.this_host().spawn_procs(per_host={"procs": 1})
    far_procs = hosts.slice(far_index).spawn_procs(per_host={"procs": 1})
    try:
        near, far = near_procs.spawn("near", Where), far_procs.spawn("far", Where)
        victim = await near.start_child.call_one()
        cousin = await far.start_child.call_one()
        assert victim[1] == here != cousin[1], (victim, cousin)
        await far.child_remember.call_one(await near.child_handle.call_one())
        return await kill_while_waiting(victim[0], far.child_waits_on_remembered.call_one())
    finally:
        await near_procs.stop()
        await far_procs.stop()


@check("child_elsewhere_hears_of_a_death_on_its_parents_node")
async def child_elsewhere_hears_of_a_death_on_its_parents_node(address):  # type: ignore[no-untyped-def]
    """A worker's child on another node, waiting on a peer of the worker's node: killed, then restarted.

    The peer shares a host with the worker and with its owner (the
    controller), so neither is told; the worker sees the death through the
    peer's pidfd and passes it down, then passes down the owner's news of
    the restart at the same address, and the child's handle reaches the
    replacement.
    """
    procs = actors.this_host().spawn_procs(per_host={"procs": 2}, restart="on-failure")
    try:
        restarted = asyncio.Event()
        procs.add_failure_handler(lambda failure: failure.restarted and restarted.set())
        mesh = procs.spawn("local", Where, "built again")
        parent, peer = mesh.slice(procs=0), mesh.slice(procs=1)
        before = await peer.where.call_one()
        child = await parent.start_child_elsewhere.call_one(address)
        here = (await parent.where.call_one())[1]
        assert here == before[1] != child[1], (
            f"worker and peer on one node, the child on another: {here}, {before}, {child}"
        )
        await parent.child_remember.call_one(peer)
        # The call must be in the peer before the kill: sent later, it would reach the replacement and hang there.
        waited = await kill_while_waiting(
            before[0], parent.child_waits_on_remembered.call_one(), arrived=peer.hanging.call_one()
        )
        await asyncio.wait_for(restarted.wait(), 30)
        after = await asyncio.wait_for(peer.where.call_one(), 30)  # the replacement has its actor again
        started = time.monotonic()
        via_child = await asyncio.wait_for(parent.child_asks_remembered.call_one(), 10)
        assert after[0] != before[0] and via_child[0] == after[0] and via_child[2] == "built again", (after, via_child)
        return {**waited, "child_reached_replacement_s": round(time.monotonic() - started, 3), "child_on": child[1]}
    finally:
        await procs.stop()


async def kill_while_waiting(pid: int, wait: Any, arrived: Any = None) -> dict[str, object]:
    """Kill ``pid`` while ``wait`` (a call ending only by that death) runs; it must fail within 2 s.

    ``arrived``, if given, is awaited before the kill: a call answering once
    the wait has reached its target.
    """
    waiting = asyncio.ensure_future(wait)
    if arrived is not None:
        await asyncio.wait_for(arrived, 30)
    started = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    outcome = await asyncio.wait_for(waiting, 10)
    took = time.monotonic() - started
    assert outcome.startswith("ActorDied"), outcome
    assert took < 2.0, (took, outcome)
    return {"seconds": round(took, 3), "outcome": outcome[:200]}


@check("controller_killed_ends_every_worker")
async def controller_killed_ends_every_worker(address):  # type: ignore[no-untyped-def]
    """A controller holding workers on two nodes is killed with SIGKILL: every worker, on every node, ends."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACTORS_")}
    child = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "controller", address, stdout=asyncio.subprocess.PIPE, env=env
    )
    try:
        assert child.stdout is not None
        line = await asyncio.wait_for(child.stdout.readline(), 120)
        spawned = json.loads(line)
        workers, node_hosts = spawned["workers"], spawned["node_hosts"]
        assert len(workers) == 4 and len(set(spawned["hosts"])) == 2, spawned
        fds = {os.pidfd_open(pid): pid for pid in workers}  # readable once that process has exited
        started = time.monotonic()
        child.kill()
        await child.wait()
        gone = await asyncio.to_thread(wait_exited, fds, 10.0)
        took = time.monotonic() - started
        assert gone == set(workers), f"workers {set(workers) - gone} outlived their controller"
        host_fds = {os.pidfd_open(pid): pid for pid in node_hosts if pid_exists(pid)}
        hosts_gone = await asyncio.to_thread(wait_exited, host_fds, 60.0)
        assert hosts_gone == set(host_fds.values()), f"node hosts {set(host_fds.values()) - hosts_gone} outlived it"
        assert took < 5.0, took
        return {"workers_gone_s": round(took, 3), "workers": len(workers), "node_hosts": len(node_hosts)}
    finally:
        if child.returncode is None:
            child.kill()
            await child.wait()


def pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def pid_exited(pid: int, timeout: float) -> bool:
    """Whether process ``pid`` (not a child: another node's) exits within ``timeout`` s; polled without blocking."""
    deadline = time.monotonic() + timeout
    while pid_exists(pid):
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.05)  # another process's exit, polled: a guard with a deadline
    return True


def wait_exited(fds: dict[int, int], timeout: float) -> set[int]:
    """The pids of ``fds`` (pidfds) that exited within ``timeout`` s; closes the fds."""
    import select

    gone: set[int] = set()
    deadline = time.monotonic() + timeout
    waiting = dict(fds)
    while waiting and (left := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select(list(waiting), [], [], left)
        for fd in ready:
            gone.add(waiting.pop(fd))
            os.close(fd)
    for fd in waiting:
        os.close(fd)
    return gone


async def run_controller(address: str) -> None:
    """The controller ``controller_killed_ends_every_worker`` kills: workers on two nodes, then it waits."""
    import ray

    from actors.ray import host_mesh_async

    ray.init(address=address, log_to_driver=False)
    hosts = await host_mesh_async(hosts=2)
    procs = hosts.spawn_procs(per_host={"procs": 2})
    mesh = procs.spawn("orphan", Where)
    found = [v for _, v in await mesh.where.call()]
    line = {
        "workers": [r[0] for r in found],
        "hosts": [r[1] for r in found],
        "node_hosts": [h["pid"] for h in hosts.hosts],
    }
    print(json.dumps(line), flush=True)
    await asyncio.Event().wait()  # until killed


@check("restart_on_a_live_node")
async def restart_on_a_live_node(cluster):  # type: ignore[no-untyped-def]
    """A node removed under a restartable mesh: its rank restarts on the live node, at a new address.

    The controller's handles follow at once; a worker that held a handle to
    the lost process hears of the move and reaches the replacement; its call
    pending on the lost one failed with ActorDied.
    """
    from actors.ray import host_mesh_async

    hosts = await host_mesh_async(hosts=2)
    try:
        procs = hosts.spawn_procs(per_host={"procs": 1}, restart="on-failure")
        restarted = asyncio.Event()
        procs.add_failure_handler(lambda failure: failure.restarted and restarted.set())
        mesh = procs.spawn("mover", Where, "built again")
        head = cluster.head_node.node_id
        index = next(i for i, h in enumerate(hosts.hosts) if h["node"] != head)
        far, near = mesh.slice(hosts=index), mesh.slice(hosts=1 - index)
        before = await far.where.call_one()
        old_address = await far.address.call_one()
        await near.remember.call_one(far)
        assert (await near.ask_remembered.call_one())[0] == before[0]
        waiting = asyncio.ensure_future(near.wait_on_remembered.call_one())  # it holds the handle: either order fails
        victim = next(n for n in cluster.list_all_nodes() if n.node_id == hosts.hosts[index]["node"])
        started = time.monotonic()
        removing = asyncio.ensure_future(asyncio.to_thread(cluster.remove_node, victim, False))
        outcome = await asyncio.wait_for(waiting, 30)
        failed_after = time.monotonic() - started
        assert outcome.startswith("ActorDied"), outcome
        await asyncio.wait_for(restarted.wait(), 30)
        after = await asyncio.wait_for(far.where.call_one(), 60)
        answered_after = time.monotonic() - started
        await removing
        new_address = await far.address.call_one()
        near_where = await near.where.call_one()
        assert hosts.hosts[index]["lost"], hosts.hosts
        assert after[0] != before[0] and after[2] == "built again", (before, after)
        assert after[1] == near_where[1] and new_address != old_address, (after, near_where, new_address)
        assert procs.restarts[index] == 1, procs.restarts
        via_worker = await asyncio.wait_for(near.ask_remembered.call_one(), 30)
        assert via_worker[0] == after[0], (via_worker, after)
        await procs.stop()
        return {
            "worker_call_failed_s": round(failed_after, 3),
            "replacement_answered_s": round(answered_after, 3),
            "moved": [old_address, new_address],
        }
    finally:
        await hosts.shutdown_async()


async def pipeline_past(config: Any, steps: int) -> tuple[asyncio.Future[Any], int]:
    """Start ``run_pipeline(config)``; return it, still running, once its log holds ``steps`` steps."""
    from pipeline import run_pipeline

    run = asyncio.ensure_future(run_pipeline(config, quiet=True))
    metrics = os.path.join(config.run_dir, "metrics.jsonl")
    deadline, steps_logged = time.monotonic() + 120, 0
    while not run.done() and time.monotonic() < deadline:  # an outside condition: the run's own log
        with contextlib.suppress(FileNotFoundError), open(metrics) as f:
            steps_logged = sum(1 for _ in f)
        if steps_logged >= steps:
            break
        await asyncio.sleep(0.05)
    assert not run.done(), run.result() if not run.exception() else run.exception()
    return run, steps_logged


@check("pipeline_survives_a_lost_node")
async def pipeline_survives_a_lost_node(cluster):  # type: ignore[no-untyped-def]
    """``--ray`` with a node removed mid-run: its generator restarts on the trainer's node and the run finishes.

    The trainer goes on the controller's own node, so only a generator's node is lost.
    """

    from pipeline import Config

    node = cluster.add_node(num_cpus=1, node_ip_address="127.0.0.4")
    cluster.wait_for_nodes()
    # 400 steps after the removal, ~6 s at this cluster's pace (~70 steps/s); the restart was in by 60-185 steps
    config = Config(task="bandit", steps=600, generators=2, ray=cluster.address, ray_hosts=2, target_score=None)
    config.run_dir = scratch("ray-lost-node-")
    run, steps_logged = await pipeline_past(config, 200)
    removing = asyncio.ensure_future(asyncio.to_thread(cluster.remove_node, node, False))
    result = await asyncio.wait_for(run, 240)
    await removing
    assert result.steps == 600, result
    assert len(result.restarts) == 1 and list(result.restarts.values()) == [1], result.restarts
    (moved,) = result.restarts
    assert result.rollouts[moved] > 0, f"{moved} never produced after its restart: {result.rollouts}"
    return {
        "removed_after_steps": steps_logged,
        "restarts": result.restarts,
        "rollouts": result.rollouts,
        "routes": result.weight_routes,
        "seconds": round(result.seconds, 2),
    }


async def reservations_given_back(before: set[str]) -> dict[str, object]:
    """The placement groups made since ``before``, once every one of them is removed (90 s at most)."""
    from ray.util import placement_group_table

    deadline = time.monotonic() + 90
    while True:  # (an outside condition: the cluster's own table)
        new = {key: group["state"] for key, group in placement_group_table().items() if key not in before}
        if new and all(state == "REMOVED" for state in new.values()):
            return {"groups": new}
        assert time.monotonic() < deadline, f"the reservation was not given back: {new}"
        await asyncio.sleep(0.1)


@check("cancelled_host_mesh_gives_its_reservation_back")
async def cancelled_host_mesh_gives_its_reservation_back():  # type: ignore[no-untyped-def]
    """``wait_for(host_mesh_async(...), t)`` that gives up: the reservation went on on its thread and the mesh it
    made was referenced by nothing but the exit hook (its nodes and placement group held until the program
    exited). It is shut down once made: its placement group is removed."""
    from ray.util import placement_group_table

    from actors.ray import host_mesh_async

    before = set(placement_group_table())
    try:
        await asyncio.wait_for(host_mesh_async(hosts=1), 0.05)
    except asyncio.TimeoutError:
        pass
    else:
        raise AssertionError("the host mesh was up within 50 ms: nothing was given up")
    return await reservations_given_back(before)


@check("host_mesh_left_pending_at_its_loops_end_gives_its_reservation_back")
async def host_mesh_left_pending_at_its_loops_end_gives_its_reservation_back():  # type: ignore[no-untyped-def]
    """``asyncio.run`` ending with a ``host_mesh_async`` still pending cancels the task making it too: the thread
    went on and made the mesh, and nothing gave its nodes and placement group back until the program exited."""
    import threading

    from ray.util import placement_group_table

    from actors.ray import host_mesh_async

    before = set(placement_group_table())

    async def leave_it_pending() -> None:
        pending = asyncio.ensure_future(host_mesh_async(hosts=1))
        await asyncio.sleep(0.05)  # (it is under way; the loop ends now, cancelling what is left on it)
        assert not pending.done()

    thread = threading.Thread(target=asyncio.run, args=(leave_it_pending(),))
    thread.start()
    await asyncio.to_thread(thread.join, 30)
    return await reservations_given_back(before)


async def main() -> None:
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    for n in range(2):  # each node on its own loopback address: to every other node it is another machine
        cluster.add_node(num_cpus=1, node_ip_address=f"127.0.0.{n + 2}")
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        from actors.ray import host_mesh_async

        hosts = await host_mesh_async(hosts=2, cpus_per_host=1)
        try:
            await call_across_nodes(hosts)
            await ports_across_nodes(hosts)
            await worker_killed_fails_calls(hosts)
            await key_refused(hosts)
            await spawn_beyond_ready_addresses_refused_on_a_loop(hosts)
            await weights_across_nodes(hosts)
            await worker_hears_of_a_death_on_another_node(hosts)
            await grandchild_hears_of_a_death_on_another_node(hosts)
            await cousin_hears_of_a_death_on_another_node(hosts)
            await stop_kills_a_wedged_worker_on_another_node(hosts)
            await node_host_lost_fails_calls(hosts)
        finally:
            await hosts.shutdown()
        await cancelled_host_mesh_gives_its_reservation_back()
        await host_mesh_left_pending_at_its_loops_end_gives_its_reservation_back()
        await child_elsewhere_hears_of_a_death_on_its_parents_node(cluster.address)
        await pipeline_placement_refused(cluster.address)
        await pipeline_across_nodes(cluster.address)
        await controller_killed_ends_every_worker(cluster.address)
        await raylet_killed_fails_calls(cluster)
        await restart_on_a_live_node(cluster)
        await pipeline_survives_a_lost_node(cluster)
    finally:
        ray.shutdown()
        cluster.shutdown()
    print(json.dumps({"done": True}), flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["controller"]:
        asyncio.run(run_controller(sys.argv[2]))
    else:
        asyncio.run(main())
    sys.exit(0)
