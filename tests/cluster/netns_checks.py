"""Checks of ``actors.ray`` on a Ray cluster whose nodes are network namespaces (run by test_netns.py).

This process runs in the first namespace, beside the Ray head; each other
node is ``ray start`` in a namespace of its own, reached only through its
veth link to the bridge. Every byte between nodes crosses a real network
interface, and a node's link can be set down while everything on it lives
on (a partition). Prints one JSON line per check, like
``ray_cluster_checks.py`` (whose checks it reuses), then ``{"done": true}``.

    python netns_checks.py '<hosts as JSON: names, addresses, hub, ends>'
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import ray_cluster_checks as base
from check_records import scratch
from ray_cluster_checks import Where, check

from actors import ActorDied

#: Partitions measured for the detection time (the median is reported); each takes ~10 s of the suite.
ROUNDS = 2
#: A gap between ticks of the controller's loop this long counts as a stall (it measured under 5 ms).
STALL = 0.5


class Cluster:
    """The namespaces and the Ray cluster in them (from the test's fixture); cuts and heals links."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.names: list[str] = spec["names"]
        self.addresses: list[str] = spec["addresses"]
        self.hub: str = spec["hub"]
        self.ends: list[str] = spec["ends"]
        self.address: str = spec["ray"]
        self.head = self.addresses[0]

    def namespace_of(self, ip: str) -> int:
        return self.addresses.index(ip)

    def cut(self, k: int) -> None:
        subprocess.run(["ip", "-n", self.hub, "link", "set", self.ends[k], "down"], check=True, timeout=30)

    def heal(self, k: int) -> None:
        subprocess.run(["ip", "-n", self.hub, "link", "set", self.ends[k], "up"], check=True, timeout=30)


class LoopLag:
    """The longest gap between ticks of this loop while it runs (the controller's loop must never stall)."""

    def __init__(self, tick: float = 0.01) -> None:
        self.tick = tick
        self.worst = 0.0
        self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(self.tick)
            now = time.monotonic()
            self.worst = max(self.worst, now - last - self.tick)
            last = now

    def stop(self) -> float:
        self._task.cancel()
        return self.worst


@check("nodes_are_namespaces")
async def nodes_are_namespaces(cluster: Cluster) -> dict[str, Any]:
    import ray

    alive = sorted(n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"])
    assert alive == sorted(cluster.addresses), (alive, cluster.addresses)
    return {"nodes": alive}


@check("partition_fails_calls_and_moves_the_rank")
async def partition_fails_calls_and_moves_the_rank(cluster: Cluster) -> dict[str, Any]:
    """A node's link set down under a pending call, ``ROUNDS`` times: the call fails, the rank moves, the strays stop.

    Each round: a restartable mesh over two nodes; a call pending on the
    worker of the node that is not the controller's; that node's link set
    down. The pending call must fail with ActorDied (the lifeline's silence
    bound), the rank must answer again from a live node, the controller's
    loop must keep ticking, and the stranded worker must end itself (its
    node host hears nothing from the controller); then the link comes back
    and calls still reach the replacement, not the stray.
    """
    from actors._processes._lifeline import silence_bound
    from actors.ray import host_mesh_async

    bound = silence_bound()  # the fixture sets a short one
    detections, lags, moves = [], [], []
    for _ in range(ROUNDS):
        hosts = await host_mesh_async(hosts=2)
        try:
            procs = hosts.spawn_procs(per_host={"procs": 1}, restart="on-failure")
            mesh = procs.spawn("part", Where, "again")
            index = next(i for i, h in enumerate(hosts.hosts) if h["ip"] != cluster.head)
            far = mesh.slice(hosts=index)
            before = await far.where.call_one()
            k = cluster.namespace_of(str(before[1]))
            pending = asyncio.ensure_future(far.hang.call_one())
            await far.hanging.call_one()  # the hang is running there now
            lag = LoopLag()
            started = time.monotonic()
            cluster.cut(k)
            try:
                try:
                    await asyncio.wait_for(pending, bound + 10)
                    raise AssertionError("a call pending on a partitioned node answered")
                except ActorDied:
                    detections.append(time.monotonic() - started)
                after = await asyncio.wait_for(far.where.call_one(), 60)
                lags.append(lag.stop())
                assert lags[-1] < STALL, f"the controller's loop stalled {lags[-1]:.3f}s during the partition"
                assert after[1] != before[1] and after[2] == "again", (before, after)
                assert await base.pid_exited(int(before[0]), bound + 10), (
                    f"stranded worker {before[0]} outlived the partition"
                )
            finally:
                cluster.heal(k)
            again = await asyncio.wait_for(far.where.call_one(), 30)
            assert again[0] == after[0], (again, after)  # the replacement answers, never the stray
            moves.append([before[1], after[1]])
            await procs.stop()
        finally:
            await hosts.shutdown_async()
    return {
        "detection_s": [round(d, 3) for d in detections],
        "detection_median_s": round(statistics.median(detections), 3),
        "silence_bound_s": bound,
        "worst_loop_lag_ms": round(max(lags) * 1000, 1),
        "moves": moves,
    }


_INTRUDER = """
import os, sys, time, msgpack, zmq
from actors._wire._records import PROTOCOL_VERSION, Kind, record_prefix
target, port_id, server_key = sys.argv[1], int(sys.argv[2]), sys.argv[3].encode()
ctx = zmq.Context()
body = msgpack.packb([int(Kind.PORT), port_id, "intruder"])
header = msgpack.packb([PROTOCOL_VERSION, "tcp://10.0.0.1:9", 1])
for curve in (False, True):
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 2000)
    if curve:  # knows the controller's public key, holds a key pair of its own
        sock.curve_serverkey = server_key
        sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
    sock.connect(target)
    sock.send_multipart([header, record_prefix(0, len(body)) + body])
    sock.close()
ctx.term()  # waits out the linger: each tried to deliver for 2 s
print("sent")
"""


@check("key_refused_from_another_host")
async def key_refused_from_another_host(cluster: Cluster) -> dict[str, Any]:
    """A process in another namespace, without the session key (no CURVE, or CURVE with its own keys), delivers nothing."""
    from actors import Channel
    from actors._runtime._core import runtime

    port, recv = Channel.open(str)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACTORS_CURVE")}
    command = [sys.executable, "-c", _INTRUDER, runtime().address, str(port._id), os.environ["ACTORS_CURVE_PUBLIC"]]
    child = await asyncio.create_subprocess_exec(
        "ip", "netns", "exec", cluster.names[-1], *command, env=env, stdout=asyncio.subprocess.PIPE
    )
    out, _ = await asyncio.wait_for(child.communicate(), 60)
    assert out.decode().strip() == "sent" and child.returncode == 0, (out, child.returncode)
    assert recv.qsize() == 0, "an intruder delivered a message"
    port.send("friend")  # the port itself works
    assert await asyncio.wait_for(recv.recv(), 10) == "friend"
    return {"intruder_at": cluster.addresses[-1], "delivered": 0}


@check("brief_partition_loses_nothing")
async def brief_partition_loses_nothing(cluster: Cluster) -> dict[str, Any]:
    """A link down for less than the lifeline's silence bound: nothing is declared lost, calls made meanwhile answer.

    A call sent while the link is down waits in the sockets (tcp retransmits);
    once the link is up it is answered by the same process, and no restart
    or failure happened.
    """
    from actors._processes._lifeline import silence_bound
    from actors.ray import host_mesh_async

    bound = silence_bound()
    hosts = await host_mesh_async(hosts=2)
    try:
        procs = hosts.spawn_procs(per_host={"procs": 1}, restart="on-failure")
        mesh = procs.spawn("blip", Where)
        index = next(i for i, h in enumerate(hosts.hosts) if h["ip"] != cluster.head)
        far = mesh.slice(hosts=index)
        before = await far.where.call_one()
        k = cluster.namespace_of(str(before[1]))
        cluster.cut(k)
        try:
            during = asyncio.ensure_future(far.where.call_one())
            await asyncio.sleep(bound / 2)  # the partition's length (a fault's duration, not synchronisation)
            assert not during.done(), during
        finally:
            cluster.heal(k)
        healed = time.monotonic()
        after = await asyncio.wait_for(during, 30)
        answered = time.monotonic() - healed
        assert after[0] == before[0], (before, after)
        assert procs.restarts == [0, 0] and not procs.failures, (procs.restarts, procs.failures)
        assert not any(h["lost"] for h in hosts.hosts), hosts.hosts
        await procs.stop()
        return {"cut_s": bound / 2, "answered_after_heal_s": round(answered, 3)}
    finally:
        await hosts.shutdown_async()


@check("pipeline_survives_a_partition")
async def pipeline_survives_a_partition(cluster: Cluster) -> dict[str, Any]:
    """``--ray`` on every node, 1,600 bandit steps; the last node cut off after 200 steps: the run finishes.

    With a host on every node, the trainer is on the controller's node (the
    head's namespace), so the cut takes only the last node's generator: it
    restarts on a live node once the lifeline's silence says its host is
    lost. The link comes back after the run.
    """

    from pipeline import Config

    nodes = len(cluster.names)
    # 1,400 steps after the cut: ~6 s at its pace (227 steps/s); the silence bound (2 s here) and the restart take ~3
    config = Config(
        task="bandit", steps=1600, generators=nodes, ray=cluster.address, ray_hosts=nodes, target_score=None
    )
    config.run_dir = scratch("netns-partition-")
    run, steps_logged = await base.pipeline_past(config, 200)
    cut = nodes - 1
    cluster.cut(cut)
    try:
        result = await asyncio.wait_for(run, 300)
    finally:
        cluster.heal(cut)
    assert result.steps == 1600, result
    assert list(result.restarts.values()) == [1], result.restarts
    (moved,) = result.restarts
    assert result.rollouts[moved] > 0, f"{moved} never produced after its restart: {result.rollouts}"
    return {
        "cut_after_steps": steps_logged,
        "cut": cluster.addresses[cut],
        "restarts": result.restarts,
        "rollouts": result.rollouts,
        "routes": result.weight_routes,
        "seconds": round(result.seconds, 2),
    }


async def main(spec: dict[str, Any]) -> None:
    import ray

    cluster = Cluster(spec)
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        await nodes_are_namespaces(cluster)
        from actors.ray import host_mesh_async

        hosts = await host_mesh_async(hosts=2, cpus_per_host=1)
        try:
            await base.call_across_nodes(hosts)
            await base.ports_across_nodes(hosts)
            await base.key_refused(hosts)
            await key_refused_from_another_host(cluster)
            await base.weights_across_nodes(hosts)
        finally:
            await hosts.shutdown()
        await partition_fails_calls_and_moves_the_rank(cluster)
        await brief_partition_loses_nothing(cluster)
        await base.pipeline_across_nodes(cluster.address)
        await pipeline_survives_a_partition(cluster)
    finally:
        ray.shutdown()
    print(json.dumps({"done": True}), flush=True)


if __name__ == "__main__":
    asyncio.run(main(json.loads(sys.argv[1])))
    sys.exit(0)
