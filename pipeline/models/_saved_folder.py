"""A saved folder (an exported model, a LoRA adapter) replaced whole, so that a kill at any moment loses neither.

It is written to ``<folder>.tmp-<pid>``; then ``<folder>`` is set aside as
``<folder>.old-<pid>``, the staging renamed into place, and the old one
removed. While ``.old-<pid>`` exists the staging beside it is complete: a
start after a kill finishes the swap
(:func:`pipeline.learning.checkpoint.remove_stale_staging`).
"""

from __future__ import annotations

import os
import shutil

__all__ = ["replace_folder", "staging_folder", "sync_path"]


def staging_folder(folder: str) -> str:
    """A fresh, empty-to-be staging path for ``folder`` (whatever an earlier save of this process left is gone)."""
    staging = f"{folder}.tmp-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    return staging


def sync_path(path: str) -> None:
    """Flush a file's bytes, or a folder's entries (a rename in it), to the disk."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if os.path.isdir(path) else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_folder(staging: str, folder: str) -> str:
    """Put the complete ``staging`` in ``folder``'s place, on the disk before the old one goes; returns ``folder``.

    A crash after the swap (XFS, NFS: a rename may reach the disk before a
    file's bytes) leaves whole files under the new name, not empty ones.
    """
    for root, _, files in os.walk(staging):
        for name in files:
            sync_path(os.path.join(root, name))
        sync_path(root)
    old = f"{folder}.old-{os.getpid()}"
    shutil.rmtree(old, ignore_errors=True)  # (one an earlier save of this process could not remove whole)
    if os.path.exists(folder):
        os.replace(folder, old)
    os.replace(staging, folder)
    sync_path(os.path.dirname(os.path.abspath(folder)))
    shutil.rmtree(old, ignore_errors=True)
    return folder
