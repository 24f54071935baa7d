"""Actor classes and helpers shared by the tests (importable by worker processes)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import math
import os
import signal
import time
from dataclasses import InitVar, dataclass, field
from typing import Any, ClassVar

import torch

from actors import (
    Actor,
    ActorMesh,
    Channel,
    Failure,
    Port,
    PortReceiver,
    ProcMesh,
    current_rank,
    current_size,
    endpoint,
    get_or_spawn_controller,
    send,
    this_host,
)
from actors.weights import ReceivesWeights, WeightManifest, WeightPublisher, join_publish


@dataclass
class Item:
    seq: int
    payload: torch.Tensor


@dataclass
class Fragile:
    """A dataclass whose own check raises something other than TypeError/ValueError for a negative count."""

    count: int

    def __post_init__(self) -> None:
        if self.count < 0:
            raise RuntimeError(f"count {self.count} is negative")


@dataclass
class Counted:
    """A dataclass that notes each time this process builds one: a record decoded twice shows."""

    value: int
    built: ClassVar[list[int]] = []

    def __post_init__(self) -> None:
        Counted.built.append(self.value)


@dataclass(frozen=True)
class Triple:
    a: torch.Tensor
    b: torch.Tensor
    c: torch.Tensor


@dataclass(kw_only=True)
class Keyworded:
    """A dataclass whose fields can only be given by keyword."""

    name: str
    size: int = 1


@dataclass(frozen=True, slots=True)
class Derived:
    """A dataclass whose ``__post_init__`` rewrites a field and fills one the constructor does not take."""

    raw: int
    doubled: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        object.__setattr__(self, "raw", self.raw + 1)
        object.__setattr__(self, "doubled", self.raw * 2)


@dataclass
class Scaled:
    """A dataclass with an init-only value between its fields: the constructor takes ``(tokens, scale, label)``."""

    tokens: list[int]
    scale: InitVar[float] = 1.0
    label: int = 0


@dataclass
class NeedsScale:
    """A dataclass whose init-only value has no default: an instance cannot be rebuilt from its fields."""

    tokens: list[int]
    scale: InitVar[float]


@dataclass(init=False)
class Renamed:
    """A dataclass whose constructor is its own: ``Renamed(text)`` sets ``words``."""

    words: list[str]

    def __init__(self, text: str) -> None:
        self.words = text.split()


class TalliesAtCleanup(Actor):
    """Calls the session's ``tally`` controller in its ``__cleanup__`` and writes the answer to ``path``."""

    def __init__(self, path: str) -> None:
        self.path = path

    async def __cleanup__(self, exc: BaseException | None) -> None:
        tally = await get_or_spawn_controller("tally", Echo)
        answer = await asyncio.wait_for(tally.add.call_one(1), 10)
        with open(self.path, "w") as f:
            f.write(str(answer))


class Respawner(Actor):
    """Spawns proc meshes and stops them, again and again, as a long-lived controller actor does."""

    @endpoint
    async def spawn_and_stop(self, times: int) -> int:
        """How many of what it spawned it still holds afterwards."""
        from actors._runtime._context import actor_context
        from actors._runtime._core import runtime

        for _ in range(times):
            procs = this_host().spawn_procs(per_host={"procs": 1})
            await procs.spawn("echo", Echo).add.call_one(1)
            await procs.stop()
        ctx, server = actor_context.get(), runtime().server
        assert ctx is not None and server is not None
        return len(server.lifecycle._slots.actors[ctx.name].children)  # type: ignore[attr-defined]


class Echo(Actor):
    def __init__(self, offset: int = 0, blob: object = None) -> None:
        self.offset = offset
        self.blob = blob
        self.event = asyncio.Event()

    @endpoint
    async def add(self, x: int) -> int:
        return x + self.offset

    @endpoint
    async def echo(self, value: object) -> object:
        return value

    @endpoint
    async def get_blob(self) -> object:
        return self.blob

    @endpoint
    async def whoami(self) -> tuple[int, int, dict[str, int]]:
        return os.getpid(), current_rank().rank, current_size()

    @endpoint
    async def fail(self, message: str) -> None:
        raise ValueError(message)

    @endpoint
    async def wait_event(self) -> str:
        await self.event.wait()
        return "released"

    @endpoint
    async def set_event(self) -> None:
        self.event.set()

    @endpoint
    async def sleep(self, seconds: float) -> str:
        await asyncio.sleep(seconds)
        return "done"

    @endpoint
    async def send_to(self, port: Port, values: list) -> None:
        for value in values:
            port.send(value)

    @endpoint
    async def fail_to(self, port: Port, message: str) -> None:
        port.exception(RuntimeError(message))

    @endpoint
    async def emit(self, port: Port, count: int, size: int = 4) -> None:
        for seq in range(count):
            port.send(Item(seq, torch.full((size,), float(seq))))
        port.send(None)

    @endpoint
    async def emit_paced(self, port: Port, count: int) -> int:
        """Send ``count`` ints, then wait until the receiver took back every one's credit from the backlog."""
        for seq in range(count):
            port.send(seq)
        await port.drain()
        return count

    @endpoint
    async def call_other(self, other: ActorMesh, x: int) -> int:
        return await other.add.call_one(x)

    @endpoint
    async def hold(self, port: Port) -> None:
        self.held = port

    @endpoint
    async def pid(self) -> int:
        return os.getpid()

    @endpoint
    async def getenv(self, name: str) -> str | None:
        return os.environ.get(name)

    @endpoint
    async def say(self, text: str) -> None:
        print(text, flush=True)


class Constructed(Actor):
    """Appends ``<pid> <rank>`` to ``path`` each time it is constructed (a restart's replay constructs it again)."""

    def __init__(self, path: str) -> None:
        with open(path, "a") as f:
            f.write(f"{os.getpid()} {current_rank().rank}\n")

    @endpoint
    async def ping(self) -> int:
        return os.getpid()


class SyncEcho(Actor):
    """A synchronous actor (only ``def`` endpoints): its calls run one at a time on its own thread."""

    def __init__(self, offset: int = 0) -> None:
        self.offset = offset

    @endpoint
    def blocking(self, seconds: float) -> str:
        time.sleep(seconds)
        return "slept"

    @endpoint
    def sync_add(self, x: int) -> int:
        return x + self.offset

    @endpoint
    def first(self, items: list[int]) -> int:
        return next(iter(items))  # StopIteration on an empty list

    @endpoint
    def cancelled_elsewhere(self) -> None:
        raise concurrent.futures.CancelledError()  # (as ``.result()`` of a cancelled pool future raises)


class Unprintable(Exception):
    """An exception whose ``str()`` itself raises."""

    def __str__(self) -> str:
        raise AttributeError("no detail")


class RaisesUnprintably(Actor):
    @endpoint
    async def fail(self) -> None:
        raise Unprintable()

    @endpoint
    async def ping(self) -> str:
        return "pong"


class Relay(Actor):
    """Receives on its own port and forwards to ``out``; ends on ``None``."""

    def __init__(self) -> None:
        self.port, self.inbox = Channel.open(Item)

    @endpoint
    async def inlet(self) -> Port:
        return self.port

    @endpoint
    async def run(self, out: Port, delay: float = 0.0) -> int:
        n = 0
        while (item := await self.inbox.recv()) is not None:
            if delay:
                await asyncio.sleep(delay)
            out.send(item)
            n += 1
        out.send(None)
        return n

    @endpoint
    async def counts_flow_to(self, port: Port) -> bool:
        """Whether this process still keeps flow-control state for sending to ``port``."""
        from actors._runtime._core import runtime

        return (port._address, port._id) in runtime().windows._windows


class OnceInlets(Actor):
    """Opens once-ports on request and counts what arrives on them."""

    def __init__(self) -> None:
        self.receivers: list[PortReceiver] = []

    @endpoint
    async def open(self) -> Port:
        port, receiver = Channel.open(int, once=True)
        self.receivers.append(receiver)
        return port

    @endpoint
    async def open_untyped(self) -> Port:
        port, receiver = Channel.open(once=True)
        self.receivers.append(receiver)
        return port

    @endpoint
    async def total(self) -> int:
        return sum([await receiver.recv() for receiver in self.receivers])  # type: ignore[misc]


class Cleanup(Actor):
    def __init__(self, port: Port) -> None:
        self.port = port

    @endpoint
    async def ping(self) -> str:
        return "pong"

    async def __cleanup__(self, exc: BaseException | None) -> None:
        self.port.send(f"cleanup {current_rank().rank}")


class CleanupThatDiesOrTakesItsTime(Actor):
    """At a stop, rank 0's process dies in its cleanup; every other rank's cleanup takes a second, then reports."""

    def __init__(self, port: Port[str]) -> None:
        self.port = port

    @endpoint
    async def ping(self) -> str:
        return "pong"

    async def __cleanup__(self, exc: BaseException | None) -> None:
        rank = current_rank().rank
        if rank == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        await asyncio.sleep(1.0)  # (a cleanup that takes its time, well inside its bound)
        self.port.send(f"done {rank}")


class BadInit(Actor):
    def __init__(self) -> None:
        raise RuntimeError("constructor exploded")

    @endpoint
    async def ping(self) -> str:
        return "unreachable"


class Fire(Actor):
    @endpoint
    async def explode(self, message: str) -> None:
        raise KeyError(message)

    @endpoint
    async def ok(self) -> str:
        return "ok"


# ---------------------------------------------------------------- weight sync


def models_equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    """Whether two models hold the same tensors, entry by entry."""
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


def filled_model(value: float, width: int = 64) -> torch.nn.Module:
    """A small model whose every parameter equals ``value`` (so a mix of versions is visible)."""
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Linear(width, 8))
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    return model


class WeightSink(ReceivesWeights):
    """Installs the newest manifest on demand and reports what it holds."""

    def __init__(self, width: int = 64) -> None:
        self.model = filled_model(0.0, width)
        self.installs = 0

    @endpoint
    async def install_pending(self) -> int | None:
        manifest = await self.weight_inbox.install_newest_async(self.model)
        if manifest is None:
            return None
        self.installs += 1
        values = {float(v) for p in self.model.parameters() for v in p.detach().flatten().unique()}
        if values != {float(manifest.version)}:
            raise AssertionError(f"mixed weights after installing version {manifest.version}: {sorted(values)}")
        return manifest.version

    @endpoint
    async def install_until(self, version: int) -> int:
        """Install whatever arrives until ``version`` is in; checks each install is whole."""
        while True:
            got = await self.install_pending()
            if got is not None and got >= version:
                return self.installs
            await asyncio.sleep(0.001)

    @endpoint
    async def hold(self, manifest: WeightManifest) -> int:
        """Import and keep holding (never release): simulates a consumer mid-update."""
        self.held = self.weight_inbox.consumer.import_update(manifest)
        return os.getpid()

    @endpoint
    async def manifest_inlet(self) -> Port:
        self.manifests_port, self.manifests = Channel.open(WeightManifest)
        return self.manifests_port

    @endpoint
    async def install_from_port(self) -> int | None:
        """Take one manifest from this actor's typed port and install it."""
        self.weight_inbox.put(await self.manifests.recv())
        return await self.install_pending()

    @endpoint
    async def inbox_stats(self) -> tuple[int, int]:
        return len(self.weight_inbox), self.weight_inbox.superseded


class WeightSource(Actor):
    """Publishes from inside an actor process (for publisher-death cleanup)."""

    def __init__(self, transport: str = "shm") -> None:
        self.publisher = WeightPublisher(transport)

    @endpoint
    async def publish(self, version: int) -> WeightManifest:
        return self.publisher.publish(filled_model(float(version)), version)

    async def __cleanup__(self, exc: BaseException | None) -> None:
        self.publisher.close()


class Pinger(Actor):
    """A target with nothing to abuse: fuzzed calls can only ever reach ``ping``."""

    @endpoint
    async def ping(self, value: int = 0) -> int:
        return value

    @endpoint
    async def mark(self, port: Port) -> None:
        port.send("processed")

    @endpoint
    async def dropped(self) -> int:
        from actors._runtime._core import runtime

        return runtime().drops.count


class Counter(Actor):
    """Streams 0..n-1 then None; reports its own resident memory."""

    @endpoint
    async def count_to(self, port: Port, n: int) -> None:
        """A producer paced the asyncio way: send, then await drain (at once while the window has room)."""
        for i in range(n):
            port.send(i)
            await port.drain()
        port.send(None)

    @endpoint
    async def rss_mib(self) -> float:
        with open("/proc/self/status") as f:
            line = next(x for x in f if x.startswith("VmRSS"))
        return int(line.split()[1]) / 1024


class Forwarder(Counter):
    """Receives on its own untyped port and forwards everything, sentinel included."""

    def __init__(self) -> None:
        self.port, self.inbox = Channel.open()
        self.peak_queue = 0

    @endpoint
    async def inlet(self) -> Port:
        return self.port

    @endpoint
    async def run(self, out: Port) -> int:
        n = 0
        while (item := await self.inbox.recv()) is not None:
            self.peak_queue = max(self.peak_queue, self.inbox.qsize())
            out.send(item)
            await out.drain()  # a slow downstream slows this stage down too: memory stays bounded
            n += 1
        out.send(None)
        return n

    @endpoint
    async def peak(self) -> int:
        return self.peak_queue


class Blocker(Actor):
    """Freezes its own event loop with a synchronous sleep (the classic mistake in an async endpoint)."""

    @endpoint
    async def freeze(self, seconds: float) -> None:
        time.sleep(seconds)

    @endpoint
    async def ping(self, value: int = 0) -> int:
        return value

    @endpoint(timeout=0.5)
    async def guarded_ping(self) -> str:
        return "pong"


class Supervisor(Actor):
    """Spawns a child mesh of its own and supervises it: ``__supervise__`` reports to ``port``."""

    def __init__(self, port: Port, handle: bool) -> None:
        self.port = port
        self.handle = handle
        self.procs: ProcMesh | None = None

    @endpoint
    async def start_child(self) -> None:
        self.procs = this_host().spawn_procs(per_host={"procs": 1}, name="children")
        self.child = self.procs.spawn("child", Fire)
        await self.child.ok.call_one()

    @endpoint
    async def fail_child(self) -> None:
        send(self.child.explode, ("from the child",))

    @endpoint
    async def ping(self) -> str:
        return "alive"

    def __supervise__(self, failure: Failure) -> bool:
        self.port.send(str(failure))
        return self.handle

    async def __cleanup__(self, exc: BaseException | None) -> None:
        if self.procs is not None:
            await self.procs.stop()


def _schedstat() -> tuple[float, float]:
    """This thread's time on a CPU and waiting in the run queue for one, in seconds (Linux's schedstat)."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            running, waiting, _ = f.read().split()
    except (OSError, ValueError):
        return 0.0, 0.0
    return int(running) / 1e9, int(waiting) / 1e9


class Heartbeat:
    """A beat every ``period`` s on the running event loop; ``worst`` is the longest gap seen (s).

    ``async with Heartbeat() as beat: ...`` measures whether the code inside
    ever keeps the loop from turning; garbage collections meanwhile are
    recorded too (``str(beat)``).
    """

    def __init__(self, period: float = 0.001) -> None:
        self.period = period
        self.worst = 0.0
        #: The longest gap less the time the loop's thread waited for a CPU meanwhile (the OS not running this
        #: process is no stall of its loop): what code on the loop kept it from turning.
        self.worst_stall = 0.0
        #: For the longest gap: (on-CPU, waiting for a CPU) seconds of the loop's thread meanwhile.
        self.worst_split = (0.0, 0.0)
        self.beats = 0
        self.gc_pauses: list[float] = []  # collections of the garbage collector meanwhile (s each)
        self._gc_started = 0.0
        self._task: asyncio.Task[None] | None = None

    def _gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        else:
            self.gc_pauses.append(time.perf_counter() - self._gc_started)

    def __str__(self) -> str:
        longest = max(self.gc_pauses, default=0.0)
        running, waiting = self.worst_split
        return (
            f"worst gap {self.worst * 1000:.0f} ms over {self.beats} beats (the loop's thread on a CPU "
            f"{running * 1000:.0f} ms of it, waiting for one {waiting * 1000:.0f} ms), the worst stall "
            f"{self.worst_stall * 1000:.0f} ms; {len(self.gc_pauses)} garbage collections meanwhile, the longest "
            f"{longest * 1000:.0f} ms"
        )

    async def _run(self) -> None:
        last, (cpu, queued) = time.perf_counter(), _schedstat()
        while True:
            await asyncio.sleep(self.period)
            now, (cpu_now, queued_now) = time.perf_counter(), _schedstat()
            gap = now - last
            self.worst_stall = max(self.worst_stall, gap - (queued_now - queued))
            if gap > self.worst:
                self.worst, self.worst_split = gap, (cpu_now - cpu, queued_now - queued)
            self.beats += 1
            last, cpu, queued = now, cpu_now, queued_now

    async def __aenter__(self) -> Heartbeat:
        import gc

        # The heap built before (pytest's, torch's) is frozen, as a long-running
        # service's startup heap would be: full collections of it are the
        # collector's pauses, not the runtime's, and are reported apart.
        gc.collect()
        gc.freeze()
        gc.callbacks.append(self._gc)
        self._task = asyncio.ensure_future(self._run())
        await asyncio.sleep(0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        import gc

        gc.callbacks.remove(self._gc)
        gc.unfreeze()
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


class CudaSink(ReceivesWeights):
    """Installs cuda-ipc updates into a model on its GPU and reports what it then holds."""

    def __init__(self, width: int = 64, device: str = "cuda") -> None:
        self.model = filled_model(0.0, width).to(device)

    def report(self, version: int | None) -> dict:
        torch.cuda.synchronize()
        values = sorted({float(v) for p in self.model.parameters() for v in p.detach().flatten().unique().cpu()})
        return {
            "version": version,
            "values": values,
            "open_slots": self.weight_inbox.consumer.reader("cuda-ipc").open_slots,
            "allocated": torch.cuda.memory_allocated(),
            "device": str(next(self.model.parameters()).device),
        }

    @endpoint
    async def install(self, manifest: WeightManifest, alias: bool = False) -> dict:
        self.weight_inbox.put(manifest)
        installed = self.weight_inbox.install_newest(self.model, alias=alias)
        return self.report(None if installed is None else installed.version)

    @endpoint
    async def sums(self, manifest: WeightManifest) -> dict[str, float]:
        """Each tensor's sum as this process imports the update (device to device), then released."""
        consumer = self.weight_inbox.consumer
        tensors = await consumer.import_update_async(manifest)
        sums = {name: float(tensor.double().sum()) for name, tensor in tensors.items()}
        await consumer.release_async(manifest.update_id)
        return sums

    @endpoint
    async def install_async_never_blocking(self, manifest: WeightManifest, alias: bool = False) -> dict:
        """``install_newest_async`` with every host wait for the GPU refused: its releases are awaited instead."""

        def refuse(*args: object, **kwargs: object) -> None:
            raise AssertionError("an install on the event loop waited for the GPU on the loop's thread")

        self.weight_inbox.put(manifest)
        saved = torch.cuda.Stream.synchronize, torch.cuda.synchronize, torch.cuda.Event.synchronize
        torch.cuda.Stream.synchronize = torch.cuda.synchronize = torch.cuda.Event.synchronize = refuse  # type: ignore[method-assign,assignment]
        try:
            installed = await self.weight_inbox.install_newest_async(self.model, alias=alias)
        finally:
            torch.cuda.Stream.synchronize, torch.cuda.synchronize, torch.cuda.Event.synchronize = saved  # type: ignore[method-assign]
        return self.report(None if installed is None else installed.version)

    @endpoint
    async def holding(self) -> dict:
        """What the model holds now (an aliased install: the slot it views)."""
        return self.report(None)

    @endpoint
    async def touch(self, manifest: WeightManifest) -> int:
        """Import and release; returns how many device slots this process has open."""
        consumer = self.weight_inbox.consumer
        consumer.import_update(manifest)
        consumer.release(manifest.update_id)
        return consumer.reader("cuda-ipc").open_slots

    @endpoint
    async def close_inbox(self) -> int:
        self.weight_inbox.close()
        return self.weight_inbox.consumer.reader("cuda-ipc").open_slots

    @endpoint
    async def close_inbox_never_blocking(self) -> int:
        """``close_async`` (what ``__cleanup__`` runs) with every host wait for the GPU refused."""

        def refuse(*args: object, **kwargs: object) -> None:
            raise AssertionError("closing the inbox on the event loop waited for the GPU on the loop's thread")

        saved = torch.cuda.Stream.synchronize, torch.cuda.synchronize, torch.cuda.Event.synchronize
        torch.cuda.Stream.synchronize = torch.cuda.synchronize = torch.cuda.Event.synchronize = refuse  # type: ignore[method-assign,assignment]
        try:
            await self.weight_inbox.close_async()
        finally:
            torch.cuda.Stream.synchronize, torch.cuda.synchronize, torch.cuda.Event.synchronize = saved  # type: ignore[method-assign]
        return self.weight_inbox.consumer.reader("cuda-ipc").open_slots


class CudaSource(Actor):
    """Publishes over cuda-ipc from its own process (for publisher-death tests)."""

    def __init__(self, width: int = 64) -> None:
        self.model = filled_model(0.0, width).cuda()
        self.publisher = WeightPublisher("cuda-ipc", slots=2)

    @endpoint
    async def publish(self, version: int) -> WeightManifest:
        with torch.no_grad():
            for p in self.model.parameters():
                p.fill_(float(version))
        return await self.publisher.publish_async(self.model, version)

    async def __cleanup__(self, exc: BaseException | None) -> None:
        self.publisher.close()


class Flooder(Actor):
    """Sends to a port as fast as it can in a background task, like a rollout loop (never waits)."""

    def __init__(self) -> None:
        self.sent = 0
        self.task: asyncio.Task[None] | None = None
        self.error: str | None = None

    @endpoint
    async def start(self, port: Port) -> None:
        async def flood() -> None:
            payload = torch.zeros(1)
            try:
                while True:
                    port.send(Item(self.sent, payload))
                    self.sent += 1
                    await asyncio.sleep(0)
            except Exception as exc:
                self.error = f"{type(exc).__name__}: {exc}"

        self.task = asyncio.ensure_future(flood())

    @endpoint
    async def status(self) -> tuple[int, str | None]:
        return self.sent, self.error

    @endpoint
    async def stop_flood(self) -> int:
        if self.task is not None:
            self.task.cancel()
        return self.sent


def seeded_model(seed: int = 0, width: int = 64) -> torch.nn.Module:
    """A small model of four blocks, the same in every process that asks with ``seed``.

    Some tensors split unevenly over two ranks (7 rows), some leave a rank nothing (1 row).
    """
    torch.manual_seed(seed)
    linears = (
        torch.nn.Linear(width, width),
        torch.nn.Linear(width, width),
        torch.nn.Linear(width, 7),
        torch.nn.Linear(7, 1),
    )
    return torch.nn.Sequential(*linears)


class ShardedSource(Actor):
    """One rank of a gloo group holding :func:`seeded_model` sharded with FSDP2: rank 0 publishes it, the rest join."""

    def __init__(self, transport: str) -> None:
        self.transport = transport
        self.store: Any = None
        self.publisher: WeightPublisher | None = None

    @endpoint
    def serve(self, world: int) -> int:
        from torch.distributed import TCPStore  # type: ignore[attr-defined]

        self.store = TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
        return int(self.store.port)

    @endpoint
    def join(self, port: int) -> None:
        """Join rank 0's group and shard :func:`seeded_model` over it (a unit per layer, the model as root)."""
        import torch.distributed as dist
        from torch.distributed import TCPStore  # type: ignore[attr-defined]
        from torch.distributed.fsdp import fully_shard

        rank, world = current_rank().rank, math.prod(current_size().values())
        store = self.store if rank == 0 else TCPStore("127.0.0.1", port, world, is_master=False)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
        self.model = seeded_model()
        for block in self.model:
            fully_shard(block)
        fully_shard(self.model)

    @endpoint
    def publish(self, version: int) -> WeightManifest | int:
        """Rank 0: the manifest of the whole model; another rank: how many tensors it gathered beside it."""
        if current_rank().rank != 0:
            return join_publish(self.model)
        self.publisher = WeightPublisher(self.transport, dtype=torch.bfloat16)
        return self.publisher.publish(self.model, version)

    @endpoint
    def gathered_in_buckets(self, bucket_bytes: int) -> list[torch.Tensor]:
        """The model's tensors gathered whole in buckets of ``bucket_bytes`` (every rank calls)."""
        from actors.tensors._sharded import wholes

        return list(wholes(self.model.state_dict().values(), bucket_bytes))

    def __cleanup__(self, exc: BaseException | None) -> None:
        import torch.distributed as dist

        if self.publisher is not None:
            self.publisher.close()
        if dist.is_initialized():
            dist.destroy_process_group()
