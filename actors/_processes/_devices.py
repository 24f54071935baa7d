"""GPUs for proc meshes: a mesh with a ``gpus`` dimension gives each process its own device.

As in Monarch, a process's coordinate along ``gpus`` picks its GPU, handed
to it as ``CUDA_VISIBLE_DEVICES`` before anything in it touches CUDA, so
``cuda:0`` in every process is that process's own GPU. The GPUs to hand out
are the spawning process's own (its ``CUDA_VISIBLE_DEVICES``, else every
device torch counts). With fewer GPUs than the dimension's size, processes
share them round-robin; on a host without GPUs, ``gpus`` is only a
dimension name and the environment is left alone (Monarch's examples use it
that way on CPU machines).

A controller counts GPUs without loading the CUDA driver (torch asks NVML
first): once the driver is loaded, a fork of the process cannot use CUDA,
and its forkserver has to start as a fresh interpreter instead
(:func:`cuda_driver_loaded` is how it tells).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from .._runtime._value_mesh import coordinates

__all__ = ["GPU_DIM", "cuda_driver_loaded", "gpu_env", "visible_gpus"]

#: The mesh dimension whose coordinate picks a process's GPU.
GPU_DIM = "gpus"


def visible_gpus() -> list[str]:
    """The GPUs this process may hand to the processes it spawns, as ``CUDA_VISIBLE_DEVICES`` entries."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [entry.strip() for entry in listed.split(",") if entry.strip()]
    import torch

    # device_count, not is_available: torch counts through NVML where it can, leaving the driver unloaded
    return [str(index) for index in range(torch.cuda.device_count())]


def cuda_driver_loaded() -> bool:
    """Whether this process has the CUDA driver (``libcuda``) mapped: a fork of it could not use CUDA.

    Raises ``OSError`` where ``/proc/self/maps`` cannot be read.
    """
    with open("/proc/self/maps") as maps:
        return "libcuda.so" in maps.read()


def gpu_env(extent: Mapping[str, int], rank: int, gpus: list[str]) -> dict[str, str]:
    """The environment that gives process ``rank`` of a mesh of ``extent`` its GPU (empty if none)."""
    if GPU_DIM not in extent or not gpus:
        return {}
    index = coordinates(rank, extent)[GPU_DIM]
    return {"CUDA_VISIBLE_DEVICES": gpus[index % len(gpus)]}
