"""Monarch's actor API, name by name, as its documentation describes it (see docs/monarch.md)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import operator
import os
import re
import textwrap
import threading
import time
from typing import Any

import pytest
from harness import actor_pids, run_python, wait_for
from support import Echo

import actors
from actors import (
    Accumulator,
    Actor,
    ActorDied,
    ActorError,
    ActorMesh,
    Channel,
    EncodeError,
    Failure,
    MeshFailure,
    Port,
    PortClosed,
    ProcMesh,
    SpawnError,
    SupervisionError,
    concurrent_endpoint,
    context,
    current_actor_name,
    current_rank,
    current_size,
    endpoint,
    get_or_spawn_controller,
    send,
    this_host,
    this_proc,
)
from actors._meshes._controllers import stop_controllers
from actors._meshes._proc_stop import ANSWER_GRACE, EXIT_WAIT
from actors._runtime._core import runtime


class Who(Actor):
    def __init__(self, start: int = 0) -> None:
        self.value = start

    @endpoint
    async def who(self) -> list[object]:
        ctx = context()
        inst = ctx.actor_instance
        return [str(inst), inst.name, inst.rank.rank, ctx.message_rank.rank, current_actor_name(), inst.pid]

    @endpoint
    async def value_of(self) -> int:
        return self.value

    @endpoint
    async def where(self) -> list[object]:
        """Where this message found the actor (as ``current_rank``/``current_size`` and the context say)."""
        return [str(current_rank()), current_size(), str(context().message_rank), context().actor_instance.rank.rank]

    @endpoint
    async def incr(self) -> None:
        self.value += 1

    @endpoint
    async def here(self) -> int:
        """Spawn an actor on this_proc() and report the pid it runs in."""
        local = this_proc().spawn("local", Who)
        return (await local.who.call_one())[5]  # type: ignore[return-value]

    @endpoint
    async def controller_value(self, name: str) -> int:
        ctl = await get_or_spawn_controller(name, Who, 99)
        return await ctl.value_of.call_one()

    @endpoint
    async def call_other(self, other: Who) -> int:
        return await other.value_of.call_one()

    @endpoint
    async def log_level(self) -> int:
        return logging.getLogger().level


class Replies(Actor):
    def __init__(self) -> None:
        self.second_send: str = ""

    @endpoint(explicit_response_port=True)
    async def later(self, port: Port[int], a: int, b: int) -> None:
        asyncio.get_running_loop().call_soon(port.send, a + b)

    @endpoint(explicit_response_port=True)
    async def twice(self, port: Port[int]) -> None:
        port.send(1)
        try:
            port.send(2)
        except PortClosed as exc:
            self.second_send = str(exc)

    @endpoint
    async def second(self) -> str:
        return self.second_send

    @endpoint(explicit_response_port=True)
    async def refuse(self, port: Port[int]) -> None:
        port.exception(ValueError("no thanks"))

    @endpoint(explicit_response_port=True)
    async def escape(self, port: Port[int]) -> None:
        raise KeyError("escaped")

    @endpoint(explicit_response_port=True)
    async def drop(self, port: Port[int]) -> None:
        return None

    @endpoint(explicit_response_port=True)
    async def answer_then_raise(self, port: Port[int]) -> None:
        port.send(1)
        raise KeyError("after answering")


class HeldPort(Actor):
    """Keeps its explicit response port and waits; its ``__cleanup__`` tries the port and reports how it went."""

    def __init__(self, report: Port[str]) -> None:
        self.report = report
        self.port: Port[int] | None = None
        self.holding = asyncio.Event()

    @endpoint(explicit_response_port=True)
    async def hold(self, port: Port[int]) -> None:
        self.port = port
        self.holding.set()
        await asyncio.Event().wait()  # (until the actor stops)

    @endpoint
    async def held(self) -> None:
        await self.holding.wait()

    async def __cleanup__(self, exc: BaseException | None) -> None:
        assert self.port is not None
        try:
            self.port.send(1)
        except PortClosed:
            self.report.send("closed")
        else:
            self.report.send("sent")


class SyncReplies(Actor):
    @endpoint(explicit_response_port=True)
    def add(self, port: Port[int], a: int, b: int) -> None:
        port.send(a + b)


class Gate(Actor):
    def __init__(self) -> None:
        self.ready = asyncio.Event()
        self.open = asyncio.Event()

    @concurrent_endpoint
    async def wait(self) -> str:
        self.ready.set()
        await self.open.wait()
        return "done"

    @endpoint
    async def release(self) -> None:
        await self.ready.wait()
        self.open.set()


class OneThread(Actor):
    """A synchronous actor: records the thread and the overlap of its calls."""

    def __init__(self) -> None:
        self.running = 0
        self.most = 0
        self.threads: set[int] = set()
        self.lock = threading.Lock()

    @endpoint
    def work(self, seconds: float) -> bool:
        with self.lock:
            self.running += 1
            self.most = max(self.most, self.running)
            self.threads.add(threading.get_ident())
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            loop_visible = False
        else:
            loop_visible = True
        time.sleep(seconds)
        with self.lock:
            self.running -= 1
        return loop_visible

    @endpoint
    def report(self) -> list[int]:
        return [self.most, len(self.threads), int(threading.get_ident() == threading.main_thread().ident)]


class Mixed(Actor):
    @endpoint
    def plain(self) -> int:
        return 1

    @endpoint
    async def fancy(self) -> int:
        return 2


class SyncWithAsyncCleanup(Actor):
    @endpoint
    def plain(self) -> int:
        return 1

    async def __cleanup__(self, exc: BaseException | None) -> None:
        pass


class BadInit(Actor):
    def __init__(self) -> None:
        raise RuntimeError("no constructor today")

    @endpoint
    async def ok(self) -> int:
        return 1


class Fails(Actor):
    @endpoint
    async def explode(self) -> None:
        raise KeyError("kaboom")


class AsyncParent(Actor):
    """Spawns a failing child on a proc mesh it is given; its async __supervise__ is awaited."""

    def __init__(self, procs: ProcMesh) -> None:
        self.child = procs.spawn("child", Fails)
        self.seen: list[str] = []
        self.event = asyncio.Event()

    @endpoint
    async def fail_child(self) -> list[str]:
        self.child.explode.broadcast()
        await asyncio.wait_for(self.event.wait(), 20)
        return self.seen

    async def __supervise__(self, failure: MeshFailure) -> bool:
        await asyncio.sleep(0)
        self.seen.append(f"{failure.mesh_name}: {failure}")
        self.event.set()
        return True


class ParentByEndpoint(AsyncParent):
    """AsyncParent whose proc mesh comes as an endpoint's argument, not its constructor's."""

    def __init__(self) -> None:
        self.seen = []
        self.event = asyncio.Event()

    @endpoint
    async def adopt(self, procs: ProcMesh) -> None:
        self.child = procs.spawn("child", Fails)


class SpawnsAWorker(Actor):
    """Spawns an actor called "worker" holding ``value`` on the processes it is given."""

    def __init__(self, procs: ProcMesh, value: int) -> None:
        self.worker = procs.spawn("worker", Who, value)

    @endpoint
    async def worker_value(self) -> int:
        return await self.worker.value_of.call_one()


class Runs(Actor):
    @endpoint
    async def run(self, fn: object) -> object:
        return fn


class SyncWhere(Actor):
    @endpoint
    def where_sync(self) -> list[object]:
        return [str(current_rank()), current_size()]


# ------------------------------------------------------------------ context and names


async def test_context_outside_any_actor_is_the_root_client():
    ctx = context()
    assert str(ctx.actor_instance) == "<root>"
    assert ctx.actor_instance.name == "root"
    assert ctx.message_rank.rank == 0
    assert current_actor_name().startswith("root@")


async def test_context_inside_an_actor_names_it_and_its_rank(spawn):
    procs = spawn(hosts=1, gpus=2)
    who = procs.spawn("who", Who)
    results = [value for _, value in await who.who.call()]
    for rank, (text, name, own_rank, message_rank, actor_name, _pid) in enumerate(results):
        assert text == f"<test_monarch_api.Who who{{'hosts': 0/1, 'gpus': {rank}/2}}>"
        assert (name, own_rank, message_rank) == ("who", rank, rank)
        assert re.fullmatch(rf"who#[0-9a-f]{{12}}\[{rank}\]@\d+", actor_name), actor_name
    assert results[0][4] != results[1][4]
    rank_text = await who.slice(gpus=1).who.call_one()
    assert rank_text[0].endswith("{'hosts': 0/1, 'gpus': 1/2}>")
    assert str(current_rank()) == "{'procs': 0/1}"


async def test_a_message_through_a_slice_finds_its_actor_at_its_place_in_the_slice(spawn):
    """As Monarch's ``message_rank`` (and ``current_rank``/``current_size``, read from it): the point of the message
    in the mesh it was sent through, not the actor's own rank in the mesh it was spawned as (that stays
    ``actor_instance.rank``). Before, a slice's actors all read their spawn ranks and the whole mesh's size."""
    procs = spawn(hosts=1, gpus=4)
    who = procs.spawn("who", Who)
    whole = [value for _, value in await who.where.call()]
    assert whole[3] == ["{'hosts': 0/1, 'gpus': 3/4}", {"hosts": 1, "gpus": 4}, "{'hosts': 0/1, 'gpus': 3/4}", 3]
    back = who.slice(gpus=slice(2, 4))
    assert [value for _, value in await back.where.call()] == [
        ["{'hosts': 0/1, 'gpus': 0/2}", {"hosts": 1, "gpus": 2}, "{'hosts': 0/1, 'gpus': 0/2}", 2],
        ["{'hosts': 0/1, 'gpus': 1/2}", {"hosts": 1, "gpus": 2}, "{'hosts': 0/1, 'gpus': 1/2}", 3],
    ]
    assert await back.slice(hosts=0, gpus=1).where.call_one() == ["{}", {}, "{}", 3]
    assert (await back.where.choose())[1] == {"hosts": 1, "gpus": 2}
    flat = [value[0] for _, value in await who.flatten("all").where.call()]
    assert flat == [f"{{'all': {r}/4}}" for r in range(4)]
    port, inbox = Channel.open(list)
    send(back.where, port=port)
    got = sorted([await inbox.recv(), await inbox.recv()])
    assert [text for text, *_ in got] == ["{'hosts': 0/1, 'gpus': 0/2}", "{'hosts': 0/1, 'gpus': 1/2}"]


async def test_a_synchronous_actors_message_through_a_slice_finds_it_at_its_place_there(spawn):
    procs = spawn(procs=3)
    sync = procs.spawn("sync", SyncWhere)
    got = [value for _, value in await sync.slice(procs=slice(1, 3)).where_sync.call()]
    assert got == [["{'procs': 0/2}", {"procs": 2}], ["{'procs': 1/2}", {"procs": 2}]]


async def test_spawners_choosing_the_same_name_each_reach_their_own_actors(spawn):
    hosts, workers = spawn(procs=1), spawn(procs=1)
    first = hosts.spawn("spawner", SpawnsAWorker, workers, 1)
    second = hosts.spawn("spawner", SpawnsAWorker, workers, 2)
    mine = workers.spawn("worker", Who, 3)
    assert await first.worker_value.call_one() == 1
    assert await second.worker_value.call_one() == 2
    assert await mine.value_of.call_one() == 3
    assert await mine.who.call_one() == await mine.who.call_one()  # the same actor each time
    name = (await mine.who.call_one())[1]
    assert name == "worker"  # the name the user gave, not the one on the wire


def test_an_actor_name_must_be_a_non_empty_string(procs: ProcMesh):
    with pytest.raises(TypeError, match="must be a string"):
        procs.spawn(7, Who)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="non-empty"):
        procs.spawn("", Who)


# ------------------------------------------------------------------ explicit response ports


async def test_an_explicit_response_port_answers_later_and_only_once(procs: ProcMesh):
    replies = procs.spawn("replies", Replies).slice(procs=0)
    assert await replies.later.call_one(2, 3) == 5
    assert await replies.twice.call_one() == 1
    assert "already answered" in await replies.second.call_one()
    sync = procs.spawn("sync_replies", SyncReplies).slice(procs=1)
    assert await sync.add.call_one(4, 5) == 9


async def test_a_fire_and_forget_send_with_a_port_gets_what_an_explicit_port_endpoint_answers(procs: ProcMesh):
    """``send(ep, args, port=p)`` to an endpoint that answers through its response port: the answer goes to ``p``,
    as a plain endpoint's result does (before, a fire-and-forget call had no caller to answer, and it was lost)."""
    port, answers = Channel.open(int)
    replies = procs.spawn("replies", Replies).slice(procs=0)
    send(replies.later, (2, 3), port=port)
    assert await asyncio.wait_for(answers.recv(), 20) == 5
    sync = procs.spawn("sync_replies", SyncReplies).slice(procs=1)
    send(sync.add, (4, 5), port=port)
    assert await asyncio.wait_for(answers.recv(), 20) == 9


async def test_an_explicit_port_endpoint_sent_with_a_port_answers_an_error_there(procs: ProcMesh):
    """``port.exception(e)`` of an explicit-port endpoint called with ``send(..., port=p)`` reaches ``p`` (it was
    only logged: a port carried values, not errors)."""
    port, answers = Channel.open(int)
    replies = procs.spawn("replies", Replies).slice(procs=0)
    send(replies.refuse, (), port=port)
    with pytest.raises(ActorError, match="no thanks"):
        await asyncio.wait_for(answers.recv(), 20)


async def test_port_exception_of_a_fire_and_forget_call_with_no_port_is_reported_not_dropped(procs: ProcMesh):
    """``broadcast()`` to an explicit-port endpoint that answers ``port.exception(e)``: nobody waits, and the error
    was dropped without a word (Monarch's port there raises). It is a failure of the call, reported to the actor's
    supervisor as an endpoint's raised in a fire-and-forget call is."""
    seen: asyncio.Queue[Failure] = asyncio.Queue()
    procs.add_failure_handler(lambda failure: seen.put_nowait(failure) or True)
    replies = procs.spawn("replies", Replies).slice(procs=0)
    replies.refuse.broadcast()
    failure = await asyncio.wait_for(seen.get(), 20)
    assert (failure.endpoint, failure.exception_type) == ("refuse", "ValueError") and "no thanks" in str(failure)


async def test_port_exception_reaches_the_caller_as_an_actor_error(procs: ProcMesh):
    replies = procs.spawn("replies", Replies).slice(procs=0)
    with pytest.raises(ActorError, match="no thanks"):
        await replies.refuse.call_one()
    assert await replies.later.call_one(1, 1) == 2  # the actor lives on


async def test_a_dropped_port_answers_with_an_error_instead_of_hanging(procs: ProcMesh):
    replies = procs.spawn("replies", Replies).slice(procs=0)
    with pytest.raises(ActorError, match="dropped its response port"):
        await asyncio.wait_for(replies.drop.call_one(), 20)


async def test_an_exception_escaping_an_explicit_port_endpoint_is_a_supervision_error(procs: ProcMesh):
    seen: list[Failure] = []
    procs.add_failure_handler(lambda failure: seen.append(failure) or True)
    replies = procs.spawn("replies", Replies).slice(procs=0)
    with pytest.raises(SupervisionError, match=r"raised instead of answering.*KeyError"):
        await asyncio.wait_for(replies.escape.call_one(), 20)
    assert [f.endpoint for f in seen] == ["escape"]  # the supervisor hears first
    with pytest.raises(
        SupervisionError, match=r"The actor <test_monarch_api.Replies replies\[0\]> and all its descendants have failed"
    ):
        await replies.later.call_one(1, 2)  # the actor is gone for good, as in Monarch


async def test_an_exception_escaping_an_explicit_port_endpoint_after_it_answered_fails_the_actor(procs: ProcMesh):
    """The endpoint answered its port, then raised: the caller has its answer, and the actor fails as when it
    raised instead of answering (Monarch's dropping port reports it). Before, the exception was swallowed without
    a word and the actor went on."""
    seen: list[Failure] = []
    procs.add_failure_handler(lambda failure: seen.append(failure) or True)
    replies = procs.spawn("replies", Replies).slice(procs=0)
    assert await asyncio.wait_for(replies.answer_then_raise.call_one(), 20) == 1
    with pytest.raises(SupervisionError, match="have failed"):
        await asyncio.wait_for(replies.later.call_one(1, 2), 20)
    assert [f.endpoint for f in seen] == ["answer_then_raise"] and "after answering" in seen[0].message


async def test_a_stop_during_an_explicit_port_call_answers_it_once_and_closes_the_port(procs: ProcMesh):
    """The actor stops while an endpoint holds its response port: the caller hears "stopped first", and the port
    is closed, so a later ``send`` (its ``__cleanup__``'s) raises ``PortClosed`` (before, it sent a second answer,
    and the dropped port a third)."""
    report, reports = Channel.open(str)
    mesh = procs.spawn("held", HeldPort, report)
    holder = mesh.slice(procs=0)
    call = asyncio.ensure_future(holder.hold.call_one())
    await asyncio.wait_for(holder.held.call_one(), 20)
    await asyncio.wait_for(mesh.stop(), 20)
    with pytest.raises((ActorError, SupervisionError), match="stopped"):
        await asyncio.wait_for(call, 20)
    assert await asyncio.wait_for(reports.recv(), 20) == "closed"


class Fatal(BaseException):
    """Not an ``Exception``: raising it from an endpoint fails the actor (as in Monarch)."""


class Doomed(Actor):
    def __init__(self, port: Port[str]) -> None:
        self.port = port

    @endpoint
    async def fatal(self) -> None:
        raise Fatal("beyond repair")

    @endpoint
    async def ordinary(self) -> None:
        raise ValueError("a bad argument")

    @endpoint
    async def ping(self) -> str:
        return "pong"

    async def __cleanup__(self, exc: BaseException | None) -> None:
        self.port.send(f"cleanup after {type(exc).__name__}")


class SyncDoomed(Actor):
    @endpoint
    def fatal(self) -> None:
        raise SystemExit("the endpoint asked to exit")

    @endpoint
    def ping(self) -> str:
        return "pong"


async def test_a_base_exception_fails_the_actor_and_later_calls_raise_supervision_error(procs: ProcMesh):
    seen: list[Failure] = []
    procs.add_failure_handler(lambda failure: seen.append(failure) or True)
    port, receiver = actors.Channel[str].open()
    doomed = procs.spawn("doomed", Doomed, port).slice(procs=0)
    with pytest.raises(ActorError, match="a bad argument"):  # an Exception with a reply port: the actor lives on
        await doomed.ordinary.call_one()
    assert await doomed.ping.call_one() == "pong"
    with pytest.raises(
        SupervisionError,
        match=r"The actor <test_monarch_api.Doomed doomed\[0\]> and all its descendants have failed.*Fatal",
    ):
        await asyncio.wait_for(doomed.fatal.call_one(), 20)
    assert [(f.endpoint, f.exception_type) for f in seen] == [("fatal", "test_monarch_api.Fatal")]
    assert await asyncio.wait_for(receiver.recv(), 20) == "cleanup after Fatal"
    with pytest.raises(RuntimeError, match="and all its descendants have failed"):  # SupervisionError is one
        await doomed.ping.call_one()


async def test_a_base_exception_fails_a_synchronous_actor_too(procs: ProcMesh):
    procs.add_failure_handler(lambda failure: True)
    doomed = procs.spawn("sync_doomed", SyncDoomed).slice(procs=1)
    with pytest.raises(SupervisionError, match="SystemExit: the endpoint asked to exit"):
        await asyncio.wait_for(doomed.fatal.call_one(), 20)
    with pytest.raises(SupervisionError, match="and all its descendants have failed"):
        await doomed.ping.call_one()


class CancelsItself(Actor):
    @endpoint
    async def awaits_a_cancelled_task(self) -> None:
        task = asyncio.ensure_future(asyncio.sleep(3600))
        await asyncio.sleep(0)
        task.cancel()
        await task  # its CancelledError is the endpoint's own: nothing stopped this actor

    @endpoint
    async def ping(self) -> str:
        return "pong"


async def test_an_endpoints_own_cancelled_error_fails_the_actor_as_any_base_exception(procs: ProcMesh):
    """It was taken for a stop ("stopped first"): a fire-and-forget call's failure was dropped unreported and the
    actor answered on as if nothing had happened; it is a BaseException raised by the endpoint, as SystemExit is."""
    seen: list[Failure] = []
    procs.add_failure_handler(lambda failure: seen.append(failure) or True)
    target = procs.spawn("cancels_itself", CancelsItself).slice(procs=0)
    with pytest.raises(SupervisionError, match=r"awaits_a_cancelled_task raised asyncio\.exceptions\.CancelledError"):
        await asyncio.wait_for(target.awaits_a_cancelled_task.call_one(), 20)
    assert [(f.endpoint, f.exception_type) for f in seen] == [
        ("awaits_a_cancelled_task", "asyncio.exceptions.CancelledError")
    ]
    with pytest.raises(SupervisionError, match="and all its descendants have failed"):
        await target.ping.call_one()


class Aborting(Actor):
    @endpoint
    def abort(self, reason: str | None) -> None:
        context().actor_instance.abort(reason)

    @endpoint
    def ping(self) -> str:
        return "pong"


class AbortsAsItIsBuilt(Actor):
    """A synchronous actor that aborts as the last line of its constructor; its ``__cleanup__`` notes each run."""

    def __init__(self, path: str) -> None:
        self.path = path
        context().actor_instance.abort("at the end of its constructor")

    @endpoint
    def ping(self) -> str:
        return "pong"

    def __cleanup__(self, exc: BaseException | None) -> None:
        with open(self.path, "a") as f:
            f.write(f"{os.getpid()}\n")


async def test_a_sync_actor_stopped_as_its_constructor_ends_is_cleaned_up_once(procs: ProcMesh, tmp_path):
    """Its stop came while the constructor ran on the actor's thread: the end of construction ran ``__cleanup__``
    (late, for a stop that found no instance) and so did the stop, which found the instance by then: twice."""
    seen: list[Failure] = []
    procs.add_failure_handler(lambda failure: seen.append(failure) or True)
    path = tmp_path / "cleanups"
    mesh = procs.spawn("aborts", AbortsAsItIsBuilt, str(path))  # (one actor in each of the mesh's processes)
    with contextlib.suppress(actors.ActorsError):
        await asyncio.wait_for(mesh.initialized, 30)
    count = procs.size()
    assert wait_for(lambda: path.exists() and len(path.read_text().split()) >= count, timeout=20), "no __cleanup__ ran"
    await asyncio.wait_for(procs.stop(), 30)  # (their processes gone: no cleanup of them can run later)
    cleaned = path.read_text().split()
    assert sorted(cleaned) == sorted(set(cleaned)) and len(cleaned) == count, cleaned
    assert seen and all("AbortsAsItIsBuilt aborts" in str(failure) for failure in seen), (
        "its class named (not NoneType)"
    )


@pytest.mark.parametrize("reason", [None, "out of patience"])
async def test_instance_abort_fails_the_actor_with_its_reason(procs: ProcMesh, reason: str | None):
    seen: asyncio.Queue[Failure] = asyncio.Queue()
    procs.add_failure_handler(lambda failure: seen.put_nowait(failure) or True)
    aborting = procs.spawn("aborting", Aborting).slice(procs=0)
    try:
        await aborting.abort.call_one(reason)  # its answer races the abort, as in Monarch
    except SupervisionError:
        pass
    failure = await asyncio.wait_for(seen.get(), 20)
    assert "Aborting aborting[0] aborted" in failure.report()
    assert (reason or "no reason provided") in failure.report()
    with pytest.raises(SupervisionError, match="aborted"):
        await aborting.ping.call_one()


def test_abort_is_for_actors_only():
    with pytest.raises(RuntimeError, match="the client is not one"):
        context().actor_instance.abort("no")


def test_actor_died_is_a_supervision_error_naming_the_call():
    died = actors.ActorDied.of("worker", 3, 1234, "killed by SIGKILL", "step")
    assert isinstance(died, SupervisionError) and isinstance(died, RuntimeError)
    assert str(died).startswith("Endpoint call worker.step() failed, The actor worker[3] and all its descendants")
    # with its class known, as Monarch's texts (and programs matching ``Actor .* and all its descendants``)
    named = actors.ActorDied.of("fault", 0, 1234, "killed by SIGSEGV", "sigsegv", "tests.faults:FaultActor")
    assert "The actor <tests.faults.FaultActor fault[0]> and all its descendants have failed" in str(named)
    assert re.search("Actor .* and all its descendants have failed", str(named))
    assert died.pid == 1234 and died.actor == "worker"


# ------------------------------------------------------------------ concurrent_endpoint and sync actors


async def test_concurrent_endpoint_lets_a_later_call_release_an_earlier_one(procs: ProcMesh):
    gate = procs.spawn("gate", Gate).slice(procs=0)
    waiting = gate.wait.call_one()
    await gate.release.call_one()
    assert await asyncio.wait_for(waiting, 20) == "done"


def test_concurrent_endpoint_refuses_to_wrap_an_endpoint_or_a_plain_def():
    with pytest.raises(ValueError, match="does not wrap @endpoint"):
        concurrent_endpoint(endpoint(Gate.wait.fn))
    with pytest.raises(ValueError, match="can only wrap async endpoints"):

        @concurrent_endpoint
        def plain(self: object) -> None: ...


async def test_a_sync_actor_runs_one_call_at_a_time_on_its_own_thread(procs: ProcMesh):
    actor = procs.spawn("one_thread", OneThread).slice(procs=0)
    visible = await asyncio.gather(*(actor.work.call_one(0.05) for _ in range(4)))
    assert visible == [False] * 4  # no event loop on the actor's thread
    most, threads, on_main = await actor.report.call_one()
    assert (most, threads, on_main) == (1, 1, 0)


async def test_an_actor_mixing_sync_and_async_endpoints_is_refused_at_spawn(procs: ProcMesh):
    with pytest.raises(ValueError, match="mixes both async and sync"):
        procs.spawn("mixed", Mixed)
    with pytest.raises(ValueError, match="async __cleanup__"):
        procs.spawn("cleanup", SyncWithAsyncCleanup)


# ------------------------------------------------------------------ this_proc and controllers


async def test_this_proc_in_an_actor_is_its_own_process(procs: ProcMesh):
    who = procs.spawn("who", Who).slice(procs=0)
    pid = (await who.who.call_one())[5]
    assert await who.here.call_one() == pid


async def test_this_proc_in_the_controller_is_a_companion_process(sockets_dir):
    local = None
    try:
        local = this_proc()
        assert this_proc() is local
        who = local.spawn("who", Who)
        pid = (await who.who.call_one())[5]
        assert pid != os.getpid() and pid in local.pids
    finally:
        if local is not None:
            await local.stop()


async def test_get_or_spawn_controller_gives_every_process_the_same_actor(procs: ProcMesh):
    try:
        ctl = await get_or_spawn_controller("counter", Who, 5)
        await ctl.incr.call_one()
        again = await get_or_spawn_controller("counter", Who, 1000)  # later arguments are not used
        assert await again.value_of.call_one() == 6
        who = procs.spawn("who", Who)
        assert [v for _, v in await who.controller_value.call("counter")] == [6, 6]
        assert await who.slice(procs=0).controller_value.call_one("fresh") == 99
        with pytest.raises(TypeError, match="Actor subclass"):
            get_or_spawn_controller("bad", int)  # type: ignore[type-var]
    finally:
        await stop_controllers()


# ------------------------------------------------------------------ Accumulator, stream, flatten, initialized


async def test_accumulator_folds_every_result_in_rank_order(spawn):
    procs = spawn(gpus=3)
    who = procs.spawn("who", Who, 2)
    who.slice(gpus=1).incr.broadcast()
    assert await Accumulator(who.value_of, 0, operator.add).accumulate() == 7
    assert await Accumulator(who.value_of, [], lambda acc, v: [*acc, v]).accumulate() == [2, 3, 2]
    with pytest.raises(TypeError, match="mesh endpoint"):
        Accumulator(len, 0, operator.add)  # type: ignore[arg-type]


async def test_stream_yields_a_future_per_actor(spawn):
    procs = spawn(gpus=2)
    who = procs.spawn("who", Who, 3)
    futures = list(who.value_of.stream())
    assert len(futures) == 2
    assert sum([await f for f in futures]) == 6


async def test_flatten_and_slice_on_actor_meshes_and_value_meshes(spawn):
    procs = spawn(hosts=1, gpus=2)
    who = procs.spawn("who", Who)
    values = await who.who.call()
    flat = values.flatten("r")
    assert flat.extent == {"r": 2}
    assert flat.slice(r=1).item()[2] == 1
    assert values.slice(hosts=0, gpus=1).item()[2] == 1
    assert (await who.flatten("all").slice(all=1).who.call_one())[2] == 1


async def test_initialized_resolves_once_constructed_and_raises_if_not(procs: ProcMesh):
    actors.unhandled_fault_hook = lambda failure: None
    try:
        assert await procs.initialized is True
        await procs.spawn("who", Who).initialized
        with pytest.raises(SpawnError, match="no constructor today"):
            await procs.spawn("bad", BadInit).initialized
    finally:
        actors.unhandled_fault_hook = actors._runtime._supervision.unhandled_fault_hook


async def test_logging_option_sets_the_workers_level_and_tensor_engine_calls_are_refused(procs: ProcMesh):
    who = procs.spawn("who", Who)
    await procs.logging_option(level=logging.ERROR)
    assert [v for _, v in await who.log_level.call()] == [logging.ERROR] * 2
    with pytest.raises(NotImplementedError, match="tensor engine"):
        procs.activate()
    with pytest.raises(NotImplementedError, match="tensor engine"):
        who.value_of.rref()


# ------------------------------------------------------------------ supervision: MeshFailure, __init__, async __supervise__


async def test_an_exception_in_init_reaches_the_unhandled_fault_hook(procs: ProcMesh):
    faults: list[MeshFailure] = []
    both = asyncio.Event()

    def hook(failure: MeshFailure) -> None:
        faults.append(failure)
        if len(faults) == 2:
            both.set()

    actors.unhandled_fault_hook = hook
    try:
        mesh = procs.spawn("bad_init", BadInit)
        await asyncio.wait_for(both.wait(), 20)
    finally:
        actors.unhandled_fault_hook = actors._runtime._supervision.unhandled_fault_hook
    assert MeshFailure is Failure
    for failure in faults:
        assert "MeshFailure" in str(failure) and "bad_init" in str(failure)
        assert "no constructor today" in failure.report() and failure.mesh_name == mesh._name


async def test_an_async_supervise_is_awaited_and_gets_a_mesh_failure(spawn):
    parent = spawn(procs=1).spawn("parent", AsyncParent, spawn(procs=1))
    seen = await parent.fail_child.call_one()
    assert len(seen) == 1 and re.match(r"child#\w+: MeshFailure child\[0\]", seen[0]) and "kaboom" in seen[0]


async def test_a_proc_mesh_an_endpoint_is_given_reports_what_it_spawns_there_to_that_actor(spawn):
    """An endpoint's arguments were decoded before the actor's context was set: a proc mesh among them had no
    owning actor, so a failure of what the actor spawned on it skipped its ``__supervise__`` (the worker's fault
    hook took it, and the actor never heard). Decoded in the actor's context, as a constructor's are."""
    parent = spawn(procs=1).spawn("parent", ParentByEndpoint)
    await parent.adopt.call_one(spawn(procs=1))
    seen = await parent.fail_child.call_one()
    assert len(seen) == 1 and "kaboom" in seen[0]


# ------------------------------------------------------------------ stop, proc meshes as arguments, functions


async def test_after_its_proc_mesh_stopped_calls_and_spawns_fail_in_monarchs_words(spawn):
    procs = spawn(procs=1)
    who = procs.spawn("who", Who)
    await who.who.call()
    await procs.stop()
    with pytest.raises(ActorDied, match="actor mesh is stopped due to proc mesh shutdown"):
        await who.who.call()
    with pytest.raises(RuntimeError, match="`ProcMesh` has already been stopped"):
        await procs.spawn("late", Who).initialized


async def test_a_proc_mesh_with_a_failed_actor_takes_no_more_spawns_and_failures_name_the_crashed_rank(spawn):
    actors.unhandled_fault_hook = lambda failure: None  # let it pass: the mesh is not faulted, yet unhealthy
    try:
        procs = spawn(procs=2)
        failed = asyncio.Event()
        procs.add_failure_handler(lambda failure: failed.set())  # (returns None: it does not handle it)
        fails = procs.spawn("fails", Fails)
        healthy = procs.spawn("healthy", Who)
        fails.slice(procs=1).explode.broadcast()  # fire-and-forget: its failure goes to the owner
        await asyncio.wait_for(failed.wait(), 20)
        assert "crashed_ranks=[1]" in str(procs.failures[0]) and "fails[1]" in str(procs.failures[0])
        with pytest.raises(RuntimeError, match=r"error spawning actor mesh 'more'.*kaboom"):
            procs.spawn("more", Who)
        assert len(await healthy.who.call()) == 2, "the actors it has keep serving"
    finally:
        actors.unhandled_fault_hook = actors._runtime._supervision.unhandled_fault_hook


async def test_a_call_after_stop_is_a_supervision_error(procs: ProcMesh):
    who = procs.spawn("who", Who)
    other = procs.spawn("other", Who)
    await who.stop()
    with pytest.raises(SupervisionError, match="stopped"):
        await who.value_of.call()
    with pytest.raises(SupervisionError, match="stopped"):
        await who.slice(procs=0).value_of.call_one()
    # a handle that did not stop it (here, in another actor) hears it from the actor's process
    with pytest.raises(ActorError, match=r"SupervisionError.*stopped"):
        await other.slice(procs=1).call_other.call_one(who.slice(procs=0))


async def test_stop_takes_monarchs_reason(spawn):
    """Monarch's ``ActorMesh.stop(reason)`` and ``ProcMesh.stop(reason)`` (its ``stop_mesh.py`` example passes one):
    the actor mesh's raised TypeError and its actors ran on; the proc mesh took the reason for a timeout, sent the
    stop, then raised TypeError, and every worker stopped without waiting for ``__cleanup__``."""
    procs = spawn(procs=2)
    who = procs.spawn("who", Who)
    await who.stop("mesh stopped by example")
    with pytest.raises(SupervisionError, match="stopped"):
        await who.value_of.call()
    pids = set(procs.pids)
    await asyncio.wait_for(procs.stop("done with the mesh"), 60)
    assert wait_for(lambda: not pids & actor_pids(), timeout=10)
    with pytest.raises(TypeError, match="the bound is timeout="):
        procs.stop(0.5)  # type: ignore[arg-type]


async def test_a_proc_mesh_travels_as_an_endpoint_argument(spawn):
    parent = spawn(procs=1).spawn("parent", AsyncParent, spawn(procs=2))
    assert len(await parent.fail_child.call_one()) >= 1


async def test_functions_and_lambdas_are_refused_with_the_reason(procs: ProcMesh):
    runs = procs.spawn("runs", Runs)
    with pytest.raises(EncodeError, match=r"code does not travel.*pickle.*endpoint"):
        runs.run.call(lambda: 1)
    with pytest.raises(EncodeError, match=r"cannot send 'len'.*ACTORS_SEND_CODE=1"):
        runs.run.call(len)


# ------------------------------------------------------------------ scripts without a __main__ guard


def test_a_script_without_a_main_guard_runs_once(tmp_path):
    script = tmp_path / "unguarded.py"
    script.write_text(
        textwrap.dedent(
            """
            from actors import Actor, endpoint, this_host

            GREETING = "hello"
            print("top level ran")

            class Greeter(Actor):
                @endpoint
                def greet(self, name: str) -> str:
                    return f"{GREETING} {name}"

            procs = this_host().spawn_procs(per_host={"gpus": 2})
            greeter = procs.spawn("greeter", Greeter)
            print(greeter.greet.call("there").get().item(gpus=1))

            class Later(Actor):  # defined after the first spawn_procs, as Monarch's ping_pong does
                @endpoint
                def twice(self, x: int) -> int:
                    return 2 * x

            later_procs = this_host().spawn_procs(per_host={"procs": 1})
            print("later", later_procs.spawn("later", Later).twice.call_one(21).get())
            later_procs.stop().get()
            procs.stop().get()
            """
        )
    )
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    done = run_python(str(script), timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("top level ran") == 1, done.stdout
    assert "hello there" in done.stdout and "later 42" in done.stdout


async def test_a_controller_claimed_but_never_published_times_out(sockets_dir, monkeypatch):
    import actors._meshes._controllers as controllers

    monkeypatch.setattr(controllers, "PUBLISH_WAIT", 0.05)
    claim, _published = controllers._paths(runtime(), "orphan")
    open(claim, "w").close()  # another process claimed the name and died before publishing
    try:
        with pytest.raises(actors.CallTimeout, match="claimed by another process"):
            await get_or_spawn_controller("orphan", Who)
    finally:
        os.remove(claim)
        os.rmdir(os.path.dirname(claim))


async def test_a_controller_that_fails_to_spawn_frees_its_name(sockets_dir):
    """Arguments that cannot be sent fail the first caller; its process is stopped and the name is free again."""
    import threading

    import actors._meshes._controllers as controllers

    try:
        with pytest.raises(actors.EncodeError):
            get_or_spawn_controller("unsendable", Who, threading.Lock())
        claim, published = controllers._paths(runtime(), "unsendable")
        assert not os.path.exists(claim) and not os.path.exists(published)
        await stop_controllers()  # waits for the failed spawn's background stop: its process and socket are gone
        own = os.path.basename(runtime().address.removeprefix("ipc://"))
        assert set(os.listdir(sockets_dir)) - {own} == set()
        ctl = await get_or_spawn_controller("unsendable", Who, 3)
        assert await ctl.value_of.call_one() == 3
    finally:
        await stop_controllers()


async def test_a_waiter_claims_the_name_its_claimer_withdrew(sockets_dir):
    """The first caller's spawn failed and it withdrew its claim: a process waiting for it spawns the controller."""
    import actors._meshes._controllers as controllers

    claim, _published = controllers._paths(runtime(), "withdrawn")
    with open(claim, "w") as f:
        f.write(str(os.getpid()))  # a live claimer (this process stands in for it)
    waiting = get_or_spawn_controller("withdrawn", Who, 4)  # finds the claim: waits for its publication
    os.remove(claim)  # the claimer's spawn failed
    try:
        ctl = await asyncio.wait_for(waiting, 30)
        assert await ctl.value_of.call_one() == 4
    finally:
        await stop_controllers()


async def test_a_controller_whose_claimer_exited_unpublished_fails_at_once(sockets_dir):
    import subprocess
    import time

    import actors._meshes._controllers as controllers

    gone = subprocess.Popen(["true"])
    gone.wait()
    claim, _published = controllers._paths(runtime(), "orphaned")
    with open(claim, "w") as f:
        f.write(str(gone.pid))
    started = time.monotonic()
    try:
        with pytest.raises(actors.ActorDied, match=rf"claimed by pid {gone.pid}, which exited before publishing"):
            await get_or_spawn_controller("orphaned", Who)
        assert time.monotonic() - started < controllers.PUBLISH_WAIT / 2
    finally:
        os.remove(claim)
        os.rmdir(os.path.dirname(claim))


def test_malformed_points_and_proc_meshes_are_refused():
    from actors._meshes._proc_mesh import _proc_mesh_from_state
    from actors._runtime._value_mesh import _point_from_state

    with pytest.raises(actors.DecodeError, match="malformed point extent"):
        _point_from_state([0, [("gpus", "two")]])
    with pytest.raises(actors.DecodeError, match="malformed point"):
        _point_from_state(["zero", []])
    with pytest.raises(actors.DecodeError, match="malformed proc mesh extent"):
        _proc_mesh_from_state(["p", [(1, 2)], []])
    with pytest.raises(actors.DecodeError, match="malformed proc mesh process"):
        _proc_mesh_from_state(["p", [("procs", 1)], [["ipc://x", "pid"]]])


async def test_an_endpoint_error_names_the_call_first(procs: ProcMesh):
    doomed = procs.spawn("named_call", Doomed, actors.Channel[str].open()[0]).slice(procs=0)
    with pytest.raises(
        ActorError, match=r"^Actor call named_call\.ordinary failed: ValueError: a bad argument"
    ) as info:
        await doomed.ordinary.call_one()
    assert info.value.method == "ordinary" and info.value.exception_type == "ValueError"


class Lingering(Actor):
    def __init__(self, port: Port[str]) -> None:
        self.port = port
        self.started = asyncio.Event()

    @endpoint
    async def hang(self) -> None:
        self.started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.port.send("cancelled")
            raise

    @endpoint
    async def wait_started(self) -> None:
        await self.started.wait()

    async def __cleanup__(self, exc: BaseException | None) -> None:
        self.port.send("cleanup")


async def test_stop_cancels_running_calls_before_cleanup(spawn):
    procs = spawn(procs=1)
    port, receiver = actors.Channel[str].open()
    lingering = procs.spawn("lingering", Lingering, port)
    hanging = lingering.hang.call_one()
    await lingering.wait_started.call_one()
    await lingering.stop()
    assert [await asyncio.wait_for(receiver.recv(), 20) for _ in range(2)] == ["cancelled", "cleanup"]
    with pytest.raises(ActorError, match="CancelledError"):
        await asyncio.wait_for(hanging, 20)


class NeverConstructed(Actor):
    """Its constructor blocks for good (Monarch's ``test_run_forever_on_init``)."""

    def __init__(self) -> None:
        threading.Event().wait()

    @endpoint
    async def ping(self) -> str:
        return "pong"


async def test_a_constructor_that_never_returns_stalls_its_own_process_only(spawn):
    """A documented difference: an async actor's constructor runs on its process's event loop, as in Monarch
    (where asyncio, ``torch.cuda.set_device`` and other thread state set there carry to its endpoints), but that
    loop is shared by the process's actors. One that never returns stalls that process: calls to it time out
    (never hang, given a deadline), other processes serve on, and stopping the mesh still ends the process."""
    stuck, free = spawn(procs=1), spawn(procs=1)
    never = stuck.spawn("never", NeverConstructed)
    echo = free.spawn("echo", Echo, 1)
    with pytest.raises(actors.CallTimeout):
        await never.ping.with_timeout(1.0).call_one()
    assert await echo.add.call_one(1) == 2
    pid = stuck.pids[0]
    started = time.monotonic()
    await asyncio.wait_for(stuck.stop(timeout=1.0), 30)
    assert wait_for(lambda: pid not in actor_pids(), timeout=10)
    # it never answered the stop: it is killed then, not also given the time to exit that answering processes get
    assert time.monotonic() - started < 1.0 + ANSWER_GRACE + EXIT_WAIT


class Wrapper(Actor):
    """Spawns an actor on a mesh it was handed, hands it out, stops it, then its own process dies."""

    def __init__(self, procs: ProcMesh) -> None:
        self.inner = procs.spawn("inner", Echo)

    @endpoint
    async def get_inner(self) -> ActorMesh[Echo]:
        return self.inner

    @endpoint
    async def stop_inner(self) -> None:
        await self.inner.stop()

    @endpoint
    async def crash(self) -> None:
        os._exit(1)


async def test_a_call_to_an_actor_its_dead_spawner_stopped_says_it_was_stopped(spawn):
    """A documented difference (Monarch's ``test_actor_mesh_supervision_controller_dead``): the process serving
    the actor knows it was stopped and says so at once; Monarch says it timed out reaching the dead spawner."""
    outer, second = spawn(procs=1), spawn(procs=1)
    outer.add_failure_handler(lambda failure: True)  # the wrapper's death is expected here
    wrapper = outer.spawn("wrapper", Wrapper, second)
    inner = await wrapper.get_inner.call_one()
    await wrapper.stop_inner.call_one()
    with pytest.raises(SupervisionError):
        await asyncio.wait_for(wrapper.crash.call_one(), 30)
    with pytest.raises(SupervisionError, match="actor inner has status: stopped"):
        await asyncio.wait_for(inner.add.call_one(1), 30)


async def test_a_host_mesh_is_initialized_when_returned():
    """Monarch's ``HostMesh.initialized``: here every host mesh is ready when it is returned."""
    assert await this_host().initialized is True


def test_a_controllers_handle_is_encoded_and_decoded_on_the_runtimes_thread(tmp_path):
    """``get_or_spawn_controller`` from a synchronous endpoint (its actor's thread) or a synchronous program used
    the runtime's encoder and the inbox's decoder on that thread, while the runtime's thread used them for the
    messages it sent and read: their shared state could mix two records (a corrupt handle, or message)."""
    from types import SimpleNamespace

    from actors._meshes._controllers import _publish, _read

    inside = [False]
    used: list[tuple[str, bool]] = []

    def on_thread(fn: Any, timeout: float | None = None) -> Any:
        inside[0] = True
        try:
            return fn()
        finally:
            inside[0] = False

    encoder = SimpleNamespace(reset=lambda: None, encode=lambda value: used.append(("encode", inside[0])) or b"x")
    decoder = SimpleNamespace(decode=lambda blob, frames: used.append(("decode", inside[0])) or "mesh")
    rt = SimpleNamespace(
        encoder_now=lambda: encoder, inbox=SimpleNamespace(decoder=decoder), driver=SimpleNamespace(on_thread=on_thread)
    )
    path = str(tmp_path / "logger.mesh")
    _publish(rt, path, object())  # type: ignore[arg-type]
    assert _read(rt, path) == "mesh"  # type: ignore[arg-type]
    assert used == [("encode", True), ("decode", True)]


def test_two_threads_asking_for_this_proc_at_once_get_one_companion(sockets_dir, monkeypatch):
    """The controller's ``this_proc()`` starts its companion process on first use: two threads asking at once each
    found none and each started one; the second replaced the first, whose process nothing held any more."""
    import types

    from actors._meshes._host_mesh import THIS_PROC, HostMesh

    started: list[object] = []

    def slow_spawn(self: Any, per_host: Any, name: Any = None, **kwargs: Any) -> Any:
        time.sleep(0.2)  # (the fault injected: a start slow enough for the other thread to ask meanwhile)
        started.append(types.SimpleNamespace(stopping=False))
        return started[-1]

    runtime().driver.follow_running_loop()  # (the background loop serves this synchronous test)
    companion = runtime().parts.get(THIS_PROC)
    before = companion.mesh
    companion.mesh = None
    monkeypatch.setattr(HostMesh, "spawn_procs", slow_spawn)
    barrier, got = threading.Barrier(2), []

    def ask() -> None:
        barrier.wait(10)
        got.append(actors.this_proc())

    threads = [threading.Thread(target=ask) for _ in range(2)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert len(started) == 1 and got == [started[0], started[0]]
    finally:
        companion.mesh = before
