"""Restart time: ``kill -9`` of an actor process until its restarted instance answers a call.

    python benchmarks/bench_restart.py [--repeat 7]

A proc mesh with ``restart="on-failure"`` hosts one actor; each repetition
kills it and times (a) until the in-flight call fails with ``ActorDied`` and
(b) until a new call is answered by the new process, constructed again with
its original arguments. The baseline, measured in the same run, is a warm
``spawn_procs`` + ``spawn`` + first call: the same work without a death.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import time

from actors import Actor, ActorDied, endpoint, this_host


class Probe(Actor):
    def __init__(self, offset: int) -> None:
        self.offset = offset

    @endpoint
    async def pid(self) -> int:
        return os.getpid()

    @endpoint
    async def add(self, x: int) -> int:
        return x + self.offset

    @endpoint
    async def sleep(self) -> None:
        await asyncio.sleep(3600)


async def main(repeat: int) -> None:
    procs = this_host().spawn_procs(per_host={"procs": 1}, restart="on-failure", max_restarts=repeat + 1)
    probe = procs.spawn("probe", Probe, 7)
    await probe.add.call_one(0)
    detect, restart, fresh = [], [], []
    for _ in range(repeat):
        pid = await probe.pid.call_one()
        in_flight = probe.sleep.call_one()
        start = time.perf_counter()
        os.kill(pid, signal.SIGKILL)
        try:
            await in_flight
        except ActorDied:
            detect.append(time.perf_counter() - start)
        assert await probe.add.call_one(1) == 8
        restart.append(time.perf_counter() - start)
        t = time.perf_counter()
        other = this_host().spawn_procs(per_host={"procs": 1})
        assert await other.spawn("probe", Probe, 7).add.call_one(1) == 8
        fresh.append(time.perf_counter() - t)
        await other.stop()
        print(
            f"death seen {detect[-1] * 1000:.1f} ms, restarted instance answers {restart[-1] * 1000:.0f} ms "
            f"| raw warm spawn + first call {fresh[-1] * 1000:.0f} ms"
        )
    await procs.stop()
    d, r, f = (statistics.median(x) for x in (detect, restart, fresh))
    print(
        f"median: death seen {d * 1000:.1f} ms, answering again {r * 1000:.0f} ms; ratio restart / fresh spawn = {r / f:.2f}"
    )
    print(
        json.dumps(
            {
                "bench": "restart",
                "repeat": repeat,
                "death_seen_ms": round(d * 1000, 2),
                "restart_answers_ms": round(r * 1000, 1),
                "raw_fresh_spawn_ms": round(f * 1000, 1),
                "ratio": round(r / f, 2),
            }
        )
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=7)
    asyncio.run(main(parser.parse_args().repeat))
