"""Worker output: lines per second written to the worker's own descriptor vs streamed to the controller.

    python benchmarks/bench_logs.py [--lines 20000] [--repeat 3]

One worker prints ``--lines`` lines. *direct* (the default, before any
``logging_option``): the call returns once every line was written and
flushed to the worker's stdout (``/dev/null`` here). *streamed*
(``logging_option(stream_to_client=True, aggregate_window_sec=None)``):
until the controller printed the last line on its ``sys.stdout``.
*aggregated* (a 60 s window, ended by the next ``logging_option``): until the
controller printed every line, counting a ``[N similar log lines]`` line as N
(lines still on their way when the window ends are printed alone). The baseline is
*direct*; streamed and aggregated are given as its multiple.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import sys
import time

from actors import Actor, ProcMesh, endpoint, this_host


class Chatty(Actor):
    @endpoint
    async def say(self, lines: int) -> None:
        for i in range(lines):
            print(f"step {i} loss 0.{i % 97}")


_GROUP = re.compile(r"\[(\d+) similar log lines\]")


class Counter:
    """The controller's ``sys.stdout`` while measuring: counts lines, wakes the waiter at the target."""

    def __init__(self) -> None:
        self.lines = 0
        self.target = -1
        self.reached = asyncio.Event()

    def write(self, text: str) -> int:
        for line in text.splitlines():
            group = _GROUP.match(line)
            self.lines += int(group.group(1)) if group else 1  # an aggregated line stands for N
        if self.lines >= self.target >= 0:
            self.reached.set()
        return len(text)

    def flush(self) -> None:
        pass

    def expect(self, lines: int) -> None:
        self.lines, self.target = 0, lines
        self.reached.clear()


async def one_round(procs: ProcMesh, chatty: Chatty, counter: Counter, mode: str, lines: int) -> float:
    if mode == "direct":
        await procs.logging_option(stream_to_client=False)
        start = time.perf_counter()
        await chatty.say.call_one(lines)
        return time.perf_counter() - start
    window = None if mode == "streamed" else 60
    await procs.logging_option(stream_to_client=True, aggregate_window_sec=window)
    counter.expect(lines)  # every line accounted for, whether printed alone or inside a group
    start = time.perf_counter()
    await chatty.say.call_one(lines)
    if mode == "aggregated":
        await procs.logging_option(stream_to_client=True, aggregate_window_sec=None)  # prints what is held
    await asyncio.wait_for(counter.reached.wait(), timeout=120)
    return time.perf_counter() - start


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=20000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    report = os.fdopen(os.dup(1), "w", buffering=1)  # the terminal, before fd 1 goes to /dev/null
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # the forkserver and its workers inherit this: direct lines cost a write, not a terminal
    counter = Counter()
    sys.stdout = counter  # type: ignore[assignment]
    procs = this_host().spawn_procs(per_host={"procs": 1})
    chatty = procs.spawn("chatty", Chatty)
    await chatty.say.call_one(100)  # warm up
    seconds: dict[str, list[float]] = {"direct": [], "streamed": [], "aggregated": []}
    for _ in range(args.repeat):
        for mode in seconds:
            seconds[mode].append(await one_round(procs, chatty, counter, mode, args.lines))
    await procs.stop()
    rate = {mode: args.lines / statistics.median(s) for mode, s in seconds.items()}
    for mode, lines_per_s in rate.items():
        ratio = lines_per_s / rate["direct"]
        report.write(f"{mode:10s} {lines_per_s:12,.0f} lines/s  ({ratio:.2f}x direct)\n")
    result = {
        "bench": "logs",
        "lines": args.lines,
        "repeat": args.repeat,
        **{f"{m}_lines_per_s": r for m, r in rate.items()},
    }
    report.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    asyncio.run(main())
