"""Supervision in a few lines: a worker crashes, is restarted, and a stuck call times out.

python examples/supervised_workers.py
"""

from __future__ import annotations

import asyncio
import os
import time

from actors import Actor, ActorDied, CallTimeout, Failure, endpoint, this_host


class Worker(Actor):
    def __init__(self, greeting: str) -> None:
        self.greeting = greeting  # given again to the restarted instance

    @endpoint
    async def hello(self) -> str:
        return f"{self.greeting} from pid {os.getpid()}"

    @endpoint
    async def crash(self) -> None:
        os._exit(3)  # the process dies mid-call

    @endpoint
    async def stuck(self, seconds: float) -> None:
        time.sleep(seconds)  # a synchronous call that freezes this actor's event loop


def on_failure(failure: Failure) -> bool:
    print(f"supervisor: {failure}")
    return True  # handled: the mesh stays usable


async def main() -> None:
    procs = this_host().spawn_procs(per_host={"procs": 2}, restart="on-failure", max_restarts=2, restart_period=60)
    procs.add_failure_handler(on_failure)
    workers = procs.spawn("worker", Worker, "hello")
    first = workers.slice(procs=0)
    print(await first.hello.call_one())
    try:
        await first.crash.call_one()
    except ActorDied as exc:
        print(f"in-flight call: ActorDied ({exc})")
    print(f"after the restart: {await first.hello.call_one()}  (restarts per rank: {procs.restarts})")

    second = workers.slice(procs=1)
    second.stuck.call_one(2.0)  # on the wire at once; we do not wait for it
    try:
        await second.hello.with_timeout(0.5).call_one()
    except CallTimeout as exc:
        print(f"deadline: {exc}")
    print(f"the other worker is fine: {await first.hello.call_one()}")
    await procs.stop()


if __name__ == "__main__":
    asyncio.run(main())
