"""The ``cuda-ipc`` transport: PyTorch CUDA IPC handles, no copy on the consumer side.

The writer copies each tensor into a device buffer it owns (so training can
go on updating its own parameters) and exports the buffer's IPC handle; the
manifest carries the handles as plain values. The buffers stay alive until
the writer releases the update. The reader reopens each handle with
PyTorch's own rebuild function; classes named in a handle are resolved from
a fixed list, never imported.

Without CUDA the transport reports itself blocked; it never falls back.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch.multiprocessing import reductions

from .._codec import _DTYPE_NAMES, _DTYPES
from .._errors import StaleUpdateError, TransportBlocked, WeightSyncError
from . import TensorSpec, checksum, layout

_CLASSES: dict[str, Any] = {
    "torch.Tensor": torch.Tensor,
    "torch.nn.parameter.Parameter": torch.nn.Parameter,
    "torch.storage.UntypedStorage": torch.storage.UntypedStorage,
    "torch.UntypedStorage": torch.UntypedStorage,
    "torch.storage.TypedStorage": torch.storage.TypedStorage,
}


def probe() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device: torch.cuda.is_available() is False"
    return None


def _class_name(cls: Any) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _export(tensor: torch.Tensor) -> list[Any]:
    """The rebuild arguments of a CUDA tensor as plain values."""
    rebuild, args = reductions.reduce_tensor(tensor)  # type: ignore[no-untyped-call]
    if rebuild is not reductions.rebuild_cuda_tensor:
        raise WeightSyncError(f"tensor on {tensor.device} cannot be shared through CUDA IPC")
    out: list[Any] = []
    for arg in args:
        if isinstance(arg, type):
            out.append(["class", _class_name(arg)])
        elif isinstance(arg, torch.dtype):
            out.append(["dtype", _DTYPE_NAMES[arg]])
        elif isinstance(arg, torch.Size):
            out.append(["size", list(arg)])
        elif isinstance(arg, tuple):
            out.append(["tuple", list(arg)])
        else:
            out.append(["value", arg])
    return out


def _import(exported: list[Any]) -> torch.Tensor:
    args: list[Any] = []
    for kind, value in exported:
        if kind == "class":
            if value not in _CLASSES:
                raise WeightSyncError(f"refusing to rebuild a CUDA tensor with class {value!r}")
            args.append(_CLASSES[value])
        elif kind == "dtype":
            args.append(_DTYPES[value])
        elif kind == "size":
            args.append(torch.Size(value))
        elif kind == "tuple":
            args.append(tuple(value))
        else:
            args.append(value)
    return reductions.rebuild_cuda_tensor(*args)  # type: ignore[no-untyped-call,no-any-return]


class CudaIpcWriter:
    """Publisher side: device buffers per update, shared by IPC handle until released."""

    def __init__(self, device: int | str | torch.device | None = None) -> None:
        reason = probe()
        if reason:
            raise TransportBlocked("cuda-ipc", reason)
        self.device = torch.device(device if device is not None else f"cuda:{torch.cuda.current_device()}")
        self._live: dict[str, list[torch.Tensor]] = {}

    def write(
        self, update_id: str, version: int, tensors: list[tuple[str, torch.Tensor]], with_checksums: bool
    ) -> tuple[Any, list[TensorSpec]]:
        specs, _ = layout(tensors)
        buffers = [t.detach().to(self.device, copy=True).contiguous() for _, t in tensors]
        torch.cuda.current_stream(self.device).synchronize()
        if with_checksums:
            specs = [replace(spec, checksum=checksum(buf)) for spec, buf in zip(specs, buffers, strict=True)]
        self._live[update_id] = buffers
        return [_export(buf) for buf in buffers], specs

    def release(self, update_id: str) -> None:
        self._live.pop(update_id, None)

    def reclaimed(self) -> list[str]:
        return []

    def close(self) -> None:
        self._live.clear()
        torch.cuda.empty_cache()


class CudaIpcReader:
    """Consumer side: tensors rebuilt over the publisher's device memory."""

    def __init__(self) -> None:
        reason = probe()
        if reason:
            raise TransportBlocked("cuda-ipc", reason)
        self._held: dict[str, dict[str, torch.Tensor]] = {}

    def read(self, update_id: str, version: int, handle: Any, specs: tuple[TensorSpec, ...]) -> dict[str, torch.Tensor]:
        if type(handle) is not list or len(handle) != len(specs):
            raise WeightSyncError("malformed cuda-ipc handle list")
        try:
            tensors = {spec.name: _import(exported) for spec, exported in zip(specs, handle, strict=True)}
        except RuntimeError as exc:  # the publisher released the buffers or exited
            raise StaleUpdateError(f"could not open the CUDA IPC handles of update {update_id}: {exc}") from exc
        self._held[update_id] = tensors
        return dict(tensors)

    def release(self, update_id: str) -> None:
        self._held.pop(update_id, None)

    def close(self) -> None:
        self._held.clear()
