"""An actor's stop inside its worker, unit by unit: cleanup, what it spawned, and the worker's own stop.

The :class:`~actors._hosting._lifecycle.Lifecycle` runs here on the test's
loop with stand-in actors and children (no process, no socket): the order
of events is the loop's, so each case is deterministic.
"""

from __future__ import annotations

import asyncio
import threading
import types
from typing import Any

import pytest

from actors import Actor, endpoint
from actors._hosting._child_supervision import ChildSupervision
from actors._hosting._failure_reports import FailureReports
from actors._hosting._lifecycle import Lifecycle
from actors._hosting._slots import ActorSlot, SlotTable
from actors._runtime._supervision import Failure
from actors._wire._records import ErrorRecord


class Child:
    """Something an actor spawned (a proc mesh): records that it was stopped."""

    def __init__(self, log: list[str], name: str) -> None:
        self._log, self._name = log, name

    async def stop(self) -> None:
        self._log.append(f"stopped {self._name}")


class Gated:
    """A stand-in actor whose ``__cleanup__`` waits for the test's gate, saying when it began and when it ended."""

    def __init__(self, log: list[str]) -> None:
        self.log = log
        self.started, self.gate = asyncio.Event(), asyncio.Event()

    async def __cleanup__(self, exc: BaseException | None) -> None:
        self.started.set()
        await self.gate.wait()
        self.log.append("cleaned up")


def hosting(instance: Any, *children: Child) -> tuple[Lifecycle, ActorSlot]:
    slots = SlotTable()
    slot = slots.actors["a"] = ActorSlot("a", 0, {}, "tests:Stand-in")
    slot.instance = instance
    slot.children.extend(children)
    return Lifecycle(None, slots, None, lambda hosted: None), slot  # type: ignore[arg-type]


async def test_the_workers_stop_waits_for_a_cleanup_already_under_way():
    """An actor stopped alone (``ActorMesh.stop``), then its worker stopped before that cleanup ended: the worker's
    stop found no actor left and answered at once, so the process exited in the middle of ``__cleanup__``."""
    log: list[str] = []
    gated = Gated(log)
    life, _ = hosting(gated, Child(log, "child"))
    alone = asyncio.ensure_future(life.stop_actor("a"))
    await asyncio.wait_for(gated.started.wait(), 10)
    everything = asyncio.ensure_future(life.stop_all())
    everything.add_done_callback(lambda _: log.append("worker stopped"))
    for _ in range(5):  # (the old stop answered within a turn or two)
        await asyncio.sleep(0)
    gated.gate.set()
    await asyncio.wait_for(asyncio.gather(alone, everything), 10)
    assert log == ["cleaned up", "stopped child", "worker stopped"]


async def test_a_second_stop_of_an_actor_is_answered_only_once_its_cleanup_ended():
    """Two ``stop()`` of one actor (two views of its mesh, a retry): the first took the actor out of the table and
    the second, finding nothing, answered at once, while ``__cleanup__`` and the stop of what it spawned ran on."""
    log: list[str] = []
    gated = Gated(log)
    life, _ = hosting(gated, Child(log, "child"))
    first = asyncio.ensure_future(life.stop_actor("a"))
    await asyncio.wait_for(gated.started.wait(), 10)
    second = asyncio.ensure_future(life.stop_actor("a"))
    second.add_done_callback(lambda _: log.append("second stop answered"))
    for _ in range(5):  # (the old second stop answered within a turn)
        await asyncio.sleep(0)
    assert not second.done()
    gated.gate.set()
    await asyncio.wait_for(asyncio.gather(first, second), 10)
    assert log == ["cleaned up", "stopped child", "second stop answered"]
    assert not life._slots.leaving  # (forgotten once stopped)
    await asyncio.wait_for(life.stop_actor("a"), 10)  # a later one: nothing left to stop, answered at once


async def test_a_failure_of_what_an_actor_spawned_during_its_stop_is_not_escalated():
    """A child mesh failing while its spawner's ``__cleanup__`` ran (a stop by name): the spawner was out of the
    table, so the failure counted as unhandled and went to this worker's owner as one, about an actor it had
    stopped on purpose; nor did a report of it find the actor's own supervisor."""
    log: list[str] = []
    reported: list[tuple[Any, ...]] = []
    gated = Gated(log)
    life, slot = hosting(gated)
    owner, spawner = types.SimpleNamespace(dead=False), types.SimpleNamespace(dead=False)
    slot.supervisor = spawner  # type: ignore[assignment]
    rt = types.SimpleNamespace(send=lambda to, what, urgent: reported.append((to, what)))
    reports = FailureReports(rt, life._slots, owner)  # type: ignore[arg-type]
    children = ChildSupervision(life._slots, reports, life)
    stopping = asyncio.ensure_future(life.stop_actor("a"))
    await asyncio.wait_for(gated.started.wait(), 10)
    failure = Failure("worker", 0, 4321, "", "ActorDied", "process exited")
    assert children.supervise("a", failure)  # handled: the actor's stop stops its children
    reports.report("a", 0, "__cleanup__", ErrorRecord("RuntimeError", "late"))
    assert [to for to, _ in reported] == [spawner]  # to whoever spawned it, not this worker's owner
    gated.gate.set()
    await asyncio.wait_for(stopping, 10)
    assert not children.supervise("a", failure)  # gone for good: nothing of it to ask
    """``self.task.cancel(); await self.task`` in ``__cleanup__`` raises CancelledError: it skipped stopping the
    actor's children (their processes lived on) and escaped the stop, whose worker then ignored SIGTERM."""
    log: list[str] = []

    class CancelsItsTask:
        async def __cleanup__(self, exc: BaseException | None) -> None:
            task = asyncio.ensure_future(asyncio.Event().wait())
            await asyncio.sleep(0)
            task.cancel()
            await task

    life, slot = hosting(CancelsItsTask(), Child(log, "older"), Child(log, "newer"))
    await asyncio.wait_for(life.stop_actor("a"), 10)  # (raised CancelledError)
    assert log == ["stopped newer", "stopped older"] and not slot.children
    await asyncio.wait_for(life.stop_all(), 10)


async def test_a_cleanup_that_fails_still_stops_what_the_actor_spawned():
    log: list[str] = []

    class Fails:
        async def __cleanup__(self, exc: BaseException | None) -> None:
            raise RuntimeError("cleanup broke")

    life, _ = hosting(Fails(), Child(log, "child"))
    await asyncio.wait_for(life.stop_actor("a"), 10)
    assert log == ["stopped child"]


async def test_a_cleanup_that_swallows_its_cancel_is_abandoned_at_its_bound(caplog):
    """``asyncio.wait_for`` cancels a cleanup that overruns and then waits for it to end: one that catches the
    cancel and goes on ("finish flushing anyway") held the stop past its bound, for good if it never ended, and
    the worker ignored SIGTERM meanwhile."""
    log: list[str] = []
    gate = asyncio.Event()

    class Stubborn:
        async def __cleanup__(self, exc: BaseException | None) -> None:
            while not gate.is_set():
                try:
                    await gate.wait()
                except asyncio.CancelledError:
                    log.append("cancel swallowed")

    life, _ = hosting(Stubborn(), Child(log, "child"))
    try:
        await asyncio.wait_for(life.stop_actor("a", timeout=0.1), 10)
        assert log == ["cancel swallowed", "stopped child"]
        assert "did not end within 0.1s" in caplog.text and "abandoned" in caplog.text
    finally:
        gate.set()  # (the abandoned cleanup ends with the test)


class Noted:
    """A child that says when it was stopped."""

    def __init__(self) -> None:
        self.stopped = asyncio.Event()

    async def stop(self) -> None:
        self.stopped.set()


async def test_what_an_actor_spawns_once_its_stop_began_is_stopped_at_once():
    """A sync actor's endpoint runs on past its actor's stop (a cancel does not stop a thread) and may spawn: a
    child adopted once the stop had begun was added to a list nothing read again, and one adopted after the
    worker's stop was dropped without a word; both processes lived on."""
    life, slot = hosting(object())
    await asyncio.wait_for(life.stop_slot(slot, None, 1.0), 10)  # (a failed actor: stopped, still in the table)
    late = Noted()
    life.adopt("a", late)
    await asyncio.wait_for(late.stopped.wait(), 10)
    assert not slot.children
    life, slot = hosting(object())
    await asyncio.wait_for(life.stop_all(), 10)
    after = Noted()
    life.adopt("a", after)
    await asyncio.wait_for(after.stopped.wait(), 10)


async def test_the_workers_stop_waits_for_stops_that_began_while_it_waited():
    """A stop that begins while the worker's stop waits (an orphan adopted meanwhile) is waited for too; before,
    only those under way when it began were, and the worker ended in the middle of the later one."""
    log: list[str] = []
    gated = Gated(log)
    child_gate = asyncio.Event()

    class SlowChild:
        async def stop(self) -> None:
            await child_gate.wait()
            log.append("late child stopped")

    life, _ = hosting(gated)
    everything = asyncio.ensure_future(life.stop_all())
    await asyncio.wait_for(gated.started.wait(), 10)
    life.adopt("a", SlowChild())  # the actor was stopped already: its child is stopped at once, as a stop of its own
    gated.gate.set()
    for _ in range(5):  # (the old stop answered within a turn or two of the cleanup's end)
        await asyncio.sleep(0)
    assert log == ["cleaned up"] and not everything.done()
    child_gate.set()
    await asyncio.wait_for(everything, 10)
    assert log == ["cleaned up", "late child stopped"]


class SlowStart(Actor):
    """A synchronous actor whose constructor waits for the test's gate (it runs on the actor's own thread)."""

    def __init__(self, started: threading.Event, gate: threading.Event, log: list[str]) -> None:
        started.set()
        gate.wait(30)
        self.log = log
        log.append("constructed")

    @endpoint
    def ping(self) -> str:
        return "pong"

    def __cleanup__(self, exc: BaseException | None) -> None:
        self.log.append(f"cleaned up on {threading.current_thread().name.partition('_')[0]}")


def slow_start(
    started: threading.Event, gate: threading.Event, log: list[str], replies: list[bool]
) -> tuple[Lifecycle, Any]:
    """A worker's lifecycle whose spawns construct :class:`SlowStart` with these arguments, and the spawn call
    (its answers, ok or not, go to ``replies``)."""
    rt = types.SimpleNamespace(
        registry=types.SimpleNamespace(proc=lambda address, pid: None),
        inbox=types.SimpleNamespace(
            decoder=types.SimpleNamespace(decode=lambda ctor, frames: ([started, gate, log], {}))
        ),
    )
    inv = types.SimpleNamespace(
        call=types.SimpleNamespace(rank=0, reply_to="ipc://caller", reply_pid=1),
        frames=[],
        reply=lambda rt, ok, value: replies.append(ok),
    )
    return Lifecycle(rt, SlotTable(), None, lambda hosted: None), inv  # type: ignore[arg-type]


async def test_an_actor_stopped_while_its_constructor_runs_is_cleaned_up_once_constructed():
    """A synchronous actor's constructor runs on its thread; a stop meanwhile found no instance, so no
    ``__cleanup__`` ever ran for the actor the constructor then finished building, and what it spawned after the
    stop was adopted by no one (its processes lived until the worker exited). Both now stop."""
    started, gate, log, replies = threading.Event(), threading.Event(), [], []
    life, inv = slow_start(started, gate, log, replies)
    spawning = asyncio.ensure_future(life.spawn(inv, "a", f"{__name__}:SlowStart", {}, b""))  # type: ignore[arg-type]
    await asyncio.wait_for(asyncio.to_thread(started.wait, 10), 20)
    await asyncio.wait_for(life.stop_actor("a"), 10)  # (no instance yet: nothing to clean up)
    orphan = Child(log, "spawned after the stop")
    life.adopt("a", orphan)  # the constructor spawns on, with its actor stopped
    gate.set()
    await asyncio.wait_for(spawning, 20)
    await asyncio.wait_for(life.stop_all(), 20)  # (waits for every stop under way)
    assert replies == [True]
    assert sorted(log) == ["cleaned up on actor-a", "constructed", "stopped spawned after the stop"]


async def test_the_workers_stop_waits_for_a_construction_under_way_and_refuses_a_later_spawn():
    """The worker's stop (a mesh's ``stop()``, SIGTERM) while a synchronous actor's constructor runs: it found no
    instance, answered at once, and the worker ended before the constructed actor's ``__cleanup__`` (what its
    ``__init__`` acquired leaked). It now waits for the construction and cleans the actor up; a spawn that
    arrives once the worker is stopping is refused (before, its actor was never stopped)."""
    started, gate, log, replies = threading.Event(), threading.Event(), [], []
    life, inv = slow_start(started, gate, log, replies)
    spawning = asyncio.ensure_future(life.spawn(inv, "a", f"{__name__}:SlowStart", {}, b""))  # type: ignore[arg-type]
    await asyncio.wait_for(asyncio.to_thread(started.wait, 10), 20)
    everything = asyncio.ensure_future(life.stop_all())
    for _ in range(5):  # (the old stop ended within a turn or two)
        await asyncio.sleep(0)
    assert not everything.done(), "the worker's stop waits for the construction under way"
    with pytest.raises(RuntimeError, match="stopping"):
        await life.spawn(inv, "b", f"{__name__}:SlowStart", {}, b"")  # type: ignore[arg-type]
    gate.set()
    await asyncio.wait_for(spawning, 20)
    await asyncio.wait_for(everything, 20)
    assert replies == [True]
    assert log == ["constructed", "cleaned up on actor-a"]


def test_a_cleanup_or_supervise_raising_system_exit_is_their_failure_and_the_worker_goes_on():
    """``SystemExit`` (or ``KeyboardInterrupt``) from ``__cleanup__`` (async, or a plain ``def`` on an async
    actor) escaped its task out of the worker's event loop: the other cleanups and the stops of what the actor
    spawned never ran, and the stop was never answered. A ``def __supervise__`` raising it escaped into the mesh
    supervisor. Each is now a failure of the hook: logged (cleanup) or escalated (supervise), and the stop goes on."""
    from actors._hosting._child_supervision import ChildSupervision

    class Exits:
        async def __cleanup__(self, exc: BaseException | None) -> None:
            raise SystemExit(3)

    class ExitsPlainly:
        def __cleanup__(self, exc: BaseException | None) -> None:
            raise KeyboardInterrupt

    class SupervisesByExiting:
        def __supervise__(self, failure: Any) -> bool:
            raise SystemExit(5)

    async def main() -> tuple[list[str], list[tuple[str, str]], bool]:
        log: list[str] = []
        for instance in (Exits(), ExitsPlainly()):
            life, _ = hosting(instance, Child(log, type(instance).__name__))
            await asyncio.wait_for(life.stop_all(), 10)
        reported: list[tuple[str, str]] = []
        reports = types.SimpleNamespace(report=lambda actor, rank, method, record: reported.append((method, record)))
        life, _slot = hosting(SupervisesByExiting(), Child(log, "supervisor's child"))
        life._reports = reports  # type: ignore[assignment]
        supervision = ChildSupervision(life._slots, reports, life)  # type: ignore[arg-type]
        handled = supervision.supervise("a", types.SimpleNamespace(traceback="", __str__=lambda self: "a failure"))
        await asyncio.wait_for(life.stop_all(), 10)
        return log, [(method, record.message) for method, record in reported], handled

    try:
        log, reported, handled = asyncio.run(main())
    except BaseException as exc:  # (what escaped the loop)
        pytest.fail(f"the worker's loop ended: {type(exc).__name__}")
    assert log == ["stopped Exits", "stopped ExitsPlainly", "stopped supervisor's child"]
    assert handled and len(reported) == 1 and reported[0][0] == "__supervise__"
    assert "__supervise__ raised SystemExit" in reported[0][1], reported


async def test_a_call_that_waited_for_its_actors_spawn_is_not_held_once_the_spawn_took_it():
    """A call read before its actor's spawn (``spawn(...)`` then at once ``load.call(state_dict)``) waits for
    it, with a timer to refuse it if the spawn never comes: the timer held the call, its arguments and buffer
    frames (gigabytes of weights) for 30 s after the call had finished. It holds the call weakly now."""
    import gc
    import weakref

    from actors._hosting._dispatch import CallDispatcher
    from actors._hosting._invocation import Invocation

    slots = SlotTable()
    life = types.SimpleNamespace(loop=asyncio.get_running_loop())
    dispatcher = CallDispatcher(None, slots, None, life)  # type: ignore[arg-type]
    inv = Invocation(types.SimpleNamespace(actor="a", method="load"), [bytearray(1 << 20)])  # type: ignore[arg-type]
    dispatcher.dispatch(inv)
    assert slots.waiting["a"] == [inv]
    taken = slots.waiting.pop("a")  # (the spawn takes the calls that waited; they run and end)
    held = weakref.ref(inv)
    del inv, taken
    gc.collect()
    assert held() is None, "nothing holds a call that has run"


async def test_a_call_whose_actor_is_never_spawned_is_refused_at_the_spawn_wait(monkeypatch):
    """The expiry of a waiting call: that very call is refused (``LookupError``); an equal call queued behind it
    (the same bytes: a retry) waits on, to its own expiry."""
    from actors._hosting import _dispatch
    from actors._hosting._dispatch import CallDispatcher
    from actors._hosting._invocation import Invocation

    monkeypatch.setattr(_dispatch, "SPAWN_WAIT", 0.01)
    refused: asyncio.Queue[tuple[Invocation, str]] = asyncio.Queue()
    reports = types.SimpleNamespace(refuse=lambda inv, record: refused.put_nowait((inv, record.type_name)))
    slots = SlotTable()
    life = types.SimpleNamespace(loop=asyncio.get_running_loop())
    dispatcher = CallDispatcher(None, slots, reports, life)  # type: ignore[arg-type]
    call = types.SimpleNamespace(actor="never", method="load")
    first, second = Invocation(call, []), Invocation(call, [])  # type: ignore[arg-type]
    dispatcher.dispatch(first)
    monkeypatch.setattr(_dispatch, "SPAWN_WAIT", 30.0)
    dispatcher.dispatch(second)
    inv, kind = await asyncio.wait_for(refused.get(), 10)
    assert inv is first and kind == "LookupError"
    assert len(slots.waiting["never"]) == 1 and slots.waiting["never"][0] is second


async def test_a_plain_cleanup_of_an_actor_without_endpoints_runs_off_the_event_loop():
    """An actor with no endpoint is not synchronous by Monarch's rule, so its plain ``def __cleanup__`` ran on
    the worker's event loop: one that waits (joins its thread) blocked every other actor's calls and the stop's
    own bound. It runs on the actor's thread now, under the bound."""
    gate, log = threading.Event(), []

    class Waits:
        def __cleanup__(self, exc: BaseException | None) -> None:
            gate.wait(5)
            log.append(f"cleaned up on {threading.current_thread().name.partition('_')[0]}")

    life, _ = hosting(Waits())
    stopping = asyncio.ensure_future(life.stop_all())
    for _ in range(5):
        await asyncio.sleep(0)
    assert log == [] and not stopping.done(), "the loop runs on while the cleanup waits"
    gate.set()
    await asyncio.wait_for(stopping, 10)
    assert log == ["cleaned up on actor-a"]


async def test_the_workers_stop_waits_for_a_construction_only_up_to_the_cleanup_bound(caplog):
    """A constructor that never returns must not hold the worker's end: its stop waits for it up to the bound."""
    started, gate, log = threading.Event(), threading.Event(), []
    life, inv = slow_start(started, gate, log, [])
    spawning = asyncio.ensure_future(life.spawn(inv, "a", f"{__name__}:SlowStart", {}, b""))  # type: ignore[arg-type]
    try:
        await asyncio.wait_for(asyncio.to_thread(started.wait, 10), 20)
        await asyncio.wait_for(life.stop_all(timeout=0.05), 10)
        assert "a constructor still runs" in caplog.text
    finally:
        gate.set()
        await asyncio.wait_for(spawning, 20)
        # the construction's end starts its late cleanup (after the stop it waits for): let it run to its end
        await asyncio.wait_for(life.stop_all(timeout=5), 20)
