"""Weight sync: trainer publish -> installed in another process, against one plain copy of the same bytes.

    python benchmarks/bench_weights.py --transport shm --mb 1024 [--install copy alias] [--json]
    python benchmarks/bench_weights.py --transport cuda-ipc --device cuda --mb 64 1024 4096 \\
        --dtype float32 bfloat16 --install alias copy
    python benchmarks/bench_weights.py --transport local --mb 1024
    python benchmarks/bench_weights.py --transport shm --mb 8 --layers 48 --install copy alias   # fixed costs

The publisher is this process (the trainer); the consumer is an actor in
another process (in this process for ``local``, which cannot cross
processes). The state_dict is shaped like a transformer's (embedding, then
per layer qkv, out, mlp up and down, two norms: many tensors, not one blob),
on ``--device``. Each update is timed from the start of ``publish`` to the
end of the install in the consumer, including the consumer's stream
finishing its copy (one clock: CLOCK_MONOTONIC). ``trainer_stall_ms`` is
how long ``publish`` keeps the trainer's thread; ``call_ms`` from its return
to the consumer's endpoint starting (the manifest's trip between the
processes); then ``import``, ``install`` (with the wait for the bytes), ``ack``. The baseline, measured in
the same run and interleaved with the updates, is one copy of the same
tensors into a second set: ``copy_`` on the CPU (one torch thread), a
device-to-device multi-tensor copy timed with CUDA events on a GPU. The
first updates touch fresh memory and are not counted.

With ``--profile``, each row publishes 5 more updates with ``publish``
under cProfile and ``torch.profiler``: the Python functions and the torch
operators or CUDA runtime calls that took the trainer's stall, per update;
and the consumer's installs under cProfile in its process (its waits for
the GPU show as the synchronize or event calls that hold them).

Targets: shm at 1 GiB <= 2.0x the copy (copy install) and alias; cuda-ipc
at 1 GiB alias <= 1.5x, copy <= 2.5x, trainer stall <= 1x; cuda-ipc 64 MiB
<= 3x.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

import torch

from actors import Actor, WeightConsumer, WeightManifest, WeightPublisher, endpoint, this_host
from actors.tensors import copy_all, probe

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def model_shapes(total_mb: int, dtype: torch.dtype, layers: int | None = None) -> dict[str, tuple[int, ...]]:
    """Names and shapes of a transformer-like state_dict of about ``total_mb`` MiB (``layers`` of 6 tensors each:
    the width follows; by default the layers follow the width)."""
    elements = total_mb * 2**20 // dtype.itemsize
    given = layers
    layers = given or (24 if total_mb >= 256 else 8)
    width = max(64, round(math.sqrt(elements / (12 * layers + 8)) / 64) * 64)
    if given is None:
        layers = max(1, round((elements - 8 * width * width) / (12 * width * width)))
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (8 * width, width)}
    for layer in range(layers):
        prefix = f"layers.{layer}."
        shapes[prefix + "attn.qkv.weight"] = (3 * width, width)
        shapes[prefix + "attn.out.weight"] = (width, width)
        shapes[prefix + "mlp.up.weight"] = (4 * width, width)
        shapes[prefix + "mlp.down.weight"] = (width, 4 * width)
        shapes[prefix + "norm1.weight"] = (width,)
        shapes[prefix + "norm2.weight"] = (width,)
    return shapes


def make_state(shapes: dict[str, tuple[int, ...]], dtype: torch.dtype, device: str, value: float) -> dict[str, Any]:
    return {name: torch.full(shape, value, dtype=dtype, device=device) for name, shape in shapes.items()}


class Holder(torch.nn.Module):
    """A module with one parameter per state_dict entry (names flattened)."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype, device: str) -> None:
        super().__init__()
        for name, shape in shapes.items():
            self.register_parameter(
                name.replace(".", "_"),
                torch.nn.Parameter(torch.zeros(shape, dtype=dtype, device=device), requires_grad=False),
            )


def flat(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name.replace(".", "_"): tensor for name, tensor in state.items()}


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.current_stream().synchronize()


class Installing:
    """The consumer's side: import -> install (one copy, or none with alias) -> acknowledge -> release."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], dtype: str, device: str) -> None:
        torch.set_num_threads(1)
        self.device = device
        self.model = Holder(shapes, DTYPES[dtype], device)
        self.consumer = WeightConsumer(verify_checksums=False)
        self.aliased: str | None = None
        self.profiler: Any = None  # a cProfile.Profile over the profiled installs (``--profile``)

    def install(self, manifest: WeightManifest, alias: bool, profiled: bool = False) -> dict[str, float]:
        if not profiled:
            return self._install(manifest, alias)
        if self.profiler is None:
            import cProfile

            self.profiler = cProfile.Profile()
        self.profiler.enable()
        try:
            return self._install(manifest, alias)
        finally:
            self.profiler.disable()

    def hotspots(self, count: int, updates: int) -> list[dict[str, Any]]:
        """Where the profiled installs spent this process's time, per update."""
        from _profile import python_hotspots

        return python_hotspots(self.profiler, count, updates) if self.profiler is not None else []

    def _install(self, manifest: WeightManifest, alias: bool) -> dict[str, float]:
        t0 = time.perf_counter()
        tensors = flat(self.consumer.import_update(manifest))
        t1 = time.perf_counter()
        with torch.no_grad():
            params = dict(self.model.named_parameters())
            if alias:  # as WeightConsumer.install(alias=True) does: each parameter takes the slot's storage
                for name, tensor in tensors.items():
                    params[name].data = tensor
            else:
                copy_all([params[name] for name in tensors], list(tensors.values()))
        synchronize(self.device)  # installed means the bytes are in place on the device
        t2 = time.perf_counter()
        self.consumer.acknowledge(manifest.update_id)
        done = time.perf_counter()
        if alias:  # the module keeps viewing this update: release the one it viewed before
            if self.aliased is not None:
                self.consumer.release(self.aliased)
            self.aliased = manifest.update_id
        else:
            self.consumer.release(manifest.update_id)
        release = time.perf_counter() - done
        return {
            "import": t1 - t0,
            "install": t2 - t1,
            "ack": done - t2,
            "release": release,
            "arrived_at": t0,
            "done_at": done,
        }

    def close(self) -> None:
        self.consumer.close()


class Installer(Actor):
    def __init__(self, shapes: dict[str, tuple[int, ...]], dtype: str, device: str) -> None:
        self.installing = Installing(shapes, dtype, device)

    @endpoint
    async def install(self, manifest: WeightManifest, alias: bool, profiled: bool = False) -> dict[str, float]:
        return self.installing.install(manifest, alias, profiled)

    @endpoint
    async def hotspots(self, count: int, updates: int) -> list[dict[str, Any]]:
        return self.installing.hotspots(count, updates)

    async def __cleanup__(self, exc: BaseException | None) -> None:
        self.installing.close()


class Copy:
    """One copy of the state into a second set of tensors: the raw baseline."""

    def __init__(self, state: dict[str, torch.Tensor], device: str) -> None:
        self.src = list(state.values())
        self.dst = [torch.empty_like(t) for t in self.src]
        self.device = device
        self.samples: list[float] = []
        copy_all(self.dst, self.src)  # touch both sets once
        synchronize(device)

    def sample(self) -> None:
        if self.device.startswith("cuda"):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            copy_all(self.dst, self.src)
            end.record()
            end.synchronize()
            self.samples.append(start.elapsed_time(end) / 1000)
        else:
            start_s = time.perf_counter()
            copy_all(self.dst, self.src)
            self.samples.append(time.perf_counter() - start_s)


async def measure(args: argparse.Namespace, mb: int, dtype: str, install: str) -> dict[str, Any]:
    torch_dtype = DTYPES[dtype]
    shapes = model_shapes(mb, torch_dtype, args.layers)
    state = make_state(shapes, torch_dtype, args.device, 1.0)
    total = sum(t.numel() * t.element_size() for t in state.values())
    baseline = Copy(state, args.device)
    alias = install == "alias"
    procs = None
    local = Installing(shapes, dtype, args.consumer_device) if args.transport == "local" else None
    if local is not None:

        async def do_install(manifest: WeightManifest, profiled: bool = False) -> dict[str, float]:
            assert local is not None
            return local.install(manifest, alias, profiled)

        async def hotspots(count: int, updates: int) -> list[dict[str, Any]]:
            assert local is not None
            return local.hotspots(count, updates)
    else:
        procs = this_host().spawn_procs(per_host={"procs": 1})
        installer = procs.spawn("installer", Installer, shapes, dtype, args.consumer_device)

        async def do_install(manifest: WeightManifest, profiled: bool = False) -> dict[str, float]:
            return await installer.install.call_one(manifest, alias, profiled)

        async def hotspots(count: int, updates: int) -> list[dict[str, Any]]:
            return await installer.hotspots.call_one(count, updates)

    rows = []
    with WeightPublisher(args.transport, **publisher_args(args)) as publisher:
        for version in range(1, args.warmup + args.updates + 1):
            measured = version > args.warmup
            if measured:
                baseline.sample()  # interleaved: the baseline sees the same machine state
            synchronize(args.device)
            start = time.perf_counter()
            manifest = await publisher.publish_async(state, version)
            published = time.perf_counter()
            timings = await do_install(manifest)
            publisher.release(manifest.update_id)
            if measured:
                elapsed, call = timings["done_at"] - start, timings["arrived_at"] - published
                rows.append({"stall": published - start, "call": call, "total": elapsed, **timings})
    found = await profile_publishes(args, state, do_install, hotspots) if args.profile else None
    if procs is not None:
        await procs.stop()
    if local is not None:
        local.close()
    copy_ms = statistics.median(baseline.samples) * 1000

    def med(key: str) -> float:
        return statistics.median(row[key] for row in rows) * 1000

    total_ms = med("total")
    row = {
        "mib": round(total / 2**20, 1),
        "dtype": dtype,
        "install": install,
        "tensor_count": len(state),
        "total_nbytes": total,
        "updates_measured": len(rows),
        "trainer_stall_ms": round(med("stall"), 3),
        "call_ms": round(med("call"), 3),
        "import_ms": round(med("import"), 3),
        "install_ms": round(med("install"), 3),
        "ack_ms": round(med("ack"), 3),
        "release_ms": round(med("release"), 3),
        "publish_to_installed_ms": round(total_ms, 3),
        "copy_ms": round(copy_ms, 3),
        "ratio": round(total_ms / copy_ms, 3),
        "stall_ratio": round(med("stall") / copy_ms, 3),
        "gb_per_s": round(total / (total_ms / 1000) / 1e9, 2),
    }
    return {**row, "profile": found} if found is not None else row


def publisher_args(args: argparse.Namespace) -> dict[str, Any]:
    options: dict[str, Any] = {} if args.transport == "local" else {"slots": args.slots}
    if args.transport == "cuda-ipc":
        options["device"] = args.device
    return options


async def profile_publishes(
    args: argparse.Namespace,
    state: dict[str, torch.Tensor],
    do_install: Callable[..., Awaitable[dict[str, float]]],
    consumer_hotspots: Callable[[int, int], Awaitable[list[dict[str, Any]]]],
    updates: int = 5,
) -> dict[str, Any]:
    """``updates`` more updates from a fresh publisher, its ``publish`` (the trainer's stall) under cProfile and
    ``torch.profiler``: the Python functions and the torch operators / CUDA calls that took its time, per update;
    and the consumer's installs under cProfile in its own process (``consumer``)."""
    import cProfile

    from _profile import busiest, python_hotspots
    from torch.profiler import ProfilerActivity, profile

    python = cProfile.Profile()
    cuda = args.device.startswith("cuda")
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with WeightPublisher(args.transport, **publisher_args(args)) as publisher:
        for version in range(1, args.warmup + 1):  # the slots' first fills are not what is profiled
            manifest = await publisher.publish_async(state, version)
            await do_install(manifest)
            publisher.release(manifest.update_id)
        with profile(activities=activities) as torch_prof:
            for version in range(args.warmup + 1, args.warmup + updates + 1):
                synchronize(args.device)
                python.enable()
                manifest = await publisher.publish_async(state, version)
                python.disable()
                await do_install(manifest, True)
                publisher.release(manifest.update_id)
    host = busiest(torch_prof, 8, by="cpu")
    for op in host:
        op["ms"] = round(op["ms"] / updates, 3)
        op["calls"] = op["calls"] // updates
    return {
        "updates": updates,
        "python": python_hotspots(python, 10, updates),
        "torch_host": host,
        "consumer": await consumer_hotspots(10, updates),
    }


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    rows = []
    for mb, dtype, install in itertools.product(args.mb, args.dtype, args.install):
        row = await measure(args, mb, dtype, install)
        rows.append(row)
        if not args.json:
            print(
                f"{args.transport} {args.device}: {row['mib']:.0f} MiB {dtype} in {row['tensor_count']} tensors, "
                f"{install} | stall {row['trainer_stall_ms']} ms, call {row['call_ms']} ms, import {row['import_ms']} ms, install "
                f"{row['install_ms']} ms, ack {row['ack_ms']} ms | publish->installed {row['publish_to_installed_ms']} ms = "
                f"{row['ratio']} x copy {row['copy_ms']} ms (stall {row['stall_ratio']} x)",
                flush=True,
            )
            for column, title in (
                ("python", "trainer's publish, Python"),
                ("torch_host", "trainer's publish, torch"),
                ("consumer", "consumer's install, Python"),
            ):
                if row.get("profile", {}).get(column):
                    print(f"  {title} (per update):")
                for entry in row.get("profile", {}).get(column, []):
                    print(f"    {entry['ms']:8.3f} ms  x{entry['calls']:<5} {entry.get('function') or entry['op']}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transport", choices=["shm", "local", "cuda-ipc"], default="shm")
    parser.add_argument("--device", default="cpu", help="where the trainer's state_dict lives: cpu or cuda[:N]")
    parser.add_argument("--consumer-device", help="where the consumer's model lives (default: --device)")
    parser.add_argument("--mb", type=int, nargs="+", default=[1024], help="sizes of the state_dict in MiB")
    parser.add_argument("--dtype", nargs="+", choices=list(DTYPES), default=["float32"])
    parser.add_argument("--install", nargs="+", choices=["copy", "alias"], default=["copy"])
    parser.add_argument("--layers", type=int, help="layers of 6 tensors (default: 24 from 256 MiB, else ~8)")
    parser.add_argument("--updates", type=int, default=5, help="measured updates per row (after warm-up)")
    parser.add_argument("--warmup", type=int, default=2, help="updates not measured (fresh memory)")
    parser.add_argument("--slots", type=int, default=3, help="slot pool size (an aliasing consumer holds one)")
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    parser.add_argument(
        "--profile", action="store_true", help="per row, where 5 more publishes spent the trainer's time"
    )
    args = parser.parse_args()
    if args.layers is not None and args.layers < 1:
        parser.error(f"--layers {args.layers}: a model needs at least one layer")
    args.consumer_device = args.consumer_device or args.device
    reason = probe(args.transport)
    if reason is None and "cuda" in args.device + args.consumer_device and not torch.cuda.is_available():
        reason = "no CUDA device: torch.cuda.is_available() is False"
    result: dict[str, Any] = {"bench": "weights", "transport": args.transport, "device": args.device}
    if reason is not None:
        result.update(status="blocked", reason=reason)
    else:
        if args.device.startswith("cuda"):
            result["gpu"] = torch.cuda.get_device_name(torch.device(args.device))
        result.update(status="pass", rows=asyncio.run(run(args)))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
