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

__all__ = ["replace_folder", "staging_folder"]


def staging_folder(folder: str) -> str:
    """A fresh, empty-to-be staging path for ``folder`` (whatever an earlier save of this process left is gone)."""
    staging = f"{folder}.tmp-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    return staging


def replace_folder(staging: str, folder: str) -> str:
    """Put the complete ``staging`` in ``folder``'s place; returns ``folder``."""
    old = f"{folder}.old-{os.getpid()}"
    if os.path.exists(folder):
        os.replace(folder, old)
    os.replace(staging, folder)
    shutil.rmtree(old, ignore_errors=True)
    return folder
