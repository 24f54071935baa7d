"""Endpoint round trip: ``call_one`` p50 against a raw blocking DEALER/ROUTER round trip.

    python benchmarks/bench_calls.py [--rounds 5000] [--repeat 3] [--loop uvloop|asyncio|none]

Target (issue 11): call_one p50 <= 3x the raw round trip measured in this run.
``--loop none`` measures a synchronous program (``call_one(i).get()``, the
runtime on its background loop: two thread hand-offs per call).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

from _raw import dealer_router_rtt

from actors import Actor, endpoint, this_host


class Pong(Actor):
    @endpoint
    async def ping(self, x: int) -> int:
        return x


async def measure(rounds: int) -> list[float]:
    procs = this_host().spawn_procs(per_host={"procs": 1})
    pong = procs.spawn("pong", Pong)
    for i in range(500):
        await pong.ping.call_one(i)
    samples = []
    for i in range(rounds):
        start = time.perf_counter()
        await pong.ping.call_one(i)
        samples.append(time.perf_counter() - start)
    await procs.stop()
    return samples


def measure_sync(rounds: int) -> list[float]:
    procs = this_host().spawn_procs(per_host={"procs": 1})
    pong = procs.spawn("pong", Pong)
    for i in range(500):
        pong.ping.call_one(i).get()
    samples = []
    for i in range(rounds):
        start = time.perf_counter()
        pong.ping.call_one(i).get()
        samples.append(time.perf_counter() - start)
    procs.stop().get()
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--loop", choices=["uvloop", "asyncio", "none"], default="uvloop")
    args = parser.parse_args()
    if args.loop == "uvloop":
        import uvloop

        run = uvloop.run
    else:
        run = asyncio.run
    ours, raw = [], []
    for _ in range(args.repeat):
        raw.append(statistics.median(dealer_router_rtt(args.rounds)) * 1e6)
        samples = measure_sync(args.rounds) if args.loop == "none" else run(measure(args.rounds))
        ours.append(statistics.median(samples) * 1e6)
        p99 = sorted(samples)[int(len(samples) * 0.99)] * 1e6
        print(f"call_one p50 {ours[-1]:7.1f} us  p99 {p99:7.1f} us | raw DEALER/ROUTER p50 {raw[-1]:6.1f} us")
    ours_med, raw_med = statistics.median(ours), statistics.median(raw)
    ratio = ours_med / raw_med
    print(
        f"median over {args.repeat} runs: call_one {ours_med:.1f} us, raw {raw_med:.1f} us, ratio {ratio:.2f} (target <= 3)"
    )
    print(
        json.dumps(
            {
                "bench": "call_one_rtt",
                "loop": args.loop,
                "call_one_p50_us": round(ours_med, 1),
                "raw_dealer_router_p50_us": round(raw_med, 1),
                "ratio": round(ratio, 2),
                "target": "<= 3",
            }
        )
    )


if __name__ == "__main__":
    main()
