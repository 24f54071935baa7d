"""Ping-pong: two actors in two processes bounce a counter through each other.

python examples/ping_pong.py
"""

from __future__ import annotations

import asyncio
import os
import time

from actors import Actor, endpoint, this_host


class Player(Actor):
    def __init__(self, name: str) -> None:
        self.name = name

    @endpoint
    async def hit(self, count: int) -> str:
        return f"{self.name} (pid {os.getpid()}) returns ball {count}"

    @endpoint
    async def rally(self, partner: Player, rounds: int) -> int:
        """Hit the ball to ``partner`` ``rounds`` times; the partner is another actor."""
        for count in range(rounds):
            await partner.hit.call_one(count)
        return rounds


async def main() -> None:
    procs = this_host().spawn_procs(per_host={"procs": 2}, name="court")
    ping = procs.spawn("ping", Player, "ping").slice(procs=0)
    pong = procs.spawn("pong", Player, "pong").slice(procs=1)
    print(await ping.hit.call_one(0))
    print(await pong.hit.call_one(1))
    start = time.perf_counter()
    rounds = await ping.rally.call_one(pong, 1000)
    elapsed = time.perf_counter() - start
    print(f"{rounds} actor-to-actor round trips in {elapsed:.2f}s ({elapsed / rounds * 1e6:.0f} us each)")
    await procs.stop()


if __name__ == "__main__":
    asyncio.run(main())
