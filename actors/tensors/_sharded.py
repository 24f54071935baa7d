"""Sharded tensors (torch ``DTensor``) as a writer copies them: gathered whole, one at a time.

A model sharded with FSDP2 holds each parameter as a ``DTensor``: this
process's shard, plus the layout of the whole. A writer that copies such a
tensor into its storage gathers it first (:func:`whole`), then drops the
gathered copy before the next one, so publishing a sharded model never holds
more than one whole tensor beyond the shards. Gathering is a collective:
every rank of the tensor's group gathers the same tensors in the same order
(a rank that does not publish runs :func:`gather_each`).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable

import torch

__all__ = ["gather_each", "is_sharded", "whole"]


def _dtensor_type() -> type | None:
    """torch's DTensor class if its module is loaded: no DTensor exists otherwise (importing it costs ~0.6 s)."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def is_sharded(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a torch ``DTensor`` (its bytes spread over a group's ranks)."""
    dtensor = _dtensor_type()
    return dtensor is not None and isinstance(tensor, dtensor)


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` detached; a ``DTensor`` gathered whole first (a collective of its group)."""
    tensor = tensor.detach()
    if is_sharded(tensor):
        return tensor.full_tensor()  # type: ignore[attr-defined, no-any-return]
    return tensor


def gather_each(tensors: Iterable[torch.Tensor]) -> int:
    """Join the gathers a writer runs while it copies ``tensors``: gather each sharded one, drop it; how many."""
    count = 0
    with torch.no_grad():
        for tensor in tensors:
            if is_sharded(tensor):
                whole(tensor)
                count += 1
    return count
