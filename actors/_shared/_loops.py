"""Whether this thread runs an event loop: the one check behind "never wait on the loop's thread"."""

from __future__ import annotations

import asyncio

__all__ = ["loop_running", "running_loop"]


def running_loop() -> asyncio.AbstractEventLoop | None:
    """The event loop this thread runs, or None."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def loop_running() -> bool:
    """True when this thread runs an event loop: code here must not block (wait, sleep, long I/O)."""
    return running_loop() is not None
