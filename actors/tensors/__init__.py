"""Tensor transports for weight updates: one interface, three ways to share storage.

A transport has a *writer* (publisher side: place a set of named tensors
somewhere a consumer can reach, keep it alive until released) and a *reader*
(consumer side: rebuild the tensors, zero-copy where the transport allows,
until released). :func:`probe` says whether a transport can run here.

========  =====================================================================
local     copies in this process's memory; for single-process tests
shm       POSIX shared memory: a bounded pool of reused slots, zero-copy import
cuda-ipc  PyTorch CUDA IPC handles; the writer keeps the storage alive
========  =====================================================================
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from .._codec import _DTYPE_NAMES, _DTYPES, tensor_buffer

__all__ = ["TRANSPORTS", "Reader", "TensorSpec", "Writer", "probe"]

TRANSPORTS = ("local", "shm", "cuda-ipc")
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
        return _DTYPES[self.dtype]


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise TypeError(f"tensors of dtype {dtype} cannot be published") from None


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride = []
    step = 1
    for dim in reversed(shape):
        stride.append(step)
        step *= max(dim, 1)
    return tuple(reversed(stride))


_layouts: dict[tuple[Any, ...], tuple[list[TensorSpec], int]] = {}


def layout(tensors: list[tuple[str, torch.Tensor]]) -> tuple[list[TensorSpec], int]:
    """Contiguous, aligned placement of ``tensors`` in one buffer: specs and total bytes.

    Cached per (names, shapes, dtypes): a publisher sends the same layout every step.
    """
    key = tuple((name, tuple(t.shape), t.dtype) for name, t in tensors)
    cached = _layouts.get(key)
    if cached is not None:
        return list(cached[0]), cached[1]
    specs = []
    offset = 0
    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        shape = tuple(tensor.shape)
        specs.append(TensorSpec(name, dtype_name(tensor.dtype), shape, _contiguous_stride(shape), nbytes, offset))
        offset += (nbytes + ALIGN - 1) // ALIGN * ALIGN
    if len(_layouts) < 64:
        _layouts[key] = (specs, offset)
    return list(specs), offset


def checksum(tensor: torch.Tensor) -> int:
    """CRC-32 of a contiguous CPU tensor's bytes (opt-in: costs a pass over memory)."""
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    if tensor.numel() == 0:
        return 0
    return zlib.crc32(tensor_buffer(tensor))


def view(buffer: Any, spec: TensorSpec, base: int = 0) -> torch.Tensor:
    """The tensor ``spec`` describes, as a view over ``buffer`` starting at ``base``."""
    dtype = spec.torch_dtype
    if spec.nbytes == 0:
        return torch.empty(spec.shape, dtype=dtype)
    flat = torch.frombuffer(buffer, dtype=torch.uint8, count=spec.nbytes, offset=base + spec.offset)
    return flat.view(dtype).view(spec.shape)


class Writer(Protocol):
    """Publisher side of a transport."""

    def write(
        self, update_id: str, version: int, tensors: list[tuple[str, torch.Tensor]], with_checksums: bool
    ) -> tuple[Any, list[TensorSpec]]:
        """Place ``tensors``; return the handle a reader needs and their specs."""

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
    return f"unknown transport {transport!r} (known: {', '.join(TRANSPORTS)})"
