"""Run Monarch's published examples on ``actors`` with only their imports changed, and time them.

    python tests/monarch/run_examples.py --monarch PATH [--examples grpo_yield ping_pong] [--repeat 5]

``PATH`` is a checkout of https://github.com/meta-pytorch/monarch (nothing
of it is part of this repository). Each example under
``docs/source/examples/`` is copied to a temporary directory with
``monarch.actor`` rewritten to ``actors`` (``from monarch.actor import`` and
``import monarch.actor``), then run as its own program. For each run the
script records whether it ran to its end (exit status 0, or the error that
an example raises by design, ``EXPECTED_ENDS``, last among the program's own
lines), the wall time and, for the GRPO example, when the first actor
answered (the example prints nothing then, so the copy gets one timing line
after its first ``call_one``). Prints a table and one JSON line. Goals (issue 11): the GRPO example (``grpo_yield``) <= 3 s wall for its
20 steps, its first actor ready <= 1 s after ``spawn_procs``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

from shim import rewrite_imports

#: The examples that need nothing but ``monarch.actor``. The others also import Monarch's RDMA, tensor
#: engine, job API or mocks (getting_started, grpo_actor*, grpo_*sim, distributed_tensors, otel_collector),
#: TorchForge (grpo_forge_lib), or ``requests``, ``bs4`` and the internet (crawler).
EXAMPLES = ("grpo_yield", "ping_pong", "debugging")
#: How an example that ends in an error by design ends: the last line of its stderr (``debugging``'s rank 2
#: raises ``ValueError("bad rank")`` for its post-mortem; its breakpoints are skipped with a warning here).
EXPECTED_ENDS = {"debugging": "ValueError: bad rank"}
#: Marks the controller's first spawn and the first answer, in the GRPO example's copy only.
_SPAWN_MARK = "this_host().spawn_procs("
_TIMING = "print(f'[run_monarch_examples] {{_rme_time.monotonic() - _RME_T0:.3f}} {label}', flush=True)"


def rewrite(source: str, name: str) -> str:
    """The example with ``monarch.actor`` replaced by ``actors`` (and timing lines for grpo_yield)."""
    out = rewrite_imports(source)
    if name == "grpo_yield":
        out = "import time as _rme_time\n_RME_T0 = _rme_time.monotonic()\n" + out
        lines = out.splitlines()
        for i, line in enumerate(lines):
            if _SPAWN_MARK in line:
                indent = line[: len(line) - len(line.lstrip())]
                lines.insert(i, indent + _TIMING.format(label="spawn"))
                break
        for i, line in enumerate(lines):
            if "await trn.initial_state_dict.call_one()" in line:
                indent = line[: len(line) - len(line.lstrip())]
                lines.insert(i + 1, indent + _TIMING.format(label="first-answer"))
                break
        out = "\n".join(lines) + "\n"
    return out


def run_once(path: str, timeout: float) -> dict[str, object]:
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, path], capture_output=True, text=True, timeout=timeout, cwd=os.path.dirname(path)
    )
    wall = time.monotonic() - started
    marks = dict(
        (m.group(2), float(m.group(1))) for m in re.finditer(r"\[run_monarch_examples\] ([0-9.]+) (\S+)", proc.stdout)
    )
    name = os.path.splitext(os.path.basename(path))[0]
    expected = EXPECTED_ENDS.get(name)
    own = [line for line in proc.stderr.strip().splitlines() if not line.startswith("[")]  # not workers' lines
    last = own[-1] if own else ""
    ended = proc.returncode == 0 if expected is None else (proc.returncode == 1 and last == expected)
    row: dict[str, object] = {"returncode": proc.returncode, "ended": ended, "wall_s": round(wall, 3)}
    if "spawn" in marks and "first-answer" in marks:
        row["first_answer_after_spawn_s"] = round(marks["first-answer"] - marks["spawn"], 3)
        row["first_answer_after_start_s"] = round(marks["first-answer"], 3)
    if not ended:
        row["error"] = (proc.stderr or proc.stdout)[-2000:]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--monarch", required=True, help="a checkout of meta-pytorch/monarch")
    parser.add_argument("--examples", nargs="+", default=list(EXAMPLES))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=120.0)
    args = parser.parse_args()
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    workdir = tempfile.mkdtemp(prefix="monarch-examples-")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    results: dict[str, list[dict[str, object]]] = {}
    for name in args.examples:
        source_path = os.path.join(args.monarch, "docs", "source", "examples", f"{name}.py")
        with open(source_path) as f:
            source = f.read()
        path = os.path.join(workdir, f"{name}.py")
        with open(path, "w") as f:
            f.write(rewrite(source, name))
        runs = []
        for _ in range(args.repeat):
            try:
                runs.append(run_once(path, args.timeout))
            except subprocess.TimeoutExpired:
                runs.append({"returncode": None, "error": f"timed out after {args.timeout:g}s"})
        results[name] = runs
        passed = sum(bool(r.get("ended")) for r in runs)
        walls = [float(r["wall_s"]) for r in runs if r.get("ended")]  # type: ignore[arg-type]
        line = f"{name:16s} {passed}/{len(runs)} ran to their end"
        if walls:
            line += f", wall median {statistics.median(walls):.2f}s (runs: {', '.join(f'{w:.2f}' for w in walls)})"
        firsts = [float(r["first_answer_after_spawn_s"]) for r in runs if "first_answer_after_spawn_s" in r]  # type: ignore[arg-type]
        if firsts:
            line += f", first actor {statistics.median(firsts):.2f}s after spawn_procs"
        print(line, flush=True)
        for r in runs:
            if "error" in r:
                print(f"  {name} failed: {str(r['error']).strip().splitlines()[-1]}")
    print(json.dumps({"bench": "monarch_examples", "results": results}))


if __name__ == "__main__":
    main()
