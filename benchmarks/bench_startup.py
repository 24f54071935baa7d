"""A run's start: how long ``python -m pipeline.grpo --task hf`` takes until its roles are up, and to its end.

    python benchmarks/bench_startup.py [--model DIR] [--repeat 3] [--steps 2]

Each run is a fresh process running the command's own code (argument
checks, which load the dataset and the tokenizer, then the pipeline), on
``examples/tiny_hf_model.py``'s task (built in a temporary folder unless
``--model`` names one), one generator, sync mode. The roles' forkserver
starts three ways, runs alternating: ``fork`` (the default, forked from
the launcher: the roles inherit torch, transformers and everything it
imported), ``exec`` (a fresh interpreter that imports the task's
``role_modules`` before it forks: a GPU run's, whose launcher has loaded
CUDA) and the baseline ``exec-bare`` (a fresh interpreter importing
nothing more, each role importing transformers itself: what every run got
while the dataset's progress bars left tqdm's monitor thread running).
Prints the medians of "roles up" (process start to every role
constructed) and of the whole run, each against the baseline, and one
JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from bench_hf import _example_model

CHILD = """
import json, os, sys, time
start = time.perf_counter()
import uvloop
from pipeline.run import parse_args, run_pipeline
if os.environ.get("BENCH_NO_PRELOAD"):
    from pipeline.tasks import HFTask
    HFTask.role_modules = ()  # the baseline: nothing preloaded, every role imports transformers itself
config, _ = parse_args(sys.argv[1:])
result = uvloop.run(run_pipeline(config, quiet=True))
ended = time.perf_counter() - start
up = ended - result.seconds - result.stop_seconds
print(json.dumps({"up_s": up, "total_s": ended, "steps": result.steps}))
"""


#: The ways a run's forkserver can start: forked from the launcher; a fresh interpreter that imports the task's
#: role modules before it forks (a GPU run's: the launcher has loaded CUDA); a fresh one that imports nothing more.
MODES = {"fork": {"ACTORS_FORKSERVER": "auto"}, "exec": {"ACTORS_FORKSERVER": "exec"}}
MODES["exec-bare"] = {**MODES["exec"], "BENCH_NO_PRELOAD": "1"}


def one_run(model: str, steps: int, mode: str) -> dict[str, float]:
    """One fresh process's run with its forkserver started as :data:`MODES` ``mode`` says: its seconds until the
    roles were up and in all."""
    run_dir = tempfile.mkdtemp(prefix="bench-startup-")
    data = os.path.dirname(model)
    argv = [
        *("--task", "hf", "--model", model, "--dataset", os.path.join(data, "train.jsonl")),
        *("--reward", f"{os.path.join(data, 'rewards.py')}:reversed_digits", "--prompts", "8", "--group", "4"),
        *("--max-new-tokens", "6", "--steps", str(steps), "--eval-every", str(steps)),
        *("--mode", "sync", "--generators", "1", "--run-dir", run_dir, "--log-completions", "0"),
        "--report-to",
        "none",
    ]
    env = dict(os.environ, **MODES[mode])
    out = subprocess.run([sys.executable, "-c", CHILD, *argv], capture_output=True, text=True, env=env, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"the {mode} run failed:\n{out.stderr[-3000:]}")
    record: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return record


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a model folder of examples/tiny_hf_model.py (its data beside it)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    if args.repeat < 1 or args.steps < 1:
        parser.error("--repeat and --steps must be at least 1")
    if args.model and not os.path.isfile(os.path.join(args.model, "config.json")):
        parser.error(f"--model {args.model}: not a model folder (no config.json) of examples/tiny_hf_model.py")
    model = args.model or os.path.join(_example_model(tempfile.mkdtemp(prefix="bench-startup-model-")), "model")
    runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    for _ in range(args.repeat):
        for mode in MODES:
            runs[mode].append(one_run(model, args.steps, mode))
            last = runs[mode][-1]
            print(f"forkserver {mode:9}: roles up {last['up_s']:5.2f} s, the whole run {last['total_s']:5.2f} s")
    up = {mode: statistics.median(r["up_s"] for r in rs) for mode, rs in runs.items()}
    total = {mode: statistics.median(r["total_s"] for r in rs) for mode, rs in runs.items()}
    print(f"medians of {args.repeat}, --task hf, {args.steps} steps (roles up / the whole run):")
    for mode in MODES:
        print(
            f"  {mode:9}: {up[mode]:5.2f} s / {total[mode]:5.2f} s; the bare fresh interpreter's "
            f"{up['exec-bare'] / up[mode]:.2f}x / {total['exec-bare'] / total[mode]:.2f}x"
        )
    record = {
        "bench": "startup",
        "task": "hf",
        "steps": args.steps,
        "repeat": args.repeat,
        **{f"{mode.replace('-', '_')}_up_s": round(up[mode], 2) for mode in MODES},
        **{f"{mode.replace('-', '_')}_total_s": round(total[mode], 2) for mode in MODES},
        "ratio": round(up["exec-bare"] / up["fork"], 2),
        "exec_ratio": round(up["exec-bare"] / up["exec"], 2),
    }
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
