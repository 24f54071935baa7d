"""What every test needs: the actor processes alive now, and waiting for a condition with a deadline."""

from __future__ import annotations

import os
import time

__all__ = ["actor_pids", "wait_for"]


def actor_pids() -> set[int]:
    """Pids of live actor worker processes of this user (named ``actors[...]``)."""
    pids = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read()
            with open(f"/proc/{entry}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except OSError:
            continue
        if cmd.startswith(b"actors[") and state != b"Z":
            pids.add(int(entry))
    return pids


def wait_for(condition, timeout: float = 5.0, interval: float = 0.02) -> bool:
    """Poll ``condition`` until true or ``timeout``; for checking external state only."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval)
    return condition()
