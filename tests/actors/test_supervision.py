"""Supervision: failures reach their owner; handled ones are contained, unhandled ones escalate."""

from __future__ import annotations

import asyncio
import os
import signal
import threading

import pytest
from harness import actor_pids, wait_for
from support import Echo, Fire, Respawner, Supervisor

import actors
from actors import Actor, Channel, Failure, Port, ProcMesh, SupervisionError, endpoint, send, this_host


async def test_an_unhandled_failure_faults_the_mesh(procs: ProcMesh):
    reported = asyncio.Event()
    procs.add_failure_handler(lambda failure: reported.set())  # observes, returns None: not handled
    fire = procs.spawn("fire", Fire)
    assert await fire.ok.call() is not None
    send(fire.explode, ("nobody handles this",), selection="choose")
    await asyncio.wait_for(reported.wait(), 30)
    with pytest.raises(SupervisionError, match=r"fire.*explode failed: KeyError: 'nobody handles this'") as info:
        await fire.ok.call()
    failure = info.value.failure
    assert isinstance(failure, Failure) and failure.pid in procs.pids and "raise KeyError" in failure.traceback
    assert procs.fault is info.value
    with pytest.raises(SupervisionError):
        send(fire.ok, (), selection="choose")
    with pytest.raises(SupervisionError):
        fire.slice(procs=1).ok.call_one()


async def test_a_coroutine_failure_handler_is_refused_and_an_awaitable_answer_handles_nothing(procs: ProcMesh):
    """A coroutine function's call returns a coroutine, always true: the failure counted as handled, the mesh was
    never faulted, and the handler's body never ran (a "never awaited" warning at best). It is refused when added;
    one that returns an awaitable anyway (a lambda around one) handles nothing."""

    async def log_it(failure: Failure) -> bool:
        return True

    with pytest.raises(TypeError, match="is a coroutine function: a handler answers at once"):
        procs.add_failure_handler(log_it)
    with pytest.raises(TypeError, match="is a coroutine function"):
        actors.add_failure_handler(log_it)
    reported = asyncio.Event()
    procs.add_failure_handler(lambda failure: reported.set())
    procs.add_failure_handler(lambda failure: log_it(failure))
    fire = procs.spawn("fire", Fire)
    send(fire.explode, ("an awaitable is no answer",), selection="choose")
    await asyncio.wait_for(reported.wait(), 30)
    with pytest.raises(SupervisionError, match="an awaitable is no answer"):
        await fire.ok.call()


async def test_kill_9_without_a_handler_faults_the_mesh(procs: ProcMesh):
    echo = procs.spawn("echo", Echo)
    pid = (await echo.slice(procs=0).whoami.call_one())[0]
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(actors.ActorDied):
        await asyncio.wait_for(echo.slice(procs=0).sleep.call_one(60), 10)
    with pytest.raises(SupervisionError, match=f"pid {pid}.*ActorDied"):
        await echo.slice(procs=1).add.call_one(1)


async def test_a_replaced_fault_hook_decides(procs: ProcMesh, monkeypatch):
    seen: list[Failure] = []
    dropped = asyncio.Event()

    def hook(failure: Failure) -> None:  # returns normally: the failure is dropped
        seen.append(failure)
        dropped.set()

    monkeypatch.setattr(actors, "unhandled_fault_hook", hook)
    fire = procs.spawn("fire", Fire)
    send(fire.explode, ("dropped by the hook",), selection="choose")
    await asyncio.wait_for(dropped.wait(), 30)
    assert seen[0].exception_type == "KeyError" and procs.fault is None
    assert await fire.ok.call() is not None


async def test_an_actor_that_spawns_and_stops_meshes_does_not_keep_them(procs: ProcMesh):
    """An actor's proc meshes stop with it, so it holds each one it spawns; one it stopped itself was held all the
    same until the actor stopped (its supervisor, failures and spawn arguments: memory that grew for as long as a
    controller actor spawned and stopped workers)."""
    respawner = procs.slice(procs=0).spawn("respawner", Respawner)
    assert await asyncio.wait_for(respawner.spawn_and_stop.call_one(2), 120) == 0


async def test_owning_actor_supervises_its_children(procs: ProcMesh):
    port, reports = Channel.open(str)
    sup = procs.spawn("sup", Supervisor, port, True).slice(procs=0)
    await sup.start_child.call_one()
    await sup.fail_child.call_one()
    report = await asyncio.wait_for(reports.recv(), 30)
    assert "child[0]" in report and "KeyError" in report and "from the child" in report
    assert await sup.ping.call_one() == "alive"
    assert procs.fault is None and procs.failures == [], "handled by the owning actor: nothing escalates"


async def test_an_actor_that_does_not_handle_escalates_to_its_owner(procs: ProcMesh):
    port, reports = Channel.open(str)
    escalated: asyncio.Queue[Failure] = asyncio.Queue()
    procs.add_failure_handler(lambda failure: escalated.put_nowait(failure) or True)
    sup = procs.spawn("sup", Supervisor, port, False).slice(procs=0)
    await sup.start_child.call_one()
    await sup.fail_child.call_one()
    assert "from the child" in await asyncio.wait_for(reports.recv(), 30)
    failure = await asyncio.wait_for(escalated.get(), 30)
    assert failure.actor == "sup" and failure.endpoint == "__supervise__"
    assert failure.exception_type == "SupervisionError"
    assert "child[0]" in failure.message and "from the child" in failure.message
    assert "raise KeyError" in failure.traceback, "the child's traceback travels up"
    with pytest.raises(SupervisionError, match=r"The actor <\S+\.\w+ sup\[0\]> and all its descendants have failed"):
        await sup.ping.call_one()  # as in Monarch, the actor that did not handle it failed with it


class ObservingSupervisor(Actor):
    """Spawns a restartable child mesh; its ``async def __supervise__`` only looks (returns False)."""

    def __init__(self, port: Port[str]) -> None:
        self.port = port
        self.procs: ProcMesh | None = None

    @endpoint
    async def start_child(self) -> int:
        self.procs = this_host().spawn_procs(per_host={"procs": 1}, name="children", restart="on-failure")
        self.child = self.procs.spawn("child", Fire)
        await self.child.ok.call_one()
        return self.procs.pids[0]

    @endpoint
    async def ping(self) -> str:
        return "alive"

    async def __supervise__(self, failure: Failure) -> bool:
        self.port.send(str(failure))
        return False

    async def __cleanup__(self, exc: BaseException | None) -> None:
        if self.procs is not None:
            await self.procs.stop()


async def test_a_failure_a_restart_handled_is_not_escalated_by_an_async_supervise_that_only_looks(procs: ProcMesh):
    """A child process of a restartable mesh dies and is restarted: the failure is handled. An ``async def
    __supervise__`` that answers False (it only looks) then killed its actor all the same, and the restarted mesh
    with it; a ``def __supervise__`` answering so did not. Neither escalates now."""
    port, reports = Channel.open(str)
    sup = procs.spawn("observer", ObservingSupervisor, port).slice(procs=0)
    child = await sup.start_child.call_one()
    os.kill(child, signal.SIGKILL)
    assert "restarted" in await asyncio.wait_for(reports.recv(), 30)
    assert await sup.ping.call_one() == "alive"
    assert procs.fault is None and procs.failures == []


class SpawnsThenFails(Actor):
    """A synchronous actor (its constructor runs on its own thread, where it may wait) that spawns, then raises."""

    def __init__(self, port: Port[int]) -> None:
        self.procs = this_host().spawn_procs(per_host={"procs": 1}, name="orphans")
        port.send(self.procs.spawn("echo", Echo).pid.call_one().get(timeout=30))  # (its process is up)
        raise RuntimeError("the constructor failed after spawning")

    @endpoint
    def noop(self) -> None:
        pass


async def test_a_constructor_that_spawned_then_raised_leaves_no_process_behind(procs: ProcMesh):
    """The failed actor's slot kept the mesh its constructor spawned, and nothing stopped it: its process (and
    GPUs) lived until the whole worker stopped, one more for each retry. The failed actor's stop ends it now."""
    procs.add_failure_handler(lambda failure: True)  # (the constructor's failure: expected here)
    port, spawned = Channel.open(int)
    mesh = procs.spawn("spawns_then_fails", SpawnsThenFails, port).slice(procs=0)
    with pytest.raises(actors.SpawnError, match="the constructor failed after spawning"):
        await mesh.initialized
    orphan = await asyncio.wait_for(spawned.recv(), 30)
    assert await asyncio.to_thread(wait_for, lambda: orphan not in actor_pids(), 20), "its spawn was stopped"


class SyncSupervisor(Actor):
    """A synchronous actor (``def`` endpoints only) that spawns a child and supervises it."""

    def __init__(self, port: Port[str]) -> None:
        self.port = port
        self.procs: ProcMesh | None = None

    @endpoint
    def start_child(self) -> str:
        self.procs = this_host().spawn_procs(per_host={"procs": 1}, name="children")
        self.child = self.procs.spawn("child", Fire)
        self.child.ok.call_one().get(timeout=30)
        return threading.current_thread().name

    @endpoint
    def fail_child(self) -> None:
        send(self.child.explode, ("from the child",))

    def __supervise__(self, failure: Failure) -> bool:
        self.port.send(threading.current_thread().name)
        return True

    def __cleanup__(self, exc: BaseException | None) -> None:
        if self.procs is not None:
            self.procs.stop().get(timeout=30)


async def test_a_synchronous_actors_supervise_runs_on_its_own_thread_in_turn_with_its_endpoints(procs: ProcMesh):
    """It ran on the worker's loop thread, beside whatever ``def`` endpoint ran on the actor's thread then (a race
    on the actor's state, and a blocking ``__supervise__`` stalled the message pump)."""
    port, threads = Channel[str].open()
    sup = procs.spawn("sync_sup", SyncSupervisor, port).slice(procs=0)
    endpoint_thread = await sup.start_child.call_one()
    await sup.fail_child.call_one()
    assert await asyncio.wait_for(threads.recv(), 30) == endpoint_thread
    assert endpoint_thread.startswith("actor-")


class RaisingSupervisor(Supervisor):
    def __supervise__(self, failure: Failure) -> bool:
        raise RuntimeError("the supervisor itself broke")


async def test_a_supervise_hook_that_raises_fails_its_actor(procs: ProcMesh):
    escalated: asyncio.Queue[Failure] = asyncio.Queue()
    procs.add_failure_handler(lambda failure: escalated.put_nowait(failure) or True)
    port, _reports = Channel.open(str)
    sup = procs.spawn("raising_sup", RaisingSupervisor, port, True).slice(procs=1)
    await sup.start_child.call_one()
    await sup.fail_child.call_one()
    failure = await asyncio.wait_for(escalated.get(), 30)
    assert failure.actor == "raising_sup" and "RuntimeError: the supervisor itself broke" in failure.message
    assert "from the child" in failure.message
    with pytest.raises(SupervisionError, match="the supervisor itself broke"):
        await sup.ping.call_one()
