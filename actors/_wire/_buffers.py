"""Tensors as raw memory: dtype names on the wire, zero-copy byte views, tensors over received bytes.

Nothing here copies: an outgoing tensor's bytes are exposed as a
``memoryview`` that keeps the tensor alive, and an incoming frame (or a
read-only shared-memory mapping) becomes a tensor over that same memory.
"""

from __future__ import annotations

import ctypes
import warnings
from typing import Any

import torch

__all__ = ["DTYPES", "DTYPE_NAMES", "ITEMSIZE", "tensor_buffer", "tensor_over"]

#: The dtypes that may cross a process boundary, by wire name (``"float32"``...).
DTYPES: dict[str, torch.dtype] = {
    str(dt).removeprefix("torch."): dt
    for dt in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
        torch.complex64,
        torch.complex128,
    )
}
DTYPE_NAMES = {dt: name for name, dt in DTYPES.items()}
ITEMSIZE = {dt: dt.itemsize for dt in DTYPES.values()}


class _TensorBuffer:
    """A zero-copy buffer over a contiguous CPU tensor that keeps it alive."""

    @staticmethod
    def of(tensor: torch.Tensor, nbytes: int) -> memoryview:
        array = (ctypes.c_char * nbytes).from_address(tensor.data_ptr())
        array._owner = tensor  # type: ignore[attr-defined]  # keep the storage alive
        return memoryview(array).cast("B")


def tensor_buffer(tensor: torch.Tensor, nbytes: int | None = None) -> memoryview:
    """A byte view over a contiguous CPU tensor's memory, keeping the tensor alive."""
    return _TensorBuffer.of(tensor, tensor.numel() * tensor.element_size() if nbytes is None else nbytes)


class _ReadOnlyWarning:
    """torch warns, once per process, that a tensor over read-only memory must not be written.

    Received frames and shared-memory slots are read-only by design and their
    owners know it, so that one warning is absorbed where it happens; no
    process-wide warning filter is changed.
    """

    seen = False


def tensor_over(buffer: Any, dtype: torch.dtype, count: int, offset: int = 0) -> torch.Tensor:
    """A 1-d tensor over ``count`` elements of ``buffer`` from byte ``offset``, sharing its memory."""
    if _ReadOnlyWarning.seen or (type(buffer) is not bytes and not memoryview(buffer).readonly):
        return torch.frombuffer(buffer, dtype=dtype, count=count, offset=offset)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        tensor = torch.frombuffer(buffer, dtype=dtype, count=count, offset=offset)
    _ReadOnlyWarning.seen = True
    return tensor
