"""Spawn time: 7 actors from a cold controller until every one answers a call.

    python benchmarks/bench_spawn.py [--repeat 3] [--actors 7]

Each repetition is a fresh controller process, so the forkserver starts cold
(its torch import included). "cold" is timed from ``spawn_procs()``; the
figure with the controller's own imports is printed beside it. The baseline is the cold start of one Python process
that imports torch, measured in the same run. Target (issue 2): <= 3 s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

CHILD = """
import asyncio, sys, time
start = time.perf_counter()
from actors import Actor, endpoint, this_host

class Ready(Actor):
    @endpoint
    async def ready(self) -> bool:
        return True

async def main(n):
    imported = time.perf_counter()
    procs = this_host().spawn_procs(per_host={"procs": n})
    mesh = procs.spawn("ready", Ready)
    assert all((await mesh.ready.call()).values())
    cold = time.perf_counter() - imported
    with_import = time.perf_counter() - start
    t = time.perf_counter()
    more = this_host().spawn_procs(per_host={"procs": n})
    assert all((await more.spawn("ready", Ready).ready.call()).values())
    warm = time.perf_counter() - t
    t = time.perf_counter()
    await procs.stop()
    await more.stop()
    print(cold, with_import, warm, time.perf_counter() - t)

if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1])))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--actors", type=int, default=7)
    args = parser.parse_args()
    colds, imports, warms, stops, torch_starts = [], [], [], [], []
    script = os.path.join(tempfile.mkdtemp(prefix="bench-spawn-"), "spawn_child.py")
    with open(script, "w") as f:
        f.write(CHILD)
    for _ in range(args.repeat):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import torch"], check=True)
        torch_starts.append(time.perf_counter() - start)
        out = subprocess.run([sys.executable, script, str(args.actors)], check=True, capture_output=True, text=True)
        cold, with_import, warm, stop = map(float, out.stdout.split()[-4:])
        colds.append(cold)
        imports.append(with_import)
        warms.append(warm)
        stops.append(stop)
        print(
            f"{args.actors} actors ready: cold {cold:.2f} s from spawn_procs ({with_import:.2f} s with the "
            f"controller's own imports), warm {warm * 1000:.0f} ms; stop {stop * 1000:.0f} ms | "
            f"raw python+torch start {torch_starts[-1]:.2f} s"
        )
    cold, with_import, warm, stop, raw = (statistics.median(x) for x in (colds, imports, warms, stops, torch_starts))
    print(
        f"median: cold {cold:.2f} s from spawn_procs (target <= 3 s; {with_import:.2f} s with imports), "
        f"warm {warm * 1000:.0f} ms, stop {stop * 1000:.0f} ms; ratio cold / one torch process start = {cold / raw:.2f}"
    )
    print(
        json.dumps(
            {
                "bench": "spawn",
                "actors": args.actors,
                "cold_s": round(cold, 3),
                "cold_with_imports_s": round(with_import, 3),
                "warm_s": round(warm, 3),
                "stop_s": round(stop, 3),
                "raw_torch_process_start_s": round(raw, 3),
                "ratio": round(cold / raw, 2),
                "target_cold_s": "<= 3",
            }
        )
    )


if __name__ == "__main__":
    main()
