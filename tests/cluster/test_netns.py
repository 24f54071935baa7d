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
    tests = os.path.dirname(here)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([here, os.path.join(tests, "actors"), tests, *sys.path]))
    for key in ("ACTORS_CURVE_PUBLIC", "ACTORS_CURVE_SECRET", "ACTORS_TRANSPORT", "ACTORS_TCP_HOST", "RAY_ADDRESS"):
        env.pop(key, None)
    with netns.Hosts(3) as hosts:
        spec = dict(hosts.spec(), ray=hosts.start_ray())
        command = hosts.run_in(0, [sys.executable, os.path.join(here, "netns_checks.py"), json.dumps(spec)])
        out = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
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
            f"the namespace checks did not finish (exit {out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}"
        )
    return found


@pytest.mark.timeout(620)
@pytest.mark.parametrize("name", CHECKS)
def test_on_hosts_of_their_own(results, name):
    record = results.get(name)
    assert record is not None, f"{name} did not run"
    assert record["ok"], f"{record['detail']}\n{record.get('tb', '')}"


def test_nothing_is_left_behind(results):
    assert netns.namespaces() == [], "a namespace outlived the checks"
