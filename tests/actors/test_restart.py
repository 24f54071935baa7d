"""Restart policies: a dead process is replaced at its address, its actors built again."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
from support import BadInit, Constructed, Echo

from actors import ActorDied, Failure, SupervisionError, this_host


@pytest.fixture
async def restartable(sockets_dir):
    meshes = []

    def make(**options):
        mesh = this_host().spawn_procs(per_host={"procs": 2}, restart="on-failure", **options)
        meshes.append(mesh)
        return mesh

    yield make
    for mesh in meshes:
        await mesh.stop()


async def test_a_killed_process_is_restarted_with_the_original_arguments(restartable, spawn):
    procs = restartable(max_restarts=2)
    seen: list[Failure] = []
    procs.add_failure_handler(seen.append)
    echo = procs.spawn("echo", Echo, 10)
    victim = echo.slice(procs=0)
    old_pid = await victim.pid.call_one()
    stamps = [ref.incarnation for ref in procs._procs]
    in_flight = victim.sleep.call_one(60)
    os.kill(old_pid, signal.SIGKILL)
    with pytest.raises(ActorDied):
        await asyncio.wait_for(in_flight, 10)
    # later calls go to the new instance, built with offset=10 again
    assert await asyncio.wait_for(victim.add.call_one(1), 30) == 11
    new_pid = await victim.pid.call_one()
    assert new_pid != old_pid and procs.pids[0] == new_pid and procs.restarts == [1, 0]
    now = [ref.incarnation for ref in procs._procs]
    assert now[0] > stamps[0] > 0 and now[1] == stamps[1], "news of the rank names the replacement's incarnation"
    assert await echo.slice(procs=1).add.call_one(2) == 12, "the other rank was untouched"
    assert [f.restarted for f in seen] == [True] and seen[0].pid == old_pid
    assert procs.fault is None, "a restart handles the failure"
    # another process holding a handle to the old instance finds the new one
    caller = spawn(procs=1).spawn("caller", Echo)
    assert await caller.call_other.call_one(victim, 5) == 15


async def test_a_stopped_actor_stays_stopped_when_its_process_is_restarted(restartable, tmp_path):
    """A restart constructs the mesh's actors again, but not one stopped before (all of it, or a slice's ranks):
    before, the replay built it anew in the new process, holding whatever its constructor takes, and old handles
    reached it again."""
    procs = restartable()
    log = tmp_path / "constructed"
    whole = procs.spawn("whole", Constructed, str(log))
    part = procs.spawn("part", Constructed, str(log))
    echo = procs.spawn("echo", Echo, 1)
    await whole.initialized
    await part.initialized
    await whole.stop()
    await part.slice(procs=0).stop()
    old_pid = procs.pids[0]
    os.kill(old_pid, signal.SIGKILL)
    with pytest.raises(ActorDied):
        await asyncio.wait_for(echo.slice(procs=0).sleep.call_one(60), 10)
    assert await asyncio.wait_for(echo.slice(procs=0).add.call_one(1), 30) == 2  # the replay has run
    new_pid = procs.pids[0]
    assert await part.slice(procs=1).ping.call_one() == procs.pids[1], "the slice not stopped answers on"
    lines = log.read_text().split()
    assert str(new_pid) not in lines, "neither stopped actor was constructed again in the new process"
    assert sorted(lines[1::2]) == ["0", "0", "1", "1"]


async def test_an_actor_spawned_on_a_slice_is_rebuilt_in_its_restarted_process_only(restartable, tmp_path):
    """A restart rebuilds a slice's actor in its own process, at its rank within the slice, and nowhere else."""
    procs = restartable()
    log = tmp_path / "constructed"
    solo = procs.slice(procs=1).spawn("solo", Constructed, str(log))
    echo = procs.spawn("echo", Echo, 1)
    await solo.initialized
    for rank in (0, 1):
        old_pid = procs.pids[rank]
        os.kill(old_pid, signal.SIGKILL)
        with pytest.raises(ActorDied):
            await asyncio.wait_for(echo.slice(procs=rank).sleep.call_one(60), 10)
        assert await asyncio.wait_for(echo.slice(procs=rank).add.call_one(1), 30) == 2  # the replay has run
    assert procs.restarts == [1, 1] and procs.slice(procs=1).restarts == [1]
    assert await solo.ping.call_one() == procs.pids[1]
    lines = log.read_text().split()  # "<pid> <rank in its mesh>" per construction
    assert lines[1::2] == ["0", "0"] and lines[2] == str(procs.pids[1]), "rebuilt once, at its rank in the slice"
    assert str(procs.pids[0]) not in lines, "not built in the other rank's new process"


async def test_a_handle_in_another_process_sees_the_restart(restartable, spawn):
    procs = restartable()
    echo = procs.spawn("echo", Echo, 1).slice(procs=1)
    caller = spawn(procs=1).spawn("caller", Echo)
    assert await caller.call_other.call_one(echo, 1) == 2  # the caller now knows the first pid
    old_pid = await echo.pid.call_one()
    os.kill(old_pid, signal.SIGKILL)
    with pytest.raises(ActorDied):
        await asyncio.wait_for(echo.sleep.call_one(60), 10)
    assert await echo.add.call_one(0) == 1  # restarted (and its pid recorded) before this answers
    assert await caller.call_other.call_one(echo, 2) == 3


async def test_restarts_beyond_the_budget_escalate(restartable):
    procs = restartable(max_restarts=1, restart_period=600)
    echo = procs.spawn("echo", Echo).slice(procs=0)
    for _attempt in range(2):
        pid = await asyncio.wait_for(echo.pid.call_one(), 30)
        os.kill(pid, signal.SIGKILL)
        with pytest.raises((ActorDied, SupervisionError)):
            await asyncio.wait_for(echo.sleep.call_one(60), 10)
    assert procs.restarts == [1, 0]
    with pytest.raises(SupervisionError, match="not restarted: 1 restarts within 600s"):
        await echo.add.call_one(1)


async def test_a_constructor_failing_after_a_restart_is_reported(restartable):
    procs = restartable()
    failures: asyncio.Queue[Failure] = asyncio.Queue()
    procs.add_failure_handler(lambda failure: failures.put_nowait(failure) or True)
    echo = procs.spawn("echo", Echo).slice(procs=0)
    pid = await echo.pid.call_one()
    procs.spawn("bad", BadInit)  # fails now, and again after the restart
    first = [await asyncio.wait_for(failures.get(), 30) for _ in range(2)]  # each rank's constructor
    assert {(f.actor, f.endpoint) for f in first} == {("bad", "__init__")}
    os.kill(pid, signal.SIGKILL)
    died = await asyncio.wait_for(failures.get(), 30)
    assert died.restarted and died.pid == pid
    again = await asyncio.wait_for(failures.get(), 30)
    assert again.actor == "bad" and again.endpoint == "__init__" and "constructor exploded" in again.message


async def test_a_process_that_cannot_be_started_again_stays_dead_and_says_why(restartable):
    """The placer refuses (say, every host lost): the rank is not restarted, and the failure escalates."""
    procs = restartable()
    seen: list[Failure] = []
    procs.add_failure_handler(seen.append)
    echo = procs.spawn("echo", Echo).slice(procs=1)
    pid = await echo.pid.call_one()

    def refuse(rank: int, ref: object) -> str:
        raise RuntimeError("every host of this mesh is lost")

    procs.supervisor.respawn = refuse  # what a Ray host mesh does with no live host left
    os.kill(pid, signal.SIGKILL)
    with pytest.raises((ActorDied, SupervisionError)):
        await asyncio.wait_for(echo.sleep.call_one(60), 10)
    assert procs.restarts == [0, 0] and [f.restarted for f in seen] == [False]
    assert "could not restart it: every host of this mesh is lost" in seen[0].message
    with pytest.raises(SupervisionError, match="could not restart it"):
        await echo.add.call_one(1)


async def test_a_restart_that_started_no_process_leaves_the_budget_to_the_next_death(restartable):
    """One restart allowed; rank 1's fails (its host lost): the budget is not spent on it, so rank 0, dying on a
    healthy host, is restarted (before, it was refused: "1 restarts within 60s already", none having happened)."""
    procs = restartable(max_restarts=1)
    seen: list[Failure] = []
    procs.add_failure_handler(lambda failure: seen.append(failure) or True)  # (handled: the mesh goes on)
    echo = procs.spawn("echo", Echo)
    ranks = [echo.slice(procs=rank) for rank in (0, 1)]
    pids = [await rank.pid.call_one() for rank in ranks]
    respawn = procs.supervisor.respawn

    def refuse(rank: int, ref: object) -> str:
        raise RuntimeError("this host is lost")

    procs.supervisor.respawn = refuse
    for rank, pid in ((1, pids[1]), (0, pids[0])):
        in_flight = ranks[rank].sleep.call_one(60)
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(ActorDied):
            await asyncio.wait_for(in_flight, 10)
        procs.supervisor.respawn = respawn  # (rank 0's host is healthy)
    assert [f.restarted for f in seen] == [False, True], [f.message for f in seen]
    assert procs.restarts == [1, 0]
    assert await asyncio.wait_for(ranks[0].add.call_one(1), 30) == 1


def test_restart_options_are_checked():
    with pytest.raises(ValueError, match="restart must be one of"):
        this_host().spawn_procs(restart="always")
    with pytest.raises(ValueError, match="max_restarts"):
        this_host().spawn_procs(restart="on-failure", max_restarts=0)
