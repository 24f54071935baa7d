"""Checkpoints: the trainer's state in ``<run_dir>/checkpoint.pt``, written atomically.

A checkpoint is replaced by rename, so a run killed at any moment (Ctrl-C,
``kill -9``) leaves the previous one intact and loadable. Loading uses
``torch.load(weights_only=True)``: tensors and plain containers only, onto
the CPU (the roles move them to their devices), so a run resumes on any machine.
"""

from __future__ import annotations

import os
from typing import Any

import torch

FILENAME = "checkpoint.pt"


def path(run_dir: str) -> str:
    return os.path.join(run_dir, FILENAME)


def save(run_dir: str, state: dict[str, Any]) -> str:
    """Write ``state`` atomically; a no-op without a run directory."""
    if not run_dir:
        return ""
    target = path(run_dir)
    tmp = f"{target}.tmp-{os.getpid()}"
    torch.save(state, tmp)
    os.replace(tmp, target)
    return target


def load(run_dir: str) -> dict[str, Any]:
    target = path(run_dir)
    if not os.path.exists(target):
        raise FileNotFoundError(f"no checkpoint in {run_dir!r} to resume from")
    state: dict[str, Any] = torch.load(target, weights_only=True, map_location="cpu")
    return state


def exists(run_dir: str) -> bool:
    return bool(run_dir) and os.path.exists(path(run_dir))
