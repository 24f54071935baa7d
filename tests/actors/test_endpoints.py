"""Endpoint invocation: every selection form, concurrency, errors, handles that travel."""

from __future__ import annotations

import asyncio
import os
import time

import pytest
import torch
from support import BadInit, Echo, Fire, Relay, SyncEcho

from actors import (
    ActorError,
    ActorMesh,
    Channel,
    Failure,
    Future,
    ProcMesh,
    SpawnError,
    SupervisionError,
    ValueMesh,
    send,
    this_host,
)


@pytest.fixture
def procs(spawn):
    return spawn(gpus=2)  # any dimension name works, as in Monarch


async def test_call_returns_value_mesh_by_rank(procs: ProcMesh):
    echo = procs.spawn("echo", Echo, 10)
    result = await echo.whoami.call()
    assert isinstance(result, ValueMesh) and len(result) == 2
    pids = [pid for pid, _, _ in result.values()]
    assert len(set(pids)) == 2 and os.getpid() not in pids
    assert [rank for _, rank, _ in result.values()] == [0, 1]
    assert result.item(gpus=1)[1] == 1
    assert [point.rank for point, _ in result.items()] == [0, 1]
    assert all(size == {"gpus": 2} for _, _, size in result.values())


async def test_call_one_choose_and_slices(procs: ProcMesh):
    echo = procs.spawn("echo", Echo, 1)
    with pytest.raises(ValueError, match="exactly one"):
        echo.add.call_one(1)
    assert await echo.slice(gpus=1).add.call_one(41) == 42
    chosen = {await echo.pid.choose() for _ in range(6)}
    assert chosen == set(procs.pids), "choose() spreads calls over every actor"
    assert len(echo.slice(gpus=slice(0, 1))) == 1
    fresh = {await echo.slice(gpus=slice(0, 2)).pid.choose() for _ in range(6)}
    assert fresh == set(procs.pids), "choose() on a new slice each time still spreads (views share the turn)"


async def test_broadcast_and_send_reach_actors_without_reply(procs: ProcMesh):
    echo = procs.spawn("echo", Echo)
    port, recv = Channel.open(str)
    assert echo.send_to.broadcast(port, ["b"]) is None
    assert sorted([await recv.recv(), await recv.recv()]) == ["b", "b"]
    send(echo.send_to, args=(port, ["one"]), kwargs={}, selection="choose")
    assert await recv.recv() == "one"
    send(echo.send_to, (port, ["all"]), selection="all")
    assert [await recv.recv(), await recv.recv()] == ["all", "all"]
    with pytest.raises(ValueError, match="selection"):
        send(echo.add, (1,), selection="some")
    with pytest.raises(TypeError, match="mesh endpoint"):
        send(lambda: None, ())  # type: ignore[arg-type]


async def test_send_with_response_port(procs: ProcMesh):
    echo = procs.spawn("echo", Echo, 5)
    port, recv = Channel.open()
    send(echo.add, (1,), {}, port=port, selection="all")
    assert [await recv.recv(), await recv.recv()] == [6, 6]


async def test_a_fire_and_forget_call_that_raises_sends_its_error_to_its_port(procs: ProcMesh):
    """As in Monarch, ``send(ep, args, port=p)`` to an endpoint that raises: ``p`` gets the error (its receive
    raises ``ActorError``) and the actor lives on, unreported (before, the port got nothing and waited for good,
    and the failure went to the supervisor as if nobody had been there to hear it)."""
    echo = procs.spawn("echo", Echo).slice(gpus=0)
    port, recv = Channel.open()
    send(echo.fail, ("boom",), port=port)
    with pytest.raises(ActorError, match="boom") as raised:
        await asyncio.wait_for(recv.recv(), 20)
    assert raised.value.method == "fail"
    assert await asyncio.wait_for(echo.add.call_one(1), 20) == 1, "the actor lives on"
    assert procs.failures == [], "and is not reported as failed (a report would have come before that answer)"


async def test_a_fire_and_forget_result_its_port_refuses_sends_the_refusal_there(procs: ProcMesh):
    """``send(ep, args, port=p)`` where ``p`` is typed for another value than the endpoint returns: the refusal
    was only logged in the worker and ``p``'s receiver waited for good. It gets the error now, as for a raise."""
    echo = procs.spawn("echo", Echo).slice(gpus=0)
    port, recv = Channel.open(str)
    send(echo.add, (1,), port=port)
    with pytest.raises(ActorError, match="could not be sent to its port") as raised:
        await asyncio.wait_for(recv.recv(), 20)
    assert raised.value.method == "add"
    assert await asyncio.wait_for(echo.add.call_one(1), 20) == 1, "the actor lives on"


async def test_a_sync_endpoint_raising_what_asyncio_cannot_carry_fails_only_its_call(procs: ProcMesh):
    """``StopIteration`` from a ``def`` endpoint cannot be set on an asyncio future: the call was never answered.
    ``concurrent.futures.CancelledError`` (an ordinary exception) was turned into asyncio's cancel on its way
    back, and failed the whole actor. Each now fails its call alone, as from an async endpoint."""
    sync = procs.spawn("sync", SyncEcho).slice(gpus=0)
    with pytest.raises(ActorError, match="StopIteration"):
        await asyncio.wait_for(sync.first.call_one([]), 30)
    with pytest.raises(ActorError) as raised:
        await asyncio.wait_for(sync.cancelled_elsewhere.call_one(), 30)
    assert "CancelledError" in raised.value.exception_type
    assert await asyncio.wait_for(sync.sync_add.call_one(1), 30) == 1, "the actor lives on"


async def test_an_exception_whose_str_raises_still_answers_the_call(procs: ProcMesh):
    from support import RaisesUnprintably

    mesh = procs.spawn("unprintable", RaisesUnprintably).slice(gpus=0)
    with pytest.raises(ActorError, match="unprintable") as raised:
        await asyncio.wait_for(mesh.fail.call_one(), 30)
    assert raised.value.exception_type.endswith("Unprintable")
    assert await mesh.ping.call_one() == "pong"


async def test_sync_endpoint_runs_off_the_loop(procs: ProcMesh):
    echo = procs.spawn("echo", Echo, 3).slice(gpus=0)
    sync = procs.spawn("sync_echo", SyncEcho, 3).slice(gpus=0)
    assert await echo.add.call_one(0) == 3 and await sync.sync_add.call_one(0) == 3  # both built: only calls timed
    slow = sync.blocking.call_one(1.0)
    start = time.monotonic()
    assert await echo.add.call_one(1) == 4, "the pump answers while a sync endpoint blocks"
    assert time.monotonic() - start < 0.8
    assert await sync.sync_add.call_one(2) == 5
    assert time.monotonic() - start >= 0.9, "a sync actor's calls run one at a time, in order"
    assert await slow == "slept"


async def test_async_endpoints_run_concurrently(procs: ProcMesh):
    echo = procs.spawn("echo", Echo).slice(gpus=0)
    waiting = echo.wait_event.call_one()
    await echo.set_event.call_one()
    assert await asyncio.wait_for(waiting, 10) == "released"


async def test_dispatch_is_eager_so_pipelines_do_not_deadlock(procs: ProcMesh):
    relay = procs.spawn("relay", Relay).slice(gpus=0)
    inlet = await relay.inlet.call_one()
    out, out_recv = Channel.open()
    run = relay.run.call_one(out)  # sent now, awaited last
    producer = procs.spawn("producer", Echo).slice(gpus=1)
    emit = producer.emit.call_one(inlet, 3)
    got = []
    while (item := await out_recv.recv()) is not None:
        got.append(item.seq)
    assert got == [0, 1, 2]
    await emit
    assert await run == 3


async def test_remote_exception_carries_type_message_and_traceback(procs: ProcMesh):
    echo = procs.spawn("echo", Echo).slice(gpus=0)
    with pytest.raises(ActorError) as info:
        await echo.fail.call_one("bad things")
    err = info.value
    assert err.exception_type == "ValueError" and err.message == "bad things"
    assert "raise ValueError(message)" in err.remote_traceback and "support.py" in err.remote_traceback
    assert err.actor == "echo" and err.rank == 0
    assert await echo.add.call_one(1) == 1, "the actor lives on after an endpoint raises"


async def test_unknown_endpoint_is_an_attribute_error(procs: ProcMesh):
    echo = procs.spawn("echo", Echo)
    with pytest.raises(AttributeError, match="no endpoint"):
        echo.not_there  # noqa: B018
    with pytest.raises(TypeError, match="call"):
        echo.add(1)


async def test_constructor_failure_surfaces_as_spawn_error(procs: ProcMesh):
    failures: asyncio.Queue[Failure] = asyncio.Queue()
    procs.add_failure_handler(lambda failure: failures.put_nowait(failure) or True)  # handled: no fault
    bad = procs.spawn("bad", BadInit)
    with pytest.raises(SpawnError, match="constructor exploded") as info:
        await bad.ping.call()
    assert "RuntimeError" in str(info.value)
    with pytest.raises(SpawnError):
        await bad.slice(gpus=0).ping.call_one()
    # as in Monarch, it is also a supervision event of each rank
    reported = [await asyncio.wait_for(failures.get(), 20) for _ in range(2)]
    assert {(f.actor, f.endpoint, f.rank) for f in reported} == {("bad", "__init__", 0), ("bad", "__init__", 1)}


async def test_spawn_rejects_bad_arguments(procs: ProcMesh):
    with pytest.raises(TypeError, match="Actor subclass"):
        procs.spawn("x", dict)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="non-empty"):
        procs.spawn("", Echo)
    with pytest.raises(ValueError, match="per_host"):
        this_host().spawn_procs(per_host={"procs": 0})


async def test_constructor_arguments_carry_tensors_state_dicts_ports_and_meshes(procs: ProcMesh):
    sd = torch.nn.Linear(4, 3).state_dict()
    port, recv = Channel.open(str)
    target = procs.spawn("target", Echo, 100)
    holder = procs.spawn("holder", Echo, 0, {"sd": sd, "port": port, "mesh": target, "t": torch.arange(5000)})
    blob = await holder.slice(gpus=0).get_blob.call_one()
    assert torch.equal(blob["sd"]["weight"], sd["weight"]) and torch.equal(blob["t"], torch.arange(5000))
    assert isinstance(blob["mesh"], ActorMesh)
    assert await blob["mesh"].slice(gpus=1).add.call_one(1) == 101, "a mesh handle returned to the controller works"
    blob["port"].send("through a returned port")
    assert await recv.recv() == "through a returned port"


async def test_mesh_handles_work_inside_other_actors(procs: ProcMesh):
    a = procs.spawn("a", Echo, 7)
    b = procs.spawn("b", Echo)
    assert await b.slice(gpus=0).call_other.call_one(a.slice(gpus=1), 1) == 8


async def test_future_get_from_a_worker_thread(procs: ProcMesh):
    echo = procs.spawn("echo", Echo, 2).slice(gpus=0)
    fut: Future[int] = echo.add.call_one(1)
    assert await asyncio.to_thread(fut.get, 30) == 3
    with pytest.raises(RuntimeError, match="await"):
        echo.add.call_one(1).get()


async def test_fire_and_forget_failures_reach_the_owner(procs: ProcMesh):
    seen: asyncio.Queue = asyncio.Queue()
    procs.add_failure_handler(lambda failure: seen.put_nowait(failure) or True)  # True: handled
    fire = procs.spawn("fire", Fire)
    send(fire.explode, ("lost key",), selection="choose")
    failure = await asyncio.wait_for(seen.get(), 10)
    assert failure.actor == "fire" and failure.endpoint == "explode"
    assert failure.exception_type == "KeyError" and "lost key" in failure.message
    assert failure.pid in procs.pids and "raise KeyError" in failure.traceback
    assert await fire.ok.call() is not None, "the actor lives on"
    assert procs.failures == [failure]


async def test_actor_mesh_stop_runs_cleanup_and_removes_actor(procs: ProcMesh):
    from support import Cleanup

    port, recv = Channel.open(str)
    mesh = procs.spawn("c", Cleanup, port)
    assert await mesh.ping.call() is not None
    await mesh.stop()
    assert sorted([await recv.recv(), await recv.recv()]) == ["cleanup 0", "cleanup 1"]
    with pytest.raises(SupervisionError, match="has status: stopped"):
        await mesh.slice(gpus=0).ping.call_one()
