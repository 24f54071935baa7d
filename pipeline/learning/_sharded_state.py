"""A sharded policy's state on disk and between layouts, through ``torch.distributed.checkpoint``.

Imported only by learners that shard, or that load a sharded checkpoint:
torch's module costs ~0.6 s to import, which every role process would pay.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as load_distributed
from torch.distributed.checkpoint.state_dict_saver import save as save_distributed

__all__ = ["load_shards", "missing_files", "moments", "restore_moments", "save_shards", "whole_policy_state"]

#: A sharded policy gathered whole into host memory, on rank 0 only.
WHOLE_ON_HOST = StateDictOptions(full_state_dict=True, cpu_offload=True)


def save_shards(policy: torch.nn.Module, optim: torch.optim.Optimizer, folder: str) -> None:
    """Write ``policy`` and ``optim`` into ``folder``: each rank of a sharded group its shards, else whole."""
    model_state, optim_state = get_state_dict(policy, optim)
    alone = not torch.distributed.is_initialized()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        save_distributed({"policy": model_state, "optimizer": optim_state}, checkpoint_id=folder, no_dist=alone)


def missing_files(folder: str) -> list[str]:
    """The files of a saved checkpoint in ``folder`` that are not there (ranks on other hosts wrote to their disks)."""
    files = {info.relative_path for info in FileSystemReader(folder).read_metadata().storage_data.values()}
    return sorted(name for name in files if not os.path.exists(os.path.join(folder, name)))


def load_shards(policy: torch.nn.Module, optim: torch.optim.Optimizer, folder: str) -> None:
    """Read what :func:`save_shards` wrote into ``policy`` and ``optim``, whatever the ranks then and now."""
    model_state, optim_state = get_state_dict(policy, optim)
    alone = not torch.distributed.is_initialized()  # one trainer, or replicas before their group forms
    with warnings.catch_warnings():  # torch warns that it assumes one process: it is told so
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        load_distributed({"policy": model_state, "optimizer": optim_state}, checkpoint_id=folder, no_dist=alone)
    set_state_dict(policy, optim, model_state_dict=model_state, optim_state_dict=optim_state)


def whole_policy_state(policy: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A sharded ``policy``'s tensors gathered whole into rank 0's host memory (every rank calls; others get none)."""
    gathered: dict[str, Any] = get_model_state_dict(policy, options=WHOLE_ON_HOST)
    return gathered


def moments(policy: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """``optim``'s state keyed by parameter name (which survives sharding; positions and objects do not)."""
    return get_optimizer_state_dict(policy, optim)


def restore_moments(policy: torch.nn.Module, optim: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load :func:`moments` taken before ``policy`` was sharded into ``optim`` over its shards."""
    set_optimizer_state_dict(policy, optim, state, options=StateDictOptions(full_state_dict=True))
