"""Sharded tensors (torch ``DTensor``) as a writer copies them: gathered whole, a bucket at a time.

A model sharded with FSDP2 holds each parameter as a ``DTensor``: this
process's shard, plus the layout of the whole. A writer that copies such
tensors into its storage gathers them first (:func:`wholes`), a bucket of
up to :data:`BUCKET_BYTES` in one collective (one per tensor costs a
network round trip each: 34 ms for a 26-tensor model over gloo, measured),
and drops each gathered tensor once copied, so publishing a sharded model
never holds more than a bucket beyond the shards. Gathering is a
collective: every rank of the group gathers the same tensors in the same
order (a rank that does not publish runs :func:`gather_each`).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable, Iterator
from typing import Any

import torch

__all__ = ["BUCKET_BYTES", "gather_each", "is_sharded", "wholes"]

#: Shards gathered in one collective, at most (bytes of the whole tensors).
BUCKET_BYTES = 64 << 20


def sharded_type() -> type | None:
    """torch's DTensor class if its module is loaded: no DTensor exists otherwise (importing it costs ~0.6 s)."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def is_sharded(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a torch ``DTensor`` (its bytes spread over a group's ranks)."""
    dtensor = sharded_type()
    return dtensor is not None and isinstance(tensor, dtensor)


def _rows_sharded(tensor: Any) -> bool:
    """A DTensor split by rows over a one-dimensional mesh (FSDP2's layout): what a bucket gathers."""
    from torch.distributed.tensor import Shard

    placements = tensor.placements
    return tensor.device_mesh.ndim == 1 and len(placements) == 1 and placements[0] == Shard(0) and tensor.dim() > 0


def wholes(tensors: Iterable[torch.Tensor], bucket_bytes: int = BUCKET_BYTES) -> Iterator[torch.Tensor]:
    """Each of ``tensors`` whole, in order: sharded ones gathered (and detached) a bucket at a time, a collective.

    The others are given as they are: writers copy from them under ``no_grad``."""
    dtensor = sharded_type()
    if dtensor is None:  # no DTensor exists in this process: the tensors as they are
        yield from tensors
        return
    bucket: list[Any] = []
    size = 0
    for given in tensors:
        if not isinstance(given, dtensor):
            yield from _gathered(bucket)
            bucket, size = [], 0
            yield given
            continue
        tensor: Any = given.detach()  # a DTensor's attributes are not Tensor's
        if not _rows_sharded(tensor):  # another layout: torch gathers it alone
            yield from _gathered(bucket)
            bucket, size = [], 0
            yield tensor.full_tensor()
            continue
        nbytes = tensor.numel() * tensor.element_size()
        first = bucket[0] if bucket else None
        if first is not None and (
            size + nbytes > bucket_bytes or tensor.dtype != first.dtype or tensor.device_mesh != first.device_mesh
        ):
            yield from _gathered(bucket)
            bucket, size = [], 0
        bucket.append(tensor)
        size += nbytes
    yield from _gathered(bucket)


def _gathered(bucket: list[Any]) -> Iterator[torch.Tensor]:
    """The row-sharded DTensors of ``bucket`` whole, from one ``all_gather`` of every rank's padded shards.

    Rank r holds rows [r c, (r + 1) c) of each tensor, c = ceil(rows / world)
    (``torch.chunk``'s split, FSDP2's and DTensor's), the last ranks fewer or
    none: each pads its shards to c rows, so every rank sends as many bytes.
    """
    if not bucket:
        return
    import torch.distributed as dist

    mesh = bucket[0].device_mesh
    world, group = mesh.size(), mesh.get_group()
    device = bucket[0].to_local().device
    chunks = [-(-t.shape[0] // world) for t in bucket]
    widths = [chunk * math.prod(t.shape[1:]) for chunk, t in zip(chunks, bucket, strict=True)]
    send = torch.zeros(sum(widths), dtype=bucket[0].dtype, device=device)
    offset = 0
    for t, width in zip(bucket, widths, strict=True):
        local = t.to_local().reshape(-1)
        send[offset : offset + local.numel()].copy_(local)
        offset += width
    received = [torch.empty_like(send) for _ in range(world)]
    dist.all_gather(received, send, group=group)
    offset = 0
    for t, chunk, width in zip(bucket, chunks, widths, strict=True):
        rows, row = t.shape[0], math.prod(t.shape[1:])
        parts = [received[r][offset : offset + max(0, min(chunk, rows - r * chunk)) * row] for r in range(world)]
        offset += width
        yield torch.cat(parts).view(t.shape)


def gather_each(tensors: Iterable[torch.Tensor]) -> int:
    """Join the gathers a writer runs while it copies ``tensors`` (the same buckets, in order); how many it gathered."""
    tensors = list(tensors)
    with torch.no_grad():
        for _ in wholes(tensors):
            pass  # each gathered tensor is dropped at once, as a writer drops it once copied
    return sum(is_sharded(tensor) for tensor in tensors)
