"""Monarch's own multi-host bootstrap: worker loops a scheduler started, attached by a controller over tcp + CURVE.

Each worker loop and each controller is a process of its own (as on separate
machines), on loopback tcp. The controllers are scripts run here, so that
their runtime starts on tcp.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from typing import Any

import pytest
from harness import actor_pids, wait_for

import actors
from actors import new_session_keys

CONTROLLER = textwrap.dedent(
    """
    import json, os, signal, sys, time
    from actors import Actor, ActorDied, SupervisionError, attach_to_workers, endpoint

    class Where(Actor):
        @endpoint
        async def where(self) -> list:
            from actors import current_rank
            return [os.getpid(), os.environ.get("ACTORS_HOST_ID", ""), str(current_rank())]

    def main(workers, action, timeout):
        t = time.monotonic()
        hosts = attach_to_workers(name="test", ca="trust_all_connections", workers=workers, timeout=timeout)
        out = {"hosts": hosts.extent, "infos": hosts.hosts, "attach_s": time.monotonic() - t}
        procs = hosts.spawn_procs(per_host={"procs": 2})
        mesh = procs.spawn("where", Where)
        answers = mesh.where.call().get(timeout=30)
        out["answers"] = [value for _, value in answers]
        out["extent"] = procs.extent
        if action == "kill":
            pid = out["answers"][-1][0]
            os.kill(pid, signal.SIGKILL)
            t = time.monotonic()
            try:
                mesh.slice(hosts=1, procs=1).where.call_one().get(timeout=20)
                out["after_kill"] = "answered"
            except (ActorDied, SupervisionError) as exc:
                out["after_kill"] = type(exc).__name__
            out["detected_s"] = time.monotonic() - t
        if action == "exit":  # leave without stopping anything: the hosts must end the workers themselves
            print(json.dumps(out), flush=True)
            os._exit(0)
        procs.stop().get(timeout=30)
        t = time.monotonic()
        hosts.shutdown()
        out["shutdown_s"] = time.monotonic() - t
        print(json.dumps(out), flush=True)

    if __name__ == "__main__":
        main(json.loads(sys.argv[1]), sys.argv[2], float(sys.argv[3]))
    """
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def clean_env(keys: dict[str, str] | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACTORS_")}
    env.update(keys or {})
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(actors.__file__)), env.get("PYTHONPATH", "")])
    return env


@pytest.fixture
def worker_loops() -> Iterator[tuple[list[str], dict[str, str]]]:
    """Two worker loops on loopback tcp holding a fresh session key; killed at the end."""
    keys = new_session_keys()
    addresses = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
    loops = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                f"from actors import run_worker_loop_forever; "
                f"run_worker_loop_forever(address={address!r}, ca='trust_all_connections')",
            ],
            env=clean_env(keys),
            start_new_session=True,
        )
        for address in addresses
    ]
    try:
        yield addresses, keys
    finally:
        for loop in loops:
            loop.send_signal(signal.SIGTERM)
        for loop in loops:
            try:
                loop.wait(15)
            except subprocess.TimeoutExpired:
                loop.kill()
                loop.wait(5)


def run_controller(
    tmp_path: Any, workers: list[str], keys: dict[str, str] | None, action: str, timeout: float = 20.0
) -> Any:
    script = tmp_path / "controller.py"
    script.write_text(CONTROLLER)
    return subprocess.run(
        [sys.executable, str(script), json.dumps(workers), action, str(timeout)],
        env=clean_env(keys),
        capture_output=True,
        text=True,
        timeout=120,
    )


def result_of(proc: Any) -> dict[str, Any]:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_attach_spawns_on_every_worker_and_a_killed_worker_fails_its_calls(tmp_path, worker_loops):
    workers, keys = worker_loops
    out = result_of(run_controller(tmp_path, workers, keys, "kill"))
    assert out["hosts"] == {"hosts": 2} and out["extent"] == {"hosts": 2, "procs": 2}
    assert [info["node"] for info in out["infos"]] == workers
    assert len({pid for pid, _, _ in out["answers"]}) == 4
    assert [host for _, host, _ in out["answers"]] == [f"worker-{workers[0]}"] * 2 + [f"worker-{workers[1]}"] * 2
    assert out["after_kill"] in ("ActorDied", "SupervisionError") and out["detected_s"] < 10
    print(f"attach {out['attach_s']:.3f} s, a killed worker's call failed after {out['detected_s']:.3f} s")
    assert wait_for(lambda: not actor_pids() & {pid for pid, _, _ in out["answers"]}, timeout=15)


def test_a_controller_without_the_session_key_is_never_heard(tmp_path, worker_loops):
    workers, _keys = worker_loops
    proc = run_controller(tmp_path, workers, new_session_keys(), "kill", timeout=3)  # a key pair of its own
    assert proc.returncode != 0
    assert "did not answer within 3s" in proc.stderr and "CURVE key" in proc.stderr, proc.stderr[-2000:]


def test_a_controller_with_no_key_at_all_is_refused_before_it_sends(tmp_path, worker_loops):
    workers, _keys = worker_loops
    proc = run_controller(tmp_path, workers, None, "kill")
    assert proc.returncode != 0 and "needs the session's CURVE key" in proc.stderr, proc.stderr[-2000:]


def test_when_its_controller_dies_a_worker_ends_its_workers_and_serves_the_next_one(tmp_path, worker_loops):
    workers, keys = worker_loops
    first = result_of(run_controller(tmp_path, workers, keys, "exit"))
    orphans = {pid for pid, _, _ in first["answers"]}
    assert wait_for(lambda: not actor_pids() & orphans, timeout=15), "the hosts end the dead controller's workers"
    second = result_of(run_controller(tmp_path, workers, keys, "stop"))
    assert len({pid for pid, _, _ in second["answers"]}) == 4
    assert second["shutdown_s"] < 5, "a shutdown stops the agents, never waits for the worker loops to exit"
    third = result_of(run_controller(tmp_path, workers, keys, "stop"))  # a clean shutdown leaves the loops serving
    assert len({pid for pid, _, _ in third["answers"]}) == 4


def test_bad_arguments_are_refused_with_the_reason(monkeypatch):
    with pytest.raises(NotImplementedError, match="CURVE key"):
        actors.run_worker_loop_forever(address="tcp://127.0.0.1:1", ca="my-ca.pem")
    with pytest.raises(ValueError, match="tcp://<host>:<port>"):
        actors.run_worker_loop_forever(address="ipc:///tmp/x", ca="trust_all_connections")
    with pytest.raises(ValueError, match="wildcard"):
        actors.run_worker_loop_forever(address="tcp://0.0.0.0:4444", ca="trust_all_connections")
    monkeypatch.delenv("ACTORS_CURVE_PUBLIC", raising=False)
    with pytest.raises(RuntimeError, match="needs the session's CURVE key"):
        actors.run_worker_loop_forever(address="tcp://127.0.0.1:4444", ca="trust_all_connections")
    with pytest.raises(TypeError, match="non-empty list"):
        actors.attach_to_workers(workers="tcp://127.0.0.1:4444")
    with pytest.raises(ValueError, match="tcp://<host>:<port>"):
        actors.attach_to_workers(workers=["localhost:4444"])
    with pytest.raises(NotImplementedError, match="start_worker_loop_forever"):
        actors.start_worker_loop_forever(address="tcp://127.0.0.1:4444", ca="trust_all_connections")


HOSTS_FROM_CONFIG = textwrap.dedent(
    """
    import json, os
    from actors import Actor, context, endpoint, hosts_from_config

    class Trainer(Actor):
        @endpoint
        def step(self):
            return [os.getpid(), f"Trainer {context().message_rank} taking a step."]

    hosts = hosts_from_config("MONARCH_HOSTS")
    procs = hosts.spawn_procs(per_host={"gpus": 2})
    steps = procs.spawn("trainer", Trainer).step.call().get(timeout=30)
    print(json.dumps({"extent": procs.extent, "steps": [v for _, v in steps]}), flush=True)
    """
)


def test_hosts_from_config_starts_worker_loops_here_and_everything_ends_with_the_program(tmp_path):
    script = tmp_path / "getting_started.py"
    script.write_text(HOSTS_FROM_CONFIG)
    before = actor_pids()
    proc = subprocess.run(
        [sys.executable, str(script)], env=clean_env(None), capture_output=True, text=True, timeout=120
    )
    out = result_of(proc)
    assert out["extent"] == {"hosts": 2, "gpus": 2}
    assert [text for _, text in out["steps"]][1] == "Trainer {'hosts': 0/2, 'gpus': 1/2} taking a step."
    assert wait_for(lambda: not (actor_pids() - before), timeout=15)
    loops = subprocess.run(["pgrep", "-f", "run_worker_loop_forever"], capture_output=True, text=True).stdout.split()
    assert not loops, "the worker loops end with the program that started them"
