"""The ``local`` transport: the update is a private copy in this process's memory.

For single-process tests and tools: it exercises the whole manifest
lifecycle without shared memory. Importing in another process is refused.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

import torch

from .._shared._errors import ManifestError, StaleUpdateError, WeightSyncError
from . import TensorSpec, check_specs, checksum, origins
from ._sharded import wholes

# update_id -> tensors, shared by every writer and reader of this process: the
# transport's whole point is that both ends live here.
_store: dict[str, dict[str, torch.Tensor]] = {}


class LocalWriter:
    host_copy = True
    lock_timeout = 0.0

    def __init__(self) -> None:
        self._committed: set[str] = set()  # this writer's updates in the store, freed at close

    def reserve(self, nbytes: int) -> dict[str, torch.Tensor]:
        return {}

    async def reserve_async(self, nbytes: int, timeout: float) -> dict[str, torch.Tensor]:
        return {}

    def reserve_blocking(self, nbytes: int, timeout: float) -> dict[str, torch.Tensor]:
        return {}

    def fill(
        self,
        copies: dict[str, torch.Tensor],
        tensors: list[tuple[str, torch.Tensor]],
        specs: list[TensorSpec],
        with_checksums: bool,
    ) -> list[TensorSpec]:
        for spec, source in zip(specs, wholes(t for _, t in tensors), strict=True):
            copies[spec.name] = source.to("cpu", dtype=spec.torch_dtype, copy=True).contiguous()
        if with_checksums:
            specs = [replace(spec, checksum=checksum(copies[spec.name])) for spec in specs]
        return specs

    def commit(self, copies: dict[str, torch.Tensor], update_id: str, version: int, nbytes: int) -> int:
        _store[update_id] = copies
        self._committed.add(update_id)
        return os.getpid()

    def abort(self, copies: dict[str, torch.Tensor]) -> None:
        copies.clear()

    def release(self, update_id: str) -> None:
        _store.pop(update_id, None)
        self._committed.discard(update_id)

    def reclaimed(self) -> list[str]:
        return []

    def close(self) -> None:
        for update_id in self._committed:
            _store.pop(update_id, None)
        self._committed.clear()


class LocalReader:
    def __init__(self) -> None:
        self._held: set[str] = set()

    def read(self, update_id: str, version: int, handle: Any, specs: tuple[TensorSpec, ...]) -> dict[str, torch.Tensor]:
        if type(handle) is not int:
            raise ManifestError(f"a 'local' handle is the publishing pid, not {handle!r:.60}")
        if handle != os.getpid():
            raise WeightSyncError(
                f"a 'local' update can only be imported in the process that published it (pid {handle}); use 'shm'"
            )
        tensors = _store.get(update_id)
        if tensors is None:
            raise StaleUpdateError(f"update {update_id} is no longer held by its publisher")
        check_specs(specs, 1 << 62)  # the bytes are private tensors: only their shapes and dtypes must agree
        out = {}
        for spec, origin in zip(specs, origins(specs), strict=True):
            tensor = tensors.get(specs[origin].name)  # a tied tensor is its twin's copy
            if tensor is None or tuple(tensor.shape) != spec.shape or tensor.dtype != spec.torch_dtype:
                raise ManifestError(f"tensor {spec.name!r} does not match what update {update_id} holds")
            out[spec.name] = tensor
        self._held.add(update_id)
        return out

    def release(self, update_id: str) -> None:
        self._held.discard(update_id)

    def close(self) -> None:
        self._held.clear()
