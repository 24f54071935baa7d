"""actors.ray on a Ray cluster of three nodes on this machine (skipped without the ``ray`` extra).

The checks run in one child process (``ray_cluster_checks.py``): its actors
runtime must be a tcp one from the start, and one cluster serves them all.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("ray", reason="needs the ray extra: pip install -e '.[ray]'")

CHECKS = [
    "call_across_nodes",
    "ports_across_nodes",
    "worker_killed_fails_calls",
    "key_refused",
    "spawn_beyond_ready_addresses_refused_on_a_loop",
    "weights_across_nodes",
    "worker_hears_of_a_death_on_another_node",
    "grandchild_hears_of_a_death_on_another_node",
    "cousin_hears_of_a_death_on_another_node",
    "stop_kills_a_wedged_worker_on_another_node",
    "node_host_lost_fails_calls",
    "child_elsewhere_hears_of_a_death_on_its_parents_node",
    "pipeline_placement_refused",
    "pipeline_across_nodes",
    "controller_killed_ends_every_worker",
    "raylet_killed_fails_calls",
    "restart_on_a_live_node",
    "pipeline_survives_a_lost_node",
]


@pytest.fixture(scope="module")
def results() -> dict[str, dict[str, object]]:
    here = os.path.dirname(os.path.abspath(__file__))
    tests = os.path.dirname(here)  # the runtime tests' actors (support) and the harness
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([here, os.path.join(tests, "actors"), tests, *sys.path]))
    for key in ("ACTORS_CURVE_PUBLIC", "ACTORS_CURVE_SECRET", "ACTORS_TRANSPORT", "ACTORS_TCP_HOST"):
        env.pop(key, None)
    out = subprocess.run(
        [sys.executable, os.path.join(here, "ray_cluster_checks.py")],
        capture_output=True,
        text=True,
        timeout=400,
        env=env,
    )
    found: dict[str, dict[str, object]] = {}
    for line in out.stdout.splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            if "check" in record:
                found[str(record["check"])] = record
            elif record.get("done"):
                found["done"] = record
    if "done" not in found:
        pytest.fail(
            f"the cluster checks did not finish (exit {out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}"
        )
    return found


@pytest.mark.timeout(420)
@pytest.mark.parametrize("name", CHECKS)
def test_on_a_ray_cluster(results, name):
    record = results.get(name)
    assert record is not None, f"{name} did not run"
    assert record["ok"], f"{record['detail']}\n{record.get('tb', '')}"


class Replies:
    """A stand-in for the Relay: keeps each pending Ray call's handler, to answer by hand."""

    def __init__(self) -> None:
        self.handlers: list[Any] = []

    def when_done(self, object_ref: Any, handler: Any) -> None:
        self.handlers.append(handler)


def a_host_mesh(tmp_path: Any, nodes: int) -> Any:
    """A RayHostMesh with fake node hosts and a real registry, fed Ray's answers by hand (no cluster)."""
    from actors._transport._registry import Registry
    from actors.ray._ray_host_mesh import RayHostMesh, _Node

    mesh = object.__new__(RayHostMesh)
    mesh._rt = SimpleNamespace(registry=Registry(str(tmp_path), os.getpid()))
    node_host = SimpleNamespace(exits=SimpleNamespace(remote=lambda: None))
    mesh._nodes = [_Node(i, node_host, f"10.255.1.{i}", 100 + i, f"node{i}", []) for i in range(nodes)]
    mesh._relay, mesh._root, mesh.closed = Replies(), None, False
    return mesh


def test_a_late_exit_of_a_worker_whose_address_was_reused_fails_nothing(tmp_path):
    mesh = a_host_mesh(tmp_path, 1)
    (node,) = mesh._nodes
    ref = mesh._rt.registry.placed("tcp://10.255.1.0:5000")
    node.procs[7] = ref  # stopped; its exit not yet reported when its port went to the next worker
    node.procs[9] = ref
    mesh._watch(node)
    mesh._relay.handlers.pop()([(7, 1111, 0)], None)
    assert not ref.dead, "the worker serving the address now is spawn 9"
    mesh._relay.handlers.pop()([(9, 2222, -9)], None)
    assert ref.dead and "process 2222" in ref.exit_reason and "SIGKILL" in ref.exit_reason


def test_a_lost_node_fails_only_the_workers_it_still_serves(tmp_path):
    mesh = a_host_mesh(tmp_path, 2)
    registry = mesh._rt.registry
    moved, stayed = registry.placed("tcp://10.255.1.0:5001"), registry.placed("tcp://10.255.1.0:5002")
    mesh._nodes[0].procs.update({3: moved, 4: stayed})
    mesh._nodes[1].procs[5] = moved  # restarted on node 1 (its exit on node 0 not yet reported)
    mesh._lose(mesh._nodes[0], "its lifeline closed")
    assert stayed.dead and not moved.dead
    mesh._lose(mesh._nodes[1], "its lifeline closed")
    assert moved.dead
