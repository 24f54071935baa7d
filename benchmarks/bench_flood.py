"""A sender's loop while it floods a receiver that stopped reading: the worst heartbeat gap, the collector's pauses.

    python benchmarks/bench_flood.py [--floats 1 256] [--repeat 3]

This process floods a port whose receiver (an actor in another process)
never reads, until the backlog's bound refuses (``BufferFull``: 262,144
messages or 256 MiB held back), yielding to its loop every 500 sends, with
a 1 ms heartbeat task on the same loop; then it runs one full garbage
collection with the backlog full (the startup heap frozen first, as a
long-running service does, and a full collection before the flood timed
too). Per payload (a dataclass of a sequence
number and a float32 tensor of ``--floats`` elements), medians over
``--repeat`` floods: the worst gap between beats, the longest collection
meanwhile, and that full collection's pause. The baseline, measured in the
same run, is the same heartbeat over an idle loop for as long. One JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import time
from dataclasses import dataclass

import torch
import uvloop

from actors import Actor, BufferFull, Channel, Port, endpoint, this_host


@dataclass
class Item:
    seq: int
    payload: torch.Tensor


class Stalled(Actor):
    """Opens a port and never reads it."""

    def __init__(self) -> None:
        self.port, self.inbox = Channel.open(Item)

    @endpoint
    async def inlet(self) -> Port[Item]:
        return self.port


class Pauses:
    """The loop's worst gap between 1 ms beats, and the garbage collector's pauses, while it is entered."""

    def __init__(self) -> None:
        self.worst = 0.0
        self.collections: list[float] = []
        self._started = 0.0

    def _gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.collections.append(time.perf_counter() - self._started)

    async def _beat(self) -> None:
        last = time.perf_counter()
        while True:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            self.worst = max(self.worst, now - last)
            last = now

    async def __aenter__(self) -> Pauses:
        gc.callbacks.append(self._gc)
        self._task = asyncio.ensure_future(self._beat())
        await asyncio.sleep(0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._task.cancel()
        gc.callbacks.remove(self._gc)


async def flood(floats: int) -> dict[str, float]:
    procs = this_host().spawn_procs(per_host={"procs": 1})
    try:
        inlet = await procs.spawn("stalled", Stalled).slice(procs=0).inlet.call_one()
        payload = torch.zeros(floats)
        gc.collect()
        gc.freeze()  # the startup heap (torch's modules), as a long-running service freezes it
        empty = time.perf_counter()
        gc.collect()
        empty_s = time.perf_counter() - empty
        sent = 0
        started = time.perf_counter()
        async with Pauses() as during:
            try:
                while True:
                    inlet.send(Item(sent, payload))
                    sent += 1
                    if sent % 500 == 0:
                        await asyncio.sleep(0)
            except BufferFull:
                pass
        seconds = time.perf_counter() - started
        full = time.perf_counter()
        gc.collect()
        full_s = time.perf_counter() - full
        async with Pauses() as idle:  # the baseline: the same beat on an idle loop, as long
            await asyncio.sleep(seconds)
    finally:
        await procs.stop()
        gc.unfreeze()
    return {
        "sent": sent,
        "flood_s": seconds,
        "worst_gap_ms": during.worst * 1000,
        "longest_collection_ms": max(during.collections, default=0.0) * 1000,
        "full_collection_ms": full_s * 1000,
        "empty_full_collection_ms": empty_s * 1000,
        "idle_worst_gap_ms": idle.worst * 1000,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--floats", type=int, nargs="+", default=[1, 256])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    if args.repeat < 1 or min(args.floats) < 1:
        parser.error(f"--repeat and --floats must be 1 or more, not {args.repeat} and {args.floats}")
    record: dict[str, object] = {"bench": "flood", "repeat": args.repeat}
    for floats in args.floats:
        runs = [uvloop.run(flood(floats)) for _ in range(args.repeat)]
        median = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
        ratio = median["worst_gap_ms"] / max(median["idle_worst_gap_ms"], 1e-9)
        print(
            f"{floats:6d} floats: {median['sent']:.0f} messages held back in {median['flood_s']:.1f} s; worst gap "
            f"{median['worst_gap_ms']:.1f} ms ({ratio:.1f}x the idle loop's {median['idle_worst_gap_ms']:.1f} ms), "
            f"longest collection {median['longest_collection_ms']:.1f} ms, a full collection with the backlog full "
            f"{median['full_collection_ms']:.1f} ms (empty: {median['empty_full_collection_ms']:.1f} ms)"
        )
        record[f"floats_{floats}"] = {key: round(value, 2) for key, value in median.items()} | {
            "gap_ratio_to_idle": round(ratio, 2)
        }
    print(json.dumps(record))


if __name__ == "__main__":
    main()
