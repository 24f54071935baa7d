"""A custom actor by subclassing: a base counter, specialised by overriding a hook.

    python examples/custom_actor.py

Endpoints are inherited like any method; the subclass changes behaviour by
overriding a plain method and adds an endpoint of its own. ``__cleanup__``
runs when the mesh stops.
"""

from __future__ import annotations

import asyncio

from actors import Actor, endpoint, this_host


class Counter(Actor):
    def __init__(self, start: int = 0) -> None:
        self.value = start

    def step(self) -> int:
        return 1

    @endpoint
    async def tick(self, times: int = 1) -> int:
        for _ in range(times):
            self.value += self.step()
        return self.value

    async def __cleanup__(self, exc: BaseException | None) -> None:
        print(f"{type(self).__name__} stopping at {self.value}", flush=True)


class SkipCounter(Counter):
    """Counts in steps of ``stride`` and can be reset."""

    def __init__(self, stride: int) -> None:
        super().__init__(start=100)
        self.stride = stride

    def step(self) -> int:
        return self.stride

    @endpoint
    async def reset(self) -> None:
        self.value = 0


async def main() -> None:
    procs = this_host().spawn_procs(per_host={"procs": 2})
    plain = procs.spawn("plain", Counter)
    skip = procs.spawn("skip", SkipCounter, 5)
    print("plain:", list((await plain.tick.call(3)).values()))
    print("skip:", list((await skip.tick.call(3)).values()))
    await skip.reset.call()
    print("skip after reset:", list((await skip.tick.call()).values()))
    await procs.stop()


if __name__ == "__main__":
    asyncio.run(main())
