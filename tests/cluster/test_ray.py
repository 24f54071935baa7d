"""actors.ray on a Ray cluster of three nodes on this machine (skipped without the ``ray`` extra).

The checks run in one child process (``ray_cluster_checks.py``): its actors
runtime must be a tcp one from the start, and one cluster serves them all.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from check_records import checks_env, read_records, require

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
    "cancelled_host_mesh_gives_its_reservation_back",
    "host_mesh_left_pending_at_its_loops_end_gives_its_reservation_back",
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
    out = subprocess.run(
        [sys.executable, os.path.join(here, "ray_cluster_checks.py")],
        capture_output=True,
        text=True,
        timeout=400,
        env=checks_env(),
    )
    return read_records(out, "the cluster checks")


@pytest.mark.timeout(420)
@pytest.mark.parametrize("name", CHECKS)
def test_on_a_ray_cluster(results, name):
    require(results, name)
