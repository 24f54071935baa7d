"""Run Monarch's own actor test files against ``actors``, and against Monarch, and count the cases.

    python tests/monarch/run_tests.py --tests DIR [--monarch-python PY] [--files test_python_actors ...]

``DIR`` holds Monarch's ``python/tests`` (from a checkout, or the ``tests/``
folder inside the ``torchmonarch`` wheel); nothing of it is part of this
repository. Each file is copied to a scratch folder with ``monarch.actor``
rewritten to ``actors``, beside the helper modules it imports and the inert
stand-ins of :mod:`shim` for Monarch's internals, and run by pytest
(asyncio mode auto, a per-test timeout). With ``--monarch-python`` (a Python
with ``torchmonarch`` installed) the original files are also run on Monarch,
with Monarch's own conftest, in the same invocation. Prints, per file, the
cases, how many pass on each, and how many of Monarch's passing cases pass
on ``actors``; then every case that passes on Monarch and fails here (without
a Monarch run: every case that does not pass here), with the first line of
its error; then one JSON line. ``ACTORS_SEND_CODE=1`` in the environment
measures a session that lets code travel. The ``actors`` run gets a fresh
session key pair in its environment (``ACTORS_CURVE_PUBLIC`` /
``ACTORS_CURVE_SECRET``), as any deployment of worker loops does: Monarch's
bootstrap tests start worker loops that authenticate with it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

import zmq
from shim import rewrite_imports, write_shim

FILES = ("test_python_actors", "test_actor_error", "test_concurrent_endpoints", "test_supervision_hierarchy")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: Monarch's test helpers that import its internals at collection time and have no public-API content.
_SKIP_HELPERS = {"conftest.py", "crash_recovery_plugin.py"}
_CONFTEST = '''"""Scratch conftest for Monarch's test files run against actors."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
'''


def prepare(tests: str, workdir: str) -> None:
    """Copy Monarch's test folder's Python files, rewritten, with the shim beside them."""
    for name in os.listdir(tests):
        if name.endswith(".py") and name not in _SKIP_HELPERS:
            with open(os.path.join(tests, name)) as f:
                source = f.read()
            with open(os.path.join(workdir, name), "w") as f:
                f.write(rewrite_imports(source))
    with open(os.path.join(workdir, "conftest.py"), "w") as f:
        f.write(_CONFTEST)
    write_shim(workdir)


def run_pytest(python: str, cwd: str, file: str, timeout: float, env: dict[str, str], report: str) -> None:
    command = [
        python,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-o",
        "asyncio_mode=auto",
        f"--timeout={timeout:g}",
        f"--junitxml={report}",
        f"{file}.py",
    ]
    try:
        subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout * 200)
    except subprocess.TimeoutExpired:
        pass


def outcomes(report: str) -> dict[str, tuple[str, str]]:
    """Case name -> (passed | failed | skipped, last line of the failure) from a junit report."""
    if not os.path.exists(report):
        return {}
    result: dict[str, tuple[str, str]] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        name = case.get("name", "?")
        status, detail = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                status = "failed"
                text = (child.get("message") or child.text or "").strip()
                detail = text.splitlines()[0][:200] if text else ""
            elif child.tag == "skipped":
                status = "skipped"
        result[name] = (status, detail)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tests", required=True, help="Monarch's python/tests folder")
    parser.add_argument("--monarch-python", help="a Python with torchmonarch installed, for the baseline")
    parser.add_argument(
        "--monarch-reports", help="keep Monarch's junit reports here and reuse them on later runs (they do not change)"
    )
    parser.add_argument("--files", nargs="+", default=list(FILES))
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per test case")
    args = parser.parse_args()
    workdir = tempfile.mkdtemp(prefix="monarch-tests-")
    prepare(args.tests, workdir)
    ours_env = dict(os.environ, PYTHONPATH=os.pathsep.join([workdir, ROOT]))
    # The session's CURVE key pair, as every deployment of worker loops provides it (docs/multihost.md): the
    # tests start worker loops and attach to them, which here authenticate with it (Monarch: "trust all").
    public, secret = zmq.curve_keypair()
    ours_env.update(ACTORS_CURVE_PUBLIC=public.decode(), ACTORS_CURVE_SECRET=secret.decode())
    theirs_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    summary = []
    misses: list[str] = []
    for file in args.files:
        ours_report = os.path.join(workdir, f"{file}.actors.xml")
        run_pytest(sys.executable, workdir, file, args.timeout, ours_env, ours_report)
        ours = outcomes(ours_report)
        theirs: dict[str, tuple[str, str]] = {}
        if args.monarch_python:
            folder = args.monarch_reports or workdir
            os.makedirs(folder, exist_ok=True)
            theirs_report = os.path.join(folder, f"{file}.monarch.xml")
            if not (args.monarch_reports and os.path.exists(theirs_report)):
                run_pytest(args.monarch_python, args.tests, file, args.timeout, theirs_env, theirs_report)
            theirs = outcomes(theirs_report)
        cases = sorted(set(ours) | set(theirs))
        monarch_pass = [c for c in cases if theirs.get(c, ("",))[0] == "passed"]
        ours_pass = [c for c in cases if ours.get(c, ("",))[0] == "passed"]
        both = [c for c in monarch_pass if c in ours_pass]
        for case in monarch_pass if args.monarch_python else cases:
            if case not in ours_pass:
                status, detail = ours.get(case, ("missing", ""))
                misses.append(f"{file}::{case}: {status} {detail}")
        row = {
            "file": file,
            "cases": len(cases),
            "monarch_passed": len(monarch_pass) if args.monarch_python else None,
            "actors_passed": len(ours_pass),
            "actors_passed_of_monarch_passed": len(both) if args.monarch_python else None,
        }
        summary.append(row)
        monarch = f"Monarch {len(monarch_pass):3d}, " if args.monarch_python else ""
        share = f", {len(both)}/{len(monarch_pass)} of Monarch's passes" if args.monarch_python else ""
        print(f"{file:32s} {len(cases):3d} cases: {monarch}actors {len(ours_pass):3d}{share}", flush=True)
    if misses:
        print("\npass on Monarch, not on actors:" if args.monarch_python else "\nnot passing on actors:")
        for line in misses:
            print("  " + line)
    print(json.dumps({"bench": "monarch_tests", "files": summary}))
    shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
