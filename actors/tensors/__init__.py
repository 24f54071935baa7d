"""Tensor transports for weight updates: one interface, three ways to share storage.

A transport has a *writer* (publisher side: reserve storage, fill it with a
set of named tensors, keep it alive until released) and a *reader*
(consumer side: rebuild the tensors, zero-copy where the transport allows,
until released). :func:`probe` says whether a transport can run here.

========  =====================================================================
local     copies in this process's memory; for single-process tests
shm       POSIX shared memory: a bounded pool of reused slots, zero-copy import
cuda-ipc  device slots shared by CUDA IPC handles, filled on a side stream and
          ordered for readers by an interprocess CUDA event
tcp       staged in host buffers (pinned for GPU tensors) and streamed to readers
          on other hosts over a dedicated, authenticated, checksummed connection
========  =====================================================================

Publishing is three steps so that only the copy can take time: ``reserve``
(never waits; ``None`` while every slot is held), ``fill`` (copies; touches
only the reserved storage, so it may run off the event loop's thread) and
``commit`` (makes the update visible to readers and returns its handle).
Reading is immediate for the shared-memory transports; ``tcp`` moves the
bytes at read time, so its readers also offer ``read_async``.
"""

from __future__ import annotations

import functools
import zlib
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from .._shared._errors import ManifestError
from .._wire._buffers import DTYPE_NAMES, DTYPES, tensor_buffer, tensor_over
from ._sharded import gather_each, is_sharded, sharded_type
from ._stream import TcpHandle

__all__ = [
    "TRANSPORTS",
    "Reader",
    "TcpHandle",
    "TensorSpec",
    "Writer",
    "check_specs",
    "copy_all",
    "distinct",
    "gather_each",
    "is_sharded",
    "layout",
    "origins",
    "probe",
    "read_async",
    "release_async",
    "ties",
]

TRANSPORTS = ("local", "shm", "cuda-ipc", "tcp")
#: Byte alignment of each tensor inside a shared buffer.
ALIGN = 64


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of an update: where it lives in the transport's storage and what it is."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    nbytes: int
    offset: int
    checksum: int | None = None

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise TypeError(f"tensors of dtype {dtype} cannot be published") from None


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride = []
    step = 1
    for dim in reversed(shape):
        stride.append(step)
        step *= max(dim, 1)
    return tuple(reversed(stride))


@functools.lru_cache(maxsize=64)
def _layout(
    key: tuple[tuple[str, tuple[int, ...], torch.dtype, int | None], ...],
) -> tuple[tuple[TensorSpec, ...], int]:
    specs: list[TensorSpec] = []
    offset = 0
    for name, shape, dtype, tie in key:
        numel = 1
        for dim in shape:
            numel *= dim
        nbytes = numel * dtype.itemsize
        at = offset if tie is None else specs[tie].offset
        specs.append(TensorSpec(name, dtype_name(dtype), shape, _contiguous_stride(shape), nbytes, at))
        if tie is None:
            offset += (nbytes + ALIGN - 1) // ALIGN * ALIGN
    return tuple(specs), offset


def ties(tensors: list[tuple[str, torch.Tensor]]) -> list[int | None]:
    """For each tensor, the index of an earlier one that is the same bytes (a tied output head and the embedding
    it shares), else None. Of a sharded tensor, its shard's storage is compared: every rank finds the same ties.

    Looked up by address first: only tensors that start at an earlier one's address (rare: ties, views) have
    their device, shape, stride and dtype compared (a publish asks this of every tensor, every step).
    """
    at: dict[Any, list[int]] = {}  # address -> the untied tensors that start there
    found: list[int | None] = []
    dtensor = sharded_type()  # looked up once
    for index, (_, tensor) in enumerate(tensors):
        if dtensor is not None and isinstance(tensor, dtensor):  # its shard's storage: no other's, on every rank
            local = tensor.to_local()  # type: ignore[attr-defined]
            address: Any = ("shard", local.untyped_storage()._cdata, local.storage_offset())
        elif pointer := tensor.data_ptr():  # none: an empty (or meta) tensor is no other's bytes
            address = pointer
        else:
            found.append(None)
            continue
        earlier = at.get(address)
        if earlier is None:
            at[address] = [index]
            found.append(None)
            continue
        match = next((i for i in earlier if _same_view(tensors[i][1], tensor, dtensor)), None)
        if match is None:
            earlier.append(index)
        found.append(match)
    return found


def _same_view(first: torch.Tensor, second: torch.Tensor, dtensor: Any) -> bool:
    """Whether two tensors at one address are the same values: one device, shape, stride (a shard's) and dtype,
    and neither read through a lazy conjugate or negation the other lacks (``w.conj()`` is w's bytes, not its
    values)."""
    if first.is_conj() != second.is_conj() or first.is_neg() != second.is_neg():
        return False
    if dtensor is not None and isinstance(first, dtensor):
        a, b = first.to_local(), second.to_local()  # type: ignore[attr-defined]
        return bool(first.shape == second.shape and a.stride() == b.stride() and first.dtype == second.dtype)
    return bool(
        first.device == second.device
        and first.shape == second.shape
        and first.stride() == second.stride()
        and first.dtype == second.dtype
    )


def layout(tensors: list[tuple[str, torch.Tensor]], cast: torch.dtype | None = None) -> tuple[list[TensorSpec], int]:
    """Contiguous, aligned placement of ``tensors`` in one buffer: specs and total bytes.

    With ``cast``, floating-point tensors are described (and so copied) in
    that dtype. A tensor that is another's bytes (:func:`ties`) is laid at
    that one's offset: a tied output head costs no bytes and no copy. Cached
    per (names, shapes, dtypes, ties): a publisher sends the same layout
    every step.
    """
    specs, total = _layout(
        tuple(
            (name, tuple(t.shape), cast if cast is not None and t.is_floating_point() else t.dtype, tie)
            for (name, t), tie in zip(tensors, ties(tensors), strict=True)
        )
    )
    return list(specs), total


def origins(specs: Any) -> list[int]:
    """For each spec, the index of the first spec over the same bytes (itself, unless its tensor is tied to an
    earlier one's): only those are copied. Zero-byte tensors share no bytes."""
    first: dict[int, int] = {}
    return [first.setdefault(spec.offset, index) if spec.nbytes else index for index, spec in enumerate(specs)]


def distinct(specs: Any) -> list[int]:
    """The indices of the specs over bytes of their own (:func:`origins`): what is copied, gathered and counted."""
    return [index for index, origin in enumerate(origins(specs)) if origin == index]


def check_specs(specs: Any, capacity: int) -> tuple[TensorSpec, ...]:
    """``specs`` if they describe tensors lying inside ``capacity`` bytes, else :class:`ManifestError`.

    A reader runs this before it builds any view: a manifest with a wrong
    size, dtype, shape, stride or offset is refused before a byte is read.
    """
    if type(specs) is not tuple:
        raise ManifestError("a manifest's tensors must be a tuple of TensorSpec")
    names = set()
    for spec in specs:
        if type(spec) is not TensorSpec:
            raise ManifestError(f"not a TensorSpec: {type(spec).__name__}")
        what = f"tensor {spec.name!r:.60}"
        if type(spec.name) is not str or spec.name in names:
            raise ManifestError(f"{what}: names must be distinct strings")
        names.add(spec.name)
        dtype = DTYPES.get(spec.dtype) if type(spec.dtype) is str else None
        if dtype is None:
            raise ManifestError(f"{what}: unknown dtype {spec.dtype!r:.40}")
        shape, stride = spec.shape, spec.stride
        if type(shape) is not tuple or not all(type(d) is int and d >= 0 for d in shape):
            raise ManifestError(f"{what}: shape must be a tuple of non-negative ints, not {shape!r:.60}")
        if stride != _contiguous_stride(shape):
            raise ManifestError(f"{what}: stride {stride!r:.60} is not the contiguous stride of shape {shape}")
        numel = 1
        for dim in shape:
            numel *= dim
        if type(spec.nbytes) is not int or spec.nbytes != numel * dtype.itemsize:
            raise ManifestError(f"{what}: {spec.nbytes!r} bytes cannot hold {numel} elements of {spec.dtype}")
        offset = spec.offset
        if type(offset) is not int or offset < 0 or offset % ALIGN or offset + spec.nbytes > capacity:
            raise ManifestError(f"{what}: offset {offset!r} (+{spec.nbytes} bytes) is outside its slot of {capacity}")
        if spec.checksum is not None and type(spec.checksum) is not int:
            raise ManifestError(f"{what}: checksum must be an int")
    return specs  # type: ignore[no-any-return]


def checksum(tensor: torch.Tensor) -> int:
    """CRC-32 of a tensor's bytes (opt-in: costs a pass over memory, and a copy off a GPU)."""
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    if tensor.numel() == 0:
        return 0
    return zlib.crc32(tensor_buffer(tensor))


def copy_all(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """``dst[i].copy_(src[i])`` for every i: one multi-tensor copy where devices and dtypes agree (a cast is a copy)."""
    same = [(d, s) for d, s in zip(dst, src, strict=True) if d.device == s.device]
    foreach = getattr(torch, "_foreach_copy_", None)
    alike = [(d, s) for d, s in same if d.dtype == s.dtype]
    if foreach is not None and alike and alike[0][0].is_cuda:
        foreach([d for d, _ in alike], [s for _, s in alike])
        same = [(d, s) for d, s in same if d.dtype != s.dtype]
    for d, s in same:
        d.copy_(s)
    for d, s in zip(dst, src, strict=True):
        if d.device != s.device:
            d.copy_(s, non_blocking=d.is_cuda and s.is_cuda)


def view(buffer: Any, spec: TensorSpec, base: int = 0) -> torch.Tensor:
    """The tensor ``spec`` describes, as a view over ``buffer`` starting at ``base``."""
    dtype = spec.torch_dtype
    if spec.nbytes == 0:
        return torch.empty(spec.shape, dtype=dtype)
    flat = tensor_over(buffer, torch.uint8, spec.nbytes, base + spec.offset)
    return flat.view(dtype).view(spec.shape)


class Writer(Protocol):
    """Publisher side of a transport."""

    #: True when ``fill`` is a host memory copy, worth running off the event loop's thread.
    host_copy: bool

    def reserve(self, nbytes: int) -> Any | None:
        """Storage for ``nbytes`` of payload, or None while consumers hold every slot. Never waits."""

    async def reserve_async(self, nbytes: int, timeout: float) -> Any:
        """Storage for ``nbytes``, awaiting a free slot up to ``timeout`` s."""

    def reserve_blocking(self, nbytes: int, timeout: float) -> Any:
        """Storage for ``nbytes``, blocking this thread up to ``timeout`` s (outside an event loop)."""

    def fill(
        self, reservation: Any, tensors: list[tuple[str, torch.Tensor]], specs: list[TensorSpec], with_checksums: bool
    ) -> list[TensorSpec]:
        """Copy ``tensors`` into the reservation at ``specs``; returns the specs (with checksums)."""

    def commit(self, reservation: Any, update_id: str, version: int, nbytes: int) -> Any:
        """Make the filled reservation visible to readers as ``update_id``; returns its handle."""

    def abort(self, reservation: Any) -> None:
        """Give back a reservation that will not be committed."""

    def release(self, update_id: str) -> None:
        """The publisher no longer needs ``update_id``; its storage may be reused."""

    def reclaimed(self) -> list[str]:
        """Updates whose storage the writer reused on its own since the last call."""

    def close(self) -> None:
        """Free every resource (segments, device buffers)."""


class Reader(Protocol):
    """Consumer side of a transport."""

    def read(self, update_id: str, version: int, handle: Any, specs: tuple[TensorSpec, ...]) -> dict[str, torch.Tensor]:
        """Rebuild the tensors of one update (views where possible) and hold them."""

    def release(self, update_id: str) -> None:
        """Stop holding ``update_id``; its tensors must no longer be used."""

    def close(self) -> None:
        """Release everything still held."""


async def read_async(
    reader: Reader, update_id: str, version: int, handle: Any, specs: tuple[TensorSpec, ...], timeout: float | None
) -> dict[str, torch.Tensor]:
    """``reader.read`` for code on an event loop: awaited where the reader moves bytes (``tcp``)."""
    fetch = getattr(reader, "read_async", None)
    if fetch is not None:
        return await fetch(update_id, version, handle, specs, timeout)  # type: ignore[no-any-return]
    return reader.read(update_id, version, handle, specs)


async def release_async(reader: Reader, update_id: str) -> None:
    """``reader.release`` for code on an event loop: awaited where the reader must wait for a device (``cuda-ipc``)."""
    release = getattr(reader, "release_async", None)
    if release is not None:
        await release(update_id)
    else:
        reader.release(update_id)


def probe(transport: str) -> str | None:
    """``None`` if ``transport`` can run on this machine, else the reason it cannot."""
    if transport == "local":
        return None
    if transport == "shm":
        from .shm import probe as shm_probe

        return shm_probe()
    if transport == "cuda-ipc":
        from .cuda_ipc import probe as cuda_probe

        return cuda_probe()
    if transport == "tcp":
        return None
    return f"unknown transport {transport!r} (known: {', '.join(TRANSPORTS)})"
