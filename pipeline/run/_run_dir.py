"""The run folder: what a run leaves there, and the check that a fresh run never mixes with an earlier one's outputs.

A fresh run in a folder that holds an earlier run's outputs is refused:
its checkpoint would be lost without a word, and the earlier run's
completions, TensorBoard events and saved model would sit beside the new
run's as if one run had made them. ``--resume`` continues that run;
``--overwrite`` removes its outputs first.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from typing import TextIO

from ..config import Config, SettingsError
from ..learning import checkpoint
from ..models import process_tag, sync_path

__all__ = [
    "OUTPUTS",
    "drop_completions_after",
    "earlier_outputs",
    "outputs",
    "refuse_earlier_run",
    "remove_earlier_run",
    "write_config",
]

#: What a run folder may hold, in the order the summary names it.
OUTPUTS = (
    "config.json",
    "metrics.jsonl",
    "learning_curve.png",
    "checkpoint.pt",
    "model",
    "adapter",
    "completions.jsonl",
    "tensorboard",
    "wandb",
)


def outputs(run_dir: str) -> list[str]:
    """The outputs ``run_dir`` holds (a folder with a trailing slash), in :data:`OUTPUTS` order."""
    return [
        name + ("/" if os.path.isdir(os.path.join(run_dir, name)) else "")
        for name in OUTPUTS
        if os.path.exists(os.path.join(run_dir, name))
    ]


def earlier_outputs(run_dir: str) -> list[str]:
    """An earlier run's outputs in ``run_dir``, its sharded checkpoints' folders among them, and what a save of
    it killed mid-way left (a complete staged export would otherwise be put in place for the fresh run)."""
    if not os.path.isdir(run_dir):
        return []
    shards = sorted(name for name in os.listdir(run_dir) if checkpoint.is_shard_folder(name))
    staged = checkpoint.stale_staging(run_dir)
    return outputs(run_dir) + [
        name + ("/" if os.path.isdir(os.path.join(run_dir, name)) else "") for name in [*shards, *staged]
    ]


def refuse_earlier_run(run_dir: str) -> None:
    """:class:`SettingsError` if ``run_dir`` holds an earlier run's outputs (a fresh run would mix with them)."""
    earlier = earlier_outputs(run_dir)
    if earlier:
        raise SettingsError(
            f"--run-dir {run_dir} holds an earlier run ({', '.join(earlier)}): continue it with --resume {run_dir}, "
            "pick another folder, or add --overwrite to replace it"
        )


def remove_earlier_run(run_dir: str) -> None:
    """Remove an earlier run's outputs from ``run_dir`` (``--overwrite``); other files of the user's stay."""
    for name in earlier_outputs(run_dir):
        target = os.path.join(run_dir, name.rstrip("/"))
        if os.path.isdir(target) and not os.path.islink(target):
            shutil.rmtree(target)
        else:
            os.remove(target)


def write_config(run_dir: str, config: Config) -> None:
    """``<run_dir>/config.json``, replaced whole or not at all: written beside it, then renamed (a write cut
    short, by a full disk, left it empty, and the run it describes could never be resumed)."""
    _replace_file(os.path.join(run_dir, "config.json"), lambda f: json.dump(config.to_dict(), f, indent=2))


def drop_completions_after(run_dir: str, step: int) -> int:
    """Drop the ``completions.jsonl`` rows of evaluations after ``step`` (a resumed run evaluates those steps
    again, as ``metrics.jsonl``'s rows are dropped); rows of another version, with no step, stay. The file is
    replaced whole; how many rows were dropped."""
    target = os.path.join(run_dir, "completions.jsonl")
    try:
        with open(target) as f:
            lines = f.readlines()
    except FileNotFoundError:
        return 0
    kept = [line for line in lines if not _evaluated_after(line, step)]
    if len(kept) == len(lines):
        return 0
    _replace_file(target, lambda f: f.writelines(kept))
    return len(lines) - len(kept)


def _replace_file(target: str, write: Callable[[TextIO], object]) -> None:
    """``target`` replaced whole or not at all: ``write`` fills a file beside it, synced to disk before the rename
    and the folder after (a write cut short by a full disk, or a power loss, never leaves it empty: XFS, NFS)."""
    staging = f"{target}.tmp-{process_tag()}"
    try:
        with open(staging, "w") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(staging, target)
        sync_path(os.path.dirname(target))
    finally:
        if os.path.exists(staging):
            os.remove(staging)


def _evaluated_after(line: str, step: int) -> bool:
    try:
        row = json.loads(line)
    except ValueError:
        return not line.endswith("\n")  # a torn last row (no newline) goes; an odd whole one stays
    return isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] > step
