"""Checkpoints: the trainer's state in ``<run_dir>/checkpoint.pt``, written atomically; a sharded trainer's beside it.

A checkpoint is replaced by rename, so a run killed at any moment (Ctrl-C,
``kill -9``) leaves the previous one intact and loadable. Loading uses
``torch.load(weights_only=True)``: tensors and plain containers only, onto
the CPU (the roles move them to their devices), so a run resumes on any machine.

A sharded trainer (``--trainer-shard fsdp``) writes its policy and optimizer
with ``torch.distributed.checkpoint``, each rank its own shards, into
``checkpoint-<step>-<id>.dcp/``; ``checkpoint.pt`` then holds the rest (step,
version, schedule, reference weights) and names that folder (``shards``).
It is written after the folder is complete, and older folders are removed
after it, so the file always names a whole set of shards. Any number of
ranks, sharded or not, loads either kind (:meth:`Learner.load_shards`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from typing import Any

import torch

from ..models import process_tag, sync_path, tag_alive

FILENAME = "checkpoint.pt"
#: The key of ``checkpoint.pt`` that names a sharded checkpoint's folder of shards.
SHARDS = "shards"


def path(run_dir: str) -> str:
    return os.path.join(run_dir, FILENAME)


def save(run_dir: str, state: dict[str, Any]) -> str:
    """Write ``state`` atomically; a no-op without a run directory. Older shard folders it no longer names go."""
    if not run_dir:
        return ""
    target = path(run_dir)
    shards = state.get(SHARDS)
    if shards:  # the folder's entries on the disk before the file names it (its last one is renamed into it)
        sync_path(os.path.join(run_dir, shards))
    tmp = f"{target}.tmp-{process_tag()}"
    torch.save(state, tmp)
    sync_path(tmp)  # on the disk before the rename (else a crash may leave the new name, empty)
    os.replace(tmp, target)
    sync_path(run_dir)  # the rename too, before the shards the last checkpoint named go
    remove_shards(run_dir, keep=state.get(SHARDS))
    return target


def is_shard_folder(name: str) -> bool:
    """Whether ``name`` (in a run folder) is a sharded checkpoint's folder of shards."""
    return name.startswith("checkpoint-") and name.endswith(".dcp")


def remove_shards(run_dir: str, keep: str | None = None) -> None:
    """Remove the folders of shards in ``run_dir`` but ``keep`` (a fresh run's, or those a newer checkpoint replaced)."""
    for name in os.listdir(run_dir):
        if is_shard_folder(name) and name != keep:
            shutil.rmtree(os.path.join(run_dir, name), ignore_errors=True)


def stale_staging(run_dir: str) -> list[str]:
    """The names in ``run_dir`` that a save killed mid-way left (``<name>.tmp-<tag>``, ``<name>.old-<tag>``, their
    process gone: :func:`~pipeline.models.tag_alive`): an earlier run's, which :func:`remove_stale_staging` would
    finish or clear."""
    found = []
    for name in sorted(os.listdir(run_dir)):
        for mark in (".tmp-", ".old-"):
            stem, _, tag = name.rpartition(mark)
            if stem and tag_alive(tag) is False:
                found.append(name)
                break
    return found


def remove_stale_staging(run_dir: str) -> list[str]:
    """Clear what a killed save left in ``run_dir``, under the tag of a process now gone; returns the names removed.

    Saves write ``<name>.tmp-<tag>`` first and rename it when complete; one
    killed mid-write (a stop's kill, a crash) leaves it behind, and it goes.
    A folder replaced whole (the exported model) is first renamed to
    ``<name>.old-<tag>``: while that is there, the staging beside it was
    complete, so a save killed between the two renames is finished (the
    staging goes into place), and the old copy goes.
    """
    removed = []
    for name in sorted(os.listdir(run_dir)):
        stem, _, tag = name.rpartition(".tmp-")
        if not stem or tag_alive(tag) is not False:
            continue
        where, replaced = os.path.join(run_dir, name), os.path.join(run_dir, f"{stem}.old-{tag}")
        if os.path.exists(replaced) and not os.path.exists(os.path.join(run_dir, stem)):
            os.replace(where, os.path.join(run_dir, stem))  # complete: the old one was already set aside for it
            continue
        _remove(where)
        removed.append(name)
    for name in sorted(os.listdir(run_dir)):
        stem, _, tag = name.rpartition(".old-")
        if stem and tag_alive(tag) is False:
            _remove(os.path.join(run_dir, name))
            removed.append(name)
    return removed


def _remove(where: str) -> None:
    if os.path.isdir(where):
        shutil.rmtree(where, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.remove(where)


def shards_folder(run_dir: str, step: int) -> str:
    """A new folder for the shards of a checkpoint at ``step`` (rank 0 names it; every rank writes there)."""
    return os.path.join(run_dir, f"checkpoint-{step}-{uuid.uuid4().hex[:8]}.dcp")


def load(run_dir: str) -> dict[str, Any]:
    target = path(run_dir)
    if not os.path.exists(target):
        raise FileNotFoundError(f"no checkpoint in {run_dir!r} to resume from")
    state: dict[str, Any] = torch.load(target, weights_only=True, map_location="cpu")
    return state


def saved_step(run_dir: str) -> int:
    """The step the run's checkpoint was saved at; its tensors are mapped, not read (a large model's stay on disk)."""
    state = torch.load(path(run_dir), weights_only=True, map_location="cpu", mmap=True)
    return int(state["step"])


def shards_of(run_dir: str, state: dict[str, Any]) -> str | None:
    """The folder of shards a loaded checkpoint names, or None if it holds its tensors whole."""
    name = state.get(SHARDS)
    if name is None:
        return None
    folder = os.path.join(run_dir, str(name))
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"the checkpoint in {run_dir!r} names shards {name!r}, which are missing")
    return folder


def exists(run_dir: str) -> bool:
    return bool(run_dir) and os.path.exists(path(run_dir))
