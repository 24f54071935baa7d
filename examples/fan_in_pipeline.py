"""Fan-in pipeline: N producers feed one typed port; a consumer stops on the sentinels.

    python examples/fan_in_pipeline.py

Each producer sends its readings, then ``None``; the consumer stage sums
them and forwards one total per producer, then its own ``None`` downstream.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import torch

from actors import Actor, Channel, Port, current_rank, endpoint, this_host


@dataclass
class Reading:
    producer: int
    values: torch.Tensor


@dataclass
class Total:
    producer: int
    total: float


class Producer(Actor):
    @endpoint
    async def run(self, out: Port[Reading], batches: int) -> None:
        me = current_rank().rank
        for step in range(batches):
            out.send(Reading(me, torch.full((8,), float(step))))
        out.send(None)  # end of this producer's stream


class Summer(Actor):
    def __init__(self) -> None:
        self.port, self.inbox = Channel.open(Reading)

    @endpoint
    async def inlet(self) -> Port[Reading]:
        return self.port

    @endpoint
    async def run(self, producers: int, out: Port[Total]) -> None:
        totals = [0.0] * producers
        finished = 0
        while finished < producers:
            reading = await self.inbox.recv()
            if reading is None:
                finished += 1
                continue
            totals[reading.producer] += float(reading.values.sum())
        for producer, total in enumerate(totals):
            out.send(Total(producer, total))
        out.send(None)


async def main(producers: int = 3, batches: int = 100) -> None:
    producer_procs = this_host().spawn_procs(per_host={"procs": producers}, name="producers")
    summer_procs = this_host().spawn_procs(per_host={"procs": 1}, name="summer")
    summer = summer_procs.spawn("summer", Summer)
    inlet = await summer.inlet.call_one()
    totals_port, totals = Channel.open(Total)
    summing = summer.run.call_one(producers, totals_port)  # dispatched now, awaited later
    producing = producer_procs.spawn("producer", Producer).run.call(inlet, batches)
    while (total := await totals.recv()) is not None:
        print(f"producer {total.producer}: total {total.total:.0f}")
    await producing
    await summing
    expected = 8 * sum(range(batches))
    print(f"expected per producer: {expected}")
    await producer_procs.stop()
    await summer_procs.stop()


if __name__ == "__main__":
    asyncio.run(main())
