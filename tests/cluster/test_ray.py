"""actors.ray on a Ray cluster of three nodes on this machine (skipped without the ``ray`` extra).

The checks run in one child process (``ray_cluster_checks.py``): its actors
runtime must be a tcp one from the start, and one cluster serves them all.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

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
