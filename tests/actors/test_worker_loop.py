"""Monarch's own multi-host bootstrap: worker loops a scheduler started, attached by a controller over tcp + CURVE.

Each worker loop and each controller is a process of its own (as on separate
machines), on loopback tcp. The controllers are scripts run here, so that
their runtime starts on tcp.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from typing import Any

import pytest
from harness import actor_pids, last_json, run_python, wait_for

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
        assert hosts.initialized.get() is True  # (Monarch's readiness future: every worker answered)
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
        if action == "lose":  # a request to host 0 failed (timed out): lost here, though its loop still serves
            hosts._rt.driver.on_thread(lambda: hosts._lose(hosts._nodes[0], "TimeoutError: no answer in time"))
        if action == "exit":  # leave without stopping anything: the hosts must end the workers themselves
            print(json.dumps(out), flush=True)
            os._exit(0)
        if action == "hoststop":  # Monarch's stop(): this mesh's workers end, the loops serve the next controller
            hosts.stop().get(timeout=30)
            print(json.dumps(out), flush=True)
            return
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


def start_loop(
    address: str, keys: dict[str, str], run: str = "run_worker_loop_forever", pass_fds: tuple[int, ...] = ()
) -> subprocess.Popen[str]:
    """A worker loop serving ``address`` in a process of its own; it prints ``returned`` if ``run`` returns."""
    boot = f"from actors import {run}; {run}(address={address!r}, ca='trust_all_connections'); print('returned')"
    return subprocess.Popen(
        [sys.executable, "-c", boot],
        env=clean_env(keys),
        start_new_session=True,
        pass_fds=pass_fds,
        stdout=subprocess.PIPE,
        text=True,
    )


def end_loops(loops: list[subprocess.Popen[str]]) -> None:
    for loop in loops:
        if loop.poll() is None:
            loop.send_signal(signal.SIGTERM)
    for loop in loops:
        try:
            loop.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            loop.kill()
            loop.communicate(timeout=5)


@pytest.fixture
def worker_loops(request, tmp_path) -> Iterator[tuple[list[str], dict[str, str], list[subprocess.Popen[str]]]]:
    """Two worker loops holding a fresh session key, on loopback tcp or at unix sockets outside any session
    folder (both CURVE-authenticated); ended at the end."""
    keys = new_session_keys()
    if getattr(request, "param", "tcp") == "tcp":
        addresses = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
    else:
        addresses = [f"ipc://{tmp_path}/loop{i}" for i in range(2)]
    loops = [start_loop(address, keys) for address in addresses]
    try:
        yield addresses, keys, loops
    finally:
        end_loops(loops)


def run_controller(
    tmp_path: Any, workers: list[str], keys: dict[str, str] | None, action: str, timeout: float = 20.0
) -> Any:
    script = tmp_path / "controller.py"
    script.write_text(CONTROLLER)
    return run_python(str(script), json.dumps(workers), action, str(timeout), timeout=120, env=clean_env(keys))


def result_of(proc: Any) -> dict[str, Any]:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return last_json(proc.stdout)  # type: ignore[no-any-return]


BOTH_TRANSPORTS = pytest.mark.parametrize("worker_loops", ["tcp", "ipc"], indirect=True)


@BOTH_TRANSPORTS
def test_attach_spawns_on_every_worker_and_a_killed_worker_fails_its_calls(tmp_path, worker_loops):
    workers, keys, _ = worker_loops
    out = result_of(run_controller(tmp_path, workers, keys, "kill"))
    assert out["hosts"] == {"hosts": 2} and out["extent"] == {"hosts": 2, "procs": 2}
    assert [info["node"] for info in out["infos"]] == workers
    assert len({pid for pid, _, _ in out["answers"]}) == 4
    assert [host for _, host, _ in out["answers"]] == [f"worker-{workers[0]}"] * 2 + [f"worker-{workers[1]}"] * 2
    assert out["after_kill"] in ("ActorDied", "SupervisionError") and out["detected_s"] < 10
    print(f"attach {out['attach_s']:.3f} s, a killed worker's call failed after {out['detected_s']:.3f} s")
    assert wait_for(lambda: not actor_pids() & {pid for pid, _, _ in out["answers"]}, timeout=15)


@BOTH_TRANSPORTS
def test_a_controller_without_the_session_key_is_never_heard(tmp_path, worker_loops):
    workers, _keys, _ = worker_loops
    proc = run_controller(tmp_path, workers, new_session_keys(), "kill", timeout=3)  # a key pair of its own
    assert proc.returncode != 0
    assert "did not answer within 3s" in proc.stderr and "CURVE key" in proc.stderr, proc.stderr[-2000:]


ATTACH_LATER = textwrap.dedent(
    """
    import asyncio, json, sys, time
    from actors import Actor, CallTimeout, attach_to_workers, endpoint

    class Echo(Actor):
        @endpoint
        async def echo(self, x: int) -> int:
            return x

    def failure(exc):
        return f"{type(exc).__name__}: {exc}"

    async def on_a_loop(workers):
        hosts = attach_to_workers(ca="trust_all_connections", workers=workers)  # on the loop: returns at once
        try:
            hosts.spawn_procs(per_host={"procs": 1})  # (the answers need this loop: it has not run yet)
            early = "spawned"
        except RuntimeError as exc:
            early = str(exc)
        assert await hosts.initialized is True
        procs = hosts.spawn_procs(per_host={"procs": 1})
        answers = await procs.spawn("echo", Echo).echo.call(7)
        await procs.stop()
        await hosts.shutdown()  # Monarch's idiom on a loop
        return early, [value for _, value in answers]

    async def observe(hosts):
        try:
            await hosts.initialized
            return "ready"
        except Exception as exc:
            return failure(exc)

    def main(workers, unreachable):
        out = {}
        # one worker answers, one never does: attaching returns; readiness fails at the deadline, naming the
        # silent one, for everyone; shutting down then stops the one that answered (and ends its loop). Meanwhile
        # the runtime moves to another event loop and back (the answers and the deadline follow it).
        hosts = attach_to_workers(name="mixed", ca="trust_all_connections", workers=[workers[1], unreachable], timeout=5)
        out["early"], out["answers"] = asyncio.run(on_a_loop(workers[:1]))
        out["extent"] = hosts.extent
        errors = []
        for _ in range(2):
            try:
                hosts.initialized.get()
            except Exception as exc:
                errors.append(failure(exc))
        try:
            hosts.spawn_procs()
        except Exception as exc:
            errors.append(failure(exc))
        errors.append(asyncio.run(observe(hosts)))
        out["errors"] = errors
        hosts.shutdown()
        # shut down while still attaching: no wait for the deadline; readiness then fails saying so
        hosts = attach_to_workers(ca="trust_all_connections", workers=[unreachable], timeout=120)
        try:
            hosts.initialized.get(timeout=0.05)
            out["pending"] = "ready"
        except CallTimeout as exc:
            out["pending"] = failure(exc)
        t = time.monotonic()
        hosts.shutdown()
        out["shutdown_s"] = time.monotonic() - t
        out["after_shutdown"] = asyncio.run(observe(hosts))
        print(json.dumps(out), flush=True)

    if __name__ == "__main__":
        main(json.loads(sys.argv[1]), sys.argv[2])
    """
)


@pytest.mark.parametrize("worker_loops", ["ipc"], indirect=True)
def test_attaching_returns_at_once_and_readiness_says_which_worker_never_answered(tmp_path, worker_loops):
    """As Monarch's: ``attach_to_workers`` returns at once (on an event loop too, which it never blocks);
    ``initialized`` waits for the workers, and one that never answers fails it (and every later observer, and
    spawning) with Monarch's ``attach failed`` text naming its address, at the attach deadline."""
    workers, keys, _ = worker_loops
    unreachable = f"ipc://{tmp_path}/never_bound"
    script = tmp_path / "attach_later.py"
    script.write_text(ATTACH_LATER)
    out = result_of(run_python(str(script), json.dumps(workers), unreachable, timeout=120, env=clean_env(keys)))
    assert "await" in out["early"] and "initialized" in out["early"], out["early"]
    assert out["answers"] == [7]
    assert out["extent"] == {"hosts": 2}
    assert len(out["errors"]) == 4
    for error in out["errors"]:
        assert error.startswith("CallTimeout: attach failed: config push failed during attach"), error
        assert f"{tmp_path}/never_bound" in error and "did not answer within 5s" in error, error
    assert out["pending"].startswith("CallTimeout: gave up"), out["pending"]
    assert out["shutdown_s"] < 30, "shutting down a mesh still attaching waits for no deadline"
    assert "shut down before" in out["after_shutdown"], out["after_shutdown"]
    loops = worker_loops[2]
    assert wait_for(lambda: all(loop.poll() is not None for loop in loops), timeout=30), (
        "both loops ended: the first by its mesh's shutdown, the second by the failed mesh's, as it had answered"
    )


def test_a_controller_with_no_key_at_all_is_refused_before_it_sends(tmp_path, worker_loops):
    workers, _keys, _ = worker_loops
    proc = run_controller(tmp_path, workers, None, "kill")
    assert proc.returncode != 0 and "needs the session's CURVE key" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.parametrize("worker_loops", ["ipc"], indirect=True)  # (tcp: the test of the other address forms)
def test_a_worker_loop_serves_the_next_controller_until_one_shuts_its_hosts_down(tmp_path, worker_loops):
    workers, keys, loops = worker_loops
    first = result_of(run_controller(tmp_path, workers, keys, "exit"))
    orphans = {pid for pid, _, _ in first["answers"]}
    assert wait_for(lambda: not actor_pids() & orphans, timeout=15), "the hosts end the dead controller's workers"
    assert all(loop.poll() is None for loop in loops), "a controller that exits leaves the loops serving"
    stopped = result_of(run_controller(tmp_path, workers, keys, "hoststop"))
    assert not actor_pids() & {pid for pid, _, _ in stopped["answers"]}, "stop() ended the mesh's workers"
    assert all(loop.poll() is None for loop in loops), "Monarch's stop() leaves the loops serving"
    second = result_of(run_controller(tmp_path, workers, keys, "stop"))
    assert len({pid for pid, _, _ in second["answers"]}) == 4
    assert second["shutdown_s"] < 5, "shutdown() never waits for a worker loop's process to exit"
    for loop in loops:  # Monarch's shutdown() ends run_worker_loop_forever's process
        assert loop.wait(15) == 0
        assert "returned" not in (loop.communicate()[0] or ""), "run_worker_loop_forever never returns"
    assert not any(os.path.exists(w.removeprefix("ipc://")) for w in workers), "the loops remove their socket files"


def test_a_host_lost_by_a_failed_request_is_still_asked_to_end_its_loop_at_shutdown(tmp_path, worker_loops):
    """A request to host 0 failed (it timed out): the host counts as lost, but its lifeline holds and its loop
    serves on. ``shutdown()`` asks it too, briefly (before: only the hosts not lost were asked, so that loop
    outlived the shutdown that was to end it, and a scheduler's job with it)."""
    workers, keys, loops = worker_loops
    out = result_of(run_controller(tmp_path, workers, keys, "lose"))
    assert out["shutdown_s"] < 5
    for loop in loops:
        assert loop.wait(15) == 0, "every loop ends"


def test_inherited_socket_proc_id_forms_and_the_variant_that_returns(tmp_path):
    """Monarch's fd bootstrap (``tcp://host:fdN``), a ``<proc-id>@<url>`` address, and
    ``run_worker_loop_until_shutdown``, which returns when its host mesh is shut down."""
    keys = new_session_keys()
    bound = socket.socket()
    bound.bind(("127.0.0.1", 0))  # bound, not listening: the worker loop makes it listen
    port = bound.getsockname()[1]
    loops = [
        start_loop(f"tcp://127.0.0.1:fd{bound.fileno()}", keys, "run_worker_loop_until_shutdown", (bound.fileno(),)),
        start_loop(f"service@tcp://127.0.0.1:{(other := free_port())}", keys),
    ]
    bound.close()
    try:
        out = result_of(run_controller(tmp_path, [f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{other}"], keys, "stop"))
        assert len({pid for pid, _, _ in out["answers"]}) == 4
        assert [loop.wait(15) for loop in loops] == [0, 0]
        assert [loop.communicate()[0].strip() for loop in loops] == ["returned", ""]
    finally:
        end_loops(loops)


def test_bad_arguments_are_refused_with_the_reason(monkeypatch):
    with pytest.raises(NotImplementedError, match="CURVE key"):
        actors.run_worker_loop_forever(address="tcp://127.0.0.1:1", ca="my-ca.pem")
    bad_addresses = {
        "localhost:4444": "tcp://<host>:<port>",
        "ipc://relative/path": "absolute path",
        "ipc:///tmp/../x": "normalised",
        f"ipc:///{'x' * 120}": "at most 107 bytes",
        "tcp://127.0.0.1:99999": "1-65535",
        "tcp://127.0.0.1:fdx": "descriptor number",
        "tcp://127.0.0.1:fd987654": "not an open socket",
        "tcp://host:4444@tcp://0.0.0.0:4444": "'<advertised>@<bind>' is not offered",
        "proc@localhost": "<proc-id>@<url>",
    }
    for address, why in bad_addresses.items():
        with pytest.raises(ValueError, match=re.escape(why)):
            actors.run_worker_loop_forever(address=address, ca="trust_all_connections")
    from actors._meshes._worker_addresses import serving_address

    assert serving_address("ipc:///tmp/a@b/loop").address == "ipc:///tmp/a@b/loop"  # '@' in a socket path
    assert serving_address("service@ipc:///tmp/loop").address == "ipc:///tmp/loop"
    with pytest.raises(TypeError, match="is a string"):
        actors.run_worker_loop_forever(address=4444, ca="trust_all_connections")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="wildcard"):
        actors.run_worker_loop_forever(address="tcp://0.0.0.0:4444", ca="trust_all_connections")
    with open(os.devnull) as not_a_socket:
        with pytest.raises(ValueError, match=r"not an open socket|not a tcp socket"):
            actors.run_worker_loop_forever(
                address=f"tcp://127.0.0.1:fd{not_a_socket.fileno()}", ca="trust_all_connections"
            )
    monkeypatch.delenv("ACTORS_CURVE_PUBLIC", raising=False)
    with pytest.raises(RuntimeError, match="needs the session's CURVE key"):
        actors.run_worker_loop_forever(address="tcp://127.0.0.1:4444", ca="trust_all_connections")
    with pytest.raises(TypeError, match="non-empty list"):
        actors.attach_to_workers(workers="tcp://127.0.0.1:4444")
    with pytest.raises(ValueError, match="tcp://<host>:<port>"):
        actors.attach_to_workers(workers=["localhost:4444"])
    with pytest.raises(ValueError, match="not its descriptor"):
        actors.attach_to_workers(workers=["tcp://127.0.0.1:fd3"])
    for timeout in (0, -1.0, "30", True):
        with pytest.raises(ValueError, match="timeout must be a positive number of seconds"):
            actors.attach_to_workers(workers=["tcp://127.0.0.1:4444"], timeout=timeout)  # type: ignore[arg-type]
    with pytest.raises(NotImplementedError, match="start_worker_loop_forever"):
        actors.start_worker_loop_forever(address="tcp://127.0.0.1:4444", ca="trust_all_connections")
    monkeypatch.setenv("ACTORS_LIFELINE_SILENCE", "0.5")  # a lost host would be declared on one missed beat
    with pytest.raises(ValueError, match=r"ACTORS_LIFELINE_SILENCE='0.5': .* at least 2"):
        actors.attach_to_workers(workers=["tcp://127.0.0.1:4444"])


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
    proc = run_python(str(script), timeout=120, env=clean_env(None))
    out = result_of(proc)
    assert out["extent"] == {"hosts": 2, "gpus": 2}
    assert [text for _, text in out["steps"]][1] == "Trainer {'hosts': 0/2, 'gpus': 1/2} taking a step."
    assert wait_for(lambda: not (actor_pids() - before), timeout=15)
    loops = subprocess.run(["pgrep", "-f", "run_worker_loop_forever"], capture_output=True, text=True).stdout.split()
    assert not loops, "the worker loops end with the program that started them"


def test_hosts_from_config_ends_the_loops_it_started_when_the_next_cannot_start(monkeypatch, tmp_path):
    """The second worker loop's start fails (no process can be made): the first, already running, is ended and
    the folder removed (before: a list comprehension lost the started ones, which served on until this program
    exited)."""
    from actors._meshes import _attached

    started: list[subprocess.Popen[bytes]] = []

    def start(address: str) -> tuple[str, subprocess.Popen[bytes]]:
        if started:
            raise OSError("[Errno 11] Resource temporarily unavailable")
        started.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"]))
        return address, started[0]

    folder = tmp_path / "loops"
    monkeypatch.setenv("ACTORS_CURVE_PUBLIC", "p")
    monkeypatch.setenv("ACTORS_CURVE_SECRET", "s")
    monkeypatch.setattr(_attached, "_use_tcp", lambda: None)
    monkeypatch.setattr(_attached, "make_runtime_dir", lambda: (folder.mkdir(), str(folder))[1])
    monkeypatch.setattr(_attached, "_start_worker_loop", start)
    try:
        with pytest.raises(OSError, match="Resource temporarily unavailable"):
            _attached.hosts_from_config("hosts", 2)
        assert started[0].poll() is not None, "the loop already started is ended"
        assert not folder.exists()
    finally:
        if started[0].poll() is None:
            started[0].kill()
            started[0].wait()


def test_a_senders_ipc_address_outside_the_session_folder_is_trusted_only_on_an_authenticated_inbox(tmp_path):
    """A header names where replies go: without CURVE only this session's folder may hold a peer's socket; with
    it (every sender holds the key) an ipc worker loop's socket may lie anywhere, but never a relative, denormalised
    or over-long path."""
    from actors._shared._session import valid_peer_address

    folder = str(tmp_path / "session")
    inside, outside = f"ipc://{folder}/w1.sock", f"ipc://{tmp_path}/loop0"
    assert valid_peer_address(inside, folder) and valid_peer_address(inside, folder, authenticated=True)
    assert not valid_peer_address(outside, folder)
    assert valid_peer_address(outside, folder, authenticated=True)
    for bad in ("ipc://relative/loop", f"ipc://{tmp_path}/../loop", f"ipc:///{'x' * 120}", "ipc://"):
        assert not valid_peer_address(bad, folder, authenticated=True), bad


def test_an_ipc_path_another_process_serves_or_a_plain_file_is_refused(tmp_path):
    """Binding would silently take the path over (ZeroMQ removes what it finds there); a stale socket is fine."""
    import errno as errno_codes
    import socket as sockets

    from actors._meshes._worker_addresses import serving_address

    served = str(tmp_path / "served")
    with sockets.socket(sockets.AF_UNIX, sockets.SOCK_STREAM) as listener:
        listener.bind(served)
        listener.listen()
        with pytest.raises(OSError, match="already serves") as refused:
            serving_address(f"ipc://{served}")
        assert refused.value.errno == errno_codes.EADDRINUSE
    assert serving_address(f"ipc://{served}").address == f"ipc://{served}", "a socket nobody serves is stale"
    (tmp_path / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="is not a socket"):
        serving_address(f"ipc://{tmp_path}/notes.txt")
    assert (tmp_path / "notes.txt").read_text() == "keep me"


async def test_a_host_agent_starts_one_forkserver_however_often_asked_and_stops_one_still_starting(monkeypatch):
    """Two ``start`` calls share one forkserver; a stop (``__cleanup__``) that comes while it is still starting
    waits for it and stops it, instead of leaving it to the lifeline."""
    import threading

    from actors._meshes import _worker_loop

    entered, release = threading.Event(), threading.Event()
    made: list[Any] = []

    class Node:
        ip, stopped = "127.0.0.1", False

        def stop(self) -> None:
            self.stopped = True

    def tied_to(ip: str, folder: str, ticket: Any) -> Node:
        entered.set()
        release.wait(30)
        made.append(Node())
        return made[-1]

    monkeypatch.setattr(_worker_loop.NodeForkserver, "tied_to", tied_to)
    monkeypatch.setattr(_worker_loop, "make_runtime_dir", lambda: "/nonexistent")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    agent = _worker_loop.HostAgent(None)  # type: ignore[arg-type]
    starts = [asyncio.ensure_future(agent.start()), asyncio.ensure_future(agent.start())]
    assert await asyncio.to_thread(entered.wait, 30)
    cleanup = asyncio.ensure_future(agent.__cleanup__(None))  # (queued before the forkserver can be ready)
    release.set()
    infos = await asyncio.wait_for(asyncio.gather(*starts), 30)
    await asyncio.wait_for(cleanup, 30)
    assert [info["ip"] for info in infos] == ["127.0.0.1"] * 2
    assert len(made) == 1, "one forkserver however many start calls"
    assert made[0].stopped, "a stop during start stops the forkserver it started"


LOST_OR_LATE = textwrap.dedent(
    """
    import json, os, signal, sys, time
    from actors import attach_to_workers

    def failure(exc):
        return f"{type(exc).__name__}: {exc}"

    def until(condition, what):
        deadline = time.monotonic() + 60
        while not condition():
            assert time.monotonic() < deadline, what
            time.sleep(0.02)

    def main(workers, pids, unreachable):
        out = {}
        # A worker's loop dies after its agent started, while another worker has not answered yet: attaching
        # fails at once, naming the lost one, not at the deadline two minutes away.
        hosts = attach_to_workers(name="lost", ca="trust_all_connections", workers=[workers[0], unreachable],
                                  timeout=120)
        until(lambda: hosts._attaching.started == {0}, "the first agent started")  # (internal: nothing public says)
        os.kill(pids[0], signal.SIGKILL)
        t = time.monotonic()
        try:
            hosts.initialized.get()
            out["lost"] = "ready"
        except Exception as exc:
            out["lost"] = failure(exc)
        out["lost_s"] = time.monotonic() - t
        t = time.monotonic()
        hosts.shutdown()
        out["shutdown_lost_s"] = time.monotonic() - t
        # A worker too slow for the deadline answers `start` after attaching failed: shutting down still stops
        # it (its forkserver would otherwise run until the lifeline ends) and ends its loop.
        os.kill(pids[1], signal.SIGSTOP)
        hosts = attach_to_workers(name="late", ca="trust_all_connections", workers=[workers[1]], timeout=1)
        try:
            hosts.initialized.get()
            out["late"] = "ready"
        except Exception as exc:
            out["late"] = failure(exc)
        os.kill(pids[1], signal.SIGCONT)
        t = time.monotonic()
        until(lambda: hosts._attaching.started == {0}, "the late agent started")
        out["late_start_s"] = time.monotonic() - t
        t = time.monotonic()
        hosts.shutdown()
        out["shutdown_late_s"] = time.monotonic() - t
        print(json.dumps(out), flush=True)

    if __name__ == "__main__":
        main(json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3])
    """
)


@pytest.mark.parametrize("worker_loops", ["ipc"], indirect=True)
def test_a_worker_lost_while_attaching_fails_it_at_once_and_a_late_starter_is_stopped_at_shutdown(
    tmp_path, worker_loops
):
    workers, keys, loops = worker_loops
    assert wait_for(lambda: all(os.path.exists(w.removeprefix("ipc://")) for w in workers), timeout=30)
    script = tmp_path / "lost_or_late.py"
    script.write_text(LOST_OR_LATE)
    pids = json.dumps([loop.pid for loop in loops])
    proc = run_python(
        str(script), json.dumps(workers), pids, f"ipc://{tmp_path}/never_bound", timeout=120, env=clean_env(keys)
    )
    out = result_of(proc)
    assert out["lost"].startswith(f"RuntimeError: attach failed: lost the worker loop at {workers[0]}"), out["lost"]
    assert out["lost_s"] < 30, "a lost worker fails attaching without waiting for the deadline"
    assert out["shutdown_lost_s"] < 10, "shutting down asks no lost worker to stop (it waited 15 s for an answer)"
    assert "did not answer within 1s" in out["late"], out["late"]
    assert loops[1].wait(15) == 0, "the late starter's loop was ended by its mesh's shutdown"


SHUT_BEFORE_START = textwrap.dedent(
    """
    import json, os, signal, sys, threading, time
    from actors import attach_to_workers

    def main(workers, pids):
        # Both loops are paused: attaching returns, and the mesh is shut down before any agent answered `start`.
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        hosts = attach_to_workers(name="early", ca="trust_all_connections", workers=workers, timeout=60)
        out = {"started": sorted(hosts._attaching.started)}  # (internal: nothing public says)
        resume = threading.Timer(0.5, lambda: [os.kill(pid, signal.SIGCONT) for pid in pids])
        resume.start()
        t = time.monotonic()
        hosts.shutdown()
        out["shutdown_s"] = time.monotonic() - t
        resume.join()
        deadline = time.monotonic() + 60  # (kept alive until the loops are gone: the request left before it ends)
        while any(os.path.exists(w.removeprefix("ipc://")) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        print(json.dumps(out), flush=True)

    if __name__ == "__main__":
        main(json.loads(sys.argv[1]), json.loads(sys.argv[2]))
    """
)


@pytest.mark.parametrize("worker_loops", ["ipc"], indirect=True)
def test_a_mesh_shut_down_before_its_agents_answered_still_ends_their_loops(tmp_path, worker_loops):
    """``shutdown()`` right after ``attach_to_workers`` returned asked only the agents that had answered `start`
    (none): the others started their forkserver later and the loops served on. Every agent not lost is asked."""
    workers, keys, loops = worker_loops
    assert wait_for(lambda: all(os.path.exists(w.removeprefix("ipc://")) for w in workers), timeout=30)
    script = tmp_path / "shut_before_start.py"
    script.write_text(SHUT_BEFORE_START)
    pids = json.dumps([loop.pid for loop in loops])
    out = result_of(run_python(str(script), json.dumps(workers), pids, timeout=120, env=clean_env(keys)))
    assert out["started"] == [], "no agent had answered when the mesh was shut down"
    assert out["shutdown_s"] < 10
    for loop in loops:
        assert loop.wait(15) == 0, "shutdown() ends the worker loops, answered or not"


async def test_a_shutdown_awaited_on_an_event_loop_runs_off_the_loop_and_is_awaited_to_its_end():
    """Monarch's ``await hosts.shutdown()``: it ran on the loop's thread, where each of its waits raised "would
    block the running event loop" (swallowed), the lifelines' threads were joined on the loop, and it returned a
    finished Future before the hosts had stopped. Now it starts on a worker thread and is awaited to its end."""
    import threading
    import types

    from actors._meshes._remote_host_mesh import RemoteHostMesh

    loop_thread, release = threading.get_ident(), threading.Event()
    calls: list[tuple[bool, bool]] = []

    def _release(end_hosts: bool) -> None:
        release.wait(30)  # (a shutdown's waits, on its own thread)
        calls.append((end_hosts, threading.get_ident() != loop_thread))

    mesh = types.SimpleNamespace(_root=None, _release=_release, _shutting_down=None)
    mesh._released = functools.partial(RemoteHostMesh._released, mesh)
    ended = RemoteHostMesh.shutdown(mesh)  # type: ignore[arg-type]
    waiting = asyncio.ensure_future(_awaited(ended))
    await asyncio.sleep(0)
    assert not waiting.done() and not calls, "under way, off the loop, which runs on"
    release.set()
    await asyncio.wait_for(waiting, 30)
    assert calls == [(True, True)]


async def _awaited(future: Any) -> None:
    await future
