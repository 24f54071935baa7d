"""Failure behaviour: dead actors, hostile frames, and a controller that dies."""

from __future__ import annotations

import asyncio
import contextlib
import glob
import os
import signal
import subprocess
import sys
import textwrap
import time

import msgpack
import pytest
import zmq
from harness import actor_pids, wait_for
from support import Echo

from actors import ActorDied, DecodeError, ProcMesh, this_host
from actors._wire._records import PROTOCOL_VERSION, Kind


async def test_kill_9_fails_pending_and_later_calls_promptly(procs: ProcMesh):
    procs.add_failure_handler(lambda failure: failure.exception_type == "ActorDied")  # handled: contained
    echo = procs.spawn("echo", Echo)
    victim = echo.slice(procs=0)
    pid = await victim.pid.call_one()
    pending = [victim.sleep.call_one(60) for _ in range(3)]
    whole = echo.sleep.call(60)
    start = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    for fut in [*pending, whole]:
        with pytest.raises(ActorDied, match="died"):
            await asyncio.wait_for(fut, 5)
    assert time.monotonic() - start < 1.5
    start = time.monotonic()
    with pytest.raises(ActorDied):
        await victim.add.call_one(1)
    assert time.monotonic() - start < 0.5, "calls to a known-dead actor fail at once (no wait for any answer)"
    assert await echo.slice(procs=1).add.call_one(1) == 1, "the other actor is unaffected"
    assert any(f.exception_type == "ActorDied" and f.pid == pid for f in procs.failures)


async def test_a_reply_already_in_the_socket_wins_over_its_senders_death(procs: ProcMesh):
    """A worker answers, then dies, and its pidfd is read before its reply (the loop's reader ran first, or the
    reply waited behind a full turn's records): the call still gets its answer, not ``ActorDied``. What waits in
    the inbox is read once the news of the death has gone out, before the dead process's calls fail."""
    from actors._runtime._core import runtime

    procs.add_failure_handler(lambda failure: True)  # (the death below is contained)
    both = procs.spawn("echo", Echo)
    pid = (await both.pid.call()).item(procs=0)  # (both ranks answered: no late answer of rank 1 comes next)
    echo = both.slice(procs=0)
    rt = runtime()
    rt.inbox.pump()  # (nothing else waits in the socket: what comes now is the reply)
    answer = echo.add.call_one(41)  # on the wire now; the loop does not run until the await below
    deadline = time.monotonic() + 10
    while not rt.inbox.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:  # the reply waits in the socket, unread
        assert time.monotonic() < deadline, "no reply came"
        time.sleep(0.001)
    os.kill(pid, signal.SIGKILL)
    watcher = rt.registry.watcher
    while pid not in watcher.dead:  # its pidfd handled first, the reply still unread
        assert time.monotonic() < deadline, "its death was not seen"
        watcher.take_pending(pid)
        time.sleep(0.001)
    assert await asyncio.wait_for(answer, 5) == 41
    with pytest.raises(ActorDied):
        await echo.add.call_one(1)


def test_calls_waiting_on_a_dead_process_fail_on_every_rank_it_hosts_but_not_once_answered():
    """The calls a dead process owes are taken when its exit is announced and failed after the inbox is read:
    one answered meanwhile stays answered; one still owed a rank the process hosts fails, whichever of its ranks
    answered (the first version kept one rank per call, and a call whose kept rank answered was never failed)."""
    from actors._runtime._pending_calls import CallTable, fail_waiting
    from actors._shared._liveness import ProcRef

    calls = CallTable()
    dead, alive = ProcRef("ipc:///tmp/dead", 7), ProcRef("ipc:///tmp/alive", 8)
    answered = calls.open("echo", "add", [(0, dead)])
    both = calls.open("echo", "add", [(0, dead), (1, dead), (2, alive)])
    other = calls.open("echo", "add", [(0, alive)])
    doomed = calls.waiting_on(dead)
    assert doomed == [answered, both]
    answered.deliver(0, True, 1)  # (read from the inbox before the calls fail)
    both.deliver(0, True, 2)
    fail_waiting(doomed, dead, 7, "process exited")
    assert answered.error is None and answered.results == {0: 1}
    assert isinstance(both.error, ActorDied) and "7" in str(both.error)
    assert not other.done


def test_an_answer_meant_for_a_callers_predecessor_completes_none_of_its_own_calls():
    """A caller restarted at its address (a restart policy) numbered its calls from 1 again: an answer to its
    predecessor's call, sent before the actor's process had seen that caller die, reached the new process (the
    same address) and completed the new call of that number with the old call's result. Each process numbers its
    calls from a random start, so such an answer finds no call of its."""
    from actors._runtime._pending_calls import CallTable
    from actors._shared._liveness import ProcRef
    from actors._wire._records import Reply

    target = [(0, ProcRef("ipc:///tmp/actor", 9))]
    earlier, restarted = CallTable(), CallTable()  # the caller's process, then the one started in its place
    old = earlier.open("x", "slow", target)
    new = restarted.open("x", "fast", target)
    restarted.on_reply(Reply(old.call_id, 0, True, "old"))
    assert not new.done, "the predecessor's answer completed the new call"
    restarted.on_reply(Reply(new.call_id, 0, True, "new"))
    assert new.results == {0: "new"}


def test_a_calls_deadline_follows_the_runtime_to_its_next_loop(sockets_dir):
    """A call with a deadline given up on (``wait_for`` ran out first) inside ``asyncio.run``: its deadline's timer
    was on that loop, which closed; the actor never answered, so the call stayed in the table for good (a service
    calling ``asyncio.run`` per request grew without bound). The deadline is timed again on the next loop."""
    from support import Blocker

    from actors._runtime._core import runtime

    procs = this_host().spawn_procs(per_host={"procs": 1})
    try:
        blocker = procs.spawn("blocker", Blocker)
        blocker.ping.call_one().get(timeout=30)
        blocker.freeze.broadcast(3600.0)  # it never answers
        rt = runtime()
        before = len(rt.calls)

        async def give_up() -> None:
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(blocker.ping.with_timeout(0.3).call_one(), 0.01)

        asyncio.run(give_up())  # the loop ends, the call's deadline timer with it
        rt.driver.follow_running_loop()  # the background loop drives the runtime again
        assert wait_for(lambda: len(rt.calls) == before, timeout=10), "the call stayed in the table"
    finally:
        procs.stop(timeout=0.1).get(timeout=30)


async def test_stop_of_a_dead_mesh_returns(sockets_dir):
    procs = this_host().spawn_procs(per_host={"procs": 2})
    echo = procs.spawn("echo", Echo)
    pids = [pid for pid, _, _ in (await echo.whoami.call()).values()]
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    await asyncio.wait_for(procs.stop(), 10)
    await asyncio.wait_for(procs.stop(), 10)  # twice is fine


async def test_a_stop_given_up_on_goes_on_and_shutdown_context_waits_for_it(sockets_dir):
    """``wait_for(procs.stop(), t)`` ran out while a worker's loop was blocked: its stop was abandoned before the
    SIGKILL step, and ``shutdown_context()`` skipped the mesh as stopping already, so the process lived on. The stop
    runs to its end whoever waits; ``shutdown_context`` (and a second ``stop()``) waits for it."""
    from support import Blocker

    import actors

    procs = this_host().spawn_procs(per_host={"procs": 1})
    blocker = procs.spawn("blocker", Blocker)
    await blocker.ping.call_one()
    pid = procs.pids[0]
    blocker.freeze.broadcast(3600.0)  # its loop never answers the stop: only SIGKILL ends it
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(procs.stop(timeout=0.1), 0.3)
    with pytest.raises(actors.CallTimeout, match=r"did not stop within host_timeout=0\.1s; their stops go on"):
        await actors.shutdown_context(host_timeout=0.1)  # (the project's own timeout, not asyncio's bare one)
    await asyncio.wait_for(actors.shutdown_context(), 30)
    assert pid not in actor_pids()
    await asyncio.wait_for(procs.stop(), 5)  # the same run, done


async def test_a_process_the_stop_cannot_kill_leaves_the_others_killed_and_cleaned_up(sockets_dir, monkeypatch):
    """The stop's SIGKILL step raised on the first process it could not kill (an agent that could not be asked,
    a pid not ours): the steps after it were lost with the generator, and a later ``stop()`` found nothing left to
    run and reported success, the other processes alive and their socket files kept. The others are killed all
    the same, and the files removed."""
    from support import Blocker

    from actors._meshes import _proc_stop

    procs = this_host().spawn_procs(per_host={"procs": 2})
    blocker = procs.spawn("blocker", Blocker)
    await blocker.ping.call()
    stubborn, other = procs.pids
    sockets = [ref.address.removeprefix("ipc://") for ref in procs._procs]
    blocker.freeze.broadcast(3600.0)  # neither answers the stop: only SIGKILL ends them
    kill = os.kill

    def refuse_the_first(pid: int, sig: int) -> None:
        if pid == stubborn:
            raise PermissionError(f"not allowed to signal {pid}")
        kill(pid, sig)

    monkeypatch.setattr(_proc_stop.os, "kill", refuse_the_first)
    try:
        await asyncio.wait_for(procs.stop(timeout=0.1), 30)
        assert other not in actor_pids(), "the other process was not killed"
        assert not os.path.exists(sockets[1])
    finally:
        monkeypatch.undo()
        with contextlib.suppress(ProcessLookupError):
            os.kill(stubborn, signal.SIGKILL)
        await asyncio.wait_for(procs.stop(), 30)


async def test_a_process_reported_only_after_its_meshs_stop_is_killed_then(sockets_dir):
    """A worker not started yet when its mesh stopped (its forkserver still importing): no pid to kill, so the stop
    ended without it, and the worker, started after, lived on (a frozen one for good). It is killed as its pid is
    reported."""
    from actors._meshes._proc_stop import stop_steps
    from actors._runtime._core import runtime
    from actors._shared._session import inbox_address

    rt = runtime()
    late = rt.registry.proc(inbox_address(rt.dir, "w-late"), None)  # (spawned, its pid not reported yet)
    for _condition, _limit in stop_steps(rt, [late], 0.1, None):
        pass  # every step at once: the SIGKILL step finds no pid
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        rt.registry.set_pid(late, worker.pid)  # its forkserver reports it at last
        assert worker.wait(timeout=10) == -signal.SIGKILL
        await asyncio.wait_for(_until_dead(late), 10)
    finally:
        worker.kill()
        worker.wait()


async def _until_dead(ref) -> None:  # type: ignore[no-untyped-def]
    while not ref.dead:  # (its pidfd's news, read by the loop: polled with a guard)
        await asyncio.sleep(0.01)


def test_a_stop_waited_for_without_a_loop_honours_its_timeout_and_the_next_waiter_goes_on(sockets_dir):
    """Waited for on this thread (no loop runs the runtime: the program's exit, ``shutdown_context``'s synchronous
    wait), a mesh's stop dropped the timeout it was given and ran every step (a frozen worker: its answer's grace,
    then the kill's), so ``host_timeout`` could not bound it. It raises ``CallTimeout`` at the timeout; a later
    wait goes on from where it was left, to the kill."""
    from support import Blocker

    import actors

    procs = this_host().spawn_procs(per_host={"procs": 1})
    blocker = procs.spawn("blocker", Blocker)
    blocker.ping.call_one().get(timeout=30)
    pid = procs.pids[0]
    blocker.freeze.broadcast(3600.0)  # its loop never answers the stop: only SIGKILL ends it
    stop = procs.stop(timeout=0.1)
    started = time.monotonic()
    with pytest.raises(actors.CallTimeout, match=r"did not end within 0\.3s"):
        stop._wait_sync(0.3)  # (the wait a program without a loop makes)
    assert time.monotonic() - started < 1.5, "the timeout was not honoured"
    procs.stop().get(timeout=30)
    assert wait_for(lambda: pid not in actor_pids(), timeout=10)


def test_shutdown_context_without_a_loop_waits_host_timeout_in_all_not_per_mesh(monkeypatch):
    """Two meshes whose stops take 0.3 s and 0.75 s, ``host_timeout=0.5``, waited for without an event loop
    (``shutdown_context``'s synchronous wait): ``CallTimeout`` at 0.5 s, as the awaited form raises (before: each
    stop had the whole ``host_timeout``, so the second one's wait ran on to 0.75 s and returned without a word)."""
    from types import SimpleNamespace

    import actors
    from actors._meshes import _shutdown

    class Stop:
        def __init__(self, seconds: float) -> None:
            self.ends = time.monotonic() + seconds

        def get(self, timeout: float | None = None) -> None:
            left = self.ends - time.monotonic()
            if timeout is not None and left > timeout:
                time.sleep(timeout)
                raise actors.CallTimeout("gave up")
            time.sleep(max(0.0, left))

    meshes = [SimpleNamespace(stop=lambda seconds=seconds: Stop(seconds)) for seconds in (0.3, 0.75)]
    parts = {_shutdown.SPAWNED_MESHES: meshes, _shutdown.CONTROLLERS: SimpleNamespace(spawned={})}
    monkeypatch.setattr(_shutdown, "current_runtime", lambda: SimpleNamespace(parts=parts))
    stopped: list[bool] = []

    async def stop_controllers() -> None:
        stopped.append(True)

    monkeypatch.setattr(_shutdown, "stop_controllers", stop_controllers)
    waiting = actors.shutdown_context(host_timeout=0.5)
    with pytest.raises(actors.CallTimeout, match=r"did not stop within host_timeout=0\.5s; their stops go on"):
        waiting._wait_sync(None)  # type: ignore[misc]
    assert stopped == [True], "the controllers stop all the same"


async def test_a_stop_reaches_a_frozen_process_whose_link_is_full(sockets_dir):
    """A frozen worker that a million records wait for: the stop request is queued past the link's limits, as an
    owed answer is (before, ``BufferFull`` escaped ``stop()`` before its SIGKILL step, the process lived on, and a
    second ``stop()`` raised again); the frozen process never answers it and is killed."""
    from support import Blocker

    from actors._runtime._core import runtime
    from actors._transport._outbox import LINK_RECORDS

    procs = this_host().spawn_procs(per_host={"procs": 1})
    blocker = procs.spawn("blocker", Blocker)
    await blocker.ping.call_one()
    pid = procs.pids[0]
    blocker.freeze.broadcast(3600.0)
    runtime().link(procs._procs[0]).records = LINK_RECORDS  # (as if a million records waited for it)
    await asyncio.wait_for(procs.stop(timeout=0.1), 30)
    assert pid not in actor_pids()


async def test_a_process_dying_in_its_stop_leaves_the_others_their_cleanup(sockets_dir, monkeypatch):
    """Rank 0 dies in its cleanup while rank 1's takes a second (its bound is 10 s): rank 1 finishes it. Before,
    the death failed the stop call, and every process left got only the time to exit (3 s; 0.2 s here) before
    SIGKILL, whatever its cleanup's bound."""
    from support import CleanupThatDiesOrTakesItsTime

    from actors import Channel
    from actors._meshes import _proc_stop

    monkeypatch.setattr(_proc_stop, "EXIT_WAIT", 0.2)
    port, recv = Channel.open(str)
    procs = this_host().spawn_procs(per_host={"procs": 2})
    mesh = procs.spawn("c", CleanupThatDiesOrTakesItsTime, port)
    await mesh.ping.call()
    pids = set(procs.pids)
    await asyncio.wait_for(procs.stop(timeout=10), 30)
    assert await asyncio.wait_for(recv.recv(), 30) == "done 1"
    assert not (pids & actor_pids())


async def test_stop_runs_cleanup_and_ends_processes(sockets_dir):
    from support import Cleanup

    from actors import Channel

    port, recv = Channel.open(str)
    procs = this_host().spawn_procs(per_host={"procs": 2})
    mesh = procs.spawn("c", Cleanup, port)
    await mesh.ping.call()
    pids = set(procs.pids)
    await procs.stop()
    assert sorted([await recv.recv(), await recv.recv()]) == ["cleanup 0", "cleanup 1"]
    assert not (pids & actor_pids())
    with pytest.raises(RuntimeError, match="stopped"):
        procs.spawn("again", Echo)


def batch(*messages: object, frames: int = 0) -> bytes:
    """A batch payload as the runtime frames it: frame count, byte length, message."""
    out = b""
    for message in messages:
        data = message if isinstance(message, bytes) else msgpack.packb(message)
        out += msgpack.packb(frames) + msgpack.packb(len(data)) + data
    return out


async def test_a_bad_message_does_not_cost_the_rest_of_its_batch():
    from actors import Channel
    from actors._wire._codec import EXT_DATACLASS

    PORT = int(Kind.PORT)
    from actors._runtime._core import runtime

    port, recv = Channel.open()
    unknown = msgpack.ExtType(EXT_DATACLASS, msgpack.packb(["not_loaded_module:Thing", [1]]))
    header = msgpack.packb([PROTOCOL_VERSION, f"ipc://{runtime().dir}/nowhere.sock", 1])
    payload = batch(
        [PORT, port._id, "first"], msgpack.packb([PORT, port._id, unknown]), b"\xc1", [PORT, port._id, "last"]
    )
    _inject(runtime().address, [header, payload])
    assert await asyncio.wait_for(recv.recv(), 5) == "first"
    with pytest.raises(DecodeError, match="not_loaded_module"):  # (told, in its place; the malformed one dropped)
        await asyncio.wait_for(recv.recv(), 5)
    assert await asyncio.wait_for(recv.recv(), 5) == "last"


async def test_a_header_naming_a_foreign_address_is_refused():
    """Replies and credits go to the header's address, so it must belong to this session."""
    from actors import Channel

    PORT = int(Kind.PORT)
    from actors._runtime._core import runtime

    port, recv = Channel.open()
    for address in (
        "ipc:///tmp/elsewhere.sock",
        "tcp://evil.example:notaport",
        "inproc://x",
        f"ipc://{runtime().dir}/../x.sock",
    ):
        header = msgpack.packb([PROTOCOL_VERSION, address, 1])
        _inject(runtime().address, [header, batch([PORT, port._id, "smuggled"])])
    good = msgpack.packb([PROTOCOL_VERSION, f"ipc://{runtime().dir}/peer.sock", 1])
    _inject(runtime().address, [good, batch([PORT, port._id, "delivered"])])
    assert await asyncio.wait_for(recv.recv(), 5) == "delivered"
    assert recv.qsize() == 0
    assert not any(a.startswith(("ipc:///tmp/elsewhere", "tcp://evil")) for a in runtime().outbox.links)


def _inject(address: str, frames: list[bytes]) -> None:
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(address)
    sock.send_multipart(frames)
    sock.close()


async def test_malformed_frames_are_dropped_and_the_worker_keeps_serving(procs: ProcMesh):
    echo = procs.spawn("echo", Echo).slice(procs=0)
    assert await echo.add.call_one(1) == 1
    address = procs._procs[0].address
    from actors._runtime._core import runtime

    header = msgpack.packb([PROTOCOL_VERSION, f"ipc://{runtime().dir}/nowhere.sock", 1])
    garbage = [
        [b"only one frame"],
        [b"\xc1", b""],
        [msgpack.packb([99, "x", 1]), b""],
        [header, b"\xc1\xc1"],
        [header, batch([1, 2])],  # CALL with the wrong arity
        [header, batch([3, 1, None], frames=5)],  # claims frames it lacks
        [header, batch([6, "no-such-op", None])],
        [header, msgpack.packb(0) + msgpack.packb(5) + b"\xdd\xff\xff\xff\xff"],  # declares 4G items
        [header, msgpack.packb(0) + msgpack.packb(1000) + b"\x01"],  # length past the end
    ]
    for frames in garbage:
        _inject(address, frames)
    assert await echo.add.call_one(41) == 41


def _run_script(tmp_path, body: str, **env_vars: str) -> subprocess.Popen[str]:
    script = tmp_path / "controller.py"
    script.write_text(textwrap.dedent(body))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(__file__), *sys.path]), **env_vars)
    return subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )


def _ready_line(proc: subprocess.Popen[str]) -> str:
    """The controller script's ``READY ...`` line (read past what it prints before)."""
    assert proc.stdout is not None
    line = ""
    while not line.startswith("READY"):
        line = proc.stdout.readline()
        assert line, "controller exited early"
    return line


CONTROLLER = """
    import asyncio, os, sys
    from actors import this_host
    from actors._runtime._core import runtime
    from support import Echo

    async def main():
        procs = this_host().spawn_procs(per_host={"procs": 3})
        echo = procs.spawn("echo", Echo)
        pids = [p for p, _, _ in (await echo.whoami.call()).values()]
        print("READY", runtime().dir, *pids, flush=True)
        await asyncio.sleep(600)

    if __name__ == "__main__":
        asyncio.run(main())
"""


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT, signal.SIGTERM])
def test_controller_death_ends_every_actor_process(tmp_path, sig):
    proc = _run_script(tmp_path, CONTROLLER)
    try:
        _, rundir, *pids = _ready_line(proc).split()
        workers = {int(p) for p in pids}
        assert workers <= actor_pids()
        start = time.monotonic()
        proc.send_signal(sig)
        assert wait_for(lambda: not (workers & actor_pids()), timeout=5)
        elapsed = time.monotonic() - start
        assert elapsed < 4.0, f"workers outlived the controller by {elapsed:.2f}s"  # (measured: docs/reliability.md)
        assert wait_for(lambda: not os.path.exists(rundir), timeout=3), "socket directory left behind"
        assert not glob.glob(f"/dev/shm/{os.path.basename(rundir)}-*")
    finally:
        proc.kill()
        proc.wait()


CONTROLLER_WITH_A_FORKED_HELPER = """
    import asyncio, multiprocessing, os, sys, time
    from actors import this_host
    from actors._processes._forkserver import forkserver
    from actors._runtime._core import runtime
    from support import Echo

    async def main():
        procs = this_host().spawn_procs(per_host={"procs": 2})
        echo = procs.spawn("echo", Echo)
        pids = [p for p, _, _ in (await echo.whoami.call()).values()]
        helper = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,), daemon=True)
        helper.start()  # (a plain fork: it inherits every descriptor the program holds, the forkserver's pipe too)
        print("READY", runtime().dir, helper.pid, forkserver(runtime()).process.pid, *pids, flush=True)
        await asyncio.sleep(600)

    if __name__ == "__main__":
        asyncio.run(main())
"""


def test_a_plain_fork_of_the_controller_does_not_keep_its_forkserver_alive(tmp_path):
    """A forkserver started as a fresh interpreter ends when its request pipe's last writer closes: a helper the
    program forked (multiprocessing's fork start) held that pipe, so after a ``kill -9`` of the controller the
    forkserver, its session folder and its segments outlived it for as long as the helper ran. A fork of the
    program closes the forkserver's pipe ends now."""
    proc = _run_script(tmp_path, CONTROLLER_WITH_A_FORKED_HELPER, ACTORS_FORKSERVER="exec")
    helper = 0
    try:
        _, rundir, helper_pid, forkserver_pid, *pids = _ready_line(proc).split()
        helper, forkserver = int(helper_pid), int(forkserver_pid)
        workers = {int(p) for p in pids}
        proc.send_signal(signal.SIGKILL)
        assert wait_for(lambda: not (workers & actor_pids()), timeout=10)
        assert wait_for(lambda: not _alive(forkserver), timeout=10), "the forkserver outlived its program"
        assert wait_for(lambda: not os.path.exists(rundir), timeout=5), "socket directory left behind"
    finally:
        proc.kill()
        proc.wait()
        if helper:
            with contextlib.suppress(ProcessLookupError):
                os.kill(helper, signal.SIGKILL)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, which its dead parent's init reaps, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


MAIN_SCRIPT = """
    import asyncio
    from dataclasses import dataclass
    from actors import Actor, Channel, endpoint, this_host

    @dataclass
    class Note:
        text: str

    class Speaker(Actor):
        @endpoint
        async def speak(self, port, text: str) -> Note:
            print("hello from", text, flush=True)
            port.send(Note(text.upper()))
            return Note(text)

    async def main():
        procs = this_host().spawn_procs(per_host={"procs": 1}, name="talk")
        s = procs.spawn("speaker", Speaker)
        port, recv = Channel.open(Note)
        note = await s.speak.call_one(port, "worker")
        got = await recv.recv()
        print("RESULT", type(note).__name__, note.text, got.text, flush=True)
        await procs.stop()

    if __name__ == "__main__":
        asyncio.run(main())
"""


@pytest.mark.parametrize("mode", ["fork", "exec"])
def test_actor_classes_in_main_prints_prefixed_and_clean_exit(tmp_path, mode):
    proc = _run_script(tmp_path, MAIN_SCRIPT, ACTORS_FORKSERVER=mode)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert "RESULT Note worker WORKER" in out
    assert "[speaker[0]] hello from worker" in out


def test_a_script_without_a_main_guard_runs_once(tmp_path):
    """Workers get the script's definitions from the forkserver forked off it: its top level never reruns."""
    body = MAIN_SCRIPT.replace('if __name__ == "__main__":\n        asyncio.run(main())', "asyncio.run(main())")
    proc = _run_script(tmp_path, body)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert out.count("RESULT Note worker WORKER") == 1, out


async def test_processes_are_named_for_ps(procs: ProcMesh):
    procs.spawn("namer", Echo)
    await procs.spawn("other", Echo).pid.call()
    for pid in procs.pids:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            title = f.read().decode()
        assert title.startswith("actors[") and "namer" in title and "other" in title


async def test_stop_is_eager(sockets_dir):
    procs = this_host().spawn_procs(per_host={"procs": 2})
    await procs.spawn("echo", Echo).pid.call()
    pids = set(procs.pids)
    stopping = procs.stop()  # not awaited yet: the request is already on the wire
    assert wait_for(lambda: not (pids & actor_pids()), timeout=10)
    await stopping


async def test_a_lost_forkserver_is_reaped_and_its_pipes_closed_at_once(procs: ProcMesh):
    """A forkserver that dies is reaped and both its pipes closed when its loss is seen (before, they stayed open and
    it stayed a zombie until the program exited); the next spawn starts a new one."""
    from actors._processes._forkserver import forkserver
    from actors._runtime._core import runtime

    await procs.initialized
    server = forkserver(runtime())
    pipes = {os.fstat(fd).st_ino for fd in (server.process.requests, server.status_fd)}

    def pipes_open_here() -> set[int]:
        found = set()
        for entry in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/self/fd/{entry}")
                if target.startswith("pipe:["):
                    found.add(int(target[6:-1]))
        return found & pipes

    assert len(pipes_open_here()) == 2
    os.kill(server.process.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10  # a guard against a hang only
    while server.process.returncode is None and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert server.closed and server.process.returncode == -signal.SIGKILL
    assert not os.path.exists(f"/proc/{server.process.pid}"), "reaped, not a zombie"
    assert pipes_open_here() == set()
    fresh = this_host().spawn_procs(per_host={"procs": 1})
    try:
        await fresh.initialized
        assert forkserver(runtime()) is not server
    finally:
        await fresh.stop()
