"""A restarted generator rejoining a run: the launcher's side (``pipeline.run._rejoins.Rejoins``)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from pipeline.run._rejoins import Rejoins


def _rejoins(tasks: dict[str, asyncio.Task[Any]], notes: list[str]) -> Rejoins:
    async def loading() -> None:
        await asyncio.Event().wait()  # the restarted process, its model still loading

    gen = SimpleNamespace(grant_inlet=SimpleNamespace(call_one=loading))
    gens = SimpleNamespace(slice=lambda procs: gen)
    procs = SimpleNamespace(pids=[0])
    return Rejoins(gens, procs, SimpleNamespace(), tasks, ["generator 0"], SimpleNamespace(note=notes.append))  # type: ignore[arg-type]


async def test_a_generator_dying_again_before_its_rejoin_is_done_cancels_that_rejoin():
    """Generator 0 dies, is restarted, and dies again while its rejoin waits for the new process: the first rejoin
    is cancelled (before, it went on once the newest process answered, and started a second ``run`` loop there,
    beside the second rejoin's, both taking the same grants)."""
    running = asyncio.ensure_future(asyncio.Event().wait())  # its run call, on the process that died
    tasks: dict[str, asyncio.Task[Any]] = {"generator 0": running}
    notes: list[str] = []
    rejoins = _rejoins(tasks, notes)
    assert rejoins.on_failure(SimpleNamespace(rank=0, pid=11, restarted=True, message="killed"))  # type: ignore[arg-type]
    first = tasks["generator 0"]
    assert rejoins.on_failure(SimpleNamespace(rank=0, pid=12, restarted=True, message="killed"))  # type: ignore[arg-type]
    second = tasks["generator 0"]
    await asyncio.wait([running, first], timeout=10)
    assert running.cancelled() and first.cancelled() and not second.done()
    assert rejoins.restarts == {"generator 0": 2} and rejoins.producing == set(), "still joining again"
    assert notes == ["generator 0 died (pid 11): killed", "generator 0 died (pid 12): killed"]
    second.cancel()


async def test_a_generator_dying_once_training_ended_is_not_rejoined_and_one_out_of_restarts_is_not_handled():
    running = asyncio.ensure_future(asyncio.Event().wait())
    tasks: dict[str, asyncio.Task[Any]] = {"generator 0": running}
    notes: list[str] = []
    rejoins = _rejoins(tasks, notes)
    assert not rejoins.on_failure(SimpleNamespace(rank=0, pid=11, restarted=False, message="killed"))  # type: ignore[arg-type]
    rejoins.end_training()
    assert rejoins.on_failure(SimpleNamespace(rank=0, pid=11, restarted=True, message="killed"))  # type: ignore[arg-type]
    assert tasks == {"generator 0": running} and rejoins.restarts == {} and rejoins.producing == {0}
    assert notes == ["generator 0 died after training ended (pid 11)"]
    running.cancel()
