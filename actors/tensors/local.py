"""The ``local`` transport: the update is a private copy in this process's memory.

For single-process tests and tools: it exercises the whole manifest
lifecycle without shared memory. Importing in another process is refused.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

import torch

from .._errors import StaleUpdateError, WeightSyncError
from . import TensorSpec, checksum, layout

# update_id -> tensors, shared by every writer and reader of this process.
_store: dict[str, dict[str, torch.Tensor]] = {}


class LocalWriter:
    def write(
        self, update_id: str, version: int, tensors: list[tuple[str, torch.Tensor]], with_checksums: bool
    ) -> tuple[Any, list[TensorSpec]]:
        copies = {name: tensor.detach().to("cpu", copy=True).contiguous() for name, tensor in tensors}
        specs, _ = layout(list(copies.items()))
        if with_checksums:
            specs = [replace(spec, checksum=checksum(copies[spec.name])) for spec in specs]
        _store[update_id] = copies
        return os.getpid(), specs

    def release(self, update_id: str) -> None:
        _store.pop(update_id, None)

    def reclaimed(self) -> list[str]:
        return []

    def close(self) -> None:
        pass


class LocalReader:
    def __init__(self) -> None:
        self._held: set[str] = set()

    def read(self, update_id: str, version: int, handle: Any, specs: tuple[TensorSpec, ...]) -> dict[str, torch.Tensor]:
        if handle != os.getpid():
            raise WeightSyncError(
                f"a 'local' update can only be imported in the process that published it (pid {handle}); use 'shm'"
            )
        tensors = _store.get(update_id)
        if tensors is None:
            raise StaleUpdateError(f"update {update_id} is no longer held by its publisher")
        self._held.add(update_id)
        return dict(tensors)

    def release(self, update_id: str) -> None:
        self._held.discard(update_id)

    def close(self) -> None:
        self._held.clear()
