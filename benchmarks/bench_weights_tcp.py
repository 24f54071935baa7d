"""Weights across hosts: the ``tcp`` transport against raw tcp between the same two processes.

    python benchmarks/bench_weights_tcp.py --mb 1024 [--repeats 5] [--ray auto] [--json]

A publisher actor and a consumer actor live in two processes: on this host
by default (loopback), or with ``--ray ADDRESS`` on two Ray nodes
(``actors.ray.host_mesh(hosts=2)``, tcp between the nodes' addresses). The
state_dict is transformer-shaped (many tensors) on the CPU. Per round:

* ``fetch``: the consumer's ``import_update_async`` of one published
  update, from connect to the last chunk received and CRC-checked, the
  tensors built as views (what the transport adds to the wire);
* ``raw``: the same number of bytes sent with one ``sendall`` from a
  buffer and received with ``recv_into`` into a reused buffer, between the
  same two processes, on a fresh connection (the wire, nothing else);
* ``publish``: the trainer's side, staging copy and chunk CRCs.

Rounds interleave the two; the first is warm-up. Figures are medians.
Goal: ``fetch`` throughput at least 0.7x raw.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import threading
import time
from typing import Any

import torch
from bench_weights import make_state, model_shapes

from actors import Actor, WeightConsumer, WeightManifest, WeightPublisher, endpoint, this_host
from actors._wire._buffers import tensor_buffer


class Sender(Actor):
    """The trainer's side: publishes over ``tcp``, and serves raw bytes for the baseline."""

    def __init__(self, mb: int) -> None:
        torch.set_num_threads(1)
        self.state = make_state(model_shapes(mb, torch.float32), torch.float32, "cpu", 1.0)
        self.nbytes = sum(t.numel() * t.element_size() for t in self.state.values())
        self.publisher = WeightPublisher("tcp", slots=2)
        self.raw = torch.ones(self.nbytes, dtype=torch.uint8)
        self.version = 0

    @endpoint
    async def publish(self) -> tuple[WeightManifest, float]:
        self.version += 1
        started = time.perf_counter()
        manifest = await self.publisher.publish_async(self.state, self.version)
        return manifest, time.perf_counter() - started

    @endpoint
    async def serve_raw(self) -> tuple[str, int, int]:
        """Listen once; the next connection gets ``nbytes`` in one ``sendall``."""
        host = self.publisher._writer.address[0]  # type: ignore[attr-defined]
        listener = socket.create_server((host, 0))

        def send() -> None:
            with listener:
                sock, _ = listener.accept()
                with sock:
                    sock.sendall(tensor_buffer(self.raw))

        threading.Thread(target=send, daemon=True).start()
        return host, listener.getsockname()[1], self.nbytes

    async def __cleanup__(self, exc: BaseException | None) -> None:
        self.publisher.close()


class Receiver(Actor):
    """The generator's side: fetches updates, and receives the raw baseline."""

    def __init__(self) -> None:
        torch.set_num_threads(1)
        self.consumer = WeightConsumer()
        self.buffer: torch.Tensor | None = None

    @endpoint
    async def fetch(self, manifest: WeightManifest) -> float:
        started = time.perf_counter()
        await self.consumer.import_update_async(manifest)
        took = time.perf_counter() - started
        self.consumer.release(manifest.update_id)
        return took

    @endpoint
    async def raw(self, host: str, port: int, nbytes: int) -> float:
        if self.buffer is None or self.buffer.numel() != nbytes:
            self.buffer = torch.empty(nbytes, dtype=torch.uint8)
        view = tensor_buffer(self.buffer)

        def receive() -> float:
            started = time.perf_counter()
            with socket.create_connection((host, port)) as sock:
                got = 0
                while got < nbytes:
                    n = sock.recv_into(view[got:])
                    if n == 0:
                        raise ConnectionError("the raw sender closed early")
                    got += n
            return time.perf_counter() - started

        return await asyncio.get_running_loop().run_in_executor(None, receive)

    async def __cleanup__(self, exc: BaseException | None) -> None:
        self.consumer.close()


def _hosts(ray_address: str | None) -> tuple[Any, Any, Any, str]:
    """Where the two processes go: (sender's host mesh, receiver's, Ray host mesh to shut down, in words)."""
    if ray_address is None:
        return this_host(), this_host(), None, "two processes on this host (loopback)"
    from actors.ray import host_mesh

    hosts = host_mesh(ray_address, hosts=2)
    where = " and ".join(f"{h['ip']} (node {h['node'][:8]})" for h in hosts.hosts)
    return hosts.slice(0), hosts.slice(1), hosts, f"two Ray nodes: {where}"


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    send_host, recv_host, hosts, where = _hosts(args.ray)
    meshes = []
    try:
        meshes.append(send_host.spawn_procs(per_host={"procs": 1}, name="sender"))
        meshes.append(recv_host.spawn_procs(per_host={"procs": 1}, name="receiver"))
        sender = meshes[0].spawn("sender", Sender, args.mb)
        receiver = meshes[1].spawn("receiver", Receiver)
        fetch, raw, publish = [], [], []
        nbytes = 0
        for round_ in range(args.repeats + 1):
            host, port, nbytes = await sender.serve_raw.call_one()
            raw_s = await receiver.raw.call_one(host, port, nbytes)
            manifest, publish_s = await sender.publish.call_one()
            fetch_s = await receiver.fetch.call_one(manifest)
            if round_:
                raw.append(raw_s)
                fetch.append(fetch_s)
                publish.append(publish_s)
        gib = nbytes / 2**30
        fetch_gibs, raw_gibs = gib / statistics.median(fetch), gib / statistics.median(raw)
        return {
            "bench": "weights_tcp",
            "where": where,
            "mb": args.mb,
            "repeats": args.repeats,
            "fetch_s": round(statistics.median(fetch), 4),
            "raw_s": round(statistics.median(raw), 4),
            "publish_s": round(statistics.median(publish), 4),
            "fetch_gib_s": round(fetch_gibs, 3),
            "raw_gib_s": round(raw_gibs, 3),
            "ratio_vs_raw": round(fetch_gibs / raw_gibs, 3),
        }
    finally:
        for mesh in meshes:
            await mesh.stop()
        if hosts is not None:
            hosts.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=1024, help="update size in MiB (default 1024)")
    parser.add_argument("--repeats", type=int, default=5, help="measured rounds after one warm-up (default 5)")
    parser.add_argument("--ray", metavar="ADDRESS", help="place the two processes on two Ray nodes ('auto' joins)")
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    args = parser.parse_args()
    result = asyncio.run(measure(args))
    if not args.json:
        print(f"weights over tcp, {args.mb} MiB, {result['where']}, median of {args.repeats}:")
        print(f"  fetch   {result['fetch_s'] * 1e3:8.1f} ms  {result['fetch_gib_s']:6.2f} GiB/s  (transport)")
        print(
            f"  raw     {result['raw_s'] * 1e3:8.1f} ms  {result['raw_gib_s']:6.2f} GiB/s  (baseline, same processes)"
        )
        print(f"  ratio   {result['ratio_vs_raw']:.2f}x raw throughput (goal >= 0.7x)")
        print(f"  publish {result['publish_s'] * 1e3:8.1f} ms  (trainer: staging copy + chunk CRCs)")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
