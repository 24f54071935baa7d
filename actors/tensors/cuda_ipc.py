"""The ``cuda-ipc`` transport: device slots shared by CUDA IPC, filled on a side stream.

Writer: a pool of device buffers, one per slot, allocated once per layout
size and reused across versions (the pool and its ``flock`` ownership rules
are the ones ``shm`` uses, kept on a small control segment per slot). Each
buffer is exported once (a CUDA IPC memory handle) together with an
interprocess CUDA event. ``fill`` enqueues the copies on a side stream that
first waits for the producer's current stream, records the slot's event,
and makes the current stream wait on that event, so a later in-place update
of the parameters cannot overtake the copy. The host never waits for the
GPU: no stream or device synchronize on the publishing path.

Reader: opens a slot's memory and event once and caches them by slot name
(a slot that must grow gets a new name, so a layout change is a reopen).
For each update it makes its current stream wait on the slot's event, so
its reads are ordered after the writer's copy, and builds the tensors as
views of the slot. Before it releases an update it waits for its own
stream's reads of the slot to finish, then drops the lock.

GPUs are matched by UUID: a process that cannot see the publisher's GPU
cannot map its memory and gets :class:`TransportBlocked` saying so. The
transport never falls back to another one.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from .._shared._errors import ManifestError, StaleUpdateError, TransportBlocked, WeightSyncError
from . import TensorSpec, check_specs, checksum, copy_all
from ._sharded import is_sharded, wholes
from ._slot_views import SlotViews
from ._slots import LOCK_TIMEOUT, PooledWriter, Slot, SlotHolds, SlotPool, check_segment_name, poll_async

__all__ = ["CudaIpcReader", "CudaIpcWriter", "SlotHandle", "parse_handle", "probe"]

log = logging.getLogger("actors")

#: Bytes in a CUDA IPC event handle.
IPC_HANDLE_BYTES = 64
#: torch frames a memory handle (a version and a type byte, then the handle: 66 bytes for
#: cudaMalloc memory, more for expandable segments): any length up to this is accepted.
MAX_MEM_HANDLE_BYTES = 1 << 20
#: Seconds an awaited release waits for this process's GPU reads of a slot before it gives up (the slot stays held).
RELEASE_TIMEOUT = 120.0
#: A reference-count file that cannot exist: see ``CudaIpcReader._opened``.
_NO_REFCOUNT = b"/actors-cuda-ipc-no-refcount"


def probe() -> str | None:
    """Why this machine cannot run the transport (None if it can), asked without loading the CUDA driver.

    torch counts GPUs through NVML where it can, so a controller that probes
    can still fork its forkserver; the publisher and reader, which use CUDA
    anyway, also check that the driver works (:func:`_usable`).
    """
    if torch.cuda.device_count() == 0:
        return "no CUDA device: torch counts no GPU on this machine"
    return None


def _usable() -> str | None:
    reason = probe()
    if reason is None and not torch.cuda.is_available():
        return (
            "no usable CUDA device: torch counts a GPU, but the CUDA driver does not start (torch.cuda.is_available())"
        )
    return reason


def device_uuid(device: torch.device) -> str:
    """A GPU's identity across processes (indices differ with CUDA_VISIBLE_DEVICES)."""
    return str(torch.cuda.get_device_properties(device).uuid)


@dataclass(frozen=True)
class SlotHandle:
    """What a reader needs to open one device slot: sent, as a plain dict, in every manifest."""

    slot: str  # control segment name (locks and the header)
    capacity: int  # payload bytes of the device buffer
    device: str  # UUID of the GPU holding it
    pid: int  # the exporting process (CUDA cannot open a handle in the process that made it)
    mem: bytes  # torch's CUDA IPC memory handle of the allocation
    size: int  # bytes of the storage inside the allocation
    offset: int  # where the storage starts inside the allocation
    ready: bytes  # torch's event for the buffer's allocation (waited once, at open)
    ready_sync: bool
    event: bytes  # the slot's interprocess event: recorded after every fill

    def to_plain(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


_HANDLE_TYPES: dict[str, tuple[type, ...]] = {
    "slot": (str,),
    "capacity": (int,),
    "device": (str,),
    "pid": (int,),
    "mem": (bytes,),
    "size": (int,),
    "offset": (int,),
    "ready": (bytes,),
    "ready_sync": (bool,),
    "event": (bytes,),
}


def parse_handle(handle: Any) -> SlotHandle:
    """The :class:`SlotHandle` a manifest carries, or :class:`ManifestError` if it is not one."""
    if type(handle) is not dict or set(handle) != set(_HANDLE_TYPES):
        raise ManifestError(f"not a cuda-ipc slot handle: {handle!r:.120}")
    for key, types in _HANDLE_TYPES.items():
        if type(handle[key]) not in types:
            raise ManifestError(f"cuda-ipc handle field {key!r} is a {type(handle[key]).__name__}")
    for key in ("ready", "event"):
        if len(handle[key]) != IPC_HANDLE_BYTES:
            raise ManifestError(f"cuda-ipc handle field {key!r} is not a {IPC_HANDLE_BYTES}-byte IPC event handle")
    if not 2 <= len(handle["mem"]) <= MAX_MEM_HANDLE_BYTES:
        raise ManifestError("cuda-ipc handle field 'mem' is not a CUDA IPC memory handle")
    if min(handle["capacity"], handle["size"], handle["offset"], handle["pid"]) < 0:
        raise ManifestError("cuda-ipc handle sizes and offsets must be non-negative")
    if handle["capacity"] > handle["size"]:
        raise ManifestError("cuda-ipc handle: the slot is larger than its storage")
    check_segment_name(handle["slot"])
    return SlotHandle(**handle)


def _slot_view(base: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    if spec.nbytes == 0:
        return torch.empty(spec.shape, dtype=spec.torch_dtype, device=base.device)
    return base.narrow(0, spec.offset, spec.nbytes).view(spec.torch_dtype).view(spec.shape)


@dataclass(eq=False)
class _DeviceSlot:
    buffer: torch.Tensor  # uint8 [capacity] on the writer's GPU
    event: torch.cuda.Event  # interprocess; recorded after each fill
    handle: SlotHandle
    views: SlotViews = field(default_factory=SlotViews)  # the buffer's tensors by layout


class CudaIpcWriter(PooledWriter):
    """Publisher side: a pool of device slots on ``device`` (default: the current GPU)."""

    host_copy = False

    def __init__(
        self, slots: int = 2, lock_timeout: float = LOCK_TIMEOUT, device: int | str | torch.device | None = None
    ) -> None:
        reason = _usable()
        if reason:
            raise TransportBlocked("cuda-ipc", reason)
        self.device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"a cuda-ipc publisher needs a CUDA device, not {self.device}")
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._uuid = device_uuid(self.device)
        self._stream: torch.cuda.Stream | None = None
        pool = SlotPool(slots, kind="g", payload_in_segment=False, allocate=self._allocate, free=self._free)
        super().__init__(pool, lock_timeout)

    def _allocate(self, slot: Slot) -> None:
        device = self.device
        with torch.cuda.device(device):
            buffer = torch.empty(max(slot.capacity, 1), dtype=torch.uint8, device=device)
            shared = buffer.untyped_storage()._share_cuda_()  # type: ignore[attr-defined,no-untyped-call]
            _, mem, size, offset, refcount, refcount_offset, ready, ready_sync = shared
            # Readers are ordered by this transport's locks and events, not by torch's
            # per-send reference counts: give the export's count back at once (1 -> 0),
            # so the buffer is freed like any other when the pool drops it.
            try:
                torch.UntypedStorage._release_ipc_counter_cuda(refcount, refcount_offset)  # type: ignore[attr-defined]
            except (AttributeError, RuntimeError, TypeError) as exc:
                log.warning("cuda-ipc: could not return torch's IPC reference count (%s)", exc)
            event = torch.cuda.Event(interprocess=True)  # type: ignore[no-untyped-call]
            event.record(torch.cuda.current_stream(device))
            handle = SlotHandle(
                slot.name,
                slot.capacity,
                self._uuid,
                os.getpid(),
                bytes(mem),
                int(size),
                int(offset),
                bytes(ready),
                bool(ready_sync),
                bytes(event.ipc_handle()),  # type: ignore[no-untyped-call]
            )
        slot.storage = _DeviceSlot(buffer, event, handle)

    def _free(self, slot: Slot) -> None:
        slot.storage = None

    def _side_stream(self) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self.device)  # type: ignore[no-untyped-call]
        return self._stream

    def fill(
        self, slot: Slot, tensors: list[tuple[str, torch.Tensor]], specs: list[TensorSpec], with_checksums: bool
    ) -> list[TensorSpec]:
        device = self.device
        storage: _DeviceSlot = slot.storage
        side = self._side_stream()
        current = torch.cuda.current_stream(device)
        side.wait_stream(current)  # the sources as they are now, e.g. after the optimizer step
        for other in {t.device for _, t in tensors if t.is_cuda and t.device != device}:
            side.wait_stream(torch.cuda.current_stream(other))
        dst, src = [], []
        targets = storage.views.of(specs, lambda spec: _slot_view(storage.buffer, spec))
        sources = wholes(t for _, t in tensors)
        for spec, (_, tensor), target, gathered in zip(specs, tensors, targets, sources, strict=True):
            if not spec.nbytes:
                continue
            if is_sharded(tensor):  # gathered whole (a bucket at a time) and copied at once
                side.wait_stream(torch.cuda.current_stream(gathered.device))
                with torch.cuda.device(device), torch.cuda.stream(side):
                    target.copy_(gathered)
                if gathered.device == device:
                    gathered.record_stream(side)  # freed when the loop moves on: not reused mid-copy
                continue
            dst.append(target)
            src.append(gathered)
        with torch.cuda.device(device), torch.cuda.stream(side):
            copy_all(dst, src)
            storage.event.record(side)
        for tensor in src:
            if tensor.device == device:
                tensor.record_stream(side)  # a caller freeing a temporary source cannot hand it out mid-copy
        current.wait_event(storage.event)  # later in-place updates of the sources wait for the copy
        if not with_checksums:
            return specs
        storage.event.synchronize()
        return [replace(spec, checksum=checksum(_slot_view(storage.buffer, spec))) for spec in specs]

    def commit(self, slot: Slot, update_id: str, version: int, nbytes: int) -> dict[str, Any]:
        self._pool.commit(slot, update_id, version, nbytes)
        return slot.storage.handle.to_plain()  # type: ignore[no-any-return]

    def close(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()  # copies still queued write into buffers about to be freed
        super().close()
        self._stream = None


@dataclass(eq=False)
class _OpenSlot:
    mem: bytes  # the memory handle it was opened from
    base: torch.Tensor  # uint8 view of the whole slot, in this process
    event: torch.cuda.Event
    device: int  # this process's index of the slot's GPU
    views: SlotViews = field(default_factory=SlotViews)  # the slot's tensors by layout, checked once


class CudaIpcReader:
    """Consumer side: slots opened once and cached; reads ordered after the writer's event."""

    def __init__(self) -> None:
        reason = _usable()
        if reason:
            raise TransportBlocked("cuda-ipc", reason)
        self._holds = SlotHolds(map_payload=False, on_forget=self._forget)
        self._open: dict[str, _OpenSlot] = {}
        self._held: dict[str, str] = {}  # update_id -> slot name
        self._devices: dict[str, int] | None = None  # GPU UUID -> this process's index

    @property
    def open_slots(self) -> int:
        """Device slots this reader has mapped (each is one open CUDA IPC memory handle)."""
        return len(self._open)

    def read(self, update_id: str, version: int, handle: Any, specs: tuple[TensorSpec, ...]) -> dict[str, torch.Tensor]:
        parsed = parse_handle(handle)
        _, nbytes = self._holds.hold(parsed.slot, update_id, version)
        try:
            capacity = min(nbytes, parsed.capacity)
            known = self._open.get(parsed.slot)
            opening = known is None or known.mem != parsed.mem
            if opening:
                check_specs(specs, capacity)  # before a slot is opened
            opened = self._opened(parsed)
            made = opened.views.of(
                specs,
                lambda spec: _slot_view(opened.base, spec),
                None if opening else lambda: check_specs(specs, capacity),  # an opened slot knows checked layouts
            )
            torch.cuda.current_stream(opened.device).wait_event(opened.event)
            tensors = {spec.name: tensor for spec, tensor in zip(specs, made, strict=True)}
        except BaseException:
            self._holds.unhold(parsed.slot)
            raise
        self._holds.keep(self._held, update_id, parsed.slot)
        return tensors

    def _local_device(self, uuid: str) -> int:
        if self._devices is None:
            self._devices = {
                device_uuid(torch.device("cuda", index)): index for index in range(torch.cuda.device_count())
            }
        index = self._devices.get(uuid)
        if index is None:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES", "<all>")
            raise TransportBlocked(
                "cuda-ipc",
                f"the publisher's GPU {uuid} is not visible in this process (CUDA_VISIBLE_DEVICES={visible}); "
                "CUDA IPC shares memory only between processes that can both see the GPU",
            )
        return index

    def _opened(self, handle: SlotHandle) -> _OpenSlot:
        opened = self._open.get(handle.slot)
        if opened is not None and opened.mem == handle.mem:
            return opened
        if opened is not None:
            self._forget(handle.slot)
        if handle.pid == os.getpid():
            raise TransportBlocked(
                "cuda-ipc",
                "CUDA cannot open an IPC handle in the process that exported it: install in another process",
            )
        device = self._local_device(handle.device)
        try:
            with torch.cuda.device(device):
                # torch's deleter for this storage decrements the reference count it is
                # given; the writer already returned the real one (a second decrement would
                # wrap it and strand the buffer), so it is given a count that cannot exist,
                # the path torch itself takes when the producer has gone.
                storage = torch.UntypedStorage._new_shared_cuda(  # type: ignore[attr-defined]
                    device,
                    handle.mem,
                    handle.size,
                    handle.offset,
                    _NO_REFCOUNT,
                    0,
                    handle.ready,
                    handle.ready_sync,
                )
                base = torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", device)).set_(storage)
                event = torch.cuda.Event.from_ipc_handle(device, handle.event)  # type: ignore[no-untyped-call]
        except RuntimeError as exc:  # the publisher freed the slot or exited
            raise StaleUpdateError(f"could not open CUDA IPC slot {handle.slot}: {exc}") from exc
        if base.numel() < handle.capacity:
            raise ManifestError(f"CUDA IPC slot {handle.slot} is smaller than its handle says")
        opened = self._open[handle.slot] = _OpenSlot(handle.mem, base, event, device)
        return opened

    def _forget(self, name: str) -> None:
        self._open.pop(name, None)

    def release(self, update_id: str) -> None:
        name = self._held.pop(update_id, None)
        if name is None:
            return
        opened = self._open.get(name)
        if opened is not None:
            # The writer may rewrite the slot as soon as the lock drops: our reads
            # of it (installs, or generation over aliased weights) finish first.
            try:
                torch.cuda.current_stream(opened.device).synchronize()
            except BaseException:  # (a Ctrl-C, a device error): still held, and a later release tries again
                self._held[update_id] = name
                raise
        self._holds.unhold(name)

    async def release_async(self, update_id: str) -> None:
        """:meth:`release` for an event loop: the wait for this process's reads of the slot is awaited, not blocked on.

        The reads queued on the current stream so far are marked with an event,
        polled between turns of the loop; the lock drops once they are done. A
        GPU that does not get there within :data:`RELEASE_TIMEOUT` s leaves the
        slot held (its bytes may still be read) and raises.
        """
        name = self._held.pop(update_id, None)
        if name is None:
            return
        opened = self._open.get(name)
        if opened is not None:
            read = torch.cuda.Event()  # type: ignore[no-untyped-call]
            read.record(torch.cuda.current_stream(opened.device))
            try:
                await poll_async(lambda: True if read.query() else None, RELEASE_TIMEOUT, self._reads_stuck)  # type: ignore[no-untyped-call]
            except BaseException:
                self._held[update_id] = name  # still held: a later release (or close) tries again
                raise
        self._holds.unhold(name)

    @staticmethod
    def _reads_stuck(timeout: float) -> WeightSyncError:
        return WeightSyncError(f"this process's GPU reads of a weight slot did not finish within {timeout:g}s")

    def close(self) -> None:
        for update_id in list(self._held):
            try:
                self.release(update_id)
            except RuntimeError as exc:  # a device error must not keep the locks
                log.warning("cuda-ipc: releasing %s: %s", update_id, exc)
        self._held.clear()
        self._holds.close()
        self._open.clear()
