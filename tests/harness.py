"""What every test needs: the actor processes alive now, waiting for a condition with a deadline, a Python child."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from typing import Any

__all__ = ["ROOT", "actor_pids", "descriptors_below_1024_taken", "last_json", "run_python", "wait_for"]

#: The repository's root: where examples, benchmarks and ``python -m pipeline.grpo`` run from.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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


def run_python(
    *args: str, timeout: float, env: Mapping[str, str] | None = None, cwd: str = ROOT
) -> subprocess.CompletedProcess[str]:
    """``python *args`` from the repository's root, its output captured as text; ``timeout`` guards against a hang."""
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd, check=False
    )


def last_json(stdout: str) -> Any:
    """The JSON record a benchmark or a checks child prints as its last line."""
    return json.loads(stdout.strip().splitlines()[-1])


@contextlib.contextmanager
def descriptors_below_1024_taken() -> Iterator[None]:
    """Every descriptor number below 1024 in use while it lasts: the next one opened is numbered 1024 or more (as
    in a process holding device files, sockets and mapped shards), which ``select.select`` refuses.

    The collector is off meanwhile: a collection the code under test set off could finalize an earlier test's
    socket or file and free a number below 1024, which the next descriptor then took (a CI run saw 513)."""
    taken: list[int] = []
    collecting = gc.isenabled()
    gc.collect()  # (what is garbage now closes its descriptors before the numbers are taken)
    gc.disable()
    try:
        while not taken or taken[-1] < 1023:
            taken.append(os.open(os.devnull, os.O_RDONLY))
        yield
    finally:
        if collecting:
            gc.enable()
        for fd in taken:
            os.close(fd)
