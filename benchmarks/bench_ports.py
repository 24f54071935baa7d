"""One-way port throughput between two actor processes, against raw PUSH/PULL.

    python benchmarks/bench_ports.py [--count 200000] [--repeat 3]

Two payloads: a tuple of 4 floats (compared with blocking PUSH/PULL of the
same msgpack bytes, both timed first send -> last receive) and a dataclass
holding three small tensors. The sender sends and awaits ``port.drain()``
after each message (it returns at once while the window has room), the
loop-friendly way to outrun a receiver. Targets (issue 11): ratio >= 0.5;
>= 50k tensor-dataclass messages/s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass

import msgpack
import torch
import uvloop
from _raw import push_pull_rate

from actors import Actor, Channel, Port, endpoint, this_host


@dataclass
class Sample:
    obs: torch.Tensor
    action: torch.Tensor
    reward: torch.Tensor


SMALL = (0.25, 0.5, 0.75, 1.0)


class Sender(Actor):
    @endpoint
    async def blast(self, port: Port, count: int, kind: str) -> float:
        if kind == "tuple":
            message: object = SMALL
        else:
            message = Sample(torch.zeros(4), torch.zeros(1, dtype=torch.int64), torch.zeros(1))
        first = time.perf_counter()
        for _ in range(count):
            port.send(message)
            await port.drain()  # returns at once while the window has room
        port.send(None)
        return first


class Receiver(Actor):
    def __init__(self) -> None:
        self.port, self.inbox = Channel.open()

    @endpoint
    async def inlet(self) -> Port:
        return self.port

    @endpoint
    async def drain(self) -> tuple[int, float]:
        n = 0
        recv = self.inbox.recv
        while (await recv()) is not None:
            n += 1
        return n, time.perf_counter()


async def measure(count: int, kind: str) -> float:
    procs = this_host().spawn_procs(per_host={"procs": 2})
    sender = procs.spawn("sender", Sender).slice(procs=0)
    receiver = procs.spawn("receiver", Receiver).slice(procs=1)
    inlet = await receiver.inlet.call_one()
    done = receiver.drain.call_one()
    first = await sender.blast.call_one(inlet, count, kind)
    n, last = await done
    assert n == count, (n, count)
    await procs.stop()
    return count / (last - first)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=200_000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    raw_rates, tuple_rates, tensor_rates = [], [], []
    message = msgpack.packb(SMALL)
    for _ in range(args.repeat):
        raw_rates.append(push_pull_rate(message, args.count))
        tuple_rates.append(uvloop.run(measure(args.count, "tuple")))
        tensor_rates.append(uvloop.run(measure(args.count // 4, "tensors")))
        print(
            f"port tuple {tuple_rates[-1]:9,.0f} msg/s | raw PUSH/PULL {raw_rates[-1]:9,.0f} msg/s | "
            f"dataclass of 3 tensors {tensor_rates[-1]:8,.0f} msg/s"
        )
    raw, ours, tensors = (statistics.median(x) for x in (raw_rates, tuple_rates, tensor_rates))
    ratio = ours / raw
    print(
        f"median over {args.repeat} runs: tuple {ours:,.0f} msg/s = {ratio:.2f} x raw {raw:,.0f} (target >= 0.5); "
        f"3-tensor dataclass {tensors:,.0f} msg/s (target >= 50,000)"
    )
    print(
        json.dumps(
            {
                "bench": "port_throughput",
                "tuple_msgs_per_s": round(ours),
                "raw_push_pull_msgs_per_s": round(raw),
                "ratio": round(ratio, 3),
                "tensor_dataclass_msgs_per_s": round(tensors),
                "target_ratio": ">= 0.5",
                "target_tensor_dataclass": ">= 50000",
            }
        )
    )


if __name__ == "__main__":
    main()
