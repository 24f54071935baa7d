"""What a role needs of its device: the right one, a GPU allocator that shares well, its memory figures.

Also the run-wide choices every role agrees on: whether there is a
reference (a KL term) and the seed of each rollout's sampling (the dtype
held weights take: :mod:`pipeline.models._held_weights`).
"""

from __future__ import annotations

import os

import torch

from ..config import Config

__all__ = [
    "ALLOCATOR_VARIABLES",
    "CPU",
    "compact_gpu_allocator",
    "peak_gpu_gb",
    "reserved_gpu_gb",
    "role_device",
    "sampling_seed",
    "trainer_rank_device",
    "uses_reference",
]

#: The CPU, where samples travel between processes.
CPU = torch.device("cpu")


def sampling_seed(seed: int, ticket: int) -> int:
    """The seed of rollout ``ticket``'s sampling: the same whichever generator draws it, and when."""
    return (1_000_003 * (seed + 1) + 7_919 * (ticket + 1)) % (2**63)


def uses_reference(config: Config) -> bool:
    """Whether the run has a KL term, so a RefModel (β = 0: no reference process, no reference pass)."""
    return config.hyper("kl_coeff") > 0


def peak_gpu_gb(device: torch.device) -> float | None:
    """The most GPU memory torch's allocator has held for tensors on ``device`` in this process (GiB); None on a CPU."""
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def reserved_gpu_gb(device: torch.device) -> float | None:
    """The most GPU memory torch's caching allocator has reserved from the driver on ``device`` (GiB); None on a CPU.

    What processes sharing a GPU compete for: it includes freed blocks the
    allocator keeps cached, which no other process can use.
    """
    return torch.cuda.max_memory_reserved(device) / 2**30 if device.type == "cuda" else None


#: The variables torch reads its allocator's settings from (the second is the older name).
ALLOCATOR_VARIABLES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")


def compact_gpu_allocator(device: torch.device) -> bool:
    """Have torch's caching allocator on ``device`` grow its segments in place (``expandable_segments``).

    Without it a KV cache that grows a token at a time asks for a new segment
    at each size and keeps the smaller ones cached: a 256 x 256-token rollout
    of a 0.5 B model reserved 29 GB for about 2 GB of tensors, and the trainer
    sharing the GPU ran out of memory (H100, 2026-11-26). Only for processes
    that export no CUDA IPC memory (generators, the reference): the trainer's
    published slots keep ordinary segments. Leaves a user's own setting of
    either allocator variable alone; returns whether it changed anything.
    """
    if device.type != "cuda" or any(os.environ.get(name) for name in ALLOCATOR_VARIABLES):
        return False
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None:  # torch before the accelerator-wide allocator settings
        setter = torch.cuda.memory._set_allocator_settings
    setter("expandable_segments:True")
    return True


def role_device(config: Config, role: str) -> torch.device:
    """The role's device, with torch limited to the run's threads (every role is one process of many)."""
    torch.set_num_threads(config.threads)
    return torch.device(config.device_of(role))


def trainer_rank_device(config: Config, offset: int) -> torch.device:
    """The device of the trainer rank ``offset`` GPUs past the trainer's own on its host: NCCL needs one GPU a rank.

    On CPUs every rank shares the CPU. With the trainer on ``cuda:K`` (or
    ``cuda``: K = 0) the rank takes ``cuda:K+offset``; a host without that
    GPU is refused with a line that names it, before the rank loads anything.
    """
    device = role_device(config, "trainer")
    if device.type != "cuda":
        return device
    index = (device.index or 0) + offset
    count = torch.cuda.device_count()
    if index >= count:
        raise RuntimeError(
            f"--trainer-ranks {config.trainer_ranks} on {config.device_of('trainer')}: a rank needs cuda:{index}, "
            f"but its host has {count} CUDA device(s); one GPU per rank"
        )
    return torch.device("cuda", index)
