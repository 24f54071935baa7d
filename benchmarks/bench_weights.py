"""Weight sync: publish -> installed in another process, against one plain memcpy.

    python benchmarks/bench_weights.py --transport shm --mb 1024 [--json] [--updates 5]
    python benchmarks/bench_weights.py --transport local --mb 1024
    python benchmarks/bench_weights.py --transport cuda-ipc --mb 1024   # "blocked" without CUDA

The publisher is this process; the consumer is an actor in another process
(in this process for ``local``, which cannot cross processes). Each update is
timed from the start of ``publish`` to the end of ``install`` in the consumer
(one clock: CLOCK_MONOTONIC). ``memcpy_ms`` is one ``copy_`` of the same
bytes between two warm buffers, sampled before each measured update (median). Every copy, baseline
included, runs with one torch thread. Steady state: the first updates (which
write fresh shared-memory pages) are warm-up and not counted.
``--install alias`` measures the zero-copy install (the module's parameters
view the shared slot). Target (issue 3): ratio <= 2.0 for 1 GiB over shm.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

import torch

from actors import Actor, WeightConsumer, WeightManifest, WeightPublisher, endpoint, this_host
from actors.tensors import probe


def make_state(total_mb: int, count: int) -> dict[str, torch.Tensor]:
    per = total_mb * 1024 * 1024 // 4 // count
    return {f"w{i}": torch.full((per,), float(i)) for i in range(count)}


class Holder(torch.nn.Module):
    """A module whose parameters match ``make_state``'s names and shapes."""

    def __init__(self, total_mb: int, count: int) -> None:
        super().__init__()
        for name, tensor in make_state(total_mb, count).items():
            self.register_parameter(name, torch.nn.Parameter(torch.zeros_like(tensor), requires_grad=False))


ALIASED: list[str] = []  # the update an aliased module currently views (one consumer per process)


class Installer(Actor):
    def __init__(self, total_mb: int, count: int) -> None:
        torch.set_num_threads(1)
        self.model = Holder(total_mb, count)
        self.consumer = WeightConsumer(verify_checksums=False)

    @endpoint
    async def install(self, manifest: WeightManifest, alias: bool) -> dict[str, float]:
        return install(self.consumer, self.model, manifest, alias)

    async def __cleanup__(self, exc: BaseException | None) -> None:
        self.consumer.close()


def install(
    consumer: WeightConsumer, model: torch.nn.Module, manifest: WeightManifest, alias: bool
) -> dict[str, float]:
    """import -> load (one copy, or none with alias) -> acknowledge -> release, each timed."""
    t0 = time.perf_counter()
    tensors = consumer.import_update(manifest)
    t1 = time.perf_counter()
    with torch.no_grad():
        model.load_state_dict(tensors, assign=alias)
    t2 = time.perf_counter()
    consumer.acknowledge(manifest.update_id)
    t3 = time.perf_counter()
    if alias:  # the module keeps viewing this update: release the one it viewed before
        if ALIASED:
            consumer.release(ALIASED.pop())
        ALIASED.append(manifest.update_id)
    else:
        consumer.release(manifest.update_id)
    t4 = time.perf_counter()
    return {"import": t1 - t0, "install": t2 - t1, "ack": t3 - t2, "release": t4 - t3, "done_at": t3}


class Memcpy:
    """One plain copy of ``total_mb`` between two warm buffers, sampled through the run."""

    def __init__(self, total_mb: int) -> None:
        self.src = torch.ones(total_mb * 1024 * 1024 // 4)
        self.dst = torch.empty_like(self.src)
        self.dst.copy_(self.src)  # fault both buffers in
        self.samples: list[float] = []

    def sample(self) -> None:
        start = time.perf_counter()
        self.dst.copy_(self.src)
        self.samples.append(time.perf_counter() - start)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    state = make_state(args.mb, args.tensors)
    total = sum(t.numel() * 4 for t in state.values())
    memcpy = Memcpy(args.mb)
    procs = None
    if args.transport == "local":
        model, consumer = Holder(args.mb, args.tensors), WeightConsumer(verify_checksums=False)

        async def do_install(manifest: WeightManifest) -> dict[str, float]:
            return install(consumer, model, manifest, args.install == "alias")
    else:
        procs = this_host().spawn_procs(per_host={"procs": 1})
        installer = procs.spawn("installer", Installer, args.mb, args.tensors)

        async def do_install(manifest: WeightManifest) -> dict[str, float]:
            return await installer.install.call_one(manifest, args.install == "alias")

    rows = []
    with WeightPublisher(args.transport, **({"slots": args.slots} if args.transport == "shm" else {})) as publisher:
        for version in range(1, args.warmup + args.updates + 1):
            if version > args.warmup:
                memcpy.sample()  # interleaved: the baseline sees the same machine state
            start = time.perf_counter()
            manifest = publisher.publish(state, version)
            published = time.perf_counter()
            timings = await do_install(manifest)
            publisher.release(manifest.update_id)
            released = time.perf_counter()
            if version > args.warmup:
                rows.append(
                    {
                        "publish": published - start,
                        "total": timings["done_at"] - start,
                        "publisher_release": released - timings["done_at"],
                        **timings,
                    }
                )
    if procs is not None:
        await procs.stop()
    memcpy_ms = statistics.median(memcpy.samples) * 1000

    def med(key: str) -> float:
        return statistics.median(row[key] for row in rows) * 1000

    total_ms = med("total")
    return {
        "transport": args.transport,
        "status": "pass",
        "tensor_count": len(state),
        "total_nbytes": total,
        "updates_measured": len(rows),
        "publish_ms": round(med("publish"), 2),
        "import_ms": round(med("import"), 2),
        "install_ms": round(med("install"), 2),
        "ack_ms": round(med("ack"), 3),
        "release_ms": round(med("release"), 3),
        "publish_to_installed_ms": round(total_ms, 2),
        "memcpy_ms": round(memcpy_ms, 2),
        "ratio": round(total_ms / memcpy_ms, 3),
        "gb_per_s": round(total / (total_ms / 1000) / 1e9, 2),
        "install_mode": args.install,
        "threads": 1,
        "target_ratio": "<= 2.0 (shm, 1 GiB)",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transport", choices=["shm", "local", "cuda-ipc"], default="shm")
    parser.add_argument("--mb", type=int, default=1024, help="total size of the state_dict in MiB")
    parser.add_argument("--tensors", type=int, default=16)
    parser.add_argument("--updates", type=int, default=5, help="measured updates (after warm-up)")
    parser.add_argument("--warmup", type=int, default=2, help="updates not measured (fresh pages)")
    parser.add_argument("--slots", type=int, default=3, help="shm pool size (an aliasing consumer holds one)")
    parser.add_argument(
        "--install",
        choices=["copy", "alias"],
        default="copy",
        help="copy into the module (default) or alias its parameters to the shared storage (zero-copy)",
    )
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    args = parser.parse_args()
    reason = probe(args.transport)
    if reason is not None:
        result: dict[str, Any] = {"transport": args.transport, "status": "blocked", "reason": reason}
    else:
        result = asyncio.run(run(args))
        if not args.json:
            print(
                f"{args.transport}: {result['total_nbytes'] / 2**20:.0f} MiB in {result['tensor_count']} tensors | "
                f"publish {result['publish_ms']} ms, import {result['import_ms']} ms, install {result['install_ms']} ms, "
                f"ack {result['ack_ms']} ms, release {result['release_ms']} ms | publish->installed "
                f"{result['publish_to_installed_ms']} ms = {result['ratio']} x memcpy {result['memcpy_ms']} ms"
            )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
