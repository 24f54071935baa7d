"""actors.ray on a Ray cluster of network namespaces: nodes with network stacks of their own, links that can be cut.

One fixture builds three namespaces on a bridge (``netns.py``), runs every
check in one child process inside the first (``netns_checks.py``: the Ray
head and the controller there, a Ray node in each other namespace), and
removes the namespaces and everything left in them afterwards, even when a
check failed. Skipped where namespaces cannot be made (not root, no
iproute2) or without the ``ray`` extra.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import netns
import pytest
from check_records import checks_env, read_records, require

pytest.importorskip("ray", reason="needs the ray extra: pip install -e '.[ray]'")

WHY_NOT = netns.unavailable()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=f"network namespaces unavailable: {WHY_NOT}")

CHECKS = [
    "nodes_are_namespaces",
    "call_across_nodes",
    "ports_across_nodes",
    "key_refused",
    "key_refused_from_another_host",
    "weights_across_nodes",
    "partition_fails_calls_and_moves_the_rank",
    "brief_partition_loses_nothing",
    "pipeline_across_nodes",
    "pipeline_survives_a_partition",
]


@pytest.fixture(scope="module")
def results() -> dict[str, dict[str, object]]:
    netns.sweep()
    here = os.path.dirname(os.path.abspath(__file__))
    with netns.Hosts(3) as hosts:
        spec = dict(hosts.spec(), ray=hosts.start_ray())
        command = hosts.run_in(0, [sys.executable, os.path.join(here, "netns_checks.py"), json.dumps(spec)])
        # the partition checks wait out the lifeline's silence bound: the shortest allowed, not the default 5 s
        env = dict(checks_env(), ACTORS_LIFELINE_SILENCE="2")
        out = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    return read_records(out, "the namespace checks")


@pytest.mark.timeout(620)
@pytest.mark.parametrize("name", CHECKS)
def test_on_hosts_of_their_own(results, name):
    require(results, name)


def test_nothing_is_left_behind(results):
    assert netns.namespaces() == [], "a namespace outlived the checks"
