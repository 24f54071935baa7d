"""The child processes that run cluster checks print one JSON line per check: read them back, or fail clearly."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

__all__ = ["checks_env", "read_records", "require", "scratch"]


def checks_env() -> dict[str, str]:
    """The environment of a checks child: the tests' helpers importable, no session of this process's."""
    here = os.path.dirname(os.path.abspath(__file__))
    tests = os.path.dirname(here)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([here, os.path.join(tests, "actors"), tests, *sys.path]))
    for key in ("ACTORS_CURVE_PUBLIC", "ACTORS_CURVE_SECRET", "ACTORS_TRANSPORT", "ACTORS_TCP_HOST", "RAY_ADDRESS"):
        env.pop(key, None)
    return env


def read_records(out: subprocess.CompletedProcess[str], what: str) -> dict[str, dict[str, object]]:
    """Each check's record by name; fails the module's tests when the child did not get to the end."""
    found: dict[str, dict[str, object]] = {}
    for line in out.stdout.splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            if "check" in record:
                found[str(record["check"])] = record
            elif record.get("done"):
                found["done"] = record
    if "done" not in found:
        pytest.fail(f"{what} did not finish (exit {out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}")
    return found


def require(records: dict[str, dict[str, object]], name: str) -> None:
    """Fail unless check ``name`` ran and passed, with its detail and traceback."""
    record = records.get(name)
    assert record is not None, f"{name} did not run"
    assert record["ok"], f"{record['detail']}\n{record.get('tb', '')}"


def scratch(prefix: str) -> str:
    """A new folder for a check's run (its run folder, a fifo), removed when the checks' process exits."""
    path = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path
