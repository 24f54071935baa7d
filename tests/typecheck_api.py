"""Checked by mypy in CI, never run: the API's types reach the user's call site.

Each ``assert_type`` must hold, and each ``# type: ignore[...]`` marks a
call mypy must reject (``warn_unused_ignores`` is on for this file, so an
ignore that is not needed, because the mistake went unnoticed, fails CI).
"""

from __future__ import annotations

from typing_extensions import assert_type

from actors import (
    Actor,
    Channel,
    Future,
    Port,
    PortReceiver,
    ProcMesh,
    ValueMesh,
    endpoint,
    send,
    this_host,
)


class Adder(Actor):
    @endpoint
    async def add(self, a: int, b: int) -> int:
        return a + b

    @endpoint
    def name(self) -> str:
        return "adder"

    @endpoint(timeout=5)
    async def scale(self, x: float, *, by: float = 2.0) -> float:
        return x * by


async def calls(procs: ProcMesh) -> None:
    adder = procs.spawn("adder", Adder)
    assert_type(adder, Adder)
    assert_type(adder.add.call_one(1, 2), Future[int])
    assert_type(await adder.add.call_one(1, 2), int)
    assert_type(await adder.add.call(1, 2), ValueMesh[int])
    assert_type(await adder.add.choose(a=1, b=2), int)
    assert_type(await adder.name.call_one(), str)
    assert_type(await adder.scale.call_one(1.5, by=3.0), float)
    assert_type(adder.slice(procs=0), Adder)
    adder.add.broadcast(1, 2)
    adder.add.call_one("1", 2)  # type: ignore[arg-type]
    adder.add.call_one(1)  # type: ignore[call-arg]
    adder.scale.call_one(1.0, factor=2.0)  # type: ignore[call-arg]
    send(adder.add, (1, 2), selection="choose")
    send(adder.add, (1, 2), selection="some")  # type: ignore[arg-type]


async def ports() -> None:
    port, receiver = Channel.open(int)
    assert_type(port, Port[int])
    assert_type(receiver, PortReceiver[int])
    assert_type(await receiver.recv(), int | None)
    port.send(3)
    port.send(None)
    port.send("three")  # type: ignore[arg-type]
    untyped, _ = Channel.open()
    untyped.send("anything")


def meshes() -> None:
    this_host().spawn_procs(per_host={"procs": 2}, restart="on-failure")
    this_host().spawn_procs(restart="sometimes")  # type: ignore[arg-type]
