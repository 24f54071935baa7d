"""Every public name of Monarch's ``monarch.actor`` 0.7.0 is importable here; each works or raises at use, saying why."""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

import pytest
from harness import actor_pids, wait_for

import actors
from actors import ProcMesh
from actors._runtime._telemetry import Meter

#: ``monarch.actor.__all__`` of torchmonarch 0.7.0, and the getting-started example's ``hosts_from_config``.
MONARCH_ACTOR_ALL = [
    "Accumulator", "Actor", "ActorError", "current_actor_name", "as_endpoint", "current_rank", "current_size",
    "concurrent_endpoint", "endpoint", "Future", "returns_future", "Point", "ProcMesh", "ProcId", "Channel", "send",
    "shutdown_context", "ValueMesh", "debug_controller", "get_or_spawn_controller", "this_host", "this_proc",
    "default_bootstrap_cmd", "HostMesh", "context", "Port", "PortReceiver", "Endpoint", "Extent",
    "run_worker_loop_forever", "run_worker_loop_until_shutdown", "start_worker_loop_forever", "attach_to_workers",
    "attach", "enable_transport", "Context", "ChannelTransport", "unhandled_fault_hook", "MeshFailure", "config",
    "get_meter", "span", "traced", "Uid", "hosts_from_config",
]  # fmt: skip


@pytest.mark.parametrize("name", MONARCH_ACTOR_ALL)
def test_every_monarch_name_is_exported(name):
    assert name in actors.__all__ and getattr(actors, name) is not None


@pytest.mark.parametrize(
    ("use", "what"),
    [
        (lambda: actors.as_endpoint(print), "as_endpoint"),
        (lambda: actors.attach("tcp://127.0.0.1:1"), "attach"),
        (lambda: actors.debug_controller(), "debug_controller"),
        (lambda: actors.default_bootstrap_cmd(), "default_bootstrap_cmd"),
        (lambda: actors.ProcId(), "ProcId"),
        (lambda: actors.Uid(), "Uid"),
        (lambda: actors.config.enable_log_forwarding, "config.enable_log_forwarding"),
        (lambda: actors.enable_transport("metatls"), "MetaTlsWithIpV6"),
    ],
)
def test_names_not_offered_raise_at_use_with_the_reason(use, what):
    with pytest.raises(NotImplementedError, match=what):
        use()


def _doubling(calls: list[int]) -> Any:
    """A ``@returns_future`` function that doubles its argument, noting each run of its body in ``calls``."""

    @actors.returns_future
    async def double(x: int) -> int:
        calls.append(x)
        await asyncio.sleep(0)
        return 2 * x

    return double


def test_returns_future_serves_both_kinds_of_caller():
    calls: list[int] = []
    double = _doubling(calls)
    pending = double(4)
    assert calls == [], "calling does not start the body"
    assert pending.get(timeout=5) == 8

    async def awaited() -> int:
        return await double(5)

    assert asyncio.run(awaited()) == 10
    with pytest.raises(TypeError, match="async def"):
        actors.returns_future(lambda: 1)  # type: ignore[arg-type]


def test_as_asyncio_is_an_asyncio_future_of_the_work_run_once_and_refused_off_a_loop():
    """Monarch's ``Future.as_asyncio()`` (its guide awaits ``call_one(...).as_asyncio()``): an ``AttributeError``
    here before. Observing never consumes the future: each ``as_asyncio()`` and ``await`` sees the one run."""
    calls: list[int] = []
    pending = _doubling(calls)(4)
    with pytest.raises(RuntimeError, match=r"as_asyncio\(\) needs a running asyncio event loop"):
        pending.as_asyncio()
    assert calls == [], "nothing started off the loop"

    async def observed() -> tuple[int, int, int]:
        first, second = pending.as_asyncio(), pending.as_asyncio()
        assert isinstance(first, asyncio.Future) and first is not second
        return await first, await second, await pending

    assert asyncio.run(observed()) == (8, 8, 8) and calls == [4]


def test_a_get_that_gives_up_does_not_consume_the_future_nor_run_it_twice():
    """Monarch: a timeout never consumes the future; a later get() or await sees its result. A get(timeout) that
    gave up cancelled the body, and the next get() ran it again (an endpoint call in it was sent twice)."""
    started, release = [], threading.Event()

    @actors.returns_future
    async def slow() -> int:
        started.append(1)
        await asyncio.to_thread(release.wait, 30)
        return 7

    pending = slow()
    with pytest.raises(actors.CallTimeout, match="gave up after"):
        pending.get(timeout=0.05)
    release.set()
    assert pending.get(timeout=30) == 7 and started == [1]

    async def awaited() -> int:
        return await again

    again, release = slow(), threading.Event()
    with pytest.raises(actors.CallTimeout):
        again.get(timeout=0.05)
    release.set()
    assert asyncio.run(awaited()) == 7 and started == [1, 1], "an await waits for the run a get() started"


def test_a_future_awaited_by_two_tasks_at_once_runs_its_work_once():
    """Each ``await`` of a future ran its work when none had finished it yet: two tasks awaiting one future at
    once (a ``returns_future`` body, a ``then``) ran it twice, an endpoint call in it sent twice. A later awaiter
    waits for the run under way; if that run's awaiter is cancelled, the next one runs it."""
    runs: list[int] = []

    @actors.returns_future
    async def work() -> int:
        runs.append(1)
        await asyncio.sleep(0.05)
        return 7

    async def both() -> list[int]:
        pending = work()

        async def wait() -> int:
            return await pending

        return list(await asyncio.gather(wait(), wait()))

    assert asyncio.run(both()) == [7, 7] and runs == [1]

    async def first_given_up() -> int:
        pending = work()
        first = asyncio.ensure_future(_awaited(pending))
        while not runs:  # (the first await's run is under way)
            await asyncio.sleep(0)
        second = asyncio.ensure_future(_awaited(pending))
        await asyncio.sleep(0)  # (the second waits for that run)
        first.cancel()  # not the future's outcome: the second awaiter runs the work itself
        return await second

    runs.clear()
    assert asyncio.run(first_given_up()) == 7 and runs == [1, 1]


async def _awaited(pending: Any) -> Any:
    return await pending


def test_spans_traced_functions_and_the_meter_record(caplog):
    @actors.traced
    def work(x: int) -> int:
        return x + 1

    @actors.traced(name="named")
    async def later() -> str:
        return "done"

    with caplog.at_level(logging.DEBUG, logger="actors.telemetry"):
        with actors.span("block"):
            pass
        assert work(1) == 2 and asyncio.run(later()) == "done"
        with pytest.raises(KeyError), actors.span("failing"):
            raise KeyError("x")
    assert [r.getMessage().split(":")[0] for r in caplog.records] == [
        "span block",
        "span work",
        "span named",
        "span failing",
    ]
    assert "raised KeyError" in caplog.records[-1].getMessage()
    actors.get_meter().create_counter("steps").add(2)  # OpenTelemetry's meter where installed, else ours
    meter = Meter()  # ours: instruments keep their totals in this process
    counter = meter.create_counter("steps")
    counter.add(2)
    counter.add(3)
    assert meter.create_counter("steps").value == 5
    with pytest.raises(ValueError, match="only goes up"):
        counter.add(-1)
    histogram = meter.create_histogram("latency")
    histogram.record(0.5)
    assert histogram.value == 0.5 and histogram.count == 1


def test_extent_is_an_ordered_shape():
    extent = actors.Extent(["hosts", "gpus"], [2, 4])
    assert extent.labels == ["hosts", "gpus"] and extent.sizes == [2, 4] and extent.nelements == 8
    assert dict(extent) == {"hosts": 2, "gpus": 4}
    with pytest.raises(ValueError, match="distinct labels"):
        actors.Extent(["a", "a"], [1, 2])
    with pytest.raises(ValueError, match="non-negative ints"):
        actors.Extent(["a"], [-1])


def test_enable_transport_accepts_the_transport_in_use_and_refuses_a_change(sockets_dir):
    actors.enable_transport("ipc")  # the runtime of this process runs on ipc
    actors.enable_transport(actors.ChannelTransport.Unix)
    with pytest.raises(RuntimeError, match="already started on ipc"):
        actors.enable_transport("tcp")
    with pytest.raises(ValueError, match="unknown transport"):
        actors.enable_transport("carrier-pigeon")


async def test_shutdown_context_stops_the_controllers_after_the_actors_whose_cleanup_calls_them(sockets_dir, tmp_path):
    """The controllers' processes were stopped with every other mesh at once: an actor's ``__cleanup__`` that
    calls a controller (to log its last figures, say) raced the controller's own stop and lost."""
    from support import Echo, TalliesAtCleanup

    tally = await actors.get_or_spawn_controller("tally", Echo)
    assert await tally.add.call_one(1).as_asyncio() == 1  # (Monarch's guide: ``await ….call_one(5, 3).as_asyncio()``)
    procs: ProcMesh = actors.this_host().spawn_procs(per_host={"procs": 1})
    await procs.spawn("caller", TalliesAtCleanup, str(tmp_path / "called")).initialized
    await asyncio.wait_for(actors.shutdown_context(), 60)
    assert (tmp_path / "called").read_text() == "1"


async def test_shutdown_context_stops_every_proc_mesh_this_process_spawned(sockets_dir):
    procs: ProcMesh = actors.this_host().spawn_procs(per_host={"procs": 2})
    await procs.initialized
    await actors.shutdown_context()
    assert procs.stopping and all(pid is not None for pid in procs.pids)
    await actors.shutdown_context()  # nothing left: returns at once


async def test_this_host_as_an_async_context_manager_stops_the_proc_meshes_spawned_through_it(sockets_dir):
    """Monarch's ``async with hosts:`` shuts the hosts down on leaving, and a host mesh has an ``extent``,
    ``shutdown()`` and ``stop()``: the local host had none of them (``AttributeError``/``TypeError``)."""
    async with actors.this_host() as host:
        assert host.extent == {"hosts": 1}
        procs: ProcMesh = host.spawn_procs(per_host={"procs": 2})
        await procs.initialized
        pids = set(procs.pids)
    assert procs.stopping and wait_for(lambda: not actor_pids() & pids, timeout=10)
    other = actors.this_host()
    more: ProcMesh = other.spawn_procs(per_host={"procs": 1})
    await more.initialized
    await other.stop()
    assert more.stopping and wait_for(lambda: not actor_pids() & set(more.pids), timeout=10)
    await other.shutdown()  # nothing left: returns at once


async def test_a_host_mesh_shutdown_stops_every_mesh_though_one_stop_fails_and_holds_none_alive():
    """One proc mesh's stop that raised left the others running; and the host mesh kept every mesh it spawned
    alive (the runtime holds them weakly)."""
    import gc

    from actors._runtime._future import Future

    class Stand:
        """A proc mesh's stand-in: its stop fails or succeeds."""

        def __init__(self, fails: bool) -> None:
            self.fails, self.stopped = fails, False

        def stop(self) -> Future[None]:
            async def stopping() -> None:
                self.stopped = True
                if self.fails:
                    raise RuntimeError("this stop failed")

            return Future(stopping)

    host = actors.HostMesh()
    meshes = [Stand(True), Stand(False)]
    for mesh in meshes:
        host._spawned.add(mesh)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="this stop failed"):
        await host.shutdown()
    assert all(mesh.stopped for mesh in meshes)
    host._spawned.add(Stand(False))  # type: ignore[arg-type]  # (dropped by the program at once)
    gc.collect()
    assert len(host._spawned) == 0
